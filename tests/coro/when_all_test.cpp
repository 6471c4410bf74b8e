// gdr/coro/when_all.hpp: concurrency, order, void results, exceptions after
// every child finished, the shared stop token.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
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
gdr::task<int> now(int v) { co_return v; }
gdr::task<void> nothing() { co_await gdr::nop(); }
gdr::task<int> fails_after(std::chrono::milliseconds d, const char* what) {
  co_await gdr::sleep_for(d);
  throw std::runtime_error(what);
}
// Appends `id` to `log` at start, after each of `steps` NOPs, and at the end.
gdr::task<void> steps(std::vector<std::string>& log, std::string id, int n) {
  log.push_back(id + "0");
  for (int i = 1; i <= n; ++i) {
    co_await gdr::nop();
    log.push_back(id + std::to_string(i));
  }
}

}  // namespace

static_assert(std::is_same_v<decltype(gdr::when_all(now(1), nothing()))::value_type, std::tuple<int, std::monostate>>,
              "task<void> contributes std::monostate to the tuple");
static_assert(std::is_void_v<decltype(gdr::when_all(std::vector<gdr::task<void>>{}))::value_type>,
              "the range form over task<void> returns void");

TEST_CASE("when_all runs children concurrently and returns a tuple in argument order") {
  gdr::scheduler s;
  auto t0 = std::chrono::steady_clock::now();
  auto [a, b, c] = gdr::sync_wait(s, gdr::when_all(after(30ms, 1), after(20ms, 2), nothing()));
  CHECK(a == 1);
  CHECK(b == 2);
  CHECK(c == std::monostate{});
  CHECK(ms_since(t0) < 50.0);  // concurrent: about 30 ms, not 50
  CHECK(s.inflight() == 0);
}

TEST_CASE("when_all doesn't start its children until awaited") {
  gdr::scheduler s;
  std::vector<std::string> log;
  auto all = gdr::when_all(steps(log, "a", 1), steps(log, "b", 1));
  CHECK(log.empty());
  gdr::sync_wait(s, std::move(all));
  CHECK(log.size() == 4);
}

TEST_CASE("children start one after another and interleave at their suspension points") {
  gdr::scheduler s;
  std::vector<std::string> log;
  gdr::sync_wait(s, gdr::when_all(steps(log, "a", 2), steps(log, "b", 2)));
  // Each runs to its first NOP before the next starts; the NOPs complete in
  // submission order, so the children alternate.
  CHECK(log == std::vector<std::string>{"a0", "b0", "a1", "b1", "a2", "b2"});
}

TEST_CASE("when_all of children that finish synchronously continues without suspending") {
  gdr::scheduler s;
  auto [a, b] = gdr::sync_wait(s, gdr::when_all(now(1), now(2)));
  CHECK(a + b == 3);
  CHECK(s.stats().completions == 0);  // no I/O at all
}

TEST_CASE("when_all over a vector keeps the order of its tasks") {
  gdr::scheduler s;
  std::vector<gdr::task<int>> ts;
  for (int i = 0; i < 100; ++i) ts.push_back(after(std::chrono::milliseconds((100 - i) % 5), i));
  auto v = gdr::sync_wait(s, gdr::when_all(std::move(ts)));
  REQUIRE(v.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(v[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("when_all over an empty vector completes at once") {
  gdr::scheduler s;
  CHECK(gdr::sync_wait(s, gdr::when_all(std::vector<gdr::task<int>>{})).empty());
  gdr::sync_wait(s, gdr::when_all(std::vector<gdr::task<void>>{}));
}

TEST_CASE("when_all over ten thousand synchronous children does not grow the stack") {
  gdr::scheduler s;
  std::vector<gdr::task<int>> ts;
  for (int i = 0; i < 10'000; ++i) ts.push_back(now(1));
  auto v = gdr::sync_wait(s, gdr::when_all(std::move(ts)));
  long sum = 0;
  for (int x : v) sum += x;
  CHECK(sum == 10'000);
}

TEST_CASE("when_all passes move-only results through") {
  gdr::scheduler s;
  auto boxed = [](int v) -> gdr::task<std::unique_ptr<int>> { co_return std::make_unique<int>(v); };
  auto [a, b] = gdr::sync_wait(s, gdr::when_all(boxed(1), boxed(2)));
  CHECK(*a + *b == 3);
}

TEST_CASE("when_all waits for every child before rethrowing the first failure") {
  gdr::scheduler s;
  int finished = 0;
  auto counted = [&]() -> gdr::task<int> {
    co_await gdr::sleep_for(20ms);
    ++finished;
    co_return 0;
  };
  // "first" fails at 1 ms, "second" at 5 ms; the counted sibling ends at 20 ms.
  CHECK_THROWS_WITH(gdr::sync_wait(s, gdr::when_all(fails_after(5ms, "second"), fails_after(1ms, "first"), counted())),
                    "first");
  CHECK(finished == 1);  // the slow sibling ran to its end: nothing outlives when_all
  CHECK(s.inflight() == 0);
}

TEST_CASE("a failure in the vector form is rethrown after the rest finished") {
  gdr::scheduler s;
  int finished = 0;
  auto counted = [&](int i) -> gdr::task<void> {
    co_await gdr::sleep_for(std::chrono::milliseconds(i % 3));
    ++finished;
    if (i == 5) throw std::runtime_error("five");
  };
  std::vector<gdr::task<void>> ts;
  for (int i = 0; i < 10; ++i) ts.push_back(counted(i));
  CHECK_THROWS_WITH(gdr::sync_wait(s, gdr::when_all(std::move(ts))), "five");
  CHECK(finished == 10);
}

TEST_CASE("children share the parent's stop token, so stopping the parent cancels them all") {
  gdr::scheduler s;
  std::stop_source src;
  auto sleeper = []() -> gdr::task<bool> {
    auto r = co_await gdr::sleep_for(10s).as_result();
    co_return r.error() == gdr::errc::cancelled;
  };
  auto stopper = [&]() -> gdr::task<bool> {
    co_await gdr::sleep_for(2ms);
    src.request_stop();
    co_return true;
  };
  auto t0 = std::chrono::steady_clock::now();
  auto [a, b, c] = gdr::sync_wait(s, gdr::when_all(sleeper(), sleeper(), stopper()), src.get_token());
  CHECK(a);
  CHECK(b);
  CHECK(c);
  CHECK(ms_since(t0) < 1000.0);
  CHECK(s.inflight() == 0);
}
