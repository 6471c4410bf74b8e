// The protocol layer's conformance suite: every rule of
// gdr/protocol/engine.hpp, checked over every transport (loopback and TCP
// today; each new transport adds a fixture in conformance.hpp and inherits
// all of it), in both run modes where timing matters.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stop_token>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include <gdr/coro/when_all.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/protocol/conformance.hpp"

using namespace std::chrono_literals;
using conformance::pattern;
using conformance::report_of;
using gdr::op_report;
using gdr::tag;
using gdr::wire_protocol;

namespace {

gdr::protocol_options small_threshold(std::size_t e) {
  gdr::protocol_options o;
  o.rendezvous_threshold = e;
  return o;
}

template <class T>
gdr::view<std::byte, gdr::Host> bytes_of(T& v) {
  return gdr::view<std::byte, gdr::Host>(v.data(), v.size());
}
template <class T>
gdr::view<const std::byte, gdr::Host> cbytes_of(const T& v) {
  return gdr::view<const std::byte, gdr::Host>(v.data(), v.size());
}

/// Requests a stop of `src` after `d`. (Its parameters live in the
/// coroutine's frame: a lambda's captures would die with the lambda.)
gdr::task<op_report> stop_after(std::stop_source& src, std::chrono::milliseconds d) {
  co_await gdr::sleep_for(d);
  src.request_stop();
  co_return op_report{};
}

}  // namespace

TEST_CASE_TEMPLATE("messages keep their boundaries and order at every size around the rendezvous threshold",
                   T, CONFORMANCE_TRANSPORTS) {
  constexpr std::size_t e = 4096;
  const std::vector<std::size_t> sizes{0, 1, 7, e - 1, e, e + 1, 3 * e + 5, (1u << 20) + 3};
  for (bool recv_first : {true, false}) {
    CAPTURE(recv_first);
    conformance::run_both<T>(
        [&](auto& a, auto& b) -> gdr::task<> {
          std::vector<std::vector<std::byte>> out, in;
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            out.push_back(pattern(sizes[i], static_cast<std::uint32_t>(i)));
            in.emplace_back(sizes[i] + 16);
          }
          std::vector<gdr::task<op_report>> recvs, sends;
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            auto s = report_of(a.send(cbytes_of(out[i])));
            auto r = report_of(b.recv(bytes_of(in[i])));
            if (recv_first) {
              recvs.push_back(std::move(r));
              sends.push_back(std::move(s));
            } else {
              sends.push_back(std::move(s));
              recvs.push_back(std::move(r));
            }
          }
          auto [rs, ss] = co_await gdr::when_all(gdr::when_all(std::move(recvs)), gdr::when_all(std::move(sends)));
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            CAPTURE(sizes[i]);
            REQUIRE(!ss[i].error);
            REQUIRE(!rs[i].error);
            CHECK(ss[i].bytes == sizes[i]);
            CHECK(rs[i].bytes == sizes[i]);
            CHECK(rs[i].message_size == sizes[i]);
            CHECK(std::equal(out[i].begin(), out[i].end(), in[i].begin()));
            wire_protocol want = sizes[i] > e ? wire_protocol::rendezvous : wire_protocol::eager;
            CHECK(ss[i].protocol == want);
            CHECK(rs[i].protocol == want);
          }
          CHECK(a.stats().rendezvous_sends == 3);
          CHECK(a.stats().eager_sends == 5);
          co_await a.close();
          co_await b.close();
        },
        small_threshold(e), small_threshold(e));
  }
}

TEST_CASE_TEMPLATE("receives match messages of their own tag, in order, whatever else is waiting", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>(
      [&](auto& a, auto& b) -> gdr::task<> {
        // Sent: 1:A, 2:B, 1:C (C large: rendezvous), 3:D. Received: tag 2, tag 3, then tag 1 twice.
        auto A = pattern(10, 1), B = pattern(20, 2), C = pattern(200000, 3), D = pattern(30, 4);
        co_await a.send(cbytes_of(A), tag{1});
        co_await a.send(cbytes_of(B), tag{2});
        auto big = report_of(a.send(cbytes_of(C), tag{1}));
        co_await a.send(cbytes_of(D), tag{3});
        std::vector<std::byte> in(300000);
        std::size_t n = co_await b.recv(bytes_of(in), tag{2});
        CHECK(n == B.size());
        CHECK(std::equal(B.begin(), B.end(), in.begin()));
        n = co_await b.recv(bytes_of(in), tag{3});
        CHECK(n == D.size());
        CHECK(std::equal(D.begin(), D.end(), in.begin()));
        n = co_await b.recv(bytes_of(in), tag{1});
        CHECK(n == A.size());
        CHECK(std::equal(A.begin(), A.end(), in.begin()));
        auto [r, s] = co_await gdr::when_all(report_of(b.recv(bytes_of(in), tag{1})), std::move(big));
        CHECK(!r.error);
        CHECK(!s.error);
        CHECK(r.bytes == C.size());
        CHECK(r.tag == 1);
        CHECK(std::equal(C.begin(), C.end(), in.begin()));
        co_await a.close();
      },
      small_threshold(64 * 1024), small_threshold(64 * 1024));
}

