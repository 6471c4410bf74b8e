// gdr/transport/shm: a peer on the same node is not necessarily friendly
// (a stale rank of an earlier job, a buggy process, another user's program
// that found the socket's name). A hand-made peer (raw_peer.hpp) completes
// the handshake, or breaks it, and then writes malformed frames,
// descriptors and head, tail and count words into the shared memory and
// the socket. The endpoint must not crash or touch memory outside its
// mappings (run under ASan+UBSan by CI), must fail the connection with
// protocol_error where the peer broke the protocol, must allocate nothing
// the peer's words ask for, and must go on serving its other peers.
//
// The seeded cases replay alone:
//   GDR_SHM_HOSTILE_SEED=17 bazel-bin/tests/transport/shm/hostile_test
// and GDR_SHM_HOSTILE_SEEDS=N runs seeds 0..N-1 (by default 6 seeds of
// each kind, 2 under a sanitizer: a few seconds). Each seed picks a kind
// (seed % kinds) and its details.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/shm.hpp>

#include "tests/protocol/staged.hpp"
#include "tests/support/alloc_failure.hpp"
#include "tests/support/watchdog.hpp"
#include "tests/transport/shm/raw_peer.hpp"

namespace shm = gdr::shm;
namespace d = gdr::detail::shm;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
using gdr::tcp::frame_header;
using gdr::tcp::frame_type;

namespace {

std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (auto& b : v) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    b = static_cast<std::byte>(x >> 56);
  }
  return v;
}

frame_header eager(std::uint64_t tag, std::uint64_t length) {
  frame_header h;
  h.type = frame_type::eager;
  h.tag = tag;
  h.length = length;
  return h;
}

struct rng {
  std::uint64_t s;
  std::uint64_t operator()() noexcept {  // splitmix64
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) noexcept { return (*this)() % n; }
};

template <class T>
gdr::task<gdr::op_report> report_of(T op) {
  co_return co_await std::move(op).report();
}

/// A coroutine that starts at once, nobody awaiting it; counts itself in `done`.
struct detached {
  struct promise_type {
    detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};
detached start(gdr::op_awaitable op, gdr::op_report& out, int& done) {
  out = co_await std::move(op).report();
  ++done;
}

gdr::task<bool> wait_until(std::function<bool()> pred, std::chrono::milliseconds limit) {
  const auto end = clock_type::now() + limit;
  while (!pred()) {
    if (clock_type::now() > end) co_return false;
    co_await gdr::sleep_for(200us);
  }
  co_return true;
}

}  // namespace

// ------------------------------------------------------------------ item 1: the capacity words

TEST_CASE("a peer that rewrites both rings' capacity words during the handshake: the endpoint stays inside its mappings") {
  // The capacity is checked at set-up and held in this process from then
  // on. The peer makes both words 1 GiB after this side checked its ring
  // and before this side builds its connection (the last handshake byte):
  // were the word read again, the writer would copy frames past the end of
  // its 64 KiB ring and the reader read past the peer's.
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  shm::endpoint_options o;
  o.ring_bytes = 64 * 1024;
  o.close_linger = 200ms;
  shm::listener l(sched, {}, gdr::default_registry(), o);
  const std::string name = l.name();
  constexpr int out_count = 40, in_count = 100;
  constexpr std::size_t out_each = 200 * 1024, in_each = 20 * 1024;  // 8 MB and 2 MB through 64 KiB rings
  std::atomic<int> verified{0};
  std::atomic<bool> peer_done{false}, peer_ok{false};
  std::thread raw([&] {
    shm_raw::peer p;
    const bool connected = p.connect(name, shm_raw::plan{}, [](shm_raw::peer& q) {
      q.theirs().capacity.store(std::uint64_t{1} << 30);
      q.mine().capacity.store(std::uint64_t{1} << 30);
    });
    bool good = connected;
    const auto deadline = clock_type::now() + 30s;
    if (good) {
      p.hello();
      p.publish();
    }
    // This side's messages through its 64 KiB ring, as room comes.
    int sent = 0;
    auto top_up = [&] {
      for (; sent < in_count && p.room() >= in_each + gdr::tcp::wire::header_size; ++sent) {
        p.frame(eager(3, in_each), pattern(in_each, 5000 + sent));
        p.publish();
      }
    };
    // The endpoint's: its hello, its credit, then the messages, each checked.
    gdr::tcp::frame_parse_result r;
    std::vector<std::byte> body;
    good = good && p.next_frame(r, body, deadline) && r.header.type == frame_type::hello &&
           p.next_frame(r, body, deadline) && r.header.type == frame_type::credit;
    for (int i = 0; good && i < out_count; ++i) {
      top_up();
      // (Credits for what it read of this side's come between.)
      do good = p.next_frame(r, body, deadline); while (good && r.header.type == frame_type::credit);
      good = good && r.header.type == frame_type::eager && body == pattern(out_each, i);
      if (good) ++verified;
    }
    for (top_up(); good && sent < in_count && clock_type::now() < deadline; top_up()) std::this_thread::sleep_for(50us);
    peer_ok = good && sent == in_count;
    peer_done = true;
    p.wait_hangup(5s);
  });
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    shm::endpoint ep = co_await l.accept(5s);
    int in_ok = 0;
    auto receiver = [&]() -> gdr::task<> {
      std::vector<std::byte> in(in_each);
      for (int i = 0; i < in_count; ++i) {
        const std::size_t n = co_await ep.recv(gdr::view<std::byte, gdr::Host>(in.data(), in.size()), gdr::tag{3});
        in_ok += n == in_each && in == pattern(in_each, 5000 + i);
      }
    };
    auto sender = [&]() -> gdr::task<> {
      for (int i = 0; i < out_count; ++i) {
        const auto v = pattern(out_each, i);
        co_await ep.send(gdr::view<const std::byte, gdr::Host>(v.data(), v.size()));
      }
    };
    co_await gdr::when_all(receiver(), sender());
    CHECK(in_ok == in_count);
    CHECK(ep.stats().ring_full > 0);  // the writer waited for room: it wrapped at 64 KiB
    CHECK(co_await wait_until([&] { return peer_done.load(); }, 20s));
    CHECK(ep.is_open());
    (void)co_await report_of(ep.close());
  }());
  raw.join();
  CHECK(peer_ok);
  CHECK(verified == out_count);
  sched.drain();
  CHECK(sched.inflight() == 0);
}

