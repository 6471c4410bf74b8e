// The verbs transport's own behaviour, beyond the conformance suite: inline
// and bounce-buffer SENDs, rendezvous by RDMA WRITE with immediate data,
// puts served by RDMA READ and gets by RDMA WRITE, registration and keys, revocation while a peer accesses, a peer killed
// with SIGKILL (peer_kill_test.cpp), a queue pair forced into the error state, and the GPUDirect
// probe's refusal. Real verbs: they need an RDMA device and its IP address
// (GDR_VERBS_IP; the Soft-RoCE guest of .ci/verbs-vm.sh sets it) and skip
// with the reason otherwise.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stop_token>
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
#include "tests/verbs/verbs_fixture.hpp"

using namespace std::chrono_literals;

namespace {

std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = 2654435761u * (seed + 1);
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::byte>(x);
  }
  return v;
}

gdr::view<std::byte, gdr::Host> bytes_of(std::vector<std::byte>& v) { return {v.data(), v.size()}; }
gdr::view<const std::byte, gdr::Host> cbytes_of(const std::vector<std::byte>& v) { return {v.data(), v.size()}; }

template <class Op>
gdr::task<gdr::op_report> report_of(Op op) {
  co_return co_await std::move(op).report();
}

/// Runs `body(a, b)` over a fresh verbs pair on a fresh scheduler.
template <class Body>
void with_pair(Body body, gdr::verbs::endpoint_options oa = {}, gdr::verbs::endpoint_options ob = {},
               gdr::run_mode mode = gdr::run_mode::sleep) {
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched({.mode = mode});
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto p = co_await conformance::verbs_pair(sched, gdr::default_registry(), oa, ob);
    co_await body(p.first, p.second);
  }());
  sched.drain();
}

}  // namespace

#define REQUIRE_VERBS()                                                   \
  do {                                                                    \
    std::string why_ = conformance::verbs_skip_reason();                  \
    if (!why_.empty()) GDR_SKIP(why_);                                    \
  } while (0)

TEST_CASE("small messages go inline, larger ones through the send slots, larger still in fragments") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    CHECK(a.max_inline() > 0);
    std::size_t inl = a.max_inline() > 72 ? a.max_inline() - 72 : 0;
    const std::vector<std::size_t> sizes{0, 1, inl, inl + 1, 1000, 32 * 1024 - 72, 32 * 1024, 200 * 1024};
    for (std::size_t n : sizes) {
      CAPTURE(n);
      auto out = pattern(n, static_cast<std::uint32_t>(n));
      std::vector<std::byte> in(n + 8);
      auto [s, r] = co_await gdr::when_all(report_of(a.send(cbytes_of(out))), report_of(b.recv(bytes_of(in))));
      CHECK(!s.error);
      CHECK(r.bytes == n);
      CHECK(std::equal(out.begin(), out.end(), in.begin()));
      CHECK(r.path == gdr::transfer_path::host_eager);
    }
    const auto& st = a.stats();
    CHECK(st.inline_sends >= 3);           // 0, 1 and inl bytes
    CHECK(st.send_wrs > st.inline_sends);  // the others were copied
    CHECK(b.stats().fragments > 0);        // 32 KiB and 200 KiB did not fit one buffer
    CHECK(st.write_wrs == 0);              // all eager: no RDMA WRITE
    co_await a.close();
  });
}

TEST_CASE("a rendezvous payload is written by RDMA straight into the receive, announced by immediate data") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options o;
  o.protocol.rendezvous_threshold = 4096;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        for (std::size_t n : {std::size_t{4097}, std::size_t{1} << 20, (std::size_t{20} << 20) + 3}) {
          CAPTURE(n);
          auto out = pattern(n, 7);
          std::vector<std::byte> in(n);
          auto [s, r] = co_await gdr::when_all(report_of(a.send(cbytes_of(out))), report_of(b.recv(bytes_of(in))));
          CHECK(!s.error);
          CHECK(!r.error);
          CHECK(in == out);
          CHECK(s.path == gdr::transfer_path::host_zero_copy);
          CHECK(r.path == gdr::transfer_path::host_zero_copy);
          CHECK(r.protocol == gdr::wire_protocol::rendezvous);
        }
        CHECK(b.stats().rdma_received == 3);
        CHECK(a.stats().write_wrs >= 4);  // 20 MiB took more than one WRITE
        co_await a.close();
      },
      o, o);
}