TEST_CASE_TEMPLATE("a large message nobody receives yet blocks neither the messages behind it nor the connection", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    // 32 MiB announced and left waiting; small messages and one-sided work
    // behind it still flow.
    auto big = pattern(32u << 20, 9);
    std::vector<std::byte> big_in(big.size());
    auto small_traffic = [&]() -> gdr::task<int> {
      int ok = 0;
      for (int i = 0; i < 20; ++i) {
        auto m = pattern(100, static_cast<std::uint32_t>(i));
        std::vector<std::byte> in(100);
        auto [s, r] = co_await gdr::when_all(report_of(a.send(cbytes_of(m), tag{1})),
                                             report_of(b.recv(bytes_of(in), tag{1})));
        if (!s.error && !r.error && in == m) ++ok;
      }
      co_return ok;
    };
    // when_all starts the big send first; only after the small traffic is
    // the big message received.
    auto [sent, ok] = co_await gdr::when_all(report_of(a.send(cbytes_of(big), tag{7})), [&]() -> gdr::task<int> {
      int n = co_await small_traffic();
      co_await b.recv(bytes_of(big_in), tag{7});
      co_return n;
    }());
    CHECK(ok == 20);
    CHECK(!sent.error);
    CHECK(sent.protocol == wire_protocol::rendezvous);
    CHECK(big_in == big);
    co_await a.close();
  });
}

TEST_CASE_TEMPLATE("early messages beyond the store's bounds are held back by flow control, never lost", T,
                   CONFORMANCE_TRANSPORTS) {
  gdr::protocol_options o;
  o.unexpected_bytes = 4096;
  o.unexpected_messages = 8;
  conformance::run_both<T>(
      [&](auto& a, auto& b) -> gdr::task<> {
        constexpr int n = 100;
        std::vector<std::vector<std::byte>> out;
        for (int i = 0; i < n; ++i) out.push_back(pattern(1000, static_cast<std::uint32_t>(i)));
        int sent = 0;
        for (int i = 0; i < n; ++i)
          conformance::spawn([&, i]() -> gdr::task<> { co_await a.send(cbytes_of(out[i])); }, sent);
        // Let the sender run ahead: the receiver keeps at most the bounds.
        co_await gdr::sleep_for(20ms);
        CHECK(b.stats().unexpected <= 8);
        std::vector<std::byte> in(1000);
        for (int i = 0; i < n; ++i) {
          std::size_t got = co_await b.recv(bytes_of(in));
          CHECK(got == 1000);
          CHECK(in == out[i]);
        }
        CHECK(co_await conformance::eventually(a.get_scheduler(), [&] { return sent == n; }));
        // Credits held the sender back (past the bytes, messages went
        // announced; past the slots, they waited in the sender): the
        // receiver's reader never stopped.
        CHECK(b.stats().paused == 0);
        co_await a.close();
      },
      o, o);
}

TEST_CASE_TEMPLATE("a message larger than its receive is truncated, reports its size, and the next one is intact",
                   T, CONFORMANCE_TRANSPORTS) {
  constexpr std::size_t e = 1024;
  for (std::size_t size : {std::size_t{600}, std::size_t{100000}}) {  // eager, rendezvous
    CAPTURE(size);
    conformance::run_both<T>(
        [&](auto& a, auto& b) -> gdr::task<> {
          auto m = pattern(size, 1), next = pattern(50, 2);
          std::vector<std::byte> small(100, std::byte{0xEE}), guard(16, std::byte{0x5A});
          std::vector<std::byte> room(small.size() + guard.size(), std::byte{0x5A});
          std::fill(room.begin(), room.begin() + 100, std::byte{0xEE});
          auto [s, r] = co_await gdr::when_all(
              report_of(a.send(cbytes_of(m))),
              report_of(b.recv(gdr::view<std::byte, gdr::Host>(room.data(), 100))));
          CHECK(!s.error);  // the sender's message was consumed
          CHECK(r.error == gdr::errc::truncated);
          CHECK(r.bytes == 100);
          CHECK(r.message_size == size);
          CHECK(std::equal(m.begin(), m.begin() + 100, room.begin()));
          CHECK(std::all_of(room.begin() + 100, room.end(), [](std::byte x) { return x == std::byte{0x5A}; }));
          // The throwing form names the size.
          std::string what;
          auto throwing = [&]() -> gdr::task<> {
            try {
              co_await b.recv(gdr::view<std::byte, gdr::Host>(room.data(), 10));
            } catch (const gdr::error& e) {
              what = e.what();
            }
          };
          co_await gdr::when_all(throwing(), [&]() -> gdr::task<> { co_await a.send(cbytes_of(m)); }());
          CHECK(what.find(std::to_string(size)) != std::string::npos);
          // In step: the next message is whole.
          std::vector<std::byte> in(50);
          auto [s3, r3] = co_await gdr::when_all(report_of(a.send(cbytes_of(next))), report_of(b.recv(bytes_of(in))));
          CHECK(!s3.error);
          CHECK(r3.bytes == 50);
          CHECK(in == next);
          CHECK(b.stats().truncated == 2);
          co_await a.close();
        },
        small_threshold(e), small_threshold(e));
  }
}

