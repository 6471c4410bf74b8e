/// \file
/// The early room of both directions (`early_room`): what this side owes
/// its peer of the room for early messages it granted, and what is left
/// of the room the peer granted this side, with the sends that wait for
/// it. The rules are in the file comment of engine/two_sided.hpp ("Early
/// credits"); the engine's code that spends and grants it is in
/// engine/two_sided.hpp and engine/matching.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include <gdr/protocol/engine/link.hpp>
#include <gdr/protocol/engine/op.hpp>

namespace gdr::detail::proto {

/// Early credits, both ways. Loop thread only.
struct early_room {
  // ---- this side's room, granted to the peer ----
  frame f{};                   ///< this side's credit frame (one at a time)
  std::uint64_t owed_bytes = 0;  ///< taken early bytes not yet granted back
  std::uint64_t owed_msgs = 0;
  std::uint64_t grant_bytes = 1;  ///< what is owed before a credit frame goes (a quarter of the budget)
  std::uint64_t grant_msgs = 1;
  // ---- the peer's room, this side's to use ----
  std::uint64_t send_bytes = 0;
  std::uint64_t send_msgs = 0;
  bool got_first = false;      ///< the peer's first credit came (its handshake is done)
  bool waiter_turn = false;    ///< run_send_waiters is launching the head of send_wait
  std::size_t order_holds = 0;  ///< staged eager sends whose frame is not posted yet (later sends wait)
  op_list send_wait{};         ///< sends waiting for a message slot, in order
};

}  // namespace gdr::detail::proto
