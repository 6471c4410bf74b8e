/// \file
/// An operation's life and the endpoint's: construction, start, stop,
/// completion and resumption, failure, close, and the diagnostic
/// `describe`; also the out-of-line members of `op`, which need the whole
/// engine.
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

inline engine::engine(scheduler& s, memory_registry& reg, const protocol_options& o, protocol_stats& stats,
                      std::uint64_t caps)
    : sched_(&s), sched_alive_(s.alive_flag()), registry_(&reg), opts_(o), stats_(&stats),
      answers_(o.unexpected_messages) {
  if (opts_.rendezvous_threshold > opts_.max_message) opts_.rendezvous_threshold = opts_.max_message;
  // Room is granted back in quarters of the peer's budget (maybe_grant).
  room_.grant_bytes = std::max<std::uint64_t>(opts_.unexpected_bytes / 4, 1);
  room_.grant_msgs = std::max<std::uint64_t>(opts_.unexpected_messages / 4, 1);
  std::size_t n = std::max<std::size_t>(opts_.reply_slots, 1);
  replies_.limit = n;
  resume_node_.self = this;
  resume_node_.run = &on_resume_node;
  chunk_ = std::max<std::size_t>(opts_.staging.chunk, 1);
  hello_.hdr.type = msg::hello;
  hello_.hdr.size = opts_.max_message;
  hello_.hdr.addr = chunk_;
  hello_.hdr.tag = caps | caps::atomics;  // every engine serves atomics
  hello_.hdr.id = version;
  hello_.hdr.key = n;  // the requests the peer may have unanswered here
}

inline engine::~engine() {
  if (abandoned_ && *sched_alive_) sched_->note_done();  // counted by abandon(): the flag never comes back
  while (early_msg* m = early_.pop_front()) delete m;
}

inline std::string engine::describe() const {
  std::string out;
  auto op_text = [](const op& o) {
    static const char* const kinds[] = {"send", "recv", "put", "get", "close"};
    const auto k = static_cast<std::size_t>(o.kind_);
    return std::string(k < 5 ? kinds[k] : "op") + "(" + std::to_string(o.size_) + "B tag " + std::to_string(o.tag_) +
           " stage " + std::to_string(static_cast<int>(o.stage_)) + (o.dev_ >= 0 ? " dev" : "") +
           (o.remote_dev_ ? " rdev" : "") + " done " + std::to_string(o.done_) + "/" + std::to_string(o.total_) + ")";
  };
  auto list = [&](const char* name, const op_list& l) {
    if (l.empty()) return;
    out += std::string(" ") + name + "[";
    for (const op* o = l.head; o != nullptr; o = o->next_) out += op_text(*o) + (o->next_ ? " " : "");
    out += "]";
  };
  auto vec = [&](const char* name, const std::vector<op*>& v) {
    if (v.empty()) return;
    out += std::string(" ") + name + "[";
    for (const op* o : v) out += op_text(*o) + " ";
    out += "]";
  };
  auto pool = [&](const char* name, const stage_pool& p) {
    out += std::string(" ") + name + " " + std::to_string(p.in_use) + "/" + std::to_string(p.count) + "{";
    for (std::size_t i = 0; i < p.count; ++i) {
      const stage_slot& b = p.slots[i];
      if (b.owner != nullptr) out += op_text(*b.owner);
      else if (b.rs != nullptr) out += "served";
      else continue;
      out += std::string(b.copying ? " copying" : "") + (b.ready ? " ready" : "") + (b.posted ? " posted" : "") + "; ";
    }
    out += "}";
  };
  out += "credits " + std::to_string(credits_) + " msgs " + std::to_string(room_.send_msgs) + " bytes " +
         std::to_string(room_.send_bytes) + " holds " + std::to_string(room_.order_holds) + (paused_ ? " PAUSED" : "") +
         " early " + std::to_string(early_.size);
  if (!deferred_.empty()) out += " deferred " + std::to_string(deferred_.size());
  if (answers_.held() != 0) out += " answers " + std::to_string(answers_.held());
  if (withdrawals_.announcements() != 0) out += " withdrawn " + std::to_string(withdrawals_.announcements());
  list("held", held_);
  list("announced", announced_);
  list("recvs", recvs_);
  list("awaiting", awaiting_data_);
  list("rma", rma_);
  list("direct", direct_);
  list("staging", staging_);
  list("send_wait", room_.send_wait);
  list("credit_wait", credit_wait_);
  {
    std::size_t n = 0;
    for (const reply_slot* w = replies_.serve_wait_head; w != nullptr; w = w->wait_next) ++n;
    if (n != 0) out += " serve_wait " + std::to_string(n);
  }
  vec("tx_wait", tx_wait_);
  vec("rx_wait", rx_wait_);
  vec("credit_pumps", credit_pumps_);
  pool("tx", tx_);
  pool("rx", rx_);
  return out;
}

