/// \file
/// `gdr::bootstrap::connect_mesh`: one TCP endpoint to every other rank,
/// built through a rendezvous (TCP or MPI). The steps below are the same
/// for every transport (`detail::build_mesh`); `gdr::verbs::connect_mesh`
/// (`gdr/bootstrap/verbs_mesh.hpp`) builds a mesh of verbs endpoints.
///
/// \code
///   auto rv = gdr::bootstrap::tcp_rendezvous::from_env();
///   gdr::scheduler sched;
///   gdr::sync_wait(sched, [&]() -> gdr::task<> {
///     gdr::bootstrap::mesh m = co_await gdr::bootstrap::connect_mesh(sched, rv);
///     int right = (m.rank() + 1) % m.size();
///     co_await m.peer(right).send(gdr::host_view(buf));
///     co_await m.close();
///   }());
/// \endcode
///
/// How it is built
/// ===============
/// 1. Every rank allgathers its host name and a random number; rank 0's
///    number becomes the mesh's session id.
/// 2. Every rank listens on an ephemeral port of its chosen address (below)
///    and allgathers "address:port".
/// 3. Rank i connects to every rank j > i and sends a hello (a magic, the
///    session id, i and the world size) as its first message; it accepts
///    i connections and reads each one's hello to learn which lower rank it
///    is. A connection whose hello is not of this session (a stray client, a
///    previous job) is closed and not counted.
/// 4. A final allgather of each rank's outcome: if any rank failed, every
///    rank throws, instead of some ranks waiting on a peer that gave up.
/// Connecting first and accepting after cannot deadlock: the listening
/// sockets exist before any address is published, and the kernel completes
/// the TCP handshakes into the listen backlog whether or not the peer is
/// accepting yet.
///
/// Which address a rank listens on: `mesh_options::listen_host`, else
/// `GDR_MESH_HOST`, else the rendezvous' `address_hint()` (a TCP rendezvous
/// knows the address by which this rank reached rank 0), else 127.0.0.1 when
/// every rank runs on the same host (same host name), else the first IPv4
/// address of an interface that is up and not loopback.
///
/// Blocking: the rendezvous collectives block the scheduler's thread (setup
/// code; nothing else should run on it yet). Every wait is bounded by
/// `mesh_options::timeout`; failures throw `gdr::error` with
/// `errc::bootstrap_failed` and say which peer and which step.
///
/// Teardown: `co_await m.close()` closes every endpoint in order (flushing
/// sends); destroying a mesh with open endpoints aborts them (see
/// `tcp::endpoint`).
#pragma once

#include <sys/random.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gdr/bootstrap/detail/blocking_socket.hpp>
#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/remote_view.hpp>  // detail::store_le64 / load_le64
#include <gdr/memory/view.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/tcp/connect.hpp>
#include <gdr/transport/tcp/endpoint.hpp>
#include <gdr/transport/tcp/listener.hpp>

namespace gdr::bootstrap {

/// How `connect_mesh` builds the mesh.
///
/// Not an aggregate, on purpose: GCC 12 destroys an aggregate temporary
/// twice when it is made inside a `co_await` expression, and
/// `co_await connect_mesh(sched, rv)` makes one from the default argument.
/// Set the fields on a named object.
struct mesh_options {
  mesh_options() noexcept {}  // NOLINT: user-provided on purpose (see above)

  /// The numeric address to listen on and publish (see the file comment for
  /// what is used when empty).
  std::string listen_host{};
  /// Bound on each step (each connect, each hello, all the accepts).
  std::chrono::milliseconds timeout{30'000};
  /// The registry the endpoints serve peers' put/get from.
  memory_registry* registry = &default_registry();
  /// Options of every endpoint.
  tcp::endpoint_options endpoint{};
};

/// One connected endpoint per other rank. Move-only.
///
/// The endpoints are `gdr::endpoint`s: the transport to each peer is decided
/// at run time (the bootstrap connects them over TCP; a mesh built some other
/// way may mix transports, e.g. loopback to ranks in this process). Each
/// moves what every transport moves (Host and Pinned memory) with the same
/// operations and rules.
///
/// Thread-safety: as its endpoints: use them on the scheduler's thread.
class mesh {
 public:
  mesh() = default;
  /// A mesh of endpoints connected some other way: `peers[r]` leads to rank
  /// `r`; `peers[rank]` is unused.
  mesh(int rank, std::vector<endpoint> peers) noexcept : rank_(rank), peers_(std::move(peers)) {}
  mesh(mesh&&) noexcept = default;
  mesh& operator=(mesh&&) noexcept = default;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return static_cast<int>(peers_.size()); }

