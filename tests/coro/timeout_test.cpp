// gdr/coro/timeout.hpp: deadlines on io_uring timeouts; every outcome of
// with_timeout and try_with_timeout; nothing left in flight.
#include <doctest/doctest.h>

#include <chrono>
#include <stdexcept>
#include <stop_token>
#include <system_error>
#include <thread>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/timeout.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/coro/coro_test_support.hpp"

using namespace std::chrono_literals;
using coro_test::ms_since;

namespace {

gdr::task<int> after(std::chrono::milliseconds d, int v) {
  co_await gdr::sleep_for(d);
  co_return v;
}
gdr::task<gdr::result<int>> try_after(std::chrono::milliseconds d, int v) {
  gdr::result<void> r = co_await gdr::sleep_for(d).as_result();
  if (!r) co_return r.error();
  co_return v;
}
template <class F>
std::error_code code_of(F&& f) {
  try {
    f();
  } catch (const gdr::error& e) {
    return e.code();
  }
  return {};
}

}  // namespace

TEST_CASE("with_timeout returns the value and cancels its timer when the task wins") {
  gdr::scheduler s;
  auto t0 = std::chrono::steady_clock::now();
  CHECK(gdr::sync_wait(s, gdr::with_timeout(10s, after(1ms, 7))) == 7);
  CHECK(ms_since(t0) < 1000.0);  // did not wait for the 10 s timer
  CHECK(s.inflight() == 0);
}

TEST_CASE("with_timeout throws timed_out when the deadline passes first") {
  gdr::scheduler s;
  auto t0 = std::chrono::steady_clock::now();
  CHECK(code_of([&] { gdr::sync_wait(s, gdr::with_timeout(5ms, after(10s, 1))); }) == gdr::errc::timed_out);
  CHECK(ms_since(t0) >= 5.0);
  CHECK(ms_since(t0) < 1000.0);
  CHECK(s.inflight() == 0);
}

TEST_CASE("the timed-out task has finished before with_timeout throws") {
  gdr::scheduler s;
  bool cleaned_up = false;
  auto slow = [&]() -> gdr::task<void> {
    struct on_exit {
      bool& b;
      ~on_exit() { b = true; }
    } guard{cleaned_up};
    co_await gdr::sleep_for(10s);
  };
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    try {
      co_await gdr::with_timeout(2ms, slow());
    } catch (const gdr::error& e) {
      CHECK(e.code() == gdr::errc::timed_out);
      CHECK(cleaned_up);
    }
  }());
  CHECK(cleaned_up);
}

TEST_CASE("a task that ignores the deadline keeps its value") {
  gdr::scheduler s;
  auto shielded = []() -> gdr::task<int> {
    co_await gdr::with_stop_token(std::stop_token{}, after(10ms, 0));
    co_return 42;
  };
  CHECK(gdr::sync_wait(s, gdr::with_timeout(1ms, shielded())) == 42);
  CHECK(s.inflight() == 0);
}

TEST_CASE("a failure other than cancellation passes through even after the deadline") {
  gdr::scheduler s;
  auto converts = []() -> gdr::task<int> {
    auto r = co_await gdr::sleep_for(10s).as_result();
    if (!r) throw gdr::error(gdr::errc::connection_lost);
    co_return 0;
  };
  CHECK(code_of([&] { gdr::sync_wait(s, gdr::with_timeout(2ms, converts())); }) == gdr::errc::connection_lost);
  auto plain = []() -> gdr::task<int> { throw std::runtime_error("own"); co_return 0; };
  CHECK_THROWS_WITH(gdr::sync_wait(s, gdr::with_timeout(1s, plain())), "own");
  CHECK(s.inflight() == 0);
}

TEST_CASE("a parent's stop under with_timeout is a cancellation, not a timeout") {
  gdr::scheduler s;
  std::stop_source src;
  std::thread stopper([&] {
    std::this_thread::sleep_for(3ms);
    src.request_stop();
  });
  CHECK(code_of([&] { gdr::sync_wait(s, gdr::with_timeout(10s, after(10s, 1)), src.get_token()); }) ==
        gdr::errc::cancelled);
  stopper.join();
  CHECK(s.inflight() == 0);
}

TEST_CASE("with_timeout of a void task") {
  gdr::scheduler s;
  auto sleep = [](std::chrono::milliseconds d) -> gdr::task<void> { co_await gdr::sleep_for(d); };
  gdr::sync_wait(s, gdr::with_timeout(1s, sleep(1ms)));
  CHECK(code_of([&] { gdr::sync_wait(s, gdr::with_timeout(1ms, sleep(10s))); }) == gdr::errc::timed_out);
  CHECK(s.inflight() == 0);
}

