// gdr/bootstrap/lazy_mesh.hpp: ranks in forked processes build a lazy mesh
// through the TCP rendezvous and connect on first use (a ring holds two
// connections per rank; every pair at once holds exactly one per pair); two
// ranks on one scheduler pin the tie-break when both connect at once, and
// what a failed, timed-out or closed first use does.
#include <doctest/doctest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gdr/bootstrap/lazy_mesh.hpp>
#include <gdr/bootstrap/tcp_rendezvous.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_all.hpp>

#include "tests/bootstrap/exchange.hpp"
#include "tests/bootstrap/multiprocess.hpp"

using namespace std::chrono_literals;
namespace bs = gdr::bootstrap;

namespace {

bs::tcp_rendezvous join(int rank, int world, std::uint16_t port, int listen_fd) {
  bs::tcp_rendezvous_config c;
  c.root_port = port;
  c.rank = rank;
  c.world_size = world;
  c.timeout = 20s;
  c.listen_fd = rank == 0 ? listen_fd : -1;
  if (rank != 0) ::close(listen_fd);
  return bs::tcp_rendezvous(c);
}

// Counters the forked ranks write for the parent (shared memory made before fork).
struct shared_counts {
  std::uint64_t accepted[16];
  std::uint64_t connects[16];
  int connections[16];
};
shared_counts* make_shared_counts() {
  void* p = ::mmap(nullptr, sizeof(shared_counts), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(p != MAP_FAILED);
  return new (p) shared_counts{};
}

gdr::task<> send_all_to(bs::lazy_mesh& m, int to) {
  for (int k = 0; k < gdr_test::mesh_messages; ++k) {
    std::vector<std::byte> msg = gdr_test::mesh_message(m.rank(), to, k);
    co_await m.send(to, gdr::view<const std::byte, gdr::Host>(msg.data(), msg.size()), gdr::tag{0},
                    gdr_test::mesh_timeout());
  }
}

gdr::task<> receive_all_from(bs::lazy_mesh& m, int from, int& bad) {
  std::vector<std::byte> in(1 << 20);
  for (int k = 0; k < gdr_test::mesh_messages; ++k) {
    std::size_t n = co_await m.recv(from, gdr::view<std::byte, gdr::Host>(in.data(), in.size()), gdr::tag{0},
                                    gdr_test::mesh_timeout());
    const std::vector<std::byte> want = gdr_test::mesh_message(from, m.rank(), k);
    if (n != want.size() || !std::equal(want.begin(), want.end(), in.begin())) {
      std::fprintf(stderr, "rank %d: message %d from rank %d is wrong (%zu bytes)\n", m.rank(), k, from, n);
      ++bad;
    }
  }
}

// Rank `rank` of a lazy mesh on `sched` whose table is given (tests of two
// ranks in one thread, no rendezvous): listens on 127.0.0.1, and `where[rank]`
// is filled in with its address.
std::shared_ptr<bs::detail::lazy_state> listening(gdr::scheduler& sched, const bs::mesh_options& o,
                                                  std::vector<std::string>& where, int rank) {
  auto s = std::make_shared<bs::detail::lazy_state>(sched, o);
  auto& net = s->set_net(bs::detail::tcp_net{&sched, &s->options()});
  REQUIRE(net.listen("127.0.0.1").empty());
  where[static_cast<std::size_t>(rank)] = net.published();
  return s;
}

bs::lazy_mesh started(std::shared_ptr<bs::detail::lazy_state> s, int rank, const std::vector<std::string>& where) {
  bs::detail::mesh_table t;
  t.rank = rank;
  t.size = static_cast<int>(where.size());
  t.session = 0x5e55'1011'0000'0001ull;
  t.where = where;
  s->start(std::move(t));
  return bs::detail::make_lazy_mesh(std::move(s));
}

bs::mesh_options timeouts(std::chrono::milliseconds t) {
  bs::mesh_options o;
  o.timeout = t;
  return o;
}

// What a coroutine's failure was.
template <class F>
gdr::task<std::error_code> error_of(F f) {
  try {
    co_await f();
  } catch (const gdr::error& e) {
    co_return e.code();
  }
  co_return std::error_code{};
}

}  // namespace

TEST_CASE("ranks talking around a ring connect only to their neighbours") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int world = 6;
  shared_counts* out = make_shared_counts();
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, world, port, lfd);
    gdr::scheduler sched;
    int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      bs::lazy_mesh m = co_await bs::connect_lazy_mesh(sched, rv);
      int wrong = m.connections() == 0 ? 0 : 100;  // nothing connected before first use
      const int right = (rank + 1) % world, left = (rank + world - 1) % world;
      co_await gdr::when_all(send_all_to(m, right), receive_all_from(m, left, wrong));
      out->connections[rank] = m.connections();
      out->accepted[rank] = m.stats().accepted;
      out->connects[rank] = m.stats().connects;
      wrong += (m.connected(right) && m.connected(left)) ? 0 : 1000;
      rv.barrier();
      co_await m.close();
      co_return wrong;
    }());
    sched.drain();
    return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
  std::uint64_t accepted = 0;
  for (int r = 0; r < world; ++r) {
    CHECK(out->connections[r] == 2);
    accepted += out->accepted[r];
  }
  CHECK(accepted == world);  // one connection per ring edge, each taken by one side
  ::munmap(out, sizeof(shared_counts));
}

