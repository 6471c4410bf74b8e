/// \file
/// `gdr::bootstrap::tcp_rendezvous`: processes find each other through rank
/// 0's TCP address. Rank 0 listens; every other rank connects, says hello
/// (its rank, the world size and the job id) and keeps the connection for
/// `allgather` and `barrier`, which go through rank 0 (a star: fine for
/// setup data, a few kilobytes per rank).
///
/// \code
///   // GDR_ROOT=10.0.0.1:29500 GDR_RANK=2 GDR_WORLD_SIZE=4 GDR_JOB_ID=run-17 ./app
///   auto rv = gdr::bootstrap::tcp_rendezvous::from_env();
///   auto all = rv.allgather(my_bytes);   // all[r]: rank r's bytes
///   rv.barrier();
/// \endcode
///
/// Blocking, on purpose: this runs once, before any scheduler, so it uses
/// plain sockets with `poll` timeouts rather than io_uring. Every wait is
/// bounded by `config::timeout`; when a rank never shows up, dies, or sends
/// something else, the call throws `gdr::error` with
/// `errc::bootstrap_failed` and says which rank and which step.
///
/// The root waits on every connection at once (`poll`): it takes hellos in
/// whatever order they come, each connection that has not said hello is
/// dropped after 5 s of its own, so a few silent or foreign connections to
/// the root's port never hold the others up; a connection that is not a gdr
/// rank is dropped and does not count. In a collective the root reads every
/// rank's contribution as it arrives; when its deadline passes it names
/// every rank still missing (or the rank whose connection closed) and the
/// step, and sends that sentence to every other rank, which throws it too:
/// each rank's error names the rank that did not arrive, not only the root's.
///
/// The job id. Each hello carries the job id (`tcp_rendezvous_config::job_id`:
/// `GDR_JOB_ID`, else the launcher's own: Slurm's job and step, Open MPI's
/// or PMIx's namespace). The root refuses a hello of another job with a
/// sentence naming both ids, and goes on waiting: a stale process of an
/// earlier run that reaches a new root's port (same host and port, a
/// restarted job) fails alone, with that sentence, instead of taking a
/// rank's place or aborting the new job. Where nothing sets one, every rank
/// has the empty id and such a process cannot be told apart; a launcher
/// without a job id of its own can make one with `new_job_id()` and pass it
/// in `GDR_JOB_ID` beside `GDR_ROOT`.
///
/// Thread-safety: one thread at a time per object. Collective calls must be
/// made by every rank in the same order.
#pragma once

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gdr/bootstrap/detail/blocking_socket.hpp>
#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/remote_view.hpp>  // detail::store_le64 / load_le64

namespace gdr::bootstrap {

/// Where rank 0 is, who this process is, and which job it belongs to.
struct tcp_rendezvous_config {
  /// Rank 0's host (numeric or a name) and port. Rank 0 binds it; port 0
  /// there means any free port (read it back with `port()`).
  std::string root_host = "127.0.0.1";
  std::uint16_t root_port = 0;
  /// This process's rank, in `[0, world_size)`.
  int rank = -1;
  /// Number of processes.
  int world_size = 0;
  /// The job this process belongs to: the root accepts only hellos of its
  /// own job id (see the file comment). At most `max_job_id` bytes; empty
  /// matches only empty.
  std::string job_id{};
  /// Bound on every wait: connecting, the hellos, each collective.
  std::chrono::milliseconds timeout{30'000};
  /// Rank 0 only: an already-listening socket to use instead of binding
  /// (a launcher that picked a free port itself). Taken over and closed.
  int listen_fd = -1;

  /// The longest job id a hello carries.
  static constexpr std::size_t max_job_id = 256;

  /// Reads `GDR_ROOT=host:port`, `GDR_RANK`, `GDR_WORLD_SIZE`, and the
  /// optional `GDR_JOB_ID` and `GDR_BOOTSTRAP_TIMEOUT_MS`. Rank and size fall
  /// back to what launchers set (`OMPI_COMM_WORLD_RANK`/`_SIZE`,
  /// `PMI_RANK`/`PMI_SIZE`, `SLURM_PROCID`/`SLURM_NTASKS`), the job id to
  /// `SLURM_JOB_ID` (with `.SLURM_STEP_ID`), `OMPI_MCA_ess_base_jobid`, then
  /// `PMIX_NAMESPACE`. Fails with `errc::invalid_argument` when something is
  /// missing or malformed.
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
    try {
      c.job_id = job_id_from_env();
    } catch (...) {
      return errno_code(ENOMEM);
    }
    if (c.job_id.size() > max_job_id) return errc::invalid_argument;
    return c;
  }

