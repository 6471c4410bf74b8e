/// \file
/// `verbs::pd_domain`: a scheduler's protection domain on one RDMA device as
/// a `gdr::nic_domain`, so that memory registries are exposed in it (see
/// gdr/memory/registration.hpp, "NIC exposure").
///
/// The first verbs connection made with a registry attaches that registry
/// to its device's domain; from then on every `exposure::nic` registration
/// of the registry is also registered with this protection domain
/// (`ibv_reg_mr` with remote read, remote write and remote atomics as its
/// `access` allows), and its view carries the key. Peers' direct puts, gets
/// and atomics (rma.hpp) land there; the owner's CPU takes no part.
/// Revocation deregisters. The domain detaches from every registry when the
/// scheduler's poller frees it (before its protection domain is freed),
/// and a registry destroyed first tells it (`registry_gone`).
///
/// The domain's id (nonzero, random) goes to the peer in the connection
/// parameters: the peer's operations use the key of a view that matches it.
///
/// Thread-safety: exposure and withdrawal run on whichever thread registers
/// or revokes (under the registry's lock); `ibv_reg_mr` and `ibv_dereg_mr`
/// are thread-safe. The list of attached registries has its own lock.
#pragma once

#include <infiniband/verbs.h>
#include <sys/random.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/transport/verbs/memory.hpp>

namespace gdr::verbs {

/// A protection domain as a NIC domain (see the file comment).
class pd_domain final : public gdr::nic_domain {
 public:
  explicit pd_domain(ibv_pd* pd) noexcept : pd_(pd) {
    while (id_ == 0)
      if (::getrandom(&id_, sizeof id_, 0) != static_cast<ssize_t>(sizeof id_)) id_ = static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(this) >> 4);
  }
  pd_domain(const pd_domain&) = delete;
  pd_domain& operator=(const pd_domain&) = delete;
  /// Withdraws every registration exposed here (before the protection
  /// domain is freed).
  ~pd_domain() {
    std::vector<memory_registry*> regs;
    {
      std::lock_guard lock(mu_);
      regs.swap(attached_);
    }
    for (memory_registry* r : regs) r->detach(*this);
  }

  /// Exposes `r` here (again: what it could not expose before, e.g. GPU
  /// memory once a GPUDirect endpoint has set the route).
  void attach(memory_registry& r) noexcept {
    {
      std::lock_guard lock(mu_);
      if (std::find(attached_.begin(), attached_.end(), &r) == attached_.end()) {
        try {
          attached_.push_back(&r);
        } catch (...) {
          return;
        }
      }
    }
    r.attach(*this);
  }

  /// GPU memory is exposed too, by `route` (a GPUDirect endpoint's probe
  /// found it: dma-buf, nvidia-peermem, or the test stand-in); until then a
  /// `Device` registration is served by the owner.
  void set_device_route(mr_route route) noexcept { device_route_.store(static_cast<int>(route)); }

  ibv_pd* pd() const noexcept { return pd_; }

  std::uint32_t domain_id() const noexcept override { return id_; }

  result<exposed> expose(std::uintptr_t addr, std::size_t len, access a, int device) noexcept override {
    int flags = 0;
    if (allows(a, access::read)) flags |= IBV_ACCESS_REMOTE_READ;
    if (allows(a, access::write)) flags |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    if (a == access::read_write) flags |= IBV_ACCESS_REMOTE_ATOMIC;
    if (device >= 0) {
      // GPU memory: only through GPUDirect's route (else served: staged, or
      // moved by the owner's NIC on its own GPUDirect endpoint).
      const int route = device_route_.load();
      if (route < 0) return errc::unsupported;
      mr_backend b{pd_, flags & ~IBV_ACCESS_REMOTE_ATOMIC, static_cast<mr_route>(route)};
      result<ibv_mr*> mr = b.register_range(addr, len);
      if (!mr) return mr.error();
      return exposed{*mr, (*mr)->rkey};
    }
    errno = 0;
    ibv_mr* mr = ibv_reg_mr(pd_, reinterpret_cast<void*>(addr), len, flags);
    if (mr == nullptr) return errno_code(errno != 0 ? errno : EINVAL);
    return exposed{mr, mr->rkey};
  }

  void withdraw(void* handle) noexcept override {
    if (handle != nullptr && ibv_dereg_mr(static_cast<ibv_mr*>(handle)) != 0) std::perror("gdr verbs: ibv_dereg_mr");
  }

  void registry_gone(memory_registry& r) noexcept override {
    std::lock_guard lock(mu_);
    std::erase(attached_, &r);
  }

 private:
  ibv_pd* pd_;
  std::uint32_t id_ = 0;
  std::atomic<int> device_route_{-1};  // an mr_route, or -1: GPU memory is not exposed
  std::mutex mu_;
  std::vector<memory_registry*> attached_;
};

}  // namespace gdr::verbs
