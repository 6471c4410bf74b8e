// Direct one-sided operations on verbs (gdr/transport/verbs/rma.hpp): puts,
// gets and atomics that the initiator's NIC posts into memory the owner
// exposed, with no action by the owner; batches, notifications, flushes,
// stops, and faults contained to the one-sided lane. Needs an RDMA device
// and GDR_VERBS_IP; skips with the reason otherwise.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <semaphore>
#include <span>
#include <stop_token>
#include <thread>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/verbs/support.hpp"

using namespace std::chrono_literals;
using namespace verbs_test;

namespace {

gdr::view<std::uint64_t, gdr::Host> words(std::vector<std::uint64_t>& v) { return {v.data(), v.size()}; }

}  // namespace

TEST_CASE("a peer puts, gets and adds into exposed memory while the owner's scheduler does not run at all") {
  REQUIRE_VERBS();
  gdr_test_support::watchdog dog(60);
  const std::string ip = conformance::verbs_ip();
  const std::size_t n = 1 << 20;
  std::vector<std::byte> window(n);
  std::vector<std::uint64_t> counter = {0};
  auto reg = gdr::register_memory(host(window));
  auto creg = gdr::register_memory(words(counter));
  std::atomic<std::uint16_t> port{0};
  std::binary_semaphore connected{0}, owner_may_run{0};
  gdr::verbs::endpoint_stats owner_before{}, owner_after{};
  std::uint64_t owner_loops_before = 0, owner_loops_during = 0;
  // The owner: accepts, then its thread blocks (its loop does not run)
  // until the peer is done, then closes.
  std::thread owner([&] {
    gdr::scheduler s;
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      gdr::verbs::listener l(s, ip + ":0");
      port = l.port();
      gdr::verbs::endpoint ep = co_await l.accept();
      co_await gdr::sleep_for(20ms);  // the peer's hello and credits are read
      owner_before = ep.stats();
      owner_loops_before = s.stats().iterations;
      connected.release();
      owner_may_run.acquire();  // blocks this thread: no loop, no completion polled
      owner_loops_during = s.stats().iterations;
      owner_after = ep.stats();
      std::vector<std::byte> in(1);
      co_await ep.recv(host(in));  // the peer's last word
      co_await ep.close();
    }());
    s.drain();
  });
  gdr::scheduler s;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    while (port == 0) std::this_thread::sleep_for(1ms);
    gdr::verbs::endpoint ep = co_await gdr::verbs::connect(s, ip + ":" + std::to_string(port), ip + ":0");
    connected.acquire();
    CHECK(ep.one_sided());
    auto rv = reg.describe(0);
    auto cv = creg.describe(0);
    auto src = pattern(n, 7);
    CHECK(co_await ep.put(chost(src), rv) == n);
    CHECK(ep.last_path() == gdr::transfer_path::one_sided_rdma);
    std::vector<std::byte> back(n);
    CHECK(co_await ep.get(host(back), rv) == n);
    CHECK(back == src);
    for (std::uint64_t i = 0; i < 100; ++i) CHECK(co_await ep.fetch_add(cv, 1) == i);
    CHECK(co_await ep.compare_swap(cv, 100, 7) == 100);
    std::vector<std::byte> small(8);
    CHECK(co_await ep.get(host(small), rv.subview(0, 8)) == 8);
    CHECK(co_await ep.flush() == 0);
    owner_may_run.release();
    std::vector<std::byte> last(1, std::byte{1});
    co_await ep.send(chost(last));
    co_await ep.close();
  }());
  s.drain();
  owner.join();
  CHECK(window == pattern(n, 7));
  CHECK(counter[0] == 7);
  // The owner's loop did not turn, and afterwards it had served nothing and
  // seen no completion of these operations.
  CHECK(owner_loops_during == owner_loops_before);
  CHECK(owner_after.served_puts == owner_before.served_puts);
  CHECK(owner_after.served_gets == owner_before.served_gets);
  CHECK(owner_after.completions == owner_before.completions);
}

