// What happened in one stress run, as the checks (check.hpp) read it: one
// record per operation (what it was, when it started and ended on the
// run's logical clock, what the endpoint said at its start, its report,
// the bytes a receive got) and the side events (close, drop, revoke, kill)
// with their ticks.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <system_error>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/protocol/options.hpp>

#include "tests/stress/memory.hpp"
#include "tests/stress/plan.hpp"

namespace stress {

enum class op_kind : std::uint8_t { send, recv, put, get, close };
inline const char* to_string(op_kind k) noexcept {
  switch (k) {
    case op_kind::send: return "send";
    case op_kind::recv: return "recv";
    case op_kind::put: return "put";
    case op_kind::get: return "get";
    case op_kind::close: return "close";
  }
  return "?";
}

/// The phase of a receive in its stream.
enum class recv_phase : std::uint8_t { main, final, drain };

struct op_record {
  op_kind kind = op_kind::send;
  std::uint8_t side = 0;
  std::uint8_t tag = 0;
  std::uint32_t index = 0;   ///< send: seq; recv: start order in its stream; put/get: plan index
  std::size_t size = 0;      ///< send/put/get: bytes; recv: view size
  space mem = space::host;
  space remote = space::host;  ///< put/get: the peer's window
  std::size_t offset = 0;      ///< put/get: where in that window
  bool fin = false;
  bool bad_key = false;
  recv_phase phase = recv_phase::main;
  stop_plan stop{};
  bool stream_stop = false;  ///< a receive under its stream's stop (after the fin)
  bool stop_fired = false;   ///< its stop source (or the stream's) was stopped before it ended

  block* buf = nullptr;
  std::vector<std::byte> sent;   ///< send/put: the bytes it carried
  std::vector<std::byte> init;   ///< recv/get: its view's bytes before it started

  bool started = false, done = false;
  std::uint64_t start_tick = 0, end_tick = 0;
  std::int64_t start_us = 0, end_us = 0;
  std::error_code state_at_start;  ///< the endpoint's error() when it started
  std::error_code state_at_end;    ///< and when it ended (none if the endpoint was gone)
  gdr::op_report rep{};
  std::vector<std::byte> got;      ///< recv/get: the view at completion
  std::uint64_t end_digest = 0;    ///< the view's digest at completion (late writes)

  std::string name() const {
    switch (kind) {
      case op_kind::send:
      case op_kind::recv:
        return strf("%s#%u side %u tag %u (%zu B %s%s)", to_string(kind), index, side, tag, size, to_string(mem),
                    fin ? ", fin" : "");
      case op_kind::put:
      case op_kind::get:
        return strf("%s#%u side %u (%zu B %s -> peer %s%s)", to_string(kind), index, side, size, to_string(mem),
                    to_string(remote), bad_key ? ", bad key" : "");
      case op_kind::close: return strf("close side %u", side);
    }
    return "?";
  }
};

/// A side's events, on the run's logical clock (0: did not happen).
struct side_events {
  std::uint64_t close_start = 0;
  std::uint64_t close_end = 0;
  std::error_code close_result;
  bool close_aborted = false;   ///< its close ended in timed_out/cancelled (the connection was aborted)
  std::uint64_t drop = 0;       ///< the endpoint object was destroyed
  std::uint64_t revoke[2] = {0, 0};  ///< its put window of [host, device] was revoked
  std::uint64_t killed = 0;     ///< tcp-kill: the process was SIGKILLed
  /// The side ran in another process (tcp-kill): its events are not known
  /// here, so whatever they could cause is allowed.
  bool unknown = false;
};

/// How long a run may take: `bound` in all, and `stall` with something
/// pending and nothing completing (a hang, whatever the machine's load).
struct run_limits {
  std::chrono::milliseconds bound{20000};
  std::chrono::milliseconds stall{3000};
};

struct run_record {
  std::deque<op_record> ops;
  side_events ev[2];
  op_record& add() { return ops.emplace_back(); }
};

}  // namespace stress
