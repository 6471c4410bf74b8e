/// \file
/// The engine behind `tcp::endpoint`: one connected socket, one reader and
/// one writer driven by the scheduler's io_uring, and the operations waiting
/// on them. Also the TCP transport's tag, traits row, options and counters.
///
/// How it works
/// ============
/// A `connection` lives on the heap and belongs to one scheduler; everything
/// below runs on that scheduler's thread. The endpoint owns it until it is
/// destroyed; then the connection frees itself once the kernel has returned
/// every buffer it lent it (its last CQE) and every operation has resumed.
///
/// Writer. Operations that put bytes on the wire (send, put, get, close, and
/// the replies this side owes its peer) queue a frame (`tx_item`: header and
/// a pointer to the payload) in one FIFO. While no write is in flight, the
/// writer gathers up to `max_batch` frames (and `batch_bytes` of payload)
/// from the head of the queue into one iovec array, [header, payload,
/// header, payload, ...], and submits one
/// `IORING_OP_SENDMSG`: the kernel copies the payloads straight from the
/// users' buffers (no copy in user space, at any size), and many coroutines'
/// small messages share one system call. A batch of at most `small_write`
/// bytes is instead copied into one buffer and sent with `IORING_OP_SEND`,
/// which costs the kernel less. In busy-poll mode, the frames queued during
/// an event handler are written at its end by a non-blocking system call
/// instead (`endpoint_options::direct_writes_in_busy_poll`); what the socket
/// cannot take goes to io_uring. A frame is *sealed* (numbered and
/// committed) when it joins a batch; it can no longer be withdrawn, because
/// the frames after it carry the next sequence numbers. A short write (the
/// socket buffer filled) leaves the rest sealed at the head of the queue for
/// the next write. A send completes when its last byte is in the kernel.
///
/// Reader. One read is in flight at a time: an io_uring receive, or, while
/// the scheduler busy-polls, a `recv(MSG_DONTWAIT)` the loop retries each
/// iteration (`endpoint_options::spin_reads_in_busy_poll`). A read decided
/// inside an event handler enters the SQ after the sends that the handler's
/// resumed coroutines queue, so a reply leaves first. Normally it reads up to
/// `rx_buffer` bytes into the staging buffer, and the parser walks the frames
/// found there. A data frame goes to the oldest posted `recv`: the part of
/// its payload already staged is copied, the rest is read by the kernel
/// straight into the receive view (`MSG_WAITALL`, no intermediate copy).
/// After a large frame, the next read asks for one header only, so that the
/// next large payload does not land in the staging buffer first. A data frame
/// that no recv is waiting for is kept (copied into a bounded store) if it is
/// small (<= `eager_limit`) and the store has room; otherwise the reader
/// stops reading the socket until a recv is posted: TCP flow control then
/// holds the sender, and nothing is buffered without bound. The same holds
/// for a put/get request that finds every reply slot busy.
///
/// One-sided operations are served here, by the owner's reader:
/// a put request is checked with `memory_registry::resolve` and its payload
/// read straight into the registered memory (or, refused, read and thrown
/// away); a get request is checked and answered with a reply whose payload
/// the writer sends straight from the registered memory. The initiator
/// matches replies to its requests in order.
///
/// Completion and resumption. Whatever completes an operation (a CQE, a
/// timer, a cancellation, a failure) only records the result; the
/// operation's coroutine is resumed from a ready list at the end of that
/// event's handler, when the connection's state is consistent again, so a
/// resumed coroutine may start new operations or destroy the endpoint. An
/// operation is resumed only when no kernel request still uses its memory:
/// its frame is not in a write in flight, and no read in flight targets its
/// buffer.
#pragma once

#include <liburing.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <new>
#include <optional>
#include <stop_token>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/access.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/common.hpp>
#include <gdr/transport/tcp/frame.hpp>
#include <gdr/transport/tcp/socket.hpp>

namespace gdr {

namespace tcp {

/// The TCP transport's tag: the key of its `transport_traits` rows.
struct transport {};

}  // namespace tcp

/// TCP sends host memory straight from the user's buffer (an iovec handed to
/// `sendmsg`) and receives large payloads straight into it: no copy in user
/// space. (The kernel still copies between the buffer and its socket buffers.)
template <>
struct transport_traits<tcp::transport, Host> {
  static constexpr bool zero_copy = true;
  static constexpr bool supported = true;
};

/// Pinned memory is host memory to a socket.
template <>
struct transport_traits<tcp::transport, Pinned> {
  static constexpr bool zero_copy = true;
  static constexpr bool supported = true;
};

// Device: the conservative default (unsupported) applies. A socket cannot
// reach GPU memory; see the diagnostic in detail::tcp::check_space.

namespace tcp {

/// Tuning of one endpoint. The defaults suit a loopback or datacenter link.
struct endpoint_options {
  /// Data payloads up to this size are *eager*: received through the
  /// staging buffer (one copy, cheaper than a second system call for small
  /// messages), and kept when they arrive before their recv is posted.
  std::size_t eager_limit = 16 * 1024;
  /// The most bytes of early (unexpected) eager messages held per endpoint.
  /// The store grows to this size only as needed. Beyond it, the reader
  /// stops reading the socket until a recv is posted.
  std::size_t unexpected_capacity = 256 * 1024;
  /// Size of the staging buffer each read fills (clamped to at least one
  /// header plus `eager_limit`).
  std::size_t rx_buffer = 64 * 1024;
  /// The longest frame accepted (data and put payloads, get sizes); a peer
  /// announcing more is a protocol error. Sends longer than this fail with
  /// `errc::invalid_argument` (both ends should agree).
  std::uint64_t max_message = wire::default_max_message;
  /// Writes whose payload bytes reach this size use `IORING_OP_SENDMSG_ZC`
  /// (the kernel pins the user's pages instead of copying them). 0: never.
  /// Off by default: on loopback it measured slower (benchmarks/RESULTS.md);
  /// on a real NIC it may win for large messages.
  std::size_t zero_copy_send_threshold = 0;
  /// Peer requests (put/get) served at once; more stop the reader until a
  /// reply has been written.
  std::size_t reply_slots = 64;
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
};

/// Counters of one endpoint, updated as its operations complete.
struct endpoint_stats : transfer_stats {
  std::uint64_t writes = 0;            ///< writes of a batch of frames (io_uring or direct)
  std::uint64_t zero_copy_writes = 0;  ///< of which SENDMSG_ZC
  std::uint64_t direct_writes = 0;     ///< of which non-blocking system calls by the loop (busy_poll)
  std::uint64_t reads = 0;             ///< reads started (staging and direct; io_uring or spinning)
  std::uint64_t direct_reads = 0;      ///< of which straight into a user or registered buffer
  std::uint64_t spin_reads = 0;        ///< non-blocking recv() attempts by the loop (busy_poll, see endpoint_options)
  std::uint64_t frames_out = 0;        ///< frames written
  std::uint64_t frames_in = 0;         ///< frames parsed
  std::uint64_t unexpected = 0;        ///< data frames held because no recv was posted
  std::uint64_t served_puts = 0;       ///< peer puts applied to registered memory
  std::uint64_t served_gets = 0;       ///< peer gets answered with data
  std::uint64_t refused = 0;           ///< peer puts/gets refused (errc::remote_access on their side)
};

}  // namespace tcp

namespace detail::tcp {

using gdr::tcp::endpoint_options;
using gdr::tcp::endpoint_stats;
using gdr::tcp::frame_header;
using gdr::tcp::frame_type;
using gdr::tcp::wire_status;
namespace wire = gdr::tcp::wire;

class connection;
class endpoint_op;
struct reply_slot;

/// The diagnostic for a memory space TCP cannot move.
template <class S>
constexpr void check_space() noexcept {
  static_assert(transport_supports<gdr::tcp::transport, S>,
                "gdr::tcp::endpoint: this memory space is not supported by the TCP transport "
                "(transport_traits<tcp::transport, S>::supported is false). A socket reaches host memory "
                "only: device memory needs a staged path (copy it into a gdr::Pinned buffer first, "
                "co_await gdr::copy(dst, src, stream), and send that) or another transport "
                "(CUDA IPC within a node, verbs with GPUDirect RDMA across nodes).");
}

/// A frame waiting in the writer's queue or being written.
struct tx_item {
  tx_item* prev = nullptr;
  tx_item* next = nullptr;
  frame_header hdr{};                      // seq is set when sealed
  std::byte wire_hdr[wire::header_size]{};  // the encoded header, once sealed
  const std::byte* payload = nullptr;
  std::size_t length = 0;   // payload bytes
  std::size_t written = 0;  // header + payload bytes the kernel has taken
  endpoint_op* op = nullptr;     // owner, or
  reply_slot* slot = nullptr;    // owner
  bool sealed = false;           // numbered and committed (joined a batch)
  bool in_flight = false;        // part of the write the kernel is doing now
  bool queued = false;           // in the writer's queue

