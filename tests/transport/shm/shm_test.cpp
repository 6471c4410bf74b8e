// gdr/transport/shm: the ring on its own, and the transport between two
// processes: messages both ways at once on several tags in both run modes,
// a peer SIGKILLed in the middle of a transfer, handshakes that must be
// refused, names (abstract and paths), and what the counters say about
// system calls. (The conformance suite and the stress test run over it
// too, with both ends in one process.)
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/shm.hpp>

#include "tests/support/watchdog.hpp"

namespace shm = gdr::shm;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

namespace {

std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  return v;
}

gdr::view<std::byte, gdr::Host> bytes_of(std::vector<std::byte>& v) { return {v.data(), v.size()}; }
gdr::view<const std::byte, gdr::Host> cbytes_of(const std::vector<std::byte>& v) { return {v.data(), v.size()}; }

gdr::task<gdr::op_report> report_of(gdr::op_awaitable op) { co_return co_await std::move(op).report(); }

int open_fds() {
  int n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Forks a child that reads a listener's name from a pipe, connects, runs
// `body(endpoint&)` on its own scheduler in `mode` and closes in order; its
// exit status is 0 if `body` returned true.
template <class Body>
pid_t fork_peer(int& name_pipe, gdr::run_mode mode, Body body, shm::endpoint_options opts = {}) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(p[1]);
    char name[128] = {};
    if (::read(p[0], name, sizeof name) != sizeof name) ::_exit(2);
    bool ok = false;
    try {
      gdr::scheduler s({.mode = mode});
      gdr::sync_wait(s, [&]() -> gdr::task<> {
        shm::endpoint ep = co_await shm::connect(s, name, gdr::default_registry(), opts);
        ok = co_await body(ep);
        co_await ep.close();
      }());
      s.drain();
    } catch (...) {
      ok = false;
    }
    ::_exit(ok ? 0 : 1);
  }
  ::close(p[0]);
  name_pipe = p[1];
  return pid;
}

void send_name(int fd, const std::string& n) {
  char name[128] = {};
  std::memcpy(name, n.data(), n.size());
  REQUIRE(::write(fd, name, sizeof name) == sizeof name);
  ::close(fd);
}

// Options with payloads from 64 KiB copied once by the receiver (where
// the handshake allows it).
shm::endpoint_options single_copy() {
  shm::endpoint_options o;
  o.single_copy_threshold = 64 * 1024;
  return o;
}

int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// The sizes each side sends on each tag, in order.
std::vector<std::size_t> sizes_for(std::uint32_t tag) {
  std::vector<std::size_t> v = {0, 1, 8, 63, 64, 65, 4095, 16384, 65537, 300000, (2u << 20) + 7};
  for (std::uint32_t i = 0; i < 40; ++i) v.push_back((i * 7919u + tag * 104729u) % 70000u);
  return v;
}

// Sends this side's messages on `tags` tags and receives the peer's, all at
// once; true if every received message is the one expected, intact.
gdr::task<bool> exchange(shm::endpoint& ep, std::uint32_t me, std::uint32_t tags) {
  bool ok = true;
  auto sender = [&](std::uint32_t tag) -> gdr::task<> {
    std::uint32_t i = 0;
    for (std::size_t n : sizes_for(tag)) co_await ep.send(cbytes_of(pattern(n, me * 1000 + tag * 100 + i++)), gdr::tag{tag});
  };
  auto receiver = [&](std::uint32_t tag) -> gdr::task<> {
    std::uint32_t i = 0;
    std::vector<std::byte> in((2u << 20) + 64);
    for (std::size_t n : sizes_for(tag)) {
      std::size_t got = co_await ep.recv(bytes_of(in), gdr::tag{tag});
      auto want = pattern(n, (1 - me) * 1000 + tag * 100 + i++);
      if (got != n || !std::equal(want.begin(), want.end(), in.begin())) ok = false;
    }
  };
  gdr::task_scope all;
  for (std::uint32_t t = 0; t < tags; ++t) {
    all.spawn(sender(t));
    all.spawn(receiver(t));
  }
  co_await all.join();
  co_return ok;
}

}  // namespace

