// The MPI peer of gdr_perf (`--vs mpi`): the same ping-pong and window of
// messages in flight as gdr's send, over MPI_Send/MPI_Recv and
// MPI_Isend/MPI_Irecv between two ranks, host memory. gdr_perf starts it
// with mpirun (two ranks, pinned as gdr's two sides) and reads its one line:
//
//   mpi_pingpong SIZE LAT_ITERS BW_COUNT WARMUP
//   -> "mpi_pingpong lat_us=<median round trip> gbps=<bandwidth>"
// The C API only: Open MPI's C++ bindings need a library of their own.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size_ranks = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size_ranks);
  if (argc != 5 || size_ranks != 2) {
    if (rank == 0) std::fprintf(stderr, "usage: mpirun -np 2 mpi_pingpong SIZE LAT_ITERS BW_COUNT WARMUP\n");
    MPI_Finalize();
    return 2;
  }
  const std::size_t size = std::strtoull(argv[1], nullptr, 10);
  const std::size_t iters = std::strtoull(argv[2], nullptr, 10);
  const std::size_t count = std::strtoull(argv[3], nullptr, 10);
  const std::size_t warmup = std::strtoull(argv[4], nullptr, 10);
  const int peer = 1 - rank;
  const int n = static_cast<int>(size);
  std::vector<char> buf(std::max<std::size_t>(size, 1), 1);
  using clock = std::chrono::steady_clock;

  // Latency: rank 0 sends and waits for the answer.
  std::vector<double> rtt;
  for (std::size_t i = 0; i < iters + warmup; ++i) {
    if (rank == 0) {
      auto t0 = clock::now();
      MPI_Send(buf.data(), n, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
      MPI_Recv(buf.data(), n, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      if (i >= warmup) rtt.push_back(std::chrono::duration<double, std::micro>(clock::now() - t0).count());
    } else {
      MPI_Recv(buf.data(), n, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Send(buf.data(), n, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
    }
  }

  // Bandwidth: a window of messages in flight (as gdr_perf's), one ack.
  const std::size_t depth = std::clamp<std::size_t>((4u << 20) / (size + 1), 2, 64);
  std::vector<MPI_Request> reqs(depth);
  MPI_Barrier(MPI_COMM_WORLD);
  auto t0 = clock::now();
  for (std::size_t done = 0; done < count;) {
    std::size_t k = std::min(depth, count - done);
    for (std::size_t j = 0; j < k; ++j) {
      if (rank == 0) MPI_Isend(buf.data(), n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, &reqs[j]);
      else MPI_Irecv(buf.data(), n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, &reqs[j]);
    }
    MPI_Waitall(static_cast<int>(k), reqs.data(), MPI_STATUSES_IGNORE);
    done += k;
  }
  char ack = 0;
  if (rank == 0) MPI_Recv(&ack, 1, MPI_BYTE, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  else MPI_Send(&ack, 1, MPI_BYTE, peer, 2, MPI_COMM_WORLD);
  double us = std::chrono::duration<double, std::micro>(clock::now() - t0).count();

  if (rank == 0) {
    std::nth_element(rtt.begin(), rtt.begin() + rtt.size() / 2, rtt.end());
    std::printf("mpi_pingpong lat_us=%g gbps=%g\n", rtt.empty() ? 0.0 : rtt[rtt.size() / 2],
                static_cast<double>(size * count) / (us * 1e3));
  }
  MPI_Finalize();
  return 0;
}
