// A verbs owner killed with SIGKILL in the middle of a peer's batch of
// direct puts into its exposed memory (the hand-off of a KV cache whose
// receiver dies): the batch and everything else pending fail within 2 s,
// nothing hangs. Its own binary: the owner is a child forked before this
// process has touched rdma_cm or registered memory (forked_peer.hpp). Needs an RDMA device and
// GDR_VERBS_IP; skips with the reason otherwise.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
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
template <class Op>
gdr::task<gdr::op_report> report_of(Op op) {
  co_return co_await std::move(op).report();
}
}  // namespace

TEST_CASE("when the owner is killed mid-batch, the batch and every pending operation fail within 2 seconds") {
  if (std::string why = conformance::verbs_skip_reason(); !why.empty()) GDR_SKIP(why);
  std::string ip = conformance::verbs_ip();
  const std::size_t blk = 16 * 1024, count = 512;
  gdr_test_support::forked_peer owner(ip, blk * count);
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr::verbs::listener l(sched, ip + ":0");
    owner.tell_port(l.port());
    gdr::verbs::endpoint ep = co_await l.accept();
    const auto rv = owner.window();
    REQUIRE(rv.nic_exposed());
    std::vector<std::byte> local(blk * count, std::byte{3});
    std::vector<gdr::block> blocks;
    for (std::size_t i = 0; i < count; ++i) blocks.push_back({i * blk, ((i * 101) % count) * blk, blk});
    // Batches keep going until the owner dies; then the one in flight fails.
    std::chrono::steady_clock::time_point killed{}, failed{};
    bool stop = false;
    int batches = 0;
    gdr::op_report last{}, recv{};
    std::vector<std::byte> in(8);
    auto pusher = [&]() -> gdr::task<int> {
      while (!stop) {
        last = co_await report_of(ep.put_batch(gdr::host_view(local), rv, blocks));
        if (last.error) {
          failed = std::chrono::steady_clock::now();
          break;
        }
        ++batches;
      }
      co_return 0;
    };
    auto receiver = [&]() -> gdr::task<int> {
      recv = co_await report_of(ep.recv(gdr::host_view(in)));
      co_return 0;
    };
    auto killer = [&]() -> gdr::task<int> {
      while (batches < 3) co_await gdr::sleep_for(1ms);
      killed = std::chrono::steady_clock::now();
      ::kill(owner.pid(), SIGKILL);
      while (!last.error && !stop && std::chrono::steady_clock::now() - killed < 5s) co_await gdr::sleep_for(1ms);
      stop = true;
      co_return 0;
    };
    co_await gdr::when_all(pusher(), receiver(), killer());
    auto took = failed - killed;
    MESSAGE(batches << " batches of " << count << " blocks went before the kill; the pending ones failed "
                    << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms after it");
    CHECK(last.error == gdr::errc::connection_lost);
    CHECK(recv.error == gdr::errc::connection_lost);
    CHECK(batches >= 3);
    CHECK(took < 2s);
  }());
  sched.drain();
  CHECK(WIFSIGNALED(owner.wait()));
}
