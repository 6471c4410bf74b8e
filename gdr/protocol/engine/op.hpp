/// \file
/// An operation: the awaitable of a send, recv, put, get or close, its
/// state, its frames and the links of the engine's lists.
#pragma once

#include <array>
#include <cassert>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <stop_token>
#include <system_error>

#include <gdr/log.hpp>
#include <gdr/protocol/engine/fifo.hpp>
#include <gdr/protocol/engine/link.hpp>
#include <gdr/protocol/engine/slots.hpp>
#include <gdr/protocol/options.hpp>
#include <gdr/sched/cancellable.hpp>
#include <gdr/transfer/common.hpp>

namespace gdr::detail::proto {

class engine;
struct announcement;

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
        nic_dev_(o.nic_dev_), remote_nic_(o.remote_nic_), atomic_(o.atomic_), atomic_args_{o.atomic_args_[0], o.atomic_args_[1]},
        nic_{o.nic_[0], o.nic_[1]}, batch_(o.batch_), nbatch_(o.nbatch_), notify_(o.notify_), flush_(o.flush_),
        owner_checked_(o.owner_checked_) {}
  op& operator=(op&&) = delete;

  /// Before it is awaited: the local memory is `Device` memory of GPU `dev`
  /// (-1: host memory), and for a put or get whether the peer's is. Either
  /// makes it a staged operation, or on a GPUDirect endpoint
  /// (`engine::set_device_direct`) one whose bytes only the NIC moves.
  void set_spaces(int dev, bool remote_dev) noexcept {
    dev_ = dev < 0 ? -1 : dev;
    remote_dev_ = remote_dev;
  }

  /// Before it is awaited: makes a get of 8 bytes a remote atomic
  /// (`proto::atomic_fetch_add` with operand `a`, or
  /// `proto::atomic_compare_swap` of expected `a` for `b`); the old value
  /// lands in its buffer.
  void set_atomic(std::uint64_t code, std::uint64_t a, std::uint64_t b) noexcept {
    atomic_ = code;
    atomic_args_[0] = a;
    atomic_args_[1] = b;
  }
  /// Before it is awaited: where its bytes go (a buffer inside a derived
  /// awaitable, which moves with it).
  void set_buffer(std::byte* data) noexcept { data_ = data; }
  /// Before it is awaited: the remote view's NIC keys (`remote_view::nic_keys`):
  /// a transport with direct one-sided operations may post it to its NIC.
  void set_nic(const std::array<std::uint64_t, 2>& keys) noexcept {
    nic_[0] = keys[0];
    nic_[1] = keys[1];
  }
  /// Before it is awaited: the remote view is of an `exposure::checked`
  /// registration (`remote_view::owner_checked`): a get of its `Device`
  /// memory is staged where the transport's own move would map the
  /// owner's allocation (CUDA IPC).
  void set_owner_checked(bool on) noexcept { owner_checked_ = on; }
  /// Before it is awaited: a batch of `n` blocks (`gdr::block`, offsets in
  /// bytes into the local and the remote memory) instead of one transfer.
  void set_batch(const block* b, std::size_t n) noexcept {
    static constexpr block none{};
    batch_ = n == 0 ? &none : b;  // an empty batch is still a batch
    nbatch_ = n;
  }

