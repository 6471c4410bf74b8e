// The GPUDirect data path of verbs endpoints (endpoint_options::gpudirect),
// on a machine without a GPU: gdr::verbs::testing's stand-in makes the
// probe say yes and registers "Device" memory with plain ibv_reg_mr, so the
// endpoints run their real GPUDirect data path over a real RDMA device with
// Device views of host memory. That memory is made PROT_NONE while the
// transfers run; the stand-in registers it through a second, readable
// mapping of the same pages (verbs_test::nic_memory), as a dma-buf reaches
// GPU memory without the CPU's mapping: the NIC still reaches the pages,
// but any CPU access (a copy into a SEND, out of a receive buffer, through
// a bounce buffer) faults and fails the test. So these tests show that every byte of
// Device memory is moved by the NIC and none by the CPU, and that where the
// NIC cannot move them the operation or the connection fails loudly.
//
// Real verbs: they need an RDMA device and its IP address (GDR_VERBS_IP; the
// Soft-RoCE guest of .ci/verbs-vm.sh sets it) and skip with the reason
// otherwise.
#include <doctest/doctest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/support/skip.hpp"
#include "tests/support/watchdog.hpp"
#include "tests/verbs/support.hpp"
#include "tests/verbs/verbs_fixture.hpp"

using namespace std::chrono_literals;

namespace {

using verbs_test::nic_memory;
using verbs_test::stand_in;

void fill(std::byte* p, std::size_t n, std::uint32_t seed) {
  std::uint32_t x = 2654435761u * (seed + 1);
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<std::byte>(x);
  }
}

std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  fill(v.data(), n, seed);
  return v;
}

bool same(const std::byte* a, const std::byte* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }

gdr::view<std::byte, gdr::Host> host(std::vector<std::byte>& v) { return {v.data(), v.size()}; }

template <class Op>
gdr::task<gdr::op_report> report_of(Op op) {
  co_return co_await std::move(op).report();
}
template <class Op>
gdr::task<std::size_t> bytes_of(Op op) {
  co_return co_await std::move(op);
}

gdr::verbs::endpoint_options gpudirect_options() {
  gdr::verbs::endpoint_options o;
  o.gpudirect = true;
  o.cache_registrations = true;  // registered while readable, then locked
  o.protocol.rendezvous_threshold = 4096;
  return o;
}

template <class Body>
void with_pair(Body body, gdr::verbs::endpoint_options oa = gpudirect_options(),
               gdr::verbs::endpoint_options ob = gpudirect_options()) {
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto p = co_await conformance::verbs_pair(sched, gdr::default_registry(), oa, ob);
    co_await body(p.first, p.second);
  }());
  sched.drain();
}

}  // namespace

TEST_CASE("Device to Device: every size goes by rendezvous and RDMA WRITE, the CPU never touches either buffer") {
  REQUIRE_VERBS();
  stand_in s;
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    REQUIRE(a.gpudirect() != nullptr);
    CHECK(a.gpudirect()->route == "host-stand-in");
    const std::size_t max = (std::size_t{1} << 20) + 3;
    nic_memory src(max), dst(max);
    // Registered (and cached) while the CPU may still touch the pages.
    auto [w1, w2] = co_await gdr::when_all(bytes_of(a.send(src.device())), bytes_of(b.recv(dst.device())));
    CHECK(w1 == src.size());
    CHECK(w2 == src.size());
    for (std::size_t n : {std::size_t{1}, std::size_t{100}, std::size_t{4096}, std::size_t{40000}, max}) {
      CAPTURE(n);
      fill(src.data(), n, static_cast<std::uint32_t>(n));
      std::memset(dst.data(), 0, dst.size());
      src.lock();
      dst.lock();
      auto [sr, rr] = co_await gdr::when_all(report_of(a.send(src.device(n))), report_of(b.recv(dst.device())));
      src.unlock();
      dst.unlock();
      CHECK(!sr.error);
      CHECK(!rr.error);
      CHECK(rr.bytes == n);
      CHECK(same(src.data(), dst.data(), n));
      CHECK(sr.path == gdr::transfer_path::gpudirect_rdma);
      CHECK(rr.path == gdr::transfer_path::gpudirect_rdma);
      CHECK(sr.protocol == gdr::wire_protocol::rendezvous);  // even 1 byte: an eager frame is a CPU copy
    }
    CHECK(a.stats().device_registrations > 0);
    CHECK(b.stats().device_registrations > 0);
    CHECK(b.stats().rdma_received == 6);
    CHECK(a.stats().by_path[static_cast<std::size_t>(gdr::transfer_path::gpudirect_rdma)] == 6);
    co_await a.close();
  });
}

