/// \file
/// Registration of memory with an RDMA device: the backends a
/// `gdr::registration_cache` registers through (host memory with
/// `ibv_reg_mr`; device memory with `ibv_reg_dmabuf_mr` on a dma-buf, or
/// `ibv_reg_mr` through nvidia-peermem, see
/// `gdr/transport/verbs/gpudirect.hpp`), the caches a scheduler keeps per
/// device for memory only this side's NIC uses (host memory in two, by
/// access; GPU memory of GPUDirect endpoints in a third), and the holds
/// that end a transfer's use of a cached registration.
///
/// What is registered when
/// =======================
/// * The connection's own bounce buffers (receive ring, send slots) are
///   registered once, when it is made.
/// * Memory whose key goes to the peer (a rendezvous receive's view, in its
///   `rtr`; a large put's source and a large get's destination, in their
///   requests) is registered exactly, `[addr, addr + len)` and no byte
///   more, for that one transfer, and deregistered when the peer is done
///   with it (the data or the answer arrived) or the queue pair is in the
///   error state: it is never cached, so the peer's key covers exactly what
///   was granted for exactly as long (`grants.hpp`; docs/VERBS.md, "Keys").
/// * Memory only this side's NIC touches, with keys that never leave it (a
///   send's RDMA WRITE source, a served put's READ destination, a served
///   get's reply source, GPU memory for the flush) comes from the caches
///   below, held for the duration of the transfer (`registration_hold`).
///   A registration is never released while the NIC may still touch it.
/// * By default a cached registration is dropped when its transfer ends
///   (`endpoint_options::cache_registrations` = false): the cache cannot see
///   `free`, and a cached registration of freed and reused addresses pins the
///   old pages (`gdr/memory/registration_cache.hpp`, "Stale entries"). With
///   it on, registrations stay cached and the program must call the
///   endpoint's `invalidate_registrations(addr, len)` before freeing
///   registered buffers.
///
/// A failed registration of host memory is not an error: the transfer goes
/// through the bounce buffers instead, and its path says so
/// (`transfer_path::host_eager`). GPU memory of a GPUDirect endpoint has no
/// such way round (the CPU must not copy it): its failed registration
/// fails the connection with `errc::gpudirect_unavailable`, and
/// `registration_limit` does not apply to it.
#pragma once

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/registration_cache.hpp>
#include <gdr/transport/verbs/gpudirect.hpp>

namespace gdr::verbs {

/// How memory reaches the NIC: host memory, and GPU memory through a
/// dma-buf or through nvidia-peermem (`ibv_reg_mr` on the device address),
/// or the test stand-in's host memory playing GPU memory (through its
/// readable alias if it has one: `testing::stand_in_alias`).
enum class mr_route : std::uint8_t { host, dma_buf, peermem, stand_in };

/// The route of a GPUDirect probe's report ("dma-buf", "peermem"; the test
/// stand-in's host memory: stand_in).
inline mr_route route_of(const gpudirect_report& r) noexcept {
  if (r.route == "dma-buf") return mr_route::dma_buf;
  if (r.route == "peermem") return mr_route::peermem;
  return mr_route::stand_in;
}

/// A registration backend in one protection domain with fixed access
/// flags, over `ibv_reg_mr`, or `ibv_reg_dmabuf_mr` for GPU memory.
struct mr_backend {
  using handle_type = ibv_mr*;
  ibv_pd* pd = nullptr;
  int access = 0;
  mr_route route = mr_route::host;

  result<ibv_mr*> register_range(std::uintptr_t addr, std::size_t len) noexcept {
    if (route == mr_route::dma_buf) return detail::register_dmabuf(pd, addr, len, access);
    errno = 0;
    if (route == mr_route::stand_in) {
      if (std::uintptr_t host = detail::stand_in_host_of(addr, len); host != 0) {
        ibv_mr* mr = ibv_reg_mr_iova(pd, reinterpret_cast<void*>(host), len, addr, access);
        if (mr == nullptr) return errno_code(errno != 0 ? errno : EINVAL);
        return mr;
      }
    }
    ibv_mr* mr = ibv_reg_mr(pd, reinterpret_cast<void*>(addr), len, access);
    if (mr == nullptr) return errno_code(errno != 0 ? errno : EINVAL);
    return mr;
  }
  void deregister(ibv_mr*& mr) noexcept {
    if (mr != nullptr && ibv_dereg_mr(mr) != 0) std::perror("gdr verbs: ibv_dereg_mr");
    mr = nullptr;
  }
};

/// A cache of host-memory registrations.
using mr_cache = registration_cache<mr_backend>;

/// A transfer's hold on a cached registration, and the end the cache policy
/// asks for. When the hold ends (destroyed, assigned over, or `end()`), its
/// lease is released and, unless registrations stay cached
/// (`endpoint_options::cache_registrations`), every entry of its cache that
/// overlaps the held range is dropped (deregistered now if idle, else when
/// its last lease goes). Every path that ends a transfer's use of memory
/// (completion, withdrawal, failure, teardown) ends its hold, so none can
/// leave a registration cached that the policy says must go (issue 15,
/// defect 7: the failure paths released bare leases). Move-only; the cache
/// must outlive the hold.
template <class Cache>
class basic_registration_hold {
 public:
  using lease_type = typename Cache::lease;

