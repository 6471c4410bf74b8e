/// \file
/// `gdr::loopback`: two connected endpoints inside one process, for tests,
/// examples and the quickstart. Same API as the TCP endpoint (`send`, `recv`,
/// `put`, `get`, `close`, `last_path`, `stats`), no sockets.
///
/// \code
///   gdr::scheduler sched;
///   gdr::loopback::endpoint a, b;
///   std::tie(a, b) = gdr::loopback::make_pair(sched);  // (clang 14 cannot capture structured bindings)
///   gdr::sync_wait(sched, [&]() -> gdr::task<> {
///     std::array<int, 4> out{1, 2, 3, 4}, in{};
///     auto r = b.recv(gdr::host_view(in));              // posted first...
///     co_await a.send(gdr::host_view(out));             // ...so this copies straight into `in`
///     std::size_t n = co_await std::move(r);            // 16 bytes, path host_zero_copy
///   }());
/// \endcode
///
/// How bytes move (and how many copies that is)
/// ============================================
/// Each direction of a pair has two FIFO queues, guarded by one mutex per pair:
/// messages not yet received, and receives not yet matched. At most one of the
/// two is non-empty. A send that finds a posted receive copies its bytes
/// straight into the receive buffer: one `memcpy`, recorded as
/// `transfer_path::host_zero_copy` (no intermediate buffer; the copy itself
/// cannot be avoided between two buffers). A send that finds no receive either
///   * is *eager*: when it is at most `options::eager_limit` bytes, the
///     direction holds less than `options::eager_capacity` eager bytes, and no
///     larger send is waiting ahead of it, its bytes are copied into a buffer
///     the pair owns and the send completes at once; the receive copies them
///     out later. Two `memcpy`s, `transfer_path::host_eager`. This is what a
///     socket buffer does, and it lets a coroutine send a small message and
///     then receive without a deadlock;
///   * or waits (rendezvous) until a receive is posted, which then copies
///     straight from the sender's buffer: one `memcpy`, `host_zero_copy`.
///     The send completes after that copy, so its buffer is free when it
///     resumes.
/// `put`/`get` copy once, straight between the local view and the registered
/// memory (`host_zero_copy`), after `memory_registry::resolve` has checked the
/// remote view; they complete at once.
///
/// Threads and completion context
/// ==============================
/// Each end belongs to a scheduler: awaiting its operations is allowed only on
/// that scheduler's thread, and they resume there. The two ends may share one
/// scheduler or live on two schedulers on two threads. Whichever thread
/// matches a send with a receive does the copy, then hands the other side's
/// completion to that side's scheduler with `scheduler::post` (thread-safe;
/// it also orders the copy before the resumption). An operation that can
/// complete while it is being awaited does not suspend.
///
/// Messages, errors, close
/// =======================
/// Message boundaries are kept: one `recv` takes exactly one message. A
/// message larger than the receive view fills the view, the rest is dropped,
/// and the receive fails with `errc::truncated` (nothing is written past the
/// view; the message is consumed; the send succeeds, as with MPI). Concurrent
/// sends are delivered in the order they were started; concurrent receives are
/// matched in the order they were started.
/// `close()` on one end fails every pending operation of the pair: those of
/// the closing end with `errc::closed`, those of the peer with
/// `errc::connection_lost`. Later operations fail the same way, except that
/// the peer can still receive eager messages whose sends completed before the
/// close (like the bytes before a TCP FIN); after those, `connection_lost`.
/// Destroying an endpoint closes it.
///
/// Cancellation and timeouts: a send or receive that waits can be stopped by
/// `op_options::stop` or by the awaiting coroutine's stop token
/// (`errc::cancelled`), or by `op_options::timeout` (`errc::timed_out`),
/// which is an io_uring timeout on the endpoint's scheduler, not a user-space
/// timer. A cancelled or timed-out operation has moved no bytes; one that
/// matched before the stop completes normally (a match is never undone).
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <liburing.h>

