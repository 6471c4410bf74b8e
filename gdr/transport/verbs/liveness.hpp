/// \file
/// The verbs connection's liveness (members of `connection`, declared in
/// `connection.hpp`): device events about its queue pair, the keepalive,
/// rdma_cm's events, failure, and the kick that goes on from the loop.
///
/// Contract. An error completion, a device event about the queue pair
/// (polled every 100 ms), or rdma_cm's DISCONNECTED fails the engine once;
/// frames the peer sent before it left are taken from the completion queue
/// first. A peer that vanishes without a word (power, cable) is noticed by
/// the transport's retries: `endpoint_options::ack_timeout` and
/// `retry_count` bound how long a work request waits for an
/// acknowledgement, and an idle connection sends a keepalive (a zero-byte
/// RDMA WRITE) every `endpoint_options::keepalive`, so that a receive
/// waiting on a dead peer fails within about a second too (and unsignaled
/// requests at the end of a burst are accounted for).
#pragma once

#include <gdr/log.hpp>
#include <gdr/transport/verbs/connection.hpp>

namespace gdr::detail::verbs {

inline std::string connection::peer_name() const {
  if (id_ == nullptr) return "(closed)";
  sockaddr* a = rdma_get_peer_addr(id_);
  char ip[INET6_ADDRSTRLEN] = "?";
  unsigned port = ntohs(rdma_get_dst_port(id_));
  if (a->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a)->sin_addr, ip, sizeof ip);
    return std::string(ip) + ":" + std::to_string(port);
  }
  ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a)->sin6_addr, ip, sizeof ip);
  return "[" + std::string(ip) + "]:" + std::to_string(port);
}

inline void connection::on_tick() noexcept { keepalive_tick(); }

inline void connection::on_qp_event(ibv_event_type type) noexcept {
  proto::event_scope ev(*this);
  if (!failed()) {
    gdr::detail::log("verbs", "%s: device event %s: the connection fails", peer_name().c_str(),
                     ibv_event_type_str(type));
    on_link_failed(errc::connection_lost);
  }
  on_io_done();
}

/// Probes the peer if the connection has been idle for the keepalive
/// interval (called by the poller's tick).
inline void connection::keepalive_tick() noexcept {
  if (lane_lost_at_ != std::chrono::steady_clock::time_point{} && !failed() && !shut_ &&
      std::chrono::steady_clock::now() - lane_lost_at_ > std::chrono::seconds(1)) {
    proto::event_scope ev(*this);
    gdr::detail::log("verbs", "%s: the one-sided lane is gone and the connection did not end: it fails",
                     peer_name().c_str());
    on_link_failed(errc::connection_lost);
    return;
  }
  if (!established_ || shut_ || failed() || vopts_.keepalive.count() == 0) return;
  // Called every ~100 ms (the poller's tick): activity since the last
  // tick restarts the idle time; reading the clock per completion would
  // cost more than the whole keepalive.
  auto now = std::chrono::steady_clock::now();
  if (activity_ != tick_activity_) {
    tick_activity_ = activity_;
    last_activity_ = now;
    return;
  }
  if (now - last_activity_ < vopts_.keepalive) return;
  if (free_tx_ == nullptr || sq_used_ + 1 > sq_depth_) return;
  tx_slot* t = take_tx();
  t->keepalive = true;
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;  // zero bytes: no memory, no key checked
  // Always signaled: a failed unsignaled request completes to
  // unsignaled_work(), which tells no one, and the probe is there to
  // fail. It also accounts for unsignaled SENDs that nothing followed.
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr_id = t->wr_id();
  wr.num_sge = 0;
  // The scope's end cannot free this: the probe is in flight, or the
  // failure still flushes.
  proto::event_scope ev(*this);
  if (post_send_wrs(&wr, 1, t)) ++stats_.keepalives;
}

inline void connection::arm_cm_watch() noexcept {
  if (cm_watch_in_flight_ || shut_ || ch_ == nullptr) return;
  io_uring_sqe* sqe = sched().get_sqe();
  if (sqe == nullptr) return;
  io_uring_prep_poll_add(sqe, ch_->fd, POLLIN);
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&cm_watch_));
  sched().note_submitted();
  cm_watch_in_flight_ = true;
}

inline void connection::on_cm_readable(operation* o, int, std::uint32_t) noexcept {
  connection* c = static_cast<cm_op*>(o)->self;
  proto::event_scope ev(*c);
  c->cm_watch_in_flight_ = false;
  c->cm_events();
  c->on_io_done();
}

inline void connection::cm_events() noexcept {
  rdma_cm_event* ev = nullptr;
  while (ch_ != nullptr && rdma_get_cm_event(ch_, &ev) == 0) {
    rdma_cm_event_type type = ev->event;
    rdma_ack_cm_event(ev);
    switch (type) {
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
      case RDMA_CM_EVENT_TIMEWAIT_EXIT:
        if (!failed() && !shut_) {
          // What the peer sent before leaving is already in the
          // completion queue: take it first.
          poller_->drain();
          if (!failed() && !shut_) {
            if ((paused_ || held_) && backlog_n_ != 0) {
              peer_gone_ = true;  // after the kept frames (parse)
            } else {
              on_link_failed(errc::connection_lost);
            }
          }
        }
        break;
      default: break;
    }
  }
  if (!shut_) arm_cm_watch();
}

inline bool connection::protocol_fail() noexcept {
  if (!failed()) on_link_failed(errc::protocol_error);
  return false;
}

/// GPUDirect: bytes only the NIC may move cannot be moved by it. Loud,
/// and never a copy instead: the connection fails, and every pending
/// operation with it (`errc::gpudirect_unavailable`).
inline bool connection::gpudirect_fail(const char* why) noexcept {
  if (!failed()) {
    gdr::detail::log("verbs", "%s: GPUDirect: %s: the connection fails", peer_name().c_str(), why);
    on_link_failed(errc::gpudirect_unavailable);
  }
  return false;
}

inline void connection::fail_wc(const ibv_wc& wc) noexcept {
  if (wc.status != IBV_WC_WR_FLUSH_ERR)
    gdr::detail::log("verbs", "%s: work completion failed: %s", peer_name().c_str(), ibv_wc_status_str(wc.status));
  on_link_failed(wc_error(wc.status));
}

inline void connection::drop(frame& f) noexcept {
  f.where = in_dropped;
  dropped_.push_back(&f);
}

inline void connection::kick() noexcept {
  if (kick_posted_) return;
  kick_posted_ = true;
  sched().post(&kick_);
}

inline void connection::on_kick(remote_work* w) noexcept {
  connection* c = static_cast<kick_node*>(w)->self;
  proto::event_scope ev(*c);
  c->kick_posted_ = false;
  while (frame* f = c->dropped_.pop_front()) {
    f->where = nowhere;
    c->on_sent(*f, c->error() ? c->error() : std::error_code(errc::connection_lost));
  }
  // A flush that waited for room on the flush queue pair (woken).
  if (c->gate_.current() == nic_gate::state::flush_ready) c->post_flush();
  // Paused by the engine, or by a gate that opened without a completion
  // (a stopped placement): go on with the frames behind.
  if (!c->failed() && (c->paused_ || c->backlog_n_ != 0)) {
    c->paused_ = false;
    c->parse();
    c->pump_tx();
  }
  c->on_io_done();
}

}  // namespace gdr::detail::verbs
