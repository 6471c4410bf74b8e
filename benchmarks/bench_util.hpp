// Small helpers the single-file benchmarks share: pinning to a CPU, elapsed
// time, and the median of a set of rounds. Included as
// "benchmarks/bench_util.hpp" (the repository root is on the include path,
// with Bazel and with tools/gpu/run_gpu_tests.sh alike).
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace bench {

/// Pins the calling thread to `cpu`; says so and goes on unpinned if it cannot.
inline void pin_to_cpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) std::perror("sched_setaffinity (continuing unpinned)");
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The median of `v` (the upper one for an even count). `v` must not be empty.
inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace bench