#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/common.hpp>

namespace gdr {

namespace loopback {

/// The loopback transport's tag, the key of its `transport_traits` rows.
struct transport {};

}  // namespace loopback

/// Loopback moves host-accessible memory with one `memcpy` from the sender's
/// buffer into the receiver's (eager sends: two, see the file comment).
template <>
struct transport_traits<loopback::transport, Host> {
  static constexpr bool zero_copy = true;
  static constexpr bool supported = true;
};

/// Pinned memory is host memory to the loopback transport.
template <>
struct transport_traits<loopback::transport, Pinned> {
  static constexpr bool zero_copy = true;
  static constexpr bool supported = true;
};

// Device: the conservative default (unsupported) applies until loopback can
// copy through the CUDA copy engines; see endpoint::send's diagnostic.

namespace loopback {

/// Tuning of a pair (both directions).
struct options {
  /// Sends of at most this many bytes complete at once when no receive is
  /// posted (copied into the pair's buffer). 0: every send waits for its
  /// receive (always one copy).
  std::size_t eager_limit = 64 * 1024;
  /// The most bytes of eager messages a direction holds; beyond, sends wait.
  std::size_t eager_capacity = 1024 * 1024;
};

/// Counters of one end (the counters every transport keeps).
using endpoint_stats = transfer_stats;

}  // namespace loopback

namespace detail::lb {

/// A link in a channel queue: a waiting send, a waiting receive, or an eager
/// message.
struct node {
  node* prev = nullptr;
  node* next = nullptr;
  bool eager = false;  // an eager_message, not a transfer_op
};

/// Intrusive FIFO with O(1) removal (a cancelled operation leaves from the middle).
struct node_list {
  node* head = nullptr;
  node* tail = nullptr;

  bool empty() const noexcept { return head == nullptr; }
  void push_back(node* n) noexcept {
    n->prev = tail;
    n->next = nullptr;
    (tail ? tail->next : head) = n;
    tail = n;
  }
  void erase(node* n) noexcept {
    (n->prev ? n->prev->next : head) = n->next;
    (n->next ? n->next->prev : tail) = n->prev;
    n->prev = n->next = nullptr;
  }
  node* pop_front() noexcept {
    node* n = head;
    if (n != nullptr) erase(n);
    return n;
  }
};

struct eager_message : node {
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0;
};

/// One direction of a pair: what side `s` sent, and what side `1 - s` waits for.
struct direction {
  node_list messages;             // eager messages and waiting sends, in send order
  node_list recvs;                // receives posted by the other side, in order
  std::size_t eager_bytes = 0;    // bytes held by eager messages in `messages`
  std::size_t waiting_sends = 0;  // rendezvous sends in `messages`
};

/// Per-side state. `closed` is guarded by the channel mutex; `stats` and
/// `last_path` belong to the side's scheduler thread alone.
struct side_state {
  scheduler* sched = nullptr;
  bool closed = false;
  loopback::endpoint_stats stats{};
  transfer_path last_path = transfer_path::none;
};

/// The shared state of a pair. Operations hold a reference, so it outlives
/// both endpoints while anything is pending.
struct channel {
  std::mutex mu;
  direction dir[2];  // dir[s]: from side s to side 1 - s
  side_state side[2];
  memory_registry* registry = nullptr;
  loopback::options opts{};

  channel() = default;
  channel(const channel&) = delete;
  channel& operator=(const channel&) = delete;
  ~channel() {
    // Eager messages nobody received.
    for (direction& d : dir)
      while (node* n = d.messages.pop_front()) {
        assert(n->eager && "channel destroyed with a send pending");
        delete static_cast<eager_message*>(n);
      }
  }

