// gdr's verbs transport measured the way perftest measures a link: two
// processes on one RDMA device (fork, then rdma_cm), each with its own
// scheduler busy-polling. The client (the forked child) measures and prints
// one line:
//
//   gdr-verbs send_lat size=8 iters=1000 typical_us=... avg_us=...
//   gdr-verbs put_lat  size=8 iters=1000 typical_us=... avg_us=...
//   gdr-verbs get_lat  size=8 iters=1000 typical_us=... avg_us=...
//   gdr-verbs send_bw  size=65536 iters=2000 window=128 MBps=...
//   gdr-verbs put_bw   size=65536 iters=2000 window=128 MBps=...
//   gdr-verbs get_bw   size=65536 iters=2000 window=128 MBps=...
//   gdr-verbs atomic_lat size=8 iters=1000 typical_us=... avg_us=...
//   gdr-verbs batch_bw size=16384 iters=20 window=512 MBps=...
//
//   verbs_bench IP MODE SIZE ITERS [WINDOW]
//     MODE: send_lat | put_lat | get_lat | atomic_lat | send_bw | put_bw | get_bw | batch_bw
//     WINDOW: operations in flight in the *_bw modes (default 128, perftest's
//     default --tx-depth for ib_write_bw and ib_read_bw)
//
// What each number is, next to the perftest number it is compared with.
// perftest's *_lat tools stamp the time at each post and report the median
// (t_typical) and mean (t_avg) of the gaps between consecutive posts,
// divided by 2 for SEND and WRITE (a ping-pong: one-way) and by 1 for READ
// (one READ's round trip) (perftest_parameters.c, print_report_lat).
//   send_lat: a send/recv ping-pong of SIZE bytes, the client's round trip
//             (send, then recv of the answer) / 2: one-way, as ib_send_lat.
//   put_lat:  a put ping-pong, as ib_write_lat: each side puts SIZE bytes
//             into the other's registered memory; the server busy-polls the
//             last byte of its memory for the client's put, then puts back;
//             the client's round trip (its put, until the answer's last byte
//             has changed in its own memory) / 2: one-way.
//   get_lat:  one get of SIZE bytes from the peer's registered memory, from
//             its start to its completion: a full round trip, as ib_read_lat.
//   atomic_lat: one fetch_add on an 8-byte word of the peer's registered
//             memory, a full round trip, as ib_atomic_lat (SIZE is 8).
// Puts, gets and atomics are direct (the initiator's NIC, RDMA WRITE, READ
// and atomics into the memory the peer exposed: the view goes over whole,
// with its NIC key) unless GDR_BENCH_CHECKED=1, which registers the memory
// `exposure::checked`: every access is then served by the peer's loop (the
// checked mode), as before the one-sided lane.
// perftest's *_bw tools time the client from the first post to the last
// completion, with up to --tx-depth (128) operations in flight, and report
// "MB/sec" in MiB/s (2^20 bytes; --report_gbits says so). Here:
//   send_bw:  SIZE-byte sends with WINDOW in flight (a sliding window: a new
//             one starts as soon as any completes); above the rendezvous
//             threshold (8 KiB) the payload goes by RDMA WRITE, so this is
//             compared with ib_write_bw. The receiver keeps 2 x WINDOW
//             receives posted, each into its own buffer, so that it is never
//             what the sender waits for.
//   put_bw:   SIZE-byte puts into the server's registered memory, WINDOW in
//             flight; the server only serves (ib_write_bw -R).
//   get_bw:   SIZE-byte gets from the server's registered memory, WINDOW in
//             flight (ib_read_bw, ib_read_bw -R).
//   batch_bw: ITERS batches, one at a time, of WINDOW blocks of SIZE bytes
//             each (put_batch; block i goes to block (i * 37) % WINDOW of the
//             server's pool): a KV-cache hand-off, against ib_write_bw moving
//             the same bytes (-s SIZE -n ITERS*WINDOW).
// MBps is SIZE x ITERS / seconds / 2^20, perftest's unit. Every operation of
// a window shares one local buffer (one source for sends and puts, one
// destination for gets; perftest's buffers are shared the same way), except
// the receives, which each have their own.
// Registrations are cached (endpoint_options::cache_registrations), and an
// untimed warm-up of the same pattern runs first (2 x WINDOW operations for
// send_bw, so that every receive buffer is registered; WINDOW for put_bw and
// get_bw; 10% of ITERS, at most 100, for the latency modes): registration
// is out of the timed loop, as perftest registers before it starts.
// The connection's send slots and receive buffers (tx_depth, rx_depth) are
// made at least WINDOW deep, as perftest sizes its queue pair by --tx-depth.
//
// GDR_BENCH_CACHE=0: registrations are not cached (the endpoints' default),
// so every transfer registers its memory (what it costs: docs/VERBS.md,
// "Keys").
//
// GDR_BENCH_GPUDIRECT=1: both endpoints are GPUDirect endpoints on the test
// stand-in (gdr::verbs::testing: host memory plays GPU 0's memory, no GPU
// needed), and send_lat / send_bw send from and receive into Device views:
// the GPUDirect data path's cost against the host path on the same link
// (every Device send goes by rendezvous, so an 8-byte one takes the rts,
// rtr and WRITE round trips). Lines then start "gdr-verbs-gpudirect".
//
// Needs an RDMA device whose address is IP (benchmarks/verbs/run.sh runs it
// in the Soft-RoCE guest, side by side with perftest).
#include <sys/wait.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

