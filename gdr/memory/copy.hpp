/// \file
/// `co_await gdr::copy(dst, src[, stream])`: a local copy between memory
/// spaces, on the path the access table gives for the pair (`copy_path<Dst,
/// Src>` in gdr/memory/access.hpp). The one place that turns the pair of
/// spaces into a path:
///
///   host_memcpy        Host/Pinned <-> Host/Pinned: the CPU copies
///                      (`memmove`, so overlapping ranges are fine) when the
///                      copy is awaited; it completes at once and needs no
///                      stream: `co_await gdr::copy(dst, src)`.
///   copy engine        Pinned -> Device, Device -> Pinned, Device -> Device:
///                      `cudaMemcpyAsync` on the stream, then a CUDA event; the
///                      coroutine resumes when the scheduler's
///                      `gdr::cuda::event_poller` sees the event complete.
///                      Needs CUDA (//gdr:cuda) and a stream.
///   none               Host <-> Device (pageable): does not compile; the
///                      message names the space to stage through (`via`:
///                      Pinned). Anything Remote: does not compile; a peer's
///                      memory is reached through an endpoint.
///
/// Arguments are views or anything with `.view()` (a `gdr::buffer`). The
/// element types must match (a compile error otherwise: copy bytes with
/// `gdr::as_bytes` on both sides). Sizes must match: a mismatch throws
/// `gdr::error(errc::invalid_argument)` at the `co_await` (or, with
/// `.as_result()`, returns it) and copies nothing.
///
/// \code
///   gdr::buffer<float, gdr::Pinned> staging(n);
///   gdr::buffer<float, gdr::Device> dev(n);
///   co_await gdr::copy(staging, host_view);       // CPU, at once
///   co_await gdr::copy(dev, staging, stream);     // copy engine, event
///   gdr::result<void> r = co_await gdr::copy(dev, staging, stream).as_result();
/// \endcode
///
/// Completion context: host copies complete inside the `co_await`, on the
/// awaiting thread; copy-engine copies on the scheduler's thread, inside its
/// event poller. Not cancellable: a queued DMA cannot be recalled, so both
/// buffers stay alive until the awaiting coroutine resumes.
#pragma once

#include <coroutine>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>

#include <gdr/config.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/access.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>

#if GDR_HAS_CUDA
#include <gdr/memory/cuda_copy.hpp>
#include <gdr/cuda/stream.hpp>
#endif

namespace gdr {

namespace detail {

template <class T>
inline constexpr bool dependent_false_v = false;

template <class X>
struct is_remote_view : std::false_type {};
template <class T, class S>
struct is_remote_view<remote_view<T, S>> : std::true_type {};
template <class X>
inline constexpr bool is_remote_view_v = is_remote_view<std::remove_cvref_t<X>>::value;

/// What `gdr::copy` accepts: a view, a buffer (anything with `.view()`), or
/// a remote view (only to say, at compile time, why that cannot work).
template <class X>
concept copy_operand = any_view<std::remove_cvref_t<X>> || is_remote_view_v<X> ||
                       requires(X& x) { { x.view() } -> any_view; };

// A buffer also looks like a view (data, size_bytes, space), so ask for
// `.view()` first.
template <class X>
constexpr auto as_copy_view(X& x) noexcept {
  if constexpr (requires { x.view(); }) {
    return x.view();
  } else {
    return x;
  }
}

/// Every compile-time rule of `gdr::copy`, in the order a user should read
/// them; at most one assertion fires. True when the copy is legal.
template <class DV, class SV, bool WithStream>
constexpr bool check_copy() noexcept {
  if constexpr (is_remote_view_v<DV> || is_remote_view_v<SV>) {
    static_assert(dependent_false_v<DV>,
                  "gdr::copy: one side is a gdr::remote_view, a peer's memory. It is reachable only through a "
                  "transport endpoint: co_await ep.put(local_view, remote) or co_await ep.get(local_view, remote)");
    return false;
  } else {
    using dst_t = typename DV::element_type;
    using src_t = typename SV::element_type;
    using dst_space = typename DV::space;
    using src_space = typename SV::space;
    using path = copy_path<dst_space, src_space>;
    if constexpr (std::is_const_v<dst_t>) {
      static_assert(dependent_false_v<DV>, "gdr::copy: the destination is a view of const elements");
      return false;
    } else if constexpr (!std::is_same_v<std::remove_cv_t<dst_t>, std::remove_cv_t<src_t>>) {
      static_assert(dependent_false_v<DV>,
                    "gdr::copy: the element types of dst and src differ. Copy between views of the same T, "
                    "or copy raw bytes: gdr::as_bytes(dst) and gdr::as_bytes(src)");
      return false;
    } else if constexpr (path::kind == copy_kind::none && std::is_same_v<typename path::via, Pinned>) {
      static_assert(dependent_false_v<DV>,
                    "gdr::copy: there is no direct copy between pageable Host memory and Device memory (the "
                    "copy engine cannot DMA pageable pages asynchronously). Stage through a "
                    "gdr::buffer<T, gdr::Pinned>: copy Host -> Pinned, then Pinned -> Device (or the reverse)");
      return false;
    } else if constexpr (path::kind == copy_kind::none) {
      static_assert(dependent_false_v<DV>, "gdr::copy: the access table has no copy path between these spaces");
      return false;
    } else if constexpr (copy_uses_engine_v<dst_space, src_space> && !GDR_HAS_CUDA) {
      static_assert(dependent_false_v<DV>,
                    "gdr::copy: this copy runs on a GPU copy engine, and this translation unit is built without "
                    "CUDA (GDR_HAS_CUDA=0). Depend on //gdr:cuda (or build with -DGDR_HAS_CUDA=1)");
      return false;
    } else if constexpr (copy_uses_engine_v<dst_space, src_space> && !WithStream) {
      static_assert(dependent_false_v<DV>,
                    "gdr::copy(dst, src): this pair runs on a GPU copy engine (Pinned <-> Device, Device <-> "
                    "Device) and needs a stream: co_await gdr::copy(dst, src, stream) with a gdr::cuda::stream");
      return false;
    } else {
      return true;
    }
  }
}

/// Placeholder returned after a failed `check_copy`, so that the one
/// diagnostic is not followed by unrelated ones.
struct invalid_copy {
  bool await_ready() const noexcept { return true; }
  void await_suspend(std::coroutine_handle<>) const noexcept {}
  void await_resume() const noexcept {}
};

}  // namespace detail

/// The awaitable of a CPU copy (`copy_kind::host_memcpy`): copies when
/// awaited and never suspends. Throws `gdr::error(errc::invalid_argument)`
/// when the sizes differ; `.as_result()` returns the error instead.
template <class T>
class host_copy_awaitable {
 public:
  host_copy_awaitable(T* dst, std::size_t dst_size, const T* src, std::size_t src_size) noexcept
      : dst_(dst), src_(src), dst_size_(dst_size), src_size_(src_size) {}

