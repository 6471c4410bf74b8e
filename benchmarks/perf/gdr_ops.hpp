// gdr_perf's gdr side for every transport, operation and memory space:
// latency (one operation at a time: a send answered by the peer's send, or
// a put or get, which completes when the target has answered) and
// bandwidth (a window of operations in flight), between two endpoints of
// the chosen transport, with the path the last operation took.
//
//   tcp, shm,    two forked processes, pinned (harness.hpp); shm meets on an
//   verbs        abstract Unix socket name; verbs needs an
//                RDMA device and its IP address (--verbs-ip or GDR_VERBS_IP)
//   loopback     one process, two threads each with its scheduler, pinned
//
// Spaces: host (std::vector), pinned (gdr::buffer<Pinned>: cudaHostAlloc, or
// mlock without CUDA), device[:N] (gdr::buffer<Device> on GPU N: needs a
// CUDA build and a GPU; the staged path or GPUDirect moves it). For put and
// get, `peer` is the space of the exposed memory on the other side.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/view.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/shm.hpp>
#include <gdr/transport/tcp.hpp>
#if GDR_HAS_CUDA
#include <gdr/cuda/event_poller.hpp>
#endif
#if GDR_HAS_VERBS
#include <gdr/transport/verbs.hpp>
#endif

#include "benchmarks/perf/harness.hpp"

