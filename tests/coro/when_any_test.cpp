// gdr/coro/when_any.hpp: the first finisher wins; the losers are cancelled
// through a linked token and awaited; what happens to their outcomes.
#include <doctest/doctest.h>

#include <chrono>
#include <stdexcept>
#include <stop_token>
#include <thread>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_any.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/coro/coro_test_support.hpp"

using namespace std::chrono_literals;
using coro_test::ms_since;

namespace {

gdr::task<int> after(std::chrono::milliseconds d, int v) {
  co_await gdr::sleep_for(d);
  co_return v;
}
gdr::task<int> fails_after(std::chrono::milliseconds d) {
  co_await gdr::sleep_for(d);
  throw std::runtime_error("child failed");
}
// Sleeps `d`; records in `ended` that it ran to its end, cancelled or not.
gdr::task<int> recorded(std::chrono::milliseconds d, int v, int& ended) {
  struct on_exit {
    int& n;
    ~on_exit() { ++n; }
  } guard{ended};
  co_await gdr::sleep_for(d);
  co_return v;
}

}  // namespace

TEST_CASE("when_any returns the index and value of the first to finish") {
  gdr::scheduler s;
  auto t0 = std::chrono::steady_clock::now();
  auto r = gdr::sync_wait(s, gdr::when_any(after(10s, 1), after(5ms, 2), after(10s, 3)));
  CHECK(r.index == 1);
  CHECK(r.value == 2);
  CHECK(ms_since(t0) < 1000.0);  // the 10 s losers were cancelled, not waited out
  CHECK(s.inflight() == 0);
}

TEST_CASE("when_any cancels the losers and awaits them before returning") {
  gdr::scheduler s;
  int ended = 0;
  auto r = gdr::sync_wait(s, [&]() -> gdr::task<std::size_t> {
    auto w = co_await gdr::when_any(recorded(10s, 0, ended), recorded(1ms, 1, ended), recorded(10s, 2, ended));
    CHECK(ended == 3);  // every child's frame is gone by now, losers included
    co_return w.index;
  }());
  CHECK(r == 1);
}

TEST_CASE("when_any rethrows when the winner failed") {
  gdr::scheduler s;
  CHECK_THROWS_WITH(gdr::sync_wait(s, gdr::when_any(fails_after(1ms), after(10s, 1))), "child failed");
  CHECK(s.inflight() == 0);
}

TEST_CASE("the losers' exceptions are dropped, cancellations and others alike") {
  gdr::scheduler s;
  // Loser 1 fails with cancelled (the stop request), loser 2 turns the stop
  // into an error of its own; neither reaches the caller.
  auto converts = []() -> gdr::task<int> {
    auto r = co_await gdr::sleep_for(10s).as_result();
    if (!r) throw std::runtime_error("turned the stop into something else");
    co_return 0;
  };
  auto r = gdr::sync_wait(s, gdr::when_any(after(2ms, 7), after(10s, 1), converts()));
  CHECK(r.index == 0);
  CHECK(r.value == 7);
}

TEST_CASE("a loser that ignores the stop request is waited for and its value dropped") {
  gdr::scheduler s;
  bool loser_finished = false;
  auto shielded = []() -> gdr::task<void> { co_await gdr::sleep_for(20ms); };
  auto stubborn = [&]() -> gdr::task<int> {
    // Runs its sleep under a token that never fires: the stop cannot reach it.
    co_await gdr::with_stop_token(std::stop_token{}, shielded());
    loser_finished = true;
    co_return 99;
  };
  auto t0 = std::chrono::steady_clock::now();
  auto r = gdr::sync_wait(s, gdr::when_any(after(1ms, 1), stubborn()));
  CHECK(r.index == 0);
  CHECK(r.value == 1);
  CHECK(loser_finished);  // waited for, not abandoned
  CHECK(ms_since(t0) >= 20.0);
}

TEST_CASE("a child that finishes synchronously wins before the others start") {
  gdr::scheduler s;
  std::vector<gdr::task<int>> ts;
  ts.push_back([]() -> gdr::task<int> { co_return 5; }());
  ts.push_back(after(10s, 6));  // starts with stop already requested
  auto t0 = std::chrono::steady_clock::now();
  auto r = gdr::sync_wait(s, gdr::when_any(std::move(ts)));
  CHECK(r.index == 0);
  CHECK(r.value == 5);
  CHECK(ms_since(t0) < 1000.0);
  CHECK(s.inflight() == 0);
}

TEST_CASE("the children's token is linked to the parent's, not the parent's itself") {
  gdr::scheduler s;
  std::stop_source parent;
  auto body = [&]() -> gdr::task<bool> {
    std::stop_token mine = co_await gdr::this_stop_token;
    std::stop_token childs;
    auto grab = [&]() -> gdr::task<int> {
      childs = co_await gdr::this_stop_token;
      co_return 0;
    };
    co_await gdr::when_any(grab());
    // The winner's stop request reached the child's token only.
    co_return childs.stop_requested() && !mine.stop_requested();
  };
  CHECK(gdr::sync_wait(s, body(), parent.get_token()));
}

TEST_CASE("a parent's stop request cancels every child and when_any reports cancelled") {
  gdr::scheduler s;
  std::stop_source src;
  std::thread stopper([&] {
    std::this_thread::sleep_for(5ms);
    src.request_stop();  // from another thread
  });
  auto t0 = std::chrono::steady_clock::now();
  try {
    gdr::sync_wait(s, gdr::when_any(after(10s, 1), after(10s, 2)), src.get_token());
    FAIL("not cancelled");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::cancelled);
  }
  stopper.join();
  CHECK(ms_since(t0) < 1000.0);
  CHECK(s.inflight() == 0);
}

TEST_CASE("when_any of void tasks reports the winner's index") {
  gdr::scheduler s;
  auto sleep = [](std::chrono::milliseconds d) -> gdr::task<void> { co_await gdr::sleep_for(d); };
  auto r = gdr::sync_wait(s, gdr::when_any(sleep(10s), sleep(10s), sleep(1ms)));
  CHECK(r.index == 2);
}

TEST_CASE("when_any of no tasks is an invalid argument") {
  gdr::scheduler s;
  try {
    gdr::sync_wait(s, gdr::when_any(std::vector<gdr::task<int>>{}));
    FAIL("accepted an empty set");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::invalid_argument);
  }
}
