/// \file
/// The staged path's bounce buffers: the pools, checks made before a staged
/// operation starts, handing slots out and taking them back, and the queues
/// where operations and served gets wait for a slot (never the reader).
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

inline bool engine::spaces_allowed(op& o) noexcept {
  if (refused_ == 0 && !o.staged() && o.nic_dev_ < 0 && !o.remote_nic_) return true;
  o.ec_ = staging_check(o);
  return !o.ec_;
}

inline std::error_code engine::staging_check(op& o) noexcept {
  const bool staged = o.staged();
  const bool device = staged || o.nic_dev_ >= 0 || o.remote_nic_;
  if (refused_ & (device ? refuse_device : refuse_host)) {
    o.what_ = device ? "this endpoint's forced path excludes device memory"
                     : "this endpoint's forced path excludes host memory";
    return errc::unsupported;
  }
  if (!staged) {
    // Direct: the transport says now whether it can move this memory (CUDA
    // IPC: can the driver share the allocation?), not after the peer is
    // told of it.
    const bool read_by_peer = o.kind_ == op::kind::send || o.kind_ == op::kind::put;
    if (o.nic_dev_ >= 0 && read_by_peer && o.size_ != 0) return link_check_device(o.data_, o.size_, &o.what_);
    return {};
  }
  if (o.dev_ >= 0 && !can_stage()) {
    o.what_ = "device memory needs a copy engine on the endpoint's scheduler: create a gdr::cuda::event_poller "
              "for it (gdr::cuda::event_poller events(sched);)";
    return errc::no_device;
  }
  const bool out = o.kind_ == op::kind::send || o.kind_ == op::kind::put;
  std::error_code ec;
  if (o.kind_ != op::kind::recv) ec = ensure_pool(tx_, o.dev_ >= 0 && out);
  if (!ec && o.dev_ >= 0 && !out) ec = ensure_pool(rx_, true);
  if (ec) o.what_ = "could not allocate the staged path's pinned bounce buffers";
  return ec;
}

inline std::error_code engine::ensure_pool(stage_pool& p, bool mem) noexcept {
  if (!p.slots) {
    std::size_t n = std::max<std::size_t>(opts_.staging.depth, 1);
    p.slots.reset(new (std::nothrow) stage_slot[n]);
    if (!p.slots) return errno_code(ENOMEM);
    p.count = n;
    for (std::size_t i = n; i-- > 0;) {
      stage_slot& b = p.slots[i];
      b.eng = this;
      b.rx = &p == &rx_;
      b.done = &on_copy_done;
      b.f.sslot = &b;
      b.next = p.free;
      p.free = &b;
    }
  }
  if (mem && p.block.data == nullptr) {
    copy_engine* ce = copy_engine::of(*sched_);
    if (ce == nullptr) return errc::no_device;
    p.block = ce->allocate_pinned(p.count * chunk_);
    if (p.block.data == nullptr) return errno_code(ENOMEM);
    for (std::size_t i = 0; i < p.count; ++i) p.slots[i].mem = p.block.data + i * chunk_;
  }
  return {};
}

inline stage_slot* engine::take(stage_pool& p) noexcept {
  stage_slot* b = p.free;
  if (b == nullptr) return nullptr;
  p.free = b->next;
  b->next = nullptr;
  ++p.in_use;
  return b;
}

inline void engine::release_slot(stage_slot& b) noexcept {
  stage_pool& p = b.rx ? rx_ : tx_;
  if (op* o = b.owner) {
    --o->slots_;
    if (!b.rx) unlink_segment(*o, b);
  }
  // A request's credit taken with the buffer and never spent on a request
  // that went out comes back.
  if (std::exchange(b.credited, false) && !b.posted) credit_back();
  b.owner = nullptr;
  b.rs = nullptr;
  b.off = b.len = 0;
  b.req = 0;
  b.copying = b.ready = b.posted = false;
  b.f.reset(nullptr);
  b.f.sslot = &b;
  b.next = p.free;
  p.free = &b;
  --p.in_use;
  slot_freed(b.rx);
}

