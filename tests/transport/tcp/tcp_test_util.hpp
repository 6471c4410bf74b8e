// Helpers for the TCP transport tests: a watchdog so no test can hang, a
// connected endpoint pair over 127.0.0.1, fire-and-forget coroutines, and a
// raw (blocking) socket for hand-made byte streams: wire v2 frames with
// their sequence numbers, and the hello each side must send first.
#pragma once

#include <dirent.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/protocol/message.hpp>
#include <gdr/protocol/options.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/support/watchdog.hpp"

namespace tcp_test {

using watchdog = gdr_test_support::watchdog;

// A coroutine that starts at once and is never awaited.
struct detached {
  struct promise_type {
    detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

// Runs the coroutine lambda `f` without anyone awaiting it; counts it in
// `done` when it finishes. `f` is kept in this frame: a lambda coroutine's
// captures live in the closure object, not in its own frame.
template <class F>
detached spawn(F f, int& done) {
  co_await f();
  ++done;
}

// Waits until both endpoints have the other's hello (the handshake is done).
// False after 5 s.
template <class A, class B>
gdr::task<bool> handshake_done(const A& a, const B& b) {
  for (int i = 0; i < 5000; ++i) {
    if (a.peer_max_message() != 0 && b.peer_max_message() != 0) co_return true;
    co_await gdr::sleep_for(std::chrono::milliseconds(1));
  }
  co_return false;
}

// Starts endpoint operation `op` now (it is pending from here on: a
// rendezvous send needs its receive posted, not merely created), stores its
// report in `out` and counts it in `done` when it completes.
inline detached start(gdr::op_awaitable op, gdr::op_report& out, int& done) {
  out = co_await std::move(op).report();
  ++done;
}

// An endpoint pair connected over 127.0.0.1, both on `s`, with the
// handshake done (each has the other's hello), so that what a test starts
// next does not race it.
inline gdr::task<std::pair<gdr::tcp::endpoint, gdr::tcp::endpoint>> connected_pair(
    gdr::scheduler& s, gdr::memory_registry& reg = gdr::default_registry(),
    gdr::tcp::endpoint_options opts = {}) {
  gdr::tcp::listener l(s, gdr::tcp::address::loopback(0), reg, opts);
  auto acc = l.accept();
  gdr::tcp::endpoint a = co_await gdr::tcp::connect(s, l.local_address(), {}, reg, opts);
  gdr::tcp::endpoint b = co_await std::move(acc);
  REQUIRE(co_await handshake_done(a, b));
  co_return std::pair<gdr::tcp::endpoint, gdr::tcp::endpoint>(std::move(a), std::move(b));
}

// Open file descriptors of this process (to check that nothing leaks).
inline int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n - 3;  // ".", "..", and the directory itself
}

// ---- raw blocking sockets (the "hostile peer" and forked helpers) ----

inline int raw_listen(std::uint16_t& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 16) != 0) std::abort();
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  port = ntohs(a.sin_port);
  return fd;
}

inline int raw_connect(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) std::abort();
  return fd;
}

