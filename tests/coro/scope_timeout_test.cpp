#include <doctest/doctest.h>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/timeout.hpp>
#include <gdr/sched/timer.hpp>

#include <chrono>
#include <stdexcept>

using namespace std::chrono_literals;

namespace {
gdr::task<void> sleep_then_count(std::chrono::milliseconds d, int& n) {
  co_await gdr::sleep_for(d);
  ++n;
}
gdr::task<int> after(std::chrono::milliseconds d, int v) {
  co_await gdr::sleep_for(d);
  co_return v;
}
}  // namespace

TEST_CASE("a scope joins every task it spawned") {
  gdr::scheduler s;
  int n = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    for (int i = 0; i < 200; ++i) scope.spawn(sleep_then_count(std::chrono::milliseconds(i % 7), n));
    CHECK(scope.active() > 0);
    co_await scope.join();
    CHECK(scope.active() == 0);
  }());
  CHECK(n == 200);
  CHECK(s.inflight() == 0);
}

TEST_CASE("request_stop on a scope cancels its tasks and join reports it") {
  gdr::scheduler s;
  int n = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    for (int i = 0; i < 10; ++i) scope.spawn(sleep_then_count(10s, n));
    co_await gdr::sleep_for(1ms);
    scope.request_stop();
    CHECK_THROWS_AS(co_await scope.join(), gdr::error);
  }());
  CHECK(n == 0);
  CHECK(s.inflight() == 0);
}

TEST_CASE("with_timeout throws timed_out when the deadline passes first") {
  gdr::scheduler s;
  try {
    gdr::sync_wait(s, gdr::with_timeout(5ms, after(10s, 1)));
    FAIL("no timeout");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::timed_out);
  }
  CHECK(s.inflight() == 0);
}

TEST_CASE("with_timeout returns the value and cancels its timer when the task wins") {
  gdr::scheduler s;
  CHECK(gdr::sync_wait(s, gdr::with_timeout(10s, after(1ms, 7))) == 7);
  CHECK(s.inflight() == 0);
}

TEST_CASE("a parent's stop under with_timeout is a cancellation, not a timeout") {
  gdr::scheduler s;
  std::stop_source src;
  auto body = [&]() -> gdr::task<int> {
    auto stopper = [&]() -> gdr::task<int> {
      co_await gdr::sleep_for(2ms);
      src.request_stop();
      co_return 0;
    };
    auto [a, b] = co_await gdr::when_all(gdr::with_timeout(10s, after(10s, 1)), stopper());
    co_return a + b;
  };
  try {
    gdr::sync_wait(s, body(), src.get_token());
    FAIL("not cancelled");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::cancelled);
  }
  CHECK(s.inflight() == 0);
}
