/// \file
/// `gdr::cuda::stream`: an owning, move-only CUDA stream on one device.
///
/// Copies (`co_await gdr::copy(dst, src, stream)`) and stream waits
/// (`co_await gdr::cuda::synchronize(stream)`) take one. The stream is created
/// non-blocking by default (`cudaStreamNonBlocking`): it does not synchronise
/// with the legacy default stream, so work other libraries put on stream 0
/// does not stall gdr's copies.
///
/// \code
///   gdr::cuda::stream s(/*device=*/0);
///   co_await gdr::copy(dev, pinned, s);
/// \endcode
///
/// Thread-safety: CUDA streams may be used from any thread; the object itself
/// is not synchronised (move it only while nothing else uses it).
#pragma once

#include <gdr/cuda/device.hpp>
#include <gdr/cuda/error.hpp>

#include <utility>

#include <gdr/sched/stream_order.hpp>

namespace gdr::cuda {

/// An owning CUDA stream on a device. See the file comment.
class stream {
 public:
  /// A stream on GPU `device`. Throws `gdr::error`: `errc::no_device` with
  /// the probe's reason (no driver, no GPU, bad ordinal), or the CUDA error.
  explicit stream(int device = 0, unsigned flags = cudaStreamNonBlocking) : device_(device) {
    if (std::string why = device_unavailable_reason(device); !why.empty())
      throw error(make_error_code(errc::no_device), "gdr::cuda::stream: " + why);
    if (std::error_code ec = create_on(device, flags, &s_)) throw error(ec, "gdr::cuda::stream: cudaStreamCreateWithFlags");
  }

  /// The non-throwing form.
  static result<stream> create(int device = 0, unsigned flags = cudaStreamNonBlocking) noexcept {
    try {
      if (!device_unavailable_reason(device).empty()) return errc::no_device;
    } catch (...) {
      return errc::no_device;
    }
    cudaStream_t s = nullptr;
    if (std::error_code ec = create_on(device, flags, &s)) return ec;
    return stream(s, device);
  }

  stream(stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)), device_(o.device_) {}
  stream& operator=(stream&& o) noexcept {
    if (this != &o) {
      destroy();
      s_ = std::exchange(o.s_, nullptr);
      device_ = o.device_;
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  /// Destroys the stream. Work still queued on it completes (CUDA's rule);
  /// gdr operations that wait on it must have been awaited first.
  ~stream() { destroy(); }

  /// The CUDA handle, for kernel launches and other libraries.
  cudaStream_t get() const noexcept { return s_; }
  /// The device the stream belongs to.
  int device() const noexcept { return device_; }

  /// True when all work queued so far has finished (`cudaStreamQuery`), an
  /// error code (other than "not ready") otherwise.
  result<bool> query() const noexcept {
    cudaError_t e = cudaStreamQuery(s_);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not ready" is recorded as a last error too
      return false;
    }
    if (std::error_code ec = check(e, "cudaStreamQuery")) return ec;
    return true;
  }

 private:
  stream(cudaStream_t s, int device) noexcept : s_(s), device_(device) {}

  static std::error_code create_on(int device, unsigned flags, cudaStream_t* out) noexcept {
    device_guard guard(device);
    if (guard.error()) return guard.error();
    return check(cudaStreamCreateWithFlags(out, flags), "cudaStreamCreateWithFlags");
  }

  void destroy() noexcept {
    if (s_ != nullptr) check_or_log(cudaStreamDestroy(s_), "cudaStreamDestroy");
    s_ = nullptr;
  }

  cudaStream_t s_ = nullptr;
  int device_ = 0;
};

/// Orders an operation after the work already queued on `s` (see
/// `op_options::after`): `co_await ep.send(dev, gdr::cuda::after(s))`.
inline stream_order after(const stream& s) noexcept { return {s.get(), s.device()}; }
/// The same for a raw CUDA stream of GPU `device`.
inline stream_order after(cudaStream_t s, int device) noexcept { return {s, device}; }

}  // namespace gdr::cuda
