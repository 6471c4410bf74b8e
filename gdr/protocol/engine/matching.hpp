/// \file
/// Receiving: receives matched to messages by tag, the early-message store,
/// the handshake, and the early credits that bound what the peer may make
/// this side keep (granted back as kept messages are taken).
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

inline bool engine::begin_recv(op& o) noexcept {
  if (closing_) {
    // Receiving ends when close() starts (GUIDE section 8): kept
    // messages are not handed out any more. An endpoint that failed
    // first says how.
    o.ec_ = error_ ? error_ : std::error_code(errc::closed);
    return false;
  }
  if (!spaces_allowed(o)) return false;
  switch (take_kept(o)) {
    case kept::done: return false;
    case kept::pending: return true;
    case kept::none: break;
  }
  if (error_) {
    o.ec_ = error_;
    return false;
  }
  o.to(op::stage::posted);
  enlist(recvs_, o);
  resume_reading();
  return true;
}

inline engine::kept engine::take_kept(op& o) noexcept {
  for (early_msg* m = early_.head; m != nullptr; m = m->next) {
    if (m->tag != o.tag_) continue;
    if (!m->rts && refuses_eager(o, m->size)) {
      o.ec_ = errc::gpudirect_unavailable;  // the message stays for a host receive
      return kept::done;
    }
    if (m->rts && error_) return kept::none;  // an announcement can no longer be answered
    early_.erase(m);
    owe(m->rts ? 0 : m->size);
    ++matches_;
    if (!m->rts && o.dev_ >= 0 && std::min<std::size_t>(m->size, o.size_) != 0) {
      // Kept eager bytes for device memory: through a bounce buffer.
      early_bytes_ -= m->size;
      resume_reading();
      deliver_early_staged(o, m);
      return kept::pending;
    }
    if (!m->rts) {
      // Kept eager bytes: received now, without suspending.
      early_bytes_ -= m->size;
      o.ec_ = deliver_early(o, *m);
      delete m;
      resume_reading();
      return kept::done;
    }
    match_rts(o, m->size, m->sid);
    delete m;
    resume_reading();
    return kept::pending;
  }
  return kept::none;
}

inline void engine::repost_recv(op& r) noexcept {
  delist(r);
  r.to(op::stage::idle);  // nothing more comes for its token
  // Back in line only if that keeps the order of its tag: no receive has
  // taken a message since this one matched (a later receive of its tag
  // that did would otherwise have overtaken it), a frame is free for its
  // next rtr (the last one's may still be with the transport), and
  // receiving goes on.
  if (r.matched_at_ != matches_ || (held_by_link(r.f1_) && held_by_link(r.f2_)) || closing_ || error_) {
    complete(r, errc::withdrawn);
    return;
  }
  r.ec_ = {};
  r.id_ = 0;
  r.msg_size_ = r.total_ = r.issued_ = r.done_ = 0;
  r.proto_ = wire_protocol::none;
  switch (take_kept(r)) {
    case kept::done: complete(r, r.ec_); return;
    case kept::pending: return;
    case kept::none: break;
  }
  // The first of its tag again: before any receive of its tag posted since.
  r.to(op::stage::posted);
  enlist(recvs_, r, true);
}

inline op* engine::find_recv(std::uint64_t tag) noexcept {
  for (op* r = recvs_.head; r != nullptr; r = r->next_)
    if (r->tag_ == tag) return r;
  return nullptr;
}

inline void engine::take_recv(op& r) noexcept {
  ++matches_;
  delist(r);
  r.to(op::stage::idle);
}

inline op* engine::recv_for_eager(std::uint64_t tag, std::size_t len) noexcept {
  while (op* r = find_recv(tag)) {
    if (!refuses_eager(*r, len)) return r;
    complete(*r, errc::gpudirect_unavailable);
  }
  return nullptr;
}

inline std::error_code engine::deliver_early(op& r, const early_msg& m) noexcept {
  std::size_t n = std::min<std::size_t>(m.size, r.size_);
  if (n != 0) std::memcpy(r.data_, m.bytes.get(), n);
  r.bytes_ = n;
  r.msg_size_ = m.size;
  r.proto_ = wire_protocol::eager;
  r.path_ = transfer_path::host_eager;
  return m.size > r.size_ ? std::error_code(errc::truncated) : std::error_code{};
}

