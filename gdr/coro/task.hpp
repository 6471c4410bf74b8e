/// \file
/// `gdr::task<T>`: a lazy coroutine that produces a `T` (or throws).
///
/// A task does not start until it is awaited; awaiting it runs it without
/// growing the stack for long chains of synchronous `co_await`s, and an
/// exception thrown inside rethrows at the `co_await`. A task carries a
/// `std::stop_token`: an awaited task inherits its parent's token, so
/// cancelling a top-level task cancels every operation it is waiting on.
///
/// Thread-safety: a task is owned by one thread at a time; it resumes on
/// whichever thread completes what it awaits (for gdr operations: the thread
/// running the scheduler that owns the operation).
///
/// \code
///   gdr::task<int> answer() { co_return 42; }
///   gdr::task<int> twice() { co_return 2 * co_await answer(); }
///   int v = gdr::sync_wait(sched, twice());   // 84
/// \endcode
#pragma once

#include <atomic>
#include <coroutine>
#include <exception>
#include <stop_token>
#include <type_traits>
#include <utility>
#include <variant>

#include <gdr/config.hpp>

namespace gdr {

template <class T = void>
class task;

namespace detail {

/// What every gdr promise offers its awaitables: the continuation to resume
/// when it finishes, and the stop token that cancels what it waits on.
class promise_base {
 public:
  std::suspend_always initial_suspend() noexcept { return {}; }

  struct final_awaiter {
    bool await_ready() const noexcept { return false; }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) noexcept {
      promise_base& p = h.promise();
      // If the awaiter is still inside `start` (the child ran to completion
      // without suspending), return to it: it continues the parent without
      // nesting. Otherwise the parent is suspended: transfer to it.
      if (p.state_.exchange(done, std::memory_order_acq_rel) == running_inline) return std::noop_coroutine();
      std::coroutine_handle<> next = p.continuation_;
      return next ? next : std::noop_coroutine();
    }
    void await_resume() const noexcept {}
  };
  final_awaiter final_suspend() noexcept { return {}; }

  /// The token every operation awaited by this coroutine observes.
  const std::stop_token& stop_token() const noexcept { return stop_; }
  void set_stop_token(std::stop_token st) noexcept { stop_ = std::move(st); }
  /// Runs this coroutine (`self`) on behalf of `parent` until it first
  /// suspends or finishes. Returns true if the parent must suspend (the child
  /// will resume it), false if the child already finished (the parent goes on
  /// at once).
  ///
  /// Why not plain symmetric transfer (return the child's handle from
  /// await_suspend): gcc emits the tail call that keeps symmetric transfer
  /// from growing the stack only at -O2 and above, so a long loop of
  /// synchronously completing `co_await`s overflows the stack in -O0/-O1
  /// builds (measured: 1e6 awaits crash at -O0 and -O1, pass at -O2; clang is
  /// fine at -O0). Resuming the child here and handing the result back through
  /// `state_` keeps the stack flat for synchronous completions; asynchronous
  /// ones resume from the event loop, whose stack is shallow anyway. (This is
  /// the scheme cppcoro used before symmetric transfer.)
  bool start(std::coroutine_handle<> self, std::coroutine_handle<> parent) noexcept {
    continuation_ = parent;
    state_.store(running_inline, std::memory_order_relaxed);
    self.resume();
    int expected = running_inline;
    return state_.compare_exchange_strong(expected, parent_suspended, std::memory_order_acq_rel);
  }

 private:
  static constexpr int running_inline = 0;   // the parent is still inside start()
  static constexpr int parent_suspended = 1; // start() returned: the child resumes the parent
  static constexpr int done = 2;             // the child reached its final suspend
  std::coroutine_handle<> continuation_{};
  std::stop_token stop_{};
  // Atomic: the child may finish on another thread (after moving to another
  // scheduler) while start() is still returning.
  std::atomic<int> state_{running_inline};
};

/// A promise type that can hand a stop token to the operations it awaits.
template <class P>
concept stoppable_promise = requires(const P& p) {
  { p.stop_token() } -> std::convertible_to<const std::stop_token&>;
};

/// The stop token of the coroutine behind `h`, or an empty one.
template <class P>
std::stop_token stop_token_of(std::coroutine_handle<P> h) noexcept {
  if constexpr (stoppable_promise<P>) {
    return h.promise().stop_token();
  } else {
    return {};
  }
}

template <class T>
class task_promise final : public promise_base {
 public:
  task<T> get_return_object() noexcept;