TEST_CASE("host memory to and from Device memory over a GPUDirect endpoint") {
  REQUIRE_VERBS();
  stand_in s;
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    const std::size_t n = 300 * 1024 + 5;  // above the rendezvous threshold
    nic_memory dev(n);
    auto out = pattern(n, 3);
    std::vector<std::byte> in(n);
    co_await gdr::when_all(bytes_of(a.send(host(out))), bytes_of(b.recv(dev.device())));  // registers dev
    fill(dev.data(), n, 4);
    auto expect = pattern(n, 4);
    dev.lock();
    // Device -> host.
    auto [s1, r1] = co_await gdr::when_all(report_of(b.send(dev.device(n))), report_of(a.recv(host(in))));
    // host -> Device.
    auto [s2, r2] = co_await gdr::when_all(report_of(a.send(host(out))), report_of(b.recv(dev.device(n))));
    dev.unlock();
    CHECK(!s1.error);
    CHECK(!r1.error);
    CHECK(in == expect);
    CHECK(s1.path == gdr::transfer_path::gpudirect_rdma);
    CHECK(r1.path == gdr::transfer_path::host_zero_copy);
    CHECK(!s2.error);
    CHECK(!r2.error);
    CHECK(same(dev.data(), out.data(), n));
    CHECK(r2.path == gdr::transfer_path::gpudirect_rdma);
    co_await a.close();
  });
}

TEST_CASE("a Device receive refuses an eager message, which stays receivable into host memory") {
  REQUIRE_VERBS();
  stand_in s;
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    nic_memory dev(4096);
    for (bool posted_first : {true, false}) {
      CAPTURE(posted_first);
      auto out = pattern(100, posted_first ? 1 : 2);  // below the threshold: eager
      dev.lock();
      gdr::op_report r{};
      if (posted_first) {
        // The receive waits; the eager frame arrives and is refused to it.
        auto [r1, s1] = co_await gdr::when_all(report_of(b.recv(dev.device(4096))), report_of(a.send(host(out))));
        r = r1;
        CHECK(!s1.error);
      } else {
        CHECK(co_await a.send(host(out)) == 100);
        // The message is kept by now or soon; a receive meets it either way.
        r = co_await report_of(b.recv(dev.device(4096)));
      }
      dev.unlock();
      CHECK(r.error == gdr::errc::gpudirect_unavailable);
      std::vector<std::byte> in(100);
      CHECK(co_await b.recv(host(in)) == 100);  // nothing lost
      CHECK(in == out);
    }
    // A zero-byte message needs no copy: a Device receive takes it.
    std::vector<std::byte> none;
    auto [s0, r0] = co_await gdr::when_all(report_of(a.send(host(none))), report_of(b.recv(dev.device(4096))));
    CHECK(!s0.error);
    CHECK(!r0.error);
    CHECK(r0.bytes == 0);
    co_await a.close();
  });
}

