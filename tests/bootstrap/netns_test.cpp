// Bootstrap and mesh across two network namespaces joined by a veth pair:
// ranks 0 and 1 live in one ("host A", 10.77.0.1), ranks 2 and 3 in the other
// ("host B", 10.77.0.2). Needs root; skips with the reason otherwise. Runs outside
// Bazel's sandbox (tags = ["no-sandbox"]): creating namespaces needs a
// writable /var/run/netns.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/tcp_rendezvous.hpp>
#include <gdr/coro/sync_wait.hpp>

#include "tests/bootstrap/exchange.hpp"
#include "tests/bootstrap/multiprocess.hpp"
#include "tests/bootstrap/netns.hpp"
#include "tests/support/skip.hpp"

using namespace std::chrono_literals;
namespace bs = gdr::bootstrap;

namespace {

constexpr int world = 4;
constexpr std::uint16_t root_port = 29500;  // inside a namespace of our own: nothing else is there

// Host A holds ranks 0 and 1, host B ranks 2 and 3.
bool on_host_a(int rank) { return rank < 2; }

bs::tcp_rendezvous join(int rank) {
  bs::tcp_rendezvous_config c;
  c.root_host = gdr_test::netns_pair::addr_a;
  c.root_port = root_port;
  c.rank = rank;
  c.world_size = world;
  c.timeout = 10s;
  return bs::tcp_rendezvous(c);
}

}  // namespace

TEST_CASE("ranks in two network namespaces find each other through the rendezvous") {
  std::string why;
  auto net = gdr_test::netns_pair::create(why);
  if (!net) GDR_SKIP(why);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 60s, [&](int rank) {
    if (!gdr_test::netns_pair::enter(on_host_a(rank) ? net->name_a() : net->name_b())) return gdr_test::rank_failed;
    bs::tcp_rendezvous rv = join(rank);
    // Each rank learns the address by which the other host reaches it.
    const std::string mine = rv.address_hint();
    const std::string expected = on_host_a(rank) ? gdr_test::netns_pair::addr_a : gdr_test::netns_pair::addr_b;
    if (mine != expected) {
      std::fprintf(stderr, "rank %d: address hint %s, expected %s\n", rank, mine.c_str(), expected.c_str());
      return gdr_test::rank_failed;
    }
    auto all = rv.allgather(std::as_bytes(std::span(mine)));
    for (int r = 0; r < world; ++r) {
      std::string got(reinterpret_cast<const char*>(all[r].data()), all[r].size());
      if (got != (on_host_a(r) ? gdr_test::netns_pair::addr_a : gdr_test::netns_pair::addr_b))
        return gdr_test::rank_failed;
    }
    rv.barrier();
    return gdr_test::rank_ok;
  });
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
}

TEST_CASE("a mesh spans two network namespaces and every pair exchanges checksummed messages") {
  std::string why;
  auto net = gdr_test::netns_pair::create(why);
  if (!net) GDR_SKIP(why);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
    if (!gdr_test::netns_pair::enter(on_host_a(rank) ? net->name_a() : net->name_b())) return gdr_test::rank_failed;
    bs::tcp_rendezvous rv = join(rank);
    gdr::scheduler sched;
    int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      bs::mesh m = co_await bs::connect_mesh(sched, rv);
      // Ranks on the other host are reached through the veth pair; ranks
      // in this namespace by shared memory (one node, one network
      // namespace: an abstract socket name reaches them).
      int wrong = 0;
      for (int p = 0; p < world; ++p) {
        if (p == rank) continue;
        // "10.0.0.1:41234" (TCP: the peer's address as the endpoint names
        // it) or "pid 4242 (shared memory)".
        const std::string name = m.peer(p).peer_name();
        const bool here = on_host_a(p) == on_host_a(rank);
        const bool ok = here ? name.find("(shared memory)") != std::string::npos
                             : name.substr(0, name.rfind(':')) ==
                                   (on_host_a(p) ? gdr_test::netns_pair::addr_a : gdr_test::netns_pair::addr_b);
        if (!ok) {
          std::fprintf(stderr, "rank %d: peer %d is at %s\n", rank, p, name.c_str());
          ++wrong;
        }
      }
      wrong += co_await gdr_test::exchange_with_all(m);
      rv.barrier();
      co_await m.close();
      co_return wrong;
    }());
    sched.drain();
    return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
  });
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
}