TEST_CASE_TEMPLATE("a cancelled receive completes at once, writes nothing later, and the next receive gets the message",
                   T, CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    std::vector<std::byte> poisoned(64, std::byte{0xCD});
    std::stop_source src;
    auto r = report_of(b.recv(bytes_of(poisoned), {src.get_token()}));
    auto [rep, x] = co_await gdr::when_all(std::move(r), [&]() -> gdr::task<int> {
      co_await gdr::sleep_for(2ms);
      src.request_stop();
      co_return 0;
    }());
    CHECK(rep.error == gdr::errc::cancelled);
    auto m = pattern(64, 3);
    co_await a.send(cbytes_of(m));
    std::vector<std::byte> in(64);
    CHECK(co_await b.recv(bytes_of(in)) == 64);
    CHECK(in == m);
    CHECK(std::all_of(poisoned.begin(), poisoned.end(), [](std::byte v) { return v == std::byte{0xCD}; }));
    co_await a.close();
  });
}

TEST_CASE_TEMPLATE("a receive times out with timed_out and the endpoint stays usable", T, CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    std::vector<std::byte> in(8);
    auto t0 = std::chrono::steady_clock::now();
    op_report r = co_await report_of(b.recv(bytes_of(in), {30ms}));
    CHECK(r.error == gdr::errc::timed_out);
    CHECK(std::chrono::steady_clock::now() - t0 >= 30ms);
    auto m = pattern(8, 1);
    co_await a.send(cbytes_of(m));
    CHECK(co_await b.recv(bytes_of(in)) == 8);
    CHECK(in == m);
    co_await a.close();
  });
}

TEST_CASE_TEMPLATE("an announced send nobody receives is withdrawn by its timeout and never delivered", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>(
      [&](auto& a, auto& b) -> gdr::task<> {
        auto big = pattern(100000, 1), next = pattern(100000, 2);
        op_report r = co_await report_of(a.send(cbytes_of(big), {30ms}));
        CHECK(r.error == gdr::errc::timed_out);
        CHECK(a.stats().withdrawn == 1);
        // The receiver gets the next message, not the withdrawn one.
        std::vector<std::byte> in(100000);
        auto [s, n] = co_await gdr::when_all(report_of(a.send(cbytes_of(next))), report_of(b.recv(bytes_of(in))));
        CHECK(!s.error);
        CHECK(!n.error);
        CHECK(in == next);
        co_await a.close();
      },
      small_threshold(1024), small_threshold(1024));
}

TEST_CASE_TEMPLATE("a stop racing the receiver's match either completes the send or withdraws it on both ends", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>(
      [&](auto& a, auto& b) -> gdr::task<> {
        // The receive is posted first, so the rtr is on its way as soon as
        // the rts lands; a stop requested right after the send starts races
        // with it. Either outcome is allowed, but exactly one: the message
        // is received whole (the rtr reached the sender first: the send
        // succeeded) or not at all (the stop came first: the send is
        // withdrawn, and the receive, which may have matched it, goes on
        // waiting for the next message, until its own timeout here).
        auto big = pattern(200000, 5);
        std::vector<std::byte> in(200000);
        for (int round = 0; round < 20; ++round) {
          std::stop_source src;
          auto recv = report_of(b.recv(bytes_of(in), {50ms}));
          auto send = report_of(a.send(cbytes_of(big), {src.get_token()}));
          auto [r, s, x] = co_await gdr::when_all(std::move(recv), std::move(send), [&]() -> gdr::task<int> {
            src.request_stop();
            co_return 0;
          }());
          if (!s.error) {
            CHECK(!r.error);
            CHECK(in == big);
          } else {
            CHECK(s.error == gdr::errc::cancelled);
            CHECK(r.error == gdr::errc::timed_out);
          }
        }
        CHECK(b.is_open());
        co_await a.close();
      },
      small_threshold(1024), small_threshold(1024));
}

