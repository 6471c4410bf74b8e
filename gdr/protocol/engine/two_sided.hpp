/// \file
/// Sends: eager and rendezvous (rts, rtr, data), a send's stop (withdrawn
/// here at once: the announcement that outlives it sends rts_cancel and
/// answers a late rtr, engine/withdrawals.hpp), the peer's rts_withdrawn,
/// and the eager limits of a send and a receive.
///
/// Early credits. The room each side keeps for early messages (eager
/// bytes and announcements no receive has taken yet: `unexpected_bytes`,
/// `unexpected_messages`) is granted to the peer in advance: a `credit`
/// frame right after the hello, then more as messages are taken. A sender
/// spends a message slot on every message and the bytes of an eager one;
/// short of bytes it announces the message instead (rendezvous), short of
/// slots it waits, in order, on its own side (room_.send_wait). The receiver
/// gives credit back in batches of a quarter of its room. So the store
/// never fills while the reader keeps reading: the data of receives that
/// already matched always gets through. A rendezvous send withdrawn here
/// after its rts went gets its slot back only from the peer (which holds
/// the rts until it reads the rts_cancel): never refunded here, so the
/// announcements this side has withdrawn and the peer not yet answered
/// stay within the peer's room.
#pragma once

#include <algorithm>
#include <atomic>
#include <cassert>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include <gdr/protocol/engine/engine.hpp>