namespace {

using clk = std::chrono::steady_clock;

// The latency samples' clock: the TSC where there is one, as perftest's
// get_cycles(), converted by the run's own calibration against
// steady_clock (start and end of the loop). steady_clock is a system call
// where the clock source has no vDSO (the emulated guest: about 1 us),
// which would sit inside every sample.
std::uint64_t ticks() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return static_cast<std::uint64_t>(clk::now().time_since_epoch().count());
#endif
}
using bytes = std::vector<std::byte>;
using remote = gdr::remote_view<std::byte, gdr::Host>;

// Data on tag 0; the benchmark's own handshakes (descriptors, ready, done)
// on tag 1, so that they never meet a data receive.
constexpr gdr::tag data_tag{0};
constexpr gdr::tag ctl_tag{1};

gdr::view<std::byte, gdr::Host> v(bytes& b) { return {b.data(), b.size()}; }
// The same bytes as GPU 0's memory (GDR_BENCH_GPUDIRECT: the stand-in).
gdr::view<std::byte, gdr::Device> dv(bytes& b) { return {b.data(), b.size(), 0}; }

// Resumes the awaiting coroutine on the next turn of the scheduler's loop,
// after it has polled its completion queue (a busy-poll that lets the
// endpoint progress meanwhile).
struct next_turn : gdr::remote_work {
  gdr::scheduler* s;
  std::coroutine_handle<> h{};
  explicit next_turn(gdr::scheduler& sc) : s(&sc) {}
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> c) noexcept {
    h = c;
    run = [](gdr::remote_work* w) noexcept { static_cast<next_turn*>(w)->h.resume(); };
    s->post(this);
  }
  void await_resume() const noexcept {}
};

// The ping-pong's mark of iteration i: never 0 (the memory's first value),
// and different in consecutive iterations.
std::byte mark(int i) { return static_cast<std::byte>(i % 255 + 1); }

gdr::task<> ctl_send(gdr::verbs::endpoint& ep, const void* p, std::size_t n) {
  co_await ep.send(gdr::view<const std::byte, gdr::Host>(static_cast<const std::byte*>(p), n), ctl_tag);
}
gdr::task<> ctl_recv(gdr::verbs::endpoint& ep, void* p, std::size_t n) {
  co_await ep.recv(gdr::view<std::byte, gdr::Host>(static_cast<std::byte*>(p), n), ctl_tag);
}

// The sliding window: `window` workers share a count of `n` operations; each
// starts the next as soon as its previous one has completed, so that
// min(window, n) operations are in flight until the last ones drain.
// `op(w)` starts one operation for worker w and returns its awaitable.
template <class Op>
gdr::task<> worker(int& next, int n, int w, Op& op) {
  while (next < n) {
    ++next;
    (void)co_await op(w);
  }
}
template <class Op>
gdr::task<> sliding_window(int n, int window, Op op) {
  int next = 0;
  std::vector<gdr::task<>> workers;
  for (int w = 0; w < std::min(window, n); ++w) workers.push_back(worker(next, n, w, op));
  co_await gdr::when_all(std::move(workers));
}

