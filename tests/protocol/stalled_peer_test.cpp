// A peer that is alive but does not run its loop (it computes, sits in a
// debugger, is stopped): a timeout or stop ends a send at about its
// deadline, whatever that peer does, unless the send is committed (issue
// "Hostile, stalled and careless peers", item 9). Before, a 1 MiB send with
// a 1000 ms timeout to a peer that blocked its thread for 8 s returned ok
// after 7.7 s (the stop sent rts_cancel and waited for the peer's answer),
// and a send waiting behind a write the full socket held up waited for the
// peer too. Then, the peer running again, what it sees is consistent: the
// withdrawn message is never delivered, later ones are.
//
// Each case runs over loopback, TCP and shared memory, with the peer on a
// scheduler of its own whose thread blocks inside its coroutine (so its
// loop does not run) while this side sends.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/timeout.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/shm.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/protocol/conformance.hpp"

using namespace std::chrono_literals;
using conformance::pattern;
using gdr::errc;
using gdr::op_report;

namespace {

template <class T>
gdr::view<std::byte, gdr::Host> bytes_of(T& v) {
  return gdr::view<std::byte, gdr::Host>(v.data(), v.size());
}
template <class T>
gdr::view<const std::byte, gdr::Host> cbytes_of(const T& v) {
  return gdr::view<const std::byte, gdr::Host>(v.data(), v.size());
}

// ---- a pair across two schedulers: `a` here, `b` on a thread of its own ----

/// Where the two sides meet: what the peer's side publishes for this one.
struct meeting {
  std::atomic<bool> ready{false};
  std::uint16_t port = 0;
  std::string name;
  gdr::loopback::endpoint la, lb;
};

struct loopback_side {
  using endpoint = gdr::loopback::endpoint;
  static constexpr const char* name = "loopback";
  static void prepare(gdr::scheduler& sa, gdr::scheduler& sb, const gdr::protocol_options& ob, meeting& m) {
    // One option set serves both ends of a pair: the peer's (its limits).
    std::tie(m.la, m.lb) = gdr::loopback::make_pair(sa, sb, gdr::default_registry(), ob);
  }
  static gdr::task<endpoint> b_side(gdr::scheduler&, meeting& m, const gdr::protocol_options&) {
    co_return std::move(m.lb);
  }
  static gdr::task<endpoint> a_side(gdr::scheduler&, meeting& m, const gdr::protocol_options&) {
    co_return std::move(m.la);
  }
};

struct tcp_side {
  using endpoint = gdr::tcp::endpoint;
  static constexpr const char* name = "tcp";
  /// The sending side's socket options (a case may lower user_timeout).
  static inline gdr::tcp::socket_options a_socket{};
  static void prepare(gdr::scheduler&, gdr::scheduler&, const gdr::protocol_options&, meeting&) {}
  static gdr::task<endpoint> b_side(gdr::scheduler& s, meeting& m, const gdr::protocol_options& o) {
    gdr::tcp::endpoint_options eo;
    eo.protocol = o;
    gdr::tcp::listener l(s, gdr::tcp::address::loopback(0), gdr::default_registry(), eo);
    auto acc = l.accept();
    m.port = l.local_address().port();
    m.ready = true;
    co_return co_await std::move(acc);
  }
  static gdr::task<endpoint> a_side(gdr::scheduler& s, meeting& m, const gdr::protocol_options& o) {
    while (!m.ready.load()) co_await gdr::sleep_for(1ms);
    gdr::tcp::endpoint_options eo;
    eo.protocol = o;
    eo.socket = a_socket;
    co_return co_await gdr::tcp::connect(s, gdr::tcp::address::loopback(m.port), {}, gdr::default_registry(), eo);
  }
};

struct shm_side {
  using endpoint = gdr::shm::endpoint;
  static constexpr const char* name = "shm";
  static void prepare(gdr::scheduler&, gdr::scheduler&, const gdr::protocol_options&, meeting&) {}
  static gdr::task<endpoint> b_side(gdr::scheduler& s, meeting& m, const gdr::protocol_options& o) {
    gdr::shm::endpoint_options eo;
    eo.protocol = o;
    gdr::shm::listener l(s, {}, gdr::default_registry(), eo);
    auto acc = l.accept();
    m.name = l.name();
    m.ready = true;
    co_return co_await std::move(acc);
  }
  static gdr::task<endpoint> a_side(gdr::scheduler& s, meeting& m, const gdr::protocol_options& o) {
    while (!m.ready.load()) co_await gdr::sleep_for(1ms);
    gdr::shm::endpoint_options eo;
    eo.protocol = o;
    co_return co_await gdr::shm::connect(s, m.name, gdr::default_registry(), eo);
  }
};

#define STALLED_TRANSPORTS loopback_side, tcp_side, shm_side

/// The peer's phases, told across the two threads.
struct phases {
  std::atomic<int> at{0};
  static constexpr int stalled = 1, resumed = 2, done = 3;

