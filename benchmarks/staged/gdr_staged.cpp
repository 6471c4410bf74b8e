// gdr_staged: gdr's staged path measured the way benchmarks/staged/
// raw_pipeline.cpp measures the hand-written one, so their CSVs line up
// (mode,size,chunk,depth,iters,median_gbps,min_gbps,max_gbps):
//
//   tcp2   two processes over TCP on 127.0.0.1: `co_await ep.send(dev)` of
//          `size` bytes of Device memory into `ep.recv(dev)` on the other
//          side, then a 1-byte acknowledgement (so the time includes the last
//          host-to-device copy). --space pinned sends Pinned memory instead
//          (no staging: gdr's zero-copy host path), the reference the staged
//          path is held against. Modes in the CSV: gdr_device, gdr_pinned.
//   loop1  one process, a loopback pair on one scheduler with staging
//          forced: the "wire" is a memcpy between the two bounce pools, so
//          the pipeline itself is what is measured (gdr_loop_device). With
//          --both, both directions at once (gdr_both_device, per direction).
//   lat    8-byte ping-pong over tcp2, Device and Pinned: half the round trip
//          (lat_device, lat_pinned; the "gbps" columns hold microseconds).
//          Two processes on one GPU: their CUDA contexts time-slice it.
//   lat1   the same between two TCP endpoints of one process (one context):
//          lat1_device, lat1_pinned, alternating twice.
//   kill   the receiving process is SIGKILLed in the middle of a 1 GiB
//          staged send while two receives wait: every pending operation must
//          fail within 2 s and no bounce buffer stay out (five rounds; exit
//          status 1 otherwise).
//
//   gdr_staged [--mode tcp2|loop1|lat|lat1|kill] [--space device|pinned] [--sizes 1M,64M]
//              [--sweep] [--chunks 256K,1M] [--depths 2,4] [--iters N]
//              [--both] [--verify] [--csv FILE]
//
// --verify (tcp2): random bytes, every byte of every size checked on the
// receiving side, including sizes that are not a multiple of the chunk.
//
// Build without Bazel (the GPU machine): see benchmarks/staged/build_and_run.sh.
// Without a GPU it prints why and exits 0.
#include <gdr/gdr.hpp>

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using clk = std::chrono::steady_clock;

std::size_t parse_size(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  switch (*end) {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<std::size_t>(v);
}

std::vector<std::size_t> parse_list(const std::string& s) {
  std::vector<std::size_t> v;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    std::size_t c = s.find(',', pos);
    if (c == std::string::npos) c = s.size();
    if (c > pos) v.push_back(parse_size(s.substr(pos, c - pos)));
    pos = c + 1;
  }
  return v;
}

struct options {
  std::string mode = "tcp2";
  std::string space = "device";
  std::vector<std::size_t> sizes = {1u << 20, 4u << 20, 16u << 20, 64u << 20, 256u << 20};
  std::vector<std::size_t> chunks = {4u << 20};  // the defaults
  std::vector<std::size_t> depths = {4};
  int iters = 0;  // 0: by size
  bool both = false;
  bool verify = false;
  std::string csv;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gdr_staged: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--mode") o.mode = next();
    else if (a == "--space") o.space = next();
    else if (a == "--sizes") o.sizes = parse_list(next());
    else if (a == "--sweep") o.sizes = {1u << 20, 4u << 20, 16u << 20, 64u << 20, 256u << 20, 1u << 30};
    else if (a == "--chunks") o.chunks = parse_list(next());
    else if (a == "--depths") o.depths = parse_list(next());
    else if (a == "--iters") o.iters = std::atoi(next().c_str());
    else if (a == "--both") o.both = true;
    else if (a == "--verify") o.verify = true;
    else if (a == "--csv") o.csv = next();
    else {
      std::fprintf(stderr, "usage: gdr_staged [--mode tcp2|loop1|lat|lat1|kill] [--space device|pinned] [--sizes 1M,64M] "
                           "[--sweep] [--chunks 256K,1M] [--depths 2,4] [--iters N] [--both] [--verify] [--csv F]\n");
      std::exit(a == "--help" ? 0 : 2);
    }
  }
  return o;
}

