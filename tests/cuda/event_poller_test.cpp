// gdr/cuda/event_poller.hpp: CUDA event completion through the scheduler.
// Registration runs anywhere; the rest needs a GPU: one FIFO per stream with
// only the head queried, the event pool, and completion in busy_poll and in
// sleep mode with both wake strategies (host function + eventfd, bounded
// polling).
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/stream.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/cuda/cuda_test_support.hpp"
#include "tests/support/alloc_failure.hpp"
#include "tests/support/skip.hpp"

using namespace std::chrono_literals;

// Hot operation states live in coroutine frames: pin their size so growth is
// a decision (STYLE.md, after UCX's test_obj_size).
static_assert(sizeof(gdr::cuda::event_operation) <= 32);
static_assert(sizeof(gdr::cuda::detail::synchronize_awaitable) <= 80);

TEST_CASE("an event poller attaches to one scheduler and detaches when destroyed") {
  gdr::scheduler sched;
  CHECK(gdr::cuda::event_poller::of(sched) == nullptr);
  {
    gdr::cuda::event_poller events(sched);
    CHECK(gdr::cuda::event_poller::of(sched) == &events);
    CHECK(std::string(events.name()) == "cuda-events");
    CHECK(events.options().wake == gdr::cuda::wake_strategy::bounded_poll);
    CHECK_THROWS_AS(gdr::cuda::event_poller{sched}, gdr::error);
    gdr::poll_status st = events.poll();
    CHECK_FALSE(st.did_work);
    CHECK(st.sleep_bound == std::chrono::nanoseconds::max());  // nothing pending: may sleep forever
  }
  CHECK(gdr::cuda::event_poller::of(sched) == nullptr);
  gdr::scheduler other;
  gdr::cuda::event_poller a(sched), b(other);
  CHECK(gdr::cuda::event_poller::of(sched) == &a);
  CHECK(gdr::cuda::event_poller::of(other) == &b);
}

TEST_CASE("without memory for a new stream's FIFO, enqueue and copy fail with not_enough_memory before any CUDA call") {
  // Runs anywhere: the FIFO's room is found before the first CUDA call.
  // Before the fix the FIFO was added after the event was recorded (or the
  // copy queued), inside noexcept functions: std::terminate on a GPU, and
  // here the CUDA error of the missing driver instead of this one.
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  gdr::cuda::event_operation op;
  op.complete = [](gdr::operation*, int, std::uint32_t) noexcept {};
  struct done_probe : gdr::copy_engine::completion {
    done_probe() {
      done = [](gdr::copy_engine::completion*, std::error_code) noexcept {};
    }
  } c;
  unsigned char host[8] = {}, device_stand_in[8] = {};
  std::error_code enqueued, copied;
  long failed = 0;
  {
    gdr_test_support::failing_allocations oom;
    enqueued = events.enqueue(nullptr, 0, &op);
    copied = events.copy(gdr::copy_engine::direction::to_host, 0, host, device_stand_in, sizeof host, {}, &c);
    failed = oom.failed();
  }
  CHECK(enqueued == std::errc::not_enough_memory);
  CHECK(copied == std::errc::not_enough_memory);
  CHECK(failed == 2);
  CHECK(events.pending() == 0);
  CHECK(events.stats().enqueued == 0);
  CHECK(events.stats().events_created == 0);
}

namespace {
// Records the order in which the poller completes it.
struct probe_op : gdr::cuda::event_operation {
  std::vector<int>* order = nullptr;
  int id = 0;
  int res = 1;
  probe_op() {
    complete = [](gdr::operation* op, int res, std::uint32_t) noexcept {
      auto* self = static_cast<probe_op*>(op);
      self->res = res;
      self->order->push_back(self->id);
    };
  }
};

struct config {
  const char* name;
  gdr::run_mode mode;
  gdr::cuda::wake_strategy wake;
};
constexpr config configs[] = {
    {"busy_poll", gdr::run_mode::busy_poll, gdr::cuda::wake_strategy::bounded_poll},
    {"sleep + host_func", gdr::run_mode::sleep, gdr::cuda::wake_strategy::host_func},
    {"sleep + bounded_poll", gdr::run_mode::sleep, gdr::cuda::wake_strategy::bounded_poll},
};
}  // namespace