  /// The peer: blocks its thread (its loop does not run) until told to go on.
  void stall() {
    at = stalled;
    while (at.load() < resumed) std::this_thread::sleep_for(1ms);
  }
  /// This side: waits, running its loop, until the peer has stalled.
  gdr::task<> until_stalled() {
    while (at.load() < stalled) co_await gdr::sleep_for(1ms);
  }
  /// This side: lets the peer go on, then runs its loop until the peer is done.
  gdr::task<> resume_and_wait() {
    at = resumed;
    while (at.load() < done) co_await gdr::sleep_for(1ms);
  }
};

/// Runs `body_b(b, ph)` on the peer's thread and `body_a(a, ph)` here, after
/// a first message each way has made sure both handshakes are done.
template <class F, class BodyA, class BodyB>
void run_stalled(BodyA body_a, BodyB body_b, gdr::protocol_options oa = {}, gdr::protocol_options ob = {}) {
  conformance::watchdog dog(60);
  gdr::scheduler sa, sb;
  meeting m;
  phases ph;
  F::prepare(sa, sb, ob, m);
  std::thread tb([&] {
    gdr::sync_wait(sb, [&]() -> gdr::task<> {
      typename F::endpoint b = co_await F::b_side(sb, m, ob);
      std::vector<std::byte> ping(8);
      CHECK(co_await b.recv(bytes_of(ping), {10s}) == 8);
      co_await b.send(cbytes_of(ping), {10s});
      co_await body_b(b, ph);
      ph.at = phases::done;
      co_await b.close({10s});
    }());
    sb.drain();
  });
  gdr::sync_wait(sa, [&]() -> gdr::task<> {
    typename F::endpoint a = co_await F::a_side(sa, m, oa);
    std::vector<std::byte> ping(8);
    co_await a.send(cbytes_of(ping), {10s});
    CHECK(co_await a.recv(bytes_of(ping), {10s}) == 8);
    co_await body_a(a, ph);
    co_await a.close({10s});
  }());
  sa.drain();
  tb.join();
}

/// Awaits `op`, keeping its report in `out`.
gdr::task<> keep(gdr::op_awaitable op, op_report& out) { out = co_await std::move(op).report(); }

/// How long `op` took, and its report.
template <class Op>
gdr::task<std::pair<op_report, std::chrono::milliseconds>> timed(Op op) {
  auto t0 = std::chrono::steady_clock::now();
  op_report r = co_await std::move(op).report();
  co_return std::pair(r, std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0));
}

/// Ended "at about its deadline": not before, and within half a second after.
void check_deadline(std::chrono::milliseconds took, std::chrono::milliseconds deadline) {
  CAPTURE(took.count());
  CHECK(took >= deadline - 50ms);
  CHECK(took < deadline + 500ms);
}

}  // namespace