// Issue "Hostile, stalled and careless peers", item 3: the answers an
// endpoint makes for its peer (here rts_withdrawn, to the peer's
// rts_cancel) are bounded by its unexpected_messages, and a peer that keeps
// to its credits never reaches the bound: the reader never stops for it.
TEST_CASE_TEMPLATE("a peer withdrawing many announced sends at once gets its answers without stopping the reader", T,
                   CONFORMANCE_TRANSPORTS) {
  gdr::protocol_options o = small_threshold(1024);
  o.unexpected_messages = 16;  // the receiver keeps 16 announcements, and makes at most 16 answers waiting
  conformance::run_both<T>(
      [&](auto& a, auto& b) -> gdr::task<> {
        auto big = pattern(4096, 3);
        constexpr int wave = 48;
        for (int round = 0; round < 20; ++round) {
          // More sends than credits: some are announced, the rest wait
          // here for credit; all are stopped a moment later.
          std::stop_source stop;
          std::vector<gdr::task<op_report>> ops;
          for (int i = 0; i < wave; ++i) ops.push_back(report_of(a.send(cbytes_of(big), {stop.get_token()})));
          ops.push_back(stop_after(stop, std::chrono::milliseconds(1 + round % 3)));
          auto reps = co_await gdr::when_all(std::move(ops));
          for (int i = 0; i < wave; ++i) CHECK(reps[i].error == gdr::errc::cancelled);
        }
        CHECK(a.stats().withdrawn > 0);
        CHECK(b.stats().answers_most <= 16);
        CHECK(b.stats().paused == 0);
        // The withdrawn messages never arrive; the next one does.
        auto m = pattern(4096, 4);
        std::vector<std::byte> in(4096);
        auto [s, r] = co_await gdr::when_all(report_of(a.send(cbytes_of(m), {5s})), report_of(b.recv(bytes_of(in), {5s})));
        CHECK(!s.error);
        CHECK(!r.error);
        CHECK(in == m);
        co_await a.close();
      },
      o, o);
}

TEST_CASE_TEMPLATE("many rendezvous in flight at once all arrive intact", T, CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    constexpr int n = 16;
    std::vector<std::vector<std::byte>> out, in;
    for (int i = 0; i < n; ++i) {
      out.push_back(pattern(1u << 20, static_cast<std::uint32_t>(i)));
      in.emplace_back(1u << 20);
    }
    std::vector<gdr::task<op_report>> ops;
    for (int i = 0; i < n; ++i) ops.push_back(report_of(a.send(cbytes_of(out[i]))));
    for (int i = 0; i < n; ++i) ops.push_back(report_of(b.recv(bytes_of(in[i]))));
    auto reps = co_await gdr::when_all(std::move(ops));
    for (auto& r : reps) CHECK(!r.error);
    for (int i = 0; i < n; ++i) CHECK(in[i] == out[i]);
    CHECK(a.stats().rendezvous_sends == n);
    CHECK(b.stats().recvs == n);
    CHECK(b.stats().on_path(b.last_path()) >= 1);
    co_await a.close();
  });
}

TEST_CASE_TEMPLATE("a send larger than the peer accepts fails alone and the endpoint stays usable", T,
                   CONFORMANCE_TRANSPORTS) {
  gdr::protocol_options limited;
  limited.max_message = 4096;
  limited.rendezvous_threshold = 1024;
  conformance::run_both<T>(
      [&](auto& a, auto& b) -> gdr::task<> {
        // `b` accepts at most 4096 bytes: a's larger send fails locally.
        auto big = pattern(5000, 1), ok = pattern(4096, 2);
        // The handshake may still be on its way: the send waits for it.
        op_report r = co_await report_of(a.send(cbytes_of(big)));
        CHECK(r.error == gdr::errc::message_too_large);
        CHECK(a.is_open());
        CHECK(a.peer_max_message() == 4096);
        std::vector<std::byte> in(4096);
        auto [s, n] = co_await gdr::when_all(report_of(a.send(cbytes_of(ok))), report_of(b.recv(bytes_of(in))));
        CHECK(!s.error);
        CHECK(n.bytes == 4096);
        CHECK(in == ok);
        co_await a.close();
      },
      gdr::protocol_options{}, limited);
}

