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

#include <coroutine>
#include <exception>
#include <memory>
#include <new>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <gdr/config.hpp>
#include <gdr/sched/stop_token.hpp>

namespace gdr {

template <class T = void>
class task;

namespace detail {

class promise_base;

// The promise an awaiter on this thread is starting inline right now (see
// promise_base::start). That promise's final suspension sets it to null to
// say "finished before start() regained control". A thread-local, not a
// promise member: once the child's resume() returns, its frame may already be
// gone (it moved to another thread, finished there and its parent destroyed
// it), so start() reads only this. Constant-initialised: no TLS wrapper call.
inline constinit thread_local promise_base* starting_inline = nullptr;

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
      // Still inside the start() that resumed us, on this thread: tell it we
      // are done and return to it; it continues the parent without nesting.
      if (starting_inline == &p) {
        starting_inline = nullptr;
        return std::noop_coroutine();
      }
      // Otherwise the parent is suspended: transfer to it.
      std::coroutine_handle<> next = p.continuation_;
      return next ? next : std::noop_coroutine();
    }
    void await_resume() const noexcept {}
  };
  final_awaiter final_suspend() noexcept { return {}; }

  /// The token every operation awaited by this coroutine observes.
  const std::stop_token& stop_token() const noexcept { return *stop_; }
  /// Makes this coroutine observe the token object `st` itself, not a copy:
  /// copying a live token costs two atomic reference-count updates per await,
  /// and a token member in every promise costs its construction and
  /// destruction per task (benchmarks/RESULTS.md, (b)). `st` must outlive
  /// this coroutine's run: an awaiting parent's token does (the parent stays
  /// suspended until the child finishes), so does a token held by the
  /// awaiter or by the awaiting frame. Before the coroutine starts only.
  void inherit_stop_token(const std::stop_token& st) noexcept { stop_ = &st; }
  /// Runs this coroutine (`self`) on behalf of `parent` until it first
  /// suspends or finishes. Returns true if the parent must suspend (the child
  /// will resume it), false if the child already finished (the parent goes on
  /// at once).
  ///
  /// Why not plain symmetric transfer (return the child's handle from
  /// await_suspend): gcc emits the tail call that keeps symmetric transfer
  /// from growing the stack only with -foptimize-sibling-calls (-O2) and never
  /// under ASan or TSan, so a long loop of synchronously completing
  /// `co_await`s overflows the stack there (measured: 1e6 awaits crash at -O0,
  /// -O1, and -O2 with ASan or TSan; clang is fine). Resuming the child here
  /// and learning through a thread-local whether it finished keeps the stack
  /// flat for synchronous completions; asynchronous ones resume from the event
  /// loop, whose stack is shallow anyway.
  ///
  /// Why a thread-local and not an atomic in the promise (cppcoro's scheme
  /// before symmetric transfer): the atomic costs two locked instructions per
  /// await, most of the price of a synchronous await (benchmarks/RESULTS.md,
  /// (b)). The race the atomic settles, a child finishing on another thread
  /// while start() is still returning, needs none: the other thread's
  /// `starting_inline` is not this promise, so it resumes the parent itself,
  /// and this thread then finds its own still set and suspends the parent
  /// without touching either frame again.
  bool start(std::coroutine_handle<> self, std::coroutine_handle<> parent) noexcept {
    continuation_ = parent;
    promise_base* outer = starting_inline;
    starting_inline = this;
    self.resume();
    // From here on `this` may be gone: thread-locals and locals only. Nested
    // starts inside the resume restored the value they found, so it is still
    // `this` unless our child reached its final suspension.
    bool suspended = starting_inline != nullptr;
    starting_inline = outer;
    return suspended;
  }

 private:
  std::coroutine_handle<> continuation_{};
  const std::stop_token* stop_ = &no_stop_token;
};

/// A promise base that owns its token: for coroutines that start a tree of
/// tasks (sync_wait's, when_all's and task_scope's wrappers), whose token has
/// no awaiting frame to live in.
class owning_promise_base : public promise_base {
 public:
  owning_promise_base() noexcept = default;
  owning_promise_base(const owning_promise_base&) = delete;  // stop_ points into *this
  owning_promise_base& operator=(const owning_promise_base&) = delete;
  /// Gives this coroutine a token of its own. Before it starts only.
  void set_stop_token(std::stop_token st) noexcept {
    own_stop_ = std::move(st);
    inherit_stop_token(own_stop_);
  }

 private:
  std::stop_token own_stop_{};
};

template <class T>
class task_promise final : public promise_base {
 public:
  task_promise() noexcept {}
  ~task_promise() {
    if constexpr (!std::is_trivially_destructible_v<T>) {
      if (state_ == state::value) value_.~T();
    }
    if (state_ == state::error) error_.~exception_ptr();
  }

  task<T> get_return_object() noexcept;

  template <class U>
    requires std::is_convertible_v<U&&, T>
  void return_value(U&& v) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
    ::new (static_cast<void*>(std::addressof(value_))) T(std::forward<U>(v));
    state_ = state::value;
  }
  void unhandled_exception() noexcept {
    ::new (static_cast<void*>(std::addressof(error_))) std::exception_ptr(std::current_exception());
    state_ = state::error;
  }

  T take() {
    if (state_ == state::error) std::rethrow_exception(error_);
    return std::move(value_);
  }

 private:
  // A hand-rolled variant: std::variant's checked access and index switch
  // showed up in the synchronous-await benchmark.
  enum class state : unsigned char { empty, value, error };
  union {
    T value_;
    std::exception_ptr error_;
  };
  state state_ = state::empty;
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
      h.promise().inherit_stop_token(detail::stop_token_ref(parent));
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
  // `st` lives in this frame, which outlives `t`'s run.
  t.handle().promise().inherit_stop_token(st);
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
