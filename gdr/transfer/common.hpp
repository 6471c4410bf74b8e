/// \file
/// What every transport shares: per-operation options (stop token, timeout),
/// the paths an operation can take, and the counters that record which path
/// each operation took.
///
/// "Move bytes" (a transport: loopback, tcp, ipc, verbs) is kept apart from
/// "how to move these bytes" (the protocol layer, `gdr/protocol/`, and the
/// path table, `gdr/transfer/path.hpp`), as UCX keeps `uct/` apart from `ucp/`.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stop_token>
#include <type_traits>

#include <gdr/memory/access.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/sched/stream_order.hpp>

namespace gdr {

/// Options every transport operation accepts.
///
/// `stop`: in addition to the awaiting coroutine's own stop token; either one
/// cancels the operation (`errc::cancelled`). `timeout`: zero means none; when
/// it passes first the operation completes with `errc::timed_out`. Either way
/// the operation's buffers stay in use until the transport is done with them:
/// the coroutine resumes only after that.
///
///   co_await ep.recv(v, {src.get_token()});         // a stop token
///   co_await ep.recv(v, {50ms});                    // a timeout
///   co_await ep.recv(v, {src.get_token(), 50ms});   // both
///   co_await ep.send(dev, gdr::cuda::after(s));     // ordered after work on stream s
///
/// `after` (staged `Device` operations): the operation's device-to-host and
/// host-to-device copies are queued after the work already on that stream,
/// and the coroutine still resumes only when the transfer is done. A send
/// after a producer kernel needs no synchronize; a receive into a buffer a
/// consumer kernel still reads waits for that kernel on the GPU.
///
/// Deliberately not an aggregate (no `{.timeout = 50ms}`): GCC 12 destroys
/// the members of an aggregate temporary twice when it is brace-initialized
/// inside a `co_await` expression, which for the stop token is a
/// use-after-free of its shared state (clang and GCC 13 are fine). With
/// constructors GCC 12 builds and destroys it once; tests/transport pin that.
struct op_options {
  std::stop_token stop{};
  std::chrono::nanoseconds timeout{0};
  stream_order after{};

  op_options() noexcept = default;
  op_options(std::stop_token st) noexcept : stop(std::move(st)) {}  // NOLINT: implicit by design
  template <class Rep, class Period>
  op_options(std::chrono::duration<Rep, Period> t) noexcept  // NOLINT: implicit by design
      : timeout(std::chrono::duration_cast<std::chrono::nanoseconds>(t)) {}
  template <class Rep, class Period>
  op_options(std::stop_token st, std::chrono::duration<Rep, Period> t) noexcept
      : stop(std::move(st)), timeout(std::chrono::duration_cast<std::chrono::nanoseconds>(t)) {}
  op_options(stream_order a) noexcept : after(a) {}  // NOLINT: implicit by design
  template <class Rep, class Period>
  op_options(stream_order a, std::chrono::duration<Rep, Period> t) noexcept
      : timeout(std::chrono::duration_cast<std::chrono::nanoseconds>(t)), after(a) {}
  op_options(std::stop_token st, stream_order a) noexcept : stop(std::move(st)), after(a) {}
};
static_assert(!std::is_aggregate_v<op_options>, "see the GCC 12 note above");

/// How an operation's bytes travelled. Observable on every endpoint
/// (`endpoint.last_path()`, and per-path counters in `endpoint.stats()`).
enum class transfer_path : std::uint8_t {
  none,            ///< no bytes moved yet
  host_zero_copy,  ///< straight from/into the user's host buffer (no extra copy)
  host_eager,      ///< small message copied through the transport's own buffer
  staged_pinned,   ///< pipelined through pinned bounce buffers (device memory)
  cuda_ipc,        ///< CUDA IPC, GPU to GPU within a node
  gpudirect_rdma,  ///< NIC DMA to/from GPU memory
  shared_memory,   ///< copied through a shared-memory ring between processes of one node
  one_sided_rdma,  ///< put, get or atomic posted by this side's NIC into the peer's exposed memory (no action by the peer)
};

/// One block of a batch transfer (`ep.put_batch`, `ep.get_batch`): `bytes`
/// bytes at byte offset `local` of the local view and `remote` of the
/// remote one.
struct block {
  std::size_t local = 0;
  std::size_t remote = 0;
  std::size_t bytes = 0;
};

/// A printable name for a path ("host-zero-copy", ...).
constexpr const char* to_string(transfer_path p) noexcept {
  switch (p) {
    case transfer_path::none: return "none";
    case transfer_path::host_zero_copy: return "host-zero-copy";
    case transfer_path::host_eager: return "host-eager";
    case transfer_path::staged_pinned: return "staged-pinned";
    case transfer_path::cuda_ipc: return "cuda-ipc";
    case transfer_path::gpudirect_rdma: return "gpudirect-rdma";
    case transfer_path::shared_memory: return "shared-memory";
    case transfer_path::one_sided_rdma: return "one-sided-rdma";
  }
  return "?";
}

/// Counters every endpoint keeps, updated on its scheduler's thread as its
/// operations complete. Transports extend it with their own
/// (`tcp::endpoint_stats`).
struct transfer_stats {
  std::uint64_t sends = 0;           ///< sends completed successfully
  std::uint64_t recvs = 0;           ///< receives completed successfully
  std::uint64_t puts = 0;            ///< puts completed successfully
  std::uint64_t gets = 0;            ///< gets completed successfully
  std::uint64_t failed = 0;          ///< operations that completed with an error
  std::uint64_t bytes_sent = 0;      ///< payload bytes of successful sends and puts
  std::uint64_t bytes_received = 0;  ///< payload bytes of successful receives and gets
  /// Successful operations by the path they took, indexed by `transfer_path`.
  std::array<std::uint64_t, static_cast<std::size_t>(transfer_path::one_sided_rdma) + 1> by_path{};
  /// Successful operations that took path `p`.
  std::uint64_t on_path(transfer_path p) const noexcept { return by_path[static_cast<std::size_t>(p)]; }
};

}  // namespace gdr