TEST_CASE_TEMPLATE("an orderly close delivers what was sent before it, then the peer sees peer_closed", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    auto m1 = pattern(10, 1), m2 = pattern(100000, 2);
    std::vector<std::byte> in1(10), in2(100000), in3(8);
    // A receive of a's pending at close time fails with closed.
    auto mine = report_of(a.recv(bytes_of(in3)));
    auto [r0, x] = co_await gdr::when_all(std::move(mine), [&]() -> gdr::task<int> {
      co_await a.send(cbytes_of(m1));
      auto s2 = [&]() -> gdr::task<op_report> { co_return co_await report_of(a.send(cbytes_of(m2))); };
      auto r2 = [&]() -> gdr::task<op_report> {
        co_await gdr::sleep_for(5ms);
        co_return co_await report_of(b.recv(bytes_of(in2), tag{0}));
      };
      // m1 (eager, kept), then m2 (rendezvous: completes once received).
      auto [s, r] = co_await gdr::when_all(s2(), [&]() -> gdr::task<op_report> {
        co_await b.recv(bytes_of(in1));
        co_return co_await r2();
      }());
      CHECK(!s.error);
      CHECK(!r.error);
      co_await a.close();
      co_return 0;
    }());
    CHECK(r0.error == gdr::errc::closed);
    CHECK(in1 == m1);
    CHECK(in2 == m2);
    op_report after = co_await report_of(b.recv(bytes_of(in3)));
    CHECK(after.error == gdr::errc::peer_closed);
    CHECK(b.error() == gdr::errc::peer_closed);
    CHECK(a.error() == gdr::errc::closed);
    op_report late = co_await report_of(a.send(cbytes_of(m1)));
    CHECK(late.error == gdr::errc::closed);
    co_await b.close();
  });
}

TEST_CASE_TEMPLATE("messages kept before the peer closed are still received after it", T, CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    auto m = pattern(100, 1);
    co_await a.send(cbytes_of(m));
    co_await a.close();
    std::vector<std::byte> in(100);
    CHECK(co_await b.recv(bytes_of(in)) == 100);
    CHECK(in == m);
    op_report r = co_await report_of(b.recv(bytes_of(in)));
    CHECK(r.error == gdr::errc::peer_closed);
  });
}

TEST_CASE_TEMPLATE("when the peer goes away every pending operation fails with connection_lost, in every state", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>(
      [&](auto& a, auto& b) -> gdr::task<> {
        std::vector<std::byte> mem(4096);
        auto reg = gdr::register_memory(gdr::host_view(mem));
        auto remote = reg.describe(0);
        std::vector<std::byte> in(64), gin(4096);
        auto big = pattern(100000, 1);
        // Pending on `a` when `b` goes: a receive, and an announced send
        // no receive matched. Started afterwards: a get.
        auto r = report_of(a.recv(bytes_of(in)));
        auto s = report_of(a.send(cbytes_of(big)));
        auto t0 = std::chrono::steady_clock::now();
        auto [rr, sr, x] = co_await gdr::when_all(std::move(r), std::move(s), [&]() -> gdr::task<int> {
          co_await gdr::sleep_for(5ms);
          b = {};  // the peer's endpoint is destroyed: aborted
          co_return 0;
        }());
        CHECK(rr.error == gdr::errc::connection_lost);
        CHECK(sr.error == gdr::errc::connection_lost);
        CHECK(std::chrono::steady_clock::now() - t0 < 2s);
        op_report g = co_await report_of(a.get(gdr::host_view(gin), remote));
        CHECK(g.error == gdr::errc::connection_lost);
        CHECK(a.error() == gdr::errc::connection_lost);
        co_await a.close();
      },
      small_threshold(1024), small_threshold(1024));
}

TEST_CASE_TEMPLATE("put and get move bytes to and from registered memory and are refused outside it", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    bool direct = false;  // a's NIC moved them (verbs, one-sided): b's loop never saw them
    for (std::size_t size : {std::size_t{16}, std::size_t{300000}}) {
      CAPTURE(size);
      std::vector<std::uint32_t> target(size / 4, 0), back(size / 4, 0), src(size / 4);
      for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint32_t>(i * 7 + 1);
      auto reg = gdr::register_memory(gdr::host_view(target));
      auto rv = reg.describe(0);
      CHECK(co_await a.put(gdr::host_view(src), rv) == size);
      CHECK(target == src);
      direct = a.last_path() == gdr::transfer_path::one_sided_rdma;
      CHECK(co_await a.get(gdr::host_view(back), rv) == size);
      CHECK(back == src);
      // Wrong key: refused, nothing written.
      auto bad = gdr::remote_view<std::uint32_t, gdr::Host>(rv.address(), rv.size(), rv.key() ^ 1, 0);
      std::fill(target.begin(), target.end(), 0u);
      op_report r = co_await report_of(a.put(gdr::host_view(src), bad));
      CHECK(r.error == gdr::errc::remote_access);
      CHECK(std::all_of(target.begin(), target.end(), [](std::uint32_t v) { return v == 0; }));
      r = co_await report_of(a.get(gdr::host_view(back), bad));
      CHECK(r.error == gdr::errc::remote_access);
    }
    CHECK(b.stats().refused == 4);  // (the wrong keys carry no NIC key: served, and refused)
    CHECK(b.stats().served_puts == (direct ? 0 : 2));
    CHECK(b.stats().served_gets == (direct ? 0 : 2));
    // Still in step: a message after the refusals.
    auto m = pattern(10, 1);
    std::vector<std::byte> in(10);
    co_await a.send(cbytes_of(m));
    CHECK(co_await b.recv(bytes_of(in)) == 10);
    co_await a.close();
  });
}