TEST_CASE("a zero deadline times out a task that waits") {
  gdr::scheduler s;
  CHECK(code_of([&] { gdr::sync_wait(s, gdr::with_timeout(0ns, after(10s, 1))); }) == gdr::errc::timed_out);
  // ...but a task that finishes without waiting still wins.
  CHECK(gdr::sync_wait(s, gdr::with_timeout(0ns, []() -> gdr::task<int> { co_return 3; }())) == 3);
}

TEST_CASE("nested deadlines: the shorter one reports the timeout") {
  gdr::scheduler s;
  // Inner shorter: the inner with_timeout times out; the outer passes it on.
  CHECK(code_of([&] { gdr::sync_wait(s, gdr::with_timeout(10s, gdr::with_timeout(2ms, after(10s, 1)))); }) ==
        gdr::errc::timed_out);
  // Outer shorter: the inner task sees a cancellation (not its own deadline),
  // the outer turns it into timed_out.
  CHECK(code_of([&] { gdr::sync_wait(s, gdr::with_timeout(2ms, gdr::with_timeout(10s, after(10s, 1)))); }) ==
        gdr::errc::timed_out);
  CHECK(s.inflight() == 0);
}

TEST_CASE("many concurrent deadlines on one scheduler each settle") {
  gdr::scheduler s;
  std::vector<gdr::task<gdr::result<int>>> ts;
  for (int i = 0; i < 200; ++i) {
    // Even ones finish in 1 ms under a 1 s deadline; odd ones time out at 2 ms.
    ts.push_back(gdr::try_with_timeout(i % 2 == 0 ? 1s : 2ms, after(i % 2 == 0 ? 1ms : 10s, i)));
  }
  auto rs = gdr::sync_wait(s, gdr::when_all(std::move(ts)));
  for (int i = 0; i < 200; ++i) {
    const auto& r = rs[static_cast<std::size_t>(i)];
    if (i % 2 == 0) {
      CHECK(r.has_value());
    } else {
      CHECK(r.error() == gdr::errc::timed_out);
    }
  }
  CHECK(s.inflight() == 0);
}

TEST_CASE("try_with_timeout returns timed_out as a code") {
  gdr::scheduler s;
  gdr::result<int> r = gdr::sync_wait(s, gdr::try_with_timeout(2ms, after(10s, 1)));
  CHECK(r.error() == gdr::errc::timed_out);
  gdr::result<int> ok = gdr::sync_wait(s, gdr::try_with_timeout(1s, after(1ms, 9)));
  REQUIRE(ok.has_value());
  CHECK(*ok == 9);
}

TEST_CASE("try_with_timeout over a result-returning task flattens it and maps its cancellation") {
  gdr::scheduler s;
  gdr::result<int> r = gdr::sync_wait(s, gdr::try_with_timeout(2ms, try_after(10s, 1)));
  CHECK(r.error() == gdr::errc::timed_out);
  gdr::result<int> ok = gdr::sync_wait(s, gdr::try_with_timeout(1s, try_after(1ms, 4)));
  REQUIRE(ok.has_value());
  CHECK(*ok == 4);
  // The task's own error passes through.
  auto fails = []() -> gdr::task<gdr::result<int>> { co_return gdr::errc::connection_lost; };
  CHECK(gdr::sync_wait(s, gdr::try_with_timeout(1s, fails())).error() == gdr::errc::connection_lost);
}

TEST_CASE("try_with_timeout turns a thrown gdr::error into its code and keeps other exceptions") {
  gdr::scheduler s;
  auto throws = []() -> gdr::task<int> {
    throw gdr::error(gdr::errc::protocol_error);
    co_return 0;
  };
  CHECK(gdr::sync_wait(s, gdr::try_with_timeout(1s, throws())).error() == gdr::errc::protocol_error);
  auto other = []() -> gdr::task<int> {
    throw std::logic_error("not a system error");
    co_return 0;
  };
  CHECK_THROWS_AS((void)gdr::sync_wait(s, gdr::try_with_timeout(1s, other())), std::logic_error);
  auto v = []() -> gdr::task<void> { co_await gdr::nop(); };
  CHECK(gdr::sync_wait(s, gdr::try_with_timeout(1s, v())).has_value());
  CHECK(s.inflight() == 0);
}

TEST_CASE("a task that moves to another thread is brought home before the timer is cancelled") {
  coro_test::watchdog wd(30);
  coro_test::loop_thread other;
  gdr::scheduler s;
  auto away = [&]() -> gdr::task<std::thread::id> {
    co_await other.sched().schedule();
    co_return std::this_thread::get_id();
  };
  auto body = [&]() -> gdr::task<bool> {
    std::thread::id child = co_await gdr::with_timeout(10s, away());
    // with_timeout completes on the scheduler it was called from.
    co_return child == other.id() && gdr::scheduler::current() == &s;
  };
  CHECK(gdr::sync_wait(s, body()));
  CHECK(s.inflight() == 0);
}
