/// \file
/// The TCP connection's writer: frames posted by the engine, gathered into
/// batches (sendmsg, send, or a direct non-blocking write in busy-poll
/// mode), sealed, and handed back to the engine once written or dropped.
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

inline void connection::link_post(frame& f) noexcept {
  assert((fast_rest_ == nullptr || fast_rest_ == &f) && "gdr tcp: a frame posted between link_send_now and its post");
  f.queued = true;
  f.in_flight = false;
  if (fast_rest_ == &f) {
    fast_rest_ = nullptr;  // sealed, partly written: the rest goes first
  } else {
    f.sealed = false;
    f.written = 0;
  }
  if (failed()) {
    // Nothing will be written: hand it back from the loop, not from
    // inside the caller (an operation must not complete before it waits).
    f.queued = true;
    drop(f);
    kick();
    return;
  }
  f.where = in_tx;
  tx_.push_back(&f);
  if (direct_writes() && in_handler()) {
    // Posted inside an event handler: written by a system call at its end
    // (link_flush), with whatever else its coroutines queue. Posted
    // outside one (from a caller's co_await), it goes to io_uring: an
    // operation must not complete before it has suspended.
    write_deferred_ = true;
    return;
  }
  start_write(false);
}

/// The eager fast path (see the file comment of connection.hpp): one
/// non-blocking write of the whole frame, copied into the small buffer.
/// Short of room, nothing or part of it is written; it then goes by
/// link_post, which the engine calls at once, and the part written stays
/// written (sealed, at the head of the queue, the rest through io_uring).
inline bool connection::link_send_now(frame& f) noexcept {
  const std::size_t total = wire::header_size + f.hdr.length;
  if (total > small_write || !tx_.empty() || write_inflight_ || write_blocked_ || failed() || !topts_.fast_sends ||
      f.hdr.type != proto::msg::eager)
    return false;
  // One per loop turn: a coroutine that sends on and on yields to the rest
  // of the loop (its next send suspends) instead of writing until the
  // socket is full.
  const std::uint64_t turn = sched().stats().iterations;
  if (turn == fast_turn_) return false;
  seal(f);
  std::memcpy(small_buf_, f.encoded, wire::header_size);
  if (f.hdr.length != 0) std::memcpy(small_buf_ + wire::header_size, f.payload, f.hdr.length);
  // MSG_NOSIGNAL: see start_write.
  const ssize_t r = ::send(fd(), small_buf_, total, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (r == static_cast<ssize_t>(total)) {
    fast_turn_ = turn;
    tx_path_ = transfer_path::host_eager;
    f.sealed = false;
    ++stats_.writes;
    ++stats_.fast_sends;
    ++stats_.frames_out;
    return true;
  }
  // A full socket, or an error the write through link_post reports.
  write_blocked_ = true;
  if (r <= 0) {
    f.sealed = false;
    --tx_seq_;
    return false;
  }
  ++stats_.writes;
  ++stats_.fast_short;
  f.written = static_cast<std::size_t>(r);
  fast_rest_ = &f;
  return false;
}

inline bool connection::link_withdraw(frame& f) noexcept {
  if (!f.queued || f.in_flight) return false;
  if (f.sealed && !failed()) return false;
  (f.where == in_dropped ? dropped_ : tx_).erase(&f);
  f.where = nowhere;
  f.queued = false;
  return true;
}

inline void connection::drop_unsent() noexcept {
  for (frame* f = tx_.head; f != nullptr;) {
    frame* next = f->next;
    if (!f->in_flight) {
      tx_.erase(f);
      drop(*f);
    }
    f = next;
  }
  if (!dropped_.empty()) kick();
}

inline void connection::drop(frame& f) noexcept {
  f.where = in_dropped;
  dropped_.push_back(&f);
}

inline void connection::return_dropped() noexcept {
  while (frame* f = dropped_.pop_front()) {
    f->where = nowhere;
    on_sent(*f, error());
  }
}

inline void connection::seal(frame& f) noexcept {
  f.seq = tx_seq_++;
  gdr::tcp::encode_frame(f.hdr, f.seq, f.encoded);
  f.sealed = true;
}

inline bool connection::direct_writes() const noexcept {
  return topts_.direct_writes_in_busy_poll && sched().mode() == run_mode::busy_poll;
}

inline bool connection::grow_iov(std::size_t used) noexcept {
  if (iov_big_) return false;
  auto* big = new (std::nothrow) iovec[2 * max_batch];
  if (big == nullptr) return false;
  std::copy_n(iov_small_, used, big);
  iov_big_.reset(big);
  msg_.msg_iov = big;
  return true;
}

inline std::size_t connection::gather() noexcept {
  std::size_t iovn = 0;
  std::size_t payload = 0;
  std::size_t n = 0;
  // Locals: stores through the array must not make the loop reload members.
  iovec* iov = msg_.msg_iov;
  std::size_t cap = iov_big_ ? 2 * max_batch : iov_inline;
  for (frame* f = tx_.head; f != nullptr && n < max_batch; f = f->next) {
    // A frame takes up to two iovecs.
    if (iovn + 2 > cap) {
      if (!grow_iov(iovn)) break;
      iov = msg_.msg_iov;
      cap = 2 * max_batch;
    }
    if (!f->sealed) seal(*f);
    f->in_flight = true;
    std::size_t off = f->written;
    if (off < wire::header_size) {
      iov[iovn++] = {f->encoded + off, wire::header_size - off};
      off = 0;
    } else {
      off -= wire::header_size;
    }
    if (f->hdr.length > off) {
      // sendmsg only reads through iov_base; iovec has no const member.
      iov[iovn++] = {const_cast<std::byte*>(f->payload) + off, static_cast<std::size_t>(f->hdr.length) - off};
      payload += f->hdr.length - off;
    }
    ++n;
    if (payload >= batch_bytes) break;
  }
  batch_n_ = n;
  msg_.msg_iovlen = iovn;
  zc_write_ = topts_.zero_copy_send_threshold != 0 && payload >= topts_.zero_copy_send_threshold;
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < iovn; ++i) bytes += iov[i].iov_len;
  small_ = bytes <= small_write && !zc_write_;
  if (small_) {
    // A small batch is copied into one buffer and sent with a plain send:
    // the kernel then skips copying in a msghdr and importing an iovec
    // array, which costs more than copying these few bytes here.
    std::size_t off = 0;
    for (std::size_t i = 0; i < iovn; ++i) {
      std::memcpy(small_buf_ + off, iov[i].iov_base, iov[i].iov_len);
      off += iov[i].iov_len;
    }
  }
  return bytes;
}

