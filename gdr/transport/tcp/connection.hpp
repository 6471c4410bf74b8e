/// \file
/// The TCP transport behind `tcp::endpoint`: one connected socket, one
/// reader and one writer driven by the scheduler's io_uring. It moves the
/// protocol layer's frames (`gdr/protocol/engine.hpp`, which it derives
/// from) and nothing else: matching, rendezvous, cancellation and failure
/// rules live there. Its members are defined by concern in writer.hpp,
/// reader.hpp and close.hpp beside it; its options in options.hpp.
///
/// How it works
/// ============
/// A `connection` lives on the heap and belongs to one scheduler; everything
/// below runs on that scheduler's thread (the protocol engine's rules).
///
/// Writer. The engine posts frames (a header and a pointer to the payload)
/// into one FIFO. While no write is in flight, the writer gathers up to
/// `max_batch` frames (and `batch_bytes` of payload) from the head of the
/// queue into one iovec array, [header, payload, header, payload, ...] (a
/// few inside the connection; the whole array of `2 * max_batch` is
/// allocated the first time a batch needs more, so an idle endpoint does not
/// carry it), and
/// submits one `IORING_OP_SENDMSG`: the kernel copies the payloads straight
/// from the users' buffers (no copy in user space, at any size), and many
/// coroutines' small messages share one system call. A batch of at most
/// `small_write` bytes is instead copied into one buffer and sent with
/// `IORING_OP_SEND`, which costs the kernel less. In busy-poll mode, the
/// frames posted during an event handler are written at its end by a
/// non-blocking system call instead (`endpoint_options::direct_writes_in_busy_poll`);
/// what the socket cannot take waits for room. A small eager message sent
/// while nothing is queued or being written, and no other coroutine of the
/// event is about to run, is written whole by the send itself
/// (`endpoint_options::fast_sends`, `link_send_now`; one per connection and
/// loop turn): its `co_await` completes without suspending. A frame is *sealed*
/// (numbered, committed) when it joins a batch; it can no longer be
/// withdrawn, because the frames after it carry the next sequence numbers. A
/// short write leaves the rest sealed at the head of the queue; frames the
/// kernel took no byte of are unsealed again. A short write means the
/// socket is full: the writer then polls for room (POLLOUT) before it
/// gathers the next batch, instead of handing io_uring a write that would
/// wait in the kernel with every frame of its batch sealed. So while a
/// peer does not read, only the frame the kernel has begun to take is
/// committed; the frames behind it can still be withdrawn (a stopped send
/// ends at its deadline). A frame is done (`on_sent`) when its last byte is
/// in the kernel.
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
#include <gdr/transport/tcp/options.hpp>
#include <gdr/transport/tcp/socket.hpp>