TEST_CASE("put and get need the registration's key and stay inside it; a refusal writes nothing") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    std::vector<std::byte> target(4096, std::byte{0});
    auto reg = gdr::register_memory(gdr::host_view(target), gdr::access::read_write, gdr::exposure::checked);
    auto rv = reg.describe(0);
    auto src = pattern(4096, 1);
    CHECK(co_await a.put(cbytes_of(src), rv) == 4096);
    CHECK(target == src);
    std::fill(target.begin(), target.end(), std::byte{0});
    // A wrong key.
    gdr::remote_view<std::byte, gdr::Host> bad(rv.address(), rv.size(), rv.key() + 1, 0);
    gdr::op_report r = co_await report_of(a.put(cbytes_of(src), bad));
    CHECK(r.error == gdr::errc::remote_access);
    // Outside the registration: one byte past its end.
    gdr::remote_view<std::byte, gdr::Host> past(rv.address() + 1, rv.size(), rv.key(), 0);
    r = co_await report_of(a.put(cbytes_of(src), past));
    CHECK(r.error == gdr::errc::remote_access);
    std::vector<std::byte> back(4096);
    r = co_await report_of(a.get(bytes_of(back), past));
    CHECK(r.error == gdr::errc::remote_access);
    CHECK(std::all_of(target.begin(), target.end(), [](std::byte x) { return x == std::byte{0}; }));
    CHECK(b.stats().refused == 3);
    CHECK(a.is_open());
    co_await a.close();
  });
}

TEST_CASE("a large put is read and a large get written by the target's NIC, straight between the two buffers") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    // One byte more than one SEND carries, several MiB, and more than one
    // READ work request's worth (8 MiB each).
    const std::vector<std::size_t> sizes{32 * 1024 - 72 + 1, std::size_t{1} << 20, (std::size_t{20} << 20) + 3};
    std::uint64_t puts = 0;
    for (std::size_t n : sizes) {
      CAPTURE(n);
      std::vector<std::byte> target(n, std::byte{0});
      auto reg = gdr::register_memory(gdr::host_view(target), gdr::access::read_write, gdr::exposure::checked);
      auto rv = reg.describe(0);
      auto src = pattern(n, static_cast<std::uint32_t>(n));
      gdr::op_report p = co_await report_of(a.put(cbytes_of(src), rv));
      CHECK(!p.error);
      CHECK(p.bytes == n);
      CHECK(p.path == gdr::transfer_path::host_zero_copy);
      CHECK(target == src);
      ++puts;
      CHECK(b.stats().rdma_read == puts);
      std::vector<std::byte> back(n);
      auto received = a.stats().rdma_received;
      gdr::op_report g = co_await report_of(a.get(bytes_of(back), rv));
      CHECK(!g.error);
      CHECK(g.bytes == n);
      CHECK(g.path == gdr::transfer_path::host_zero_copy);
      CHECK(back == src);
      CHECK(a.stats().rdma_received == received + 1);
    }
    CHECK(b.stats().read_wrs >= 5);   // 20 MiB took three READs
    CHECK(b.stats().write_wrs >= 5);  // and three WRITEs back
    CHECK(b.stats().served_puts == 3);
    CHECK(b.stats().served_gets == 3);
    // Their payloads went by RDMA, not SENDs: a handful of header SENDs each.
    CHECK(a.stats().send_wrs < 20);
    CHECK(b.stats().fragments == 0);
    co_await a.close();
  });
}

