/// \file
/// Copy-engine copies: `gdr::cuda::memcpy_async` (queue a `cudaMemcpyAsync`,
/// return at once) and the awaitable behind `co_await gdr::copy(dst, src,
/// stream)` for the copy-engine pairs of the access table (Pinned -> Device,
/// Device -> Pinned, Device -> Device).
///
/// Use `gdr::copy` (gdr/memory/copy.hpp): it picks the path from the spaces
/// and completes through the scheduler. `memcpy_async` is the step below it,
/// for code that batches several copies before one
/// `co_await gdr::cuda::synchronize(stream)`.
///
/// Both ends must be memory the copy engine can reach asynchronously
/// (`space_traits<S>::copy_engine_accessible`): an async copy from pageable
/// Host memory does not compile. (`cudaMemcpyAsync` accepts pageable memory,
/// but then it is silently synchronous for the host or staged by the driver:
/// the "async" copy blocks, which a coroutine scheduler must never do.)
///
/// Thread-safety: as CUDA streams: any thread may queue on a stream.
#pragma once

#include <gdr/cuda/error.hpp>
#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/stream.hpp>

#include <cstddef>
#include <type_traits>

#include <gdr/memory/access.hpp>
#include <gdr/memory/view.hpp>

namespace gdr::cuda {

namespace detail {

template <class Dst, class Src>
constexpr cudaMemcpyKind memcpy_kind() noexcept {
  // From the one table: the path's kind names the direction.
  switch (copy_path<Dst, Src>::kind) {
    case copy_kind::host_to_device: return cudaMemcpyHostToDevice;
    case copy_kind::device_to_host: return cudaMemcpyDeviceToHost;
    case copy_kind::device_to_device: return cudaMemcpyDeviceToDevice;
    default: return cudaMemcpyDefault;  // unreachable: callers check copy_uses_engine_v
  }
}

}  // namespace detail

/// Queues a copy of `src` into `dst` on stream `s` and returns at once.
///
/// Contract: `dst.size() == src.size()` (else `errc::invalid_argument`, and
/// nothing is queued); for Device -> Device on one GPU the ranges must not
/// overlap (else `errc::invalid_argument`); both memories must stay alive
/// until the stream has run the copy (await `synchronize(s)`). Different GPUs
/// for Device -> Device use a peer copy. Returns the CUDA error if queueing
/// failed. Both spaces must be copy-engine accessible: compile error otherwise.
template <class T, class U, class DstS, class SrcS>
std::error_code memcpy_async(gdr::view<T, DstS> dst, gdr::view<U, SrcS> src, const stream& s) noexcept {
  static_assert(!std::is_const_v<T>, "gdr::cuda::memcpy_async: the destination is a view of const elements");
  static_assert(std::is_same_v<std::remove_cv_t<T>, std::remove_cv_t<U>>,
                "gdr::copy: the element types of dst and src differ. Copy between views of the same T, "
                "or copy raw bytes: gdr::as_bytes(dst) and gdr::as_bytes(src)");
  static_assert(space_traits<SrcS>::copy_engine_accessible,
                "gdr::cuda::memcpy_async: the source is pageable Host memory, and an asynchronous copy needs "
                "page-locked memory (cudaMemcpyAsync from pageable memory blocks the host or is unsafe). "
                "Copy it into a gdr::buffer<T, gdr::Pinned> first and copy from that.");
  static_assert(space_traits<DstS>::copy_engine_accessible,
                "gdr::cuda::memcpy_async: the destination is pageable Host memory, and an asynchronous copy "
                "needs page-locked memory (cudaMemcpyAsync into pageable memory blocks the host or is "
                "unsafe). Copy into a gdr::buffer<T, gdr::Pinned> and from there to Host memory.");
  // Only once both ends are page-locked, so one mistake gives one message.
  static_assert(!(space_traits<SrcS>::copy_engine_accessible && space_traits<DstS>::copy_engine_accessible) ||
                    copy_uses_engine_v<DstS, SrcS>,
                "gdr::cuda::memcpy_async: this pair of spaces is not a copy-engine copy "
                "(Pinned -> Pinned is a host copy: use co_await gdr::copy(dst, src))");
  if (dst.size() != src.size()) return make_error_code(errc::invalid_argument);
  if (dst.size() == 0) return {};
  constexpr cudaMemcpyKind kind = detail::memcpy_kind<DstS, SrcS>();
  if constexpr (kind == cudaMemcpyDeviceToDevice) {
    if (dst.device() >= 0 && src.device() >= 0 && dst.device() != src.device()) {
      return check(cudaMemcpyPeerAsync(dst.data(), dst.device(), src.data(), src.device(), dst.size_bytes(), s.get()),
                   "cudaMemcpyPeerAsync");
    }
    // Overlapping device ranges: cudaMemcpy's result is undefined for them.
    const auto* d = reinterpret_cast<const std::byte*>(dst.data());
    const auto* r = reinterpret_cast<const std::byte*>(src.data());
    if (d < r + src.size_bytes() && r < d + dst.size_bytes()) return make_error_code(errc::invalid_argument);
  }
  return check(cudaMemcpyAsync(dst.data(), src.data(), dst.size_bytes(), kind, s.get()), "cudaMemcpyAsync");
}

namespace detail {

/// The awaitable of a copy-engine `gdr::copy`: queues the copy, then waits
/// for an event recorded after it.
template <class T, class U, class DstS, class SrcS>
class copy_awaitable : public stream_awaitable<copy_awaitable<T, U, DstS, SrcS>> {
  using base = stream_awaitable<copy_awaitable<T, U, DstS, SrcS>>;

 public:
  copy_awaitable(gdr::view<T, DstS> dst, gdr::view<U, SrcS> src, const stream& s) noexcept
      : base(s.get(), s.device()), dst_(dst), src_(src), s_(&s) {
    if (dst.size() != src.size()) {
      this->ec_ = make_error_code(errc::invalid_argument);
      this->what_ = "gdr::copy: dst and src have different sizes";
    }
  }

  std::error_code issue() noexcept {
    std::error_code ec = memcpy_async(dst_, src_, *s_);
    if (ec) this->what_ = ec == errc::invalid_argument ? "gdr::copy: overlapping device ranges" : "gdr::copy: cudaMemcpyAsync";
    return ec;
  }

 private:
  gdr::view<T, DstS> dst_;
  gdr::view<U, SrcS> src_;
  const stream* s_;
};

}  // namespace detail

}  // namespace gdr::cuda