inline bool engine::deletable() const noexcept {
  return attached_ == 0 && ready_head_ == nullptr && !resume_posted_ && copies_ == 0 && outbox_head_ == nullptr &&
         deferred_.empty() && link_quiet();
}

inline void engine::abandon() noexcept {
  abandoned_ = true;
  // Until it frees itself it counts as in flight, so drain() and the
  // scheduler's teardown wait for it: what its transport still waits for
  // (a NIC's flushed requests, a copy) completes through pollers, which
  // the scheduler does not count. ~engine gives it back. (Not when the
  // scheduler is gone: an endpoint that outlived it touches nothing of it.)
  if (*sched_alive_) sched_->note_submitted();
  event_scope ev(*this);  // its end frees this once the transport is quiet
  if (!error_) fail(errc::closed);
  abort_link();  // an orderly end still under way
}

inline bool engine::begin(op& o) noexcept {
  // A get of an exposure::checked registration's Device memory: over CUDA
  // IPC the answer would be the owner's allocation, mapped here; staged,
  // the owner copies the bytes out (and refuses to answer otherwise).
  const bool owner_copies = o.kind_ == op::kind::get && o.remote_dev_ && o.owner_checked_ &&
                            direct_path_ == transfer_path::cuda_ipc;
  if (device_direct_ && (o.dev_ >= 0 || o.remote_dev_) && !owner_copies) {
    // GPUDirect: not staged; the NIC moves the bytes.
    o.nic_dev_ = o.dev_;
    o.remote_nic_ = o.remote_dev_;
    o.dev_ = -1;
    o.remote_dev_ = false;
  }
  switch (o.kind_) {
    case op::kind::recv: return begin_recv(o);
    case op::kind::close: return begin_close(o);
    default: return begin_out(o);
  }
}

inline void engine::cancel(op& o, std::error_code why) noexcept {
  if (o.result_set_ || o.stop_due_) return;
  if (link_calls_now()) {
    do_cancel(o, why);
    return;
  }
  o.stop_due_ = true;
  o.stop_reason_ = why;  // kept until drain() hands it to do_cancel
  o.stop_next_ = nullptr;
  (stops_tail_ ? stops_tail_->stop_next_ : stops_head_) = &o;
  stops_tail_ = &o;
  due();
}

inline void engine::do_cancel(op& o, std::error_code why) noexcept {
  if (o.result_set_) return;
  switch (o.kind_) {
    case op::kind::recv: complete(o, why); return;
    case op::kind::close:
      complete(o, why);
      if (!error_) fail(errc::closed);  // stop flushing: abort
      abort_link();                      // stop waiting for the peer's end: abort
      return;
    case op::kind::send: cancel_send(o, why); return;
    case op::kind::put:
    case op::kind::get:
      if (o.stage_ == op::stage::direct) {
        if (o.direct_out_ && !link_direct_withdraw(o)) {
          o.stop_reason_ = why;  // the NIC has it: it ends when the NIC is done
          return;
        }
        o.direct_out_ = false;
        complete(o, why);
        return;
      }
      if (o.segmented()) {
        // Requests not yet written are withdrawn (try_finish); answers
        // to those out are dropped.
        complete(o, why);
        return;
      }
      if (o.stage_ == op::stage::awaiting && o.f1_.queued && withdraw(o.f1_)) {
        // The request never left: no answer will come.
        o.f1_.queued = false;
        credit_back();
        delist(o);
        o.to(op::stage::idle);
      } else if (o.f1_.queued && link_committed(o.f1_)) {
        // Being written: it completes with `why` once the request is out
        // (a put's payload is still in the kernel's hands).
        o.stop_reason_ = why;
        return;
      }
      // Its answer, if one comes, is dropped.
      complete(o, why);
      return;
  }
}

