// gdr/transport/tcp/endpoint.hpp: two-sided messages over 127.0.0.1, one process.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include <gdr/sched/timer.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/transport/tcp/tcp_test_util.hpp"

using gdr::transfer_path;
namespace tcp = gdr::tcp;
using tcp_test::connected_pair;

// ---- compile-time facts: the traits table rows of the TCP transport ----
static_assert(gdr::select_path_v<tcp::transport, gdr::op::send, gdr::Host> == gdr::path_kind::zero_copy);
static_assert(gdr::select_path_v<tcp::transport, gdr::op::recv, gdr::Pinned> == gdr::path_kind::zero_copy);
static_assert(gdr::select_path_v<tcp::transport, gdr::op::get, gdr::Pinned, gdr::Host> == gdr::path_kind::zero_copy);
static_assert(gdr::select_path_v<tcp::transport, gdr::op::send, gdr::Device> == gdr::path_kind::staged);
static_assert(gdr::select_path_v<tcp::transport, gdr::op::put, gdr::Host, gdr::Device> == gdr::path_kind::staged);

namespace {

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 9)) & 0xff);
  return v;
}

}  // namespace

TEST_CASE("a small message goes from one endpoint to the other over loopback") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  std::array<int, 4> out{1, 2, 3, 4}, in{};
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    auto r = b.recv(gdr::host_view(in));
    std::size_t sent = co_await a.send(gdr::host_view(out));
    std::size_t got = co_await std::move(r);
    CHECK(sent == 16);
    CHECK(got == 16);
    CHECK(a.last_path() == transfer_path::host_eager);  // small: copied into one buffer with its header
    CHECK(b.last_path() == transfer_path::host_eager);  // small: through the staging buffer
    CHECK(a.stats().sends == 1);
    CHECK(a.stats().bytes_sent == 16);
    CHECK(b.stats().recvs == 1);
    CHECK(b.stats().bytes_received == 16);
    co_await a.close();
    co_await b.close();
  }());
  CHECK(in == out);
  CHECK(sched.inflight() == 0);
}

TEST_CASE("a send's path says whether gdr copied it: small ones into one buffer, larger ones from the user's") {
  tcp_test::watchdog wd(30);
  for (bool fast : {true, false}) {
    CAPTURE(fast);
    gdr::scheduler sched;
    gdr::tcp::endpoint_options opts;
    opts.fast_sends = fast;
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      auto ab_pair = co_await connected_pair(sched, gdr::default_registry(), opts);
      auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
      auto& b = ab_pair.second;
      std::vector<std::byte> small(448, std::byte{5}), large(4096, std::byte{6}), in(4096);
      for (int round = 0; round < 3; ++round) {
        auto rs = b.recv(gdr::host_view(in));
        auto s1 = co_await a.send(gdr::host_view(small)).report();
        CHECK(s1.path == transfer_path::host_eager);  // header and payload copied into the 512-byte buffer
        CHECK(co_await std::move(rs) == small.size());
        auto rl = b.recv(gdr::host_view(in));
        auto s2 = co_await a.send(gdr::host_view(large)).report();
        CHECK(s2.path == transfer_path::host_zero_copy);  // written from `large` by iovec
        CHECK(co_await std::move(rl) == large.size());
        CHECK(in == large);
      }
      CHECK(a.stats().on_path(transfer_path::host_eager) == 3);
      CHECK(a.stats().on_path(transfer_path::host_zero_copy) == 3);
      co_await a.close();
      co_await b.close();
    }());
  }
}

