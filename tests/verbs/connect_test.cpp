// gdr/transport/verbs/connect.hpp: connection set-up through rdma_cm. The
// address test runs anywhere (without a device the set-up fails after the
// addresses were read); the connection needs an RDMA device and its IP
// address (GDR_VERBS_IP; the Soft-RoCE guest of .ci/verbs-vm.sh sets it).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/transport/verbs.hpp>

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