TEST_CASE("a refused large put or get moves nothing by RDMA, and the endpoint stays usable") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    const std::size_t n = 1 << 20;
    std::vector<std::byte> target(n, std::byte{0});
    auto reg = gdr::register_memory(gdr::host_view(target), gdr::access::read_write, gdr::exposure::checked);
    auto rv = reg.describe(0);
    auto src = pattern(n, 5);
    gdr::remote_view<std::byte, gdr::Host> bad(rv.address(), rv.size(), rv.key() + 1, 0);
    gdr::op_report r = co_await report_of(a.put(cbytes_of(src), bad));
    CHECK(r.error == gdr::errc::remote_access);
    std::vector<std::byte> back(n, std::byte{0x5a});
    r = co_await report_of(a.get(bytes_of(back), bad));
    CHECK(r.error == gdr::errc::remote_access);
    CHECK(std::all_of(target.begin(), target.end(), [](std::byte x) { return x == std::byte{0}; }));
    CHECK(std::all_of(back.begin(), back.end(), [](std::byte x) { return x == std::byte{0x5a}; }));
    CHECK(b.stats().read_wrs == 0);
    CHECK(b.stats().write_wrs == 0);
    CHECK(a.stats().rdma_received == 0);
    CHECK(b.stats().refused == 2);
    // The right key still works, both ways.
    CHECK(co_await a.put(cbytes_of(src), rv) == n);
    CHECK(target == src);
    CHECK(co_await a.get(bytes_of(back), rv) == n);
    CHECK(back == src);
    co_await a.close();
  });
}

TEST_CASE("a large get stopped after its request went out returns only when nothing writes into its buffer") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    (void)b;
    const std::size_t n = 8u << 20;
    std::vector<std::byte> exposed = pattern(n, 9);
    auto reg = gdr::register_memory(gdr::host_view(exposed), gdr::access::read_write, gdr::exposure::checked);
    auto rv = reg.describe(0);
    for (auto delay : {0ms, 1ms, 5ms}) {
      CAPTURE(delay.count());
      std::vector<std::byte> back(n, std::byte{0});
      std::stop_source stop;
      auto [g, x] = co_await gdr::when_all(report_of(a.get(bytes_of(back), rv, {stop.get_token()})),
                                           [&]() -> gdr::task<int> {
                                             if (delay.count() != 0) co_await gdr::sleep_for(delay);
                                             stop.request_stop();
                                             co_return 0;
                                           }());
      // Either way the operation has ended: whole, or stopped.
      if (!g.error) CHECK(back == exposed);
      if (g.error) CHECK(g.error == gdr::errc::cancelled);
      // Nothing lands in the buffer after the operation returned.
      std::fill(back.begin(), back.end(), std::byte{0x77});
      co_await gdr::sleep_for(50ms);
      CHECK(std::all_of(back.begin(), back.end(), [](std::byte x) { return x == std::byte{0x77}; }));
    }
    // Still in step.
    std::vector<std::byte> back(n);
    CHECK(co_await a.get(bytes_of(back), rv) == n);
    CHECK(back == exposed);
    co_await a.close();
  });
}