inline void engine::unlink_segment(op& o, stage_slot& b) noexcept {
  stage_slot** pp = &o.sq_head_;
  stage_slot* prev = nullptr;
  while (*pp != nullptr && *pp != &b) {
    prev = *pp;
    pp = &(*pp)->next;
  }
  if (*pp == nullptr) return;
  *pp = b.next;
  if (o.sq_tail_ == &b) o.sq_tail_ = prev;
  b.next = nullptr;
}

inline void engine::slot_freed(bool rx) noexcept {
  resume_reading();
  // The waiters go on at the end of the event (run_deferred): a slot is
  // often freed from inside the transport's own bookkeeping (on_sent),
  // where posting a frame is not allowed.
  (rx ? kick_rx_ : kick_tx_) = true;
  deferred_due_ = true;
  if (busy_ == 0) post_resume();
}

inline void engine::defer_pump(op& o) noexcept {
  if (o.pump_due_ || o.result_set_) return;
  try {
    pumps_.push_back(&o);
    o.pump_due_ = true;
    deferred_due_ = true;
  } catch (...) {
    complete(o, errno_code(ENOMEM));
  }
}

inline bool engine::run_deferred() noexcept {
  if (!std::exchange(deferred_due_, false)) {
    assert(!kick_tx_ && !kick_rx_ && pumps_.empty() && !credit_due_ && "gdr: deferred work without deferred_due_");
    return false;
  }
  if (std::exchange(credit_due_, false)) run_credit_waiters();
  if (std::exchange(kick_rx_, false)) kick_waiters(true);
  if (std::exchange(kick_tx_, false)) kick_waiters(false);
  while (!pumps_.empty()) {
    op* o = pumps_.front();
    pumps_.erase(pumps_.begin());
    o->pump_due_ = false;
    pump(*o);
  }
  return true;
}

inline void engine::serve_waiting_gets() noexcept {
  while (replies_.serve_wait_head != nullptr && tx_.free != nullptr) {
    reply_slot* s = replies_.serve_wait_head;
    replies_.serve_wait_head = s->wait_next;
    if (replies_.serve_wait_head == nullptr) replies_.serve_wait_tail = nullptr;
    s->wait_next = nullptr;
    if (error_) {
      free_slot(s);
      continue;
    }
    stage_slot* b = take(tx_);
    b->rs = s;
    b->req = s->wait_id;
    b->len = s->wait_len;
    if (!start_copy(*b, copy_engine::direction::to_host, s->lease.device(), b->mem, s->lease.data(), s->wait_len,
                    nullptr)) {
      continue;  // answered when the copy is done
    }
    s->lease.release();
    release_slot(*b);
    ++stats_->refused;
    send_answer(s, msg::get_reply, s->wait_id, status::remote_access, nullptr, 0);
  }
}

inline void engine::drop_waiting_gets() noexcept {
  while (reply_slot* s = replies_.serve_wait_head) {
    replies_.serve_wait_head = s->wait_next;
    s->wait_next = nullptr;
    free_slot(s);
  }
  replies_.serve_wait_tail = nullptr;
}

inline void engine::kick_waiters(bool rx) noexcept {
  if (!rx) serve_waiting_gets();
  std::vector<op*>& q = rx ? rx_wait_ : tx_wait_;
  while (!q.empty() && (rx ? rx_.free : tx_.free) != nullptr) {
    op* o = q.front();
    q.erase(q.begin());
    o->waiting_ = false;
    if (rx) {
      try_deliver_early(*o);
    } else {
      pump(*o);
    }
  }
}

inline void engine::wait_for_slot(op& o, bool rx) noexcept {
  if (o.waiting_) return;
  try {
    (rx ? rx_wait_ : tx_wait_).push_back(&o);
    o.waiting_ = true;
  } catch (...) {
    complete(o, errno_code(ENOMEM));
  }
}

inline void engine::stop_waiting(op& o) noexcept {
  for (std::vector<op*>* q : {&tx_wait_, &rx_wait_}) std::erase(*q, &o);
  o.waiting_ = false;
}

}  // namespace gdr::detail::proto
