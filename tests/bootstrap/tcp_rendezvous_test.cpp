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
#include <thread>
#include <vector>

#include <gdr/bootstrap/tcp_rendezvous.hpp>

#include "tests/bootstrap/multiprocess.hpp"

using namespace std::chrono_literals;
namespace bs = gdr::bootstrap;
using gdr_test::rank_bootstrap_failed;
using gdr_test::rank_ok;

namespace {

bs::tcp_rendezvous_config config(int rank, int world, std::uint16_t port, int listen_fd,
                                 std::chrono::milliseconds timeout = 10s, std::string job = {}) {
  bs::tcp_rendezvous_config c;
  c.job_id = std::move(job);
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
      // Rank 0 names the missing rank, and tells rank 1, which names it too.
      if (std::strstr(e.what(), "missing: 2") == nullptr) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        return gdr_test::rank_failed;
      }
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
    try {
      bs::tcp_rendezvous rv(config(rank, rank == 0 ? 2 : 3, port, lfd, 5s));
      rv.barrier();
    } catch (const gdr::error& e) {
      // Both say why: rank 0 tells rank 1.
      if (std::strstr(e.what(), "rank 1 says the world has 3 ranks, rank 0 says 2") != nullptr) throw;
      std::fprintf(stderr, "rank %d: unexpected: %s\n", rank, e.what());
      return gdr_test::rank_failed;
    }
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
  ::setenv("GDR_JOB_ID", "run-17", 1);
  auto c = bs::tcp_rendezvous_config::from_env();
  REQUIRE(c.has_value());
  CHECK(c->root_host == "10.1.2.3");
  CHECK(c->root_port == 4567);
  CHECK(c->rank == 2);
  CHECK(c->world_size == 5);
  CHECK(c->timeout == 1500ms);
  CHECK(c->job_id == "run-17");
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
  for (const char* v : {"GDR_ROOT", "GDR_BOOTSTRAP_TIMEOUT_MS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "GDR_JOB_ID"})
    ::unsetenv(v);
}

TEST_CASE("the job id comes from GDR_JOB_ID, else from the launcher") {
  for (const char* v : {"GDR_JOB_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"})
    ::unsetenv(v);
  CHECK(bs::tcp_rendezvous_config::job_id_from_env().empty());
  ::setenv("PMIX_NAMESPACE", "ns7", 1);
  CHECK(bs::tcp_rendezvous_config::job_id_from_env() == "pmix:ns7");
  ::setenv("OMPI_MCA_ess_base_jobid", "1645412353", 1);
  CHECK(bs::tcp_rendezvous_config::job_id_from_env() == "ompi:1645412353");
  ::setenv("SLURM_JOB_ID", "4242", 1);
  CHECK(bs::tcp_rendezvous_config::job_id_from_env() == "slurm:4242");
  ::setenv("SLURM_STEP_ID", "3", 1);
  CHECK(bs::tcp_rendezvous_config::job_id_from_env() == "slurm:4242.3");
  ::setenv("GDR_JOB_ID", "mine", 1);
  CHECK(bs::tcp_rendezvous_config::job_id_from_env() == "mine");
  for (const char* v : {"GDR_JOB_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"})
    ::unsetenv(v);
  const std::string a = bs::tcp_rendezvous_config::new_job_id(), b = bs::tcp_rendezvous_config::new_job_id();
  CHECK(a.size() == 16);
  CHECK(a != b);
  CHECK_THROWS_AS(bs::tcp_rendezvous(config(0, 1, 0, -1, 1s, std::string(300, 'x'))), gdr::error);
}

TEST_CASE("a stale process of an earlier job is refused with a clear error and the new job forms") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int stale_same_world = 10, stale_other_world = 11;
  // World of 2, job "new". Two processes of job "old" (one that also has
  // another world size) reach the root before the real rank 1 does.
  auto t0 = std::chrono::steady_clock::now();
  auto codes = gdr_test::run_ranks({0, 1, stale_same_world, stale_other_world}, 30s, [&](int who) {
    if (who >= stale_same_world) {
      try {
        bs::tcp_rendezvous rv(config(1, who == stale_same_world ? 2 : 5, port, lfd, 5s, "old"));
        rv.barrier();
      } catch (const gdr::error& e) {
        const bool clear = std::strstr(e.what(), "job 'new'") != nullptr && std::strstr(e.what(), "job 'old'") != nullptr;
        if (e.code() == gdr::errc::bootstrap_failed && clear) return rank_bootstrap_failed;
        std::fprintf(stderr, "stale process: unexpected: %s\n", e.what());
      }
      return gdr_test::rank_failed;
    }
    if (who == 1) std::this_thread::sleep_for(400ms);  // the stale ones knock first
    bs::tcp_rendezvous rv(config(who, 2, port, lfd, 5s, "new"));
    RANK_CHECK(rv.job_id() == "new");
    auto all = rv.allgather(contribution(who, 1));
    RANK_CHECK(all[0] == contribution(0, 1) && all[1] == contribution(1, 1));
    rv.barrier();
    return rank_ok;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{rank_ok, rank_ok, rank_bootstrap_failed, rank_bootstrap_failed});
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
}

TEST_CASE("silent connections to the root's port do not hold up the ranks") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  // Four clients that connect and never say anything, before any rank. The
  // root gives each 5 s of its own to say hello; one at a time they would
  // use up the 3 s deadline.
  std::vector<int> silent;
  for (int i = 0; i < 4; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    silent.push_back(fd);
  }
  auto t0 = std::chrono::steady_clock::now();
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(3), 30s, [&](int rank) {
    bs::tcp_rendezvous rv(config(rank, 3, port, lfd, 3s));
    rv.barrier();
    return rank_ok;
  });
  auto took = std::chrono::steady_clock::now() - t0;
  for (int fd : silent) ::close(fd);
  ::close(lfd);
  CHECK(codes == std::vector<int>(3, rank_ok));
  CHECK(took < 2s);
}