inline void engine::match_rts(op& r, std::uint64_t size, std::uint64_t sid) noexcept {
  r.id_ = next_id_++;
  r.matched_at_ = matches_;  // (repost_recv)
  r.msg_size_ = static_cast<std::size_t>(size);
  r.proto_ = wire_protocol::rendezvous;
  std::size_t accept = std::min<std::size_t>(size, r.size_);
  if (accept < size) r.ec_ = errc::truncated;  // reported when the data is in
  r.to(op::stage::awaiting);
  r.total_ = accept;
  r.issued_ = 0;
  r.done_ = 0;
  enlist(awaiting_data_, r);
  // Its first frame, or, back in line after a withdrawn message while the
  // transport still holds that rtr, its second (repost_recv).
  frame& f = held_by_link(r.f1_) ? r.f2_ : r.f1_;
  f.reset(&r);
  f.hdr.type = msg::rtr;
  f.hdr.id = sid;
  f.hdr.size = accept;
  f.hdr.addr = r.id_;
  f.mark_nic(r.nic_dev_, r.nic_dev_ >= 0);
  // Device memory takes the data in frames no larger than its bounce
  // buffers.
  if (r.dev_ >= 0) f.hdr.key = chunk_;
  post(f);
}

inline void engine::resume_reading() noexcept {
  if (paused_) {
    paused_ = false;
    if (link_calls_now()) {
      link_resume();
    } else {
      resume_due_ = true;
      due();
    }
  }
}

inline rx_plan engine::pause_reading() noexcept {
  if (!paused_) ++stats_->paused;
  paused_ = true;
  return pause_plan();
}

inline rx_plan engine::rx_hello(const header& h) noexcept {
  if (got_hello_) return fail_plan();
  if (h.id != version) return fail_plan();  // only version 2 exists
  got_hello_ = true;
  peer_max_ = h.size;
  peer_caps_ = h.tag;
  peer_seg_ = h.addr;
  credits_ = h.key != 0 ? h.key : ~std::uint64_t{0};
  if (h.key == 0) {
    // A peer that counts no credits (a hand-written one: every gdr peer
    // has reply slots): it sends no credit frame and bounds nothing.
    room_.send_bytes = room_.send_msgs = ~std::uint64_t{0} / 2;
    handshake_done();
  }
  return consumed();
}

inline void engine::handshake_done() noexcept {
  if (std::exchange(room_.got_first, true)) return;
  while (op* o = held_.head) {
    delist(*o);
    o->to(op::stage::idle);
    if (!launch(*o)) complete(*o, o->ec_);  // larger than the peer accepts
  }
  maybe_post_close();
}

inline rx_plan engine::rx_credit(const header& h) noexcept {
  room_.send_bytes += h.size;
  room_.send_msgs += h.id;
  handshake_done();
  run_send_waiters();
  maybe_post_close();
  return consumed();
}

inline early_msg* engine::new_eager_msg(std::uint64_t tag, std::size_t len, std::size_t room) noexcept {
  auto* m = new (std::nothrow) early_msg;
  if (m == nullptr) return nullptr;
  room = std::min(room, len);
  if (room != 0) {
    m->bytes.reset(new (std::nothrow) std::byte[room]);
    if (!m->bytes) {
      delete m;
      return nullptr;
    }
  }
  m->tag = tag;
  m->size = len;
  return m;
}

