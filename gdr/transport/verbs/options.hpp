/// \file
/// The verbs transport's tag (its key in the path table), the tuning of one
/// endpoint (`endpoint_options`) and its counters (`endpoint_stats`).
///
/// Contract: plain values, read once when an endpoint is made; nothing here
/// touches a device. What each option changes is said beside it, and
/// docs/VERBS.md says how they show on the wire.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include <gdr/protocol/options.hpp>

namespace gdr::verbs {

/// The verbs transport's tag: the key of its rows in the path table.
struct endpoint_stats;
struct transport {
  static constexpr const char* name = "verbs";
  using stats_type = endpoint_stats;
};

/// Tuning of one endpoint. The defaults suit Soft-RoCE and a datacenter NIC.
struct endpoint_options {
  /// The protocol layer's tuning.
  protocol_options protocol{};
  /// Bytes of each receive buffer and send slot: the largest SEND.
  std::size_t buffer_size = 32 * 1024;
  /// Receive buffers posted (the peer's credits).
  unsigned rx_depth = 64;
  /// Send slots: the bounce buffers of SENDs not yet known to be read by
  /// the NIC.
  unsigned tx_depth = 64;
  /// Ask for a completion on every this-many send-queue work requests at
  /// most (sooner when slots or the send queue run short, and always for
  /// a frame that only its completion can end). 0: `tx_depth / 4`; 1:
  /// every work request is signaled.
  unsigned signal_every = 0;
  /// Inline data asked for at queue pair creation (the device may give
  /// less; `connection::max_inline()` says what it gave). 0: never inline.
  unsigned max_inline = 220;
  /// Users' buffers larger than this are not registered with the NIC (0:
  /// no limit): their bytes go through the bounce buffers instead, and a
  /// put served for a peer is read through a send slot. Bounds the memory
  /// one transfer pins.
  std::size_t registration_limit = 0;
  /// Keep registrations of users' buffers cached after their transfer
  /// (see `gdr/transport/verbs/memory.hpp`: then invalidate before freeing).
  bool cache_registrations = false;
  /// An idle connection probes its peer this often (a zero-byte RDMA
  /// WRITE); zero: never.
  std::chrono::milliseconds keepalive{500};
  /// Local ACK timeout exponent: 4.096 us * 2^ack_timeout per try (15: 134 ms).
  std::uint8_t ack_timeout = 15;
  /// Transport retries before a work request fails (at most 7).
  std::uint8_t retry_count = 7;
  /// Make a zero-copy `Device` endpoint: GPUDirect RDMA is probed for GPU
  /// `gpu` and this endpoint's NIC, and the endpoint is not made if it is
  /// not there (`errc::gpudirect_unavailable`, saying which check failed).
  bool gpudirect = false;
  /// The GPU a zero-copy `Device` endpoint serves (CUDA device ordinal).
  int gpu = 0;
  /// Direct one-sided operations (rma.hpp): a put, get or atomic into a
  /// peer's memory exposed to this endpoint's NIC domain is posted by this
  /// side's NIC on a queue pair of its own, with no action by the peer.
  /// Off: every put, get and atomic is served by the peer's loop. Both
  /// sides must have it on for either direction to be direct.
  bool one_sided = true;
  /// Direct operations in flight at most (more wait in order), and the
  /// one-sided queue pair's send-queue entries.
  std::uint32_t one_sided_depth = 64;
  std::uint32_t one_sided_wrs = 256;
  /// Receives posted for the peer's notifying puts (`put_notify`): more
  /// notifications unread than this hold the peer's lane (RNR) until read.
  std::uint32_t notify_depth = 64;
};

/// Memory of this side that a frame told the peer's NIC about: its address,
/// length and remote key (`endpoint::last_key_sent`, for tests).
struct key_info {
  std::uint64_t addr = 0;
  std::size_t len = 0;
  std::uint32_t rkey = 0;
};

/// Counters of one endpoint: the protocol layer's, and the transport's.
struct endpoint_stats : protocol_stats {
  std::uint64_t send_wrs = 0;        ///< SEND work requests (a frame's first buffer, and continuations)
  std::uint64_t inline_sends = 0;    ///< of which inline
  std::uint64_t fast_sends = 0;      ///< eager messages posted at once, never queued (`link_send_now`)
  std::uint64_t fragments = 0;       ///< continuation SENDs of payloads larger than a buffer
  std::uint64_t write_wrs = 0;       ///< RDMA WRITE work requests (WITH_IMM included)
  std::uint64_t read_wrs = 0;        ///< RDMA READ work requests (puts this side serves)
  std::uint64_t rdma_received = 0;   ///< payloads the peer wrote straight into a receive or a get
  std::uint64_t rdma_read = 0;       ///< put payloads this side read from the peer's memory
  std::uint64_t credit_messages = 0; ///< credit-only SENDs
  std::uint64_t credit_stalls = 0;   ///< times a frame waited for credits
  std::uint64_t registrations = 0;   ///< users' buffers registered (or found cached)
  std::uint64_t device_registrations = 0;  ///< ... of which GPU memory (GPUDirect)
  std::uint64_t flushes = 0;         ///< GPUDirect flushes (loopback READs) before a Device receive completed
  std::uint64_t flush_waits = 0;     ///< ... that waited for room on the device's flush queue pair
  std::uint64_t registration_failures = 0;  ///< ... that could not be: bounce buffers instead
  std::uint64_t keepalives = 0;      ///< keepalive probes sent
  std::uint64_t signaled_wrs = 0;    ///< send-queue work requests that asked for a completion
  std::uint64_t completions = 0;     ///< work completions of this connection (receives included)
  std::uint64_t direct_wrs = 0;      ///< one-sided lane: WRITE, READ and atomic work requests posted
  std::uint64_t direct_faults = 0;   ///< ... that the peer's NIC refused (remote access), each one operation failed
  std::uint64_t gpu_flush_reads = 0; ///< ... READs that flushed direct puts into the peer's GPU memory (flush, put_notify)
  std::uint64_t lane_resets = 0;     ///< ... times the lane's queue pairs were made usable again after a fault
  std::uint64_t notifications = 0;   ///< notifying puts of the peer's that arrived
};

}  // namespace gdr::verbs