namespace gdr::detail::proto {

inline bool engine::begin_out(op& o) noexcept {
  if (std::error_code ec = state_error()) {
    o.ec_ = ec;
    return false;
  }
  if (!spaces_allowed(o)) return false;
  if (o.batch_ != nullptr) {
    // Every block inside both views (overflow-safe), checked here before
    // anything is posted; the peer's NIC checks the rest.
    for (std::size_t i = 0; i < o.nbatch_; ++i) {
      const block& b = o.batch_[i];
      if (b.bytes > o.size_ || b.local > o.size_ - b.bytes || b.bytes > o.rsize_ || b.remote > o.rsize_ - b.bytes) {
        o.ec_ = errc::invalid_argument;
        o.what_ = "a block of the batch lies outside the local or the remote view";
        return false;
      }
    }
  } else if (o.kind_ != op::kind::send && o.size_ > o.rsize_) {
    o.ec_ = errc::invalid_argument;  // the local view must fit in the remote one
    return false;
  }
  if (o.atomic_ != 0 && (o.raddr_ % sizeof(std::uint64_t) != 0 || o.size_ != sizeof(std::uint64_t))) {
    o.ec_ = errc::invalid_argument;
    o.what_ = "a remote atomic works on one 8-byte word whose remote address is a multiple of 8";
    return false;
  }
  if (o.size_ > opts_.max_message && o.kind_ == op::kind::get) {
    o.ec_ = errc::message_too_large;  // the answer would exceed our own limit
    return false;
  }
  if (!room_.got_first) {  // the peer's handshake: its hello and first credit
    o.to(op::stage::held);
    enlist(held_, o);
    return true;
  }
  return launch(o);
}

inline bool engine::launch(op& o) noexcept {
  if (o.size_ > peer_max_) {
    o.ec_ = errc::message_too_large;
    return false;
  }
  if (o.kind_ != op::kind::send && o.staged()) return launch_segmented(o);
  frame& f = o.f1_;
  f.owner = &o;
  header& h = f.hdr;
  switch (o.kind_) {
    case op::kind::send: {
      // Early credits: every message takes a slot of the peer's room for
      // early messages, an eager one its bytes too; without the bytes it
      // is announced instead, without a slot it waits (in order).
      if ((!room_.send_wait.empty() && !room_.waiter_turn) || room_.send_msgs == 0 || room_.order_holds != 0) {
        o.to(op::stage::held);
        enlist(room_.send_wait, o);
        return true;
      }
      const bool eager = o.size_ <= eager_limit(o) && o.size_ <= room_.send_bytes;
      announcement* a = nullptr;
      if (!eager && (a = new (std::nothrow) announcement) == nullptr) {
        o.ec_ = errno_code(ENOMEM);
        return false;
      }
      --room_.send_msgs;
      o.debit_ = eager ? o.size_ : 0;
      o.debited_ = true;
      room_.send_bytes -= o.debit_;
      if (eager) {
        if (o.dev_ >= 0 && o.size_ != 0) return launch_staged_eager(o);
        o.proto_ = wire_protocol::eager;
        h.type = msg::eager;
        h.length = o.size_;
        h.tag = o.tag_;
        f.payload = o.data_;
        f.mark_nic(o.nic_dev_, o.nic_dev_ >= 0);  // GPUDirect: only an empty one
        // The fast path (UCX's eager short): outside any event, nothing in
        // the outbox, no other resumed coroutine about to post behind it
        // (theirs would share one write) and no close under way, the
        // transport may post it whole at once and copy it; then the send
        // is done here (begin reports it: it never suspends, no frame
        // stays with the link).
        if (send_now_ && link_calls_now() && outbox_head_ == nullptr && ready_head_ == nullptr && !closing_ &&
            link_send_now(f)) {
          o.bytes_ = o.size_;
          o.path_ = link_tx_path();
          return false;  // ec_ clear: done
        }
        o.to(op::stage::queued);
      } else {
        // The rts goes from the engine's memory (withdrawals.hpp): a stop
        // ends the send at once, whoever holds the frame then.
        o.proto_ = wire_protocol::rendezvous;
        o.id_ = next_id_++;
        a->send = &o;
        a->id = o.id_;
        a->size = o.size_;
        a->hdr.type = msg::rts;
        a->hdr.size = o.size_;
        a->hdr.tag = o.tag_;
        a->hdr.id = o.id_;
        o.ann_ = a;
        o.to(op::stage::announced);
        enlist(announced_, o);
        post(*a);
        if (o.dev_ >= 0) {
          // Copy the first chunks out while the announcement travels.
          o.seg_ = own_segment();
          o.total_ = o.size_;
          pump(o);
        }
        return true;
      }
      break;
    }
    case op::kind::put:
    case op::kind::get: {
      // A view the peer's NIC serves: this side's NIC moves it. (Not an
      // empty put or get: a NIC checks no key for zero bytes, the owner
      // does, so a wrong key is refused either way.)
      if (direct_domain_ != 0 && !o.staged() &&
          (o.flush_ || (o.nic_key(direct_domain_) != 0 && (o.size_ != 0 || o.batch_ != nullptr))))
        return launch_direct(o);
      if (o.flush_) return false;  // nothing of this side's is in flight without the peer knowing it
      if (o.batch_ != nullptr || o.notifies()) {
        o.ec_ = errc::unsupported;
        o.what_ = o.batch_ != nullptr
                      ? "a batch needs a remote view this endpoint's NIC reaches (memory a verbs peer exposed)"
                      : "a notifying put needs a remote view this endpoint's NIC reaches (memory a verbs peer exposed)";
        return false;
      }
      if (o.atomic_ != 0 && (peer_caps_ & caps::atomics) == 0) {
        o.ec_ = errc::unsupported;
        o.what_ = "the peer's gdr serves no remote atomics (an older version)";
        return false;
      }
      if (credits_ == 0) {
        // The peer's reply slots are all spoken for: wait for an answer
        // (the reader never stops for this; see "Credits").
        o.to(op::stage::held);
        enlist(credit_wait_, o);
        return true;
      }
      --credits_;
      bool put = o.kind_ == op::kind::put;
      o.id_ = next_id_++;
      h.type = put ? msg::put_request : msg::get_request;
      h.id = o.id_;
      h.addr = o.raddr_;
      h.key = o.rkey_;
      if (put) {
        h.length = o.size_;
        f.payload = o.data_;
      } else if (o.atomic_ != 0) {
        // The operands travel; the old value comes back as a get's answer.
        h.type = msg::atomic_request;
        h.tag = o.atomic_;
        h.size = o.size_;
        h.length = sizeof o.atomic_args_;
        f.payload = reinterpret_cast<const std::byte*>(o.atomic_args_);
      } else {
        h.size = o.size_;
      }
      f.mark_nic(o.nic_dev_, o.nic_dev_ >= 0 || o.remote_nic_);
      // Awaiting its answer from now on: the answer may be parsed before
      // the write's own completion is.
      o.to(op::stage::awaiting);
      enlist(rma_, o);
      break;
    }
    default: break;
  }
  post(f);
  return true;
}

inline void engine::cancel_send(op& o, std::error_code why) noexcept {
  switch (o.stage_) {
    case op::stage::held:
      complete(o, why);  // takes it off held_
      return;
    case op::stage::queued:  // eager
      // Staged eager (launch_staged_eager: its frame is a bounce slot's)
      // or plain (f1_, an empty Device message too): what launch chose,
      // read from the op, not decided again from its memory space.
      if (o.segmented()) {
        stage_slot* b = o.sq_head_;
        if (b != nullptr && b->posted) {
          if (!withdraw(b->f)) return;  // committed: it completes when written
          b->f.queued = false;
          b->posted = false;
        }
        refund(o);  // the peer never sees it
        complete(o, why);  // a copy still running holds the finish back
        return;
      }
      if (withdraw(o.f1_)) {
        o.f1_.queued = false;
        refund(o);
        complete(o, why);
      }
      // else committed: it completes when written.
      return;
    case op::stage::announced:
      // No rtr has come, so no byte has moved: withdrawn at once, whatever
      // the peer does (end_announcement tells it).
      complete(o, why);
      return;
    default: return;  // committed (sending)
  }
}

inline void engine::end_announcement(op& s) noexcept {
  announcement* a = std::exchange(s.ann_, nullptr);
  if (a == nullptr) return;
  a->send = nullptr;
  if (error_) {
    // Nothing more comes or goes.
    a->st = announcement::state::over;
    if (!held_by_link(*a)) delete a;
    return;
  }
  ++stats_->withdrawn;
  if (held_by_link(*a) && (a->in_outbox || link_calls_now()) && withdraw(*a)) {
    // The rts never left: the peer never sees it.
    a->queued = false;
    refund(s);
    delete a;
    return;
  }
  // The peer has the rts, or will: it learns from an rts_cancel (behind the
  // rts) and gives the message credit back then. Its answer, an
  // rts_withdrawn or an rtr that was already on its way, ends the record.
  a->st = announcement::state::withdrawn;
  withdrawals_.add(*a);
  post_announcement(*a, announcement::due::cancel);
}

inline void engine::take_announcement(op& s) noexcept {
  announcement* a = std::exchange(s.ann_, nullptr);
  a->send = nullptr;
  a->st = announcement::state::over;
  if (!held_by_link(*a)) delete a;  // else when the transport gives it back
}

inline void engine::post_announcement(announcement& a, announcement::due what) noexcept {
  if (held_by_link(a)) {
    a.next = what;  // after what the frame carries now, once it is back
    return;
  }
  a.next = announcement::due::none;
  a.reset(nullptr);
  if (what == announcement::due::cancel) {
    a.hdr.type = msg::rts_cancel;
    a.hdr.id = a.id;
  } else {
    // The answer to a late rtr: nothing comes for that receive.
    a.hdr.type = msg::data;
    a.hdr.flags = flag::last | flag::withdrawn;
    a.hdr.addr = a.token;
  }
  post(a);
}

inline void engine::announcement_sent(announcement& a, std::error_code ec) noexcept {
  if (a.st == announcement::state::waiting) {
    if (ec) complete(*a.send, failure_of(ec));  // its rts never went
    return;
  }
  // What is due goes, unless the connection ended (an error, or this
  // side's close frame went first: the peer fails what waits for it).
  if (!ec && !error_ && a.next != announcement::due::none) {
    post_announcement(a, a.next);
    return;
  }
  a.next = announcement::due::none;
  if (a.st == announcement::state::over) delete &a;
}

inline rx_plan engine::rx_rtr(const header& h) noexcept {
  op* s = announced_.head;
  while (s != nullptr && s->id_ != h.id) s = s->next_;
  if (s == nullptr) {
    // A send withdrawn here before this rtr came: its receive learns that
    // no byte comes (once; a second rtr for it is not one of ours).
    announcement* a = withdrawals_.find(h.id);
    if (a == nullptr || h.size > a->size) return fail_plan();
    withdrawals_.erase(*a);
    ++stats_->late_rtrs;
    a->st = announcement::state::over;
    a->token = h.addr;
    post_announcement(*a, announcement::due::answer);  // (an rts_cancel not yet out is moot: it matched)
    return consumed();
  }
  if (h.size > s->size_) return fail_plan();  // more than the message
  if (s->nic_dev_ >= 0 && h.key != 0) return fail_plan();  // a staging peer: the ends disagree
  take_announcement(*s);  // committed now: nothing can withdraw it any more
  if (s->dev_ >= 0 || h.key != 0) return rtr_segmented(*s, h);
  delist(*s);
  s->to(op::stage::sending);
  ++rendezvous_out_;
  frame& f = s->f2_;
  f.reset(s);
  f.hdr.type = msg::data;
  f.hdr.flags = flag::last;
  f.hdr.length = h.size;
  f.hdr.addr = h.addr;
  f.payload = s->data_;
  f.mark_nic(s->nic_dev_, s->nic_dev_ >= 0);
  post(f);
  return consumed();
}

inline rx_plan engine::rx_data(const header& h) noexcept {
  std::uint64_t token = h.addr;
  bool last = (h.flags & flag::last) != 0;
  for (op* r = awaiting_data_.head; r != nullptr; r = r->next_) {
    if (r->id_ != token) continue;
    if ((h.flags & flag::withdrawn) != 0) {
      // Its sender withdrew the message before this rtr reached it: no
      // byte comes, and none has (valid() checked the frame is empty).
      if (r->issued_ != 0) return fail_plan();
      repost_recv(*r);
      return consumed();
    }
    auto len = static_cast<std::size_t>(h.length);
    auto off = static_cast<std::size_t>(h.size);
    // Segments come in order, cover exactly what was accepted, and the
    // last one says so.
    if (off != r->issued_ || len > r->total_ - off || last != (off + len == r->total_))
      return fail_plan();
    if (r->dev_ >= 0 && len != 0) {
      if (len > chunk_) return fail_plan();  // larger than the rtr allowed
      stage_slot* b = take(rx_);
      if (b == nullptr) return pause_reading();
      r->issued_ += len;
      if (last) {
        delist(*r);
        r->to(op::stage::placing);
      }
      return place_in_bounce(*r, *b, off, len, 0);
    }
    r->issued_ += len;
    if (last) {
      delist(*r);
      r->to(op::stage::placing);
    }
    r->placing_ = true;
    if (off == 0 && last && r->done_ == 0 && r->dev_ < 0) {
      return place({target::op_payload, r}, r->data_, len, 0, r->nic_dev_);  // the whole message in one frame
    }
    target t{target::op_payload, r};
    t.counted = true;
    return place(t, r->data_ + off, len, 0, r->nic_dev_);
  }
  if (last ? withdrawals_.forget_token(token) : withdrawals_.has_token(token)) return drop(h.length);  // its receive was cancelled
  return fail_plan();
}

inline rx_plan engine::rx_rts_cancel(const header& h) noexcept {
  for (early_msg* m = early_.head; m != nullptr; m = m->next) {
    if (!m->rts || m->sid != h.id) continue;
    // Its answer waits for room (engine/answers.hpp): a peer that sends
    // and never reads is not read either.
    if (!answers_.room()) return pause_reading();
    early_.erase(m);
    delete m;
    owe(0);
    answer_withdrawn(h.id);
    return consumed();
  }
  // Already matched: the rtr on its way answers the sender.
  return consumed();
}

inline void engine::answer_withdrawn(std::uint64_t id, bool owed) noexcept {
  frame* f = owed ? answers_.make_owed() : answers_.make();
  if (f == nullptr) {
    fail(errno_code(ENOMEM));  // (the caller checked the room: no memory)
    return;
  }
  stats_->answers_most = answers_.most();
  f->hdr.type = msg::rts_withdrawn;
  f->hdr.id = id;
  post(*f);
}

inline rx_plan engine::rx_rts_withdrawn(const header& h) noexcept {
  op* s = announced_.head;
  while (s != nullptr && s->id_ != h.id) s = s->next_;
  if (s == nullptr) {
    // The answer to the rts_cancel of a send withdrawn here.
    announcement* a = withdrawals_.find(h.id);
    if (a == nullptr) return fail_plan();
    withdrawals_.erase(*a);
    a->st = announcement::state::over;
    a->next = announcement::due::none;  // (an rts_cancel not yet out is moot)
    if (!held_by_link(*a)) delete a;
    return consumed();
  }
  // Unasked: the peer closed without receiving it. Closing here too, it
  // fails as this side's pending operations do.
  ++stats_->withdrawn;
  take_announcement(*s);
  complete(*s, closing_ ? errc::closed : errc::peer_closed);
  return consumed();
}

inline bool engine::refuses_eager(op& r, std::size_t len) noexcept {
  if (r.nic_dev_ < 0 || std::min(len, r.size_) == 0) return false;
  r.what_ = "a Device receive on a direct endpoint (GPUDirect, CUDA IPC) takes only messages moved straight into "
            "it (rendezvous, above the sender's rendezvous_threshold, or any send from Device memory); this "
            "message came eager, through host memory, and stays receivable into host memory";
  return true;
}

inline std::size_t engine::eager_limit(const op& o) const noexcept {
  if (o.nic_dev_ >= 0) return 0;  // GPUDirect: the CPU never reads it into a frame
  std::size_t e = opts_.rendezvous_threshold;
  if (o.dev_ >= 0) e = std::min(e, chunk_);
  return e;
}

}  // namespace gdr::detail::proto
