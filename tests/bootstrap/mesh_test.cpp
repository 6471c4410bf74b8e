// gdr/bootstrap/mesh.hpp: ranks in forked processes on 127.0.0.1 build a
// mesh (shared memory between them, since they share a node; TCP when told
// so) through the TCP rendezvous and exchange checksummed messages; a
// rank that fails is named, with the step, by every other rank.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/tcp_rendezvous.hpp>
#include <gdr/coro/sync_wait.hpp>

#include "tests/bootstrap/exchange.hpp"
#include "tests/bootstrap/multiprocess.hpp"

using namespace std::chrono_literals;
namespace bs = gdr::bootstrap;

namespace {

bs::tcp_rendezvous join(int rank, int world, std::uint16_t port, int listen_fd, std::chrono::milliseconds timeout = 20s) {
  bs::tcp_rendezvous_config c;
  c.root_port = port;
  c.rank = rank;
  c.world_size = world;
  c.timeout = timeout;
  c.listen_fd = rank == 0 ? listen_fd : -1;
  if (rank != 0) ::close(listen_fd);
  return bs::tcp_rendezvous(c);
}

bs::mesh_options short_timeouts(std::chrono::milliseconds t) {
  bs::mesh_options o;
  o.timeout = t;
  return o;
}

// Builds the mesh, which must fail with bootstrap_failed and a message that
// holds every one of `says`.
gdr_test::rank_exit fails_naming(gdr::scheduler& sched, bs::tcp_rendezvous& rv, const bs::mesh_options& o,
                 std::initializer_list<const char*> says) {
  try {
    gdr::sync_wait(sched, bs::connect_mesh(sched, rv, o));
  } catch (const gdr::error& e) {
    bool all = e.code() == gdr::errc::bootstrap_failed;
    for (const char* s : says) all = all && std::strstr(e.what(), s) != nullptr;
    if (all) return gdr_test::rank_bootstrap_failed;
    std::fprintf(stderr, "rank %d: unexpected: %s\n", rv.rank(), e.what());
    return gdr_test::rank_failed;
  }
  std::fprintf(stderr, "rank %d: the mesh was built\n", rv.rank());
  return gdr_test::rank_failed;
}

}  // namespace

TEST_CASE("four ranks build a mesh and every pair exchanges checksummed messages both ways") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int world = 4;
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, world, port, lfd);
    gdr::scheduler sched;
    int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      bs::mesh m = co_await bs::connect_mesh(sched, rv);
      co_return co_await gdr_test::check_mesh(m, rv, rank, world);
    }());
    sched.drain();
    return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
}

TEST_CASE("ranks of one node are joined by shared memory, or by TCP when the options say so") {
  for (bool shm : {true, false}) {
    CAPTURE(shm);
    std::uint16_t port = 0;
    int lfd = gdr_test::listen_loopback(port);
    REQUIRE(lfd >= 0);
    constexpr int world = 3;
    auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
      bs::tcp_rendezvous rv = join(rank, world, port, lfd);
      gdr::scheduler sched;
      bs::mesh_options o;
      if (!shm) o.same_node = bs::same_node_transport::tcp;
      int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
        bs::mesh m = co_await bs::connect_mesh(sched, rv, o);
        int wrong = 0;
        for (int p = 0; p < world; ++p) {
          if (p == rank) continue;
          // "pid N (shared memory)" or "127.0.0.1:port"
          const bool via_shm = m.peer(p).peer_name().find("shared memory") != std::string::npos;
          if (via_shm != shm) {
            std::fprintf(stderr, "rank %d: peer %d is %s\n", rank, p, m.peer(p).peer_name().c_str());
            ++wrong;
          }
        }
        wrong += co_await gdr_test::check_mesh(m, rv, rank, world);
        co_return wrong;
      }());
      sched.drain();
      return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
    });
    ::close(lfd);
    CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
  }
}

TEST_CASE("a mesh of one rank has no peers") {
  bs::tcp_rendezvous_config c;
  c.rank = 0;
  c.world_size = 1;
  bs::tcp_rendezvous rv(c);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    bs::mesh m = co_await bs::connect_mesh(sched, rv);
    CHECK(m.size() == 1);
    CHECK(!m.peer(0).is_open());
    co_await m.close();
  }());
}

TEST_CASE("a rank that leaves before the mesh makes every other rank fail within the timeout, naming it") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto t0 = std::chrono::steady_clock::now();
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(3), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 3, port, lfd, 3s);
    if (rank == 2) return gdr_test::rank_ok;  // joins the rendezvous, never the mesh
    gdr::scheduler sched;
    return fails_naming(sched, rv, short_timeouts(3s), {"rank 2 left during connect_mesh step 1 (introductions)"});
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{gdr_test::rank_bootstrap_failed, gdr_test::rank_bootstrap_failed, gdr_test::rank_ok});
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
}

