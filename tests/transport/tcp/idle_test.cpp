// gdr/transport/tcp/connection.hpp and gdr/protocol/engine.hpp: what an idle
// endpoint holds (no reply slot, no heap staging buffer), and what happens
// when the memory they are made of on first need is not there.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <system_error>
#include <utility>
#include <vector>

#include <gdr/sched/timer.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/support/alloc_failure.hpp"
#include "tests/transport/tcp/tcp_test_util.hpp"

namespace tcp = gdr::tcp;
using gdr_test_support::failing_allocations;
using tcp_test::connected_pair;

namespace {

// The budget of one idle endpoint (the goal; benchmarks/RESULTS.md,
// "Idle endpoints").
constexpr long long idle_budget = 8 * 1024;


}  // namespace

TEST_CASE("an idle endpoint holds at most 8 KiB of heap") {
  tcp_test::watchdog wd(30);
  constexpr int conns = 32;
  gdr::scheduler sched;
  tcp::listener l(sched, tcp::address::loopback(0));
  std::vector<tcp::endpoint> eps;
  eps.reserve(2 * conns);
  long long before = 0, after = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    // One connection first, so that what the scheduler and the listener
    // allocate once is not counted.
    {
      auto acc = l.accept();
      tcp::endpoint a = co_await tcp::connect(sched, l.local_address());
      tcp::endpoint b = co_await std::move(acc);
      REQUIRE(co_await tcp_test::handshake_done(a, b));
    }
    before = gdr_test_support::live_bytes();
    for (int i = 0; i < conns; ++i) {
      auto acc = l.accept();
      tcp::endpoint a = co_await tcp::connect(sched, l.local_address());
      tcp::endpoint b = co_await std::move(acc);
      REQUIRE(co_await tcp_test::handshake_done(a, b));
      eps.push_back(std::move(a));
      eps.push_back(std::move(b));
    }
    after = gdr_test_support::live_bytes();
  }());
  const long long per_endpoint = (after - before) / (2 * conns);
  MESSAGE("heap per idle endpoint: " << per_endpoint << " bytes");
  CHECK(per_endpoint > 0);
  CHECK(per_endpoint <= idle_budget);
}

TEST_CASE("a put or get the target cannot allocate a reply slot for fails with not_enough_memory, and the endpoint goes on") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::uint32_t> mem(64, 0);
  auto r = gdr::register_memory(reg, gdr::host_view(mem));
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::array<std::uint32_t, 8> src{};
    std::iota(src.begin(), src.end(), 100u);
    std::array<std::uint32_t, 8> back{};
    auto remote = r.describe().subview(10, 8);
    {
      failing_allocations oom;
      gdr::result<std::size_t> p = co_await a.put(gdr::host_view(src), remote).as_result();
      gdr::result<std::size_t> g = co_await a.get(gdr::host_view(back), remote).as_result();
      CHECK(oom.failed() >= 2);
      REQUIRE(!p);
      CHECK(p.error() == std::errc::not_enough_memory);
      REQUIRE(!g);
      CHECK(g.error() == std::errc::not_enough_memory);
    }
    CHECK(b.stats().no_memory == 2);
    CHECK(mem[10] == 0);  // nothing was written
    // With memory again, both go through on the same connection.
    CHECK(co_await a.put(gdr::host_view(src), remote) == 32);
    CHECK(co_await a.get(gdr::host_view(back), remote) == 32);
    CHECK(back == src);
    CHECK(b.stats().served_puts == 1);
    CHECK(b.stats().served_gets == 1);
    co_await a.close();
    co_await b.close();
  }());
  CHECK(mem[10] == 100);
}

TEST_CASE("requests beyond the spare slot wait for its answer and fail alike") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::uint32_t> mem(64, 0);
  auto r = gdr::register_memory(reg, gdr::host_view(mem));
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg);
    auto& a = ab_pair.first;
    auto& b = ab_pair.second;
    std::array<std::uint32_t, 8> src{};
    auto remote = r.describe().subview(0, 8);
    // Three puts at once: the target has no slot and none can be made, so
    // the first is answered from the spare, and the others find it busy
    // (the target's reader pauses) until its answer is written. Started
    // before the failures are armed (their frames are allocated); the
    // target reads them once this coroutine waits.
    std::array<gdr::op_report, 3> rep{};
    int done = 0;
    for (auto& x : rep) tcp_test::start(a.put(gdr::host_view(src), remote), x, done);
    {
      failing_allocations oom;
      for (int i = 0; i < 5000 && done < 3; ++i) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    }
    REQUIRE(done == 3);
    for (auto& x : rep) CHECK(x.error == std::errc::not_enough_memory);
    CHECK(b.stats().no_memory == 3);
    CHECK(b.stats().paused >= 1);
    CHECK(co_await a.put(gdr::host_view(src), remote) == 32);
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("a staging buffer that cannot grow reads on through the inline one") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;
    auto& b = ab_pair.second;
    // 12 KiB: eager, and under the direct-read threshold, so every byte
    // comes through the staging buffer.
    std::vector<std::uint8_t> src(12 * 1024), dst(src.size());
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 13 + 5);
    const std::uint64_t reads0 = b.stats().reads;
    gdr::op_report rs{}, rr{};
    int done = 0;
    tcp_test::start(b.recv(gdr::host_view(dst)), rr, done);
    tcp_test::start(a.send(gdr::host_view(src)), rs, done);
    {
      failing_allocations oom;
      for (int i = 0; i < 5000 && done < 2; ++i) co_await gdr::sleep_for(std::chrono::milliseconds(1));
      CHECK(oom.failed() >= 1);  // the heap buffer was asked for and refused
    }
    REQUIRE(done == 2);
    CHECK(!rr.error);
    CHECK(rr.bytes == src.size());
    CHECK(dst == src);
    const std::uint64_t small_reads = b.stats().reads - reads0;
    CHECK(small_reads >= src.size() / 512);
    // With memory, the next full read makes the heap buffer: the same
    // message again takes far fewer reads.
    std::fill(dst.begin(), dst.end(), 0);
    const std::uint64_t reads1 = b.stats().reads;
    done = 0;
    tcp_test::start(b.recv(gdr::host_view(dst)), rr, done);
    co_await a.send(gdr::host_view(src));
    for (int i = 0; i < 5000 && done < 1; ++i) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    REQUIRE(done == 1);
    CHECK(dst == src);
    CHECK(b.stats().reads - reads1 < small_reads);
    co_await a.close();
    co_await b.close();
  }());
}