namespace gdr {

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
  /// The iovecs inside the connection (four frames); a longer batch first
  /// allocates the full array (grow_iov).
  static constexpr std::size_t iov_inline = 8;
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
    room_op_.self = this;
    room_op_.complete = &on_room;
    kick_.self = this;
    kick_.run = &on_kick;
    spin_.self = this;
    msg_.msg_iov = iov_small_;
    enable_send_now();
    say_hello();
    // The reader runs from the start: the peer may send requests (put/get)
    // before this side posts anything.
    pump();
  }

  /// The hello and the first credit, in one write: the writer is held (as
  /// if a write were in flight) while both are posted.
  void say_hello() noexcept {
    write_inflight_ = true;
    start_protocol();
    write_inflight_ = false;
    start_write(false);
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

  void link_post(frame& f) noexcept override;
  bool link_send_now(frame& f) noexcept override;

  bool link_withdraw(frame& f) noexcept override;

  bool link_committed(const frame& f) const noexcept override { return f.queued && (f.sealed || f.in_flight); }

  void link_resume() noexcept override;

  bool link_abort_target() noexcept override;

  void link_shutdown() noexcept override;

  /// The orderly end (the close frame is out, or the peer's came): this
  /// side's half ends (FIN after what the kernel holds), and the reader
  /// reads and drops what the peer still sends until its end of stream.
  /// Shutting down both halves at once, as link_shutdown does, makes the
  /// kernel answer the peer's next bytes with a reset (TcpExt
  /// TCPAbortOnData; RFC 1122 4.2.2.13), and a reset throws away what
  /// this side's kernel had not sent yet and fails the peer with
  /// connection_lost: on the same machine, 3 of 20 closes in
  /// tests/transport/tcp/orderly_close_test lost a message that way.
  bool link_close() noexcept override;

  /// Hands back the frames not being written (after a failure).
  void drop_unsent() noexcept;

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
           !watch_inflight_ && !room_inflight_;
  }
  // (While ending, the read of the peer's rest is in flight until its end.)

  void link_release() noexcept override { sock_.close(); }

  transfer_path link_rx_path(bool direct) const noexcept override {
    return direct ? transfer_path::host_zero_copy : transfer_path::host_eager;
  }
  /// The path of the frame just handed back by on_sent (or just written by
  /// link_send_now): copied into `small_buf_` (a small batch, a fast send)
  /// or written from the user's buffer by iovec.
  transfer_path link_tx_path() const noexcept override { return tx_path_; }

  // ---------------------------------------------------------------- failure

  void protocol_fail(gdr::tcp::frame_status why) noexcept {
    protocol_reason_ = why;
    on_link_failed(errc::protocol_error);
  }

  /// `f` will never be written: it goes back through return_dropped().
  void drop(frame& f) noexcept;

  /// Hands back the frames that will never be written (after a failure).
  void return_dropped() noexcept;

  // ---------------------------------------------------------------- writer

  void seal(frame& f) noexcept;

  std::size_t frame_total(const frame& f) const noexcept { return wire::header_size + f.hdr.length; }

  /// Writes go out as non-blocking system calls made by the loop
  /// (endpoint_options::direct_writes_in_busy_poll).
  bool direct_writes() const noexcept;

  /// Gathers the next batch from the head of the queue into msg_
  /// (sealing its frames and marking them in flight); a small batch is also
  /// copied into small_buf_. Returns its bytes.
  std::size_t gather() noexcept;

  /// Moves the iovecs to a heap array of 2 * max_batch. False if it cannot
  /// be allocated (the batch stays within the inline ones).
  bool grow_iov(std::size_t used) noexcept;

  /// Writes what is queued, while no write is in flight: with non-blocking
  /// system calls while they take everything (`direct`: inside an event
  /// handler, in busy-poll mode), else, or for what the socket could not
  /// take, one io_uring write.
  void start_write(bool direct) noexcept;

  static void on_write(operation* o, int res, std::uint32_t flags) noexcept;

  /// The socket is full: a poll for room, after which the writer goes on
  /// (nothing is gathered meanwhile, so every frame not begun stays
  /// withdrawable).
  void wait_for_room() noexcept;
  static void on_room(operation* o, int res, std::uint32_t flags) noexcept;

  /// Accounts for the write of the current batch (`res`: bytes taken, or
  /// -errno): frames entirely out are done, frames untouched are unsealed.
  /// False: the connection failed.
  bool batch_done(ssize_t res) noexcept;

  /// After a short write: the sealed frames the kernel took no byte of are
  /// the last ones sealed, so they can be withdrawn again (numbers handed
  /// back).
  void unseal_untouched() noexcept;

  // ---------------------------------------------------------------- kicks

  void kick() noexcept {
    if (kick_posted_) return;
    kick_posted_ = true;
    sched().post(&kick_);
  }

  static void on_kick(remote_work* w) noexcept {
    connection* c = static_cast<kick_node*>(w)->self;
    proto::event_scope ev(*c);
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
  }

  // ---------------------------------------------------------------- reader

  /// Consumes what the staging buffer holds, then starts the next read or
  /// pauses. Precondition: no read in flight, not paused.
  void pump() noexcept;

  /// Handles the frame whose header starts at rx_pos_. False: stop pumping
  /// (paused or failed).
  bool parse_one() noexcept;

  /// The current payload's wanted bytes are in place.
  void target_done() noexcept;

  /// Reads are non-blocking recv() attempts made by the loop
  /// (endpoint_options::spin_reads_in_busy_poll).
  bool spinning() const noexcept;

  /// Reads into the staging buffer.
  void read_staging() noexcept;

  /// A staging read filled the inline buffer: more is likely waiting, so
  /// the staging buffer becomes a heap one of `rx_buffer` bytes, with the
  /// bytes not yet parsed moved to its front. Without memory the reader goes
  /// on through the inline buffer (more reads, nothing lost) and tries again
  /// after the next full read.
  void grow_rx() noexcept;

  /// Reads the rest of the current payload straight into its destination.
  void read_direct() noexcept;

  /// Starts the one read of the reader: `n` bytes into `dst`. `flags` and
  /// `poll_first` say how an io_uring read waits for data; `direct`: `dst` is
  /// a user's or registered buffer.
  void submit_read(std::byte* dst, std::size_t n, int flags, bool direct, bool poll_first) noexcept;

  /// Hands the pending read to io_uring.
  void issue_read() noexcept;

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
  bool start_spin() noexcept;

  /// One attempt of the pending spinning read (the loop's poll).
  poll_status poll_spin() noexcept;

  static void on_read(operation* o, int res, std::uint32_t) noexcept;

  void read_done(int res) noexcept;

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

  void arm_watch() noexcept;

  void end_watch() noexcept;

  static void on_watch(operation* o, int res, std::uint32_t) noexcept;

  /// After the peer's end of stream: do the bytes not yet parsed (from the
  /// paused header on, then the socket's) end with a whole close frame?
  /// Unsure (no memory) counts as yes: the reader stays paused.
  bool unread_ends_with_close() noexcept;

  // ---------------------------------------------------------------- the orderly end

  /// Reads what the peer still sends after the end began, into the staging
  /// buffer, to be dropped.
  void read_rest() noexcept;

  /// A read of the orderly end completed: its bytes are dropped; the end
  /// of the peer's stream (or a reset) ends it.
  void rest_done(int res) noexcept;

  /// Bounds the orderly end (endpoint_options::close_linger): an io_uring
  /// timeout whose expiry shuts both halves down, which ends the read.
  void arm_linger() noexcept;

  void end_linger() noexcept;

  static void on_linger(operation* o, int, std::uint32_t) noexcept;

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
  bool write_blocked_ = false;   // a write came back short (the socket is full): the next waits for room
  std::size_t batch_bytes_ = 0;  // bytes of the batch being written (batch_done: was it short?)
  conn_op room_op_{};            // the poll for room in the socket (wait_for_room)
  bool room_inflight_ = false;
  bool write_deferred_ = false;  // frames queued in a handler, written at its end (link_flush)
  bool handler_wrote_ = false;   // this handler made its one direct write
  frame* fast_rest_ = nullptr;   // link_send_now wrote part of it: link_post, next, keeps that progress
  std::uint64_t fast_turn_ = ~std::uint64_t{0};  // the loop turn of the last link_send_now write
  int zc_result_ = 0;
  msghdr msg_{};
  iovec iov_small_[iov_inline]{};
  std::unique_ptr<iovec[]> iov_big_;  // 2 * max_batch, once a batch needed more (msg_.msg_iov: the one in use)
  std::byte small_buf_[small_write];  // a small batch, copied (start_write)
  transfer_path tx_path_ = transfer_path::host_zero_copy;  // link_tx_path
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
