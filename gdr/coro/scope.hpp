/// \file
/// `gdr::task_scope`: start tasks now, join them later; nothing outlives the
/// scope.
///
/// `spawn(task)` starts a task at once, on the calling thread, and returns
/// when it first suspends (or finishes): fire-and-forget, but within the
/// scope. `co_await scope.join()` waits until every task spawned so far, and
/// any they spawn meanwhile, has finished. Each spawned task observes the
/// scope's stop token (not the spawner's: a spawned task belongs to the scope,
/// not to whoever happened to start it); `request_stop()` cancels them all.
///
/// Exceptions: a failing task does not disturb its siblings. The scope keeps
/// the first exception (in completion order) and `join()` rethrows it after
/// every task has finished; later ones are dropped. The scope can be used
/// again after `join()` returns or throws (its stop state stays as it was).
///
/// Destroying a scope that still has tasks, or while a `join()` waits, is a
/// bug: their frames would point at a dead scope. It ends the program, in
/// every build, as destroying a joinable `std::thread` does: one line through
/// gdr's log sink says why, then `std::terminate()`. Join it first.
///
/// \code
///   gdr::task_scope scope;
///   for (auto& ep : peers) scope.spawn(serve(ep));
///   co_await scope.join();
/// \endcode
///
/// Thread-safety: `spawn` and `join` on one thread, normally the scheduler's
/// (spawned tasks run their first steps inside `spawn`, so they need
/// `scheduler::current()` like any coroutine that awaits I/O). Tasks may
/// finish on any thread; `request_stop()`, `stop_token()` and `active()` are
/// safe from any thread. `join()` completes on the thread where the last task
/// finished.
#pragma once

#include <atomic>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <stop_token>
#include <utility>

#include <gdr/config.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/log.hpp>

namespace gdr {

/// A set of eagerly started tasks that are joined together. See the file comment.
class task_scope {
 public:
  task_scope() = default;
  task_scope(const task_scope&) = delete;
  task_scope& operator=(const task_scope&) = delete;
  ~task_scope() {
    if (GDR_UNLIKELY(count_.load(std::memory_order_acquire) != 1 || joiner_)) destroyed_early();
  }

  /// Starts `t` now, under the scope's stop token; it runs until its first
  /// suspension before `spawn` returns. An exception it throws is kept for
  /// `join()`. Allocates one frame (the wrapper that tracks the task); if
  /// that throws (`std::bad_alloc`), `t` is destroyed without having run and
  /// the scope is as it was.
  void spawn(task<void> t) {
    // The frame first: counted before it, a failed allocation would leave a
    // task that never runs for join() to wait for.
    auto h = run(std::move(t)).release();
    count_.fetch_add(1, std::memory_order_relaxed);
    h.promise().scope = this;
    h.promise().set_stop_token(stop_.get_token());
    h.resume();
  }

  /// Awaitable that completes when every spawned task has finished, then
  /// rethrows the first exception one of them threw. Only one `join()` may
  /// wait at a time.
  auto join() noexcept {
    struct awaiter {
      task_scope* s;
      bool await_ready() const noexcept { return s->count_.load(std::memory_order_acquire) == 1; }
      bool await_suspend(std::coroutine_handle<> h) noexcept {
        // Install the joiner, then drop the scope's own reference: whoever
        // brings the count to zero (a finishing task, or this release if all
        // finished meanwhile) is ordered after the install by the acq_rel
        // decrement, so it reads the joiner safely.
        s->joiner_ = h;
        return !s->release();
      }
      void await_resume() {
        if (s->joiner_) {
          // The count reached zero: restore the scope's own reference for reuse.
          s->joiner_ = {};
          s->count_.store(1, std::memory_order_relaxed);
        }
        if (s->has_error_.load(std::memory_order_acquire)) {
          std::exception_ptr e = std::exchange(s->error_, nullptr);
          s->has_error_.store(false, std::memory_order_relaxed);
          std::rethrow_exception(e);
        }
      }
    };
    return awaiter{this};
  }

  /// Requests stop on the scope's token: every task, running or spawned
  /// later, sees it. Safe from any thread; the tasks' stop callbacks run on
  /// the calling thread (gdr's operations post their cancellation to their
  /// scheduler's thread).
  void request_stop() noexcept { stop_.request_stop(); }
  /// The token every spawned task observes.
  std::stop_token stop_token() const noexcept { return stop_.get_token(); }
  /// Tasks spawned and not yet finished (a snapshot when read from another thread).
  std::size_t active() const noexcept {
    std::size_t c = count_.load(std::memory_order_acquire);
    return c == 0 ? 0 : c - 1;  // 0 only between the last finish and join's resume
  }

 private:
  struct spawned {
    struct promise_type : detail::owning_promise_base {
      task_scope* scope = nullptr;
      spawned get_return_object() noexcept {
        return spawned{std::coroutine_handle<promise_type>::from_promise(*this)};
      }
      struct final_awaiter {
        bool await_ready() const noexcept { return false; }
        std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) const noexcept {
          task_scope* s = h.promise().scope;
          h.destroy();  // the frame is done: free it before waking the joiner
          if (s->release()) return s->joiner_;
          return std::noop_coroutine();
        }
        void await_resume() const noexcept {}
      };
      final_awaiter final_suspend() noexcept { return {}; }
      void return_void() noexcept {}
      void unhandled_exception() noexcept { scope->record(std::current_exception()); }
    };
    std::coroutine_handle<promise_type> h;
    std::coroutine_handle<promise_type> release() noexcept { return std::exchange(h, {}); }
  };

  static spawned run(task<void> t) { co_await std::move(t); }

  [[noreturn, gnu::cold, gnu::noinline]] void destroyed_early() const noexcept {
    // While a join() waits, the scope's own reference is not in the count.
    const std::size_t c = count_.load(std::memory_order_acquire);
    const std::size_t running = joiner_ ? c : c - 1;
    gdr::detail::log("task_scope",
                     "destroyed with %zu task(s) running%s, whose frames point at it: co_await join() first. "
                     "Ending the program (std::terminate), as a joinable std::thread's destructor does",
                     running, joiner_ ? " and a join() waiting" : "");
    std::terminate();
  }

  void record(std::exception_ptr e) noexcept {
    // The write is published to the joiner by the acq_rel decrement in release().
    if (!has_error_.exchange(true, std::memory_order_acq_rel)) error_ = std::move(e);
  }
  bool release() noexcept { return count_.fetch_sub(1, std::memory_order_acq_rel) == 1; }

  // One reference per running task, plus the scope's own, dropped by join():
  // the count reaches zero only while a joiner is installed.
  std::atomic<std::size_t> count_{1};
  std::coroutine_handle<> joiner_{};
  std::exception_ptr error_{};
  std::atomic<bool> has_error_{false};
  std::stop_source stop_{};
};

}  // namespace gdr
