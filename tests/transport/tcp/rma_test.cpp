// gdr/transport/tcp/endpoint.hpp: put and get, served by the owner's endpoint
// after memory_registry::resolve.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <gdr/sched/timer.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/transport/tcp/tcp_test_util.hpp"

using gdr::transfer_path;
namespace tcp = gdr::tcp;
using tcp_test::connected_pair;

TEST_CASE("put writes into the peer's registered memory and get reads it back") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::uint32_t> mem(64, 0);
  auto r = gdr::register_memory(reg, gdr::host_view(mem));
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;  // b owns `mem` (one registry per process)
    std::array<std::uint32_t, 8> src{};
    std::iota(src.begin(), src.end(), 100u);
    auto remote = r.describe().subview(10, 8);
    CHECK(co_await a.put(gdr::host_view(src), remote) == 32);
    CHECK(a.last_path() == transfer_path::host_eager);  // the request, copied with its 32 bytes
    std::array<std::uint32_t, 8> back{};
    CHECK(co_await a.get(gdr::host_view(back), remote) == 32);
    CHECK(back == src);
    CHECK(a.stats().puts == 1);
    CHECK(a.stats().gets == 1);
    CHECK(b.stats().served_puts == 1);
    CHECK(b.stats().served_gets == 1);
    co_await a.close();
    co_await b.close();
  }());
  CHECK(mem[9] == 0);
  CHECK(mem[10] == 100);
  CHECK(mem[17] == 107);
  CHECK(mem[18] == 0);
}

TEST_CASE("large puts and gets go straight between the wire and the memory") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::byte> mem(8 << 20);
  auto r = gdr::register_memory(reg, gdr::host_view(mem));
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::vector<std::byte> src(6 << 20);
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7 + 1);
    auto remote = r.describe().subview(1000, src.size());
    CHECK(co_await a.put(gdr::host_view(src), remote) == src.size());
    std::vector<std::byte> back(src.size());
    CHECK(co_await a.get(gdr::host_view(back), remote) == src.size());
    CHECK(back == src);
    CHECK(a.last_path() == transfer_path::host_zero_copy);
    CHECK(a.stats().direct_reads >= 1);
    CHECK(b.stats().direct_reads >= 1);
    co_await a.close();
    co_await b.close();
  }());
  CHECK(mem[1000] == std::byte{1});
}

TEST_CASE("every refused access fails with remote_access and touches nothing") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::uint8_t> mem(256, 0x11), ro(64, 0x22), wo(64, 0x33), gone(64, 0x44);
  auto rw_reg = gdr::register_memory(reg, gdr::host_view(mem));
  auto ro_reg = gdr::register_memory(reg, gdr::host_view(ro), gdr::access::read);
  auto wo_reg = gdr::register_memory(reg, gdr::host_view(wo), gdr::access::write);
  auto gone_reg = gdr::register_memory(reg, gdr::host_view(gone));
  auto gone_remote = gone_reg.describe();
  gone_reg.revoke();
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::vector<std::uint8_t> src(32, 0xAA), dst(32, 0x55);
    auto rw = rw_reg.describe();
    using rv = gdr::remote_view<std::uint8_t, gdr::Host>;
    struct refused_case {
      const char* what;
      rv remote;
    };
    std::vector<refused_case> cases = {
        {"past the end", rv(rw.address() + 240, 32, rw.key(), 0)},
        {"before the start", rv(rw.address() - 8, 32, rw.key(), 0)},
        {"address wrapping around", rv(~std::uint64_t{0} - 4, 32, rw.key(), 0)},
        {"wrong key", rv(rw.address(), 32, rw.key() ^ 1, 0)},
        {"key zero", rv(rw.address(), 32, 0, 0)},
        {"revoked registration", rv(gone_remote.address(), 32, gone_remote.key(), 0)},
        {"another registration's key", rv(rw.address(), 32, ro_reg.key(), 0)},
    };
    for (auto& c : cases) {
      CAPTURE(c.what);
      CHECK((co_await a.put(gdr::host_view(src), c.remote).as_result()).error() == gdr::errc::remote_access);
      CHECK((co_await a.get(gdr::host_view(dst), c.remote).as_result()).error() == gdr::errc::remote_access);
    }
    // Permissions: no put into read-only memory, no get from write-only memory.
    CHECK((co_await a.put(gdr::host_view(src), ro_reg.describe().subview(0, 32)).as_result()).error() ==
          gdr::errc::remote_access);
    CHECK((co_await a.get(gdr::host_view(dst), wo_reg.describe().subview(0, 32)).as_result()).error() ==
          gdr::errc::remote_access);
    // ...but the allowed directions work.
    CHECK(co_await a.get(gdr::host_view(dst), ro_reg.describe().subview(0, 32)) == 32);
    CHECK(dst[0] == 0x22);
    CHECK(co_await a.put(gdr::host_view(src), wo_reg.describe().subview(0, 32)) == 32);
    // A local view larger than the remote one is the caller's mistake, caught before sending.
    std::vector<std::uint8_t> big(64);
    CHECK((co_await a.put(gdr::host_view(big), rw.subview(0, 32)).as_result()).error() ==
          gdr::errc::invalid_argument);
    CHECK(b.stats().refused == 2 * cases.size() + 2);
    CHECK(a.is_open());
    CHECK(b.is_open());
    co_await a.close();
    co_await b.close();
  }());
  CHECK(std::all_of(mem.begin(), mem.end(), [](std::uint8_t v) { return v == 0x11; }));
  CHECK(std::all_of(ro.begin(), ro.end(), [](std::uint8_t v) { return v == 0x22; }));
  CHECK(std::all_of(gone.begin(), gone.end(), [](std::uint8_t v) { return v == 0x44; }));
  CHECK(wo[0] == 0xAA);
}

