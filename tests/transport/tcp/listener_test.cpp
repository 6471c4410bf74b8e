// gdr/transport/tcp/listener.hpp: an accept reads the listener's socket when
// it is submitted, not when its awaitable was built, so it never accepts on
// a descriptor number that a closed listener left to the next socket.
#include <doctest/doctest.h>

#include <fcntl.h>
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
