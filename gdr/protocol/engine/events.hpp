/// \file
/// The engine's side of a transport's events: a header arrived, a payload
/// is in place, a frame is written; and the engine's calls to the
/// transport, queued in the outbox and the end-of-event lists so that
/// nothing done inside a transport's event calls back into it (the
/// re-entrancy rule in gdr/protocol/engine.hpp).
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

inline void engine::leave() noexcept {
  if (busy_ != 1) {
    resume_ready();  // inside an outer event: what they do is queued
  } else {
    // The end of the outermost event: the transport walks none of its
    // lists, so what the event queued is handed over first (drain), and
    // then what the resumed coroutines do goes to the transport at once,
    // after it and in order (draining_ makes link calls allowed).
    for (;;) {
      drain();
      if (ready_head_ != nullptr) {
        draining_ = true;
        resume_ready();
        draining_ = false;
        continue;
      }
      if (run_deferred()) continue;
      if (link_flush()) continue;
      break;
    }
  }
  if (--busy_ == 0 && abandoned_ && deletable()) destroy();
}

inline void engine::resume_ready() noexcept {
  while (op* o = ready_head_) {
    ready_head_ = o->ready_next_;
    if (ready_head_ == nullptr) ready_tail_ = nullptr;
    --attached_;
    o->waiter_.resume();  // may start ops, or destroy the endpoint
  }
}

inline rx_plan engine::on_header(const header& h) noexcept {
  assert(valid(h, opts_.max_message) && "gdr protocol: the transport passed an unchecked header");
  if (!got_hello_ && h.type != msg::hello) return fail_plan();  // hello comes first
  switch (h.type) {
    case msg::hello: return rx_hello(h);
    case msg::eager: return rx_eager(h);
    case msg::rts: return rx_rts(h);
    case msg::rtr: return rx_rtr(h);
    case msg::data: return rx_data(h);
    case msg::rts_cancel: return rx_rts_cancel(h);
    case msg::rts_withdrawn: return rx_rts_withdrawn(h);
    case msg::put_request: return rx_put_request(h);
    case msg::get_request: return rx_get_request(h);
    case msg::atomic_request: return rx_atomic_request(h);
    case msg::put_ack:
    case msg::get_reply: return rx_answer(h);
    case msg::credit: return rx_credit(h);
    case msg::close:
      // The peer sends nothing more. Kept early messages stay receivable;
      // everything else fails, and this side ends the connection in
      // order too (what it still had in flight may follow the peer's
      // close frame; a reset would throw it away with the peer's last
      // bytes).
      fail(errc::peer_closed, true);
      return consumed();
  }
  return fail_plan();
}

inline void engine::on_placed(bool direct) noexcept {
  const target t = cur_;
  cur_.kind = target::none;  // (what reads cur_ looks at its kind first)
  placed(t, direct);
}

inline std::uint32_t engine::defer_placement() noexcept {
  // Only a placement whose completion no later frame's handling depends
  // on: the whole payload of one operation (matched when its header came),
  // or a put served into exposed memory (its ack goes when it is done).
  // Kept messages, bounce buffers and segments wait for theirs.
  const bool whole_op = cur_.kind == target::op_payload && !cur_.counted;
  const bool put = cur_.kind == target::serve_put && cur_.s->atomic == 0;
  if (!whole_op && !put) return 0;
  try {
    deferred_.reserve(deferred_.size() + 1);
  } catch (...) {
    return 0;  // placed in turn instead
  }
  std::uint32_t ticket = next_ticket_++;
  if (ticket == 0) ticket = next_ticket_++;
  deferred_.emplace_back(ticket, std::exchange(cur_, target{}));
  return ticket;
}

inline void engine::on_deferred_placed(std::uint32_t ticket, bool ok, bool direct) noexcept {
  auto it = std::find_if(deferred_.begin(), deferred_.end(), [&](const auto& d) { return d.first == ticket; });
  assert(it != deferred_.end() && "gdr: on_deferred_placed for a ticket the engine did not give");
  if (it == deferred_.end()) return;
  const target t = it->second;
  deferred_.erase(it);
  assert((ok || error_) && "gdr: a deferred placement failed before its connection did");
  // A failed endpoint answers nothing: the memory is free, no more.
  if (ok && !error_) placed(t, direct);
  else release_target(t);
}