TEST_CASE("a refused put with a large payload is read and dropped and the stream stays in step") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::byte> mem(1 << 20);
  auto r = gdr::register_memory(reg, gdr::host_view(mem));
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::vector<std::byte> src(3 << 20, std::byte{7});
    gdr::remote_view<std::byte, gdr::Host> bad(r.describe().address(), src.size(), r.key() + 1, 0);
    CHECK((co_await a.put(gdr::host_view(src), bad).as_result()).error() == gdr::errc::remote_access);
    std::array<int, 2> msg{4, 2}, in{};
    auto rcv = b.recv(gdr::host_view(in));
    co_await a.send(gdr::host_view(msg));
    CHECK(co_await std::move(rcv) == 8);
    CHECK(in == msg);
    co_await a.close();
    co_await b.close();
  }());
}

TEST_CASE("both sides can put and get concurrently, interleaved with messages") {
  tcp_test::watchdog wd(60);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  constexpr int n = 64;
  std::vector<std::uint64_t> mem_a(n * 16), mem_b(n * 16);
  auto reg_a = gdr::register_memory(reg, gdr::host_view(mem_a));
  auto reg_b = gdr::register_memory(reg, gdr::host_view(mem_b));
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    int done = 0, bad = 0;
    std::vector<std::array<std::uint64_t, 16>> bufs(4 * n);
    for (int i = 0; i < n; ++i) {
      // a puts into b's memory, b puts into a's; then each gets it back.
      tcp_test::spawn([&, i]() -> gdr::task<> {
        auto& s = bufs[i];
        s.fill(1000 + i);
        auto remote = reg_b.describe().subview(i * 16, 16);
        co_await a.put(gdr::host_view(s), remote);
        auto& g = bufs[n + i];
        co_await a.get(gdr::host_view(g), remote);
        if (g != s) ++bad;
      }, done);
      tcp_test::spawn([&, i]() -> gdr::task<> {
        auto& s = bufs[2 * n + i];
        s.fill(2000 + i);
        auto remote = reg_a.describe().subview(i * 16, 16);
        co_await b.put(gdr::host_view(s), remote);
        auto& g = bufs[3 * n + i];
        co_await b.get(gdr::host_view(g), remote);
        if (g != s) ++bad;
      }, done);
      tcp_test::spawn([&, i]() -> gdr::task<> {
        std::array<int, 1> v{i};
        co_await a.send(gdr::host_view(v));
        std::array<int, 1> w{};
        co_await a.recv(gdr::host_view(w));
        if (w[0] != i) ++bad;
      }, done);
      tcp_test::spawn([&, i]() -> gdr::task<> {
        std::array<int, 1> v{};
        co_await b.recv(gdr::host_view(v));
        if (v[0] != i) ++bad;
        co_await b.send(gdr::host_view(v));
      }, done);
    }
    while (done < 4 * n) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(bad == 0);
    co_await a.close();
    co_await b.close();
  }());
  for (int i = 0; i < n; ++i) {
    CHECK(mem_b[i * 16] == static_cast<std::uint64_t>(1000 + i));
    CHECK(mem_a[i * 16 + 15] == static_cast<std::uint64_t>(2000 + i));
  }
}