  /// The job id the environment gives (see `from_env`), or empty.
  static std::string job_id_from_env() {
    auto var = [](const char* n) -> std::string {
      const char* v = std::getenv(n);
      return v != nullptr ? v : "";
    };
    if (std::string v = var("GDR_JOB_ID"); !v.empty()) return v;
    if (std::string v = var("SLURM_JOB_ID"); !v.empty()) {
      std::string step = var("SLURM_STEP_ID");
      return "slurm:" + v + (step.empty() ? "" : "." + step);
    }
    if (std::string v = var("OMPI_MCA_ess_base_jobid"); !v.empty()) return "ompi:" + v;
    if (std::string v = var("PMIX_NAMESPACE"); !v.empty()) return "pmix:" + v;
    return {};
  }

  /// A fresh random job id (16 hex digits), for a launcher that has none
  /// of its own: pass it to every rank in `GDR_JOB_ID`.
  static std::string new_job_id() {
    std::uint64_t x = 0;
    if (::getrandom(&x, sizeof x, 0) != static_cast<ssize_t>(sizeof x))
      x = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
    static constexpr char hex[] = "0123456789abcdef";
    std::string s(16, '0');
    for (int i = 0; i < 16; ++i) s[static_cast<std::size_t>(i)] = hex[(x >> (60 - 4 * i)) & 0xf];
    return s;
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
  /// `errc::invalid_argument` for a bad rank, size or job id).
  explicit tcp_rendezvous(tcp_rendezvous_config cfg) : cfg_(std::move(cfg)) {
    gdr::detail::sock::unique_fd handed(cfg_.listen_fd);
    cfg_.listen_fd = -1;
    if (cfg_.world_size <= 0 || cfg_.rank < 0 || cfg_.rank >= cfg_.world_size)
      throw error(errc::invalid_argument, "gdr::bootstrap::tcp_rendezvous: rank " + std::to_string(cfg_.rank) +
                                               " is not in [0, " + std::to_string(cfg_.world_size) + ")");
    if (cfg_.job_id.size() > tcp_rendezvous_config::max_job_id)
      throw error(errc::invalid_argument, "gdr::bootstrap::tcp_rendezvous: the job id is longer than " +
                                               std::to_string(tcp_rendezvous_config::max_job_id) + " bytes");
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
                  "gdr::bootstrap::tcp_rendezvous: set GDR_ROOT=host:port, GDR_RANK and GDR_WORLD_SIZE "
                  "(and GDR_JOB_ID, at most 256 bytes)");
    return tcp_rendezvous(std::move(*c));
  }

  tcp_rendezvous(tcp_rendezvous&&) noexcept = default;
  tcp_rendezvous& operator=(tcp_rendezvous&&) noexcept = default;

  int rank() const noexcept { return cfg_.rank; }
  int size() const noexcept { return cfg_.world_size; }
  /// The job id every rank of this job shares.
  const std::string& job_id() const noexcept { return cfg_.job_id; }
  /// The root's port (useful when rank 0 bound port 0).
  std::uint16_t port() const noexcept { return port_; }
  /// This process's address on the interface that reaches the root (what
  /// peers on that network can connect to).
  std::string address_hint() const { return address_; }