TEST_CASE("only the head of each stream's FIFO is queried, and a stream completes in order") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream busy(0), idle(0);
  gdr_test::busy_work work;
  std::vector<int> order;
  probe_op ops[4];
  for (int i = 0; i < 4; ++i) {
    ops[i].order = &order;
    ops[i].id = i;
  }
  work.queue(busy, 8);  // ~2 ms of copies
  REQUIRE_FALSE(events.enqueue(busy.get(), 0, &ops[0]));
  REQUIRE_FALSE(events.enqueue(busy.get(), 0, &ops[1]));
  REQUIRE_FALSE(events.enqueue(busy.get(), 0, &ops[2]));
  REQUIRE(cudaStreamSynchronize(idle.get()) == cudaSuccess);
  REQUIRE_FALSE(events.enqueue(idle.get(), 0, &ops[3]));
  CHECK(events.pending() == 4);
  REQUIRE(cudaStreamSynchronize(idle.get()) == cudaSuccess);
  const auto q0 = events.stats().queries;
  gdr::poll_status st = events.poll();
  // The idle stream's event is done; the busy stream's head is not, and its
  // two followers are not even queried.
  CHECK(st.did_work);
  CHECK(order == std::vector<int>{3});
  CHECK(events.stats().queries - q0 == 2);
  CHECK(st.sleep_bound == events.options().poll_interval);
  while (events.pending() != 0) sched.run_once();
  CHECK(order == std::vector<int>{3, 0, 1, 2});
  for (auto& op : ops) CHECK(op.res == 0);
}

TEST_CASE("events are pooled, so a thousand waits create one event") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream s(0);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    for (int i = 0; i < 1000; ++i) co_await gdr::cuda::synchronize(s);
  }());
  CHECK(events.stats().completed == 1000);
  CHECK(events.stats().events_created == 1);
}

TEST_CASE("a wait on a busy stream completes through the scheduler in every mode and strategy") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr_test::busy_work work;
  gdr::cuda::stream s(0);
  for (const config& c : configs) {
    const std::string name = c.name;  // doctest prints a plain const char* as an address
    CAPTURE(name);
    gdr::scheduler sched({.mode = c.mode});
    gdr::cuda::event_poller events(sched, {.wake = c.wake, .poll_interval = 50us});
    // ~2 ms of copies: longer than the loop's first iterations even under
    // ASan, so that sleep mode really sleeps before the work ends.
    work.queue(s, 16);
    // Marks the end of the work itself. Not s.query(): with (A) the stream
    // still holds the host function when the coroutine may already resume.
    cudaEvent_t work_done = nullptr;
    REQUIRE(cudaEventCreateWithFlags(&work_done, cudaEventDisableTiming) == cudaSuccess);
    REQUIRE(cudaEventRecord(work_done, s.get()) == cudaSuccess);
    const auto t0 = std::chrono::steady_clock::now();
    gdr::sync_wait(sched, [&]() -> gdr::task<> { co_await gdr::cuda::synchronize(s); }());
    const auto waited = std::chrono::steady_clock::now() - t0;
    CHECK(cudaEventQuery(work_done) == cudaSuccess);  // resumed only after the GPU finished
    CHECK(cudaEventDestroy(work_done) == cudaSuccess);
    CHECK(events.stats().completed == 1);
    const auto& ss = sched.stats();
    MESSAGE(name << ": waited " << std::chrono::duration<double, std::micro>(waited).count() << " us, "
                   << events.stats().queries << " queries, " << ss.sleeps << " sleeps, " << ss.iterations
                   << " iterations, " << events.host_funcs_run() << " host functions run");
    if (c.mode == gdr::run_mode::busy_poll) {
      CHECK(ss.sleeps == 0);
      CHECK(events.stats().host_funcs == 0);
    } else if (c.wake == gdr::cuda::wake_strategy::host_func) {
      CHECK(events.stats().host_funcs == 1);
      CHECK(ss.sleeps >= 1);
      // Slept without a bound until the host function's eventfd write: a few
      // queries (about 3), not one per interval.
      CHECK(events.stats().queries <= 6);
    } else {
      CHECK(events.stats().host_funcs == 0);
      CHECK(ss.sleeps >= 1);
      CHECK(events.stats().queries >= 2);
    }
  }
}

TEST_CASE("the destructor waits for host functions still in flight") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::cuda::stream s(0);
  gdr_test::busy_work work;
  for (int round = 0; round < 20; ++round) {
    gdr::scheduler sched({.mode = gdr::run_mode::sleep});
    gdr::cuda::event_poller events(sched, {.wake = gdr::cuda::wake_strategy::host_func});
    if (round % 2) work.queue(s, 1);
    gdr::sync_wait(sched, [&]() -> gdr::task<> { co_await gdr::cuda::synchronize(s); }());
    // The event completed; its host function may not have run yet. Leaving
    // the scope must not free what the callback touches before it returns.
  }
  CHECK(cudaStreamSynchronize(s.get()) == cudaSuccess);
}