  /// Why side `s` cannot start an operation now, if it cannot. Under `mu`.
  std::error_code closed_error(int s) const noexcept {
    if (side[s].closed) return errc::closed;
    if (side[1 - s].closed) return errc::connection_lost;
    return {};
  }
};

class transfer_op;
inline void close_side(channel& c, int s) noexcept;

inline void copy_bytes(std::byte* dst, const std::byte* src, std::size_t n) noexcept {
  // memcpy's pointers must be valid even for n == 0; empty views may be null.
  if (n != 0) std::memcpy(dst, src, n);
}

/// Counts a completed operation in its side's stats. Owner thread only.
inline void record(side_state& s, std::error_code ec, std::size_t bytes, transfer_path path, bool outgoing,
                   std::uint64_t loopback::endpoint_stats::*counter) noexcept {
  if (ec) {
    ++s.stats.failed;
    return;
  }
  ++(s.stats.*counter);
  (outgoing ? s.stats.bytes_sent : s.stats.bytes_received) += bytes;
  ++s.stats.by_path[static_cast<std::size_t>(path)];
  s.last_path = path;
}

/// A send or a receive: the awaitable, its queue node, and its completion.
///
/// Life: built with its parameters (movable until awaited); `await_suspend`
/// either completes it at once (returns false) or queues it and, when a
/// timeout is set, arms an io_uring timeout on the owner's scheduler. From
/// then on exactly one party *claims* it, under the channel mutex: a matching
/// operation, `close()`, a stop callback, or the timer. The claimer sets the
/// result and hands the completion to the owner's scheduler; the owner then
/// waits for the timer's CQE too (the timer lives in this frame) and resumes.
class transfer_op : public node {
 public:
  enum class kind : std::uint8_t { send, recv };

  transfer_op(std::shared_ptr<channel> ch, int side, kind k, std::byte* data, std::size_t size,
              op_options opts) noexcept
      : ch_(std::move(ch)), data_(data), size_(size), opts_(std::move(opts)), side_(side), kind_(k) {}

  // Movable only before it is awaited (it is then only its parameters).
  transfer_op(transfer_op&& o) noexcept
      : node(), ch_(std::move(o.ch_)), data_(o.data_), size_(o.size_), opts_(std::move(o.opts_)),
        side_(o.side_), kind_(o.kind_) {}
  transfer_op& operator=(transfer_op&&) = delete;

  bool await_ready() const noexcept { return false; }

  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    assert(scheduler::current() == ch_->side[side_].sched &&
           "gdr::loopback: await an endpoint's operations on its scheduler's thread");
    std::stop_token coro_stop = stop_token_of(h);
    if (coro_stop.stop_requested() || opts_.stop.stop_requested()) {
      ec_ = errc::cancelled;
      return false;
    }
    waiter_ = h;
    if (!(kind_ == kind::send ? start_send() : start_recv())) return false;
    // Queued. From here on another thread may claim it at any moment; it
    // cannot complete before we return, because completion runs on this thread.
    pending_ = 1;
    if (opts_.timeout.count() > 0 && !arm_timer()) {
      if (claim(errc::busy)) return false;  // no SQE for the timer: give up at once
    }
    if (opts_.stop.stop_possible()) stop_user_.emplace(opts_.stop, canceller{this});
    if (coro_stop.stop_possible()) stop_coro_.emplace(std::move(coro_stop), canceller{this});
    return true;
  }

  /// The same operation, but `co_await` returns `result<std::size_t>` instead of throwing.
  auto as_result() && noexcept {
    struct adapter : transfer_op {
      explicit adapter(transfer_op&& o) noexcept : transfer_op(std::move(o)) {}
      result<std::size_t> await_resume() noexcept { return this->finish(); }
    };
    return adapter{std::move(*this)};
  }

  /// Bytes moved: sent, or received into the view. Throws `gdr::error`.
  std::size_t await_resume() { return finish().value(); }

 protected:
  result<std::size_t> finish() noexcept {
    side_state& s = ch_->side[side_];
    if (kind_ == kind::send)
      record(s, ec_, bytes_, path_, true, &loopback::endpoint_stats::sends);
    else
      record(s, ec_, bytes_, path_, false, &loopback::endpoint_stats::recvs);
    if (ec_) return ec_;
    return bytes_;
  }