inline void engine::placed(const target& t, bool direct) noexcept {
  switch (t.kind) {
    case target::none:
    case target::discard: return;
    case target::op_payload: {
      op& o = *t.o;
      o.placing_ = false;
      if (t.counted) {
        // One segment of several, straight into the operation's memory.
        o.done_ += t.want;
        if (!o.result_set_ && o.done_ == o.total_) finish_counted(o, direct);
        else try_finish(o);
        if (o.kind_ == op::kind::get && !o.result_set_) pump(o);
        return;
      }
      if (!o.result_set_) {
        o.bytes_ = t.want;
        if (o.path_ == transfer_path::none) o.path_ = link_rx_path(direct);
        complete(o, o.ec_);  // errc::truncated was noted when the message began
      } else {
        try_finish(o);
      }
      return;
    }
    case target::store: {
      early_msg* m = t.m;
      ++stats_->unexpected;
      // A receive may have been posted while the bytes were placed.
      if (op* r = recv_for_eager(m->tag, m->size)) {
        take_recv(*r);
        owe(m->size);
        if (r->dev_ >= 0 && std::min<std::size_t>(m->size, r->size_) != 0) {
          // Device memory: through bounce buffers, never a CPU copy.
          deliver_early_staged(*r, m);
          return;
        }
        std::error_code ec = deliver_early(*r, *m);
        complete(*r, ec);
        delete m;
      } else if (closing_) {
        // Receiving ended while its bytes were placed: dropped, and its
        // room granted back (the peer may still be sending).
        owe(m->size);
        delete m;
      } else {
        early_.push_back(m);
        early_bytes_ += m->size;
      }
      return;
    }
    case target::serve_put: {
      reply_slot* s = t.s;
      if (s->atomic != 0) {
        serve_atomic(*s, t.id);
        return;
      }
      s->lease.release();
      ++stats_->served_puts;
      send_answer(s, msg::put_ack, t.id, status::ok, nullptr, 0);
      return;
    }
    case target::stage_rx: placed_in_bounce(*t.b); return;
    case target::via_host: {
      op& o = *t.o;
      o.placing_ = false;
      if (o.result_set_) {
        delete t.m;
        try_finish(o);
        return;
      }
      deliver_early_staged(o, t.m);
      return;
    }
  }
}

inline void engine::on_sent(frame& f, std::error_code ec) noexcept {
  f.queued = false;
  if (f.sslot != nullptr) {
    segment_sent(*f.sslot, ec);
    return;
  }
  if (f.slot != nullptr) {
    free_slot(f.slot);
    return;
  }
  if (f.own_answer) {
    if (answers_.release(f)) resume_reading();  // a reader paused for room may go on
    return;
  }
  if (f.own_announcement) {
    announcement_sent(static_cast<announcement&>(f), ec);
    return;
  }
  if (&f == &room_.f) {
    if (!ec) maybe_grant();  // what was owed meanwhile
    return;
  }
  if (&f == &hello_) return;
  op& o = *f.owner;
  if (ec) {
    if (o.kind_ == op::kind::close) {
      // Nothing left to flush: closing a failed endpoint succeeds.
      complete(o, {});
    } else {
      complete(o, failure_of(ec));
    }
    try_finish(o);
    return;
  }
  switch (o.kind_) {
    case op::kind::send:
      if (&f == &o.f1_ && o.proto_ == wire_protocol::eager) {
        o.bytes_ = o.size_;
        o.path_ = link_tx_path();
        complete(o, {});
      } else if (&f == &o.f2_ && o.stage_ == op::stage::sending) {
        // The whole message was taken by its receive (which may have
        // accepted fewer bytes: truncated there, delivered here).
        o.bytes_ = o.size_;
        o.path_ = link_tx_path();
        complete(o, {});
      }
      break;
    case op::kind::put:
    case op::kind::get:
      // The request is out; the answer completes it. A stop that came
      // while it was written completes it now. A put's path is its
      // request's (payload copied or not), known now.
      if (!o.result_set_ && o.kind_ == op::kind::put && &f == &o.f1_) o.path_ = link_tx_path();
      if (!o.result_set_ && o.stop_reason_) complete(o, o.stop_reason_);
      break;
    case op::kind::recv: break;  // its rtr
    case op::kind::close:
      // Everything before the close frame is out: fail what is still
      // pending with errc::closed; the transport ends the connection in
      // order, and the close completes when it has (settle_close), or
      // when its timeout aborts it.
      fail(errc::closed, true);
      break;
  }
  try_finish(o);
}

inline void engine::enlist(op_list& l, op& o, bool front) noexcept {
  assert(o.list_ == nullptr && "gdr: an operation put on a second list");
  if (front) l.push_front(&o);
  else l.push_back(&o);
  o.list_ = &l;
}

inline void engine::delist(op& o) noexcept {
  if (o.list_ == nullptr) return;
  o.list_->erase(&o);
  o.list_ = nullptr;
}