  std::size_t total() const noexcept { return wire::header_size + length; }
};

/// A reply this side owes its peer (put_ack or get_reply).
struct reply_slot {
  tx_item item{};
  reply_slot* next_free = nullptr;
};

/// Doubly linked intrusive FIFO; `T` has `prev` and `next` (or named members
/// through `Links`).
template <class T, T* T::*Prev, T* T::*Next>
struct fifo {
  T* head = nullptr;
  T* tail = nullptr;
  std::size_t size = 0;

  bool empty() const noexcept { return head == nullptr; }
  void push_back(T* n) noexcept {
    n->*Prev = tail;
    n->*Next = nullptr;
    (tail ? tail->*Next : head) = n;
    tail = n;
    ++size;
  }
  void erase(T* n) noexcept {
    (n->*Prev ? (n->*Prev)->*Next : head) = n->*Next;
    (n->*Next ? (n->*Next)->*Prev : tail) = n->*Prev;
    n->*Prev = n->*Next = nullptr;
    --size;
  }
  T* pop_front() noexcept {
    T* n = head;
    if (n != nullptr) erase(n);
    return n;
  }
};

/// Early eager messages (arrived before their recv): a bounded FIFO of
/// [length, bytes] records in one buffer. The buffer grows by doubling, up to
/// the endpoint's `unexpected_capacity`; sizes are gdr's choice, never the
/// peer's.
class message_store {
 public:
  explicit message_store(std::size_t limit) noexcept : limit_(limit) {}

  bool empty() const noexcept { return count_ == 0; }
  std::size_t count() const noexcept { return count_; }

  /// Room for a message of `len` bytes (within the limit, allocation aside).
  bool fits(std::size_t len) const noexcept { return (tail_ - head_) + record(len) <= limit_; }

  /// Appends a message; false if it does not fit or memory is short.
  bool push(const std::byte* src, std::size_t len) noexcept {
    std::size_t need = record(len);
    if (!fits(len)) return false;
    if (tail_ + need > cap_) {
      // Slide the live records to the front, then grow if still short.
      if (head_ != 0) {
        std::memmove(buf_.get(), buf_.get() + head_, tail_ - head_);
        tail_ -= head_;
        head_ = 0;
      }
      if (tail_ + need > cap_) {
        std::size_t cap = std::max<std::size_t>(cap_ * 2, 4096);
        while (cap < tail_ + need) cap *= 2;
        cap = std::min(cap, limit_);
        std::unique_ptr<std::byte[]> nb(new (std::nothrow) std::byte[cap]);
        if (!nb) return false;
        if (tail_ != 0) std::memcpy(nb.get(), buf_.get(), tail_);
        buf_ = std::move(nb);
        cap_ = cap;
      }
    }
    std::uint64_t l = len;
    std::memcpy(buf_.get() + tail_, &l, sizeof l);
    if (len != 0) std::memcpy(buf_.get() + tail_ + sizeof l, src, len);
    tail_ += need;
    ++count_;
    return true;
  }

  /// Moves the oldest message into `dst` (at most `cap` bytes); returns its
  /// full length. Precondition: not empty.
  std::size_t pop(std::byte* dst, std::size_t cap) noexcept {
    std::uint64_t l = 0;
    std::memcpy(&l, buf_.get() + head_, sizeof l);
    std::size_t n = std::min<std::size_t>(l, cap);
    if (n != 0) std::memcpy(dst, buf_.get() + head_ + sizeof l, n);
    head_ += record(static_cast<std::size_t>(l));
    if (--count_ == 0) head_ = tail_ = 0;
    return static_cast<std::size_t>(l);
  }

 private:
  static std::size_t record(std::size_t len) noexcept { return sizeof(std::uint64_t) + ((len + 7) & ~std::size_t{7}); }

  std::unique_ptr<std::byte[]> buf_;
  std::size_t cap_ = 0;
  std::size_t limit_;
  std::size_t head_ = 0;
  std::size_t tail_ = 0;
  std::size_t count_ = 0;
};

/// A send, recv, put, get or close: the awaitable, its queue links, its
/// frame and its completion. Lives in the awaiting coroutine's frame.
///
/// Life: built with its parameters (movable until awaited). `await_suspend`
/// completes it at once (returns false) or hands it to the connection. From
/// then on the connection records its result (`connection::complete`) and
/// calls `finish` once the kernel no longer uses its memory; `finish` waits
/// for the op's timer CQE and a posted cancellation, if any, then puts it on
/// the connection's ready list, which resumes it.
class endpoint_op {
 public:
  enum class kind : std::uint8_t { send, recv, put, get, close };

  endpoint_op(connection* c, kind k, std::byte* data, std::size_t size, op_options opts) noexcept
      : conn_(c), data_(data), size_(size), opts_(std::move(opts)), kind_(k) {}

  endpoint_op(connection* c, kind k, std::byte* data, std::size_t size, std::uint64_t raddr, std::size_t rsize,
              std::uint64_t rkey, op_options opts) noexcept
      : conn_(c), data_(data), size_(size), raddr_(raddr), rsize_(rsize), rkey_(rkey), opts_(std::move(opts)),
        kind_(k) {}

  // Movable only before it is awaited (it is then only its parameters).
  endpoint_op(endpoint_op&& o) noexcept
      : conn_(o.conn_), data_(o.data_), size_(o.size_), raddr_(o.raddr_), rsize_(o.rsize_), rkey_(o.rkey_),
        opts_(std::move(o.opts_)), kind_(o.kind_) {}
  endpoint_op& operator=(endpoint_op&&) = delete;

