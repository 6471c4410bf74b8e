// The producer's and the consumer's kernels of examples/gpu_pipeline.cpp.
#include "gpu_pipeline_kernels.h"

namespace {

constexpr unsigned threads_per_block = 256;

// Word `i` of message `seed`. For a fixed `i` the mix's input differs for
// every seed, and for a fixed seed it differs for every `i` below 2^32; the
// mix is invertible. So a message checked against another message's seed
// (one in the wrong lane or order) differs in every word, and so does a
// chunk placed at the wrong offset: the check counts them word by word.
__device__ __forceinline__ std::uint32_t word(std::uint32_t seed, std::size_t i) {
  std::uint32_t x = static_cast<std::uint32_t>(i) ^ (seed * 0x9e3779b9u) ^
                    (static_cast<std::uint32_t>(i >> 32) * 0x85ebca6bu);
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__global__ void fill_kernel(std::uint32_t* p, std::size_t n, std::uint32_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = word(seed, i);
}

__global__ void check_kernel(const std::uint32_t* p, std::size_t n, std::uint32_t seed, unsigned long long* errors) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    bad += p[i] != word(seed, i) ? 1 : 0;
  if (bad != 0) atomicAdd(errors, bad);  // one atomic per thread, only when something differs
}

// Enough blocks to cover `n` words, at most 4096 (a grid-stride loop does
// the rest): plenty to fill an H200's 132 SMs.
unsigned blocks_for(std::size_t n) {
  const std::size_t b = (n + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(b < 4096 ? b : 4096);
}

}  // namespace

cudaError_t launch_fill(std::uint32_t* p, std::size_t n, std::uint32_t seed, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  fill_kernel<<<blocks_for(n), threads_per_block, 0, s>>>(p, n, seed);
  return cudaGetLastError();
}

cudaError_t launch_check(const std::uint32_t* p, std::size_t n, std::uint32_t seed, unsigned long long* errors,
                         cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  check_kernel<<<blocks_for(n), threads_per_block, 0, s>>>(p, n, seed, errors);
  return cudaGetLastError();
}
