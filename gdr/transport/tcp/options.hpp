/// \file
/// The TCP transport's tag (the key of its rows in the path table), the
/// tuning of one endpoint and its counters.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include <gdr/protocol/options.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transport/tcp/socket.hpp>

namespace gdr::tcp {

/// The TCP transport's tag: the key of its rows in the path table.
struct endpoint_stats;
struct transport {
  static constexpr const char* name = "tcp";
  using stats_type = endpoint_stats;
};

/// Tuning of one endpoint. The defaults suit a loopback or datacenter link.
struct endpoint_options {
  /// The protocol layer's tuning (rendezvous threshold, early-message
  /// store, reply slots, the largest message accepted).
  protocol_options protocol{};
  /// Size of the staging buffer each read fills (clamped to at least one
  /// header plus `direct_read_threshold`). Allocated when a read first
  /// fills the 512 bytes a connection starts with (an idle endpoint holds
  /// none); without memory for it, reading goes on 512 bytes at a time.
  std::size_t rx_buffer = 64 * 1024;
  /// A payload rest larger than this is read by the kernel straight into
  /// its destination instead of through the staging buffer (one system call
  /// more, one copy less).
  std::size_t direct_read_threshold = 16 * 1024;
  /// Writes whose payload bytes reach this size use `IORING_OP_SENDMSG_ZC`
  /// (the kernel pins the user's pages instead of copying them). 0: never.
  /// Off by default: on loopback it measured slower (benchmarks/RESULTS.md);
  /// on a real NIC it may win for large messages.
  std::size_t zero_copy_send_threshold = 0;
  /// While the scheduler is in `run_mode::busy_poll`, read the socket the
  /// way a spinning socket program does: the loop calls
  /// `recv(MSG_DONTWAIT)` once per iteration while a read is pending,
  /// instead of handing the read to io_uring, where it would wait on the
  /// kernel's poll (wake-up, task work, then the CQE). Lower latency when
  /// data arrives; one system call per idle endpoint per loop iteration.
  /// Reads in `run_mode::sleep` always go through io_uring. false: reads
  /// always go through io_uring.
  bool spin_reads_in_busy_poll = true;
  /// While the scheduler is in `run_mode::busy_poll`, write the way a
  /// spinning socket program does: the frames queued during one event
  /// handler go out at its end as one non-blocking `sendmsg` (or `send`)
  /// system call made by the loop, instead of an io_uring write (an SQE, a
  /// submission and a CQE to process: about 0.2-0.5 us more per write,
  /// benchmarks/RESULTS.md). What the socket cannot take at once waits for
  /// room (a poll), then goes on. false: writes always go through io_uring.
  bool direct_writes_in_busy_poll = true;
  /// In both run modes: a small eager message (up to 448 bytes) sent while
  /// nothing is queued or being written, and no other coroutine resumed by
  /// the same event is about to send, is written by the send itself (one
  /// non-blocking `send`), and its `co_await` completes without suspending:
  /// no queue, no write completion to process. One per endpoint and loop
  /// turn, so a coroutine that only sends still lets the loop run. What the
  /// socket does not take at once goes on through io_uring. false: every
  /// frame goes through the writer's queue.
  bool fast_sends = true;
  /// Socket settings (keepalive, TCP_USER_TIMEOUT, ...).
  socket_options socket{};
  /// How long an orderly close (this side's or the peer's) waits, after
  /// its close frame, for the peer's end of stream before it drops the
  /// connection (GUIDE section 8). A close's own timeout, if shorter,
  /// bounds it first.
  std::chrono::milliseconds close_linger{2000};
};

/// Counters of one endpoint: the protocol layer's, and the transport's.
struct endpoint_stats : protocol_stats {
  std::uint64_t writes = 0;            ///< writes of a batch of frames (io_uring or direct)
  std::uint64_t zero_copy_writes = 0;  ///< of which SENDMSG_ZC
  std::uint64_t direct_writes = 0;     ///< of which non-blocking system calls by the loop (busy_poll)
  std::uint64_t fast_sends = 0;        ///< of which small eager messages written whole by the send itself (fast_sends)
  std::uint64_t fast_short = 0;        ///< writes of the send itself the socket took only part of (the rest: io_uring)
  std::uint64_t write_waits = 0;       ///< times the socket was full and the writer waited for room (a poll)
  std::uint64_t reads = 0;             ///< reads started (staging and direct; io_uring or spinning)
  std::uint64_t direct_reads = 0;      ///< of which straight into a user or registered buffer
  std::uint64_t spin_reads = 0;        ///< non-blocking recv() attempts by the loop (busy_poll, see endpoint_options)
  std::uint64_t frames_out = 0;        ///< frames written
  std::uint64_t frames_in = 0;         ///< frames parsed
};

}  // namespace gdr::tcp