TEST_CASE("every pair talking at once holds exactly one connection per pair, whoever connected first") {
  std::uint16_t port = 0;
  int lfd = gdr_test::listen_loopback(port);
  REQUIRE(lfd >= 0);
  constexpr int world = 6;
  shared_counts* out = make_shared_counts();
  auto codes = gdr_test::run_ranks(gdr_test::first_ranks(world), 120s, [&](int rank) {
    bs::tcp_rendezvous rv = join(rank, world, port, lfd);
    gdr::scheduler sched;
    bs::mesh_options o;
    o.max_connects_in_flight = 2;  // some first uses wait for a turn
    int bad = gdr::sync_wait(sched, [&]() -> gdr::task<int> {
      bs::lazy_mesh m = co_await bs::connect_lazy_mesh(sched, rv, o);
      int wrong = 0;
      std::vector<gdr::task<>> work;
      for (int p = 0; p < world; ++p) {
        if (p == rank) continue;
        work.push_back(send_all_to(m, p));
        work.push_back(receive_all_from(m, p, wrong));
      }
      co_await gdr::when_all(std::move(work));
      out->connections[rank] = m.connections();
      out->accepted[rank] = m.stats().accepted;
      out->connects[rank] = m.stats().connects;
      rv.barrier();
      co_await m.close();
      co_return wrong;
    }());
    sched.drain();
    return bad == 0 ? gdr_test::rank_ok : gdr_test::rank_failed;
  });
  ::close(lfd);
  CHECK(codes == std::vector<int>(world, gdr_test::rank_ok));
  std::uint64_t accepted = 0;
  for (int r = 0; r < world; ++r) {
    CHECK(out->connections[r] == world - 1);
    accepted += out->accepted[r];
  }
  CHECK(accepted == world * (world - 1) / 2);
  ::munmap(out, sizeof(shared_counts));
}

TEST_CASE("two ranks that connect to each other at the same moment keep the lower rank's connection") {
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::vector<std::string> where(2);
    auto s0 = listening(sched, {}, where, 0);
    auto s1 = listening(sched, {}, where, 1);
    bs::lazy_mesh m0 = started(s0, 0, where), m1 = started(s1, 1, where);
    // Both first uses start in the same turn of the one scheduler: each rank
    // reads the other's hello while its own connection is under way.
    std::array<int, 4> a{1, 2, 3, 4}, b{5, 6, 7, 8}, got_a{}, got_b{};
    (void)co_await gdr::when_all(m0.send(1, gdr::host_view(a)), m1.send(0, gdr::host_view(b)),
                                 m0.recv(1, gdr::host_view(got_b)), m1.recv(0, gdr::host_view(got_a)));
    CHECK(got_a == a);
    CHECK(got_b == b);
    CHECK(m0.connections() == 1);
    CHECK(m1.connections() == 1);
    // Rank 0 (lower) refused rank 1's connection; rank 1 took rank 0's.
    CHECK(m0.stats().connects == 1);
    CHECK(m1.stats().connects == 1);
    CHECK(m0.stats().refused == 1);
    CHECK(m0.stats().accepted == 0);
    CHECK(m1.stats().accepted == 1);
    CHECK(m1.stats().refused_by_peer == 1);
    CHECK(m0.stats().refused_by_peer == 0);
    // The one connection carries more both ways, and put/get through peer().
    gdr::endpoint& e0 = co_await m0.peer(1);
    gdr::endpoint& e1 = co_await m1.peer(0);
    co_await e0.send(gdr::host_view(b));  // eager
    co_await e1.recv(gdr::host_view(got_a));
    CHECK(got_a == b);
    co_await m0.close();
    co_await m1.close();
  }());
  sched.drain();
}