TEST_CASE_TEMPLATE("a rendezvous send to a peer whose loop does not run ends at its timeout; the peer then gets the "
                   "next message in the receive it had posted",
                   F, STALLED_TRANSPORTS) {
  const auto m1 = pattern(1 << 20, 1), m2 = pattern(1 << 20, 2);
  std::vector<std::byte> in(1 << 20);
  op_report got{}, sent2{};
  run_stalled<F>(
      [&](auto& a, phases& ph) -> gdr::task<> {
        co_await ph.until_stalled();
        auto [r, took] = co_await timed(a.send(cbytes_of(m1), {1000ms}));
        CHECK(r.error == errc::timed_out);
        check_deadline(took, 1000ms);
        CHECK(a.stats().withdrawn == 1);
        gdr::task_scope scope;
        scope.spawn(keep(a.send(cbytes_of(m2), {20s}), sent2));
        co_await ph.resume_and_wait();
        co_await scope.join();
        CHECK(!sent2.error);
        // Over a socket or a ring the peer's receive matched the withdrawn
        // announcement first (it had it when it ran again): its rtr came
        // late. On loopback the announcement was still queued, so it was
        // taken back instead.
        CHECK(a.stats().late_rtrs == (std::string(F::name) == "loopback" ? 0u : 1u));
      },
      [&](auto& b, phases& ph) -> gdr::task<> {
        gdr::task_scope scope;
        scope.spawn(keep(b.recv(bytes_of(in), {30s}), got));
        co_await gdr::sleep_for(10ms);  // posted (the loop ran): then the peer stalls
        ph.stall();
        co_await scope.join();
        CHECK(!got.error);
        CHECK(got.bytes == m2.size());
        CHECK(in == m2);  // the withdrawn message is never delivered
      });
}

TEST_CASE_TEMPLATE("a rendezvous send to a peer whose loop does not run ends when stopped; the peer later gets only "
                   "the messages after it",
                   F, STALLED_TRANSPORTS) {
  const auto m1 = pattern(1 << 20, 1), m2 = pattern(1 << 20, 2);
  std::vector<std::byte> in(1 << 20);
  op_report got{}, sent2{};
  run_stalled<F>(
      [&](auto& a, phases& ph) -> gdr::task<> {
        co_await ph.until_stalled();
        std::stop_source stop;
        auto [results, x] = co_await gdr::when_all(timed(a.send(cbytes_of(m1), {stop.get_token()})),
                                                   [&]() -> gdr::task<int> {
                                                     co_await gdr::sleep_for(300ms);
                                                     stop.request_stop();
                                                     co_return 0;
                                                   }());
        auto [r, took] = results;
        CHECK(r.error == errc::cancelled);
        check_deadline(took, 300ms);
        gdr::task_scope scope;
        scope.spawn(keep(a.send(cbytes_of(m2), {20s}), sent2));
        co_await ph.resume_and_wait();
        co_await scope.join();
        CHECK(!sent2.error);
      },
      [&](auto& b, phases& ph) -> gdr::task<> {
        ph.stall();
        // The loop runs again before the receive is posted: the withdrawn
        // announcement is forgotten (its rts_cancel read) by then.
        co_await gdr::sleep_for(200ms);
        got = co_await b.recv(bytes_of(in), {10s}).report();
        CHECK(!got.error);
        CHECK(in == m2);
        CHECK(b.stats().recvs == 2);  // the ping and m2: nothing else came
      });
}

TEST_CASE_TEMPLATE("a 64 KiB send once the eager credit is spent, to a peer whose loop does not run, ends at its "
                   "timeout",
                   F, STALLED_TRANSPORTS) {
  // The peer's 1 MiB of room for early messages is 16 of these: the 17th
  // is announced (rendezvous), and nothing answers it.
  constexpr int eager = 16;
  std::vector<std::vector<std::byte>> out;
  for (int i = 0; i < eager + 2; ++i) out.push_back(pattern(64 << 10, static_cast<std::uint32_t>(10 + i)));
  std::vector<op_report> sent(eager + 2);
  std::vector<std::vector<std::byte>> in(eager + 1, std::vector<std::byte>(64 << 10));
  run_stalled<F>(
      [&](auto& a, phases& ph) -> gdr::task<> {
        co_await ph.until_stalled();
        gdr::task_scope scope;
        for (int i = 0; i < eager; ++i) scope.spawn(keep(a.send(cbytes_of(out[i]), {20s}), sent[i]));
        auto [r, took] = co_await timed(a.send(cbytes_of(out[eager]), {1000ms}));
        CHECK(r.error == errc::timed_out);
        CHECK(r.protocol == gdr::wire_protocol::rendezvous);
        check_deadline(took, 1000ms);
        scope.spawn(keep(a.send(cbytes_of(out[eager + 1]), {20s}), sent[eager + 1]));
        co_await ph.resume_and_wait();
        co_await scope.join();
        for (int i = 0; i < eager; ++i) CHECK(!sent[i].error);
        CHECK(!sent[eager + 1].error);
      },
      [&](auto& b, phases& ph) -> gdr::task<> {
        ph.stall();
        for (int i = 0; i <= eager; ++i) {
          op_report g = co_await b.recv(bytes_of(in[i]), {10s}).report();
          CHECK(!g.error);
        }
        for (int i = 0; i < eager; ++i) CHECK(in[i] == out[i]);
        CHECK(in[eager] == out[eager + 1]);  // the withdrawn one never came
      });
}