TEST_CASE("a rank that stays but never builds the mesh is named, with the step, by every other rank") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(4), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 4, port, lfd, 1500ms);
    if (rank == 2) {  // alive, silent
      std::this_thread::sleep_for(5s);
      return gdr_test::rank_ok;
    }
    gdr::scheduler sched;
    return fails_naming(sched, rv, short_timeouts(1500ms),
                        {"step 1 (introductions)", "rank 2 did not contribute to connect_mesh step 1 (introductions)"});
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{gdr_test::rank_bootstrap_failed, gdr_test::rank_bootstrap_failed, gdr_test::rank_ok,
                                  gdr_test::rank_bootstrap_failed});
}

TEST_CASE("a rank that publishes an address but never connects nor accepts is named in step 3 by every other rank") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto t0 = std::chrono::steady_clock::now();
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(4), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 4, port, lfd, 10s);
    if (rank == 2) {
      // Takes part in the collectives as a mesh rank would, but its
      // published port is a socket nobody accepts on.
      std::uint16_t dead_port = 0;
      int dead = gdr_test::listen_loopback(dead_port);
      std::vector<std::byte> intro(8, std::byte{1});
      (void)rv.allgather(intro);
      const std::string where = "127.0.0.1:" + std::to_string(dead_port);
      (void)rv.allgather(std::as_bytes(std::span(where)));
      auto outcomes = rv.allgather({});
      ::close(dead);
      return outcomes.size() == 4 ? gdr_test::rank_ok : gdr_test::rank_failed;
    }
    gdr::scheduler sched;
    // The lower ranks cannot greet it; the higher one waits for it to connect.
    const char* says = rank < 2 ? "step 3 (connections): within 1500 ms, rank 2 did not answer"
                                : "step 3 (connections): within 1500 ms, rank 2 did not connect";
    return fails_naming(sched, rv, short_timeouts(1500ms), {says});
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{gdr_test::rank_bootstrap_failed, gdr_test::rank_bootstrap_failed, gdr_test::rank_ok,
                                  gdr_test::rank_bootstrap_failed});
  CHECK(std::chrono::steady_clock::now() - t0 < 20s);
}

TEST_CASE("twelve ranks build a mesh with at most two connections of each under way") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int world = 12;
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, world, port, lfd);
    gdr::scheduler sched;
    bs::mesh_options o;
    o.max_connects_in_flight = 2;
    int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      bs::mesh m = co_await bs::connect_mesh(sched, rv, o);
      co_return co_await gdr_test::check_mesh(m, rv, rank, world);
    }());
    sched.drain();
    return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
}

TEST_CASE("a rank that cannot listen makes every rank fail with its reason") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(3), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 3, port, lfd, 5s);
    gdr::scheduler sched;
    bs::mesh_options o = short_timeouts(5s);
    if (rank == 1) o.listen_host = "not-an-address";
    try {
      gdr::sync_wait(sched, bs::connect_mesh(sched, rv, o));
    } catch (const gdr::error& e) {
      // Every rank names rank 1 (rank 1 names its address).
      const bool names_it = std::strstr(e.what(), rank == 1 ? "not-an-address" : "rank 1") != nullptr;
      if (e.code() == gdr::errc::bootstrap_failed && names_it) return gdr_test::rank_bootstrap_failed;
      std::fprintf(stderr, "rank %d: unexpected: %s\n", rank, e.what());
      return gdr_test::rank_failed;
    }
    return gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(3, gdr_test::rank_bootstrap_failed));
}

namespace {

// TCP, but every connect fails with a gdr::error whose words say more than
// its code (as a verbs connect names its rdma_cm step).
struct wordy_net : bs::detail::tcp_net {
  gdr::task<gdr::result<gdr::tcp::endpoint>> connect(const std::string&, std::chrono::milliseconds) {
    throw gdr::error(gdr::errc::invalid_argument, "the transport's own words");
    co_return gdr::errc::invalid_argument;
  }
};

}  // namespace

TEST_CASE("a connection that fails with a transport's words fails step 3 with those words") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(2), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 2, port, lfd, 10s);
    gdr::scheduler sched;
    bs::mesh_options o = short_timeouts(2s);
    wordy_net net{{&sched, &o}};
    bs::detail::mesh_limits lim;
    lim.timeout = o.timeout;
    try {
      gdr::sync_wait(sched, bs::detail::build_mesh(rv, "127.0.0.1", lim, net));
    } catch (const gdr::error& e) {
      // Rank 0 connects to rank 1 and says what the transport said (before:
      // only the code's message, "invalid argument"); rank 1 names rank 0.
      const bool ok = rank == 0 ? std::strstr(e.what(), "step 3 (connections): connecting to rank 1 at 127.0.0.1:") &&
                                      std::strstr(e.what(), "the transport's own words")
                                : std::strstr(e.what(), "rank 0") != nullptr;
      if (e.code() == gdr::errc::bootstrap_failed && ok) return gdr_test::rank_bootstrap_failed;
      std::fprintf(stderr, "rank %d: unexpected: %s\n", rank, e.what());
      return gdr_test::rank_failed;
    }
    return gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(2, gdr_test::rank_bootstrap_failed));
}
