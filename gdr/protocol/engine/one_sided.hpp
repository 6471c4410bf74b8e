/// \file
/// Puts and gets: serving the peer's requests, answering them from reply
/// slots, completing this side's requests from their answers, and the
/// credits (the peer's reply slots) those requests spend. Direct one-sided
/// operations, which the transport's NIC moves, are in engine/direct.hpp.
///
/// Reply slots. An endpoint grants its peer `reply_slots` credits in its
/// hello from the start, but allocates a slot only when a request finds
/// none free (an idle endpoint holds none: 64 of them were 16.5 KiB,
/// zeroed at creation, benchmarks/RESULTS.md "Idle endpoints"); a slot is
/// kept once made, so a steady stream of requests allocates nothing. The
/// peer never has more requests unanswered than the credits, so at most
/// `reply_slots` are made. When one cannot be allocated, the request is
/// answered from the spare slot, which every engine holds, with
/// `status::no_memory`: that put or get fails with
/// `std::errc::not_enough_memory` on the peer, whose credit comes back with
/// the answer, and the connection goes on. While the spare's answer is not
/// yet written, a further request that finds no slot pauses the reader, as
/// one does when every slot is in use, until it is.
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

inline rx_plan engine::rx_put_request(const header& h) noexcept {
  reply_slot* s = take_slot();
  if (s == nullptr) return pause_reading();
  auto len = static_cast<std::size_t>(h.length);
  if (s == &replies_.spare) {
    // No slot could be allocated: refused, the payload read and dropped.
    ++stats_->no_memory;
    send_answer(s, msg::put_ack, h.id, status::no_memory, nullptr, 0);
    return drop(len);
  }
  result<access_lease> l = registry_->acquire(h.addr, len, h.key, access::write, can_stage() || device_direct_);
  if (l && l->on_device() && len != 0 && device_direct_) {
    // GPUDirect: the NIC writes the exposed device memory.
    s->lease = std::move(*l);
    target t{target::serve_put};
    t.s = s;
    t.id = h.id;
    return place(t, s->lease.data(), len, 0, s->lease.device());
  }
  if (l && l->on_device() && len != 0) {
    // Into device memory: through a bounce buffer, then a copy; the ack
    // follows the copy. A request larger than a bounce buffer (the peer
    // ignored our hello) is refused.
    if (len <= chunk_ && !ensure_pool(rx_, true)) {
      stage_slot* b = bounce_for_request(rx_, s, *l, h.id, len);
      if (b == nullptr) return pause_reading();
      target t{target::stage_rx};
      t.b = b;
      return place(t, b->mem, len, 0);
    }
    l = errc::remote_access;
  }
  if (!l) {
    // Refused: nothing is written; the payload is read and dropped.
    ++stats_->refused;
    send_answer(s, msg::put_ack, h.id, status::remote_access, nullptr, 0);
    return drop(len);
  }
  s->lease = std::move(*l);
  target t{target::serve_put};
  t.s = s;
  t.id = h.id;
  return place(t, s->lease.data(), len, 0);
}