TEST_CASE_TEMPLATE("a send waiting for the peer's message credit ends at its timeout while the peer's loop does not run",
                   F, STALLED_TRANSPORTS) {
  gdr::protocol_options ob;
  ob.unexpected_messages = 4;  // the peer keeps 4 early messages: the 5th send waits here
  std::vector<std::vector<std::byte>> out;
  for (int i = 0; i < 6; ++i) out.push_back(pattern(100, static_cast<std::uint32_t>(20 + i)));
  std::vector<op_report> sent(6);
  run_stalled<F>(
      [&](auto& a, phases& ph) -> gdr::task<> {
        co_await ph.until_stalled();
        gdr::task_scope scope;
        for (int i = 0; i < 4; ++i) scope.spawn(keep(a.send(cbytes_of(out[i]), {20s}), sent[i]));
        auto [r, took] = co_await timed(a.send(cbytes_of(out[4]), {500ms}));
        CHECK(r.error == errc::timed_out);
        check_deadline(took, 500ms);
        scope.spawn(keep(a.send(cbytes_of(out[5]), {20s}), sent[5]));
        co_await ph.resume_and_wait();
        co_await scope.join();
        for (int i : {0, 1, 2, 3, 5}) CHECK(!sent[i].error);
      },
      [&](auto& b, phases& ph) -> gdr::task<> {
        ph.stall();
        std::vector<std::byte> in(100);
        for (int i : {0, 1, 2, 3, 5}) {
          CHECK(co_await b.recv(bytes_of(in), {10s}) == 100);
          CHECK(in == out[i]);
        }
      },
      {}, ob);
}

TEST_CASE_TEMPLATE("an eager send queued behind what a peer whose loop does not run holds up ends at its timeout", F,
                   STALLED_TRANSPORTS) {
  // Eager messages of 512 KiB, room for 64 MiB of them at the peer: 24 are
  // more than its socket buffers or its ring hold, so the writer stops
  // with a message cut in the middle. The one queued behind them has not
  // begun: its timeout withdraws it (it waited in the transport's queue).
  gdr::protocol_options oa, ob;
  oa.rendezvous_threshold = ob.rendezvous_threshold = 1 << 20;
  ob.unexpected_bytes = 64 << 20;
  constexpr int ahead = 24;
  std::vector<std::vector<std::byte>> out;
  for (int i = 0; i < ahead + 2; ++i) out.push_back(pattern(512 << 10, static_cast<std::uint32_t>(40 + i)));
  std::vector<op_report> sent(ahead + 2);
  run_stalled<F>(
      [&](auto& a, phases& ph) -> gdr::task<> {
        co_await ph.until_stalled();
        gdr::task_scope scope;
        for (int i = 0; i < ahead; ++i) scope.spawn(keep(a.send(cbytes_of(out[i]), {20s}), sent[i]));
        auto [r, took] = co_await timed(a.send(cbytes_of(out[ahead]), {1000ms}));
        CHECK(r.error == errc::timed_out);
        CHECK(r.protocol == gdr::wire_protocol::eager);
        check_deadline(took, 1000ms);
        scope.spawn(keep(a.send(cbytes_of(out[ahead + 1]), {20s}), sent[ahead + 1]));
        co_await ph.resume_and_wait();
        co_await scope.join();
        for (int i = 0; i < ahead; ++i) CHECK(!sent[i].error);
        CHECK(!sent[ahead + 1].error);
      },
      [&](auto& b, phases& ph) -> gdr::task<> {
        ph.stall();
        std::vector<std::byte> in(512 << 10);
        for (int i = 0; i <= ahead + 1; ++i) {
          if (i == ahead) continue;  // withdrawn: never delivered
          CHECK(co_await b.recv(bytes_of(in), {10s}) == in.size());
          CHECK(in == out[i]);
        }
      },
      oa, ob);
}

