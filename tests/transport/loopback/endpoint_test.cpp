// gdr/transport/loopback/endpoint.hpp: messages on one scheduler.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/loopback.hpp>

#include "tests/transport/loopback/test_util.hpp"

using gdr::transfer_path;
namespace lb = gdr::loopback;

// ---- compile-time facts: the traits table rows of the loopback transport ----
static_assert(gdr::select_path_v<lb::transport, gdr::op::send, gdr::Host> == gdr::path_kind::zero_copy);
static_assert(gdr::select_path_v<lb::transport, gdr::op::recv, gdr::Pinned> == gdr::path_kind::zero_copy);
static_assert(gdr::select_path_v<lb::transport, gdr::op::put, gdr::Host, gdr::Pinned> == gdr::path_kind::zero_copy);
static_assert(gdr::select_path_v<lb::transport, gdr::op::send, gdr::Device> == gdr::path_kind::staged);
static_assert(gdr::select_path_v<lb::transport, gdr::op::get, gdr::Host, gdr::Device> == gdr::path_kind::staged);

TEST_CASE("a small message sent before its receive is posted is kept by the receiving end and arrives intact") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::vector<int> out(100), in(100, -1);
  std::iota(out.begin(), out.end(), 7);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::size_t sent = co_await a.send(gdr::host_view(out));
    CHECK(sent == 400);
    // The receiving end copied it out of the sender's buffer into its store.
    CHECK(a.last_path() == transfer_path::host_zero_copy);
    CHECK(b.stats().unexpected == 1);
    std::size_t got = co_await b.recv(gdr::host_view(in));
    CHECK(got == 400);
    CHECK(b.last_path() == transfer_path::host_eager);  // the second copy, out of the store
  }());
  CHECK(in == out);
  CHECK(a.stats().sends == 1);
  CHECK(a.stats().eager_sends == 1);
  CHECK(a.stats().bytes_sent == 400);
  CHECK(b.stats().on_path(transfer_path::host_eager) == 1);
  CHECK(b.stats().recvs == 1);
  CHECK(b.stats().bytes_received == 400);
  CHECK(sched.inflight() == 0);
}

TEST_CASE("a receive posted first gets the bytes straight from the sender's buffer") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::vector<std::byte> out(1 << 20), in(1 << 20);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>(i * 31 + 5);
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> {
      std::size_t n = co_await b.recv(gdr::host_view(in));
      CHECK(n == in.size());
    }, done, failed);
    CHECK(done == 0);  // the receive waits
    std::size_t n = co_await a.send(gdr::host_view(out));
    CHECK(n == out.size());
    co_await gdr::nop();  // lets the receiver's completion run
  }());
  CHECK(done == 1);
  CHECK(failed == 0);
  CHECK(in == out);
  CHECK(a.last_path() == transfer_path::host_zero_copy);
  CHECK(b.last_path() == transfer_path::host_zero_copy);
  CHECK(a.stats().on_path(transfer_path::host_zero_copy) == 1);
  CHECK(b.stats().on_path(transfer_path::host_zero_copy) == 1);
}

TEST_CASE("a large send waits for its receive and completes only after the copy") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::vector<std::uint32_t> out(100000), in(100000);  // 400 kB: above the eager limit
  std::iota(out.begin(), out.end(), 1u);
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(out)); }, done, failed);
    co_await gdr::nop();
    co_await gdr::nop();
    CHECK(done == 0);  // nobody received yet
    std::size_t n = co_await b.recv(gdr::host_view(in));
    CHECK(n == out.size() * sizeof(std::uint32_t));
    // The receiver copied synchronously; the sender's completion is posted.
    co_await gdr::nop();
  }());
  CHECK(done == 1);
  CHECK(failed == 0);
  CHECK(in == out);
  CHECK(a.last_path() == transfer_path::host_zero_copy);
  CHECK(b.last_path() == transfer_path::host_zero_copy);
}

