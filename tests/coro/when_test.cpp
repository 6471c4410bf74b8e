#include <doctest/doctest.h>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/coro/when_any.hpp>
#include <gdr/sched/timer.hpp>

#include <chrono>
#include <stdexcept>
#include <vector>

using namespace std::chrono_literals;

namespace {
gdr::task<int> after(std::chrono::milliseconds d, int v) {
  co_await gdr::sleep_for(d);
  co_return v;
}
gdr::task<void> nothing() { co_await gdr::nop(); }
gdr::task<int> fails_after(std::chrono::milliseconds d) {
  co_await gdr::sleep_for(d);
  throw std::runtime_error("child failed");
}
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST_CASE("when_all runs children concurrently and returns a tuple") {
  gdr::scheduler s;
  auto t0 = std::chrono::steady_clock::now();
  auto [a, b, c] = gdr::sync_wait(s, gdr::when_all(after(30ms, 1), after(30ms, 2), nothing()));
  CHECK(a == 1);
  CHECK(b == 2);
  (void)c;
  CHECK(ms_since(t0) < 55.0);  // concurrent: about 30 ms, not 60
  CHECK(s.inflight() == 0);
}

TEST_CASE("when_all over a vector keeps the order of its tasks") {
  gdr::scheduler s;
  std::vector<gdr::task<int>> ts;
  for (int i = 0; i < 100; ++i) ts.push_back(after(std::chrono::milliseconds(i % 5), i));
  auto v = gdr::sync_wait(s, gdr::when_all(std::move(ts)));
  REQUIRE(v.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(v[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("when_all waits for every child before rethrowing the first failure") {
  gdr::scheduler s;
  int finished = 0;
  auto counted = [&]() -> gdr::task<int> {
    co_await gdr::sleep_for(20ms);
    ++finished;
    co_return 0;
  };
  CHECK_THROWS_WITH(gdr::sync_wait(s, gdr::when_all(fails_after(1ms), counted())), "child failed");
  CHECK(finished == 1);  // the slow sibling ran to its end
  CHECK(s.inflight() == 0);
}

TEST_CASE("when_any returns the first and cancels and awaits the rest") {
  gdr::scheduler s;
  auto t0 = std::chrono::steady_clock::now();
  auto r = gdr::sync_wait(s, gdr::when_any(after(10s, 1), after(5ms, 2), after(10s, 3)));
  CHECK(r.index == 1);
  CHECK(r.value == 2);
  CHECK(ms_since(t0) < 1000.0);  // the 10 s losers were cancelled, not waited out
  CHECK(s.inflight() == 0);
}

TEST_CASE("when_any rethrows when the winner failed") {
  gdr::scheduler s;
  CHECK_THROWS_WITH(gdr::sync_wait(s, gdr::when_any(fails_after(1ms), after(10s, 1))), "child failed");
  CHECK(s.inflight() == 0);
}