TEST_CASE("a message sent before its receive is posted is kept and delivered") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::vector<int> out(100);
    std::iota(out.begin(), out.end(), 7);
    co_await a.send(gdr::host_view(out));
    co_await a.send(gdr::host_view(out).first(10));
    // Let the reader take both in before any receive exists.
    for (int i = 0; i < 20 && b.stats().unexpected < 2; ++i) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(b.stats().unexpected == 2);
    std::vector<int> in(100, -1);
    CHECK(co_await b.recv(gdr::host_view(in)) == 400);
    CHECK(in == out);
    CHECK(co_await b.recv(gdr::host_view(in)) == 40);
    CHECK(in[9] == 16);
    CHECK(b.last_path() == transfer_path::host_eager);
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("message boundaries are kept, in order, whatever the sizes, in both run modes") {
  tcp_test::watchdog wd(60);
  // sleep: reads wait on io_uring's poll; busy_poll: the loop polls the
  // socket with recv(MSG_DONTWAIT) (endpoint_options::spin_reads_in_busy_poll).
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    CAPTURE(static_cast<int>(mode));
    gdr::scheduler sched({.mode = mode});
    // Sizes around the direct-read threshold (16 KiB), the staging buffer
    // (64 KiB) and the rendezvous threshold, and beyond.
    const std::vector<std::size_t> sizes = {0,     1,     7,     40,     1000,   16383,  16384, 16385,
                                            65535, 65536, 65537, 262145, 1 << 20, 3, (4 << 20) + 3, 2};
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      auto ab_pair = co_await connected_pair(sched);
      auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
      auto& b = ab_pair.second;
      std::vector<std::vector<std::byte>> outs, ins;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        outs.push_back(pattern(sizes[i], static_cast<unsigned>(i)));
        ins.emplace_back(sizes[i] + 16);  // room to spare: the size must come from the message
      }
      int done = 0;
      std::vector<std::size_t> got(sizes.size(), 12345);
      // Receives are posted first for the first half, after the sends for the rest.
      for (std::size_t i = 0; i < sizes.size() / 2; ++i) {
        tcp_test::spawn([&, i]() -> gdr::task<> { got[i] = co_await b.recv(gdr::host_view(ins[i])); }, done);
      }
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        tcp_test::spawn([&, i]() -> gdr::task<> { co_await a.send(gdr::host_view(outs[i])); }, done);
      }
      for (std::size_t i = sizes.size() / 2; i < sizes.size(); ++i) {
        tcp_test::spawn([&, i]() -> gdr::task<> { got[i] = co_await b.recv(gdr::host_view(ins[i])); }, done);
      }
      while (done < static_cast<int>(2 * sizes.size())) co_await gdr::sleep_for(std::chrono::milliseconds(1));
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        CHECK(got[i] == sizes[i]);
        CHECK(std::equal(outs[i].begin(), outs[i].end(), ins[i].begin()));
      }
      CHECK(a.stats().sends == sizes.size());
      CHECK(b.stats().recvs == sizes.size());
      const std::size_t threshold = gdr::protocol_options{}.rendezvous_threshold;
      const auto over = static_cast<std::size_t>(
          std::count_if(sizes.begin(), sizes.end(), [&](std::size_t n) { return n > threshold; }));
      CHECK(over >= 2);  // 1 MiB and 4 MiB + 3 at least
      CHECK(a.stats().rendezvous_sends == over);
      CHECK(a.stats().eager_sends == sizes.size() - over);
      CHECK(b.stats().on_path(transfer_path::host_zero_copy) > 0);  // the large ones
      CHECK(b.stats().on_path(transfer_path::host_eager) > 0);      // the small ones
      if (mode == gdr::run_mode::busy_poll) {
        CHECK(b.stats().spin_reads > 0);
      } else {
        CHECK(b.stats().spin_reads == 0);
        CHECK(a.stats().direct_writes == 0);
      }
      co_await a.close();
      co_await b.close();
    }());
    CHECK(sched.inflight() == 0);
  }
}