// ------------------------------------------------------------------ item 2: descriptors replaced in their slot

TEST_CASE("descriptors a peer replaces in their slots are let go with their mappings: 40 passed, at most 16 held") {
  // A hand-made peer in another process passes 40 allocations' descriptors
  // (memfds, the copy engine's stand-in for the virtual memory API), each
  // in the slot after the last, and a frame that names each: each
  // replacement lets the allocation the slot held go, descriptor and
  // mapping. Then it frees the 16 it still has there.
  gdr_test_support::watchdog dog(60);
  gdr::scheduler sched;
  staged::env env(sched);
#if !GDR_HAS_CUDA
  env.ce.ipc = true;
#endif
  shm::endpoint_options o;
  o.close_linger = 200ms;
  shm::listener l(sched, {}, gdr::default_registry(), o);
  constexpr int count = 40;
  constexpr std::size_t each = 4096;
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::alarm(30);
    shm_raw::plan pl;
    pl.device = 1;
    shm_raw::peer p;
    if (!p.connect(l.name(), pl)) ::_exit(2);
    p.hello();
    p.publish();
    std::vector<int> blocks;
    for (int i = 0; i < count; ++i) {
      const int fd = ::memfd_create("gdr-test-block", MFD_CLOEXEC);
      const auto v = pattern(each, 100 + i);
      if (fd < 0 || ::pwrite(fd, v.data(), v.size(), 0) != static_cast<ssize_t>(v.size())) ::_exit(3);
      blocks.push_back(fd);
      gdr::copy_engine::ipc_memory m;
      m.base = 0x100000000ull + static_cast<std::uint64_t>(i) * 0x10000;
      m.size = each;
      m.buffer_id = 1000 + static_cast<std::uint64_t>(i);
      m.device = 0;
      m.pid = static_cast<std::int32_t>(::getpid());
      const auto slot = static_cast<std::uint32_t>(i % 16);
      std::byte desc[gdr::copy_engine::ipc_memory::wire_size + 8]{};
      m.to_wire(desc);
      desc[0] = static_cast<std::byte>(slot);
      if (!p.pass_fd(fd, m.buffer_id, m.base, slot)) ::_exit(4);
      p.frame(eager(7, each), desc, 2);
      p.publish();
    }
    // Wait until the endpoint has read every frame, then free the 16.
    const auto deadline = clock_type::now() + 10s;
    while (p.mine().tail.load() != p.head() && clock_type::now() < deadline) std::this_thread::sleep_for(100us);
    p.mine().released.store(0xffff);
    p.ring_bell();
    p.wait_hangup(10s);
    ::_exit(0);
  }
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    shm::endpoint ep = co_await l.accept(5s);
    CHECK(ep.device_ipc());
    std::vector<std::byte> in(each);
    int ok = 0;
    for (int i = 0; i < count; ++i) {
      gdr::op_report r = co_await report_of(ep.recv(gdr::view<std::byte, gdr::Host>(in.data(), in.size()), gdr::tag{7}));
      ok += !r.error && r.bytes == each && in == pattern(each, 100 + i);
    }
    CHECK(ok == count);
    CHECK(ep.stats().fds_taken == count);
    CHECK(ep.stats().fds_replaced == count - 16);
#if !GDR_HAS_CUDA
    CHECK(env.ce.fd_imports == count);
    CHECK(env.ce.mapped() <= 16);  // each replacement let its allocation go
#endif
    CHECK(co_await wait_until([&] { return ep.stats().fds_let_go == 16; }, 5s));
