/// \file
/// The shared-memory connection's end (members of `connection`, declared in
/// connection.hpp): the watch on the socket's hang-up (the peer's end, in
/// order or not), what the peer wrote before it ended, the orderly close,
/// the shutdown, the release, and the linger bound. The design is in
/// connection.hpp ("Liveness", "Orderly end").
#pragma once

#include <liburing.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>

#include <gdr/protocol/engine/event_scope.hpp>
#include <gdr/transport/shm/connection.hpp>

namespace gdr::detail::shm {

inline void connection::arm_watch() noexcept {
  io_uring_sqe* sqe = sched().get_sqe();
  if (sqe == nullptr) return;  // unreachable with sane ring sizes; the peer's end is then unseen
  io_uring_prep_poll_add(sqe, parts_.sock.get(), POLLRDHUP);
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&watch_op_));
  sched().note_submitted();
  watch_inflight_ = true;
}

inline void connection::on_watch(operation* o, int res, std::uint32_t) noexcept {
  connection* c = static_cast<conn_op*>(o)->self;
  proto::event_scope ev(*c);
  c->watch_inflight_ = false;
  const bool cancelled = std::exchange(c->watch_cancelled_, false) || res == -ECANCELED;
  if (!cancelled) {
    c->peer_gone_ = true;
    // Its mappings go (each once no copy uses it): an allocation of a
    // process that ended is never read again, and its pid may come back.
    if (c->ce_ != nullptr) c->ce_->ipc_forget(c->parts_.peer_pid);
    // What the peer wrote before it ended is read first: while the reader
    // waits for a GPU copy, its end is taken at the copy's completion.
    if (c->gpu_busy()) c->hangup_due_ = true;
    else c->peer_ended();
  }
  c->return_finished();
  c->on_io_done();
}

inline void connection::peer_ended() noexcept {
  // The copies the peer counted before it ended are done, whatever else.
  if (!sent_.empty()) settle_copied(true);
  if (ending_) {
    pump();
    end_done();
  } else if (live_ && !failed()) {
    // What the peer wrote (still in the ring).
    const bool all_copied = sent_.empty();
    if (reading()) pump();
    if (gpu_busy()) {
      hangup_due_ = true;  // a GPU copy runs again: go on when none does
      return;
    }
    // An orderly end: the peer's close frame came (or is in what the
    // paused reader has not read), or this side's close frame is out and
    // the peer copied everything before it (its end answers the close;
    // this side's close goes on to link_close, which finds it gone).
    const bool orderly = saw_close_ || (close_written_ && all_copied) ||
                         (rx_paused_ && unread_ends_with_close());
    if (!failed() && !orderly) on_link_failed(errc::connection_lost);
  }
  // The peer ended its half: it copies nothing more from this side (a
  // side ends its socket before it stops, and copies nothing after), so
  // what it did not copy is released, and the bounce buffers and the
  // reader's pause that waited on those frames go on.
  release_sent();
  // A shut-down connection that held them for the peer's end (the linger
  // timer as its bound) has nothing left to wait for.
  if (!live_ && !ending_) end_linger();
}

inline void connection::end_done() noexcept {
  ending_ = false;
  live_ = false;
  end_linger();
  cancel_bell();
  drop_unsent();
}

inline void connection::link_shutdown() noexcept {
  rx_paused_ = false;
  ending_ = false;
  live_ = false;
  cancel_bell();
  if (!sent_.empty() && !peer_gone_ && watch_inflight_ && parts_.sock.valid()) {
    // The peer may be copying from the payloads of `sent_`: end this side's
    // half only (the peer sees the hang-up at once and stops), and release
    // them at the peer's end (the watch) or after the bound (the linger
    // timer, which then shuts both halves).
    end_socket(SHUT_WR);
    if (!linger_inflight_) arm_linger(hold_bound());
  } else {
    end_linger();
    // The peer sees the hang-up at once; this side's watch returns too.
    end_socket(SHUT_RDWR);
  }
  drop_unsent();
}

inline bool connection::link_close() noexcept {
  rx_paused_ = false;
  if (!live_ || !parts_.sock.valid()) return false;
  end_socket(SHUT_WR);
  drop_unsent();
  ending_ = true;
  if (peer_gone_ || !watch_inflight_) {
    end_done();
    return true;
  }
  arm_linger(opts_.close_linger);
  kick();  // read and drop what the peer still writes
  return true;
}

inline void connection::link_release() noexcept {
  live_ = false;
  tx_ = ring{};
  rx_ = ring{};
  parts_.tx_segment.reset();
  parts_.rx_segment.reset();
  parts_.bell.reset();
  parts_.peer_bell.reset();
  parts_.sock.reset();
  fd_in_.close_all();
}

inline void connection::arm_linger(std::chrono::milliseconds bound) noexcept {
  if (bound.count() <= 0) return;
  io_uring_sqe* sqe = sched().get_sqe();
  if (sqe == nullptr) return;  // the close's own timeout bounds the end
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(bound).count();
  linger_ts_.tv_sec = ns / 1000000000;
  linger_ts_.tv_nsec = ns % 1000000000;
  io_uring_prep_timeout(sqe, &linger_ts_, 0, 0);
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&linger_op_));
  sched().note_submitted();
  linger_inflight_ = true;
}

inline void connection::on_linger(operation* o, int, std::uint32_t) noexcept {
  connection* c = static_cast<conn_op*>(o)->self;
  proto::event_scope ev(*c);
  c->linger_inflight_ = false;
  c->linger_cancelled_ = false;
  // Still ending, or still holding payloads the peer might copy: the peer
  // did not end in time. Both halves down: the watch returns and ends it.
  if (c->ending_ || !c->sent_.empty()) c->end_socket(SHUT_RDWR);
  c->on_io_done();
}

}  // namespace gdr::detail::shm
