// Helpers for the coroutine tests: a watchdog that ends a hung test case, a
// scheduler running on a thread of its own, and small timing helpers.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include <gdr/sched/scheduler.hpp>

#include "tests/support/watchdog.hpp"

namespace coro_test {

using watchdog = gdr_test_support::watchdog;

// A scheduler whose loop runs on its own thread until destruction, for tests
// where a task moves to another thread and back.
class loop_thread {
 public:
  loop_thread() : thread_([this] { sched_.run_until([this] { return stop_.load(); }); }) {}
  ~loop_thread() {
    stop_ = true;
    sched_.wake();
    thread_.join();
  }
  loop_thread(const loop_thread&) = delete;
  loop_thread& operator=(const loop_thread&) = delete;
  gdr::scheduler& sched() noexcept { return sched_; }
  std::thread::id id() const noexcept { return thread_.get_id(); }

 private:
  gdr::scheduler sched_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace coro_test