TEST_CASE("with a rendezvous threshold of zero every message waits for its receive and is copied once") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  lb::options opts;
  opts.rendezvous_threshold = 0;
  auto ends = lb::make_pair(sched, gdr::default_registry(), opts);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  int done = 0, failed = 0;
  std::array<int, 3> out{1, 2, 3}, in{};
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(out)); }, done, failed);
    CHECK(done == 0);
    co_await b.recv(gdr::host_view(in));
    co_await gdr::nop();
  }());
  CHECK(done == 1);
  CHECK(in == out);
  CHECK(a.stats().on_path(transfer_path::host_eager) == 0);
  CHECK(a.stats().on_path(transfer_path::host_zero_copy) == 1);
  CHECK(b.stats().on_path(transfer_path::host_zero_copy) == 1);
  CHECK(a.stats().rendezvous_sends == 1);
}

TEST_CASE("message boundaries are kept, including empty messages") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::string m1 = "hello", m3 = "a somewhat longer third message";
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    co_await a.send(gdr::host_view(m1));
    co_await a.send(gdr::view<const char, gdr::Host>());  // empty
    co_await a.send(gdr::host_view(m3));
    std::array<char, 64> buf{};
    gdr::view<char, gdr::Host> v(buf.data(), buf.size());
    std::size_t n1 = co_await b.recv(v);
    CHECK(std::string(buf.data(), n1) == m1);
    std::size_t n2 = co_await b.recv(v);
    CHECK(n2 == 0);
    std::size_t n3 = co_await b.recv(v);
    CHECK(std::string(buf.data(), n3) == m3);
  }());
}

TEST_CASE("a message larger than the receive view fails with truncated and writes nothing past the view") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  SUBCASE("eager") {}
  SUBCASE("rendezvous") {
    lb::options opts;
    opts.rendezvous_threshold = 0;
    std::tie(a, b) = lb::make_pair(sched, gdr::default_registry(), opts);
  }
  std::vector<std::uint8_t> out(64, 0xAB), in(48, 0);
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> {
      std::size_t n = co_await a.send(gdr::host_view(out));
      CHECK(n == 64);  // the sender delivered its message
    }, done, failed);
    // Only the first 32 bytes are offered; 16 guard bytes follow.
    gdr::view<std::uint8_t, gdr::Host> v(in.data(), 32);
    gdr::result<std::size_t> r = co_await std::move(b.recv(v)).as_result();
    REQUIRE(!r);
    CHECK(r.error() == gdr::errc::truncated);
    // The truncated message was consumed: the next one arrives normally.
    gdr_test::spawn([&]() -> gdr::task<> {
      std::size_t n = co_await b.recv(gdr::host_view(in).subview(32));
      CHECK(n == 4);
    }, done, failed);
    co_await a.send(gdr::host_view(out).first(4));
    while (done < 2) co_await gdr::nop();
  }());
  CHECK(done == 2);
  CHECK(failed == 0);
  for (std::size_t i = 0; i < 32; ++i) CHECK(in[i] == 0xAB);
  for (std::size_t i = 36; i < 48; ++i) CHECK(in[i] == 0);
  CHECK(b.stats().failed == 1);
}

TEST_CASE("many concurrent sends and receives are matched in the order they started") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  constexpr int n = 64;
  std::vector<std::vector<std::uint32_t>> out(n), in(n);
  for (int i = 0; i < n; ++i) {
    // Mixed sizes: some eager, some rendezvous (> 64 KiB).
    std::size_t len = (i % 3 == 0) ? 20000 + i : 10 + i;
    out[i].assign(len, static_cast<std::uint32_t>(i));
    in[i].assign(len, 0xFFFFFFFF);
  }
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    // Half the receives first, then all the sends, then the other half.
    for (int i = 0; i < n / 2; ++i)
      gdr_test::spawn([&, i]() -> gdr::task<> { co_await b.recv(gdr::host_view(in[i])); }, done, failed);
    for (int i = 0; i < n; ++i)
      gdr_test::spawn([&, i]() -> gdr::task<> { co_await a.send(gdr::host_view(out[i])); }, done, failed);
    for (int i = n / 2; i < n; ++i)
      gdr_test::spawn([&, i]() -> gdr::task<> { co_await b.recv(gdr::host_view(in[i])); }, done, failed);
    while (done < 2 * n) co_await gdr::sleep_for(std::chrono::microseconds(100));
  }());
  CHECK(failed == 0);
  for (int i = 0; i < n; ++i) CHECK(in[i] == out[i]);
  CHECK(a.stats().sends == n);
  CHECK(b.stats().recvs == n);
}