int iters_for(const options& o, std::size_t size) {
  if (o.iters > 0) return o.iters;
  if (size >= (std::size_t{1} << 30)) return 3;
  if (size >= (std::size_t{256} << 20)) return 5;
  if (size >= (std::size_t{64} << 20)) return 10;
  return 30;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

FILE* csv_out = nullptr;

void row(const char* mode, std::size_t size, std::size_t chunk, std::size_t depth, const std::vector<double>& v) {
  double med = median(v);
  double lo = *std::min_element(v.begin(), v.end());
  double hi = *std::max_element(v.begin(), v.end());
  std::printf("%s,%zu,%zu,%zu,%zu,%.4f,%.4f,%.4f\n", mode, size, chunk, depth, v.size(), med, lo, hi);
  std::fflush(stdout);
  if (csv_out != nullptr) {
    std::fprintf(csv_out, "%s,%zu,%zu,%zu,%zu,%.4f,%.4f,%.4f\n", mode, size, chunk, depth, v.size(), med, lo, hi);
    std::fflush(csv_out);
  }
}

std::vector<std::byte> random_bytes(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  std::uint64_t x = 0x9e3779b97f4a7c15ull * (seed + 1);
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<std::byte>(x);
  }
  return v;
}

gdr::protocol_options proto(std::size_t chunk, std::size_t depth) {
  gdr::protocol_options p;
  p.staging.chunk = chunk;
  p.staging.depth = depth;
  return p;
}

// Memory of either space, the largest size once.
struct memory {
  bool device;
  gdr::buffer<std::byte, gdr::Device> d;
  gdr::buffer<std::byte, gdr::Pinned> p;
  memory(bool dev, std::size_t n) : device(dev) {
    if (dev) d = gdr::buffer<std::byte, gdr::Device>(n, 0);
    else p = gdr::buffer<std::byte, gdr::Pinned>(n);
  }
  void fill(const std::vector<std::byte>& v) {
    if (device) {
      // From pageable memory cudaMemcpy may return before its DMA is done,
      // and the staged path's copies run on streams that do not wait for
      // the legacy stream: wait for the device.
      (void)cudaMemcpy(d.data(), v.data(), v.size(), cudaMemcpyHostToDevice);
      (void)cudaDeviceSynchronize();
    } else {
      std::memcpy(p.data(), v.data(), v.size());
    }
  }
  std::vector<std::byte> read(std::size_t n) {
    std::vector<std::byte> v(n);
    if (device) (void)cudaMemcpy(v.data(), d.data(), n, cudaMemcpyDeviceToHost);
    else std::memcpy(v.data(), p.data(), n);
    return v;
  }
};

// One operation on the first n bytes of `m`, whichever its space.
template <class Ep>
gdr::task<std::size_t> send_n(Ep& ep, memory& m, std::size_t n, gdr::tag t = gdr::tag{0}) {
  if (m.device) co_return co_await ep.send(m.d.view().first(n), t);
  co_return co_await ep.send(m.p.view().first(n), t);
}
template <class Ep>
gdr::task<std::size_t> recv_n(Ep& ep, memory& m, std::size_t n, gdr::tag t = gdr::tag{0}) {
  if (m.device) co_return co_await ep.recv(m.d.view().first(n), t);
  co_return co_await ep.recv(m.p.view().first(n), t);
}

// ------------------------------------------------------------------ tcp2

// The receiving process: accepts one connection per (chunk, depth) and
// mirrors the sender's loops.
int receiver(const options& o, int port_fd) {
  bool dev = o.space == "device";
  std::size_t maxn = *std::max_element(o.sizes.begin(), o.sizes.end());
  if (o.mode == "lat") maxn = 8;
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller ev(s);
  int rc = 0;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    for (std::size_t chunk : o.chunks) {
      for (std::size_t depth : o.depths) {
        gdr::tcp::endpoint_options eo;
        eo.protocol = proto(chunk, depth);
        gdr::tcp::listener l(s, gdr::tcp::address::loopback(0), gdr::default_registry(), eo);
        if (port_fd >= 0) {
          std::uint16_t port = l.local_address().port();
          if (::write(port_fd, &port, sizeof port) != sizeof port) std::_Exit(3);
        }
        gdr::tcp::endpoint ep = co_await l.accept();
        memory m(dev, maxn);
        std::byte ack{1};
        if (o.mode == "lat") {
          for (int i = 0; i < 2000 + 20000; ++i) {
            co_await recv_n(ep, m, 8);
            co_await send_n(ep, m, 8);
          }
        } else {
          unsigned seed = 0;
          for (std::size_t n : o.sizes) {
            int k = iters_for(o, n) + 2;
            for (int i = 0; i < k; ++i) {
              co_await recv_n(ep, m, n);
              if (o.verify && i == 0) {
                auto want = random_bytes(n, ++seed);
                if (m.read(n) != want) {
                  std::fprintf(stderr, "VERIFY FAILED: size %zu chunk %zu depth %zu\n", n, chunk, depth);
                  rc = 1;
                }
              }
              co_await ep.send(gdr::view<std::byte, gdr::Host>(&ack, 1));
            }
          }
        }
        co_await ep.close();
      }
    }
  }());
  s.drain();
  return rc;
}