TEST_CASE("a get queued behind a send the peer does not read yet is withdrawn at once when cancelled") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::byte> mem(4096, std::byte{9});
  auto r = gdr::register_memory(reg, gdr::host_view(mem));
  // The blocker goes eager (threshold raised) to a hand-written peer that
  // does not read yet (its hello counts no credits): more than the socket
  // buffers hold, so the send stays in flight and the get request waits
  // behind it. (A gdr peer would keep reading.)
  tcp::endpoint_options opts;
  opts.protocol.rendezvous_threshold = 64 << 20;
  std::vector<std::byte> blocker(32 << 20, std::byte{1});
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    tcp::listener l(sched, tcp::address::loopback(0), reg, opts);
    auto acc = l.accept();
    int fd = tcp_test::raw_connect(l.local_address().port());
    REQUIRE(tcp_test::send_hello(fd));
    tcp::endpoint a = co_await std::move(acc);
    int done = 0;
    tcp_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(blocker)); }, done);
    std::vector<std::byte> dst(mem.size(), std::byte{0});
    std::stop_source stop;
    gdr::result<std::size_t> got = gdr::errc::busy;  // not yet set
    tcp_test::spawn([&]() -> gdr::task<> {
      auto op = a.get(gdr::host_view(dst), r.describe(), {stop.get_token()});
      got = co_await std::move(op).as_result();
    }, done);
    co_await gdr::sleep_for(std::chrono::milliseconds(20));
    CHECK(done == 0);
    stop.request_stop();
    for (int i = 0; i < 100 && done < 1; ++i) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(done == 1);  // the get, at once; the send still waits
    CHECK(got.error() == gdr::errc::cancelled);
    // The peer reads now, on a thread of its own: a's handshake and the
    // blocker, and nothing after it (the request never went out).
    std::vector<tcp::frame_type> types;
    std::thread reader([&] {
      std::vector<std::byte> head(tcp::wire::header_size), payload;
      for (int i = 0; i < 3; ++i) {
        if (!tcp_test::raw_read(fd, head.data(), head.size())) return;
        auto pr = tcp::parse_frame(head, ~std::uint64_t{0});
        if (pr.status != tcp::frame_status::ok) return;
        payload.resize(pr.header.length);
        if (!payload.empty() && !tcp_test::raw_read(fd, payload.data(), payload.size())) return;
        types.push_back(pr.header.type);
      }
    });
    while (done < 2) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    reader.join();
    CHECK(types == std::vector<tcp::frame_type>{tcp::frame_type::hello, tcp::frame_type::credit,
                                                tcp::frame_type::eager});
    co_await gdr::sleep_for(std::chrono::milliseconds(20));
    char byte;
    CHECK(::recv(fd, &byte, 1, MSG_DONTWAIT) < 0);  // nothing more: no get request
    CHECK(std::all_of(dst.begin(), dst.end(), [](std::byte v) { return v == std::byte{0}; }));
    ::close(fd);
    co_await a.close();
  }());
}

TEST_CASE("a get cancelled while waiting for its reply completes at once and its late reply is dropped") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    // The target is a hand-written peer, so that the request can be held
    // unanswered for as long as the test likes (a gdr target's reader
    // never stops: its credits hold initiators back instead).
    tcp::listener l(sched, tcp::address::loopback(0));
    auto acc = l.accept();
    int fd = tcp_test::raw_connect(l.local_address().port());
    REQUIRE(tcp_test::send_hello(fd));
    tcp::endpoint a = co_await std::move(acc);
    REQUIRE(co_await tcp_test::read_hello(fd));
    std::vector<std::byte> peer_mem(4 << 20);
    // A view the peer "exposes": any address and key; the peer checks nothing.
    gdr::memory_registry peer_reg;
    auto peer_r = gdr::register_memory(peer_reg, gdr::host_view(peer_mem));
    auto remote = peer_r.describe();
    int done = 0;
    std::vector<std::byte> dst(1 << 20, std::byte{0});
    std::stop_source stop;
    gdr::result<std::size_t> got = gdr::errc::busy;  // not yet set
    tcp_test::spawn([&]() -> gdr::task<> {
      auto op = a.get(gdr::host_view(dst), remote.subview(0, dst.size()), {stop.get_token()});
      got = co_await std::move(op).as_result();
    }, done);
    auto req = co_await tcp_test::read_frame(fd);
    REQUIRE(req.status == tcp::frame_status::ok);
    REQUIRE(req.header.type == tcp::frame_type::get_request);
    CHECK(done == 0);
    stop.request_stop();
    for (int i = 0; i < 100 && done < 1; ++i) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(done == 1);
    CHECK(got.error() == gdr::errc::cancelled);
    // The late reply comes, then a message behind it on the same stream:
    // the reply is dropped (dst is never written), the message arrives.
    tcp_test::frame_stream out;
    out.seq = 1;
    tcp::frame_header reply;
    reply.type = tcp::frame_type::get_reply;
    reply.id = req.header.id;
    reply.length = dst.size();
    std::vector<std::byte> late(dst.size(), std::byte{9});
    out.add(reply, late);
    tcp::frame_header ping;
    ping.type = tcp::frame_type::eager;
    ping.length = 4;
    out.add(ping, "ping");
    REQUIRE(out.write_to(fd));
    std::array<char, 4> in{};
    CHECK(co_await a.recv(gdr::host_view(in)) == 4);
    CHECK(std::string(in.data(), 4) == "ping");
    CHECK(std::all_of(dst.begin(), dst.end(), [](std::byte v) { return v == std::byte{0}; }));
    // The endpoint is still in step: a new get is answered.
    std::array<std::byte, 16> small{};
    tcp_test::spawn([&]() -> gdr::task<> {
      CHECK(co_await a.get(gdr::host_view(small), remote.subview(0, 16)) == 16);
    }, done);
    auto req2 = co_await tcp_test::read_frame(fd);
    REQUIRE(req2.header.type == tcp::frame_type::get_request);
    reply.id = req2.header.id;
    reply.length = 16;
    out.add(reply, std::span<const std::byte>(late.data(), 16));
    REQUIRE(out.write_to(fd));
    while (done < 2) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(small[0] == std::byte{9});
    ::close(fd);
    co_await a.close();
  }());
}

