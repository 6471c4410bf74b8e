/// \file
/// `gdr::buffer<T, S>`: an owning, move-only array of `T` in memory space `S`,
/// allocated through the space's resource (`gdr/memory/resource.hpp`).
///
/// A buffer is to `view<T, S>` what `std::vector` is to `std::span`: it owns
/// the bytes and hands out views. What the host may do with the elements is
/// the view's rule (`space_traits<S>::host_accessible`): `operator[]`,
/// `begin`/`end` and `span()` exist for Host and Pinned buffers and fail to
/// compile, with the view's message, for Device buffers.
///
/// Elements are not initialised (as with `cudaMalloc` and `cudaHostAlloc`,
/// whose memory arrives uninitialised): `T` must be trivially copyable, since
/// copy engines and NICs move its bytes without constructors.
///
/// \code
///   gdr::buffer<float, gdr::Pinned> staging(1 << 20);
///   std::fill(staging.begin(), staging.end(), 1.0f);
///   gdr::buffer<float, gdr::Device> d(1 << 20, /*device=*/0);  // needs //gdr:cuda
///   co_await gdr::copy(d, staging, stream);
/// \endcode
///
/// Thread-safety: as a `std::vector`: distinct buffers may be used from any
/// threads; one buffer is not synchronised. Freeing Device or Pinned memory
/// while a copy or transfer still uses it is the caller's bug: await the
/// operation first.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>

#include <gdr/config.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/access.hpp>
#include <gdr/memory/resource.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>

namespace gdr {

/// Owning, move-only array of `count` elements of `T` in space `S`. See the
/// file comment.
template <class T, class S>
class buffer {
  static_assert(memory_space<S>, "gdr::buffer<T, S>: S must be a memory space tag (gdr::Host, gdr::Pinned, gdr::Device)");
  static_assert(!is_remote_v<S>, "gdr::buffer<T, Remote<S>>: a peer's memory cannot be allocated here; the peer "
                                 "allocates it and sends a gdr::remote_view (registration.describe(rank))");
  static_assert(GDR_HAS_CUDA || !space_traits<S>::on_device,
                "gdr::buffer<T, gdr::Device> needs CUDA, and this translation unit is built without it "
                "(GDR_HAS_CUDA=0). Depend on //gdr:cuda (Bazel; it defines GDR_HAS_CUDA=1 and links "
                "cudart), or build with -DGDR_HAS_CUDA=1 and link the CUDA runtime.");
  static_assert(std::is_trivially_copyable_v<T> && !std::is_const_v<T>,
                "gdr::buffer<T, S>: T must be a non-const trivially copyable type: copy engines and NICs move "
                "its bytes without running constructors");

  using resource = memory_resource<S>;

 public:
  using element_type = T;
  using value_type = T;
  using space = S;
  using size_type = std::size_t;
  using iterator = T*;
  using const_iterator = const T*;

  /// An empty buffer; allocates nothing.
  buffer() noexcept = default;

  /// `count` uninitialised elements; for Device, on GPU `device` (ignored
  /// otherwise). Throws `gdr::error`: `errc::no_device` (with the reason: no
  /// driver, no GPU, bad ordinal), an errno value (`ENOMEM`, or `mlock`'s
  /// error for Pinned without CUDA), or a CUDA error (out of device memory).
  explicit buffer(std::size_t count, int device = 0) {
    const std::size_t bytes = checked_bytes(count);
    result<allocation> r = resource::allocate(bytes, device);
    if (!r) throw error(r.error(), resource::failure_message(r.error(), bytes, device));
    alloc_ = *r;
    size_ = count;
  }

  /// The non-throwing form: a buffer, or the error code the constructor
  /// would have thrown (without its sentence; `memory_resource<S>::failure_message`
  /// gives that).
  static result<buffer> allocate(std::size_t count, int device = 0) noexcept {
    if (count > max_size()) return errc::invalid_argument;
    result<allocation> r = resource::allocate(count * sizeof(T), device);
    if (!r) return r.error();
    return buffer(*r, count);
  }

  buffer(buffer&& o) noexcept : alloc_(std::exchange(o.alloc_, allocation{})), size_(std::exchange(o.size_, 0)) {}
  buffer& operator=(buffer&& o) noexcept {
    if (this != &o) {
      release();
      alloc_ = std::exchange(o.alloc_, allocation{});
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;

  /// Frees the memory. Never throws; a CUDA error on free is logged once.
  ~buffer() { release(); }

  /// A view of all elements (carries the device ordinal for Device memory).
  gdr::view<T, S> view() noexcept { return gdr::view<T, S>(data(), size_, device()); }
  gdr::view<const T, S> view() const noexcept { return gdr::view<const T, S>(data(), size_, device()); }
  /// Implicit conversion, so a buffer can be passed where a view is taken.
  operator gdr::view<T, S>() noexcept { return view(); }              // NOLINT: implicit by design
  operator gdr::view<const T, S>() const noexcept { return view(); }  // NOLINT

  /// The first element's address: what kernels, copies and transports take.
  /// Not dereferenceable by the host for Device memory.
  T* data() noexcept { return static_cast<T*>(alloc_.ptr); }
  const T* data() const noexcept { return static_cast<const T*>(alloc_.ptr); }
  std::size_t size() const noexcept { return size_; }
  std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }
  /// GPU ordinal for Device memory, -1 otherwise.
  int device() const noexcept { return alloc_.device; }
  /// How the memory was obtained (e.g. `cuda_host_alloc` or `mmap_mlock` for
  /// Pinned): says whether CUDA knows this memory.
  alloc_method method() const noexcept { return alloc_.method; }
  /// The largest element count whose byte size fits a `std::size_t`.
  static constexpr std::size_t max_size() noexcept { return static_cast<std::size_t>(-1) / sizeof(T); }

  // ---- host access: the view's rules (compile error for Device) ----------

  T& operator[](std::size_t i) noexcept { return view()[i]; }
  const T& operator[](std::size_t i) const noexcept { return view()[i]; }
  T* begin() noexcept { return view().begin(); }
  T* end() noexcept { return view().end(); }
  const T* begin() const noexcept { return view().begin(); }
  const T* end() const noexcept { return view().end(); }
  std::span<T> span() noexcept { return view().span(); }
  std::span<const T> span() const noexcept { return view().span(); }

 private:
  buffer(allocation a, std::size_t count) noexcept : alloc_(a), size_(count) {}

  static std::size_t checked_bytes(std::size_t count) {
    if (count > max_size()) throw error(make_error_code(errc::invalid_argument), "gdr::buffer: element count overflows size_t");
    return count * sizeof(T);
  }

  void release() noexcept {
    if (alloc_.method != alloc_method::none) resource::deallocate(alloc_);
    alloc_ = allocation{};
    size_ = 0;
  }

  allocation alloc_{};
  std::size_t size_ = 0;
};

}  // namespace gdr
