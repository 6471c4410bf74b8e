// co_await gdr::copy(dst, src[, stream]): the path follows from the spaces.
// CPU pairs run everywhere; copy-engine pairs (Pinned <-> Device, Device <->
// Device) run on a GPU with random data, and skip elsewhere saying why.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/memory/copy.hpp>
#include <gdr/sched/scheduler.hpp>

#if GDR_HAS_CUDA
#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/stream.hpp>
#endif

#include "tests/memory/memory_test_support.hpp"
#include "tests/support/skip.hpp"

namespace {
template <class Dst, class Src>
void host_round(std::uint32_t seed) {
  gdr::scheduler sched;
  gdr::buffer<std::uint64_t, Src> src(4099);
  gdr::buffer<std::uint64_t, Dst> dst(4099);
  gdr_test::fill_random(src.data(), src.size(), seed);
  std::fill(dst.begin(), dst.end(), 0);
  gdr::sync_wait(sched, [&]() -> gdr::task<> { co_await gdr::copy(dst, src); }());
  CHECK(std::equal(dst.begin(), dst.end(), src.begin()));
}
}  // namespace

TEST_CASE("every CPU pair copies random data exactly, without a stream") {
  host_round<gdr::Host, gdr::Host>(1);
  host_round<gdr::Host, gdr::Pinned>(2);
  host_round<gdr::Pinned, gdr::Host>(3);
  host_round<gdr::Pinned, gdr::Pinned>(4);
}

TEST_CASE("a CPU copy completes inside the co_await, without suspending") {
  std::vector<int> a{1, 2, 3}, b(3);
  auto op = gdr::copy(gdr::host_view(b), gdr::host_view(a));
  CHECK(op.await_ready());
  // Nothing is copied before the co_await: the copy is lazy like a task.
  CHECK(b[0] == 0);
  op.await_resume();
  CHECK(b == a);
}

TEST_CASE("a size mismatch throws invalid_argument at the co_await and copies nothing") {
  gdr::scheduler sched;
  std::vector<int> a{1, 2, 3, 4}, b(3, 0);
  auto body = [&]() -> gdr::task<> { co_await gdr::copy(gdr::host_view(b), gdr::host_view(a)); };
  try {
    gdr::sync_wait(sched, body());
    FAIL("no error");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::invalid_argument);
  }
  CHECK(b == std::vector<int>{0, 0, 0});
}

TEST_CASE("as_result reports a size mismatch without throwing") {
  gdr::scheduler sched;
  std::vector<int> a{1, 2}, b(3);
  gdr::result<void> r = gdr::sync_wait(sched, [&]() -> gdr::task<gdr::result<void>> {
    co_return co_await gdr::copy(gdr::host_view(b), gdr::host_view(a)).as_result();
  }());
  CHECK(r.error() == gdr::errc::invalid_argument);
}

TEST_CASE("overlapping host ranges copy as if through a temporary") {
  std::vector<int> v{1, 2, 3, 4, 5, 6};
  auto whole = gdr::host_view(v);
  auto op = gdr::copy(whole.subview(1, 5), whole.subview(0, 5));
  op.await_resume();
  CHECK(v == std::vector<int>{1, 1, 2, 3, 4, 5});
}

TEST_CASE("a copy of const elements into mutable ones is fine") {
  const std::vector<int> a{9, 8};
  std::vector<int> b(2);
  gdr::copy(gdr::host_view(b), gdr::host_view(a)).await_resume();
  CHECK(b == std::vector<int>{9, 8});
}

#if GDR_HAS_CUDA
namespace {
// Host -> Pinned -> Device -> Device -> Pinned -> Host, every hop through gdr::copy.
gdr::task<> staged_round_trip(const gdr::cuda::stream& s, std::size_t n, bool& ok) {
  std::vector<std::uint32_t> host(n), back(n, 0);
  gdr_test::fill_random(host.data(), n, 42);
  gdr::buffer<std::uint32_t, gdr::Pinned> up(n), down(n);
  gdr::buffer<std::uint32_t, gdr::Device> d1(n, s.device()), d2(n, s.device());
  co_await gdr::copy(up, gdr::host_view(host));
  co_await gdr::copy(d1, up, s);
  co_await gdr::copy(d2, d1, s);
  co_await gdr::copy(down, d2, s);
  co_await gdr::copy(gdr::host_view(back), down, s);  // a CPU pair: the stream is not used
  ok = back == host;
}
}  // namespace

TEST_CASE("a staged round trip through two device buffers returns the random data") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream s(0);
  for (std::size_t n : {std::size_t{1}, std::size_t{4097}, std::size_t{1} << 22}) {
    bool ok = false;
    gdr::sync_wait(sched, staged_round_trip(s, n, ok));
    CHECK_MESSAGE(ok, "n = " << n);
  }
  CHECK(events.pending() == 0);
  CHECK(events.stats().completed == 9);
}

TEST_CASE("an engine copy with a size mismatch throws at the co_await and queues nothing") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched;
  gdr::cuda::event_poller events(sched);
  gdr::cuda::stream s(0);
  gdr::buffer<int, gdr::Pinned> p(10);
  gdr::buffer<int, gdr::Device> d(11);
  auto body = [&]() -> gdr::task<> { co_await gdr::copy(d, p, s); };
  CHECK_THROWS_AS(gdr::sync_wait(sched, body()), gdr::error);
  CHECK(events.stats().enqueued == 0);
}

TEST_CASE("an engine copy without an event poller fails with a sentence saying to create one") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched;
  gdr::cuda::stream s(0);
  gdr::buffer<int, gdr::Pinned> p(10);
  gdr::buffer<int, gdr::Device> d(10);
  try {
    gdr::sync_wait(sched, [&]() -> gdr::task<> { co_await gdr::copy(d, p, s); }());
    FAIL("no error");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::invalid_argument);
    CHECK(std::string(e.what()).find("event_poller") != std::string::npos);
  }
  // The copy was never queued: nothing may still write into p or d.
  CHECK(s.query().value());
}
#endif
