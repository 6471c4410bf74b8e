// gdr/transport/tcp/listener.hpp: an accept reads the listener's socket when
// it is submitted, not when its awaitable was built, so it never accepts on
// a descriptor number that a closed listener left to the next socket.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <utility>

#include <gdr/transport/tcp.hpp>

#include "tests/transport/tcp/tcp_test_util.hpp"

namespace tcp = gdr::tcp;
using namespace std::chrono_literals;

TEST_CASE("an accept built before its listener closed fails with closed, though the descriptor is reused") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    tcp::listener l(sched, tcp::address::loopback(0));
    const int fd = l.native_handle();
    REQUIRE(fd >= 0);
    auto acc = l.accept({2s});  // built while the listener is open, awaited later
    l.close();
    CHECK(l.native_handle() == -1);
    // Another listening socket gets the lowest free descriptor: the one just
    // closed. A connection waits on it.
    std::uint16_t port = 0;
    const int other = tcp_test::raw_listen(port);
    REQUIRE(other == fd);
    const int client = tcp_test::raw_connect(port);
    auto r = co_await std::move(acc).as_result();
    CHECK_FALSE(r.has_value());
    if (!r) CHECK(r.error() == gdr::errc::closed);
    // The other socket's connection is still there for its owner.
    ::fcntl(other, F_SETFL, O_NONBLOCK);
    const int taken = ::accept(other, nullptr, nullptr);
    CHECK(taken >= 0);
    if (taken >= 0) ::close(taken);
    ::close(client);
    ::close(other);
  }());
  CHECK(sched.inflight() == 0);
}

TEST_CASE("a listener moved after an accept was built leaves that accept closed; the moved-to one accepts") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    tcp::listener a(sched, tcp::address::loopback(0));
    auto stale = a.accept({2s});
    tcp::listener b = std::move(a);
    CHECK(a.native_handle() == -1);
    CHECK((co_await std::move(stale).as_result()).error() == gdr::errc::closed);
    auto acc = b.accept({2s});
    const int client = tcp_test::raw_connect(b.local_address().port());
    tcp::endpoint ep = co_await std::move(acc);
    CHECK(ep.is_open());
    ::close(client);
    co_await ep.close();
  }());
  CHECK(sched.inflight() == 0);
}

namespace {
struct tcp_opts_seen {
  int nodelay, user_timeout, keepalive, idle, interval, count;
};
tcp_opts_seen seen(int fd) {
  auto get = [fd](int level, int name) {
    int v = -1;
    socklen_t len = sizeof v;
    ::getsockopt(fd, level, name, &v, &len);
    return v;
  };
  return {get(IPPROTO_TCP, TCP_NODELAY),   get(IPPROTO_TCP, TCP_USER_TIMEOUT), get(SOL_SOCKET, SO_KEEPALIVE),
          get(IPPROTO_TCP, TCP_KEEPIDLE),  get(IPPROTO_TCP, TCP_KEEPINTVL),    get(IPPROTO_TCP, TCP_KEEPCNT)};
}
}  // namespace

// The listener sets the endpoint's socket options on the listening socket
// and an accepted socket carries them from there (checked once per process,
// set again where the kernel does not copy them): either way every accepted
// endpoint, the first and the later ones, has exactly the options asked for,
// and so has the connecting side, which sets its own.
TEST_CASE("accepted and connected endpoints have the socket options of their endpoint_options") {
  tcp_test::watchdog wd(30);
  gdr::scheduler sched;
  tcp::endpoint_options eo;
  eo.socket.user_timeout = 4321ms;
  eo.socket.keepalive_idle = 7s;
  eo.socket.keepalive_interval = 3s;
  eo.socket.keepalive_count = 4;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    tcp::listener l(sched, tcp::address::loopback(0), eo);
    for (int i = 0; i < 3; ++i) {
      auto acc = l.accept({5s});
      tcp::endpoint c = co_await tcp::connect(sched, l.local_address(), {5s}, gdr::default_registry(), eo);
      tcp::endpoint a = co_await std::move(acc);
      for (int fd : {a.native_handle(), c.native_handle()}) {
        tcp_opts_seen s = seen(fd);
        CHECK(s.nodelay != 0);
        CHECK(s.user_timeout == 4321);
        CHECK(s.keepalive != 0);
        CHECK(s.idle == 7);
        CHECK(s.interval == 3);
        CHECK(s.count == 4);
      }
      co_await a.close();
      co_await c.close();
    }
  }());
}