inline void engine::push_ready(op& o) noexcept {
  o.ready_next_ = nullptr;
  (ready_tail_ ? ready_tail_->ready_next_ : ready_head_) = &o;
  ready_tail_ = &o;
  // Completed outside an event (a failure found by a user's call): resume
  // it from the loop.
  if (busy_ == 0) post_resume();
}

inline void engine::record(op& o) noexcept {
  if (o.ec_) {
    ++stats_->failed;
    if (o.ec_ == errc::truncated) ++stats_->truncated;
    return;
  }
  switch (o.kind_) {
    case op::kind::send:
      ++stats_->sends;
      stats_->bytes_sent += o.bytes_;
      ++(o.proto_ == wire_protocol::rendezvous ? stats_->rendezvous_sends : stats_->eager_sends);
      break;
    case op::kind::put: ++stats_->puts; stats_->bytes_sent += o.bytes_; break;
    case op::kind::recv: ++stats_->recvs; stats_->bytes_received += o.bytes_; break;
    case op::kind::get: ++stats_->gets; stats_->bytes_received += o.bytes_; break;
    case op::kind::close: return;
  }
  // Device memory on either side took the staged path, or GPUDirect RDMA,
  // whatever moved.
  if (o.dev_ >= 0 || o.remote_dev_) o.path_ = transfer_path::staged_pinned;
  if (o.nic_dev_ >= 0 || o.remote_nic_) o.path_ = direct_path_;
  ++stats_->by_path[static_cast<std::size_t>(o.path_)];
  last_path_ = o.path_;
}

inline void engine::start_protocol() noexcept {
  post(hello_);
  // The first grant of early-message room (see "Early credits").
  room_.f.hdr = header{};
  room_.f.hdr.type = msg::credit;
  room_.f.hdr.size = opts_.unexpected_bytes;
  room_.f.hdr.id = std::max<std::size_t>(opts_.unexpected_messages, 1);
  post(room_.f);
}

inline bool engine::begin_close(op& o) noexcept {
  if (closing_) return false;  // a second close: nothing more to do
  closing_ = true;
  o.f1_.owner = &o;
  close_op_ = &o;
  if (error_) {
    // Failed already: nothing to flush. Wait only for the transport to
    // be quiet. An orderly end under way (the peer closed first) is
    // waited for like one of this side's own: it succeeds when it has
    // ended, and this close's timeout or stop aborts it.
    if (link_end_ == link_end::close_due || (link_end_ == link_end::ending && !link_quiet())) return true;
    o.result_set_ = true;
    if (link_quiet()) {
      close_op_ = nullptr;
      link_release();
      return false;
    }
    return true;
  }
  drop_kept_messages();
  // The close frame follows every send already started: those waiting
  // for the peer's hello, and rendezvous sends until their receive has
  // taken them or the peer has declined them (maybe_post_close).
  maybe_post_close();
  return true;
}

inline void engine::maybe_post_close() noexcept {
  if (close_op_ == nullptr || close_posted_ || error_ || close_op_->result_set_) return;
  // Held sends wait for the peer's hello; the close frame itself needs
  // none (this side's own hello is already ahead of it).
  if (!held_.empty() || !room_.send_wait.empty() || !announced_.empty() || rendezvous_out_ != 0) return;
  // A staged eager send posts its frame once its copy is done: the close
  // frame must not overtake it.
  for (op* o = staging_.head; o != nullptr; o = o->next_)
    if (o->kind_ == op::kind::send) return;
  close_posted_ = true;
  op& o = *close_op_;
  o.f1_.hdr = header{};
  o.f1_.hdr.type = msg::close;
  post(o.f1_);
}