namespace perf::ops {

enum class op { send, put, get, fetch_add };
enum class space { host, pinned, device };

struct space_arg {
  space kind = space::host;
  int gpu = 0;
};

inline const char* name(op o) {
  return o == op::send ? "send" : o == op::put ? "put" : o == op::get ? "get" : "fetch_add";
}
inline const char* name(space s) { return s == space::host ? "host" : s == space::pinned ? "pinned" : "device"; }

/// What one gdr measurement runs.
struct spec {
  std::string transport = "tcp";  // tcp, shm, loopback, verbs
  op operation = op::send;
  space_arg local{};  // the initiator's (client's) memory
  space_arg peer{};   // the other side's: its receive buffer, or the exposed memory of a put/get
  gdr::run_mode mode = gdr::run_mode::busy_poll;
  std::string verbs_ip;
};

/// A measurement: microseconds per operation (latency) or GB/s
/// (bandwidth), and the path of the initiator's last operation.
struct measured {
  sample v;
  std::string path;
};

/// `n` bytes in space S, as a view.
template <class S>
struct bytes {
  explicit bytes(std::size_t n, int gpu) : b(allocate(n, gpu)) {}
  gdr::view<std::byte, S> view(std::size_t n) { return b.view().subview(0, n); }
  static gdr::buffer<std::byte, S> allocate(std::size_t n, int gpu) {
    auto t0 = now();
    gdr::buffer<std::byte, S> b(std::max<std::size_t>(n, 1), gpu);
    if (diag())
      std::fprintf(stderr, "gdr_perf diag: pid %d allocated %zu bytes in %.1f us\n", static_cast<int>(::getpid()), n,
                   elapsed_us(t0));
    return b;
  }
  gdr::buffer<std::byte, S> b;
};
template <>
struct bytes<gdr::Host> {
  explicit bytes(std::size_t n, int) : b(std::max<std::size_t>(n, 1), std::byte{1}) {}
  gdr::view<std::byte, gdr::Host> view(std::size_t n) { return gdr::view<std::byte, gdr::Host>(b.data(), n); }
  std::vector<std::byte> b;
};

/// The scheduler's CUDA event poller when a space is Device memory (the
/// staged path's copy engine).
struct gpu_side {
  /// `role`: "server" or "client" (GDR_PERF_DEVICE_ALLOC_SERVER or _CLIENT,
  /// where set, decides for that side alone).
  explicit gpu_side([[maybe_unused]] gdr::scheduler& s, [[maybe_unused]] bool needed,
                    [[maybe_unused]] const char* role = "") {
#if GDR_HAS_CUDA
    // GDR_PERF_DEVICE_ALLOC=cudamalloc, vmm or automatic: how
    // gdr::buffer<Device> allocates (default: the process's rule), to
    // compare the two ways CUDA IPC shares memory.
    const char* e = std::getenv("GDR_PERF_DEVICE_ALLOC");
    if (const char* r = std::getenv((std::string("GDR_PERF_DEVICE_ALLOC_") + (*role == 's' ? "SERVER" : "CLIENT")).c_str());
        *role != 0 && r != nullptr && *r != 0)
      e = r;
    if (e != nullptr && *e != 0) {
      const std::string v = e;
      gdr::cuda::set_device_allocation(
          {.vmm = v == "vmm" ? gdr::cuda::vmm_use::always
                             : v == "cudamalloc" ? gdr::cuda::vmm_use::never : gdr::cuda::vmm_use::automatic});
    }
    if (needed) events.emplace(s);
#endif
  }
#if GDR_HAS_CUDA
  ~gpu_side() {
    if (!events || !diag()) return;
    const gdr::cuda::ipc_stats& s = events->ipc().stats();
    std::fprintf(stderr,
                 "gdr_perf diag: pid %d CUDA IPC exports %llu (fd %llu), imports %llu (fd %llu), hits %llu, stale "
                 "%llu, evictions %llu, released %llu, closed %llu, longest import %.1f us\n",
                 static_cast<int>(::getpid()), static_cast<unsigned long long>(s.exports),
                 static_cast<unsigned long long>(s.fd_exports), static_cast<unsigned long long>(s.imports),
                 static_cast<unsigned long long>(s.fd_imports), static_cast<unsigned long long>(s.hits),
                 static_cast<unsigned long long>(s.stale), static_cast<unsigned long long>(s.evictions),
                 static_cast<unsigned long long>(s.released), static_cast<unsigned long long>(s.closed), static_cast<double>(s.max_import_ns) / 1e3);
    const gdr::cuda::event_poller_stats& e = events->stats();
    std::fprintf(stderr, "gdr_perf diag: pid %d copies %llu, fences %llu (idle %llu), queries %llu\n",
                 static_cast<int>(::getpid()), static_cast<unsigned long long>(e.copies),
                 static_cast<unsigned long long>(e.fences), static_cast<unsigned long long>(e.fences_idle),
                 static_cast<unsigned long long>(e.queries));
  }
  std::optional<gdr::cuda::event_poller> events;
#endif
};

/// Operations in flight for a bandwidth run: enough for 4 MiB, 2 to 64
/// (GDR_PERF_DEPTH overrides, for experiments).
inline std::size_t window(std::size_t size) {
  if (const char* d = std::getenv("GDR_PERF_DEPTH"); d != nullptr && *d != 0)
    return std::max<std::size_t>(1, std::strtoul(d, nullptr, 10));
  return std::clamp<std::size_t>((4u << 20) / (size + 1), 2, 64);
}

/// The abstract socket name a shm pair meets on: both sides are children
/// of one gdr_perf, and the harness's free port differs per run.
inline std::string shm_name(std::uint16_t port) { return "@gdr-perf-" + std::to_string(::getppid()) + "-" + std::to_string(port); }

/// The shm endpoints' options: the defaults, or GDR_PERF_SHM_SINGLE_COPY
/// (bytes; 0 = every payload through the rings) for experiments.
inline gdr::shm::endpoint_options shm_options() {
  gdr::shm::endpoint_options o;
  if (const char* e = std::getenv("GDR_PERF_SHM_SINGLE_COPY"); e != nullptr && *e != 0)
    o.single_copy_threshold = std::strtoull(e, nullptr, 10);
  // GDR_PERF_SHM_DEVICE=staged: Device memory through the bounce buffers
  // and the ring instead of CUDA IPC, for a comparison.
  if (const char* e = std::getenv("GDR_PERF_SHM_DEVICE"); e != nullptr && std::string(e) == "staged")
    o.device = gdr::shm::device_path::staged;
  return o;
}

/// GDR_PERF_DIAG: a shm endpoint's counters on stderr (where a difference
/// between two runs comes from: descriptors passed, copies overlapped,
/// pieces through the ring).
template <class E>
void report_counters(const char* who, const E& ep) {
  if constexpr (std::is_same_v<E, gdr::shm::endpoint>) {
    if (!diag()) return;
    const gdr::shm::endpoint_stats& s = ep.stats();
    std::fprintf(stderr,
                 "gdr_perf diag: %s shm frames out %llu in %llu, rendezvous sends %llu, ipc copies %llu (read past "
                 "%llu, most in flight %llu), ipc exports %llu, fds passed %llu taken %llu, socket full %llu, ring "
                 "gpu copies %llu, single copies %llu, staged chunks %llu, paused %llu\n",
                 who, static_cast<unsigned long long>(s.frames_out), static_cast<unsigned long long>(s.frames_in),
                 static_cast<unsigned long long>(s.rendezvous_sends), static_cast<unsigned long long>(s.ipc_copies),
                 static_cast<unsigned long long>(s.ipc_read_past), static_cast<unsigned long long>(s.ipc_max_in_flight),
                 static_cast<unsigned long long>(s.ipc_exports), static_cast<unsigned long long>(s.fds_passed),
                 static_cast<unsigned long long>(s.fds_taken), static_cast<unsigned long long>(s.fd_socket_full),
                 static_cast<unsigned long long>(s.ring_gpu_copies), static_cast<unsigned long long>(s.single_copies),
                 static_cast<unsigned long long>(s.staged_chunks), static_cast<unsigned long long>(s.paused));
  } else {
    (void)who, (void)ep;
  }
}

/// Operations before a bandwidth run's clock starts (a send's receiver
/// takes them before its window, then says it is ready).
inline std::size_t bw_warmup(std::size_t warmup) { return std::min<std::size_t>(warmup, 8); }

/// The passive side: echoes (send, latency), receives and acks (send,
/// bandwidth), or exposes its memory until the initiator says it is done
/// (put, get).
template <class E, class PS>
gdr::task<> serve(E& ep, const spec& sp, std::size_t size, std::size_t n, std::size_t warm, bool latency) {
  // (A fetch_add's word is 8 bytes whatever the size.)
  if (sp.operation == op::fetch_add) size = std::max<std::size_t>(size, sizeof(std::uint64_t));
  bytes<PS> mem(size, sp.peer.gpu);
  if (sp.operation == op::send) {
    if (latency) {
      for (std::size_t i = 0; i < n; ++i) {
        std::size_t got = co_await ep.recv(mem.view(size));
        co_await ep.send(mem.view(got));
      }
    } else {
      // The warm-up messages, then a word back: the timed window starts
      // with both sides set up (buffers, GPU contexts, first imports).
      for (std::size_t i = 0; i < warm; ++i) co_await ep.recv(mem.view(size));
      std::array<std::byte, 1> ready{};
      co_await ep.send(gdr::host_view(ready));
      const std::size_t depth = window(size);
      auto receiver = [&](std::size_t k) -> gdr::task<> {
        for (std::size_t i = k; i < n; i += depth) co_await ep.recv(mem.view(size));
      };
      std::vector<gdr::task<>> rs;
      for (std::size_t k = 0; k < depth; ++k) rs.push_back(receiver(k));
      co_await gdr::when_all(std::move(rs));
      std::array<std::byte, 1> ack{};
      co_await ep.send(gdr::host_view(ack));
    }
  } else {
    auto reg = gdr::register_memory(mem.view(std::max<std::size_t>(size, 1)), gdr::access::read_write);
    auto wire = reg.describe(0).to_wire();
    co_await ep.send(gdr::host_view(wire));
    std::array<std::byte, 1> done{};
    co_await ep.recv(gdr::host_view(done));
    co_await reg.revoke();
  }
  report_counters(latency ? "server (latency)" : "server (bandwidth)", ep);
  co_await ep.close();
}

/// The initiator: times `n` operations (after `warmup`), one at a time or
/// a window of them.
template <class E, class LS, class PS>
gdr::task<measured> drive(E& ep, const spec& sp, std::size_t size, std::size_t n, std::size_t warmup, bool latency) {
  bytes<LS> mem(size, sp.local.gpu);
  measured m;
  using remote_t = gdr::remote_view<std::byte, PS>;
  std::optional<remote_t> remote;
  if (sp.operation != op::send) {
    std::array<std::byte, remote_t::wire_size> wire{};
    co_await ep.recv(gdr::host_view(wire));
    gdr::result<remote_t> r = remote_t::from_wire(wire);
    if (!r) throw std::runtime_error("the peer's remote view did not parse");
    remote = r->subview(0, std::max<std::size_t>(size, 1));
  }
  gdr::transfer_path path = gdr::transfer_path::none;  // of the initiator's own operation
  auto one = [&]() -> gdr::task<> {
    switch (sp.operation) {
      case op::send:
        co_await ep.send(mem.view(size));
        path = ep.last_path();
        if (latency) co_await ep.recv(mem.view(size));
        break;
      case op::put: co_await ep.put(mem.view(size), remote->subview(0, size)); break;
      case op::get: co_await ep.get(mem.view(size), remote->subview(0, size)); break;
      case op::fetch_add:
        // One 8-byte word of the peer's host memory (`size` is ignored).
        if constexpr (!gdr::space_traits<PS>::on_device)
          co_await ep.fetch_add(gdr::remote_view<std::uint64_t, PS>(remote->address(), 1, remote->key(), 0), 1);
        break;
    }
    if (sp.operation != op::send) path = ep.last_path();
  };
  if (latency) {
    for (std::size_t i = 0; i < n + warmup; ++i) {
      auto t0 = now();
      co_await one();
      if (i >= warmup) m.v.add_us(elapsed_us(t0));
    }
  } else {
    auto w0 = now();
    for (std::size_t i = 0; i < bw_warmup(warmup); ++i) co_await one();
    if (sp.operation == op::send) {
      std::array<std::byte, 1> ready{};
      co_await ep.recv(gdr::host_view(ready));  // the receiver has the warm-up messages
    }
    if (diag())
      std::fprintf(stderr, "gdr_perf diag: pid %d warm-up of %zu operations in %.1f us\n", static_cast<int>(::getpid()),
                   bw_warmup(warmup), elapsed_us(w0));
    const std::size_t depth = window(size);
    auto t0 = now();
    auto worker = [&](std::size_t k) -> gdr::task<> {
      for (std::size_t i = k; i < n; i += depth) co_await one();
    };
    std::vector<gdr::task<>> ws;
    for (std::size_t k = 0; k < depth; ++k) ws.push_back(worker(k));
    co_await gdr::when_all(std::move(ws));
    if (sp.operation == op::send) {
      std::array<std::byte, 1> ack{};
      co_await ep.recv(gdr::host_view(ack));  // the receiver has them all
    }
    m.v.add(static_cast<double>(size * n) / (elapsed_us(t0) * 1e3));  // GB/s
  }
  m.path = gdr::to_string(path);
  if (sp.operation != op::send) {
    std::array<std::byte, 1> done{};
    co_await ep.send(gdr::host_view(done));
  }
  report_counters(latency ? "client (latency)" : "client (bandwidth)", ep);
  co_await ep.close();
  co_return m;
}

/// Runs the initiator's side and the passive side with spaces LS and PS.
template <class LS, class PS>
measured run_spaces(const config& cfg, const spec& sp, std::size_t size, std::size_t n, bool latency) {
  const bool gpu = std::is_same_v<LS, gdr::Device> || std::is_same_v<PS, gdr::Device>;
  // A send's latency echoes: the passive side sees every message, warm-up too.
  const std::size_t passive_n = sp.operation == op::send ? (latency ? n + cfg.warmup : n) : 0;
  const gdr::scheduler_options so{.mode = sp.mode};
  if (sp.transport == "loopback") {
    gdr::scheduler sa(so), sb(so);
    gpu_side ga(sa, gpu), gb(sb, gpu);
    auto [a, b] = gdr::loopback::make_pair(sa, sb);
    measured m;
    std::thread passive([&, ep = std::move(b)]() mutable {
      pin(cfg.server_cpu);
      gdr::sync_wait(sb, serve<gdr::loopback::endpoint, PS>(ep, sp, size, passive_n, bw_warmup(cfg.warmup), latency));
    });
    pin(cfg.client_cpu);
    m = gdr::sync_wait(sa, drive<gdr::loopback::endpoint, LS, PS>(a, sp, size, n, cfg.warmup, latency));
    passive.join();
    return m;
  }
  // Two processes: the client's sample comes back through the harness's
  // pipe, the path it took through a pipe of its own.
  int pp[2];
  if (::pipe(pp) != 0) die("pipe");
  std::string ip = sp.verbs_ip;
  auto server = [&](std::uint16_t port, const std::function<void()>& ready) {
    ::close(pp[0]);
    gdr::scheduler sched(so);
    gpu_side g(sched, gpu, "server");
    if (sp.transport == "tcp") {
      gdr::tcp::listener l(sched, "127.0.0.1:" + std::to_string(port));
      ready();
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        gdr::tcp::endpoint ep = co_await l.accept();
        co_await serve<gdr::tcp::endpoint, PS>(ep, sp, size, passive_n, bw_warmup(cfg.warmup), latency);
      }());
    } else if (sp.transport == "shm") {
      gdr::shm::listener l(sched, shm_name(port), gdr::default_registry(), shm_options());
      ready();
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        gdr::shm::endpoint ep = co_await l.accept();
        co_await serve<gdr::shm::endpoint, PS>(ep, sp, size, passive_n, bw_warmup(cfg.warmup), latency);
      }());
    } else {
#if GDR_HAS_VERBS
      gdr::verbs::listener l(sched, ip + ":" + std::to_string(port));
      ready();
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        gdr::verbs::endpoint ep = co_await l.accept();
        co_await serve<gdr::verbs::endpoint, PS>(ep, sp, size, passive_n, bw_warmup(cfg.warmup), latency);
      }());
