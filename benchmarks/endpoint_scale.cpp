// endpoint_scale: what an idle TCP endpoint costs when one scheduler holds
// many: N endpoints (N / 2 connections over 127.0.0.1, both ends in this
// process), made one connection at a time (connect, accept, and one 1-byte
// message from the connecting end, which leaves only after the peer's hello
// and is read only after it, so both ends are usable), then left idle.
// Prints the time per connection and the memory per idle endpoint (heap in
// use from mallinfo2, and resident set), beside raw blocking sockets doing
// the same connects, accepts and 1-byte messages, in the same run, and the
// ratios. Needs about N + 20 descriptors (RLIMIT_NOFILE is raised to its hard
// limit; it says so when that is too few). --no-message leaves the 1-byte
// message out on both sides: then a connection is the connect and the accept
// alone (gdr's hellos still go out, but nobody waits for them).
//
//   ./bazelw build -c opt //benchmarks:endpoint_scale
//   bazel-bin/benchmarks/endpoint_scale [--endpoints 10000] [--reps 3] [--small] [--no-message]
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/transport/tcp.hpp>

#include "benchmarks/bench_util.hpp"

namespace tcp = gdr::tcp;
using clk = std::chrono::steady_clock;

namespace {

struct sample {
  double us_per_conn = 0;       // whole run / connections
  double us_per_conn_last = 0;  // the last tenth of the connections
  double heap_per_ep = 0;       // bytes of heap in use per endpoint
  double rss_per_ep = 0;        // bytes resident per endpoint
};

std::size_t heap_in_use() {
  struct mallinfo2 m = ::mallinfo2();
  return m.uordblks + m.hblkhd;
}

std::size_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  std::size_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

// Raw blocking sockets: connect, accept, one byte written and read, per
// connection; both descriptors kept open until all are made.
sample run_raw(int conns, bool message) {
  std::vector<int> fds;
  fds.reserve(2 * static_cast<std::size_t>(conns));
  std::uint16_t port = 0;
  int lfd = bench::listen_loopback(port);
  ::malloc_trim(0);
  const std::size_t heap0 = heap_in_use(), rss0 = rss_bytes();
  const auto t0 = clk::now();
  auto t_last = t0;
  for (int i = 0; i < conns; ++i) {
    if (i == conns - conns / 10) t_last = clk::now();
    int c = bench::connect_loopback(port);
    int s = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (s < 0) bench::die("accept");
    bench::set_nodelay(s);
    char b = 1;
    if (message && (::send(c, &b, 1, MSG_NOSIGNAL) != 1 || ::recv(s, &b, 1, 0) != 1)) bench::die("1-byte message");
    fds.push_back(c);
    fds.push_back(s);
  }
  sample r;
  const double all = bench::seconds_since(t0), last = bench::seconds_since(t_last);
  r.us_per_conn = all * 1e6 / conns;
  r.us_per_conn_last = last * 1e6 / (conns / 10 > 0 ? conns / 10 : 1);
  r.heap_per_ep = static_cast<double>(heap_in_use() - heap0) / (2.0 * conns);
  r.rss_per_ep = static_cast<double>(static_cast<long>(rss_bytes()) - static_cast<long>(rss0)) / (2.0 * conns);
  for (int fd : fds) ::close(fd);
  ::close(lfd);
  return r;
}

// gdr: the same on one scheduler, the endpoints kept until all are made.
sample run_gdr(int conns, bool small, bool message) {
  sample r;
  tcp::endpoint_options eo;
  if (small) {
    eo.rx_buffer = 4096;
    eo.protocol.reply_slots = 4;
  }
  std::vector<tcp::endpoint> eps;
  eps.reserve(2 * static_cast<std::size_t>(conns));
  {
    gdr::scheduler s;
    tcp::listener l(s, "127.0.0.1:0", gdr::default_registry(), eo);
    // Warm the scheduler and the listener with one connection made and closed,
    // so the first endpoint's numbers are not the scheduler's.
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      auto acc = l.accept();
      tcp::endpoint a = co_await tcp::connect(s, l.local_address(), eo);
      tcp::endpoint b = co_await std::move(acc);
    }());
    ::malloc_trim(0);
    const std::size_t heap0 = heap_in_use(), rss0 = rss_bytes();
    const auto t0 = clk::now();
    auto t_last = t0;
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      std::array<std::byte, 1> x{}, y{};
      for (int i = 0; i < conns; ++i) {
        if (i == conns - conns / 10) t_last = clk::now();
        auto acc = l.accept();
        tcp::endpoint a = co_await tcp::connect(s, l.local_address(), eo);
        tcp::endpoint b = co_await std::move(acc);
        if (message) {
          co_await a.send(gdr::host_view(x));
          co_await b.recv(gdr::host_view(y));
        }
        eps.push_back(std::move(a));
        eps.push_back(std::move(b));
      }
    }());
    const double all = bench::seconds_since(t0), last = bench::seconds_since(t_last);
    r.us_per_conn = all * 1e6 / conns;
    r.us_per_conn_last = last * 1e6 / (conns / 10 > 0 ? conns / 10 : 1);
    r.heap_per_ep = static_cast<double>(heap_in_use() - heap0) / (2.0 * conns);
    r.rss_per_ep = static_cast<double>(static_cast<long>(rss_bytes()) - static_cast<long>(rss0)) / (2.0 * conns);
    eps.clear();  // aborted; ~scheduler runs the loop until they are gone
  }
  return r;
}

