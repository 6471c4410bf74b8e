/// \file
/// `gdr::bootstrap::tcp_rendezvous`: processes find each other through rank
/// 0's TCP address. Rank 0 listens; every other rank connects, says hello
/// (its rank and the world size), and keeps the connection for `allgather`
/// and `barrier`, which go through rank 0 (a star: fine for setup data, a
/// few kilobytes per rank).
///
/// \code
///   // GDR_ROOT=10.0.0.1:29500 GDR_RANK=2 GDR_WORLD_SIZE=4 ./app
///   auto rv = gdr::bootstrap::tcp_rendezvous::from_env();
///   auto all = rv.allgather(my_bytes);   // all[r]: rank r's bytes
///   rv.barrier();
/// \endcode
///
/// Blocking, on purpose: this runs once, before any scheduler, so it uses
/// plain sockets with `poll` timeouts rather than io_uring. Every wait is
/// bounded by `config::timeout`; when a rank never shows up, dies, or sends
/// something else, the call throws `gdr::error` with
/// `errc::bootstrap_failed` and says which rank and which step (rank 0
/// lists the ranks still missing). A rank that is not a gdr rank connecting
/// to the root's port is dropped and does not count.
///
/// Thread-safety: one thread at a time per object. Collective calls must be
/// made by every rank in the same order.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gdr/bootstrap/detail/blocking_socket.hpp>
#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/remote_view.hpp>  // detail::store_le64 / load_le64

