// Credits of the verbs transport: a work request that consumes one of the
// peer's posted receive buffers (a SEND, an RDMA WRITE with immediate) takes
// a credit; a plain RDMA WRITE, a READ or a keepalive takes none. The
// ledger's rules run everywhere (no NIC); the traffic tests need an RDMA
// device (the Soft-RoCE guest of .ci/verbs-vm.sh) and skip without one.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/protocol/cpu_copy_engine.hpp"
#include "tests/verbs/support.hpp"

using namespace std::chrono_literals;
using namespace verbs_test;
using gdr::detail::verbs::consumes_receive;
using gdr::detail::verbs::credit_ledger;
using gdr::detail::verbs::receives_consumed;

TEST_CASE("only requests that land in the peer's receive queue consume a credit") {
  CHECK(consumes_receive(IBV_WR_SEND));
  CHECK(consumes_receive(IBV_WR_SEND_WITH_IMM));
  CHECK(consumes_receive(IBV_WR_SEND_WITH_INV));
  CHECK(consumes_receive(IBV_WR_RDMA_WRITE_WITH_IMM));
  CHECK(!consumes_receive(IBV_WR_RDMA_WRITE));
  CHECK(!consumes_receive(IBV_WR_RDMA_READ));
  CHECK(!consumes_receive(IBV_WR_ATOMIC_CMP_AND_SWP));
  CHECK(!consumes_receive(IBV_WR_ATOMIC_FETCH_AND_ADD));
  CHECK(!consumes_receive(IBV_WR_LOCAL_INV));
  CHECK(!consumes_receive(IBV_WR_BIND_MW));
  // A rendezvous payload: three plain WRITEs, then the one with immediate.
  ibv_send_wr chain[4]{};
  for (int i = 0; i < 4; ++i) {
    chain[i].opcode = i == 3 ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    chain[i].next = i == 3 ? nullptr : &chain[i + 1];
  }
  CHECK(receives_consumed(chain) == 1);
  CHECK(receives_consumed(&chain[3]) == 1);
  chain[3].opcode = IBV_WR_RDMA_WRITE;  // a staged segment before the last
  CHECK(receives_consumed(chain) == 0);
  CHECK(receives_consumed(nullptr) == 0);
}

TEST_CASE("a frame keeps the last of the peer's buffers for a credit-only message") {
  credit_ledger c;
  c.start(4);
  CHECK(c.can_consume(3));
  CHECK(!c.can_consume(4));
  CHECK(c.can_consume(4, true));
  c.consumed(3);
  CHECK(c.in_flight() == 3);
  CHECK(!c.can_consume(1));
  CHECK(c.can_consume(1, true));
  CHECK(c.can_consume(0));  // a request that consumes nothing always may go
  c.consumed(1);
  CHECK(!c.can_consume(1, true));
  c.peer_granted(2);  // the peer posted two again
  CHECK(c.in_flight() == 2);
  CHECK(c.can_consume(1));
  CHECK(!c.can_consume(2));
}

TEST_CASE("a grant is a running count: an older one changes nothing, and the count wraps") {
  credit_ledger c;
  c.start(64);
  c.consumed(10);
  c.peer_granted(8);
  c.peer_granted(5);  // older
  CHECK(c.in_flight() == 2);
  // Both counts run on across the end of the 32-bit range (steps of a
  // quarter of it keep each grant "after" the last in serial arithmetic).
  for (int i = 0; i < 4; ++i) {
    c.consumed(0x40000000u);
    c.peer_granted(8u + 0x40000000u * static_cast<std::uint32_t>(i + 1));
    CHECK(c.in_flight() == 2);
  }
  c.consumed(3);
  c.peer_granted(11);  // 8 + 2^32, wrapped, then 3 more
  CHECK(c.in_flight() == 2);
  c.peer_granted(0xfffffff0u);  // before 11 in serial arithmetic: older
  CHECK(c.in_flight() == 2);
}