TEST_CASE("the ring copies across its end and refuses a counter that claims more than it holds") {
  namespace d = gdr::detail::shm;
  constexpr std::size_t cap = 4096;
  std::vector<std::byte> seg(d::segment_bytes(cap) + 64);
  void* base = seg.data() + (64 - reinterpret_cast<std::uintptr_t>(seg.data()) % 64) % 64;
  d::ring::format(base, cap);
  REQUIRE(d::ring::valid_capacity(base, d::segment_bytes(cap)) == cap);
  CHECK(d::ring::valid_capacity(base, d::segment_bytes(cap) - 1) == 0);
  d::ring w(base, cap), r(base, cap);
  bool corrupt = false;
  std::size_t total = 0;
  for (std::uint32_t round = 0; round < 50; ++round) {
    auto p = pattern(1000 + round * 37, round);
    REQUIRE(w.room(p.size()) >= p.size());
    w.put(p.data(), p.size());
    CHECK(r.readable(corrupt) == 0);  // not published yet
    w.publish();
    REQUIRE(r.readable(corrupt) == p.size());
    std::vector<std::byte> out(p.size());
    r.peek(out.data(), 0, out.size());
    r.consume(out.size());
    r.release();
    CHECK(out == p);
    total += p.size();
  }
  CHECK(total > 4 * cap);  // went round several times
  CHECK(w.room(cap) == cap);
  // A head that runs more than a ring ahead of the reader, or behind it: corrupt.
  w.control().head.store(r.position() + cap + 1);
  CHECK(r.readable(corrupt) == 0);
  CHECK(corrupt);
  w.control().head.store(r.position() - 1);
  CHECK(r.readable(corrupt) == 0);
  CHECK(corrupt);
  w.publish();
  CHECK(r.readable(corrupt) == 0);
  CHECK_FALSE(corrupt);
  CHECK_FALSE(w.corrupt());
}

TEST_CASE("the ring's capacity is the one checked at set-up, whatever the segment's word says later") {
  namespace d = gdr::detail::shm;
  constexpr std::size_t cap = 4096;
  std::vector<std::byte> seg(d::segment_bytes(cap) + 128);  // (64 for the alignment, 64 for the canary)
  void* base = seg.data() + (64 - reinterpret_cast<std::uintptr_t>(seg.data()) % 64) % 64;
  d::ring::format(base, cap);
  auto& c = *static_cast<d::ring_control*>(base);
  // Words a peer may write before the check: each refused.
  for (std::uint64_t bad : {std::uint64_t{0}, std::uint64_t{2048}, std::uint64_t{cap + 1}, std::uint64_t{2 * cap},
                            ~std::uint64_t{0}, std::uint64_t{1} << 63}) {
    CAPTURE(bad);
    c.capacity.store(bad);
    CHECK(d::ring::valid_capacity(base, d::segment_bytes(cap)) == 0);
  }
  c.capacity.store(cap);
  const std::size_t checked = d::ring::valid_capacity(base, d::segment_bytes(cap));
  REQUIRE(checked == cap);
  // After the check the peer makes it 1 GiB: the writer still wraps at
  // 4 KiB, inside the mapping (the bytes just past the data are a canary).
  c.capacity.store(std::uint64_t{1} << 30);
  std::byte* canary = static_cast<std::byte*>(base) + d::segment_bytes(cap);
  std::memset(canary, 0x5a, 64);
  d::ring w(base, checked), r(base, checked);
  CHECK(w.capacity() == cap);
  for (std::uint32_t round = 0; round < 20; ++round) {
    auto p = pattern(3000, round);
    REQUIRE(w.room(p.size()) == cap);
    w.put(p.data(), p.size());
    w.publish();
    bool corrupt = false;
    REQUIRE(r.readable(corrupt) == p.size());
    std::vector<std::byte> out(p.size());
    r.peek(out.data(), 0, out.size());
    r.consume(out.size());
    r.release();
    CHECK(out == p);
  }
  for (int i = 0; i < 64; ++i) CHECK(canary[i] == std::byte{0x5a});
}

TEST_CASE("the writer refuses a tail behind the last one it saw or past what it wrote") {
  namespace d = gdr::detail::shm;
  constexpr std::size_t cap = 4096;
  for (int how = 0; how < 3; ++how) {
    CAPTURE(how);
    std::vector<std::byte> seg(d::segment_bytes(cap) + 64);
    void* base = seg.data() + (64 - reinterpret_cast<std::uintptr_t>(seg.data()) % 64) % 64;
    d::ring::format(base, cap);
    d::ring w(base, cap);
    auto p = pattern(3000, 1);
    w.put(p.data(), p.size());
    w.publish();
    w.control().tail.store(2000);  // the reader took 2000 bytes
    CHECK(w.room(cap) == cap - 1000);
    CHECK_FALSE(w.corrupt());
    // Then: back to 1000, past what was written, or far away.
    const std::uint64_t bad[] = {1000, 3001, std::uint64_t{1} << 40};
    w.control().tail.store(bad[how]);
    CHECK(w.room(cap) == 0);
    CHECK(w.corrupt());
    CHECK(w.room(1) == 0);  // for good
    CHECK(w.peer_tail() == 2000);  // the last good one
  }
}

