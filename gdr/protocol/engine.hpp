/// \file
/// The protocol layer: one engine per endpoint, the same for every
/// transport. It owns the endpoint's operations and everything that makes
/// them correct: matching receives to messages by tag, the bounded store of
/// early messages, eager and rendezvous sends, truncation, one-sided
/// requests and their answers, cancellation and timeouts, failure, and the
/// per-operation records and counters. A transport derives from `engine`
/// and only moves bytes (see "The transport's side" below).
///
/// How it works
/// ============
/// An engine lives on the heap and belongs to one scheduler; everything
/// here runs on that scheduler's thread (stop requests from other threads
/// are posted to it). The endpoint object owns it; once the endpoint is
/// gone the engine frees itself when the transport is quiet and every
/// operation has resumed (`abandon`).
///
/// Messages. A send of at most `rendezvous_threshold` bytes goes *eager*:
/// the whole message in one `eager` frame. The receiver places it straight
/// into the first posted receive of its tag, or keeps a copy if none is
/// posted (`unexpected_bytes`, `unexpected_messages`: the room granted to
/// the sender in advance, see "Early credits" below; a sender short of
/// bytes announces instead, short of messages it waits). A
/// larger send goes by *rendezvous*: an `rts` announces it; the receive
/// that matches it answers `rtr` with a token and the bytes it accepts;
/// the sender then writes the bytes in a `data` frame that the receiver
/// places straight into that receive. An unmatched announcement costs the
/// receiver a small record, never the message's bytes, and never blocks
/// the messages behind it. Every send announces at once, so many
/// rendezvous are in flight together.
///
/// Matching. Receives match messages of the same tag in the order both
/// were started (eager and announced messages alike). A message larger than
/// its receive fills the view, the rest is dropped (eager) or never sent
/// (rendezvous: the `rtr` accepts only the view's size), and the receive
/// fails with `errc::truncated`, reporting the message's size.
///
/// Handshake. Each side's first frame is `hello` (protocol version, the
/// largest message it accepts, capabilities). Sends, puts and gets wait
/// for the peer's hello before they go out; one larger than the peer
/// accepts fails alone (`errc::message_too_large`).
///
/// Completion and resumption. Whatever decides an operation's outcome (a
/// frame, a timer, a stop request, a failure) only records it; the
/// operation resumes from the ready list at the end of the current event
/// handler (`leave`), when the engine's state is consistent, and only once
/// the transport no longer uses the operation's memory: none of its frames
/// is being written and no payload is being placed into its view.
///
/// Cancellation and timeouts: withdrawn until committed, then it completes.
///   * A receive stops at once. If its message was being placed, the rest
///     is dropped; if it had answered an `rts`, the data that comes is
///     dropped (the sender completes normally).
///   * An eager send is withdrawn while its frame waits in the transport;
///     once the transport has committed it, it completes normally.
///   * A rendezvous send is withdrawn while its `rts` waits; once the `rts`
///     is out, a stop sends `rts_cancel`, and the peer answers
///     `rts_withdrawn` (the send fails with the stop's reason) or, if a
///     receive had already matched it, the `rtr` (the send is committed and
///     completes normally).
///   * A put or get stops at once unless its request is being written; a
///     late answer is dropped.
///
/// Close. `close()` sends a `close` frame after every send already started
/// (held ones once the hello arrives; rendezvous ones once their receive has
/// taken them: a close waits for the peer to receive what was sent, bounded
/// by the close's own timeout; a closing peer declines the announcements it
/// will never receive with `rts_withdrawn`, and those sends fail with
/// `errc::peer_closed`), then fails what is still pending with
/// `errc::closed`; the peer fails its pending operations with
/// `errc::peer_closed` after receiving everything sent before. Both ends
/// then end the connection in order (`link_close`): a stream transport
/// ends its half and reads what the peer still sends until the peer's end,
/// so that nothing sent before is lost to a reset; close() returns when
/// the transport has ended (or its timeout aborts it: `link_shutdown`).
///
/// Device memory (the staged path, below the rest of the engine). An
/// operation whose local or remote memory is `Device` moves as segments of
/// at most one chunk through pinned bounce buffers, on the side that owns
/// the memory: copies out (device-to-host into a tx slot, whose frame then
/// carries the segment) and in (the transport places a payload into an rx
/// slot, then a host-to-device copy), through the scheduler's `copy_engine`
/// (gdr/sched/copy_engine.hpp). Rendezvous data goes as several `data` frames
/// (offset, `last` flag), puts and gets as several requests. A receiver with
/// no free rx slot pauses reading. An operation finishes only when no copy
/// touches its memory and it holds no slot; slots freed from inside
/// `on_sent` let their waiters go on at the end of the event, never there.
///
/// Device memory with GPUDirect (`set_device_direct`). When the transport's
/// NIC reaches GPU memory, nothing is staged, and the CPU must never touch
/// `Device` memory: a send from it goes by rendezvous at any size (the
/// receiver's rtr carries its key and the sender's NIC writes), a `Device`
/// receive fails with `errc::gpudirect_unavailable` when an eager message
/// (already in host memory) would be copied into it, and the message stays
/// for the next receive; puts and gets touching `Device` memory on either
/// side, and the rtr of a `Device` receive, are marked for the transport
/// (`frame::nic_only`, `rx_plan::device`), which moves them by RDMA or
/// fails the connection with `errc::gpudirect_unavailable`, never copies.
///
/// Credits. A put or get request holds one of the target's reply slots
/// until its answer is written. Each hello says how many the sender grants;
/// the other side keeps at most that many requests unanswered, and the rest
/// wait on the initiator's side, so puts and gets in both directions at
/// once never leave both readers waiting for a slot. The slots are
/// allocated when first needed; a request none can be allocated for is
/// answered `status::no_memory` from a spare slot (see "Reply slots").
///
/// Failure. When the transport fails (peer gone, protocol error) or the
/// endpoint closes, every pending and later operation fails with that
/// error, in order; messages already kept remain receivable.
///
/// The transport's side
/// ====================
/// A transport derives from `engine`, implements the `link_*` hooks, and
/// calls the `on_*` events, on the engine's thread, between `enter()` and
/// `leave()`:
///   * `link_post(frame&)`: queue a frame (a `header` and a payload
///     pointer) to be sent in order. Exactly one `on_sent(f, ec)` follows,
///     when the payload memory is no longer needed (written, or failed),
///     unless `link_withdraw(f)` took it back first. `link_committed(f)`:
///     it can no longer be withdrawn.
///   * Receiving is header first: for each frame the transport calls
///     `on_header(h)` before reading any payload byte; the plan it gets
///     says where the payload goes (`dst`, `want` bytes, then `discard`
///     bytes to drop), or to pause (nothing consumed: the transport offers
///     the same header again after `link_resume()`), or that the header is
///     a protocol error. After placing `want` bytes it calls `on_placed`.
///     `link_abort_target()` stops a placement early (a cancelled receive):
///     the transport drops the rest and says when the memory is free.
///   * `on_link_failed(ec)` once, when the connection breaks; then every
///     posted frame comes back through `on_sent` with an error.
///   * `link_shutdown()`: the engine failed or closed; stop the connection
///     (an abort).
///   * `link_close()`: the close frame was written, or the peer's arrived;
///     end the connection in order (a stream: end this side's half, then
///     read and drop what the peer still sends until its end). True: it is
///     ending, `link_quiet()` says when it has, and `link_shutdown()` may
///     follow to abort it; false (the default): it was shut down at once.
///   * `link_flush()`: the end of an outermost handler, after the ready
///     operations resumed (a transport writes what they queued).
///   * `link_quiet()`: no kernel request of the transport is in flight.
///
/// The re-entrancy rule: the engine never calls a `link_*` hook from
/// inside an event (between the transport's `enter()` and `leave()`,
/// where the transport may be walking its own queues). What an event
/// decides (posts, withdrawals, the abort of a placement, resuming the
/// reader, the shutdown) is queued and made, in order, at the end of the
/// outermost event, in `leave()`, before `link_flush()`. Outside every
/// event (an operation starting from its `await_suspend`) the hooks are
/// called at once. Debug builds assert it. Which list an operation is on
/// is recorded in the operation (`op::list_`), never inferred from its
/// stage; taking a node off a list it is not on is an assertion.
#pragma once

#include <liburing.h>

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

#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/message.hpp>
#include <gdr/protocol/options.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/cancellable.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>