inline void engine::complete(op& o, std::error_code ec) noexcept {
  if (o.result_set_) return;
  o.result_set_ = true;
  o.ec_ = ec;
  switch (o.stage_) {
    case op::stage::sending: --rendezvous_out_; break;
    case op::stage::awaiting:
      if (o.kind_ == op::kind::recv) {
        // The data will come: drop it.
        if (!error_) remembered(withdrawals_.remember_token(o.id_));
      } else if (!error_ && !o.segmented()) {
        // A request the peer has (or will have) seen: its answer must be
        // recognised and dropped.
        remembered(withdrawals_.remember_answer(o.id_));
      }
      break;
    case op::stage::announced:
      // No rtr has come: withdrawn here, whatever the peer does; its
      // announcement tells the peer and answers a late rtr.
      end_announcement(o);
      break;
    default: break;
  }
  delist(o);
  // One test for the queues and holdings a small message never has.
  if (o.waiting_ | o.pump_due_ | o.credit_due_ | o.holds_order_ | o.direct_due_ | (o.early_ != nullptr)) {
    if (o.direct_due_) {
      std::erase(direct_due_, &o);  // never handed to the transport
      o.direct_due_ = false;
    }
    if (o.waiting_) stop_waiting(o);
    if (o.pump_due_) {
      std::erase(pumps_, &o);
      o.pump_due_ = false;
    }
    if (o.credit_due_) {
      std::erase(credit_pumps_, &o);
      o.credit_due_ = false;
    }
    release_order(o);
    if (o.early_ != nullptr) {
      delete o.early_;
      o.early_ = nullptr;
    }
  }
  if (o.segmented() && o.kind_ != op::kind::send && o.kind_ != op::kind::recv && o.out_ != 0 && !error_) {
    // Answers to the requests out will be dropped; requests not yet
    // written are taken back when it finishes (release_segments), each
    // one answer fewer to drop.
    remembered(withdrawals_.remember_range(o.id_, o.id_ + o.nseg_, o.out_));
    o.answers_dropped_ = true;
  }
  if (o.placing_ && (cur_.kind == target::op_payload || cur_.kind == target::via_host) && cur_.o == &o)
    request_abort();
  if (cur_.kind == target::stage_rx && cur_.b->owner == &o) request_abort();
  o.to(op::stage::idle);
  if (closing_ && o.kind_ == op::kind::send) maybe_post_close();
  try_finish(o);
}

inline void engine::try_finish(op& o) noexcept {
  if (!o.result_set_ || o.finished_ || o.placing_) return;
  const bool calls_link = held_by_link(o.f1_) || held_by_link(o.f2_) || o.slots_ != 0 || o.direct_out_ ||
                          o.kind_ == op::kind::close;
  if (!calls_link) {
    // Nothing of it is with the transport (a small message's usual end).
    if (o.copies_ == 0) finish_unlinked(o);
    return;
  }
  if (link_calls_now()) {
    finish_now(o);
    return;
  }
  if (o.finish_due_) return;
  o.finish_due_ = true;
  o.due_next_ = nullptr;
  (finishes_tail_ ? finishes_tail_->due_next_ : finishes_head_) = &o;
  finishes_tail_ = &o;
  due();
}

inline void engine::finish_now(op& o) noexcept {
  if (!o.result_set_ || o.finished_ || o.placing_) return;
  if (held_by_link(o.f1_) || held_by_link(o.f2_)) {
    if (!frames_released(o)) return;
  }
  // A direct operation the NIC has: on_direct_done finishes it.
  if (o.direct_out_) {
    if (!link_direct_withdraw(o)) return;
    o.direct_out_ = false;
  }
  // Copies still write or read its memory; its segments' frames are
  // still with the transport.
  if (o.slots_ != 0 && !release_segments(o)) return;
  if (o.copies_ != 0) return;
  if (o.kind_ == op::kind::close) {
    if (!link_quiet()) return;  // close() returns when the transport is quiet
    close_op_ = nullptr;
    link_release();
  }
  finish_unlinked(o);
}