TEST_CASE("a small send behind an announced large one is matched in order and completes first") {
  // Matching follows the order sends started; completion does not: the
  // small one is kept by the receiving end at once, the large one completes
  // when its receive has taken it.
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::vector<char> big(400000, 'x'), small(10, 's'), in1(400000), in2(10);  // big: over the rendezvous threshold
  std::vector<int> order;
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(big)); order.push_back(1); }, done, failed);
    gdr_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(small)); order.push_back(2); }, done, failed);
    CHECK(order.empty());
    co_await gdr::sleep_for(std::chrono::milliseconds(2));
    CHECK(order == std::vector<int>{2});
    co_await b.recv(gdr::host_view(in1));
    co_await b.recv(gdr::host_view(in2));
    while (done < 2) co_await gdr::nop();
  }());
  CHECK(order == std::vector<int>{2, 1});
  CHECK(in1 == big);
  CHECK(in2 == small);
}

TEST_CASE("the store of early messages bounds what a receiving end keeps; the rest waits in the sender") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  lb::options opts;
  opts.rendezvous_threshold = 100;
  opts.unexpected_bytes = 250;
  auto ends = lb::make_pair(sched, gdr::default_registry(), opts);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<char, 100> m{};
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    for (int i = 0; i < 3; ++i)
      gdr_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(m)); }, done, failed);
    co_await gdr::sleep_for(std::chrono::milliseconds(5));
    // b granted a 250 bytes of room: two messages went eager and are kept;
    // the third, short of room, was announced instead and waits in the
    // sender. b never stopped reading.
    CHECK(done == 2);
    CHECK(b.stats().unexpected == 2);
    CHECK(b.stats().unexpected_rts == 1);
    CHECK(b.stats().paused == 0);
    std::array<char, 100> in{};
    for (int i = 0; i < 3; ++i) co_await b.recv(gdr::host_view(in));
    while (done < 3) co_await gdr::nop();
  }());
  // Two came out of the store, the third straight from the sender.
  CHECK(b.stats().on_path(transfer_path::host_eager) == 2);
  CHECK(b.stats().on_path(transfer_path::host_zero_copy) == 1);
}

TEST_CASE("both directions of a pair work independently") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::array<int, 2> x{1, 2}, y{3, 4}, rx{}, ry{};
    co_await a.send(gdr::host_view(x));
    co_await b.send(gdr::host_view(y));
    co_await a.recv(gdr::host_view(ry));
    co_await b.recv(gdr::host_view(rx));
    CHECK(rx == x);
    CHECK(ry == y);
  }());
}

// Buffers are taken where views are (a Pinned buffer's type needs no CUDA).
static_assert(gdr::detail::proto::viewable<gdr::buffer<int, gdr::Pinned>&>);
static_assert(gdr::detail::proto::viewable<const gdr::buffer<int, gdr::Pinned>&>);

TEST_CASE("a buffer is sent and received where a view would be") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  gdr::buffer<int, gdr::Host> out(64), in(64);
  std::iota(out.begin(), out.end(), 1);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    co_await a.send(out);
    CHECK(co_await b.recv(in) == 64 * sizeof(int));
  }());
  CHECK(std::equal(out.begin(), out.end(), in.begin()));
}

TEST_CASE("pinned views travel like host views") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<double, 8> out{1, 2, 3, 4, 5, 6, 7, 8}, in{};
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    co_await a.send(gdr::view<double, gdr::Pinned>(out.data(), out.size()));
    co_await b.recv(gdr::view<double, gdr::Pinned>(in.data(), in.size()));
  }());
  CHECK(in == out);
}

TEST_CASE("a failed send throws gdr::error at the co_await") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 1> x{};
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    co_await b.close();
    try {
      co_await a.send(gdr::host_view(x));
      FAIL("send to a closed peer succeeded");
    } catch (const gdr::error& e) {
      CHECK(e.code() == gdr::errc::peer_closed);
    }
  }());
}