TEST_CASE("the staged segments of many messages never use up the window") {
  // Each message: 95 plain WRITEs and one WRITE_WITH_IMM (one receive of
  // the peer's), which the peer gives back once it has parsed it.
  credit_ledger c;
  c.start(64);
  std::uint32_t peer_reposted = 0;
  for (int msg = 0; msg < 1000; ++msg) {
    ibv_send_wr seg{};
    seg.opcode = IBV_WR_RDMA_WRITE;
    for (int i = 0; i < 95; ++i) {
      REQUIRE(c.can_consume(receives_consumed(&seg)));
      c.consumed(receives_consumed(&seg));
    }
    seg.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    REQUIRE(c.can_consume(receives_consumed(&seg)));
    c.consumed(receives_consumed(&seg));
    c.peer_granted(++peer_reposted);
  }
  CHECK(c.in_flight() == 0);
}

TEST_CASE("credits owed go in a message of their own only when half the ring is owed and no frame carries them") {
  credit_ledger c;
  c.start(64);
  for (int i = 0; i < 31; ++i) c.reposted();
  CHECK(c.owed() == 31);
  CHECK(!c.credit_message_due(64, false));
  c.reposted();
  CHECK(c.credit_message_due(64, false));
  CHECK(!c.credit_message_due(64, true));  // the next frame carries them
  CHECK(c.grant() == 32);
  CHECK(c.owed() == 0);
  CHECK(!c.credit_message_due(64, false));
}

// Issue 15, defect 4. A staged Device send to a host receive moves its
// segments by RDMA WRITE at their offsets; only the last one carries the
// immediate (and consumes a receive of the peer's). Counting every segment
// as a consumed receive leaked one credit per segment but the last: after
// 63 of them (rx_depth 64, one kept for a credit-only message) the sender
// waited for credits the peer had no reason to send, for ever (the
// keepalive kept the connection looking alive). 64 KiB chunks make 96
// segments of a 6 MiB message; three of them are 285 plain WRITEs.
TEST_CASE("staged Device to host traffic of many times 63 chunks keeps flowing: plain RDMA WRITEs take no credit") {
  REQUIRE_VERBS();
  gdr_test_support::watchdog dog(120);
  gdr::scheduler sched;
  gdr_test_support::cpu_copy_engine ce(sched);
  gdr::verbs::endpoint_options o;
  o.protocol.staging.chunk = 64 * 1024;
  with_pair_on(
      sched,
      [](auto& a, auto& b) -> gdr::task<> {
        const std::size_t n = std::size_t{6} << 20;
        for (std::uint32_t round = 0; round < 3; ++round) {
          CAPTURE(round);
          std::vector<std::byte> src = pattern(n, round);
          std::vector<std::byte> in(n);
          auto [s, r] = co_await gdr::when_all(report_of(a.send(device(src), {20s})),
                                               report_of(b.recv(host(in), {20s})));
          CHECK(!s.error);
          CHECK(!r.error);
          CHECK(in == src);
          CHECK(s.path == gdr::transfer_path::staged_pinned);
          if (r.error) break;
        }
        MESSAGE(a.stats().write_wrs << " WRITEs, " << a.stats().credit_stalls << " credit stalls");
        CHECK(a.stats().write_wrs >= 3 * 96);
        // Host to staged Device the other way: SENDs into bounce buffers,
        // which do take credits, and give them back.
        std::vector<std::byte> back = pattern(n, 9), got(n);
        auto [s2, r2] =
            co_await gdr::when_all(report_of(b.send(host(back), {20s})), report_of(a.recv(device(got), {20s})));
        CHECK(!s2.error);
        CHECK(!r2.error);
        CHECK(got == back);
        co_await a.close();
      },
      o, o);
}

