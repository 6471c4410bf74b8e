/// \file
/// `gdr::task_scope`: start tasks now, join them later; nothing outlives the
/// scope.
///
/// `spawn(task)` starts a task at once, on the calling thread, and returns
/// when it first suspends. `co_await scope.join()` waits until every task
/// spawned so far (and any they spawn) has finished, then rethrows the first
/// exception one of them threw (the others are dropped). Each spawned task
/// observes the scope's stop token; `request_stop()` cancels them all.
/// Destroying a scope that still has running tasks is a bug (asserted): join
/// it first.
///
/// \code
///   gdr::task_scope scope;
///   for (auto& ep : peers) scope.spawn(serve(ep));
///   co_await scope.join();
/// \endcode
///
/// Thread-safety: spawn and join on one thread (the scheduler's); tasks may
/// finish on any thread (the count is atomic).
#pragma once

#include <atomic>
#include <cassert>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <stop_token>
#include <utility>

#include <gdr/coro/task.hpp>

namespace gdr {

class task_scope {
 public:
  task_scope() = default;
  task_scope(const task_scope&) = delete;
  task_scope& operator=(const task_scope&) = delete;
  ~task_scope() { assert(active_.load() == 0 && "gdr::task_scope destroyed with tasks running: join it first"); }

  /// Starts `t` now; it runs until its first suspension before spawn returns.
  void spawn(task<void> t) {
    active_.fetch_add(1, std::memory_order_relaxed);
    auto h = run(std::move(t)).release();
    h.promise().scope = this;
    h.promise().set_stop_token(stop_.get_token());
    h.resume();
  }

  /// Waits for every spawned task; rethrows the first exception.
  auto join() noexcept {
    struct awaiter {
      task_scope* s;
      bool await_ready() const noexcept { return s->active_.load(std::memory_order_acquire) == 0; }
      bool await_suspend(std::coroutine_handle<> h) noexcept {
        s->joiner_ = h;
        // One extra reference while installing the joiner: a task finishing in
        // between sees it only after this release.
        s->active_.fetch_add(1, std::memory_order_relaxed);
        return !s->release();
      }
      void await_resume() {
        s->joiner_ = {};
        if (s->error_) std::rethrow_exception(std::exchange(s->error_, nullptr));
      }
    };
    return awaiter{this};
  }

  /// Cancels every task of the scope (through their stop token).
  void request_stop() noexcept { stop_.request_stop(); }
  std::stop_token stop_token() const noexcept { return stop_.get_token(); }
  /// Tasks still running.
  std::size_t active() const noexcept { return active_.load(std::memory_order_acquire); }

 private:
  struct spawned {
    struct promise_type : detail::promise_base {
      task_scope* scope = nullptr;
      spawned get_return_object() noexcept {
        return spawned{std::coroutine_handle<promise_type>::from_promise(*this)};
      }
      struct final_awaiter {
        bool await_ready() const noexcept { return false; }
        std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) const noexcept {
          task_scope* s = h.promise().scope;
          h.destroy();  // the frame is done; free it before waking the joiner
          if (s->release() && s->joiner_) return s->joiner_;
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

  void record(std::exception_ptr e) noexcept {
    if (!has_error_.exchange(true, std::memory_order_acq_rel)) error_ = std::move(e);
  }
  bool release() noexcept { return active_.fetch_sub(1, std::memory_order_acq_rel) == 1; }

  std::atomic<std::size_t> active_{0};
  std::coroutine_handle<> joiner_{};
  std::exception_ptr error_{};
  std::atomic<bool> has_error_{false};
  std::stop_source stop_{};
};

}  // namespace gdr