 private:
  friend void close_side(channel& c, int s) noexcept;

  struct canceller {
    transfer_op* self;
    void operator()() const noexcept {
      if (self->claim(errc::cancelled)) self->post_done();
    }
  };
  struct done_node : remote_work {
    transfer_op* self = nullptr;
  };
  struct timer_node : operation {
    transfer_op* self = nullptr;
  };

  // ---- starting (owner thread, in await_suspend). True: queued. ----

  bool start_send() noexcept {
    channel& c = *ch_;
    direction& d = c.dir[side_];
    std::unique_lock lock(c.mu);
    if (std::error_code ec = c.closed_error(side_)) {
      ec_ = ec;
      return false;
    }
    if (node* n = d.recvs.pop_front()) {
      auto* r = static_cast<transfer_op*>(n);
      r->queued_ = false;
      lock.unlock();
      deliver(*this, *r);
      r->post_done();
      return false;
    }
    if (d.waiting_sends == 0 && size_ <= c.opts.eager_limit && d.eager_bytes + size_ <= c.opts.eager_capacity) {
      auto* m = new (std::nothrow) eager_message;
      std::unique_ptr<std::byte[]> buf(size_ != 0 ? new (std::nothrow) std::byte[size_] : nullptr);
      if (m != nullptr && (size_ == 0 || buf != nullptr)) {
        copy_bytes(buf.get(), data_, size_);
        m->eager = true;
        m->data = std::move(buf);
        m->size = size_;
        d.eager_bytes += size_;
        d.messages.push_back(m);
        bytes_ = size_;
        path_ = transfer_path::host_eager;
        return false;
      }
      delete m;  // out of memory: fall back to waiting for the receive
    }
    d.messages.push_back(this);
    ++d.waiting_sends;
    queued_ = true;
    return true;
  }

  bool start_recv() noexcept {
    channel& c = *ch_;
    direction& d = c.dir[1 - side_];
    std::unique_lock lock(c.mu);
    if (c.side[side_].closed) {
      ec_ = errc::closed;
      return false;
    }
    if (node* n = d.messages.pop_front()) {
      if (n->eager) {
        std::unique_ptr<eager_message> m(static_cast<eager_message*>(n));
        d.eager_bytes -= m->size;
        lock.unlock();
        std::size_t len = std::min(m->size, size_);
        copy_bytes(data_, m->data.get(), len);
        set_received(len, m->size, transfer_path::host_eager);
        return false;
      }
      auto* s = static_cast<transfer_op*>(n);
      --d.waiting_sends;
      s->queued_ = false;
      lock.unlock();
      deliver(*s, *this);
      s->post_done();
      return false;
    }
    if (c.side[1 - side_].closed) {
      ec_ = errc::connection_lost;
      return false;
    }
    d.recvs.push_back(this);
    queued_ = true;
    return true;
  }

  /// Copies a matched send into a matched receive; both are claimed, so no
  /// lock is needed and both buffers are alive until their owners resume.
  static void deliver(transfer_op& s, transfer_op& r) noexcept {
    std::size_t len = std::min(s.size_, r.size_);
    copy_bytes(r.data_, s.data_, len);
    s.bytes_ = s.size_;
    s.path_ = transfer_path::host_zero_copy;
    r.set_received(len, s.size_, transfer_path::host_zero_copy);
  }

  void set_received(std::size_t len, std::size_t message_size, transfer_path p) noexcept {
    bytes_ = len;
    path_ = p;
    if (message_size > size_) ec_ = errc::truncated;
  }

  // ---- claiming and completing ----

  /// Takes the operation out of its queue with error `why`, if it is still
  /// queued. Any thread. True if this call claimed it.
  bool claim(std::error_code why) noexcept {
    channel& c = *ch_;
    std::lock_guard lock(c.mu);
    if (!queued_) return false;
    if (kind_ == kind::send) {
      c.dir[side_].messages.erase(this);
      --c.dir[side_].waiting_sends;
    } else {
      c.dir[1 - side_].recvs.erase(this);
    }
    queued_ = false;
    ec_ = why;
    return true;
  }