  basic_registration_hold() noexcept = default;
  /// Holds `l`, a lease of `cache` covering `[addr, addr + len)`.
  basic_registration_hold(lease_type l, Cache& cache, const void* addr, std::size_t len, bool keep_cached) noexcept
      : lease_(std::move(l)), cache_(&cache), addr_(addr), len_(len), keep_(keep_cached) {}
  basic_registration_hold(basic_registration_hold&& o) noexcept
      : lease_(std::move(o.lease_)), cache_(std::exchange(o.cache_, nullptr)), addr_(o.addr_), len_(o.len_),
        keep_(o.keep_) {}
  basic_registration_hold& operator=(basic_registration_hold&& o) noexcept {
    if (this != &o) {
      end();
      lease_ = std::move(o.lease_);
      cache_ = std::exchange(o.cache_, nullptr);
      addr_ = o.addr_;
      len_ = o.len_;
      keep_ = o.keep_;
    }
    return *this;
  }
  ~basic_registration_hold() { end(); }

  /// Holds a registration.
  explicit operator bool() const noexcept { return static_cast<bool>(lease_); }
  /// The registration's handle (verbs: the `ibv_mr*`).
  const auto& handle() const noexcept { return lease_.handle(); }

  /// Ends the hold now (see the class comment). Idempotent.
  void end() noexcept {
    if (!lease_) return;
    lease_.release();
    if (!keep_) cache_->invalidate(addr_, len_);
    cache_ = nullptr;
  }

 private:
  lease_type lease_{};
  Cache* cache_ = nullptr;
  const void* addr_ = nullptr;
  std::size_t len_ = 0;
  bool keep_ = false;
};

/// A hold on a registration of a device's cache.
using registration_hold = basic_registration_hold<mr_cache>;

/// Access flags of an exact registration whose key goes to the peer, for
/// its WRITE (a rendezvous receive, a get's destination).
inline constexpr int remote_write_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
/// Access flags of an exact registration whose key goes to the peer, for
/// its READ (a put's source). No LOCAL_WRITE: a put may come from
/// read-only pages.
inline constexpr int remote_read_access = IBV_ACCESS_REMOTE_READ;
/// Access flags of cached memory this side's NIC writes (a served put's
/// READ destination): no remote access, its key never leaves this side.
inline constexpr int local_write_access = IBV_ACCESS_LOCAL_WRITE;
/// Access flags of cached memory this side's NIC only reads (RDMA WRITE
/// sources). No LOCAL_WRITE: a send may come from read-only pages.
inline constexpr int local_read_access = 0;
/// Access flags of cached GPU memory on a GPUDirect endpoint (WRITE
/// sources, served puts' READ destinations, served gets' sources): local
/// writes, and the remote READ of the GPUDirect flush, whose loopback
/// queue pair reads one byte of it (`flush.hpp`); no remote WRITE.
inline constexpr int device_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;

/// One owned registration of memory the transport allocated itself.
class owned_mr {
 public:
  owned_mr() noexcept = default;
  owned_mr(owned_mr&& o) noexcept : mr_(std::exchange(o.mr_, nullptr)) {}
  owned_mr& operator=(owned_mr&& o) noexcept {
    if (this != &o) {
      reset();
      mr_ = std::exchange(o.mr_, nullptr);
    }
    return *this;
  }
  ~owned_mr() { reset(); }

  static result<owned_mr> make(ibv_pd* pd, void* addr, std::size_t len, int access) noexcept {
    errno = 0;
    ibv_mr* mr = ibv_reg_mr(pd, addr, len, access);
    if (mr == nullptr) return errno_code(errno != 0 ? errno : EINVAL);
    owned_mr m;
    m.mr_ = mr;
    return m;
  }

  /// Takes ownership of `mr` (null: none).
  static owned_mr adopt(ibv_mr* mr) noexcept {
    owned_mr m;
    m.mr_ = mr;
    return m;
  }

  explicit operator bool() const noexcept { return mr_ != nullptr; }
  ibv_mr* get() const noexcept { return mr_; }
  std::uint32_t lkey() const noexcept { return mr_->lkey; }
  std::uint32_t rkey() const noexcept { return mr_->rkey; }

  void reset() noexcept {
    if (mr_ != nullptr && ibv_dereg_mr(mr_) != 0) std::perror("gdr verbs: ibv_dereg_mr");
    mr_ = nullptr;
  }

 private:
  ibv_mr* mr_ = nullptr;
};

}  // namespace gdr::verbs
