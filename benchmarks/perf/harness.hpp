// gdr_perf's process harness: a server and a client, each a forked process
// pinned to its own CPU, a readiness pipe so the client connects only once the
// server listens, results sent back through a pipe, and a hard deadline so a
// stuck run kills its children instead of hanging the benchmark.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <exception>
#include <utility>
#include <vector>

namespace perf {

[[noreturn]] inline void die(const char* what) {
  std::perror(what);
  std::_Exit(2);
}

struct config {
  int server_cpu = 0;
  int client_cpu = 1;
  std::size_t warmup = 100;
  int deadline_s = 120;  // per measurement; the children are killed after it
};

using clock = std::chrono::steady_clock;
inline clock::time_point now() { return clock::now(); }
inline double elapsed_us(clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock::now() - t0).count();
}

/// A set of measurements (microseconds, or GB/s for streams).
struct sample {
  std::vector<double> v;
  void add(double x) { v.push_back(x); }
  void add_us(double x) { v.push_back(x); }
  bool empty() const { return v.empty(); }
  double median() const {
    if (v.empty()) return NAN;
    auto c = v;
    std::nth_element(c.begin(), c.begin() + c.size() / 2, c.end());
    return c[c.size() / 2];
  }
  /// The q-quantile (0 <= q <= 1) by nearest rank: 0.99 is the p99.
  double quantile(double q) const {
    if (v.empty()) return NAN;
    auto c = v;
    const auto k = static_cast<std::size_t>(q * static_cast<double>(c.size() - 1) + 0.5);
    std::nth_element(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(k), c.end());
    return c[k];
  }
  double mean() const {
    return v.empty() ? NAN : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  }
};

inline void pin(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

/// A free loopback port (bound and released; fine for a benchmark on lo).
inline std::uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("bind");
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// A listening socket on 127.0.0.1:port.
inline int listen_on(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("bind");
  if (::listen(fd, 16) != 0) die("listen");
  return fd;
}

/// A blocking connection to 127.0.0.1:port.
inline int connect_to(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("connect");
  return fd;
}

/// GDR_PERF_DIAG set: each child reports its CPU time (and gdr's side its
/// endpoint counters) on stderr, to see where a difference comes from.
inline bool diag() {
  static const bool on = std::getenv("GDR_PERF_DIAG") != nullptr;
  return on;
}

/// Runs a child's body; an exception is reported and ends the child with status 4.
template <class F>
void guarded(const char* who, F&& body) {
  ::prctl(PR_SET_NAME, who);  // "gdr server", "raw client"...: tells the processes apart in a profile
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gdr_perf: %s failed: %s\n", who, e.what());
    std::_Exit(4);
  }
  if (diag()) {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
    std::fprintf(stderr, "gdr_perf diag: %s cpu user %.3f s, sys %.3f s\n", who, s(ru.ru_utime), s(ru.ru_stime));
  }
}

/// Writes a sample to a pipe: its count, then the values.
inline void send_sample(int fd, const sample& s) {
  std::size_t n = s.v.size();
  if (::write(fd, &n, sizeof n) != sizeof n) std::_Exit(3);
  const char* bytes = reinterpret_cast<const char*>(s.v.data());
  std::size_t left = n * sizeof(double);
  while (left > 0) {
    ssize_t k = ::write(fd, bytes, left);
    if (k <= 0) std::_Exit(3);
    bytes += k;
    left -= static_cast<std::size_t>(k);
  }
}