// The eager fast path (link_send_now): a small send started while nothing of
// this side waits to go is posted at once and done without suspending. The
// burst below starts 64 sends back to back, each in a coroutine of its own,
// before the loop turns once: the first few take the fast path, until the
// peer's receive buffers (rx_depth 8, one kept for a credit-only message)
// are all spoken for; every later one must queue behind the first that
// could not go, never pass it (it would, if the fast path looked only at
// the credit, which comes back while the queue still holds frames). The
// receiver takes them in order and checks each one's bytes.
TEST_CASE("small sends take the fast path while nothing waits, and queue in order behind one that could not go") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options o;
  o.rx_depth = 8;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        std::vector<std::byte> one = pattern(8, 1), got1(8);
        // First the handshake: a send before the peer's hello waits for it.
        co_await gdr::when_all(report_of(a.send(chost(one), gdr::tag{3})), report_of(b.recv(host(got1), gdr::tag{3})));
        const auto fast0 = a.stats().fast_sends;
        std::size_t n1 = co_await a.send(chost(one), gdr::tag{3});
        CHECK(n1 == 8);
        CHECK(a.stats().fast_sends == fast0 + 1);
        co_await b.recv(host(got1), gdr::tag{3});
        CHECK(got1 == one);
        // After a rendezvous message (its bytes went by RDMA), a fast send
        // reports its own path, not the last one the transport took.
        std::vector<std::byte> big = pattern(1024 * 1024, 2), got_big(big.size());
        auto [br, bq] = co_await gdr::when_all(report_of(a.send(chost(big), gdr::tag{5})),
                                               report_of(b.recv(host(got_big), gdr::tag{5})));
        CHECK(br.path == gdr::transfer_path::host_zero_copy);
        const auto fast_after_big = a.stats().fast_sends;
        auto [sr, sq] = co_await gdr::when_all(report_of(a.send(chost(one), gdr::tag{3})),
                                               report_of(b.recv(host(got1), gdr::tag{3})));
        CHECK(a.stats().fast_sends == fast_after_big + 1);
        CHECK(sr.path == gdr::transfer_path::host_eager);
        (void)bq;
        (void)sq;

        constexpr int burst = 64;
        std::vector<std::vector<std::byte>> out(burst), in(burst, std::vector<std::byte>(40));
        for (int i = 0; i < burst; ++i) out[i] = pattern(40, 100 + static_cast<std::uint32_t>(i));
        const auto fast1 = a.stats().fast_sends;
        std::vector<gdr::task<gdr::op_report>> sends;
        for (int i = 0; i < burst; ++i) sends.push_back(report_of(a.send(chost(out[i]), gdr::tag{4})));
        auto receiver = [](auto& ep, std::vector<std::vector<std::byte>>& dst) -> gdr::task<int> {
          int ok = 0;
          for (std::vector<std::byte>& d : dst) {
            gdr::op_report r = co_await ep.recv(verbs_test::host(d), gdr::tag{4}).report();
            ok += r.error ? 0 : 1;
          }
          co_return ok;
        };
        auto [reports, received] = co_await gdr::when_all(gdr::when_all(std::move(sends)), receiver(b, in));
        int sent = 0;
        for (auto& r : reports) sent += r.error ? 0 : 1;
        CHECK(sent == burst);
        CHECK(received == burst);
        for (int i = 0; i < burst; ++i) {
          CAPTURE(i);
          CHECK(in[i] == out[i]);  // in order: message i in receive i
        }
        const auto fast = a.stats().fast_sends - fast1;
        MESSAGE(fast << " of " << burst << " sends took the fast path, " << a.stats().credit_stalls
                     << " credit stalls");
        CHECK(fast >= 1);
        CHECK(fast < static_cast<decltype(fast)>(burst));  // the credit ran out: the rest queued
        // Fast or queued, a send reports the same path and size.
        CHECK(reports.front().path == reports.back().path);
        CHECK(reports.front().path != gdr::transfer_path::none);
        CHECK(reports.front().bytes == 40);
        CHECK(reports.back().bytes == 40);
        co_await a.close();
      },
      o, o);
}
