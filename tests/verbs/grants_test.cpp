// Memory this side lets the peer's NIC reach (grants: a rendezvous
// receive's rtr, a large get's destination, a large put's source), and the
// registrations behind them: how long they live, and what the peer's key
// covers. Real verbs: they need an RDMA device and its IP address
// (GDR_VERBS_IP; the Soft-RoCE guest of .ci/verbs-vm.sh sets it) and skip
// otherwise.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/verbs/support.hpp"

using namespace std::chrono_literals;
using namespace verbs_test;

// Issue 15, defect 7. With cache_registrations off, a registration lives
// only as long as the transfer that made it: the cache cannot see free(),
// and a registration outliving its memory pins the old pages, so that a
// later transfer into reused addresses may hit it and the peer's NIC write
// into the old pages. On a connection failure the grants still out (an
// rtr's receive, a get's destination, a put's source, all waiting for the
// peer, which is not reading) were handed back without that invalidation,
// and their registrations stayed in the device's cache, which every
// endpoint of the scheduler shares.
TEST_CASE("a failed connection leaves no registration of its grants in the device's cache") {
  REQUIRE_VERBS();
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  gdr::verbs::endpoint_options oa, ob;
  oa.keepalive = ob.keepalive = 100ms;
  oa.ack_timeout = ob.ack_timeout = 12;
  oa.retry_count = ob.retry_count = 3;
  ob.protocol.unexpected_messages = 1;  // b stops reading at its second early message
  ob.protocol.rendezvous_threshold = 4096;
  const std::size_t n = 1 << 20;
  std::vector<std::byte> in(n), back(n), src = pattern(n, 1), exposed(n);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    // Another pair on the same scheduler and device keeps the caches alive
    // after the first pair is gone.
    auto witness = co_await conformance::verbs_pair(sched, gdr::default_registry(), {}, {});
    {
      auto [a, b] = co_await conformance::verbs_pair(sched, gdr::default_registry(), oa, ob);
      auto reg = gdr::register_memory(host(exposed));
      auto rv = reg.describe(0);
      // b announces a rendezvous message and stops reading.
      std::vector<std::byte> m1 = pattern(100, 1), m2 = pattern(100, 2), big = pattern(n, 3);
      co_await a.send(chost(m1));
      co_await a.send(chost(m2));
      auto send_big = report_of(b.send(chost(big)));
      // a's three grants: the rtr of a receive, a get's destination, a
      // put's source; b reads none of them.
      std::uint64_t regs = a.stats().registrations;
      auto [rs, rr, rg, rp, fail] = co_await gdr::when_all(
          std::move(send_big), report_of(a.recv(host(in))), report_of(a.get(host(back), rv)),
          report_of(a.put(chost(src), rv)), [&]() -> gdr::task<int> {
            while (a.stats().registrations < regs + 3) co_await gdr::sleep_for(1ms);
            co_await gdr::sleep_for(20ms);  // the three frames are out
            // The three grants are registered now.
            ibv_qp_attr attr{};
            attr.qp_state = IBV_QPS_ERR;
            CHECK(ibv_modify_qp(a.native_qp(), &attr, IBV_QP_STATE) == 0);
            co_return 0;
          }());
      CHECK(rr.error == gdr::errc::connection_lost);
      CHECK(rg.error == gdr::errc::connection_lost);
      CHECK(rp.error == gdr::errc::connection_lost);
      CHECK(!a.is_open());
      // a's connection still exists (the endpoint does): no registration of
      // the receive's grant is left in its caches.
      CHECK(a.invalidate_registrations(in.data(), n) == 0);
      (void)rs;
    }
    // The pair is gone; the caches stay (the witness uses them): no
    // registration of the get's or the put's grant is left there either.
    CHECK(witness.first.invalidate_registrations(back.data(), n) == 0);
    CHECK(witness.first.invalidate_registrations(src.data(), n) == 0);
    co_await witness.first.close();
  }());
  sched.drain();
}
