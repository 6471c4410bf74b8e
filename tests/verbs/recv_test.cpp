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
// b's early-message store is full while a stops, so b answers only after.
TEST_CASE("a large get stopped while its answer comes as SENDs writes nothing into its buffer after it returns") {
  REQUIRE_VERBS();
  gdr::verbs::endpoint_options oa, ob;
  ob.registration_limit = 64 * 1024;
  ob.protocol.unexpected_messages = 1;
  with_pair(
      [](auto& a, auto& b) -> gdr::task<> {
        const std::size_t n = std::size_t{4} << 20;  // 128 SENDs of answer
        std::vector<std::byte> exposed = pattern(n, 3);
        auto reg = gdr::register_memory(host(exposed));
        auto rv = reg.describe(0);
        for (int round = 0; round < 3; ++round) {
          CAPTURE(round);
          // Two messages b does not receive yet: the second one stops b's
          // reader (its store holds one), so the get request behind waits.
          std::vector<std::byte> m1 = pattern(100, 1), m2 = pattern(100, 2);
          co_await a.send(chost(m1));
          co_await a.send(chost(m2));
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
                                                 std::vector<std::byte> in(100);
                                                 co_await b.recv(host(in));
                                                 co_await b.recv(host(in));
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