inline rx_plan engine::rx_get_request(const header& h) noexcept {
  reply_slot* s = take_slot();
  if (s == nullptr) return pause_reading();
  if (s == &replies_.spare) {
    ++stats_->no_memory;
    send_answer(s, msg::get_reply, h.id, status::no_memory, nullptr, 0);
    return consumed();
  }
  auto len = static_cast<std::size_t>(h.size);
  result<access_lease> l = registry_->acquire(h.addr, len, h.key, access::read, can_stage() || device_direct_);
  // Over CUDA IPC the answer is the registration's whole allocation, which
  // the peer maps: an exposure::checked one is staged instead.
  if (l && l->on_device() && len != 0 && device_direct_ && (l->exposed() || direct_path_ != transfer_path::cuda_ipc)) {
    // GPUDirect: the NIC reads the exposed device memory (CUDA IPC: the peer's GPU).
    ++stats_->served_gets;
    s->lease = std::move(*l);
    send_answer(s, msg::get_reply, h.id, status::ok, s->lease.data(), len, s->lease.device());
    return consumed();
  }
  if (l && l->on_device() && len != 0) {
    // From device memory: copied into a bounce buffer, sent from there.
    if (len <= chunk_ && !ensure_pool(tx_, true)) {
      // No bounce buffer free: the request waits for one in its own
      // queue (its reply slot is the peer's credit), and the reader goes
      // on; the frames that free bounce buffers are behind this one.
      s->lease = std::move(*l);
      s->wait_id = h.id;
      s->wait_len = len;
      s->wait_next = nullptr;
      (replies_.serve_wait_tail ? replies_.serve_wait_tail->wait_next : replies_.serve_wait_head) = s;
      replies_.serve_wait_tail = s;
      serve_waiting_gets();
      return consumed();
    }
    l = errc::remote_access;
  }
  if (!l) {
    ++stats_->refused;
    send_answer(s, msg::get_reply, h.id, status::remote_access, nullptr, 0);
  } else {
    // The bytes go out straight from the registered memory; the lease
    // keeps a revocation waiting until they are written.
    ++stats_->served_gets;
    s->lease = std::move(*l);
    send_answer(s, msg::get_reply, h.id, status::ok, s->lease.data(), len);
  }
  return consumed();
}

inline rx_plan engine::rx_atomic_request(const header& h) noexcept {
  reply_slot* s = take_slot();
  if (s == nullptr) return pause_reading();
  constexpr std::size_t word = sizeof(std::uint64_t);
  if (s == &replies_.spare) {
    ++stats_->no_memory;
    send_answer(s, msg::get_reply, h.id, status::no_memory, nullptr, 0);
    return drop(h.length);
  }
  // An aligned word of host memory, readable and writable: the CPU does
  // the atomic (never on Device memory).
  result<access_lease> l = registry_->acquire(h.addr, word, h.key, access::read_write, false);
  if (!l || l->on_device() || h.addr % word != 0) {
    ++stats_->refused;
    send_answer(s, msg::get_reply, h.id, status::remote_access, nullptr, 0);
    return drop(h.length);
  }
  s->lease = std::move(*l);
  s->atomic = h.tag;
  target t{target::serve_put};
  t.s = s;
  t.id = h.id;
  return place(t, s->atomic_args, sizeof s->atomic_args, 0);
}

inline void engine::serve_atomic(reply_slot& s, std::uint64_t id) noexcept {
  std::uint64_t a = 0, b = 0;
  std::memcpy(&a, s.atomic_args, sizeof a);
  std::memcpy(&b, s.atomic_args + sizeof a, sizeof b);
  // Atomic against every other server of this word (endpoints on other
  // threads of this process) and against the owner's own atomic_ref.
  std::atomic_ref<std::uint64_t> w(*reinterpret_cast<std::uint64_t*>(s.lease.data()));
  if (s.atomic == atomic_fetch_add) {
    s.atomic_old = w.fetch_add(a, std::memory_order_acq_rel);
  } else {
    std::uint64_t expected = a;
    w.compare_exchange_strong(expected, b, std::memory_order_acq_rel);
    s.atomic_old = expected;  // the word's value before: equal to `a` when swapped
  }
  s.atomic = 0;
  s.lease.release();
  ++stats_->served_gets;
  send_answer(&s, msg::get_reply, id, status::ok, reinterpret_cast<const std::byte*>(&s.atomic_old),
              sizeof s.atomic_old);
}

inline rx_plan engine::rx_answer(const header& h) noexcept {
  bool get = h.type == msg::get_reply;
  credit_back();  // whatever it answers, the peer's reply slot is free again
  op* o = rma_.head;
  while (o != nullptr && !(h.id >= o->id_ && h.id - o->id_ < o->nseg_)) o = o->next_;
  if (o == nullptr) {
    if (withdrawals_.forget_answer(h.id) || withdrawals_.forget_in_range(h.id)) return drop(h.length);  // a cancelled request's answer
    return fail_plan();  // an answer to nothing we asked
  }
  if ((o->kind_ == op::kind::get) != get) return fail_plan();
  if (o->segmented()) return segment_answer(*o, h);
  delist(*o);
  o->to(op::stage::idle);
  if (h.st != status::ok) {
    complete(*o, answer_error(h.st));
    return consumed();
  }
  if (!get) {
    o->bytes_ = o->size_;
    // Set when its request was handed back (on_sent); an answer parsed
    // before that takes the transport's latest.
    if (o->path_ == transfer_path::none) o->path_ = link_tx_path();
    complete(*o, {});
    return consumed();
  }
  if (h.length != o->size_) return fail_plan();  // not what was asked for
  o->to(op::stage::placing);
  o->placing_ = true;
  return place({target::op_payload, o}, o->data_, o->size_, 0, o->nic_dev_);
}

