/// \file
/// Memory spaces as types: `Host`, `Pinned`, `Device`, `Remote<S>`.
///
/// A space is an empty tag that names itself through `memory_space` (as Kokkos
/// does with `using memory_space = CudaSpace;`). Views and buffers carry their
/// space as a template parameter, so the compiler, not a run-time pointer query,
/// decides what may touch the memory and which path a copy or a send takes.
/// The facts about each space and each pair of spaces are in one table:
/// `gdr/memory/access.hpp`.
///
/// What a space does not carry is a run-time location: which GPU a `Device`
/// buffer is on (its ordinal) and which peer a `Remote` view belongs to are
/// values, stored in the view.
#pragma once

#include <concepts>
#include <type_traits>

namespace gdr {

/// Ordinary pageable host memory (`malloc`, `new`, the stack). The host may
/// dereference it; DMA engines cannot reach it safely (the kernel may move or
/// swap its pages), so GPU copies and RDMA need it staged or registered.
struct Host {
  using memory_space = Host;
  static constexpr const char* name = "Host";
};

/// Page-locked host memory (`cudaMallocHost`, or `mlock`ed without CUDA). The
/// host may dereference it, and the GPU copy engines and NICs can DMA to and
/// from it directly: the bounce buffers of staged paths are Pinned.
struct Pinned {
  using memory_space = Pinned;
  static constexpr const char* name = "Pinned";
};

/// GPU memory (`cudaMalloc`). The host must not dereference it; the copy
/// engines reach it, a NIC reaches it only with GPUDirect RDMA, and another
/// process on the node through CUDA IPC. The device ordinal is a run-time value.
struct Device {
  using memory_space = Device;
  static constexpr const char* name = "Device";
};

/// Memory of a peer, in space `S` on the peer's side. Reachable only through a
/// transport (`put`/`get` with the registration key); never dereferenced or
/// copied locally.
template <class S>
struct Remote {
  using memory_space = Remote<S>;
  using peer_space = S;
  static constexpr const char* name = "Remote";
};

namespace detail {
template <class S>
struct is_remote : std::false_type {};
template <class S>
struct is_remote<Remote<S>> : std::true_type {};
}  // namespace detail

/// A memory-space tag: a type whose `memory_space` is itself.
template <class S>
concept memory_space = requires { typename S::memory_space; } &&
                       std::same_as<typename S::memory_space, S>;

/// True for `Remote<S>`.
template <class S>
inline constexpr bool is_remote_v = detail::is_remote<S>::value;

/// A space of this process: `Host`, `Pinned` or `Device`.
template <class S>
concept local_memory_space = memory_space<S> && !is_remote_v<S>;

}  // namespace gdr
