/// \file
/// `gdr::with_timeout`: a deadline for any task, on an io_uring timeout.
///
/// How it works: `with_timeout` submits one `IORING_OP_TIMEOUT` on the
/// calling thread's scheduler, then runs the task with a stop token of its own
/// (linked to the parent's). If the timeout's CQE arrives first, stop is
/// requested on that token, so every operation the task waits on is
/// cancelled; if the task finishes first, the timeout is cancelled
/// (`IORING_OP_ASYNC_CANCEL`). Either way both the task and the timeout's CQE
/// are awaited before `with_timeout` returns: nothing outlives it, and the
/// timespec the kernel holds lives in its frame. No userspace timer and no
/// thread is involved.
///
/// Outcomes:
///   * the task finished with a value: that value, even if the deadline
///     passed meanwhile (the work was done; discarding it would be worse);
///   * the deadline passed and the task then failed with a cancellation
///     (`errc::cancelled` or `ECANCELED`, see `is_cancellation`): throws
///     `gdr::error(errc::timed_out)`;
///   * the task failed otherwise: its exception, unchanged, even after the
///     deadline (a task may turn the stop into a more precise error);
///   * the parent's stop request: the task's own outcome (typically
///     `errc::cancelled`), never `timed_out`.
///
/// `try_with_timeout` is the form for hot loops: it returns `result<T>` and
/// turns `gdr::error`s into error codes; with a task that itself returns
/// `result<U>` (built on `.as_result()`), no exception is thrown at all.
///
/// \code
///   std::size_t n = co_await gdr::with_timeout(2s, recv_message(ep));
///   gdr::result<std::size_t> r = co_await gdr::try_with_timeout(2s, try_recv(ep));
///   if (r.error() == gdr::errc::timed_out) ...
/// \endcode
///
/// Completion context: the scheduler of the calling thread. A task that moved
/// to another scheduler is brought back (through `schedule()`) before the
/// timeout is cancelled, because only the owning thread may touch a ring.
/// Cost: the coroutine frame, one `std::stop_source` state, one timeout SQE
/// and, when the task wins, one cancel SQE; no extra frame for the task.
#pragma once

#include <liburing.h>

#include <cerrno>
#include <chrono>
#include <coroutine>
#include <exception>
#include <optional>
#include <stop_token>
#include <system_error>
#include <type_traits>
#include <utility>

#include <gdr/coro/cancel.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/error.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/timer.hpp>

namespace gdr {

namespace detail {

/// The deadline of one `with_timeout`: an `IORING_OP_TIMEOUT` that, when it
/// expires, requests stop on the work's source. Lives in the coroutine frame.
/// Loop thread only.
class deadline final : public operation {
 public:
  deadline(scheduler& s, std::chrono::nanoseconds d, const std::stop_token& parent) noexcept
      : sched_(&s), ts_(to_timespec(d)), work_(parent) {
    complete = &on_complete;
  }
  deadline(const deadline&) = delete;
  deadline& operator=(const deadline&) = delete;

  /// Submits the timeout; false if the SQ is full even after submitting.
  bool arm() noexcept {
    io_uring_sqe* sqe = sched_->get_sqe();
    if (sqe == nullptr) return false;
    io_uring_prep_timeout(sqe, &ts_, 0, 0);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(this));
    sched_->note_submitted();
    pending_ = true;
    return true;
  }

  /// The token the work runs under.
  std::stop_token token() const noexcept { return work_.get_token(); }
  bool expired() const noexcept { return expired_; }
  scheduler& sched() const noexcept { return *sched_; }

  /// Awaitable: cancels the timeout if still pending and waits for its CQE.
  /// Must be awaited on the scheduler's thread.
  auto settle() noexcept {
    struct awaiter {
      deadline* d;
      bool await_ready() const noexcept { return !d->pending_; }
      void await_suspend(std::coroutine_handle<> h) noexcept {
        d->waiter_ = h;
        d->sched_->cancel(d);
      }
      void await_resume() const noexcept {}
    };
    return awaiter{this};
  }

 private:
  static void on_complete(operation* op, int res, std::uint32_t) noexcept {
    auto* self = static_cast<deadline*>(op);
    self->pending_ = false;
    // -ETIME: the time passed. -ECANCELED: settle() cancelled it. A count
    // completion (res >= 0) cannot happen: the timeout waits for 0 CQEs.
    if (res == -ETIME) {
      self->expired_ = true;
      self->work_.request_stop();  // cancels what the task waits on, inline here
    }
    if (self->waiter_) std::exchange(self->waiter_, {}).resume();
  }

