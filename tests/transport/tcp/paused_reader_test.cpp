// gdr/transport/tcp: a paused reader still sees the peer leave (engine
// issue, defect 10). The engine pauses its reader when this side cannot
// take the next frame yet (here: a hand-written peer that counts no credits
// sends more early messages than the endpoint keeps). No read is posted
// then, so before, a peer that went away was never noticed and a receive
// waiting for it stayed pending for ever. Now a peer gone without a close
// fails the pending receives with connection_lost at once; a peer that
// closed in order leaves what it sent receivable.
#include <doctest/doctest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>

#include <gdr/sched/timer.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/transport/tcp/tcp_test_util.hpp"

namespace tcp = gdr::tcp;
using namespace std::chrono_literals;

namespace {

using tcp_test::raw_peer;

// An endpoint keeping one early message, whose peer is a raw socket that
// counts no credits.
gdr::task<> make_one_kept_peer(gdr::scheduler& s, raw_peer& p) {
  tcp::endpoint_options o;
  o.protocol.unexpected_messages = 1;
  co_await tcp_test::make_raw_peer(s, p, o);
}

}  // namespace

TEST_CASE("a receive pending on a paused reader fails with connection_lost when the peer goes away without closing") {
  tcp_test::watchdog wd(30);
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    CAPTURE(static_cast<int>(mode));
    gdr::scheduler sched({.mode = mode});
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      raw_peer p;
      co_await make_one_kept_peer(sched, p);
      std::array<std::byte, 16> m{}, in{};
      gdr::op_report r;
      int done = 0;
      tcp_test::start(p.ep.recv(gdr::host_view(in), gdr::tag{7}), r, done);
      p.eager(1, m);
      p.eager(1, m);  // beyond the one kept: the reader pauses on it
      for (int i = 0; i < 2000 && p.ep.stats().paused == 0; ++i) co_await gdr::sleep_for(1ms);
      REQUIRE(p.ep.stats().paused != 0);
      auto t0 = std::chrono::steady_clock::now();
      ::close(std::exchange(p.fd, -1));  // gone, no close frame
      while (done < 1 && std::chrono::steady_clock::now() - t0 < 5s) co_await gdr::sleep_for(1ms);
      CHECK(done == 1);
      CHECK(r.error == gdr::errc::connection_lost);
      CHECK(std::chrono::steady_clock::now() - t0 < 2s);
      co_await p.ep.close();
    }());
    CHECK(sched.inflight() == 0);
  }
}

TEST_CASE("a paused reader whose peer closed in order stays paused and what the peer sent is still received") {
  tcp_test::watchdog wd(30);
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    CAPTURE(static_cast<int>(mode));
    gdr::scheduler sched({.mode = mode});
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      raw_peer p;
      co_await make_one_kept_peer(sched, p);
      std::array<std::byte, 16> m1{}, m2{}, in{};
      m1.fill(std::byte{1});
      m2.fill(std::byte{2});
      gdr::op_report r;
      int done = 0;
      tcp_test::start(p.ep.recv(gdr::host_view(in), gdr::tag{7}), r, done);
      p.eager(1, m1);
      p.eager(1, m2);
      p.close_frame();
      ::shutdown(p.fd, SHUT_WR);  // its end of stream follows its close frame
      for (int i = 0; i < 2000 && p.ep.stats().paused == 0; ++i) co_await gdr::sleep_for(1ms);
      REQUIRE(p.ep.stats().paused != 0);
      co_await gdr::sleep_for(100ms);  // the end of stream has come
      CHECK(done == 0);                // still paused, nothing lost
      CHECK(co_await p.ep.recv(gdr::host_view(in), gdr::tag{1}) == in.size());
      CHECK(in == m1);
      CHECK(co_await p.ep.recv(gdr::host_view(in), gdr::tag{1}) == in.size());
      CHECK(in == m2);
      for (int i = 0; i < 2000 && done < 1; ++i) co_await gdr::sleep_for(1ms);
      CHECK(done == 1);
      CHECK(r.error == gdr::errc::peer_closed);
      co_await p.ep.close();
    }());
    CHECK(sched.inflight() == 0);
  }
}
