// Helpers for the scheduler tests: a watchdog, a fire-and-forget coroutine
// started by hand, and a remote_work node that counts its runs.
#pragma once

#include <atomic>
#include <coroutine>
#include <exception>
#include <thread>

#include <gdr/coro/task.hpp>
#include <gdr/sched/operation.hpp>

#include "tests/support/watchdog.hpp"

namespace sched_test {

using watchdog = gdr_test_support::watchdog;

// A coroutine that starts at once and frees itself at the end: for starting
// operations from inside a loop without any gdr/coro combinator.
struct detached {
  struct promise_type {
    detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

// Runs `t` to completion, then counts it in `done`.
inline detached run_detached(gdr::task<void> t, int& done) {
  co_await std::move(t);
  ++done;
}

// A remote_work node that counts its runs and remembers the thread.
struct counter_node : gdr::remote_work {
  std::atomic<int> runs{0};
  std::atomic<std::thread::id> where{};
  counter_node() noexcept {
    run = [](gdr::remote_work* w) noexcept {
      auto* self = static_cast<counter_node*>(w);
      self->where = std::this_thread::get_id();
      self->runs.fetch_add(1);
    };
  }
};

}  // namespace sched_test