TEST_CASE("in busy_poll, replies sent from a completion go out as direct writes; in sleep, through io_uring") {
  tcp_test::watchdog wd(30);
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    CAPTURE(static_cast<int>(mode));
    gdr::scheduler sched({.mode = mode});
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      auto ab_pair = co_await connected_pair(sched);
      auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
      auto& b = ab_pair.second;
      constexpr int rounds = 100;
      int done = 0;
      // b echoes: each reply is queued by a coroutine resumed by b's read.
      tcp_test::spawn([&]() -> gdr::task<> {
        std::vector<std::byte> buf(4096);
        for (int i = 0; i < rounds; ++i) {
          std::size_t n = co_await b.recv(gdr::host_view(buf));
          co_await b.send(gdr::view<const std::byte, gdr::Host>(buf.data(), n));
        }
      }, done);
      for (int i = 0; i < rounds; ++i) {
        std::size_t size = 1 + static_cast<std::size_t>(i) * 37;  // small and copied, up to 3.6 KiB
        auto out = pattern(size, static_cast<unsigned>(i));
        std::vector<std::byte> in(size);
        co_await a.send(gdr::host_view(out));
        CHECK(co_await a.recv(gdr::host_view(in)) == size);
        CHECK(in == out);
      }
      while (done < 1) co_await gdr::nop();
      CHECK(b.stats().sends == rounds);
      if (mode == gdr::run_mode::busy_poll) {
        CHECK(b.stats().direct_writes >= rounds / 2);
      } else {
        CHECK(b.stats().direct_writes == 0);
        CHECK(a.stats().direct_writes == 0);
      }
      co_await a.close();
      co_await b.close();
    }());
    CHECK(sched.inflight() == 0);
  }
}

TEST_CASE("a small send with nothing queued is written by the send itself, one per loop turn, in both run modes") {
  tcp_test::watchdog wd(30);
  for (bool fast : {true, false}) {
    for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
      CAPTURE(fast);
      CAPTURE(static_cast<int>(mode));
      gdr::scheduler sched({.mode = mode});
      tcp::endpoint_options opts;
      opts.fast_sends = fast;
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        auto ab_pair = co_await connected_pair(sched, gdr::default_registry(), opts);
        auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
        auto& b = ab_pair.second;
        auto one = pattern(8, 1), two = pattern(448, 2), three = pattern(449, 3);
        // The first send: nothing queued, a new loop turn. Its co_await
        // completes without suspending: done before spawn returns.
        int first = 0, second = 0;
        tcp_test::spawn([&]() -> gdr::task<> { CHECK(co_await a.send(gdr::host_view(one)) == 8); }, first);
        CHECK(first == (fast ? 1 : 0));
        // The second, in the same loop turn: queued and written by the loop.
        tcp_test::spawn([&]() -> gdr::task<> { CHECK(co_await a.send(gdr::host_view(two)) == 448); }, second);
        CHECK(second == 0);
        while (first + second < 2) co_await gdr::nop();
        CHECK(a.stats().fast_sends == (fast ? 1u : 0u));
        CHECK(a.last_path() == transfer_path::host_eager);  // both copied into the small buffer
        // 449 bytes and the 64-byte header do not fit the 512-byte buffer.
        co_await gdr::nop();
        CHECK(co_await a.send(gdr::host_view(three)) == 449);
        CHECK(a.stats().fast_sends == (fast ? 1u : 0u));
        co_await gdr::nop();
        CHECK(co_await a.send(gdr::host_view(two)) == 448);
        CHECK(a.stats().fast_sends == (fast ? 2u : 0u));
        CHECK(a.stats().fast_short == 0);
        CHECK(a.stats().eager_sends == 4);
        CHECK(a.stats().frames_out >= 4);
        if (mode == gdr::run_mode::sleep) CHECK(a.stats().direct_writes == 0);
        for (const auto* want : {&one, &two, &three, &two}) {
          std::vector<std::byte> in(want->size() + 8);
          CHECK(co_await b.recv(gdr::host_view(in)) == want->size());
          CHECK(std::equal(want->begin(), want->end(), in.begin()));
        }
        co_await a.close();
        // After close nothing is written; the send fails as before.
        CHECK((co_await a.send(gdr::host_view(one)).as_result()).error() == gdr::errc::closed);
        CHECK(a.stats().fast_sends == (fast ? 2u : 0u));
        co_await b.close();
      }());
      CHECK(sched.inflight() == 0);
    }
  }
}

