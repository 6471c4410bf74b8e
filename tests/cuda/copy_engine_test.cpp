// gdr/cuda/event_poller.hpp as the staged path's copy engine
// (gdr::copy_engine, gdr/sched/copy_engine.hpp). The slots and the argument
// checks run anywhere; the copies need a GPU: round trips of random bytes
// through pinned memory, completion order per direction, both directions at
// once, stream ordering with `after`, node reuse, and a completion that
// destroys the poller.
#include <doctest/doctest.h>

#include <algorithm>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <ostream>
#include <string>
#include <system_error>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/stream.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/scheduler.hpp>

#include "tests/cuda/cuda_test_support.hpp"
#include "tests/support/skip.hpp"

using direction = gdr::copy_engine::direction;

// The copy flag lives in event_operation's padding.
static_assert(sizeof(gdr::cuda::event_operation) <= 32);

namespace {

// Counts a copy's completions and records their order.
struct probe : gdr::copy_engine::completion {
  std::vector<int>* order = nullptr;
  int id = 0;
  int calls = 0;
  std::error_code ec;
  probe() {
    done = [](gdr::copy_engine::completion* c, std::error_code ec) noexcept {
      auto* self = static_cast<probe*>(c);
      ++self->calls;
      self->ec = ec;
      if (self->order != nullptr) self->order->push_back(self->id);
    };
  }
};

// `co_await copied(engine, ...)`: queues the copy and resumes from the
// engine's poll() with its error code.
struct copy_wait : gdr::copy_engine::completion {
  gdr::copy_engine* engine = nullptr;
  direction d = direction::to_host;
  int device = 0;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t n = 0;
  gdr::stream_order after{};
  std::error_code ec{};
  std::coroutine_handle<> waiter{};

  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) noexcept {
    waiter = h;
    done = [](gdr::copy_engine::completion* c, std::error_code e) noexcept {
      auto* self = static_cast<copy_wait*>(c);
      self->ec = e;
      self->waiter.resume();
    };
    ec = engine->copy(d, device, dst, src, n, after, this);
    return !ec;  // not queued: resume at once with the error
  }
  std::error_code await_resume() const noexcept { return ec; }
};

copy_wait copied(gdr::copy_engine& e, direction d, void* dst, const void* src, std::size_t n,
                 gdr::stream_order after = {}) {
  copy_wait w;
  w.engine = &e;
  w.d = d;
  w.dst = dst;
  w.src = src;
  w.n = n;
  w.after = after;
  return w;
}

// Pinned memory from a copy engine, given back to it.
class pinned {
 public:
  pinned(gdr::copy_engine& e, std::size_t n) : b_(e.allocate_pinned(n)) {}
  pinned(const pinned&) = delete;
  pinned& operator=(const pinned&) = delete;
  ~pinned() {
    if (b_.data != nullptr) b_.release(b_.data, b_.size);
  }
  unsigned char* data() const noexcept { return reinterpret_cast<unsigned char*>(b_.data); }

 private:
  gdr::copy_engine::pinned_block b_;
};

// A copy engine that is not CUDA's (as a test without a GPU would install).
class other_engine final : public gdr::copy_engine {
 public:
  explicit other_engine(gdr::scheduler& s) : s_(&s) { claimed = s.claim_poller_slot(*this); }
  ~other_engine() override { s_->release_poller_slot(*this); }
  std::error_code copy(direction, int, void*, const void*, std::size_t, gdr::stream_order,
                       completion*) noexcept override {
    return make_error_code(gdr::errc::unsupported);
  }
  pinned_block allocate_pinned(std::size_t) noexcept override { return {}; }
  gdr::poll_status poll() noexcept override { return {}; }
  const char* name() const noexcept override { return "other"; }
  bool claimed = false;

 private:
  gdr::scheduler* s_;
};

std::size_t pollers_of(const gdr::scheduler& s) { return gdr::detail::scheduler_testing::poller_count(s); }

}  // namespace

TEST_CASE("the event poller is its scheduler's copy engine, polled once, and gives the slot back") {
  gdr::scheduler sched;
  CHECK(gdr::copy_engine::of(sched) == nullptr);
  {
    gdr::cuda::event_poller events(sched);
    CHECK(gdr::copy_engine::of(sched) == static_cast<gdr::copy_engine*>(&events));
    CHECK(gdr::cuda::event_poller::of(sched) == &events);
    CHECK(events.is_copy_engine());
    CHECK(pollers_of(sched) == 1);
    // A second event poller is refused and leaves both slots alone.
    CHECK_THROWS_AS(gdr::cuda::event_poller{sched}, gdr::error);
    CHECK(gdr::copy_engine::of(sched) == static_cast<gdr::copy_engine*>(&events));
    CHECK(pollers_of(sched) == 1);
  }
  CHECK(gdr::copy_engine::of(sched) == nullptr);
  CHECK(gdr::cuda::event_poller::of(sched) == nullptr);
  CHECK(pollers_of(sched) == 0);
}