/// The puts and gets of the two put/get cases, at 8 B, 5000 B and `max`:
/// host to `a`'s peer's Device memory (`drv`, `2 * max` bytes: puts from
/// host land in the first half, from Device in the second) and back, Device
/// to the peer's host memory (`hrv`) and back, Device to Device. The CPU
/// may touch neither Device buffer while they run (only the NICs do); every
/// byte is checked after.
template <class Ep>
gdr::task<> put_get_rounds(Ep& a, nic_memory& exposed, nic_memory& local, std::vector<std::byte>& hexposed,
                           const gdr::remote_view<std::byte, gdr::Device>& drv,
                           const gdr::remote_view<std::byte, gdr::Host>& hrv, std::size_t max) {
  for (std::size_t n : {std::size_t{8}, std::size_t{5000}, max}) {
    CAPTURE(n);
    auto h = pattern(n, static_cast<std::uint32_t>(n));
    fill(local.data(), n, static_cast<std::uint32_t>(n) + 1);
    auto lcopy = std::vector<std::byte>(local.data(), local.data() + n);
    exposed.lock();
    local.lock();
    // Host -> Remote<Device>, and back.
    auto p1 = co_await report_of(a.put(host(h), drv));
    std::vector<std::byte> back(n);
    auto g1 = co_await report_of(a.get(host(back), drv));
    // Device -> Remote<Host>, and Remote<Host> -> Device.
    auto p2 = co_await report_of(a.put(local.device(n), hrv));
    auto g2 = co_await report_of(a.get(local.device(n, max - n), hrv));
    // Device -> Remote<Device>.
    auto p3 = co_await report_of(a.put(local.device(n), drv.subview(max, n)));
    exposed.unlock();
    local.unlock();
    for (auto* r : {&p1, &g1, &p2, &g2, &p3}) {
      CHECK(!r->error);
      CHECK(r->bytes == n);
      CHECK(r->path == gdr::transfer_path::gpudirect_rdma);
    }
    CHECK(same(exposed.data(), h.data(), n));
    CHECK(back == h);
    CHECK(same(hexposed.data(), lcopy.data(), n));
    CHECK(same(local.data() + (max - n), lcopy.data(), n));
    CHECK(same(exposed.data() + max, lcopy.data(), n));
  }
}

TEST_CASE("puts and gets between host and Device memory, small and large, move by the NIC alone") {
  REQUIRE_VERBS();
  stand_in s;
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    const std::size_t max = 2 * 1024 * 1024 + 9;
    nic_memory exposed(2 * max), local(max);  // puts from host land in the first half, from Device in the second
    std::vector<std::byte> hexposed(max);
    auto dreg = gdr::register_memory(exposed.device(), gdr::access::read_write, gdr::exposure::checked);
    auto drv = dreg.describe(0);  // a remote_view of b's Device memory
    auto hreg = gdr::register_memory(host(hexposed), gdr::access::read_write, gdr::exposure::checked);
    auto hrv = hreg.describe(0);
    // Registrations made and cached while the pages are readable.
    std::vector<std::byte> warm(2 * max);
    co_await a.put(host(warm), drv);
    co_await a.get(local.device(max), hrv);
    co_await a.put(local.device(max), hrv);
    co_await put_get_rounds(a, exposed, local, hexposed, drv, hrv, max);
    CHECK(b.stats().rdma_read > 0);  // b's NIC read the puts' sources
    co_await a.close();
  });
}

TEST_CASE("direct puts and gets into exposed Device memory move by the initiator's NIC, the owner serving nothing") {
  REQUIRE_VERBS();
  stand_in s;
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    const std::size_t max = 2 * 1024 * 1024 + 9;
    nic_memory exposed(2 * max), local(max);
    std::vector<std::byte> hexposed(max);
    // Exposed to the NIC (the default): GPU memory through the GPUDirect route.
    auto dreg = gdr::register_memory(exposed.device());
    auto drv = dreg.describe(0);
    auto hreg = gdr::register_memory(host(hexposed));
    auto hrv = hreg.describe(0);
    CHECK(drv.nic_exposed());
    CHECK(hrv.nic_exposed());
    const auto served_before = b.stats().served_puts + b.stats().served_gets;
    co_await put_get_rounds(a, exposed, local, hexposed, drv, hrv, max);
    CHECK(b.stats().served_puts + b.stats().served_gets == served_before);  // b's loop took no part
    CHECK(a.stats().direct_wrs > 0);
    co_await a.close();
  });
}

