// cuda_ipc_bench: what gdr's CUDA IPC mapping cache costs (gdr/cuda/ipc.hpp),
// beside the raw driver calls, in the same run.
//
//   cuda_ipc_bench [--allocs N] [--size BYTES] [--hits N] [--vmm] [--copies N]
//
// --vmm: the owner allocates as gdr::buffer<Device> does from 1 MiB (the
// virtual memory API, gdr/cuda/vmm.hpp) and passes each allocation's file
// descriptor over a Unix socket, as the shared-memory transport does; the
// raw half then maps them with the driver's calls alone (import, reserve,
// map, grant access).
//
// A child process (forked before CUDA is initialised here) allocates N
// device buffers and exports them; the parent
//   * imports each through gdr's cache (the first import: one
//     cudaIpcOpenMemHandle, timed by the cache), and then opens a second
//     set of the child's allocations with raw cudaIpcOpenMemHandle, timed
//     the same way, for the ratio;
//   * looks up an open allocation again and again (a cache hit: what every
//     copy after the first pays), timing acquire + release per hit.
//   * with --copies N: times N copies of BYTES through the first mapping
//     (out of it into a cudaMalloc buffer and into a buffer of the virtual
//     memory API, and into it from a cudaMalloc buffer) beside N local
//     cudaMalloc-to-cudaMalloc copies, in GB/s: what the mapping itself
//     costs a copy, apart from any transport; and what an allocation and
//     its free cost each way.
// Goals (the CUDA IPC issue): first import <= 0.3 ms, hit < 1 us.
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/ipc.hpp>

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

/// Sends `m` and, when it has one, its descriptor.
bool send_memory(int sock, const gdr::copy_engine::ipc_memory& m) {
  iovec iov{const_cast<gdr::copy_engine::ipc_memory*>(&m), sizeof m};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))]{};
  msghdr h{};
  h.msg_iov = &iov;
  h.msg_iovlen = 1;
  if (m.fd >= 0) {
    h.msg_control = ctl;
    h.msg_controllen = sizeof ctl;
    cmsghdr* c = CMSG_FIRSTHDR(&h);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &m.fd, sizeof m.fd);
  }
  return ::sendmsg(sock, &h, 0) == static_cast<ssize_t>(sizeof m);
}

/// Receives one `send_memory` (the descriptor, if any, in `m.fd`).
bool recv_memory(int sock, gdr::copy_engine::ipc_memory& m) {
  iovec iov{&m, sizeof m};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))]{};
  msghdr h{};
  h.msg_iov = &iov;
  h.msg_iovlen = 1;
  h.msg_control = ctl;
  h.msg_controllen = sizeof ctl;
  if (::recvmsg(sock, &h, MSG_WAITALL) != static_cast<ssize_t>(sizeof m)) return false;
  m.fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&h); c != nullptr; c = CMSG_NXTHDR(&h, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(&m.fd, CMSG_DATA(c), sizeof m.fd);
  return true;
}

/// GB/s of `n` back-to-back copies of `size` bytes from `src` to `dst` on
/// one stream (after one untimed copy).
double copy_rate(void* dst, const void* src, std::size_t size, int n, cudaStream_t s) {
  if (cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, s) != cudaSuccess || cudaStreamSynchronize(s) != cudaSuccess)
    return -1;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i)
    if (cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, s) != cudaSuccess) return -1;
  if (cudaStreamSynchronize(s) != cudaSuccess) return -1;
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(size) * n / (us * 1e3);
}

/// Median microseconds to allocate and free `size` bytes with cudaMalloc
/// and with the virtual memory API (gdr::buffer<Device>'s two ways).
void alloc_times(std::size_t size, int n) {
  std::vector<double> m, v;
  for (int i = 0; i < n; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    void* p = nullptr;
    if (cudaMalloc(&p, size) != cudaSuccess) return;
    (void)cudaFree(p);
    auto t1 = std::chrono::steady_clock::now();
    auto b = gdr::cuda::vmm_registry::instance().allocate(size, 0);
    if (!b) return;
    gdr::cuda::vmm_registry::instance().free(reinterpret_cast<void*>(b->base));
    auto t2 = std::chrono::steady_clock::now();
    m.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    v.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  std::printf("allocate + free %zu bytes, median of %d: cudaMalloc %.1f us, virtual memory API %.1f us\n", size, n,
              median(m), median(v));
}

/// What the calls around one CUDA IPC copy cost the CPU (median us): the
/// copy's launch out of the mapping, an event recorded behind it, a query
/// of that event, and a query of the legacy stream (the sender's fence).
void call_costs(void* dst, const void* mapped, std::size_t size, int n, cudaStream_t s) {
  std::vector<double> launch, record, query, legacy;
  cudaEvent_t ev = nullptr;
  if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) return;
  auto us = [](auto t0, auto t1) { return std::chrono::duration<double, std::micro>(t1 - t0).count(); };
  for (int i = 0; i < n; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    (void)cudaMemcpyAsync(dst, mapped, size, cudaMemcpyDefault, s);
    auto t1 = std::chrono::steady_clock::now();
    (void)cudaEventRecord(ev, s);
    auto t2 = std::chrono::steady_clock::now();
    (void)cudaEventQuery(ev);
    auto t3 = std::chrono::steady_clock::now();
    (void)cudaStreamQuery(cudaStreamLegacy);
    auto t4 = std::chrono::steady_clock::now();
    launch.push_back(us(t0, t1));
    record.push_back(us(t1, t2));
    query.push_back(us(t2, t3));
    legacy.push_back(us(t3, t4));
  }
  (void)cudaGetLastError();
  (void)cudaStreamSynchronize(s);
  (void)cudaEventDestroy(ev);
  std::printf("CPU per call, median us: cudaMemcpyAsync out of the mapping %.2f, cudaEventRecord %.2f, "
              "cudaEventQuery %.2f, cudaStreamQuery(legacy) %.2f\n",
              median(launch), median(record), median(query), median(legacy));
}