  bool await_ready() const noexcept { return false; }

  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    return start(h, stop_token_of(h));
  }

  /// Bytes moved (sent, received into the view, put or got). Throws `gdr::error`.
  std::size_t await_resume() { return result_value().value(); }

  /// The same operation, but `co_await` returns `result<std::size_t>`.
  auto as_result() && noexcept {
    struct adapter : endpoint_op {
      explicit adapter(endpoint_op&& o) noexcept : endpoint_op(std::move(o)) {}
      result<std::size_t> await_resume() noexcept { return this->result_value(); }
    };
    return adapter{std::move(*this)};
  }

 protected:
  result<std::size_t> result_value() noexcept {
    if (ec_) return ec_;
    return bytes_;
  }

 private:
  friend class connection;

  struct canceller {
    endpoint_op* self;
    void operator()() const noexcept { self->on_stop_requested(); }
  };
  struct cancel_node : remote_work {
    endpoint_op* self = nullptr;
  };
  struct timer_node : operation {
    endpoint_op* self = nullptr;
  };

  inline bool start(std::coroutine_handle<> h, std::stop_token coro_stop) noexcept;
  inline void on_stop_requested() noexcept;
  inline static void on_cancel_node(remote_work* w) noexcept;
  inline static void on_timer(operation* op, int res, std::uint32_t flags) noexcept;
  inline bool arm_timer() noexcept;
  inline void finish() noexcept;
  inline void release() noexcept;

  // ---- parameters ----
  connection* conn_;
  std::byte* data_;
  std::size_t size_;
  std::uint64_t raddr_ = 0;
  std::size_t rsize_ = 0;
  std::uint64_t rkey_ = 0;
  op_options opts_;
  kind kind_;

  // ---- state (loop thread) ----
  bool result_set_ = false;     // the outcome is decided
  bool finished_ = false;       // finish() ran
  bool in_recvs_ = false;       // in the connection's recv queue
  bool in_rma_ = false;         // in the connection's awaiting-reply queue
  bool direct_target_ = false;  // a direct read into data_ is in flight
  bool timer_armed_ = false;
  bool timer_fired_ = false;
  bool cancel_ran_ = false;
  int pending_ = 0;  // events to come before resumption: the result, the timer, a posted cancel
  std::error_code ec_{};
  std::error_code deferred_cancel_{};  // cancelled while its frame is in a write in flight
  std::size_t bytes_ = 0;
  transfer_path path_ = transfer_path::none;
  endpoint_op* prev_ = nullptr;  // recv queue or awaiting-reply queue
  endpoint_op* next_ = nullptr;
  endpoint_op* ready_next_ = nullptr;
  std::coroutine_handle<> waiter_{};
  tx_item tx_{};

  // ---- cancellation (the callbacks may run on any thread) ----
  std::optional<std::stop_callback<canceller>> stop_user_{};
  std::optional<std::stop_callback<canceller>> stop_coro_{};
  std::atomic<bool> cancel_posted_{false};
  std::error_code cancel_reason_{errc::cancelled};  // what the posted cancellation reports
  cancel_node cancel_{};
  timer_node timer_{};
  __kernel_timespec ts_{};
};

/// Where the reader is putting the payload of the current frame.
struct rx_target {
  bool active = false;
  endpoint_op* op = nullptr;   // a recv or a get; null for a put being served
  reply_slot* slot = nullptr;  // a put being served: its ack
  std::byte* dst = nullptr;
  std::size_t want = 0;     // bytes to write at dst
  std::size_t done = 0;     // bytes written so far
  std::size_t discard = 0;  // bytes of the frame to drop after `want` (truncation)
  bool direct = false;      // some bytes were read by the kernel straight into dst
};

/// One connected socket and everything in flight on it. See the file comment.
class connection {
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

  /// Takes over `sock` (connected; options already applied) and starts
  /// reading. Call on `s`'s thread, or before `s` runs. Throws
  /// `std::bad_alloc`.
  connection(scheduler& s, gdr::tcp::socket sock, memory_registry& reg, const endpoint_options& o)
      : sched_(&s), sock_(std::move(sock)), registry_(&reg), opts_(o), store_(o.unexpected_capacity) {
    if (opts_.eager_limit > opts_.max_message) opts_.eager_limit = static_cast<std::size_t>(opts_.max_message);
    rx_cap_ = std::max(opts_.rx_buffer, wire::header_size + opts_.eager_limit);
    rx_buf_.reset(new std::byte[rx_cap_]);
    std::size_t nslots = std::max<std::size_t>(opts_.reply_slots, 1);
    slots_.reset(new reply_slot[nslots]);
    for (std::size_t i = nslots; i-- > 0;) {
      slots_[i].item.slot = &slots_[i];
      slots_[i].next_free = free_slots_;
      free_slots_ = &slots_[i];
    }
    read_op_.self = this;
    read_op_.complete = &on_read;
    write_op_.self = this;
    write_op_.complete = &on_write;
    kick_.self = this;
    kick_.run = &on_kick;
    spin_.self = this;
    msg_.msg_iov = iov_;
    // The reader runs from the start: the peer may send requests (put/get)
    // before this side posts anything.
    pump();
  }

  connection(const connection&) = delete;
  connection& operator=(const connection&) = delete;

  scheduler& sched() const noexcept { return *sched_; }
  int fd() const noexcept { return sock_.native_handle(); }
  const endpoint_stats& stats() const noexcept { return stats_; }
  transfer_path last_path() const noexcept { return last_path_; }
  /// The error new operations fail with (none while usable).
  std::error_code state_error() const noexcept {
    if (closing_) return errc::closed;
    return error_;
  }
  /// The parser's reason for the last protocol error, for diagnostics.
  gdr::tcp::frame_status protocol_reason() const noexcept { return protocol_reason_; }

  /// The endpoint is gone: abort (if still open); the connection frees
  /// itself once nothing is in flight and every operation has resumed. Loop
  /// thread.
  void abandon() noexcept {
    abandoned_ = true;
    if (!error_) fail(errc::closed);
    if (busy_ == 0 && deletable()) delete this;
  }

  // ---------------------------------------------------------------- ops

  /// Starts `op` (from its await_suspend). True: the op is pending; false:
  /// it completed at once (its result is set).
  bool begin(endpoint_op& op) noexcept {
    switch (op.kind_) {
      case endpoint_op::kind::recv: return begin_recv(op);
      case endpoint_op::kind::close: return begin_close(op);
      default: return begin_tx(op);
    }
  }