void print(const char* what, const sample& s) {
  std::printf("  %-5s %10.1f %14.1f %12.2f %12.2f\n", what, s.us_per_conn, s.us_per_conn_last,
              s.heap_per_ep / 1024.0, s.rss_per_ep / 1024.0);
}

}  // namespace

int main(int argc, char** argv) {
  int endpoints = 10000, reps = 3;
  bool small = false, message = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--endpoints" && i + 1 < argc) {
      endpoints = std::atoi(argv[++i]);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (a == "--small") {
      small = true;
    } else if (a == "--no-message") {
      message = false;
    } else {
      std::fprintf(stderr, "usage: %s [--endpoints N] [--reps R] [--small] [--no-message]\n", argv[0]);
      return a == "--help" ? 0 : 2;
    }
  }
  const int conns = endpoints / 2;
  if (conns < 1) return 2;
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &rl);
  ::getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < static_cast<rlim_t>(endpoints) + 20) {
    std::fprintf(stderr, "RLIMIT_NOFILE is %llu (hard limit), %d endpoints need about %d: use fewer\n",
                 static_cast<unsigned long long>(rl.rlim_cur), endpoints, endpoints + 20);
    return 1;
  }
  std::printf("%d endpoints (%d connections, both ends here) on one scheduler; RLIMIT_NOFILE %llu%s%s\n", 2 * conns,
              conns, static_cast<unsigned long long>(rl.rlim_cur), small ? "; rx_buffer 4096, reply_slots 4" : "",
              message ? "" : "; no message (connect and accept only)");
  std::vector<double> rt, gt, rl10, gl10, rh, gh, rr, gr;
  for (int k = 0; k < reps; ++k) {
    // Alternating, so that the machine's load falls on both alike.
    sample raw = run_raw(conns, message);
    sample g = run_gdr(conns, small, message);
    std::printf("rep %d   us/conn  us/conn (last 10%%)  heap KiB/ep   RSS KiB/ep\n", k + 1);
    print("raw", raw);
    print("gdr", g);
    rt.push_back(raw.us_per_conn), gt.push_back(g.us_per_conn);
    rl10.push_back(raw.us_per_conn_last), gl10.push_back(g.us_per_conn_last);
    rh.push_back(raw.heap_per_ep), gh.push_back(g.heap_per_ep);
    rr.push_back(raw.rss_per_ep), gr.push_back(g.rss_per_ep);
  }
  std::printf("median of %d: raw %.1f us/conn (last 10%% %.1f), gdr %.1f us/conn (last 10%% %.1f), gdr/raw %.2fx\n",
              reps, bench::median(rt), bench::median(rl10), bench::median(gt), bench::median(gl10),
              bench::median(gt) / bench::median(rt));
  std::printf("median of %d: per idle endpoint: gdr heap %.2f KiB, RSS %.2f KiB; raw heap %.2f KiB, RSS %.2f KiB\n",
              reps, bench::median(gh) / 1024.0, bench::median(gr) / 1024.0, bench::median(rh) / 1024.0,
              bench::median(rr) / 1024.0);
  return 0;
}