/// The launch of one copy out of the mapping by size and call (median CPU
/// us of `n`, synchronized every 16 so the queue stays short): the
/// runtime with cudaMemcpyDefault, with cudaMemcpyDeviceToDevice, and the
/// driver's cuMemcpyDtoDAsync.
void launch_costs(void* dst, const void* mapped, std::size_t size, int n, cudaStream_t s) {
  using dtod_fn = CUresult (*)(CUdeviceptr, CUdeviceptr, std::size_t, CUstream);
  dtod_fn dtod = nullptr;
  void* p = nullptr;
  cudaDriverEntryPointQueryResult st{};
  if (cudaGetDriverEntryPointByVersion("cuMemcpyDtoDAsync", &p, 12000, cudaEnableDefault, &st) == cudaSuccess &&
      st == cudaDriverEntryPointSuccess)
    dtod = reinterpret_cast<dtod_fn>(p);
  std::printf("launch of one copy out of the mapping, median CPU us (Default / DeviceToDevice / cuMemcpyDtoDAsync):\n");
  for (std::size_t sz : {std::size_t{8}, std::size_t{64} << 10, std::size_t{1} << 20, size}) {
    if (sz > size) continue;
    std::vector<double> t[3];
    for (int way = 0; way < 3; ++way) {
      for (int i = 0; i < n; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        if (way == 0) (void)cudaMemcpyAsync(dst, mapped, sz, cudaMemcpyDefault, s);
        else if (way == 1) (void)cudaMemcpyAsync(dst, mapped, sz, cudaMemcpyDeviceToDevice, s);
        else if (dtod != nullptr)
          (void)dtod(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(mapped), sz,
                     reinterpret_cast<CUstream>(s));
        t[way].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        if (i % 16 == 15) (void)cudaStreamSynchronize(s);
      }
      (void)cudaStreamSynchronize(s);
    }
    std::printf("  %9zu bytes: %.2f / %.2f / %.2f\n", sz, median(t[0]), median(t[1]), median(t[2]));
  }
}

