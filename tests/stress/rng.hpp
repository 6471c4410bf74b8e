// The stress test's only source of randomness: a xoshiro256** generator
// seeded through splitmix64, owned by whoever draws from it. Nothing global,
// nothing read from the clock: a seed and the order of the draws decide
// every choice, so one seed always plans the same run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace stress {

/// splitmix64: mixes one 64-bit value into another (seeding, hashing).
constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// A hash of several values, order-sensitive (payload and fill patterns).
constexpr std::uint64_t hash_of(std::initializer_list<std::uint64_t> vs) noexcept {
  std::uint64_t h = 0x6a09e667f3bcc909ull;
  for (std::uint64_t v : vs) h = mix64(h ^ v);
  return h;
}

class rng {
 public:
  explicit rng(std::uint64_t seed) noexcept {
    std::uint64_t x = seed;
    for (auto& w : s_) w = mix64(x += 0x9e3779b97f4a7c15ull);
  }

  std::uint64_t next() noexcept {
    const std::uint64_t r = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return r;
  }
  /// Uniform in [0, n) (n > 0; the bias of the modulo is irrelevant here).
  std::uint64_t below(std::uint64_t n) noexcept { return next() % n; }
  /// Uniform in [lo, hi].
  std::uint64_t between(std::uint64_t lo, std::uint64_t hi) noexcept { return lo + below(hi - lo + 1); }
  /// True with probability `percent` / 100.
  bool chance(unsigned percent) noexcept { return below(100) < percent; }
  template <class T>
  T pick(std::initializer_list<T> xs) noexcept {
    return xs.begin()[below(xs.size())];
  }
  /// A generator of its own for a part of the plan, so that adding draws to
  /// one part does not change the others.
  rng fork(std::uint64_t salt) noexcept { return rng(next() ^ mix64(salt)); }

 private:
  static constexpr std::uint64_t rotl(std::uint64_t x, int k) noexcept { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

}  // namespace stress