TEST_CASE("a rank whose peer makes the first use takes the peer's connection") {
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::vector<std::string> where(2);
    auto s0 = listening(sched, {}, where, 0);
    auto s1 = listening(sched, {}, where, 1);
    bs::lazy_mesh m0 = started(s0, 0, where), m1 = started(s1, 1, where);
    std::array<int, 2> x{7, 9}, y{};
    co_await m1.send(0, gdr::host_view(x));  // eager: done once the connection is made
    co_await m0.recv(1, gdr::host_view(y));  // the connection rank 0's accept side took
    CHECK(y == x);
    CHECK(m0.connected(1));
    CHECK(m0.stats().connects == 0);
    CHECK(m0.stats().accepted == 1);
    CHECK(m1.stats().connects == 1);
    CHECK(m1.stats().refused_by_peer == 0);
    co_await m0.close();
    co_await m1.close();
  }());
  sched.drain();
}

TEST_CASE("a first use of a rank that is gone fails naming it, and a later use tries again") {
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::vector<std::string> where(2);
    auto s0 = listening(sched, timeouts(2s), where, 0);
    where[1] = "127.0.0.1:1";  // nobody listens there
    bs::lazy_mesh m0 = started(s0, 0, where);
    std::array<int, 1> v{3};
    for (int attempt = 1; attempt <= 2; ++attempt) {
      try {
        co_await m0.send(1, gdr::host_view(v));
        FAIL("sent to nobody");
      } catch (const gdr::error& e) {
        CHECK(e.code() == gdr::errc::bootstrap_failed);
        CHECK(std::string(e.what()).find("lazy_mesh (rank 0 of 2): connecting to rank 1 at 127.0.0.1:1") !=
              std::string::npos);
      }
      CHECK(!m0.connected(1));
      CHECK(m0.stats().failed == static_cast<std::uint64_t>(attempt));
      CHECK(m0.stats().connects == static_cast<std::uint64_t>(attempt));
    }
    co_await m0.close();
  }());
  sched.drain();
}

TEST_CASE("a first use observes its own timeout, and closing fails the waits still pending") {
  // Rank 1's address is a socket nobody accepts on: the connection is made
  // by the kernel, but no verdict ever comes.
  std::uint16_t dead_port = 0;
  int dead = gdr_test::listen_loopback(dead_port);
  REQUIRE(dead >= 0);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::vector<std::string> where(3);
    auto s0 = listening(sched, timeouts(5s), where, 0);
    where[1] = "127.0.0.1:" + std::to_string(dead_port);
    where[2] = where[1];
    bs::lazy_mesh m0 = started(s0, 0, where);
    std::array<int, 1> v{3};
    auto t0 = std::chrono::steady_clock::now();
    std::error_code e = co_await error_of([&]() -> gdr::task<> {
      co_await m0.send(1, gdr::host_view(v), gdr::tag{0}, gdr::op_options(200ms));
    });
    CHECK(e == gdr::errc::timed_out);
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
    CHECK(!m0.connected(1));
    // A wait on rank 2, and the close, at once: the wait fails with closed.
    auto [waited, closed] = co_await gdr::when_all(error_of([&]() -> gdr::task<> {
                                                     co_await m0.recv(2, gdr::host_view(v));
                                                   }),
                                                   error_of([&]() -> gdr::task<> { co_await m0.close(); }));
    CHECK(waited == gdr::errc::closed);
    CHECK(!closed);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  }());
  sched.drain();
  ::close(dead);
}

TEST_CASE("a lazy mesh refuses its own rank and ranks outside the world") {
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    std::vector<std::string> where(2);
    auto s0 = listening(sched, {}, where, 0);
    where[1] = "127.0.0.1:1";
    bs::lazy_mesh m0 = started(s0, 0, where);
    for (int r : {0, 2, -1}) {
      std::error_code e = co_await error_of([&]() -> gdr::task<> { (void)co_await m0.peer(r); });
      CHECK(e == gdr::errc::invalid_argument);
    }
    CHECK(m0.stats().connects == 0);
    co_await m0.close();
  }());
  sched.drain();
}

TEST_CASE("a lazy mesh of one rank has no peers") {
  bs::tcp_rendezvous_config c;
  c.rank = 0;
  c.world_size = 1;
  bs::tcp_rendezvous rv(c);
  gdr::scheduler sched;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    bs::lazy_mesh m = co_await bs::connect_lazy_mesh(sched, rv);
    CHECK(m.size() == 1);
    CHECK(m.connections() == 0);
    co_await m.close();
  }());
}