#endif
    }
  };
  auto client = [&](std::uint16_t port) -> sample {
    ::close(pp[0]);
    gdr::scheduler sched(so);
    gpu_side g(sched, gpu, "client");
    measured m;
    if (sp.transport == "tcp") {
      m = gdr::sync_wait(sched, [&]() -> gdr::task<measured> {
        gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, "127.0.0.1:" + std::to_string(port));
        co_return co_await drive<gdr::tcp::endpoint, LS, PS>(ep, sp, size, n, cfg.warmup, latency);
      }());
    } else if (sp.transport == "shm") {
      m = gdr::sync_wait(sched, [&]() -> gdr::task<measured> {
        gdr::shm::endpoint ep =
            co_await gdr::shm::connect(sched, shm_name(port), gdr::default_registry(), shm_options());
        co_return co_await drive<gdr::shm::endpoint, LS, PS>(ep, sp, size, n, cfg.warmup, latency);
      }());
    } else {
#if GDR_HAS_VERBS
      m = gdr::sync_wait(sched, [&]() -> gdr::task<measured> {
        gdr::verbs::endpoint ep =
            co_await gdr::verbs::connect(sched, ip + ":" + std::to_string(port), ip + ":0", {std::chrono::seconds(10)});
        co_return co_await drive<gdr::verbs::endpoint, LS, PS>(ep, sp, size, n, cfg.warmup, latency);
      }());
#endif
    }
    char path[32] = {};
    std::snprintf(path, sizeof path, "%s", m.path.c_str());
    if (::write(pp[1], path, sizeof path) != static_cast<ssize_t>(sizeof path)) std::_Exit(3);
    ::close(pp[1]);
    return m.v;
  };
  measured m;
  m.v = run_pair_port(cfg, server, client);
  ::close(pp[1]);
  char path[32] = {};
  if (::read(pp[0], path, sizeof path) == static_cast<ssize_t>(sizeof path)) m.path = path;
  ::close(pp[0]);
  return m;
}

