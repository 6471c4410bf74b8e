// Stress: 100k tasks spawned in a scope in batches, on NOPs, timers and
// deadlines, with stop requests fired from another thread at random moments.
// Every task must end exactly once, the counts must add up, and nothing may
// stay in flight. Deterministic inputs (fixed seeds); the interleavings vary
// from run to run, which is the point under TSan.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <stop_token>
#include <thread>
#include <vector>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/timeout.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/coro/coro_test_support.hpp"

using namespace std::chrono_literals;

namespace {

struct counters {
  std::atomic<int> completed{0};
  std::atomic<int> cancelled{0};
  std::atomic<int> timed_out{0};
  std::atomic<int> other{0};
  int total() const { return completed + cancelled + timed_out + other; }
};

void count(const std::error_code& ec, counters& c) {
  if (!ec) {
    c.completed.fetch_add(1, std::memory_order_relaxed);
  } else if (ec == gdr::errc::cancelled) {
    c.cancelled.fetch_add(1, std::memory_order_relaxed);
  } else if (ec == gdr::errc::timed_out) {
    c.timed_out.fetch_add(1, std::memory_order_relaxed);
  } else {
    c.other.fetch_add(1, std::memory_order_relaxed);
  }
}

gdr::task<void> sleep(std::chrono::milliseconds d) { co_await gdr::sleep_for(d); }

// One task: kind 0 a NOP, 1-3 a timer of that many ms, 4 a 10 s sleep under a
// 1 ms deadline (times out unless stopped first), 5 a 1 ms sleep under a 2 ms
// deadline (usually completes). Counts how it ended; never throws.
gdr::task<void> one(int kind, counters& c) {
  std::error_code ec;
  switch (kind) {
    case 0: ec = (co_await gdr::nop().as_result()).error(); break;
    case 1:
    case 2:
    case 3: ec = (co_await gdr::sleep_for(std::chrono::milliseconds(kind)).as_result()).error(); break;
    case 4: ec = (co_await gdr::try_with_timeout(1ms, sleep(10s))).error(); break;
    default: ec = (co_await gdr::try_with_timeout(2ms, sleep(1ms))).error(); break;
  }
  count(ec, c);
}

}  // namespace

TEST_CASE("100k tasks with timers, deadlines and cross-thread cancellation races all finish") {
  coro_test::watchdog wd(300);
  constexpr int total = 100'000;
  constexpr int batch = 2'000;
  gdr::scheduler s;
  std::mt19937 rng(12345);
  counters c;
  int batches_stopped_whole = 0;
  auto t0 = std::chrono::steady_clock::now();

  for (int start = 0; start < total; start += batch) {
    const int round = start / batch;
    std::vector<std::stop_source> sources(batch);
    std::vector<int> kind(batch);
    for (int& k : kind) k = static_cast<int>(rng() % 6);
    std::atomic<gdr::task_scope*> scope_ptr{nullptr};
    std::atomic<bool> racer_done{false};
    // The racer stops about one task in three, in random order with random
    // pauses, while the batch runs; every 8th round it also stops the whole
    // scope half-way through.
    std::thread racer([&, round] {
      std::mt19937 r(static_cast<unsigned>(round) * 7919u + 1u);
      while (scope_ptr.load() == nullptr) std::this_thread::yield();
      for (int n = 0; n < batch / 3; ++n) {
        if (r() % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(r() % 200));
        sources[r() % batch].request_stop();
        if (round % 8 == 0 && n == batch / 6) scope_ptr.load()->request_stop();
      }
      racer_done = true;
    });
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      gdr::task_scope scope;
      scope_ptr = &scope;
      for (int i = 0; i < batch; ++i) {
        auto idx = static_cast<std::size_t>(i);
        scope.spawn(gdr::with_stop_token(sources[idx].get_token(), one(kind[idx], c)));
      }
      // Keep the scope alive (and its address valid for the racer) until the
      // racer is done with it, then join.
      while (!racer_done.load()) co_await gdr::sleep_for(100us);
      if (scope.stop_token().stop_requested()) ++batches_stopped_whole;
      co_await scope.join();
    }());
    racer.join();
    REQUIRE(s.inflight() == 0);
    REQUIRE(c.total() == start + batch);
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(c.total() == total);
  CHECK(c.other == 0);
  CHECK(c.cancelled > 0);
  CHECK(c.timed_out > 0);
  CHECK(c.completed > total / 4);
  CHECK(batches_stopped_whole == 7);
  MESSAGE("completed " << c.completed.load() << ", cancelled " << c.cancelled.load() << ", timed out "
                       << c.timed_out.load() << " in " << secs << " s");
}
