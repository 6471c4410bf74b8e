// gdr/coro/sync_wait.hpp: the bridge from ordinary code into a scheduler's loop.
#include <doctest/doctest.h>

#include <liburing.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/coro/coro_test_support.hpp"
#include "tests/support/skip.hpp"

using namespace std::chrono_literals;

TEST_CASE("sync_wait returns the task's value") {
  gdr::scheduler s;
  CHECK(gdr::sync_wait(s, []() -> gdr::task<std::string> { co_return "done"; }()) == "done");
}

TEST_CASE("sync_wait of a void task returns once it has finished") {
  gdr::scheduler s;
  bool ran = false;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    co_await gdr::nop();
    ran = true;
  }());
  CHECK(ran);
}

TEST_CASE("sync_wait rethrows the task's exception") {
  gdr::scheduler s;
  CHECK_THROWS_WITH_AS(gdr::sync_wait(s, []() -> gdr::task<int> {
                         co_await gdr::nop();
                         throw std::out_of_range("late");
                       }()),
                       "late", std::out_of_range);
  // The scheduler is still usable after a failed task.
  CHECK(gdr::sync_wait(s, []() -> gdr::task<int> { co_return 3; }()) == 3);
}

TEST_CASE("sync_wait starts the task inside the scheduler's loop on the calling thread") {
  gdr::scheduler s;
  CHECK(gdr::scheduler::current() == nullptr);
  auto where = gdr::sync_wait(s, []() -> gdr::task<gdr::scheduler*> { co_return gdr::scheduler::current(); }());
  CHECK(where == &s);
  CHECK(gdr::scheduler::current() == nullptr);  // unbound again afterwards
}

TEST_CASE("sync_wait hands its stop token to the task") {
  gdr::scheduler s;
  std::stop_source src;
  src.request_stop();
  auto stopped = gdr::sync_wait(
      s, []() -> gdr::task<bool> { co_return (co_await gdr::this_stop_token).stop_requested(); }(), src.get_token());
  CHECK(stopped);
}

TEST_CASE("sync_wait waits for I/O and may be called again on the same scheduler") {
  gdr::scheduler s;
  for (int i = 0; i < 3; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    gdr::sync_wait(s, []() -> gdr::task<> { co_await gdr::sleep_for(2ms); }());
    CHECK(coro_test::ms_since(t0) >= 2.0);
  }
  CHECK(s.inflight() == 0);
}

TEST_CASE("two threads can each sync_wait on their own scheduler at once") {
  coro_test::watchdog wd(30);
  int a = 0, b = 0;
  auto work = []() -> gdr::task<int> {
    int n = 0;
    for (int i = 0; i < 1000; ++i) {
      co_await gdr::nop();
      ++n;
    }
    co_return n;
  };
  std::thread other([&] {
    gdr::scheduler s;
    b = gdr::sync_wait(s, work());
  });
  gdr::scheduler s;
  a = gdr::sync_wait(s, work());
  other.join();
  CHECK(a == 1000);
  CHECK(b == 1000);
}

TEST_CASE("sync_wait on a thread that may not run the scheduler throws, runs nothing, and leaves nothing queued") {
  coro_test::watchdog wd(30);
  if (!gdr::scheduler_options{}.single_thread) GDR_SKIP("GDR_SCHED_ANY_THREAD=1: rings any thread may run");
  auto s = std::make_unique<gdr::scheduler>();
  if (!(s->ring()->flags & IORING_SETUP_SINGLE_ISSUER))
    GDR_SKIP("the kernel refuses IORING_SETUP_DEFER_TASKRUN (before Linux 6.1)");
  // Its ring is bound to the thread that first runs it.
  std::thread loop([&] { gdr::sync_wait(*s, []() -> gdr::task<> { co_await gdr::nop(); }()); });
  loop.join();
  bool ran = false;
  bool refused = false;
  try {
    gdr::sync_wait(*s, [&]() -> gdr::task<> {
      ran = true;
      co_return;
    }());
  } catch (const gdr::error& e) {
    refused = true;
    CHECK(e.code() == gdr::errc::unsupported);
    CHECK(std::string(e.what()).find("single_thread") != std::string::npos);
  }
  CHECK(refused);
  CHECK_FALSE(ran);
  // Destroyed here (not the loop's thread): it finishes what is queued, and
  // the refused call left nothing (it used to leave the node that starts
  // its task, in its dead frame: SIGSEGV).
  s.reset();
  CHECK_FALSE(ran);
}

TEST_CASE("sync_wait from inside its own scheduler's loop throws, in every build, and runs nothing") {
  gdr::scheduler s;
  bool ran = false;
  std::error_code why;
  std::string what;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    try {
      gdr::sync_wait(s, [&]() -> gdr::task<> {
        ran = true;
        co_return;
      }());
    } catch (const gdr::error& e) {
      why = e.code();
      what = e.what();
    }
    co_await gdr::nop();
  }());
  CHECK(why == gdr::errc::unsupported);
  CHECK(what.find("gdr::sync_wait: called from inside the same scheduler's loop") != std::string::npos);
  CHECK_FALSE(ran);
  // Inside another scheduler's loop it runs (blocking that loop meanwhile).
  gdr::scheduler other;
  CHECK(gdr::sync_wait(other, [&]() -> gdr::task<int> {
    co_return gdr::sync_wait(s, []() -> gdr::task<int> { co_return 7; }());
  }()) == 7);
}
