/// \file
/// The staged path's movement: copies into and out of bounce buffers,
/// segments, the pump that keeps them flowing, and the segmented
/// rendezvous, puts and gets.
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
#include <gdr/protocol/engine/event_scope.hpp>

namespace gdr::detail::proto {

inline std::error_code engine::start_copy(stage_slot& b, copy_engine::direction d, int device, void* dst,
    const void* src, std::size_t n, op* o) noexcept {
  copy_engine* ce = copy_engine::of(*sched_);
  if (ce == nullptr) return errc::no_device;
  stream_order after{};
  if (o != nullptr && !o->after_used_) {
    after = o->opts_.after;
    o->after_used_ = true;
  }
  b.copying = true;
  if (std::error_code ec = ce->copy(d, device, dst, src, n, after, &b)) {
    b.copying = false;
    return ec;
  }
  ++copies_;
  ++stats_->staged_chunks;
  if (o != nullptr) ++o->copies_;
  return {};
}

inline void engine::on_copy_done(copy_engine::completion* c, std::error_code ec) noexcept {
  auto* b = static_cast<stage_slot*>(c);
  event_scope ev(*b->eng);
  b->eng->copy_done(*b, ec);
}

inline void engine::copy_done(stage_slot& b, std::error_code ec) noexcept {
  b.copying = false;
  --copies_;
  if (reply_slot* s = b.rs) {
    served_copy_done(b, *s, ec);
    return;
  }
  op& o = *b.owner;
  --o.copies_;
  if (b.rx) {
    std::size_t len = b.len;
    release_slot(b);
    if (ec) {
      copy_failed(o, ec);
    } else {
      o.done_ += len;
      if (!o.result_set_ && o.done_ == o.total_) finish_counted(o, false);
    }
    try_finish(o);
    if (o.kind_ == op::kind::get) pump(o);
    return;
  }
  if (ec || o.result_set_ || b.off >= o.total_) {
    release_slot(b);
    if (ec) copy_failed(o, ec);
    try_finish(o);
    return;
  }
  b.ready = true;
  post_ready(o);
}

inline void engine::copy_failed(op& o, std::error_code ec) noexcept {
  if (o.result_set_) return;
  if (o.kind_ == op::kind::send && o.proto_ == wire_protocol::eager) refund(o);  // its frame never went out
  o.what_ = "a copy of the staged path failed";
  // A rendezvous send whose data is committed cannot stop half way: the
  // receiver waits for the rest. The connection cannot go on.
  if (o.kind_ == op::kind::send && o.stage_ == op::stage::sending) {
    complete(o, ec);
    fail(errc::device_error);
    return;
  }
  complete(o, ec);
}

inline void engine::served_copy_done(stage_slot& b, reply_slot& s, std::error_code ec) noexcept {
  std::uint64_t id = b.req;
  std::size_t len = b.len;
  s.lease.release();
  if (b.rx || ec) {
    release_slot(b);
    ++(ec ? stats_->refused : b.rx ? stats_->served_puts : stats_->served_gets);
    send_answer(&s, b.rx ? msg::put_ack : msg::get_reply, id, ec ? status::remote_access : status::ok, nullptr, 0);
    return;
  }
  ++stats_->served_gets;
  b.rs = nullptr;
  s.bounce = &b;
  send_answer(&s, msg::get_reply, id, status::ok, b.mem, len);
}

inline rx_plan engine::place_in_bounce(op& r, stage_slot& b, std::size_t off, std::size_t len,
    std::uint64_t discard) noexcept {
  b.owner = &r;
  b.off = off;
  b.len = len;
  ++r.slots_;
  r.placing_ = true;
  r.path_ = transfer_path::staged_pinned;
  target t{target::stage_rx};
  t.b = &b;
  return place(t, b.mem, len, discard);
}

inline void engine::placed_in_bounce(stage_slot& b) noexcept {
  if (reply_slot* s = b.rs) {
    if (start_copy(b, copy_engine::direction::to_device, s->lease.device(), s->lease.data(), b.mem, b.len,
                   nullptr)) {
      std::uint64_t id = b.req;
      s->lease.release();
      release_slot(b);
      ++stats_->refused;
      send_answer(s, msg::put_ack, id, status::remote_access, nullptr, 0);
    }
    return;
  }
  op& o = *b.owner;
  o.placing_ = false;
  if (o.result_set_) {
    release_slot(b);
    try_finish(o);
    return;
  }
  if (std::error_code ec =
          start_copy(b, copy_engine::direction::to_device, o.dev_, o.data_ + b.off, b.mem, b.len, &o)) {
    release_slot(b);
    copy_failed(o, ec);
    try_finish(o);
  }
}

inline void engine::finish_counted(op& o, bool direct) noexcept {
  switch (o.kind_) {
    case op::kind::recv: o.bytes_ = o.total_; break;
    default: o.bytes_ = o.size_; break;
  }
  o.path_ = o.staged() ? transfer_path::staged_pinned : link_rx_path(direct);
  complete(o, o.ec_);  // errc::truncated was noted when the message began
}

inline void engine::deliver_early_staged(op& o, early_msg* m) noexcept {
  o.msg_size_ = static_cast<std::size_t>(m->size);
  o.proto_ = wire_protocol::eager;
  o.path_ = transfer_path::staged_pinned;
  o.total_ = std::min<std::size_t>(o.msg_size_, o.size_);
  if (o.msg_size_ > o.size_) o.ec_ = errc::truncated;
  o.early_ = m;
  o.to(op::stage::placing);
  enlist(staging_, o);
  try_deliver_early(o);
}

inline void engine::try_deliver_early(op& o) noexcept {
  while (o.early_ != nullptr && !o.result_set_ && o.issued_ < o.total_) {
    stage_slot* b = take(rx_);
    if (b == nullptr) {
      wait_for_slot(o, true);
      return;
    }
    std::size_t len = std::min(chunk_, o.total_ - o.issued_);
    std::memcpy(b->mem, o.early_->bytes.get() + o.issued_, len);
    b->owner = &o;
    b->off = o.issued_;
    b->len = len;
    ++o.slots_;
    o.issued_ += len;
    if (std::error_code ec = start_copy(*b, copy_engine::direction::to_device, o.dev_, o.data_ + b->off, b->mem,
                                        b->len, &o)) {
      release_slot(*b);
      copy_failed(o, ec);
      try_finish(o);
      return;
    }
  }
  if (o.early_ != nullptr && o.issued_ >= o.total_) delete std::exchange(o.early_, nullptr);
}

inline bool engine::launch_staged_eager(op& o) noexcept {
  o.proto_ = wire_protocol::eager;
  o.to(op::stage::queued);
  // Its frame goes out only once its copy is done: the sends after it
  // wait until then, so that messages keep the order they were sent in.
  o.holds_order_ = true;
  ++room_.order_holds;
  o.seg_ = o.size_;
  o.total_ = o.size_;
  enlist(staging_, o);
  pump(o);
  return true;
}

inline bool engine::launch_segmented(op& o) noexcept {
  std::size_t seg = o.size_;
  if (o.dev_ >= 0) seg = std::min(seg, chunk_);
  if (o.remote_dev_ && peer_seg_ != 0) seg = std::min<std::size_t>(seg, peer_seg_);
  o.seg_ = std::max<std::size_t>(seg, 1);
  o.total_ = o.size_;
  o.nseg_ = o.size_ == 0 ? 1 : (o.size_ + o.seg_ - 1) / o.seg_;
  o.id_ = next_id_;
  next_id_ += o.nseg_;
  o.path_ = transfer_path::staged_pinned;
  o.to(op::stage::awaiting);
  enlist(rma_, o);
  pump(o);
  return true;
}

inline void engine::attach_segment(op& o, stage_slot& b, std::size_t off, std::size_t len) noexcept {
  b.owner = &o;
  b.off = off;
  b.len = len;
  b.next = nullptr;
  (o.sq_tail_ ? o.sq_tail_->next : o.sq_head_) = &b;
  o.sq_tail_ = &b;
  ++o.slots_;
}

inline void engine::pump(op& o) noexcept {
  if (o.result_set_) return;
  const bool rma = o.kind_ == op::kind::put || o.kind_ == op::kind::get;
  const bool copy_out = o.dev_ >= 0 && o.kind_ != op::kind::get;
  const std::size_t depth = tx_.count;
  if (rma && o.total_ == 0) {
    // Nothing to move: one empty request checks the key (once: a slot
    // held or a request out means it is on its way).
    if (o.sq_head_ != nullptr || o.out_ != 0) return post_ready(o);
    if (credits_ == 0) return wait_for_credit(o);
    stage_slot* b = take(tx_);
    if (b == nullptr) return wait_for_slot(o, false);
    take_credit(*b);
    attach_segment(o, *b, 0, 0);
    b->ready = true;
    return post_ready(o);
  }
  // A rendezvous send whose receive has not answered yet copies ahead at
  // most one chunk, and never into the last free slot: slots go to what
  // can move now.
  const bool before_rtr = o.kind_ == op::kind::send && o.proto_ == wire_protocol::rendezvous && !o.go_;
  while (o.issued_ < o.total_) {
    if (rma && o.out_ + o.slots_ >= depth) break;  // enough requests unanswered
    if (before_rtr && (o.slots_ != 0 || tx_.count - tx_.in_use < 2)) break;
    // A request's credit (a reply slot of the peer's) before its bounce
    // buffer, never a buffer held while waiting for a credit: the peer's
    // answers that return credits may wait for this side's buffers (a get
    // of this side's Device memory), and both sides would wait for ever.
    if (rma && credits_ == 0) {
      wait_for_credit(o);
      break;
    }
    stage_slot* b = take(tx_);
    if (b == nullptr) {
      wait_for_slot(o, false);
      break;
    }
    if (rma) take_credit(*b);
    std::size_t len = std::min(o.seg_, o.total_ - o.issued_);
    attach_segment(o, *b, o.issued_, len);
    o.issued_ += len;
    if (copy_out) {
      if (std::error_code ec =
              start_copy(*b, copy_engine::direction::to_host, o.dev_, b->mem, o.data_ + b->off, len, &o)) {
        release_slot(*b);
        copy_failed(o, ec);
        try_finish(o);
        return;
      }
    } else {
      b->ready = true;
    }
  }
  post_ready(o);
}

inline void engine::post_ready(op& o) noexcept {
  if (o.result_set_) return;
  if (o.kind_ == op::kind::send && o.proto_ == wire_protocol::rendezvous && !o.go_) return;
  for (stage_slot* b = o.sq_head_; b != nullptr; b = b->next) {
    if (b->posted) continue;
    if (!b->ready) break;
    assert((o.kind_ == op::kind::send || b->credited) && "gdr: a request's bounce buffer without its credit");
    frame& f = b->f;
    f.reset(&o);
    f.sslot = b;
    header& h = f.hdr;
    const std::byte* src = o.dev_ >= 0 ? b->mem : o.data_ + b->off;
    switch (o.kind_) {
      case op::kind::send:
        if (o.proto_ == wire_protocol::eager) {
          h.type = msg::eager;
          h.tag = o.tag_;
          release_order(o);
        } else {
          h.type = msg::data;
          h.addr = o.raddr_;  // the receiver's token
          h.size = b->off;
          if (b->off + b->len == o.total_) h.flags = flag::last;
        }
        h.length = b->len;
        f.payload = src;
        break;
      case op::kind::put:
        h.type = msg::put_request;
        h.id = o.id_ + b->off / o.seg_;
        h.addr = o.raddr_ + b->off;
        h.key = o.rkey_;
        h.length = b->len;
        f.payload = src;
        ++o.out_;
        break;
      case op::kind::get:
        h.type = msg::get_request;
        h.id = o.id_ + b->off / o.seg_;
        h.addr = o.raddr_ + b->off;
        h.key = o.rkey_;
        h.size = b->len;
        ++o.out_;
        break;
      default: break;
    }
    b->posted = true;
    post(f);
  }
}

inline void engine::segment_sent(stage_slot& b, std::error_code ec) noexcept {
  op& o = *b.owner;
  b.posted = false;
  b.credited = false;  // a request's credit is its answer's now (or the connection is over)
  std::size_t len = b.len;
  release_slot(b);
  if (ec) {
    if (o.kind_ != op::kind::send && o.out_ != 0) --o.out_;  // no answer will come
    complete(o, failure_of(ec));
    try_finish(o);
    return;
  }
  if (o.kind_ == op::kind::send) {
    o.done_ += len;
    if (!o.result_set_ && o.done_ == o.total_) {
      o.bytes_ = o.size_;
      o.path_ = transfer_path::staged_pinned;
      complete(o, {});
    }
  }
  try_finish(o);
  defer_pump(o);  // not from inside on_sent: the transport is mid-bookkeeping
}

inline bool engine::release_segments(op& o) noexcept {
  for (stage_slot* b = o.sq_head_; b != nullptr;) {
    stage_slot* next = b->next;
    if (b->posted) {
      if (held_by_link(b->f) && withdraw(b->f)) {
        b->f.queued = false;
        if (o.kind_ != op::kind::send && o.out_ != 0) {
          --o.out_;  // never sent: no answer
          credit_back();
          if (o.answers_dropped_) withdrawals_.forget_in_range(o.id_);
        }
        release_slot(*b);
      }
    } else if (!b->copying) {
      release_slot(*b);
    }
    b = next;
  }
  return o.slots_ == 0;
}

inline rx_plan engine::rtr_segmented(op& s, const header& h) noexcept {
  if (s.dev_ >= 0 && h.key != 0 && h.key < s.seg_) return fail_plan();  // smaller than its hello said
  if (s.dev_ < 0 && ensure_pool(tx_, false)) return fail_plan();
  delist(s);
  s.to(op::stage::sending);
  ++rendezvous_out_;
  s.go_ = true;
  s.raddr_ = h.addr;  // the receiver's token
  if (s.dev_ < 0) s.seg_ = static_cast<std::size_t>(h.key);
  // The receive may accept fewer bytes: segments past them are not sent.
  s.total_ = static_cast<std::size_t>(h.size);
  s.issued_ = std::min(s.issued_, s.total_);
  for (stage_slot* b = s.sq_head_; b != nullptr;) {
    stage_slot* next = b->next;
    if (b->off >= s.total_) {
      if (!b->copying) release_slot(*b);
    } else if (b->off + b->len > s.total_) {
      b->len = s.total_ - b->off;
    }
    b = next;
  }
  enlist(staging_, s);
  if (s.total_ == 0) {
    // Nothing accepted: one empty segment ends the message.
    frame& f = s.f2_;
    f.reset(&s);
    f.hdr.type = msg::data;
    f.hdr.flags = flag::last;
    f.hdr.addr = h.addr;
    post(f);
    return consumed();
  }
  pump(s);
  return consumed();
}

inline rx_plan engine::segment_answer(op& o, const header& h) noexcept {
  std::size_t off = static_cast<std::size_t>(h.id - o.id_) * o.seg_;
  std::size_t len = o.size_ == 0 ? 0 : std::min(o.seg_, o.total_ - off);
  if (h.st != status::ok) {
    --o.out_;
    complete(o, answer_error(h.st));
    return h.length != 0 ? drop(h.length) : consumed();
  }
  if (o.kind_ == op::kind::put) {
    --o.out_;
    o.done_ += len;
    if (!o.result_set_ && o.done_ == o.total_) finish_counted(o, false);
    else pump(o);
    return consumed();
  }
  if (h.length != len) return fail_plan();  // not what was asked for
  if (o.dev_ >= 0 && len != 0) {
    stage_slot* b = take(rx_);
    if (b == nullptr) return pause_reading();
    --o.out_;
    return place_in_bounce(o, *b, off, len, 0);
  }
  --o.out_;
  o.placing_ = true;
  target t{target::op_payload, &o};
  t.counted = true;
  return place(t, o.data_ + off, len, 0);
}

inline std::size_t engine::own_segment() const noexcept {
  return peer_seg_ != 0 ? std::min<std::size_t>(chunk_, peer_seg_) : chunk_;
}

}  // namespace gdr::detail::proto