namespace gdr::bootstrap {

/// Where rank 0 is and who this process is.
struct tcp_rendezvous_config {
  /// Rank 0's host (numeric or a name) and port. Rank 0 binds it; port 0
  /// there means any free port (read it back with `port()`).
  std::string root_host = "127.0.0.1";
  std::uint16_t root_port = 0;
  /// This process's rank, in `[0, world_size)`.
  int rank = -1;
  /// Number of processes.
  int world_size = 0;
  /// Bound on every wait: connecting, the hellos, each collective.
  std::chrono::milliseconds timeout{30'000};
  /// Rank 0 only: an already-listening socket to use instead of binding
  /// (a launcher that picked a free port itself). Taken over and closed.
  int listen_fd = -1;

  /// Reads `GDR_ROOT=host:port`, `GDR_RANK`, `GDR_WORLD_SIZE` and the optional
  /// `GDR_BOOTSTRAP_TIMEOUT_MS`. Rank and size fall back to what launchers
  /// set (`OMPI_COMM_WORLD_RANK`/`_SIZE`, `PMI_RANK`/`PMI_SIZE`,
  /// `SLURM_PROCID`/`SLURM_NTASKS`). Fails with `errc::invalid_argument`
  /// when something is missing or malformed.
  static result<tcp_rendezvous_config> from_env() noexcept {
    tcp_rendezvous_config c;
    const char* root = std::getenv("GDR_ROOT");
    if (root == nullptr || gdr::detail::sock::split_host_port(root, c.root_host, c.root_port)) return errc::invalid_argument;
    if (!env_int({"GDR_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, c.rank)) return errc::invalid_argument;
    if (!env_int({"GDR_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}, c.world_size))
      return errc::invalid_argument;
    int ms = 0;
    if (env_int({"GDR_BOOTSTRAP_TIMEOUT_MS"}, ms)) c.timeout = std::chrono::milliseconds(ms);
    if (c.world_size <= 0 || c.rank < 0 || c.rank >= c.world_size) return errc::invalid_argument;
    return c;
  }

 private:
  static bool env_int(std::initializer_list<const char*> names, int& out) noexcept {
    for (const char* n : names) {
      const char* v = std::getenv(n);
      if (v == nullptr || *v == '\0') continue;
      char* end = nullptr;
      long x = std::strtol(v, &end, 10);
      if (*end != '\0' || x < 0 || x > 1'000'000'000) return false;
      out = static_cast<int>(x);
      return true;
    }
    return false;
  }
};

/// A TCP bootstrap; see the file comment. Satisfies `rendezvous`.
class tcp_rendezvous {
 public:
  /// Joins the job: rank 0 waits for every other rank to connect, the others
  /// connect to rank 0 (retrying while it starts). Blocks up to
  /// `cfg.timeout`. Throws `gdr::error` (`errc::bootstrap_failed`, or
  /// `errc::invalid_argument` for a bad rank or size).
  explicit tcp_rendezvous(tcp_rendezvous_config cfg) : cfg_(std::move(cfg)) {
    gdr::detail::sock::unique_fd handed(cfg_.listen_fd);
    cfg_.listen_fd = -1;
    if (cfg_.world_size <= 0 || cfg_.rank < 0 || cfg_.rank >= cfg_.world_size)
      throw error(errc::invalid_argument, "gdr::bootstrap::tcp_rendezvous: rank " + std::to_string(cfg_.rank) +
                                               " is not in [0, " + std::to_string(cfg_.world_size) + ")");
    if (cfg_.rank == 0)
      start_root(std::move(handed));
    else
      start_member();
  }

  /// `tcp_rendezvous(tcp_rendezvous_config::from_env().value())`, with a
  /// clear message when the environment is incomplete.
  static tcp_rendezvous from_env() {
    result<tcp_rendezvous_config> c = tcp_rendezvous_config::from_env();
    if (!c)
      throw error(errc::bootstrap_failed,
                  "gdr::bootstrap::tcp_rendezvous: set GDR_ROOT=host:port, GDR_RANK and GDR_WORLD_SIZE");
    return tcp_rendezvous(std::move(*c));
  }

  tcp_rendezvous(tcp_rendezvous&&) noexcept = default;
  tcp_rendezvous& operator=(tcp_rendezvous&&) noexcept = default;

  int rank() const noexcept { return cfg_.rank; }
  int size() const noexcept { return cfg_.world_size; }
  /// The root's port (useful when rank 0 bound port 0).
  std::uint16_t port() const noexcept { return port_; }
  /// This process's address on the interface that reaches the root (what
  /// peers on that network can connect to).
  std::string address_hint() const { return address_; }

  /// Every rank's `mine`, indexed by rank. Collective; blocks up to the
  /// timeout. Throws `gdr::error(errc::bootstrap_failed)` naming the rank
  /// that failed.
  std::vector<std::vector<std::byte>> allgather(std::span<const std::byte> mine) {
    ++seq_;
    auto deadline = gdr::detail::sock::clock::now() + cfg_.timeout;
    std::vector<std::vector<std::byte>> all(static_cast<std::size_t>(cfg_.world_size));
    all[static_cast<std::size_t>(cfg_.rank)].assign(mine.begin(), mine.end());
    if (cfg_.rank == 0) {
      for (int r = 1; r < cfg_.world_size; ++r) {
        const int fd = peers_[static_cast<std::size_t>(r)].get();
        std::uint64_t h[3];
        check(gdr::detail::sock::recv_all(fd, h, sizeof h, deadline), "allgather #" + std::to_string(seq_) + ": rank " +
                                                                     std::to_string(r) + " did not contribute");
        if (load(h[0]) != contrib_magic || load(h[1]) != seq_ || load(h[2]) > max_contribution)
          fail("allgather #" + std::to_string(seq_) + ": rank " + std::to_string(r) +
               " sent a malformed contribution (mismatched collective calls?)");
        auto& v = all[static_cast<std::size_t>(r)];
        v.resize(load(h[2]));
        check(gdr::detail::sock::recv_all(fd, v.data(), v.size(), deadline),
              "allgather #" + std::to_string(seq_) + ": rank " + std::to_string(r) + " did not contribute");
      }
      // One message for everyone: header, every length, every contribution.
      std::vector<std::byte> out;
      put(out, result_magic);
      put(out, seq_);
      for (auto& v : all) put(out, v.size());
      for (auto& v : all) out.insert(out.end(), v.begin(), v.end());
      for (int r = 1; r < cfg_.world_size; ++r)
        check(gdr::detail::sock::send_all(peers_[static_cast<std::size_t>(r)].get(), out.data(), out.size(), deadline),
              "allgather #" + std::to_string(seq_) + ": sending the result to rank " + std::to_string(r));
      return all;
    }
    const int fd = root_.get();
    const std::string step = "allgather #" + std::to_string(seq_) + " with the root " + root_name();
    std::vector<std::byte> head;
    put(head, contrib_magic);
    put(head, seq_);
    put(head, mine.size());
    check(gdr::detail::sock::send_all(fd, head.data(), head.size(), deadline), step);
    check(gdr::detail::sock::send_all(fd, mine.data(), mine.size(), deadline), step);
    std::uint64_t h[2];
    check(gdr::detail::sock::recv_all(fd, h, sizeof h, deadline), step);
    if (load(h[0]) != result_magic || load(h[1]) != seq_) fail(step + ": malformed result");
    std::vector<std::uint64_t> lens(static_cast<std::size_t>(cfg_.world_size));
    check(gdr::detail::sock::recv_all(fd, lens.data(), lens.size() * 8, deadline), step);
    for (std::size_t r = 0; r < all.size(); ++r) {
      std::uint64_t n = load(lens[r]);
      if (n > max_contribution) fail(step + ": malformed result");
      if (r == static_cast<std::size_t>(cfg_.rank)) {
        std::vector<std::byte> echo(n);
        check(gdr::detail::sock::recv_all(fd, echo.data(), n, deadline), step);
        continue;
      }
      all[r].resize(n);
      check(gdr::detail::sock::recv_all(fd, all[r].data(), n, deadline), step);
    }
    return all;
  }

  /// Returns once every rank has entered the barrier (an empty allgather).
  void barrier() { (void)allgather({}); }

 private:
  // Every header field is a little-endian u64 (gdr::detail::store_le64).
  static constexpr std::uint64_t hello_magic = 0x3148'5244'4700'0001ull;    // rank -> root
  static constexpr std::uint64_t ack_magic = 0x314b'5244'4700'0001ull;      // root -> rank
  static constexpr std::uint64_t contrib_magic = 0x3141'5244'4700'0001ull;  // rank -> root
  static constexpr std::uint64_t result_magic = 0x3152'5244'4700'0001ull;   // root -> rank
  static constexpr std::uint64_t max_contribution = 256ull << 20;           // setup data, not payloads

  static std::uint64_t load(std::uint64_t raw) noexcept {
    return gdr::detail::load_le64(reinterpret_cast<const std::byte*>(&raw));
  }
  static void put(std::vector<std::byte>& out, std::uint64_t v) {
    std::byte b[8];
    gdr::detail::store_le64(b, v);
    out.insert(out.end(), b, b + 8);
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw error(errc::bootstrap_failed,
                "gdr::bootstrap::tcp_rendezvous (rank " + std::to_string(cfg_.rank) + " of " +
                    std::to_string(cfg_.world_size) + "): " + what);
  }
  void check(std::error_code ec, const std::string& what) const {
    if (!ec) return;
    std::string why = ec == errc::timed_out ? "no answer within " + std::to_string(cfg_.timeout.count()) + " ms"
                      : ec == errc::connection_lost ? "the connection was closed (did the process exit?)"
                                                    : ec.message();
    fail(what + ": " + why);
  }
  std::string root_name() const { return "at " + gdr::detail::sock::join_host_port(cfg_.root_host, cfg_.root_port); }

  void start_root(gdr::detail::sock::unique_fd handed) {
    auto deadline = gdr::detail::sock::clock::now() + cfg_.timeout;
    gdr::detail::sock::unique_fd listener = std::move(handed);
    if (listener) {
      check(gdr::detail::sock::set_nonblocking(listener.get()), "using the listening socket handed in");
    } else {
      check(gdr::detail::sock::listen_on(cfg_.root_host, cfg_.root_port, std::max(cfg_.world_size, 16), listener),
            "listening " + root_name());
    }
    std::string host;
    check(gdr::detail::sock::local_endpoint(listener.get(), host, port_), "reading the listening address");
    address_ = cfg_.root_host;
    peers_.resize(static_cast<std::size_t>(cfg_.world_size));
    int missing = cfg_.world_size - 1;
    while (missing > 0) {
      gdr::detail::sock::unique_fd c;
      std::error_code ec = gdr::detail::sock::accept_until(listener.get(), deadline, c);
      if (ec == errc::timed_out) {
        std::string who;
        for (int r = 1; r < cfg_.world_size; ++r)
          if (!peers_[static_cast<std::size_t>(r)]) who += (who.empty() ? "" : ", ") + std::to_string(r);
        fail("waited " + std::to_string(cfg_.timeout.count()) + " ms on port " + std::to_string(port_) + " for " +
             std::to_string(missing) + " of " + std::to_string(cfg_.world_size - 1) +
             " ranks to connect; missing: " + who);
      }
      check(ec, "accepting a connection");
      std::uint64_t h[2];
      // A silent or foreign client must not hold the root for long.
      auto hello_deadline = std::min(deadline, gdr::detail::sock::clock::now() + std::chrono::seconds(5));
      if (gdr::detail::sock::recv_all(c.get(), h, sizeof h, hello_deadline) || load(h[0]) != hello_magic)
        continue;  // not a gdr rank: drop it
      const std::uint64_t r = load(h[1]) & 0xffff'ffff, world = load(h[1]) >> 32;
      if (world != static_cast<std::uint64_t>(cfg_.world_size))
        fail("rank " + std::to_string(r) + " says the world has " + std::to_string(world) + " ranks, rank 0 says " +
             std::to_string(cfg_.world_size));
      if (r == 0 || r >= world) fail("a process connected claiming rank " + std::to_string(r));
      if (peers_[r]) fail("two processes claim rank " + std::to_string(r));
      std::vector<std::byte> ack;
      put(ack, ack_magic);
      put(ack, static_cast<std::uint64_t>(cfg_.world_size));
      check(gdr::detail::sock::send_all(c.get(), ack.data(), ack.size(), deadline), "greeting rank " + std::to_string(r));
      if (missing == cfg_.world_size - 1) {
        std::uint16_t unused;
        gdr::detail::sock::local_endpoint(c.get(), address_, unused);  // the root's address on the ranks' network
      }
      peers_[r] = std::move(c);
      --missing;
    }
  }

  void start_member() {
    auto deadline = gdr::detail::sock::clock::now() + cfg_.timeout;
    check(gdr::detail::sock::connect_retry(cfg_.root_host, cfg_.root_port, deadline, root_), "connecting to the root " + root_name());
    port_ = cfg_.root_port;
    std::uint16_t unused;
    check(gdr::detail::sock::local_endpoint(root_.get(), address_, unused), "reading the local address");
    std::vector<std::byte> hello;
    put(hello, hello_magic);
    put(hello, static_cast<std::uint64_t>(cfg_.rank) | static_cast<std::uint64_t>(cfg_.world_size) << 32);
    check(gdr::detail::sock::send_all(root_.get(), hello.data(), hello.size(), deadline), "greeting the root " + root_name());
    std::uint64_t h[2];
    check(gdr::detail::sock::recv_all(root_.get(), h, sizeof h, deadline),
          "waiting for the root " + root_name() + " to accept rank " + std::to_string(cfg_.rank));
    if (load(h[0]) != ack_magic || load(h[1]) != static_cast<std::uint64_t>(cfg_.world_size))
      fail("the process " + root_name() + " is not a gdr root for this job");
  }

  tcp_rendezvous_config cfg_;
  std::uint16_t port_ = 0;
  std::string address_;
  std::uint64_t seq_ = 0;
  gdr::detail::sock::unique_fd root_;                 // ranks > 0: the connection to rank 0
  std::vector<gdr::detail::sock::unique_fd> peers_;  // rank 0: peers_[r], the connection to rank r
};

static_assert(rendezvous<tcp_rendezvous>);

}  // namespace gdr::bootstrap