TEST_CASE("buffers over the registration limit go through the bounce buffers, every path, every byte") {
  REQUIRE_VERBS();
  // Only the target side limited: the initiator's memory is registered and
  // its key sent, and the target reads the put through a send slot, buffer
  // by buffer. Then both limited: nothing registered, everything as SENDs.
  for (bool both : {false, true}) {
    CAPTURE(both);
    gdr::verbs::endpoint_options free_side, limited;
    limited.registration_limit = 64 * 1024;
    limited.protocol.rendezvous_threshold = 4096;
    free_side.protocol.rendezvous_threshold = 4096;
    with_pair(
        [both](auto& a, auto& b) -> gdr::task<> {
          const std::size_t n = (1 << 20) + 7;  // 32 buffers and a bit
          std::vector<std::byte> target(n, std::byte{0});
          auto reg = gdr::register_memory(gdr::host_view(target), gdr::access::read_write, gdr::exposure::checked);
          auto rv = reg.describe(0);
          auto src = pattern(n, 21);
          gdr::op_report p = co_await report_of(a.put(cbytes_of(src), rv));
          CHECK(!p.error);
          CHECK(target == src);
          std::vector<std::byte> back(n);
          gdr::op_report g = co_await report_of(a.get(bytes_of(back), rv));
          CHECK(!g.error);
          CHECK(back == src);
          // A rendezvous message each way: the limited receive (b's) takes
          // its data as SENDs.
          std::vector<std::byte> in(n);
          auto [s, r] = co_await gdr::when_all(report_of(a.send(cbytes_of(src))), report_of(b.recv(bytes_of(in))));
          CHECK(!s.error);
          CHECK(in == src);
          CHECK(r.path == gdr::transfer_path::host_eager);
          CHECK(b.stats().rdma_received == 0);
          if (!both) {
            // b could not register: the receive, the put's destination, the get's source.
            CHECK(b.stats().registration_failures == 3);
            CHECK(p.path == gdr::transfer_path::host_zero_copy);  // read by the target, through its slots
            CHECK(b.stats().rdma_read == 1);
            CHECK(b.stats().read_wrs >= 17);                      // one READ per 32 KiB buffer
          } else {
            CHECK(b.stats().registration_failures == 1);  // the receive: no key came to try the others
            CHECK(a.stats().registration_failures == 2);  // the put's source, the get's destination
            CHECK(p.path == gdr::transfer_path::host_eager);
            CHECK(g.path == gdr::transfer_path::host_eager);
            CHECK(a.stats().registrations == 0);
            CHECK(b.stats().read_wrs == 0);
            CHECK(b.stats().write_wrs == 0);
          }
          co_await a.close();
        },
        both ? limited : free_side, limited);
  }
}

TEST_CASE("a receive registered for RDMA whose sender cannot register its message gets it as SENDs, and completes") {
  REQUIRE_VERBS();
  // a (the sender, the initiator) is limited, b is not: b's receive sends
  // its key, a's data comes as SENDs all the same; b's registration must
  // end with them (not wait for a WRITE_WITH_IMM that never comes).
  gdr::verbs::endpoint_options limited, free_side;
  limited.registration_limit = 64 * 1024;
  limited.protocol.rendezvous_threshold = 4096;
  free_side.protocol.rendezvous_threshold = 4096;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        for (std::size_t n : {std::size_t{100000}, (std::size_t{1} << 20) + 7}) {
          CAPTURE(n);
          auto src = pattern(n, 23);
          std::vector<std::byte> in(n);
          auto [s, r] = co_await gdr::when_all(report_of(a.send(cbytes_of(src))),
                                               report_of(b.recv(bytes_of(in), {5s})));
          CHECK(!s.error);
          CHECK(!r.error);
          CHECK(in == src);
          CHECK(r.path == gdr::transfer_path::host_eager);
        }
        CHECK(b.stats().registrations == 2);          // b offered its receives
        CHECK(a.stats().registration_failures == 2);  // a could not take them up
        CHECK(b.stats().rdma_received == 0);
        // A put from the limited side goes as SENDs, and is served.
        std::vector<std::byte> target(200000);
        auto reg = gdr::register_memory(gdr::host_view(target), gdr::access::read_write, gdr::exposure::checked);
        auto src = pattern(target.size(), 24);
        CHECK(co_await a.put(cbytes_of(src), reg.describe(0)) == target.size());
        CHECK(target == src);
        co_await a.close();
      },
      limited, free_side);
}

