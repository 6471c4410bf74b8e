// gdr/transport/loopback/endpoint.hpp: the two ends on two schedulers, each
// run by its own thread; completions cross threads through scheduler::post.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <stop_token>
#include <thread>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/loopback.hpp>

#include "tests/transport/loopback/test_util.hpp"

using namespace std::chrono_literals;
namespace lb = gdr::loopback;
using gdr::errc;

namespace {

// Fills a message whose contents depend on (seed, i) and ends with its checksum.
std::vector<std::byte> make_message(std::uint64_t seed, std::size_t len) {
  std::vector<std::byte> m(len + 8);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < len; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    m[i] = static_cast<std::byte>(x);
  }
  std::uint64_t h = gdr_test::fnv1a({m.data(), len});
  for (int i = 0; i < 8; ++i) m[len + i] = static_cast<std::byte>(h >> (8 * i));
  return m;
}

bool checksum_ok(const std::byte* p, std::size_t n) {
  if (n < 8) return false;
  std::uint64_t h = 0;
  for (int i = 0; i < 8; ++i) h |= static_cast<std::uint64_t>(p[n - 8 + i]) << (8 * i);
  return h == gdr_test::fnv1a({p, n - 8});
}

// Sizes that cover empty-ish, eager and rendezvous messages.
std::size_t size_of(int i) { return (i % 7 == 0) ? 100000 + i : static_cast<std::size_t>(i % 1000); }

}  // namespace

TEST_CASE("ping-pong between two schedulers on two threads delivers every message intact and in order") {
  gdr_test::watchdog wd(60);
  gdr::scheduler sa, sb;
  auto ends = lb::make_pair(sa, sb);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  constexpr int rounds = 500;
  std::atomic<int> bad{0};
  std::thread tb([&] {
    gdr::sync_wait(sb, [&]() -> gdr::task<> {
      std::vector<std::byte> in(200000);
      for (int i = 0; i < rounds; ++i) {
        std::size_t n = co_await b.recv(gdr::host_view(in), gdr_test::timeout_opts(10s));
        if (n != size_of(i) + 8 || !checksum_ok(in.data(), n)) ++bad;
        std::vector<std::byte> reply = make_message(1000 + i, size_of(i));
        co_await b.send(gdr::host_view(std::as_const(reply)), gdr_test::timeout_opts(10s));
      }
    }());
  });
  gdr::sync_wait(sa, [&]() -> gdr::task<> {
    std::vector<std::byte> in(200000);
    for (int i = 0; i < rounds; ++i) {
      std::vector<std::byte> m = make_message(i, size_of(i));
      co_await a.send(gdr::host_view(std::as_const(m)), gdr_test::timeout_opts(10s));
      std::size_t n = co_await a.recv(gdr::host_view(in), gdr_test::timeout_opts(10s));
      if (n != size_of(i) + 8 || !checksum_ok(in.data(), n) || std::vector<std::byte>(in.begin(), in.begin() + n) != make_message(1000 + i, size_of(i)))
        ++bad;
    }
  }());
  tb.join();
  CHECK(bad == 0);
  CHECK(a.stats().sends == rounds);
  CHECK(b.stats().recvs == rounds);
  CHECK(sa.inflight() == 0);
  CHECK(sb.inflight() == 0);
}

TEST_CASE("streams in both directions at once between two threads arrive in order") {
  gdr_test::watchdog wd(60);
  gdr::scheduler sa, sb;
  auto ends = lb::make_pair(sa, sb);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  constexpr int n = 300;
  std::atomic<int> bad{0};
  // Each side runs a sender and a receiver concurrently on its own loop.
  auto side = [&](gdr::scheduler& s, lb::endpoint& ep, std::uint64_t my_seed, std::uint64_t peer_seed) {
    int done = 0, failed = 0;
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      gdr_test::spawn([&]() -> gdr::task<> {
        for (int i = 0; i < n; ++i) {
          std::vector<std::byte> m = make_message(my_seed + i, size_of(i));
          co_await ep.send(gdr::host_view(std::as_const(m)), gdr_test::timeout_opts(10s));
        }
      }, done, failed);
      gdr_test::spawn([&]() -> gdr::task<> {
        std::vector<std::byte> in(200000);
        for (int i = 0; i < n; ++i) {
          std::size_t len = co_await ep.recv(gdr::host_view(in), gdr_test::timeout_opts(10s));
          if (std::vector<std::byte>(in.begin(), in.begin() + len) != make_message(peer_seed + i, size_of(i))) ++bad;
        }
      }, done, failed);
      while (done < 2) co_await gdr::sleep_for(100us);
    }());
    if (failed != 0) ++bad;
  };
  std::thread tb([&] { side(sb, b, 50000, 0); });
  side(sa, a, 0, 50000);
  tb.join();
  CHECK(bad == 0);
}

TEST_CASE("a receive waiting on one thread is cancelled by a stop request from another thread") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sb;
  gdr::scheduler sa;
  auto ends = lb::make_pair(sa, sb);
  lb::endpoint& b = ends.second;
  std::stop_source src;
  std::atomic<bool> waiting{false};
  std::error_code ec;
  std::thread tb([&] {
    gdr::sync_wait(sb, [&]() -> gdr::task<> {
      std::array<int, 1> x{};
      auto op = b.recv(gdr::host_view(x), gdr_test::stop_opts(src.get_token(), 10s));
      waiting = true;
      gdr::result<std::size_t> r = co_await std::move(op).as_result();
      ec = r.error();
    }());
  });
  while (!waiting) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(5ms);
  src.request_stop();
  tb.join();
  CHECK(ec == errc::cancelled);
  CHECK(sb.inflight() == 0);
}

TEST_CASE("closing an end on its thread fails the peer's operations waiting on another thread") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sa, sb;
  auto ends = lb::make_pair(sa, sb);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::atomic<int> started{0};
  std::error_code ea, eb;
  std::atomic<bool> close_now{false};
  auto waiter = [&](gdr::scheduler& s, lb::endpoint& ep, std::error_code& out, bool closer) {
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      std::array<int, 1> x{};
      auto op = ep.recv(gdr::host_view(x), gdr_test::timeout_opts(10s));
      ++started;
      auto wait = [&]() -> gdr::task<> {
        gdr::result<std::size_t> r = co_await std::move(op).as_result();
        out = r.error();
      };
      auto close = [&]() -> gdr::task<> {
        if (!closer) co_return;
        while (!close_now) co_await gdr::sleep_for(1ms);
        co_await ep.close();
      };
      co_await gdr::when_all(wait(), close());
    }());
  };
  std::thread ta([&] { waiter(sa, a, ea, true); });
  std::thread tb([&] { waiter(sb, b, eb, false); });
  while (started < 2) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(5ms);
  close_now = true;
  ta.join();
  tb.join();
  CHECK(ea == errc::closed);
  CHECK(eb == errc::peer_closed);
}
