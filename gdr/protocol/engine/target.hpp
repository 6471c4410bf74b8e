/// \file
/// What a payload being placed is for (`placement`): the engine's record of
/// the one placement the transport makes at a time (the current one), of a
/// placement stopped while the kernel still wrote into its memory, and of
/// the placements a transport completes later (deferred).
#pragma once

#include <cstddef>
#include <cstdint>

namespace gdr::detail::proto {

class op;
struct early_msg;
struct reply_slot;
struct stage_slot;

/// The owner of a placement and what its bytes do once in place.
struct placement {
  enum kind_t : std::uint8_t {
    none,        ///< nothing is being placed
    op_payload,  ///< into an operation's own memory (`o`): a receive, a get's answer
    store,       ///< into a kept early message (`m`)
    serve_put,   ///< the peer's put (or an atomic's operands) into registered memory, answered from `s`
    discard,     ///< dropped
    stage_rx,    ///< into a bounce buffer (`b`), copied to the device next
    via_host,    ///< an eager message for a Device receive (`o`), through host memory (`m`)
  } kind = none;
  op* o = nullptr;
  early_msg* m = nullptr;
  reply_slot* s = nullptr;
  stage_slot* b = nullptr;  // stage_rx: the bounce buffer
  std::uint64_t id = 0;     // serve_put: the request id
  std::size_t want = 0;
  bool counted = false;  // op_payload: one segment of several
};

}  // namespace gdr::detail::proto