  // ---- what a transport that posts it directly reads (`engine::link_direct`) ----
  bool is_get() const noexcept { return kind_ == kind::get; }
  std::byte* local_data() const noexcept { return data_; }
  std::size_t local_size() const noexcept { return size_; }
  std::uint64_t remote_address() const noexcept { return raddr_; }
  std::size_t remote_size() const noexcept { return rsize_; }
  /// The remote key of NIC domain `domain` (0: the view has none).
  std::uint32_t nic_key(std::uint32_t domain) const noexcept {
    for (std::uint64_t k : nic_)
      if (k != 0 && static_cast<std::uint32_t>(k >> 32) == domain) return static_cast<std::uint32_t>(k);
    return 0;
  }
  /// A remote atomic's operation (0: none) and operands.
  std::uint64_t atomic_code() const noexcept { return atomic_; }
  std::uint64_t atomic_arg(int i) const noexcept { return atomic_args_[i]; }
  /// Before it is awaited: a put that also tells the owner `value`
  /// (`put_notify`), or a flush of the direct operations before it.
  void set_notify(std::uint32_t value) noexcept { notify_ = (std::uint64_t{1} << 32) | value; }
  void set_flush() noexcept { flush_ = true; }
  bool notifies() const noexcept { return (notify_ >> 32) != 0; }
  std::uint32_t notify_value() const noexcept { return static_cast<std::uint32_t>(notify_); }
  bool is_flush() const noexcept { return flush_; }
  /// GPUDirect: the local memory is Device memory of this GPU (-1: host).
  int local_device() const noexcept { return nic_dev_; }
  /// The peer's memory is GPU memory (a GPUDirect put or get).
  bool remote_device() const noexcept { return remote_nic_; }
  const block* batch() const noexcept { return batch_; }
  std::size_t batch_size() const noexcept { return nbatch_; }
  /// The transport's link while it holds the operation (a queue of its own).
  op* direct_next = nullptr;

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
  /// The stream work its bytes wait for (`gdr::cuda::after`): a transport
  /// that moves `Device` memory itself orders its move after it.
  stream_order after() const noexcept { return opts_.after; }

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
    announced,    // rendezvous send: rts posted, no rtr yet (a stop withdraws it here at once)
    sending,      // rendezvous send: data posted (committed)
    posted,       // recv: waiting for a message
    placing,      // recv/get: its payload is being placed
    awaiting,     // recv: rtr sent, waiting for data; put/get: waiting for the answer
    direct,       // put/get: posted by the transport itself (its NIC), on_direct_done ends it
  };

  /// The one place that says how an operation of each kind may move
  /// between stages (the engine moves one only through `to`, and a debug
  /// build asserts the move). Any stage may go back to `idle` (completed,
  /// or taken off a waiting list to be launched again), `idle` may go to
  /// any stage of the kind's, and a stage may be entered again:
  ///   send      held, queued, announced -> sending
  ///   recv      posted, awaiting -> placing, placing
  ///   put, get  held, queued, awaiting -> placing (a get's reply), direct
  ///   close     idle only (its frame and the link's end say where it is)
  static constexpr bool may_move(kind k, stage from, stage to) noexcept {
    if (to == stage::idle) return true;
    auto own = [k](stage s) {
      switch (k) {
        case kind::send:
          return s == stage::held || s == stage::queued || s == stage::announced || s == stage::sending;
        case kind::recv: return s == stage::posted || s == stage::awaiting || s == stage::placing;
        case kind::put:
        case kind::get:
          return s == stage::held || s == stage::queued || s == stage::awaiting || s == stage::placing ||
                 s == stage::direct;
        case kind::close: return false;
      }
      return false;
    };
    if (!own(to)) return false;
    if (from == stage::idle || from == to) return true;  // (a kept message into Device memory: placing twice)
    switch (k) {
      case kind::send:
        return from == stage::announced && to == stage::sending;
      case kind::recv:
      case kind::put:
      case kind::get: return from == stage::awaiting && to == stage::placing;
      case kind::close: return false;
    }
    return false;
  }
  void to(stage s) noexcept {
#ifndef NDEBUG
    if (!may_move(kind_, stage_, s))
      gdr::detail::log("protocol", "an operation of kind %d moved from stage %d to stage %d", static_cast<int>(kind_),
                       static_cast<int>(stage_), static_cast<int>(s));
#endif
    assert(may_move(kind_, stage_, s) && "gdr: an operation moved to a stage its kind does not allow from there");
    stage_ = s;
  }

  friend class gdr::detail::cancellable<op>;

  // The stop and timeout mechanism's hooks (gdr/sched/cancellable.hpp).
  inline scheduler& cancel_scheduler() const noexcept;
  inline void on_stop(std::error_code why) noexcept;
  inline void on_settled() noexcept;
  template <class F>
  inline void in_event(F&& f) noexcept;

  [[noreturn]] void throw_error() const;
  inline bool start(std::coroutine_handle<> h, std::stop_token coro_stop) noexcept;
  // No connection, or not the endpoint's scheduler's thread (`start`): fails at once.
  [[gnu::cold, gnu::noinline]] bool refuse_start() noexcept {
    if (eng_ == nullptr) {
      ec_ = errc::closed;
      what_ = "gdr: an operation on an endpoint that holds no connection (default-constructed or moved from)";
    } else {
      ec_ = errc::unsupported;
      what_ = "gdr: an endpoint's operation awaited on a thread other than its scheduler's: await it on the thread "
              "that runs the endpoint's scheduler";
    }
    return false;
  }
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
  std::uint64_t atomic_ = 0;           // a get that is a remote atomic: its operation (0: none)
  std::uint64_t atomic_args_[2] = {};  // its operands (the request's payload)
  std::uint64_t nic_[2] = {};          // put/get: the remote view's NIC keys (domain << 32 | rkey)
  const block* batch_ = nullptr;       // put/get: a batch of blocks (direct only)
  std::size_t nbatch_ = 0;
  std::uint64_t notify_ = 0;           // put: 1 << 32 | the value to tell the owner (direct only)
  bool flush_ = false;                 // a flush of this side's direct operations (a put of nothing)
  bool owner_checked_ = false;         // put/get: the remote view is exposure::checked

  // ---- state (loop thread) ----
  stage stage_ = stage::idle;
  bool result_set_ = false;  // the outcome is decided
  bool finished_ = false;    // finish() ran
  bool placing_ = false;     // the transport is placing a payload into data_
  std::error_code ec_{};
  std::error_code stop_reason_{};  // a stop queued (stop_due_); put/get: one that waits for its request to be written (or the NIC)
  std::size_t bytes_ = 0;
  std::size_t msg_size_ = 0;
  std::uint64_t id_ = 0;  // send id, rendezvous token, or request id
  std::uint64_t matched_at_ = 0;  // recv: the engine's count of matches when it matched an rts (repost_recv)
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
  bool direct_out_ = false;   // direct: the transport holds it (link_direct, until on_direct_done)
  bool direct_due_ = false;   // direct: in the engine's direct_due_ (handed over at the end of the event)
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
  frame f1_;                       // eager, put/get request, rtr, close
  frame f2_{frame::unposted_t{}};  // rendezvous data; a receive's next rtr while f1_ is out (reset before its post)
  announcement* ann_ = nullptr;    // rendezvous send: its rts, the engine's (engine/withdrawals.hpp)

};

using op_list = fifo<op, &op::prev_, &op::next_>;

}  // namespace gdr::detail::proto