TEST_CASE("a copy engine that was there first keeps its slot") {
  gdr::scheduler sched;
  other_engine other(sched);
  REQUIRE(other.claimed);
  {
    gdr::cuda::event_poller events(sched);
    CHECK(gdr::copy_engine::of(sched) == &other);
    CHECK(gdr::cuda::event_poller::of(sched) == &events);
    CHECK_FALSE(events.is_copy_engine());
  }
  // Leaving did not take the slot from its holder.
  CHECK(gdr::copy_engine::of(sched) == &other);
  // And the other way round: a copy engine arriving second gets no slot.
  gdr::scheduler sched2;
  gdr::cuda::event_poller events2(sched2);
  other_engine late(sched2);
  CHECK_FALSE(late.claimed);
  CHECK(gdr::copy_engine::of(sched2) == static_cast<gdr::copy_engine*>(&events2));
}

TEST_CASE("invalid arguments are refused at once and complete nothing") {
  // Checked before any CUDA call, so this runs without a GPU too.
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  unsigned char a[16] = {}, b[16] = {};
  probe p;
  gdr::copy_engine::completion no_done;  // done == nullptr
  // Never used: the missing device is refused first.
  const gdr::stream_order no_device{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000}), -1};
  const auto invalid = make_error_code(gdr::errc::invalid_argument);
  CHECK(events.copy(direction::to_host, 0, a, b, 0, {}, &p) == invalid);
  CHECK(events.copy(direction::to_host, -1, a, b, 16, {}, &p) == invalid);
  CHECK(events.copy(direction::to_device, 0, nullptr, b, 16, {}, &p) == invalid);
  CHECK(events.copy(direction::to_device, 0, a, nullptr, 16, {}, &p) == invalid);
  CHECK(events.copy(direction::to_host, 0, a, b, 16, {}, nullptr) == invalid);
  CHECK(events.copy(direction::to_host, 0, a, b, 16, {}, &no_done) == invalid);
  CHECK(events.copy(direction::to_host, 0, a, b, 16, no_device, &p) == invalid);
  for (int i = 0; i < 10; ++i) sched.run_once();
  CHECK(p.calls == 0);
  CHECK(events.pending() == 0);
  CHECK(events.stats().copies == 0);
  CHECK(events.stats().streams_created == 0);
}

TEST_CASE("a copy on a GPU that cannot be used fails at once with the CUDA error and completes nothing") {
  // Without a GPU every ordinal is such a GPU; with one, an absurd ordinal.
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  unsigned char a[16] = {}, b[16] = {};
  probe p;
  const bool gpu = gdr_test::no_gpu_reason().empty();
  const int device = gpu ? 1000 : 0;
  std::error_code ec = events.copy(direction::to_device, device, a, b, 16, {}, &p);
  CHECK(ec);
  CHECK(ec.category() == gdr::cuda::cuda_category());
  MESSAGE("copy on GPU " << device << ": " << ec.message());
  for (int i = 0; i < 10; ++i) sched.run_once();
  CHECK(p.calls == 0);
  CHECK(events.pending() == 0);
  CHECK(events.stats().streams_created == 0);
  // check() cleared it (without a driver the runtime's failed start stays
  // the last error, whatever clears it).
  if (gpu) CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("random bytes go device to pinned host and back, every byte intact") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  gdr::copy_engine& engine = *gdr::copy_engine::of(sched);
  const std::size_t sizes[] = {1, 4095, (std::size_t{1} << 20) + 3, std::size_t{64} << 20};
  for (std::size_t n : sizes) {
    for (std::size_t off : {0, 1}) {  // 1: neither end aligned
      CAPTURE(n);
      CAPTURE(off);
      std::vector<unsigned char> want(n), back(n, 0);
      gdr_test::fill_random(want.data(), n, static_cast<std::uint32_t>(n + off));
      gdr::buffer<unsigned char, gdr::Device> d1(n + off), d2(n + off);
      pinned host(engine, n + off);
      REQUIRE(host.data() != nullptr);
      cudaPointerAttributes attr{};
      REQUIRE(cudaPointerGetAttributes(&attr, host.data()) == cudaSuccess);
      CHECK(attr.type == cudaMemoryTypeHost);  // page-locked and known to the driver
      std::memset(host.data(), 0, n + off);
      REQUIRE(cudaMemcpy(d1.data() + off, want.data(), n, cudaMemcpyHostToDevice) == cudaSuccess);
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        std::error_code ec = co_await copied(engine, direction::to_host, host.data() + off, d1.data() + off, n);
        CHECK_FALSE(ec);
        CHECK(std::memcmp(host.data() + off, want.data(), n) == 0);
        ec = co_await copied(engine, direction::to_device, d2.data() + off, host.data() + off, n);
        CHECK_FALSE(ec);
      }());
      REQUIRE(cudaMemcpy(back.data(), d2.data() + off, n, cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(back == want);
    }
  }
  CHECK(events.stats().streams_created == 2);  // one per direction, made on first use
  CHECK(events.stats().copy_nodes == 1);       // one copy in flight at a time: one node, reused
  CHECK(events.stats().copies == 16);
  CHECK(events.pending() == 0);
}