int sender(const options& o, int port) {
  bool dev = o.space == "device";
  std::size_t maxn = *std::max_element(o.sizes.begin(), o.sizes.end());
  if (o.mode == "lat") maxn = 8;
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller ev(s);
  int rc = 0;
  std::string label = std::string("gdr_") + o.space;
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    for (std::size_t chunk : o.chunks) {
      for (std::size_t depth : o.depths) {
        gdr::tcp::endpoint_options eo;
        eo.protocol = proto(chunk, depth);
        gdr::tcp::endpoint ep;
        for (int tries = 0;; ++tries) {
          auto r = co_await gdr::tcp::connect(s, gdr::tcp::address::loopback(static_cast<std::uint16_t>(port)), {},
                                              gdr::default_registry(), eo)
                       .as_result();
          if (r) {
            ep = std::move(*r);
            break;
          }
          if (tries > 200) {
            std::fprintf(stderr, "gdr_staged: connect failed\n");
            rc = 1;
            co_return;
          }
          co_await gdr::sleep_for(s, std::chrono::milliseconds(10));
        }
        memory m(dev, maxn);
        std::byte ack{};
        if (o.mode == "lat") {
          std::vector<double> us;
          for (int i = 0; i < 2000 + 20000; ++i) {
            auto t0 = clk::now();
            co_await send_n(ep, m, 8);
            co_await recv_n(ep, m, 8);
            if (i >= 2000) us.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count() / 2);
          }
          row(dev ? "lat_device" : "lat_pinned", 8, chunk, depth, us);
        } else {
          unsigned seed = 0;
          for (std::size_t n : o.sizes) {
            int k = iters_for(o, n);
            std::vector<double> gbps;
            if (o.verify) m.fill(random_bytes(n, ++seed));
            for (int i = 0; i < k + 2; ++i) {
              auto t0 = clk::now();
              co_await send_n(ep, m, n);
              co_await ep.recv(gdr::view<std::byte, gdr::Host>(&ack, 1));
              double sec = std::chrono::duration<double>(clk::now() - t0).count();
              if (i >= 2) gbps.push_back(static_cast<double>(n) / sec / 1e9);
            }
            row(label.c_str(), n, chunk, depth, gbps);
          }
        }
        co_await ep.close();
      }
    }
  }());
  s.drain();
  return rc;
}

