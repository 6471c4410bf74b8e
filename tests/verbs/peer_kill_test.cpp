// A verbs peer killed with SIGKILL: the kernel destroys its rdma_cm ids,
// which disconnects; every operation pending on this side fails within
// 2 s. Its own binary: the peer is a child forked before this process has
// touched rdma_cm or registered memory (a forked child shares the parent's
// verbs objects otherwise). Needs an RDMA device and GDR_VERBS_IP; skips
// with the reason otherwise.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/support/skip.hpp"
#include "tests/support/watchdog.hpp"
#include "tests/verbs/verbs_fixture.hpp"

using namespace std::chrono_literals;

namespace {

std::vector<std::byte> pattern(std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(i * 31 + 7);
  return v;
}

template <class Op>
gdr::task<gdr::op_report> report_of(Op op) {
  co_return co_await std::move(op).report();
}

}  // namespace

TEST_CASE("when the peer process is killed, every pending operation fails within 2 seconds") {
  if (std::string why = conformance::verbs_skip_reason(); !why.empty()) GDR_SKIP(why);
  std::string ip = conformance::verbs_ip();
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  // The listener's port, chosen by the parent before the child connects.
  int port_pipe[2];
  REQUIRE(::pipe(port_pipe) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The peer: connects, says so, and waits to be killed.
    std::uint16_t port = 0;
    if (::read(port_pipe[0], &port, sizeof port) != sizeof port) ::_exit(2);
    gdr::scheduler s;
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      auto ep = co_await gdr::verbs::connect(s, ip + ":" + std::to_string(port), ip + ":0");
      char c = 1;
      (void)!::write(ready[1], &c, 1);
      co_await gdr::sleep_for(s, 60s);
    }());
    ::_exit(0);
  }
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr::verbs::listener l(sched, ip + ":0");
    std::uint16_t port = l.port();
    (void)!::write(port_pipe[1], &port, sizeof port);
    gdr::verbs::endpoint ep = co_await l.accept();
    char c = 0;
    REQUIRE(::read(ready[0], &c, 1) == 1);
    std::vector<std::byte> in(64);
    auto big = pattern(1u << 20);
    auto t0 = std::chrono::steady_clock::now();
    std::chrono::steady_clock::time_point killed;
    auto [r, s, x] = co_await gdr::when_all(report_of(ep.recv(gdr::view<std::byte, gdr::Host>(in.data(), in.size()))), report_of(ep.send(gdr::view<const std::byte, gdr::Host>(big.data(), big.size()))),
                                            [&]() -> gdr::task<int> {
                                              co_await gdr::sleep_for(20ms);
                                              killed = std::chrono::steady_clock::now();
                                              ::kill(child, SIGKILL);
                                              co_return 0;
                                            }());
    auto took = std::chrono::steady_clock::now() - killed;
    MESSAGE("pending operations failed "
            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms after SIGKILL");
    CHECK(r.error == gdr::errc::connection_lost);
    CHECK(s.error == gdr::errc::connection_lost);
    CHECK(took < 2s);
    (void)t0;
  }());
  sched.drain();
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFSIGNALED(status));
}

