// gdr/transport/loopback/endpoint.hpp: close, cancellation and timeouts.
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <stop_token>
#include <utility>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/loopback.hpp>

#include "tests/transport/loopback/test_util.hpp"

using namespace std::chrono_literals;
namespace lb = gdr::loopback;
using gdr::errc;

using gdr_test::error_of;

TEST_CASE("a close that times out waiting for an announced send aborts: pending operations on both ends fail") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  lb::options opts;
  opts.rendezvous_threshold = 0;  // every non-empty send waits for its receive
  auto ends = lb::make_pair(sched, gdr::default_registry(), opts);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 4> buf{};
  std::error_code a_send, b_send;
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    // Two sends in opposite directions, nobody receiving: both wait.
    gdr_test::spawn([&]() -> gdr::task<> { a_send = co_await error_of(a.send(gdr::host_view(buf))); }, done, failed);
    gdr_test::spawn([&]() -> gdr::task<> { b_send = co_await error_of(b.send(gdr::host_view(buf))); }, done, failed);
    CHECK(done == 0);
    // A close waits for a's announced send to be received; nobody will, so
    // its timeout aborts the connection instead.
    CHECK(co_await error_of(a.close(gdr_test::timeout_opts(20ms))) == errc::timed_out);
    while (done < 2) co_await gdr::nop();
    CHECK(a_send == errc::closed);
    // a, closing, receives nothing more: it declined b's announcement when
    // its close began (GUIDE section 8).
    CHECK(b_send == errc::peer_closed);
    // Later operations fail the same way.
    CHECK(co_await error_of(a.send(gdr::host_view(buf))) == errc::closed);
    CHECK(co_await error_of(a.recv(gdr::host_view(buf))) == errc::closed);
    CHECK(co_await error_of(b.send(gdr::host_view(buf))) == errc::connection_lost);
    CHECK(co_await error_of(b.recv(gdr::host_view(buf))) == errc::connection_lost);
  }());
  CHECK(failed == 0);
  CHECK(!a.is_open());
  CHECK(!b.is_open());
  CHECK(sched.inflight() == 0);
}

TEST_CASE("pending receives on both ends fail when one end closes") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 4> x{}, y{};
  std::error_code a_recv, b_recv;
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> { a_recv = co_await error_of(a.recv(gdr::host_view(x))); }, done, failed);
    gdr_test::spawn([&]() -> gdr::task<> { b_recv = co_await error_of(b.recv(gdr::host_view(y))); }, done, failed);
    co_await b.close();
    while (done < 2) co_await gdr::nop();
  }());
  CHECK(a_recv == errc::peer_closed);
  CHECK(b_recv == errc::closed);
}

TEST_CASE("messages sent before a close are still delivered to the peer, then peer_closed") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 2> m{5, 6}, in{};
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    co_await a.send(gdr::host_view(m));  // eager: kept by b
    co_await a.close();
    std::size_t n = co_await b.recv(gdr::host_view(in));
    CHECK(n == sizeof m);
    CHECK(co_await error_of(b.recv(gdr::host_view(in))) == errc::peer_closed);
  }());
  CHECK(in == m);
}

TEST_CASE("destroying an endpoint closes it") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto pair = lb::make_pair(sched);
  lb::endpoint b = std::move(pair.second);
  std::array<int, 1> x{};
  std::error_code ec;
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> { ec = co_await error_of(b.recv(gdr::host_view(x))); }, done, failed);
    { lb::endpoint gone = std::move(pair.first); }
    while (done < 1) co_await gdr::nop();
  }());
  CHECK(ec == errc::connection_lost);
  CHECK(!pair.first.is_open());  // moved-from: belongs to no pair
}