  /// Hands the (claimed) completion to the owner's scheduler. Any thread; the
  /// caller must not touch the operation afterwards.
  void post_done() noexcept {
    done_.self = this;
    done_.run = [](remote_work* w) noexcept { static_cast<done_node*>(w)->self->transfer_done(); };
    ch_->side[side_].sched->post(&done_);
  }

  /// The transfer part is over (owner thread).
  void transfer_done() noexcept {
    // Waits for a stop callback running on another thread to return; callbacks
    // only take the channel mutex, which is not held here.
    stop_user_.reset();
    stop_coro_.reset();
    if (timer_armed_ && !timer_fired_) {
      // Remove the timer; its CQE (-ECANCELED) still arrives and is awaited,
      // because the timer's state lives in this frame. Without a free SQE it
      // simply expires on its own, within the timeout.
      if (io_uring_sqe* sqe = ch_->side[side_].sched->get_sqe()) {
        io_uring_prep_timeout_remove(sqe, timer_.user_data(), 0);
        io_uring_sqe_set_data64(sqe, detail::ignore_tag);
      }
    }
    release();
  }

  bool arm_timer() noexcept {
    scheduler& s = *ch_->side[side_].sched;
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

  static void on_timer(operation* op, int res, std::uint32_t) noexcept {
    transfer_op* self = static_cast<timer_node*>(op)->self;
    self->timer_fired_ = true;
    // -ETIME: the timeout expired; -ECANCELED: transfer_done removed it.
    if (res == -ETIME && self->claim(errc::timed_out)) self->transfer_done();
    self->release();
  }

  void release() noexcept {
    if (--pending_ == 0) waiter_.resume();
  }

  std::shared_ptr<channel> ch_;
  std::byte* data_;
  std::size_t size_;
  op_options opts_;
  int side_;
  kind kind_;
  bool queued_ = false;  // guarded by the channel mutex
  bool timer_armed_ = false;
  bool timer_fired_ = false;
  int pending_ = 0;  // completions still to come: the transfer, the timer
  transfer_path path_ = transfer_path::none;
  std::size_t bytes_ = 0;
  std::error_code ec_{};
  std::coroutine_handle<> waiter_{};
  std::optional<std::stop_callback<canceller>> stop_user_{};
  std::optional<std::stop_callback<canceller>> stop_coro_{};
  done_node done_{};
  timer_node timer_{};
  __kernel_timespec ts_{};
};

/// Closes side `s` of `c` (see `loopback::endpoint::close`). Any thread.
inline void close_side(channel& c, int s) noexcept {
  node_list done;  // claimed operations, completed after unlocking
  {
    std::lock_guard lock(c.mu);
    if (c.side[s].closed) return;
    c.side[s].closed = true;
    auto fail_all = [&](node_list& l, std::error_code ec, bool keep_eager) {
      for (node* n = l.head; n != nullptr;) {
        node* next = n->next;
        if (!n->eager) {
          l.erase(n);
          static_cast<transfer_op*>(n)->queued_ = false;
          static_cast<transfer_op*>(n)->ec_ = ec;
          done.push_back(n);
        } else if (!keep_eager) {
          l.erase(n);
          delete static_cast<eager_message*>(n);
        }
        n = next;
      }
    };
    direction& out = c.dir[s];
    direction& in = c.dir[1 - s];
    fail_all(out.messages, errc::closed, true);  // the peer may still receive what was sent
    out.waiting_sends = 0;
    fail_all(out.recvs, errc::connection_lost, false);
    fail_all(in.messages, errc::connection_lost, false);  // nobody will receive them now
    in.waiting_sends = 0;
    in.eager_bytes = 0;
    fail_all(in.recvs, errc::closed, false);
  }
  while (node* n = done.pop_front()) static_cast<transfer_op*>(n)->post_done();
}

/// The diagnostic for a memory space loopback cannot move.
template <class S>
constexpr void check_space() noexcept {
  static_assert(transport_supports<loopback::transport, S>,
                "gdr::loopback::endpoint: this memory space is not supported by the loopback transport "
                "(Device memory is not supported yet). Copy the data into a gdr::Pinned or gdr::Host "
                "buffer first (co_await gdr::copy(dst, src, stream)) and send that.");
}

/// A one-sided access: resolved and copied when awaited; never suspends.
class rma_op {
 public:
  enum class kind : std::uint8_t { put, get };