  /// A cancellation (stop token, timeout) reached `op`. Loop thread, inside
  /// enter()/leave().
  void cancel(endpoint_op& op, std::error_code why) noexcept {
    if (op.result_set_) return;
    switch (op.kind_) {
      case endpoint_op::kind::send:
      case endpoint_op::kind::put:
      case endpoint_op::kind::get:
        if (!op.tx_.sealed) {
          complete(op, why);  // still waiting in the queue: withdrawn
        } else if (op.tx_.queued) {
          // In a write in flight: the kernel holds its memory. If the write
          // leaves the frame untouched it is withdrawn then (write_done);
          // if any byte goes out it is committed: a send then completes
          // normally (withdrawing it would leave a hole in the stream), a
          // put/get completes with `why` once its request is out and its
          // reply is dropped.
          if (!op.deferred_cancel_) op.deferred_cancel_ = why;
        } else if (op.kind_ != endpoint_op::kind::send) {
          complete(op, why);  // awaiting the reply or its payload: orphan it
        }
        break;
      case endpoint_op::kind::recv: complete(op, why); break;
      case endpoint_op::kind::close:
        // Stop waiting for the flush: abort the connection.
        complete(op, why);
        if (!error_) fail(errc::closed);
        break;
    }
  }

  // Every event handler runs between enter() and leave(). leave() resumes
  // what completed, now that the state is consistent, and frees an abandoned
  // connection; nothing is resumed from inside a user's call.
  void enter() noexcept { ++busy_; }
  void leave() noexcept {
    bool wrote = false;
    for (;;) {
      while (endpoint_op* op = ready_head_) {
        ready_head_ = op->ready_next_;
        if (ready_head_ == nullptr) ready_tail_ = nullptr;
        --attached_;
        op->waiter_.resume();  // may start ops, or destroy the endpoint
      }
      if (busy_ != 1) break;
      // Frames the resumed coroutines queued go out now (direct writes),
      // once per handler: sends that complete resume senders that queue
      // more, and the rest of the loop must get its turn (what is queued
      // after that goes to io_uring, below).
      if (write_deferred_ && !wrote) {
        write_deferred_ = false;
        wrote = true;
        start_write(true);
        continue;
      }
      // A staging read decided during the handler goes into the SQ behind
      // whatever the resumed coroutines queued (see submit_read). Issuing
      // it can fail the connection, which completes more operations.
      if (read_deferred_) {
        issue_read();
        continue;
      }
      break;
    }
    if (busy_ == 1 && write_deferred_) {
      write_deferred_ = false;
      start_write(false);
    }
    if (--busy_ == 0 && abandoned_ && deletable()) delete this;
  }

  void push_ready(endpoint_op& op) noexcept {
    op.ready_next_ = nullptr;
    (ready_tail_ ? ready_tail_->ready_next_ : ready_head_) = &op;
    ready_tail_ = &op;
    // Completed outside an event handler (a failure found by a user's
    // call): resume it from the loop.
    if (busy_ == 0) kick();
  }

  void note_attached() noexcept { ++attached_; }

  /// Counts a finished operation. Loop thread.
  void record(const endpoint_op& op) noexcept {
    if (op.ec_) {
      ++stats_.failed;
      return;
    }
    switch (op.kind_) {
      case endpoint_op::kind::send: ++stats_.sends; stats_.bytes_sent += op.bytes_; break;
      case endpoint_op::kind::put: ++stats_.puts; stats_.bytes_sent += op.bytes_; break;
      case endpoint_op::kind::recv: ++stats_.recvs; stats_.bytes_received += op.bytes_; break;
      case endpoint_op::kind::get: ++stats_.gets; stats_.bytes_received += op.bytes_; break;
      case endpoint_op::kind::close: return;
    }
    ++stats_.by_path[static_cast<std::size_t>(op.path_)];
    last_path_ = op.path_;
  }

 private:
  struct conn_op : operation {
    connection* self = nullptr;
  };
  struct kick_node : remote_work {
    connection* self = nullptr;
  };
  enum class rx_wait : std::uint8_t {
    none,     // reading (or about to)
    recv,     // a data frame waits for a recv (or for room in the store)
    slot,     // a request waits for a free reply slot
    stopped,  // failed or closed: no more reading
  };
  struct orphan {
    std::uint32_t tag;
    bool get;
  };

  ~connection() {  // only through leave() or abandon()
    if (spin_registered_) sched_->remove_poller(spin_);
  }

  bool deletable() const noexcept {
    return attached_ == 0 && ready_head_ == nullptr && !read_inflight_ && !write_inflight_ && !kick_posted_;
  }

  // ---------------------------------------------------------------- starting

  bool begin_recv(endpoint_op& op) noexcept {
    if (closing_) {
      op.ec_ = errc::closed;
      return false;
    }
    if (!store_.empty()) {
      // Early messages first: recvs match messages in arrival order.
      std::size_t len = store_.pop(op.data_, op.size_);
      op.bytes_ = std::min(len, op.size_);
      op.path_ = transfer_path::host_eager;
      if (len > op.size_) op.ec_ = errc::truncated;
      if (wait_ == rx_wait::recv) kick();
      return false;
    }
    if (error_) {
      op.ec_ = error_;
      return false;
    }
    recvs_.push_back(&op);
    op.in_recvs_ = true;
    if (wait_ == rx_wait::recv) kick();
    return true;
  }

  bool begin_tx(endpoint_op& op) noexcept {
    if (std::error_code ec = state_error()) {
      op.ec_ = ec;
      return false;
    }
    frame_header& h = op.tx_.hdr;
    if (op.kind_ == endpoint_op::kind::send) {
      if (op.size_ > opts_.max_message) {
        op.ec_ = errc::invalid_argument;  // the peer would refuse it (same limit)
        return false;
      }
      h.type = frame_type::data;
      h.length = op.size_;
      op.tx_.payload = op.data_;
      op.tx_.length = op.size_;
    } else {
      // The local view must fit in the remote one: a mismatch is the caller's bug.
      if (op.size_ > op.rsize_ || op.size_ > opts_.max_message) {
        op.ec_ = errc::invalid_argument;
        return false;
      }
      bool put = op.kind_ == endpoint_op::kind::put;
      h.type = put ? frame_type::put_request : frame_type::get_request;
      h.length = op.size_;
      h.addr = op.raddr_;
      h.key = op.rkey_;
      if (put) {
        op.tx_.payload = op.data_;
        op.tx_.length = op.size_;
      }
      // Awaiting its reply from now on: a reply may be parsed before the
      // write's own CQE is.
      rma_.push_back(&op);
      op.in_rma_ = true;
    }
    op.tx_.op = &op;
    enqueue(op.tx_);
    return true;
  }

  bool begin_close(endpoint_op& op) noexcept {
    if (closing_) return false;  // a second close: nothing more to do
    closing_ = true;
    if (error_) {
      // Failed already: nothing to flush; wait only for the kernel to
      // return the connection's buffers.
      close_op_ = &op;
      op.result_set_ = true;
      if (!read_inflight_ && !write_inflight_) {
        close_op_ = nullptr;
        sock_.close();
        return false;
      }
      return true;
    }
    close_op_ = &op;
    op.tx_.hdr.type = frame_type::close;
    op.tx_.op = &op;
    enqueue(op.tx_);
    return true;
  }

  // ---------------------------------------------------------------- completing