inline void engine::finish_unlinked(op& o) noexcept {
  if (o.stop_due_ || o.finish_due_) unlink_due(o);  // it may resume (and its frame end) before the next drain
  o.finish();
}

inline bool engine::frames_released(op& o) noexcept {
  for (frame* f : {&o.f1_, &o.f2_}) {
    if (!held_by_link(*f)) continue;
    // An rtr is never withdrawn: the sender waits for it (the data it
    // brings is dropped).
    if (f->hdr.type == msg::rtr && !error_) return false;
    const bool was_queued = f->queued;
    if (!withdraw(*f)) return false;  // committed or being written: waits for on_sent
    if (was_queued) f->queued = false;
  }
  return true;
}

inline void engine::remembered(bool ok) noexcept {
  if (!ok) fail(errno_code(ENOMEM));
}

inline void engine::fail(std::error_code ec, bool in_order) noexcept {
  if (error_) return;
  error_ = ec;
  if (link_calls_now()) {
    end_link(in_order);
  } else {
    link_end_ = in_order ? link_end::close_due : link_end::abort_due;
    due();
  }
  while (op* o = held_.head) complete(*o, ec);
  while (op* o = announced_.head) complete(*o, ec);
  while (op* o = recvs_.head) complete(*o, ec);
  while (op* o = awaiting_data_.head) complete(*o, ec);
  while (op* o = rma_.head) complete(*o, ec);
  while (op* o = direct_.head) complete(*o, ec);  // those the NIC has finish when it gives them back
  while (op* o = credit_wait_.head) complete(*o, ec);
  while (op* o = room_.send_wait.head) complete(*o, ec);
  // A receive in staging_ is copying a kept message into device memory:
  // its bytes are all here, so it completes as kept messages do.
  for (op* o = staging_.head; o != nullptr;) {
    op* next = o->next_;
    if (o->kind_ != op::kind::recv) complete(*o, ec);
    o = next;
  }
  // Announcements kept can no longer be answered; after this side's
  // close nothing kept is received any more.
  for (early_msg* m = early_.head; m != nullptr;) {
    early_msg* next = m->next;
    if (m->rts || closing_) {
      if (!m->rts) early_bytes_ -= m->size;
      early_.erase(m);
      delete m;
    }
    m = next;
  }
  drop_waiting_gets();
  // Nothing late comes any more; an announcement whose frame the
  // transport still holds is freed when it comes back.
  withdrawals_.clear_ids();
  while (announcement* a = withdrawals_.pop()) {
    a->st = announcement::state::over;
    a->next = announcement::due::none;
    if (!held_by_link(*a)) delete a;
  }
  // Deferred placements: their operations fail now and finish when the
  // transport gives the memory back (on_deferred_placed).
  for (const auto& d : deferred_)
    if (d.second.kind == target::op_payload) complete(*d.second.o, ec);
  if (cur_.kind == target::op_payload || cur_.kind == target::via_host) {
    complete(*cur_.o, ec);
  } else if (cur_.kind == target::stage_rx && cur_.b->owner != nullptr) {
    complete(*cur_.b->owner, ec);  // a receive that left every list with its last segment
  } else {
    request_abort();
  }
  if (close_op_ != nullptr && !in_order) {
    // Nothing more can be flushed: closing a failed endpoint succeeds.
    complete(*close_op_, {});
    try_finish(*close_op_);
  }
}

inline void engine::end_link(bool in_order) noexcept {
  if (in_order) {
    link_end_ = link_end::ending;
    if (!link_close()) link_end_ = link_end::shut;
  } else {
    link_end_ = link_end::shut;
    link_shutdown();
  }
  settle_close();
}