/// The limit of a host transfer between two processes of one node: one
/// CPU's `memcpy` of `size` bytes between two buffers of this process.
/// Latency: two copies (a round trip's worth), microseconds; bandwidth: a
/// stream of at least 20 copies after one untimed, GB/s.
inline void local_host_copy(std::size_t size, std::size_t iters, std::size_t count, sample& lat, sample& bw) {
  const std::size_t n = std::max<std::size_t>(size, 1);
  std::vector<std::byte> a(n, std::byte{1}), b(n);
  sample l;
  for (std::size_t i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), size);
    std::memcpy(a.data(), b.data(), size);
    asm volatile("" : : "r"(a.data()), "r"(b.data()) : "memory");  // the copies happen
    l.add(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  lat.add(l.median());
  count = std::max<std::size_t>(count, 20);
  std::memcpy(b.data(), a.data(), size);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < count; ++i) {
    std::memcpy(b.data(), a.data(), size);
    asm volatile("" : : "r"(b.data()) : "memory");
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bw.add(static_cast<double>(size) * static_cast<double>(count) / secs / 1e9);
}

/// The local copy a CUDA IPC transfer is measured against: `cudaMemcpy`
/// device-to-device of `size` bytes on GPU `gpu`, in one process (a forked
/// child: CUDA must not be initialised in gdr_perf itself). Latency: two
/// synchronous copies (a round trip's worth), microseconds; bandwidth: a
/// stream of `count` asynchronous copies, GB/s. False: no GPU, or no CUDA.
inline bool local_device_copy([[maybe_unused]] int gpu, [[maybe_unused]] std::size_t size,
                              [[maybe_unused]] std::size_t iters, [[maybe_unused]] std::size_t count,
                              [[maybe_unused]] sample& lat, [[maybe_unused]] sample& bw) {
#if !GDR_HAS_CUDA
  return false;
#else
  int p[2];
  if (::pipe(p) != 0) die("pipe");
  pid_t c = ::fork();
  if (c < 0) die("fork");
  if (c == 0) {
    ::close(p[0]);
    double out[2] = {NAN, NAN};
    void *a = nullptr, *b = nullptr;
    cudaStream_t st = nullptr;
    const std::size_t n = std::max<std::size_t>(size, 1);
    if (cudaSetDevice(gpu) == cudaSuccess && cudaMalloc(&a, n) == cudaSuccess && cudaMalloc(&b, n) == cudaSuccess &&
        cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess) {
      for (int w = 0; w < 10; ++w) (void)cudaMemcpy(b, a, size, cudaMemcpyDeviceToDevice);
      sample l;
      for (std::size_t i = 0; i < iters; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        (void)cudaMemcpy(b, a, size, cudaMemcpyDeviceToDevice);
        (void)cudaMemcpy(a, b, size, cudaMemcpyDeviceToDevice);
        l.add(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      out[0] = l.median();
      // At least 20 copies, after one that is not timed: a stream of two or
      // three large copies measured the launch more than the copy.
      count = std::max<std::size_t>(count, 20);
      (void)cudaMemcpyAsync(b, a, size, cudaMemcpyDeviceToDevice, st);
      (void)cudaStreamSynchronize(st);
      const auto t0 = std::chrono::steady_clock::now();
      for (std::size_t i = 0; i < count; ++i) (void)cudaMemcpyAsync(b, a, size, cudaMemcpyDeviceToDevice, st);
      (void)cudaStreamSynchronize(st);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      out[1] = static_cast<double>(size) * static_cast<double>(count) / s / 1e9;
    }
    if (::write(p[1], out, sizeof out) != static_cast<ssize_t>(sizeof out)) std::_Exit(3);
    std::_Exit(0);
  }
  ::close(p[1]);
  double got[2] = {NAN, NAN};
  const bool ok = ::read(p[0], got, sizeof got) == static_cast<ssize_t>(sizeof got);
  ::close(p[0]);
  int status = 0;
  ::waitpid(c, &status, 0);
  if (!ok || std::isnan(got[0])) return false;
  lat.add(got[0]);
  bw.add(got[1]);
  return true;
#endif
}

/// Why `sp` cannot run in this build or on this machine (empty: it can).
inline std::string cannot_run(const spec& sp) {
  if (sp.transport != "tcp" && sp.transport != "shm" && sp.transport != "loopback" && sp.transport != "verbs") {
    if (sp.transport == "ipc")
      return "--transport ipc: CUDA IPC is the shm transport's Device path: --transport shm --space device "
             "--peer-space device";
    return "--transport " + sp.transport + ": not a transport (tcp, shm, loopback, verbs)";
  }
  if (sp.transport == "verbs") {
#if !GDR_HAS_VERBS
    return "--transport verbs: this gdr_perf was built without verbs (GDR_HAS_VERBS=0)";
#else
    if (sp.verbs_ip.empty()) return "--transport verbs needs an RDMA device's IP address: --verbs-ip or GDR_VERBS_IP";
#endif
  }
  for (const space_arg* s : {&sp.local, &sp.peer}) {
    if (s->kind != space::device) continue;
#if !GDR_HAS_CUDA
    return "device memory: this gdr_perf was built without CUDA (GDR_HAS_CUDA=0)";
#else
    // Asked in a child: CUDA must not be initialised in this process, whose
    // children (the two sides) use it after fork.
    int p[2];
    if (::pipe(p) != 0) die("pipe");
    pid_t c = ::fork();
    if (c < 0) die("fork");
    if (c == 0) {
      ::close(p[0]);
      std::string why;
      try {
        gdr::buffer<std::byte, gdr::Device> probe(1, s->gpu);
      } catch (const std::exception& e) {
        why = e.what();
      }
      if (!why.empty() && ::write(p[1], why.data(), std::min<std::size_t>(why.size(), 1000)) < 0) std::_Exit(3);
      std::_Exit(why.empty() ? 0 : 1);
    }
    ::close(p[1]);
    char buf[1000];
    ssize_t k = ::read(p[0], buf, sizeof buf);
    ::close(p[0]);
    int st = 0;
    ::waitpid(c, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
      return "device memory on GPU " + std::to_string(s->gpu) + ": " +
             (k > 0 ? std::string(buf, static_cast<std::size_t>(k)) : std::string("the probe failed"));
#endif
  }
  return {};
}

/// Dispatches on the two spaces. Throws what the run threw.
inline measured run(const config& cfg, const spec& sp, std::size_t size, std::size_t n, bool latency) {
  auto with_peer = [&]<class LS>() -> measured {
    switch (sp.peer.kind) {
      case space::host: return run_spaces<LS, gdr::Host>(cfg, sp, size, n, latency);
      case space::pinned: return run_spaces<LS, gdr::Pinned>(cfg, sp, size, n, latency);
      case space::device:
#if GDR_HAS_CUDA
        return run_spaces<LS, gdr::Device>(cfg, sp, size, n, latency);
#else
        break;
#endif
    }
    return {};
  };
  switch (sp.local.kind) {
    case space::host: return with_peer.template operator()<gdr::Host>();
    case space::pinned: return with_peer.template operator()<gdr::Pinned>();
    case space::device:
#if GDR_HAS_CUDA
      return with_peer.template operator()<gdr::Device>();
#else
      break;
#endif
  }
  return {};
}

}  // namespace perf::ops