namespace gdr::detail::proto {

class engine;
class op;
struct reply_slot;
struct stage_slot;

/// Doubly linked intrusive FIFO over `T::*Prev` / `T::*Next`.
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
  /// Unlinks `n`, which must be on this list (an assertion: unlinking a
  /// node that is not would silently empty the list).
  void erase(T* n) noexcept {
    assert((n->*Prev != nullptr ? (n->*Prev)->*Next == n : head == n) && "gdr: fifo::erase of a node not on the list");
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

/// An outgoing frame: the protocol's header and payload, plus the
/// transport's bookkeeping of it. Lives in an operation or a reply slot.
struct frame {
  header hdr{};
  const std::byte* payload = nullptr;  ///< `hdr.length` bytes
  op* owner = nullptr;                 ///< the operation it belongs to, or
  reply_slot* slot = nullptr;          ///< the reply slot it belongs to (or neither: the engine's own)
  stage_slot* sslot = nullptr;         ///< the staging slot it belongs to (a segment)
  /// The engine's outbox (frames posted inside an event, handed to the
  /// transport at its end): the next one, and whether it is there.
  frame* out_next = nullptr;
  bool in_outbox = false;
  bool own_answer = false;  ///< an answer allocated for itself, freed once sent
  // ---- the transport's (queue links, progress, its encoding of the header) ----
  frame* prev = nullptr;
  frame* next = nullptr;
  std::size_t written = 0;
  bool queued = false;     ///< in the transport's queue (posted, no on_sent yet)
  bool sealed = false;     ///< committed: can no longer be withdrawn
  bool in_flight = false;  ///< part of a write the kernel is doing now
  std::uint8_t where = 0;  ///< which of the transport's lists holds it
  /// Set by the engine: the bytes this frame carries or names (a payload, an
  /// rtr's receive, a request's local memory) may be moved by the NIC only,
  /// never copied by the CPU: `Device` memory on a GPUDirect endpoint, or a
  /// put's or get's host memory whose peer side is `Device` memory.
  /// `device`: the GPU whose memory it is (-1: host memory). A transport
  /// that cannot move them by RDMA fails the connection with
  /// `errc::gpudirect_unavailable` instead of copying.
  bool nic_only = false;
  std::int8_t device = -1;
  std::uint32_t seq = 0;
  /// The transport's encoding of `hdr` (TCP: the wire header), written when
  /// the frame is sealed. Deliberately not initialised: an operation holds
  /// three frames, and zeroing them cost more than the rest of a small
  /// send's bookkeeping.
  alignas(8) std::byte encoded[64];

  /// Makes the frame a fresh one of `owner` (no transport state, a zero
  /// header), without touching `encoded`.
  void reset(op* o) noexcept {
    assert(!in_outbox && "gdr: a frame in the engine's outbox was reused");
    hdr = header{};
    payload = nullptr;
    owner = o;
    slot = nullptr;
    sslot = nullptr;
    prev = next = nullptr;
    written = 0;
    queued = sealed = in_flight = false;
    where = 0;
    nic_only = false;
    device = -1;
    seq = 0;
  }
};

/// A frame this side owes its peer (an answer), with what it holds.
/// Allocated one at a time when a request finds none free (see "Reply
/// slots" in the engine).
struct reply_slot {
  frame f;
  access_lease lease{};  ///< a get's source memory, held until written
  reply_slot* next_free = nullptr;
  reply_slot* next_made = nullptr;  ///< every slot the engine allocated (freed with it)
  stage_slot* bounce = nullptr;  ///< a get from Device memory: the bytes' bounce buffer
  // A get from Device memory waiting for a tx bounce buffer (serve_wait_):
  reply_slot* wait_next = nullptr;
  std::uint64_t wait_id = 0;
  std::size_t wait_len = 0;
};

/// One segment of the staged path in flight: a bounce buffer of
/// `staging_options::chunk` bytes (rx: the bytes received, copied to the
/// device next; tx: the bytes copied from the device, sent next), the frame
/// that carries it (tx), and its copy's completion. A tx slot also carries
/// the segments of host memory that a peer's bounce buffers limit (then its
/// buffer is not used).
struct stage_slot : copy_engine::completion {
  engine* eng = nullptr;
  op* owner = nullptr;      ///< the operation it serves, or
  reply_slot* rs = nullptr; ///< the peer's request it serves
  std::byte* mem = nullptr; ///< its bounce buffer
  frame f;
  std::size_t off = 0;      ///< where its bytes are in the operation's memory
  std::size_t len = 0;
  std::uint64_t req = 0;    ///< a served request's id
  stage_slot* next = nullptr;  ///< the free list, or its operation's list
  bool rx = false;
  bool copying = false;  ///< a copy into or out of it is queued
  bool ready = false;    ///< tx: its bytes are in place, the frame not yet posted
  bool posted = false;   ///< tx: its frame is posted
};

/// The bounce buffers of one direction of an endpoint.
struct stage_pool {
  std::unique_ptr<stage_slot[]> slots;
  std::size_t count = 0;
  std::size_t in_use = 0;
  stage_slot* free = nullptr;
  copy_engine::pinned_block block{};  ///< `count * chunk` pinned bytes, once needed

  ~stage_pool() {
    if (block.data != nullptr && block.release != nullptr) block.release(block.data, block.size);
  }
};

/// An early message: eager bytes kept, or an announcement (`rts`).
struct early_msg {
  early_msg* prev = nullptr;
  early_msg* next = nullptr;
  std::uint64_t tag = 0;
  std::uint64_t size = 0;  ///< message bytes
  std::uint64_t sid = 0;   ///< rts: the sender's send id
  bool rts = false;
  std::unique_ptr<std::byte[]> bytes;  ///< eager: the message
};

/// Where the transport is to put a payload (`engine::on_header`).
struct rx_plan {
  enum class action : std::uint8_t {
    place,  ///< `want` bytes to `dst`, then drop `discard` bytes, then on_placed()
    pause,  ///< nothing consumed: offer this header again after link_resume()
    fail,   ///< a protocol error: the header is not acceptable
  };
  action act = action::place;
  std::byte* dst = nullptr;
  std::size_t want = 0;
  std::uint64_t discard = 0;
  /// `dst` is `Device` memory of this GPU on a GPUDirect endpoint (-1: host
  /// memory): only the NIC may write it. A transport that would copy the
  /// payload with the CPU fails the connection (`errc::gpudirect_unavailable`).
  int device = -1;
};

/// A send, recv, put, get or close: the awaitable, its queue links, its
/// frames and its completion. Lives in the awaiting coroutine's frame.
///
/// Life: built with its parameters (movable until awaited). `await_suspend`
/// completes it at once (returns false) or hands it to the engine. From then
/// on the engine decides its result (`engine::complete`) and calls `finish`
/// once the transport no longer uses its memory; `finish` waits for the
/// op's timer CQE and a posted cancellation, if any, then puts it on the
/// engine's ready list, which resumes it.
class op : private gdr::detail::cancellable<op> {
 public:
  enum class kind : std::uint8_t { send, recv, put, get, close };

  op(engine* e, kind k, std::byte* data, std::size_t size, std::uint64_t tag, op_options opts) noexcept
      : eng_(e), data_(data), size_(size), tag_(tag), opts_(std::move(opts)), kind_(k) {}

  op(engine* e, kind k, std::byte* data, std::size_t size, std::uint64_t raddr, std::size_t rsize, std::uint64_t rkey,
     op_options opts) noexcept
      : eng_(e), data_(data), size_(size), raddr_(raddr), rsize_(rsize), rkey_(rkey), opts_(std::move(opts)),
        kind_(k) {}

  // Movable only before it is awaited (it is then only its parameters).
  op(op&& o) noexcept
      : cancellable<op>(std::move(o)),
        eng_(o.eng_), data_(o.data_), size_(o.size_), tag_(o.tag_), raddr_(o.raddr_), rsize_(o.rsize_),
        rkey_(o.rkey_), opts_(std::move(o.opts_)), kind_(o.kind_), dev_(o.dev_), remote_dev_(o.remote_dev_),
        nic_dev_(o.nic_dev_), remote_nic_(o.remote_nic_) {}
  op& operator=(op&&) = delete;

  /// Before it is awaited: the local memory is `Device` memory of GPU `dev`
  /// (-1: host memory), and for a put or get whether the peer's is. Either
  /// makes it a staged operation, or on a GPUDirect endpoint
  /// (`engine::set_device_direct`) one whose bytes only the NIC moves.
  void set_spaces(int dev, bool remote_dev) noexcept {
    dev_ = dev < 0 ? -1 : dev;
    remote_dev_ = remote_dev;
  }

  bool await_ready() const noexcept { return false; }

  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    return start(h, stop_token_of(h));
  }

  /// Bytes moved (sent, received into the view, put or got). Throws
  /// `gdr::error`; a truncated receive's message says the message's size.
  std::size_t await_resume() {
    if (ec_) throw_error();
    return bytes_;
  }

  /// The same operation, but `co_await` returns `result<std::size_t>`.
  [[nodiscard]] auto as_result() && noexcept {
    struct adapter : op {
      explicit adapter(op&& o) noexcept : op(std::move(o)) {}
      [[nodiscard]] result<std::size_t> await_resume() noexcept {
        if (this->ec_) return this->ec_;
        return this->bytes_;
      }
    };
    return adapter{std::move(*this)};
  }

  /// The operation's local buffer (a transport that registers it for RDMA
  /// reads the address; the engine keeps the bytes' ownership rules).
  std::byte* buffer_data() const noexcept { return data_; }

  /// The same operation, but `co_await` returns its `op_report` (error,
  /// bytes, the message's size, tag, path and protocol) and never throws.
  [[nodiscard]] auto report() && noexcept {
    struct adapter : op {
      explicit adapter(op&& o) noexcept : op(std::move(o)) {}
      [[nodiscard]] op_report await_resume() noexcept { return this->make_report(); }
    };
    return adapter{std::move(*this)};
  }

 protected:
  op_report make_report() const noexcept {
    return {ec_, bytes_, msg_size_, tag_, path_, proto_};
  }

  /// Local or peer memory is staged through bounce buffers.
  bool staged() const noexcept { return dev_ >= 0 || remote_dev_; }
  /// Segments: an operation moved as several frames (staged, or limited by
  /// the peer's bounce buffers) rather than one.
  bool segmented() const noexcept { return seg_ != 0; }

 private:
  friend class engine;

  enum class stage : std::uint8_t {
    idle,         // not started or finished
    held,         // waits for the peer's hello
    queued,       // send/put/get: its first frame is posted
    announced,    // rendezvous send: rts posted, no rtr yet
    withdrawing,  // rendezvous send: rts_cancel posted, waiting for rts_withdrawn or rtr
    sending,      // rendezvous send: data posted (committed)
    posted,       // recv: waiting for a message
    placing,      // recv/get: its payload is being placed
    awaiting,     // recv: rtr sent, waiting for data; put/get: waiting for the answer
  };

  friend class gdr::detail::cancellable<op>;

  // The stop and timeout mechanism's hooks (gdr/sched/cancellable.hpp).
  inline scheduler& cancel_scheduler() const noexcept;
  inline void on_stop(std::error_code why) noexcept;
  inline void on_settled() noexcept;
  template <class F>
  inline void in_event(F&& f) noexcept;

  [[noreturn]] void throw_error() const;
  inline bool start(std::coroutine_handle<> h, std::stop_token coro_stop) noexcept;
  inline void finish() noexcept;

  // ---- parameters ----
  engine* eng_;
  std::byte* data_;
  std::size_t size_;
  std::uint64_t tag_ = 0;
  std::uint64_t raddr_ = 0;
  std::size_t rsize_ = 0;
  std::uint64_t rkey_ = 0;
  op_options opts_;
  kind kind_;
  int dev_ = -1;             // local memory is Device memory of this GPU (staged)
  bool remote_dev_ = false;  // put/get: the peer's memory is Device memory (it stages)
  int nic_dev_ = -1;         // GPUDirect: local memory is Device memory of this GPU, moved by the NIC only
  bool remote_nic_ = false;  // GPUDirect: put/get: the peer's memory is Device memory (its NIC moves it)

  // ---- state (loop thread) ----
  stage stage_ = stage::idle;
  bool result_set_ = false;  // the outcome is decided
  bool finished_ = false;    // finish() ran
  bool placing_ = false;     // the transport is placing a payload into data_
  std::error_code ec_{};
  std::error_code stop_reason_{};  // a stop that waits for an rts_withdrawn or a commit
  std::size_t bytes_ = 0;
  std::size_t msg_size_ = 0;
  std::uint64_t id_ = 0;  // send id, rendezvous token, or request id
  transfer_path path_ = transfer_path::none;
  wire_protocol proto_ = wire_protocol::none;
  const char* what_ = nullptr;  // more about ec_, for the exception's text

  // ---- segments (staged or peer-limited; loop thread) ----
  std::size_t seg_ = 0;       // bytes per segment (0: one frame, not segmented)
  std::size_t total_ = 0;     // bytes the segments cover (what moves)
  std::size_t issued_ = 0;    // bytes handed to segments so far (recv: the next data segment's offset)
  std::size_t done_ = 0;      // bytes whose segments finished
  std::uint64_t nseg_ = 1;    // put/get: requests (ids id_ .. id_ + nseg_ - 1)
  std::uint32_t copies_ = 0;  // copies in flight on this op's memory
  std::uint32_t slots_ = 0;   // staging slots it holds
  std::uint32_t out_ = 0;     // put/get: requests sent and not answered
  bool go_ = false;           // send: the rtr came; put/get: requests may go
  bool after_used_ = false;   // opts_.after was applied (to the first copy)
  bool waiting_ = false;      // in the engine's queue for a staging slot
  bool pump_due_ = false;     // in the engine's pumps_ (deferred to the end of the event)
  bool answers_dropped_ = false;  // put/get: remember_range holds its requests out
  bool credit_due_ = false;   // in the engine's credit_pumps_
  bool debited_ = false;      // send: it spent an early-message credit (debit_ bytes with it)
  bool holds_order_ = false;  // staged eager send: later sends wait until its frame is posted
  std::size_t debit_ = 0;
  bool finish_due_ = false;   // in the engine's finishes_ (try_finish at the end of the event)
  bool stop_due_ = false;     // in the engine's stops_ (a stop handled at the end of the event; its reason in stop_reason_)
  stage_slot* sq_head_ = nullptr;  // tx slots it holds, by offset
  stage_slot* sq_tail_ = nullptr;
  early_msg* early_ = nullptr;     // recv: a kept message to deliver once an rx slot is free

 public:  // links of the engine's lists (fifo needs them as template arguments)
  op* prev_ = nullptr;  // links in list_, the one engine list it is on
  op* next_ = nullptr;

 private:
  /// The engine list it is on (null: none). Set and cleared only by
  /// engine::enlist / engine::delist: which list holds an operation is
  /// recorded here, never inferred from its stage.
  fifo<op, &op::prev_, &op::next_>* list_ = nullptr;
  op* due_next_ = nullptr;  // finishes_ / stops_ links (an op is on at most one of each at a time)
  op* stop_next_ = nullptr;

 private:
  op* ready_next_ = nullptr;
  std::coroutine_handle<> waiter_{};
  frame f1_;  // eager, rts, put/get request, rtr, close
  frame f2_;  // rendezvous data
  frame f3_;  // rts_cancel

};

using op_list = fifo<op, &op::prev_, &op::next_>;

/// The protocol engine of one endpoint. See the file comment.
class engine {
 public:
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  scheduler& sched() const noexcept { return *sched_; }
  const protocol_options& options() const noexcept { return opts_; }
  /// The error new operations fail with (none while usable).
  std::error_code state_error() const noexcept {
    if (closing_ && !error_) return errc::closed;
    return error_;
  }
  transfer_path last_path() const noexcept { return last_path_; }
  /// The peer's limit from its hello (0 until it arrived).
  std::uint64_t peer_max_message() const noexcept { return peer_max_; }
  /// The counters (the transport's object, seen as the protocol's part).
  const protocol_stats& pstats() const noexcept { return *stats_; }
  /// The peer's capability bits from its hello.
  std::uint64_t peer_caps() const noexcept { return peer_caps_; }

  /// Rows a forced path excludes (`set_refused`): their operations fail
  /// with `errc::unsupported`.
  static constexpr std::uint8_t refuse_host = 1;    ///< host memory on both sides
  static constexpr std::uint8_t refuse_device = 2;  ///< device memory on either side (staged)
  /// Set once by the transport at set-up, from `decide_paths`.
  void set_refused(std::uint8_t rows) noexcept { refused_ = rows; }

  /// GPUDirect: the transport moves `Device` memory with the NIC, so such
  /// operations are not staged. Their rules (the GPUDirect section below):
  /// a send from `Device` memory goes by rendezvous at any size, a
  /// `Device` receive takes only rendezvous messages (an eager one fails
  /// it with `errc::gpudirect_unavailable` and stays receivable), and
  /// their frames and placements are marked `nic_only` / `device` for the
  /// transport. Set once by the transport at set-up.
  void set_device_direct(bool on) noexcept { device_direct_ = on; }
  bool device_direct() const noexcept { return device_direct_; }

  /// Bounce buffers checked out now (tx, rx): zero when nothing staged is
  /// in flight.
  std::pair<std::size_t, std::size_t> bounce_in_use() const noexcept { return {tx_.in_use, rx_.in_use}; }

  /// The engine's state in one line, for a hang's diagnosis (what waits on
  /// which list, who holds each bounce slot, the credits): not a stable
  /// format.
  std::string describe() const {
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
    out += "credits " + std::to_string(credits_) + " msgs " + std::to_string(send_msgs_credit_) + " bytes " +
           std::to_string(send_bytes_credit_) + " holds " + std::to_string(order_holds_) + (paused_ ? " PAUSED" : "") +
           " early " + std::to_string(early_.size);
    list("held", held_);
    list("announced", announced_);
    list("recvs", recvs_);
    list("awaiting", awaiting_data_);
    list("rma", rma_);
    list("staging", staging_);
    list("send_wait", send_wait_);
    list("credit_wait", credit_wait_);
    {
      std::size_t n = 0;
      for (const reply_slot* w = serve_wait_head_; w != nullptr; w = w->wait_next) ++n;
      if (n != 0) out += " serve_wait " + std::to_string(n);
    }
    vec("tx_wait", tx_wait_);
    vec("rx_wait", rx_wait_);
    vec("credit_pumps", credit_pumps_);
    pool("tx", tx_);
    pool("rx", rx_);
    return out;
  }

  /// The endpoint is gone: abort (if still open); the engine frees itself
  /// once nothing is in flight and every operation has resumed.
  void abandon() noexcept {
    abandoned_ = true;
    enter();
    if (!error_) fail(errc::closed);
    abort_link();  // an orderly end still under way
    leave();
  }

  // ---------------------------------------------------------------- ops