inline rx_plan engine::rx_eager(const header& h) noexcept {
  auto len = static_cast<std::size_t>(h.length);
  if (op* r = recv_for_eager(h.tag, len)) {
    std::size_t want = std::min(len, r->size_);
    if (r->dev_ >= 0 && want != 0 && len > chunk_) {
      // Into device memory, larger than a bounce buffer (the sender's
      // threshold is above our chunk): through host memory first, then
      // chunk by chunk as a kept message is. Only what the receive takes
      // is kept: the peer's header does not choose the allocation.
      early_msg* m = new_eager_msg(h.tag, len, want);
      if (m == nullptr) return pause_reading();
      owe(len);
      take_recv(*r);
      r->to(op::stage::placing);
      r->placing_ = true;
      target t{target::via_host, r};
      t.m = m;
      return place(t, m->bytes.get(), want, len - want);
    }
    if (r->dev_ >= 0 && want != 0) {
      // Into device memory: through a bounce buffer.
      stage_slot* b = take(rx_);
      if (b == nullptr) return pause_reading();
      owe(len);
      take_recv(*r);
      if (want < len) r->ec_ = errc::truncated;
      r->msg_size_ = len;
      r->proto_ = wire_protocol::eager;
      r->to(op::stage::placing);
      r->total_ = want;
      return place_in_bounce(*r, *b, 0, want, len - want);
    }
    take_recv(*r);
    owe(len);
    if (want < len) r->ec_ = errc::truncated;
    r->msg_size_ = len;
    r->proto_ = wire_protocol::eager;
    r->to(op::stage::placing);
    r->placing_ = true;
    return place({target::op_payload, r}, r->data_, want, len - want);
  }
  if (closing_) {  // no receive will take it: dropped, its room granted back
    owe(len);
    return drop(len);
  }
  if (early_bytes_ + len > opts_.unexpected_bytes || early_.size >= opts_.unexpected_messages)
    return pause_reading();
  early_msg* m = new_eager_msg(h.tag, len);
  if (m == nullptr) return pause_reading();
  target t{target::store};
  t.m = m;
  return place(t, m->bytes.get(), len, 0);
}

inline rx_plan engine::rx_rts(const header& h) noexcept {
  if (op* r = find_recv(h.tag)) {
    take_recv(*r);
    owe(0);
    match_rts(*r, h.size, h.id);
    return consumed();
  }
  if (closing_) {  // no receive will take it: the sender learns now
    if (!answers_.room()) return pause_reading();  // (engine/answers.hpp)
    owe(0);
    answer_withdrawn(h.id);
    return consumed();
  }
  if (early_.size >= opts_.unexpected_messages) return pause_reading();
  auto* m = new (std::nothrow) early_msg;
  if (m == nullptr) return pause_reading();
  m->rts = true;
  m->tag = h.tag;
  m->size = h.size;
  m->sid = h.id;
  early_.push_back(m);
  ++stats_->unexpected_rts;
  return consumed();
}

inline void engine::drop_kept_messages() noexcept {
  for (early_msg* m = early_.head; m != nullptr && !error_;) {
    early_msg* next = m->next;
    early_.erase(m);
    if (m->rts) {
      owe(0);
      answer_withdrawn(m->sid, true);  // owed whatever the room: at most unexpected_messages
    } else {
      early_bytes_ -= m->size;
      owe(m->size);
    }
    delete m;
    m = next;
  }
}

inline void engine::owe(std::uint64_t bytes) noexcept {
  room_.owed_bytes += bytes;
  ++room_.owed_msgs;
  if (room_.owed_bytes >= room_.grant_bytes || room_.owed_msgs >= room_.grant_msgs) maybe_grant();
}

inline void engine::maybe_grant() noexcept {
  if (error_ || close_posted_ || held_by_link(room_.f)) return;
  if (room_.owed_bytes < room_.grant_bytes && room_.owed_msgs < room_.grant_msgs) return;
  room_.f.reset(nullptr);
  room_.f.hdr.type = msg::credit;
  room_.f.hdr.size = std::exchange(room_.owed_bytes, 0);
  room_.f.hdr.id = std::exchange(room_.owed_msgs, 0);
  post(room_.f);
}

inline void engine::refund(op& o) noexcept {
  if (!std::exchange(o.debited_, false)) return;
  room_.send_bytes += o.debit_;
  ++room_.send_msgs;
  if (!room_.send_wait.empty()) credit_due_ = deferred_due_ = true;
}

inline void engine::release_order(op& o) noexcept {
  if (!std::exchange(o.holds_order_, false)) return;
  --room_.order_holds;
  if (room_.order_holds == 0 && !room_.send_wait.empty()) credit_due_ = deferred_due_ = true;
}

inline void engine::run_send_waiters() noexcept {
  while (room_.send_msgs != 0 && room_.order_holds == 0 && !room_.send_wait.empty()) {
    op* o = room_.send_wait.head;
    delist(*o);
    o->to(op::stage::idle);
    room_.waiter_turn = true;  // its turn: it does not queue behind the others
    const bool pending = launch(*o);
    room_.waiter_turn = false;
    if (!pending) complete(*o, o->ec_);
  }
}

}  // namespace gdr::detail::proto