TEST_CASE("a coroutine resumed by the poller may destroy the poller") {
  // The quickstart's shape: a coroutine owns the poller and the stream, and
  // its last co_await is resumed from inside poll(); it then destroys both.
  // The poller must not touch itself after completing it (on the heap here,
  // so ASan would name the use-after-free).
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  for (const config& c : configs) {
    const std::string name = c.name;
    CAPTURE(name);
    gdr::scheduler sched({.mode = c.mode});
    gdr_test::busy_work work;
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      auto events = std::make_unique<gdr::cuda::event_poller>(sched, gdr::cuda::event_poller_options{.wake = c.wake});
      gdr::cuda::stream a(0), b(0);
      work.queue(a, 1);
      // Two completions in one poll: the first resumes a coroutine that is
      // still waiting for the second; this one destroys the poller after the
      // second, while poll() is still on the stack.
      auto wait = [](gdr::cuda::stream& s) -> gdr::task<> { co_await gdr::cuda::synchronize(s); };
      co_await gdr::when_all(wait(a), wait(b));
      CHECK(events->pending() == 0);
      events.reset();
    }());
    CHECK(gdr::cuda::event_poller::of(sched) == nullptr);
    gdr::sync_wait(sched, [&]() -> gdr::task<> { co_await gdr::nop(); }());  // the loop still runs
  }
}

TEST_CASE("waits on two streams complete independently") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream busy(0), idle(0);
  gdr_test::busy_work work;
  work.queue(busy, 8);
  bool idle_done = false, busy_still_running = false;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    co_await gdr::cuda::synchronize(idle);
    idle_done = true;
    busy_still_running = !busy.query().value();
    co_await gdr::cuda::synchronize(busy);
  }());
  CHECK(idle_done);
  CHECK(busy_still_running);
  CHECK(busy.query().value());
}

TEST_CASE("a not-ready query leaves no last error for unrelated code to find") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream s(0);
  gdr_test::busy_work work;
  work.queue(s, 4);
  std::vector<int> order;
  probe_op op;
  op.order = &order;
  REQUIRE_FALSE(events.enqueue(s.get(), 0, &op));
  (void)events.poll();
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  while (events.pending() != 0) sched.run_once();
}

namespace {

// A stream awaitable whose issue() says it queued work without doing so, and
// whose drain_issued() records when it runs: the base's control flow after a
// failed event record, on any machine.
struct seam_awaitable : gdr::cuda::detail::stream_awaitable<seam_awaitable> {
  using stream_awaitable::stream_awaitable;
  std::string* log = nullptr;
  std::error_code issue() noexcept {
    *log += "issue ";
    return {};
  }
  void drain_issued() noexcept { *log += "drain "; }
};

// A GPU that does not exist: the poller cannot record an event for it.
constexpr int no_such_gpu = 1 << 20;

gdr::task<> await_seam(std::string& log, gdr::result<void>& r) {
  seam_awaitable a(nullptr, no_such_gpu);
  a.log = &log;
  r = co_await std::move(a).as_result();
  log += "resumed";
}

}  // namespace

TEST_CASE("work queued before a failed event record is waited for before the coroutine resumes") {
  // Runs anywhere. Before the fix the coroutine resumed with the error at
  // once, free to release buffers a queued copy was still using.
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  std::string log;
  gdr::result<void> r;
  gdr::sync_wait(sched, await_seam(log, r));
  CHECK(log == "issue drain resumed");
  CHECK(!r);
  CHECK(events.pending() == 0);
}

namespace {

// Queues real copies on `s`, for an event the poller cannot record.
struct queued_copies : gdr::cuda::detail::stream_awaitable<queued_copies> {
  using stream_awaitable::stream_awaitable;
  gdr_test::busy_work* work = nullptr;
  const gdr::cuda::stream* on = nullptr;
  std::error_code issue() noexcept {
    try {
      work->queue(*on, 16);
    } catch (const gdr::error& e) {
      return e.code();
    }
    return {};
  }
};

gdr::task<> await_copies(queued_copies a, const gdr::cuda::stream& s, gdr::result<void>& r, bool& idle_at_resume) {
  r = co_await std::move(a).as_result();
  idle_at_resume = s.query().value();
}

}  // namespace

TEST_CASE("copies queued before a failed event record have finished when the coroutine resumes") {
  // What only a GPU shows: the base's host wait is a real cudaStreamSynchronize.
  // The awaitable's stream is a real one, its device one that does not
  // exist, so the event fails after 16 copies of 256 MiB (~4 ms) are queued.
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream s(0);
  gdr_test::busy_work work;
  queued_copies a(s.get(), no_such_gpu);
  a.work = &work;
  a.on = &s;
  gdr::result<void> r;
  bool idle = false;
  gdr::sync_wait(sched, await_copies(std::move(a), s, r, idle));
  CHECK(!r);
  CHECK(idle);  // before the fix: the copies were still running
}
