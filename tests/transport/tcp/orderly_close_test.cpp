// gdr/transport/tcp: an orderly close while the peer is still sending. The
// closing side ends its half of the stream after the close frame and reads
// (and drops) what the peer still sends until the peer's end of stream, so
// no reset is sent: every message whose send succeeded before close()
// returned is received, and the peer sees peer_closed, never
// connection_lost. The close is bounded by its timeout when the peer never
// ends its stream.
#include <doctest/doctest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gdr/sched/timer.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/transport/tcp/tcp_test_util.hpp"

namespace tcp = gdr::tcp;
using namespace std::chrono_literals;
using tcp_test::connected_pair;

namespace {

// TcpExt's TCPAbortOnData (resets sent because data arrived on a socket
// closed for reading), from /proc/net/netstat; -1 if it cannot be read. It
// counts for the whole network namespace, so the tests print it and do not
// check it.
long abort_on_data() {
  std::ifstream in("/proc/net/netstat");
  std::string names, values;
  while (std::getline(in, names) && std::getline(in, values)) {
    if (names.rfind("TcpExt:", 0) != 0) continue;
    std::istringstream n(names), v(values);
    std::string name, value;
    while (n >> name && v >> value)
      if (name == "TCPAbortOnData") return std::stol(value);
  }
  return -1;
}

// Message i's size: eager ones of two sizes and rendezvous ones (the
// threshold is 64 KiB in these tests).
std::size_t size_of(std::uint64_t i) {
  switch (i % 3) {
    case 0: return 512;
    case 1: return 48 << 10;
    default: return 200 << 10;
  }
}

// Fills `buf` for message i (its number in the first 8 bytes) and returns
// the view of its size.
std::span<std::byte> fill(std::vector<std::byte>& buf, std::uint64_t i) {
  std::size_t n = size_of(i);
  std::memset(buf.data(), static_cast<int>(i & 0xff), n);
  std::memcpy(buf.data(), &i, sizeof i);
  return {buf.data(), n};
}

struct stream_counts {
  std::uint64_t ok = 0;   // sends that succeeded / messages received in order
  bool in_order = true;   // each message received was the next one, whole
  std::error_code end{};  // the error that ended the loop
};

gdr::task<> send_loop(tcp::endpoint& ep, stream_counts& c) {
  std::vector<std::byte> buf(size_of(2));
  for (std::uint64_t i = 0;; ++i) {
    std::span<std::byte> msg = fill(buf, i);
    auto r = co_await ep.send(gdr::host_view(msg)).as_result();
    if (!r) {
      c.end = r.error();
      co_return;
    }
    ++c.ok;
  }
}

gdr::task<> recv_loop(tcp::endpoint& ep, stream_counts& c) {
  std::vector<std::byte> buf(size_of(2));
  for (std::uint64_t i = 0;; ++i) {
    auto r = co_await ep.recv(gdr::host_view(buf)).as_result();
    if (!r) {
      c.end = r.error();
      co_return;
    }
    std::uint64_t got = 0;
    std::memcpy(&got, buf.data(), sizeof got);
    if (got != i || *r != size_of(i) || buf[*r - 1] != static_cast<std::byte>(i & 0xff)) c.in_order = false;
    ++c.ok;
  }
}

tcp::endpoint_options test_options() {
  tcp::endpoint_options o;
  o.protocol.rendezvous_threshold = 64 << 10;
  return o;
}

}  // namespace

