// A verbs peer killed with SIGKILL: the kernel destroys its rdma_cm ids,
// which disconnects; every operation pending on this side (a receive, a
// rendezvous send, a put its NIC reads and a get its NIC writes) fails
// within 2 s. Its own binary: the peer is a child forked before this process has
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
#include <gdr/memory/registration.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/support/skip.hpp"
#include "tests/support/watchdog.hpp"
#include "tests/verbs/forked_peer.hpp"
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
  // The peer exposes 32 MiB that this side puts into and gets from (its
  // NIC reads the put and writes the get when it is killed).
  gdr_test_support::forked_peer peer(ip, 32u << 20);
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr::verbs::listener l(sched, ip + ":0");
    peer.tell_port(l.port());
    gdr::verbs::endpoint ep = co_await l.accept();
    // Its window without the NIC key: the put and the get are served by
    // the peer (the rendezvous and RDMA of the message channel).
    const auto w = peer.window();
    gdr::remote_view<std::byte, gdr::Host> rv(w.address(), w.size(), w.key(), 0);
    std::vector<std::byte> in(64);
    auto big = pattern(1u << 20);
    auto src = pattern(16u << 20);
    std::vector<std::byte> back(16u << 20);
    std::chrono::steady_clock::time_point killed;
    auto [r, s, p, g, x] = co_await gdr::when_all(
        report_of(ep.recv(gdr::view<std::byte, gdr::Host>(in.data(), in.size()))),
        report_of(ep.send(gdr::view<const std::byte, gdr::Host>(big.data(), big.size()))),
        report_of(ep.put(gdr::view<const std::byte, gdr::Host>(src.data(), src.size()), rv)),
        report_of(ep.get(gdr::view<std::byte, gdr::Host>(back.data(), back.size()), rv)),
        [&]() -> gdr::task<int> {
          co_await gdr::sleep_for(20ms);
          killed = std::chrono::steady_clock::now();
          ::kill(peer.pid(), SIGKILL);
          co_return 0;
        }());
    auto took = std::chrono::steady_clock::now() - killed;
    MESSAGE("pending operations failed "
            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms after SIGKILL");
    CHECK(r.error == gdr::errc::connection_lost);
    CHECK(s.error == gdr::errc::connection_lost);
    CHECK(p.error == gdr::errc::connection_lost);
    CHECK(g.error == gdr::errc::connection_lost);
    CHECK(took < 2s);
    // The put and the get went by RDMA: their buffers were registered.
    CHECK(ep.stats().registrations >= 2);
  }());
  sched.drain();
  CHECK(WIFSIGNALED(peer.wait()));
}