TEST_CASE("a faulty access in the middle of a stream of sends fails alone: every send arrives, the lane comes back") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    std::vector<std::byte> window(64 * 1024);
    auto reg = gdr::register_memory(host(window));
    auto rv = reg.describe(0);
    constexpr int count = 200;
    std::vector<std::vector<std::byte>> out, in;
    for (int i = 0; i < count; ++i) {
      out.push_back(pattern(64 + static_cast<std::size_t>(i), static_cast<std::uint32_t>(i)));
      in.emplace_back(out.back().size());
    }
    auto sender = [&]() -> gdr::task<int> {
      for (int i = 0; i < count; ++i) co_await a.send(chost(out[static_cast<std::size_t>(i)]));
      co_return 0;
    };
    auto receiver = [&]() -> gdr::task<int> {
      for (int i = 0; i < count; ++i) co_await b.recv(host(in[static_cast<std::size_t>(i)]));
      co_return 0;
    };
    int faults = 0, good = 0;
    auto putter = [&]() -> gdr::task<int> {
      auto src = pattern(4096, 9);
      for (int i = 0; i < 40; ++i) {
        auto nic = rv.nic_keys();
        if (i % 10 == 5)
          for (auto& k : nic)
            if (k != 0) k ^= 0x100;  // a forged NIC key: the owner's NIC refuses it
        gdr::remote_view<std::byte, gdr::Host> v(rv.address(), rv.size(), rv.key(), 0, nic);
        gdr::op_report r = co_await report_of(a.put(chost(src), v.subview(0, 4096)));
        if (r.error == gdr::errc::remote_access) {
          ++faults;
        } else if (!r.error) {
          ++good;
          CHECK(r.path == gdr::transfer_path::one_sided_rdma);
        } else {
          FAIL_CHECK("unexpected error " << r.error.message());
        }
      }
      co_return 0;
    };
    co_await gdr::when_all(sender(), receiver(), putter());
    CHECK(in == out);
    CHECK(faults == 4);
    CHECK(good == 36);
    CHECK(a.stats().direct_faults == 4);
    CHECK(a.stats().lane_resets == 4);
    CHECK(a.is_open());
    CHECK(b.is_open());
    co_await a.close();
  });
}

TEST_CASE("a batch of 512 blocks moves with one completion, each block checked against both views first") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto&) -> gdr::task<> {
    const std::size_t blk = 16 * 1024, count = 512;
    std::vector<std::byte> pool(blk * count), local = pattern(blk * count, 3);
    auto reg = gdr::register_memory(host(pool));
    auto rv = reg.describe(0);
    // A permutation: local block i goes to remote block (i * 37) % count.
    std::vector<gdr::block> blocks;
    for (std::size_t i = 0; i < count; ++i) blocks.push_back({i * blk, ((i * 37) % count) * blk, blk});
    std::uint64_t wrs = a.stats().direct_wrs, signaled = a.stats().completions;
    CHECK(co_await a.put_batch(chost(local), rv, blocks) == blk * count);
    CHECK(a.last_path() == gdr::transfer_path::one_sided_rdma);
    CHECK(a.stats().direct_wrs - wrs == count);
    CHECK(a.stats().completions - signaled <= count / 16 + 4);  // chains of 16, one signalled each
    bool placed = true;
    for (std::size_t i = 0; i < count; ++i)
      placed = placed && std::equal(local.begin() + static_cast<std::ptrdiff_t>(i * blk),
                                    local.begin() + static_cast<std::ptrdiff_t>((i + 1) * blk),
                                    pool.begin() + static_cast<std::ptrdiff_t>(((i * 37) % count) * blk));
    CHECK(placed);
    std::vector<std::byte> back(blk * count);
    CHECK(co_await a.get_batch(host(back), rv, blocks) == blk * count);
    CHECK(back == local);
    // A block past the end of the remote view: refused, nothing moved.
    std::fill(pool.begin(), pool.end(), std::byte{0});
    std::vector<gdr::block> bad = {{0, 0, blk}, {0, pool.size() - blk + 1, blk}};
    gdr::op_report r = co_await report_of(a.put_batch(chost(local), rv, bad));
    CHECK(r.error == gdr::errc::invalid_argument);
    CHECK(all_are(pool, std::byte{0}));
    // An empty batch completes with nothing moved.
    CHECK(co_await a.put_batch(chost(local), rv, std::span<const gdr::block>{}) == 0);
    // Without a NIC key (a checked registration) a batch is refused, not served piecemeal.
    auto checked = gdr::register_memory(host(pool), gdr::access::read_write, gdr::exposure::checked);
    r = co_await report_of(a.put_batch(chost(local), checked.describe(0), blocks));
    CHECK(r.error == gdr::errc::unsupported);
    co_await a.close();
  });
}