inline void connection::start_write(bool direct) noexcept {
  while (!write_inflight_ && !failed() && !tx_.empty()) {
    if (write_blocked_) {
      // The socket was full: nothing is gathered (so nothing sealed) until
      // it has room again. A write handed to io_uring now would wait in the
      // kernel with its whole batch, and every frame in it would stay
      // committed for as long as the peer does not read; only a frame the
      // kernel has begun to take is, this way.
      wait_for_room();
      return;
    }
    std::size_t bytes = gather();
    batch_bytes_ = bytes;
    // Zero-copy sends need io_uring's notification: never direct.
    if (direct && direct_writes() && !zc_write_) {
      // MSG_NOSIGNAL: a write to a reset connection must report EPIPE,
      // not raise SIGPIPE (which kills the process by default).
      ssize_t r = small_ ? ::send(fd(), small_buf_, bytes, MSG_NOSIGNAL | MSG_DONTWAIT)
                         : ::sendmsg(fd(), &msg_, MSG_NOSIGNAL | MSG_DONTWAIT);
      ++stats_.writes;
      ++stats_.direct_writes;
      // Short (the socket buffer is full): batch_done marks the writer
      // blocked, and the rest waits for room.
      if (!batch_done(r < 0 ? -errno : r)) return;
      continue;
    }
    io_uring_sqe* sqe = sched().get_sqe();
    if (sqe == nullptr) {
      // The SQ is full even after submitting: take the batch back (nothing
      // of it was written) and try again from the loop.
      batch_done(0);
      kick();
      return;
    }
    if (small_) {
      io_uring_prep_send(sqe, fd(), small_buf_, bytes, MSG_NOSIGNAL);
    } else if (zc_write_) {
      io_uring_prep_sendmsg_zc(sqe, fd(), &msg_, MSG_NOSIGNAL);
      ++stats_.zero_copy_writes;
    } else {
      io_uring_prep_sendmsg(sqe, fd(), &msg_, MSG_NOSIGNAL);
    }
    io_uring_sqe_set_data(sqe, static_cast<operation*>(&write_op_));
    sched().note_submitted();
    write_inflight_ = true;
    ++stats_.writes;
    return;
  }
}

