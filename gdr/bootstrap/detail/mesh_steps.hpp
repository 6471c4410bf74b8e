/// \file
/// Internal: what the full mesh (`gdr/bootstrap/mesh.hpp`) and the lazy mesh
/// (`gdr/bootstrap/lazy_mesh.hpp`) share: the collectives of their first two
/// steps (introductions and the session id; listening and publishing each
/// rank's address), the hello a connecting rank sends first, the address a
/// rank listens on, and errors that name the rank and the step.
///
/// Every collective here goes through the rendezvous with the step's name
/// (a rendezvous that takes one, as `tcp_rendezvous` does, puts it in its
/// own errors) and a failure is rethrown as `errc::bootstrap_failed` with
/// the mesh's rank and the step in front.
#pragma once

#include <sys/random.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <gdr/bootstrap/detail/blocking_socket.hpp>
#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/remote_view.hpp>  // detail::store_le64 / load_le64
#include <gdr/transfer/common.hpp>

namespace gdr::bootstrap::detail {

/// The first message on a mesh connection, from the rank that connected:
/// magic, session id, (rank | world size << 32).
inline constexpr std::uint64_t mesh_hello_magic = 0x3148'534d'5244'4701ull;
inline constexpr std::size_t mesh_hello_size = 24;
/// How long a connection the lazy mesh accepted may take to say hello
/// before it is dropped (a stray client must not keep a coroutine for long).
inline constexpr std::chrono::milliseconds hello_bound{5000};

inline std::vector<std::byte> bytes_of(const std::string& s) {
  auto b = std::as_bytes(std::span(s));
  return {b.begin(), b.end()};
}
inline std::string string_of(const std::vector<std::byte>& b, std::size_t from = 0) {
  if (from > b.size()) from = b.size();
  return {reinterpret_cast<const char*>(b.data()) + from, b.size() - from};
}

/// op_options with a timeout, made outside any co_await expression (GCC 12
/// destroys a braced op_options temporary there twice; see tcp/endpoint.hpp).
inline op_options timeout_options(std::chrono::milliseconds t) {
  op_options o;
  o.timeout = t;
  return o;
}

/// "rank 3" or "ranks 2, 5, 7" (the first dozen, then how many more).
inline std::string ranks_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i == 12 && ranks.size() > 13) return s + " and " + std::to_string(ranks.size() - i) + " more";
    s += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return s;
}

/// An error's own sentence, without the category's text that
/// `system_error::what()` appends (so that a wrapped error does not repeat it).
inline std::string reason_of(const error& e) {
  std::string w = e.what();
  const std::string tail = ": " + e.code().message();
  if (w.size() > tail.size() && w.compare(w.size() - tail.size(), tail.size(), tail) == 0)
    w.resize(w.size() - tail.size());
  return w;
}

/// "gdr::bootstrap::connect_mesh (rank 3 of 8): "
inline std::string mesh_prefix(const char* who, int rank, int size) {
  return std::string("gdr::bootstrap::") + who + " (rank " + std::to_string(rank) + " of " + std::to_string(size) +
         "): ";
}

[[noreturn]] inline void mesh_fail(const char* who, int rank, int size, const std::string& what) {
  throw error(errc::bootstrap_failed, mesh_prefix(who, rank, size) + what);
}

/// `rv.allgather(mine)`, naming the step to a rendezvous that takes a name,
/// and rethrowing a failure with the mesh's rank and the step in front.
template <rendezvous R>
std::vector<std::vector<std::byte>> gather_step(R& rv, std::span<const std::byte> mine, const char* who,
                                                const std::string& step) {
  try {
    if constexpr (requires { rv.allgather(mine, std::string_view{}); }) {
      const std::string label = std::string(who) + " " + step;
      return rv.allgather(mine, std::string_view(label));
    } else {
      return rv.allgather(mine);
    }
  } catch (const error& e) {
    mesh_fail(who, rv.rank(), rv.size(), step + ": " + reason_of(e));
  }
}

/// The address a rank listens on and publishes: `configured`, else
/// `GDR_MESH_HOST`, else the rendezvous' hint, else 127.0.0.1 when every rank
/// runs on this host, else the first external IPv4 address.
template <rendezvous R>
std::string listen_host(R& rv, const std::string& configured, bool one_host) {
  std::string host = configured;
  if (host.empty())
    if (const char* env = std::getenv("GDR_MESH_HOST")) host = env;
  if (host.empty()) host = rv.address_hint();
  if (host.empty()) host = one_host ? "127.0.0.1" : gdr::detail::sock::first_external_ipv4();
  if (host.empty()) host = "127.0.0.1";
  return host;
}

