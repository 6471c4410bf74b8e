/// \file
/// The TCP connection's reader: reads into the staging buffer or straight
/// into a payload's destination, spinning reads in busy-poll mode, and the
/// parser that hands each header to the engine.
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

inline void connection::link_resume() noexcept {
  if (rx_paused_) kick();
}

inline bool connection::link_abort_target() noexcept {
  if (!tgt_.active) return true;
  if (read_inflight_ && read_direct_) {
    // The kernel is writing into the destination: stop it. The read's
    // CQE (for a spinning read, the next poll) releases it; the rest of
    // the frame is skipped.
    tgt_.aborted = true;
    if (spin_pending_) {
      spin_cancel_ = true;
    } else {
      sched().cancel(&read_op_);
    }
    return false;
  }
  skip_ += (tgt_.want - tgt_.done) + tgt_.discard;
  tgt_ = {};
  return true;
}

inline void connection::pump() noexcept {
  while (!failed()) {
    std::size_t avail = rx_end_ - rx_pos_;
    if (skip_ > 0) {
      auto n = static_cast<std::size_t>(std::min<std::uint64_t>(skip_, avail));
      rx_pos_ += n;
      skip_ -= n;
      if (skip_ > 0) return read_staging();
      continue;
    }
    if (tgt_.active) {
      std::size_t n = std::min(tgt_.want - tgt_.done, avail);
      if (n != 0) {
        std::memcpy(tgt_.dst + tgt_.done, rx_buf_ + rx_pos_, n);
        rx_pos_ += n;
        tgt_.done += n;
      }
      if (tgt_.done == tgt_.want) {
        target_done();
        continue;
      }
      // The buffer is empty and the payload goes on: a small rest comes
      // through the staging buffer (with whatever follows it), a large
      // one straight into its destination.
      if (tgt_.want - tgt_.done <= direct_min_) return read_staging();
      return read_direct();
    }
    if (avail < wire::header_size) return read_staging();
    if (!parse_one()) return;
  }
}

inline bool connection::parse_one() noexcept {
  const std::byte* p = rx_buf_ + rx_pos_;
  gdr::tcp::frame_parse_result r =
      gdr::tcp::parse_frame(std::span<const std::byte>(p, wire::header_size), options().max_message);
  if (r.status != gdr::tcp::frame_status::ok) {
    protocol_fail(r.status);
    return false;
  }
  if (r.seq != rx_seq_) {
    protocol_fail(gdr::tcp::frame_status::bad_field);  // out of step (a lost or forged frame)
    return false;
  }
  proto::rx_plan plan = on_header(r.header);
  switch (plan.act) {
    case proto::rx_plan::action::pause:
      rx_paused_ = true;
      arm_watch();
      return false;
    case proto::rx_plan::action::fail:
      if (!failed()) protocol_fail(gdr::tcp::frame_status::bad_field);
      return false;
    case proto::rx_plan::action::place: break;
  }
  rx_pos_ += wire::header_size;
  ++rx_seq_;
  ++stats_.frames_in;
  large_ = r.header.length > direct_min_;
  tgt_ = {};
  tgt_.active = true;
  tgt_.dst = plan.dst;
  tgt_.want = plan.want;
  tgt_.discard = plan.discard;
  return !failed();
}

inline void connection::target_done() noexcept {
  rx_target t = std::exchange(tgt_, rx_target{});
  skip_ = t.discard;
  on_placed(t.direct);
}

inline bool connection::spinning() const noexcept {
  return topts_.spin_reads_in_busy_poll && sched().mode() == run_mode::busy_poll;
}

inline void connection::read_staging() noexcept {
  if (rx_pos_ == rx_end_) {
    rx_pos_ = rx_end_ = 0;
  } else if (rx_cap_ - rx_end_ < wire::header_size + direct_min_ && rx_pos_ != 0) {
    // Slide the partial frame to the front so that a header and a small
    // payload fit.
    std::memmove(rx_buf_, rx_buf_ + rx_pos_, rx_end_ - rx_pos_);
    rx_end_ -= rx_pos_;
    rx_pos_ = 0;
  }
  std::size_t n = rx_cap_ - rx_end_;
  assert(n != 0 && "staging buffer full with an incomplete frame");
  // After a large payload, ask for one header only: the next payload is
  // likely large too and should go straight to its destination, not
  // through here.
  if (large_ && rx_end_ == rx_pos_ && skip_ == 0 && !tgt_.active) n = wire::header_size;
  submit_read(rx_buf_ + rx_end_, n, 0, false, drained_);
}

inline void connection::grow_rx() noexcept {
  auto* b = new (std::nothrow) std::byte[rx_full_];
  if (b == nullptr) return;
  std::memcpy(b, rx_buf_ + rx_pos_, rx_end_ - rx_pos_);
  rx_end_ -= rx_pos_;
  rx_pos_ = 0;
  rx_big_.reset(b);
  rx_buf_ = b;
  rx_cap_ = rx_full_;
}

