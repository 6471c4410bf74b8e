// The GPUDirect flush (a one-byte loopback READ of GPU memory the NIC has
// just written, on GPUs whose RDMA write ordering is below OWNER), shared
// by every GPUDirect endpoint of one device and scheduler. On the test
// stand-in (host memory plays GPU memory; gdr::verbs::testing), so it runs
// on a real RDMA device without a GPU: it needs the device and its address
// (GDR_VERBS_IP; the Soft-RoCE guest of .ci/verbs-vm.sh sets it) and skips
// otherwise.
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/verbs/support.hpp"

using namespace std::chrono_literals;
using namespace verbs_test;

namespace {

/// A GPUDirect endpoint's options, small: many of them share one device.
gdr::verbs::endpoint_options small_gpudirect() {
  gdr::verbs::endpoint_options o;
  o.gpudirect = true;
  o.cache_registrations = true;
  o.protocol.rendezvous_threshold = 4096;
  o.rx_depth = 4;
  o.tx_depth = 4;
  o.buffer_size = 1024;
  o.protocol.reply_slots = 2;
  return o;
}

using pair_t = std::pair<gdr::verbs::endpoint, gdr::verbs::endpoint>;

}  // namespace

namespace {

/// `pairs` GPUDirect pairs on one scheduler, each sending `n` bytes of
/// Device memory to the other at the same time; every receive ends with a
/// flush. Returns the operations that failed; counts the flushes and those
/// that waited for room.
int flush_at_once(int pairs, std::size_t n, std::uint64_t& flushes, std::uint64_t& waits) {
  gdr_test_support::watchdog dog(240);
  gdr::scheduler sched;
  std::vector<std::unique_ptr<nic_memory>> src, dst;
  for (int i = 0; i < pairs; ++i) {
    src.push_back(std::make_unique<nic_memory>(n));
    dst.push_back(std::make_unique<nic_memory>(n));
    fill(src.back()->data(), n, static_cast<std::uint32_t>(i));
  }
  int failed = 0;
  flushes = waits = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::vector<pair_t> eps;
    for (int i = 0; i < pairs; ++i)
      eps.push_back(co_await conformance::verbs_pair(sched, gdr::default_registry(), small_gpudirect(),
                                                     small_gpudirect()));
    REQUIRE(eps.front().second.gpudirect()->needs_flush);
    std::vector<gdr::task<gdr::op_report>> ops;
    for (int i = 0; i < pairs; ++i) {
      ops.push_back(report_of(eps[i].first.send(src[i]->device(n), {30s})));
      ops.push_back(report_of(eps[i].second.recv(dst[i]->device(n), {30s})));
    }
    auto reports = co_await gdr::when_all(std::move(ops));
    for (const auto& r : reports) failed += r.error ? 1 : 0;
    for (auto& p : eps) {
      flushes += p.second.stats().flushes;
      waits += p.second.stats().flush_waits;
      CHECK(p.first.is_open());
      CHECK(p.second.is_open());
    }
    for (auto& p : eps) co_await p.first.close();
  }());
  sched.drain();
  for (int i = 0; i < pairs; ++i) CHECK(std::memcmp(src[i]->data(), dst[i]->data(), n) == 0);
  return failed;
}

}  // namespace

// Issue 15: the flush's queue pair takes 64 work requests, and each
// endpoint that flushes posts one READ; a 65th flush in flight at once
// failed to post, which failed its connection. Flushes beyond the queue
// pair's depth now wait for one to come back. (Soft-RoCE reuses a send
// queue entry as soon as the READ is done, before its completion is taken,
// so there the 65th post did not fail; a NIC that frees entries when their
// completions are polled refuses it.)
TEST_CASE("more flushes at once than the flush queue pair holds all complete") {
  REQUIRE_VERBS();
  stand_in s(true);
  std::uint64_t flushes = 0, waits = 0;
  int failed = flush_at_once(100, 8192, flushes, waits);
  MESSAGE(failed << " operations failed, " << flushes << " flushes, " << waits << " waited for room");
  CHECK(failed == 0);
  CHECK(flushes == 100);
}

// The same with the queue pair's depth cut to 2 (gdr::verbs::testing):
// most flushes wait for room, and all of them complete.
TEST_CASE("flushes that find the flush queue pair full wait for room, in order, and all complete") {
  REQUIRE_VERBS();
  stand_in s(true);
  gdr::verbs::testing::limit_flush_depth(2);
  std::uint64_t flushes = 0, waits = 0;
  int failed = flush_at_once(12, 8192, flushes, waits);
  gdr::verbs::testing::limit_flush_depth(0);
  MESSAGE(failed << " operations failed, " << flushes << " flushes, " << waits << " waited for room");
  CHECK(failed == 0);
  CHECK(flushes == 12);
  CHECK(waits > 0);
}

// Issue 15: the flush's queue pair was made once per device and scheduler
// and never again: after an error (here forced) every later flush of every
// endpoint of that device failed, and with it the connection.
TEST_CASE("the flush queue pair is made again after an error, and the flush it failed is retried") {
  REQUIRE_VERBS();
  stand_in s(true);
  auto o = small_gpudirect();
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        const std::size_t n = 100 * 1024;
        nic_memory src(n), dst(n);
        for (int round = 0; round < 3; ++round) {
          CAPTURE(round);
          fill(src.data(), n, static_cast<std::uint32_t>(round));
          ibv_qp* fq = b.native_flush_qp();
          REQUIRE(fq != nullptr);
          if (round > 0) {
            ibv_qp_attr attr{};
            attr.qp_state = IBV_QPS_ERR;
            CHECK(ibv_modify_qp(fq, &attr, IBV_QP_STATE) == 0);
          }
          auto [sr, rr] = co_await gdr::when_all(report_of(a.send(src.device(n), {20s})),
                                                 report_of(b.recv(dst.device(n), {20s})));
          CHECK(!sr.error);
          CHECK(!rr.error);
          CHECK(std::memcmp(src.data(), dst.data(), n) == 0);
          CHECK(b.is_open());
        }
        CHECK(b.stats().flushes == 3);
        co_await a.close();
      },
      o, o);
}