inline void engine::wait_for_credit(op& o) noexcept {
  if (o.credit_due_) return;
  try {
    credit_pumps_.push_back(&o);
    o.credit_due_ = true;
  } catch (...) {
    complete(o, errno_code(ENOMEM));
  }
}

inline void engine::credit_back() noexcept {
  ++credits_;
  if (!credit_wait_.empty() || !credit_pumps_.empty()) credit_due_ = deferred_due_ = true;
}

inline void engine::take_credit(stage_slot& b) noexcept {
  --credits_;
  b.credited = true;
}

inline void engine::run_credit_waiters() noexcept {
  run_send_waiters();
  while (credits_ != 0 && !credit_wait_.empty()) {
    op* o = credit_wait_.head;
    delist(*o);
    o->to(op::stage::idle);
    if (!launch(*o)) complete(*o, o->ec_);
  }
  while (credits_ != 0 && !credit_pumps_.empty()) {
    op* o = credit_pumps_.front();
    credit_pumps_.erase(credit_pumps_.begin());
    o->credit_due_ = false;
    pump(*o);
  }
}

inline reply_slot* engine::take_slot() noexcept {
  reply_slot* s = replies_.free;
  if (s != nullptr) {
    replies_.free = s->next_free;
    return s;
  }
  return make_slot();
}

inline std::error_code engine::answer_error(status st) noexcept {
  if (st == status::no_memory) return errno_code(ENOMEM);
  return errc::remote_access;
}

inline reply_slot* engine::make_slot() noexcept {
  if (replies_.made_count >= replies_.limit) return nullptr;
  auto* s = new (std::nothrow) reply_slot;
  if (s == nullptr) {
    if (replies_.spare_busy) return nullptr;
    replies_.spare_busy = true;
    return &replies_.spare;
  }
  s->f.slot = s;
  s->next_made = replies_.made;
  replies_.made = s;
  ++replies_.made_count;
  return s;
}

inline stage_slot* engine::bounce_for_request(stage_pool& p, reply_slot* s, access_lease& l, std::uint64_t id,
    std::size_t len) noexcept {
  stage_slot* b = take(p);
  if (b == nullptr) {
    l.release();
    put_back_slot(s);
    return nullptr;
  }
  s->lease = std::move(l);
  b->rs = s;
  b->req = id;
  b->len = len;
  return b;
}

inline void engine::put_back_slot(reply_slot* s) noexcept {
  assert(s != &replies_.spare && "gdr: the spare reply slot serves no request");
  s->next_free = replies_.free;
  replies_.free = s;
}

inline void engine::free_slot(reply_slot* s) noexcept {
  s->lease.release();
  s->atomic = 0;
  if (stage_slot* b = std::exchange(s->bounce, nullptr)) release_slot(*b);
  s->f.reset(nullptr);
  s->f.slot = s;
  if (s == &replies_.spare) {
    replies_.spare_busy = false;
  } else {
    s->next_free = replies_.free;
    replies_.free = s;
  }
  resume_reading();
}

inline void engine::send_answer(reply_slot* s, msg type, std::uint64_t id, status st, const std::byte* payload,
    std::size_t len, int device) noexcept {
  if (error_) {
    free_slot(s);
    return;
  }
  frame& f = s->f;
  f.hdr = header{};
  f.hdr.type = type;
  f.hdr.st = st;
  f.hdr.id = id;
  f.hdr.length = len;
  f.payload = payload;
  f.mark_nic(device, device >= 0);
  post(f);
}

}  // namespace gdr::detail::proto
