/// \file
/// Registration of memory with an RDMA device: the backends a
/// `gdr::registration_cache` registers through (host memory with
/// `ibv_reg_mr`; device memory with `ibv_reg_dmabuf_mr` on a dma-buf, or
/// `ibv_reg_mr` through nvidia-peermem, see
/// `gdr/transport/verbs/gpudirect.hpp`), and the caches a scheduler keeps per
/// device, keyed by address range and by memory space (host memory in
/// three, by access; GPU memory of GPUDirect endpoints in a fourth).
///
/// What is registered when
/// =======================
/// * The connection's own bounce buffers (receive ring, send slots) are
///   registered once, when it is made.
/// * A rendezvous receive registers its view before its `rtr` goes out (the
///   `rtr` carries the address and remote key); the sender registers the
///   message before its RDMA WRITEs. Both hold a lease until the transfer's
///   completion; a registration is never released while the NIC may still
///   touch it (the receiver's lease ends when the sender's WRITE_WITH_IMM
///   has arrived, or when the connection has failed and its queue pair has
///   flushed).
/// * A put or get larger than one SEND buffer registers the initiator's
///   memory before its request goes out (the request carries the address
///   and key): a put's source for the target's RDMA READ, a get's
///   destination for the target's RDMA WRITE. The lease lasts until the
///   answer has come back. The target registers its side (the exposed
///   memory) for the duration of its READ or WRITE.
/// * By default an operation's registration is dropped when it completes
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
/// dma-buf or through nvidia-peermem (`ibv_reg_mr` on the device address).
enum class mr_route : std::uint8_t { host, dma_buf, peermem };

/// The route of a GPUDirect probe's report ("dma-buf", "peermem"; the test
/// stand-in's host memory: host).
inline mr_route route_of(const gpudirect_report& r) noexcept {
  if (r.route == "dma-buf") return mr_route::dma_buf;
  if (r.route == "peermem") return mr_route::peermem;
  return mr_route::host;
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

/// Access flags of memory a peer writes into (rendezvous receives).
inline constexpr int remote_write_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
/// Access flags of memory the NIC only reads (RDMA WRITE sources). No
/// LOCAL_WRITE: a send may come from read-only pages.
inline constexpr int local_read_access = 0;
/// Access flags of memory a peer reads (the source of a put, which the
/// target's NIC reads with RDMA READ). No LOCAL_WRITE either.
inline constexpr int remote_read_access = IBV_ACCESS_REMOTE_READ;
/// Access flags of GPU memory on a GPUDirect endpoint: one registration
/// serves every use (receive, RDMA source, put source), as NCCL registers
/// its buffers.
inline constexpr int device_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

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
