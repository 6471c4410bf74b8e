#include <doctest/doctest.h>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>

#include <stdexcept>
#include <stop_token>

namespace {
gdr::task<int> value(int v) { co_return v; }
gdr::task<int> twice(int v) { co_return 2 * co_await value(v); }
gdr::task<void> thrower() {
  throw std::runtime_error("boom");
  co_return;
}
gdr::task<std::stop_token> token() { co_return co_await gdr::this_stop_token; }
// A named function, not an immediately invoked lambda: a lambda coroutine's
// captures live in the closure, which a statement like `auto t = [&]...();`
// destroys before the task runs.
gdr::task<int> mark(bool& started) {
  started = true;
  co_return 1;
}
}  // namespace

TEST_CASE("task doesn't start until awaited") {
  bool started = false;
  auto t = mark(started);
  CHECK_FALSE(started);
  gdr::scheduler s;
  CHECK(gdr::sync_wait(s, std::move(t)) == 1);
  CHECK(started);
}

TEST_CASE("awaiting a task returns its value and chains") {
  gdr::scheduler s;
  CHECK(gdr::sync_wait(s, twice(21)) == 42);
}

TEST_CASE("an exception inside a task rethrows at the co_await") {
  gdr::scheduler s;
  CHECK_THROWS_WITH_AS(gdr::sync_wait(s, thrower()), "boom", std::runtime_error);
}

TEST_CASE("a million synchronous co_awaits do not grow the stack") {
  gdr::scheduler s;
  auto loop = []() -> gdr::task<long> {
    long sum = 0;
    for (int i = 0; i < 1'000'000; ++i) sum += co_await value(1);
    co_return sum;
  };
  CHECK(gdr::sync_wait(s, loop()) == 1'000'000);
}

TEST_CASE("a child task inherits its parent's stop token") {
  gdr::scheduler s;
  std::stop_source src;
  auto parent = [&]() -> gdr::task<bool> {
    std::stop_token child = co_await token();
    src.request_stop();
    co_return child.stop_requested();
  };
  CHECK(gdr::sync_wait(s, parent(), src.get_token()));
}

TEST_CASE("with_stop_token gives a child a token of its own") {
  gdr::scheduler s;
  std::stop_source mine;
  auto parent = [&]() -> gdr::task<bool> {
    std::stop_token t = co_await gdr::with_stop_token(mine.get_token(), token());
    mine.request_stop();
    co_return t.stop_requested();
  };
  CHECK(gdr::sync_wait(s, parent()));
}

TEST_CASE("a moved-from task is empty and a finished task is done") {
  auto t = value(3);
  CHECK(t.valid());
  auto u = std::move(t);
  CHECK_FALSE(t.valid());  // NOLINT: checking the moved-from state on purpose
  gdr::scheduler s;
  CHECK(gdr::sync_wait(s, std::move(u)) == 3);
}