  scheduler* sched_;
  __kernel_timespec ts_;  // read by the kernel until the CQE
  linked_stop_source work_;
  std::coroutine_handle<> waiter_{};
  bool pending_ = false;
  bool expired_ = false;
};

/// True for `result<U>`: `try_with_timeout` passes its error through.
template <class T>
inline constexpr bool is_result_v = false;
template <class U>
inline constexpr bool is_result_v<result<U>> = true;

template <class T>
struct result_value {
  using type = T;
};
template <class U>
struct result_value<result<U>> {
  using type = U;
};

}  // namespace detail

/// Runs `t` with a deadline `d` from now. Returns its value, or throws
/// `gdr::error(errc::timed_out)` when the deadline passed first and the task
/// ended with a cancellation; see the file comment for every outcome.
///
/// Contract: called from inside a scheduler's loop (`this_scheduler()`);
/// `t` valid and not started. Throws `gdr::error(errc::busy)` if no SQE is
/// free for the timeout (the task is then not run). A negative or zero `d`
/// expires at once (the task still starts, and sees a stop request soon
/// after its first suspension).
template <class T>
task<T> with_timeout(std::chrono::nanoseconds d, task<T> t) {
  scheduler& s = this_scheduler();
  detail::deadline dl(s, d, co_await this_stop_token);
  if (!dl.arm()) throw error(errc::busy, "gdr::with_timeout: submission queue full");
  std::optional<detail::non_void_t<T>> value;
  std::exception_ptr failure;
  try {
    if constexpr (std::is_void_v<T>) {
      co_await detail::await_with_token(t, dl.token());
      value.emplace();
    } else {
      value.emplace(co_await detail::await_with_token(t, dl.token()));
    }
  } catch (...) {
    failure = std::current_exception();
  }
  if (scheduler::current() != &s) co_await s.schedule();
  co_await dl.settle();
  if (failure) {
    if (dl.expired() && is_cancellation(failure)) throw error(errc::timed_out, "gdr::with_timeout");
    std::rethrow_exception(failure);
  }
  if constexpr (!std::is_void_v<T>) co_return std::move(*value);
}

/// `with_timeout` returning `result<V>` instead of throwing: `errc::timed_out`
/// when the deadline passed first and the task ended with a cancellation, and
/// the code of any `std::system_error` (such as `gdr::error`) the task threw.
/// Other exceptions propagate. If `t` returns `result<U>` itself, `V` is `U`
/// and its error is passed through, with a cancellation after the deadline
/// reported as `errc::timed_out`: a task built on `.as_result()` then never
/// throws.
///
/// Contract: as `with_timeout`; a full SQ gives `errc::busy`.
template <class T>
task<result<typename detail::result_value<T>::type>> try_with_timeout(std::chrono::nanoseconds d, task<T> t) {
  using V = typename detail::result_value<T>::type;
  scheduler& s = this_scheduler();
  detail::deadline dl(s, d, co_await this_stop_token);
  if (!dl.arm()) co_return result<V>(errc::busy);
  std::optional<detail::non_void_t<T>> value;
  std::exception_ptr failure;
  try {
    if constexpr (std::is_void_v<T>) {
      co_await detail::await_with_token(t, dl.token());
      value.emplace();
    } else {
      value.emplace(co_await detail::await_with_token(t, dl.token()));
    }
  } catch (...) {
    failure = std::current_exception();
  }
  if (scheduler::current() != &s) co_await s.schedule();
  co_await dl.settle();
  std::error_code ec;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::system_error& e) {
      ec = e.code();
    }
  } else if constexpr (detail::is_result_v<T>) {
    ec = value->error();
  }
  if (ec) {
    if (dl.expired() && is_cancellation(ec)) co_return result<V>(errc::timed_out);
    co_return result<V>(ec);
  }
  if constexpr (std::is_void_v<V>) {
    co_return result<void>{};
  } else if constexpr (detail::is_result_v<T>) {
    co_return result<V>(std::move(**value));
  } else {
    co_return result<V>(std::move(*value));
  }
}

}  // namespace gdr