TEST_CASE_TEMPLATE("remote atomics give the old value and change the word, and are refused where they may not", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    std::vector<std::uint64_t> words = {100, 7, 0, 0};
    auto reg = gdr::register_memory(gdr::host_view(words));
    auto rv = reg.describe(0);
    CHECK(co_await a.fetch_add(rv, 5) == 100);
    CHECK(words[0] == 105);
    const bool direct = a.last_path() == gdr::transfer_path::one_sided_rdma;
    CHECK(co_await a.fetch_add(rv.subview(1, 1), ~std::uint64_t{0}) == 7);  // adds wrap: 7 - 1
    CHECK(words[1] == 6);
    CHECK(co_await a.compare_swap(rv, 105, 42) == 105);  // swapped
    CHECK(words[0] == 42);
    CHECK(co_await a.compare_swap(rv, 105, 1) == 42);  // not: the old value says why
    CHECK(words[0] == 42);
    CHECK(a.last_path() != gdr::transfer_path::none);
    // An address not a multiple of 8: refused before it leaves.
    auto odd = gdr::remote_view<std::uint64_t, gdr::Host>(rv.address() + 4, 1, rv.key(), 0);
    gdr::result<std::uint64_t> r = co_await a.fetch_add(odd, 1).as_result();
    CHECK(r.error() == gdr::errc::invalid_argument);
    // A wrong key, outside the registration, a read-only one: refused, nothing changed.
    auto bad = gdr::remote_view<std::uint64_t, gdr::Host>(rv.address(), 1, rv.key() ^ 1, 0);
    r = co_await a.fetch_add(bad, 1).as_result();
    CHECK(r.error() == gdr::errc::remote_access);
    auto past = gdr::remote_view<std::uint64_t, gdr::Host>(rv.address() + 4 * 8, 1, rv.key(), 0);
    r = co_await a.compare_swap(past, 0, 1).as_result();
    CHECK(r.error() == gdr::errc::remote_access);
    std::vector<std::uint64_t> ro_words = {9};
    auto ro = gdr::register_memory(gdr::host_view(ro_words), gdr::access::read);
    r = co_await a.fetch_add(ro.describe(0), 1).as_result();
    CHECK(r.error() == gdr::errc::remote_access);
    CHECK(ro_words[0] == 9);
    CHECK(words == std::vector<std::uint64_t>{42, 6, 0, 0});
    CHECK(b.stats().refused == (direct ? 2 : 3));  // the read-only one's NIC key: refused by b's NIC
    // Still in step: a message after the refusals.
    auto m = pattern(10, 1);
    std::vector<std::byte> in(10);
    co_await a.send(cbytes_of(m));
    CHECK(co_await b.recv(bytes_of(in)) == 10);
    co_await a.close();
  });
}

