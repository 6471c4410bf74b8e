/// \file
/// The TCP transport behind `tcp::endpoint`: one connected socket, one
/// reader and one writer driven by the scheduler's io_uring. It moves the
/// protocol layer's frames (`gdr/protocol/engine.hpp`, which it derives
/// from) and nothing else: matching, rendezvous, cancellation and failure
/// rules live there. Also the TCP transport's tag, options and counters.
///
/// How it works
/// ============
/// A `connection` lives on the heap and belongs to one scheduler; everything
/// below runs on that scheduler's thread (the protocol engine's rules).
///
/// Writer. The engine posts frames (a header and a pointer to the payload)
/// into one FIFO. While no write is in flight, the writer gathers up to
/// `max_batch` frames (and `batch_bytes` of payload) from the head of the
/// queue into one iovec array, [header, payload, header, payload, ...], and
/// submits one `IORING_OP_SENDMSG`: the kernel copies the payloads straight
/// from the users' buffers (no copy in user space, at any size), and many
/// coroutines' small messages share one system call. A batch of at most
/// `small_write` bytes is instead copied into one buffer and sent with
/// `IORING_OP_SEND`, which costs the kernel less. In busy-poll mode, the
/// frames posted during an event handler are written at its end by a
/// non-blocking system call instead (`endpoint_options::direct_writes_in_busy_poll`);
/// what the socket cannot take goes to io_uring. A frame is *sealed*
/// (numbered, committed) when it joins a batch; it can no longer be
/// withdrawn, because the frames after it carry the next sequence numbers. A
/// short write leaves the rest sealed at the head of the queue; frames the
/// kernel took no byte of are unsealed again. A frame is done (`on_sent`)
/// when its last byte is in the kernel.
///
/// Reader. One read is in flight at a time: an io_uring receive, or, while
/// the scheduler busy-polls, a `recv(MSG_DONTWAIT)` the loop retries each
/// iteration (`endpoint_options::spin_reads_in_busy_poll`). A read decided
/// inside an event handler enters the SQ after the sends that the handler's
/// resumed coroutines queue, so a reply leaves first. Normally it reads up to
/// `rx_buffer` bytes into the staging buffer (512 bytes inside the
/// connection until a read fills them; then `rx_buffer` bytes are
/// allocated, so an idle endpoint holds none), and the parser walks the
/// frames found there: each header goes to the engine (`on_header`), which says
/// where its payload goes. The part of a payload already staged is copied;
/// a rest larger than `direct_read_threshold` is read by the kernel straight
/// into its destination (`MSG_WAITALL`, no intermediate copy). After a large
/// payload, the next read asks for one header only, so that the next large
/// payload does not land in the staging buffer first. When the engine
/// pauses on a header (no room for an early message, no reply slot), the
/// reader stops reading the socket until the engine resumes it: TCP flow
/// control then holds the sender back.
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

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/engine.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transport/tcp/frame.hpp>
#include <gdr/transport/tcp/socket.hpp>

