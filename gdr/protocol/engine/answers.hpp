/// \file
/// The bound on what the engine writes on its peer's behalf: the answers it
/// allocates for the peer (`answer_budget`), and, in this comment, the
/// census of every frame the engine makes because the peer asked, with
/// what bounds each.
///
/// Why a bound. A frame the engine makes for the peer waits in the
/// transport until the peer reads; a peer that sends and never reads (a
/// hostile one, or one whose loop does not run) would otherwise make this
/// side keep one frame per request for as long as the connection lasts
/// (2M pairs of `rts` and `rts_cancel` were 413 MB). So every such frame is
/// bounded, and while the bound is reached the engine stops reading that
/// peer (the header pauses, `rx_plan::action::pause`, and is offered again
/// once answers have been written): its requests then wait in its own
/// buffers, held back by the transport's flow control.
///
/// The census: what the engine posts because of a frame of the peer's.
///   * `rts_withdrawn`, the answer to an `rts_cancel` for an announcement
///     kept here, to an `rts` that comes while this side closes, and to the
///     announcements kept when `close()` starts: allocated one by one,
///     counted here (`answer_budget`).
///   * `put_ack`, `get_reply` (puts, gets, atomics served from the
///     registry, refused, or answered `no_memory`): one reply slot each,
///     at most `reply_slots` made plus the spare; a request that finds none
///     pauses the reader (engine/one_sided.hpp, "Reply slots").
///   * `credit`: one frame (`early_room::f`), reused; what is owed
///     meanwhile is a counter.
///   * `rtr`: one per receive posted here (the user's operations).
///   * `data` flagged `withdrawn`, the answer to an `rtr` for a send this
///     side withdrew first: from the announcement's own frame, at most once
///     per announcement (engine/withdrawals.hpp).
///
/// The budget's limit is `unexpected_messages`, which a peer that keeps to
/// its credits never reaches, so it never stops reading such a peer: each
/// `rts_withdrawn` answers an `rts` that spent one of the message credits
/// this side granted, and a peer that has stopped reading gets no credit
/// back; so the answers this side writes after the last frame such a peer
/// read answer announcements sent on credit it held then, at most
/// `unexpected_messages` of them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <new>

#include <gdr/protocol/engine/link.hpp>

namespace gdr::detail::proto {

/// The answers an engine has allocated for its peer and the transport
/// still holds (posted, not yet written).
///
/// Invariant: `held() <= limit() + forced`, where `forced` counts the
/// answers made with `make_owed` (the announcements kept when close()
/// starts, at most `unexpected_messages`); the answers the peer asks for
/// (`make`) are refused once `held() >= limit()`, and the caller then pauses
/// the reader without changing any state. Loop thread only.
class answer_budget {
 public:
  explicit answer_budget(std::size_t limit) noexcept : limit_(std::max<std::size_t>(limit, 1)) {}
  answer_budget(const answer_budget&) = delete;
  answer_budget& operator=(const answer_budget&) = delete;

  /// Room for an answer the peer asks for.
  bool room() const noexcept { return held_ < limit_; }

  /// A fresh answer frame (`own_answer`), counted; null when there is no
  /// room (check `room()` first to pause before changing state) or no
  /// memory.
  frame* make() noexcept { return room() ? alloc() : nullptr; }

  /// The same whatever the room: an answer this side owes for a reason
  /// bounded elsewhere (the announcements kept when close() starts).
  frame* make_owed() noexcept { return alloc(); }

  /// Answer `f` (from make) was written or will never be: freed. True when
  /// that made room again (a reader paused for room may go on).
  bool release(frame& f) noexcept {
    const bool was_full = !room();
    delete &f;
    --held_;
    return was_full && room();
  }

  std::size_t held() const noexcept { return held_; }
  std::size_t limit() const noexcept { return limit_; }
  /// The most answers held at once so far.
  std::size_t most() const noexcept { return most_; }

 private:
  frame* alloc() noexcept {
    auto* f = new (std::nothrow) frame;
    if (f == nullptr) return nullptr;
    f->own_answer = true;
    most_ = std::max(most_, ++held_);
    return f;
  }

  std::size_t limit_;
  std::size_t held_ = 0;
  std::size_t most_ = 0;
};

}  // namespace gdr::detail::proto
