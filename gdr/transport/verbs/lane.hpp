/// \file
/// The one-sided lane's types (rma.hpp has the lane itself): its phases and
/// the one table of their moves, a job (one direct operation with the NIC),
/// a notification receive, and a waiter for a notification.
#pragma once

#include <infiniband/verbs.h>

#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <system_error>
#include <vector>

#include <gdr/log.hpp>
#include <gdr/protocol/engine.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/verbs/completion.hpp>
#include <gdr/transport/verbs/memory.hpp>

namespace gdr::detail::verbs {

class connection;

enum class lane_phase : std::uint8_t {
  off,        // not connected (not made, or the peer has none)
  ready,      // work requests may be posted
  broken,     // a fault: waiting for every work request to come back
  resetting,  // this side's queue pair reset, the peer asked to reset its target
  shut,       // the connection ended, or the lane could not go on
};
/// Lane control messages due (`connection::lane_ctl_due_`).
inline constexpr std::uint8_t lane_ctl_reset = 1;  // ask the peer to reset its target
inline constexpr std::uint8_t lane_ctl_ready = 2;  // tell the peer its target here is reset
inline constexpr std::size_t lane_small = 256;                      // gets up to this land in the scratch
inline constexpr std::size_t lane_piece_max = std::size_t{1} << 30;  // bytes per work request at most
/// Where in the peer's registered memory: address and NIC key.
struct lane_target {
  std::uint64_t addr = 0;
  std::uint32_t rkey = 0;
  std::uint32_t bytes = 0;  // 0: none
};
struct lane_job : gdr::verbs::work {
  connection* c = nullptr;
  proto::op* o = nullptr;
  gdr::verbs::registration_hold hold{};  // the local memory's registration, if the job made one
  std::uint32_t lkey = 0;  // of the local memory (unless inline)
  std::size_t pieces = 0;  // work requests in all
  std::size_t posted = 0;  // ... posted (after a reset: from the first not done)
  std::size_t done = 0;    // ... completed successfully (a prefix)
  std::size_t out = 0;     // ... in flight (posted, not accounted for)
  std::size_t failed = 0;  // ... of them that came back in error or flushed (the lane broke)
  /// The piece ends (index + 1) of its signalled work requests in flight,
  /// in order: a successful completion accounts for every piece up to its
  /// end (the unsignalled ones before it completed too).
  std::vector<std::size_t> ends;
  std::size_t ends_head = 0;
  std::size_t ends_used = 0;
  std::error_code ec{};
  bool bounce = false;     // lands in `scratch` (a small get, an atomic)
  bool inl = false;        // a small put: its bytes go inline in the work request
  bool faulted = false;    // refused by the peer's NIC: fails once the lane is back (or with the connection)
  /// The peer's GPU memory is flushed: a READ of `flush_at` (`flush_bytes`
  /// bytes, into `scratch`) after the job's WRITEs; a notifying put then
  /// sends its notification last, fenced behind the READ.
  std::size_t data_pieces = 0;  // pieces that move the operation's bytes
  bool flush_read = false;
  std::uint32_t flush_bytes = 0;
  lane_target flush_at{};
  lane_job* next_free = nullptr;
  lane_job* prev = nullptr;
  lane_job* next = nullptr;
  alignas(64) std::byte scratch[lane_small];
};
struct lane_rx : gdr::verbs::work {
  connection* c = nullptr;
};
/// The lane's marker: one work request posted to a queue pair in the error
/// state after a fault or at the end. Its (flushed) completion comes after
/// every earlier work request's, so when it arrives nothing of the lane is
/// with the NIC any more, signalled or not.
struct lane_marker : gdr::verbs::work {
  connection* c = nullptr;
  bool posted = false;
};
struct lane_piece {
  std::size_t local, remote, bytes;
};
/// The lane's queue pairs' device events: a fault of the lane is handled
/// by its completions and the reset, never by failing the connection.
struct lane_event_sink final : gdr::verbs::qp_event_sink {
  connection* c = nullptr;
  void on_qp_event(ibv_event_type type) noexcept override {
    gdr::detail::log("verbs", "one-sided queue pair event: %s", ibv_event_type_str(type));
  }
  void on_tick() noexcept override {}
};


/// Awaits the peer's next notifying put (rma.hpp): its value, or the
/// connection's error.
struct note_waiter : remote_work {
  connection* c = nullptr;
  std::coroutine_handle<> h{};
  std::uint32_t value = 0;
  std::error_code ec{};
  bool queued = false;
  note_waiter* next = nullptr;
};

/// The one place that says how the lane moves between phases.
constexpr bool lane_may_move(lane_phase from, lane_phase to) noexcept {
  switch (to) {
    case lane_phase::ready: return from == lane_phase::off || from == lane_phase::resetting;
    case lane_phase::broken: return from == lane_phase::ready;
    case lane_phase::resetting: return from == lane_phase::broken;
    case lane_phase::shut: return true;
    case lane_phase::off: return false;
  }
  return false;
}

}  // namespace gdr::detail::verbs