TEST_CASE("in busy_poll, senders that never wait do not starve the rest of the loop") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    bool stop = false;
    int done = 0;
    std::uint64_t sent = 0, received = 0;
    // Eight senders and eight receivers of small messages: every completion
    // resumes a coroutine that queues the next operation at once.
    for (int k = 0; k < 8; ++k) {
      tcp_test::spawn([&]() -> gdr::task<> {
        std::array<std::byte, 64> m{};
        while (!stop) {
          co_await a.send(gdr::host_view(m));
          ++sent;
        }
      }, done);
    }
    std::array<std::byte, 64> sink{};
    int receivers_done = 0;
    for (int k = 0; k < 8; ++k) {
      tcp_test::spawn([&]() -> gdr::task<> {
        // Until a's close: then the pending receives fail.
        while ((co_await b.recv(gdr::host_view(sink)).as_result()).has_value()) ++received;
      }, receivers_done);
    }
    // The timer must still fire, and on time.
    auto t0 = std::chrono::steady_clock::now();
    co_await gdr::sleep_for(std::chrono::milliseconds(20));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
    stop = true;
    while (done < 8) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    co_await a.close();  // after everything sent: b receives it all, then the close
    while (receivers_done < 8) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(sent > 100);
    CHECK(received == sent);
    co_await b.close();
  }());
}

TEST_CASE("busy_poll without spinning reads waits on io_uring's poll, and still delivers") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::tcp::endpoint_options opts;
  opts.spin_reads_in_busy_poll = false;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, gdr::default_registry(), opts);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    for (std::size_t size : {std::size_t{8}, std::size_t{1} << 20}) {
      auto out = pattern(size, 9);
      std::vector<std::byte> in(size);
      // The receive is posted (started) before the send: a rendezvous send
      // completes only once its receive is posted.
      int done = 0;
      std::size_t got = 0;
      tcp_test::spawn([&]() -> gdr::task<> { got = co_await b.recv(gdr::host_view(in)); }, done);
      co_await gdr::sleep_for(std::chrono::milliseconds(2));  // the read waits, armed, meanwhile
      co_await a.send(gdr::host_view(out));
      while (done < 1) co_await gdr::sleep_for(std::chrono::milliseconds(1));
      CHECK(got == size);
      CHECK(in == out);
    }
    CHECK(a.stats().spin_reads == 0);
    CHECK(b.stats().spin_reads == 0);
    CHECK(b.stats().reads < 20);  // not one attempt per loop iteration
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("a message larger than the receive view is truncated and the stream stays in step") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    for (std::size_t size : {std::size_t{100}, std::size_t{200000}, std::size_t{3 << 20}}) {
      CAPTURE(size);
      auto out = pattern(size, 3);
      std::vector<std::byte> small(50, std::byte{0xEE});
      std::vector<std::byte> guard_after(64, std::byte{0xAB});
      // The view is the first 40 bytes of `small`: the 10 after must stay untouched.
      int done = 0;
      gdr::op_report res{};
      tcp_test::start(b.recv(gdr::host_view(small).first(40)), res, done);
      co_await a.send(gdr::host_view(out));
      while (done < 1) co_await gdr::sleep_for(std::chrono::milliseconds(1));
      CHECK(res.error == gdr::errc::truncated);
      CHECK(res.bytes == 40);
      CHECK(res.message_size == size);
      CHECK(std::equal(small.begin(), small.begin() + 40, out.begin()));
      CHECK(small[40] == std::byte{0xEE});
      CHECK(small[49] == std::byte{0xEE});
      // The next message arrives whole: the rest of the long one was dropped.
      std::array<int, 3> next{5, 6, 7}, next_in{};
      auto r2 = b.recv(gdr::host_view(next_in));
      co_await a.send(gdr::host_view(next));
      CHECK(co_await std::move(r2) == 12);
      CHECK(next_in == next);
    }
    CHECK(b.is_open());
    // A truncated early (kept) message is reported the same way.
    std::array<int, 8> eight{};
    co_await a.send(gdr::host_view(eight));
    for (int i = 0; i < 20 && b.stats().unexpected == 0; ++i) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    std::array<int, 2> two{};
    CHECK((co_await b.recv(gdr::host_view(two)).as_result()).error() == gdr::errc::truncated);
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("many concurrent sends and receives on one endpoint are matched in order") {
  tcp_test::watchdog wd(60);
  gdr::scheduler sched;
  constexpr int n = 500;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::vector<std::array<std::uint32_t, 4>> outs(n), ins(n);
    for (int i = 0; i < n; ++i) outs[i] = {static_cast<std::uint32_t>(i), 1, 2, static_cast<std::uint32_t>(i * i)};
    int done = 0;
    std::vector<int> order;
    for (int i = 0; i < n; ++i) {
      tcp_test::spawn([&, i]() -> gdr::task<> {
        co_await b.recv(gdr::host_view(ins[i]));
        order.push_back(i);
      }, done);
    }
    for (int i = 0; i < n; ++i) {
      tcp_test::spawn([&, i]() -> gdr::task<> { co_await a.send(gdr::host_view(outs[i])); }, done);
    }
    while (done < 2 * n) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    // The i-th receive posted got the i-th message sent, and they resumed in that order.
    CHECK(ins == outs);
    std::vector<int> expected(n);
    std::iota(expected.begin(), expected.end(), 0);
    CHECK(order == expected);
    CHECK(a.stats().writes < static_cast<std::uint64_t>(n));  // frames share system calls
    co_await a.close();
    co_await b.close();
  }());
}

