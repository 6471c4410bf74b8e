#include <doctest/doctest.h>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/timer.hpp>

#include <atomic>
#include <chrono>
#include <thread>

using namespace std::chrono_literals;

TEST_CASE("a NOP round trip completes through the ring in both modes") {
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    gdr::scheduler s({.mode = mode});
    auto body = []() -> gdr::task<int> {
      for (int i = 0; i < 1000; ++i) co_await gdr::nop();
      co_return 1;
    };
    CHECK(gdr::sync_wait(s, body()) == 1);
    CHECK(s.stats().completions >= 1000);
    CHECK(s.inflight() == 0);
  }
}

TEST_CASE("busy-poll mode never sleeps in the kernel") {
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  gdr::sync_wait(s, []() -> gdr::task<> { co_await gdr::sleep_for(2ms); }());
  CHECK(s.stats().sleeps == 0);
}

TEST_CASE("sleep mode blocks in the kernel while a timer runs") {
  gdr::scheduler s({.mode = gdr::run_mode::sleep});
  gdr::sync_wait(s, []() -> gdr::task<> { co_await gdr::sleep_for(5ms); }());
  CHECK(s.stats().sleeps >= 1);
  CHECK(s.stats().iterations < 100);  // it did not spin
}

TEST_CASE("schedule() moves a coroutine from another thread onto the loop's thread") {
  gdr::scheduler s;
  std::thread::id loop_thread;
  std::atomic<bool> moved{false};
  std::atomic<bool> stop{false};
  std::thread other([&] {
    // A coroutine started on a plain thread hops onto the scheduler: the
    // wake-up goes through the eventfd (this thread has no scheduler).
    auto hop = [&]() -> gdr::task<> {
      co_await s.schedule();
      loop_thread = std::this_thread::get_id();
      moved = true;
    }();
    auto h = hop.handle();
    h.resume();
    while (!moved) std::this_thread::sleep_for(1ms);
    (void)hop;
  });
  std::thread::id main_id = std::this_thread::get_id();
  s.run_until([&] { return moved.load(); });
  other.join();
  CHECK(loop_thread == main_id);
  (void)stop;
}

TEST_CASE("posting from a thread with its own scheduler wakes a sleeping loop through MSG_RING") {
  gdr::scheduler target;
  std::atomic<int> ran{0};
  struct work : gdr::remote_work {
    std::atomic<int>* ran;
  } w;
  w.ran = &ran;
  w.run = [](gdr::remote_work* self) noexcept { static_cast<work*>(self)->ran->fetch_add(1); };
  std::thread poster([&] {
    gdr::scheduler mine;
    gdr::sync_wait(mine, [&]() -> gdr::task<> {
      co_await gdr::sleep_for(20ms);  // let the target fall asleep first
      target.post(&w);                // current() is `mine`: MSG_RING to target
    }());
  });
  auto t0 = std::chrono::steady_clock::now();
  target.run_until([&] { return ran.load() == 1; });
  poster.join();
  CHECK(ran == 1);
  CHECK(target.stats().sleeps >= 1);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
}

TEST_CASE("a stop requested before the await completes the operation with cancelled, without submitting") {
  gdr::scheduler s;
  std::stop_source src;
  src.request_stop();
  auto r = gdr::sync_wait(s, []() -> gdr::task<gdr::result<void>> { co_return co_await gdr::sleep_for(10s).as_result(); }(),
                          src.get_token());
  CHECK(r.error() == gdr::errc::cancelled);
  CHECK(s.inflight() == 0);
}

TEST_CASE("a stop from another thread cancels an in-flight timer and the loop keeps serving") {
  gdr::scheduler s;
  std::stop_source src;
  std::thread stopper([&] {
    std::this_thread::sleep_for(10ms);
    src.request_stop();
  });
  auto t0 = std::chrono::steady_clock::now();
  auto r = gdr::sync_wait(s, []() -> gdr::task<gdr::result<void>> { co_return co_await gdr::sleep_for(10s).as_result(); }(),
                          src.get_token());
  stopper.join();
  CHECK(r.error() == gdr::errc::cancelled);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(s.inflight() == 0);
  CHECK(gdr::sync_wait(s, []() -> gdr::task<int> { co_await gdr::nop(); co_return 5; }()) == 5);
}

TEST_CASE("the throwing form of a cancelled operation throws gdr::error with cancelled") {
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

TEST_CASE("sleep_until an absolute time wakes after it") {
  gdr::scheduler s;
  auto deadline = std::chrono::steady_clock::now() + 5ms;
  gdr::sync_wait(s, [&]() -> gdr::task<> { co_await gdr::sleep_until(deadline); }());
  CHECK(std::chrono::steady_clock::now() >= deadline);
}

TEST_CASE("hot operation states stay small") {
  // The awaitables live in coroutine frames; their size is what every pending
  // operation costs. A change that grows them should be deliberate.
  CHECK(sizeof(gdr::operation) == 8);
  CHECK(sizeof(gdr::nop_awaitable) <= 128);
  CHECK(sizeof(gdr::timer_awaitable) <= 160);
}