/// Reads the client's sample from `fd`, reaps both children; kills them after
/// the deadline. An empty sample means the run failed.
inline sample collect(const config& cfg, pid_t srv, pid_t cli, int fd) {
  sample s;
  auto deadline = now() + std::chrono::seconds(cfg.deadline_s);
  std::size_t n = 0;
  std::vector<char> buf;
  std::size_t want = sizeof n, got = 0;
  bool have_n = false;
  buf.resize(sizeof n);
  for (;;) {
    if (now() > deadline) {
      std::fprintf(stderr, "gdr_perf: run exceeded %d s, killing it\n", cfg.deadline_s);
      ::kill(srv, SIGKILL);
      ::kill(cli, SIGKILL);
      break;
    }
    timeval tv{0, 200000};
    fd_set rs;
    FD_ZERO(&rs);
    FD_SET(fd, &rs);
    if (::select(fd + 1, &rs, nullptr, nullptr, &tv) <= 0) continue;
    ssize_t k = ::read(fd, buf.data() + got, want - got);
    if (k <= 0) break;
    got += static_cast<std::size_t>(k);
    if (got < want) continue;
    if (!have_n) {
      std::memcpy(&n, buf.data(), sizeof n);
      have_n = true;
      want = n * sizeof(double);
      got = 0;
      buf.assign(want, 0);
      if (want == 0) break;
      continue;
    }
    s.v.resize(n);
    std::memcpy(s.v.data(), buf.data(), want);
    break;
  }
  ::close(fd);
  int st = 0;
  for (auto [pid, who] : {std::pair{cli, "client"}, std::pair{srv, "server"}}) {
    ::waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::fprintf(stderr, "gdr_perf: %s ended with %s %d\n", who, WIFEXITED(st) ? "status" : "signal",
                   WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
      s.v.clear();
    }
  }
  return s;
}

/// Runs `server(listen_fd)` and `client(connected_fd)` in two pinned child
/// processes; returns the client's sample. The listening socket is made before
/// the fork, so the client never races the server.
inline sample run_pair(const config& cfg, const std::function<void(int)>& server,
                       const std::function<sample(int)>& client) {
  std::uint16_t port = free_port();
  int lfd = listen_on(port);
  pid_t srv = ::fork();
  if (srv < 0) die("fork");
  if (srv == 0) {
    pin(cfg.server_cpu);
    guarded("raw server", [&] { server(lfd); });
    std::_Exit(0);
  }
  ::close(lfd);
  int p[2];
  if (::pipe(p) != 0) die("pipe");
  pid_t cli = ::fork();
  if (cli < 0) die("fork");
  if (cli == 0) {
    ::close(p[0]);
    pin(cfg.client_cpu);
    guarded("raw client", [&] { send_sample(p[1], client(connect_to(port))); });
    std::_Exit(0);
  }
  ::close(p[1]);
  return collect(cfg, srv, cli, p[0]);
}


/// Like `run_pair`, for peers that make their own sockets: `server(port,
/// ready)` must call `ready()` once it listens on 127.0.0.1:port;
/// `client(port)` starts after that.
inline sample run_pair_port(const config& cfg, const std::function<void(std::uint16_t, const std::function<void()>&)>& server,
                            const std::function<sample(std::uint16_t)>& client) {
  std::uint16_t port = free_port();
  int ready[2];
  if (::pipe(ready) != 0) die("pipe");
  pid_t srv = ::fork();
  if (srv < 0) die("fork");
  if (srv == 0) {
    ::close(ready[0]);
    pin(cfg.server_cpu);
    guarded("gdr server", [&] { server(port, [&] {
      char c = 1;
      if (::write(ready[1], &c, 1) != 1) std::_Exit(3);
      ::close(ready[1]);
    }); });
    std::_Exit(0);
  }
  ::close(ready[1]);
  char c = 0;
  if (::read(ready[0], &c, 1) != 1) {  // the server died before listening
    ::close(ready[0]);
    int st = 0;
    ::waitpid(srv, &st, 0);
    return {};
  }
  ::close(ready[0]);
  int p[2];
  if (::pipe(p) != 0) die("pipe");
  pid_t cli = ::fork();
  if (cli < 0) die("fork");
  if (cli == 0) {
    ::close(p[0]);
    pin(cfg.client_cpu);
    guarded("gdr client", [&] { send_sample(p[1], client(port)); });
    std::_Exit(0);
  }
  ::close(p[1]);
  return collect(cfg, srv, cli, p[0]);
}

}  // namespace perf