TEST_CASE("copies of one direction complete in the order queued, and their nodes are reused") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  constexpr int k = 16;
  constexpr std::size_t chunk = std::size_t{4} << 20;
  gdr::buffer<unsigned char, gdr::Device> src(k * chunk), dst(k * chunk);
  pinned down(events, k * chunk), up(events, k * chunk);
  REQUIRE(down.data() != nullptr);
  REQUIRE(up.data() != nullptr);
  gdr_test::fill_random(up.data(), k * chunk, 11);
  std::vector<unsigned char> want(k * chunk);
  gdr_test::fill_random(want.data(), k * chunk, 12);
  REQUIRE(cudaMemcpy(src.data(), want.data(), k * chunk, cudaMemcpyHostToDevice) == cudaSuccess);
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    std::vector<int> to_host_order, to_device_order;
    std::vector<probe> ps(2 * k);
    for (int i = 0; i < k; ++i) {
      ps[i].order = &to_host_order;
      ps[i].id = i;
      ps[k + i].order = &to_device_order;
      ps[k + i].id = i;
      const std::size_t o = i * chunk;
      REQUIRE_FALSE(events.copy(direction::to_host, 0, down.data() + o, src.data() + o, chunk, {}, &ps[i]));
      REQUIRE_FALSE(events.copy(direction::to_device, 0, dst.data() + o, up.data() + o, chunk, {}, &ps[k + i]));
    }
    CHECK(events.pending() == 2 * k);
    for (const probe& p : ps) CHECK(p.calls == 0);  // never inside copy()
    while (events.pending() != 0) sched.run_once();
    std::vector<int> in_order(k);
    std::iota(in_order.begin(), in_order.end(), 0);
    CHECK(to_host_order == in_order);
    CHECK(to_device_order == in_order);
    for (const probe& p : ps) {
      CHECK(p.calls == 1);
      CHECK_FALSE(p.ec);
    }
    CHECK(std::memcmp(down.data(), want.data(), k * chunk) == 0);
    std::vector<unsigned char> back(k * chunk);
    REQUIRE(cudaMemcpy(back.data(), dst.data(), k * chunk, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(std::memcmp(back.data(), up.data(), k * chunk) == 0);
    // The second round finds every node on the freelist.
    CHECK(events.stats().copy_nodes == 2 * k);
  }
}

TEST_CASE("a poll completes at most 64 copies and asks to be polled again, keeping the order") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  constexpr int k = 150;
  gdr::buffer<unsigned char, gdr::Device> dev(k);
  pinned host(events, k);
  REQUIRE(host.data() != nullptr);
  std::vector<int> order;
  std::vector<probe> ps(k);
  for (int i = 0; i < k; ++i) {
    ps[i].order = &order;
    ps[i].id = i;
    REQUIRE_FALSE(events.copy(direction::to_host, 0, host.data() + i, dev.data() + i, 1, {}, &ps[i]));
  }
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // every copy's event has completed
  gdr::poll_status st = events.poll();
  CHECK(st.did_work);
  CHECK(order.size() == 64);
  CHECK(events.pending() == k - 64);
  st = events.poll();
  CHECK(st.did_work);
  CHECK(order.size() == 128);
  st = events.poll();
  CHECK(order.size() == k);
  CHECK(events.pending() == 0);
  std::vector<int> in_order(k);
  std::iota(in_order.begin(), in_order.end(), 0);
  CHECK(order == in_order);
}

