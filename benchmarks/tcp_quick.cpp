// tcp_quick: the TCP endpoint against raw blocking sockets over 127.0.0.1,
// two processes, each pinned: 8-byte ping-pong round trip, and one-way stream
// bandwidth (optionally with SENDMSG_ZC). Repetitions alternate raw and gdr;
// medians are printed. A quick check for the transport's own developer, not
// the benchmark tool (that is gdr_perf).
//
//   g++ -std=c++20 -O2 -DNDEBUG -I. benchmarks/tcp_quick.cpp -o tcp_quick -luring -lpthread
//   ./tcp_quick [--cpus A,B] [--reps N] [--only pingpong|stream|zc]
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/transport/tcp.hpp>

#include "benchmarks/bench_util.hpp"

namespace tcp = gdr::tcp;
using clk = std::chrono::steady_clock;

namespace {

int cpu_a = 0, cpu_b = 1, reps = 7;

using bench::die;

void write_all(int fd, const void* p, std::size_t n) {
  auto* b = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    if (k <= 0) die("send");
    b += k;
    n -= static_cast<std::size_t>(k);
  }
}

void read_all(int fd, void* p, std::size_t n) {
  auto* b = static_cast<char*>(p);
  while (n > 0) {
    ssize_t k = ::recv(fd, b, n, 0);
    if (k <= 0) die("recv");
    b += k;
    n -= static_cast<std::size_t>(k);
  }
}

// Runs `server(listen_fd)` in a child pinned to cpu_b and `client(port)` here,
// pinned to cpu_a; returns the client's result.
double run_pair(const std::function<void(int)>& server, const std::function<double(std::uint16_t)>& client) {
  std::uint16_t port = 0;
  int lfd = bench::listen_loopback(port);
  pid_t pid = ::fork();
  if (pid == 0) {
    bench::pin_to_cpu(cpu_b);
    server(lfd);
    ::_exit(0);
  }
  ::close(lfd);
  bench::pin_to_cpu(cpu_a);
  double r = client(port);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return r;
}

int raw_accept(int lfd) {
  int fd = ::accept(lfd, nullptr, nullptr);
  bench::set_nodelay(fd);
  return fd;
}

// ---- ping-pong: microseconds per round trip ----

constexpr int pp_warmup = 2000, pp_iters = 20000;

double raw_pingpong(std::size_t size) {
  return run_pair(
      [&](int lfd) {
        int fd = raw_accept(lfd);
        std::vector<char> b(size);
        for (int i = 0; i < pp_warmup + pp_iters; ++i) {
          read_all(fd, b.data(), size);
          write_all(fd, b.data(), size);
        }
        ::close(fd);
      },
      [&](std::uint16_t port) {
        int fd = bench::connect_loopback(port);
        std::vector<char> b(size, 1);
        clk::time_point t0;
        for (int i = 0; i < pp_warmup + pp_iters; ++i) {
          if (i == pp_warmup) t0 = clk::now();
          write_all(fd, b.data(), size);
          read_all(fd, b.data(), size);
        }
        double us = std::chrono::duration<double, std::micro>(clk::now() - t0).count() / pp_iters;
        ::close(fd);
        return us;
      });
}

double gdr_pingpong(std::size_t size, gdr::run_mode mode) {
  return run_pair(
      [&](int lfd) {
        gdr::scheduler s({.mode = mode});
        tcp::endpoint ep(s, tcp::socket(::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC)));
        gdr::sync_wait(s, [&]() -> gdr::task<> {
          std::vector<char> b(size);
          for (int i = 0; i < pp_warmup + pp_iters; ++i) {
            co_await ep.recv(gdr::host_view(b));
            co_await ep.send(gdr::host_view(b));
          }
          co_await ep.close();
        }());
      },
      [&](std::uint16_t port) {
        gdr::scheduler s({.mode = mode});
        double us = 0;
        gdr::sync_wait(s, [&]() -> gdr::task<> {
          tcp::endpoint ep = co_await tcp::connect(s, tcp::address::loopback(port));
          std::vector<char> out(size, 1), in(size);
          clk::time_point t0;
          for (int i = 0; i < pp_warmup + pp_iters; ++i) {
            if (i == pp_warmup) t0 = clk::now();
            auto r = ep.recv(gdr::host_view(in));  // posted before the send, as an app would
            co_await ep.send(gdr::host_view(out));
            co_await std::move(r);
          }
          us = std::chrono::duration<double, std::micro>(clk::now() - t0).count() / pp_iters;
          // Wait for the peer's close so it never sees a reset.
          std::array<char, 1> x{};
          (void)co_await ep.recv(gdr::host_view(x)).as_result();
          co_await ep.close();
        }());
        return us;
      });
}

// ---- stream: GB/s, `total` bytes in messages of `size`, then a 1-byte ack ----