// The writer keeps a few iovecs inside the connection (an idle endpoint does
// not carry the full array) and allocates the full one when a batch needs
// more: forty frames posted while a write is in flight still go out in a
// few system calls, intact.
TEST_CASE("frames beyond the connection's inline iovecs still share sendmsg calls") {
  tcp_test::watchdog wd(30);
  for (auto mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    CAPTURE(static_cast<int>(mode));
    gdr::scheduler sched({.mode = mode});
    constexpr int n = 40;
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      auto ab_pair = co_await connected_pair(sched);
      auto& a = ab_pair.first;
      auto& b = ab_pair.second;
      std::vector<std::array<std::uint32_t, 25>> outs(n), ins(n);  // 100 bytes: not one small write
      for (int i = 0; i < n; ++i) outs[i].fill(static_cast<std::uint32_t>(i * 7 + 1));
      int done = 0;
      const auto writes0 = a.stats().writes;
      for (int i = 0; i < n; ++i)
        tcp_test::spawn([&, i]() -> gdr::task<> { co_await b.recv(gdr::host_view(ins[i])); }, done);
      for (int i = 0; i < n; ++i)
        tcp_test::spawn([&, i]() -> gdr::task<> { co_await a.send(gdr::host_view(outs[i])); }, done);
      while (done < 2 * n) co_await gdr::sleep_for(std::chrono::milliseconds(1));
      CHECK(ins == outs);
      // Four frames per write (the inline iovecs alone) would take ten.
      MESSAGE("writes for " << n << " frames: " << a.stats().writes - writes0);
      CHECK(a.stats().writes - writes0 <= 5);
      co_await a.close();
      co_await b.close();
    }());
  }
}

TEST_CASE("both directions work at once, on many endpoints of one scheduler") {
  tcp_test::watchdog wd(60);
  gdr::scheduler sched;
  constexpr int pairs = 8, msgs = 50;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::vector<tcp::endpoint> left, right;
    for (int p = 0; p < pairs; ++p) {
      auto ab_pair = co_await connected_pair(sched);
      auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
      auto& b = ab_pair.second;
      left.push_back(std::move(a));
      right.push_back(std::move(b));
    }
    int done = 0, bad = 0;
    for (int p = 0; p < pairs; ++p) {
      for (tcp::endpoint* ep : {&left[p], &right[p]}) {
        tcp_test::spawn([&, ep, p]() -> gdr::task<> {
          for (int m = 0; m < msgs; ++m) {
            std::array<int, 2> v{p, m};
            co_await ep->send(gdr::host_view(v));
          }
        }, done);
        tcp_test::spawn([&, ep, p]() -> gdr::task<> {
          for (int m = 0; m < msgs; ++m) {
            std::array<int, 2> v{};
            co_await ep->recv(gdr::host_view(v));
            if (v[0] != p || v[1] != m) ++bad;
          }
        }, done);
      }
    }
    while (done < 4 * pairs) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(bad == 0);
    for (auto& ep : left) co_await ep.close();
    for (auto& ep : right) co_await ep.close();
  }());
  CHECK(sched.inflight() == 0);
}