  rma_op(std::shared_ptr<channel> ch, int side, kind k, std::byte* local, std::size_t bytes, std::uint64_t addr,
         std::size_t remote_bytes, std::uint64_t key, std::stop_token stop) noexcept
      : ch_(std::move(ch)), local_(local), bytes_(bytes), addr_(addr), remote_bytes_(remote_bytes), key_(key),
        stop_(std::move(stop)), side_(side), kind_(k) {}

  bool await_ready() const noexcept { return false; }

  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    ec_ = run(stop_token_of(h));
    return false;
  }

  /// Bytes moved. Throws `gdr::error`.
  std::size_t await_resume() { return finish().value(); }

  /// The same operation, but `co_await` returns `result<std::size_t>`.
  auto as_result() && noexcept {
    struct adapter : rma_op {
      explicit adapter(rma_op&& o) noexcept : rma_op(std::move(o)) {}
      result<std::size_t> await_resume() noexcept { return this->finish(); }
    };
    return adapter{std::move(*this)};
  }

 protected:
  result<std::size_t> finish() noexcept {
    side_state& s = ch_->side[side_];
    if (kind_ == kind::put)
      record(s, ec_, bytes_, transfer_path::host_zero_copy, true, &loopback::endpoint_stats::puts);
    else
      record(s, ec_, bytes_, transfer_path::host_zero_copy, false, &loopback::endpoint_stats::gets);
    if (ec_) return ec_;
    return bytes_;
  }

 private:
  std::error_code run(const std::stop_token& coro_stop) noexcept {
    if (coro_stop.stop_requested() || stop_.stop_requested()) return errc::cancelled;
    {
      std::lock_guard lock(ch_->mu);
      if (std::error_code ec = ch_->closed_error(side_)) return ec;
    }
    // The local view must fit in the remote one: a mismatch is the caller's bug.
    if (bytes_ > remote_bytes_) return errc::invalid_argument;
    // The owner's check: range, key, permission. Nothing is touched on failure.
    result<std::byte*> target = ch_->registry->resolve(addr_, bytes_, key_, kind_ == kind::put ? access::write : access::read);
    if (!target) return target.error();
    if (kind_ == kind::put)
      copy_bytes(*target, local_, bytes_);
    else
      copy_bytes(local_, *target, bytes_);
    return {};
  }

  std::shared_ptr<channel> ch_;
  std::byte* local_;
  std::size_t bytes_;
  std::uint64_t addr_;
  std::size_t remote_bytes_;
  std::uint64_t key_;
  std::stop_token stop_;
  int side_;
  kind kind_;
  std::error_code ec_{};
};

}  // namespace detail::lb

