/// \file
/// What the RDMA hardware of this node can do, asked once: which verbs devices
/// exist, and whether their NICs can reach GPU memory (GPUDirect RDMA).
///
/// GPUDirect is a run-time fact the type system cannot know: the NIC reaches
/// GPU memory only through the nvidia-peermem kernel module or dma-buf. The
/// probe follows what NCCL does (`src/transport/net_ib/gdr.cc`): the peermem
/// module is present if `/sys/kernel/mm/memory_peers/nv_mem/version` or
/// `/sys/module/nvidia_peermem/version` exists; dma-buf is supported if
/// `ibv_reg_dmabuf_mr` with fd -1 fails with EBADF (the kernel got as far as
/// looking at the fd) rather than EOPNOTSUPP/EPROTONOSUPPORT. The answer is
/// computed once per process (`std::call_once`) and says *why*, so a zero-copy
/// device endpoint that cannot be had fails at setup with a reason instead of
/// silently staging (the failure mode of NVIDIA/nccl#1676).
#pragma once

#include <infiniband/verbs.h>
#include <sys/stat.h>

#include <cerrno>
#include <mutex>
#include <string>
#include <vector>

#include <gdr/config.hpp>
#include <gdr/error.hpp>

namespace gdr::verbs {

/// One verbs device as the probe saw it.
struct device_info {
  std::string name;       ///< e.g. "mlx5_0", "rxe0"
  bool dmabuf = false;    ///< ibv_reg_dmabuf_mr is supported (GPUDirect through dma-buf)
};

/// The node's RDMA capabilities, with the reason for each "no".
struct capabilities {
  std::vector<device_info> devices;  ///< empty: no RDMA device
  std::error_code devices_error;     ///< why the device list is empty (errno from ibv_get_device_list)
  bool peermem = false;              ///< nvidia-peermem (or the older nv_peer_mem) is loaded
  /// GPUDirect RDMA is possible on at least one device: peermem is loaded, or
  /// a device supports dma-buf.
  bool gpudirect() const noexcept {
    if (devices.empty()) return false;
    if (peermem) return true;
    for (const auto& d : devices)
      if (d.dmabuf) return true;
    return false;
  }
  /// A sentence saying why GPUDirect is not available (empty when it is).
  std::string why_not() const {
    if (devices.empty())
      return "no RDMA device (ibv_get_device_list: " +
             (devices_error ? devices_error.message() : std::string("empty list")) + ")";
    if (gpudirect()) return {};
    return "the NIC cannot reach GPU memory: nvidia-peermem is not loaded and no device supports "
           "dma-buf registration";
  }
};

namespace detail {

inline bool path_exists(const char* p) noexcept {
  struct stat st {};
  return ::stat(p, &st) == 0;
}

/// Whether nvidia-peermem (or the older nv_peer_mem) is loaded, as the sysfs
/// mounted at `sysfs` shows it (another root for tests).
inline bool peermem_loaded(const std::string& sysfs = "/sys") {
  return path_exists((sysfs + "/kernel/mm/memory_peers/nv_mem/version").c_str()) ||
         path_exists((sysfs + "/module/nvidia_peermem/version").c_str());
}

// EBADF means the kernel accepted the call far enough to look at the fd: the
// dma-buf path exists. EOPNOTSUPP / EPROTONOSUPPORT: it does not.
inline bool probe_dmabuf(ibv_context* ctx) noexcept {
  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (pd == nullptr) return false;
  errno = 0;
  ibv_mr* mr = ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE);
  int err = errno;
  if (mr != nullptr) ibv_dereg_mr(mr);  // cannot happen with fd -1; be tidy anyway
  ibv_dealloc_pd(pd);
  return mr == nullptr && err == EBADF;
}

inline capabilities run_probe() {
  capabilities caps;
  caps.peermem = peermem_loaded();
  int n = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) {
    // No kernel support at all gives ENOSYS; a missing provider gives an empty list.
    caps.devices_error = errno_code(errno != 0 ? errno : ENODEV);
    return caps;
  }
  for (int i = 0; i < n; ++i) {
    device_info d;
    d.name = ibv_get_device_name(list[i]);
    if (ibv_context* ctx = ibv_open_device(list[i])) {
      d.dmabuf = probe_dmabuf(ctx);
      ibv_close_device(ctx);
    }
    caps.devices.push_back(std::move(d));
  }
  ibv_free_device_list(list);
  if (caps.devices.empty()) caps.devices_error = errno_code(ENODEV);
  return caps;
}

}  // namespace detail

/// The node's RDMA capabilities, probed on the first call and cached.
/// Thread-safe.
inline const capabilities& probe() {
  static std::once_flag once;
  static capabilities caps;
  std::call_once(once, [] { caps = detail::run_probe(); });
  return caps;
}

/// Throws `gdr::error(errc::gpudirect_unavailable)` with the probe's reason
/// unless GPUDirect RDMA is possible. Endpoints that promise zero-copy device
/// transfers over verbs call this at setup: never a silent downgrade.
inline void require_gpudirect() {
  const capabilities& caps = probe();
  if (!caps.gpudirect()) throw error(errc::gpudirect_unavailable, caps.why_not());
}

}  // namespace gdr::verbs