// Before the protocol layer, a large message with no receive posted stopped
// the reader (and so everything behind it) until the receive came. Now a
// message over the rendezvous threshold is only announced: the receiver
// keeps a small record, goes on reading, and the bytes move once the
// receive is posted. Only eager messages beyond unexpected_bytes stop the
// reader (next test).
TEST_CASE("a large message with no receive posted is only announced and does not stop the reader") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    auto out = pattern(32 << 20, 9);  // more than the socket buffers hold
    int done = 0;
    tcp_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(out)); }, done);
    for (int i = 0; i < 1000 && b.stats().unexpected_rts == 0; ++i) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(b.stats().unexpected_rts == 1);  // the announcement, kept
    CHECK(b.stats().unexpected == 0);      // no byte of the message was copied aside
    CHECK(b.stats().paused == 0);
    CHECK(done == 0);                      // the send waits for the receive
    // Messages behind it still arrive: the reader goes on.
    std::array<int, 3> small{1, 2, 3}, small_in{};
    co_await a.send(gdr::host_view(small), gdr::tag{1});
    CHECK(co_await b.recv(gdr::host_view(small_in), gdr::tag{1}) == 12);
    CHECK(small_in == small);
    CHECK(done == 0);
    std::vector<std::byte> in(out.size());
    auto r = co_await b.recv(gdr::host_view(in)).report();
    CHECK(!r.error);
    CHECK(r.bytes == out.size());
    CHECK(r.protocol == gdr::wire_protocol::rendezvous);
    while (done == 0) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(in == out);
    CHECK(b.last_path() == transfer_path::host_zero_copy);
    CHECK(a.stats().rendezvous_sends == 1);
    CHECK(b.stats().paused == 0);
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("messages beyond the room the receiver granted wait in the sender, and the reader never stops") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  tcp::endpoint_options opts;
  opts.protocol.unexpected_bytes = 256 << 10;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, gdr::default_registry(), opts);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    // 512 eager messages of 64 KiB (32 MiB): more than the store and the
    // socket buffers hold together.
    constexpr int n = 512;
    std::vector<std::vector<std::byte>> outs;
    for (int i = 0; i < n; ++i) outs.push_back(pattern(64 << 10, static_cast<unsigned>(i)));
    int done = 0;
    tcp_test::spawn([&]() -> gdr::task<> {
      for (auto& o : outs) co_await a.send(gdr::host_view(o));
    }, done);
    co_await gdr::sleep_for(std::chrono::milliseconds(50));
    // b granted 256 KiB of room: four messages went eager, the rest were
    // announced (each a small record) until its message slots ran out, and
    // the sender holds what is left. b never stopped reading.
    CHECK(b.stats().paused == 0);
    CHECK(b.stats().unexpected <= 4);
    CHECK(done == 0);
    // The receives come: everything arrives, in order.
    int bad = 0;
    std::vector<std::byte> in(64 << 10);
    for (int i = 0; i < n; ++i) {
      CHECK(co_await b.recv(gdr::host_view(in)) == in.size());
      if (in != outs[i]) ++bad;
    }
    CHECK(bad == 0);
    while (done == 0) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(a.stats().eager_sends + a.stats().rendezvous_sends == n);
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("a send larger than the peer accepts fails alone with message_too_large and the endpoint stays usable") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  tcp::endpoint_options opts;
  opts.protocol.max_message = 1 << 20;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, gdr::default_registry(), opts);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    CHECK(a.peer_max_message() == (1u << 20));
    auto too_big = pattern((1 << 20) + 1, 1);
    auto r = co_await a.send(gdr::host_view(too_big)).report();
    CHECK(r.error == gdr::errc::message_too_large);
    CHECK(r.bytes == 0);
    bool threw = false;
    try {
      co_await a.send(gdr::host_view(too_big));
    } catch (const gdr::error& e) {
      threw = e.code() == gdr::errc::message_too_large;
    }
    CHECK(threw);
    CHECK(a.is_open());
    CHECK(b.is_open());
    CHECK(b.stats().unexpected_rts == 0);  // nothing went out
    // The largest message accepted, and a small one, still go through.
    auto largest = pattern(1 << 20, 2);
    std::vector<std::byte> in(1 << 20);
    int done = 0;
    gdr::op_report rr{};
    tcp_test::start(b.recv(gdr::host_view(in)), rr, done);
    CHECK(co_await a.send(gdr::host_view(largest)) == largest.size());
    while (done < 1) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(!rr.error);
    CHECK(rr.bytes == largest.size());
    CHECK(in == largest);
    std::array<int, 2> small{6, 7}, small_in{};
    co_await a.send(gdr::host_view(small));
    CHECK(co_await b.recv(gdr::host_view(small_in)) == 8);
    CHECK(small_in == small);
    CHECK(a.stats().failed == 2);
    co_await a.close();
    co_await b.close();
  }());
  CHECK(sched.inflight() == 0);
}