  /// Decides `op`'s outcome (the first decision wins) and takes it out of
  /// every queue it can leave now; it finishes once the kernel is done with
  /// its memory (try_finish).
  void complete(endpoint_op& op, std::error_code ec) noexcept {
    if (op.result_set_) return;
    op.result_set_ = true;
    op.ec_ = ec;
    if (op.in_recvs_) {
      recvs_.erase(&op);
      op.in_recvs_ = false;
    }
    if (op.in_rma_) {
      rma_.erase(&op);
      op.in_rma_ = false;
      // A request the peer has (or will have) seen: its reply must be
      // recognised and dropped.
      if (op.tx_.sealed && !error_) orphans_.push_back({op.tx_.hdr.seq, op.kind_ == endpoint_op::kind::get});
    }
    if (target_.active && target_.op == &op) {
      if (read_inflight_ && read_direct_) {
        // The kernel is writing into op's buffer: stop it. The read's CQE
        // (for a spinning read, the next poll) finishes the op; the rest of
        // the frame is skipped.
        if (spin_pending_) {
          spin_cancel_ = true;
        } else {
          sched_->cancel(&read_op_);
        }
      } else {
        release_target();
      }
    }
    try_finish(op);
  }

  /// Finishes `op` if its outcome is decided and no kernel request uses
  /// its memory any more.
  void try_finish(endpoint_op& op) noexcept {
    if (!op.result_set_ || op.finished_ || op.direct_target_) return;
    if (op.tx_.queued) {
      if (op.tx_.in_flight) return;
      if (op.tx_.sealed && !error_) return;  // committed: waits for its write
      tx_.erase(&op.tx_);
      op.tx_.queued = false;
    }
    if (op.kind_ == endpoint_op::kind::close) {
      // close() returns when the socket is quiet and closed.
      if (read_inflight_ || write_inflight_) return;
      close_op_ = nullptr;
      sock_.close();
    }
    op.finish();
  }

  /// The current frame's payload is no longer wanted: skip the rest of it.
  void release_target() noexcept {
    skip_ += (target_.want - target_.done) + target_.discard;
    if (target_.op != nullptr) target_.op->direct_target_ = false;
    if (target_.slot != nullptr) free_slot(target_.slot);
    target_ = {};
  }

  // ---------------------------------------------------------------- failure

  /// The connection is unusable: fail everything with `ec` (connection_lost,
  /// protocol_error, or closed). Frames in the write in flight, and an op
  /// the kernel is reading into, complete when their CQE arrives (the
  /// shutdown makes it arrive at once).
  void fail(std::error_code ec) noexcept {
    if (error_) return;
    error_ = ec;
    wait_ = rx_wait::stopped;
    // Wake the reads and writes in flight: a recv returns 0, a send EPIPE.
    if (sock_.valid()) ::shutdown(fd(), SHUT_RDWR);
    for (tx_item* it = tx_.head; it != nullptr;) {
      tx_item* next = it->next;
      if (!it->in_flight) drop_item(*it);
      it = next;
    }
    while (endpoint_op* op = recvs_.head) complete(*op, ec);
    while (endpoint_op* op = rma_.head) complete(*op, ec);
    orphans_.clear();
    if (target_.active) {
      if (target_.op != nullptr) {
        complete(*target_.op, ec);
      } else if (!read_inflight_) {
        release_target();
      }
    }
  }

  /// A frame that will not be written (failure): take it out and complete
  /// its owner.
  void drop_item(tx_item& it) noexcept {
    tx_.erase(&it);
    it.queued = false;
    if (it.slot != nullptr) {
      free_slot(it.slot);
    } else if (it.op != nullptr) {
      // A close overtaken by a failure (or by the peer's own close) has
      // nothing left to flush: it succeeds, as closing a failed endpoint does.
      complete(*it.op, it.op->kind_ == endpoint_op::kind::close ? std::error_code{} : error_);
      try_finish(*it.op);
    }
  }

  void protocol_fail(gdr::tcp::frame_status why) noexcept {
    protocol_reason_ = why;
    fail(errc::protocol_error);
  }

  // ---------------------------------------------------------------- writer

  void enqueue(tx_item& it) noexcept {
    it.queued = true;
    tx_.push_back(&it);
    if (direct_writes() && busy_ > 0) {
      // Queued inside an event handler: written by a system call at its
      // end (leave), with whatever else its coroutines queue. Queued
      // outside one (from the caller's co_await), it goes to io_uring: an
      // operation must not complete before it has suspended.
      write_deferred_ = true;
      return;
    }
    start_write(false);
  }

  void seal(tx_item& it) noexcept {
    it.hdr.seq = tx_seq_++;
    gdr::tcp::encode_frame(it.hdr, it.wire_hdr);
    it.sealed = true;
  }

  /// Writes go out as non-blocking system calls made by the loop
  /// (endpoint_options::direct_writes_in_busy_poll).
  bool direct_writes() const noexcept {
    return opts_.direct_writes_in_busy_poll && sched_->mode() == run_mode::busy_poll;
  }