#if !GDR_HAS_CUDA
    CHECK(env.ce.mapped() == 0);
    CHECK(env.ce.ipc_releases == count);
#endif
    CHECK(ep.is_open());
    (void)co_await report_of(ep.close());
  }());
  sched.drain();
  int st = 0;
  ::waitpid(child, &st, 0);
  CHECK(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
}

// ------------------------------------------------------------------ item 8: seeded hostile peers

namespace {

/// What the endpoint must do with a case's peer.
enum class outcome {
  refused,    ///< the handshake fails with protocol_error
  protocol,   ///< the connection fails with protocol_error
  failed,     ///< the connection fails (a copy the peer's descriptor made fail: device_error, invalid_argument)
  delivered,  ///< the message of tag 7 arrives whole, the connection stays open
  any,        ///< nothing in particular (the peer stalls, or breaks nothing the endpoint can see)
};
const char* to_string(outcome o) {
  switch (o) {
    case outcome::refused: return "refused";
    case outcome::protocol: return "protocol_error";
    case outcome::failed: return "failed";
    case outcome::delivered: return "delivered";
    case outcome::any: return "any";
  }
  return "?";
}

/// One seeded case: what the peer does (in a forked child) and what the
/// endpoint must do.
struct hostile_case {
  std::string what;
  shm_raw::plan plan;
  std::function<void(shm_raw::peer&)> before_last = [](shm_raw::peer&) {};
  std::function<void(shm_raw::peer&)> act = [](shm_raw::peer&) {};  // after the handshake
  outcome expect = outcome::any;
  std::vector<std::byte> message;   // delivered: the message of tag 7
  std::size_t endpoint_sends = 0;   // the endpoint sends messages of this size meanwhile (0: none)
  bool single_copy = false;         // the endpoint's single_copy_threshold is 64 KiB
  bool child_verifies = false;      // the child's exit status says whether what it read was right
  bool first_delivered = false;     // protocol: the message of tag 7 arrives before the bad frame
};

constexpr std::size_t ring_cap = 64 * 1024;
constexpr std::uint64_t max_message = gdr::protocol_options{}.max_message;

/// The eager message of tag 7 the endpoint receives, as its next frame.
void write_message(shm_raw::peer& p, const std::vector<std::byte>& m) {
  p.frame(eager(7, m.size()), m);
  p.publish();
}

/// Waits until the endpoint has consumed everything this side published.
void wait_consumed(shm_raw::peer& p, std::chrono::milliseconds limit = 2000ms) {
  const auto end = clock_type::now() + limit;
  while (p.mine().tail.load() != p.head() && clock_type::now() < end) std::this_thread::sleep_for(50us);
}

/// The endpoint's hello and credit, read out of its ring.
bool read_endpoint_hello(shm_raw::peer& p) {
  gdr::tcp::frame_parse_result r;
  std::vector<std::byte> b;
  const auto end = clock_type::now() + 2s;
  return p.next_frame(r, b, end) && r.header.type == frame_type::hello && p.next_frame(r, b, end) &&
         r.header.type == frame_type::credit;
}

/// A CUDA IPC descriptor frame's body (connection.hpp): the allocation and
/// the offset; the slot, for a descriptor passed over the socket.
std::vector<std::byte> ipc_body(const gdr::copy_engine::ipc_memory& m, std::uint64_t off, std::uint32_t slot = 0) {
  std::vector<std::byte> b(gdr::copy_engine::ipc_memory::wire_size + sizeof off);
  m.to_wire(b.data());
  if (m.kind == gdr::copy_engine::ipc_kind::fd) b[0] = static_cast<std::byte>(slot);
  std::memcpy(b.data() + gdr::copy_engine::ipc_memory::wire_size, &off, sizeof off);
  return b;
}

constexpr int kinds = 26;

hostile_case make_case(std::uint64_t seed) {
  rng r{seed * 0x2545f4914f6cdd1dull + 7};
  hostile_case c;
  const int kind = static_cast<int>(seed % kinds);
  c.message = pattern(1 + r.below(ring_cap / 2), seed);
  auto deliver = [m = c.message](shm_raw::peer& p) {
    p.hello();
    write_message(p, m);
  };
  switch (kind) {
    // ---- the handshake ----
    case 0:
      c.what = "hello with a wrong magic";
      do c.plan.magic = static_cast<std::uint32_t>(r()); while (c.plan.magic == d::hello_magic);
      c.expect = outcome::refused;
      break;
    case 1:
      c.what = "hello of another version";
      c.plan.version = r.below(2) != 0 ? 0 : 2 + static_cast<std::uint32_t>(r.below(1000));
      c.expect = outcome::refused;
      break;
    case 2:
      c.what = "hello with an unknown device word";
      c.plan.device = 3 + static_cast<std::uint32_t>(r.below(1u << 30));
      c.expect = outcome::refused;
      break;
    case 3:
      c.what = "a hello cut short";
      c.plan.hello_size = 1 + r.below(sizeof(d::hello_msg) - 1);
      c.expect = outcome::refused;
      break;
    case 4: {
      const int n[] = {0, 1, 3};
      c.plan.fds = n[r.below(3)];
      c.what = "a hello with " + std::to_string(c.plan.fds) + " descriptors";
      c.expect = outcome::refused;
      break;
    }
    case 5:
      c.what = "a ring not sealed against resizing";
      c.plan.seal = false;
      c.expect = outcome::refused;
      break;
    case 6:
      switch (r.below(3)) {
        case 0:
          c.what = "a ring with a wrong magic";
          do c.plan.segment_magic = static_cast<std::uint32_t>(r()); while (c.plan.segment_magic == d::segment_magic);
          break;
        case 1:
          c.what = "a ring of another version";
          c.plan.segment_version = 2 + static_cast<std::uint32_t>(r.below(100));
          break;
        default: {
          const std::uint64_t caps[] = {0, 1000, ring_cap / 2, ring_cap + 1, 2 * ring_cap, std::uint64_t{1} << 40,
                                        ~std::uint64_t{0}, r()};
          std::uint64_t word = caps[r.below(8)];
          if (word == ring_cap) word = ring_cap + 64;
          c.plan.segment_capacity = word;
          c.what = "a ring whose capacity word says " + std::to_string(word);
        }
      }
      c.expect = outcome::refused;
      break;
    case 7:
      c.what = "a hello whose ring size is not its ring's";
      do c.plan.ring_bytes = r.below(2) != 0 ? r() : std::uint64_t{1} << (12 + r.below(20)); while (c.plan.ring_bytes == ring_cap || c.plan.ring_bytes == 0);
      c.expect = outcome::refused;
      break;
    case 8:
      c.what = "a segment longer than its ring (allowed), then a message";
      c.plan.extra_bytes = 1 + r.below(1 << 20);
      c.act = deliver;
      c.expect = outcome::delivered;
      break;
    case 9:
      c.what = "a handshake's last byte that is neither 0 nor 1";
      c.plan.can_read = static_cast<std::uint8_t>(2 + r.below(254));
      c.expect = outcome::refused;
      break;
    // ---- frames ----
    case 10: {
      std::vector<std::byte> junk = pattern(64 + r.below(256), seed + 1);
      if (junk[0] == std::byte{'G'}) junk[0] = std::byte{'X'};
      c.what = "garbage where a frame should be (" + std::to_string(junk.size()) + " bytes)";
      c.act = [junk](shm_raw::peer& p) {
        p.hello();
        p.put(junk.data(), junk.size());
        p.publish();
      };
      c.expect = outcome::protocol;
      break;
    }
    case 11: {
      // A message whose header has one byte changed: judged by the parser
      // (and the transport's own checks: the sequence, the CUDA IPC mark).
      std::byte h[gdr::tcp::wire::header_size];
      gdr::tcp::encode_frame(eager(7, c.message.size()), 1, h);
      const std::size_t at = r.below(sizeof h);
      std::byte v;
      do v = static_cast<std::byte>(r()); while (v == h[at]);
      h[at] = v;
      c.what = "a message with byte " + std::to_string(at) + " of its header changed to " +
               std::to_string(static_cast<int>(v));
      const bool marked = at == 13 && (v == std::byte{1} || v == std::byte{2} || v == std::byte{3});
      const auto pr = gdr::tcp::parse_frame(std::span<const std::byte>(h), max_message);
      if (marked || pr.status != gdr::tcp::frame_status::ok || pr.seq != 1) c.expect = outcome::protocol;
      else if (pr.header == eager(7, c.message.size())) c.expect = outcome::delivered;  // (unreachable: no slack)
      else c.expect = outcome::any;  // another tag, another length: a message nobody waits for, or one still coming
      std::vector<std::byte> bytes(h, h + sizeof h);
      bytes.insert(bytes.end(), c.message.begin(), c.message.end());
      c.act = [bytes](shm_raw::peer& p) {
        p.hello();
        p.put(bytes.data(), bytes.size());
        p.publish();
      };
      break;
    }
    case 12: {
      const bool ahead = r.below(2) != 0;
      const std::uint64_t by = 1 + r.below(std::uint64_t{1} << 40);
      c.what = ahead ? "a head more than the ring ahead of the reader" : "a head behind the reader";
      c.act = [ahead, by](shm_raw::peer& p) {
        p.hello();
        p.publish();
        wait_consumed(p);
        p.publish_at(ahead ? p.head() + ring_cap + by : p.head() - by);
      };
      c.expect = outcome::protocol;
      break;
    }
    case 13: {
      const std::uint64_t by = 64 + r.below(ring_cap - 128);
      c.what = "a head " + std::to_string(by) + " bytes ahead over nothing written";
      c.act = [by](shm_raw::peer& p) {
        p.hello();
        p.publish();
        wait_consumed(p);
        p.publish_at(p.head() + by);
      };
      c.expect = outcome::protocol;  // zeros: no magic
      break;
    }
    case 14: {
      const std::uint64_t first = 1 + r.below(63);
      c.what = "a header published in two pieces (" + std::to_string(first) + " bytes first)";
      c.act = [first, m = c.message](shm_raw::peer& p) {
        p.hello();
        p.publish();
        const std::uint64_t at = p.head();
        p.frame(eager(7, m.size()), m);
        p.publish_at(at + first);
        std::this_thread::sleep_for(5ms);
        p.publish();
      };
      c.expect = outcome::delivered;
      break;
    }
    case 15: {
      frame_header h = eager(7, max_message + 1 + r.below(std::uint64_t{1} << 40));
      if (r.below(2) != 0) {
        h = frame_header{};
        h.type = frame_type::rts;
        h.tag = 7;
        h.id = 1;
        h.size = max_message + 1 + r.below(std::uint64_t{1} << 40);
      }
      c.what = "a message announced larger than this side accepts";
      c.act = [h](shm_raw::peer& p) {
        p.hello();
        p.frame(h);
        p.publish();
      };
      c.expect = outcome::protocol;
      break;
    }
    case 16: {
      const std::uint64_t len = (std::uint64_t{1} << 20) + r.below(max_message - (1u << 20));
      const std::uint64_t tag = 7 + r.below(2);
      c.what = "a message of " + std::to_string(len) + " bytes announced on tag " + std::to_string(tag) +
               ", 32 KiB of it sent";
      c.act = [len, tag](shm_raw::peer& p) {
        p.hello();
        p.frame(eager(tag, len));
        const auto junk = pattern(32 * 1024, 3);
        p.put(junk.data(), junk.size());
        p.publish();
      };
      c.expect = outcome::any;  // (the endpoint waits for the rest; it must not allocate it)
      break;
    }
    case 17: {
      const std::uint64_t a = r(), b = r();
      c.what = "both capacity words rewritten after the handshake, then a message";
      c.act = [a, b, m = c.message](shm_raw::peer& p) {
        p.theirs().capacity.store(a);
        p.mine().capacity.store(b);
        p.hello();
        write_message(p, m);
      };
      c.expect = outcome::delivered;
      break;
    }
    case 18: {
      const std::uint64_t a = std::uint64_t{1} << (17 + r.below(14)), b = r();
      c.what = "both capacity words rewritten before the endpoint builds its rings; it sends 1 MiB";
      c.before_last = [a, b](shm_raw::peer& p) {
        p.theirs().capacity.store(a);
        p.mine().capacity.store(b);
      };
      c.endpoint_sends = 100 * 1024;
      c.act = [m = c.message](shm_raw::peer& p) {
        p.hello();
        write_message(p, m);
        if (!read_endpoint_hello(p)) ::_exit(10);
        gdr::tcp::frame_parse_result fr;
        std::vector<std::byte> body;
        for (int i = 0; i < 10; ++i) {
          bool ok = false;
          do ok = p.next_frame(fr, body, clock_type::now() + 5s); while (ok && fr.header.type == frame_type::credit);
          if (!ok || body != pattern(100 * 1024, 77 + i)) ::_exit(11);
        }
      };
      c.child_verifies = true;
      c.expect = outcome::delivered;
      break;
    }
    case 19: {
      const auto released = static_cast<std::uint32_t>(r()), w1 = static_cast<std::uint32_t>(r()),
                 w2 = static_cast<std::uint32_t>(r());
      c.what = "garbage in the release bits and the waiting flags, then a message";
      c.act = [=, m = c.message](shm_raw::peer& p) {
        p.mine().released.store(released);
        p.mine().reader_waiting.store(w1);
        p.theirs().writer_waiting.store(w2);
        p.theirs().released.store(released);
        p.hello();
        write_message(p, m);
      };
      c.expect = outcome::delivered;
      break;
    }
    case 20: {
      const auto junk = pattern(1 + r.below(200), seed + 2);
      const bool with_fd = r.below(2) != 0;
      c.what = std::string("garbage on the socket") + (with_fd ? " with a descriptor" : "") + ", then a message";
      c.act = [junk, with_fd, m = c.message](shm_raw::peer& p) {
        const int fd = with_fd ? ::memfd_create("junk", MFD_CLOEXEC) : -1;
        shm_raw::send_with_fds(p.socket(), junk.data(), junk.size(), std::span<const int>(&fd, with_fd ? 1 : 0));
        if (fd >= 0) ::close(fd);
        p.hello();
        write_message(p, m);
      };
      c.expect = outcome::delivered;
      break;
    }
    // ---- the endpoint's ring: its tail and its count ----
    case 21: {
      const std::uint64_t by = 1 + r.below(std::uint64_t{1} << 40);
      c.what = "a tail past what the endpoint wrote, while it sends";
      c.endpoint_sends = 200 * 1024;
      c.act = [by](shm_raw::peer& p) {
        p.hello();
        p.publish();
        if (!read_endpoint_hello(p)) ::_exit(10);
        if (!p.wait_readable(1, clock_type::now() + 2s)) ::_exit(11);
        p.theirs().tail.store(p.theirs().head.load() + ring_cap + by);
        p.ring_bell();
      };
      c.expect = outcome::protocol;
      break;
    }
    case 22: {
      const std::uint64_t claimed = 11 + r.below(1u << 20);
      c.what = "a count of copies the endpoint never wrote (" + std::to_string(claimed) + " of at most 10)";
      c.single_copy = true;
      c.plan.can_read = 1;  // the endpoint sends large payloads as addresses
      c.endpoint_sends = 128 * 1024;
      c.act = [claimed](shm_raw::peer& p) {
        p.hello();
        p.publish();
        if (!read_endpoint_hello(p)) ::_exit(10);
        gdr::tcp::frame_parse_result fr;
        std::vector<std::byte> body;
        if (!p.next_frame(fr, body, clock_type::now() + 2s, 64 * 1024) || body.size() != 8) ::_exit(11);
        p.theirs().copied.store(claimed);
        p.ring_bell();
      };
      c.expect = outcome::protocol;
      break;
    }
    // ---- CUDA IPC descriptors ----
    case 23: {
      const auto mark = static_cast<std::uint8_t>(1 + r.below(3));
      c.what = "a CUDA IPC frame (mark " + std::to_string(mark) + ") where none was agreed";
      c.act = [mark, m = c.message](shm_raw::peer& p) {
        p.hello();
        p.frame(eager(7, m.size()), std::vector<std::byte>(104), mark);
        p.publish();
      };
      c.expect = outcome::protocol;
      break;
    }
    case 24: {
      // The driver's handle kind: the stand-in copies from the peer's
      // memory at the descriptor's base.
      c.plan.device = 1;
      const int how = static_cast<int>(r.below(6));
      const std::uint64_t junk = r();
      c.what = std::string("a CUDA IPC descriptor (handle) ") +
               (how == 0   ? "naming the peer's memory"
                : how == 1 ? "of another process"
                : how == 2 ? "of no GPU"
                : how == 3 ? "with an offset past its allocation"
                : how == 4 ? "whose payload runs past its allocation"
                           : "naming memory the peer does not have");
      c.act = [how, junk, m = c.message](shm_raw::peer& p) {
        gdr::copy_engine::ipc_memory im;
        im.kind = gdr::copy_engine::ipc_kind::handle;
        im.base = reinterpret_cast<std::uintptr_t>(m.data());
        im.size = m.size();
        im.buffer_id = 1;
        im.device = 0;
        im.pid = static_cast<std::int32_t>(::getpid());
        std::uint64_t off = 0;
        std::uint64_t len = m.size();
        if (how == 1) im.pid = static_cast<std::int32_t>(junk | 1) == im.pid ? 1 : static_cast<std::int32_t>(junk | 1);
        if (how == 2) im.device = -1 - static_cast<std::int32_t>(junk % 100);
        if (how == 3) off = m.size() + 1 + junk % 1000;
        if (how == 4) len = m.size() + 1;
        if (how == 5) im.base = 4096 + (junk % 4096);  // the first pages: never mapped
        p.hello();
        p.frame(eager(7, len), ipc_body(im, off), 1);
        p.publish();
        p.wait_hangup(5s);  // (keeps `m` alive while the endpoint copies)
      };
      c.expect = how == 0 ? outcome::delivered : how == 5 ? outcome::failed : outcome::protocol;
      break;
    }
    case 25: {
      // A descriptor passed over the socket (mark 2), or one the endpoint
      // should hold already (mark 3).
      c.plan.device = 1;
      const int how = static_cast<int>(r.below(7));
      const auto slot = static_cast<std::uint32_t>(r.below(16));
      const std::uint64_t junk = r();
      c.what = std::string("a CUDA IPC descriptor (file descriptor, slot ") + std::to_string(slot) + ") " +
               (how == 0   ? "passed as it should be"
                : how == 1 ? "never passed"
                : how == 2 ? "passed for another allocation"
                : how == 3 ? "for a slot out of range"
                : how == 4 ? "longer than its file"
                : how == 5 ? "said to be held in an empty slot"
                           : "said to be held after the peer freed it");
      c.act = [how, slot, junk, m = c.message](shm_raw::peer& p) {
        const int fd = ::memfd_create("gdr-test-block", MFD_CLOEXEC);
        if (fd < 0 || ::pwrite(fd, m.data(), m.size(), 0) != static_cast<ssize_t>(m.size())) ::_exit(12);
        gdr::copy_engine::ipc_memory im;
        im.kind = gdr::copy_engine::ipc_kind::fd;
        im.base = 0x200000000ull;
        im.size = m.size();
        im.buffer_id = 5;
        im.device = 0;
        im.pid = static_cast<std::int32_t>(::getpid());
        std::uint32_t s = slot;
        if (how == 3) s = 16 + static_cast<std::uint32_t>(junk % 240);
        if (how == 4) im.size = m.size() + 4096 + junk % (1u << 20);
        p.hello();
        if (how != 1 && how != 5) {
          if (how == 2) p.pass_fd(fd, im.buffer_id + 1, im.base, s);
          else p.pass_fd(fd, im.buffer_id, im.base, s);
        }
        p.frame(eager(7, m.size()), ipc_body(im, 0, s), how == 5 ? 3 : 2);
        p.publish();
        if (how == 6) {
          // Held (the frame above), then freed, then named as held.
          wait_consumed(p);
          p.mine().released.store(1u << s);
          p.ring_bell();
          const auto end = clock_type::now() + 2s;
          while (p.mine().released.load() != 0 && clock_type::now() < end) std::this_thread::sleep_for(50us);
          p.frame(eager(7, m.size()), ipc_body(im, 0, s), 3);
          p.publish();
        }
        ::close(fd);
      };
      c.expect = how == 0 ? outcome::delivered : how == 4 ? outcome::failed : outcome::protocol;
      c.first_delivered = how == 6;
      break;
    }
  }
  return c;
}

/// Whether this build has a sanitizer: a fork costs several times more
/// there (its shadow memory), so fewer seeds run by default.
constexpr bool sanitized =
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
    true;
#else
    false;
#endif
#else
    false;
#endif

/// The seeds to run: GDR_SHM_HOSTILE_SEED alone, else 0..GDR_SHM_HOSTILE_SEEDS-1
/// (by default each kind 6 times, 2 under a sanitizer: a few seconds).
std::vector<std::uint64_t> seeds() {
  if (const char* s = std::getenv("GDR_SHM_HOSTILE_SEED"); s != nullptr && *s != '\0')
    return {std::strtoull(s, nullptr, 10)};
  std::uint64_t n = (sanitized ? 2 : 6) * kinds;
  if (const char* s = std::getenv("GDR_SHM_HOSTILE_SEEDS"); s != nullptr && *s != '\0') n = std::strtoull(s, nullptr, 10);
  std::vector<std::uint64_t> v;
  for (std::uint64_t i = 0; i < n; ++i) v.push_back(i);
  return v;
}

/// The forked peer: the case's handshake and acts, then it waits for the
/// endpoint's hang-up. Never returns.
[[noreturn]] void run_child(const std::string& name, const hostile_case& c) {
  ::alarm(20);
  ::syscall(SYS_close_range, 3u, ~0u, 0u);  // nothing of the parent's: its sockets' ends are its own
  shm_raw::peer p;
  if (!p.connect(name, c.plan, c.before_last)) ::_exit(0);  // refused (the parent checks how)
  c.act(p);
  p.wait_hangup(10s);
  ::_exit(0);
}

}  // namespace

