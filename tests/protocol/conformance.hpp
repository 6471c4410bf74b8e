// The transports the conformance suite runs over, and its helpers. Each
// transport gives a connected pair of endpoints on one scheduler with given
// protocol options; every TEST_CASE_TEMPLATE in conformance_test.cpp runs
// over each. A new transport joins the suite by adding a fixture here.
//
// Built with CONFORMANCE_VERBS=1 (//tests/verbs:conformance_test), the same
// suite runs over the verbs transport alone: its fixture needs an RDMA
// device, and a fixture that says why it cannot run (`skip_reason()`) makes
// every case print one `[gdr-skip]` line instead.
#pragma once

#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iostream>
#include <set>
#include <span>
#include <system_error>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/protocol/endpoint.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/shm.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/support/watchdog.hpp"

#ifndef CONFORMANCE_VERBS
#define CONFORMANCE_VERBS 0
#endif
#if CONFORMANCE_VERBS
#include "tests/verbs/verbs_fixture.hpp"
#endif

namespace conformance {

using watchdog = gdr_test_support::watchdog;
using namespace std::chrono_literals;

/// Loopback: both ends on one scheduler.
struct loopback_fixture {
  using endpoint = gdr::loopback::endpoint;
  static constexpr const char* name = "loopback";
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg,
                                                        gdr::protocol_options a, gdr::protocol_options b) {
    // One option set serves both ends of a loopback pair; the suite's
    // asymmetric cases (a smaller limit on one side) use `b`'s limits.
    (void)a;
    co_return gdr::loopback::make_pair(s, s, reg, b);
  }
};

/// TCP over 127.0.0.1: both ends on one scheduler.
struct tcp_fixture {
  using endpoint = gdr::tcp::endpoint;
  static constexpr const char* name = "tcp";
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg,
                                                        gdr::protocol_options a, gdr::protocol_options b) {
    gdr::tcp::endpoint_options ea, eb;
    ea.protocol = a;
    eb.protocol = b;
    gdr::tcp::listener l(s, gdr::tcp::address::loopback(0), reg, eb);
    auto acc = l.accept();
    endpoint x = co_await gdr::tcp::connect(s, l.local_address(), {}, reg, ea);
    endpoint y = co_await std::move(acc);
    co_return std::pair<endpoint, endpoint>(std::move(x), std::move(y));
  }
};

/// Shared memory: both ends on one scheduler, in one process (the rings
/// and the socket are the same as between two). `SingleCopy`: payloads from
/// that size are copied by the receiver from the sender's memory (0: all
/// through the rings, the default).
template <std::size_t SingleCopy>
struct shm_fixture_t {
  using endpoint = gdr::shm::endpoint;
  static constexpr const char* name = SingleCopy == 0 ? "shm" : "shm-single-copy";
  static constexpr gdr::transfer_path bulk_path = gdr::transfer_path::shared_memory;
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg,
                                                        gdr::protocol_options a, gdr::protocol_options b) {
    gdr::shm::endpoint_options ea, eb;
    ea.protocol = a;
    eb.protocol = b;
    ea.single_copy_threshold = eb.single_copy_threshold = SingleCopy;
    // The staged suite runs over it: Device memory staged even where the
    // copy engine could share it (the CUDA IPC path has its own suite).
    ea.device = eb.device = gdr::shm::device_path::staged;
    gdr::shm::listener l(s, {}, reg, eb);
    auto [x, y] = co_await gdr::when_all(gdr::shm::connect(s, l.name(), reg, ea), l.accept());
    co_return std::pair<endpoint, endpoint>(std::move(x), std::move(y));
  }
};
using shm_fixture = shm_fixture_t<0>;
using shm_single_copy_fixture = shm_fixture_t<4096>;

#ifndef CONFORMANCE_VERBS_GPUDIRECT
#define CONFORMANCE_VERBS_GPUDIRECT 0
#endif
#if CONFORMANCE_VERBS && CONFORMANCE_VERBS_GPUDIRECT
// The conformance suite (host memory) also over GPUDirect endpoints: their
// rules for host memory are every endpoint's.
#define CONFORMANCE_TRANSPORTS conformance::verbs_fixture, conformance::verbs_gpudirect_fixture
#elif CONFORMANCE_VERBS
#define CONFORMANCE_TRANSPORTS conformance::verbs_fixture
#else
#define CONFORMANCE_TRANSPORTS \
  conformance::loopback_fixture, conformance::tcp_fixture, conformance::shm_fixture, conformance::shm_single_copy_fixture
#endif

/// The path of a rendezvous payload placed straight into its receive:
/// `host_zero_copy` unless the fixture says otherwise (shared memory copies
/// through its rings).
template <class Fixture>
constexpr gdr::transfer_path bulk_path() {
  if constexpr (requires { Fixture::bulk_path; }) return Fixture::bulk_path;
  else return gdr::transfer_path::host_zero_copy;
}

/// The fixture cannot run here (no device): says so once per test case, in
/// the form .ci/run counts as skipped.
template <class Fixture>
bool skipped() {
  if constexpr (requires { Fixture::skip_reason(); }) {
    std::string why = Fixture::skip_reason();
    if (why.empty()) return false;
    static std::set<std::string> said;
    std::string name = ::doctest::getContextOptions()->currentTest->m_name;
    if (said.insert(name).second) std::cout << "[gdr-skip] " << name << ": " << why << std::endl;
    return true;
  }
  return false;
}

/// Runs `body(a, b)` (a coroutine lambda taking the two endpoints) on a
/// fresh scheduler in `mode`, with a watchdog; closes nothing itself.
template <class Fixture, class Body>
void run(gdr::run_mode mode, Body body, gdr::protocol_options a = {}, gdr::protocol_options b = {},
         gdr::memory_registry& reg = gdr::default_registry()) {
  if (skipped<Fixture>()) return;
  watchdog dog(60);
  gdr::scheduler sched({.mode = mode});
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto p = co_await Fixture::pair(sched, reg, a, b);
    co_await body(p.first, p.second);
  }());
  sched.drain();
}

/// Both run modes, as doctest subcases.
template <class Fixture, class Body>
void run_both(Body body, gdr::protocol_options a = {}, gdr::protocol_options b = {}) {
  for (gdr::run_mode m : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    CAPTURE(static_cast<int>(m));
    run<Fixture>(m, body, a, b);
  }
}

/// Deterministic bytes for message `i` of size `n`.
inline std::vector<std::byte> pattern(std::size_t n, std::uint32_t i) {
  std::vector<std::byte> v(n);
  std::uint32_t x = 2654435761u * (i + 1);
  for (std::size_t k = 0; k < n; ++k) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v[k] = static_cast<std::byte>(x);
  }
  return v;
}

/// Awaits `op` and returns its report.
template <class Op>
gdr::task<gdr::op_report> report_of(Op op) {
  co_return co_await std::move(op).report();
}

/// A coroutine that starts at once and is never awaited.
struct detached {
  struct promise_type {
    detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

/// Runs the coroutine lambda `f` unawaited; counts it in `done`.
template <class F>
detached spawn(F f, int& done) {
  co_await f();
  ++done;
}

/// Waits (yielding to the loop) until `pred()` holds, or `limit` passes.
template <class Pred>
gdr::task<bool> eventually(gdr::scheduler& s, Pred pred, std::chrono::milliseconds limit = 5000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) co_return false;
    co_await gdr::sleep_for(s, 1ms);
  }
  co_return true;
}

}  // namespace conformance