int run_tcp2(const options& o) {
  int p[2];
  if (::pipe(p) != 0) return 3;
  pid_t pid = ::fork();
  if (pid < 0) return 3;
  if (pid == 0) {
    // The receiver. Dies with the parent; touches CUDA only after the fork.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::close(p[0]);
    int rc = 3;
    try {
      rc = receiver(o, p[1]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gdr_staged receiver: %s\n", e.what());
    }
    std::_Exit(rc);
  }
  ::close(p[1]);
  int rc = 0;
  // One listener per (chunk, depth): read each port before connecting.
  // The sender reads the first port here and the rest as it goes: simplest
  // is to read them lazily through a small wrapper around sender().
  struct port_reader {
    int fd;
    int next() {
      std::uint16_t port = 0;
      if (::read(fd, &port, sizeof port) != sizeof port) return -1;
      return port;
    }
  } pr{p[0]};
  try {
    // Each (chunk, depth) gets its own process-side connection: run the
    // sender once per pair with that pair only.
    for (std::size_t chunk : o.chunks) {
      for (std::size_t depth : o.depths) {
        options one = o;
        one.chunks = {chunk};
        one.depths = {depth};
        int port = pr.next();
        if (port < 0) {
          rc = 3;
          break;
        }
        if (int r = sender(one, port)) rc = r;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gdr_staged sender: %s\n", e.what());
    rc = 3;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "gdr_staged: the receiver failed (status %d)\n", status);
    if (rc == 0) rc = 1;
  }
  return rc;
}

// ------------------------------------------------------------------ loop1

int run_loop1(const options& o) {
  std::size_t maxn = *std::max_element(o.sizes.begin(), o.sizes.end());
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller ev(s);
  for (std::size_t chunk : o.chunks) {
    for (std::size_t depth : o.depths) {
      auto po = proto(chunk, depth);
      po.force = gdr::force_path::staged;
      auto pair = gdr::loopback::make_pair(s, s, gdr::default_registry(), po);
      auto& a = pair.first;  // references, not structured bindings: clang 14
      auto& b = pair.second; // cannot capture those in the lambda below
      memory src(true, maxn), dst(true, maxn);
      std::unique_ptr<memory> src2, dst2;
      if (o.both) {
        src2 = std::make_unique<memory>(true, maxn);
        dst2 = std::make_unique<memory>(true, maxn);
      }
      gdr::sync_wait(s, [&]() -> gdr::task<> {
        for (std::size_t n : o.sizes) {
          int k = iters_for(o, n);
          std::vector<double> gbps;
          for (int i = 0; i < k + 2; ++i) {
            auto t0 = clk::now();
            if (o.both) {
              co_await gdr::when_all(send_n(a, src, n), recv_n(b, dst, n), send_n(b, *src2, n, gdr::tag{1}),
                                     recv_n(a, *dst2, n, gdr::tag{1}));
            } else {
              co_await gdr::when_all(send_n(a, src, n), recv_n(b, dst, n));
            }
            double sec = std::chrono::duration<double>(clk::now() - t0).count();
            if (i >= 2) gbps.push_back(static_cast<double>(n) / sec / 1e9);
          }
          row(o.both ? "gdr_both_device" : "gdr_loop_device", n, chunk, depth, gbps);
        }
        co_await a.close();
      }());
    }
  }
  s.drain();
  return 0;
}

// ------------------------------------------------------------------ kill

// The peer is SIGKILLed in the middle of staged transfers: every pending
// operation (a 1 GiB Device send under way, a Device receive and a Pinned
// receive nobody answers) must complete with an error within 2 s, and no
// bounce buffer may stay checked out. Five rounds; exit 1 on a failure.
int kill_round(int round);

int run_kill() {
  // Each round in a process of its own that forks the receiver before it
  // touches CUDA: a process that initialised CUDA must not fork a child that
  // uses it (a first version ran the rounds in one process, and from the
  // second round on the receiver could not initialise CUDA).
  int failures = 0;
  for (int round = 0; round < 5; ++round) {
    std::fflush(stdout);
    pid_t pid = ::fork();
    if (pid < 0) return 3;
    if (pid == 0) std::_Exit(kill_round(round));
    int st = 0;
    ::waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ++failures;
  }
  return failures == 0 ? 0 : 1;
}

int kill_round(int round) {
  int failures = 0;
  {
    int p[2];
    if (::pipe(p) != 0) return 3;
    pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::close(p[0]);
      gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
      gdr::cuda::event_poller ev(s);
      gdr::sync_wait(s, [&]() -> gdr::task<> {
        gdr::tcp::listener l(s, gdr::tcp::address::loopback(0));
        std::uint16_t port = l.local_address().port();
        if (::write(p[1], &port, sizeof port) != sizeof port) std::_Exit(3);
        gdr::tcp::endpoint ep = co_await l.accept();
        memory m(true, std::size_t{1} << 30);
        for (;;) co_await recv_n(ep, m, std::size_t{1} << 30);  // until killed
      }());
      std::_Exit(0);
    }
    ::close(p[1]);
    std::uint16_t port = 0;
    if (::read(p[0], &port, sizeof port) != sizeof port) return 3;
    ::close(p[0]);
    gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
    gdr::cuda::event_poller ev(s);
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      gdr::tcp::endpoint ep = co_await gdr::tcp::connect(s, gdr::tcp::address::loopback(port));
      memory big(true, std::size_t{1} << 30), din(true, 1 << 20), pin(false, 64);
      auto report = [](auto op) -> gdr::task<gdr::op_report> { co_return co_await std::move(op).report(); };
      clk::time_point killed{};
      auto [rs, rd, rp, x] = co_await gdr::when_all(
          report(ep.send(big.d.view())), report(ep.recv(din.d.view(), gdr::tag{7})),
          report(ep.recv(pin.p.view(), gdr::tag{8})), [&]() -> gdr::task<int> {
            co_await gdr::sleep_for(s, std::chrono::milliseconds(20 + 10 * round));
            killed = clk::now();
            ::kill(pid, SIGKILL);
            co_return 0;
          }());
      (void)x;
      double ms = std::chrono::duration<double, std::milli>(clk::now() - killed).count();
      bool lost = rd.error == gdr::errc::connection_lost && rp.error == gdr::errc::connection_lost &&
                  (!rs.error || rs.error == gdr::errc::connection_lost);
      auto t0 = clk::now();
      while (ep.bounce_buffers_in_use() != std::pair<std::size_t, std::size_t>{0, 0} &&
             clk::now() - t0 < std::chrono::seconds(2))
        co_await gdr::sleep_for(s, std::chrono::milliseconds(1));
      auto out = ep.bounce_buffers_in_use();
      bool ok = lost && ms < 2000 && out == std::pair<std::size_t, std::size_t>{0, 0};
      std::printf("kill round %d: send %s (%zu bytes staged), recv Device %s, recv Pinned %s; all done %.1f ms after "
                  "SIGKILL; bounce buffers out %zu/%zu: %s\n",
                  round, rs.error ? rs.error.message().c_str() : "completed", rs.bytes, rd.error.message().c_str(),
                  rp.error.message().c_str(), ms, out.first, out.second, ok ? "OK" : "FAILED");
      if (!ok) ++failures;
      co_await ep.close();
    }());
    s.drain();
    int st = 0;
    ::waitpid(pid, &st, 0);
    // The kill must have found the receiver alive and mid-transfer.
    if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGKILL) {
      std::printf("kill round %d: FAILED: the receiver ended before the kill (status %d)\n", round, st);
      ++failures;
    }
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