inline bool raw_write(int fd, const void* p, std::size_t n) {
  auto* b = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

inline bool raw_read(int fd, void* p, std::size_t n) {
  auto* b = static_cast<char*>(p);
  while (n > 0) {
    ssize_t k = ::recv(fd, b, n, 0);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

// ---- hand-made wire v2 frames ----

// A frame header's 64 bytes, numbered `seq` (each direction counts its
// frames from 0; the hello is frame 0).
inline std::vector<std::byte> frame_bytes(const gdr::tcp::frame_header& h, std::uint32_t seq) {
  std::vector<std::byte> v(gdr::tcp::wire::header_size);
  gdr::tcp::encode_frame(h, seq, v.data());
  return v;
}

// The hello a peer must send first: protocol version, the largest message
// it accepts, its capability bits.
inline gdr::tcp::frame_header hello_header(std::uint64_t max_message = gdr::protocol_options{}.max_message,
                                           std::uint64_t caps = gdr::detail::proto::caps::host,
                                           std::uint64_t version = gdr::detail::proto::version) {
  gdr::tcp::frame_header h;
  h.type = gdr::tcp::frame_type::hello;
  h.size = max_message;
  h.tag = caps;
  h.id = version;
  return h;
}

// The bytes of a stream of frames written by a hand-made peer: each frame
// gets the next sequence number. Starts with the hello unless told not to.
struct frame_stream {
  std::vector<std::byte> bytes;
  std::uint32_t seq = 0;

  frame_stream() = default;
  explicit frame_stream(const gdr::tcp::frame_header& hello) { add(hello); }

  frame_stream& add(const gdr::tcp::frame_header& h, std::span<const std::byte> payload = {}) {
    return add_numbered(h, seq++, payload);
  }
  frame_stream& add(const gdr::tcp::frame_header& h, std::string_view payload) {
    return add(h, std::as_bytes(std::span<const char>(payload.data(), payload.size())));
  }
  // A frame with a sequence number of the caller's choosing (the count
  // still advances).
  frame_stream& add_numbered(const gdr::tcp::frame_header& h, std::uint32_t n,
                             std::span<const std::byte> payload = {}) {
    auto b = frame_bytes(h, n);
    bytes.insert(bytes.end(), b.begin(), b.end());
    bytes.insert(bytes.end(), payload.begin(), payload.end());
    return *this;
  }
  // Raw bytes (a broken header, garbage).
  frame_stream& raw(std::span<const std::byte> b) {
    bytes.insert(bytes.end(), b.begin(), b.end());
    return *this;
  }
  // Writes what was added since the last write (blocking).
  bool write_to(int fd) {
    bool ok = raw_write(fd, bytes.data(), bytes.size());
    bytes.clear();
    return ok;
  }
};

// Sends a hello as frame 0 (blocking).
inline bool send_hello(int fd, const gdr::tcp::frame_header& hello = hello_header()) {
  auto b = frame_bytes(hello, 0);
  return raw_write(fd, b.data(), b.size());
}

// Waits, letting the loop run (the endpoint on this thread must get to
// write), until `n` bytes can be read from `fd` without blocking. False
// after `limit`, or at end of stream (or a reset) before `n` bytes.
inline gdr::task<bool> wait_readable(int fd, std::size_t n,
                                     std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int avail = 0;
    if (::ioctl(fd, FIONREAD, &avail) == 0 && static_cast<std::size_t>(avail) >= n) co_return true;
    if (avail == 0) {
      char c;
      ssize_t k = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) co_return false;
    }
    if (std::chrono::steady_clock::now() > until) co_return false;
    co_await gdr::sleep_for(std::chrono::milliseconds(1));
  }
}

// Reads one frame header (and skips nothing) from a hand-made peer's
// socket, letting the loop run meanwhile. need_more if none came in time.
inline gdr::task<gdr::tcp::frame_parse_result> read_frame(int fd, std::uint64_t max = ~std::uint64_t{0}) {
  std::vector<std::byte> b(gdr::tcp::wire::header_size);
  if (!co_await wait_readable(fd, b.size()) || !raw_read(fd, b.data(), b.size())) co_return gdr::tcp::frame_parse_result{};
  co_return gdr::tcp::parse_frame(b, max);
}

// Reads the endpoint's hello (its frame 0); true if it is one, of version 2.
// Reads an endpoint's handshake: its hello, then its first credit (the room
// it grants for early messages). A hand-made peer's own hello (key 0)
// counts no credits, so it need not send one.
inline gdr::task<bool> read_hello(int fd) {
  gdr::tcp::frame_parse_result r = co_await read_frame(fd);
  if (!(r.status == gdr::tcp::frame_status::ok && r.seq == 0 && r.header.type == gdr::tcp::frame_type::hello &&
        r.header.id == gdr::detail::proto::version && r.header.key != 0))
    co_return false;
  r = co_await read_frame(fd);
  co_return r.status == gdr::tcp::frame_status::ok && r.seq == 1 && r.header.type == gdr::tcp::frame_type::credit;
}

// An endpoint whose peer is a raw blocking socket, for byte-exact control.
// The raw side has said hello (its frame 0) with no credits to count; `out`
// numbers its next frames.
struct raw_peer {
  gdr::tcp::endpoint ep;
  int fd = -1;
  frame_stream out;
  ~raw_peer() {
    if (fd >= 0) ::close(fd);
  }
  void write_eager_header(std::uint64_t len) {
    gdr::tcp::frame_header h;
    h.type = gdr::tcp::frame_type::eager;
    h.length = len;
    out.add(h);
    REQUIRE(out.write_to(fd));
  }
  void eager(std::uint64_t tag, std::span<const std::byte> payload) {
    gdr::tcp::frame_header h;
    h.type = gdr::tcp::frame_type::eager;
    h.tag = tag;
    h.length = payload.size();
    out.add(h, payload);
    REQUIRE(out.write_to(fd));
  }
  void close_frame() {
    gdr::tcp::frame_header h;
    h.type = gdr::tcp::frame_type::close;
    out.add(h);
    REQUIRE(out.write_to(fd));
  }
};

// Connects `p`'s raw socket to a listener's endpoint made with `opts`.
inline gdr::task<> make_raw_peer(gdr::scheduler& s, raw_peer& p, const gdr::tcp::endpoint_options& opts = {}) {
  gdr::tcp::listener l(s, gdr::tcp::address::loopback(0), gdr::default_registry(), opts);
  auto acc = l.accept();
  p.fd = raw_connect(l.local_address().port());  // the handshake needs no accept
  REQUIRE(send_hello(p.fd));
  p.out.seq = 1;
  p.ep = co_await std::move(acc);
}

}  // namespace tcp_test