  /// Every rank's `mine`, indexed by rank. Collective; blocks up to the
  /// timeout. `step` names the collective in errors (every rank should pass
  /// the same; empty: "allgather #N"). Throws
  /// `gdr::error(errc::bootstrap_failed)` naming the rank that failed and
  /// the step.
  std::vector<std::vector<std::byte>> allgather(std::span<const std::byte> mine, std::string_view step = {}) {
    ++seq_;
    const std::string what = step_name(step);
    auto deadline = gdr::detail::sock::clock::now() + cfg_.timeout;
    std::vector<std::vector<std::byte>> all(static_cast<std::size_t>(cfg_.world_size));
    all[static_cast<std::size_t>(cfg_.rank)].assign(mine.begin(), mine.end());
    if (cfg_.rank == 0) {
      gather_at_root(all, what, deadline);
      // One message for everyone: header, every length, every contribution.
      std::vector<std::byte> out;
      put(out, result_magic);
      put(out, seq_);
      for (auto& v : all) put(out, v.size());
      for (auto& v : all) out.insert(out.end(), v.begin(), v.end());
      for (int r = 1; r < cfg_.world_size; ++r) {
        auto& p = peers_[static_cast<std::size_t>(r)];
        if (std::error_code ec = gdr::detail::sock::send_all(p.get(), out.data(), out.size(), deadline)) {
          p.reset();
          abort_all("rank " + std::to_string(r) + " left after contributing to " + what + " (" +
                    (ec == errc::connection_lost ? std::string("its connection closed") : ec.message()) + ")");
        }
      }
      return all;
    }
    const int fd = root_.get();
    const std::string with_root = what + " with the root " + root_name();
    std::vector<std::byte> head;
    put(head, contrib_magic);
    put(head, seq_);
    put(head, mine.size());
    std::error_code sent = gdr::detail::sock::send_all(fd, head.data(), head.size(), deadline);
    if (!sent) sent = gdr::detail::sock::send_all(fd, mine.data(), mine.size(), deadline);
    if (sent) {
      // The root may have given up already and said why before closing.
      std::uint64_t a[2];
      const auto soon = gdr::detail::sock::clock::now() + std::chrono::milliseconds(200);
      if (!gdr::detail::sock::recv_all(fd, a, sizeof a, soon) && load(a[0]) == abort_magic)
        fail(with_root + ": the root gave up: " + read_text(fd, load(a[1]), soon));
      check(sent, with_root);
    }
    std::uint64_t h[2];
    // The root's own deadline passes first when a rank is missing, and it
    // then says which: wait a little longer than it does.
    const auto until = deadline + member_grace;
    check(gdr::detail::sock::recv_all(fd, h, sizeof h, until), with_root,
          " (the root waits for every rank's contribution; its error names those missing)");
    if (load(h[0]) == abort_magic) fail(with_root + ": the root gave up: " + read_text(fd, load(h[1]), until));
    if (load(h[0]) != result_magic || load(h[1]) != seq_) fail(with_root + ": malformed result");
    std::vector<std::uint64_t> lens(static_cast<std::size_t>(cfg_.world_size));
    check(gdr::detail::sock::recv_all(fd, lens.data(), lens.size() * 8, until), with_root);
    for (std::size_t r = 0; r < all.size(); ++r) {
      std::uint64_t n = load(lens[r]);
      if (n > max_contribution) fail(with_root + ": malformed result");
      if (r == static_cast<std::size_t>(cfg_.rank)) {
        std::vector<std::byte> echo(n);
        check(gdr::detail::sock::recv_all(fd, echo.data(), n, until), with_root);
        continue;
      }
      all[r].resize(n);
      check(gdr::detail::sock::recv_all(fd, all[r].data(), n, until), with_root);
    }
    return all;
  }

  /// Returns once every rank has entered the barrier (an empty allgather);
  /// `step` as for `allgather`.
  void barrier(std::string_view step = {}) { (void)allgather({}, step); }

 private:
  // Every header field is a little-endian u64 (gdr::detail::store_le64).
  // Version 2 of the hello carries the job id; a version-1 hello (an older
  // gdr) is not one of ours and is dropped like any foreign client.
  static constexpr std::uint64_t hello_magic = 0x3148'5244'4700'0002ull;    // rank -> root
  static constexpr std::uint64_t ack_magic = 0x314b'5244'4700'0001ull;      // root -> rank
  static constexpr std::uint64_t refuse_magic = 0x3158'5244'4700'0001ull;   // root -> a process of another job
  static constexpr std::uint64_t contrib_magic = 0x3141'5244'4700'0001ull;  // rank -> root
  static constexpr std::uint64_t result_magic = 0x3152'5244'4700'0001ull;   // root -> rank
  static constexpr std::uint64_t abort_magic = 0x3158'4252'4700'0001ull;    // root -> rank: the sentence why
  static constexpr std::uint64_t max_contribution = 256ull << 20;           // setup data, not payloads
  static constexpr std::uint64_t max_text = 64 * 1024;                      // a refusal's or an abort's sentence
  // How long the root waits for a connection to say hello, on its own clock.
  static constexpr std::chrono::seconds hello_bound{5};
  // How much longer than the root a rank waits for a collective's result.
  static constexpr std::chrono::seconds member_grace{2};

