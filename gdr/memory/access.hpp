/// \file
/// The access table: every fact about a memory space, and about a pair of
/// spaces, in one place (after Kokkos `MemorySpaceAccess<Dst, Src>`).
///
/// Each fact has a conservative default (no access, no copy path) and explicit
/// specializations; code elsewhere asks this table and never compares spaces
/// with `std::is_same_v`. The static_assert tables in
/// `tests/memory/access_test.cpp` pin every entry.
#pragma once

#include <type_traits>

#include <gdr/memory/space.hpp>

namespace gdr {

/// Per-space facts. Conservative default: nothing may touch the memory.
template <class S>
struct space_traits {
  /// The host CPU may load and store through a plain pointer.
  static constexpr bool host_accessible = false;
  /// GPU copy engines (`cudaMemcpyAsync`) may read and write it asynchronously.
  static constexpr bool copy_engine_accessible = false;
  /// Pages cannot move: DMA (copy engines, NICs) may target it.
  static constexpr bool page_locked = false;
  /// Allocations live on a GPU (carry a device ordinal).
  static constexpr bool on_device = false;
};

template <>
struct space_traits<Host> {
  static constexpr bool host_accessible = true;
  static constexpr bool copy_engine_accessible = false;  // pageable: not async-safe
  static constexpr bool page_locked = false;
  static constexpr bool on_device = false;
};

template <>
struct space_traits<Pinned> {
  static constexpr bool host_accessible = true;
  static constexpr bool copy_engine_accessible = true;
  static constexpr bool page_locked = true;
  static constexpr bool on_device = false;
};

template <>
struct space_traits<Device> {
  static constexpr bool host_accessible = false;
  static constexpr bool copy_engine_accessible = true;
  static constexpr bool page_locked = true;  // GPU memory never pages out
  static constexpr bool on_device = true;
};

// Remote<S>: the default (nothing) applies: only a transport reaches it.

/// The host may dereference memory in `S`.
template <class S>
concept host_accessible = memory_space<S> && space_traits<S>::host_accessible;

/// How a local copy from `Src` to `Dst` is done.
enum class copy_kind {
  none,            ///< no direct path (see `copy_path::via`)
  host_memcpy,     ///< the CPU copies (`std::memcpy`), completes at once
  host_to_device,  ///< copy engine, `cudaMemcpyAsync` H2D on a stream
  device_to_host,  ///< copy engine, D2H on a stream
  device_to_device ///< copy engine (or peer access), D2D on a stream
};

/// Copy facts for a pair of spaces. Conservative default: no path, no
/// intermediate.
template <class Dst, class Src>
struct copy_path {
  static constexpr copy_kind kind = copy_kind::none;
  /// The space to stage through when there is no direct path (`void`: none).
  using via = void;
};

// CPU copies between host-accessible spaces.
template <> struct copy_path<Host, Host> { static constexpr copy_kind kind = copy_kind::host_memcpy; using via = void; };
template <> struct copy_path<Host, Pinned> { static constexpr copy_kind kind = copy_kind::host_memcpy; using via = void; };
template <> struct copy_path<Pinned, Host> { static constexpr copy_kind kind = copy_kind::host_memcpy; using via = void; };
template <> struct copy_path<Pinned, Pinned> { static constexpr copy_kind kind = copy_kind::host_memcpy; using via = void; };

// Copy-engine copies: asynchronous, so both ends must be page-locked.
template <> struct copy_path<Device, Pinned> { static constexpr copy_kind kind = copy_kind::host_to_device; using via = void; };
template <> struct copy_path<Pinned, Device> { static constexpr copy_kind kind = copy_kind::device_to_host; using via = void; };
template <> struct copy_path<Device, Device> { static constexpr copy_kind kind = copy_kind::device_to_device; using via = void; };

// Pageable <-> Device has no asynchronous path: an async DMA from pageable
// memory is either silently synchronous or unsafe. Stage through Pinned.
template <> struct copy_path<Device, Host> { static constexpr copy_kind kind = copy_kind::none; using via = Pinned; };
template <> struct copy_path<Host, Device> { static constexpr copy_kind kind = copy_kind::none; using via = Pinned; };

/// A direct local copy from `Src` to `Dst` exists.
template <class Dst, class Src>
concept copyable_to = memory_space<Dst> && memory_space<Src> &&
                      copy_path<Dst, Src>::kind != copy_kind::none;

/// The copy runs on a GPU copy engine (needs a stream and completes through a
/// CUDA event).
template <class Dst, class Src>
inline constexpr bool copy_uses_engine_v =
    copy_path<Dst, Src>::kind == copy_kind::host_to_device ||
    copy_path<Dst, Src>::kind == copy_kind::device_to_host ||
    copy_path<Dst, Src>::kind == copy_kind::device_to_device;

}  // namespace gdr
