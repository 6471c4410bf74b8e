// gdr/transport/tcp under load: 1000 sending coroutines on one scheduler
// (thread), 1000 receiving coroutines on another, over 4 connections;
// every message checksummed, and every sender's messages checked to arrive
// in order on its connection.
//
// Default: 100 messages per sender (100k messages). The full size, 10k per
// sender (10M messages), is the manual target :load_full_test, or
//   GDR_TCP_LOAD_MESSAGES=10000 bazel-bin/tests/transport/tcp/load_test
#include <doctest/doctest.h>

#include <sys/socket.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <gdr/sched/timer.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/transport/tcp/tcp_test_util.hpp"

namespace tcp = gdr::tcp;
using namespace std::chrono_literals;

namespace {

constexpr int senders = 1000;
constexpr int connections = 4;
constexpr std::size_t max_payload = 256;

struct message {
  std::uint32_t sender;
  std::uint32_t seq;
  std::uint32_t len;
  std::uint32_t sum;
  std::byte payload[max_payload];
};

std::uint32_t fnv(const std::byte* p, std::size_t n, std::uint32_t h = 2166136261u) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<std::uint8_t>(p[i])) * 16777619u;
  return h;
}

void fill(message& m, std::uint32_t sender, std::uint32_t seq) {
  m.sender = sender;
  m.seq = seq;
  m.len = (sender * 7 + seq * 13) % (max_payload + 1);
  for (std::uint32_t i = 0; i < m.len; ++i) m.payload[i] = static_cast<std::byte>(sender + seq * 3 + i);
  m.sum = fnv(m.payload, m.len, sender ^ (seq << 10));
}

std::size_t wire_size(const message& m) { return offsetof(message, payload) + m.len; }

int messages_per_sender() {
  if (const char* e = std::getenv("GDR_TCP_LOAD_MESSAGES")) return std::max(1, std::atoi(e));
  return 100;
}

}  // namespace

TEST_CASE("1000 senders and 1000 receivers on two threads deliver every message intact and in order") {
  const int per_sender = messages_per_sender();
  tcp_test::watchdog wd(per_sender > 1000 ? 3600 : 120);
  gdr::scheduler sa, sb;
  // Connected sockets, made before either loop runs, each end adopted by
  // its scheduler.
  std::vector<tcp::endpoint> left, right;
  for (int c = 0; c < connections; ++c) {
    std::uint16_t port = 0;
    int lfd = tcp_test::raw_listen(port);
    int a = tcp_test::raw_connect(port);
    int b = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(lfd);
    left.emplace_back(sa, tcp::socket(a));
    right.emplace_back(sb, tcp::socket(b));
  }
  const std::uint64_t per_connection = std::uint64_t(senders / connections) * per_sender;

  // Receiver side: its own thread and scheduler. Receives are matched to
  // messages in the order they are posted, so the k-th receive posted on a
  // connection holds its k-th message: recorded by that ticket, then checked
  // per sender (sequence numbers 0, 1, 2... in ticket order).
  struct seen {
    std::uint32_t sender;
    std::uint32_t seq;
  };
  std::vector<std::vector<seen>> by_ticket(connections, std::vector<seen>(per_connection));
  std::atomic<std::uint64_t> bad_sum{0}, received{0};
  std::jthread receiver([&] {
    gdr::sync_wait(sb, [&]() -> gdr::task<> {
      int done = 0;
      std::vector<std::uint64_t> posted(connections, 0);
      for (int r = 0; r < senders; ++r) {
        int c = r % connections;
        tcp_test::spawn([&, c]() -> gdr::task<> {
          message m;
          while (posted[c] < per_connection) {
            std::uint64_t ticket = posted[c]++;
            co_await right[c].recv(gdr::view<message, gdr::Host>(&m, 1).as_bytes());
            if (m.len > max_payload || fnv(m.payload, m.len, m.sender ^ (m.seq << 10)) != m.sum) ++bad_sum;
            by_ticket[c][ticket] = {m.sender, m.seq};
            ++received;
          }
        }, done);
      }
      while (done < senders) co_await gdr::sleep_for(1ms);
      for (auto& ep : right) co_await ep.close();
    }());
  });

  auto t0 = std::chrono::steady_clock::now();
  gdr::sync_wait(sa, [&]() -> gdr::task<> {
    int done = 0;
    for (int s = 0; s < senders; ++s) {
      tcp_test::spawn([&, s]() -> gdr::task<> {
        tcp::endpoint& ep = left[s % connections];
        message m;
        for (int i = 0; i < per_sender; ++i) {
          fill(m, static_cast<std::uint32_t>(s), static_cast<std::uint32_t>(i));
          co_await ep.send(gdr::view<message, gdr::Host>(&m, 1).as_bytes().first(wire_size(m)));
        }
      }, done);
    }
    while (done < senders) co_await gdr::sleep_for(1ms);
    // Wait for the receiver before closing: the close would fail its
    // receives that are posted beyond the last message.
    while (received.load() < per_connection * connections) co_await gdr::sleep_for(1ms);
    for (auto& ep : left) co_await ep.close();
  }());
  receiver.join();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::uint64_t total = per_connection * connections;
  MESSAGE(total << " messages in " << secs << " s: " << static_cast<std::uint64_t>(total / secs)
                << " messages/s; sender writes: " << left[0].stats().writes << " for "
                << left[0].stats().frames_out << " frames on connection 0");
  CHECK(received.load() == total);
  CHECK(bad_sum.load() == 0);
  // Every message is small: eager, never announced.
  for (int c = 0; c < connections; ++c) {
    CHECK(left[c].stats().eager_sends == per_connection);
    CHECK(left[c].stats().rendezvous_sends == 0);
    CHECK(right[c].stats().recvs == per_connection);
    CHECK(right[c].stats().failed == 0);
  }
  std::uint64_t bad_order = 0, bad_conn = 0, incomplete = 0;
  for (int c = 0; c < connections; ++c) {
    std::vector<std::uint32_t> next(senders, 0);
    for (const seen& e : by_ticket[c]) {
      if (e.sender >= senders || static_cast<int>(e.sender) % connections != c) {
        ++bad_conn;
        continue;
      }
      if (next[e.sender]++ != e.seq) ++bad_order;
    }
    for (int s = c; s < senders; s += connections) incomplete += next[s] != static_cast<std::uint32_t>(per_sender);
  }
  CHECK(bad_order == 0);
  CHECK(bad_conn == 0);
  CHECK(incomplete == 0);
  CHECK(sa.inflight() == 0);
  CHECK(sb.inflight() == 0);
}
