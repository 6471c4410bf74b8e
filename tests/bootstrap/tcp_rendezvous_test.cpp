// gdr/bootstrap/tcp_rendezvous.hpp: ranks in forked processes on 127.0.0.1.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gdr/bootstrap/tcp_rendezvous.hpp>

#include "tests/bootstrap/multiprocess.hpp"

using namespace std::chrono_literals;
namespace bs = gdr::bootstrap;
using gdr_test::rank_bootstrap_failed;
using gdr_test::rank_ok;

namespace {

bs::tcp_rendezvous_config config(int rank, int world, std::uint16_t port, int listen_fd,
                                 std::chrono::milliseconds timeout = 10s) {
  bs::tcp_rendezvous_config c;
  c.root_host = "127.0.0.1";
  c.root_port = port;
  c.rank = rank;
  c.world_size = world;
  c.timeout = timeout;
  c.listen_fd = rank == 0 ? listen_fd : -1;
  if (rank != 0 && listen_fd >= 0) ::close(listen_fd);  // only rank 0 listens
  return c;
}

// Rank r's contribution to round k: (r + k) * 37 bytes, each a function of (r, k, i).
std::vector<std::byte> contribution(int r, int k) {
  std::vector<std::byte> v(static_cast<std::size_t>((r + k) * 37 % 500));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::byte>(r * 31 + k * 7 + static_cast<int>(i));
  return v;
}

#define RANK_CHECK(cond)                                                                          \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      std::fprintf(stderr, "rank check failed at %s:%d: %s\n", __FILE__, __LINE__, #cond);       \
      return gdr_test::rank_failed;                                                               \
    }                                                                                             \
  } while (0)

}  // namespace

TEST_CASE("four ranks in four processes allgather contributions of different sizes and pass barriers") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int world = 4;
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 60s, [&](int rank) {
    bs::tcp_rendezvous rv(config(rank, world, port, lfd));
    RANK_CHECK(rv.rank() == rank);
    RANK_CHECK(rv.size() == world);
    RANK_CHECK(rv.address_hint() == "127.0.0.1");
    for (int k = 0; k < 20; ++k) {
      auto mine = contribution(rank, k);
      auto all = rv.allgather(mine);
      RANK_CHECK(all.size() == static_cast<std::size_t>(world));
      for (int r = 0; r < world; ++r) RANK_CHECK(all[static_cast<std::size_t>(r)] == contribution(r, k));
      if (k % 5 == 0) rv.barrier();
    }
    return rank_ok;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(world, rank_ok));
}

TEST_CASE("a world of one needs no connections") {
  bs::tcp_rendezvous rv(config(0, 1, 0, -1));
  std::vector<std::byte> mine(3, std::byte{7});
  auto all = rv.allgather(mine);
  REQUIRE(all.size() == 1);
  CHECK(all[0] == mine);
  rv.barrier();
  CHECK(rv.port() != 0);  // bound port 0: the kernel picked one
}

TEST_CASE("rank 0 binds the configured port itself when no socket is handed in") {
  std::uint16_t port = 0;
  int probe = gdr_test::listen_loopback(port);  // find a free port, then free it
  REQUIRE(probe >= 0);
  ::close(probe);
  auto codes = gdr_test::run_ranks({0, 1}, 30s, [&](int rank) {
    bs::tcp_rendezvous rv(config(rank, 2, port, -1));
    rv.barrier();
    return rv.port() == port ? rank_ok : gdr_test::rank_failed;
  });
  CHECK(codes == std::vector<int>{rank_ok, rank_ok});
}

TEST_CASE("a rank that never shows up makes rank 0 fail within the timeout, naming it") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto t0 = std::chrono::steady_clock::now();
  // World of 3, but rank 2 is never started.
  auto codes = gdr_test::run_ranks({0, 1}, 30s, [&](int rank) {
    try {
      bs::tcp_rendezvous rv(config(rank, 3, port, lfd, 500ms));
      rv.barrier();
    } catch (const gdr::error& e) {
      if (e.code() != gdr::errc::bootstrap_failed) throw;
      // Rank 0 names the missing rank; rank 1 learns that the root went away.
      if (rank == 0 && std::strstr(e.what(), "missing: 2") == nullptr) return gdr_test::rank_failed;
      return rank_bootstrap_failed;
    }
    return rank_ok;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{rank_bootstrap_failed, rank_bootstrap_failed});
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
}

