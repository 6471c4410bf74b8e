/// \file
/// `gdr::sync_wait`: runs a scheduler's loop on the calling thread until a
/// task finishes, and returns its result (or rethrows its exception).
///
/// The bridge from ordinary code into coroutines: `main` calls it once.
/// Not for use inside a coroutine (it would block that scheduler's loop).
///
/// \code
///   gdr::scheduler sched;
///   int v = gdr::sync_wait(sched, compute());
/// \endcode
#pragma once

#include <cassert>
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

}  // namespace detail

/// Runs `s` until `t` completes; returns its value or rethrows its exception.
/// `stop` becomes the task's stop token.
template <class T>
T sync_wait(scheduler& s, task<T> t, std::stop_token stop = {}) {
  assert(scheduler::current() != &s && "sync_wait called from inside the same scheduler's loop");
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
  s.run_until([&] { return h.promise().done; });
  if (err) std::rethrow_exception(err);
  if constexpr (!std::is_void_v<T>) return std::move(*out);
}

}  // namespace gdr