namespace gdr {

namespace tcp {

/// The TCP transport's tag: the key of its rows in the path table.
struct endpoint_stats;
struct transport {
  static constexpr const char* name = "tcp";
  using stats_type = endpoint_stats;
};

/// Tuning of one endpoint. The defaults suit a loopback or datacenter link.
struct endpoint_options {
  /// The protocol layer's tuning (rendezvous threshold, early-message
  /// store, reply slots, the largest message accepted).
  protocol_options protocol{};
  /// Size of the staging buffer each read fills (clamped to at least one
  /// header plus `direct_read_threshold`). Allocated when a read first
  /// fills the 512 bytes a connection starts with (an idle endpoint holds
  /// none); without memory for it, reading goes on 512 bytes at a time.
  std::size_t rx_buffer = 64 * 1024;
  /// A payload rest larger than this is read by the kernel straight into
  /// its destination instead of through the staging buffer (one system call
  /// more, one copy less).
  std::size_t direct_read_threshold = 16 * 1024;
  /// Writes whose payload bytes reach this size use `IORING_OP_SENDMSG_ZC`
  /// (the kernel pins the user's pages instead of copying them). 0: never.
  /// Off by default: on loopback it measured slower (benchmarks/RESULTS.md);
  /// on a real NIC it may win for large messages.
  std::size_t zero_copy_send_threshold = 0;
  /// While the scheduler is in `run_mode::busy_poll`, read the socket the
  /// way a spinning socket program does: the loop calls
  /// `recv(MSG_DONTWAIT)` once per iteration while a read is pending,
  /// instead of handing the read to io_uring, where it would wait on the
  /// kernel's poll (wake-up, task work, then the CQE). Lower latency when
  /// data arrives; one system call per idle endpoint per loop iteration.
  /// Reads in `run_mode::sleep` always go through io_uring. false: reads
  /// always go through io_uring.
  bool spin_reads_in_busy_poll = true;
  /// While the scheduler is in `run_mode::busy_poll`, write the way a
  /// spinning socket program does: the frames queued during one event
  /// handler go out at its end as one non-blocking `sendmsg` (or `send`)
  /// system call made by the loop, instead of an io_uring write (an SQE, a
  /// submission and a CQE to process: about 0.2-0.5 us more per write,
  /// benchmarks/RESULTS.md). What the socket cannot take at once goes to
  /// io_uring, which waits for room. false: writes always go through io_uring.
  bool direct_writes_in_busy_poll = true;
  /// Socket settings (keepalive, TCP_USER_TIMEOUT, ...).
  socket_options socket{};
  /// How long an orderly close (this side's or the peer's) waits, after
  /// its close frame, for the peer's end of stream before it drops the
  /// connection (GUIDE section 8). A close's own timeout, if shorter,
  /// bounds it first.
  std::chrono::milliseconds close_linger{2000};
};

/// Counters of one endpoint: the protocol layer's, and the transport's.
struct endpoint_stats : protocol_stats {
  std::uint64_t writes = 0;            ///< writes of a batch of frames (io_uring or direct)
  std::uint64_t zero_copy_writes = 0;  ///< of which SENDMSG_ZC
  std::uint64_t direct_writes = 0;     ///< of which non-blocking system calls by the loop (busy_poll)
  std::uint64_t reads = 0;             ///< reads started (staging and direct; io_uring or spinning)
  std::uint64_t direct_reads = 0;      ///< of which straight into a user or registered buffer
  std::uint64_t spin_reads = 0;        ///< non-blocking recv() attempts by the loop (busy_poll, see endpoint_options)
  std::uint64_t frames_out = 0;        ///< frames written
  std::uint64_t frames_in = 0;         ///< frames parsed
};

}  // namespace tcp

namespace detail::tcp {

using gdr::tcp::endpoint_options;
using gdr::tcp::endpoint_stats;
using proto::frame;
namespace wire = gdr::tcp::wire;

/// One connected socket: the TCP transport under a protocol engine. See the
/// file comment.
class connection final : public proto::engine {
 public:
  static constexpr std::size_t max_batch = 64;  // frames per sendmsg (2 iovecs each; IOV_MAX is 1024)
  /// A batch closes once it holds this much payload. Up to it, several
  /// large frames share one sendmsg (one system call and one completion per
  /// megabyte, not per frame: 256 KiB messages went from 0.88-0.97x to
  /// 1.01-1.04x of a raw socket stream, benchmarks/RESULTS.md). Frames
  /// behind a full batch stay unsealed (withdrawable) instead of waiting
  /// inside a write that a slow peer holds up.
  static constexpr std::size_t batch_bytes = std::size_t{1} << 20;
  /// Batches of at most this many bytes (headers and payloads) are copied
  /// into one buffer and written with `send` instead of `sendmsg`.
  static constexpr std::size_t small_write = 512;
  /// The staging buffer a connection starts with, inside it; the
  /// `rx_buffer` bytes are allocated once a read fills it.
  static constexpr std::size_t rx_inline = 512;

