// Small helpers the single-file benchmarks share: pinning to a CPU, elapsed
// time, the median of a set of rounds, and loopback TCP sockets. Included as
// "benchmarks/bench_util.hpp" (the repository root is on the include path,
// with Bazel and with tools/gpu/run_gpu_tests.sh alike).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace bench {

/// Says why and ends the process at once. `_Exit`, not `exit`: benchmarks
/// fork, and a child must not flush the stdout buffer it copied.
[[noreturn]] inline void die(const char* what) {
  std::perror(what);
  std::_Exit(1);
}

/// A TCP socket listening on 127.0.0.1 on a free port; `port` receives it.
inline int listen_loopback(std::uint16_t& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    die("listen");
  port = ntohs(a.sin_port);
  return fd;
}

inline void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/// A blocking connection to 127.0.0.1:port, with TCP_NODELAY.
inline int connect_loopback(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("connect");
  set_nodelay(fd);
  return fd;
}

/// Pins the calling thread to `cpu`; says so and goes on unpinned if it cannot.
inline void pin_to_cpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) std::perror("sched_setaffinity (continuing unpinned)");
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The median of `v` (the upper one for an even count). `v` must not be empty.
inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace bench