  /// The endpoint to rank `r` (`r != rank()`).
  endpoint& peer(int r) noexcept { return peers_[static_cast<std::size_t>(r)]; }
  const endpoint& peer(int r) const noexcept { return peers_[static_cast<std::size_t>(r)]; }

  /// Closes every endpoint in order (see `basic_endpoint::close`), one after
  /// the other; the first failure is rethrown after all were closed.
  // A template, so that a translation unit that never closes a mesh does not
  // compile this coroutine and everything it reaches (gcc emits every
  // non-template inline coroutine where it is defined: about 0.4 s of
  // `#include <gdr/gdr.hpp>`, benchmarks/compile_cost.sh).
  template <class = void>
  task<> close() {
    std::error_code first;
    for (auto& ep : peers_) {
      if (!ep.is_open()) continue;
      auto op = ep.close();  // made outside the co_await: see mesh_options
      result<std::size_t> r = co_await std::move(op).as_result();
      if (!r && !first) first = r.error();
    }
    throw_if(first, "gdr::bootstrap::mesh::close");
  }

 private:
  int rank_ = 0;
  std::vector<endpoint> peers_;  // peers_[rank_] is not connected
};

namespace detail {

inline constexpr std::uint64_t mesh_hello_magic = 0x3148'534d'5244'4701ull;

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

[[noreturn]] inline void mesh_fail(int rank, const std::string& what) {
  throw error(errc::bootstrap_failed, "gdr::bootstrap::connect_mesh (rank " + std::to_string(rank) + "): " + what);
}

}  // namespace detail

/// Builds the mesh through `rv` (see the file comment). Collective: every
/// rank calls it with the same `rv` world. Throws `gdr::error`
/// (`errc::bootstrap_failed`).
namespace detail {

/// The address a rank listens on and publishes (see the file comment).
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

/// Builds a mesh over the transport `net` stands for (the steps of the file
/// comment). `Net` gives:
///   * `std::string listen(const std::string& host)`: listens on `host`
///     (any port); returns why it could not, or nothing;
///   * `std::string published() const`: what other ranks connect to;
///   * `task<result<E>> connect(const std::string& where, std::chrono::milliseconds)`
///     and `task<result<E>> accept(std::chrono::milliseconds)`, `E` an
///     endpoint of the transport (converts to `gdr::endpoint`);
///   * `void close()`: stops listening.
template <rendezvous R, class Net>
task<mesh> build_mesh(R& rv, std::string configured_host, std::chrono::milliseconds timeout, Net& net) {
  const int me = rv.rank(), n = rv.size();
  // 1. Host names and the session id.
  std::uint64_t nonce = 0;
  while (nonce == 0)
    if (::getrandom(&nonce, sizeof nonce, 0) != static_cast<ssize_t>(sizeof nonce)) nonce = 0x9e3779b97f4a7c15ull;
  std::vector<std::byte> intro(8);
  gdr::detail::store_le64(intro.data(), nonce);
  std::string host_name = gdr::detail::sock::host_name();
  auto name_bytes = detail::bytes_of(host_name);
  intro.insert(intro.end(), name_bytes.begin(), name_bytes.end());
  auto intros = rv.allgather(intro);
  const std::uint64_t session = gdr::detail::load_le64(intros[0].data());
  bool one_host = true;
  for (const auto& i : intros) one_host &= i.size() >= 8 && detail::string_of(i, 8) == host_name;

  // 2. Listen and publish.
  std::string failure = net.listen(listen_host(rv, configured_host, one_host));
  // A rank that cannot listen publishes nothing; every rank then skips to
  // the final allgather, where the failure is reported to all.
  auto addrs = rv.allgather(detail::bytes_of(failure.empty() ? net.published() : std::string()));
  for (int r = 0; r < n && failure.empty(); ++r)
    if (addrs[static_cast<std::size_t>(r)].empty()) failure = "rank " + std::to_string(r) + " could not listen";

  std::vector<endpoint> peers(static_cast<std::size_t>(n));
  auto hello_for = [&](int rank) {
    std::vector<std::byte> h(24);
    gdr::detail::store_le64(h.data(), detail::mesh_hello_magic);
    gdr::detail::store_le64(h.data() + 8, session);
    gdr::detail::store_le64(h.data() + 16, static_cast<std::uint64_t>(rank) | static_cast<std::uint64_t>(n) << 32);
    return h;
  };

  // 3a. Connect to every higher rank and introduce ourselves.
  const std::vector<std::byte> hello = hello_for(me);
  for (int j = me + 1; j < n && failure.empty(); ++j) {
    const std::string where = detail::string_of(addrs[static_cast<std::size_t>(j)]);
    auto ep = co_await net.connect(where, timeout);
    if (!ep) {
      failure = "connecting to rank " + std::to_string(j) + " at " + where + ": " + ep.error().message();
      break;
    }
    auto send = ep->send(gdr::view<const std::byte, Host>(hello.data(), hello.size()), detail::timeout_options(timeout));
    result<std::size_t> sent = co_await std::move(send).as_result();
    if (!sent) {
      failure = "greeting rank " + std::to_string(j) + " at " + where + ": " + sent.error().message();
      break;
    }
    peers[static_cast<std::size_t>(j)] = std::move(*ep);
  }

  // 3b. Accept every lower rank; its hello says which one it is.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int missing = failure.empty() ? me : 0;
  while (missing > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      failure = "waited " + std::to_string(timeout.count()) + " ms for " + std::to_string(missing) +
                " lower ranks to connect";
      break;
    }
    auto ep = co_await net.accept(left);
    if (!ep) {
      failure = "accepting: " + ep.error().message();
      break;
    }
    std::array<std::byte, 32> h{};
    // A silent client must not hold the mesh for long.
    auto recv = ep->recv(gdr::view<std::byte, Host>(h.data(), h.size()),
                         detail::timeout_options(std::min(left, std::chrono::milliseconds(5000))));
    result<std::size_t> got = co_await std::move(recv).as_result();
    const std::uint64_t who = got ? gdr::detail::load_le64(h.data() + 16) : 0;
    const auto r = static_cast<std::size_t>(who & 0xffff'ffff);
    const bool ours = got && *got == 24 && gdr::detail::load_le64(h.data()) == detail::mesh_hello_magic &&
                      gdr::detail::load_le64(h.data() + 8) == session && (who >> 32) == static_cast<std::uint64_t>(n) &&
                      r < static_cast<std::size_t>(me) && !peers[r].is_open();
    if (!ours) {
      // Not a rank of this mesh (or a duplicate): drop it, keep waiting.
      auto bye = ep->close(detail::timeout_options(std::chrono::milliseconds(1000)));
      result<std::size_t> closed = co_await std::move(bye).as_result();
      (void)closed;  // whatever it was, it is gone
      continue;
    }
    peers[r] = std::move(*ep);
    --missing;
  }
  net.close();

  // 4. Everyone's outcome, so that no rank waits on a peer that gave up.
  std::vector<std::byte> outcome = detail::bytes_of(failure);
  std::vector<std::vector<std::byte>> outcomes;
  std::string rv_error;
  try {
    outcomes = rv.allgather(outcome);
  } catch (const error& e) {
    rv_error = e.what();
  }
  std::string report = failure;
  if (report.empty() && !rv_error.empty()) report = "final allgather: " + rv_error;
  for (int r = 0; r < static_cast<int>(outcomes.size()) && report.empty(); ++r)
    if (!outcomes[static_cast<std::size_t>(r)].empty())
      report = "rank " + std::to_string(r) + " failed: " + detail::string_of(outcomes[static_cast<std::size_t>(r)]);
  mesh m(me, std::move(peers));
  if (!report.empty()) {
    try {
      co_await m.close();
    } catch (const error&) {
      // Reporting the mesh failure matters more than a close failure.
    }
    detail::mesh_fail(me, report);
  }
  co_return m;
}


/// The TCP side of `build_mesh`.
struct tcp_net {
  scheduler* sched;
  const mesh_options* opts;
  std::optional<tcp::listener> listener{};