inline void connection::read_direct() noexcept {
  tgt_.direct = true;
  ++stats_.direct_reads;
  // MSG_WAITALL: io_uring retries short stream reads itself, one CQE for the
  // whole rest; on cancellation or end of stream the CQE carries the bytes
  // already placed (io_uring/net.c, done_io). A spinning read takes
  // whatever has arrived; pump() asks for the rest.
  submit_read(tgt_.dst + tgt_.done, tgt_.want - tgt_.done, MSG_WAITALL, true, false);
}

inline void connection::submit_read(std::byte* dst, std::size_t n, int flags, bool direct, bool poll_first) noexcept {
  // One SQE's length is 32 bits; a longer payload takes several reads.
  n = std::min<std::size_t>(n, std::size_t{1} << 30);
  rd_ = {dst, n, flags, poll_first};
  last_ask_ = n;
  read_inflight_ = true;
  read_direct_ = direct;
  ++stats_.reads;
  if (spinning() && start_spin()) return;
  // Inside an event handler, a staging read waits for the handler's end
  // (link_flush): the coroutines it resumes queue their sends first, and
  // the kernel runs SQEs in order. A reply then leaves before this side's
  // poll is armed, not after. Nothing can observe the gap: read_inflight_
  // already holds the reader, and the buffer it reads into is the
  // connection's own. A direct read targets a user's buffer and is issued
  // at once (a cancellation may need to reach it).
  if (in_handler() && !direct) {
    read_deferred_ = true;
    return;
  }
  issue_read();
}

inline void connection::issue_read() noexcept {
  read_deferred_ = false;
  io_uring_sqe* sqe = sched().get_sqe();
  if (sqe == nullptr) {
    // The SQ is full even after submitting (unreachable with sane ring
    // sizes): fail rather than stall silently.
    read_inflight_ = false;
    on_link_failed(errno_code(EBUSY));
    return;
  }
  io_uring_prep_recv(sqe, fd(), rd_.dst, rd_.n, rd_.flags);
  // The last read emptied the socket (it returned less than asked): the
  // next one would fail its first, non-blocking attempt. POLL_FIRST arms
  // the wait at once (io_uring.h, IORING_RECVSEND_POLL_FIRST, since 5.19).
  if (rd_.poll_first) sqe->ioprio |= IORING_RECVSEND_POLL_FIRST;
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&read_op_));
  sched().note_submitted();
}

inline bool connection::start_spin() noexcept {
  if (!spin_registered_) {
    try {
      sched().add_poller(spin_);
    } catch (...) {
      return false;
    }
    spin_registered_ = true;
  }
  spin_pending_ = true;
  sched().note_submitted();  // outstanding like an SQE's read: drain() waits for it
  return true;
}

inline poll_status connection::poll_spin() noexcept {
  if (!spin_pending_) return {};
  int res = -ECANCELED;
  if (!spin_cancel_) {
    if (!spinning()) {
      // The loop left busy-poll mode: wait through io_uring instead.
      spin_pending_ = false;
      sched().note_done();
      {
        proto::event_scope ev(*this);
        issue_read();
      }  // may have freed this
      return {.did_work = true};
    }
    ssize_t r = ::recv(fd(), rd_.dst, rd_.n, MSG_DONTWAIT);
    ++stats_.spin_reads;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return {};
    res = r < 0 ? -errno : static_cast<int>(r);
  }
  spin_pending_ = false;
  spin_cancel_ = false;
  sched().note_done();
  {
    proto::event_scope ev(*this);
    read_done(res);
  }  // may have freed this
  return {.did_work = true};
}

inline void connection::on_read(operation* o, int res, std::uint32_t) noexcept {
  connection* c = static_cast<conn_op*>(o)->self;
  proto::event_scope ev(*c);
  c->read_done(res);
}

inline void connection::read_done(int res) noexcept {
  read_inflight_ = false;
  if (ending_) return rest_done(res);
  std::size_t got = res > 0 ? static_cast<std::size_t>(res) : 0;
  if (read_direct_) {
    tgt_.done += got;
    if (tgt_.aborted) {
      // Stopped by the engine while the kernel wrote: skip the rest.
      skip_ += (tgt_.want - tgt_.done) + tgt_.discard;
      tgt_ = {};
      on_target_released();
    } else if (tgt_.active && tgt_.done == tgt_.want) {
      target_done();
    }
  } else {
    rx_end_ += got;
    drained_ = got < last_ask_;
    if (!drained_ && rx_cap_ < rx_full_) grow_rx();
  }
  if (!failed() && (res == 0 || (res < 0 && res != -ECANCELED && res != -EINTR && res != -EAGAIN))) {
    // End of stream without a close frame, or a reset: the peer is gone.
    on_link_failed(connection_error(res));
  }
  if (failed()) {
    if (tgt_.active && read_direct_ && !tgt_.aborted) {
      // Failed while the kernel wrote into a destination the engine still
      // counts as being placed: it is free now.
      tgt_ = {};
      on_target_released();
    }
    return_dropped();
    on_io_done();
    return;
  }
  pump();
}

}  // namespace gdr::detail::tcp
