// CUDA event completion through gdr's scheduler, against raw CUDA, in one run.
// Shows: (1) the cost of `co_await gdr::cuda::synchronize(s)` / `gdr::copy`
// in busy_poll mode against a raw cudaEventRecord + cudaEventQuery spin (the
// ratio is printed); (2) sleep mode: host function + eventfd (A) against
// bounded polling (B), latency and CPU, with cudaEventBlockingSync as the
// CUDA reference. Needs a GPU; without one it prints why and exits 0.
//
//   cuda_event_bench [--quick] [--csv FILE] [--cpu N]
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/memory/cuda_copy.hpp>
#include <gdr/cuda/device.hpp>
#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/stream.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/memory/copy.hpp>
#include <gdr/sched/scheduler.hpp>

namespace {

using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);  // the whole process: the driver's callback thread counts too
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

double us(clock_type::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

void die_on(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct result_row {
  std::string workload;
  std::string method;
  double median_us = 0, p10_us = 0, p99_us = 0, mean_us = 0;
  double cpu_pct = 0;        // process CPU time / wall time, in % of one core
  double sleeps_per_op = 0;  // scheduler sleeps per operation (sleep modes)
  double queries_per_op = 0; // cudaEventQuery calls per operation (gdr modes)
  int n = 0;
};

result_row summarize(std::string workload, std::string method, std::vector<double>& t, double cpu, double wall) {
  result_row r;
  r.workload = std::move(workload);
  r.method = std::move(method);
  r.n = static_cast<int>(t.size());
  std::sort(t.begin(), t.end());
  auto at = [&](double q) { return t[std::min(t.size() - 1, static_cast<std::size_t>(q * static_cast<double>(t.size())))]; };
  r.median_us = at(0.5);
  r.p10_us = at(0.1);
  r.p99_us = at(0.99);
  double sum = 0;
  for (double x : t) sum += x;
  r.mean_us = sum / static_cast<double>(t.size());
  r.cpu_pct = 100.0 * cpu / wall;
  return r;
}

// What the GPU does before the event: nothing, a tiny H2D copy, or a D2D
// copy of `bytes` (to hold the stream busy for a known time).
struct workload {
  std::string name;
  enum kind_t { empty, tiny_copy, d2d } kind;
  std::size_t bytes;
  int iterations;
};

struct gpu_state {
  gdr::cuda::stream s{0};
  gdr::buffer<char, gdr::Device> a{std::size_t{1} << 30};
  gdr::buffer<char, gdr::Device> b{std::size_t{1} << 30};
  gdr::buffer<std::uint64_t, gdr::Pinned> p8{1};
  gdr::buffer<std::uint64_t, gdr::Device> d8{1};

  void issue_raw(const workload& w) {
    if (w.kind == workload::tiny_copy) {
      die_on(cudaMemcpyAsync(d8.data(), p8.data(), 8, cudaMemcpyHostToDevice, s.get()), "cudaMemcpyAsync");
    } else if (w.kind == workload::d2d) {
      die_on(cudaMemcpyAsync(b.data(), a.data(), w.bytes, cudaMemcpyDeviceToDevice, s.get()), "cudaMemcpyAsync");
    }
  }
};

// ---- raw baselines --------------------------------------------------------

result_row run_raw_spin(gpu_state& g, const workload& w) {
  cudaEvent_t ev;
  die_on(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  std::vector<double> t;
  t.reserve(w.iterations);
  const double c0 = cpu_seconds();
  const auto w0 = clock_type::now();
  for (int i = 0; i < w.iterations; ++i) {
    const auto t0 = clock_type::now();
    g.issue_raw(w);
    die_on(cudaEventRecord(ev, g.s.get()), "cudaEventRecord");
    while (cudaEventQuery(ev) == cudaErrorNotReady) {
    }
    t.push_back(us(clock_type::now() - t0));
  }
  const double wall = std::chrono::duration<double>(clock_type::now() - w0).count();
  const double cpu = cpu_seconds() - c0;
  cudaEventDestroy(ev);
  return summarize(w.name, "raw record+query spin", t, cpu, wall);
}

result_row run_raw_blocking(gpu_state& g, const workload& w) {
  cudaEvent_t ev;
  die_on(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreate");
  std::vector<double> t;
  t.reserve(w.iterations);
  const double c0 = cpu_seconds();
  const auto w0 = clock_type::now();
  for (int i = 0; i < w.iterations; ++i) {
    const auto t0 = clock_type::now();
    g.issue_raw(w);
    die_on(cudaEventRecord(ev, g.s.get()), "cudaEventRecord");
    die_on(cudaEventSynchronize(ev), "cudaEventSynchronize");
    t.push_back(us(clock_type::now() - t0));
  }
  const double wall = std::chrono::duration<double>(clock_type::now() - w0).count();
  const double cpu = cpu_seconds() - c0;
  cudaEventDestroy(ev);
  return summarize(w.name, "raw cudaEventBlockingSync", t, cpu, wall);
}

// ---- through gdr ------------------------------------------------------------

gdr::task<> gdr_loop(gpu_state& g, const workload& w, std::vector<double>& t) {
  for (int i = 0; i < w.iterations; ++i) {
    const auto t0 = clock_type::now();
    if (w.kind == workload::tiny_copy) {
      co_await gdr::copy(g.d8, g.p8, g.s);  // cudaMemcpyAsync + event, through the poller
    } else {
      if (w.kind == workload::d2d) {
        gdr::view<char, gdr::Device> src = g.a.view().first(w.bytes);
        gdr::view<char, gdr::Device> dst = g.b.view().first(w.bytes);
        if (std::error_code ec = gdr::cuda::memcpy_async(dst, src, g.s)) throw gdr::error(ec, "memcpy_async");
      }
      co_await gdr::cuda::synchronize(g.s);
    }
    t.push_back(us(clock_type::now() - t0));
  }
}

result_row run_gdr(gpu_state& g, const workload& w, gdr::run_mode mode, gdr::cuda::wake_strategy wake,
                   std::chrono::nanoseconds interval, const char* method) {
  gdr::scheduler sched({.mode = mode});
  gdr::cuda::event_poller events(sched, {.wake = wake, .poll_interval = interval});
  std::vector<double> t;
  t.reserve(w.iterations);
  const double c0 = cpu_seconds();
  const auto w0 = clock_type::now();
  gdr::sync_wait(sched, gdr_loop(g, w, t));
  const double wall = std::chrono::duration<double>(clock_type::now() - w0).count();
  const double cpu = cpu_seconds() - c0;
  result_row r = summarize(w.name, method, t, cpu, wall);
  r.sleeps_per_op = static_cast<double>(sched.stats().sleeps) / w.iterations;
  r.queries_per_op = static_cast<double>(events.stats().queries) / w.iterations;
  return r;
}

void print_row(const result_row& r, std::FILE* csv) {
  std::printf("%-14s %-30s %9.2f %9.2f %9.2f %9.2f %7.1f%% %8.2f %8.2f\n", r.workload.c_str(), r.method.c_str(),
              r.median_us, r.p10_us, r.p99_us, r.mean_us, r.cpu_pct, r.sleeps_per_op, r.queries_per_op);
  if (csv != nullptr)
    std::fprintf(csv, "%s,%s,%d,%.3f,%.3f,%.3f,%.3f,%.2f,%.3f,%.3f\n", r.workload.c_str(), r.method.c_str(), r.n,
                 r.median_us, r.p10_us, r.p99_us, r.mean_us, r.cpu_pct, r.sleeps_per_op, r.queries_per_op);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  const char* csv_path = nullptr;
  int cpu = 2;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    else if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc) csv_path = argv[++i];
    else if (std::strcmp(argv[i], "--cpu") == 0 && i + 1 < argc) cpu = std::atoi(argv[++i]);
  }
  const auto& probe = gdr::cuda::probe_devices();
  if (!probe.usable()) {
    std::printf("[gdr-skip] cuda_event_bench: %s\n", probe.reason.c_str());
    return 0;
  }
  // Timings swing with the CPU the loop lands on: pin it (DESIGN-NOTES).
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) std::printf("note: could not pin to CPU %d\n", cpu);
  }
  auto info = gdr::cuda::query_device(0);
  std::printf("device 0: %s (sm_%d%d), CUDA runtime %d, driver %d, timer slack %d ns\n", info->name.c_str(),
              info->cc_major, info->cc_minor, probe.runtime_version, probe.driver_version, prctl(PR_GET_TIMERSLACK));

  gpu_state g;
  die_on(cudaMemset(g.a.data(), 1, g.a.size_bytes()), "cudaMemset");
  die_on(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const int k = quick ? 4 : 1;
  const std::vector<workload> loads = {
      {"empty", workload::empty, 0, 20000 / k},
      {"copy 8 B H2D", workload::tiny_copy, 8, 20000 / k},
      {"D2D 16 MiB", workload::d2d, std::size_t{16} << 20, 2000 / k},
      {"D2D 256 MiB", workload::d2d, std::size_t{256} << 20, 400 / k},
      {"D2D 1 GiB", workload::d2d, std::size_t{1} << 30, 100 / k},
  };
  std::FILE* csv = csv_path != nullptr ? std::fopen(csv_path, "w") : nullptr;
  if (csv != nullptr) std::fprintf(csv, "workload,method,n,median_us,p10_us,p99_us,mean_us,cpu_pct,sleeps_per_op,queries_per_op\n");

  std::printf("\n%-14s %-30s %9s %9s %9s %9s %8s %8s %8s\n", "workload", "method", "median", "p10", "p99", "mean",
              "cpu", "sleeps/op", "queries/op");
  std::printf("%-14s %-30s %9s %9s %9s %9s %8s %8s %8s\n", "", "", "us", "us", "us", "us", "%core", "", "");
  struct ratio {
    std::string workload;
    double raw, busy, host_func, bounded20, bounded50, blocking;
  };
  std::vector<ratio> ratios;
  // Warm up: first events, first copies, first pool entries.
  for (int i = 0; i < 2; ++i) (void)run_gdr(g, loads[1], gdr::run_mode::busy_poll, gdr::cuda::wake_strategy::bounded_poll, 20us, "warm-up");
  for (const workload& w : loads) {
    result_row raw = run_raw_spin(g, w);
    result_row busy = run_gdr(g, w, gdr::run_mode::busy_poll, gdr::cuda::wake_strategy::bounded_poll, 20us,
                              "gdr busy_poll");
    result_row blocking = run_raw_blocking(g, w);
    result_row hf = run_gdr(g, w, gdr::run_mode::sleep, gdr::cuda::wake_strategy::host_func, 20us,
                            "gdr sleep (A) host_func+eventfd");
    result_row b20 = run_gdr(g, w, gdr::run_mode::sleep, gdr::cuda::wake_strategy::bounded_poll, 20us,
                             "gdr sleep (B) bounded 20us");
    result_row b50 = run_gdr(g, w, gdr::run_mode::sleep, gdr::cuda::wake_strategy::bounded_poll, 50us,
                             "gdr sleep (B) bounded 50us");
    for (const result_row* r : {&raw, &busy, &blocking, &hf, &b20, &b50}) print_row(*r, csv);
    ratios.push_back({w.name, raw.median_us, busy.median_us, hf.median_us, b20.median_us, b50.median_us,
                      blocking.median_us});
  }
  if (csv != nullptr) std::fclose(csv);

  std::printf("\nratios of medians (gdr / raw spin), added latency = gdr median - raw spin median:\n");
  for (const ratio& r : ratios) {
    std::printf("RATIO %-14s busy_poll %.2fx (+%.2f us) | sleep A host_func %.2fx (+%.2f us) | sleep B 20us "
                "%.2fx (+%.2f us) | sleep B 50us %.2fx (+%.2f us) | raw blocking-sync %.2fx\n",
                r.workload.c_str(), r.busy / r.raw, r.busy - r.raw, r.host_func / r.raw, r.host_func - r.raw,
                r.bounded20 / r.raw, r.bounded20 - r.raw, r.bounded50 / r.raw, r.bounded50 - r.raw,
                r.blocking / r.raw);
  }
  return 0;
}
