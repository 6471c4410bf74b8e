// One rank of tests/bootstrap:mpi_test, started by mpirun: the MPI bootstrap
// (rank, size, allgather of contributions of different sizes, barrier), then
// a TCP mesh built through it, over which every pair exchanges checksummed
// messages. Prints "mpi rank R of N: ok" and exits 0, or says what failed
// and exits 1.
#include <cstdio>
#include <exception>
#include <vector>

#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/mpi.hpp>
#include <gdr/coro/sync_wait.hpp>

#include "tests/bootstrap/exchange.hpp"

namespace {

std::vector<std::byte> contribution(int r, int k) {
  std::vector<std::byte> v(static_cast<std::size_t>((r * 13 + k * 5) % 300));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::byte>(r + 3 * k + static_cast<int>(i));
  return v;
}

int run() {
  gdr::bootstrap::mpi_rendezvous rv;
  const int rank = rv.rank(), size = rv.size();
  for (int k = 0; k < 10; ++k) {
    auto all = rv.allgather(contribution(rank, k));
    if (all.size() != static_cast<std::size_t>(size)) return 1;
    for (int r = 0; r < size; ++r)
      if (all[static_cast<std::size_t>(r)] != contribution(r, k)) {
        std::fprintf(stderr, "mpi rank %d: wrong contribution of rank %d in round %d\n", rank, r, k);
        return 1;
      }
    rv.barrier();
  }
  gdr::scheduler sched;
  int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
    gdr::bootstrap::mesh m = co_await gdr::bootstrap::connect_mesh(sched, rv);
    int wrong = co_await gdr_test::exchange_with_all(m);
    rv.barrier();  // nobody closes while a peer still receives
    co_await m.close();
    co_return wrong;
  }());
  sched.drain();
  if (bad != 0) return 1;
  std::printf("mpi rank %d of %d: ok\n", rank, size);
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi rank: %s\n", e.what());
    return 1;
  }
}
