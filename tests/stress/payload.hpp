// What every byte the stress test moves should be. A message of at least
// `header_size` bytes begins with a header naming it (sender side, tag,
// sequence number, size, the run's seed, whether it is the stream's last
// "fin" message), followed by a pattern derived from the same; a shorter
// message is the first bytes of that pattern alone, so two messages of one
// stream differ even at one byte (but for 1/256 of pairs, which the
// matcher in check.hpp tolerates by trying every candidate). Puts, gets,
// windows and receive buffers have patterns of their own, so a byte that
// lands in the wrong place is seen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "tests/stress/journal.hpp"
#include "tests/stress/rng.hpp"

namespace stress {

inline constexpr std::size_t header_size = 32;
inline constexpr std::uint32_t magic = 0x53525453;  // "STRS"

/// `n` bytes of the pattern named by `key`.
inline std::vector<std::byte> pattern_bytes(std::uint64_t key, std::size_t n) {
  std::vector<std::byte> v(n);
  std::uint64_t x = mix64(key);
  for (std::size_t i = 0; i < n; i += 8) {
    x = mix64(x);
    for (std::size_t k = 0; k < 8 && i + k < n; ++k) v[i + k] = static_cast<std::byte>(x >> (8 * k));
  }
  return v;
}

/// The identity a message carries.
struct msg_id {
  std::uint8_t from = 0;  ///< the sending side (0 or 1)
  std::uint8_t tag = 0;
  std::uint32_t seq = 0;  ///< its place among the sends of (from, tag)
  std::uint64_t size = 0;
  bool fin = false;       ///< the stream's last message
};

#pragma pack(push, 1)
struct wire_header {
  std::uint32_t magic;
  std::uint32_t seq;
  std::uint64_t size;
  std::uint8_t from;
  std::uint8_t tag;
  std::uint8_t fin;
  std::uint8_t zero;
  std::uint32_t seed_lo;
  std::uint64_t check;
};
#pragma pack(pop)
static_assert(sizeof(wire_header) == header_size);

/// The bytes of message `id` in the run of `seed`.
inline std::vector<std::byte> message_bytes(std::uint64_t seed, const msg_id& id) {
  const std::uint64_t key = hash_of({seed, id.from, id.tag, id.seq, id.size, id.fin ? 1u : 0u, 0x6d7367});
  std::vector<std::byte> v = pattern_bytes(key, id.size);
  if (id.size >= header_size) {
    wire_header h{magic, id.seq, id.size, id.from, id.tag, static_cast<std::uint8_t>(id.fin), 0,
                  static_cast<std::uint32_t>(seed), key};
    std::memcpy(v.data(), &h, sizeof h);
  }
  return v;
}

/// What a received prefix says it is, for messages ("seq 4 of 1/tag 2,
/// 8192 bytes"), or "unlabelled".
inline std::string describe_bytes(const std::vector<std::byte>& v) {
  if (v.size() < header_size) return strf("%zu unlabelled bytes", v.size());
  wire_header h;
  std::memcpy(&h, v.data(), sizeof h);
  if (h.magic != magic) return strf("%zu bytes without a header", v.size());
  return strf("seq %u of side %u tag %u (%llu bytes%s)", h.seq, h.from, h.tag, static_cast<unsigned long long>(h.size),
              h.fin ? ", fin" : "");
}

/// The first byte where `got` differs from `want`'s first got.size() bytes,
/// or -1.
inline long first_difference(const std::vector<std::byte>& got, const std::vector<std::byte>& want) {
  for (std::size_t i = 0; i < got.size(); ++i)
    if (i >= want.size() || got[i] != want[i]) return static_cast<long>(i);
  return -1;
}

/// A 64-bit digest of some bytes (late writes: compared before and after).
inline std::uint64_t digest(const std::vector<std::byte>& v) {
  std::uint64_t h = 0xcbf29ce484222325ull ^ v.size();
  for (std::byte b : v) h = (h ^ static_cast<std::uint8_t>(b)) * 0x100000001b3ull;
  return h;
}

}  // namespace stress
