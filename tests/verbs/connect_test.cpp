// gdr/transport/verbs/connect.hpp: connection set-up through rdma_cm. The
// address test runs anywhere (without a device the set-up fails after the
// addresses were read); the connection needs an RDMA device and its IP
// address (GDR_VERBS_IP; the Soft-RoCE guest of .ci/verbs-vm.sh sets it).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <gdr/coro/cancel.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/support/skip.hpp"
#include "tests/verbs/support.hpp"

using namespace verbs_test;

// The mesh's transport passed `host + ":0"` and returned the task unstarted:
// connect kept a string_view of the temporary and parsed it when the task
// ran, which failed the connection with "source address: invalid
// argument" (or read freed memory).
TEST_CASE("connect reads its addresses when it is called: the strings may be gone before the task starts") {
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  const std::string ip = conformance::verbs_ip().empty() ? std::string("10.99.0.1") : conformance::verbs_ip();
  const bool real = conformance::verbs_skip_reason().empty();
  std::optional<gdr::verbs::listener> l;
  std::uint16_t port = 7;
  if (real) {
    l.emplace(sched, ip + ":0");
    port = l->port();
  }
  // The strings are on the heap, overwritten and freed before the task
  // starts: a view of them would read garbage (ASan: a use-after-free).
  auto to = std::make_unique<std::string>(ip + ":" + std::to_string(port));
  auto from = std::make_unique<std::string>(ip + ":0");
  gdr::task<gdr::verbs::endpoint> t = gdr::verbs::connect(sched, *to, *from);
  std::memset(to->data(), 'x', to->size());
  std::memset(from->data(), 'x', from->size());
  to.reset();
  from.reset();
  std::string failure;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    try {
      if (real) {
        auto [a, b] = co_await gdr::when_all(std::move(t), l->accept());
        CHECK(a.is_open());
        CHECK(b.is_open());
        co_await a.close();
      } else {
        (void)co_await std::move(t);
      }
    } catch (const gdr::error& e) {
      failure = e.what();
    }
  }());
  sched.drain();
  INFO(failure);
  if (real) {
    CHECK(failure.empty());
  } else {
    // Failed past the addresses (no device here).
    CHECK(!failure.empty());
    CHECK(failure.find("address") == std::string::npos);
  }
}

// A new user found that verbs' connect and accept, unlike TCP's, took no
// timeout: an accept with nobody connecting waited for ever. Both now take
// op_options: the timeout ends the wait with timed_out, the stop token
// with cancelled, and the listener still accepts afterwards.
TEST_CASE("accept and connect take op_options: a timeout and a stop end their waits, and the listener still works") {
  if (std::string why = conformance::verbs_skip_reason(); !why.empty()) GDR_SKIP(why);
  using namespace std::chrono_literals;
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  const std::string ip = conformance::verbs_ip();
  gdr::verbs::listener l(sched, ip + ":0");
  const std::string to = ip + ":" + std::to_string(l.port());
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    // Nobody connects: the accept ends after its timeout.
    auto t0 = std::chrono::steady_clock::now();
    std::error_code ec;
    try {
      (void)co_await l.accept({200ms});
    } catch (const gdr::error& e) {
      ec = e.code();
    }
    CHECK(ec == gdr::errc::timed_out);
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
    // A stop token ends it too.
    std::stop_source stop;
    stop.request_stop();
    ec = {};
    try {
      (void)co_await l.accept({stop.get_token()});
    } catch (const gdr::error& e) {
      ec = e.code();
    }
    CHECK(gdr::is_cancellation(ec));
    // The listener still accepts, and a bounded connect that succeeds is an
    // ordinary endpoint.
    auto [a, b] = co_await gdr::when_all(l.accept({10s}), gdr::verbs::connect(sched, to, ip + ":0", {10s}));
    CHECK(a.is_open());
    CHECK(b.is_open());
    co_await a.close();
    co_await b.close();
  }());
  sched.drain();
}
