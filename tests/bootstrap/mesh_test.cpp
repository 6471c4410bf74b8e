// gdr/bootstrap/mesh.hpp: ranks in forked processes on 127.0.0.1 build a
// mesh (shared memory between them, since they share a node; TCP when told
// so) through the TCP rendezvous and exchange checksummed messages; a
// rank that fails is named, with the step, by every other rank; processes
// that connect to a rank's listener and are no rank of the mesh are closed
// and hold nobody up.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/tcp_rendezvous.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/transport/shm/connect.hpp>

#include "tests/bootstrap/exchange.hpp"
#include "tests/bootstrap/multiprocess.hpp"

using namespace std::chrono_literals;
namespace bs = gdr::bootstrap;

namespace {

bs::tcp_rendezvous join(int rank, int world, std::uint16_t port, int listen_fd, std::chrono::milliseconds timeout = 20s) {
  bs::tcp_rendezvous_config c;
  c.root_port = port;
  c.rank = rank;
  c.world_size = world;
  c.timeout = timeout;
  c.listen_fd = rank == 0 ? listen_fd : -1;
  if (rank != 0) ::close(listen_fd);
  return bs::tcp_rendezvous(c);
}

bs::mesh_options short_timeouts(std::chrono::milliseconds t) {
  bs::mesh_options o;
  o.timeout = t;
  return o;
}

// Builds the mesh, which must fail with bootstrap_failed and a message that
// holds every one of `says`.
gdr_test::rank_exit fails_naming(gdr::scheduler& sched, bs::tcp_rendezvous& rv, const bs::mesh_options& o,
                 std::initializer_list<const char*> says) {
  try {
    gdr::sync_wait(sched, bs::connect_mesh(sched, rv, o));
  } catch (const gdr::error& e) {
    bool all = e.code() == gdr::errc::bootstrap_failed;
    for (const char* s : says) all = all && std::strstr(e.what(), s) != nullptr;
    if (all) return gdr_test::rank_bootstrap_failed;
    std::fprintf(stderr, "rank %d: unexpected: %s\n", rv.rank(), e.what());
    return gdr_test::rank_failed;
  }
  std::fprintf(stderr, "rank %d: the mesh was built\n", rv.rank());
  return gdr_test::rank_failed;
}

}  // namespace

TEST_CASE("four ranks build a mesh and every pair exchanges checksummed messages both ways") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int world = 4;
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, world, port, lfd);
    gdr::scheduler sched;
    int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      bs::mesh m = co_await bs::connect_mesh(sched, rv);
      co_return co_await gdr_test::check_mesh(m, rv, rank, world);
    }());
    sched.drain();
    return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
}

TEST_CASE("ranks of one node are joined by shared memory, or by TCP when the options say so") {
  for (bool shm : {true, false}) {
    CAPTURE(shm);
    std::uint16_t port = 0;
    int lfd = gdr_test::listen_loopback(port);
    REQUIRE(lfd >= 0);
    constexpr int world = 3;
    auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
      bs::tcp_rendezvous rv = join(rank, world, port, lfd);
      gdr::scheduler sched;
      bs::mesh_options o;
      if (!shm) o.same_node = bs::same_node_transport::tcp;
      int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
        bs::mesh m = co_await bs::connect_mesh(sched, rv, o);
        int wrong = 0;
        for (int p = 0; p < world; ++p) {
          if (p == rank) continue;
          // "pid N (shared memory)" or "127.0.0.1:port"
          const bool via_shm = m.peer(p).peer_name().find("shared memory") != std::string::npos;
          if (via_shm != shm) {
            std::fprintf(stderr, "rank %d: peer %d is %s\n", rank, p, m.peer(p).peer_name().c_str());
            ++wrong;
          }
        }
        wrong += co_await gdr_test::check_mesh(m, rv, rank, world);
        co_return wrong;
      }());
      sched.drain();
      return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
    });
    ::close(lfd);
    CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
  }
}

TEST_CASE("a mesh of one rank has no peers") {
  bs::tcp_rendezvous_config c;
  c.rank = 0;
  c.world_size = 1;
  bs::tcp_rendezvous rv(c);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    bs::mesh m = co_await bs::connect_mesh(sched, rv);
    CHECK(m.size() == 1);
    CHECK(!m.peer(0).is_open());
    co_await m.close();
  }());
}

TEST_CASE("a rank that leaves before the mesh makes every other rank fail within the timeout, naming it") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto t0 = std::chrono::steady_clock::now();
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(3), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 3, port, lfd, 3s);
    if (rank == 2) return gdr_test::rank_ok;  // joins the rendezvous, never the mesh
    gdr::scheduler sched;
    return fails_naming(sched, rv, short_timeouts(3s), {"rank 2 left during connect_mesh step 1 (introductions)"});
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{gdr_test::rank_bootstrap_failed, gdr_test::rank_bootstrap_failed, gdr_test::rank_ok});
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
}