  /// Starts `o` (from its await_suspend). True: pending; false: it
  /// completed at once (its result is set).
  bool begin(op& o) noexcept {
    if (device_direct_ && (o.dev_ >= 0 || o.remote_dev_)) {
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

  /// A stop or a timeout reached `o` (its reason `why`). Loop thread,
  /// inside enter()/leave(). Handled at the end of the event (do_cancel),
  /// where the transport may be called.
  void cancel(op& o, std::error_code why) noexcept {
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
  }

  // Every event runs between enter() and leave(). leave() resumes what
  // completed, now that the state is consistent, makes the transport calls
  // the event queued (the re-entrancy rule in the file comment), lets the
  // transport write what the resumed coroutines queued, and frees an
  // abandoned engine.
  void enter() noexcept { ++busy_; }
  void leave() noexcept {
    for (;;) {
      while (op* o = ready_head_) {
        ready_head_ = o->ready_next_;
        if (ready_head_ == nullptr) ready_tail_ = nullptr;
        --attached_;
        o->waiter_.resume();  // may start ops, or destroy the endpoint
      }
      if (busy_ != 1) break;
      if (drain()) continue;
      if (run_deferred()) continue;
      if (link_flush()) continue;
      break;
    }
    if (--busy_ == 0 && abandoned_ && deletable()) destroy();
  }

 private:
  /// The stop of `o` (see "Cancellation" in the file comment); the
  /// transport may be called.
  void do_cancel(op& o, std::error_code why) noexcept {
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
          o.stage_ = op::stage::idle;
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

 public:
  void push_ready(op& o) noexcept {
    o.ready_next_ = nullptr;
    (ready_tail_ ? ready_tail_->ready_next_ : ready_head_) = &o;
    ready_tail_ = &o;
    // Completed outside an event (a failure found by a user's call): resume
    // it from the loop.
    if (busy_ == 0) post_resume();
  }

  void note_attached() noexcept { ++attached_; }
  void note_detached() noexcept { --attached_; }

  /// Counts a finished operation. Loop thread.
  void record(op& o) noexcept {
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
    if (o.nic_dev_ >= 0 || o.remote_nic_) o.path_ = transfer_path::gpudirect_rdma;
    ++stats_->by_path[static_cast<std::size_t>(o.path_)];
    last_path_ = o.path_;
  }

 protected:
  /// `stats` is the transport's counters object (a `protocol_stats` or a
  /// type derived from it), owned by the transport.
  engine(scheduler& s, memory_registry& reg, const protocol_options& o, protocol_stats& stats, std::uint64_t caps)
      : sched_(&s), registry_(&reg), opts_(o), stats_(&stats) {
    if (opts_.rendezvous_threshold > opts_.max_message) opts_.rendezvous_threshold = opts_.max_message;
    std::size_t n = std::max<std::size_t>(opts_.reply_slots, 1);
    slot_limit_ = n;
    spare_slot_.f.slot = &spare_slot_;
    resume_node_.self = this;
    resume_node_.run = &on_resume_node;
    chunk_ = std::max<std::size_t>(opts_.staging.chunk, 1);
    hello_.hdr.type = msg::hello;
    hello_.hdr.size = opts_.max_message;
    hello_.hdr.addr = chunk_;
    hello_.hdr.tag = caps;
    hello_.hdr.id = version;
    hello_.hdr.key = n;  // the requests the peer may have unanswered here
  }

  virtual ~engine() {
    while (early_msg* m = early_.pop_front()) delete m;
    while (reply_slot* s = slots_made_) {
      slots_made_ = s->next_made;
      delete s;
    }
  }

  /// Sends the hello. The transport calls it once, when it is ready to
  /// write (before any other frame can be posted).
  void start_protocol() noexcept {
    post(hello_);
    // The first grant of early-message room (see "Early credits").
    credit_f_.hdr = header{};
    credit_f_.hdr.type = msg::credit;
    credit_f_.hdr.size = opts_.unexpected_bytes;
    credit_f_.hdr.id = std::max<std::size_t>(opts_.unexpected_messages, 1);
    post(credit_f_);
  }

  // ---------------------------------------------------------------- transport hooks

  virtual void link_post(frame& f) noexcept = 0;
  virtual bool link_withdraw(frame& f) noexcept = 0;
  virtual bool link_committed(const frame& f) const noexcept = 0;
  virtual void link_resume() noexcept = 0;
  /// Stop placing the current payload. True: its memory is free now; false:
  /// `on_target_released()` comes when it is.
  virtual bool link_abort_target() noexcept = 0;
  virtual void link_shutdown() noexcept = 0;
  /// End the connection in order (see the file comment). True: ending,
  /// quiet once it has; `link_shutdown()` may follow. False: shut down.
  virtual bool link_close() noexcept {
    link_shutdown();
    return false;
  }
  /// The end of an outermost event handler, after the ready operations
  /// resumed. True: the transport did something that may have completed
  /// operations (leave() goes round again).
  virtual bool link_flush() noexcept = 0;
  virtual bool link_quiet() const noexcept = 0;
  /// The endpoint closed and the transport is quiet: release the
  /// connection's resources (a socket) now rather than at destruction.
  virtual void link_release() noexcept = 0;
  /// The path of a payload this transport placed (`direct`: straight from
  /// the wire or the sender into the destination) or sent.
  virtual transfer_path link_rx_path(bool direct) const noexcept = 0;
  virtual transfer_path link_tx_path() const noexcept = 0;
  /// Frees the engine (the transport's object): `delete this`.
  virtual void destroy() noexcept = 0;

 public:
  /// The peer as this transport names it ("10.0.0.2:4791"), for messages
  /// and logs.
  virtual std::string peer_name() const = 0;

 protected:

  // ---------------------------------------------------------------- transport events

  /// A header arrived (see the file comment). It must have passed
  /// `valid(h, options().max_message)`: the transport checks what it reads
  /// from the wire (TCP's `parse_frame` does) once, not here again. Must
  /// not change any state when it pauses.
  rx_plan on_header(const header& h) noexcept {
    assert(valid(h, opts_.max_message) && "gdr protocol: the transport passed an unchecked header");
    if (!got_hello_ && h.type != msg::hello) return fail_plan();  // hello comes first
    switch (h.type) {
      case msg::hello: return rx_hello(h);
      case msg::eager: return rx_eager(h);
      case msg::rts: return rx_rts(h);
      case msg::rtr: return rx_rtr(h);
      case msg::data: return rx_data(h);
      case msg::rts_cancel: return rx_rts_cancel(h);
      case msg::rts_withdrawn: return rx_rts_withdrawn(h);
      case msg::put_request: return rx_put_request(h);
      case msg::get_request: return rx_get_request(h);
      case msg::put_ack:
      case msg::get_reply: return rx_answer(h);
      case msg::credit: return rx_credit(h);
      case msg::close:
        // The peer sends nothing more. Kept early messages stay receivable;
        // everything else fails, and this side ends the connection in
        // order too (what it still had in flight may follow the peer's
        // close frame; a reset would throw it away with the peer's last
        // bytes).
        fail(errc::peer_closed, true);
        return consumed();
    }
    return fail_plan();
  }

  /// The current target's `want` bytes are in place (`direct`: not through
  /// a staging copy of the transport's).
  void on_placed(bool direct) noexcept {
    target t = std::exchange(cur_, target{});
    switch (t.kind) {
      case target::none:
      case target::discard: return;
      case target::op_payload: {
        op& o = *t.o;
        o.placing_ = false;
        if (t.counted) {
          // One segment of several, straight into the operation's memory.
          o.done_ += t.want;
          if (!o.result_set_ && o.done_ == o.total_) finish_counted(o, direct);
          else try_finish(o);
          if (o.kind_ == op::kind::get && !o.result_set_) pump(o);
          return;
        }
        if (!o.result_set_) {
          o.bytes_ = t.want;
          if (o.path_ == transfer_path::none) o.path_ = link_rx_path(direct);
          complete(o, o.ec_);  // errc::truncated was noted when the message began
        } else {
          try_finish(o);
        }
        return;
      }
      case target::store: {
        early_msg* m = t.m;
        ++stats_->unexpected;
        // A receive may have been posted while the bytes were placed.
        if (op* r = recv_for_eager(m->tag, m->size)) {
          take_recv(*r);
          owe(m->size);
          if (r->dev_ >= 0 && std::min<std::size_t>(m->size, r->size_) != 0) {
            // Device memory: through bounce buffers, never a CPU copy.
            deliver_early_staged(*r, m);
            return;
          }
          std::error_code ec = deliver_early(*r, *m);
          complete(*r, ec);
          delete m;
        } else if (closing_) {
          // Receiving ended while its bytes were placed: dropped, and its
          // room granted back (the peer may still be sending).
          owe(m->size);
          delete m;
        } else {
          early_.push_back(m);
          early_bytes_ += m->size;
        }
        return;
      }
      case target::serve_put: {
        reply_slot* s = t.s;
        s->lease.release();
        ++stats_->served_puts;
        send_answer(s, msg::put_ack, t.id, status::ok, nullptr, 0);
        return;
      }
      case target::stage_rx: placed_in_bounce(*t.b); return;
      case target::via_host: {
        op& o = *t.o;
        o.placing_ = false;
        if (o.result_set_) {
          delete t.m;
          try_finish(o);
          return;
        }
        deliver_early_staged(o, t.m);
        return;
      }
    }
  }

  /// A placement stopped by link_abort_target() no longer uses its memory.
  void on_target_released() noexcept { release_target(std::exchange(aborted_, target{})); }

  /// A kernel request of the transport completed: a close waiting for the
  /// transport to be quiet may finish.
  void on_io_done() noexcept { settle_close(); }

  /// Frame `f` is written (`ec` empty) or will never be (`ec`: the
  /// connection failed). Its payload memory is free.
  void on_sent(frame& f, std::error_code ec) noexcept {
    f.queued = false;
    if (f.sslot != nullptr) {
      segment_sent(*f.sslot, ec);
      return;
    }
    if (f.slot != nullptr) {
      free_slot(f.slot);
      return;
    }
    if (f.own_answer) {
      delete &f;
      return;
    }
    if (&f == &credit_f_) {
      if (!ec) maybe_grant();  // what was owed meanwhile
      return;
    }
    if (&f == &hello_) return;
    op& o = *f.owner;
    if (ec) {
      if (o.kind_ == op::kind::close) {
        // Nothing left to flush: closing a failed endpoint succeeds.
        complete(o, {});
      } else {
        complete(o, failure_of(ec));
      }
      try_finish(o);
      return;
    }
    switch (o.kind_) {
      case op::kind::send:
        if (&f == &o.f1_ && o.proto_ == wire_protocol::eager) {
          o.bytes_ = o.size_;
          o.path_ = link_tx_path();
          complete(o, {});
        } else if (&f == &o.f2_ && o.stage_ == op::stage::sending) {
          // The whole message was taken by its receive (which may have
          // accepted fewer bytes: truncated there, delivered here).
          o.bytes_ = o.size_;
          o.path_ = link_tx_path();
          complete(o, {});
        }
        break;
      case op::kind::put:
      case op::kind::get:
        // The request is out; the answer completes it. A stop that came
        // while it was written completes it now.
        if (!o.result_set_ && o.stop_reason_) complete(o, o.stop_reason_);
        break;
      case op::kind::recv: break;  // its rtr
      case op::kind::close:
        // Everything before the close frame is out: fail what is still
        // pending with errc::closed; the transport ends the connection in
        // order, and the close completes when it has (settle_close), or
        // when its timeout aborts it.
        fail(errc::closed, true);
        break;
    }
    try_finish(o);
  }

  /// The connection broke (`errc::connection_lost`, `errc::protocol_error`,
  /// an errno code). Frames still posted come back through on_sent.
  void on_link_failed(std::error_code ec) noexcept { fail(ec); }

  /// Inside an event handler (between enter() and leave()).
  bool in_handler() const noexcept { return busy_ > 0; }
  bool failed() const noexcept { return static_cast<bool>(error_); }
  std::error_code error() const noexcept { return error_; }

 private:
  struct target {
    enum kind_t : std::uint8_t { none, op_payload, store, serve_put, discard, stage_rx, via_host } kind = none;
    op* o = nullptr;
    early_msg* m = nullptr;
    reply_slot* s = nullptr;
    stage_slot* b = nullptr;  // stage_rx: the bounce buffer
    std::uint64_t id = 0;
    std::size_t want = 0;
    bool counted = false;  // op_payload: one segment of several
  };
  struct resume_node : remote_work {
    engine* self = nullptr;
  };

  bool deletable() const noexcept {
    return attached_ == 0 && ready_head_ == nullptr && !resume_posted_ && copies_ == 0 && outbox_head_ == nullptr &&
           link_quiet();
  }

  // ---------------------------------------------------------------- lists and the transport's calls
  //
  // Which list an operation is on is its `list_`, set only here.
  void enlist(op_list& l, op& o) noexcept {
    assert(o.list_ == nullptr && "gdr: an operation put on a second list");
    l.push_back(&o);
    o.list_ = &l;
  }
  void delist(op& o) noexcept {
    if (o.list_ == nullptr) return;
    o.list_->erase(&o);
    o.list_ = nullptr;
  }

  // The re-entrancy rule: nothing done inside an event calls the transport.
  // Posts, withdrawals, aborts, resumes and the shutdown that an event
  // decides are queued and made at its end (drain(), from the outermost
  // leave()), when the transport has finished walking its own state.
  // Outside every event (an operation starting from await_suspend) they
  // are made at once.

  /// The transport may be called now.
  bool link_calls_now() const noexcept { return busy_ == 0 || draining_; }

  /// Posts `f` now, or at the end of the event.
  void post(frame& f) noexcept {
    if (link_calls_now()) {
      link_post(f);
      return;
    }
    assert(!f.in_outbox);
    f.in_outbox = true;
    f.out_next = nullptr;
    (outbox_tail_ ? outbox_tail_->out_next : outbox_head_) = &f;
    outbox_tail_ = &f;
  }

  /// `f` is the engine's or the transport's until on_sent.
  static bool held_by_link(const frame& f) noexcept { return f.queued || f.in_outbox; }

  /// Takes `f` back: from the outbox at any time, from the transport only
  /// where it may be called. True: withdrawn (no on_sent will come).
  bool withdraw(frame& f) noexcept {
    if (f.in_outbox) {
      frame* prev = nullptr;
      for (frame* x = outbox_head_; x != &f; x = x->out_next) prev = x;
      (prev ? prev->out_next : outbox_head_) = f.out_next;
      if (outbox_tail_ == &f) outbox_tail_ = prev;
      f.in_outbox = false;
      f.out_next = nullptr;
      return true;
    }
    assert(link_calls_now() && "gdr: the engine withdrew a frame from inside a transport event");
    return link_withdraw(f);
  }

  /// The current placement's owner is gone: stop it (now, or at the end of
  /// the event if it is still dead then).
  void request_abort() noexcept {
    if (link_calls_now()) {
      abort_current();
    } else {
      abort_due_ = true;
    }
  }

  /// The placement in progress is for something that no longer wants it.
  bool current_target_dead() const noexcept {
    switch (cur_.kind) {
      case target::op_payload:
      case target::via_host: return cur_.o->result_set_;
      case target::stage_rx: return cur_.b->owner != nullptr ? cur_.b->owner->result_set_ : failed();
      case target::store:
      case target::serve_put: return failed();
      default: return false;
    }
  }

  /// Takes a finishing `o` off the end-of-event queues (a stop or a finish
  /// queued for it must not reach it once it has resumed).
  void unlink_due(op& o) noexcept {
    if (o.stop_due_) {
      op* prev = nullptr;
      for (op* x = stops_head_; x != &o; x = x->stop_next_) prev = x;
      (prev ? prev->stop_next_ : stops_head_) = o.stop_next_;
      if (stops_tail_ == &o) stops_tail_ = prev;
      o.stop_due_ = false;
    }
    if (o.finish_due_) {
      op* prev = nullptr;
      for (op* x = finishes_head_; x != &o; x = x->due_next_) prev = x;
      (prev ? prev->due_next_ : finishes_head_) = o.due_next_;
      if (finishes_tail_ == &o) finishes_tail_ = prev;
      o.finish_due_ = false;
    }
  }

  /// Makes the transport calls the event queued, in order. True if it made
  /// any (what they complete is resumed by leave()).
  bool drain() noexcept {
    if (!link_end_due() && outbox_head_ == nullptr && !abort_due_ && stops_head_ == nullptr &&
        finishes_head_ == nullptr && !resume_due_)
      return false;
    draining_ = true;
    if (link_end_due()) end_link(link_end_ == link_end::close_due);
    while (frame* f = outbox_head_) {
      outbox_head_ = f->out_next;
      if (outbox_head_ == nullptr) outbox_tail_ = nullptr;
      f->in_outbox = false;
      f->out_next = nullptr;
      link_post(*f);
    }
    if (std::exchange(abort_due_, false) && current_target_dead()) abort_current();
    while (op* o = stops_head_) {
      stops_head_ = o->stop_next_;
      if (stops_head_ == nullptr) stops_tail_ = nullptr;
      o->stop_due_ = false;
      do_cancel(*o, o->stop_reason_);
    }
    while (op* o = finishes_head_) {
      finishes_head_ = o->due_next_;
      if (finishes_head_ == nullptr) finishes_tail_ = nullptr;
      o->finish_due_ = false;
      finish_now(*o);
    }
    if (std::exchange(resume_due_, false) && !paused_ && !error_) link_resume();
    draining_ = false;
    return true;
  }

  static rx_plan consumed() noexcept { return {}; }
  static rx_plan pause_plan() noexcept { return {rx_plan::action::pause, nullptr, 0, 0}; }
  static rx_plan fail_plan() noexcept { return {rx_plan::action::fail, nullptr, 0, 0}; }
  rx_plan place(target t, std::byte* dst, std::size_t want, std::uint64_t discard, int device = -1) noexcept {
    t.want = want;
    cur_ = t;
    return {rx_plan::action::place, dst, want, discard, device};
  }
  rx_plan drop(std::uint64_t n) noexcept {
    cur_ = target{target::discard};
    return {rx_plan::action::place, nullptr, 0, n};
  }

  // ---------------------------------------------------------------- starting

  bool begin_recv(op& o) noexcept {
    if (closing_) {
      // Receiving ends when close() starts (GUIDE section 8): kept
      // messages are not handed out any more. An endpoint that failed
      // first says how.
      o.ec_ = error_ ? error_ : std::error_code(errc::closed);
      return false;
    }
    if (std::error_code ec = staging_check(o)) {
      o.ec_ = ec;
      return false;
    }
    for (early_msg* m = early_.head; m != nullptr; m = m->next) {
      if (m->tag != o.tag_) continue;
      if (!m->rts && refuses_eager(o, m->size)) {
        o.ec_ = errc::gpudirect_unavailable;  // the message stays for a host receive
        return false;
      }
      early_.erase(m);
      owe(m->rts ? 0 : m->size);
      if (!m->rts && o.dev_ >= 0 && std::min<std::size_t>(m->size, o.size_) != 0) {
        // Kept eager bytes for device memory: through a bounce buffer.
        early_bytes_ -= m->size;
        resume_reading();
        deliver_early_staged(o, m);
        return true;
      }
      if (!m->rts) {
        // Kept eager bytes: received now, without suspending.
        early_bytes_ -= m->size;
        o.ec_ = deliver_early(o, *m);
        delete m;
        resume_reading();
        return false;
      }
      if (error_) break;  // an announcement can no longer be answered
      match_rts(o, m->size, m->sid);
      delete m;
      resume_reading();
      return true;
    }
    if (error_) {
      o.ec_ = error_;
      return false;
    }
    o.stage_ = op::stage::posted;
    enlist(recvs_, o);
    resume_reading();
    return true;
  }

  /// A send, put or get.
  bool begin_out(op& o) noexcept {
    if (std::error_code ec = state_error()) {
      o.ec_ = ec;
      return false;
    }
    if (std::error_code ec = staging_check(o)) {
      o.ec_ = ec;
      return false;
    }
    if (o.kind_ != op::kind::send && o.size_ > o.rsize_) {
      o.ec_ = errc::invalid_argument;  // the local view must fit in the remote one
      return false;
    }
    if (o.size_ > opts_.max_message && o.kind_ == op::kind::get) {
      o.ec_ = errc::message_too_large;  // the answer would exceed our own limit
      return false;
    }
    if (!got_credit_) {  // the peer's handshake: its hello and first credit
      o.stage_ = op::stage::held;
      enlist(held_, o);
      return true;
    }
    return launch(o);
  }

  /// Puts `o`'s first frame on the wire (the peer's hello is known). True:
  /// pending.
  bool launch(op& o) noexcept {
    if (o.size_ > peer_max_) {
      o.ec_ = errc::message_too_large;
      return false;
    }
    if (o.kind_ != op::kind::send && o.staged()) return launch_segmented(o);
    frame& f = o.f1_;
    f.owner = &o;
    header& h = f.hdr;
    switch (o.kind_) {
      case op::kind::send: {
        // Early credits: every message takes a slot of the peer's room for
        // early messages, an eager one its bytes too; without the bytes it
        // is announced instead, without a slot it waits (in order).
        if ((!send_wait_.empty() && !waiter_turn_) || send_msgs_credit_ == 0 || order_holds_ != 0) {
          o.stage_ = op::stage::held;
          enlist(send_wait_, o);
          return true;
        }
        const bool eager = o.size_ <= eager_limit(o) && o.size_ <= send_bytes_credit_;
        --send_msgs_credit_;
        o.debit_ = eager ? o.size_ : 0;
        o.debited_ = true;
        send_bytes_credit_ -= o.debit_;
        if (eager) {
          if (o.dev_ >= 0 && o.size_ != 0) return launch_staged_eager(o);
          o.proto_ = wire_protocol::eager;
          h.type = msg::eager;
          h.length = o.size_;
          h.tag = o.tag_;
          f.payload = o.data_;
          mark_nic(f, o.nic_dev_, o.nic_dev_ >= 0);  // GPUDirect: only an empty one
          o.stage_ = op::stage::queued;
        } else {
          o.proto_ = wire_protocol::rendezvous;
          o.id_ = next_id_++;
          h.type = msg::rts;
          h.size = o.size_;
          h.tag = o.tag_;
          h.id = o.id_;
          o.stage_ = op::stage::announced;
          enlist(announced_, o);
          if (o.dev_ >= 0) {
            // Copy the first chunks out while the announcement travels.
            o.seg_ = own_segment();
            o.total_ = o.size_;
            post(f);
            pump(o);
            return true;
          }
        }
        break;
      }
      case op::kind::put:
      case op::kind::get: {
        if (credits_ == 0) {
          // The peer's reply slots are all spoken for: wait for an answer
          // (the reader never stops for this; see "Credits").
          o.stage_ = op::stage::held;
          enlist(credit_wait_, o);
          return true;
        }
        --credits_;
        bool put = o.kind_ == op::kind::put;
        o.id_ = next_id_++;
        h.type = put ? msg::put_request : msg::get_request;
        h.id = o.id_;
        h.addr = o.raddr_;
        h.key = o.rkey_;
        if (put) {
          h.length = o.size_;
          f.payload = o.data_;
        } else {
          h.size = o.size_;
        }
        mark_nic(f, o.nic_dev_, o.nic_dev_ >= 0 || o.remote_nic_);
        // Awaiting its answer from now on: the answer may be parsed before
        // the write's own completion is.
        o.stage_ = op::stage::awaiting;
        enlist(rma_, o);
        break;
      }
      default: break;
    }
    post(f);
    return true;
  }

  bool begin_close(op& o) noexcept {
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

  /// Posts the close frame once nothing started before it is left to send.
  void maybe_post_close() noexcept {
    if (close_op_ == nullptr || close_posted_ || error_ || close_op_->result_set_) return;
    // Held sends wait for the peer's hello; the close frame itself needs
    // none (this side's own hello is already ahead of it).
    if (!held_.empty() || !send_wait_.empty() || !announced_.empty() || rendezvous_out_ != 0) return;
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

  void cancel_send(op& o, std::error_code why) noexcept {
    switch (o.stage_) {
      case op::stage::held:
        complete(o, why);  // takes it off held_
        return;
      case op::stage::queued:  // eager
        // Staged eager (launch_staged_eager: its frame is a bounce slot's)
        // or plain (f1_, an empty Device message too): what launch chose,
        // read from the op, not decided again from its memory space.
        if (o.segmented()) {
          stage_slot* b = o.sq_head_;
          if (b != nullptr && b->posted) {
            if (!withdraw(b->f)) return;  // committed: it completes when written
            b->f.queued = false;
            b->posted = false;
          }
          refund(o);  // the peer never sees it
          complete(o, why);  // a copy still running holds the finish back
          return;
        }
        if (withdraw(o.f1_)) {
          o.f1_.queued = false;
          refund(o);
          complete(o, why);
        }
        // else committed: it completes when written.
        return;
      case op::stage::announced:
        if (o.f1_.queued && withdraw(o.f1_)) {
          // The rts never left: withdrawn.
          o.f1_.queued = false;
          refund(o);
          complete(o, why);  // takes it off announced_
          ++stats_->withdrawn;
          return;
        }
        // The peer has (or will have) the rts: ask for it back.
        o.stop_reason_ = why;
        o.stage_ = op::stage::withdrawing;
        o.f3_.reset(&o);
        o.f3_.hdr.type = msg::rts_cancel;
        o.f3_.hdr.id = o.id_;
        post(o.f3_);
        return;
      default: return;  // withdrawing already, or committed (sending)
    }
  }

  // ---------------------------------------------------------------- completing

  /// Decides `o`'s outcome (the first decision wins), takes it out of its
  /// list, and finishes it once the transport is done with its memory.
  void complete(op& o, std::error_code ec) noexcept {
    if (o.result_set_) return;
    o.result_set_ = true;
    o.ec_ = ec;
    switch (o.stage_) {
      case op::stage::sending: --rendezvous_out_; break;
      case op::stage::awaiting:
        if (o.kind_ == op::kind::recv) {
          // The data will come: drop it.
          if (!error_) remember(dropped_tokens_, o.id_);
        } else if (!error_ && !o.segmented()) {
          // A request the peer has (or will have) seen: its answer must be
          // recognised and dropped.
          remember(dropped_answers_, o.id_);
        }
        break;
      default: break;
    }
    delist(o);
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
    if (o.segmented() && o.kind_ != op::kind::send && o.kind_ != op::kind::recv && o.out_ != 0 && !error_) {
      // Answers to the requests out will be dropped; requests not yet
      // written are taken back when it finishes (release_segments), each
      // one answer fewer to drop.
      remember_range(o.id_, o.id_ + o.nseg_, o.out_);
      o.answers_dropped_ = true;
    }
    if (o.placing_ && (cur_.kind == target::op_payload || cur_.kind == target::via_host) && cur_.o == &o)
      request_abort();
    if (cur_.kind == target::stage_rx && cur_.b->owner == &o) request_abort();
    o.stage_ = op::stage::idle;
    if (closing_ && o.kind_ == op::kind::send) maybe_post_close();
    try_finish(o);
  }

  /// Finishes `o` if its outcome is decided and the transport no longer
  /// uses its memory; where that takes a call of the transport, at the end
  /// of the event.
  void try_finish(op& o) noexcept {
    if (!o.result_set_ || o.finished_ || o.placing_) return;
    const bool calls_link = held_by_link(o.f1_) || held_by_link(o.f2_) || held_by_link(o.f3_) || o.slots_ != 0 ||
                            o.kind_ == op::kind::close;
    if (!calls_link || link_calls_now()) {
      finish_now(o);
      return;
    }
    if (o.finish_due_) return;
    o.finish_due_ = true;
    o.due_next_ = nullptr;
    (finishes_tail_ ? finishes_tail_->due_next_ : finishes_head_) = &o;
    finishes_tail_ = &o;
  }

  void finish_now(op& o) noexcept {
    if (!o.result_set_ || o.finished_ || o.placing_) return;
    if (held_by_link(o.f1_) || held_by_link(o.f2_) || held_by_link(o.f3_)) {
      if (!frames_released(o)) return;
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
    unlink_due(o);  // it may resume (and its frame end) before the next drain
    o.finish();
  }

  /// Takes `o`'s frames back from the transport where it allows. True when
  /// none is left with it.
  bool frames_released(op& o) noexcept {
    for (frame* f : {&o.f1_, &o.f2_, &o.f3_}) {
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

  void remember(std::vector<std::uint64_t>& v, std::uint64_t id) noexcept {
    try {
      v.push_back(id);
    } catch (...) {
      fail(errno_code(ENOMEM));
    }
  }
  static bool forget(std::vector<std::uint64_t>& v, std::uint64_t id) noexcept {
    auto it = std::find(v.begin(), v.end(), id);
    if (it == v.end()) return false;
    v.erase(it);
    return true;
  }

  // ---------------------------------------------------------------- failure

  /// The endpoint is unusable: fail everything with `ec` (in order). Frames
  /// the transport still holds come back through on_sent. `in_order`: the
  /// close frame went out or the peer's came; the transport ends the
  /// connection in order (link_close) instead of aborting it.
  void fail(std::error_code ec, bool in_order = false) noexcept {
    if (error_) return;
    error_ = ec;
    if (link_calls_now()) {
      end_link(in_order);
    } else {
      link_end_ = in_order ? link_end::close_due : link_end::abort_due;
    }
    while (op* o = held_.head) complete(*o, ec);
    while (op* o = announced_.head) complete(*o, ec);
    while (op* o = recvs_.head) complete(*o, ec);
    while (op* o = awaiting_data_.head) complete(*o, ec);
    while (op* o = rma_.head) complete(*o, ec);
    while (op* o = credit_wait_.head) complete(*o, ec);
    while (op* o = send_wait_.head) complete(*o, ec);
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
    dropped_tokens_.clear();
    dropped_answers_.clear();
    dropped_ranges_.clear();
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

  /// How the connection ends (fail, link_close, link_shutdown). Explicit,
  /// so that an abort reaches an orderly end still under way exactly once.
  enum class link_end : std::uint8_t {
    open,        // not ending
    close_due,   // end in order at the end of the event (drain)
    abort_due,   // shut down at the end of the event (drain)
    ending,      // link_close() is under way: quiet once it has ended
    shut,        // ended, or shut down
  };

  bool link_end_due() const noexcept { return link_end_ == link_end::close_due || link_end_ == link_end::abort_due; }

  /// Ends the connection now: in order, or by shutting it down.
  void end_link(bool in_order) noexcept {
    if (in_order) {
      link_end_ = link_end::ending;
      if (!link_close()) link_end_ = link_end::shut;
    } else {
      link_end_ = link_end::shut;
      link_shutdown();
    }
    settle_close();
  }

  /// An orderly end under way (or due) becomes an abort: the close's
  /// timeout or stop, or the endpoint dropped.
  void abort_link() noexcept {
    switch (link_end_) {
      case link_end::close_due: link_end_ = link_end::abort_due; return;
      case link_end::ending:
        if (link_calls_now()) {
          link_end_ = link_end::shut;
          link_shutdown();
        } else {
          link_end_ = link_end::abort_due;
        }
        return;
      default: return;
    }
  }

  /// A close after its frame: it succeeds once the connection has ended
  /// (the transport quiet); it finishes when the transport is quiet.
  void settle_close() noexcept {
    if (close_op_ == nullptr) return;
    op& o = *close_op_;
    if (!o.result_set_ && (link_end_ == link_end::ending || link_end_ == link_end::shut) && link_quiet())
      complete(o, {});
    try_finish(o);
  }

  /// Stops the placement in progress; its resources are released now or,
  /// if the kernel still writes into them, at on_target_released().
  void abort_current() noexcept {
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

  void release_target(const target& t) noexcept {
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

  // ---------------------------------------------------------------- receiving

  op* find_recv(std::uint64_t tag) noexcept {
    for (op* r = recvs_.head; r != nullptr; r = r->next_)
      if (r->tag_ == tag) return r;
    return nullptr;
  }
  void take_recv(op& r) noexcept {
    delist(r);
    r.stage_ = op::stage::idle;
  }

  /// The receive an eager message of `len` bytes with `tag` goes to. A
  /// GPUDirect `Device` receive ahead of it fails instead (`refuses_eager`):
  /// the message goes on to the next receive, or is kept.
  op* recv_for_eager(std::uint64_t tag, std::size_t len) noexcept {
    while (op* r = find_recv(tag)) {
      if (!refuses_eager(*r, len)) return r;
      complete(*r, errc::gpudirect_unavailable);
    }
    return nullptr;
  }

  /// Hands kept eager bytes to receive `r` (one copy); returns its outcome.
  static std::error_code deliver_early(op& r, const early_msg& m) noexcept {
    std::size_t n = std::min<std::size_t>(m.size, r.size_);
    if (n != 0) std::memcpy(r.data_, m.bytes.get(), n);
    r.bytes_ = n;
    r.msg_size_ = m.size;
    r.proto_ = wire_protocol::eager;
    r.path_ = transfer_path::host_eager;
    return m.size > r.size_ ? std::error_code(errc::truncated) : std::error_code{};
  }

  /// Receive `r` takes the announced message `sid` of `size` bytes: it
  /// answers rtr with a token and the bytes it accepts.
  void match_rts(op& r, std::uint64_t size, std::uint64_t sid) noexcept {
    r.id_ = next_id_++;
    r.msg_size_ = static_cast<std::size_t>(size);
    r.proto_ = wire_protocol::rendezvous;
    std::size_t accept = std::min<std::size_t>(size, r.size_);
    if (accept < size) r.ec_ = errc::truncated;  // reported when the data is in
    r.stage_ = op::stage::awaiting;
    r.total_ = accept;
    r.issued_ = 0;
    r.done_ = 0;
    enlist(awaiting_data_, r);
    frame& f = r.f1_;
    f.reset(&r);
    f.hdr.type = msg::rtr;
    f.hdr.id = sid;
    f.hdr.size = accept;
    f.hdr.addr = r.id_;
    mark_nic(f, r.nic_dev_, r.nic_dev_ >= 0);
    // Device memory takes the data in frames no larger than its bounce
    // buffers.
    if (r.dev_ >= 0) f.hdr.key = chunk_;
    post(f);
  }

  void resume_reading() noexcept {
    if (paused_) {
      paused_ = false;
      if (link_calls_now()) {
        link_resume();
      } else {
        resume_due_ = true;
      }
    }
  }
  rx_plan pause_reading() noexcept {
    if (!paused_) ++stats_->paused;
    paused_ = true;
    return pause_plan();
  }

  rx_plan rx_hello(const header& h) noexcept {
    if (got_hello_) return fail_plan();
    if (h.id != version) return fail_plan();  // only version 2 exists
    got_hello_ = true;
    peer_max_ = h.size;
    peer_caps_ = h.tag;
    peer_seg_ = h.addr;
    credits_ = h.key != 0 ? h.key : ~std::uint64_t{0};
    if (h.key == 0) {
      // A peer that counts no credits (a hand-written one: every gdr peer
      // has reply slots): it sends no credit frame and bounds nothing.
      send_bytes_credit_ = send_msgs_credit_ = ~std::uint64_t{0} / 2;
      handshake_done();
    }
    return consumed();
  }

  /// The peer's handshake is complete (its hello, and its first credit
  /// where it counts them): what waited for it goes out.
  void handshake_done() noexcept {
    if (std::exchange(got_credit_, true)) return;
    while (op* o = held_.head) {
      delist(*o);
      o->stage_ = op::stage::idle;
      if (!launch(*o)) complete(*o, o->ec_);  // larger than the peer accepts
    }
    maybe_post_close();
  }

  /// Room for more early messages at the peer. The first one ends the
  /// peer's handshake: what waited for it goes out.
  rx_plan rx_credit(const header& h) noexcept {
    send_bytes_credit_ += h.size;
    send_msgs_credit_ += h.id;
    handshake_done();
    run_send_waiters();
    maybe_post_close();
    return consumed();
  }

  /// A kept eager message of `len` bytes with room for its first `room`
  /// (all of it by default), or null when memory is short (the caller
  /// pauses reading).
  static early_msg* new_eager_msg(std::uint64_t tag, std::size_t len, std::size_t room = ~std::size_t{0}) noexcept {
    auto* m = new (std::nothrow) early_msg;
    if (m == nullptr) return nullptr;
    room = std::min(room, len);
    if (room != 0) {
      m->bytes.reset(new (std::nothrow) std::byte[room]);
      if (!m->bytes) {
        delete m;
        return nullptr;
      }
    }
    m->tag = tag;
    m->size = len;
    return m;
  }

  rx_plan rx_eager(const header& h) noexcept {
    auto len = static_cast<std::size_t>(h.length);
    if (op* r = recv_for_eager(h.tag, len)) {
      std::size_t want = std::min(len, r->size_);
      if (r->dev_ >= 0 && want != 0 && len > chunk_) {
        // Into device memory, larger than a bounce buffer (the sender's
        // threshold is above our chunk): through host memory first, then
        // chunk by chunk as a kept message is. Only what the receive takes
        // is kept: the peer's header does not choose the allocation.
        early_msg* m = new_eager_msg(h.tag, len, want);
        if (m == nullptr) return pause_reading();
        owe(len);
        take_recv(*r);
        r->stage_ = op::stage::placing;
        r->placing_ = true;
        target t{target::via_host, r};
        t.m = m;
        return place(t, m->bytes.get(), want, len - want);
      }
      if (r->dev_ >= 0 && want != 0) {
        // Into device memory: through a bounce buffer.
        stage_slot* b = take(rx_);
        if (b == nullptr) return pause_reading();
        owe(len);
        take_recv(*r);
        if (want < len) r->ec_ = errc::truncated;
        r->msg_size_ = len;
        r->proto_ = wire_protocol::eager;
        r->stage_ = op::stage::placing;
        r->total_ = want;
        return place_in_bounce(*r, *b, 0, want, len - want);
      }
      take_recv(*r);
      owe(len);
      if (want < len) r->ec_ = errc::truncated;
      r->msg_size_ = len;
      r->proto_ = wire_protocol::eager;
      r->stage_ = op::stage::placing;
      r->placing_ = true;
      return place({target::op_payload, r}, r->data_, want, len - want);
    }
    if (closing_) {  // no receive will take it: dropped, its room granted back
      owe(len);
      return drop(len);
    }
    if (early_bytes_ + len > opts_.unexpected_bytes || early_.size >= opts_.unexpected_messages)
      return pause_reading();
    early_msg* m = new_eager_msg(h.tag, len);
    if (m == nullptr) return pause_reading();
    target t{target::store};
    t.m = m;
    return place(t, m->bytes.get(), len, 0);
  }

  rx_plan rx_rts(const header& h) noexcept {
    if (op* r = find_recv(h.tag)) {
      take_recv(*r);
      owe(0);
      match_rts(*r, h.size, h.id);
      return consumed();
    }
    if (closing_) {  // no receive will take it: the sender learns now
      owe(0);
      answer_withdrawn(h.id);
      return consumed();
    }
    if (early_.size >= opts_.unexpected_messages) return pause_reading();
    auto* m = new (std::nothrow) early_msg;
    if (m == nullptr) return pause_reading();
    m->rts = true;
    m->tag = h.tag;
    m->size = h.size;
    m->sid = h.id;
    early_.push_back(m);
    ++stats_->unexpected_rts;
    return consumed();
  }

  rx_plan rx_rtr(const header& h) noexcept {
    op* s = announced_.head;
    while (s != nullptr && s->id_ != h.id) s = s->next_;
    if (s == nullptr || h.size > s->size_) return fail_plan();  // not one of ours
    if (s->nic_dev_ >= 0 && h.key != 0) return fail_plan();  // a staging peer: the ends disagree
    if (s->dev_ >= 0 || h.key != 0) return rtr_segmented(*s, h);
    delist(*s);
    // Committed now, whatever a stop asked: a pending rts_cancel is
    // ignored by the peer, which matched the message first.
    s->stop_reason_ = {};
    s->stage_ = op::stage::sending;
    ++rendezvous_out_;
    frame& f = s->f2_;
    f.reset(s);
    f.hdr.type = msg::data;
    f.hdr.flags = flag::last;
    f.hdr.length = h.size;
    f.hdr.addr = h.addr;
    f.payload = s->data_;
    mark_nic(f, s->nic_dev_, s->nic_dev_ >= 0);
    post(f);
    return consumed();
  }

  rx_plan rx_data(const header& h) noexcept {
    std::uint64_t token = h.addr;
    bool last = (h.flags & flag::last) != 0;
    for (op* r = awaiting_data_.head; r != nullptr; r = r->next_) {
      if (r->id_ != token) continue;
      auto len = static_cast<std::size_t>(h.length);
      auto off = static_cast<std::size_t>(h.size);
      // Segments come in order, cover exactly what was accepted, and the
      // last one says so.
      if (off != r->issued_ || len > r->total_ - off || last != (off + len == r->total_))
        return fail_plan();
      if (r->dev_ >= 0 && len != 0) {
        if (len > chunk_) return fail_plan();  // larger than the rtr allowed
        stage_slot* b = take(rx_);
        if (b == nullptr) return pause_reading();
        r->issued_ += len;
        if (last) {
          delist(*r);
          r->stage_ = op::stage::placing;
        }
        return place_in_bounce(*r, *b, off, len, 0);
      }
      r->issued_ += len;
      if (last) {
        delist(*r);
        r->stage_ = op::stage::placing;
      }
      r->placing_ = true;
      if (off == 0 && last && r->done_ == 0 && r->dev_ < 0) {
        return place({target::op_payload, r}, r->data_, len, 0, r->nic_dev_);  // the whole message in one frame
      }
      target t{target::op_payload, r};
      t.counted = true;
      return place(t, r->data_ + off, len, 0, r->nic_dev_);
    }
    if (last ? forget(dropped_tokens_, token) : is_dropped(token)) return drop(h.length);  // its receive was cancelled
    return fail_plan();
  }


  rx_plan rx_rts_cancel(const header& h) noexcept {
    for (early_msg* m = early_.head; m != nullptr; m = m->next) {
      if (!m->rts || m->sid != h.id) continue;
      early_.erase(m);
      delete m;
      owe(0);
      answer_withdrawn(h.id);
      return consumed();
    }
    // Already matched: the rtr on its way answers the sender.
    return consumed();
  }

  /// Tells the sender of announcement `id` that no receive here will take
  /// it: the answer to its rts_cancel, or, unasked, from a closing side
  /// (rx_rts_withdrawn). In a frame of its own, not a reply slot: the
  /// sender's reply-slot credits count only puts and gets.
  void answer_withdrawn(std::uint64_t id) noexcept {
    auto* f = new (std::nothrow) frame;
    if (f == nullptr) {
      fail(errno_code(ENOMEM));
      return;
    }
    f->own_answer = true;
    f->hdr.type = msg::rts_withdrawn;
    f->hdr.id = id;
    post(*f);
  }

  /// Receiving ends when close() starts: the messages kept here will never
  /// be received. Kept bytes are dropped; the senders of kept announcements
  /// learn it now, each by its own rts_withdrawn, and not from this side's
  /// close frame, which waits for this side's own announced sends (two ends
  /// closing at once with announcements nobody will receive each way waited
  /// for each other). Either way the room is granted back: a peer with
  /// sends waiting for credit must not wait for this side's close frame,
  /// which may be waiting for them.
  void drop_kept_messages() noexcept {
    for (early_msg* m = early_.head; m != nullptr && !error_;) {
      early_msg* next = m->next;
      early_.erase(m);
      if (m->rts) {
        owe(0);
        answer_withdrawn(m->sid);
      } else {
        early_bytes_ -= m->size;
        owe(m->size);
      }
      delete m;
      m = next;
    }
  }

  rx_plan rx_rts_withdrawn(const header& h) noexcept {
    op* s = announced_.head;
    while (s != nullptr && s->id_ != h.id) s = s->next_;
    if (s == nullptr) return fail_plan();
    ++stats_->withdrawn;
    if (s->stage_ == op::stage::withdrawing) {
      complete(*s, s->stop_reason_);  // the answer to its rts_cancel
    } else {
      // Unasked: the peer closed without receiving it. Closing here too,
      // it fails as this side's pending operations do.
      complete(*s, closing_ ? errc::closed : errc::peer_closed);
    }
    return consumed();
  }

  rx_plan rx_put_request(const header& h) noexcept {
    reply_slot* s = take_slot();
    if (s == nullptr) return pause_reading();
    auto len = static_cast<std::size_t>(h.length);
    if (s == &spare_slot_) {
      // No slot could be allocated: refused, the payload read and dropped.
      ++stats_->no_memory;
      send_answer(s, msg::put_ack, h.id, status::no_memory, nullptr, 0);
      return drop(len);
    }
    result<access_lease> l = registry_->acquire(h.addr, len, h.key, access::write, can_stage() || device_direct_);
    if (l && l->on_device() && len != 0 && device_direct_) {
      // GPUDirect: the NIC writes the exposed device memory.
      s->lease = std::move(*l);
      target t{target::serve_put};
      t.s = s;
      t.id = h.id;
      return place(t, s->lease.data(), len, 0, s->lease.device());
    }
    if (l && l->on_device() && len != 0) {
      // Into device memory: through a bounce buffer, then a copy; the ack
      // follows the copy. A request larger than a bounce buffer (the peer
      // ignored our hello) is refused.
      if (len <= chunk_ && !ensure_pool(rx_, true)) {
        stage_slot* b = bounce_for_request(rx_, s, *l, h.id, len);
        if (b == nullptr) return pause_reading();
        target t{target::stage_rx};
        t.b = b;
        return place(t, b->mem, len, 0);
      }
      l = errc::remote_access;
    }
    if (!l) {
      // Refused: nothing is written; the payload is read and dropped.
      ++stats_->refused;
      send_answer(s, msg::put_ack, h.id, status::remote_access, nullptr, 0);
      return drop(len);
    }
    s->lease = std::move(*l);
    target t{target::serve_put};
    t.s = s;
    t.id = h.id;
    return place(t, s->lease.data(), len, 0);
  }

  rx_plan rx_get_request(const header& h) noexcept {
    reply_slot* s = take_slot();
    if (s == nullptr) return pause_reading();
    if (s == &spare_slot_) {
      ++stats_->no_memory;
      send_answer(s, msg::get_reply, h.id, status::no_memory, nullptr, 0);
      return consumed();
    }
    auto len = static_cast<std::size_t>(h.size);
    result<access_lease> l = registry_->acquire(h.addr, len, h.key, access::read, can_stage() || device_direct_);
    if (l && l->on_device() && len != 0 && device_direct_) {
      // GPUDirect: the NIC reads the exposed device memory.
      ++stats_->served_gets;
      s->lease = std::move(*l);
      send_answer(s, msg::get_reply, h.id, status::ok, s->lease.data(), len, s->lease.device());
      return consumed();
    }
    if (l && l->on_device() && len != 0) {
      // From device memory: copied into a bounce buffer, sent from there.
      if (len <= chunk_ && !ensure_pool(tx_, true)) {
        // No bounce buffer free: the request waits for one in its own
        // queue (its reply slot is the peer's credit), and the reader goes
        // on; the frames that free bounce buffers are behind this one.
        s->lease = std::move(*l);
        s->wait_id = h.id;
        s->wait_len = len;
        s->wait_next = nullptr;
        (serve_wait_tail_ ? serve_wait_tail_->wait_next : serve_wait_head_) = s;
        serve_wait_tail_ = s;
        serve_waiting_gets();
        return consumed();
      }
      l = errc::remote_access;
    }
    if (!l) {
      ++stats_->refused;
      send_answer(s, msg::get_reply, h.id, status::remote_access, nullptr, 0);
    } else {
      // The bytes go out straight from the registered memory; the lease
      // keeps a revocation waiting until they are written.
      ++stats_->served_gets;
      s->lease = std::move(*l);
      send_answer(s, msg::get_reply, h.id, status::ok, s->lease.data(), len);
    }
    return consumed();
  }

  rx_plan rx_answer(const header& h) noexcept {
    bool get = h.type == msg::get_reply;
    credit_back();  // whatever it answers, the peer's reply slot is free again
    op* o = rma_.head;
    while (o != nullptr && !(h.id >= o->id_ && h.id - o->id_ < o->nseg_)) o = o->next_;
    if (o == nullptr) {
      if (forget(dropped_answers_, h.id) || forget_in_range(h.id)) return drop(h.length);  // a cancelled request's answer
      return fail_plan();  // an answer to nothing we asked
    }
    if ((o->kind_ == op::kind::get) != get) return fail_plan();
    if (o->segmented()) return segment_answer(*o, h);
    delist(*o);
    o->stage_ = op::stage::idle;
    if (h.st != status::ok) {
      complete(*o, answer_error(h.st));
      return consumed();
    }
    if (!get) {
      o->bytes_ = o->size_;
      o->path_ = link_tx_path();
      complete(*o, {});
      return consumed();
    }
    if (h.length != o->size_) return fail_plan();  // not what was asked for
    o->stage_ = op::stage::placing;
    o->placing_ = true;
    return place({target::op_payload, o}, o->data_, o->size_, 0, o->nic_dev_);
  }


  // ---------------------------------------------------------------- the staged path
  //
  // Device memory moves through bounce buffers (`stage_slot`s, one pool per
  // direction): out through a device-to-host copy into a tx slot whose frame
  // then carries it, in through an rx slot the transport places a frame's
  // payload into, then a host-to-device copy. An operation moves as
  // segments of at most one chunk; each segment is a slot, and its op
  // counts the bytes done. `pump` hands segments to slots while slots are
  // free (an op waits in tx_wait_ otherwise) and posts the ready ones in
  // order; copies complete through the scheduler's copy engine
  // (`copy_done`). An op finishes only once none of its copies runs and it
  // holds no slot.

  // ---------------------------------------------------------------- GPUDirect
  //
  // On a GPUDirect endpoint the transport's NIC reads and writes `Device`
  // memory itself, so nothing is staged; instead the CPU must never touch
  // it. The engine keeps it out of every frame the CPU would copy (a send
  // from Device memory announces itself at any size; a Device receive
  // refuses eager bytes) and marks what only the NIC may move: frames
  // (`frame::nic_only`, `frame::device`) and placements (`rx_plan::device`).

  /// Marks `f` as carrying or naming memory only the NIC may move.
  static void mark_nic(frame& f, int device, bool nic_only) noexcept {
    f.nic_only = nic_only;
    f.device = static_cast<std::int8_t>(device < 0 ? -1 : device);
  }

  /// A GPUDirect Device receive cannot take `len` eager bytes (they are in
  /// host memory already, and only the CPU could copy them): it fails with
  /// this reason, and the message waits for another receive.
  static bool refuses_eager(op& r, std::size_t len) noexcept {
    if (r.nic_dev_ < 0 || std::min(len, r.size_) == 0) return false;
    r.what_ = "a Device receive on a GPUDirect endpoint takes only messages the NIC writes into it (rendezvous, "
              "above the sender's rendezvous_threshold, or any send from Device memory); this message came eager, "
              "through host memory, and stays receivable into host memory";
    return true;
  }

  /// This side can serve device memory (it has a copy engine).
  bool can_stage() const noexcept { return copy_engine::of(*sched_) != nullptr; }

  /// The segment of this side's own device memory: one chunk, or less if
  /// the peer's bounce buffers are smaller.
  std::size_t own_segment() const noexcept {
    return peer_seg_ != 0 ? std::min<std::size_t>(chunk_, peer_seg_) : chunk_;
  }

  /// The largest message `o` sends eager: the threshold, and from device
  /// memory within one bounce buffer (copied out whole, then sent).
  std::size_t eager_limit(const op& o) const noexcept {
    if (o.nic_dev_ >= 0) return 0;  // GPUDirect: the CPU never reads it into a frame
    std::size_t e = opts_.rendezvous_threshold;
    if (o.dev_ >= 0) e = std::min(e, chunk_);
    return e;
  }

  /// Whether `o` may start: its rows are not refused, and a staged one has
  /// a copy engine and its bounce buffers.
  std::error_code staging_check(op& o) noexcept {
    const bool staged = o.staged();
    const bool device = staged || o.nic_dev_ >= 0 || o.remote_nic_;
    if (refused_ & (device ? refuse_device : refuse_host)) {
      o.what_ = device ? "this endpoint's forced path excludes device memory"
                       : "this endpoint's forced path excludes host memory";
      return errc::unsupported;
    }
    if (!staged) return {};
    if (o.dev_ >= 0 && !can_stage()) {
      o.what_ = "device memory needs a copy engine on the endpoint's scheduler: create a gdr::cuda::event_poller "
                "for it (gdr::cuda::event_poller events(sched);)";
      return errc::no_device;
    }
    const bool out = o.kind_ == op::kind::send || o.kind_ == op::kind::put;
    std::error_code ec;
    if (o.kind_ != op::kind::recv) ec = ensure_pool(tx_, o.dev_ >= 0 && out);
    if (!ec && o.dev_ >= 0 && !out) ec = ensure_pool(rx_, true);
    if (ec) o.what_ = "could not allocate the staged path's pinned bounce buffers";
    return ec;
  }

  /// Makes `p`'s slots, and its pinned memory if `mem`.
  std::error_code ensure_pool(stage_pool& p, bool mem) noexcept {
    if (!p.slots) {
      std::size_t n = std::max<std::size_t>(opts_.staging.depth, 1);
      p.slots.reset(new (std::nothrow) stage_slot[n]);
      if (!p.slots) return errno_code(ENOMEM);
      p.count = n;
      for (std::size_t i = n; i-- > 0;) {
        stage_slot& b = p.slots[i];
        b.eng = this;
        b.rx = &p == &rx_;
        b.done = &on_copy_done;
        b.f.sslot = &b;
        b.next = p.free;
        p.free = &b;
      }
    }
    if (mem && p.block.data == nullptr) {
      copy_engine* ce = copy_engine::of(*sched_);
      if (ce == nullptr) return errc::no_device;
      p.block = ce->allocate_pinned(p.count * chunk_);
      if (p.block.data == nullptr) return errno_code(ENOMEM);
      for (std::size_t i = 0; i < p.count; ++i) p.slots[i].mem = p.block.data + i * chunk_;
    }
    return {};
  }

  stage_slot* take(stage_pool& p) noexcept {
    stage_slot* b = p.free;
    if (b == nullptr) return nullptr;
    p.free = b->next;
    b->next = nullptr;
    ++p.in_use;
    return b;
  }

  /// Gives slot `b` back (unlinking it from its op), then lets whoever
  /// waits for one go on.
  void release_slot(stage_slot& b) noexcept {
    stage_pool& p = b.rx ? rx_ : tx_;
    if (op* o = b.owner) {
      --o->slots_;
      if (!b.rx) unlink_segment(*o, b);
    }
    b.owner = nullptr;
    b.rs = nullptr;
    b.off = b.len = 0;
    b.req = 0;
    b.copying = b.ready = b.posted = false;
    b.f.reset(nullptr);
    b.f.sslot = &b;
    b.next = p.free;
    p.free = &b;
    --p.in_use;
    slot_freed(b.rx);
  }

  void unlink_segment(op& o, stage_slot& b) noexcept {
    stage_slot** pp = &o.sq_head_;
    stage_slot* prev = nullptr;
    while (*pp != nullptr && *pp != &b) {
      prev = *pp;
      pp = &(*pp)->next;
    }
    if (*pp == nullptr) return;
    *pp = b.next;
    if (o.sq_tail_ == &b) o.sq_tail_ = prev;
    b.next = nullptr;
  }

  /// A slot came free: a paused reader may go on, and so may the ops
  /// waiting for one.
  void slot_freed(bool rx) noexcept {
    resume_reading();
    // The waiters go on at the end of the event (run_deferred): a slot is
    // often freed from inside the transport's own bookkeeping (on_sent),
    // where posting a frame is not allowed.
    (rx ? kick_rx_ : kick_tx_) = true;
    if (busy_ == 0) post_resume();
  }

  /// `o` is to be pumped at the end of the current event.
  void defer_pump(op& o) noexcept {
    if (o.pump_due_ || o.result_set_) return;
    try {
      pumps_.push_back(&o);
      o.pump_due_ = true;
    } catch (...) {
      complete(o, errno_code(ENOMEM));
    }
  }

  /// What segment bookkeeping left for the end of the event: waiters for
  /// freed slots, and pumps. True if it did anything.
  bool run_deferred() noexcept {
    if (!kick_tx_ && !kick_rx_ && pumps_.empty() && !credit_due_) return false;
    if (std::exchange(credit_due_, false)) run_credit_waiters();
    if (std::exchange(kick_rx_, false)) kick_waiters(true);
    if (std::exchange(kick_tx_, false)) kick_waiters(false);
    while (!pumps_.empty()) {
      op* o = pumps_.front();
      pumps_.erase(pumps_.begin());
      o->pump_due_ = false;
      pump(*o);
    }
    return true;
  }

  /// Gets of Device memory served in arrival order as tx bounce buffers
  /// come free, before this side's own operations (they hold the peer's
  /// reply-slot credits).
  void serve_waiting_gets() noexcept {
    while (serve_wait_head_ != nullptr && tx_.free != nullptr) {
      reply_slot* s = serve_wait_head_;
      serve_wait_head_ = s->wait_next;
      if (serve_wait_head_ == nullptr) serve_wait_tail_ = nullptr;
      s->wait_next = nullptr;
      if (error_) {
        free_slot(s);
        continue;
      }
      stage_slot* b = take(tx_);
      b->rs = s;
      b->req = s->wait_id;
      b->len = s->wait_len;
      if (!start_copy(*b, copy_engine::direction::to_host, s->lease.device(), b->mem, s->lease.data(), s->wait_len,
                      nullptr)) {
        continue;  // answered when the copy is done
      }
      s->lease.release();
      release_slot(*b);
      ++stats_->refused;
      send_answer(s, msg::get_reply, s->wait_id, status::remote_access, nullptr, 0);
    }
  }

  /// Gives every waiting get's reply slot back (the endpoint failed).
  void drop_waiting_gets() noexcept {
    while (reply_slot* s = serve_wait_head_) {
      serve_wait_head_ = s->wait_next;
      s->wait_next = nullptr;
      free_slot(s);
    }
    serve_wait_tail_ = nullptr;
  }

  void kick_waiters(bool rx) noexcept {
    if (!rx) serve_waiting_gets();
    std::vector<op*>& q = rx ? rx_wait_ : tx_wait_;
    while (!q.empty() && (rx ? rx_.free : tx_.free) != nullptr) {
      op* o = q.front();
      q.erase(q.begin());
      o->waiting_ = false;
      if (rx) {
        try_deliver_early(*o);
      } else {
        pump(*o);
      }
    }
  }


  void wait_for_slot(op& o, bool rx) noexcept {
    if (o.waiting_) return;
    try {
      (rx ? rx_wait_ : tx_wait_).push_back(&o);
      o.waiting_ = true;
    } catch (...) {
      complete(o, errno_code(ENOMEM));
    }
  }
  void stop_waiting(op& o) noexcept {
    for (std::vector<op*>* q : {&tx_wait_, &rx_wait_}) std::erase(*q, &o);
    o.waiting_ = false;
  }

  /// Queues a copy for slot `b`; `o` is the op whose memory it touches
  /// (null: a served request's). Its first copy is ordered after
  /// `op_options::after`.
  std::error_code start_copy(stage_slot& b, copy_engine::direction d, int device, void* dst, const void* src,
                             std::size_t n, op* o) noexcept {
    copy_engine* ce = copy_engine::of(*sched_);
    if (ce == nullptr) return errc::no_device;
    stream_order after{};
    if (o != nullptr && !o->after_used_) {
      after = o->opts_.after;
      o->after_used_ = true;
    }
    b.copying = true;
    if (std::error_code ec = ce->copy(d, device, dst, src, n, after, &b)) {
      b.copying = false;
      return ec;
    }
    ++copies_;
    ++stats_->staged_chunks;
    if (o != nullptr) ++o->copies_;
    return {};
  }

  static void on_copy_done(copy_engine::completion* c, std::error_code ec) noexcept {
    auto* b = static_cast<stage_slot*>(c);
    engine* e = b->eng;
    e->enter();
    e->copy_done(*b, ec);
    e->leave();
  }

  void copy_done(stage_slot& b, std::error_code ec) noexcept {
    b.copying = false;
    --copies_;
    if (reply_slot* s = b.rs) {
      served_copy_done(b, *s, ec);
      return;
    }
    op& o = *b.owner;
    --o.copies_;
    if (b.rx) {
      std::size_t len = b.len;
      release_slot(b);
      if (ec) {
        copy_failed(o, ec);
      } else {
        o.done_ += len;
        if (!o.result_set_ && o.done_ == o.total_) finish_counted(o, false);
      }
      try_finish(o);
      if (o.kind_ == op::kind::get) pump(o);
      return;
    }
    if (ec || o.result_set_ || b.off >= o.total_) {
      release_slot(b);
      if (ec) copy_failed(o, ec);
      try_finish(o);
      return;
    }
    b.ready = true;
    post_ready(o);
  }

  void copy_failed(op& o, std::error_code ec) noexcept {
    if (o.result_set_) return;
    if (o.kind_ == op::kind::send && o.proto_ == wire_protocol::eager) refund(o);  // its frame never went out
    o.what_ = "a copy of the staged path failed";
    // A rendezvous send whose data is committed cannot stop half way: the
    // receiver waits for the rest. The connection cannot go on.
    if (o.kind_ == op::kind::send && o.stage_ == op::stage::sending) {
      complete(o, ec);
      fail(errc::device_error);
      return;
    }
    complete(o, ec);
  }

  /// A served request's copy finished (`b.rx`: a put into device memory,
  /// answered now; else a get from it, sent from the bounce buffer now).
  void served_copy_done(stage_slot& b, reply_slot& s, std::error_code ec) noexcept {
    std::uint64_t id = b.req;
    std::size_t len = b.len;
    s.lease.release();
    if (b.rx || ec) {
      release_slot(b);
      ++(ec ? stats_->refused : b.rx ? stats_->served_puts : stats_->served_gets);
      send_answer(&s, b.rx ? msg::put_ack : msg::get_reply, id, ec ? status::remote_access : status::ok, nullptr, 0);
      return;
    }
    ++stats_->served_gets;
    b.rs = nullptr;
    s.bounce = &b;
    send_answer(&s, msg::get_reply, id, status::ok, b.mem, len);
  }

  /// The transport is to place `len` bytes of `r`'s message (at `off`) into
  /// bounce buffer `b`, then drop `discard`.
  rx_plan place_in_bounce(op& r, stage_slot& b, std::size_t off, std::size_t len, std::uint64_t discard) noexcept {
    b.owner = &r;
    b.off = off;
    b.len = len;
    ++r.slots_;
    r.placing_ = true;
    r.path_ = transfer_path::staged_pinned;
    target t{target::stage_rx};
    t.b = &b;
    return place(t, b.mem, len, discard);
  }

  /// Bytes are in rx slot `b`: copy them to the device.
  void placed_in_bounce(stage_slot& b) noexcept {
    if (reply_slot* s = b.rs) {
      if (start_copy(b, copy_engine::direction::to_device, s->lease.device(), s->lease.data(), b.mem, b.len,
                     nullptr)) {
        std::uint64_t id = b.req;
        s->lease.release();
        release_slot(b);
        ++stats_->refused;
        send_answer(s, msg::put_ack, id, status::remote_access, nullptr, 0);
      }
      return;
    }
    op& o = *b.owner;
    o.placing_ = false;
    if (o.result_set_) {
      release_slot(b);
      try_finish(o);
      return;
    }
    if (std::error_code ec =
            start_copy(b, copy_engine::direction::to_device, o.dev_, o.data_ + b.off, b.mem, b.len, &o)) {
      release_slot(b);
      copy_failed(o, ec);
      try_finish(o);
    }
  }

  /// A counted op has all its bytes in place.
  void finish_counted(op& o, bool direct) noexcept {
    switch (o.kind_) {
      case op::kind::recv: o.bytes_ = o.total_; break;
      default: o.bytes_ = o.size_; break;
    }
    o.path_ = o.staged() ? transfer_path::staged_pinned : link_rx_path(direct);
    complete(o, o.ec_);  // errc::truncated was noted when the message began
  }

  /// A kept eager message for device memory: copied into bounce buffers
  /// (as they come free), a chunk at a time, then to the device.
  void deliver_early_staged(op& o, early_msg* m) noexcept {
    o.msg_size_ = static_cast<std::size_t>(m->size);
    o.proto_ = wire_protocol::eager;
    o.path_ = transfer_path::staged_pinned;
    o.total_ = std::min<std::size_t>(o.msg_size_, o.size_);
    if (o.msg_size_ > o.size_) o.ec_ = errc::truncated;
    o.early_ = m;
    o.stage_ = op::stage::placing;
    enlist(staging_, o);
    try_deliver_early(o);
  }

  void try_deliver_early(op& o) noexcept {
    while (o.early_ != nullptr && !o.result_set_ && o.issued_ < o.total_) {
      stage_slot* b = take(rx_);
      if (b == nullptr) {
        wait_for_slot(o, true);
        return;
      }
      std::size_t len = std::min(chunk_, o.total_ - o.issued_);
      std::memcpy(b->mem, o.early_->bytes.get() + o.issued_, len);
      b->owner = &o;
      b->off = o.issued_;
      b->len = len;
      ++o.slots_;
      o.issued_ += len;
      if (std::error_code ec = start_copy(*b, copy_engine::direction::to_device, o.dev_, o.data_ + b->off, b->mem,
                                          b->len, &o)) {
        release_slot(*b);
        copy_failed(o, ec);
        try_finish(o);
        return;
      }
    }
    if (o.early_ != nullptr && o.issued_ >= o.total_) delete std::exchange(o.early_, nullptr);
  }


  /// A staged eager send: one chunk copied out, then sent.
  bool launch_staged_eager(op& o) noexcept {
    o.proto_ = wire_protocol::eager;
    o.stage_ = op::stage::queued;
    // Its frame goes out only once its copy is done: the sends after it
    // wait until then, so that messages keep the order they were sent in.
    o.holds_order_ = true;
    ++order_holds_;
    o.seg_ = o.size_;
    o.total_ = o.size_;
    enlist(staging_, o);
    pump(o);
    return true;
  }

  /// A put or get that touches device memory (either side): requests of at
  /// most one segment each, at most `depth` unanswered.
  bool launch_segmented(op& o) noexcept {
    std::size_t seg = o.size_;
    if (o.dev_ >= 0) seg = std::min(seg, chunk_);
    if (o.remote_dev_ && peer_seg_ != 0) seg = std::min<std::size_t>(seg, peer_seg_);
    o.seg_ = std::max<std::size_t>(seg, 1);
    o.total_ = o.size_;
    o.nseg_ = o.size_ == 0 ? 1 : (o.size_ + o.seg_ - 1) / o.seg_;
    o.id_ = next_id_;
    next_id_ += o.nseg_;
    o.path_ = transfer_path::staged_pinned;
    o.stage_ = op::stage::awaiting;
    enlist(rma_, o);
    pump(o);
    return true;
  }

  void attach_segment(op& o, stage_slot& b, std::size_t off, std::size_t len) noexcept {
    b.owner = &o;
    b.off = off;
    b.len = len;
    b.next = nullptr;
    (o.sq_tail_ ? o.sq_tail_->next : o.sq_head_) = &b;
    o.sq_tail_ = &b;
    ++o.slots_;
  }

  /// Hands `o`'s next segments to free tx slots (copying device memory out
  /// into them) and posts those ready, in order.
  void pump(op& o) noexcept {
    if (o.result_set_) return;
    const bool rma = o.kind_ == op::kind::put || o.kind_ == op::kind::get;
    const bool copy_out = o.dev_ >= 0 && o.kind_ != op::kind::get;
    const std::size_t depth = tx_.count;
    if (rma && o.total_ == 0) {
      // Nothing to move: one empty request checks the key (once: a slot
      // held or a request out means it is on its way).
      if (o.sq_head_ != nullptr || o.out_ != 0) return post_ready(o);
      stage_slot* b = take(tx_);
      if (b == nullptr) return wait_for_slot(o, false);
      attach_segment(o, *b, 0, 0);
      b->ready = true;
      return post_ready(o);
    }
    // A rendezvous send whose receive has not answered yet copies ahead at
    // most one chunk, and never into the last free slot: slots go to what
    // can move now.
    const bool before_rtr = o.kind_ == op::kind::send && o.proto_ == wire_protocol::rendezvous && !o.go_;
    while (o.issued_ < o.total_) {
      if (rma && o.out_ + o.slots_ >= depth) break;  // enough requests unanswered
      if (before_rtr && (o.slots_ != 0 || tx_.count - tx_.in_use < 2)) break;
      stage_slot* b = take(tx_);
      if (b == nullptr) {
        wait_for_slot(o, false);
        break;
      }
      std::size_t len = std::min(o.seg_, o.total_ - o.issued_);
      attach_segment(o, *b, o.issued_, len);
      o.issued_ += len;
      if (copy_out) {
        if (std::error_code ec =
                start_copy(*b, copy_engine::direction::to_host, o.dev_, b->mem, o.data_ + b->off, len, &o)) {
          release_slot(*b);
          copy_failed(o, ec);
          try_finish(o);
          return;
        }
      } else {
        b->ready = true;
      }
    }
    post_ready(o);
  }

  /// Posts `o`'s segments whose bytes are ready, in offset order.
  void post_ready(op& o) noexcept {
    if (o.result_set_) return;
    if (o.kind_ == op::kind::send && o.proto_ == wire_protocol::rendezvous && !o.go_) return;
    for (stage_slot* b = o.sq_head_; b != nullptr; b = b->next) {
      if (b->posted) continue;
      if (!b->ready) break;
      if (o.kind_ != op::kind::send) {
        if (credits_ == 0) {
          wait_for_credit(o);
          break;
        }
        --credits_;
      }
      frame& f = b->f;
      f.reset(&o);
      f.sslot = b;
      header& h = f.hdr;
      const std::byte* src = o.dev_ >= 0 ? b->mem : o.data_ + b->off;
      switch (o.kind_) {
        case op::kind::send:
          if (o.proto_ == wire_protocol::eager) {
            h.type = msg::eager;
            h.tag = o.tag_;
            release_order(o);
          } else {
            h.type = msg::data;
            h.addr = o.raddr_;  // the receiver's token
            h.size = b->off;
            if (b->off + b->len == o.total_) h.flags = flag::last;
          }
          h.length = b->len;
          f.payload = src;
          break;
        case op::kind::put:
          h.type = msg::put_request;
          h.id = o.id_ + b->off / o.seg_;
          h.addr = o.raddr_ + b->off;
          h.key = o.rkey_;
          h.length = b->len;
          f.payload = src;
          ++o.out_;
          break;
        case op::kind::get:
          h.type = msg::get_request;
          h.id = o.id_ + b->off / o.seg_;
          h.addr = o.raddr_ + b->off;
          h.key = o.rkey_;
          h.size = b->len;
          ++o.out_;
          break;
        default: break;
      }
      b->posted = true;
      post(f);
    }
  }

  /// A segment's frame is written (or failed).
  void segment_sent(stage_slot& b, std::error_code ec) noexcept {
    op& o = *b.owner;
    b.posted = false;
    std::size_t len = b.len;
    release_slot(b);
    if (ec) {
      if (o.kind_ != op::kind::send && o.out_ != 0) --o.out_;  // no answer will come
      complete(o, failure_of(ec));
      try_finish(o);
      return;
    }
    if (o.kind_ == op::kind::send) {
      o.done_ += len;
      if (!o.result_set_ && o.done_ == o.total_) {
        o.bytes_ = o.size_;
        o.path_ = transfer_path::staged_pinned;
        complete(o, {});
      }
    }
    try_finish(o);
    defer_pump(o);  // not from inside on_sent: the transport is mid-bookkeeping
  }

  /// Takes back what `o`'s segments still hold: frames not yet committed
  /// are withdrawn, idle slots freed. True once it holds none.
  bool release_segments(op& o) noexcept {
    for (stage_slot* b = o.sq_head_; b != nullptr;) {
      stage_slot* next = b->next;
      if (b->posted) {
        if (held_by_link(b->f) && withdraw(b->f)) {
          b->f.queued = false;
          if (o.kind_ != op::kind::send && o.out_ != 0) {
            --o.out_;  // never sent: no answer
            credit_back();
            if (o.answers_dropped_) forget_in_range(o.id_);
          }
          release_slot(*b);
        }
      } else if (!b->copying) {
        release_slot(*b);
      }
      b = next;
    }
    return o.slots_ == 0;
  }

  /// An rtr for a send moved in segments (from device memory, or into the
  /// peer's device memory).
  rx_plan rtr_segmented(op& s, const header& h) noexcept {
    if (s.dev_ >= 0 && h.key != 0 && h.key < s.seg_) return fail_plan();  // smaller than its hello said
    if (s.dev_ < 0 && ensure_pool(tx_, false)) return fail_plan();
    delist(s);
    s.stop_reason_ = {};
    s.stage_ = op::stage::sending;
    ++rendezvous_out_;
    s.go_ = true;
    s.raddr_ = h.addr;  // the receiver's token
    if (s.dev_ < 0) s.seg_ = static_cast<std::size_t>(h.key);
    // The receive may accept fewer bytes: segments past them are not sent.
    s.total_ = static_cast<std::size_t>(h.size);
    s.issued_ = std::min(s.issued_, s.total_);
    for (stage_slot* b = s.sq_head_; b != nullptr;) {
      stage_slot* next = b->next;
      if (b->off >= s.total_) {
        if (!b->copying) release_slot(*b);
      } else if (b->off + b->len > s.total_) {
        b->len = s.total_ - b->off;
      }
      b = next;
    }
    enlist(staging_, s);
    if (s.total_ == 0) {
      // Nothing accepted: one empty segment ends the message.
      frame& f = s.f2_;
      f.reset(&s);
      f.hdr.type = msg::data;
      f.hdr.flags = flag::last;
      f.hdr.addr = h.addr;
      post(f);
      return consumed();
    }
    pump(s);
    return consumed();
  }

  /// An answer to one request of a segmented put or get.
  rx_plan segment_answer(op& o, const header& h) noexcept {
    std::size_t off = static_cast<std::size_t>(h.id - o.id_) * o.seg_;
    std::size_t len = o.size_ == 0 ? 0 : std::min(o.seg_, o.total_ - off);
    if (h.st != status::ok) {
      --o.out_;
      complete(o, answer_error(h.st));
      return h.length != 0 ? drop(h.length) : consumed();
    }
    if (o.kind_ == op::kind::put) {
      --o.out_;
      o.done_ += len;
      if (!o.result_set_ && o.done_ == o.total_) finish_counted(o, false);
      else pump(o);
      return consumed();
    }
    if (h.length != len) return fail_plan();  // not what was asked for
    if (o.dev_ >= 0 && len != 0) {
      stage_slot* b = take(rx_);
      if (b == nullptr) return pause_reading();
      --o.out_;
      return place_in_bounce(o, *b, off, len, 0);
    }
    --o.out_;
    o.placing_ = true;
    target t{target::op_payload, &o};
    t.counted = true;
    return place(t, o.data_ + off, len, 0);
  }

  struct drop_range {
    std::uint64_t lo, hi, left;
  };
  void remember_range(std::uint64_t lo, std::uint64_t hi, std::uint64_t left) noexcept {
    try {
      dropped_ranges_.push_back({lo, hi, left});
    } catch (...) {
      fail(errno_code(ENOMEM));
    }
  }
  bool forget_in_range(std::uint64_t id) noexcept {
    for (auto it = dropped_ranges_.begin(); it != dropped_ranges_.end(); ++it) {
      if (id < it->lo || id >= it->hi) continue;
      if (--it->left == 0) dropped_ranges_.erase(it);
      return true;
    }
    return false;
  }
  bool is_dropped(std::uint64_t token) const noexcept {
    return std::find(dropped_tokens_.begin(), dropped_tokens_.end(), token) != dropped_tokens_.end();
  }

  // ---------------------------------------------------------------- early credits
  //
  // Early credits. The room each side keeps for early messages (eager
  // bytes and announcements no receive has taken yet: `unexpected_bytes`,
  // `unexpected_messages`) is granted to the peer in advance: a `credit`
  // frame right after the hello, then more as messages are taken. A sender
  // spends a message slot on every message and the bytes of an eager one;
  // short of bytes it announces the message instead (rendezvous), short of
  // slots it waits, in order, on its own side (send_wait_). The receiver
  // gives credit back in batches of a quarter of its room. So the store
  // never fills while the reader keeps reading: the data of receives that
  // already matched always gets through.

  /// This side has taken one early message of `bytes` (eager) or an
  /// announcement (0): the peer may send it again.
  void owe(std::uint64_t bytes) noexcept {
    owed_bytes_ += bytes;
    ++owed_msgs_;
    maybe_grant();
  }

  /// The error an operation whose frame failed with `ec` completes with:
  /// the endpoint's own if it has failed already.
  std::error_code failure_of(std::error_code ec) const noexcept { return error_ ? error_ : ec; }

  /// Sends what is owed once it is a quarter of the room (and no credit
  /// frame is on its way already).
  void maybe_grant() noexcept {
    if (error_ || close_posted_ || held_by_link(credit_f_)) return;
    const std::uint64_t qb = std::max<std::uint64_t>(opts_.unexpected_bytes / 4, 1);
    const std::uint64_t qm = std::max<std::uint64_t>(opts_.unexpected_messages / 4, 1);
    if (owed_bytes_ < qb && owed_msgs_ < qm) return;
    credit_f_.reset(nullptr);
    credit_f_.hdr.type = msg::credit;
    credit_f_.hdr.size = std::exchange(owed_bytes_, 0);
    credit_f_.hdr.id = std::exchange(owed_msgs_, 0);
    post(credit_f_);
  }

  /// `o` spent credit on a message the peer will never see: give it back.
  void refund(op& o) noexcept {
    if (!std::exchange(o.debited_, false)) return;
    send_bytes_credit_ += o.debit_;
    ++send_msgs_credit_;
    if (!send_wait_.empty()) credit_due_ = true;
  }

  /// A staged eager send's frame is posted (or it ended without one): the
  /// sends behind it may go.
  void release_order(op& o) noexcept {
    if (!std::exchange(o.holds_order_, false)) return;
    --order_holds_;
    if (order_holds_ == 0 && !send_wait_.empty()) credit_due_ = true;
  }

  /// Sends that waited for credit go out, in order, while it lasts.
  void run_send_waiters() noexcept {
    while (send_msgs_credit_ != 0 && order_holds_ == 0 && !send_wait_.empty()) {
      op* o = send_wait_.head;
      delist(*o);
      o->stage_ = op::stage::idle;
      waiter_turn_ = true;  // its turn: it does not queue behind the others
      const bool pending = launch(*o);
      waiter_turn_ = false;
      if (!pending) complete(*o, o->ec_);
    }
  }

  // ---------------------------------------------------------------- credits
  //
  // Credits. A put or get request holds one of the target's reply slots
  // until its answer is written. The target says in its hello how many it
  // has; the initiator keeps that many requests unanswered at most, and a
  // request beyond them waits here (a whole put or get in credit_wait_, a
  // segment of a staged one by its op in credit_pumps_) until an answer
  // comes back. So requests never find the slots all taken by the peer's
  // own traffic, and puts and gets in both directions cannot stop each
  // other's readers.

  void credit_back() noexcept {
    ++credits_;
    if (!credit_wait_.empty() || !credit_pumps_.empty()) credit_due_ = true;
  }

  void wait_for_credit(op& o) noexcept {
    if (o.credit_due_) return;
    try {
      credit_pumps_.push_back(&o);
      o.credit_due_ = true;
    } catch (...) {
      complete(o, errno_code(ENOMEM));
    }
  }

  /// Credits came back: whoever waits for one goes on, in order.
  void run_credit_waiters() noexcept {
    run_send_waiters();
    while (credits_ != 0 && !credit_wait_.empty()) {
      op* o = credit_wait_.head;
      delist(*o);
      o->stage_ = op::stage::idle;
      if (!launch(*o)) complete(*o, o->ec_);
    }
    while (credits_ != 0 && !credit_pumps_.empty()) {
      op* o = credit_pumps_.front();
      credit_pumps_.erase(credit_pumps_.begin());
      o->credit_due_ = false;
      post_ready(*o);
    }
  }

  // ---------------------------------------------------------------- answers

  // Reply slots. An endpoint grants its peer `reply_slots` credits in its
  // hello from the start, but allocates a slot only when a request finds
  // none free (an idle endpoint holds none: 64 of them were 16.5 KiB,
  // zeroed at creation, benchmarks/RESULTS.md "Idle endpoints"); a slot is
  // kept once made, so a steady stream of requests allocates nothing. The
  // peer never has more requests unanswered than the credits, so at most
  // `reply_slots` are made. When one cannot be allocated, the request is
  // answered from the spare slot, which every engine holds, with
  // `status::no_memory`: that put or get fails with
  // `std::errc::not_enough_memory` on the peer, whose credit comes back with
  // the answer, and the connection goes on. While the spare's answer is not
  // yet written, a further request that finds no slot pauses the reader, as
  // one does when every slot is in use, until it is.

  reply_slot* take_slot() noexcept {
    reply_slot* s = free_slots_;
    if (s != nullptr) {
      free_slots_ = s->next_free;
      return s;
    }
    return make_slot();
  }

  /// No free slot: a new one if the credits allow it and memory is there,
  /// else the spare (when no slot could be allocated and it is free), else
  /// null (every slot is in use: the caller pauses).
  reply_slot* make_slot() noexcept {
    if (slots_made_count_ >= slot_limit_) return nullptr;
    auto* s = new (std::nothrow) reply_slot;
    if (s == nullptr) {
      if (spare_busy_) return nullptr;
      spare_busy_ = true;
      return &spare_slot_;
    }
    s->f.slot = s;
    s->next_made = slots_made_;
    slots_made_ = s;
    ++slots_made_count_;
    return s;
  }

  /// The error a put or get fails with for a refusing answer.
  static std::error_code answer_error(status st) noexcept {
    if (st == status::no_memory) return errno_code(ENOMEM);
    return errc::remote_access;
  }
  /// A bounce buffer of `p` for serving request `id` (reply slot `s`, lease
  /// `l` on device memory, `len` bytes). Null when none is free: the lease
  /// and the reply slot are given back, nothing changed (the caller pauses).
  stage_slot* bounce_for_request(stage_pool& p, reply_slot* s, access_lease& l, std::uint64_t id,
                                 std::size_t len) noexcept {
    stage_slot* b = take(p);
    if (b == nullptr) {
      l.release();
      put_back_slot(s);
      return nullptr;
    }
    s->lease = std::move(l);
    b->rs = s;
    b->req = id;
    b->len = len;
    return b;
  }

  /// Returns a slot taken a moment ago, without resuming a paused reader
  /// (the header that took it is about to pause).
  void put_back_slot(reply_slot* s) noexcept {
    assert(s != &spare_slot_ && "gdr: the spare reply slot serves no request");
    s->next_free = free_slots_;
    free_slots_ = s;
  }

  void free_slot(reply_slot* s) noexcept {
    s->lease.release();
    if (stage_slot* b = std::exchange(s->bounce, nullptr)) release_slot(*b);
    s->f.reset(nullptr);
    s->f.slot = s;
    if (s == &spare_slot_) {
      spare_busy_ = false;
    } else {
      s->next_free = free_slots_;
      free_slots_ = s;
    }
    resume_reading();
  }

  void send_answer(reply_slot* s, msg type, std::uint64_t id, status st, const std::byte* payload,
                   std::size_t len, int device = -1) noexcept {
    if (error_) {
      free_slot(s);
      return;
    }
    frame& f = s->f;
    f.hdr = header{};
    f.hdr.type = type;
    f.hdr.st = st;
    f.hdr.id = id;
    f.hdr.length = len;
    f.payload = payload;
    mark_nic(f, device, device >= 0);
    post(f);
  }

  // ---------------------------------------------------------------- resuming

  void post_resume() noexcept {
    if (resume_posted_) return;
    resume_posted_ = true;
    sched_->post(&resume_node_);
  }

  static void on_resume_node(remote_work* w) noexcept {
    engine* e = static_cast<resume_node*>(w)->self;
    e->enter();
    e->resume_posted_ = false;
    e->leave();
  }

  // ---------------------------------------------------------------- state

  scheduler* sched_;
  memory_registry* registry_;
  protocol_options opts_;
  protocol_stats* stats_;
  transfer_path last_path_ = transfer_path::none;
  std::error_code error_{};
  bool closing_ = false;
  bool abandoned_ = false;
  bool got_hello_ = false;
  bool paused_ = false;
  std::uint64_t peer_max_ = 0;
  std::uint64_t peer_caps_ = 0;
  std::uint64_t next_id_ = 1;
  op* close_op_ = nullptr;
  bool close_posted_ = false;
  std::size_t rendezvous_out_ = 0;  // rendezvous sends whose data is posted, not yet written
  int busy_ = 0;
  std::size_t attached_ = 0;  // operations suspended and not yet resumed
  op* ready_head_ = nullptr;
  op* ready_tail_ = nullptr;
  resume_node resume_node_{};
  bool resume_posted_ = false;
  frame hello_{};
  target cur_{};
  target aborted_{};  // a placement stopped while the kernel wrote into it

  op_list held_{};           // waiting for the peer's hello
  op_list announced_{};      // rendezvous sends: rts posted
  op_list recvs_{};          // posted receives, unmatched
  op_list awaiting_data_{};  // receives that sent rtr
  op_list rma_{};            // puts and gets awaiting their answer
  fifo<early_msg, &early_msg::prev, &early_msg::next> early_{};
  std::size_t early_bytes_ = 0;
  std::vector<std::uint64_t> dropped_tokens_;   // rendezvous data to drop (cancelled receives)
  std::vector<std::uint64_t> dropped_answers_;  // answers to drop (cancelled puts and gets)
  reply_slot* free_slots_ = nullptr;
  reply_slot* serve_wait_head_ = nullptr;  // gets of Device memory waiting for a tx bounce buffer
  reply_slot* serve_wait_tail_ = nullptr;
  reply_slot* slots_made_ = nullptr;   // every slot allocated (next_made), freed with the engine
  std::size_t slots_made_count_ = 0;
  std::size_t slot_limit_ = 0;         // the credits granted in the hello
  reply_slot spare_slot_{};            // answers no_memory when no slot can be allocated
  bool spare_busy_ = false;
  // ---- the staged path ----
  std::size_t chunk_ = 0;          // bytes per bounce buffer
  std::uint64_t peer_seg_ = 0;     // the peer's chunk (its hello), 0: no limit
  std::uint8_t refused_ = 0;       // rows a forced path excludes (refuse_host, refuse_device)
  bool device_direct_ = false;     // GPUDirect: Device memory is moved by the transport's NIC, not staged
  std::size_t copies_ = 0;         // copies in flight (ops' and served requests')
  stage_pool tx_{};
  stage_pool rx_{};
  std::vector<op*> tx_wait_;       // ops waiting for a tx slot
  std::vector<op*> rx_wait_;       // ops waiting for an rx slot
  op_list staging_{};              // staged ops in no other list
  std::vector<drop_range> dropped_ranges_;  // cancelled segmented requests' answers to drop
  bool kick_tx_ = false;          // tx slots came free: waiters go on (run_deferred)
  bool kick_rx_ = false;
  std::vector<op*> pumps_;        // ops to pump at the end of the event
  // ---- early credits ----
  frame credit_f_{};                   // this side's credit frame (one at a time)
  std::uint64_t owed_bytes_ = 0;       // taken early bytes not yet granted back
  std::uint64_t owed_msgs_ = 0;
  std::uint64_t send_bytes_credit_ = 0;  // the peer's early room this side may use
  std::uint64_t send_msgs_credit_ = 0;
  bool got_credit_ = false;            // the peer's first credit (its handshake is done)
  bool waiter_turn_ = false;           // run_send_waiters is launching the head of send_wait_
  std::size_t order_holds_ = 0;        // staged eager sends whose frame is not posted yet
  op_list send_wait_{};                // sends waiting for a message slot
  // ---- credits: the peer's reply slots this side may still use ----
  std::uint64_t credits_ = 0;
  bool credit_due_ = false;        // credits came back and someone waits (run_deferred)
  op_list credit_wait_{};          // puts and gets waiting for a credit
  std::vector<op*> credit_pumps_;  // staged puts and gets whose next segment waits for one
  // ---- the transport calls an event queued (drain) ----
  bool draining_ = false;
  link_end link_end_ = link_end::open;
  bool abort_due_ = false;
  bool resume_due_ = false;
  frame* outbox_head_ = nullptr;
  frame* outbox_tail_ = nullptr;
  op* stops_head_ = nullptr;
  op* stops_tail_ = nullptr;
  op* finishes_head_ = nullptr;
  op* finishes_tail_ = nullptr;
};

// ---------------------------------------------------------------- op

inline void op::throw_error() const {
  if (ec_ == errc::truncated) {
    std::string what = "message of " + std::to_string(msg_size_) + " bytes truncated to " + std::to_string(bytes_);
    throw gdr::error(ec_, what);
  }
  if (what_ != nullptr) throw gdr::error(ec_, what_);
  throw gdr::error(ec_);
}

inline bool op::start(std::coroutine_handle<> h, std::stop_token coro_stop) noexcept {
  assert(eng_ != nullptr && "gdr: operation on an endpoint that holds no connection");
  assert(scheduler::current() == &eng_->sched() && "gdr: await an endpoint's operations on its scheduler's thread");
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
    stage_ = stage::idle;
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
  engine* e = eng_;
  e->enter();
  f();
  e->leave();  // may resume this operation's coroutine, which may end it
}

inline void op::finish() noexcept {
  finished_ = true;
  eng_->record(*this);
  settle();
}

}  // namespace gdr::detail::proto