inline void engine::abort_link() noexcept {
  switch (link_end_) {
    case link_end::close_due: link_end_ = link_end::abort_due; due(); return;
    case link_end::ending:
      if (link_calls_now()) {
        link_end_ = link_end::shut;
        link_shutdown();
      } else {
        link_end_ = link_end::abort_due;
        due();
      }
      return;
    default: return;
  }
}

inline void engine::settle_close() noexcept {
  if (close_op_ == nullptr) return;
  op& o = *close_op_;
  if (!o.result_set_ && (link_end_ == link_end::ending || link_end_ == link_end::shut) && link_quiet())
    complete(o, {});
  try_finish(o);
}

inline void engine::abort_current() noexcept {
  target t = std::exchange(cur_, target{});
  if (t.kind == target::none || t.kind == target::discard) return;
  cur_.kind = target::discard;  // the transport drops the rest
  assert(link_calls_now() && "gdr: the engine stopped a placement from inside a transport event");
  if (link_abort_target()) {
    release_target(t);
  } else {
    aborted_ = t;
  }
}

inline void engine::release_target(const target& t) noexcept {
  switch (t.kind) {
    case target::op_payload:
      t.o->placing_ = false;
      try_finish(*t.o);
      break;
    case target::store: delete t.m; break;
    case target::serve_put: free_slot(t.s); break;
    case target::via_host:
      delete t.m;
      t.o->placing_ = false;
      try_finish(*t.o);
      break;
    case target::stage_rx: {
      stage_slot& b = *t.b;
      if (reply_slot* s = b.rs) {
        release_slot(b);
        free_slot(s);  // a failed endpoint sends nothing
      } else {
        op& o = *b.owner;
        o.placing_ = false;
        release_slot(b);
        try_finish(o);
      }
      break;
    }
    default: break;
  }
}

inline void engine::post_resume() noexcept {
  if (resume_posted_) return;
  resume_posted_ = true;
  sched_->post(&resume_node_);
}

inline void engine::on_resume_node(remote_work* w) noexcept {
  engine* e = static_cast<resume_node*>(w)->self;
  event_scope ev(*e);
  e->resume_posted_ = false;
}


inline void op::throw_error() const {
  if (ec_ == errc::truncated) {
    std::string what = "message of " + std::to_string(msg_size_) + " bytes truncated to " + std::to_string(bytes_);
    throw gdr::error(ec_, what);
  }
  if (what_ != nullptr) throw gdr::error(ec_, what_);
  throw gdr::error(ec_);
}

inline bool op::start(std::coroutine_handle<> h, std::stop_token coro_stop) noexcept {
  // Misuse, refused in every build before anything of the engine is touched
  // (a thread other than its loop's would race with it).
  if (GDR_UNLIKELY(eng_ == nullptr || scheduler::current() != &eng_->sched())) return refuse_start();
  if (coro_stop.stop_requested() || opts_.stop.stop_requested()) {
    ec_ = errc::cancelled;
    eng_->record(*this);
    return false;
  }
  waiter_ = h;
  // Counted as pending before it starts: whatever completes it, even during
  // begin(), resumes it through the loop, never from inside this call (no
  // event handler is running: begin() does not call leave()).
  prime();
  eng_->note_attached();
  if (!eng_->begin(*this)) {
    eng_->note_detached();
    result_set_ = true;
    finished_ = true;
    to(stage::idle);
    eng_->record(*this);
    return false;
  }
  if (finished_) return true;  // completed during begin(): resumes from the loop
  arm(opts_.stop, std::move(coro_stop), opts_.timeout);
  return true;
}

inline scheduler& op::cancel_scheduler() const noexcept { return eng_->sched(); }

inline void op::on_stop(std::error_code why) noexcept { eng_->cancel(*this, why); }

inline void op::on_settled() noexcept { eng_->push_ready(*this); }

template <class F>
inline void op::in_event(F&& f) noexcept {
  event_scope ev(*eng_);  // its end may resume this operation's coroutine, which may end it
  f();
}

inline void op::finish() noexcept {
  finished_ = true;
  eng_->record(*this);
  settle();
}

}  // namespace gdr::detail::proto