TEST_CASE_TEMPLATE("one-sided puts and gets of every size, at both edges, and refused with revoked, forged or foreign keys",
                   T, CONFORMANCE_TRANSPORTS) {
  // Direct where the transport has it (verbs: the initiator's NIC, the
  // owner's loop takes no part), served by the owner's loop elsewhere; the
  // same answers either way, and a refusal never breaks the endpoint.
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    const std::size_t cap = 2 * 1024 * 1024 + 9;
    std::vector<std::byte> window(cap + 64), other(4096);
    auto reg = gdr::register_memory(gdr::host_view(window));
    auto reg2 = gdr::register_memory(gdr::host_view(other));
    auto rv = reg.describe(0);
    auto message_still_passes = [&](std::uint32_t seed) -> gdr::task<> {
      auto m = pattern(10, seed);
      std::vector<std::byte> in(10);
      auto [s, r] = co_await gdr::when_all(report_of(a.send(cbytes_of(m))), report_of(b.recv(bytes_of(in))));
      CHECK(!s.error);
      CHECK(!r.error);
      CHECK(in == m);
    };
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{8}, std::size_t{4095}, std::size_t{65536},
                          cap}) {
      CAPTURE(n);
      auto src = pattern(n, static_cast<std::uint32_t>(n));
      for (std::size_t at : {std::size_t{0}, rv.size() - n}) {  // the first and the last bytes of the window
        CAPTURE(at);
        std::fill(window.begin(), window.end(), std::byte{0});
        CHECK(co_await a.put(cbytes_of(src), rv.subview(at, n)) == n);
        CHECK(std::equal(src.begin(), src.end(), window.begin() + static_cast<std::ptrdiff_t>(at)));
        CHECK(std::all_of(window.begin(), window.begin() + static_cast<std::ptrdiff_t>(at),
                          [](std::byte x) { return x == std::byte{0}; }));
        std::vector<std::byte> back(n, std::byte{0x5a});
        CHECK(co_await a.get(bytes_of(back), rv.subview(at, n)) == n);
        CHECK(back == src);
      }
    }
    // One byte past the end: refused before anything moves.
    std::vector<std::byte> two(2);
    op_report r = co_await report_of(a.put(cbytes_of(two), rv.subview(rv.size() - 1)));
    CHECK(r.error == gdr::errc::invalid_argument);
    // A forged key (registry key and NIC keys altered): refused, nothing written.
    auto nic = rv.nic_keys();
    for (auto& k : nic)
      if (k != 0) k ^= 0x5a5a;
    auto forged = gdr::remote_view<std::byte, gdr::Host>(rv.address(), rv.size(), rv.key() ^ 1, 0, nic);
    std::fill(window.begin(), window.end(), std::byte{0});
    auto ones = std::vector<std::byte>(64, std::byte{1});
    r = co_await report_of(a.put(cbytes_of(ones), forged.subview(0, 64)));
    CHECK(r.error == gdr::errc::remote_access);
    CHECK(std::all_of(window.begin(), window.end(), [](std::byte x) { return x == std::byte{0}; }));
    co_await message_still_passes(1);
    // The key of another registration, with this one's address: refused.
    auto rv2 = reg2.describe(0);
    auto foreign = gdr::remote_view<std::byte, gdr::Host>(rv.address(), 64, rv2.key(), 0, rv2.nic_keys());
    r = co_await report_of(a.get(bytes_of(two), foreign.subview(0, 2)));
    CHECK(r.error == gdr::errc::remote_access);
    co_await message_still_passes(2);
    // A valid access after the refusals works (the lane was reset where there is one).
    CHECK(co_await a.put(cbytes_of(ones), rv.subview(0, 64)) == 64);
    CHECK(window[63] == std::byte{1});
    // Revoked: refused from then on, and a peer that keeps reading sees every later access fail.
    co_await reg.revoke();
    for (int i = 0; i < 3; ++i) {
      r = co_await report_of(a.get(bytes_of(two), rv.subview(0, 2)));
      CHECK(r.error == gdr::errc::remote_access);
    }
    co_await message_still_passes(3);
    CHECK(co_await a.put(cbytes_of(ones), reg2.describe(0).subview(0, 64)) == 64);  // the other one still works
    co_await a.close();
  });
}

TEST_CASE_TEMPLATE("remote atomics from three initiators at once lose no update", T, CONFORMANCE_TRANSPORTS) {
  if (conformance::skipped<T>()) return;
  conformance::watchdog dog(120);
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    CAPTURE(static_cast<int>(mode));
    gdr::scheduler sched({.mode = mode});
    std::vector<std::uint64_t> word = {0};
    auto reg = gdr::register_memory(gdr::host_view(word));
    constexpr int per = 300;
    std::vector<std::uint64_t> olds;
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      auto p1 = co_await T::pair(sched, gdr::default_registry(), {}, {});
      auto p2 = co_await T::pair(sched, gdr::default_registry(), {}, {});
      auto p3 = co_await T::pair(sched, gdr::default_registry(), {}, {});
      auto adder = [](typename T::endpoint& ep, gdr::remote_view<std::uint64_t, gdr::Host> rv,
                      std::vector<std::uint64_t>& out) -> gdr::task<> {
        // Two in flight per initiator, so that the owner's three endpoints
        // serve interleaved requests.
        auto one = [](typename T::endpoint& e, gdr::remote_view<std::uint64_t, gdr::Host> r,
                      std::vector<std::uint64_t>& o) -> gdr::task<> {
          for (int i = 0; i < per / 2; ++i) o.push_back(co_await e.fetch_add(r, 1));
        };
        co_await gdr::when_all(one(ep, rv, out), one(ep, rv, out));
      };
      std::vector<std::uint64_t> o1, o2, o3;
      co_await gdr::when_all(adder(p1.first, reg.describe(0), o1), adder(p2.first, reg.describe(0), o2),
                             adder(p3.first, reg.describe(0), o3));
      for (auto* o : {&o1, &o2, &o3}) olds.insert(olds.end(), o->begin(), o->end());
      for (auto* p : {&p1, &p2, &p3}) co_await p->first.close();
    }());
    sched.drain();
    CHECK(word[0] == 3 * per);
    // Every add saw a different old value: 0 .. 3 * per - 1, each once.
    std::sort(olds.begin(), olds.end());
    REQUIRE(olds.size() == 3 * per);
    bool each_once = true;
    for (std::size_t i = 0; i < olds.size(); ++i) each_once = each_once && olds[i] == i;
    CHECK(each_once);
  }
}