struct stats {
  double typical = 0, avg = 0;
};
stats summarize(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  double sum = 0;
  for (double x : xs) sum += x;
  return {xs[xs.size() / 2], sum / static_cast<double>(xs.size())};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr,
                 "usage: %s IP send_lat|put_lat|get_lat|atomic_lat|send_bw|put_bw|get_bw|batch_bw SIZE ITERS [WINDOW]\n",
                 argv[0]);
    return 2;
  }
  std::string ip = argv[1], mode = argv[2];
  std::size_t size = std::strtoull(argv[3], nullptr, 10);
  int iters = std::atoi(argv[4]);
  int window = argc > 5 ? std::atoi(argv[5]) : 128;
  bool lat = mode == "send_lat" || mode == "put_lat" || mode == "get_lat" || mode == "atomic_lat";
  bool bw = mode == "send_bw" || mode == "put_bw" || mode == "get_bw" || mode == "batch_bw";
  if (mode == "atomic_lat") size = 8;
  const bool batch = mode == "batch_bw";
  const char* checked_env = std::getenv("GDR_BENCH_CHECKED");
  const bool checked = checked_env != nullptr && std::strcmp(checked_env, "1") == 0;
  if ((!lat && !bw) || size == 0 || iters < 2 || window < 1) {
    std::fprintf(stderr, "verbs_bench: bad arguments (MODE %s, SIZE >= 1, ITERS >= 2, WINDOW >= 1)\n", mode.c_str());
    return 2;
  }
  const int recv_window = 2 * window;  // send_bw's receives posted ahead
  const std::uint16_t port = static_cast<std::uint16_t>(20000 + (::getpid() % 20000));
  gdr::verbs::endpoint_options eo;
  const char* gd_env = std::getenv("GDR_BENCH_GPUDIRECT");
  const bool gd = gd_env != nullptr && std::strcmp(gd_env, "1") == 0;
  if (gd && mode != "send_lat" && mode != "send_bw") {
    std::fprintf(stderr, "verbs_bench: GDR_BENCH_GPUDIRECT=1 measures send_lat and send_bw only\n");
    return 2;
  }
  const char* label = gd ? "gdr-verbs-gpudirect" : checked ? "gdr-verbs-checked" : "gdr-verbs";
  if (gd) {
    gdr::verbs::testing::stand_in_host_memory_for_device(true);
    eo.gpudirect = true;
  }
  eo.protocol.rendezvous_threshold = 8192;  // large messages by RDMA WRITE, as ib_write_bw
  // The buffers live for the whole run; GDR_BENCH_CACHE=0 measures the
  // default policy instead (every transfer registers its memory anew).
  const char* cache_env = std::getenv("GDR_BENCH_CACHE");
  eo.cache_registrations = cache_env == nullptr || std::strcmp(cache_env, "0") != 0;
  eo.tx_depth = std::max<unsigned>(eo.tx_depth, static_cast<unsigned>(batch ? 64 : window));
  eo.rx_depth = std::max<unsigned>(eo.rx_depth, static_cast<unsigned>(batch ? 64 : window));
  eo.one_sided_depth = std::max<unsigned>(eo.one_sided_depth, static_cast<unsigned>(window));
  eo.one_sided_wrs = std::max<unsigned>(eo.one_sided_wrs, 2u * static_cast<unsigned>(window));
  int ctl[2];
  if (::pipe(ctl) != 0) return 1;
  pid_t child = ::fork();
  if (child < 0) return 1;
  bool server = child != 0;
  // The owner of memory that direct gets, atomics and bandwidth puts reach
  // has nothing to do: its loop sleeps (as perftest's server of those
  // tests waits on its socket). It polls only where it works: send/recv,
  // put_lat (it watches its memory for the ping and puts back) and the
  // checked mode (it serves every access).
  const bool owner_idle = server && !checked && mode != "send_lat" && mode != "send_bw" && mode != "put_lat";
  gdr::scheduler sched({.mode = owner_idle ? gdr::run_mode::sleep : gdr::run_mode::busy_poll});
  int rc = 0;
  try {
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      gdr::verbs::endpoint ep;
      std::string addr = ip + ":" + std::to_string(port);
      // Each side's memory the other may put into and get from (a pool of
      // WINDOW blocks for batch_bw).
      bytes target(batch ? size * static_cast<std::size_t>(window) : size);
      auto reg = gdr::register_memory(gdr::host_view(target), gdr::access::read_write,
                                      checked ? gdr::exposure::checked : gdr::exposure::nic);
      if (server) {
        gdr::verbs::listener l(sched, addr, gdr::default_registry(), eo);
        char c = 1;
        (void)!::write(ctl[1], &c, 1);
        ep = co_await l.accept();
      } else {
        char c;
        if (::read(ctl[0], &c, 1) != 1) co_return;
        // The server listens before it writes `ctl`; retry a refused
        // connect anyway (rdma_cm may lag behind the listen).
        for (int attempt = 0;; ++attempt) {
          bool ok = false;
          try {
            ep = co_await gdr::verbs::connect(sched, addr, ip + ":0", gdr::default_registry(), eo);
            ok = true;
          } catch (const gdr::error&) {
            if (attempt > 50) throw;
          }
          if (ok) break;
          co_await gdr::sleep_for(sched, std::chrono::milliseconds(20));
        }
      }
      // Tell each other where to put and get: the whole view, with its NIC
      // key (none when checked).
      auto mine = reg.describe(0).to_wire();
      std::array<std::byte, remote::wire_size> theirs{};
      co_await ctl_send(ep, mine.data(), mine.size());
      co_await ctl_recv(ep, theirs.data(), theirs.size());
      remote peer = remote::from_wire(theirs).value();
      bytes buf(target.size(), std::byte{1});
      using word_view = gdr::remote_view<std::uint64_t, gdr::Host>;
      word_view word(peer.address(), 1, peer.key(), 0, peer.nic_keys());
      std::vector<gdr::block> blocks;
      for (std::size_t i = 0; batch && i < static_cast<std::size_t>(window); ++i)
        blocks.push_back({i * size, ((i * 37) % static_cast<std::size_t>(window)) * size, size});
      std::byte flag{};  // ready / done
      // A data message from `buf`, into `b` (GDR_BENCH_GPUDIRECT: as Device memory).
      auto send_msg = [&] { return gd ? ep.send(dv(buf), data_tag) : ep.send(v(buf), data_tag); };
      auto recv_msg = [&](bytes& b) { return gd ? ep.recv(dv(b), data_tag) : ep.recv(v(b), data_tag); };

      if (lat) {
        std::vector<double> samples;
        samples.reserve(static_cast<std::size_t>(iters));
        int warm = std::min(100, iters / 10);
        enum class lat_mode { send, put, get, atomic };
        const lat_mode lm = mode == "send_lat"  ? lat_mode::send
                            : mode == "put_lat" ? lat_mode::put
                            : mode == "get_lat" ? lat_mode::get
                                                : lat_mode::atomic;
        // put_lat: each side polls the last byte of its memory for the
        // peer's put, as ib_write_lat does, turning the loop in between.
        const volatile std::byte* last = target.data() + target.size() - 1;
        // get_lat, atomic_lat: the server only serves (until the client's done).
        int rounds = server && (lm == lat_mode::get || lm == lat_mode::atomic) ? 0 : warm + iters;
        // One-way latencies are a ping-pong's round trip / 2 (send, put);
        // a get and an atomic are one round trip, as perftest reports them.
        const double div = lm == lat_mode::send || lm == lat_mode::put ? 2 : 1;
        std::vector<std::uint64_t> spans;  // ticks per sample
        spans.reserve(static_cast<std::size_t>(iters));
        const auto c0 = clk::now();
        const std::uint64_t k0 = ticks();
        for (int i = 0; i < rounds; ++i) {
          const std::uint64_t t0 = ticks();
          switch (lm) {
            case lat_mode::send:
              if (server) {
                co_await recv_msg(target);
                co_await send_msg();
              } else {
                co_await send_msg();
                co_await recv_msg(target);
              }
              break;
            case lat_mode::put:
              // As ib_write_lat's loop: the server waits, then puts; the
              // client puts, then waits (its put's completion and the
              // server's answer arrive together).
              buf.back() = mark(i);
              if (server) {
                while (*last != mark(i)) co_await next_turn(sched);
                co_await ep.put(v(buf), peer);
              } else {
                co_await ep.put(v(buf), peer);
                while (*last != mark(i)) co_await next_turn(sched);
              }
              break;
            case lat_mode::atomic: (void)co_await ep.fetch_add(word, 1); break;
            case lat_mode::get: co_await ep.get(v(buf), peer); break;
          }
          if (i >= warm) spans.push_back(ticks() - t0);
        }
        const double us = std::chrono::duration<double, std::micro>(clk::now() - c0).count();
        const std::uint64_t k = ticks() - k0;
        const double us_per_tick = k != 0 ? us / static_cast<double>(k) : 0;
        for (std::uint64_t t : spans) samples.push_back(static_cast<double>(t) * us_per_tick / div);
        if (!server) {
          stats s = summarize(samples);
          std::printf("%s %s size=%zu iters=%d typical_us=%.2f avg_us=%.2f\n", label, mode.c_str(), size, iters,
                      s.typical, s.avg);
        }
      } else {
        std::vector<bytes> rbufs;
        if (mode == "send_bw" && server) rbufs.assign(static_cast<std::size_t>(recv_window), bytes(size));
        auto send_op = [&](int) { return send_msg(); };
        auto recv_op = [&](int w) { return recv_msg(rbufs[static_cast<std::size_t>(w)]); };
        auto put_op = [&](int) { return ep.put(v(buf), peer); };
        auto get_op = [&](int) { return ep.get(v(buf), peer); };
        auto batch_op = [&](int) { return ep.put_batch(v(buf), peer, blocks); };
        int warm = batch ? 2 : std::min(iters, mode == "send_bw" ? recv_window : window);
        if (server) {
          if (mode == "send_bw") {
            co_await sliding_window(warm, recv_window, recv_op);
            // Receives of the timed run posted before the sender starts.
            gdr::task_scope scope;
            scope.spawn(sliding_window(iters, recv_window, recv_op));
            co_await ctl_send(ep, &flag, 1);
            co_await scope.join();
          } else {
            co_await ctl_send(ep, &flag, 1);  // put and get: the server only serves
          }
        } else {
          if (mode == "send_bw") co_await sliding_window(warm, window, send_op);
          else if (mode == "put_bw") co_await sliding_window(warm, window, put_op);
          else if (batch) co_await sliding_window(warm, 1, batch_op);
          else co_await sliding_window(warm, window, get_op);
          co_await ctl_recv(ep, &flag, 1);  // ready
          auto t0 = clk::now();
          if (mode == "send_bw") co_await sliding_window(iters, window, send_op);
          else if (mode == "put_bw") co_await sliding_window(iters, window, put_op);
          else if (batch) co_await sliding_window(iters, 1, batch_op);  // one batch at a time
          else co_await sliding_window(iters, window, get_op);
          double secs = std::chrono::duration<double>(clk::now() - t0).count();
          const double moved = static_cast<double>(size) * iters * (batch ? window : 1);
          std::printf("%s %s size=%zu iters=%d window=%d MBps=%.2f\n", label, mode.c_str(), size, iters, window,
                      moved / secs / (1024.0 * 1024.0));
        }
      }
      // Both sides finish together: the client's done after its last
      // operation completed, so the server served everything.
      if (server) co_await ctl_recv(ep, &flag, 1);
      else co_await ctl_send(ep, &flag, 1);
      co_await reg.revoke();
      co_await ep.close();
    }());
    sched.drain();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "verbs_bench (%s): %s\n", server ? "server" : "client", e.what());
    rc = 1;
  }
  if (server) {
    int st = 0;
    ::waitpid(child, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  std::fflush(stdout);
  return rc;
}
