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

#include "tests/protocol/cpu_copy_engine.hpp"
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
  ob.protocol.rendezvous_threshold = 4096;
  const std::size_t n = 1 << 20;
  std::vector<std::byte> in(n), back(n), src = pattern(n, 1), exposed(n);
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    // Another pair on the same scheduler and device keeps the caches alive
    // after the first pair is gone.
    auto witness = co_await conformance::verbs_pair(sched, gdr::default_registry(), {}, {});
    {
      auto [a, b] = co_await conformance::verbs_pair(sched, gdr::default_registry(), oa, ob);
      auto reg = gdr::register_memory(host(exposed), gdr::access::read_write, gdr::exposure::checked);
      auto rv = reg.describe(0);
      // Both handshakes are done (b has read a message of a's), then b
      // stops reading, as a stopped process, and announces a rendezvous
      // message. (b's early-message store cannot stop its reader: a's
      // early credits hold a's sends back instead.)
      std::vector<std::byte> m1 = pattern(100, 1), m1_in(100), big = pattern(n, 3);
      co_await gdr::when_all(report_of(a.send(chost(m1))), report_of(b.recv(host(m1_in))));
      CHECK(m1_in == m1);
      b.hold_reading(true);
      auto send_big = report_of(b.send(chost(big)));
      // a's three grants: the rtr of a receive, a get's destination, a
      // put's source; b reads none of them.
      std::uint64_t regs = a.stats().registrations;
      auto& ea = a;  // (a structured binding; C++20 lambdas cannot name it)
      auto [rs, rr, rg, rp, fail] = co_await gdr::when_all(
          std::move(send_big), report_of(a.recv(host(in))), report_of(a.get(host(back), rv)),
          report_of(a.put(chost(src), rv)), [&]() -> gdr::task<int> {
            while (ea.stats().registrations < regs + 3) co_await gdr::sleep_for(1ms);
            co_await gdr::sleep_for(20ms);  // the three frames are out
            // The three grants are registered now.
            ibv_qp_attr attr{};
            attr.qp_state = IBV_QPS_ERR;
            CHECK(ibv_modify_qp(ea.native_qp(), &attr, IBV_QP_STATE) == 0);
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

namespace {

/// Plays a peer that misbehaves: posts, on `qp` (an endpoint's own queue
/// pair), an RDMA WRITE of one byte 0xab to `raddr` with `rkey`, inline
/// (no local key needed) and unsignaled (a failure completes to
/// unsignaled_work(), which tells no one; the queue pair's error does).
void rogue_write(ibv_qp* qp, std::uint64_t raddr, std::uint32_t rkey) {
  static const std::byte b{0xab};
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uintptr_t>(&b);
  sge.length = 1;
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_INLINE;
  wr.wr_id = gdr::verbs::unsignaled_work()->wr_id();
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  CHECK(ibv_post_send(qp, &wr, &bad) == 0);
}

}  // namespace

// Issue 15, defect 12. The key of an rtr came from a cache entry widened
// to whole pages (or from any larger registration covering the receive),
// so the peer's NIC could write the bytes around the receive, other
// objects on the same pages, for as long as the registration lived. Now it
// is a registration of exactly the receive, made for this grant: a WRITE
// one byte before the granted range is refused by the receiver's NIC (and,
// RC being what it is, the connection fails), and nothing is written.
TEST_CASE("the key of a receive covers exactly its bytes: a peer's WRITE next to them is refused") {
  REQUIRE_VERBS();
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  gdr_test_support::cpu_copy_engine ce(sched);  // holds the sender's data back
  gdr::verbs::endpoint_options o;
  o.protocol.rendezvous_threshold = 4096;
  o.keepalive = 100ms;
  o.ack_timeout = 12;
  o.retry_count = 3;
  const std::size_t n = 20000;
  std::vector<std::byte> page(3 * 4096 + n, std::byte{0});
  std::vector<std::byte> src = pattern(n, 8);
  gdr::view<std::byte, gdr::Host> into(page.data() + 4096 + 100, n);  // not page aligned
  with_pair_on(
      sched,
      [&](auto& a, auto& b) -> gdr::task<> {
        ce.hold();
        auto [s, r, x] = co_await gdr::when_all(
            report_of(a.send(device(src), {10s})), report_of(b.recv(into, {10s})), [&]() -> gdr::task<int> {
              while (b.last_key_sent().rkey == 0) co_await gdr::sleep_for(1ms);
              gdr::verbs::key_info k = b.last_key_sent();
              CHECK(k.addr == reinterpret_cast<std::uintptr_t>(into.data()));
              CHECK(k.len == n);
              rogue_write(a.native_qp(), k.addr, k.rkey);      // inside: the key works
              rogue_write(a.native_qp(), k.addr - 1, k.rkey);  // the byte before: not granted
              co_await gdr::sleep_for(200ms);
              ce.release();
              co_return 0;
            }());
        CHECK(page[4096 + 100] == std::byte{0xab});
        CHECK(page[4096 + 99] == std::byte{0});  // refused
        MESSAGE("send: " << s.error.message() << "; receive: " << r.error.message());
        CHECK(r.error);  // the refusal failed the connection
      },
      o, o);
}

// The same key after its grant ended: the registration went with it, also
// when registrations are cached (before, a cached registration's key stayed
// valid until the program invalidated it).
TEST_CASE("the key of a receive dies with the receive, also when registrations are cached") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options o;
  o.protocol.rendezvous_threshold = 4096;
  o.cache_registrations = true;
  o.keepalive = 100ms;
  o.ack_timeout = 12;
  o.retry_count = 3;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        const std::size_t n = 100000;
        std::vector<std::byte> src = pattern(n, 9), in(n);
        auto [s, r] = co_await gdr::when_all(report_of(a.send(chost(src))), report_of(b.recv(host(in))));
        CHECK(!s.error);
        CHECK(!r.error);
        CHECK(r.path == gdr::transfer_path::host_zero_copy);
        gdr::verbs::key_info k = b.last_key_sent();
        CHECK(k.addr == reinterpret_cast<std::uintptr_t>(in.data()));
        rogue_write(a.native_qp(), k.addr, k.rkey);
        co_await gdr::sleep_for(200ms);
        CHECK(in[0] == src[0]);  // refused: the receive's registration is gone
        CHECK(in == src);
      },
      o, o);
}