/// --copies: the copy rates through the mapping of `m`, beside a local copy.
bool copy_rates(gdr::cuda::ipc_share& cache, const gdr::copy_engine::ipc_memory& m, std::size_t size, int n) {
  auto e = cache.acquire(m, 0);
  if (!e) return false;
  std::byte* mapped = (*e)->mapped;
  void *a = nullptr, *b = nullptr;
  cudaStream_t s = nullptr;
  if (cudaMalloc(&a, size) != cudaSuccess || cudaMalloc(&b, size) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    return false;
  auto v = gdr::cuda::vmm_registry::instance().allocate(std::max<std::size_t>(size, 1), 0);
  void* vb = v ? reinterpret_cast<void*>(v->base) : nullptr;
  const double local = copy_rate(b, a, size, n, s);
  const double out_to_malloc = copy_rate(a, mapped, size, n, s);
  const double out_to_vmm = vb != nullptr ? copy_rate(vb, mapped, size, n, s) : -1;
  const double into = copy_rate(mapped, a, size, n, s);
  const double vmm_local = vb != nullptr ? copy_rate(b, vb, size, n, s) : -1;
  std::printf("copies of %zu bytes, %d back to back, GB/s (ratio to the local copy):\n", size, n);
  std::printf("  local cudaMalloc -> cudaMalloc:           %8.1f\n", local);
  std::printf("  the peer's mapping -> local cudaMalloc:   %8.1f  (%.2fx)\n", out_to_malloc, out_to_malloc / local);
  std::printf("  the peer's mapping -> local VMM:          %8.1f  (%.2fx)\n", out_to_vmm, out_to_vmm / local);
  std::printf("  local cudaMalloc -> the peer's mapping:   %8.1f  (%.2fx)\n", into, into / local);
  std::printf("  local VMM -> local cudaMalloc:            %8.1f  (%.2fx)\n", vmm_local, vmm_local / local);
  call_costs(a, mapped, size, n, s);
  launch_costs(a, mapped, size, n, s);
  if (vb != nullptr) gdr::cuda::vmm_registry::instance().free(vb);
  (void)cudaFree(a);
  (void)cudaFree(b);
  (void)cudaStreamDestroy(s);
  cache.release(*e);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int allocs = 16;
  std::size_t size = std::size_t{4} << 20;
  long hits = 200000;
  bool vmm = false;
  int copies = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--vmm") vmm = true;
    else if (i + 1 >= argc) break;
    else if (a == "--allocs") allocs = std::atoi(argv[++i]);
    else if (a == "--size") size = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--hits") hits = std::atol(argv[++i]);
    else if (a == "--copies") copies = std::atoi(argv[++i]);
  }
  using memory = gdr::copy_engine::ipc_memory;
  int to_parent[2], to_child[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, to_parent) != 0 || ::pipe(to_child) != 0) return 1;
  pid_t c = ::fork();
  if (c == 0) {
    // The owner: 2N allocations exported (the first N for gdr's cache, the
    // rest for the raw calls), kept until the parent is done.
    gdr::cuda::ipc_share share;
    std::vector<void*> bufs;
    for (int i = 0; i < 2 * allocs; ++i) {
      void* p = nullptr;
      if (vmm) {
        auto b = gdr::cuda::vmm_registry::instance().allocate(size, 0);
        if (!b) std::_Exit(2);
        p = reinterpret_cast<void*>(b->base);
      } else if (cudaMalloc(&p, size) != cudaSuccess) {
        std::_Exit(2);
      }
      bufs.push_back(p);
      memory m;
      std::uint64_t off = 0;
      const char* why = nullptr;
      if (share.export_memory(p, size, m, off, &why)) {
        std::fprintf(stderr, "export failed: %s\n", why != nullptr ? why : "?");
        std::_Exit(3);
      }
      if (!send_memory(to_parent[1], m)) std::_Exit(4);
    }
    char done = 0;
    if (::read(to_child[0], &done, 1) < 0) std::_Exit(5);
    for (void* p : bufs) {
      if (vmm) gdr::cuda::vmm_registry::instance().free(p);
      else (void)cudaFree(p);
    }
    std::_Exit(0);
  }
  std::vector<memory> ms(static_cast<std::size_t>(2 * allocs));
  for (auto& m : ms)
    if (!recv_memory(to_parent[0], m)) {
      std::fprintf(stderr, "the owner process failed (no GPU?)\n");
      return 1;
    }
  (void)cudaSetDevice(0);
  (void)cudaFree(nullptr);  // the context exists before anything is timed
  gdr::cuda::ipc_share cache;
  std::vector<double> gdr_first, raw_first;
  std::vector<gdr::cuda::ipc_share::entry*> held;
  for (int i = 0; i < allocs; ++i) {
    auto e = cache.acquire(ms[static_cast<std::size_t>(i)], 0);
    if (!e) {
      std::fprintf(stderr, "import failed: %s\n", e.error().message().c_str());
      return 1;
    }
    gdr_first.push_back(static_cast<double>(cache.stats().last_import_ns) / 1e3);
    cache.release(*e);
  }
  for (int i = allocs; i < 2 * allocs && vmm; ++i) {
    const memory& m = ms[static_cast<std::size_t>(i)];
    const auto t0 = std::chrono::steady_clock::now();
    auto p = gdr::cuda::vmm_map(m.fd, m.size, 0);
    raw_first.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    if (!p) return 1;
    gdr::cuda::vmm_unmap(*p, m.size);
    ::close(m.fd);
  }
  for (int i = allocs; i < 2 * allocs && !vmm; ++i) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, ms[static_cast<std::size_t>(i)].handle, sizeof h);
    void* p = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    raw_first.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    if (e != cudaSuccess) return 1;
    (void)cudaIpcCloseMemHandle(p);
  }
  // Hits: the same allocation again and again.
  const memory& m0 = ms[0];
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < hits; ++i) {
    auto e = cache.acquire(m0, 0);
    cache.release(*e);
  }
  const double hit_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
                        static_cast<double>(hits);
  const double g = median(gdr_first), r = median(raw_first);
  std::printf("cuda_ipc_bench: %d allocations of %zu bytes, %s\n", allocs, size,
              vmm ? "the virtual memory API (a file descriptor each)" : "cudaMalloc (legacy IPC handles)");
  std::printf("first import, gdr's cache:       median %8.1f us (max %.1f)   goal <= 300 us: %s\n", g,
              *std::max_element(gdr_first.begin(), gdr_first.end()), g <= 300 ? "met" : "not met");
  std::printf("first import, raw %s: median %8.1f us   ratio gdr/raw %.2fx\n",
              vmm ? "driver calls (import, reserve, map, access)" : "cudaIpcOpenMemHandle", r, g / r);
  std::printf("cache hit (acquire + release):   %8.1f ns   goal < 1000 ns: %s\n", hit_ns,
              hit_ns < 1000 ? "met" : "not met");
  if (copies > 0 && !copy_rates(cache, m0, size, copies)) return 1;
  if (copies > 0) alloc_times(size, 20);
  char done = 1;
  if (::write(to_child[1], &done, 1) < 0) return 1;
  int st = 0;
  ::waitpid(c, &st, 0);
  return 0;
}