  /// Gathers the next batch from the head of the queue into iov_/msg_
  /// (sealing its frames and marking them in flight); a small batch is also
  /// copied into small_buf_. Returns its bytes.
  std::size_t gather() noexcept {
    std::size_t iovn = 0;
    std::size_t payload = 0;
    std::size_t n = 0;
    for (tx_item* it = tx_.head; it != nullptr && n < max_batch; it = it->next) {
      if (!it->sealed) seal(*it);
      it->in_flight = true;
      std::size_t off = it->written;
      if (off < wire::header_size) {
        iov_[iovn++] = {it->wire_hdr + off, wire::header_size - off};
        off = 0;
      } else {
        off -= wire::header_size;
      }
      if (it->length > off) {
        // sendmsg only reads through iov_base; iovec has no const member.
        iov_[iovn++] = {const_cast<std::byte*>(it->payload) + off, it->length - off};
        payload += it->length - off;
      }
      ++n;
      if (payload >= batch_bytes) break;
    }
    batch_n_ = n;
    msg_.msg_iovlen = iovn;
    zc_write_ = opts_.zero_copy_send_threshold != 0 && payload >= opts_.zero_copy_send_threshold;
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
    while (!write_inflight_ && !error_ && !tx_.empty()) {
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
      io_uring_sqe* sqe = sched_->get_sqe();
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
      sched_->note_submitted();
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
    c->write_done(res);
    c->leave();
  }

  void write_done(int res) noexcept {
    write_inflight_ = false;
    write_blocked_ = false;
    if (batch_done(res)) start_write(true);
  }

  /// Accounts for the write of the current batch (`res`: bytes taken, or
  /// -errno): frames entirely out complete, frames untouched are unsealed.
  /// False: the connection failed.
  bool batch_done(ssize_t res) noexcept {
    std::size_t left = res > 0 ? static_cast<std::size_t>(res) : 0;
    std::size_t n = std::exchange(batch_n_, 0);
    // The batch is the first n frames of the queue; none can have left it
    // while in flight.
    tx_item* it = tx_.head;
    for (std::size_t i = 0; i < n; ++i) {
      tx_item* next = it->next;
      it->in_flight = false;
      std::size_t take = std::min(left, it->total() - it->written);
      it->written += take;
      left -= take;
      if (it->written == it->total()) {
        tx_.erase(it);
        it->queued = false;
        ++stats_.frames_out;
        written(*it);
      }
      it = next;
    }
    if (res < 0 && res != -EINTR && res != -EAGAIN) fail(connection_error(static_cast<int>(res)));
    if (error_) {
      while (tx_item* rest = tx_.head) drop_item(*rest);
      if (close_op_ != nullptr) try_finish(*close_op_);
      return false;
    }
    unseal_untouched();
    return true;
  }

  /// After a short write: the sealed frames the kernel took no byte of are
  /// the last ones sealed, so they can be withdrawn again (numbers handed
  /// back), and those cancelled meanwhile complete now.
  void unseal_untouched() noexcept {
    tx_item* it = tx_.head;
    while (it != nullptr && it->sealed && it->written != 0) it = it->next;
    while (it != nullptr && it->sealed) {
      tx_item* next = it->next;
      it->sealed = false;
      --tx_seq_;
      if (it->op != nullptr && it->op->deferred_cancel_) complete(*it->op, it->op->deferred_cancel_);
      it = next;
    }
  }

  /// Frame `it` is entirely in the kernel.
  void written(tx_item& it) noexcept {
    if (it.slot != nullptr) {
      free_slot(it.slot);
      return;
    }
    endpoint_op& op = *it.op;
    switch (op.kind_) {
      case endpoint_op::kind::send:
        op.bytes_ = op.size_;
        op.path_ = transfer_path::host_zero_copy;  // from the user's buffer by iovec
        complete(op, {});
        break;
      case endpoint_op::kind::put:
      case endpoint_op::kind::get:
        if (!op.result_set_ && op.deferred_cancel_) complete(op, op.deferred_cancel_);
        break;
      case endpoint_op::kind::close:
        // Everything before the close frame is out. Fail what is still
        // pending with errc::closed; the shutdown ends the stream (FIN).
        complete(op, {});
        fail(errc::closed);
        break;
      case endpoint_op::kind::recv: break;
    }
    try_finish(op);
  }

  // ---------------------------------------------------------------- replies

  reply_slot* take_slot() noexcept {
    reply_slot* s = free_slots_;
    if (s != nullptr) free_slots_ = s->next_free;
    return s;
  }

  void free_slot(reply_slot* s) noexcept {
    s->item = tx_item{};
    s->item.slot = s;
    s->next_free = free_slots_;
    free_slots_ = s;
    if (wait_ == rx_wait::slot) kick();
  }

  void send_reply(reply_slot* s, frame_type type, std::uint32_t request_seq, wire_status status,
                  const std::byte* payload, std::size_t length) noexcept {
    tx_item& it = s->item;
    it.hdr = frame_header{};
    it.hdr.type = type;
    it.hdr.status = status;
    it.hdr.addr = request_seq;
    it.hdr.length = length;
    it.payload = payload;
    it.length = length;
    if (error_) {
      free_slot(s);
      return;
    }
    enqueue(it);
  }

  // ---------------------------------------------------------------- reader

  void kick() noexcept {
    if (kick_posted_) return;
    kick_posted_ = true;
    sched_->post(&kick_);
  }

  static void on_kick(remote_work* w) noexcept {
    connection* c = static_cast<kick_node*>(w)->self;
    c->enter();
    c->kick_posted_ = false;
    if (!c->error_) {
      if (c->wait_ == rx_wait::recv || c->wait_ == rx_wait::slot) {
        c->wait_ = rx_wait::none;
        c->pump();
      }
      c->start_write(true);  // after an SQ-full retry
    }
    c->leave();
  }

  /// Consumes what the staging buffer holds, then starts the next read or
  /// pauses. Precondition: no read in flight, not paused.
  void pump() noexcept {
    while (!error_) {
      std::size_t avail = rx_end_ - rx_pos_;
      if (skip_ > 0) {
        auto n = static_cast<std::size_t>(std::min<std::uint64_t>(skip_, avail));
        rx_pos_ += n;
        skip_ -= n;
        if (skip_ > 0) return read_staging();
        continue;
      }
      if (target_.active) {
        std::size_t n = std::min(target_.want - target_.done, avail);
        if (n != 0) {
          std::memcpy(target_.dst + target_.done, rx_buf_.get() + rx_pos_, n);
          rx_pos_ += n;
          target_.done += n;
        }
        if (target_.done == target_.want) {
          target_done();
          continue;
        }
        // The buffer is empty and the payload goes on: a small rest comes
        // through the staging buffer (with whatever follows it), a large
        // one straight into its destination.
        if (target_.want - target_.done <= opts_.eager_limit) return read_staging();
        return read_direct();
      }
      if (avail < wire::header_size) return read_staging();
      if (!parse_one()) return;
    }
  }

  /// Handles the frame whose header starts at rx_pos_. False: stop pumping
  /// (paused, waiting for more bytes, or failed).
  bool parse_one() noexcept {
    const std::byte* p = rx_buf_.get() + rx_pos_;
    gdr::tcp::frame_parse_result r =
        gdr::tcp::parse_frame(std::span<const std::byte>(p, wire::header_size), opts_.max_message);
    if (r.status != gdr::tcp::frame_status::ok) {
      protocol_fail(r.status);
      return false;
    }
    const frame_header& h = r.header;
    if (h.seq != rx_seq_) {
      protocol_fail(gdr::tcp::frame_status::bad_field);  // out of step (a lost or forged frame)
      return false;
    }
    auto len = static_cast<std::size_t>(h.length);
    switch (h.type) {
      case frame_type::data: {
        large_ = len > opts_.eager_limit;
        if (endpoint_op* op = recvs_.pop_front()) {
          op->in_recvs_ = false;
          consume_header();
          std::size_t want = std::min(len, op->size_);
          if (want < len) op->ec_ = errc::truncated;  // reported when the payload is in
          set_target(op, nullptr, op->data_, want, len - want);
          return true;
        }
        if (len <= opts_.eager_limit && store_.fits(len)) {
          if (rx_end_ - rx_pos_ < wire::header_size + len) {
            read_staging();  // the whole frame fits in the staging buffer: get the rest
            return false;
          }
          if (store_.push(p + wire::header_size, len)) {
            ++stats_.unexpected;
            consume_header();
            rx_pos_ += len;
            return true;
          }
        }
        wait_ = rx_wait::recv;  // flow control: read no further until a recv comes
        return false;
      }
      case frame_type::put_request: {
        large_ = len > opts_.eager_limit;
        reply_slot* s = take_slot();
        if (s == nullptr) {
          wait_ = rx_wait::slot;
          return false;
        }
        consume_header();
        result<std::byte*> dst = registry_->resolve(h.addr, len, h.key, access::write);
        if (!dst) {
          // Refused: nothing is written; the payload is read and dropped.
          ++stats_.refused;
          skip_ = len;
          send_reply(s, frame_type::put_ack, h.seq, wire_status::remote_access, nullptr, 0);
          return true;
        }
        s->item.hdr.addr = h.seq;  // remembered for the ack
        set_target(nullptr, s, *dst, len, 0);
        return true;
      }
      case frame_type::get_request: {
        reply_slot* s = take_slot();
        if (s == nullptr) {
          wait_ = rx_wait::slot;
          return false;
        }
        consume_header();
        result<std::byte*> src = registry_->resolve(h.addr, len, h.key, access::read);
        if (!src) {
          ++stats_.refused;
          send_reply(s, frame_type::get_reply, h.seq, wire_status::remote_access, nullptr, 0);
        } else {
          // The payload goes to the wire straight from the registered memory.
          // A registration revoked while it is written still finishes
          // (registration.hpp: accesses being served finish).
          ++stats_.served_gets;
          send_reply(s, frame_type::get_reply, h.seq, wire_status::ok, *src, len);
        }
        return true;
      }
      case frame_type::put_ack:
      case frame_type::get_reply: {
        bool get = h.type == frame_type::get_reply;
        if (get) large_ = len > opts_.eager_limit;
        auto tag = static_cast<std::uint32_t>(h.addr);
        consume_header();
        if (!orphans_.empty() && orphans_.front().tag == tag) {
          if (orphans_.front().get != get) {
            protocol_fail(gdr::tcp::frame_status::bad_field);
            return false;
          }
          orphans_.pop_front();
          skip_ = len;  // a cancelled get: its data is dropped
          return true;
        }
        endpoint_op* op = rma_.head;
        if (op == nullptr || !op->tx_.sealed || op->tx_.hdr.seq != tag ||
            (op->kind_ == endpoint_op::kind::get) != get) {
          protocol_fail(gdr::tcp::frame_status::bad_field);  // a reply to nothing we asked
          return false;
        }
        rma_.erase(op);
        op->in_rma_ = false;
        if (h.status != wire_status::ok) {
          complete(*op, errc::remote_access);
          return true;
        }
        if (!get) {
          op->bytes_ = op->size_;
          op->path_ = transfer_path::host_zero_copy;
          complete(*op, {});
          return true;
        }
        if (len != op->size_) {
          protocol_fail(gdr::tcp::frame_status::bad_field);  // not what was asked for
          return false;
        }
        set_target(op, nullptr, op->data_, len, 0);
        return true;
      }
      case frame_type::close:
        consume_header();
        // The peer sends nothing more. Held early messages stay receivable;
        // everything else fails.
        fail(errc::connection_lost);
        return false;
    }
    return false;
  }

  void consume_header() noexcept {
    rx_pos_ += wire::header_size;
    ++rx_seq_;
    ++stats_.frames_in;
  }

  void set_target(endpoint_op* op, reply_slot* s, std::byte* dst, std::size_t want, std::size_t discard) noexcept {
    target_ = {};
    target_.active = true;
    target_.op = op;
    target_.slot = s;
    target_.dst = dst;
    target_.want = want;
    target_.discard = discard;
  }

  /// The current frame's payload is in place.
  void target_done() noexcept {
    rx_target t = target_;
    target_ = {};
    skip_ = t.discard;
    if (t.slot != nullptr) {
      ++stats_.served_puts;
      send_reply(t.slot, frame_type::put_ack, static_cast<std::uint32_t>(t.slot->item.hdr.addr), wire_status::ok,
                 nullptr, 0);
      return;
    }
    endpoint_op& op = *t.op;
    op.direct_target_ = false;
    op.bytes_ = t.want;
    op.path_ = t.direct ? transfer_path::host_zero_copy : transfer_path::host_eager;
    complete(op, op.ec_);  // errc::truncated was noted when the frame began
  }

  /// Reads are non-blocking recv() attempts made by the loop
  /// (endpoint_options::spin_reads_in_busy_poll).
  bool spinning() const noexcept {
    return opts_.spin_reads_in_busy_poll && sched_->mode() == run_mode::busy_poll;
  }

  /// Reads into the staging buffer.
  void read_staging() noexcept {
    if (rx_pos_ == rx_end_) {
      rx_pos_ = rx_end_ = 0;
    } else if (rx_cap_ - rx_end_ < wire::header_size + opts_.eager_limit && rx_pos_ != 0) {
      // Slide the partial frame to the front so that a whole eager frame fits.
      std::memmove(rx_buf_.get(), rx_buf_.get() + rx_pos_, rx_end_ - rx_pos_);
      rx_end_ -= rx_pos_;
      rx_pos_ = 0;
    }
    std::size_t n = rx_cap_ - rx_end_;
    assert(n != 0 && "staging buffer full with an incomplete frame");
    // After a large payload, ask for one header only: the next payload is
    // likely large too and should go straight to its destination, not
    // through here.
    if (large_ && rx_end_ == rx_pos_ && skip_ == 0 && !target_.active) n = wire::header_size;
    submit_read(rx_buf_.get() + rx_end_, n, 0, false, drained_);
  }

  /// Reads the rest of the current payload straight into its destination.
  void read_direct() noexcept {
    target_.direct = true;
    if (target_.op != nullptr) target_.op->direct_target_ = true;
    ++stats_.direct_reads;
    // MSG_WAITALL: io_uring retries short stream reads itself, one CQE for the
    // whole rest; on cancellation or end of stream the CQE carries the bytes
    // already placed (io_uring/net.c, done_io). A spinning read takes
    // whatever has arrived; pump() asks for the rest.
    submit_read(target_.dst + target_.done, target_.want - target_.done, MSG_WAITALL, true, false);
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
    // (leave): the coroutines it resumes queue their sends first, and the
    // kernel runs SQEs in order. A reply then leaves before this side's
    // poll is armed, not after. Nothing can observe the gap: read_inflight_
    // already holds the reader, and the buffer it reads into is the
    // connection's own. A direct read targets a user's buffer and is issued
    // at once (a cancellation may need to reach it).
    if (busy_ > 0 && !direct) {
      read_deferred_ = true;
      return;
    }
    issue_read();
  }

  /// Hands the pending read to io_uring.
  void issue_read() noexcept {
    read_deferred_ = false;
    io_uring_sqe* sqe = sched_->get_sqe();
    if (sqe == nullptr) {
      // The SQ is full even after submitting (unreachable with sane ring
      // sizes): fail rather than stall silently.
      read_inflight_ = false;
      if (read_direct_ && target_.op != nullptr) target_.op->direct_target_ = false;
      fail(errno_code(EBUSY));
      return;
    }
    io_uring_prep_recv(sqe, fd(), rd_.dst, rd_.n, rd_.flags);
    // The last read emptied the socket (it returned less than asked): the
    // next one would fail its first, non-blocking attempt. POLL_FIRST arms
    // the wait at once (io_uring.h, IORING_RECVSEND_POLL_FIRST, since 5.19).
    if (rd_.poll_first) sqe->ioprio |= IORING_RECVSEND_POLL_FIRST;
    io_uring_sqe_set_data(sqe, static_cast<operation*>(&read_op_));
    sched_->note_submitted();
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
        sched_->add_poller(spin_);
      } catch (...) {
        return false;
      }
      spin_registered_ = true;
    }
    spin_pending_ = true;
    sched_->note_submitted();  // outstanding like an SQE's read: drain() waits for it
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
        sched_->note_done();
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
    sched_->note_done();
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
    std::size_t got = res > 0 ? static_cast<std::size_t>(res) : 0;
    if (read_direct_) {
      target_.done += got;
      endpoint_op* op = target_.op;
      if (op != nullptr) op->direct_target_ = false;
      if (op != nullptr && op->result_set_) {
        // Its op was cancelled or failed while the kernel wrote: skip the rest.
        release_target();
        try_finish(*op);
      } else if (target_.active && target_.done == target_.want) {
        target_done();
      }
    } else {
      rx_end_ += got;
      drained_ = got < last_ask_;
    }
    if (error_) {
      // Failed while the read was in flight: a put being served is dropped.
      if (target_.active && target_.op == nullptr) release_target();
      if (close_op_ != nullptr) try_finish(*close_op_);
      return;
    }
    if (res == 0 || (res < 0 && res != -ECANCELED && res != -EINTR && res != -EAGAIN)) {
      // End of stream without a close frame, or a reset: the peer is gone.
      fail(connection_error(res));
      if (close_op_ != nullptr) try_finish(*close_op_);
      return;
    }
    pump();
  }

