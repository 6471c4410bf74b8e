// gdr/bootstrap/verbs_mesh.hpp: ranks in forked processes meet through the
// TCP rendezvous (on 127.0.0.1) and build a mesh of verbs endpoints on the
// RDMA device's address (GDR_VERBS_IP), then every pair exchanges
// checksummed messages both ways (eager and rendezvous); a rank that cannot
// listen on an RDMA address makes every rank fail with its reason. Needs an
// RDMA device; skips with the reason otherwise. Each rank is a fresh fork
// of a process that has not touched verbs.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include <gdr/bootstrap/tcp_rendezvous.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/bootstrap/verbs_mesh.hpp>

#include "tests/bootstrap/exchange.hpp"
#include "tests/bootstrap/multiprocess.hpp"
#include "tests/support/skip.hpp"
#include "tests/verbs/verbs_fixture.hpp"

using namespace std::chrono_literals;
namespace bs = gdr::bootstrap;

namespace {

bs::tcp_rendezvous join(int rank, int world, std::uint16_t port, int listen_fd) {
  bs::tcp_rendezvous_config c;
  c.root_port = port;
  c.rank = rank;
  c.world_size = world;
  c.timeout = 20s;
  c.listen_fd = rank == 0 ? listen_fd : -1;
  if (rank != 0) ::close(listen_fd);
  return bs::tcp_rendezvous(c);
}

}  // namespace

TEST_CASE("three ranks build a verbs mesh and every pair exchanges checksummed messages both ways") {
  if (std::string why = conformance::verbs_skip_reason(); !why.empty()) GDR_SKIP(why);
  const std::string ip = conformance::verbs_ip();
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int world = 3;
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, world, port, lfd);
    gdr::scheduler sched;
    gdr::verbs::mesh_options o;
    o.listen_host = ip;
    o.timeout = 20s;
    int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      bs::mesh m = co_await gdr::verbs::connect_mesh(sched, rv, o);
      co_return co_await gdr_test::check_mesh(m, rv, rank, world);
    }());
    sched.drain();
    return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
}

TEST_CASE("a rank that cannot listen on an RDMA address makes every rank fail with its reason") {
  if (std::string why = conformance::verbs_skip_reason(); !why.empty()) GDR_SKIP(why);
  const std::string ip = conformance::verbs_ip();
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto t0 = std::chrono::steady_clock::now();
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(3), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 3, port, lfd);
    gdr::scheduler sched;
    gdr::verbs::mesh_options o;
    o.listen_host = rank == 1 ? "not-an-address" : ip;
    o.timeout = 5s;
    gdr::sync_wait(sched, gdr::verbs::connect_mesh(sched, rv, o));
    return gdr_test::rank_failed;  // must not get here
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(3, gdr_test::rank_bootstrap_failed));
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
}