  std::string listen(const std::string& host) {
    const bool v6 = host.find(':') != std::string::npos;
    result<tcp::address> at = tcp::address::parse((v6 ? "[" + host + "]" : host) + ":0");
    if (!at) return "cannot listen on \"" + host + "\": not a numeric address";
    try {
      listener.emplace(*sched, *at, *opts->registry, opts->endpoint);
    } catch (const error& e) {
      return std::string("cannot listen on ") + host + ": " + e.what();
    }
    return {};
  }
  std::string published() const { return listener->local_address().to_string(); }
  task<result<tcp::endpoint>> connect(const std::string& where, std::chrono::milliseconds t) {
    auto conn = tcp::connect(*sched, where, detail::timeout_options(t), *opts->registry, opts->endpoint);
    co_return co_await std::move(conn).as_result();
  }
  task<result<tcp::endpoint>> accept(std::chrono::milliseconds t) {
    auto acc = listener->accept(detail::timeout_options(t));
    co_return co_await std::move(acc).as_result();
  }
  void close() {
    if (listener) listener->close();
  }
};

}  // namespace detail

/// Builds the mesh over TCP (see the file comment).
template <rendezvous R>
task<mesh> connect_mesh(scheduler& sched, R& rv, mesh_options opts = {}) {
  detail::tcp_net net{&sched, &opts};
  co_return co_await detail::build_mesh(rv, opts.listen_host, opts.timeout, net);
}

}  // namespace gdr::bootstrap