TEST_CASE("a send whose frame the dropped peer never took fails with connection_lost, and the endpoint already says so") {
  // The sequence the stress test found (loopback, seed 91): b is dropped
  // while a's message is still queued for it. The frame comes back untaken
  // with connection_lost, and the peer-gone event comes after it. Before,
  // the send's coroutine resumed while a.error() still said nothing (or
  // closed, with a close under way), and the endpoint failed only later.
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto pair = lb::make_pair(sched);
  lb::endpoint a = std::move(pair.first);
  std::array<int, 4> x{1, 2, 3, 4};
  std::error_code sent, state_then;
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn(
        [&]() -> gdr::task<> {
          sent = co_await error_of(a.send(gdr::host_view(x)));
          state_then = a.error();
        },
        done, failed);
    { lb::endpoint gone = std::move(pair.second); }
    while (done < 1) co_await gdr::nop();
  }());
  CHECK(failed == 0);
  CHECK(sent == errc::connection_lost);
  CHECK(state_then == errc::connection_lost);
  CHECK(a.error() == errc::connection_lost);
}

TEST_CASE("close is idempotent, can be awaited like the TCP endpoint's, and error() says why an end stopped") {
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  CHECK(!a.error());
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::size_t n = co_await a.close();
    CHECK(n == 0);
    gdr::result<std::size_t> r = co_await a.close().as_result();
    CHECK(r.has_value());
  }());
  CHECK(a.error() == errc::closed);
  CHECK(b.error() == errc::peer_closed);
  gdr::sync_wait(sched, [&]() -> gdr::task<> { co_await b.close(); }());
  CHECK(!a.is_open());
  CHECK(!b.is_open());
  CHECK(lb::endpoint().error() == errc::closed);
}

TEST_CASE("a stop request through op_options cancels a waiting receive") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 4> x{};
  std::stop_source src;
  std::error_code ec;
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> { ec = co_await error_of(b.recv(gdr::host_view(x), gdr_test::stop_opts(src.get_token()))); },
                    done, failed);
    co_await gdr::sleep_for(2ms);
    CHECK(done == 0);
    src.request_stop();
    while (done < 1) co_await gdr::nop();
    // The endpoint is still usable, and the cancelled receive took nothing.
    std::array<int, 4> m{1, 2, 3, 4};
    co_await a.send(gdr::host_view(m));
    co_await b.recv(gdr::host_view(x));
    CHECK(x == m);
  }());
  CHECK(ec == errc::cancelled);
  CHECK(b.stats().failed == 1);
  CHECK(b.stats().recvs == 1);
}

TEST_CASE("op_options braced inside the co_await expression are destroyed once") {
  // GCC 12 destroyed an aggregate temporary built there twice: the stop
  // token's shared state was released early, and a later request_stop (or
  // the source's destructor) touched freed memory; ASan names it. op_options
  // has constructors so that this cannot happen (gdr/transfer/common.hpp).
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::stop_source src;
  std::array<int, 4> m{1, 2, 3, 4}, x{};
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    for (int i = 0; i < 100; ++i) {
      co_await a.send(gdr::host_view(std::as_const(m)), {src.get_token()});
      co_await b.recv(gdr::host_view(x), {src.get_token(), 5s});
      co_await a.send(gdr::host_view(std::as_const(m)), {5s});
      auto r = co_await b.recv(gdr::host_view(x), {src.get_token()}).as_result();
      CHECK(r.value() == sizeof m);
    }
  }());
  CHECK(x == m);
  CHECK(src.stop_possible());
  CHECK(src.request_stop());
  CHECK(src.get_token().stop_requested());
  CHECK(b.stats().recvs == 200);
}

TEST_CASE("the awaiting coroutine's stop token cancels a waiting send") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  lb::options opts;
  opts.rendezvous_threshold = 0;  // every non-empty send waits for its receive
  auto ends = lb::make_pair(sched, gdr::default_registry(), opts);
  lb::endpoint& a = ends.first;
  std::array<int, 4> x{};
  std::stop_source src;
  std::error_code ec;
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> {
      ec = co_await gdr::with_stop_token(src.get_token(), error_of(a.send(gdr::host_view(x))));
    }, done, failed);
    co_await gdr::nop();
    CHECK(done == 0);
    src.request_stop();
    while (done < 1) co_await gdr::nop();
  }());
  CHECK(ec == errc::cancelled);
}

TEST_CASE("an operation whose stop was requested before it started fails at once without moving bytes") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 1> x{42}, in{};
  std::stop_source src;
  src.request_stop();
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    CHECK(co_await error_of(a.send(gdr::host_view(x), gdr_test::stop_opts(src.get_token()))) == errc::cancelled);
    CHECK(co_await error_of(b.recv(gdr::host_view(in), gdr_test::stop_opts(src.get_token()))) == errc::cancelled);
    // Nothing was queued by the cancelled send.
    CHECK(co_await error_of(b.recv(gdr::host_view(in), gdr_test::timeout_opts(1ms))) == errc::timed_out);
  }());
  CHECK(in[0] == 0);
}