namespace loopback {

/// Awaitable of `send`/`recv`: `co_await` gives the byte count or throws
/// `gdr::error`; `co_await std::move(op).as_result()` gives `result<std::size_t>`.
using transfer_awaitable = gdr::detail::lb::transfer_op;
/// Awaitable of `put`/`get` (never suspends); same two forms.
using rma_awaitable = gdr::detail::lb::rma_op;

/// Awaitable of `close`: the close has happened; `co_await` gives 0.
struct close_awaitable {
  bool await_ready() const noexcept { return true; }
  void await_suspend(std::coroutine_handle<>) const noexcept {}
  std::size_t await_resume() const noexcept { return 0; }
  /// The same, as `result<std::size_t>` (for code written against the TCP endpoint).
  auto as_result() && noexcept {
    struct adapter : close_awaitable {
      result<std::size_t> await_resume() const noexcept { return std::size_t{0}; }
    };
    return adapter{};
  }
};

class endpoint;
std::pair<endpoint, endpoint> make_pair(scheduler& a, scheduler& b, memory_registry& registry, options opts);

/// One end of an in-process connection. Move-only; destroying it closes it.
///
/// Thread-safety: operations are started and awaited on the scheduler the end
/// was made for, and resume there; `close()`, `is_open()`, `error()` may be called from
/// any thread; `stats()` and `last_path()` only on the scheduler's thread.
class endpoint {
 public:
  /// An end that belongs to no pair (what a moved-from end is): `close`,
  /// `is_open` (false), `stats` and `last_path` work; starting an operation
  /// on it is a bug.
  endpoint() noexcept = default;
  endpoint(endpoint&&) noexcept = default;
  endpoint& operator=(endpoint&& o) noexcept {
    if (this != &o) {
      close();
      ch_ = std::move(o.ch_);
      side_ = o.side_;
    }
    return *this;
  }
  endpoint(const endpoint&) = delete;
  endpoint& operator=(const endpoint&) = delete;
  ~endpoint() { close(); }

  /// Sends `v` as one message. Completes with `v.size_bytes()` when the
  /// message has been copied out of `v` (into a posted receive, or into the
  /// pair's eager buffer): `v` may be reused when it resumes.
  ///
  /// Errors: `errc::closed`, `errc::connection_lost`, `errc::cancelled`,
  /// `errc::timed_out`, `errc::busy` (no SQE for the timeout).
  /// Spaces: Host and Pinned; any other space fails to compile.
  template <class T, class S>
  transfer_awaitable send(view<T, S> v, op_options opts = {}) const noexcept {
    gdr::detail::lb::check_space<S>();
    auto b = v.as_bytes();
    // The transfer never writes through a send's pointer; the op stores one
    // pointer type for both directions.
    return transfer_awaitable(ch_, side_, transfer_awaitable::kind::send, const_cast<std::byte*>(b.data()), b.size(),
                              std::move(opts));
  }

  /// Receives one message into `v`. Completes with the message's size.
  ///
  /// Errors: as `send`, plus `errc::truncated` when the message is larger
  /// than `v` (the first `v.size_bytes()` bytes are written, the rest dropped).
  template <class T, class S>
  transfer_awaitable recv(view<T, S> v, op_options opts = {}) const noexcept {
    gdr::detail::lb::check_space<S>();
    static_assert(!std::is_const_v<T>, "gdr::loopback::endpoint::recv: cannot receive into a view of const elements");
    auto b = v.as_bytes();
    return transfer_awaitable(ch_, side_, transfer_awaitable::kind::recv, b.data(), b.size(), std::move(opts));
  }

  /// Writes `local` into the peer's registered memory at `remote` (which must
  /// be at least as large). Completes at once with the byte count.
  ///
  /// Errors: `errc::remote_access` (outside a registration, wrong key,
  /// revoked, or not writable: nothing is written), `errc::invalid_argument`
  /// (`local` larger than `remote`), `errc::closed`,
  /// `errc::connection_lost`, `errc::cancelled`. `remote.peer()` is not
  /// checked: a loopback pair has one peer.
  template <class T, class S, class U, class RS>
  rma_awaitable put(view<T, S> local, remote_view<U, RS> remote, op_options opts = {}) const noexcept {
    gdr::detail::lb::check_space<S>();
    gdr::detail::lb::check_space<RS>();
    static_assert(std::is_same_v<std::remove_const_t<T>, U>,
                  "gdr::loopback::endpoint::put: the local and remote element types differ");
    auto b = local.as_bytes();
    return rma_awaitable(ch_, side_, rma_awaitable::kind::put, const_cast<std::byte*>(b.data()), b.size(),
                         remote.address(), remote.size_bytes(), remote.key(), std::move(opts.stop));
  }

