// Helpers for tests/memory: random non-zero data, and the reason to skip a
// Device test on this machine (or none).
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include <gdr/config.hpp>
#if GDR_HAS_CUDA
#include <gdr/cuda/device.hpp>
#endif

namespace gdr_test {

/// Fills `n` elements at `p` with random values that are never zero (so a
/// copy that did nothing into zeroed memory cannot pass).
template <class T>
void fill_random(T* p, std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<std::uint32_t> d(1, 0xffff'ffffu);
  for (std::size_t i = 0; i < n; ++i) {
    T v = static_cast<T>(d(gen));
    if (v == T{}) v = T{1};
    p[i] = v;
  }
}

/// Empty when Device memory can be used here; otherwise why not.
inline std::string no_gpu_reason() {
#if GDR_HAS_CUDA
  return gdr::cuda::probe_devices().reason;
#else
  return "built without CUDA (GDR_HAS_CUDA=0): Device memory is not available to this test";
#endif
}

}  // namespace gdr_test