  static std::uint64_t load(std::uint64_t raw) noexcept {
    return gdr::detail::load_le64(reinterpret_cast<const std::byte*>(&raw));
  }
  static std::uint64_t load_at(const std::byte* p) noexcept { return gdr::detail::load_le64(p); }
  static void put(std::vector<std::byte>& out, std::uint64_t v) {
    std::byte b[8];
    gdr::detail::store_le64(b, v);
    out.insert(out.end(), b, b + 8);
  }
  static void put_text(std::vector<std::byte>& out, std::string_view s) {
    auto b = std::as_bytes(std::span(s.data(), s.size()));
    out.insert(out.end(), b.begin(), b.end());
  }
  static std::string ranks_list(const std::vector<int>& ranks) {
    std::string s = ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (i == 12 && ranks.size() > 13) return s + " and " + std::to_string(ranks.size() - i) + " more";
      s += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
    }
    return s;
  }

  std::string step_name(std::string_view step) const {
    return step.empty() ? "allgather #" + std::to_string(seq_) : std::string(step);
  }
  std::string prefix() const {
    return "gdr::bootstrap::tcp_rendezvous (rank " + std::to_string(cfg_.rank) + " of " +
           std::to_string(cfg_.world_size) + (cfg_.job_id.empty() ? "" : ", job " + quoted(cfg_.job_id)) + "): ";
  }
  static std::string quoted(const std::string& s) { return "'" + s + "'"; }

  [[noreturn]] void fail(const std::string& what) const { throw error(errc::bootstrap_failed, prefix() + what); }
  void check(std::error_code ec, const std::string& what, const char* hint = "") const {
    if (!ec) return;
    std::string why = ec == errc::timed_out ? "no answer within " + std::to_string(cfg_.timeout.count()) + " ms" + hint
                      : ec == errc::connection_lost ? "the connection was closed (did the process exit?)"
                                                    : ec.message();
    fail(what + ": " + why);
  }
  std::string root_name() const { return "at " + gdr::detail::sock::join_host_port(cfg_.root_host, cfg_.root_port); }

  /// A sentence of `n` bytes that follows a refusal or an abort header.
  std::string read_text(int fd, std::uint64_t n, gdr::detail::sock::clock::time_point deadline) const {
    if (n > max_text) return "(a sentence too long to read)";
    std::string s(static_cast<std::size_t>(n), '\0');
    if (gdr::detail::sock::recv_all(fd, s.data(), s.size(), deadline)) return "(the sentence was cut off)";
    return s;
  }

  /// Tells every rank still connected why the root gives up (best effort,
  /// briefly), then throws the same sentence here.
  [[noreturn]] void abort_all(const std::string& why) {
    std::vector<std::byte> out;
    const std::string text = prefix() + why;
    put(out, abort_magic);
    put(out, text.size());
    put_text(out, text);
    const auto deadline = gdr::detail::sock::clock::now() + std::chrono::milliseconds(500);
    for (auto& p : peers_)
      if (p) (void)gdr::detail::sock::send_all(p.get(), out.data(), out.size(), deadline);
    fail(why);
  }