TEST_CASE("a rank that does not contribute is named, with the step, on every rank") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(4), 30s, [&](int rank) {
    bs::tcp_rendezvous rv(config(rank, 4, port, lfd, 1s));
    rv.barrier();
    if (rank == 2) {  // alive, but never enters the step
      std::this_thread::sleep_for(4s);
      return rank_ok;
    }
    try {
      (void)rv.allgather(contribution(rank, 2), "the exchange of step 7");
    } catch (const gdr::error& e) {
      const bool names_it = std::strstr(e.what(), "rank 2 did not contribute to the exchange of step 7") != nullptr;
      if (e.code() == gdr::errc::bootstrap_failed && names_it) return rank_bootstrap_failed;
      std::fprintf(stderr, "rank %d: unexpected: %s\n", rank, e.what());
    }
    return gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{rank_bootstrap_failed, rank_bootstrap_failed, rank_ok, rank_bootstrap_failed});
}

TEST_CASE("a rank that exits during a collective is named on every rank") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(3), 30s, [&](int rank) {
    bs::tcp_rendezvous rv(config(rank, 3, port, lfd, 5s));
    if (rank == 1) return rank_ok;  // leaves
    try {
      rv.barrier("the final barrier");
    } catch (const gdr::error& e) {
      if (std::strstr(e.what(), "rank 1 left during the final barrier") != nullptr) return rank_bootstrap_failed;
      std::fprintf(stderr, "rank %d: unexpected: %s\n", rank, e.what());
    }
    return gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{rank_bootstrap_failed, rank_ok, rank_bootstrap_failed});
}

TEST_CASE("a rank outside the world is an invalid argument") {
  try {
    bs::tcp_rendezvous rv(config(4, 4, 1, -1));
    FAIL("constructed");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::invalid_argument);
  }
}