TEST_CASE_TEMPLATE("a deadline around a stream of sends to a peer whose loop does not run ends the stream at it", F,
                   STALLED_TRANSPORTS) {
  // The pipeline: per-send timeouts inside an overall deadline.
  // Before, it hung as long as the peer was stopped.
  const auto m = pattern(1 << 20, 7);
  run_stalled<F>(
      [&](auto& a, phases& ph) -> gdr::task<> {
        co_await ph.until_stalled();
        int attempts = 0;
        auto stream = [&]() -> gdr::task<gdr::result<int>> {
          for (;;) {
            ++attempts;
            op_report r = co_await a.send(cbytes_of(m), {700ms}).report();
            if (!r.error) co_return 0;
            if (r.error != errc::timed_out) co_return r.error;  // the deadline's stop: cancelled
          }
        };
        auto t0 = std::chrono::steady_clock::now();
        gdr::result<int> r = co_await gdr::try_with_timeout(2s, stream());
        auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
        CHECK(r.error() == errc::timed_out);
        check_deadline(took, 2000ms);
        CHECK(attempts == 3);  // 700 ms each: the third was stopped by the deadline
        co_await ph.resume_and_wait();
      },
      [&](auto& b, phases& ph) -> gdr::task<> {
        ph.stall();
        // None of those sends is delivered.
        std::vector<std::byte> in(1 << 20);
        op_report g = co_await b.recv(bytes_of(in), {300ms}).report();
        CHECK(g.error == errc::timed_out);
      });
}

TEST_CASE("a committed rendezvous send to a TCP peer whose loop stopped mid-message is bounded by user_timeout") {
  // Its receive took it (the rtr came), then the peer stopped reading: the
  // data is on its way and the send cannot be withdrawn, so its own
  // timeout does not end it. The kernel does: the peer's window stays
  // shut, and after user_timeout the connection is dropped (GUIDE
  // sections 7 and 10).
  tcp_side::a_socket.user_timeout = 1000ms;
  const auto big = pattern(64 << 20, 9);
  std::vector<std::byte> in(64 << 20);
  op_report got{};
  run_stalled<tcp_side>(
      [&](auto& a, phases& ph) -> gdr::task<> {
        gdr::task_scope scope;
        op_report sent{};
        auto t0 = std::chrono::steady_clock::now();
        scope.spawn(keep(a.send(cbytes_of(big), {300ms}), sent));
        co_await scope.join();
        auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
        MESSAGE("the committed send ended after " << took.count() << " ms: " << sent.error.message());
        CHECK(sent.error == errc::connection_lost);
        CHECK(took >= 900ms);  // not its own 300 ms: it was committed
        CHECK(took < 10s);     // but user_timeout (1 s, and the kernel's probe times)
        co_await ph.until_stalled();
        co_await ph.resume_and_wait();
      },
      [&](auto& b, phases& ph) -> gdr::task<> {
        gdr::task_scope scope;
        const std::uint64_t out = b.stats().frames_out;
        scope.spawn(keep(b.recv(bytes_of(in), {60s}), got));
        // Its rtr is out: the data starts; the peer stops reading now.
        while (b.stats().frames_out == out) co_await gdr::sleep_for(1ms);
        ph.stall();
        co_await scope.join();
        CHECK(got.error == errc::connection_lost);
      });
  tcp_side::a_socket = {};
}
