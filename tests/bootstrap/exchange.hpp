// What every mesh test does once the mesh is up: each pair of ranks
// exchanges checksummed messages of many sizes in both directions at once,
// and the receiver checks every byte and the checksum.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <gdr/bootstrap/mesh.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/view.hpp>

namespace gdr_test {

inline std::uint64_t fnv1a(const std::byte* p, std::size_t n) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<std::uint64_t>(p[i])) * 1099511628211ull;
  return h;
}

/// Message k from rank `from` to rank `to`: pseudo-random bytes, then their
/// 8-byte checksum. Sizes cover empty, eager and large (> 64 KiB) messages.
inline std::vector<std::byte> mesh_message(int from, int to, int k) {
  const std::size_t len = (k % 4 == 3) ? 150000 + static_cast<std::size_t>(k) * 1000
                                       : static_cast<std::size_t>((k * 997 + from * 31 + to) % 3000);
  std::vector<std::byte> m(len + 8);
  std::uint64_t x = (static_cast<std::uint64_t>(from) << 40) ^ (static_cast<std::uint64_t>(to) << 20) ^
                    static_cast<std::uint64_t>(k) ^ 0x9E3779B97F4A7C15ull;
  for (std::size_t i = 0; i < len; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    m[i] = static_cast<std::byte>(x);
  }
  const std::uint64_t h = fnv1a(m.data(), len);
  for (int i = 0; i < 8; ++i) m[len + static_cast<std::size_t>(i)] = static_cast<std::byte>(h >> (8 * i));
  return m;
}

inline constexpr int mesh_messages = 12;

inline gdr::op_options mesh_timeout() {
  gdr::op_options o;  // built outside co_await: see tcp/endpoint.hpp's GCC 12 caveat
  o.timeout = std::chrono::seconds(20);
  return o;
}

inline gdr::task<> send_messages(gdr::endpoint& ep, int from, int to) {
  for (int k = 0; k < mesh_messages; ++k) {
    std::vector<std::byte> m = mesh_message(from, to, k);
    co_await ep.send(gdr::view<const std::byte, gdr::Host>(m.data(), m.size()), mesh_timeout());
  }
}

inline gdr::task<> receive_messages(gdr::endpoint& ep, int from, int to, int& bad) {
  std::vector<std::byte> in(1 << 20);
  for (int k = 0; k < mesh_messages; ++k) {
    std::size_t n = co_await ep.recv(gdr::view<std::byte, gdr::Host>(in.data(), in.size()), mesh_timeout());
    const std::vector<std::byte> want = mesh_message(from, to, k);
    bool sum_ok = n >= 8 && [&] {
      std::uint64_t h = 0;
      for (int i = 0; i < 8; ++i) h |= static_cast<std::uint64_t>(in[n - 8 + static_cast<std::size_t>(i)]) << (8 * i);
      return h == fnv1a(in.data(), n - 8);
    }();
    if (!sum_ok || n != want.size() || !std::equal(want.begin(), want.end(), in.begin())) {
      std::fprintf(stderr, "rank %d: message %d from rank %d is wrong (%zu bytes)\n", to, k, from, n);
      ++bad;
    }
  }
}

/// Every pair exchanges `mesh_messages` messages each way, all pairs at once.
/// Returns the number of wrong messages this rank received.
inline gdr::task<int> exchange_with_all(gdr::bootstrap::mesh& m) {
  int bad = 0;
  std::vector<gdr::task<>> work;
  for (int p = 0; p < m.size(); ++p) {
    if (p == m.rank()) continue;
    work.push_back(send_messages(m.peer(p), m.rank(), p));
    work.push_back(receive_messages(m.peer(p), p, m.rank(), bad));
  }
  co_await gdr::when_all(std::move(work));
  co_return bad;
}

/// What every rank of a mesh test checks once its mesh is built: it is rank
/// `rank` of `world`, open to every peer and not to itself, every exchange
/// arrives intact; then, after a barrier (nobody closes while a peer still
/// receives), it closes. Returns the number of things wrong.
template <class R>
gdr::task<int> check_mesh(gdr::bootstrap::mesh& m, R& rv, int rank, int world) {
  if (m.rank() != rank || m.size() != world) co_return 1000;
  int wrong = 0;
  for (int p = 0; p < world; ++p)
    if ((p == rank) == m.peer(p).is_open()) ++wrong;
  wrong += co_await exchange_with_all(m);
  rv.barrier();
  co_await m.close();
  co_return wrong;
}

}  // namespace gdr_test