TEST_CASE("cached registrations stay for the next transfer until the program invalidates them") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options o;
  o.cache_registrations = true;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        const std::size_t n = 1 << 20;
        std::vector<std::byte> target(n);
        auto reg = gdr::register_memory(gdr::host_view(target), gdr::access::read_write, gdr::exposure::checked);
        auto rv = reg.describe(0);
        auto src = pattern(n, 11);
        CHECK(co_await a.put(cbytes_of(src), rv) == n);
        CHECK(co_await a.put(cbytes_of(src), rv) == n);  // the window's registration again
        CHECK(target == src);
        // The exposed window (the target's READ destination, whose key
        // never leaves the target) is cached, once. The put's source is
        // registered for each put alone (its key goes to the target: a
        // registration of exactly its bytes, for exactly that put) and never
        // cached.
        CHECK(a.invalidate_registrations(src.data(), n) == 0);
        CHECK(b.invalidate_registrations(target.data(), n) == 1);
        CHECK(b.invalidate_registrations(target.data(), n) == 0);  // gone
        CHECK(co_await a.put(cbytes_of(src), rv) == n);               // registered anew
        CHECK(b.invalidate_registrations(target.data(), n) == 1);
        co_await a.close();
      },
      o, o);
}

TEST_CASE("revoking a registration waits for the peer's access in flight, then refuses") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    (void)b;
    std::vector<std::byte> target(8u << 20);
    auto reg = gdr::register_memory(gdr::host_view(target), gdr::access::read_write, gdr::exposure::checked);
    auto rv = reg.describe(0);
    auto src = pattern(target.size(), 3);
    bool revoked = false;
    auto [r, x] = co_await gdr::when_all(report_of(a.put(cbytes_of(src), rv)), [&]() -> gdr::task<int> {
      co_await gdr::sleep_for(1ms);
      co_await reg.revoke();  // waits while the put is served
      revoked = true;
      co_return 0;
    }());
    CHECK(revoked);
    if (!r.error) CHECK(target == src);  // served whole before the revocation, or refused whole
    if (r.error) CHECK(r.error == gdr::errc::remote_access);
    gdr::op_report late = co_await report_of(a.put(cbytes_of(src), rv));
    CHECK(late.error == gdr::errc::remote_access);
    co_await a.close();
  });
}

TEST_CASE("a queue pair forced into the error state fails every pending operation on both sides") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options o;
  o.keepalive = 100ms;
  o.ack_timeout = 12;  // 17 ms per try
  o.retry_count = 3;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        std::vector<std::byte> in1(64), in2(64);
        auto ra = report_of(a.recv(bytes_of(in1)));
        auto rb = report_of(b.recv(bytes_of(in2)));
        auto t0 = std::chrono::steady_clock::now();
        auto [x, y, z] = co_await gdr::when_all(std::move(ra), std::move(rb), [&]() -> gdr::task<int> {
          co_await gdr::sleep_for(5ms);
          ibv_qp_attr attr{};
          attr.qp_state = IBV_QPS_ERR;
          CHECK(ibv_modify_qp(a.native_qp(), &attr, IBV_QP_STATE) == 0);
          co_return 0;
        }());
        CHECK(x.error == gdr::errc::connection_lost);
        CHECK(y.error == gdr::errc::connection_lost);  // the peer learns by its keepalive's retries
        CHECK(std::chrono::steady_clock::now() - t0 < 10s);
        CHECK(!a.is_open());
        CHECK(!b.is_open());
      },
      o, o);
}

namespace {

/// Sends `n` messages from `a` to `b`, one after the other (the sender
/// waits for each), `size(i)` bytes each, while `b` receives them; counts
/// the messages that arrived wrong or out of order.
template <class Ep, class Size>
gdr::task<int> stream_of(Ep& a, Ep& b, int n, Size size) {
  std::vector<std::vector<std::byte>> out;
  for (int i = 0; i < n; ++i) out.push_back(pattern(size(i), static_cast<std::uint32_t>(i)));
  int wrong = 0;
  co_await gdr::when_all(
      [&]() -> gdr::task<int> {
        for (int i = 0; i < n; ++i) co_await a.send(cbytes_of(out[static_cast<std::size_t>(i)]));
        co_return 0;
      }(),
      [&]() -> gdr::task<int> {
        std::vector<std::byte> in(64 * 1024);
        for (int i = 0; i < n; ++i) {
          const auto& want = out[static_cast<std::size_t>(i)];
          std::size_t got = co_await b.recv(bytes_of(in));
          if (got != want.size() || !std::equal(want.begin(), want.end(), in.begin())) ++wrong;
        }
        co_return 0;
      }());
  co_return wrong;
}

}  // namespace