  // ---------------------------------------------------------------- state

  scheduler* sched_;
  gdr::tcp::socket sock_;
  memory_registry* registry_;
  endpoint_options opts_;
  endpoint_stats stats_{};
  transfer_path last_path_ = transfer_path::none;
  std::error_code error_{};
  gdr::tcp::frame_status protocol_reason_ = gdr::tcp::frame_status::ok;
  bool closing_ = false;
  bool abandoned_ = false;
  endpoint_op* close_op_ = nullptr;
  int busy_ = 0;
  std::size_t attached_ = 0;  // operations suspended and not yet resumed
  endpoint_op* ready_head_ = nullptr;
  endpoint_op* ready_tail_ = nullptr;
  kick_node kick_{};
  bool kick_posted_ = false;

  // writer
  fifo<tx_item, &tx_item::prev, &tx_item::next> tx_{};
  std::size_t batch_n_ = 0;  // frames at the head of tx_ in the write in flight
  std::uint32_t tx_seq_ = 0;
  conn_op write_op_{};
  bool write_inflight_ = false;
  bool zc_write_ = false;
  bool small_ = false;           // the current batch is copied into small_buf_
  bool write_blocked_ = false;   // a direct write came back short: next write through io_uring
  bool write_deferred_ = false;  // frames queued in a handler, written at its end (leave)
  int zc_result_ = 0;
  msghdr msg_{};
  iovec iov_[2 * max_batch]{};
  std::byte small_buf_[small_write];  // a small batch, copied (start_write)

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
  rx_wait wait_ = rx_wait::none;
  std::unique_ptr<std::byte[]> rx_buf_;
  std::size_t rx_cap_ = 0;
  std::size_t rx_pos_ = 0;
  std::size_t rx_end_ = 0;
  std::uint64_t skip_ = 0;
  std::uint32_t rx_seq_ = 0;
  bool large_ = false;
  bool drained_ = false;       // the last staging read emptied the socket
  std::size_t last_ask_ = 0;  // bytes the read in flight asked for
  rx_target target_{};
  message_store store_;
  fifo<endpoint_op, &endpoint_op::prev_, &endpoint_op::next_> recvs_{};
  fifo<endpoint_op, &endpoint_op::prev_, &endpoint_op::next_> rma_{};
  std::deque<orphan> orphans_;
  std::unique_ptr<reply_slot[]> slots_;
  reply_slot* free_slots_ = nullptr;
};

