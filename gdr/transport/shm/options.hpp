/// \file
/// The shared-memory transport's tag (the key of its rows in the path
/// table), the tuning of one endpoint and its counters.
#pragma once


#include <chrono>
#include <cstddef>
#include <cstdint>

#include <gdr/protocol/options.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/unique_fd.hpp>

namespace gdr::shm {

/// The shared-memory transport's tag: the key of its rows in the path table.
struct endpoint_stats;
struct transport {
  static constexpr const char* name = "shm";
  using stats_type = endpoint_stats;
};

/// How an endpoint moves `Device` memory.
enum class device_path : std::uint8_t {
  /// CUDA IPC where both processes can share device memory (each has a copy
  /// engine that can: a `gdr::cuda::event_poller` on a machine with a GPU,
  /// made before the endpoint), else staged; `GDR_LOG=path` and
  /// `endpoint::device_ipc()` say which.
  automatic,
  /// CUDA IPC, or the endpoint is not made (`errc::unsupported`).
  cuda_ipc,
  /// Staged through pinned bounce buffers and the ring, as on TCP.
  staged,
};

/// A printable name ("automatic", "cuda-ipc", "staged").
constexpr const char* to_string(device_path p) noexcept {
  switch (p) {
    case device_path::automatic: return "automatic";
    case device_path::cuda_ipc: return "cuda-ipc";
    case device_path::staged: return "staged";
  }
  return "?";
}

/// Tuning of one endpoint.
struct endpoint_options {
  /// The protocol layer's tuning (rendezvous threshold, early-message
  /// store, reply slots, the largest message accepted).
  protocol_options protocol{};
  /// Bytes of the ring this side writes into (rounded up to a power of
  /// two, at least 64 KiB, at most 1 GiB). The peer's ring is the size the
  /// peer chose. A message larger than the ring streams through it.
  std::size_t ring_bytes = std::size_t{1} << 20;
  /// How long an orderly close (this side's or the peer's) waits, after its
  /// close frame, for the peer's end before it drops the connection. A
  /// close's own timeout, if shorter, bounds it first.
  std::chrono::milliseconds close_linger{2000};
  /// A frame whose payload reaches this size travels as its header and the
  /// payload's address: the peer copies the bytes straight from this
  /// process's memory into theirs (`process_vm_readv`: one copy instead of
  /// two through the ring), and the frame is done once it has. Used only
  /// where the handshake found that the peer may read this process (the
  /// same user, and no ptrace restriction in between, e.g. Yama's
  /// `ptrace_scope` 1 between sibling processes); else everything goes
  /// through the ring. 0 (the default): never. Off by default because it
  /// measured slower than the rings on both machines tried: one
  /// `process_vm_readv` per payload against two copies pipelined by the
  /// two CPUs through a ring that stays in cache (Debian VM: 16 MiB 6.6
  /// against 13.2 GB/s, 1 MiB round trip 235 against 74 us;
  /// benchmarks/RESULTS.md). Try it where memory bandwidth, not the
  /// copies' overlap, is the limit.
  std::size_t single_copy_threshold = 0;
  /// How `Device` memory moves (see `device_path`). Through CUDA IPC, a
  /// `Device` payload is one GPU copy, made by the receiver (of a send, or
  /// of a get's answer) or the target (of a put) straight out of the
  /// owner's allocation, which the copier's engine imports once and keeps
  /// mapped. Both ends must be able to: one that asks for `cuda_ipc` fails
  /// the handshake with a peer that stages.
  device_path device = device_path::automatic;
};

/// Counters of one endpoint: the protocol layer's, and the transport's.
struct endpoint_stats : protocol_stats {
  std::uint64_t frames_out = 0;   ///< frames written into the ring
  std::uint64_t frames_in = 0;    ///< frames parsed from the peer's ring
  std::uint64_t ring_full = 0;    ///< times a write stopped for lack of room
  std::uint64_t bells_rung = 0;   ///< times this side woke the sleeping peer (an eventfd write)
  std::uint64_t bell_waits = 0;   ///< times this side armed its bell to sleep
  std::uint64_t single_copies = 0;  ///< payloads this side copied straight from the peer's memory
  bool peer_reads_me = false;       ///< the peer copies this side's large payloads itself (see single_copy_threshold)
  bool reads_peer = false;          ///< this side copies the peer's large payloads itself
  std::uint64_t ipc_copies = 0;     ///< Device payloads this side's GPU copied out of the peer's memory (CUDA IPC)
  std::uint64_t ipc_read_past = 0;   ///< of them, copies the reader read on past (the next frame came before they were done)
  std::uint64_t ipc_max_in_flight = 0;  ///< the most CUDA IPC copies of this side's in flight at once
  std::uint64_t ipc_exports = 0;    ///< Device payloads of this side's that went as CUDA IPC descriptors
  std::uint64_t fds_passed = 0;     ///< of them, with their allocation's file descriptor over the socket
  std::uint64_t fds_taken = 0;      ///< descriptors the peer passed that this side took
  std::uint64_t fd_socket_full = 0; ///< times a descriptor waited: the peer had not taken those before it
  std::uint64_t fds_released = 0;   ///< descriptors the peer held whose allocation this side freed: it was told
  std::uint64_t fds_let_go = 0;     ///< descriptors (and mappings) let go because the peer freed their allocation
  std::uint64_t fds_replaced = 0;   ///< descriptors (and mappings) let go because the peer passed another allocation's into their slot
  std::uint64_t ring_gpu_copies = 0;  ///< pieces of host payloads copied from the ring into Device memory
  bool device_ipc = false;          ///< Device memory moves by CUDA IPC on this endpoint (else staged)
};

/// A file descriptor, closed on destruction.
using fd_handle = gdr::detail::unique_fd;

}  // namespace gdr::shm