TEST_CASE("two processes exchange messages of every size on several tags, both ways at once, in both run modes") {
  gdr_test_support::watchdog dog(120);
  for (bool once : {false, true})
  for (gdr::run_mode mode : {gdr::run_mode::busy_poll, gdr::run_mode::sleep}) {
    CAPTURE(once);
    CAPTURE(static_cast<int>(mode));
    const shm::endpoint_options o = once ? single_copy() : shm::endpoint_options{};
    int pipe_w = -1;
    pid_t pid = fork_peer(pipe_w, mode, [](shm::endpoint& ep) -> gdr::task<bool> { co_return co_await exchange(ep, 1, 1); }, o);
    gdr::scheduler s({.mode = mode});
    shm::listener l(s, {}, gdr::default_registry(), o);
    send_name(pipe_w, l.name());
    bool ok = false;
    shm::endpoint_stats st{};
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      shm::endpoint ep = co_await l.accept();
      CHECK(ep.peer_pid() == pid);
      ok = co_await exchange(ep, 0, 1);
      st = ep.stats();
      co_await ep.close();
    }());
    s.drain();
    CHECK(ok);
    CHECK(wait_exit(pid) == 0);
    // Every send through the rings; a receive too, unless its message came
    // first and was kept (then copied from the store: host_eager).
    CHECK(st.on_path(gdr::transfer_path::shared_memory) >= sizes_for(0).size());
    CHECK(st.on_path(gdr::transfer_path::shared_memory) + st.on_path(gdr::transfer_path::host_eager) ==
          2 * sizes_for(0).size());
    if (mode == gdr::run_mode::busy_poll) CHECK(st.bells_rung == 0);  // both sides poll: no system call
    // With single copy on, payloads from 64 KiB come as addresses where this
    // side may read the peer (not where ptrace is restricted between
    // siblings, e.g. Yama's ptrace_scope 1): then this side copied them
    // itself. Off, nothing does.
    MESSAGE("single copy " << once << ": this side reads the peer's memory: " << st.reads_peer
                           << ", single copies: " << st.single_copies);
    if (!once) CHECK((!st.reads_peer && st.single_copies == 0));
    CHECK(st.reads_peer == (st.single_copies >= 3));
  }
}

TEST_CASE("several tags at once between two processes arrive in order per tag") {
  gdr_test_support::watchdog dog(120);
  int pipe_w = -1;
  pid_t pid = fork_peer(pipe_w, gdr::run_mode::sleep, [](shm::endpoint& ep) -> gdr::task<bool> { co_return co_await exchange(ep, 1, 3); });
  gdr::scheduler s;
  shm::listener l(s);
  send_name(pipe_w, l.name());
  bool ok = false;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    shm::endpoint ep = co_await l.accept();
    ok = co_await exchange(ep, 0, 3);
    co_await ep.close();
  }());
  s.drain();
  CHECK(ok);
  CHECK(wait_exit(pid) == 0);
}

TEST_CASE("a peer SIGKILLed in the middle of a transfer fails every pending operation within 2 s and leaks nothing") {
  gdr_test_support::watchdog dog(120);
  for (gdr::run_mode mode : {gdr::run_mode::busy_poll, gdr::run_mode::sleep}) {
    CAPTURE(static_cast<int>(mode));
    const int fds_before = open_fds();
    int pipe_w = -1;
    pid_t pid = fork_peer(pipe_w, mode, [](shm::endpoint& ep) -> gdr::task<bool> {
      // Sends 64 MiB messages (through a 1 MiB ring) for ever.
      auto big = pattern(64u << 20, 9);
      for (;;) co_await ep.send(cbytes_of(big));
    });
    {
      gdr::scheduler s({.mode = mode});
      shm::listener l(s);
      send_name(pipe_w, l.name());
      gdr::sync_wait(s, [&]() -> gdr::task<> {
        shm::endpoint ep = co_await l.accept();
        std::vector<std::byte> in(64u << 20), small(16);
        std::size_t n = co_await ep.recv(bytes_of(in));  // one whole message first
        CHECK(n == in.size());
        clock_type::time_point killed{};
        auto [r1, r2, k] = co_await gdr::when_all(
            report_of(ep.recv(bytes_of(in))), report_of(ep.recv(bytes_of(small), gdr::tag{5})), [&]() -> gdr::task<int> {
              co_await gdr::sleep_for(3ms);  // the next message is streaming through the ring
              ::kill(pid, SIGKILL);
              killed = clock_type::now();
              co_return 0;
            }());
        const auto took = clock_type::now() - killed;
        CHECK((r1.error == gdr::errc::connection_lost || (!r1.error && r1.bytes == in.size())));
        CHECK(r2.error == gdr::errc::connection_lost);
        CHECK(took < 2s);
        CHECK(ep.error() == gdr::errc::connection_lost);
        auto r3 = co_await report_of(ep.send(cbytes_of(small)));
        CHECK(r3.error == gdr::errc::connection_lost);
        co_await ep.close();
      }());
      s.drain();
    }
    wait_exit(pid);
    CHECK(open_fds() == fds_before);  // socket, bells, memfds: all closed
  }
}