// ------------------------------------------------------------------ lat1

// 8-byte ping-pong between two TCP endpoints of one process on one
// scheduler: one CUDA context, so what the staged path adds to a small
// message is measured without two processes time-slicing the GPU.
int run_lat1() {
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller ev(s);
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    gdr::tcp::endpoint_options eo;
    gdr::tcp::listener l(s, gdr::tcp::address::loopback(0), gdr::default_registry(), eo);
    auto acc = l.accept();
    gdr::tcp::endpoint a = co_await gdr::tcp::connect(s, l.local_address(), {}, gdr::default_registry(), eo);
    gdr::tcp::endpoint b = co_await std::move(acc);
    for (bool dev : {false, true, false, true}) {
      memory ma(dev, 8), mb(dev, 8);
      std::vector<double> us;
      for (int i = 0; i < 2000 + 20000; ++i) {
        auto t0 = clk::now();
        co_await gdr::when_all(send_n(a, ma, 8), recv_n(b, mb, 8));
        co_await gdr::when_all(send_n(b, mb, 8), recv_n(a, ma, 8));
        if (i >= 2000) us.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count() / 2);
      }
      row(dev ? "lat1_device" : "lat1_pinned", 8, 0, 0, us);
    }
    co_await a.close();
  }());
  s.drain();
  return 0;
}

// Whether there is a GPU; without one, prints the skip line.
bool gpu_here() {
  std::string why = gdr::cuda::device_unavailable_reason(0);
  if (!why.empty()) std::printf("[gdr-skip] gdr_staged: %s\n", why.c_str());
  return why.empty();
}

// `gpu_here()`, asked in a child that exits: the modes that fork must not
// have initialised CUDA first (a child of a process that did cannot use it).
bool gpu_probed_in_child() {
  std::fflush(stdout);
  pid_t pid = ::fork();
  if (pid == 0) {
    bool here = gpu_here();
    std::fflush(stdout);
    std::_Exit(here ? 0 : 10);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  return !(WIFEXITED(st) && WEXITSTATUS(st) == 10);
}

}  // namespace

int main(int argc, char** argv) {
  options o = parse(argc, argv);
  if (!o.csv.empty()) csv_out = std::fopen(o.csv.c_str(), "a");
  std::fprintf(stderr, "gdr_staged: mode %s, space %s\n", o.mode.c_str(), o.space.c_str());
  int rc = 0;
  auto t0 = clk::now();
  if (o.mode == "tcp2" || o.mode == "lat") {
    if (!gpu_probed_in_child()) return 0;
    rc = run_tcp2(o);
  } else if (o.mode == "kill") {
    if (!gpu_probed_in_child()) return 0;
    rc = run_kill();
  } else if (o.mode == "lat1") {
    if (!gpu_here()) return 0;
    rc = run_lat1();
  } else if (o.mode == "loop1") {
    if (!gpu_here()) return 0;
    rc = run_loop1(o);
  } else {
    std::fprintf(stderr, "gdr_staged: unknown mode %s\n", o.mode.c_str());
    return 2;
  }
  std::fprintf(stderr, "gdr_staged: %.1f s, exit %d\n", std::chrono::duration<double>(clk::now() - t0).count(), rc);
  if (csv_out != nullptr) std::fclose(csv_out);
  return rc;
}