TEST_CASE("a rank that stays but never builds the mesh is named, with the step, by every other rank") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(4), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 4, port, lfd, 1500ms);
    if (rank == 2) {  // alive, silent
      std::this_thread::sleep_for(5s);
      return gdr_test::rank_ok;
    }
    gdr::scheduler sched;
    return fails_naming(sched, rv, short_timeouts(1500ms),
                        {"step 1 (introductions)", "rank 2 did not contribute to connect_mesh step 1 (introductions)"});
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{gdr_test::rank_bootstrap_failed, gdr_test::rank_bootstrap_failed, gdr_test::rank_ok,
                                  gdr_test::rank_bootstrap_failed});
}

TEST_CASE("a rank that publishes an address but never connects nor accepts is named in step 3 by every other rank") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto t0 = std::chrono::steady_clock::now();
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(4), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 4, port, lfd, 10s);
    if (rank == 2) {
      // Takes part in the collectives as a mesh rank would, but its
      // published port is a socket nobody accepts on.
      std::uint16_t dead_port = 0;
      int dead = gdr_test::listen_loopback(dead_port);
      std::vector<std::byte> intro(8, std::byte{1});
      (void)rv.allgather(intro);
      const std::string where = "127.0.0.1:" + std::to_string(dead_port);
      (void)rv.allgather(std::as_bytes(std::span(where)));
      auto outcomes = rv.allgather({});
      ::close(dead);
      return outcomes.size() == 4 ? gdr_test::rank_ok : gdr_test::rank_failed;
    }
    gdr::scheduler sched;
    // The lower ranks cannot greet it; the higher one waits for it to connect.
    const char* says = rank < 2 ? "step 3 (connections): within 1500 ms, rank 2 did not answer"
                                : "step 3 (connections): within 1500 ms, rank 2 did not connect";
    return fails_naming(sched, rv, short_timeouts(1500ms), {says});
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>{gdr_test::rank_bootstrap_failed, gdr_test::rank_bootstrap_failed, gdr_test::rank_ok,
                                  gdr_test::rank_bootstrap_failed});
  CHECK(std::chrono::steady_clock::now() - t0 < 20s);
}

TEST_CASE("twelve ranks build a mesh with at most two connections of each under way") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int world = 12;
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, world, port, lfd);
    gdr::scheduler sched;
    bs::mesh_options o;
    o.max_connects_in_flight = 2;
    int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      bs::mesh m = co_await bs::connect_mesh(sched, rv, o);
      co_return co_await gdr_test::check_mesh(m, rv, rank, world);
    }());
    sched.drain();
    return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
}

TEST_CASE("a rank that cannot listen makes every rank fail with its reason") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(3), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 3, port, lfd, 5s);
    gdr::scheduler sched;
    bs::mesh_options o = short_timeouts(5s);
    if (rank == 1) o.listen_host = "not-an-address";
    try {
      gdr::sync_wait(sched, bs::connect_mesh(sched, rv, o));
    } catch (const gdr::error& e) {
      // Every rank names rank 1 (rank 1 names its address).
      const bool names_it = std::strstr(e.what(), rank == 1 ? "not-an-address" : "rank 1") != nullptr;
      if (e.code() == gdr::errc::bootstrap_failed && names_it) return gdr_test::rank_bootstrap_failed;
      std::fprintf(stderr, "rank %d: unexpected: %s\n", rank, e.what());
      return gdr_test::rank_failed;
    }
    return gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(3, gdr_test::rank_bootstrap_failed));
}

namespace {

// TCP, but every connect fails with a gdr::error whose words say more than
// its code (as a verbs connect names its rdma_cm step).
struct wordy_net : bs::detail::tcp_net {
  gdr::task<gdr::result<gdr::tcp::endpoint>> connect(const std::string&, std::chrono::milliseconds) {
    throw gdr::error(gdr::errc::invalid_argument, "the transport's own words");
    co_return gdr::errc::invalid_argument;
  }
};

}  // namespace