inline void engine::post(frame& f) noexcept {
  // Nothing follows the close frame (see "Close" in gdr/protocol/engine.hpp):
  // a frame posted after it goes back through the outbox unsent.
  const bool after_close = close_posted_ && f.hdr.type != msg::close;
  if (link_calls_now() && !after_close) {
    link_post(f);
    return;
  }
  assert(!f.in_outbox);
  f.after_close = after_close;
  if (after_close && busy_ == 0) post_resume();  // returned from the loop, never from inside the caller
  f.in_outbox = true;
  f.out_next = nullptr;
  (outbox_tail_ ? outbox_tail_->out_next : outbox_head_) = &f;
  outbox_tail_ = &f;
  due();
}

inline bool engine::withdraw(frame& f) noexcept {
  if (f.in_outbox) {
    frame* prev = nullptr;
    for (frame* x = outbox_head_; x != &f; x = x->out_next) prev = x;
    (prev ? prev->out_next : outbox_head_) = f.out_next;
    if (outbox_tail_ == &f) outbox_tail_ = prev;
    f.in_outbox = false;
    f.after_close = false;
    f.out_next = nullptr;
    return true;
  }
  assert(link_calls_now() && "gdr: the engine withdrew a frame from inside a transport event");
  return link_withdraw(f);
}

inline void engine::request_abort() noexcept {
  if (link_calls_now()) {
    abort_current();
  } else {
    abort_due_ = true;
    due();
  }
}

inline bool engine::current_target_dead() const noexcept {
  switch (cur_.kind) {
    case target::op_payload:
    case target::via_host: return cur_.o->result_set_;
    case target::stage_rx: return cur_.b->owner != nullptr ? cur_.b->owner->result_set_ : failed();
    case target::store:
    case target::serve_put: return failed();
    default: return false;
  }
}

inline void engine::unlink_due(op& o) noexcept {
  if (o.stop_due_) {
    op* prev = nullptr;
    for (op* x = stops_head_; x != &o; x = x->stop_next_) prev = x;
    (prev ? prev->stop_next_ : stops_head_) = o.stop_next_;
    if (stops_tail_ == &o) stops_tail_ = prev;
    o.stop_due_ = false;
  }
  if (o.finish_due_) {
    op* prev = nullptr;
    for (op* x = finishes_head_; x != &o; x = x->due_next_) prev = x;
    (prev ? prev->due_next_ : finishes_head_) = o.due_next_;
    if (finishes_tail_ == &o) finishes_tail_ = prev;
    o.finish_due_ = false;
  }
}

inline bool engine::drain() noexcept {
  if (!due_) {
    assert(!link_end_due() && outbox_head_ == nullptr && !abort_due_ && stops_head_ == nullptr &&
           finishes_head_ == nullptr && !resume_due_ && direct_due_.empty() && "gdr: engine work queued without due()");
    return false;
  }
  return drain_due();
}

inline bool engine::drain_due() noexcept {
  due_ = false;
  draining_ = true;
  if (link_end_due()) end_link(link_end_ == link_end::close_due);
  while (frame* f = outbox_head_) {
    outbox_head_ = f->out_next;
    if (outbox_head_ == nullptr) outbox_tail_ = nullptr;
    f->in_outbox = false;
    f->out_next = nullptr;
    if (std::exchange(f->after_close, false)) {
      on_sent(*f, errc::closed);  // never written: as if the connection had ended at the close frame
    } else {
      link_post(*f);
    }
  }
  while (!direct_due_.empty()) {
    op* o = direct_due_.front();
    direct_due_.erase(direct_due_.begin());
    o->direct_due_ = false;
    o->direct_out_ = true;
    link_direct(*o);
  }
  if (std::exchange(abort_due_, false) && current_target_dead()) abort_current();
  while (op* o = stops_head_) {
    stops_head_ = o->stop_next_;
    if (stops_head_ == nullptr) stops_tail_ = nullptr;
    o->stop_due_ = false;
    do_cancel(*o, o->stop_reason_);
  }
  while (op* o = finishes_head_) {
    finishes_head_ = o->due_next_;
    if (finishes_head_ == nullptr) finishes_tail_ = nullptr;
    o->finish_due_ = false;
    finish_now(*o);
  }
  if (std::exchange(resume_due_, false) && !paused_ && !error_) link_resume();
  draining_ = false;
  return true;
}

inline rx_plan engine::place(target t, std::byte* dst, std::size_t want, std::uint64_t discard, int device) noexcept {
  t.want = want;
  cur_ = t;
  // A receive's or a get's own memory: what its `after` stream still does
  // with it comes first.
  const stream_order after = t.kind == target::op_payload && t.o != nullptr ? t.o->after() : stream_order{};
  return {rx_plan::action::place, dst, want, discard, device, after};
}

inline rx_plan engine::drop(std::uint64_t n) noexcept {
  cur_ = target{target::discard};
  return {rx_plan::action::place, nullptr, 0, n};
}

}  // namespace gdr::detail::proto