namespace {

/// Runs the cases of `run` against endpoints on a scheduler in `mode`,
/// with an honest pair served beside them; counts their outcomes.
void run_cases(gdr::run_mode mode, const std::vector<std::uint64_t>& run, int (&by_outcome)[5], std::size_t& largest_seen) {
  gdr::scheduler sched({.mode = mode});
  staged::env env(sched);
#if !GDR_HAS_CUDA
  env.ce.ipc = true;  // the stand-in shares "device" memory: CUDA IPC can be agreed
#endif
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    // The other peer this process serves all along: a pair in this process.
    shm::listener honest_l(sched);
    auto [cx, cy] = co_await gdr::when_all(shm::connect(sched, honest_l.name()), honest_l.accept());
    shm::endpoint hx = std::move(cx), hy = std::move(cy);  // (clang 14 captures no structured binding)
    std::uint32_t round = 0;
    auto honest_round = [&]() -> gdr::task<bool> {
      const auto out = pattern(1000, ++round);
      std::vector<std::byte> in(1000);
      auto [s, rr] = co_await gdr::when_all(
          report_of(hx.send(gdr::view<const std::byte, gdr::Host>(out.data(), out.size()), gdr::tag{1})),
          report_of(hy.recv(gdr::view<std::byte, gdr::Host>(in.data(), in.size()), gdr::tag{1})));
      co_return !s.error && !rr.error && in == out;
    };
    for (std::uint64_t seed : run) {
      const hostile_case c = make_case(seed);
      const std::string replay = "GDR_SHM_HOSTILE_SEED=" + std::to_string(seed);
      CAPTURE(replay);
      CAPTURE(c.what);
      const std::string expected = to_string(c.expect);
      CAPTURE(expected);
      shm::endpoint_options o;
      o.ring_bytes = ring_cap;
      o.close_linger = 200ms;
      if (c.single_copy) o.single_copy_threshold = 64 * 1024;
      shm::listener l(sched, {}, gdr::default_registry(), o);
      const pid_t child = ::fork();
      REQUIRE(child >= 0);
      if (child == 0) run_child(l.name(), c);
      // The test's own buffers first: what is allocated from here on is the endpoint's.
      std::vector<std::byte> in(ring_cap);
      std::vector<gdr::op_report> sent(c.endpoint_sends != 0 ? 10 : 0);
      std::vector<std::vector<std::byte>> payloads;
      for (std::size_t i = 0; i < sent.size(); ++i) payloads.push_back(pattern(c.endpoint_sends, 77 + i));
      gdr_test_support::reset_largest_request();
      bool refused = false;
      std::error_code refusal;
      shm::endpoint ep;
      try {
        ep = co_await l.accept(2s);
      } catch (const gdr::error& e) {
        refused = true;
        refusal = e.code();
      }
      if (c.expect == outcome::refused) {
        CHECK(refused);
        CHECK(refusal == gdr::errc::protocol_error);
      } else {
        REQUIRE_FALSE(refused);
      }
      if (!refused) {
        int done = 0, sends_done = 0;
        gdr::op_report got;
        start(ep.recv(gdr::view<std::byte, gdr::Host>(in.data(), in.size()), gdr::tag{7}), got, done);
        for (std::size_t i = 0; i < sent.size(); ++i)
          start(ep.send(gdr::view<const std::byte, gdr::Host>(payloads[i].data(), payloads[i].size())), sent[i],
                sends_done);
        switch (c.expect) {
          case outcome::protocol:
          case outcome::failed:
            CHECK(co_await wait_until([&] { return !ep.is_open(); }, 3s));
            if (c.expect == outcome::protocol) {
              CHECK(ep.error() == gdr::errc::protocol_error);
            } else {
              CHECK(ep.error());
            }
            CHECK(co_await wait_until([&] { return done == 1; }, 2s));
            CHECK(static_cast<bool>(got.error) == !c.first_delivered);
            break;
          case outcome::delivered:
            CHECK(co_await wait_until([&] { return done == 1; }, 3s));
            CHECK(!got.error);
            CHECK(got.bytes == c.message.size());
            CHECK(std::equal(c.message.begin(), c.message.end(), in.begin()));
            CHECK(ep.is_open());
            if (!sent.empty()) CHECK(co_await wait_until([&] { return sends_done == static_cast<int>(sent.size()); }, 5s));
            break;
          case outcome::any:
          case outcome::refused: co_await gdr::sleep_for(20ms); break;
        }
        // Nothing the peer's words asked for was allocated (a message of up
        // to 1 GiB announced, lengths, counts, descriptors).
        const std::size_t largest = gdr_test_support::largest_request();
        CHECK(largest <= gdr::protocol_options{}.unexpected_bytes + (256u << 10));
        largest_seen = std::max(largest_seen, largest);
        (void)co_await report_of(ep.close(2s));
        CHECK(co_await wait_until([&] { return done == 1 && sends_done == static_cast<int>(sent.size()); }, 3s));
      }
      // The child ends at the endpoint's hang-up; a stalled one is ended here.
      int st = 0;
      const auto until = clock_type::now() + 3s;
      while (::waitpid(child, &st, WNOHANG) == 0) {
        if (clock_type::now() > until) {
          ::kill(child, SIGKILL);
          ::waitpid(child, &st, 0);
          break;
        }
        co_await gdr::sleep_for(1ms);
      }
      CHECK(WIFEXITED(st));
      if (c.child_verifies) CHECK(WEXITSTATUS(st) == 0);
      // The others are served still.
      CHECK(co_await honest_round());
      ++by_outcome[static_cast<int>(c.expect)];
    }
    CHECK(hx.is_open());
    CHECK(hy.is_open());
    co_await gdr::when_all(report_of(hx.close()), report_of(hy.close()));
  }());
  sched.drain();
  CHECK(sched.inflight() == 0);
}

}  // namespace

TEST_CASE("seeded hostile shared-memory peers: no crash, protocol_error, nothing allocated at the peer's word, the others served") {
  gdr_test_support::watchdog dog(300);
  const std::vector<std::uint64_t> all = seeds();
  const auto t0 = clock_type::now();
  int by_outcome[5] = {};
  std::size_t largest = 0;
  // Each round of the kinds in the other run mode: even rounds sleep, odd
  // ones busy-poll (a seed replays in its own).
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    std::vector<std::uint64_t> run;
    for (std::uint64_t seed : all)
      if (((seed / kinds) % 2 == 1) == (mode == gdr::run_mode::busy_poll)) run.push_back(seed);
    const std::string run_mode = mode == gdr::run_mode::busy_poll ? "busy_poll" : "sleep";
    CAPTURE(run_mode);
    if (!run.empty()) run_cases(mode, run, by_outcome, largest);
  }
  MESSAGE(all.size() << " seeds in " << std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - t0).count()
                     << " ms: refused " << by_outcome[0] << ", protocol_error " << by_outcome[1] << ", failed "
                     << by_outcome[2] << ", delivered " << by_outcome[3] << ", any " << by_outcome[4]
                     << "; the largest allocation while a case ran: " << largest << " bytes");
}