TEST_CASE_TEMPLATE("the result and report forms never throw, the plain form throws gdr::error", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run<T>(gdr::run_mode::sleep, [&](auto& a, auto& b) -> gdr::task<> {
    std::vector<std::byte> in(8);
    gdr::result<std::size_t> r = co_await b.recv(bytes_of(in), {5ms}).as_result();
    CHECK(r.error() == gdr::errc::timed_out);
    bool threw = false;
    try {
      co_await b.recv(bytes_of(in), {5ms});
    } catch (const gdr::error& e) {
      threw = e.code() == gdr::errc::timed_out;
    }
    CHECK(threw);
    co_await a.close();
  });
}

TEST_CASE_TEMPLATE("every successful operation is recorded with the path and protocol it took", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>(
      [&](auto& a, auto& b) -> gdr::task<> {
        auto small = pattern(100, 1), big = pattern(100000, 2);
        // Large enough that TCP reads it straight into the view (above
        // direct_read_threshold).
        std::vector<std::byte> in(100000);
        co_await a.send(cbytes_of(small));  // early: kept by b
        // (A send completes when its bytes are out, which on shared memory
        // can be before b's loop has read them.)
        CHECK(co_await conformance::eventually(b.get_scheduler(), [&] { return b.stats().unexpected == 1; }));
        op_report r = co_await report_of(b.recv(bytes_of(in)));
        CHECK(r.path == gdr::transfer_path::host_eager);
        CHECK(r.protocol == wire_protocol::eager);
        auto [s2, r2] = co_await gdr::when_all(report_of(a.send(cbytes_of(big))), report_of(b.recv(bytes_of(in))));
        CHECK(s2.protocol == wire_protocol::rendezvous);
        CHECK(r2.protocol == wire_protocol::rendezvous);
        CHECK(s2.path == conformance::bulk_path<T>());
        CHECK(r2.path == conformance::bulk_path<T>());
        CHECK(a.last_path() == conformance::bulk_path<T>());
        const auto& st = b.stats();
        std::uint64_t total = 0;
        for (auto c : st.by_path) total += c;
        CHECK(total == st.sends + st.recvs + st.puts + st.gets);
        CHECK(st.on_path(gdr::transfer_path::host_eager) == 1);
        co_await a.close();
      },
      small_threshold(1024), small_threshold(1024));
}

TEST_CASE_TEMPLATE("a peer that goes away in the middle of a large transfer fails the receive, never hangs it", T,
                   CONFORMANCE_TRANSPORTS) {
  conformance::run_both<T>([&](auto& a, auto& b) -> gdr::task<> {
    // 64 MiB by rendezvous; the sender's endpoint is destroyed while the
    // receive is under way (or, on a fast transport, just after it
    // finished). Either the receive completed whole, or it fails with
    // connection_lost, in bounded time; nothing else.
    auto big = pattern(64u << 20, 3);
    std::vector<std::byte> in(big.size());
    auto t0 = std::chrono::steady_clock::now();
    auto [r, s, x] = co_await gdr::when_all(
        report_of(b.recv(bytes_of(in))), report_of(a.send(cbytes_of(big))), [&]() -> gdr::task<int> {
          // 64 MiB takes TCP on loopback several milliseconds: 2 ms in, the
          // data is usually on its way.
          co_await gdr::sleep_for(2ms);
          a = {};  // aborted, usually mid-transfer
          co_return 0;
        }());
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
    if (!r.error) {
      CHECK(r.bytes == big.size());
      CHECK(in == big);
    } else {
      CHECK(r.error == gdr::errc::connection_lost);
    }
    CHECK((!s.error || s.error == gdr::errc::closed));
    // b learns that its peer went away, in bounded time, whatever it was doing.
    CHECK(co_await conformance::eventually(b.get_scheduler(), [&] { return b.error() == gdr::errc::connection_lost; }));
    co_await b.close();
  });
}