TEST_CASE("direct puts into the peer's GPU memory are flushed by a READ: at flush(), and before a notification") {
  REQUIRE_VERBS();
  stand_in s;
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    const std::size_t n = 64 * 1024;
    nic_memory exposed(2 * n);
    std::vector<std::byte> hexposed(n);
    auto dreg = gdr::register_memory(exposed.device());
    auto hreg = gdr::register_memory(host(hexposed));
    auto drv = dreg.describe(0);
    auto hrv = hreg.describe(0);
    auto h = pattern(n, 41), h2 = pattern(n, 42);
    // Into host memory: nothing to flush (a zero-length WRITE).
    co_await a.put(host(h), hrv);
    CHECK(co_await a.flush() == 0);
    CHECK(a.stats().gpu_flush_reads == 0);
    // Into GPU memory: the flush is a READ of what was written; a second
    // flush has nothing left to flush.
    co_await a.put(host(h), drv);
    CHECK(co_await a.flush() == 0);
    CHECK(a.stats().gpu_flush_reads == 1);
    CHECK(co_await a.flush() == 0);
    CHECK(a.stats().gpu_flush_reads == 1);
    // A notifying put into GPU memory: its WRITE, a READ, then the
    // notification alone; the owner hears of it with every byte there.
    co_await a.put_notify(host(h2), drv.subview(n, n), 77);
    CHECK(a.stats().gpu_flush_reads == 2);
    std::uint32_t v = co_await b.notification();
    CHECK(v == 77);
    CHECK(same(exposed.data(), h.data(), n));
    CHECK(same(exposed.data() + n, h2.data(), n));
    CHECK(b.stats().served_puts == 0);
    co_await a.close();
  });
}

TEST_CASE("both ends must be GPUDirect endpoints, or neither: both sides say why") {
  REQUIRE_VERBS();
  stand_in s;
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  for (bool listener_direct : {false, true}) {
    CAPTURE(listener_direct);
    gdr::verbs::endpoint_options direct = gpudirect_options(), plain;
    std::error_code ca, cb;
    std::string wa;
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      std::string ip = conformance::verbs_ip();
      gdr::verbs::listener l(sched, ip + ":0", gdr::default_registry(), listener_direct ? direct : plain);
      std::string to = ip + ":" + std::to_string(l.port());
      co_await gdr::when_all(
          [&]() -> gdr::task<int> {
            try {
              auto ep = co_await gdr::verbs::connect(sched, to, ip + ":0", gdr::default_registry(),
                                                     listener_direct ? plain : direct);
            } catch (const gdr::error& e) {
              ca = e.code();
              wa = e.what();
            }
            co_return 0;
          }(),
          [&]() -> gdr::task<int> {
            try {
              auto ep = co_await l.accept();
            } catch (const gdr::error& e) {
              cb = e.code();
            }
            co_return 0;
          }());
    }());
    CHECK(ca == gdr::errc::gpudirect_unavailable);
    CHECK(cb == gdr::errc::gpudirect_unavailable);
    CHECK(wa.find("endpoint_options::gpudirect") != std::string::npos);
  }
  sched.drain();
}

