/// \file
/// `uring_awaitable`: the base of every awaitable that is one io_uring SQE and
/// its CQE (a NOP, a timeout, an accept, a connect...), with cancellation.
///
/// Cancellation: the awaitable observes the awaiting coroutine's stop token.
/// A stop request submits `IORING_OP_ASYNC_CANCEL` for the operation; the
/// coroutine still resumes only when the operation's own CQE arrives, so
/// buffers and registrations it names stay alive until the kernel is done with
/// them (DESIGN-NOTES: "a stop token stops the waiting"). A stop request from
/// another thread is posted to the scheduler's thread first, because only that
/// thread may touch the ring. A scheduler destroyed while the operation is
/// still in flight (it gave up on it: see "Teardown" in docs/SCHEDULER.md)
/// destroys the stop callback, so a stop requested later calls nothing.
///
/// Errors: `co_await op` throws `gdr::error`; `co_await std::move(op).as_result()`
/// (or `gdr::try_await(op)`) returns `gdr::result<T>` instead.
#pragma once

#include <atomic>
#include <cerrno>
#include <coroutine>
#include <optional>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/stop_token.hpp>

namespace gdr {

/// Maps an io_uring result (negative errno) to an error code: -ECANCELED is
/// `errc::cancelled`, anything else keeps its errno.
inline std::error_code uring_error(int res) noexcept {
  if (res >= 0) return {};
  if (res == -ECANCELED) return errc::cancelled;
  return errno_code(-res);
}

namespace detail {

/// CRTP base. `Derived` provides `void prepare(io_uring_sqe*) noexcept` and
/// `result<T> finish() noexcept` (reading `res_` and `flags_`).
template <class Derived, class T>
class uring_awaitable : public operation {
 public:
  explicit uring_awaitable(scheduler& s) noexcept : sched_(&s) { complete = &on_complete; }

  // Movable only before it is awaited (it is then just its parameters).
  uring_awaitable(uring_awaitable&& o) noexcept : operation(o), sched_(o.sched_) {}
  uring_awaitable& operator=(uring_awaitable&&) = delete;
  // The completion, or a dying scheduler, unlinked the stop hook already;
  // this keeps the scheduler's list whole if the frame goes another way.
  ~uring_awaitable() {
    if (GDR_UNLIKELY(stop_.has_value())) detail::unlink_stop_hook(cancel_);
  }

  bool await_ready() const noexcept { return false; }

  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    // The awaiting coroutine's own token object, not a copy: a copy of a live
    // token is two atomic reference-count updates per operation; the callback
    // below takes the one copy it needs.
    const std::stop_token& st = stop_token_ref(h);
    if (st.stop_requested()) {
      res_ = -ECANCELED;
      return false;
    }
    io_uring_sqe* sqe = sched_->get_sqe();
    if (sqe == nullptr) {
      res_ = -EBUSY;
      return false;
    }
    static_cast<Derived*>(this)->prepare(sqe);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(this));
    sched_->note_submitted();
    waiter_ = h;
    if (st.stop_possible()) {
      // The cross-thread cancellation state is built only here: most
      // operations never have a stoppable token, and skipping its stores is
      // measurable per NOP (benchmarks/RESULTS.md, (a)).
      ::new (static_cast<void*>(&cancel_)) cancel_state{};
      // All set before the callback is registered: from then on it may run
      // on another thread.
      cancel_.work.self = this;
      // So that a scheduler destroyed before this completes can destroy the
      // callback (a stop requested later would post to it).
      cancel_.drop = &drop_stop;
      sched_->link_stop_hook(cancel_);
      stop_.emplace(st, canceller{this});
    }
    return true;
  }

  T await_resume() { return static_cast<Derived*>(this)->finish().value(); }

  /// The same operation, but `co_await` returns `result<T>` and never throws.
  auto as_result() && noexcept {
    struct adapter : Derived {
      explicit adapter(Derived&& d) noexcept : Derived(std::move(d)) {}
      result<T> await_resume() noexcept { return this->finish(); }
    };
    return adapter{static_cast<Derived&&>(*this)};
  }

  scheduler& sched() const noexcept { return *sched_; }

 protected:
  int res_ = 0;
  std::uint32_t flags_ = 0;

 private:
  struct canceller {
    uring_awaitable* self;
    void operator()() const noexcept { self->request_cancel(); }
  };

  void request_cancel() noexcept {
    if (scheduler::current() == sched_) {
      sched_->cancel(this);
      return;
    }
    // Another thread: only the loop's thread may touch the ring.
    cancel_.posted.store(true, std::memory_order_release);
    cancel_.work.run = [](remote_work* w) noexcept {
      uring_awaitable* self = static_cast<cancel_node*>(w)->self;
      if (!self->cancel_.completed) self->sched_->cancel(self);
      self->cancel_.done.store(true, std::memory_order_release);
    };
    sched_->post(&cancel_.work);
  }

  static void on_complete(operation* op, int res, std::uint32_t flags) noexcept {
    auto* self = static_cast<uring_awaitable*>(op);
    self->res_ = res;
    self->flags_ = flags;
    // Only an operation that registered a stop callback has anything to
    // settle; keeping that out of line leaves this path a few stores and a
    // jump (benchmarks/RESULTS.md, (a)).
    if (GDR_UNLIKELY(self->stop_.has_value())) self->settle_stop();
    self->waiter_.resume();
  }

  [[gnu::noinline]] void settle_stop() noexcept {
    cancel_.completed = true;
    // Destroying the callback waits for one running on another thread.
    stop_.reset();
    detail::unlink_stop_hook(cancel_);
    // A cancel request posted from another thread must run before this frame
    // can go away: its node lives here. We are on the loop's thread, so run the
    // posted work now; the node sees `cancel_.completed` and does nothing. (Without a
    // registered callback no cancel can have been posted.)
    while (cancel_.posted.load(std::memory_order_acquire) && !cancel_.done.load(std::memory_order_acquire)) {
      sched_->run_posted();
    }
  }


  // The scheduler is being destroyed and this will never complete: no stop
  // request may reach it any more (see `detail::stop_hook`).
  static void drop_stop(detail::stop_hook* h) noexcept { static_cast<cancel_state*>(h)->work.self->stop_.reset(); }

  scheduler* sched_;
  std::coroutine_handle<> waiter_{};
  std::optional<std::stop_callback<canceller>> stop_{};
  struct cancel_node : remote_work {
    uring_awaitable* self = nullptr;
  };
  // What a registered stop callback needs: the hook that lets a dying
  // scheduler destroy it, and what a stop request from another thread posts.
  // Trivially destructible; constructed in await_suspend only when a stop
  // callback is registered, and read only when one was.
  struct cancel_state : detail::stop_hook {
    cancel_node work{};
    std::atomic<bool> posted{false};
    std::atomic<bool> done{false};
    bool completed = false;
  };
  static_assert(std::is_trivially_destructible_v<cancel_state>);
  union {
    cancel_state cancel_;
  };
};

}  // namespace detail

/// Awaits `op` and returns `result<T>` instead of throwing.
template <class Awaitable>
auto try_await(Awaitable&& op) noexcept {
  return std::forward<Awaitable>(op).as_result();
}

}  // namespace gdr