TEST_CASE("a put or get larger than the peer accepts fails alone with message_too_large") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::byte> mem(4 << 20, std::byte{9});
  auto r = gdr::register_memory(reg, gdr::host_view(mem));
  tcp::endpoint_options opts;
  opts.protocol.max_message = 1 << 20;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg, opts);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    std::vector<std::byte> big((1 << 20) + 1, std::byte{1});
    auto remote = r.describe().subview(0, big.size());
    // A put over the peer's limit; a get over this side's own (its answer
    // would be refused here).
    CHECK((co_await a.put(gdr::host_view(big), remote).as_result()).error() == gdr::errc::message_too_large);
    CHECK((co_await a.get(gdr::host_view(big), remote).as_result()).error() == gdr::errc::message_too_large);
    CHECK(b.stats().served_puts == 0);
    CHECK(b.stats().served_gets == 0);
    CHECK(mem[0] == std::byte{9});  // nothing was written
    // At the limit, both work; the endpoints are unharmed.
    std::vector<std::byte> at(1 << 20, std::byte{2}), back(1 << 20);
    CHECK(co_await a.put(gdr::host_view(at), r.describe().subview(0, at.size())) == at.size());
    CHECK(co_await a.get(gdr::host_view(back), r.describe().subview(0, back.size())) == back.size());
    CHECK(back == at);
    CHECK(a.is_open());
    CHECK(b.is_open());
    co_await a.close();
    co_await b.close();
  }());
  CHECK(mem[0] == std::byte{2});
}

TEST_CASE("revoking a registration while the peer's put is being written into it waits until the put is done") {
  // The owner serves a 16 MiB put over many reads straight into the
  // registered memory. Before leases, revoke() only erased the key: the
  // caller could free the buffer while the kernel still wrote into it.
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  constexpr std::size_t size = std::size_t{16} << 20;
  std::vector<std::byte> target(size, std::byte{0}), src(size, std::byte{0x7});
  auto r = reg.register_memory(gdr::host_view(target));
  const auto rv = r.describe();
  int done = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto ab_pair = co_await connected_pair(sched, reg);
    auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
    auto& b = ab_pair.second;
    gdr::result<std::size_t> put = gdr::errc::busy;
    tcp_test::spawn([&]() -> gdr::task<> { put = co_await a.put(gdr::host_view(std::as_const(src)), rv).as_result(); },
                    done);
    // Wait until b's reader has started reading the payload into `target`.
    while (b.stats().direct_reads == 0 && done == 0) co_await gdr::sleep_for(std::chrono::microseconds(50));
    REQUIRE(b.stats().served_puts == 0);  // the access is in flight
    co_await r.revoke();
    // The revoke resumed only once the access had ended.
    CHECK(b.stats().served_puts == 1);
    CHECK(std::all_of(target.begin(), target.end(), [](std::byte x) { return x == std::byte{0x7}; }));
    while (done == 0) co_await gdr::sleep_for(std::chrono::milliseconds(1));
    CHECK(put.has_value());
    // Revoked: a new access is refused.
    gdr::result<std::size_t> late = co_await a.put(gdr::host_view(std::as_const(src)).first(16), rv.subview(0, 16)).as_result();
    CHECK(late.error() == gdr::errc::remote_access);
    co_await a.close();
  }());
  sched.drain();
}
