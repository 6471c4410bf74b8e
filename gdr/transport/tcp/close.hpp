/// \file
/// The TCP connection's end: shutdown, the orderly close (half-close, read
/// until the peer's end of stream, the linger bound), and the watch that
/// sees the peer leave while the reader is paused.
#pragma once

#include <liburing.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <algorithm>
#include <cassert>
#include <chrono>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include <gdr/transport/tcp/connection.hpp>

namespace gdr::detail::tcp {

inline void connection::link_shutdown() noexcept {
  rx_paused_ = false;
  end_watch();
  ending_ = false;
  end_linger();
  // Wake the reads and writes in flight: a recv returns 0, a send EPIPE.
  if (sock_.valid()) ::shutdown(fd(), SHUT_RDWR);
  drop_unsent();
}

inline bool connection::link_close() noexcept {
  rx_paused_ = false;
  end_watch();
  if (!sock_.valid()) return false;
  ::shutdown(fd(), SHUT_WR);
  drop_unsent();
  ending_ = true;
  arm_linger();
  // A read in flight goes on and its bytes are dropped (one straight into
  // a destination is stopped by the engine: link_abort_target).
  if (!read_inflight_) read_rest();
  return true;
}

inline void connection::arm_watch() noexcept {
  if (watch_inflight_ || failed() || ending_ || !sock_.valid()) return;
  io_uring_sqe* sqe = sched().get_sqe();
  if (sqe == nullptr) return;  // the SQ refused it: the peer's end is seen when reading resumes
  io_uring_prep_poll_add(sqe, fd(), POLLRDHUP);
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&watch_op_));
  sched().note_submitted();
  watch_inflight_ = true;
}

inline void connection::end_watch() noexcept {
  if (watch_inflight_ && !watch_cancelled_) {
    watch_cancelled_ = true;
    sched().cancel(&watch_op_);
  }
}

inline void connection::on_watch(operation* o, int res, std::uint32_t) noexcept {
  connection* c = static_cast<conn_op*>(o)->self;
  proto::event_scope ev(*c);
  c->watch_inflight_ = false;
  c->watch_cancelled_ = false;
  if (c->rx_paused_ && !c->failed() && !c->ending_) {
    if (res > 0 && (res & (POLLERR | POLLHUP)) != 0) {
      c->on_link_failed(errc::connection_lost);
    } else if (res > 0 && (res & POLLRDHUP) != 0) {
      if (!c->unread_ends_with_close()) c->on_link_failed(errc::connection_lost);
    } else if (res == -ECANCELED) {
      c->arm_watch();  // paused again since the cancel was asked for
    }
    if (c->failed()) c->return_dropped();
  }
  c->on_io_done();
}

inline bool connection::unread_ends_with_close() noexcept {
  int queued = 0;
  if (::ioctl(fd(), FIONREAD, &queued) != 0 || queued < 0) return true;
  const std::size_t have = rx_end_ - rx_pos_;
  const std::size_t total = have + static_cast<std::size_t>(queued);
  std::unique_ptr<std::byte[]> all(new (std::nothrow) std::byte[total + 1]);
  if (!all) return true;
  std::memcpy(all.get(), rx_buf_ + rx_pos_, have);
  ssize_t got = queued == 0 ? 0 : ::recv(fd(), all.get() + have, static_cast<std::size_t>(queued), MSG_PEEK | MSG_DONTWAIT);
  if (got != queued) return got < 0 ? false : true;
  std::size_t at = 0;
  bool close_last = false;
  while (total - at >= wire::header_size) {
    gdr::tcp::frame_parse_result r =
        gdr::tcp::parse_frame(std::span<const std::byte>(all.get() + at, wire::header_size), options().max_message);
    if (r.status != gdr::tcp::frame_status::ok) return false;
    close_last = r.header.type == proto::msg::close;
    if (r.header.length > total - at - wire::header_size) return false;  // cut off in its payload
    at += wire::header_size + static_cast<std::size_t>(r.header.length);
  }
  return at == total && close_last;
}

inline void connection::read_rest() noexcept {
  rx_pos_ = rx_end_ = 0;
  skip_ = 0;
  submit_read(rx_buf_, rx_cap_, 0, false, false);
}

inline void connection::rest_done(int res) noexcept {
  if (read_direct_ && tgt_.active) {
    // The read into a destination that link_close stopped: free now.
    tgt_ = {};
    on_target_released();
  }
  if (res == 0 || (res < 0 && res != -ECANCELED && res != -EINTR && res != -EAGAIN)) {
    ending_ = false;
    end_linger();
    return_dropped();
    on_io_done();
    return;
  }
  read_rest();
}

inline void connection::arm_linger() noexcept {
  if (topts_.close_linger.count() <= 0) return;
  io_uring_sqe* sqe = sched().get_sqe();
  if (sqe == nullptr) return;  // the SQ refused it: the close's own timeout bounds the end
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(topts_.close_linger).count();
  linger_ts_.tv_sec = ns / 1000000000;
  linger_ts_.tv_nsec = ns % 1000000000;
  io_uring_prep_timeout(sqe, &linger_ts_, 0, 0);
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&linger_op_));
  sched().note_submitted();
  linger_inflight_ = true;
}

inline void connection::end_linger() noexcept {
  if (linger_inflight_ && !linger_cancelled_) {
    linger_cancelled_ = true;
    sched().cancel(&linger_op_);
  }
}

inline void connection::on_linger(operation* o, int, std::uint32_t) noexcept {
  connection* c = static_cast<conn_op*>(o)->self;
  proto::event_scope ev(*c);
  c->linger_inflight_ = false;
  c->linger_cancelled_ = false;
  // Still ending: the peer did not end its stream in time. Both halves
  // down: the read in flight returns 0 and ends it.
  if (c->ending_ && c->sock_.valid()) ::shutdown(c->fd(), SHUT_RDWR);
  c->on_io_done();
}

}  // namespace gdr::detail::tcp
