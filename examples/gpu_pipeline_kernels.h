// The kernels of examples/gpu_pipeline.cpp, as plain C++ functions: they are
// compiled by nvcc (gpu_pipeline_kernels.cu) and called from code built by
// the host compiler. Each queues one kernel on stream `s` and returns at once,
// with the launch's error (cudaSuccess when it was queued).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

/// Fills `n` words at `p` (GPU memory) with the pattern of message `seed`.
cudaError_t launch_fill(std::uint32_t* p, std::size_t n, std::uint32_t seed, cudaStream_t s);

/// Compares `n` words at `p` (GPU memory) with the pattern of message `seed`
/// and adds the number of words that differ to `*errors` (GPU memory).
cudaError_t launch_check(const std::uint32_t* p, std::size_t n, std::uint32_t seed, unsigned long long* errors,
                         cudaStream_t s);
