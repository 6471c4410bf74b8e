// The MPI bootstrap under a real launcher: runs `mpirun -np 4` on the rank
// program tests/bootstrap/mpi_rank.cpp and on examples/mpi_ring.cpp (data
// dependencies) and checks that every rank reports success. Skips, saying
// why, when mpirun cannot run here.
//
// As root, Open MPI refuses to start without --allow-run-as-root; ranks are
// oversubscribed (4 ranks on a 2-core machine). Open MPI 4.1 from Debian needs
// no OMPI_MCA_* settings offline here (shared memory and TCP BTLs on one host).
//
// Under ASan or TSan, 4 oversubscribed ranks spend 30-60 s in Open MPI's own
// start-up (measured with a plain C MPI_Init/MPI_Finalize program too; 2 ranks
// take 1 s), so sanitized builds run 2 ranks. Open MPI's libraries are not
// instrumented; TSan reports about their internal locking are suppressed, and
// ASan's leak check is off for the ranks (Open MPI leaks at finalization).
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/bootstrap/multiprocess.hpp"
#include "tests/support/skip.hpp"

using namespace std::chrono_literals;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define GDR_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define GDR_TEST_SANITIZED 1
#endif
#endif
#ifndef GDR_TEST_SANITIZED
#define GDR_TEST_SANITIZED 0
#endif

namespace {

constexpr int ranks = GDR_TEST_SANITIZED ? 2 : 4;

// Sanitizer settings for the ranks (see the file comment).
std::vector<std::string> sanitizer_env() {
  std::vector<std::string> env;
  if (const char* asan = std::getenv("ASAN_OPTIONS")) env.push_back(std::string("ASAN_OPTIONS=") + asan + ":detect_leaks=0");
  if (const char* tsan = std::getenv("TSAN_OPTIONS")) {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string supp = std::string(tmp ? tmp : "/tmp") + "/gdr-openmpi-" + std::to_string(::getpid()) + ".supp";
    if (FILE* f = std::fopen(supp.c_str(), "w")) {
      std::fputs("race:libmpi.so\nrace:libopen-pal.so\nrace:libopen-rte.so\nrace:mca_\n"
                 "deadlock:libmpi.so\ndeadlock:libopen-pal.so\ndeadlock:mca_\n",
                 f);
      std::fclose(f);
      env.push_back(std::string("TSAN_OPTIONS=") + tsan + ":suppressions=" + supp);
    }
  }
  return env;
}

// A program to launch: `override` from the environment, else Bazel's runfiles.
std::string program_path(const char* override, const char* path) {
  if (const char* p = std::getenv(override)) return p;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || ws == nullptr) return {};
  return std::string(srcdir) + "/" + ws + "/" + path;
}

std::vector<std::string> mpirun(int np, const std::string& program) {
  std::vector<std::string> argv = {"mpirun", "-np", std::to_string(np), "--oversubscribe"};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  argv.push_back(program);
  return argv;
}

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("MPI ranks started by mpirun allgather through the MPI bootstrap and exchange messages over a TCP mesh") {
  auto version = gdr_test::run_command({"mpirun", "--version"}, 30s);
  if (version.exit_code != 0) GDR_SKIP("mpirun cannot run here: " + version.output);
  const std::string program = program_path("GDR_MPI_RANK_BINARY", "tests/bootstrap/mpi_rank");
  REQUIRE_MESSAGE(!program.empty(), "set GDR_MPI_RANK_BINARY or run under bazel test");
  REQUIRE(::access(program.c_str(), X_OK) == 0);
  auto r = gdr_test::run_command(mpirun(ranks, program), 120s, sanitizer_env());
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(count(r.output, ": ok") == ranks);
  for (int rank = 0; rank < ranks; ++rank)
    CHECK(r.output.find("mpi rank " + std::to_string(rank) + " of " + std::to_string(ranks) + ": ok") !=
          std::string::npos);
}

TEST_CASE("the mpi_ring example runs to the end under mpirun") {
  auto version = gdr_test::run_command({"mpirun", "--version"}, 30s);
  if (version.exit_code != 0) GDR_SKIP("mpirun cannot run here: " + version.output);
  const std::string program = program_path("GDR_MPI_RING_BINARY", "examples/mpi_ring");
  REQUIRE_MESSAGE(!program.empty(), "set GDR_MPI_RING_BINARY or run under bazel test");
  REQUIRE(::access(program.c_str(), X_OK) == 0);
  auto r = gdr_test::run_command(mpirun(ranks, program), 120s, sanitizer_env());
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("mpi_ring: " + std::to_string(ranks) + " ranks") != std::string::npos);
  CHECK(r.output.find(": ok") != std::string::npos);
}