  /// Reads the peer's registered memory at `remote` into `local` (`local`
  /// bytes; `remote` must be at least as large). Errors as `put`, with read
  /// permission checked instead.
  template <class T, class S, class U, class RS>
  rma_awaitable get(view<T, S> local, remote_view<U, RS> remote, op_options opts = {}) const noexcept {
    gdr::detail::lb::check_space<S>();
    gdr::detail::lb::check_space<RS>();
    static_assert(!std::is_const_v<T>, "gdr::loopback::endpoint::get: cannot read into a view of const elements");
    static_assert(std::is_same_v<T, U>, "gdr::loopback::endpoint::get: the local and remote element types differ");
    auto b = local.as_bytes();
    return rma_awaitable(ch_, side_, rma_awaitable::kind::get, b.data(), b.size(), remote.address(),
                         remote.size_bytes(), remote.key(), std::move(opts.stop));
  }

  /// Closes this end at once: its pending operations fail with
  /// `errc::closed`, the peer's with `errc::connection_lost` (each resumes on
  /// its own scheduler). Idempotent; any thread. Returns an awaitable that is
  /// already complete (giving 0), so `co_await ep.close()` reads as it does
  /// for the TCP endpoint, whose close flushes first; `ep.close();` alone
  /// closes too. `opts` is accepted for the same reason and not needed.
  close_awaitable close(op_options opts = {}) const noexcept {
    (void)opts;
    if (ch_) gdr::detail::lb::close_side(*ch_, side_);
    return {};
  }

  /// Neither end has closed.
  bool is_open() const noexcept { return !error(); }
  /// Why this end stopped working (`errc::closed`: closed here or belongs to
  /// no pair; `errc::connection_lost`: the peer closed), or no error while open.
  std::error_code error() const noexcept {
    if (!ch_) return errc::closed;
    std::lock_guard lock(ch_->mu);
    return ch_->closed_error(side_);
  }

  /// The path of the last successful operation of this end.
  transfer_path last_path() const noexcept { return ch_ ? ch_->side[side_].last_path : transfer_path::none; }
  /// Counters of this end.
  const endpoint_stats& stats() const noexcept {
    static const endpoint_stats none{};
    return ch_ ? ch_->side[side_].stats : none;
  }
  /// The scheduler this end's operations complete on.
  scheduler& get_scheduler() const noexcept { return *ch_->side[side_].sched; }

 private:
  friend std::pair<endpoint, endpoint> make_pair(scheduler&, scheduler&, memory_registry&, options);
  endpoint(std::shared_ptr<gdr::detail::lb::channel> ch, int side) noexcept : ch_(std::move(ch)), side_(side) {}

  std::shared_ptr<gdr::detail::lb::channel> ch_;
  int side_ = 0;
};

/// Makes a connected pair whose ends live on two schedulers (two threads, or
/// the same one). `registry` is consulted for `put`/`get` by both ends (one
/// process, one table). Throws `std::bad_alloc` only.
///
/// \code
///   gdr::scheduler sa, sb;   // run on two threads
///   auto [a, b] = gdr::loopback::make_pair(sa, sb);
/// \endcode
inline std::pair<endpoint, endpoint> make_pair(scheduler& a, scheduler& b, memory_registry& registry = default_registry(),
                                               options opts = {}) {
  auto ch = std::make_shared<gdr::detail::lb::channel>();
  ch->side[0].sched = &a;
  ch->side[1].sched = &b;
  ch->registry = &registry;
  ch->opts = opts;
  return {endpoint(ch, 0), endpoint(ch, 1)};
}

/// Makes a connected pair whose ends both live on scheduler `s`.
inline std::pair<endpoint, endpoint> make_pair(scheduler& s, memory_registry& registry = default_registry(),
                                               options opts = {}) {
  return make_pair(s, s, registry, opts);
}

}  // namespace loopback

}  // namespace gdr
