#include <doctest/doctest.h>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/timer.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {
// One stress task: a NOP (kind 0) or a timer of 1-3 ms; counts how it ended.
gdr::task<> one(int kind, std::atomic<int>& completed, std::atomic<int>& cancelled) {
  gdr::result<void> r;
  if (kind == 0) r = co_await gdr::nop().as_result();
  else r = co_await gdr::sleep_for(std::chrono::milliseconds(kind)).as_result();
  if (r) completed.fetch_add(1);
  else if (r.error() == gdr::errc::cancelled) cancelled.fetch_add(1);
}
}  // namespace

// 100k tasks in batches on one scheduler: NOPs, short timers, and stop
// requests fired from another thread at random moments. Every task must end
// (completed or cancelled), the counts must add up, and nothing may stay in
// flight. Fixed seed: the same schedule of sizes every run.
TEST_CASE("100k tasks with timers and cross-thread cancellation races all finish") {
  constexpr int total = 100'000;
  constexpr int batch = 2'000;
  gdr::scheduler s;
  std::mt19937 rng(12345);
  std::atomic<int> completed{0}, cancelled{0};

  for (int start = 0; start < total; start += batch) {
    std::vector<std::stop_source> sources(batch);
    std::vector<int> kind(batch);
    for (int& k : kind) k = static_cast<int>(rng() % 4);
    std::atomic<bool> go{false}, done{false};
    // The racer stops every other task at a random moment while the batch runs.
    std::thread racer([&] {
      std::mt19937 r(static_cast<unsigned>(start));
      while (!go) std::this_thread::yield();
      for (int i = 0; i < batch; i += 2) {
        if (r() % 8 == 0) std::this_thread::yield();
        sources[static_cast<std::size_t>(i)].request_stop();
      }
      done = true;
    });
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      gdr::task_scope scope;
      for (int i = 0; i < batch; ++i) {
        int k = kind[static_cast<std::size_t>(i)];
        scope.spawn(gdr::with_stop_token(sources[static_cast<std::size_t>(i)].get_token(), one(k, completed, cancelled)));
      }
      go = true;
      co_await scope.join();
    }());
    racer.join();
    CHECK(done);
    CHECK(s.inflight() == 0);
  }
  CHECK(completed + cancelled == total);
  CHECK(cancelled > 0);
  CHECK(completed > total / 2);
  MESSAGE("completed " << completed.load() << ", cancelled " << cancelled.load());
}
