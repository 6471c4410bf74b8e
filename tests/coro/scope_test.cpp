// gdr/coro/scope.hpp: eager spawn, join, nested spawns, exceptions kept for
// join, request_stop (also from another thread), reuse.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <new>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/coro/coro_test_support.hpp"
#include "tests/support/alloc_failure.hpp"

using namespace std::chrono_literals;
using coro_test::ms_since;

namespace {

gdr::task<void> sleep_then_count(std::chrono::milliseconds d, int& n) {
  co_await gdr::sleep_for(d);
  ++n;
}
gdr::task<void> fail_after(std::chrono::milliseconds d, const char* what) {
  co_await gdr::sleep_for(d);
  throw std::runtime_error(what);
}
gdr::task<void> steps(int& before, int& after) {
  ++before;
  co_await gdr::nop();
  ++after;
}
gdr::task<void> count_cancelled(int& cancelled) {
  auto r = co_await gdr::sleep_for(10s).as_result();
  if (r.error() == gdr::errc::cancelled) ++cancelled;
}
gdr::task<void> grab_token(std::stop_token& seen) {
  seen = co_await gdr::this_stop_token;
}
gdr::task<void> spawner(gdr::task_scope& scope, int depth, int& n) {
  ++n;
  if (depth > 0) {
    scope.spawn(spawner(scope, depth - 1, n));
    scope.spawn(spawner(scope, depth - 1, n));
  }
  co_await gdr::nop();
}

}  // namespace

TEST_CASE("spawn starts a task at once and returns at its first suspension") {
  gdr::scheduler s;
  int before = 0, after = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    scope.spawn(steps(before, after));
    CHECK(before == 1);  // ran eagerly up to the NOP
    CHECK(after == 0);
    CHECK(scope.active() == 1);
    co_await scope.join();
    CHECK(after == 1);
  }());
}

TEST_CASE("a scope joins every task it spawned") {
  gdr::scheduler s;
  int n = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    for (int i = 0; i < 200; ++i) scope.spawn(sleep_then_count(std::chrono::milliseconds(i % 7), n));
    CHECK(scope.active() == 200);
    co_await scope.join();
    CHECK(scope.active() == 0);
  }());
  CHECK(n == 200);
  CHECK(s.inflight() == 0);
}

TEST_CASE("a spawn whose frame cannot be allocated throws and leaves the scope as it was") {
  // Before the fix the task was counted before its wrapper's frame was
  // allocated: the count stayed up, join() never completed, and
  // ~task_scope asserted.
  coro_test::watchdog wd(30);
  gdr::scheduler s;
  int before = 0, after = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    bool threw = false;
    long failed = 0;
    {
      gdr::task<void> t = steps(before, after);  // its own frame, allocated here
      gdr_test_support::failing_allocations oom;
      try {
        scope.spawn(std::move(t));
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      failed = oom.failed();
    }
    CHECK(threw);
    CHECK(failed == 1);
    CHECK(before == 0);  // never ran
    REQUIRE(scope.active() == 0);  // (before: 1, for a task that never ran)
    co_await scope.join();         // completes at once
    scope.spawn(steps(before, after));  // the scope still works
    co_await scope.join();
    CHECK(after == 1);
  }());
}

TEST_CASE("joining an empty scope completes at once") {
  gdr::scheduler s;
  gdr::sync_wait(s, []() -> gdr::task<> {
    gdr::task_scope scope;
    co_await scope.join();
    co_await scope.join();
  }());
}

TEST_CASE("tasks that finish inside spawn are counted out at once") {
  gdr::scheduler s;
  gdr::sync_wait(s, []() -> gdr::task<> {
    gdr::task_scope scope;
    for (int i = 0; i < 1000; ++i) scope.spawn([]() -> gdr::task<> { co_return; }());
    CHECK(scope.active() == 0);
    co_await scope.join();
  }());
}

TEST_CASE("tasks spawned by spawned tasks are joined too") {
  gdr::scheduler s;
  int n = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    scope.spawn(spawner(scope, 6, n));
    co_await scope.join();
  }());
  CHECK(n == 127);  // a full binary tree of depth 6
  CHECK(s.inflight() == 0);
}

TEST_CASE("join rethrows the first failure after every task finished") {
  gdr::scheduler s;
  int n = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    scope.spawn(fail_after(5ms, "second"));
    scope.spawn(fail_after(1ms, "first"));
    scope.spawn(sleep_then_count(20ms, n));
    CHECK_THROWS_WITH(co_await scope.join(), "first");
    CHECK(n == 1);  // the failures did not cancel the sibling
    // The error was consumed: the scope is clean and usable again.
    scope.spawn(sleep_then_count(1ms, n));
    co_await scope.join();
    CHECK(n == 2);
  }());
}