  /// Reads what is there of `[p + got, p + n)` without blocking. Returns
  /// false when the peer closed or failed (`ec` says which).
  static bool read_some(int fd, std::byte* p, std::size_t n, std::size_t& got, std::error_code& ec) noexcept {
    while (got < n) {
      ssize_t k = ::recv(fd, p + got, n - got, MSG_DONTWAIT);
      if (k > 0) {
        got += static_cast<std::size_t>(k);
        continue;
      }
      if (k == 0) {
        ec = errc::connection_lost;
        return false;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      ec = errno == ECONNRESET ? std::error_code(errc::connection_lost) : errno_code(errno);
      return false;
    }
    return true;
  }

  /// The root's half of a collective: every rank's contribution, read as it
  /// arrives from any rank.
  void gather_at_root(std::vector<std::vector<std::byte>>& all, const std::string& what,
                      gdr::detail::sock::clock::time_point deadline) {
    struct partial {
      std::byte head[24];
      std::size_t head_got = 0;
      std::size_t got = 0;
      bool done = false;
    };
    const auto n = static_cast<std::size_t>(cfg_.world_size);
    std::vector<partial> st(n);
    std::size_t left = n - 1;
    std::vector<pollfd> fds;
    std::vector<std::size_t> who;
    while (left > 0) {
      fds.clear();
      who.clear();
      for (std::size_t r = 1; r < n; ++r)
        if (!st[r].done) {
          fds.push_back(pollfd{peers_[r].get(), POLLIN, 0});
          who.push_back(r);
        }
      int rc = ::poll(fds.data(), fds.size(), gdr::detail::sock::remaining_ms(deadline));
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) abort_all(what + ": poll: " + errno_code(errno).message());
      if (rc == 0) {
        std::vector<int> missing;
        for (std::size_t r : who) missing.push_back(static_cast<int>(r));
        abort_all(ranks_list(missing) + " did not contribute to " + what + " within " +
                  std::to_string(cfg_.timeout.count()) + " ms");
      }
      for (std::size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        const std::size_t r = who[i];
        partial& p = st[r];
        std::error_code ec;
        const int fd = peers_[r].get();
        const std::string whose = "rank " + std::to_string(r);
        if (p.head_got < sizeof p.head) {
          if (!read_some(fd, p.head, sizeof p.head, p.head_got, ec)) {
            peers_[r].reset();
            abort_all(whose + " left during " + what + " (" +
                      (ec == errc::connection_lost ? std::string("its connection closed") : ec.message()) + ")");
          }
          if (p.head_got < sizeof p.head) continue;
          if (load_at(p.head) != contrib_magic || load_at(p.head + 8) != seq_ || load_at(p.head + 16) > max_contribution)
            abort_all(whose + " sent a malformed contribution to " + what + " (mismatched collective calls?)");
          all[r].resize(load_at(p.head + 16));
        }
        if (!read_some(fd, all[r].data(), all[r].size(), p.got, ec)) {
          peers_[r].reset();
          abort_all(whose + " left during " + what + " (its connection closed)");
        }
        if (p.got == all[r].size()) {
          p.done = true;
          --left;
        }
      }
    }
  }

