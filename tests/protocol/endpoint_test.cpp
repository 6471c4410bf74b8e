// gdr/protocol/endpoint.hpp: what an endpoint does with an operation it
// cannot start, in every build (this suite runs again with NDEBUG:
// :endpoint_test_ndebug): on an endpoint that holds no connection
// (default-constructed or moved from) every operation fails with
// errc::closed; awaited on a thread other than its scheduler's, it fails
// with errc::unsupported and leaves the endpoint as it was.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/endpoint.hpp>
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/support/watchdog.hpp"

namespace {

// Awaits `op` and gives its error (or success).
template <class Op>
gdr::task<std::error_code> error_of(Op op) {
  auto r = co_await std::move(op).as_result();
  co_return r.error();
}

// The error of every kind of operation on `ep`, in order: send, recv, put,
// get, put_notify, put_batch, get_batch, flush, fetch_add, compare_swap,
// close; and, for a send, its text and what `.report()` says.
template <class E>
gdr::task<std::vector<std::error_code>> every_operation(E& ep, gdr::remote_view<std::uint64_t, gdr::Host> remote,
                                                         std::string& what, std::error_code& reported) {
  std::array<std::uint64_t, 4> buf{};
  auto local = gdr::host_view(buf);
  const std::array<gdr::block, 1> blocks{{{0, 0, 8}}};
  auto word = remote.subview(0, 1);
  std::vector<std::error_code> e;
  e.push_back(co_await error_of(ep.send(local)));
  e.push_back(co_await error_of(ep.recv(local)));
  e.push_back(co_await error_of(ep.put(local, remote)));
  e.push_back(co_await error_of(ep.get(local, remote)));
  e.push_back(co_await error_of(ep.put_notify(local, remote, 7)));
  e.push_back(co_await error_of(ep.put_batch(local, remote, blocks)));
  e.push_back(co_await error_of(ep.get_batch(local, remote, blocks)));
  e.push_back(co_await error_of(ep.flush()));
  e.push_back(co_await error_of(ep.fetch_add(word, 1)));
  e.push_back(co_await error_of(ep.compare_swap(word, 0, 1)));
  e.push_back(co_await error_of(ep.close()));
  try {
    co_await ep.send(local);
  } catch (const gdr::error& x) {
    what = x.what();
  }
  gdr::op_report r = co_await ep.send(local).report();
  reported = r.error;
  co_return e;
}

}  // namespace

TEST_CASE("every operation on an endpoint that holds no connection fails with errc::closed") {
  gdr_test_support::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::uint64_t> mem(4, 0);
  auto keep = reg.register_memory(gdr::host_view(mem));
  auto remote = gdr::remote_view<std::uint64_t, gdr::Host>::from_wire(keep.describe(1).to_wire()).value();
  auto check = [&](auto& ep) {
    std::string what;
    std::error_code reported;
    auto errors = gdr::sync_wait(sched, every_operation(ep, remote, what, reported));
    CHECK(errors == std::vector<std::error_code>(11, gdr::errc::closed));
    CHECK(what.find("an operation on an endpoint that holds no connection") != std::string::npos);
    CHECK(reported == gdr::errc::closed);
    CHECK_FALSE(ep.is_open());
    CHECK(ep.error() == gdr::errc::closed);
  };
  SUBCASE("default-constructed, of a run-time transport") {
    gdr::endpoint ep;
    check(ep);
  }
  SUBCASE("default-constructed, of a transport") {
    gdr::tcp::endpoint ep;
    check(ep);
  }
  SUBCASE("moved from") {
    auto ends = gdr::loopback::make_pair(sched, reg);
    gdr::endpoint a = std::move(ends.first);
    check(ends.first);
    // The one it moved to works.
    std::array<char, 4> out{'a', 'b', 'c', 'd'}, in{};
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      co_await a.send(gdr::host_view(std::as_const(out)));
      CHECK(co_await ends.second.recv(gdr::host_view(in)) == 4);
      co_await a.close();
    }());
    CHECK(in == out);
  }
}

TEST_CASE("an endpoint's operation awaited on another scheduler's thread fails with errc::unsupported, the endpoint untouched") {
  gdr_test_support::watchdog wd(30);
  gdr::scheduler sched;
  gdr::memory_registry reg;
  std::vector<std::uint64_t> mem(4, 0);
  auto keep = reg.register_memory(gdr::host_view(mem));
  auto remote = gdr::remote_view<std::uint64_t, gdr::Host>::from_wire(keep.describe(1).to_wire()).value();
  auto ends = gdr::loopback::make_pair(sched, reg);
  std::vector<std::error_code> errors;
  std::string what;
  std::error_code reported;
  std::thread other([&] {
    gdr::scheduler mine;  // a loop of its own, on its own thread
    errors = gdr::sync_wait(mine, every_operation(ends.first, remote, what, reported));
  });
  other.join();
  CHECK(errors == std::vector<std::error_code>(11, gdr::errc::unsupported));
  CHECK(what.find("awaited on a thread other than its scheduler's") != std::string::npos);
  CHECK(reported == gdr::errc::unsupported);
  // Nothing of it reached the endpoint: on its own thread it works, and
  // counted none of them.
  CHECK(ends.first.is_open());
  CHECK(ends.first.stats().sends == 0);
  CHECK(ends.first.stats().failed == 0);
  std::array<char, 4> out{'w', 'x', 'y', 'z'}, in{};
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    co_await ends.first.send(gdr::host_view(std::as_const(out)));
    CHECK(co_await ends.second.recv(gdr::host_view(in)) == 4);
    co_await ends.first.close();
  }());
  CHECK(in == out);
}
