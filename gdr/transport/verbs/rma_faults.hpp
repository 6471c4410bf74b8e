/// \file
/// The one-sided lane's faults and resets, the target side's notifications,
/// and the lane's end (members of `connection`; the lane's design is in
/// rma.hpp's file comment, "Faults").
#pragma once

#include <gdr/transport/verbs/connection.hpp>

namespace gdr::detail::verbs {

// ---------------------------------------------------------------- faults and resets

/// The lane's queue pair is (or is put) in the error state; once the
/// marker is back, it is reset (a fault) or done with (the end).
inline void connection::lane_break() noexcept {
  if (lane_phase_ == lane_phase::ready) lane_to(lane_phase::broken);
  lane_mark();
}

/// Puts the initiator queue pair in the error state (a local error leaves
/// it in RTS on some devices) and posts the marker, once.
inline void connection::lane_mark() noexcept {
  if (lane_marker_.posted || lane_init_ == nullptr) return;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(lane_init_, &a, IBV_QP_STATE);
  if (lane_out_ == 0) {
    // Nothing is with the NIC: nothing to wait for.
    if (lane_phase_ == lane_phase::broken) lane_begin_reset();
    return;
  }
  ibv_send_wr wr{};
  wr.wr_id = lane_marker_.wr_id();
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(lane_init_, &wr, &bad)) {
    // A device that refuses work on a queue pair in error: the lane's
    // memory cannot be given back safely before teardown; fail the
    // connection so that it is torn down (flushing everything).
    gdr::detail::log("verbs", "posting the one-sided lane's marker: %s", std::strerror(rc));
    if (!failed()) on_link_failed(errno_code(rc));
    return;
  }
  lane_marker_.posted = true;
}

/// Every work request is back: reset this side's queue pair and ask the
/// peer to reset its target; flushed pieces are posted again after.
inline void connection::lane_begin_reset() noexcept {
  lane_to(lane_phase::resetting);
  for (lane_job* j = lane_active_.head; j != nullptr; j = j->next)
    if (!j->faulted) j->posted = j->done;  // flushed: not executed
  ++lane_gen_;
  if (std::error_code ec = lane_reset_qp(lane_init_)) {
    lane_lost(ec, "resetting the one-sided queue pair");
    return;
  }
  lane_ctl_due_ |= lane_ctl_reset;
  maybe_send_credits();  // sends it now if a send slot and a credit are there
}

/// The peer's lane control message (`wire_header::lane`).
inline void connection::lane_control(const wire_header& w) noexcept {
  if (lane_init_ == nullptr || lane_phase_ == lane_phase::shut) return;
  if (w.type == wire_header::lane_reset) {
    // The peer's initiator was reset: reset the target it connects to
    // once the receives posted on it are back.
    lane_peer_gen_ = static_cast<std::uint32_t>(w.id);
    lane_target_reset_due_ = true;
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(lane_target_, &a, IBV_QP_STATE);
    lane_try_target_reset();
  } else if (w.type == wire_header::lane_ready) {
    if (lane_phase_ != lane_phase::resetting || static_cast<std::uint32_t>(w.id) != lane_gen_) return;  // stale
    if (std::error_code ec = lane_connect(lane_init_, peer_lane_target_, false)) {
      // Most likely the peer's end (its connection is gone, so is the
      // address vector): what waits fails as the connection does.
      lane_lost(ec, "connecting the one-sided queue pair again");
      return;
    }
    ++stats_.lane_resets;
    lane_to(lane_phase::ready);
    for (lane_job* j = lane_active_.head; j != nullptr;) {
      lane_job* next = j->next;
      if (j->faulted) lane_end_job(*j, errc::remote_access);
      j = next;
    }
    lane_pump();
  }
}

/// The lane could not be brought back (`why`, `ec`): almost always because
/// the peer is ending (its connection, and so the address the queue pairs
/// connect to, is gone). What the lane holds stays held and fails as the
/// connection ends, with its error (an orderly close is not a lost
/// connection), never with the low-level error of the call that failed.
/// If the connection does not end within a second, it is failed
/// (`keepalive_tick`): the lane is gone, and nothing may hang.
inline void connection::lane_lost(std::error_code ec, const char* why) noexcept {
  gdr::detail::log("verbs", "%s: %s; the one-sided lane waits for the connection's end", why, ec.message().c_str());
  lane_lost_at_ = std::chrono::steady_clock::now();
}

inline void connection::lane_try_target_reset() noexcept {
  if (!lane_target_reset_due_ || lane_rx_out_ != 0) return;
  lane_target_reset_due_ = false;
  std::error_code ec = lane_reset_qp(lane_target_);
  if (!ec) ec = lane_connect(lane_target_, peer_lane_init_, true);
  if (!ec) ec = lane_post_receives();
  if (ec) {
    lane_lost(ec, "resetting the one-sided target queue pair");
    return;
  }
  lane_ctl_due_ |= lane_ctl_ready;
  maybe_send_credits();
}

