// gdr's verbs transport measured the way perftest measures a link: two
// processes on one RDMA device (fork, then rdma_cm), each with its own
// scheduler busy-polling. Prints one line per measurement:
//
//   gdr-verbs send_lat size=8 iters=2000 typical_us=... avg_us=...   (half a round trip, as ib_send_lat)
//   gdr-verbs put_lat  size=8 ...                                     (put + ack round trip / 2)
//   gdr-verbs send_bw  size=65536 iters=2000 MBps=...                 (rendezvous above the threshold: RDMA WRITE)
//   gdr-verbs put_bw   size=65536 ...
//
//   verbs_bench IP MODE SIZE ITERS      MODE: send_lat | put_lat | send_bw | put_bw
//
// Needs an RDMA device whose address is IP (benchmarks/verbs/run.sh runs it
// in the Soft-RoCE guest, side by side with perftest).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

namespace {

using clk = std::chrono::steady_clock;

gdr::view<std::byte, gdr::Host> v(std::vector<std::byte>& b) { return {b.data(), b.size()}; }

// Streams `iters` messages with up to `window` in flight.
gdr::task<> stream_send(gdr::verbs::endpoint& ep, std::vector<std::byte>& buf, int iters, int window) {
  for (int done = 0; done < iters;) {
    int n = std::min(window, iters - done);
    std::vector<gdr::task<std::size_t>> ops;
    for (int i = 0; i < n; ++i)
      ops.push_back([](gdr::verbs::endpoint& e, std::vector<std::byte>& b) -> gdr::task<std::size_t> {
        co_return co_await e.send(v(b));
      }(ep, buf));
    co_await gdr::when_all(std::move(ops));
    done += n;
  }
}
gdr::task<> stream_recv(gdr::verbs::endpoint& ep, std::vector<std::vector<std::byte>>& bufs, int iters, int window) {
  for (int done = 0; done < iters;) {
    int n = std::min(window, iters - done);
    std::vector<gdr::task<std::size_t>> ops;
    for (int i = 0; i < n; ++i)
      ops.push_back([](gdr::verbs::endpoint& e, std::vector<std::byte>& b) -> gdr::task<std::size_t> {
        co_return co_await e.recv(v(b));
      }(ep, bufs[static_cast<std::size_t>(i)]));
    co_await gdr::when_all(std::move(ops));
    done += n;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s IP send_lat|put_lat|send_bw|put_bw SIZE ITERS\n", argv[0]);
    return 2;
  }
  std::string ip = argv[1], mode = argv[2];
  std::size_t size = std::strtoull(argv[3], nullptr, 10);
  int iters = std::atoi(argv[4]);
  const int window = 32;
  const std::uint16_t port = static_cast<std::uint16_t>(20000 + (::getpid() % 20000));
  gdr::verbs::endpoint_options eo;
  eo.protocol.rendezvous_threshold = 8192;  // large messages by RDMA WRITE, as ib_write_bw
  eo.cache_registrations = true;            // the buffers live for the whole run
  int ctl[2];
  if (::pipe(ctl) != 0) return 1;
  pid_t child = ::fork();
  if (child < 0) return 1;
  bool server = child != 0;
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  int rc = 0;
  try {
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      gdr::verbs::endpoint ep;
      std::string addr = ip + ":" + std::to_string(port);
      std::vector<std::byte> target(std::max<std::size_t>(size, 1));
      auto reg = gdr::register_memory(gdr::host_view(target));
      if (server) {
        gdr::verbs::listener l(sched, addr, gdr::default_registry(), eo);
        char c = 1;
        (void)!::write(ctl[1], &c, 1);
        ep = co_await l.accept();
        // Tell the client where to put.
        std::uint64_t desc[3] = {reg.describe(0).address(), reg.describe(0).size(), reg.key()};
        co_await ep.send(gdr::view<const std::byte, gdr::Host>(reinterpret_cast<const std::byte*>(desc), sizeof desc));
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
      std::uint64_t desc[3] = {};
      if (!server) co_await ep.recv(gdr::view<std::byte, gdr::Host>(reinterpret_cast<std::byte*>(desc), sizeof desc));
      gdr::remote_view<std::byte, gdr::Host> remote(desc[0], desc[1], desc[2], 0);
      std::vector<std::byte> buf(size, std::byte{1});
      std::vector<std::vector<std::byte>> rbufs(window, std::vector<std::byte>(size));
      if (mode == "send_lat" || mode == "put_lat") {
        std::vector<double> half;
        half.reserve(static_cast<std::size_t>(iters));
        int warm = std::min(100, iters / 10);
        for (int i = 0; i < iters + warm; ++i) {
          auto t0 = clk::now();
          if (mode == "send_lat") {
            if (server) {
              co_await ep.recv(v(rbufs[0]));
              co_await ep.send(v(buf));
            } else {
              co_await ep.send(v(buf));
              co_await ep.recv(v(rbufs[0]));
            }
          } else if (!server) {
            co_await ep.put(v(buf), remote);  // completes when the peer has acknowledged it
          }
          if (i >= warm) half.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count() / 2);
        }
        if (!server) {
          std::sort(half.begin(), half.end());
          double avg = 0;
          for (double x : half) avg += x;
          avg /= static_cast<double>(half.size());
          std::printf("gdr-verbs %s size=%zu iters=%d typical_us=%.2f avg_us=%.2f\n", mode.c_str(), size, iters,
                      half[half.size() / 2], avg);
        }
        // Both sides finish together.
        std::byte done{};
        if (server) co_await ep.recv(gdr::view<std::byte, gdr::Host>(&done, 1));
        else co_await ep.send(gdr::view<const std::byte, gdr::Host>(&done, 1));
      } else {
        auto t0 = clk::now();
        if (mode == "send_bw") {
          if (server) co_await stream_recv(ep, rbufs, iters, window);
          else co_await stream_send(ep, buf, iters, window);
        } else if (!server) {
          for (int done = 0; done < iters;) {
            int n = std::min(window, iters - done);
            std::vector<gdr::task<std::size_t>> ops;
            for (int i = 0; i < n; ++i)
              ops.push_back([](gdr::verbs::endpoint& e, std::vector<std::byte>& b,
                               gdr::remote_view<std::byte, gdr::Host> r) -> gdr::task<std::size_t> {
                co_return co_await e.put(v(b), r);
              }(ep, buf, remote));
            co_await gdr::when_all(std::move(ops));
            done += n;
          }
        }
        double secs = std::chrono::duration<double>(clk::now() - t0).count();
        std::byte done{};
        if (server) co_await ep.recv(gdr::view<std::byte, gdr::Host>(&done, 1));
        else co_await ep.send(gdr::view<const std::byte, gdr::Host>(&done, 1));
        if (!server)
          std::printf("gdr-verbs %s size=%zu iters=%d MBps=%.2f\n", mode.c_str(), size, iters,
                      static_cast<double>(size) * iters / secs / 1e6);
      }
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