TEST_CASE("Device memory the NIC cannot register fails the connection loudly instead of being copied") {
  REQUIRE_VERBS();
  stand_in s;
  // PROT_NONE before any registration: ibv_reg_mr cannot pin the pages, as
  // a GPU buffer the driver will not export cannot be registered.
  // Three places: the sender's WRITE source; a receive posted before the
  // announcement (its rtr goes out from the event that brings the rts); a
  // receive posted after it (from the receive's own start).
  enum side { sender, receiver_first, receiver_late };
  for (side where : {sender, receiver_first, receiver_late}) {
    CAPTURE(static_cast<int>(where));
    const bool sender_side = where == sender;
    with_pair([sender_side, where](auto& a, auto& b) -> gdr::task<> {
      const std::size_t n = 256 * 1024;
      nic_memory dev(n, false);  // no readable alias: its registration fails once locked
      dev.lock();
      std::vector<std::byte> hbuf = pattern(n, 5);
      auto t0 = std::chrono::steady_clock::now();
      gdr::op_report sr{}, rr{};
      if (sender_side) {
        auto [x, y] = co_await gdr::when_all(report_of(a.send(dev.device())), report_of(b.recv(host(hbuf))));
        sr = x;
        rr = y;
        CHECK(sr.error == gdr::errc::gpudirect_unavailable);  // the side that could not register
        CHECK(rr.error);                                       // its peer: the connection is gone
      } else {
        auto late_recv = [&]() -> gdr::task<gdr::op_report> {
          if (where == receiver_late) {
            // Until the announcement is kept (bounded: the watchdog).
            while (b.stats().unexpected_rts == 0) co_await gdr::sleep_for(1ms);
          }
          co_return co_await b.recv(dev.device()).report();
        };
        auto [x, y] = co_await gdr::when_all(report_of(a.send(host(hbuf))), late_recv());
        sr = x;
        rr = y;
        CHECK(rr.error == gdr::errc::gpudirect_unavailable);
        CHECK(sr.error);
        if (where == receiver_late) CHECK(b.stats().unexpected_rts == 1);
      }
      CHECK(std::chrono::steady_clock::now() - t0 < 10s);
      CHECK(a.stats().registration_failures + b.stats().registration_failures >= 1);
      dev.unlock();
      co_await a.close();
    });
  }
}

TEST_CASE("a GPU that needs the flush: each NIC write into Device memory ends with a loopback READ first") {
  REQUIRE_VERBS();
  stand_in s(true);
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    REQUIRE(b.gpudirect() != nullptr);
    CHECK(b.gpudirect()->needs_flush);
    const std::size_t n = 200 * 1024 + 1;
    nic_memory src(n), dst(n), exposed(n);
    std::vector<std::byte> h = pattern(n, 8), back(n);
    auto reg = gdr::register_memory(exposed.device(), gdr::access::read_write, gdr::exposure::checked);
    auto rv = reg.describe(0);
    // Registered while readable.
    co_await gdr::when_all(bytes_of(a.send(src.device())), bytes_of(b.recv(dst.device())));
    co_await a.put(host(h), rv);
    co_await a.get(src.device(), rv);
    const auto fa = a.stats().flushes, fb = b.stats().flushes;
    CHECK(fb == 2);  // b's receive and the put b served
    CHECK(fa == 1);  // a's get into Device memory
    for (int round = 0; round < 3; ++round) {
      CAPTURE(round);
      fill(src.data(), n, static_cast<std::uint32_t>(round));
      auto expect = std::vector<std::byte>(src.data(), src.data() + n);
      src.lock();
      dst.lock();
      exposed.lock();
      auto [sr, rr] = co_await gdr::when_all(report_of(a.send(src.device())), report_of(b.recv(dst.device())));
      auto pr = co_await report_of(a.put(src.device(), rv));  // served into b's Device memory
      auto gr = co_await report_of(a.get(src.device(), rv));  // into a's Device memory
      std::vector<std::byte> hin(n);  // into host memory: no flush
      auto [hr, hrr] = co_await gdr::when_all(report_of(a.send(host(h))), report_of(b.recv(host(hin))));
      src.unlock();
      dst.unlock();
      exposed.unlock();
      CHECK(!sr.error);
      CHECK(!rr.error);
      CHECK(!pr.error);
      CHECK(!gr.error);
      CHECK(!hr.error);
      CHECK(!hrr.error);
      CHECK(same(dst.data(), expect.data(), n));
      CHECK(same(exposed.data(), expect.data(), n));
      CHECK(same(src.data(), expect.data(), n));
      CHECK(hin == h);
    }
    CHECK(b.stats().flushes == fb + 6);  // two per round
    CHECK(a.stats().flushes == fa + 3);  // one per round
    co_await a.close();
  });
}

TEST_CASE("an endpoint without gpudirect reports no GPUDirect and stages Device memory") {
  REQUIRE_VERBS();
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        CHECK(a.gpudirect() == nullptr);
        CHECK(b.gpudirect() == nullptr);
        co_await a.close();
      },
      gdr::verbs::endpoint_options{}, gdr::verbs::endpoint_options{});
}