TEST_CASE("a notifying put tells the owner its value once the bytes are in place, in order") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    const std::size_t blk = 4096;
    constexpr std::uint32_t count = 150;  // more than the owner's posted receives (64): the NIC waits for it
    std::vector<std::byte> pool(blk * count);
    auto reg = gdr::register_memory(host(pool));
    auto rv = reg.describe(0);
    auto producer = [&]() -> gdr::task<int> {
      for (std::uint32_t i = 0; i < count; ++i) {
        auto src = pattern(blk, i);
        co_await a.put_notify(chost(src), rv.subview(i * blk, blk), 1000 + i);
      }
      co_return 0;
    };
    bool in_order = true, in_place = true;
    auto consumer = [&]() -> gdr::task<int> {
      for (std::uint32_t i = 0; i < count; ++i) {
        std::uint32_t v = co_await b.notification();
        in_order = in_order && v == 1000 + i;
        auto expect = pattern(blk, v - 1000);
        in_place = in_place && std::equal(expect.begin(), expect.end(), pool.begin() + (v - 1000) * blk);
      }
      co_return 0;
    };
    co_await gdr::when_all(producer(), consumer());
    CHECK(in_order);
    CHECK(in_place);
    CHECK(b.stats().notifications == count);
    // Without a NIC key: refused, the owner is told nothing.
    auto checked = gdr::register_memory(host(pool), gdr::access::read_write, gdr::exposure::checked);
    std::vector<std::byte> one(8);
    gdr::op_report r = co_await report_of(a.put_notify(chost(one), checked.describe(0).subview(0, 8), 1));
    CHECK(r.error == gdr::errc::unsupported);
    // A notification awaited when the peer closes fails instead of hanging.
    auto [w, c] = co_await gdr::when_all(
        [&]() -> gdr::task<std::error_code> {
          try {
            (void)co_await b.notification();
          } catch (const gdr::error& e) {
            co_return e.code();
          }
          co_return std::error_code{};
        }(),
        [&]() -> gdr::task<int> {
          co_await gdr::sleep_for(10ms);
          co_await a.close();
          co_return 0;
        }());
    CHECK(w);
    (void)c;
  });
}

TEST_CASE("a flush completes after every direct operation started before it; a stop takes back only what waits") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options oa;
  oa.one_sided_depth = 1;  // one operation with the NIC at a time: the rest wait in order
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        const std::size_t n = 256 * 1024;
        std::vector<std::byte> window(4 * n);
        auto reg = gdr::register_memory(host(window));
        auto rv = reg.describe(0);
        auto s0 = pattern(n, 1), s1 = pattern(n, 2), s2 = pattern(n, 3);
        bool all_there = false;
        std::stop_source stop;
        auto [p0, p1, p2, f, stopper] = co_await gdr::when_all(
            report_of(a.put(chost(s0), rv.subview(0, n))), report_of(a.put(chost(s1), rv.subview(n, n))),
            report_of(a.put(chost(s2), rv.subview(2 * n, n), {stop.get_token()})),
            [&]() -> gdr::task<gdr::op_report> {
              auto r = co_await report_of(a.flush());
              all_there = std::equal(s0.begin(), s0.end(), window.begin()) &&
                          std::equal(s1.begin(), s1.end(), window.begin() + static_cast<std::ptrdiff_t>(n));
              co_return r;
            }(),
            [&]() -> gdr::task<int> {
              stop.request_stop();  // the third waits behind the first: taken back
              co_return 0;
            }());
        CHECK(!p0.error);
        CHECK(!p1.error);
        CHECK(p2.error == gdr::errc::cancelled);
        CHECK(!f.error);
        CHECK(all_there);
        CHECK(std::all_of(window.begin() + static_cast<std::ptrdiff_t>(2 * n), window.end(),
                          [](std::byte x) { return x == std::byte{0}; }));
        (void)stopper;
        (void)b;
        co_await a.close();
      },
      oa, {});
}

TEST_CASE("with one_sided off on either side every put and get is served, with the same results") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options off;
  off.one_sided = false;
  for (int side = 0; side < 2; ++side) {
    CAPTURE(side);
    with_pair(
        [](auto& a, auto& b) -> gdr::task<> {
          CHECK(!a.one_sided());
          std::vector<std::byte> window(8192);
          auto reg = gdr::register_memory(host(window));
          auto src = pattern(8192, 5);
          CHECK(co_await a.put(chost(src), reg.describe(0)) == 8192);
          CHECK(window == src);
          CHECK(a.last_path() != gdr::transfer_path::one_sided_rdma);
          CHECK(b.stats().served_puts == 1);
          co_await a.close();
        },
        side == 0 ? off : gdr::verbs::endpoint_options{}, side == 1 ? off : gdr::verbs::endpoint_options{});
  }
}
