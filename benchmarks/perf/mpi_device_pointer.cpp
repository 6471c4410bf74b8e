// The contrast to a transfer whose path is chosen by the buffer's type: an
// MPI_Send of a cudaMalloc pointer through an Open MPI built without CUDA
// support (the GPU machine's). Rank 0 sends `size` bytes of device memory,
// rank 1 receives them into device memory. Such an MPI treats the pointer
// as host memory; what happens (a crash, an error, wrong bytes) is what the
// run prints. gdr's Device path over shm is CUDA IPC, chosen at compile time
// from gdr::Device; over a transport without it, the staged path.
//
//   mpicxx -std=c++20 mpi_device_pointer.cpp -I$CUDA/include $CUDA/lib64/libcudart_static.a -ldl -lrt -lpthread
//   mpirun -np 2 ./a.out [size]
#include <mpi.h>

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int size = argc > 1 ? std::atoi(argv[1]) : (1 << 20);
  void* d = nullptr;
  if (cudaMalloc(&d, static_cast<std::size_t>(size)) != cudaSuccess) {
    std::printf("rank %d: no GPU memory\n", rank);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  (void)cudaMemset(d, rank == 0 ? 0x5a : 0, static_cast<std::size_t>(size));
  (void)cudaDeviceSynchronize();
  std::printf("rank %d: %s %d bytes of cudaMalloc memory at %p\n", rank, rank == 0 ? "MPI_Send" : "MPI_Recv", size, d);
  std::fflush(stdout);
  if (rank == 0) MPI_Send(d, size, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
  else MPI_Recv(d, size, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  if (rank == 1) {
    std::vector<unsigned char> h(static_cast<std::size_t>(size));
    (void)cudaMemcpy(h.data(), d, h.size(), cudaMemcpyDeviceToHost);
    std::printf("rank 1: received, first byte 0x%02x (0x5a expected)\n", h.empty() ? 0 : h[0]);
  }
  MPI_Finalize();
  return 0;
}