TEST_CASE("a connection that fails with a transport's words fails step 3 with those words") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(2), 60s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, 2, port, lfd, 10s);
    gdr::scheduler sched;
    bs::mesh_options o = short_timeouts(2s);
    wordy_net net{{&sched, &o}};
    bs::detail::mesh_limits lim;
    lim.timeout = o.timeout;
    try {
      gdr::sync_wait(sched, bs::detail::build_mesh(rv, "127.0.0.1", lim, net));
    } catch (const gdr::error& e) {
      // Rank 0 connects to rank 1 and says what the transport said (before:
      // only the code's message, "invalid argument"); rank 1 names rank 0.
      const bool ok = rank == 0 ? std::strstr(e.what(), "step 3 (connections): connecting to rank 1 at 127.0.0.1:") &&
                                      std::strstr(e.what(), "the transport's own words")
                                : std::strstr(e.what(), "rank 0") != nullptr;
      if (e.code() == gdr::errc::bootstrap_failed && ok) return gdr_test::rank_bootstrap_failed;
      std::fprintf(stderr, "rank %d: unexpected: %s\n", rank, e.what());
      return gdr_test::rank_failed;
    }
    return gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(2, gdr_test::rank_bootstrap_failed));
}

namespace {

// A process that connects to a rank's listener during connect_mesh and is
// not a rank of the mesh: `silent` connects and says nothing; `other_job`
// is a gdr peer (the transport's handshake done) whose hello carries
// another session id (a rank of another job); `wrong_rank` one whose hello
// has the mesh's session but names the rank it connects to (no rank greets
// itself). Forked before the rank makes its scheduler; told where to
// connect once the rank has published its address (`start`), it says when
// it has connected, then waits, bounded, for the rank to end the
// connection. Its exit status: 0 if the rank closed it, 1 if not.
enum class stray_kind { silent, other_job, wrong_rank };

class stray {
 public:
  stray(stray_kind k, bool shm) : kind_(k), shm_(shm) {
    int down[2], up[2];
    REQUIRE(::pipe2(down, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(up, O_CLOEXEC) == 0);
    std::fflush(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(down[1]);
      ::close(up[0]);
      ::_exit(run(down[0], up[1]));
    }
    ::close(down[0]);
    ::close(up[1]);
    to_ = down[1];
    from_ = up[0];
  }
  stray(const stray&) = delete;
  stray& operator=(const stray&) = delete;
  ~stray() {
    ::close(to_);
    ::close(from_);
    if (pid_ > 0) (void)gdr_test::wait_or_kill(pid_, std::chrono::steady_clock::now());
  }

  /// Connects it to `published` (what the rank published: "tcp|shm|node",
  /// or a TCP address); returns once it has connected.
  bool start(const std::string& published, std::uint64_t session, int size, int rank) {
    const std::string line = published + " " + std::to_string(session) + " " + std::to_string(size) + " " +
                             std::to_string(rank) + "\n";
    if (::write(to_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return false;
    pollfd p{from_, POLLIN, 0};
    char ack = 0;
    return ::poll(&p, 1, 10'000) == 1 && ::read(from_, &ack, 1) == 1 && ack == 'c';
  }
  /// Its exit status, waiting at most `t`.
  int wait(std::chrono::milliseconds t) {
    const int code = gdr_test::wait_or_kill(pid_, std::chrono::steady_clock::now() + t);
    pid_ = -1;
    return code;
  }

 private:
  int run(int in, int out) {
    std::string line;
    for (char c = 0; c != '\n';) {
      pollfd p{in, POLLIN, 0};
      if (::poll(&p, 1, 30'000) != 1 || ::read(in, &c, 1) != 1) return 3;
      line += c;
    }
    char where[512] = {};
    unsigned long long session = 0;
    int size = 0, rank = 0;
    if (std::sscanf(line.c_str(), "%511s %llu %d %d", where, &session, &size, &rank) != 4) return 3;
    const std::string published = where;
    gdr::detail::unique_fd fd;
    if (shm_) {
      const auto a = published.find('|'), b = published.find('|', a + 1);
      socklen_t len = 0;
      sockaddr_un to = gdr::detail::shm::unix_address(published.substr(a + 1, b - a - 1), len);
      fd.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (!fd || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&to), len) != 0) return 3;
    } else {
      std::string host;
      std::uint16_t port = 0;
      if (gdr::detail::sock::split_host_port(published.substr(0, published.find('|')), host, port) ||
          gdr::detail::sock::connect_retry(host, port, std::chrono::steady_clock::now() + 10s, fd))
        return 3;
    }
    if (::write(out, "c", 1) != 1) return 3;
    if (kind_ == stray_kind::silent) {
      // Reads what the rank's side says (its transport's hello), until the
      // end of the stream or a reset, within the bound.
      const auto until = std::chrono::steady_clock::now() + 20s;
      for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
        pollfd p{fd.get(), POLLIN, 0};
        if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) != 1) return 1;
        char b[256];
        if (::recv(fd.get(), b, sizeof b, 0) <= 0) return 0;
      }
    }
    const std::uint64_t s = kind_ == stray_kind::other_job ? session ^ 0x5a5a : session;
    const auto hello = bs::detail::mesh_hello(s, rank, size);  // wrong_rank: the rank's own
    gdr::scheduler sched;
    return gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      gdr::endpoint ep;
      try {
        if (shm_) {
          gdr::shm::endpoint_options eo;
          auto parts = co_await gdr::detail::shm::handshake(sched, std::move(fd), eo, {});
          ep = gdr::shm::endpoint(sched, std::move(parts), gdr::default_registry(), eo);
        } else {
          ep = gdr::tcp::endpoint(sched, gdr::tcp::socket(fd.release()));
        }
      } catch (const gdr::error&) {
        co_return 0;  // the rank ended the connection before the transport's handshake was done
      }
      gdr::op_options o;
      o.timeout = 20s;
      auto sent = co_await ep.send(gdr::view<const std::byte, gdr::Host>(hello.data(), hello.size()), o).as_result();
      std::array<std::byte, 64> b{};
      auto got = co_await ep.recv(gdr::view<std::byte, gdr::Host>(b.data(), b.size()), o).as_result();
      (void)sent;
      co_return !got && got.error() != gdr::errc::timed_out ? 0 : 1;
    }());
  }

