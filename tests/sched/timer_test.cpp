// gdr/sched/timer.hpp: sleep_for, sleep_until and nop on io_uring, their
// cancellation and their non-throwing forms.
#include <doctest/doctest.h>

#include <chrono>
#include <stop_token>
#include <thread>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/sched/sched_test_support.hpp"

using namespace std::chrono_literals;

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
gdr::task<gdr::result<void>> try_sleep(std::chrono::nanoseconds d) { co_return co_await gdr::sleep_for(d).as_result(); }
gdr::task<void> sleep_and_log(std::chrono::milliseconds d, int id, std::vector<int>& log) {
  co_await gdr::sleep_for(d);
  log.push_back(id);
}

}  // namespace

TEST_CASE("sleep_for waits at least its duration") {
  gdr::scheduler s;
  auto t0 = std::chrono::steady_clock::now();
  gdr::sync_wait(s, []() -> gdr::task<> { co_await gdr::sleep_for(10ms); }());
  CHECK(ms_since(t0) >= 10.0);
  CHECK(ms_since(t0) < 1000.0);
  CHECK(s.inflight() == 0);
}

TEST_CASE("sleep_for on an explicit scheduler") {
  gdr::scheduler s;
  gdr::sync_wait(s, [&]() -> gdr::task<> { co_await gdr::sleep_for(s, 1ms); }());
  CHECK(s.stats().completions == 1);
}

TEST_CASE("a zero or negative sleep completes at once, successfully") {
  gdr::scheduler s;
  CHECK(gdr::sync_wait(s, try_sleep(0ns)).has_value());
  CHECK(gdr::sync_wait(s, try_sleep(-5ms)).has_value());
}

TEST_CASE("sleep_until an absolute time wakes after it, and a past time at once") {
  gdr::scheduler s;
  auto deadline = std::chrono::steady_clock::now() + 5ms;
  gdr::sync_wait(s, [&]() -> gdr::task<> { co_await gdr::sleep_until(deadline); }());
  CHECK(std::chrono::steady_clock::now() >= deadline);
  auto t0 = std::chrono::steady_clock::now();
  gdr::sync_wait(s, [&]() -> gdr::task<> { co_await gdr::sleep_until(s, t0 - 1s); }());
  CHECK(ms_since(t0) < 1000.0);
}

TEST_CASE("timers started together fire in deadline order") {
  gdr::scheduler s;
  std::vector<int> log;
  int done = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    sched_test::run_detached(sleep_and_log(15ms, 3, log), done);
    sched_test::run_detached(sleep_and_log(5ms, 1, log), done);
    sched_test::run_detached(sleep_and_log(10ms, 2, log), done);
    while (done < 3) co_await gdr::sleep_for(1ms);
  }());
  CHECK(log == std::vector<int>{1, 2, 3});
}

TEST_CASE("a sleep whose token is already stopped fails with cancelled without submitting") {
  gdr::scheduler s;
  std::stop_source src;
  src.request_stop();
  auto r = gdr::sync_wait(s, try_sleep(10s), src.get_token());
  CHECK(r.error() == gdr::errc::cancelled);
  CHECK(s.stats().completions == 0);  // never reached the ring
  CHECK(s.inflight() == 0);
}

TEST_CASE("a sleep cancelled on the loop's thread while in flight ends early") {
  gdr::scheduler s;
  std::stop_source src;
  int done = 0;
  gdr::result<void> r;
  auto t0 = std::chrono::steady_clock::now();
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    auto sleeper = [&]() -> gdr::task<void> { r = co_await gdr::sleep_for(10s).as_result(); };
    sched_test::run_detached(gdr::with_stop_token(src.get_token(), sleeper()), done);
    co_await gdr::sleep_for(2ms);
    src.request_stop();  // same thread: the cancel SQE is prepared inline
    while (done == 0) co_await gdr::nop();
  }());
  CHECK(r.error() == gdr::errc::cancelled);
  CHECK(ms_since(t0) < 1000.0);
  CHECK(s.inflight() == 0);
}

TEST_CASE("a stop from another thread cancels an in-flight timer and the loop keeps serving") {
  sched_test::watchdog wd(30);
  gdr::scheduler s;
  std::stop_source src;
  std::thread stopper([&] {
    std::this_thread::sleep_for(10ms);
    src.request_stop();
  });
  auto t0 = std::chrono::steady_clock::now();
  auto r = gdr::sync_wait(s, try_sleep(10s), src.get_token());
  stopper.join();
  CHECK(r.error() == gdr::errc::cancelled);
  CHECK(ms_since(t0) < 2000.0);
  CHECK(s.inflight() == 0);
  CHECK(gdr::sync_wait(s, []() -> gdr::task<int> {
          co_await gdr::nop();
          co_return 5;
        }()) == 5);
}

TEST_CASE("the throwing form of a cancelled sleep throws gdr::error with cancelled") {
  gdr::scheduler s;
  std::stop_source src;
  src.request_stop();
  try {
    gdr::sync_wait(s, []() -> gdr::task<> { co_await gdr::sleep_for(1s); }(), src.get_token());
    FAIL("no exception");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::cancelled);
  }
}

TEST_CASE("try_await is the same as as_result") {
  gdr::scheduler s;
  std::stop_source src;
  src.request_stop();
  auto r = gdr::sync_wait(
      s, []() -> gdr::task<gdr::result<void>> { co_return co_await gdr::try_await(gdr::sleep_for(1s)); }(),
      src.get_token());
  CHECK(r.error() == gdr::errc::cancelled);
}

TEST_CASE("nop completes through the ring and can be cancelled before submission") {
  gdr::scheduler s;
  auto ok = gdr::sync_wait(s, []() -> gdr::task<gdr::result<void>> { co_return co_await gdr::nop().as_result(); }());
  CHECK(ok.has_value());
  CHECK(s.stats().completions == 1);
  std::stop_source src;
  src.request_stop();
  auto r = gdr::sync_wait(s, []() -> gdr::task<gdr::result<void>> { co_return co_await gdr::nop(gdr::this_scheduler()).as_result(); }(),
                          src.get_token());
  CHECK(r.error() == gdr::errc::cancelled);
  CHECK(s.stats().completions == 1);
}