TEST_CASE("a truncated receive reports the message's size, and the thrown error names it") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    // Eager and rendezvous, each with the receive posted first and late.
    for (std::size_t size : {std::size_t{1000}, std::size_t{300000}}) {
      const bool rendezvous = size > gdr::protocol_options{}.rendezvous_threshold;
      for (bool late : {false, true}) {
        CAPTURE(size);
        CAPTURE(late);
        auto out = pattern(size, 4);
        std::vector<std::byte> in(100);
        gdr::op_report rep{}, sent{};
        int done = 0;
        auto recv = [&]() -> gdr::task<> { rep = co_await b.recv(gdr::host_view(in), gdr::tag{3}).report(); };
        auto send = [&]() -> gdr::task<> { sent = co_await a.send(gdr::host_view(out), gdr::tag{3}).report(); };
        if (late) {
          tcp_test::spawn(send, done);
          co_await gdr::sleep_for(std::chrono::milliseconds(10));
          tcp_test::spawn(recv, done);
        } else {
          tcp_test::spawn(recv, done);
          tcp_test::spawn(send, done);
        }
        while (done < 2) co_await gdr::sleep_for(std::chrono::milliseconds(1));
        CHECK(rep.error == gdr::errc::truncated);
        CHECK(rep.bytes == in.size());
        CHECK(rep.message_size == size);
        CHECK(rep.tag == 3);
        CHECK(rep.protocol == (rendezvous ? gdr::wire_protocol::rendezvous : gdr::wire_protocol::eager));
        CHECK(std::equal(in.begin(), in.end(), out.begin()));
        CHECK(!sent.error);  // truncation is the receiver's business
      }
      // The throwing form: gdr::error with code truncated, and a text that
      // names the message's size and what was kept.
      auto out = pattern(size, 5);
      std::vector<std::byte> in(100);
      int done = 0;
      tcp_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(out)); }, done);
      std::string what;
      try {
        co_await b.recv(gdr::host_view(in));
      } catch (const gdr::error& e) {
        CHECK(e.code() == gdr::errc::truncated);
        what = e.what();
      }
      CAPTURE(what);
      CHECK(what.find(std::to_string(size)) != std::string::npos);
      CHECK(what.find("100") != std::string::npos);
      while (done < 1) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(b.stats().truncated == 6);
    CHECK(b.is_open());
    co_await a.close();
    co_await b.close();
  }());
  CHECK(sched.inflight() == 0);
}