  void start_root(gdr::detail::sock::unique_fd handed) {
    using gdr::detail::sock::clock;
    auto deadline = clock::now() + cfg_.timeout;
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

    // Connections that have not finished their hello, each on its own clock.
    struct pending {
      gdr::detail::sock::unique_fd fd;
      clock::time_point until;
      std::byte head[24];
      std::size_t got = 0;
      std::string job;
      std::size_t job_got = 0;
    };
    std::vector<pending> waiting;
    int missing = cfg_.world_size - 1;
    std::vector<pollfd> fds;
    while (missing > 0) {
      const auto now = clock::now();
      // Drop the connections whose hello is overdue.
      std::erase_if(waiting, [&](const pending& p) { return p.until <= now; });
      fds.clear();
      fds.push_back(pollfd{listener.get(), POLLIN, 0});
      auto wake = deadline;
      for (const auto& p : waiting) {
        fds.push_back(pollfd{p.fd.get(), POLLIN, 0});
        wake = std::min(wake, p.until);
      }
      int rc = ::poll(fds.data(), fds.size(), gdr::detail::sock::remaining_ms(wake));
      if (rc < 0 && errno != EINTR) abort_all("waiting for the ranks to connect: poll: " + errno_code(errno).message());
      if (clock::now() >= deadline) {
        std::vector<int> absent;
        for (int r = 1; r < cfg_.world_size; ++r)
          if (!peers_[static_cast<std::size_t>(r)]) absent.push_back(r);
        std::string who;
        for (int r : absent) who += (who.empty() ? "" : ", ") + std::to_string(r);
        abort_all("waited " + std::to_string(cfg_.timeout.count()) + " ms on port " + std::to_string(port_) + " for " +
                  std::to_string(missing) + " of " + std::to_string(cfg_.world_size - 1) +
                  " ranks to connect; missing: " + who);
      }
      if (rc <= 0) continue;
      // Hellos first (the vector changes below), in reverse so that erasing is cheap.
      for (std::size_t i = fds.size(); i-- > 1;) {
        if (fds[i].revents == 0) continue;
        pending& p = waiting[i - 1];
        if (hello_step(p.fd, p.head, p.got, p.job, p.job_got, missing, deadline)) waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i - 1));
      }
      if (fds[0].revents != 0) {
        for (;;) {
          gdr::detail::sock::unique_fd c;
          std::error_code ec = gdr::detail::sock::accept_until(listener.get(), clock::now(), c);
          if (ec == errc::timed_out) break;  // nothing more queued
          if (ec) abort_all("accepting a connection: " + ec.message());
          pending p;
          p.fd = std::move(c);
          p.until = std::min(deadline, clock::now() + hello_bound);
          waiting.push_back(std::move(p));
        }
      }
    }
  }

  /// Advances one connection's hello. Returns true when the connection is
  /// finished with: taken as a rank, refused, or dropped.
  bool hello_step(gdr::detail::sock::unique_fd& c, std::byte (&head)[24], std::size_t& got, std::string& job,
                  std::size_t& job_got, int& missing, gdr::detail::sock::clock::time_point deadline) {
    std::error_code ec;
    if (got < sizeof head) {
      if (!read_some(c.get(), head, sizeof head, got, ec)) return true;  // gone: not a rank of ours
      if (got >= 8 && load_at(head) != hello_magic) return true;        // not a gdr rank: drop it
      if (got < sizeof head) return false;
      if (load_at(head + 16) > tcp_rendezvous_config::max_job_id) return true;
      job.assign(static_cast<std::size_t>(load_at(head + 16)), '\0');
    }
    if (!read_some(c.get(), reinterpret_cast<std::byte*>(job.data()), job.size(), job_got, ec)) return true;
    if (job_got < job.size()) return false;
    const std::uint64_t r = load_at(head + 8) & 0xffff'ffff, world = load_at(head + 8) >> 32;
    if (job != cfg_.job_id) {
      // A process of another job (a stale one of an earlier run, or a
      // launcher that set GDR_JOB_ID differently): it fails, not this job.
      std::string why = "refused by the root " + root_name() + ": it serves job " + quoted(cfg_.job_id) +
                        " and this process is of job " + quoted(job) +
                        " (a process of an earlier run? every rank needs the same GDR_JOB_ID)";
      std::vector<std::byte> out;
      put(out, refuse_magic);
      put(out, why.size());
      put_text(out, why);
      (void)gdr::detail::sock::send_all(c.get(), out.data(), out.size(),
                                        gdr::detail::sock::clock::now() + std::chrono::milliseconds(500));
      return true;
    }
    // A process of this job that contradicts the root: the job cannot form.
    // It hears why too, as every rank already greeted does.
    auto give_up = [&](const std::string& why) {
      peers_.push_back(std::move(c));
      abort_all(why);
    };
    if (world != static_cast<std::uint64_t>(cfg_.world_size))
      give_up("rank " + std::to_string(r) + " says the world has " + std::to_string(world) + " ranks, rank 0 says " +
              std::to_string(cfg_.world_size));
    if (r == 0 || r >= world) give_up("a process connected claiming rank " + std::to_string(r));
    if (peers_[r]) give_up("two processes claim rank " + std::to_string(r));
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
    return true;
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
    put(hello, cfg_.job_id.size());
    put_text(hello, cfg_.job_id);
    check(gdr::detail::sock::send_all(root_.get(), hello.data(), hello.size(), deadline), "greeting the root " + root_name());
    std::uint64_t h[2];
    check(gdr::detail::sock::recv_all(root_.get(), h, sizeof h, deadline),
          "waiting for the root " + root_name() + " to accept rank " + std::to_string(cfg_.rank));
    if (load(h[0]) == refuse_magic) fail(read_text(root_.get(), load(h[1]), deadline));
    if (load(h[0]) == abort_magic) fail("the root gave up: " + read_text(root_.get(), load(h[1]), deadline));
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