TEST_CASE("a thousand small sends complete and arrive in order, with far fewer completions asked for than SENDs") {
  REQUIRE_VERBS();
  for (unsigned every : {0u, 1u}) {
    CAPTURE(every);
    gdr::verbs::endpoint_options o;
    o.signal_every = every;  // 0: the default moderation; 1: every work request signaled
    o.keepalive = 0ms;       // no probe to account for unsignaled SENDs: the sends themselves do
    with_pair(
        [every](auto& a, auto& b) -> gdr::task<> {
          // Inline sizes, and every fifth one copied into a send slot.
          int wrong = co_await stream_of(a, b, 1000, [](int i) -> std::size_t { return i % 5 == 4 ? 3000 : 8 + i % 64; });
          CHECK(wrong == 0);
          const auto& st = a.stats();
          MESSAGE(st.send_wrs << " SENDs, " << st.signaled_wrs << " signaled");
          CHECK(st.sends == 1000);
          CHECK(st.send_wrs >= 1000);
          CHECK(st.inline_sends >= 800);
          if (every == 0) {
            CHECK(st.signaled_wrs * 8 < st.send_wrs);  // one in 16 with tx_depth 64
          } else {
            CHECK(st.signaled_wrs >= st.send_wrs);
          }
          co_await a.close();
        },
        o, o);
  }
}

TEST_CASE("close right after a burst of unsignaled sends delivers all of it and returns") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options o;
  o.keepalive = 0ms;  // only the close frame's completion can account for the burst
  o.tx_depth = 16;    // slots run short: copied SENDs wait on signaled ones to free theirs
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        const int n = 300;
        std::vector<std::vector<std::byte>> out;
        for (int i = 0; i < n; ++i) out.push_back(pattern(i % 2 == 0 ? 20 : 5000, static_cast<std::uint32_t>(i)));
        // The last ones in many SENDs each: still on their way when the
        // close is posted (if it ended at post, the queue pair would be
        // shut down under them).
        for (int i = 0; i < 4; ++i) out.push_back(pattern(240 * 1024, static_cast<std::uint32_t>(n + i)));
        int wrong = 0;
        gdr::op_report closed, after;
        auto t0 = std::chrono::steady_clock::now();
        co_await gdr::when_all(
            [&]() -> gdr::task<int> {
              for (const auto& m : out) co_await a.send(cbytes_of(m));
              closed = co_await report_of(a.close());
              co_return 0;
            }(),
            [&]() -> gdr::task<int> {
              std::vector<std::byte> in(256 * 1024);
              for (const auto& m : out) {
                std::size_t got = co_await b.recv(bytes_of(in));
                if (got != m.size() || !std::equal(m.begin(), m.end(), in.begin())) ++wrong;
              }
              after = co_await report_of(b.recv(bytes_of(in)));
              co_return 0;
            }());
        CHECK(wrong == 0);
        CHECK(!closed.error);
        CHECK(after.error == gdr::errc::peer_closed);
        CHECK(std::chrono::steady_clock::now() - t0 < 10s);
        CHECK(a.stats().signaled_wrs < a.stats().send_wrs / 2);
        co_await b.close();
      },
      o, o);
}

