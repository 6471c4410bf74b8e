/// \file
/// `gdr::sync_wait`: runs a scheduler's loop on the calling thread until a
/// task finishes, and returns its result (or rethrows its exception).
///
/// The bridge from ordinary code into coroutines: `main` calls it once.
/// Not for use inside a coroutine: from inside `s`'s own loop it throws
/// `gdr::error` (`errc::unsupported`), in every build; inside another
/// scheduler's loop it blocks that loop until it returns.
///
/// \code
///   gdr::scheduler sched;
///   int v = gdr::sync_wait(sched, compute());
/// \endcode
#pragma once

#include <coroutine>
#include <exception>
#include <optional>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/sched/scheduler.hpp>

namespace gdr {

namespace detail {

// A coroutine that awaits the user's task and records completion; it starts
// suspended and is resumed from the loop (posted), so that the user's task
// begins inside the scheduler's loop with `scheduler::current()` set.
class sync_wait_task {
 public:
  struct promise_type : owning_promise_base {
    bool done = false;
    sync_wait_task get_return_object() noexcept {
      return sync_wait_task{std::coroutine_handle<promise_type>::from_promise(*this)};
    }
    struct final_awaiter {
      bool await_ready() const noexcept { return false; }
      void await_suspend(std::coroutine_handle<promise_type> h) const noexcept {
        h.promise().done = true;
      }
      void await_resume() const noexcept {}
    };
    final_awaiter final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }  // the body catches
  };

  explicit sync_wait_task(std::coroutine_handle<promise_type> h) noexcept : h_(h) {}
  sync_wait_task(sync_wait_task&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  ~sync_wait_task() {
    if (h_) h_.destroy();
  }
  std::coroutine_handle<promise_type> handle() const noexcept { return h_; }

 private:
  std::coroutine_handle<promise_type> h_;
};

template <class T>
sync_wait_task sync_wait_body(task<T>& t, std::optional<std::conditional_t<std::is_void_v<T>, bool, T>>& out,
                              std::exception_ptr& err) {
  try {
    if constexpr (std::is_void_v<T>) {
      co_await t;
      out.emplace(true);
    } else {
      out.emplace(co_await t);
    }
  } catch (...) {
    err = std::current_exception();
  }
}

[[noreturn, gnu::cold, gnu::noinline]] inline void sync_wait_nested() {
  throw error(make_error_code(errc::unsupported),
              "gdr::sync_wait: called from inside the same scheduler's loop (a coroutine or a completion it runs), "
              "which would run inside itself: co_await the task instead");
}

}  // namespace detail

/// Runs `s` until `t` completes; returns its value or rethrows its exception.
/// `stop` becomes the task's stop token.
///
/// Throws `gdr::error` (`errc::unsupported`), without running `t`, when
/// called from inside `s`'s own loop, or on a thread that may not run `s`
/// (its ring is bound to another: `scheduler::claim_thread`).
template <class T>
T sync_wait(scheduler& s, task<T> t, std::stop_token stop = {}) {
  // Both refusals come before anything of this call is queued on `s`: the
  // node that starts the task lives in this frame.
  if (GDR_UNLIKELY(scheduler::current() == &s)) detail::sync_wait_nested();
  s.claim_thread();
  std::optional<std::conditional_t<std::is_void_v<T>, bool, T>> out;
  std::exception_ptr err;
  detail::sync_wait_task body = detail::sync_wait_body<T>(t, out, err);
  auto h = body.handle();
  h.promise().set_stop_token(std::move(stop));
  struct starter : remote_work {
    std::coroutine_handle<> h;
  } start;
  start.h = h;
  start.run = [](remote_work* w) noexcept { static_cast<starter*>(w)->h.resume(); };
  s.post(&start);
  // The loop is this thread's now, and its iterations throw nothing else:
  // `start` runs in the first. (An exception from here would leave `start`
  // queued, or the task suspended in frames about to be freed: none may
  // leave this call.)
  [&]() noexcept { s.run_until([&] { return h.promise().done; }); }();
  if (err) std::rethrow_exception(err);
  if constexpr (!std::is_void_v<T>) return std::move(*out);
}

}  // namespace gdr
