/// \file
/// What this side ended before its peer knew: the peer's late frames for
/// it are recognised here and dropped or answered, never taken for a
/// protocol error, and nothing the peer sends makes them grow.
///
///   * tokens: rendezvous data for receives stopped after their rtr went
///     (the data is dropped when it comes; forgotten with its last segment);
///   * answers: the answers to puts and gets stopped after their request
///     went (dropped when they come);
///   * ranges: the same for a segmented put or get, one range of request
///     ids and how many answers are still to come;
///   * announcements: rendezvous sends that ended here before the peer's
///     rtr reached this side (a stop, a timeout, a failed copy). Such a
///     send is withdrawn at once, whatever the peer does: it has moved no
///     byte. Its `announcement` (below) outlives it and tells the peer: an
///     `rts_cancel`, and, if the peer's receive had matched it already, the
///     answer to that late `rtr` (`data` flagged `withdrawn`: the receive
///     fails with `errc::withdrawn`). It goes once the peer's `rtr` or
///     `rts_withdrawn` has come, the one answer the peer gives an
///     announcement.
///
/// Each entry is made by one of this side's own operations, never by a
/// frame of the peer's, and a late frame takes at most one entry away. The
/// announcements withdrawn are at most the message credits the peer
/// granted (a withdrawn send gives its credit back only when the peer has
/// the rts_cancel; engine/two_sided.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <gdr/protocol/engine/fifo.hpp>
#include <gdr/protocol/engine/link.hpp>

namespace gdr::detail::proto {

class op;

/// A rendezvous send's announcement: its `rts` frame, in the engine's
/// memory rather than the operation's, so that the send may resume while
/// the transport still holds the frame (a peer that does not read may hold
/// it for as long as it likes). Once the send has ended here first, the
/// same frame carries what this side still owes the peer for it: the
/// `rts_cancel`, then the answer to a late `rtr`, one after the other as
/// the frame comes back from the transport. Made when the send is
/// announced; freed once nothing more comes or goes for it.
struct announcement : frame {
  enum class state : std::uint8_t {
    waiting,    ///< its send (`send`) waits for the peer's rtr
    withdrawn,  ///< its send ended here; the peer's rtr or rts_withdrawn is still to come
    over,       ///< nothing more comes: freed once the frame is back (and what is due went)
  };
  /// What the frame carries next, once the transport gives it back.
  enum class due : std::uint8_t { none, cancel, answer };

  announcement() noexcept { own_announcement = true; }

  state st = state::waiting;
  due next = due::none;
  op* send = nullptr;          ///< while waiting
  std::uint64_t id = 0;        ///< the send id the rts names
  std::uint64_t size = 0;      ///< the message's size (an rtr may accept no more)
  std::uint64_t token = 0;     ///< a late rtr's token, for its answer
  announcement* wprev = nullptr;  ///< the withdrawn list
  announcement* wnext = nullptr;
};

/// The peer's late frames for what ended here first (see the file
/// comment). The `remember_*` calls return false when memory is short: the
/// engine then fails the endpoint (a late frame it could not recognise
/// would be a protocol error later). Loop thread only.
class withdrawals {
 public:
  withdrawals() = default;
  withdrawals(const withdrawals&) = delete;
  withdrawals& operator=(const withdrawals&) = delete;
  /// Frees the announcements still listed (the transport holds none of
  /// their frames by then: the engine is freed once it is quiet).
  ~withdrawals() {
    while (announcement* a = withdrawn_.pop_front()) delete a;
  }

  // ---- rendezvous data for stopped receives ----
  bool remember_token(std::uint64_t token) noexcept { return push(tokens_, token); }
  bool forget_token(std::uint64_t token) noexcept { return erase(tokens_, token); }
  bool has_token(std::uint64_t token) const noexcept {
    return std::find(tokens_.begin(), tokens_.end(), token) != tokens_.end();
  }

  // ---- answers to stopped puts and gets ----
  bool remember_answer(std::uint64_t id) noexcept { return push(answers_, id); }
  bool forget_answer(std::uint64_t id) noexcept { return erase(answers_, id); }

  /// A segmented put or get: `left` answers to come for ids [lo, hi).
  bool remember_range(std::uint64_t lo, std::uint64_t hi, std::uint64_t left) noexcept {
    try {
      ranges_.push_back({lo, hi, left});
      return true;
    } catch (...) {
      return false;
    }
  }
  /// One answer for an id of a remembered range came (or will never).
  bool forget_in_range(std::uint64_t id) noexcept {
    for (auto it = ranges_.begin(); it != ranges_.end(); ++it) {
      if (id < it->lo || id >= it->hi) continue;
      if (--it->left == 0) ranges_.erase(it);
      return true;
    }
    return false;
  }

  // ---- withdrawn announcements ----
  void add(announcement& a) noexcept { withdrawn_.push_back(&a); }
  /// The withdrawn announcement of send `id` (null: none).
  announcement* find(std::uint64_t id) const noexcept {
    for (announcement* a = withdrawn_.head; a != nullptr; a = a->wnext)
      if (a->id == id) return a;
    return nullptr;
  }
  void erase(announcement& a) noexcept { withdrawn_.erase(&a); }
  /// The withdrawn announcements, oldest first (the endpoint failed: each
  /// is taken off, then freed or left to its frame's return).
  announcement* pop() noexcept { return withdrawn_.pop_front(); }
  std::size_t announcements() const noexcept { return withdrawn_.size; }

  /// The endpoint failed: nothing late comes any more. (Announcements are
  /// the engine's to free, through pop().)
  void clear_ids() noexcept {
    tokens_.clear();
    answers_.clear();
    ranges_.clear();
  }

 private:
  struct range {
    std::uint64_t lo, hi, left;
  };
  static bool push(std::vector<std::uint64_t>& v, std::uint64_t id) noexcept {
    try {
      v.push_back(id);
      return true;
    } catch (...) {
      return false;
    }
  }
  static bool erase(std::vector<std::uint64_t>& v, std::uint64_t id) noexcept {
    auto it = std::find(v.begin(), v.end(), id);
    if (it == v.end()) return false;
    v.erase(it);
    return true;
  }

  std::vector<std::uint64_t> tokens_;
  std::vector<std::uint64_t> answers_;
  std::vector<range> ranges_;
  fifo<announcement, &announcement::wprev, &announcement::wnext> withdrawn_{};
};

}  // namespace gdr::detail::proto