TEST_CASE("a handshake with something that is not a gdr shared-memory peer fails with a clear error") {
  gdr_test_support::watchdog dog(60);
  gdr::scheduler s;
  // Nobody listens on the name.
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    bool threw = false;
    try {
      (void)co_await shm::connect(s, "@gdr-test-nobody-listens-here");
    } catch (const gdr::error& e) {
      threw = true;
      CHECK(e.code() == std::errc::connection_refused);
    }
    CHECK(threw);
  }());
  // A listener that answers with bytes that are not a hello.
  int srv = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  REQUIRE(::bind(srv, reinterpret_cast<sockaddr*>(&a), sizeof(sa_family_t)) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(srv, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  REQUIRE(::listen(srv, 1) == 0);
  std::string name = "@" + std::string(a.sun_path + 1, len - offsetof(sockaddr_un, sun_path) - 1);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int c = ::accept(srv, nullptr, nullptr);
    char junk[32];
    std::memset(junk, 'x', sizeof junk);
    (void)!::write(c, junk, sizeof junk);
    char buf[64];
    (void)!::read(c, buf, sizeof buf);
    ::_exit(0);
  }
  ::close(srv);
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    bool threw = false;
    try {
      (void)co_await shm::connect(s, name, gdr::default_registry(), {}, 5s);
    } catch (const gdr::error& e) {
      threw = true;
      CHECK(e.code() == gdr::errc::protocol_error);
      CHECK(std::string(e.what()).find("not a gdr shared-memory hello") != std::string::npos);
    }
    CHECK(threw);
  }());
  wait_exit(pid);
  // A name too long for a Unix socket.
  CHECK_THROWS_AS(shm::listener(s, std::string(200, 'n')), gdr::error);
}

TEST_CASE("a listener on a path makes a socket file and removes it when closed") {
  gdr_test_support::watchdog dog(60);
  std::string path = "/tmp/gdr-shm-test-" + std::to_string(::getpid()) + ".sock";
  gdr::scheduler s;
  {
    shm::listener l(s, path);
    CHECK(l.name() == path);
    CHECK(std::filesystem::exists(path));
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      auto [x, y] = co_await gdr::when_all(shm::connect(s, path), l.accept());
      std::vector<std::byte> out = pattern(100, 1), in(100);
      co_await gdr::when_all(report_of(x.send(cbytes_of(out))), report_of(y.recv(bytes_of(in))));
      CHECK(in == out);
      co_await gdr::when_all(report_of(x.close()), report_of(y.close()));
    }());
    s.drain();
  }
  CHECK_FALSE(std::filesystem::exists(path));
}

TEST_CASE("a peer that closes right after receiving large messages never fails the sends it received") {
  // The receiver copies each large payload straight from the sender's
  // memory (where it may read it) and counts the copy in the ring; the
  // sender completes the send when it sees the count. The receiver closes as
  // soon as its last receive completes: the sender must take the count
  // before it handles the close frame, or it fails a send whose bytes were
  // delivered (a bug the first version had).
  gdr_test_support::watchdog dog(120);
  for (gdr::run_mode mode : {gdr::run_mode::busy_poll, gdr::run_mode::sleep}) {
    CAPTURE(static_cast<int>(mode));
    for (int round = 0; round < 5; ++round) {
      int pipe_w = -1;
      pid_t pid = fork_peer(pipe_w, mode, [](shm::endpoint& ep) -> gdr::task<bool> {
        std::vector<std::byte> in(1u << 20);
        for (int i = 0; i < 20; ++i)
          if (co_await ep.recv(bytes_of(in)) != in.size()) co_return false;
        co_return true;  // fork_peer closes at once
      }, single_copy());
      gdr::scheduler s({.mode = mode});
      shm::listener l(s, {}, gdr::default_registry(), single_copy());
      send_name(pipe_w, l.name());
      int failed = 0;
      gdr::sync_wait(s, [&]() -> gdr::task<> {
        shm::endpoint ep = co_await l.accept();
        auto big = pattern(1u << 20, 5);
        for (int i = 0; i < 20; ++i)
          if ((co_await report_of(ep.send(cbytes_of(big)))).error) ++failed;
        co_await report_of(ep.close());
      }());
      s.drain();
      CHECK(failed == 0);
      CHECK(wait_exit(pid) == 0);
    }
  }
}