// ---------------------------------------------------------------- endpoint_op

inline bool endpoint_op::start(std::coroutine_handle<> h, std::stop_token coro_stop) noexcept {
  assert(conn_ != nullptr && "gdr::tcp: operation on an endpoint that holds no connection");
  assert(scheduler::current() == &conn_->sched() &&
         "gdr::tcp: await an endpoint's operations on its scheduler's thread");
  if (coro_stop.stop_requested() || opts_.stop.stop_requested()) {
    ec_ = errc::cancelled;
    conn_->record(*this);
    return false;
  }
  waiter_ = h;
  if (!conn_->begin(*this)) {
    if (!result_set_) result_set_ = true;
    finished_ = true;
    conn_->record(*this);
    return false;
  }
  // Pending. Nothing can resume it before we return: completions are
  // resumed from the loop, never from inside this call.
  pending_ = 1;
  conn_->note_attached();
  cancel_.self = this;
  cancel_.run = &on_cancel_node;
  if (opts_.timeout.count() > 0 && !arm_timer()) {
    // No SQE for the timer (the SQ is full even after submitting): give up
    // through the loop, like a cancellation.
    cancel_reason_ = errc::busy;
    on_stop_requested();
  }
  if (opts_.stop.stop_possible()) stop_user_.emplace(opts_.stop, canceller{this});
  if (coro_stop.stop_possible()) stop_coro_.emplace(std::move(coro_stop), canceller{this});
  return true;
}

inline bool endpoint_op::arm_timer() noexcept {
  scheduler& s = conn_->sched();
  io_uring_sqe* sqe = s.get_sqe();
  if (sqe == nullptr) return false;
  auto d = opts_.timeout;
  ts_.tv_sec = static_cast<long long>(d.count() / 1'000'000'000);
  ts_.tv_nsec = static_cast<long long>(d.count() % 1'000'000'000);
  timer_.self = this;
  timer_.complete = &on_timer;
  io_uring_prep_timeout(sqe, &ts_, 0, 0);
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&timer_));
  s.note_submitted();
  timer_armed_ = true;
  ++pending_;
  return true;
}

// Any thread (a stop callback). Only posts: the loop's thread does the rest.
inline void endpoint_op::on_stop_requested() noexcept {
  if (!cancel_posted_.exchange(true, std::memory_order_acq_rel)) conn_->sched().post(&cancel_);
}

inline void endpoint_op::on_cancel_node(remote_work* w) noexcept {
  endpoint_op* op = static_cast<cancel_node*>(w)->self;
  connection* c = op->conn_;
  c->enter();
  op->cancel_ran_ = true;
  if (op->finished_) {
    op->release();  // finish() waited for this node
  } else {
    c->cancel(*op, op->cancel_reason_);
  }
  c->leave();
}

inline void endpoint_op::on_timer(operation* o, int res, std::uint32_t) noexcept {
  endpoint_op* op = static_cast<timer_node*>(o)->self;
  connection* c = op->conn_;
  c->enter();
  op->timer_fired_ = true;
  // -ETIME: the timeout expired. -ECANCELED: finish() removed it.
  if (res == -ETIME && !op->result_set_) c->cancel(*op, errc::timed_out);
  op->release();
  c->leave();
}

inline void endpoint_op::finish() noexcept {
  finished_ = true;
  // Destroying a stop callback waits for one running on another thread;
  // after this, no callback can post the cancel node any more.
  stop_user_.reset();
  stop_coro_.reset();
  if (cancel_posted_.load(std::memory_order_acquire) && !cancel_ran_) ++pending_;  // its node lives here
  if (timer_armed_ && !timer_fired_) {
    // Remove the timer; its CQE (-ECANCELED) still comes and is waited for,
    // because the timer lives in this frame. Without a free SQE it simply
    // expires on its own, within the timeout.
    if (io_uring_sqe* sqe = conn_->sched().get_sqe()) {
      io_uring_prep_timeout_remove(sqe, timer_.user_data(), 0);
      io_uring_sqe_set_data64(sqe, gdr::detail::ignore_tag);
    }
  }
  conn_->record(*this);
  release();
}

inline void endpoint_op::release() noexcept {
  if (--pending_ == 0) conn_->push_ready(*this);
}

}  // namespace detail::tcp

}  // namespace gdr