/// What steps 1 and 2 give every rank.
struct mesh_table {
  int rank = 0;
  int size = 0;
  /// Rank 0's random number: the hellos of this mesh carry it.
  std::uint64_t session = 0;
  /// Where rank r listens ("host:port"); empty for a rank that could not.
  std::vector<std::string> where;
  /// Why this rank failed (it could not listen), or empty; when another
  /// rank could not listen, which.
  std::string failure;
};

/// Steps 1 and 2: introductions (host names and the session id), then
/// listening (through `net.listen(host)`, `host` from `listen_host`) and
/// publishing every rank's address. A rank that cannot listen publishes nothing; the failure is in
/// every rank's table (each mesh reports it in its own way). Throws what
/// `gather_step` throws.
template <rendezvous R, class Net>
mesh_table introduce_and_publish(R& rv, Net& net, const char* who, const std::string& configured_host) {
  mesh_table t;
  t.rank = rv.rank();
  t.size = rv.size();
  // 1. Host names and the session id.
  std::uint64_t nonce = 0;
  while (nonce == 0)
    if (::getrandom(&nonce, sizeof nonce, 0) != static_cast<ssize_t>(sizeof nonce)) nonce = 0x9e3779b97f4a7c15ull;
  std::vector<std::byte> intro(8);
  gdr::detail::store_le64(intro.data(), nonce);
  std::string host_name = gdr::detail::sock::host_name();
  auto name_bytes = bytes_of(host_name);
  intro.insert(intro.end(), name_bytes.begin(), name_bytes.end());
  auto intros = gather_step(rv, intro, who, "step 1 (introductions)");
  t.session = intros[0].size() >= 8 ? gdr::detail::load_le64(intros[0].data()) : 0;
  bool one_host = true;
  for (const auto& i : intros) one_host &= i.size() >= 8 && string_of(i, 8) == host_name;

  // 2. Listen and publish.
  t.failure = net.listen(listen_host(rv, configured_host, one_host));
  auto addrs = gather_step(rv, bytes_of(t.failure.empty() ? net.published() : std::string()), who,
                           "step 2 (listening addresses)");
  t.where.resize(addrs.size());
  std::vector<int> silent;
  for (std::size_t r = 0; r < addrs.size(); ++r) {
    t.where[r] = string_of(addrs[r]);
    if (t.where[r].empty()) silent.push_back(static_cast<int>(r));
  }
  if (t.failure.empty() && !silent.empty()) t.failure = ranks_list(silent) + " could not listen";
  return t;
}

/// The hello rank `rank` of a mesh of `size` sends first on a connection.
inline std::array<std::byte, mesh_hello_size> mesh_hello(std::uint64_t session, int rank, int size) noexcept {
  std::array<std::byte, mesh_hello_size> h{};
  gdr::detail::store_le64(h.data(), mesh_hello_magic);
  gdr::detail::store_le64(h.data() + 8, session);
  gdr::detail::store_le64(h.data() + 16, static_cast<std::uint64_t>(rank) | static_cast<std::uint64_t>(size) << 32);
  return h;
}

/// The rank a received hello names, or -1 when it is not a hello of this
/// session and world (a stray client, an earlier job) or names `me`.
inline int mesh_hello_rank(std::span<const std::byte> h, std::size_t got, std::uint64_t session, int size,
                           int me) noexcept {
  if (got != mesh_hello_size || h.size() < mesh_hello_size) return -1;
  if (gdr::detail::load_le64(h.data()) != mesh_hello_magic || gdr::detail::load_le64(h.data() + 8) != session)
    return -1;
  const std::uint64_t who = gdr::detail::load_le64(h.data() + 16);
  const std::uint64_t r = who & 0xffff'ffff;
  if ((who >> 32) != static_cast<std::uint64_t>(size) || r >= static_cast<std::uint64_t>(size) ||
      r == static_cast<std::uint64_t>(me))
    return -1;
  return static_cast<int>(r);
}

}  // namespace gdr::bootstrap::detail