  /// Takes over `sock` (connected; options already applied), says hello and
  /// starts reading. Call on `s`'s thread, or before `s` runs. Throws
  /// `std::bad_alloc`.
  connection(scheduler& s, gdr::tcp::socket sock, memory_registry& reg, const endpoint_options& o)
      : engine(s, reg, o.protocol, stats_, proto::caps::host), sock_(std::move(sock)), topts_(o) {
    direct_min_ = std::max<std::size_t>(topts_.direct_read_threshold, 1);
    rx_full_ = std::max(topts_.rx_buffer, wire::header_size + direct_min_);
    rx_cap_ = std::min(rx_full_, sizeof rx_small_);
    read_op_.self = this;
    read_op_.complete = &on_read;
    write_op_.self = this;
    write_op_.complete = &on_write;
    linger_op_.self = this;
    linger_op_.complete = &on_linger;
    watch_op_.self = this;
    watch_op_.complete = &on_watch;
    kick_.self = this;
    kick_.run = &on_kick;
    spin_.self = this;
    msg_.msg_iov = iov_;
    // The reader runs from the start: the peer may send requests (put/get)
    // before this side posts anything.
    start_protocol();
    pump();
  }

  int fd() const noexcept { return sock_.native_handle(); }
  const endpoint_stats& stats() const noexcept { return stats_; }
  /// The parser's reason for the last protocol error, for diagnostics.
  gdr::tcp::frame_status protocol_reason() const noexcept { return protocol_reason_; }

 private:
  struct conn_op : operation {
    connection* self = nullptr;
  };
  struct kick_node : remote_work {
    connection* self = nullptr;
  };
  /// Which list holds a posted frame (`frame::where`).
  enum where_t : std::uint8_t { nowhere = 0, in_tx = 1, in_dropped = 2 };
  /// Where the reader is putting the current payload.
  struct rx_target {
    bool active = false;
    std::byte* dst = nullptr;
    std::size_t want = 0;       // bytes to write at dst
    std::size_t done = 0;       // bytes written so far
    std::uint64_t discard = 0;  // bytes of the frame to drop after `want`
    bool direct = false;        // some bytes were read by the kernel straight into dst
    bool aborted = false;       // the engine stopped it while the kernel wrote into dst
  };

  ~connection() override {
    if (spin_registered_) sched().remove_poller(spin_);
  }

  void destroy() noexcept override { delete this; }

 public:
  std::string peer_name() const override {
    result<gdr::tcp::address> a = sock_.remote_address();
    return a ? a->to_string() : std::string("(closed)");
  }

 private:

  // ---------------------------------------------------------------- the engine's hooks