TEST_CASE("a receive with a timeout fails with timed_out when nothing arrives") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& b = ends.second;
  std::array<int, 1> x{};
  auto t0 = std::chrono::steady_clock::now();
  std::error_code ec = gdr::sync_wait(sched, error_of(b.recv(gdr::host_view(x), gdr_test::timeout_opts(20ms))));
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(ec == errc::timed_out);
  CHECK(took >= 20ms);
  CHECK(took < 5s);
  CHECK(sched.inflight() == 0);  // the timer's CQE was awaited
}

TEST_CASE("a send with a timeout fails with timed_out when nobody receives, and is withdrawn") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  lb::options opts;
  opts.rendezvous_threshold = 0;  // every non-empty send waits for its receive
  auto ends = lb::make_pair(sched, gdr::default_registry(), opts);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 1> x{7}, y{8}, in{};
  int done = 0, failed = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    CHECK(co_await error_of(a.send(gdr::host_view(x), gdr_test::timeout_opts(5ms))) == errc::timed_out);
    // The timed-out message is gone: the receiver sees the next one.
    gdr_test::spawn([&]() -> gdr::task<> { co_await a.send(gdr::host_view(y)); }, done, failed);
    co_await b.recv(gdr::host_view(in));
    while (done < 1) co_await gdr::nop();
  }());
  CHECK(in[0] == 8);
  CHECK(sched.inflight() == 0);
}

TEST_CASE("an operation that completes before its timeout succeeds and its timer is removed") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 1> x{3}, in{};
  int done = 0, failed = 0;
  auto t0 = std::chrono::steady_clock::now();
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr_test::spawn([&]() -> gdr::task<> {
      std::size_t n = co_await b.recv(gdr::host_view(in), gdr_test::timeout_opts(10s));
      CHECK(n == sizeof(int));
    }, done, failed);
    co_await gdr::sleep_for(1ms);
    co_await a.send(gdr::host_view(x));
    while (done < 1) co_await gdr::nop();
  }());
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);  // did not wait for the 10 s timer
  CHECK(in[0] == 3);
  CHECK(failed == 0);
  CHECK(sched.inflight() == 0);
}

TEST_CASE("a timeout and a stop request racing on many receives each complete exactly once") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  auto ends = lb::make_pair(sched);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  constexpr int n = 200;
  std::vector<std::array<int, 1>> in(n);
  std::stop_source src;
  int done = 0, failed = 0, cancelled = 0, timed_out = 0, ok = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    for (int i = 0; i < n; ++i)
      gdr_test::spawn([&, i]() -> gdr::task<> {
        std::error_code ec = co_await error_of(
            b.recv(gdr::host_view(in[i]), gdr_test::stop_opts(src.get_token(), std::chrono::microseconds(500 + 10 * i))));
        if (!ec) ++ok;
        else if (ec == errc::cancelled) ++cancelled;
        else if (ec == errc::timed_out) ++timed_out;
      }, done, failed);
    std::array<int, 1> m{1};
    for (int i = 0; i < 10; ++i) co_await a.send(gdr::host_view(m));
    co_await gdr::sleep_for(1ms);
    src.request_stop();
    while (done < n) co_await gdr::nop();
    // How many sends met a receive before the receives ran out depends on
    // timing; none is lost: the rest were kept and are received now.
    std::array<int, 1> x{};
    for (int i = ok; i < 10; ++i) CHECK(co_await b.recv(gdr::host_view(x), gdr_test::timeout_opts(5s)) == sizeof x);
    CHECK(co_await error_of(b.recv(gdr::host_view(x), gdr_test::timeout_opts(1ms))) == errc::timed_out);
  }());
  CHECK(failed == 0);
  CHECK(ok >= 1);
  CHECK(ok <= 10);
  CHECK(ok + cancelled + timed_out == n);
  CHECK(sched.inflight() == 0);
}
