// mpi_ring: ranks pass a buffer around a ring over gdr's mesh. MPI only
// starts the job and bootstraps (gdr::bootstrap::mpi_rendezvous); the bytes
// travel over the endpoints connect_mesh makes (shared memory between ranks
// of one node, TCP between nodes). Each rank adds its rank to
// every element and passes the buffer right; after the laps rank 0 checks it.
// Needs Open MPI: mpirun -np 4 ./mpi_ring (as root add --allow-run-as-root;
// add --oversubscribe when there are fewer cores than ranks).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/mpi.hpp>
#include <gdr/coro/sync_wait.hpp>

namespace {

constexpr int laps = 3;
constexpr std::size_t elements = 1 << 16;  // 512 KiB: large enough to bypass the eager buffers

gdr::task<bool> ring(gdr::scheduler& sched, gdr::bootstrap::mpi_rendezvous& rv) {
  gdr::bootstrap::mesh m = co_await gdr::bootstrap::connect_mesh(sched, rv);
  const int me = m.rank(), n = m.size();
  gdr::endpoint& left = m.peer((me + n - 1) % n);
  gdr::endpoint& right = m.peer((me + 1) % n);
  std::vector<std::uint64_t> buf(elements);
  auto view = gdr::host_view(buf);
  auto t0 = std::chrono::steady_clock::now();
  if (me == 0)
    for (std::size_t i = 0; i < elements; ++i) buf[i] = i;
  for (int lap = 0; lap < laps; ++lap) {
    if (me != 0) co_await left.recv(view);  // rank 0 starts each lap with what it has
    for (auto& x : buf) x += static_cast<std::uint64_t>(me);
    co_await right.send(view);
    if (me == 0) co_await left.recv(view);  // the lap comes back
  }
  bool ok = true;
  if (me == 0) {
    const std::uint64_t per_lap = static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(n - 1) / 2;
    for (std::size_t i = 0; i < elements; ++i) ok &= buf[i] == i + laps * per_lap;
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("mpi_ring: %d ranks, %d laps of %zu bytes in %.1f ms, path %s: %s\n", n, laps,
                view.size_bytes(), ms, gdr::to_string(right.last_path()), ok ? "ok" : "WRONG");
  }
  rv.barrier();  // nobody closes while its right neighbour still receives
  co_await m.close();
  co_return ok;
}

}  // namespace

int main() {
  try {
    gdr::bootstrap::mpi_rendezvous rv;
    if (rv.size() < 2) {
      std::printf("mpi_ring: run with at least 2 ranks (mpirun -np 4 ./mpi_ring)\n");
      return 0;
    }
    gdr::scheduler sched;
    bool ok = gdr::sync_wait(sched, ring(sched, rv));
    sched.drain();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_ring: %s\n", e.what());
    return 1;
  }
}
