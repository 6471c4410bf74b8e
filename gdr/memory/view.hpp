/// \file
/// `gdr::view<T, S>`: a non-owning, span-like range of `T` in memory space `S`.
///
/// A view is a pointer, a length and (for `Device`) a device ordinal. What the
/// host may do with it follows from `space_traits<S>`: element access,
/// iteration and conversion to `std::span` exist only where the host may
/// dereference the memory, and say so at compile time otherwise. `data()` is
/// always available: it is what kernels, copies and transports take.
///
/// \code
///   gdr::buffer<float, gdr::Device> d(1024);
///   gdr::view<float, gdr::Device> v = d.view();
///   float x = v[0];   // error: gdr::view<T, Device>: the host cannot dereference Device memory...
/// \endcode
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include <gdr/memory/access.hpp>
#include <gdr/memory/space.hpp>

#if defined(__CUDA_ARCH__)
#define GDR_DEVICE_CODE 1
#else
#define GDR_DEVICE_CODE 0
#endif

namespace gdr {

/// The host-side diagnostic for dereferencing memory the host cannot reach.
#define GDR_HOST_ACCESS_ERROR_                                                                   \
  "gdr::view<T, S>: the host cannot dereference memory in space S (Device or Remote). "        \
  "Copy it into a Host or Pinned buffer first (co_await gdr::copy(dst, src, stream)), pass "    \
  "view.data() to a kernel, or send it through an endpoint."

/// Non-owning range of `count` elements of `T` at `data` in space `S`.
///
/// Thread-safety: a view is a value; the memory it names is as shared as its
/// owner makes it.
template <class T, class S>
class view {
  static_assert(memory_space<S>, "gdr::view<T, S>: S must be a memory space tag (gdr::Host, "
                                 "gdr::Pinned, gdr::Device); use gdr::remote_view for a peer's memory");
  static_assert(!is_remote_v<S>, "gdr::view<T, Remote<S>>: a peer's memory is described by "
                                 "gdr::remote_view<T, S>, reachable only through ep.put/ep.get");

 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using space = S;
  using size_type = std::size_t;
  using pointer = T*;
  using iterator = T*;

  constexpr view() noexcept = default;
  /// `count` elements at `data`; `device` is the GPU ordinal for Device memory.
  constexpr view(T* data, std::size_t count, int device = -1) noexcept
      : data_(data), size_(count), device_(device) {}

  /// A view of const elements from a view of mutable ones.
  template <class U>
    requires std::is_convertible_v<U (*)[], T (*)[]>
  constexpr view(view<U, S> o) noexcept  // NOLINT: implicit, like std::span
      : data_(o.data()), size_(o.size()), device_(o.device()) {}

  /// Host memory from a contiguous range: `gdr::view<int, gdr::Host> v{vec};`
  template <class R>
    requires host_accessible<S> && requires(R& r) {
      { std::span<T>(r) };
    }
  constexpr explicit view(R& r) noexcept : view(std::span<T>(r)) {}
  constexpr explicit view(std::span<T> s) noexcept
    requires host_accessible<S>
      : data_(s.data()), size_(s.size()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  constexpr bool empty() const noexcept { return size_ == 0; }
  /// GPU ordinal for Device memory, -1 otherwise.
  constexpr int device() const noexcept { return device_; }

  /// `count` elements from `offset`, clamped to the view.
  constexpr view subview(std::size_t offset, std::size_t count = static_cast<std::size_t>(-1)) const noexcept {
    if (offset > size_) offset = size_;
    if (count > size_ - offset) count = size_ - offset;
    return view(data_ + offset, count, device_);
  }
  constexpr view first(std::size_t n) const noexcept { return subview(0, n); }

  /// The same bytes as `std::byte` (const-correct).
  constexpr auto as_bytes() const noexcept {
    using B = std::conditional_t<std::is_const_v<T>, const std::byte, std::byte>;
    return view<B, S>(reinterpret_cast<B*>(data_), size_bytes(), device_);
  }

  // ---- host access: only where space_traits<S>::host_accessible ----------

  constexpr T& operator[](std::size_t i) const noexcept {
#if !GDR_DEVICE_CODE
    static_assert(space_traits<S>::host_accessible, GDR_HOST_ACCESS_ERROR_);
#endif
    return data_[i];
  }
  constexpr T* begin() const noexcept {
#if !GDR_DEVICE_CODE
    static_assert(space_traits<S>::host_accessible, GDR_HOST_ACCESS_ERROR_);
#endif
    return data_;
  }
  constexpr T* end() const noexcept {
#if !GDR_DEVICE_CODE
    static_assert(space_traits<S>::host_accessible, GDR_HOST_ACCESS_ERROR_);
#endif
    return data_ + size_;
  }
  /// Conversion to `std::span`, which the host may dereference freely.
  constexpr operator std::span<T>() const noexcept {  // NOLINT: implicit by design
    static_assert(space_traits<S>::host_accessible,
                  "gdr::view<T, S> -> std::span<T>: a std::span is host-dereferenceable, and "
                  "memory in space S (Device) is not. Keep the gdr::view, or copy into a Host or "
                  "Pinned buffer (co_await gdr::copy(dst, src, stream)) and span that.");
    return {data_, size_};
  }
  constexpr std::span<T> span() const noexcept { return static_cast<std::span<T>>(*this); }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  int device_ = -1;
};

template <class T>
view(std::span<T>) -> view<T, Host>;

/// Host view of a contiguous container: `gdr::host_view(vec)`.
template <class R>
auto host_view(R& r) noexcept {
  auto s = std::span(r);
  return view<typename decltype(s)::element_type, Host>(s);
}

/// The raw bytes of a view.
template <class T, class S>
constexpr auto as_bytes(view<T, S> v) noexcept {
  return v.as_bytes();
}

/// A view of `T` in space `S`, in any constness.
template <class V>
concept any_view = requires(V v) {
  typename V::space;
  typename V::element_type;
  { v.data() };
  { v.size_bytes() } -> std::same_as<std::size_t>;
};

}  // namespace gdr