TEST_CASE("a close while both sides send: every send that succeeded before it returned is received, the peer sees peer_closed") {
  tcp_test::watchdog wd(120);
  long aborts0 = abort_on_data();
  int lost_rounds = 0, reset_rounds = 0, rounds = 0;
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    for (int round = 0; round < 10; ++round) {
      CAPTURE(static_cast<int>(mode));
      CAPTURE(round);
      ++rounds;
      gdr::scheduler sched({.mode = mode});
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        auto ab_pair = co_await connected_pair(sched, gdr::default_registry(), test_options());
        auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
        auto& b = ab_pair.second;
        stream_counts a_out, a_in, b_out, b_in;
        int done = 0;
        tcp_test::spawn([&]() -> gdr::task<> { co_await send_loop(a, a_out); }, done);
        tcp_test::spawn([&]() -> gdr::task<> { co_await recv_loop(b, b_in); }, done);
        tcp_test::spawn([&]() -> gdr::task<> { co_await send_loop(b, b_out); }, done);
        tcp_test::spawn([&]() -> gdr::task<> { co_await recv_loop(a, a_in); }, done);
        // Both directions busy, then a closes in the middle of it.
        while (a_out.ok < 100 + 37 * static_cast<std::uint64_t>(round) || b_out.ok < 100) co_await gdr::nop();
        auto t0 = std::chrono::steady_clock::now();
        auto closed = co_await a.close({5s}).as_result();
        auto took = std::chrono::steady_clock::now() - t0;
        std::uint64_t sent_before_return = a_out.ok;
        while (done < 4) co_await gdr::nop();
        CAPTURE(closed.has_value() ? std::string("ok") : closed.error().message());
        CHECK(closed.has_value());
        CHECK(took < 5s);
        CHECK(a_out.end == gdr::errc::closed);
        CHECK(a_in.end == gdr::errc::closed);
        // The peer: every message a's sends delivered before close returned,
        // in order, then peer_closed on both of its loops.
        CAPTURE(sent_before_return);
        CAPTURE(b_in.ok);
        CAPTURE(b_in.end.message());
        CAPTURE(b_out.end.message());
        CHECK(b_in.in_order);
        CHECK(b_in.ok >= sent_before_return);
        CHECK(b_in.end == gdr::errc::peer_closed);
        CHECK(b_out.end == gdr::errc::peer_closed);
        if (b_in.ok < sent_before_return) ++lost_rounds;
        if (b_in.end == gdr::errc::connection_lost || b_out.end == gdr::errc::connection_lost) ++reset_rounds;
        co_await b.close();
      }());
      CHECK(sched.inflight() == 0);
    }
  }
  long aborts1 = abort_on_data();
  MESSAGE("rounds " << rounds << ": messages lost in " << lost_rounds << ", peer saw connection_lost in "
                    << reset_rounds << "; TCPAbortOnData " << aborts0 << " -> " << aborts1);
}

TEST_CASE("both ends closing at once while both send eager and rendezvous messages: both closes succeed at once, no side sees connection_lost") {
  tcp_test::watchdog wd(60);
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    for (int round = 0; round < 5; ++round) {
      CAPTURE(static_cast<int>(mode));
      CAPTURE(round);
      gdr::scheduler sched({.mode = mode});
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        // A rendezvous send still announced when both ends close is
        // declined by the closing peer (rts_withdrawn), so neither close
        // waits for a receive the other will never post.
        auto ab_pair = co_await connected_pair(sched, gdr::default_registry(), test_options());
        auto& a = ab_pair.first;  // (clang 14 cannot capture structured bindings)
        auto& b = ab_pair.second;
        stream_counts a_out, a_in, b_out, b_in;
        int done = 0;
        tcp_test::spawn([&]() -> gdr::task<> { co_await send_loop(a, a_out); }, done);
        tcp_test::spawn([&]() -> gdr::task<> { co_await recv_loop(b, b_in); }, done);
        tcp_test::spawn([&]() -> gdr::task<> { co_await send_loop(b, b_out); }, done);
        tcp_test::spawn([&]() -> gdr::task<> { co_await recv_loop(a, a_in); }, done);
        while (a_out.ok < 100 || b_out.ok < 100 + 29 * static_cast<std::uint64_t>(round)) co_await gdr::nop();
        gdr::result<std::size_t> ca = gdr::errc::busy, cb = gdr::errc::busy;
        auto t0 = std::chrono::steady_clock::now();
        tcp_test::spawn([&]() -> gdr::task<> { ca = co_await a.close({5s}).as_result(); }, done);
        tcp_test::spawn([&]() -> gdr::task<> { cb = co_await b.close({5s}).as_result(); }, done);
        while (done < 6) co_await gdr::nop();
        auto took = std::chrono::steady_clock::now() - t0;
        CAPTURE(ca.has_value() ? std::string("ok") : ca.error().message());
        CAPTURE(cb.has_value() ? std::string("ok") : cb.error().message());
        CHECK(ca.has_value());
        CHECK(cb.has_value());
        CHECK(took < 2s);  // neither waited for its timeout nor for close_linger
        // Each side stopped receiving when its own close started; what it
        // sees is its own close or the peer's, never a lost connection.
        for (stream_counts* c : {&a_out, &a_in, &b_out, &b_in}) {
          CAPTURE(c->end.message());
          CHECK((c->end == gdr::errc::closed || c->end == gdr::errc::peer_closed));
          CHECK(c->in_order);
        }
      }());
      CHECK(sched.inflight() == 0);
    }
  }
}