// A send completes with its view's size whatever the receive accepted (the
// rendezvous data carries only what fits; the message was delivered).
TEST_CASE("a send completes with its view's size even when the receive truncates it, eager or rendezvous") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::uint64_t total = 0;
    for (std::size_t size : {std::size_t{1000}, std::size_t{300000}}) {
      CAPTURE(size);
      auto out = pattern(size, 6);
      std::vector<std::byte> in(100);
      int done = 0;
      gdr::op_report r{};
      tcp_test::start(b.recv(gdr::host_view(in)), r, done);
      auto sent = co_await a.send(gdr::host_view(out)).as_result();
      while (done < 1) co_await gdr::sleep_for(std::chrono::milliseconds(1));
      CHECK(r.error == gdr::errc::truncated);
      REQUIRE(sent.has_value());
      CHECK(*sent == size);
      total += size;
    }
    CHECK(a.stats().bytes_sent == total);
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("the result form reports errors without throwing and the throwing form throws gdr::error") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::array<int, 8> out{};
    std::array<int, 1> one{};
    auto r = b.recv(gdr::host_view(one));
    co_await a.send(gdr::host_view(out));
    bool threw = false;
    try {
      co_await std::move(r);
    } catch (const gdr::error& e) {
      threw = e.code() == gdr::errc::truncated;
    }
    CHECK(threw);
    co_await a.close();
    gdr::result<std::size_t> after = co_await a.send(gdr::host_view(out)).as_result();
    CHECK(after.error() == gdr::errc::closed);
    co_await b.close();
  }());
}

TEST_CASE("addresses parse and print") {
  auto a = tcp::address::parse("127.0.0.1:5000");
  REQUIRE(a);
  CHECK(a->port() == 5000);
  CHECK(a->to_string() == "127.0.0.1:5000");
  auto b = tcp::address::parse("[::1]:80");
  REQUIRE(b);
  CHECK(b->family() == AF_INET6);
  CHECK(b->to_string() == "[::1]:80");
  CHECK(tcp::address::parse("localhost:1")->to_string() == "127.0.0.1:1");
  CHECK(tcp::address::parse(":7")->to_string() == "0.0.0.0:7");
  CHECK(tcp::address::parse(*b->to_string().c_str() ? b->to_string() : "")->port() == 80);
  for (const char* bad : {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:65536", "1.2.3:4", "example.com:80", "[::1:80",
                          "127.0.0.1:8x", "[zz]:1"}) {
    CAPTURE(bad);
    CHECK(tcp::address::parse(bad).error() == gdr::errc::invalid_argument);
  }
}

TEST_CASE("an endpoint over IPv6 loopback works like one over IPv4") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::optional<tcp::listener> l;
    try {
      l.emplace(sched, tcp::address::loopback6(0));
    } catch (const gdr::error&) {
      co_return;  // no IPv6 on this machine
    }
    auto acc = l->accept();
    tcp::endpoint a = co_await tcp::connect(sched, l->local_address().to_string());
    tcp::endpoint b = co_await std::move(acc);
    std::array<char, 5> out{'h', 'e', 'l', 'l', 'o'}, in{};
    co_await a.send(gdr::host_view(out));
    CHECK(co_await b.recv(gdr::host_view(in)) == 5);
    CHECK(in == out);
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("connecting to a port nobody listens on fails with ECONNREFUSED") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  std::uint16_t port = 0;
  int fd = tcp_test::raw_listen(port);
  ::close(fd);  // the port is free again: nobody listens
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto r = co_await tcp::connect(sched, tcp::address::loopback(port)).as_result();
    CHECK(r.error() == std::errc::connection_refused);
    auto bad = co_await tcp::connect(sched, "not an address").as_result();
    CHECK(bad.error() == gdr::errc::invalid_argument);
  }());
}

TEST_CASE("no file descriptor is left open after endpoints close or are destroyed") {
  tcp_test::watchdog wd(30);
  int before = tcp_test::open_fds();
  {
    gdr::scheduler sched;
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      for (int i = 0; i < 10; ++i) {
        auto ab_pair = co_await connected_pair(sched);
        auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
        auto& b = ab_pair.second;
        std::array<int, 1> v{i};
        co_await a.send(gdr::host_view(v));
        co_await b.recv(gdr::host_view(v));
        if (i % 2 == 0) {
          co_await a.close();
          co_await b.close();
        }  // odd: destroyed open (aborted)
      }
    }());
    sched.drain();  // the aborted ones hand their buffers back
  }
  CHECK(tcp_test::open_fds() == before);
}