/// Sends the lane control message that is due, if a send slot and a
/// credit allow (else the next pump tries again).
inline void connection::lane_send_control() noexcept {
  if (lane_ctl_due_ == 0 || !established_ || shut_ || failed()) return;
  if (!credits_.can_consume(1) || free_tx_ == nullptr || sq_used_ + 1 > sq_depth_) return;
  wire_header w;
  w.kind = wire_header::lane;
  // The answer to the peer's reset first (the peer's lane waits for it).
  const bool ready = (lane_ctl_due_ & lane_ctl_ready) != 0;
  w.type = ready ? wire_header::lane_ready : wire_header::lane_reset;
  w.id = ready ? lane_peer_gen_ : lane_gen_;
  lane_ctl_due_ &= static_cast<std::uint8_t>(~(ready ? lane_ctl_ready : lane_ctl_reset));
  if (post_header(w, true) && lane_ctl_due_ != 0) lane_send_control();  // the other one, if due
}

// ---------------------------------------------------------------- the target side: notifications

inline void connection::on_lane_rx(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
  auto* r = static_cast<lane_rx*>(w);
  connection* c = r->c;
  if (c == nullptr) return;  // its connection is gone (lane_teardown)
  proto::event_scope ev(*c);
  c->lane_rx_done(*r, wc);
  c->on_io_done();
}

inline void connection::lane_rx_done(lane_rx& r, const ibv_wc& wc) noexcept {
  --lane_rx_out_;
  ++stats_.completions;
  ++activity_;
  if (wc.status != IBV_WC_SUCCESS) {
    // Flushed: the target queue pair went to the error state (a fault of
    // the peer's, or the end). The peer's reset posts every receive again.
    lane_try_target_reset();
    return;
  }
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    ++stats_.notifications;
    try {
      notes_.push_back(wc.imm_data);
    } catch (...) {
      on_link_failed(errno_code(ENOMEM));
      return;
    }
    wake_note_waiters();
  }
  if (shut_ || lane_target_reset_due_) {
    lane_try_target_reset();
    return;
  }
  ibv_recv_wr wr{};
  wr.wr_id = r.wr_id();
  wr.num_sge = 0;
  ibv_recv_wr* bad = nullptr;
  if (ibv_post_recv(lane_target_, &wr, &bad) == 0) ++lane_rx_out_;
}

inline bool connection::take_note(note_waiter& w) noexcept {
  if (!notes_.empty()) {
    w.value = notes_.front();
    notes_.pop_front();
    return true;
  }
  if (note_error_ || lane_init_ == nullptr) {
    w.ec = note_error_ ? note_error_ : std::error_code(errc::unsupported);
    return true;
  }
  w.run = [](remote_work* self) noexcept { static_cast<note_waiter*>(self)->h.resume(); };
  w.queued = true;
  w.next = nullptr;
  (note_tail_ != nullptr ? note_tail_->next : note_head_) = &w;
  note_tail_ = &w;
  return false;
}
inline void connection::drop_note_waiter(note_waiter& w) noexcept {
  if (!w.queued) return;
  note_waiter* prev = nullptr;
  for (note_waiter* x = note_head_; x != &w; x = x->next) prev = x;
  (prev != nullptr ? prev->next : note_head_) = w.next;
  if (note_tail_ == &w) note_tail_ = prev;
  w.queued = false;
}

inline void connection::wake_note_waiters() noexcept {
  while (note_head_ != nullptr && (!notes_.empty() || note_error_)) {
    note_waiter* w = note_head_;
    note_head_ = w->next;
    if (note_head_ == nullptr) note_tail_ = nullptr;
    w->queued = false;
    if (!notes_.empty()) {
      w->value = notes_.front();
      notes_.pop_front();
    } else {
      w->ec = note_error_;
    }
    sched().post(w);
  }
}

// ---------------------------------------------------------------- the end

/// The connection failed or ends, or the lane cannot go on: everything
/// waiting fails now, and what is posted when the marker is back.
inline void connection::lane_shutdown(std::error_code ec) noexcept {
  if (lane_init_ == nullptr) return;
  if (!ec) ec = errc::connection_lost;
  if (lane_phase_ != lane_phase::shut) {
    lane_to(lane_phase::shut);
    lane_error_ = ec;
  }
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(lane_target_, &a, IBV_QP_STATE);
  lane_target_reset_due_ = false;
  // Views reachable by the NIC are served by the peer from now on (the
  // connection may still be usable; the log says why the lane is not).
  set_direct_domain(0);
  for (lane_job* j = lane_active_.head; j != nullptr;) {
    lane_job* next = j->next;
    if (j->out == 0) lane_end_job(*j, j->ec && !j->faulted ? j->ec : lane_error_);
    j = next;
  }
  proto::op* o = std::exchange(lane_wait_head_, nullptr);
  lane_wait_tail_ = nullptr;
  while (o != nullptr) {
    proto::op* next = std::exchange(o->direct_next, nullptr);
    on_direct_done(*o, lane_error_);
    o = next;
  }
  lane_mark();  // the rest when the marker is back
  if (!note_error_) note_error_ = ec;
  wake_note_waiters();
}

}  // namespace gdr::detail::verbs