TEST_CASE("a burst of sends cut off by a queue pair error ends every send exactly once, and close returns") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options oa, ob;
  oa.keepalive = ob.keepalive = 100ms;
  oa.ack_timeout = ob.ack_timeout = 12;  // 17 ms per try
  oa.retry_count = ob.retry_count = 3;
  // b keeps few early messages and receives none: a runs out of its early
  // credits, and the rest of the burst waits unposted.
  ob.protocol.unexpected_messages = 8;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        (void)b;
        const int n = 400;
        std::vector<std::vector<std::byte>> out;
        for (int i = 0; i < n; ++i) out.push_back(pattern(i % 3 == 0 ? 4000 : 40, static_cast<std::uint32_t>(i)));
        std::vector<gdr::task<gdr::op_report>> sends;
        for (const auto& m : out) sends.push_back(report_of(a.send(cbytes_of(m))));
        auto t0 = std::chrono::steady_clock::now();
        std::vector<gdr::op_report> reports;
        co_await gdr::when_all(
            [&]() -> gdr::task<int> {
              reports = co_await gdr::when_all(std::move(sends));
              co_return 0;
            }(),
            [&]() -> gdr::task<int> {
              co_await gdr::sleep_for(20ms);
              ibv_qp_attr attr{};
              attr.qp_state = IBV_QPS_ERR;
              CHECK(ibv_modify_qp(a.native_qp(), &attr, IBV_QP_STATE) == 0);
              co_return 0;
            }());
        REQUIRE(reports.size() == static_cast<std::size_t>(n));
        int ok = 0, lost = 0, other = 0;
        for (const auto& r : reports) {
          if (!r.error) {
            ++ok;
          } else if (r.error == gdr::errc::connection_lost) {
            ++lost;
          } else {
            ++other;
          }
        }
        MESSAGE(ok << " sends completed, " << lost << " failed");
        CHECK(ok > 0);    // those posted before the error: copied, so complete
        CHECK(lost > 0);  // those still waiting for credits
        CHECK(other == 0);
        CHECK(std::chrono::steady_clock::now() - t0 < 10s);
        CHECK(!a.is_open());
        co_await a.close();  // returns once every slot and send-queue entry came back
      },
      oa, ob);
}

TEST_CASE("a zero-copy Device endpoint without GPUDirect is refused at set-up, saying which check failed") {
  REQUIRE_VERBS();
  const gdr::verbs::gpudirect_report* rep = nullptr;
  gdr::verbs::endpoint_options dev;
  dev.gpudirect = true;
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  std::string what;
  std::error_code code;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::string ip = conformance::verbs_ip();
    gdr::verbs::listener l(sched, ip + ":0");
    try {
      auto ep = co_await gdr::verbs::connect(sched, ip + ":" + std::to_string(l.port()), ip + ":0",
                                             gdr::default_registry(), dev);
    } catch (const gdr::error& e) {
      code = e.code();
      what = e.what();
    }
  }());
  sched.drain();
  // Ask the probe directly for the same pair, for the expected reason.
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  REQUIRE(n > 0);
  ibv_context* ctx = ibv_open_device(list[0]);
  rep = &gdr::verbs::probe_gpudirect(0, ctx);
  MESSAGE("probe: " << rep->reason);
  if (rep->available) {
    CHECK(!code);
  } else {
    CHECK(code == gdr::errc::gpudirect_unavailable);
    CHECK(what.find(rep->failed_check) != std::string::npos);
    CHECK(!rep->failed_check.empty());
  }
  ibv_close_device(ctx);
  ibv_free_device_list(list);
}

TEST_CASE("pcie_relation tells a shared switch from a path through the CPU") {
  using gdr::verbs::detail::pcie_relation;
  CHECK(pcie_relation("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0",
                      "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0") == "switch");
  CHECK(pcie_relation("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0",
                      "/sys/devices/pci0000:00/0000:00:03.0/0000:05:00.0") == "host-bridge");
  CHECK(pcie_relation("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0",
                      "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0") == "system");
  CHECK(pcie_relation("", "/sys/devices/pci0000:00") == "unknown");
}
