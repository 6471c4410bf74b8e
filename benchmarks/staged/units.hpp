// Byte units and their printing, shared by the staged path's hand-written
// baselines (copy_rates, raw_pipeline). Plain C++, no gdr. Included as
// "benchmarks/staged/units.hpp" (the repository root is on the include path).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace staged_bench {

constexpr std::uint64_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;

/// `n` bytes in the largest binary unit that divides it ("4 MiB", "4095 B").
inline std::string human(std::uint64_t n) {
  char b[64];
  if (n >= GiB && n % GiB == 0) std::snprintf(b, sizeof b, "%llu GiB", static_cast<unsigned long long>(n / GiB));
  else if (n >= MiB && n % MiB == 0) std::snprintf(b, sizeof b, "%llu MiB", static_cast<unsigned long long>(n / MiB));
  else if (n >= KiB && n % KiB == 0) std::snprintf(b, sizeof b, "%llu KiB", static_cast<unsigned long long>(n / KiB));
  else std::snprintf(b, sizeof b, "%llu B", static_cast<unsigned long long>(n));
  return b;
}

}  // namespace staged_bench
