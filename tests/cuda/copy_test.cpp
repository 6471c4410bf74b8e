// gdr/memory/cuda_copy.hpp: memcpy_async (queue now, wait later) and the copy-engine
// awaitable behind gdr::copy, with random data in every direction
// (H2D, D2H, D2D, and peer D2D where there are two GPUs), in busy_poll and
// sleep mode with both wake strategies.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/memory/cuda_copy.hpp>
#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/stream.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/memory/copy.hpp>

#include "tests/cuda/cuda_test_support.hpp"
#include "tests/support/skip.hpp"

using namespace std::chrono_literals;

// The copy-engine copy's state (two views, the stream, the event operation)
// lives in the coroutine frame: pin its size.
static_assert(sizeof(gdr::cuda::detail::copy_awaitable<int, int, gdr::Device, gdr::Pinned>) <= 136);

TEST_CASE("memcpy_async moves random data H2D, D2D and D2H, then one wait covers the batch") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream s(0);
  const std::size_t n = (std::size_t{1} << 20) + 3;
  gdr::buffer<std::uint32_t, gdr::Pinned> in(n), out(n);
  gdr::buffer<std::uint32_t, gdr::Device> d1(n), d2(n);
  gdr_test::fill_random(in.data(), n, 7);
  std::fill(out.begin(), out.end(), 0u);
  REQUIRE_FALSE(gdr::cuda::memcpy_async(d1.view(), in.view(), s));
  REQUIRE_FALSE(gdr::cuda::memcpy_async(d2.view(), d1.view(), s));
  REQUIRE_FALSE(gdr::cuda::memcpy_async(out.view(), d2.view(), s));
  gdr::sync_wait(sched, [&]() -> gdr::task<> { co_await gdr::cuda::synchronize(s); }());
  CHECK(std::equal(out.begin(), out.end(), in.begin()));
  CHECK(events.stats().completed == 1);
}

TEST_CASE("memcpy_async refuses mismatched sizes and overlapping device ranges, queueing nothing") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::cuda::stream s(0);
  gdr::buffer<int, gdr::Pinned> p(10);
  gdr::buffer<int, gdr::Device> d(20);
  CHECK(gdr::cuda::memcpy_async(d.view(), p.view(), s) == gdr::errc::invalid_argument);
  CHECK(gdr::cuda::memcpy_async(d.view().subview(0, 10), d.view().subview(5, 10), s) == gdr::errc::invalid_argument);
  CHECK_FALSE(gdr::cuda::memcpy_async(d.view().subview(0, 10), d.view().subview(10, 10), s));
  CHECK(cudaStreamSynchronize(s.get()) == cudaSuccess);
  CHECK(gdr::cuda::memcpy_async(d.view().first(0), p.view().first(0), s) == std::error_code{});
}

TEST_CASE("co_await copy round-trips random data in busy_poll and sleep mode with both strategies") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  struct config {
    const char* name;
    gdr::run_mode mode;
    gdr::cuda::wake_strategy wake;
  };
  const config configs[] = {
      {"busy_poll", gdr::run_mode::busy_poll, gdr::cuda::wake_strategy::bounded_poll},
      {"sleep + host_func", gdr::run_mode::sleep, gdr::cuda::wake_strategy::host_func},
      {"sleep + bounded_poll", gdr::run_mode::sleep, gdr::cuda::wake_strategy::bounded_poll},
  };
  gdr::cuda::stream s(0);
  const std::size_t n = std::size_t{16} << 20;  // 64 MiB of uint32_t: ~1.2 ms each way over PCIe
  gdr::buffer<std::uint32_t, gdr::Pinned> in(n), out(n);
  gdr::buffer<std::uint32_t, gdr::Device> d(n), d2(n);
  std::uint32_t seed = 100;
  for (const config& c : configs) {
    const std::string name = c.name;  // doctest prints a plain const char* as an address
    CAPTURE(name);
    gdr::scheduler sched({.mode = c.mode});
    gdr::cuda::event_poller events(sched, {.wake = c.wake, .poll_interval = 30us});
    gdr_test::fill_random(in.data(), n, ++seed);
    std::fill(out.begin(), out.end(), 0u);
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      co_await gdr::copy(d, in, s);
      co_await gdr::copy(d2, d, s);
      co_await gdr::copy(out, d2, s);
    }());
    CHECK(std::equal(out.begin(), out.end(), in.begin()));
    CHECK(events.stats().completed == 3);
    if (c.mode == gdr::run_mode::sleep) CHECK(sched.stats().sleeps >= 1);
    if (c.wake == gdr::cuda::wake_strategy::host_func && c.mode == gdr::run_mode::sleep)
      CHECK(events.stats().host_funcs == 3);
  }
}

TEST_CASE("a failed engine copy is reported by as_result without throwing") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream s(0);
  gdr::buffer<int, gdr::Device> d(16);
  gdr::result<void> r = gdr::sync_wait(sched, [&]() -> gdr::task<gdr::result<void>> {
    co_return co_await gdr::copy(d.view().subview(0, 8), d.view().subview(4, 8), s).as_result();
  }());
  CHECK(r.error() == gdr::errc::invalid_argument);
  CHECK(events.stats().enqueued == 0);
}

TEST_CASE("a device-to-device copy between two GPUs is a peer copy with the data intact") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  if (gdr::cuda::device_count().value() < 2) GDR_SKIP("one GPU: a peer copy needs two");
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream s(0);
  const std::size_t n = std::size_t{1} << 20;
  gdr::buffer<std::uint64_t, gdr::Pinned> in(n), out(n);
  gdr::buffer<std::uint64_t, gdr::Device> d0(n, 0), d1(n, 1);
  gdr_test::fill_random(in.data(), n, 9);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    co_await gdr::copy(d0, in, s);
    co_await gdr::copy(d1, d0, s);
    co_await gdr::copy(d0, d1, s);
    co_await gdr::copy(out, d0, s);
  }());
  CHECK(std::equal(out.begin(), out.end(), in.begin()));
}