  void link_post(frame& f) noexcept override {
    f.queued = true;
    f.sealed = false;
    f.in_flight = false;
    f.written = 0;
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

  bool link_withdraw(frame& f) noexcept override {
    if (!f.queued || f.in_flight) return false;
    if (f.sealed && !failed()) return false;
    (f.where == in_dropped ? dropped_ : tx_).erase(&f);
    f.where = nowhere;
    f.queued = false;
    return true;
  }

  bool link_committed(const frame& f) const noexcept override { return f.queued && (f.sealed || f.in_flight); }

  void link_resume() noexcept override {
    if (rx_paused_) kick();
  }

  bool link_abort_target() noexcept override {
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

  void link_shutdown() noexcept override {
    rx_paused_ = false;
    end_watch();
    ending_ = false;
    end_linger();
    // Wake the reads and writes in flight: a recv returns 0, a send EPIPE.
    if (sock_.valid()) ::shutdown(fd(), SHUT_RDWR);
    drop_unsent();
  }

  /// The orderly end (the close frame is out, or the peer's came): this
  /// side's half ends (FIN after what the kernel holds), and the reader
  /// reads and drops what the peer still sends until its end of stream.
  /// Shutting down both halves at once, as link_shutdown does, makes the
  /// kernel answer the peer's next bytes with a reset (TcpExt
  /// TCPAbortOnData; RFC 1122 4.2.2.13), and a reset throws away what
  /// this side's kernel had not sent yet and fails the peer with
  /// connection_lost: on the same machine, 3 of 20 closes in
  /// tests/transport/tcp/orderly_close_test lost a message that way.
  bool link_close() noexcept override {
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

  /// Hands back the frames not being written (after a failure).
  void drop_unsent() noexcept {
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

  bool link_flush() noexcept override {
    // Frames the resumed coroutines posted go out now (direct writes),
    // once per handler: sends that complete resume senders that queue
    // more, and the rest of the loop must get its turn (what is queued
    // after that goes to io_uring, below).
    if (write_deferred_ && !handler_wrote_) {
      write_deferred_ = false;
      handler_wrote_ = true;
      start_write(true);
      return true;
    }
    // A staging read decided during the handler goes into the SQ behind
    // whatever the resumed coroutines queued (see submit_read).
    if (read_deferred_) {
      issue_read();
      return true;
    }
    if (write_deferred_) {
      write_deferred_ = false;
      start_write(false);
    }
    handler_wrote_ = false;
    return false;
  }

  bool link_quiet() const noexcept override {
    return !read_inflight_ && !write_inflight_ && !kick_posted_ && dropped_.empty() && !linger_inflight_ &&
           !watch_inflight_;
  }
  // (While ending, the read of the peer's rest is in flight until its end.)

  void link_release() noexcept override { sock_.close(); }

  transfer_path link_rx_path(bool direct) const noexcept override {
    return direct ? transfer_path::host_zero_copy : transfer_path::host_eager;
  }
  transfer_path link_tx_path() const noexcept override {
    return transfer_path::host_zero_copy;  // from the user's buffer by iovec
  }

  // ---------------------------------------------------------------- failure

  void protocol_fail(gdr::tcp::frame_status why) noexcept {
    protocol_reason_ = why;
    on_link_failed(errc::protocol_error);
  }

  /// `f` will never be written: it goes back through return_dropped().
  void drop(frame& f) noexcept {
    f.where = in_dropped;
    dropped_.push_back(&f);
  }

  /// Hands back the frames that will never be written (after a failure).
  void return_dropped() noexcept {
    while (frame* f = dropped_.pop_front()) {
      f->where = nowhere;
      on_sent(*f, error());
    }
  }

  // ---------------------------------------------------------------- writer

  void seal(frame& f) noexcept {
    f.seq = tx_seq_++;
    gdr::tcp::encode_frame(f.hdr, f.seq, f.encoded);
    f.sealed = true;
  }

  std::size_t frame_total(const frame& f) const noexcept { return wire::header_size + f.hdr.length; }

  /// Writes go out as non-blocking system calls made by the loop
  /// (endpoint_options::direct_writes_in_busy_poll).
  bool direct_writes() const noexcept {
    return topts_.direct_writes_in_busy_poll && sched().mode() == run_mode::busy_poll;
  }

  /// Gathers the next batch from the head of the queue into iov_/msg_
  /// (sealing its frames and marking them in flight); a small batch is also
  /// copied into small_buf_. Returns its bytes.
  std::size_t gather() noexcept {
    std::size_t iovn = 0;
    std::size_t payload = 0;
    std::size_t n = 0;
    for (frame* f = tx_.head; f != nullptr && n < max_batch; f = f->next) {
      if (!f->sealed) seal(*f);
      f->in_flight = true;
      std::size_t off = f->written;
      if (off < wire::header_size) {
        iov_[iovn++] = {f->encoded + off, wire::header_size - off};
        off = 0;
      } else {
        off -= wire::header_size;
      }
      if (f->hdr.length > off) {
        // sendmsg only reads through iov_base; iovec has no const member.
        iov_[iovn++] = {const_cast<std::byte*>(f->payload) + off, static_cast<std::size_t>(f->hdr.length) - off};
        payload += f->hdr.length - off;
      }
      ++n;
      if (payload >= batch_bytes) break;
    }
    batch_n_ = n;
    msg_.msg_iovlen = iovn;
    zc_write_ = topts_.zero_copy_send_threshold != 0 && payload >= topts_.zero_copy_send_threshold;
    std::size_t bytes = 0;
    for (std::size_t i = 0; i < iovn; ++i) bytes += iov_[i].iov_len;
    small_ = bytes <= small_write && !zc_write_;
    if (small_) {
      // A small batch is copied into one buffer and sent with a plain send:
      // the kernel then skips copying in a msghdr and importing an iovec
      // array, which costs more than copying these few bytes here.
      std::size_t off = 0;
      for (std::size_t i = 0; i < iovn; ++i) {
        std::memcpy(small_buf_ + off, iov_[i].iov_base, iov_[i].iov_len);
        off += iov_[i].iov_len;
      }
    }
    return bytes;
  }

  /// Writes what is queued, while no write is in flight: with non-blocking
  /// system calls while they take everything (`direct`: inside an event
  /// handler, in busy-poll mode), else, or for what the socket could not
  /// take, one io_uring write.
  void start_write(bool direct) noexcept {
    while (!write_inflight_ && !failed() && !tx_.empty()) {
      std::size_t bytes = gather();
      // Zero-copy sends need io_uring's notification: never direct.
      if (direct && direct_writes() && !write_blocked_ && !zc_write_) {
        // MSG_NOSIGNAL: a write to a reset connection must report EPIPE,
        // not raise SIGPIPE (which kills the process by default).
        ssize_t r = small_ ? ::send(fd(), small_buf_, bytes, MSG_NOSIGNAL | MSG_DONTWAIT)
                           : ::sendmsg(fd(), &msg_, MSG_NOSIGNAL | MSG_DONTWAIT);
        ++stats_.writes;
        ++stats_.direct_writes;
        // Short (the socket buffer is full): the rest waits for room in
        // io_uring, and the next direct write only after that.
        write_blocked_ = r < 0 || static_cast<std::size_t>(r) != bytes;
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

  static void on_write(operation* o, int res, std::uint32_t flags) noexcept {
    connection* c = static_cast<conn_op*>(o)->self;
    if (flags & IORING_CQE_F_MORE) {
      // SENDMSG_ZC: the result now; the pages stay the kernel's until the
      // notification CQE (IORING_CQE_F_NOTIF) that follows.
      c->zc_result_ = res;
      return;
    }
    if (flags & IORING_CQE_F_NOTIF) res = c->zc_result_;
    c->enter();
    c->write_inflight_ = false;
    c->write_blocked_ = false;
    if (c->batch_done(res)) c->start_write(true);
    c->on_io_done();
    c->leave();
  }

  /// Accounts for the write of the current batch (`res`: bytes taken, or
  /// -errno): frames entirely out are done, frames untouched are unsealed.
  /// False: the connection failed.
  bool batch_done(ssize_t res) noexcept {
    std::size_t left = res > 0 ? static_cast<std::size_t>(res) : 0;
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

  /// After a short write: the sealed frames the kernel took no byte of are
  /// the last ones sealed, so they can be withdrawn again (numbers handed
  /// back).
  void unseal_untouched() noexcept {
    frame* f = tx_.head;
    while (f != nullptr && f->sealed && f->written != 0) f = f->next;
    while (f != nullptr && f->sealed) {
      f->sealed = false;
      --tx_seq_;
      f = f->next;
    }
  }

  // ---------------------------------------------------------------- kicks

  void kick() noexcept {
    if (kick_posted_) return;
    kick_posted_ = true;
    sched().post(&kick_);
  }

  static void on_kick(remote_work* w) noexcept {
    connection* c = static_cast<kick_node*>(w)->self;
    c->enter();
    c->kick_posted_ = false;
    c->return_dropped();
    if (!c->failed()) {
      if (c->rx_paused_) {
        c->rx_paused_ = false;
        c->end_watch();
        c->pump();
      }
      c->start_write(true);  // after an SQ-full retry
    }
    c->on_io_done();
    c->leave();
  }

  // ---------------------------------------------------------------- reader

  /// Consumes what the staging buffer holds, then starts the next read or
  /// pauses. Precondition: no read in flight, not paused.
  void pump() noexcept {
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

  /// Handles the frame whose header starts at rx_pos_. False: stop pumping
  /// (paused or failed).
  bool parse_one() noexcept {
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

  /// The current payload's wanted bytes are in place.
  void target_done() noexcept {
    rx_target t = std::exchange(tgt_, rx_target{});
    skip_ = t.discard;
    on_placed(t.direct);
  }

  /// Reads are non-blocking recv() attempts made by the loop
  /// (endpoint_options::spin_reads_in_busy_poll).
  bool spinning() const noexcept {
    return topts_.spin_reads_in_busy_poll && sched().mode() == run_mode::busy_poll;
  }

  /// Reads into the staging buffer.
  void read_staging() noexcept {
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

  /// A staging read filled the inline buffer: more is likely waiting, so
  /// the staging buffer becomes a heap one of `rx_buffer` bytes, with the
  /// bytes not yet parsed moved to its front. Without memory the reader goes
  /// on through the inline buffer (more reads, nothing lost) and tries again
  /// after the next full read.
  void grow_rx() noexcept {
    auto* b = new (std::nothrow) std::byte[rx_full_];
    if (b == nullptr) return;
    std::memcpy(b, rx_buf_ + rx_pos_, rx_end_ - rx_pos_);
    rx_end_ -= rx_pos_;
    rx_pos_ = 0;
    rx_big_.reset(b);
    rx_buf_ = b;
    rx_cap_ = rx_full_;
  }

  /// Reads the rest of the current payload straight into its destination.
  void read_direct() noexcept {
    tgt_.direct = true;
    ++stats_.direct_reads;
    // MSG_WAITALL: io_uring retries short stream reads itself, one CQE for the
    // whole rest; on cancellation or end of stream the CQE carries the bytes
    // already placed (io_uring/net.c, done_io). A spinning read takes
    // whatever has arrived; pump() asks for the rest.
    submit_read(tgt_.dst + tgt_.done, tgt_.want - tgt_.done, MSG_WAITALL, true, false);
  }

  /// Starts the one read of the reader: `n` bytes into `dst`. `flags` and
  /// `poll_first` say how an io_uring read waits for data; `direct`: `dst` is
  /// a user's or registered buffer.
  void submit_read(std::byte* dst, std::size_t n, int flags, bool direct, bool poll_first) noexcept {
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

  /// Hands the pending read to io_uring.
  void issue_read() noexcept {
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

  // ---------------------------------------------------------------- spinning reads
  //
  // In busy-poll mode the pending read is not handed to io_uring: the loop
  // polls the socket with a non-blocking recv() each iteration, as a
  // spinning socket program does (the connection is one of the scheduler's
  // pollers while it lives). An io_uring read would either wait on the
  // kernel's poll (wake-up, task work, then the CQE) or, as an MSG_DONTWAIT
  // attempt, cost an SQE, a submission and a CQE per attempt: about 0.9 us
  // against 0.37 us for the recv() call (benchmarks/RESULTS.md). Between
  // attempts the kernel holds no reference to the buffer, so nothing
  // changes for cancellation except that it is noticed by the next poll.

  struct spin_poller final : poller {
    connection* self = nullptr;
    poll_status poll() noexcept override { return self->poll_spin(); }
    const char* name() const noexcept override { return "tcp-spin-read"; }
  };

  /// Makes the pending read a spinning one. False: the poller could not be
  /// registered (no memory); the read goes to io_uring instead.
  bool start_spin() noexcept {
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

  /// One attempt of the pending spinning read (the loop's poll).
  poll_status poll_spin() noexcept {
    if (!spin_pending_) return {};
    int res = -ECANCELED;
    if (!spin_cancel_) {
      if (!spinning()) {
        // The loop left busy-poll mode: wait through io_uring instead.
        spin_pending_ = false;
        sched().note_done();
        enter();
        issue_read();
        leave();  // may free this
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
    enter();
    read_done(res);
    leave();  // may free this
    return {.did_work = true};
  }

  static void on_read(operation* o, int res, std::uint32_t) noexcept {
    connection* c = static_cast<conn_op*>(o)->self;
    c->enter();
    c->read_done(res);
    c->leave();
  }

  void read_done(int res) noexcept {
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

  // ---------------------------------------------------------------- the paused reader's watch
  //
  // While the engine has paused the reader (back-pressure: no memory, no
  // bounce slot, too many messages kept), no read is posted, so a read
  // cannot see the peer leave, and a receive waiting for what the peer
  // would have sent stayed pending after the peer was gone. A poll for the
  // socket's end (POLLRDHUP; POLLERR and POLLHUP always come) is armed
  // instead, and cancelled when reading resumes. A reset or error fails
  // the connection with connection_lost at once. The peer's end of stream
  // alone means that everything it sent is in this side's socket buffer:
  // if that ends with its close frame, it closed in order and the reader
  // stays paused (what it sent is still delivered when reading resumes);
  // if not, the peer went away without closing, and the connection fails
  // as a read would once it reached that end.

  void arm_watch() noexcept {
    if (watch_inflight_ || failed() || ending_ || !sock_.valid()) return;
    io_uring_sqe* sqe = sched().get_sqe();
    if (sqe == nullptr) return;  // the SQ refused it: the peer's end is seen when reading resumes
    io_uring_prep_poll_add(sqe, fd(), POLLRDHUP);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(&watch_op_));
    sched().note_submitted();
    watch_inflight_ = true;
  }

  void end_watch() noexcept {
    if (watch_inflight_ && !watch_cancelled_) {
      watch_cancelled_ = true;
      sched().cancel(&watch_op_);
    }
  }

  static void on_watch(operation* o, int res, std::uint32_t) noexcept {
    connection* c = static_cast<conn_op*>(o)->self;
    c->enter();
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
    c->leave();
  }

  /// After the peer's end of stream: do the bytes not yet parsed (from the
  /// paused header on, then the socket's) end with a whole close frame?
  /// Unsure (no memory) counts as yes: the reader stays paused.
  bool unread_ends_with_close() noexcept {
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

  // ---------------------------------------------------------------- the orderly end

  /// Reads what the peer still sends after the end began, into the staging
  /// buffer, to be dropped.
  void read_rest() noexcept {
    rx_pos_ = rx_end_ = 0;
    skip_ = 0;
    submit_read(rx_buf_, rx_cap_, 0, false, false);
  }

  /// A read of the orderly end completed: its bytes are dropped; the end
  /// of the peer's stream (or a reset) ends it.
  void rest_done(int res) noexcept {
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

  /// Bounds the orderly end (endpoint_options::close_linger): an io_uring
  /// timeout whose expiry shuts both halves down, which ends the read.
  void arm_linger() noexcept {
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

  void end_linger() noexcept {
    if (linger_inflight_ && !linger_cancelled_) {
      linger_cancelled_ = true;
      sched().cancel(&linger_op_);
    }
  }

  static void on_linger(operation* o, int, std::uint32_t) noexcept {
    connection* c = static_cast<conn_op*>(o)->self;
    c->enter();
    c->linger_inflight_ = false;
    c->linger_cancelled_ = false;
    // Still ending: the peer did not end its stream in time. Both halves
    // down: the read in flight returns 0 and ends it.
    if (c->ending_ && c->sock_.valid()) ::shutdown(c->fd(), SHUT_RDWR);
    c->on_io_done();
    c->leave();
  }

  // ---------------------------------------------------------------- state

  gdr::tcp::socket sock_;
  endpoint_options topts_;
  endpoint_stats stats_{};
  gdr::tcp::frame_status protocol_reason_ = gdr::tcp::frame_status::ok;
  kick_node kick_{};
  bool kick_posted_ = false;

  // writer
  proto::fifo<frame, &frame::prev, &frame::next> tx_{};
  proto::fifo<frame, &frame::prev, &frame::next> dropped_{};  // to hand back (failed)
  std::size_t batch_n_ = 0;  // frames at the head of tx_ in the write in flight
  std::uint32_t tx_seq_ = 0;
  conn_op write_op_{};
  bool write_inflight_ = false;
  bool zc_write_ = false;
  bool small_ = false;           // the current batch is copied into small_buf_
  bool write_blocked_ = false;   // a direct write came back short: next write through io_uring
  bool write_deferred_ = false;  // frames queued in a handler, written at its end (link_flush)
  bool handler_wrote_ = false;   // this handler made its one direct write
  int zc_result_ = 0;
  msghdr msg_{};
  iovec iov_[2 * max_batch]{};
  std::byte small_buf_[small_write];  // a small batch, copied (start_write)
  alignas(8) std::byte rx_small_[rx_inline];  // the first staging buffer (see rx_buf_)

  // reader
  conn_op read_op_{};
  bool read_inflight_ = false;
  bool read_direct_ = false;
  bool read_deferred_ = false;  // decided, not yet in the SQ (submit_read)
  struct read_request {
    std::byte* dst;
    std::size_t n;
    int flags;
    bool poll_first;
  } rd_{};
  spin_poller spin_{};
  bool spin_registered_ = false;  // spin_ is one of the scheduler's pollers
  bool spin_pending_ = false;     // the read in flight is a spinning one
  bool spin_cancel_ = false;      // ... and is to end with -ECANCELED
  bool rx_paused_ = false;        // the engine paused on the header at rx_pos_
  bool ending_ = false;           // link_close: reading the peer's rest until its end (rest_done)
  conn_op linger_op_{};           // the bound of the orderly end (arm_linger)
  bool linger_inflight_ = false;
  bool linger_cancelled_ = false;
  __kernel_timespec linger_ts_{};
  conn_op watch_op_{};            // the paused reader's poll for the peer's end (arm_watch)
  bool watch_inflight_ = false;
  bool watch_cancelled_ = false;
  // The staging buffer: the inline one until a read fills it, then a heap
  // one of rx_full_ bytes (grow_rx). An idle endpoint reads its peer's
  // hello and credit (128 bytes) and keeps no 64 KiB buffer.
  std::byte* rx_buf_ = rx_small_;
  std::unique_ptr<std::byte[]> rx_big_;
  std::size_t rx_cap_ = 0;   // rx_buf_'s size
  std::size_t rx_full_ = 0;  // the heap buffer's size (rx_buffer, at least a header and a small payload)
  std::size_t rx_pos_ = 0;
  std::size_t rx_end_ = 0;
  std::size_t direct_min_ = 0;
  std::uint64_t skip_ = 0;
  std::uint32_t rx_seq_ = 0;
  bool large_ = false;
  bool drained_ = false;      // the last staging read emptied the socket
  std::size_t last_ask_ = 0;  // bytes the read in flight asked for
  rx_target tgt_{};
};

}  // namespace detail::tcp

}  // namespace gdr
