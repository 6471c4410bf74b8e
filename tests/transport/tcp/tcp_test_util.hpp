// Helpers for the TCP transport tests: a watchdog so no test can hang, a
// connected endpoint pair over 127.0.0.1, fire-and-forget coroutines, and a
// raw (blocking) socket for hand-made byte streams.
#pragma once

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
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

// An endpoint pair connected over 127.0.0.1, both on `s`.
inline gdr::task<std::pair<gdr::tcp::endpoint, gdr::tcp::endpoint>> connected_pair(
    gdr::scheduler& s, gdr::memory_registry& reg = gdr::default_registry(),
    gdr::tcp::endpoint_options opts = {}) {
  gdr::tcp::listener l(s, gdr::tcp::address::loopback(0), reg, opts);
  auto acc = l.accept();
  gdr::tcp::endpoint a = co_await gdr::tcp::connect(s, l.local_address(), {}, reg, opts);
  gdr::tcp::endpoint b = co_await std::move(acc);
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

// A frame header's 40 bytes.
inline std::vector<std::byte> frame_bytes(const gdr::tcp::frame_header& h) {
  std::vector<std::byte> v(gdr::tcp::wire::header_size);
  gdr::tcp::encode_frame(h, v.data());
  return v;
}

}  // namespace tcp_test
