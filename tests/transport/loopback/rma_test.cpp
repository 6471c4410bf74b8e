// gdr/transport/loopback/endpoint.hpp: one-sided put and get, checked through
// the memory registry.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <numeric>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/transport/loopback.hpp>

#include "tests/transport/loopback/test_util.hpp"

namespace lb = gdr::loopback;
using gdr::errc;
using gdr::transfer_path;

using gdr_test::error_of;

TEST_CASE("put writes into the peer's registered memory and get reads it back") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  auto ends = lb::make_pair(sched, reg);
  lb::endpoint& a = ends.first;
  std::vector<std::uint64_t> target(256, 0);
  auto r = reg.register_memory(gdr::host_view(target));
  // What b would send to a in a message: the wire record, parsed back.
  auto wire = r.describe(1).to_wire();
  auto remote = gdr::remote_view<std::uint64_t, gdr::Host>::from_wire(wire).value();
  std::vector<std::uint64_t> src(100), back(100, 0);
  std::iota(src.begin(), src.end(), 1000u);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::size_t n = co_await a.put(gdr::host_view(std::as_const(src)), remote.subview(50));
    CHECK(n == 800);
    CHECK(a.last_path() == transfer_path::host_zero_copy);
    std::size_t m = co_await a.get(gdr::host_view(back), remote.subview(50, 100));
    CHECK(m == 800);
  }());
  sched.drain();  // the serving end releases its leases when its answers are back
  for (int i = 0; i < 50; ++i) CHECK(target[i] == 0);
  for (int i = 0; i < 100; ++i) CHECK(target[50 + i] == 1000u + i);
  for (int i = 150; i < 256; ++i) CHECK(target[i] == 0);
  CHECK(back == src);
  CHECK(a.stats().puts == 1);
  CHECK(a.stats().gets == 1);
  CHECK(a.stats().bytes_sent == 800);
  CHECK(a.stats().bytes_received == 800);
}

TEST_CASE("put and get outside a registration, with a wrong key, or after revocation fail with remote_access and touch nothing") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  auto ends = lb::make_pair(sched, reg);
  lb::endpoint& a = ends.first;
  std::vector<std::uint8_t> mem(64, 0x11);
  auto r = reg.register_memory(gdr::host_view(mem).subview(16, 32));  // bytes [16, 48)
  auto good = r.describe();
  std::array<std::uint8_t, 8> src{9, 9, 9, 9, 9, 9, 9, 9}, dst{};
  const std::uint64_t base = good.address();
  using rv = gdr::remote_view<std::uint8_t, gdr::Host>;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto s = gdr::host_view(std::as_const(src));
    auto d = gdr::host_view(dst);
    // Just before and just after the registration.
    CHECK(co_await error_of(a.put(s, rv(base - 1, 8, good.key(), 0))) == errc::remote_access);
    CHECK(co_await error_of(a.put(s, rv(base + 25, 8, good.key(), 0))) == errc::remote_access);
    CHECK(co_await error_of(a.get(d, rv(base + 25, 8, good.key(), 0))) == errc::remote_access);
    // A range whose end overflows the address space.
    CHECK(co_await error_of(a.put(s, rv(~std::uint64_t{0} - 3, 8, good.key(), 0))) == errc::remote_access);
    // A wrong key.
    CHECK(co_await error_of(a.put(s, rv(base, 8, good.key() ^ 1, 0))) == errc::remote_access);
    // The last 8 bytes fit exactly.
    CHECK(co_await a.put(s, rv(base + 24, 8, good.key(), 0)) == 8);
    r.revoke();
    CHECK(co_await error_of(a.put(s, good.subview(0, 8))) == errc::remote_access);
    CHECK(co_await error_of(a.get(d, good.subview(0, 8))) == errc::remote_access);
  }());
  sched.drain();  // the serving end releases its leases when its answers are back
  for (int i = 0; i < 40; ++i) CHECK(mem[i] == 0x11);
  for (int i = 40; i < 48; ++i) CHECK(mem[i] == 9);
  for (int i = 48; i < 64; ++i) CHECK(mem[i] == 0x11);
  CHECK(dst == std::array<std::uint8_t, 8>{});
  CHECK(a.stats().failed == 7);
  CHECK(a.stats().puts == 1);
}

TEST_CASE("a read-only registration refuses put and a write-only one refuses get") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  auto ends = lb::make_pair(sched, reg);
  lb::endpoint& a = ends.first;
  std::array<int, 4> ro{1, 2, 3, 4}, wo{5, 6, 7, 8}, buf{0, 0, 0, 0};
  auto r1 = reg.register_memory(gdr::host_view(ro), gdr::access::read);
  auto r2 = reg.register_memory(gdr::host_view(wo), gdr::access::write);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    CHECK(co_await error_of(a.put(gdr::host_view(std::as_const(buf)), r1.describe())) == errc::remote_access);
    CHECK(co_await error_of(a.get(gdr::host_view(buf), r2.describe())) == errc::remote_access);
    CHECK(co_await a.get(gdr::host_view(buf), r1.describe()) == 16);
    CHECK(buf == ro);
    CHECK(co_await a.put(gdr::host_view(std::as_const(buf)), r2.describe()) == 16);
  }());
  sched.drain();  // the serving end releases its leases when its answers are back
  CHECK(ro == std::array<int, 4>{1, 2, 3, 4});
  CHECK(wo == std::array<int, 4>{1, 2, 3, 4});
}

TEST_CASE("a local view larger than the remote view is an invalid argument") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  auto ends = lb::make_pair(sched, reg);
  lb::endpoint& a = ends.first;
  std::array<int, 8> mem{}, big{};
  auto r = reg.register_memory(gdr::host_view(mem));
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    CHECK(co_await error_of(a.put(gdr::host_view(std::as_const(big)), r.describe().subview(0, 4))) ==
          errc::invalid_argument);
  }());
  sched.drain();  // the serving end releases its leases when its answers are back
}

TEST_CASE("put and get on a closed pair fail, and a stop request cancels them") {
  gdr_test::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  auto ends = lb::make_pair(sched, reg);
  lb::endpoint& a = ends.first;
  lb::endpoint& b = ends.second;
  std::array<int, 2> mem{}, x{1, 2};
  auto r = reg.register_memory(gdr::host_view(mem));
  std::stop_source src;
  src.request_stop();
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    CHECK(co_await error_of(a.put(gdr::host_view(std::as_const(x)), r.describe(), gdr_test::stop_opts(src.get_token()))) ==
          errc::cancelled);
    co_await b.close();
    CHECK(co_await error_of(a.put(gdr::host_view(std::as_const(x)), r.describe())) == errc::peer_closed);
    CHECK(co_await error_of(b.get(gdr::host_view(x), r.describe())) == errc::closed);
  }());
  sched.drain();  // the serving end releases its leases when its answers are back
  CHECK(mem == std::array<int, 2>{});
}
