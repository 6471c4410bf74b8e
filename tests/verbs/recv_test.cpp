// The verbs transport's receive side: payloads that come as SENDs (a first
// buffer, then continuations) and what a stopped placement leaves behind.
// Real verbs: they need an RDMA device and its IP address (GDR_VERBS_IP; the
// Soft-RoCE guest of .ci/verbs-vm.sh sets it) and skip otherwise.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <stop_token>
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/verbs/support.hpp"

using namespace std::chrono_literals;
using namespace verbs_test;

// Issue 15, defect 6. The sequence: a's get carries the key of its buffer,
// but b cannot register the exposed memory (its registration limit), so b
// answers with SENDs. a's get is stopped after its request went out and
// before the answer came: the request frame is held (its key is out), so
// the stop waits. The answer's first SEND arrives: the engine places it
// into the get's buffer, the held frame ends, and the stop completes the
// get, which stops the placement (link_abort_target) while the transport
// has not yet set up the continuation of the payload. The transport then
// set the continuation up with the get's buffer all the same, and the
// SENDs after the first wrote into the buffer after the get had returned.
// b's reader is held while a stops (endpoint::hold_reading), so b answers
// only after.
TEST_CASE("a large get stopped while its answer comes as SENDs writes nothing into its buffer after it returns") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options oa, ob;
  ob.registration_limit = 64 * 1024;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        const std::size_t n = std::size_t{4} << 20;  // 128 SENDs of answer
        std::vector<std::byte> exposed = pattern(n, 3);
        auto reg = gdr::register_memory(host(exposed), gdr::access::read_write, gdr::exposure::checked);
        auto rv = reg.describe(0);
        for (int round = 0; round < 3; ++round) {
          CAPTURE(round);
          // b stops reading, as a stopped process, so the get request
          // waits there unread. (b's early-message store cannot stop its
          // reader: a's early credits hold a's sends back instead.)
          b.hold_reading(true);
          std::vector<std::byte> back(n, std::byte{0});
          std::stop_source stop;
          std::uint64_t wrs = a.stats().send_wrs;
          auto [g, x] = co_await gdr::when_all(report_of(a.get(host(back), rv, {stop.get_token()})),
                                               [&]() -> gdr::task<int> {
                                                 // The request is posted; b is not reading.
                                                 while (a.stats().send_wrs == wrs) co_await gdr::sleep_for(100us);
                                                 co_await gdr::sleep_for(2ms);
                                                 stop.request_stop();
                                                 // b reads again: the request, then the answer as SENDs.
                                                 b.hold_reading(false);
                                                 co_return 0;
                                               }());
          CHECK(g.error == gdr::errc::cancelled);
          if (!g.error) CHECK(back == exposed);
          std::fill(back.begin(), back.end(), std::byte{0x77});
          // A frame b sends after its answer: once it is here, so is every
          // SEND of the answer (RC delivers in order).
          std::vector<std::byte> ping = pattern(8, 4), pong(8);
          co_await gdr::when_all(report_of(b.send(chost(ping))), report_of(a.recv(host(pong))));
          CHECK(pong == ping);
          CHECK(all_are(back, std::byte{0x77}));
        }
        // Still in step.
        std::vector<std::byte> back(n);
        CHECK(co_await a.get(host(back), rv) == n);
        CHECK(back == exposed);
        CHECK(b.stats().registration_failures > 0);  // the answers went as SENDs
        co_await a.close();
      },
      oa, ob);
}

// The seam the tests above stop a peer with (a gdr peer's reader never
// stops by itself: the early credits hold the sender back instead).
TEST_CASE("a held reader reads nothing until it is let go, then every frame in order") {
  REQUIRE_VERBS();
  with_pair([](auto& a, auto& b) -> gdr::task<> {
    std::vector<std::byte> m0 = pattern(100, 0), in0(100);
    co_await gdr::when_all(report_of(a.send(chost(m0))), report_of(b.recv(host(in0))));
    b.hold_reading(true);
    std::vector<std::vector<std::byte>> out, in;
    for (std::uint32_t i = 1; i <= 3; ++i) {
      out.push_back(pattern(i == 2 ? 100'000 : 100, i));  // one by rendezvous (an rtr b does not read)
      in.emplace_back(out.back().size());
    }
    int got = 0;
    co_await gdr::when_all(
        [&]() -> gdr::task<int> {
          for (auto& m : out) co_await a.send(chost(m));
          co_return 0;
        }(),
        [&]() -> gdr::task<int> {
          for (auto& m : in) {
            co_await b.recv(host(m));
            ++got;
          }
          co_return 0;
        }(),
        [&]() -> gdr::task<int> {
          co_await gdr::sleep_for(200ms);
          CHECK(got == 0);  // the first message arrived long ago, unread
          b.hold_reading(false);
          co_return 0;
        }());
    CHECK(got == 3);
    CHECK(in == out);
    co_await a.close();
  });
}