  template <class U>
    requires std::is_convertible_v<U&&, T>
  void return_value(U&& v) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
    result_.template emplace<1>(std::forward<U>(v));
  }
  void unhandled_exception() noexcept { result_.template emplace<2>(std::current_exception()); }

  T take() {
    if (result_.index() == 2) std::rethrow_exception(std::get<2>(result_));
    return std::move(std::get<1>(result_));
  }

 private:
  std::variant<std::monostate, T, std::exception_ptr> result_;
};

template <>
class task_promise<void> final : public promise_base {
 public:
  task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void unhandled_exception() noexcept { error_ = std::current_exception(); }
  void take() {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::exception_ptr error_;
};

}  // namespace detail

/// A lazy, move-only coroutine returning `T`. See the file comment.
template <class T>
class [[nodiscard]] task {
 public:
  using promise_type = detail::task_promise<T>;
  using handle_type = std::coroutine_handle<promise_type>;
  using value_type = T;

  task() noexcept = default;
  explicit task(handle_type h) noexcept : h_(h) {}
  task(task&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  task& operator=(task&& o) noexcept {
    if (this != &o) {
      destroy();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  task(const task&) = delete;
  task& operator=(const task&) = delete;
  ~task() { destroy(); }

  /// True when the task holds a coroutine (it was not moved from).
  bool valid() const noexcept { return static_cast<bool>(h_); }
  /// True once the coroutine has run to completion.
  bool done() const noexcept { return !h_ || h_.done(); }

  struct awaiter {
    handle_type h;
    bool await_ready() const noexcept { return !h || h.done(); }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> parent) noexcept {
      h.promise().set_stop_token(detail::stop_token_of(parent));
      return h.promise().start(h, parent);
    }
    T await_resume() { return h.promise().take(); }
  };

  /// Starts the task (on first await) and resumes the awaiter with its result.
  awaiter operator co_await() && noexcept { return awaiter{h_}; }
  awaiter operator co_await() & noexcept { return awaiter{h_}; }

  /// For adapters (sync_wait, when_all, scopes): the coroutine itself.
  handle_type handle() const noexcept { return h_; }
  handle_type release() noexcept { return std::exchange(h_, {}); }

 private:
  void destroy() noexcept {
    if (h_) h_.destroy();
  }
  handle_type h_{};
};

namespace detail {
template <class T>
task<T> task_promise<T>::get_return_object() noexcept {
  return task<T>{std::coroutine_handle<task_promise<T>>::from_promise(*this)};
}
inline task<void> task_promise<void>::get_return_object() noexcept {
  return task<void>{std::coroutine_handle<task_promise<void>>::from_promise(*this)};
}
}  // namespace detail

/// Awaitable that yields the current coroutine's stop token:
/// `std::stop_token st = co_await gdr::this_stop_token;`
struct this_stop_token_t {
  struct awaiter {
    std::stop_token st;
    bool await_ready() const noexcept { return false; }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> h) noexcept {
      st = detail::stop_token_of(h);
      return false;  // never actually suspends
    }
    std::stop_token await_resume() noexcept { return std::move(st); }
  };
  awaiter operator co_await() const noexcept { return {}; }
};
inline constexpr this_stop_token_t this_stop_token{};

/// Runs `t` with `st` as its stop token instead of the parent's:
/// `co_await gdr::with_stop_token(src.get_token(), work());`
template <class T>
task<T> with_stop_token(std::stop_token st, task<T> t) {
  t.handle().promise().set_stop_token(std::move(st));
  // Await through the handle so the token set above is not overwritten by the
  // parent's token in task::awaiter::await_suspend.
  struct direct {
    typename task<T>::handle_type h;
    bool await_ready() const noexcept { return h.done(); }
    bool await_suspend(std::coroutine_handle<> parent) noexcept { return h.promise().start(h, parent); }
    T await_resume() { return h.promise().take(); }
  };
  co_return co_await direct{t.handle()};
}

}  // namespace gdr