inline void connection::on_write(operation* o, int res, std::uint32_t flags) noexcept {
  connection* c = static_cast<conn_op*>(o)->self;
  if (flags & IORING_CQE_F_MORE) {
    // SENDMSG_ZC: the result now; the pages stay the kernel's until the
    // notification CQE (IORING_CQE_F_NOTIF) that follows.
    c->zc_result_ = res;
    return;
  }
  if (flags & IORING_CQE_F_NOTIF) res = c->zc_result_;
  proto::event_scope ev(*c);
  c->write_inflight_ = false;
  if (c->batch_done(res)) c->start_write(true);
  c->on_io_done();
}

inline void connection::wait_for_room() noexcept {
  if (room_inflight_ || !sock_.valid()) return;
  io_uring_sqe* sqe = sched().get_sqe();
  if (sqe == nullptr) {
    kick();  // the SQ is full: try again from the loop
    return;
  }
  // POLLOUT: room again; POLLERR and POLLHUP (a reset, a shutdown) always
  // come, and the write that follows reports them.
  io_uring_prep_poll_add(sqe, fd(), POLLOUT);
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&room_op_));
  sched().note_submitted();
  room_inflight_ = true;
  ++stats_.write_waits;
}

inline void connection::on_room(operation* o, int, std::uint32_t) noexcept {
  connection* c = static_cast<conn_op*>(o)->self;
  proto::event_scope ev(*c);
  c->room_inflight_ = false;
  c->write_blocked_ = false;
  c->start_write(true);
  c->on_io_done();
}

inline bool connection::batch_done(ssize_t res) noexcept {
  std::size_t left = res > 0 ? static_cast<std::size_t>(res) : 0;
  // Short, or nothing taken: the socket is full (start_write waits for room).
  write_blocked_ = res == -EAGAIN || (res >= 0 && left < batch_bytes_);
  std::size_t n = std::exchange(batch_n_, 0);
  // The batch is the first n frames of the queue; none can have left it
  // while in flight.
  frame* f = tx_.head;
  for (std::size_t i = 0; i < n; ++i) {
    frame* next = f->next;
    f->in_flight = false;
    std::size_t take = std::min(left, frame_total(*f) - f->written);
    f->written += take;
    left -= take;
    if (f->written == frame_total(*f)) {
      tx_.erase(f);
      f->where = nowhere;
      ++stats_.frames_out;
      // Copied into small_buf_ (a small batch) or written from its buffer:
      // the path of the batch that finished it.
      tx_path_ = small_ ? transfer_path::host_eager : transfer_path::host_zero_copy;
      on_sent(*f, {});
    } else if (failed()) {
      // Failed while it was in the write: it will never go out.
      tx_.erase(f);
      f->where = nowhere;
      on_sent(*f, error());
    }
    f = next;
  }
  if (res < 0 && res != -EINTR && res != -EAGAIN && !failed()) on_link_failed(connection_error(static_cast<int>(res)));
  if (failed()) {
    // Frames behind the batch; the engine ends or shuts the connection.
    drop_unsent();
    return_dropped();
    return false;
  }
  unseal_untouched();
  return true;
}

inline void connection::unseal_untouched() noexcept {
  frame* f = tx_.head;
  while (f != nullptr && f->sealed && f->written != 0) f = f->next;
  while (f != nullptr && f->sealed) {
    f->sealed = false;
    --tx_seq_;
    f = f->next;
  }
}

}  // namespace gdr::detail::tcp
