// The raw-socket baselines gdr_perf compares against: the same ping-pong and
// stream patterns as gdr's endpoint, written with blocking POSIX sockets and
// TCP_NODELAY, nothing else. Each side runs in its own process, pinned.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "benchmarks/perf/harness.hpp"

namespace perf::raw {

inline void write_all(int fd, const std::byte* p, std::size_t n) {
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k <= 0) die("raw send");
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

/// `spin`: poll with MSG_DONTWAIT instead of blocking (the counterpart of a
/// busy-polling event loop).
inline void read_all(int fd, std::byte* p, std::size_t n, bool spin = false) {
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, spin ? MSG_DONTWAIT : 0);
    if (k < 0 && spin && errno == EAGAIN) continue;
    if (k <= 0) die("raw recv");
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

inline void nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/// Ping-pong of `size`-byte messages, `iters` round trips after `warmup`.
/// Returns per-round-trip times in microseconds (client side). `spin`: both
/// sides busy-poll their socket instead of blocking in recv.
inline sample run_pingpong(const config& cfg, std::size_t size, std::size_t iters, bool spin) {
  return run_pair(cfg, [&](int listen_fd) {
    int fd = ::accept(listen_fd, nullptr, nullptr);
    nodelay(fd);
    std::vector<std::byte> buf(size);
    for (std::size_t i = 0; i < iters + cfg.warmup; ++i) {
      read_all(fd, buf.data(), size, spin);
      write_all(fd, buf.data(), size);
    }
    ::close(fd);
  }, [&](int fd) {
    nodelay(fd);
    std::vector<std::byte> buf(size, std::byte{1});
    sample s;
    for (std::size_t i = 0; i < iters + cfg.warmup; ++i) {
      auto t0 = now();
      write_all(fd, buf.data(), size);
      read_all(fd, buf.data(), size, spin);
      if (i >= cfg.warmup) s.add_us(elapsed_us(t0));
    }
    return s;
  });
}

/// One-way stream: `count` messages of `size` bytes, then a 1-byte ack.
/// Returns one value: bytes per second, as GB/s.
inline sample run_stream(const config& cfg, std::size_t size, std::size_t count, bool spin) {
  return run_pair(cfg, [&](int listen_fd) {
    int fd = ::accept(listen_fd, nullptr, nullptr);
    nodelay(fd);
    std::vector<std::byte> buf(size);
    for (std::size_t i = 0; i < count; ++i) read_all(fd, buf.data(), size, spin);
    std::byte ack{1};
    write_all(fd, &ack, 1);
    ::close(fd);
  }, [&](int fd) {
    nodelay(fd);
    std::vector<std::byte> buf(size, std::byte{1});
    auto t0 = now();
    for (std::size_t i = 0; i < count; ++i) write_all(fd, buf.data(), size);
    std::byte ack{};
    read_all(fd, &ack, 1, spin);
    sample s;
    s.add(static_cast<double>(size * count) / (elapsed_us(t0) * 1e3));  // GB/s
    return s;
  });
}

}  // namespace perf::raw
