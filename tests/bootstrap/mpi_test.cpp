// The MPI bootstrap under a real launcher: runs `mpirun -np 4` on the rank
// program tests/bootstrap/mpi_rank.cpp (a data dependency) and checks that
// every rank reports success. Skips, saying why, when mpirun cannot run here.
//
// As root, Open MPI refuses to start without --allow-run-as-root; ranks are
// oversubscribed (4 ranks on a 2-core machine). Open MPI 4.1 from Debian needs
// no OMPI_MCA_* settings offline here (shared memory and TCP BTLs on one host).
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/bootstrap/multiprocess.hpp"
#include "tests/support/skip.hpp"

using namespace std::chrono_literals;

namespace {

// The rank program: GDR_MPI_RANK_BINARY, else Bazel's runfiles.
std::string rank_binary(const char* name) {
  if (const char* p = std::getenv("GDR_MPI_RANK_BINARY")) return p;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || ws == nullptr) return {};
  return std::string(srcdir) + "/" + ws + "/tests/bootstrap/" + name;
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

TEST_CASE("four MPI ranks started by mpirun allgather and pass barriers through the MPI bootstrap") {
  auto version = gdr_test::run_command({"mpirun", "--version"}, 30s);
  if (version.exit_code != 0) GDR_SKIP("mpirun cannot run here: " + version.output);
  const std::string program = rank_binary("mpi_rank");
  REQUIRE_MESSAGE(!program.empty(), "set GDR_MPI_RANK_BINARY or run under bazel test");
  REQUIRE(::access(program.c_str(), X_OK) == 0);
  auto r = gdr_test::run_command(mpirun(4, program), 120s);
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(count(r.output, ": ok") == 4);
  for (int rank = 0; rank < 4; ++rank)
    CHECK(r.output.find("mpi rank " + std::to_string(rank) + " of 4: ok") != std::string::npos);
}