TEST_CASE("a small host-to-device copy does not wait behind a large device-to-host one") {
  // One stream per direction: the two run on the GPU's two copy engines.
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  constexpr std::size_t big = std::size_t{256} << 20, small = 4096;
  gdr::buffer<unsigned char, gdr::Device> dev_big(big), dev_small(small);
  pinned host_big(events, big), host_small(events, small);
  REQUIRE(host_big.data() != nullptr);
  REQUIRE(host_small.data() != nullptr);
  std::vector<unsigned char> want(big);
  gdr_test::fill_random(want.data(), big, 21);
  REQUIRE(cudaMemcpy(dev_big.data(), want.data(), big, cudaMemcpyHostToDevice) == cudaSuccess);
  gdr_test::fill_random(host_small.data(), small, 22);
  std::vector<int> order;
  probe down, up;
  down.order = up.order = &order;
  down.id = 0;
  up.id = 1;
  REQUIRE_FALSE(events.copy(direction::to_host, 0, host_big.data(), dev_big.data(), big, {}, &down));
  REQUIRE_FALSE(events.copy(direction::to_device, 0, dev_small.data(), host_small.data(), small, {}, &up));
  while (events.pending() != 0) sched.run_once();
  CHECK(order == std::vector<int>{1, 0});  // on one stream the small copy would finish last
  CHECK(down.calls == 1);
  CHECK(up.calls == 1);
  CHECK_FALSE(down.ec);
  CHECK_FALSE(up.ec);
  CHECK(std::memcmp(host_big.data(), want.data(), big) == 0);
  std::vector<unsigned char> back(small);
  REQUIRE(cudaMemcpy(back.data(), dev_small.data(), small, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::memcmp(back.data(), host_small.data(), small) == 0);
  CHECK(events.stats().streams_created == 2);
}

TEST_CASE("a copy with `after` reads what the user's stream wrote, without a host wait") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream user(0);
  gdr_test::busy_work work;
  constexpr std::size_t n = std::size_t{1} << 20;
  constexpr unsigned char pattern = 0x5a;
  gdr::buffer<unsigned char, gdr::Device> src(n);
  pinned host(events, n);
  REQUIRE(host.data() != nullptr);
  // Queues ~4 ms of copies, then the write of the pattern, on the user's
  // stream; returns the bytes of the pattern the copy saw.
  auto run = [&](bool ordered) {
    REQUIRE(cudaMemset(src.data(), 0, n) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::memset(host.data(), 0, n);
    work.queue(user, 16);
    REQUIRE(cudaMemsetAsync(src.data(), pattern, n, user.get()) == cudaSuccess);
    probe p;
    const gdr::stream_order after = ordered ? gdr::cuda::after(user) : gdr::stream_order{};
    REQUIRE_FALSE(events.copy(direction::to_host, 0, host.data(), src.data(), n, after, &p));
    if (ordered) CHECK_FALSE(user.query().value());  // copy() returned while the user's work runs
    while (p.calls == 0) sched.run_once();
    CHECK_FALSE(p.ec);
    if (ordered) CHECK(user.query().value());  // completed only after the user's work
    REQUIRE(cudaStreamSynchronize(user.get()) == cudaSuccess);
    return static_cast<std::size_t>(std::count(host.data(), host.data() + n, pattern));
  };
  const std::size_t unordered = run(false);
  MESSAGE("without `after`, the copy saw " << unordered << " of " << n << " bytes of the pattern");
  CHECK(run(true) == n);
}

TEST_CASE("a copy's completion may destroy the poller") {
  // The copies' nodes belong to the poller: poll() must not read them after
  // the first completion (on the heap here, so ASan would name the
  // use-after-free).
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  constexpr std::size_t n = std::size_t{1} << 20;
  gdr::buffer<unsigned char, gdr::Device> dev(2 * n);
  std::vector<unsigned char> want(2 * n);
  gdr_test::fill_random(want.data(), 2 * n, 31);
  REQUIRE(cudaMemcpy(dev.data(), want.data(), 2 * n, cudaMemcpyHostToDevice) == cudaSuccess);
  std::vector<unsigned char> got(2 * n);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto events = std::make_unique<gdr::cuda::event_poller>(sched);
    {
      pinned host(*events, 2 * n);
      REQUIRE(host.data() != nullptr);
      // Two directions' worth of streams would finish apart; two copies on
      // one stream finish in one poll more often. Either way the last
      // completion resumes this coroutine inside poll().
      auto one = [&](std::size_t o) -> gdr::task<> {
        CHECK_FALSE(co_await copied(*events, direction::to_host, host.data() + o, dev.data() + o, n));
      };
      co_await gdr::when_all(one(0), one(n));
      std::memcpy(got.data(), host.data(), 2 * n);
    }
    CHECK(events->pending() == 0);
    events.reset();
  }());
  CHECK(gdr::copy_engine::of(sched) == nullptr);
  CHECK(got == want);
}