TEST_CASE("a close whose peer never ends its stream completes within its timeout and drops the connection") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    tcp::listener l(sched, tcp::address::loopback(0));
    auto acc = l.accept();
    int fd = tcp_test::raw_connect(l.local_address().port());
    REQUIRE(tcp_test::send_hello(fd));
    tcp::endpoint ep = co_await std::move(acc);
    std::array<int, 4> out{1, 2, 3, 4};
    // The raw peer reads nothing and never shuts down its side: the sends
    // are in its kernel, the close frame too, but no end of stream comes.
    CHECK(co_await ep.send(gdr::host_view(out)) == sizeof out);
    auto t0 = std::chrono::steady_clock::now();
    auto closed = co_await ep.close({200ms}).as_result();
    auto took = std::chrono::steady_clock::now() - t0;
    CHECK(closed.error() == gdr::errc::timed_out);
    CHECK(took >= 150ms);
    CHECK(took < 2s);
    CHECK(ep.native_handle() == -1);
    ::close(fd);
  }());
  CHECK(sched.inflight() == 0);
}

TEST_CASE("a close without a timeout whose peer never ends its stream drops the connection after close_linger") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  tcp::endpoint_options o;
  o.close_linger = 300ms;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    tcp::listener l(sched, tcp::address::loopback(0), gdr::default_registry(), o);
    auto acc = l.accept();
    int fd = tcp_test::raw_connect(l.local_address().port());
    REQUIRE(tcp_test::send_hello(fd));
    tcp::endpoint ep = co_await std::move(acc);
    auto t0 = std::chrono::steady_clock::now();
    auto closed = co_await ep.close().as_result();
    auto took = std::chrono::steady_clock::now() - t0;
    CHECK(closed.has_value());
    CHECK(took >= 250ms);
    CHECK(took < 3s);
    CHECK(ep.native_handle() == -1);
    ::close(fd);
  }());
  CHECK(sched.inflight() == 0);
}

TEST_CASE("a close whose peer ends its stream after reading the close frame succeeds without waiting for the timeout") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    tcp::listener l(sched, tcp::address::loopback(0));
    auto acc = l.accept();
    int fd = tcp_test::raw_connect(l.local_address().port());
    // The raw peer sends eager messages nobody receives (the closing side
    // drops those that come after its close started), and ends its stream
    // once it has read the endpoint's hello, credit and close frames.
    tcp_test::frame_stream out(tcp_test::hello_header());
    std::vector<std::byte> payload(1024, std::byte{0x5a});
    for (int i = 0; i < 300; ++i) {
      gdr::tcp::frame_header h;
      h.type = gdr::tcp::frame_type::eager;
      h.length = payload.size();
      out.add(h, payload);
    }
    tcp::endpoint ep = co_await std::move(acc);
    std::thread peer([&] {
      tcp_test::raw_write(fd, out.bytes.data(), out.bytes.size());
      std::vector<std::byte> in(3 * gdr::tcp::wire::header_size);
      tcp_test::raw_read(fd, in.data(), in.size());
      ::shutdown(fd, SHUT_WR);
    });
    auto t0 = std::chrono::steady_clock::now();
    auto closed = co_await ep.close({5s}).as_result();
    auto took = std::chrono::steady_clock::now() - t0;
    peer.join();
    CAPTURE(closed.has_value() ? std::string("ok") : closed.error().message());
    CHECK(closed.has_value());
    CHECK(took < 4s);
    ::close(fd);
  }());
  CHECK(sched.inflight() == 0);
}