  stray_kind kind_;
  bool shm_;
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
};

// The TCP rendezvous, but in step 2 (its second collective: every rank's
// address), once the addresses are in, this rank's strays connect to its
// own listener, and a barrier then waits for every rank's: every stray is in
// its listener's queue before the first connection of a rank.
struct strayed_rendezvous {
  bs::tcp_rendezvous& rv;
  std::vector<std::unique_ptr<stray>>& strays;
  int calls = 0;
  std::uint64_t session = 0;
  bool started = true;

  int rank() const { return rv.rank(); }
  int size() const { return rv.size(); }
  std::string address_hint() const { return rv.address_hint(); }
  void barrier() { rv.barrier(); }
  std::vector<std::vector<std::byte>> allgather(std::span<const std::byte> mine) {
    auto all = rv.allgather(mine);
    ++calls;
    if (calls == 1 && all[0].size() >= 8) session = gdr::detail::load_le64(all[0].data());  // rank 0's number
    if (calls == 2) {
      const auto& me = all[static_cast<std::size_t>(rank())];
      const std::string published(reinterpret_cast<const char*>(me.data()), me.size());
      for (auto& s : strays) started = s->start(published, session, size(), rank()) && started;
      rv.barrier();
    }
    return all;
  }
};

}  // namespace

TEST_CASE("strays on a rank's listener during connect_mesh are closed, not counted, and hold nobody up") {
  // Shared memory (the listener of ranks of one node) and TCP.
  for (bool shm : {true, false}) {
    CAPTURE(shm);
    std::uint16_t port = 0;
    int lfd = gdr_test::listen_loopback(port);
    REQUIRE(lfd >= 0);
    constexpr int world = 4;
    auto t0 = std::chrono::steady_clock::now();
    auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 90s, [&](int rank) {
      bs::tcp_rendezvous inner = join(rank, world, port, lfd);
      std::vector<std::unique_ptr<stray>> strays;
      for (stray_kind k : {stray_kind::silent, stray_kind::other_job, stray_kind::wrong_rank, stray_kind::silent})
        strays.push_back(std::make_unique<stray>(k, shm));
      strayed_rendezvous rv{inner, strays};
      gdr::scheduler sched;
      bs::mesh_options o = short_timeouts(10s);
      if (!shm) o.same_node = bs::same_node_transport::tcp;
      auto begun = std::chrono::steady_clock::now();
      std::chrono::steady_clock::duration took{};
      int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
        bs::mesh m = co_await bs::connect_mesh(sched, rv, o);
        took = std::chrono::steady_clock::now() - begun;
        int wrong = 0;
        for (int p = 0; p < world; ++p) {
          const bool via_shm = p != rank && m.peer(p).peer_name().find("shared memory") != std::string::npos;
          if (p != rank && via_shm != shm) ++wrong;
        }
        co_return wrong + co_await gdr_test::check_mesh(m, rv, rank, world);
      }());
      sched.drain();
      if (!rv.started) bad += 100;
      // Nobody waited for a stray (the step's bound is 10 s).
      if (took > 5s) {
        std::fprintf(stderr, "rank %d: the mesh took %lld ms\n", rank,
                     static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
        ++bad;
      }
      for (auto& s : strays)
        if (int c = s->wait(30s); c != 0) {
          std::fprintf(stderr, "rank %d: a stray's connection was not closed (%d)\n", rank, c);
          ++bad;
        }
      return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
    });
    ::close(lfd);
    CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
    CHECK(std::chrono::steady_clock::now() - t0 < 60s);
  }
}
