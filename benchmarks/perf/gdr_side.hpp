// gdr_perf's gdr side: the same ping-pong and stream as the raw sockets, over
// gdr::tcp::endpoint on a scheduler in busy-poll or sleep mode. The stream
// keeps `depth` sends in flight (as a socket's send buffer does for the raw
// program); the receiver keeps as many receives posted. All sends read one
// buffer and all receives write one buffer, as the raw program's single
// send and receive buffers (and perftest's) do: the endpoint reads a
// connection's stream in order, so the receives never write it at once, and
// the working set stays the raw program's instead of `depth` times larger.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/view.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/tcp.hpp>

#include "benchmarks/perf/harness.hpp"

namespace perf::gdr_side {

inline std::string addr(std::uint16_t port) { return "127.0.0.1:" + std::to_string(port); }

inline void report(const char* who, const gdr::tcp::endpoint& ep) {
  if (!diag()) return;
  const gdr::tcp::endpoint_stats& s = ep.stats();
  std::fprintf(stderr,
               "gdr_perf diag: %s writes %llu (frames %llu), reads %llu (direct %llu), spin attempts %llu\n", who,
               static_cast<unsigned long long>(s.writes), static_cast<unsigned long long>(s.frames_out),
               static_cast<unsigned long long>(s.reads), static_cast<unsigned long long>(s.direct_reads),
               static_cast<unsigned long long>(s.spin_reads));
}

inline sample run_pingpong(const config& cfg, gdr::run_mode mode, std::size_t size, std::size_t iters) {
  return run_pair_port(cfg, [&](std::uint16_t port, const std::function<void()>& ready) {
    gdr::scheduler sched({.mode = mode});
    gdr::tcp::listener l(sched, addr(port));
    ready();
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      gdr::tcp::endpoint ep = co_await l.accept();
      std::vector<std::byte> buf(size);
      gdr::view<std::byte, gdr::Host> v(buf.data(), buf.size());
      for (std::size_t i = 0; i < iters + cfg.warmup; ++i) {
        std::size_t n = co_await ep.recv(v);
        co_await ep.send(gdr::view<const std::byte, gdr::Host>(buf.data(), n));
      }
      co_await ep.close();
    }());
  }, [&](std::uint16_t port) {
    gdr::scheduler sched({.mode = mode});
    return gdr::sync_wait(sched, [&]() -> gdr::task<sample> {
      gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, addr(port));
      std::vector<std::byte> buf(size, std::byte{1});
      gdr::view<std::byte, gdr::Host> v(buf.data(), buf.size());
      sample s;
      for (std::size_t i = 0; i < iters + cfg.warmup; ++i) {
        auto t0 = now();
        co_await ep.send(gdr::view<const std::byte, gdr::Host>(v));
        co_await ep.recv(v);
        if (i >= cfg.warmup) s.add_us(elapsed_us(t0));
      }
      co_await ep.close();
      co_return s;
    }());
  });
}

inline sample run_stream(const config& cfg, gdr::run_mode mode, std::size_t size, std::size_t count) {
  // Messages in flight: enough to cover a socket buffer's worth, at least 2
  // (GDR_PERF_DEPTH overrides, for experiments).
  std::size_t depth = std::clamp<std::size_t>((4u << 20) / size, 2, 64);
  if (const char* d = std::getenv("GDR_PERF_DEPTH"); d != nullptr && *d != 0) depth = std::max<std::size_t>(1, std::strtoul(d, nullptr, 10));
  return run_pair_port(cfg, [&](std::uint16_t port, const std::function<void()>& ready) {
    gdr::scheduler sched({.mode = mode});
    gdr::tcp::listener l(sched, addr(port));
    ready();
    gdr::sync_wait(sched, [&]() -> gdr::task<> {
      gdr::tcp::endpoint ep = co_await l.accept();
      std::vector<std::byte> buf(size);
      // `depth` receivers, each taking every depth-th message (receives are
      // matched to messages in the order they were posted).
      auto receiver = [&](std::size_t k) -> gdr::task<> {
        gdr::view<std::byte, gdr::Host> v(buf.data(), size);
        for (std::size_t i = k; i < count; i += depth) co_await ep.recv(v);
      };
      std::vector<gdr::task<>> rs;
      for (std::size_t k = 0; k < depth; ++k) rs.push_back(receiver(k));
      co_await gdr::when_all(std::move(rs));
      std::byte ack{1};
      co_await ep.send(gdr::view<const std::byte, gdr::Host>(&ack, 1));
      report("gdr receiver", ep);
      co_await ep.close();
    }());
  }, [&](std::uint16_t port) {
    gdr::scheduler sched({.mode = mode});
    return gdr::sync_wait(sched, [&]() -> gdr::task<sample> {
      gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, addr(port));
      std::vector<std::byte> buf(size, std::byte{1});
      gdr::view<const std::byte, gdr::Host> v(buf.data(), size);
      auto t0 = now();
      auto sender = [&](std::size_t k) -> gdr::task<> {
        for (std::size_t i = k; i < count; i += depth) co_await ep.send(v);
      };
      std::vector<gdr::task<>> ss;
      for (std::size_t k = 0; k < depth; ++k) ss.push_back(sender(k));
      co_await gdr::when_all(std::move(ss));
      std::byte ack{};
      co_await ep.recv(gdr::view<std::byte, gdr::Host>(&ack, 1));
      sample s;
      s.add(static_cast<double>(size * count) / (elapsed_us(t0) * 1e3));  // GB/s
      report("gdr sender", ep);
      co_await ep.close();
      co_return s;
    }());
  });
}

}  // namespace perf::gdr_side