double raw_stream(std::size_t size, std::size_t total) {
  std::size_t count = total / size;
  return run_pair(
      [&](int lfd) {
        int fd = raw_accept(lfd);
        std::vector<char> b(size);
        for (std::size_t i = 0; i < count; ++i) read_all(fd, b.data(), size);
        char ack = 1;
        write_all(fd, &ack, 1);
        ::close(fd);
      },
      [&](std::uint16_t port) {
        int fd = bench::connect_loopback(port);
        std::vector<char> b(size, 1);
        auto t0 = clk::now();
        for (std::size_t i = 0; i < count; ++i) write_all(fd, b.data(), size);
        char ack;
        read_all(fd, &ack, 1);
        double s = std::chrono::duration<double>(clk::now() - t0).count();
        ::close(fd);
        return static_cast<double>(count * size) / s / 1e9;
      });
}

double gdr_stream(std::size_t size, std::size_t total, std::size_t zc_threshold) {
  std::size_t count = total / size;
  tcp::endpoint_options opts;
  opts.zero_copy_send_threshold = zc_threshold;
  return run_pair(
      [&](int lfd) {
        gdr::scheduler s;
        tcp::endpoint ep(s, tcp::socket(::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC)), gdr::default_registry(), opts);
        gdr::sync_wait(s, [&]() -> gdr::task<> {
          std::vector<char> b(size);
          for (std::size_t i = 0; i < count; ++i) co_await ep.recv(gdr::host_view(b));
          std::array<char, 1> ack{1};
          co_await ep.send(gdr::host_view(ack));
          std::array<char, 1> x{};
          (void)co_await ep.recv(gdr::host_view(x)).as_result();  // until the client closes
          co_await ep.close();
        }());
      },
      [&](std::uint16_t port) {
        gdr::scheduler s;
        double gbs = 0;
        gdr::sync_wait(s, [&]() -> gdr::task<> {
          tcp::endpoint ep = co_await tcp::connect(s, tcp::address::loopback(port), {}, gdr::default_registry(), opts);
          std::vector<char> b(size, 1);
          auto t0 = clk::now();
          for (std::size_t i = 0; i < count; ++i) co_await ep.send(gdr::host_view(b));
          std::array<char, 1> ack{};
          co_await ep.recv(gdr::host_view(ack));
          double sec = std::chrono::duration<double>(clk::now() - t0).count();
          gbs = static_cast<double>(count * size) / sec / 1e9;
          co_await ep.close();
        }());
        return gbs;
      });
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--cpus" && i + 1 < argc) {
      std::sscanf(argv[++i], "%d,%d", &cpu_a, &cpu_b);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    }
  }
  std::printf("tcp_quick: client on CPU %d, server on CPU %d, %d repetitions, medians\n", cpu_a, cpu_b, reps);
  if (only.empty() || only == "pingpong") {
    std::vector<double> raw, sleep, busy;
    for (int r = 0; r < reps; ++r) {
      raw.push_back(raw_pingpong(8));
      sleep.push_back(gdr_pingpong(8, gdr::run_mode::sleep));
      if (cpu_a != cpu_b) busy.push_back(gdr_pingpong(8, gdr::run_mode::busy_poll));
    }
    double m = bench::median(raw), g = bench::median(sleep);
    std::printf("ping-pong 8 B round trip: raw %.2f us, gdr (sleep) %.2f us  ratio %.3f\n", m, g, g / m);
    if (!busy.empty())
      std::printf("                          gdr (busy_poll) %.2f us  ratio %.3f\n", bench::median(busy),
                  bench::median(busy) / m);
  }
  if (only.empty() || only == "stream") {
    for (std::size_t size : {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{4} << 20}) {
      std::vector<double> raw, g;
      for (int r = 0; r < reps; ++r) {
        raw.push_back(raw_stream(size, std::size_t{2} << 30));
        g.push_back(gdr_stream(size, std::size_t{2} << 30, 0));
      }
      std::printf("stream %7zu B messages: raw %.2f GB/s, gdr %.2f GB/s  ratio %.3f\n", size, bench::median(raw),
                  bench::median(g), bench::median(g) / bench::median(raw));
    }
  }
  if (only.empty() || only == "zc") {
    for (std::size_t size : {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{4} << 20}) {
      std::vector<double> plain, zc;
      for (int r = 0; r < reps; ++r) {
        plain.push_back(gdr_stream(size, std::size_t{2} << 30, 0));
        zc.push_back(gdr_stream(size, std::size_t{2} << 30, 1));
      }
      std::printf("gdr stream %7zu B: sendmsg %.2f GB/s, sendmsg_zc %.2f GB/s  zc/plain %.3f\n", size,
                  bench::median(plain), bench::median(zc), bench::median(zc) / bench::median(plain));
    }
  }
}