TEST_CASE("a rank whose root never listens fails with bootstrap_failed after its timeout") {
  std::uint16_t port = 0;
  int probe = gdr_test::listen_loopback(port);
  REQUIRE(probe >= 0);
  ::close(probe);  // nothing listens there now
  auto t0 = std::chrono::steady_clock::now();
  try {
    bs::tcp_rendezvous rv(config(1, 2, port, -1, 300ms));
    FAIL("joined a job without a root");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::bootstrap_failed);
    CHECK(std::string(e.what()).find("connecting to the root") != std::string::npos);
  }
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 250ms);
  CHECK(took < 5s);
}

TEST_CASE("a rank that dies after joining makes the next collective fail on every other rank") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(3), 30s, [&](int rank) {
    bs::tcp_rendezvous rv(config(rank, 3, port, lfd, 5s));
    rv.barrier();
    if (rank == 2) return rank_ok;  // exits without the second barrier
    rv.barrier();
    return gdr_test::rank_failed;  // must not get here
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{rank_bootstrap_failed, rank_bootstrap_failed, rank_ok});
}

TEST_CASE("ranks that disagree on the world size fail at once") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks({0, 1}, 30s, [&](int rank) {
    bs::tcp_rendezvous rv(config(rank, rank == 0 ? 2 : 3, port, lfd, 5s));
    rv.barrier();
    return rank_ok;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{rank_bootstrap_failed, rank_bootstrap_failed});
}

TEST_CASE("a foreign connection to the root's port is dropped and the job still forms") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  // A client that is not a gdr rank, connected before anybody else.
  int stray = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(stray, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  const char junk[] = "GET / HTTP/1.0\r\n\r\n";
  REQUIRE(::send(stray, junk, sizeof junk, 0) > 0);
  auto codes = gdr_test::run_ranks({0, 1}, 30s, [&](int rank) {
    bs::tcp_rendezvous rv(config(rank, 2, port, lfd, 5s));
    rv.barrier();
    return rank_ok;
  });
  ::close(stray);
  ::close(lfd);
  CHECK(codes == std::vector<int>{rank_ok, rank_ok});
}

TEST_CASE("the configuration comes from GDR_ROOT, GDR_RANK and GDR_WORLD_SIZE") {
  ::setenv("GDR_ROOT", "10.1.2.3:4567", 1);
  ::setenv("GDR_RANK", "2", 1);
  ::setenv("GDR_WORLD_SIZE", "5", 1);
  ::setenv("GDR_BOOTSTRAP_TIMEOUT_MS", "1500", 1);
  auto c = bs::tcp_rendezvous_config::from_env();
  REQUIRE(c.has_value());
  CHECK(c->root_host == "10.1.2.3");
  CHECK(c->root_port == 4567);
  CHECK(c->rank == 2);
  CHECK(c->world_size == 5);
  CHECK(c->timeout == 1500ms);
  ::setenv("GDR_ROOT", "[::1]:80", 1);
  CHECK(bs::tcp_rendezvous_config::from_env()->root_host == "::1");
  ::setenv("GDR_RANK", "5", 1);  // not below the world size
  CHECK(!bs::tcp_rendezvous_config::from_env());
  ::setenv("GDR_RANK", "x", 1);
  CHECK(!bs::tcp_rendezvous_config::from_env());
  ::setenv("GDR_RANK", "1", 1);
  ::setenv("GDR_ROOT", "no-port", 1);
  CHECK(!bs::tcp_rendezvous_config::from_env());
  ::unsetenv("GDR_ROOT");
  CHECK(!bs::tcp_rendezvous_config::from_env());
  CHECK_THROWS_AS(bs::tcp_rendezvous::from_env(), gdr::error);
  // Launchers' variables stand in for GDR_RANK / GDR_WORLD_SIZE.
  ::setenv("GDR_ROOT", "127.0.0.1:1", 1);
  ::unsetenv("GDR_RANK");
  ::unsetenv("GDR_WORLD_SIZE");
  ::setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  auto o = bs::tcp_rendezvous_config::from_env();
  REQUIRE(o.has_value());
  CHECK(o->rank == 3);
  CHECK(o->world_size == 4);
  for (const char* v : {"GDR_ROOT", "GDR_BOOTSTRAP_TIMEOUT_MS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"})
    ::unsetenv(v);
}

TEST_CASE("a rank outside the world is an invalid argument") {
  try {
    bs::tcp_rendezvous rv(config(4, 4, 1, -1));
    FAIL("constructed");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::invalid_argument);
  }
}