TEST_CASE("request_stop cancels every task of the scope") {
  gdr::scheduler s;
  int n = 0;
  auto t0 = std::chrono::steady_clock::now();
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    for (int i = 0; i < 10; ++i) scope.spawn(sleep_then_count(10s, n));
    co_await gdr::sleep_for(1ms);
    scope.request_stop();
    try {
      co_await scope.join();
      FAIL("no cancellation reported");
    } catch (const gdr::error& e) {
      CHECK(e.code() == gdr::errc::cancelled);
    }
  }());
  CHECK(n == 0);
  CHECK(ms_since(t0) < 1000.0);
  CHECK(s.inflight() == 0);
}

TEST_CASE("request_stop from another thread cancels the scope's tasks") {
  coro_test::watchdog wd(30);
  gdr::scheduler s;
  int cancelled = 0;
  gdr::task_scope* scope_ptr = nullptr;
  std::atomic<bool> ready{false};
  std::thread stopper([&] {
    while (!ready) std::this_thread::yield();
    std::this_thread::sleep_for(5ms);
    scope_ptr->request_stop();
  });
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::task_scope scope;
    scope_ptr = &scope;
    for (int i = 0; i < 50; ++i) {
      // A named coroutine, not a lambda: a temporary lambda's captures die
      // with the closure at the end of this statement.
      scope.spawn(count_cancelled(cancelled));
    }
    ready = true;
    co_await scope.join();
  }());
  stopper.join();
  CHECK(cancelled == 50);
  CHECK(s.inflight() == 0);
}

TEST_CASE("spawned tasks observe the scope's token, not the spawner's") {
  gdr::scheduler s;
  std::stop_source spawners;
  gdr::sync_wait(
      s,
      [&]() -> gdr::task<> {
        gdr::task_scope scope;
        std::stop_token seen;
        scope.spawn(grab_token(seen));
        spawners.request_stop();
        CHECK_FALSE(seen.stop_requested());
        scope.request_stop();
        CHECK(seen.stop_requested());
        CHECK(scope.stop_token().stop_requested());
        co_await scope.join();
      }(),
      spawners.get_token());
}

namespace {

// How a child process that ran `f` ended: killed by SIGABRT, and what it
// wrote to stderr meanwhile. `f` runs in a forked child (a death test).
struct ending {
  bool aborted = false;
  std::string text;
};
template <class F>
ending in_child(F f) {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::signal(SIGABRT, SIG_DFL);  // not doctest's crash report
    ::dup2(p[1], 2);
    f();
    ::_exit(0);
  }
  ::close(p[1]);
  ending e;
  char buf[512];
  for (;;) {
    pollfd pf{p[0], POLLIN, 0};
    if (::poll(&pf, 1, 20'000) != 1) break;
    const ssize_t n = ::read(p[0], buf, sizeof buf);
    if (n <= 0) break;
    e.text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(p[0]);
  int status = 0;
  for (int i = 0; i < 2000 && ::waitpid(pid, &status, WNOHANG) == 0; ++i) std::this_thread::sleep_for(10ms);
  if (::waitpid(pid, &status, WNOHANG) == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  e.aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  return e;
}

}  // namespace

TEST_CASE("destroying a scope with tasks running ends the program, in every build, saying why") {
  coro_test::watchdog wd(60);
  ending e = in_child([] {
    gdr::scheduler s;
    gdr::sync_wait(s, []() -> gdr::task<> {
      int n = 0;
      {
        gdr::task_scope scope;
        scope.spawn(sleep_then_count(10s, n));
        scope.spawn(sleep_then_count(10s, n));
      }  // no join
      co_return;
    }());
  });
  CHECK(e.aborted);
  CHECK(e.text.find("gdr task_scope: destroyed with 2 task(s) running, whose frames point at it: co_await join() "
                    "first") != std::string::npos);
  // While its join() waits: the same.
  e = in_child([] {
    gdr::scheduler s;
    gdr::sync_wait(s, []() -> gdr::task<> {
      int n = 0;
      auto scope = std::make_unique<gdr::task_scope>();
      scope->spawn(sleep_then_count(10s, n));
      gdr::task_scope outer;
      outer.spawn([](gdr::task_scope& sc) -> gdr::task<> { co_await sc.join(); }(*scope));
      scope.reset();
      co_return;
    }());
  });
  CHECK(e.aborted);
  CHECK(e.text.find("gdr task_scope: destroyed with 1 task(s) running and a join() waiting") != std::string::npos);
}

TEST_CASE("a scope destroyed after its join, or that never had a task, ends quietly") {
  gdr::scheduler s;
  gdr::sync_wait(s, []() -> gdr::task<> {
    int n = 0;
    {
      gdr::task_scope scope;
      scope.spawn(sleep_then_count(1ms, n));
      co_await scope.join();
    }
    { gdr::task_scope unused; }
    CHECK(n == 1);
  }());
}
