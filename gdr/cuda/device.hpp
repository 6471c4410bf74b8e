/// \file
/// GPUs: a one-time probe that says how many devices there are and, when there
/// are none, why (no driver, a driver too old for this runtime, or a driver
/// that sees no GPU); per-device facts (GPUDirect RDMA support); and a guard
/// that makes a device current for a scope.
///
/// Why the probe explains itself: the most common report from users of GPU
/// communication libraries is "the fast path silently did not happen"
/// (DESIGN-NOTES). A test that skips, or a `buffer<T, Device>` that cannot be
/// allocated, says which of the causes it was. On a machine with the CUDA
/// toolkit but no driver (`libcuda.so.1` absent) `cudaGetDeviceCount` returns
/// `cudaErrorInsufficientDriver`, not `cudaErrorNoDevice`; both mean "no GPU
/// here", for different reasons.
///
/// Thread-safety: all functions may be called from any thread; the probe runs
/// once (a function-local static).
#pragma once

#include <gdr/cuda/error.hpp>

#include <string>

namespace gdr::cuda {

/// What the one-time device probe found.
struct device_probe_result {
  /// Usable CUDA devices (0 when there are none, for whatever reason).
  int count = 0;
  /// What `cudaGetDeviceCount` returned.
  cudaError_t status = cudaSuccess;
  /// `cudaDriverGetVersion` (1000 * major + 10 * minor); 0 = no driver loaded.
  int driver_version = 0;
  /// The CUDA runtime this program was built with (`CUDART_VERSION`).
  int runtime_version = CUDART_VERSION;
  /// Empty when `count > 0`; otherwise one sentence saying why there is no GPU.
  std::string reason;

  /// At least one GPU can be used.
  bool usable() const noexcept { return count > 0; }
};

namespace detail {

inline std::string cuda_version_string(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

inline device_probe_result run_probe() {
  device_probe_result r;
  // Returns cudaSuccess and 0 when no driver is installed: that is how the
  // two "no driver" cases below are told apart.
  (void)cudaDriverGetVersion(&r.driver_version);
  int n = 0;
  r.status = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();  // the probe's own failure is not the caller's error
  const std::string rt = cuda_version_string(r.runtime_version);
  if (r.status == cudaSuccess && n > 0) {
    r.count = n;
    return r;
  }
  if (r.status == cudaErrorInsufficientDriver && r.driver_version == 0) {
    r.reason = "no CUDA driver: libcuda.so.1 could not be loaded (cudaGetDeviceCount returned "
               "cudaErrorInsufficientDriver); this program's CUDA runtime is " + rt;
  } else if (r.status == cudaErrorInsufficientDriver) {
    r.reason = "CUDA driver too old: it supports CUDA " + cuda_version_string(r.driver_version) +
               ", this program's runtime is " + rt + " (cudaErrorInsufficientDriver)";
  } else if (r.status == cudaErrorNoDevice || (r.status == cudaSuccess && n == 0)) {
    r.reason = "no CUDA device: the driver (CUDA " + cuda_version_string(r.driver_version) +
               ") sees no GPU (cudaErrorNoDevice; check CUDA_VISIBLE_DEVICES)";
  } else {
    r.reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(r.status) + ": " +
               cudaGetErrorString(r.status);
  }
  return r;
}

}  // namespace detail

/// The device probe, run once on first use.
inline const device_probe_result& probe_devices() {
  static const device_probe_result r = detail::run_probe();
  return r;
}

/// Number of usable GPUs, or `errc::no_device` (then `probe_devices().reason`
/// says why).
inline result<int> device_count() {
  const auto& p = probe_devices();
  if (!p.usable()) return errc::no_device;
  return p.count;
}

/// Why `ordinal` cannot be used, or an empty string when it can: the probe's
/// reason, or "device ordinal N out of range (M present)".
inline std::string device_unavailable_reason(int ordinal) {
  const auto& p = probe_devices();
  if (!p.usable()) return p.reason;
  if (ordinal < 0 || ordinal >= p.count) {
    return "device ordinal " + std::to_string(ordinal) + " out of range: " +
           std::to_string(p.count) + " CUDA device(s) present";
  }
  return {};
}

/// Whether `device` supports GPUDirect RDMA
/// (`cudaDevAttrGPUDirectRDMASupported`). This is the GPU's half of the
/// answer only: a NIC also needs nvidia-peermem or dma-buf (see
/// `gdr/transport/verbs/probe.hpp`).
inline result<bool> gpudirect_rdma_supported(int device) {
  if (!device_unavailable_reason(device).empty()) return errc::no_device;
  int v = 0;
  if (std::error_code ec = check(cudaDeviceGetAttribute(&v, cudaDevAttrGPUDirectRDMASupported, device),
                                 "cudaDeviceGetAttribute"))
    return ec;
  return v != 0;
}

/// Name, compute capability and memory of a device, for logs and test output.
struct device_info {
  int ordinal = -1;
  std::string name;
  int cc_major = 0;
  int cc_minor = 0;
  std::size_t total_memory = 0;
};

/// Facts about `device`, or `errc::no_device`.
inline result<device_info> query_device(int device) {
  if (!device_unavailable_reason(device).empty()) return errc::no_device;
  cudaDeviceProp prop{};
  if (std::error_code ec = check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"))
    return ec;
  device_info d;
  d.ordinal = device;
  d.name = prop.name;
  d.cc_major = prop.major;
  d.cc_minor = prop.minor;
  d.total_memory = prop.totalGlobalMem;
  return d;
}

/// Makes `device` the calling thread's current device for a scope, and
/// restores the previous one at its end (allocation, stream and event
/// creation act on the current device).
///
/// Thread-safety: the current device is per thread; so is a guard.
class device_guard {
 public:
  /// Switches to `device` unless it is already current; `error()` tells
  /// whether that worked.
  explicit device_guard(int device) noexcept {
    ec_ = check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (!ec_ && prev_ != device) {
      ec_ = check(cudaSetDevice(device), "cudaSetDevice");
      switched_ = !ec_;
    }
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (switched_) check_or_log(cudaSetDevice(prev_), "cudaSetDevice (restoring the current device)");
  }

  /// The error from reading or setting the current device, if any.
  std::error_code error() const noexcept { return ec_; }

 private:
  int prev_ = 0;
  bool switched_ = false;
  std::error_code ec_;
};

}  // namespace gdr::cuda