  bool await_ready() const noexcept { return true; }
  void await_suspend(std::coroutine_handle<>) const noexcept {}
  void await_resume() const { throw_if(run().error(), "gdr::copy: dst and src have different sizes"); }

  /// The same copy, but `co_await` returns `result<void>` and never throws.
  auto as_result() && noexcept {
    struct adapter : host_copy_awaitable {
      result<void> await_resume() const noexcept { return this->run(); }
    };
    return adapter{std::move(*this)};
  }

 protected:
  result<void> run() const noexcept {
    if (dst_size_ != src_size_) return errc::invalid_argument;
    // memmove: host views may overlap (two subviews of one buffer), and for
    // non-overlapping ranges it is as fast as memcpy.
    if (dst_size_ != 0) std::memmove(dst_, src_, dst_size_ * sizeof(T));
    return {};
  }

 private:
  T* dst_;
  const T* src_;
  std::size_t dst_size_;
  std::size_t src_size_;
};

/// Copies `src` into `dst` when the pair of spaces is a CPU copy (Host and
/// Pinned in any combination); completes at once. For copy-engine pairs use
/// the form with a stream: this one does not compile for them, saying so.
template <class Dst, class Src>
  requires detail::copy_operand<Dst> && detail::copy_operand<Src>
auto copy(Dst&& dst, Src&& src) noexcept {
  auto dv = detail::as_copy_view(dst);
  auto sv = detail::as_copy_view(src);
  using DV = std::remove_cvref_t<decltype(dv)>;
  using SV = std::remove_cvref_t<decltype(sv)>;
  if constexpr (!detail::check_copy<DV, SV, false>()) {
    return detail::invalid_copy{};
  } else {
    using T = typename DV::element_type;
    return host_copy_awaitable<T>(dv.data(), dv.size(), sv.data(), sv.size());
  }
}

#if GDR_HAS_CUDA
/// Copies `src` into `dst` on the path the access table gives: a CPU copy
/// for host pairs (the stream is not used), `cudaMemcpyAsync` on `s` and a
/// CUDA event for copy-engine pairs. See the file comment for the contract.
template <class Dst, class Src>
  requires detail::copy_operand<Dst> && detail::copy_operand<Src>
auto copy(Dst&& dst, Src&& src, const cuda::stream& s) noexcept {
  auto dv = detail::as_copy_view(dst);
  auto sv = detail::as_copy_view(src);
  using DV = std::remove_cvref_t<decltype(dv)>;
  using SV = std::remove_cvref_t<decltype(sv)>;
  if constexpr (!detail::check_copy<DV, SV, true>()) {
    return detail::invalid_copy{};
  } else if constexpr (copy_path<typename DV::space, typename SV::space>::kind == copy_kind::host_memcpy) {
    using T = typename DV::element_type;
    return host_copy_awaitable<T>(dv.data(), dv.size(), sv.data(), sv.size());
  } else {
    return cuda::detail::copy_awaitable<typename DV::element_type, typename SV::element_type, typename DV::space,
                                        typename SV::space>(dv, sv, s);
  }
}
#endif

}  // namespace gdr
