// Helpers for tests/cuda: the reason to skip on this machine, random data,
// and a copy long enough to keep a stream busy for a while.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include <gdr/cuda/device.hpp>

namespace gdr_test {

/// Empty when a GPU can be used here; otherwise the probe's reason.
inline std::string no_gpu_reason() { return gdr::cuda::probe_devices().reason; }

/// Random values that are never zero.
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

}  // namespace gdr_test

#include <gdr/cuda/stream.hpp>
#include <gdr/memory/buffer.hpp>

namespace gdr_test {

/// Device-to-device copies that keep a stream busy for a while (about
/// 0.25 ms per repetition on an H200: 256 MiB each way at ~2 TB/s), so a
/// test can observe an event that is not ready yet.
struct busy_work {
  static constexpr std::size_t bytes = std::size_t{256} << 20;
  gdr::buffer<char, gdr::Device> a{bytes};
  gdr::buffer<char, gdr::Device> b{bytes};
  void queue(const gdr::cuda::stream& s, int reps) {
    for (int i = 0; i < reps; ++i) {
      cudaError_t e = cudaMemcpyAsync(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), bytes,
                                      cudaMemcpyDeviceToDevice, s.get());
      if (e != cudaSuccess) throw gdr::error(gdr::cuda::make_error_code(e), "busy_work");
    }
  }
};

}  // namespace gdr_test
