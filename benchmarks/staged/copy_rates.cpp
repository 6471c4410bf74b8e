// copy_rates: the rates of the staged path's pieces in one process, without
// a socket, to see whether the wire is the bottleneck. For each chunk size
// and depth it moves `total` bytes (default 1 GiB) as a stream of chunk
// copies with up to `depth` in flight (the sustained rate a pipeline gets):
//
//   d2h          cudaMemcpyAsync device -> a ring of `depth` pinned buffers
//   h2d          a ring of pinned buffers -> device
//   memcpy_ring  host memcpy ring -> ring, both pinned (what an in-process
//                transport does between bounce buffers; the rings are small
//                enough to stay in cache, so also:)
//   memcpy_big   host memcpy between two `total`-byte pinned buffers, chunk by
//                chunk (cache-cold reference)
//   chain        the whole staged transfer by hand, pipelined: D2H of a chunk
//                into ring A (its own stream), memcpy A -> ring B (this
//                thread), H2D from ring B (its own stream)
//   bidir_d2h,   D2H and H2D at the same time on two streams (each moving
//   bidir_h2d    `total` bytes): the rate of each while the other runs
//
// A ring slot is reused only after the copy that used it is done (its
// event, polled with cudaEventQuery). Rates are 1e9 bytes per second, the
// median of --reps repetitions after one untimed run.
//
// Output: CSV on stdout (and appended to --csv FILE), after a header line:
//   what,chunk,depth,total_bytes,gbps
// (depth 0 for memcpy_big: it has no ring), readable lines on stderr. Needs
// a GPU; without one it prints "[gdr-skip] copy_rates: ..." and exits 0; any
// error: a message on stderr and a non-zero exit status.
//
// Build without Bazel (what benchmarks/staged/build_and_run.sh does):
//   g++ -O2 -std=c++20 -isystem $CUDA_HOME/include benchmarks/staged/copy_rates.cpp
//       -o copy_rates $CUDA_HOME/lib64/libcudart_static.a -ldl -lrt -lpthread
// With Bazel: ./bazelw build -c opt //benchmarks/staged:copy_rates
//
// Run:
//   copy_rates                                   chunks 256K,1M,4M,16M; depths 2,4,8
//   copy_rates --chunks 1M --depths 4 --total 4G --reps 9 --csv rates.csv
//   copy_rates --help
#include <sched.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/staged/units.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

[[noreturn]] void fail(const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "copy_rates: ERROR: %s\n", msg);
  std::fflush(stdout);
  std::_Exit(1);
}

void check_cuda(cudaError_t e, const char* call, int line) {
  if (e != cudaSuccess) fail("line %d: %s: %s (%s)", line, call, cudaGetErrorString(e), cudaGetErrorName(e));
}
#define CK(call) check_cuda((call), #call, __LINE__)

using staged_bench::GiB, staged_bench::KiB, staged_bench::MiB, staged_bench::human;
constexpr std::size_t slot_align = 4096;

struct options {
  std::vector<std::uint64_t> chunks{256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB};
  std::vector<std::uint32_t> depths{2, 4, 8};
  std::uint64_t total = 1 * GiB;
  int reps = 5;
  int device = 0;
  int cpu = -1;
  std::string csv;
};

void usage(FILE* f) {
  std::fprintf(f,
               "usage: copy_rates [options]\n"
               "  --chunks C,..    chunk sizes (K/M/G = KiB/MiB/GiB; default 256K,1M,4M,16M)\n"
               "  --depths D,..    copies in flight / ring slots (default 2,4,8)\n"
               "  --total B        bytes per measurement (default 1G)\n"
               "  --reps N         timed repetitions, median reported (default 5)\n"
               "  --device N       GPU (default 0)\n"
               "  --cpu N          pin this process to CPU N\n"
               "  --csv FILE       also append the CSV lines to FILE\n");
}

[[noreturn]] void bad_arg(const char* what, const std::string& v) {
  std::fprintf(stderr, "copy_rates: %s '%s' (copy_rates --help lists the options)\n", what, v.c_str());
  std::exit(2);
}

bool parse_u64(const std::string& s, std::uint64_t& out) {
  std::size_t j = 0;
  std::uint64_t v = 0;
  while (j < s.size() && s[j] >= '0' && s[j] <= '9') {
    if (v > (UINT64_MAX - 9) / 10) return false;
    v = v * 10 + static_cast<std::uint64_t>(s[j] - '0');
    ++j;
  }
  if (j == 0) return false;
  std::uint64_t unit = 1;
  if (j < s.size() && (s[j] == 'K' || s[j] == 'k')) unit = KiB, ++j;
  else if (j < s.size() && (s[j] == 'M' || s[j] == 'm')) unit = MiB, ++j;
  else if (j < s.size() && (s[j] == 'G' || s[j] == 'g')) unit = GiB, ++j;
  if (j != s.size() || v > UINT64_MAX / unit) return false;
  out = v * unit;
  return true;
}

std::vector<std::uint64_t> parse_list(const std::string& v, const char* what) {
  std::vector<std::uint64_t> out;
  std::size_t b = 0;
  for (;;) {
    std::size_t e = v.find(',', b);
    std::string s = v.substr(b, e == std::string::npos ? std::string::npos : e - b);
    std::uint64_t x = 0;
    if (!parse_u64(s, x)) bad_arg(what, s);
    out.push_back(x);
    if (e == std::string::npos) return out;
    b = e + 1;
  }
}

options parse_args(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) bad_arg("missing the value of", a);
      return argv[++i];
    };
    auto number = [&](const char* what, std::uint64_t max) {
      std::string v = value();
      std::uint64_t x = 0;
      if (!parse_u64(v, x) || x > max) bad_arg(what, v);
      return x;
    };
    if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (a == "--chunks" || a == "--chunk") {
      o.chunks = parse_list(value(), "bad chunk");
    } else if (a == "--depths" || a == "--depth") {
      o.depths.clear();
      for (auto d : parse_list(value(), "bad depth")) {
        if (d == 0 || d > 64) bad_arg("depth out of 1..64:", std::to_string(d));
        o.depths.push_back(static_cast<std::uint32_t>(d));
      }
    } else if (a == "--total") {
      o.total = number("bad --total", 64 * GiB);
    } else if (a == "--reps") {
      o.reps = static_cast<int>(number("bad --reps", 1000));
    } else if (a == "--device") {
      o.device = static_cast<int>(number("bad --device", 1024));
    } else if (a == "--cpu") {
      o.cpu = static_cast<int>(number("bad --cpu", 4096));
    } else if (a == "--csv") {
      o.csv = value();
    } else {
      bad_arg("unknown argument", a);
    }
  }
  for (auto c : o.chunks)
    if (c == 0 || c > 1 * GiB) bad_arg("chunk out of 1 B..1 GiB:", std::to_string(c));
  if (o.chunks.empty() || o.depths.empty()) bad_arg("empty list", "--chunks/--depths");
  if (o.total == 0) bad_arg("--total must be above 0:", "0");
  if (o.reps < 1) bad_arg("--reps must be at least 1:", std::to_string(o.reps));
  return o;
}

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

// Waits for an event by polling it (what gdr's event poller does).
void wait_event(cudaEvent_t e) {
  for (;;) {
    cudaError_t r = cudaEventQuery(e);
    if (r == cudaSuccess) return;
    if (r != cudaErrorNotReady) check_cuda(r, "cudaEventQuery", __LINE__);
  }
}

// Everything one measurement touches, allocated once.
struct resources {
  cudaStream_t d2h = nullptr, h2d = nullptr;
  std::vector<cudaEvent_t> ev_d2h, ev_h2d;  // one per ring slot
  std::uint8_t* dev_src = nullptr;
  std::uint8_t* dev_dst = nullptr;
  std::uint8_t* pin_a = nullptr;  // `total` bytes; ring A is its front
  std::uint8_t* pin_b = nullptr;  // `total` bytes; ring B is its front
  std::size_t total = 0;
};

// A stream of chunk copies between device memory (at the chunk's offset) and
// a ring of `depth` pinned slots, at most `depth` in flight. step() does one
// thing (queue a copy, or retire the oldest) and never blocks, so two
// streamers can run at once from one thread.
struct streamer {
  cudaStream_t stream;
  cudaEvent_t* ev;
  cudaMemcpyKind kind;
  std::uint8_t* dev;
  std::uint8_t* ring;
  std::size_t stride, chunk, total, n;
  std::uint32_t depth;
  std::size_t issued = 0, retired = 0;
  clock_type::time_point done_at{};

  streamer(cudaStream_t s, cudaEvent_t* e, cudaMemcpyKind k, std::uint8_t* d, std::uint8_t* r, std::size_t c,
           std::size_t t, std::uint32_t dep)
      : stream(s), ev(e), kind(k), dev(d), ring(r), stride((c + slot_align - 1) / slot_align * slot_align), chunk(c),
        total(t), n((t + c - 1) / c), depth(dep) {}

  // Returns true once every copy is done.
  bool step() {
    if (retired == n) return true;
    if (issued < n && issued - retired < depth) {
      const std::size_t off = issued * chunk, len = std::min(chunk, total - off);
      std::uint8_t* slot = ring + (issued % depth) * stride;
      if (kind == cudaMemcpyDeviceToHost) CK(cudaMemcpyAsync(slot, dev + off, len, kind, stream));
      else CK(cudaMemcpyAsync(dev + off, slot, len, kind, stream));
      CK(cudaEventRecord(ev[issued % depth], stream));
      ++issued;
      return false;
    }
    cudaError_t r = cudaEventQuery(ev[retired % depth]);
    if (r == cudaErrorNotReady) return false;
    check_cuda(r, "cudaEventQuery", __LINE__);
    if (++retired == n) {
      done_at = clock_type::now();
      return true;
    }
    return false;
  }
};

double one_direction(resources& r, cudaMemcpyKind kind, std::size_t chunk, std::uint32_t depth) {
  const bool d2h = kind == cudaMemcpyDeviceToHost;
  streamer s(d2h ? r.d2h : r.h2d, d2h ? r.ev_d2h.data() : r.ev_h2d.data(), kind, d2h ? r.dev_src : r.dev_dst,
             d2h ? r.pin_a : r.pin_b, chunk, r.total, depth);
  const auto t0 = clock_type::now();
  while (!s.step()) {
  }
  return static_cast<double>(r.total) / std::chrono::duration<double>(s.done_at - t0).count() / 1e9;
}

double memcpy_ring(resources& r, std::size_t chunk, std::uint32_t depth) {
  const std::size_t stride = (chunk + slot_align - 1) / slot_align * slot_align;
  const auto t0 = clock_type::now();
  std::size_t i = 0;
  for (std::size_t off = 0; off < r.total; off += chunk, ++i) {
    const std::size_t s = (i % depth) * stride;
    std::memcpy(r.pin_b + s, r.pin_a + s, std::min(chunk, r.total - off));
  }
  return static_cast<double>(r.total) / seconds_since(t0) / 1e9;
}

double memcpy_big(resources& r, std::size_t chunk) {
  const auto t0 = clock_type::now();
  for (std::size_t off = 0; off < r.total; off += chunk) std::memcpy(r.pin_b + off, r.pin_a + off, std::min(chunk, r.total - off));
  return static_cast<double>(r.total) / seconds_since(t0) / 1e9;
}

// D2H into ring A (stream d2h), memcpy A -> B on this thread, H2D from ring B
// (stream h2d). Slot s of A is free once its chunk has been memcpy'd; slot s
// of B once its H2D copy (chunk i - depth) is done.
double chain(resources& r, std::size_t chunk, std::uint32_t depth) {
  const std::size_t stride = (chunk + slot_align - 1) / slot_align * slot_align;
  const std::size_t n = (r.total + chunk - 1) / chunk;
  auto len_of = [&](std::size_t i) { return std::min(chunk, r.total - i * chunk); };
  auto issue_d2h = [&](std::size_t i) {
    const std::size_t s = i % depth;
    CK(cudaMemcpyAsync(r.pin_a + s * stride, r.dev_src + i * chunk, len_of(i), cudaMemcpyDeviceToHost, r.d2h));
    CK(cudaEventRecord(r.ev_d2h[s], r.d2h));
  };
  const auto t0 = clock_type::now();
  for (std::size_t i = 0; i < n && i < depth; ++i) issue_d2h(i);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t s = i % depth;
    wait_event(r.ev_d2h[s]);
    if (i >= depth) wait_event(r.ev_h2d[s]);
    std::memcpy(r.pin_b + s * stride, r.pin_a + s * stride, len_of(i));
    CK(cudaMemcpyAsync(r.dev_dst + i * chunk, r.pin_b + s * stride, len_of(i), cudaMemcpyHostToDevice, r.h2d));
    CK(cudaEventRecord(r.ev_h2d[s], r.h2d));
    if (i + depth < n) issue_d2h(i + depth);  // slot s of A was just read
  }
  wait_event(r.ev_h2d[(n - 1) % depth]);
  return static_cast<double>(r.total) / seconds_since(t0) / 1e9;
}

// D2H (src -> ring A) and H2D (ring B -> dst) at once; the rate of each from
// the common start to its own last copy.
std::pair<double, double> bidir(resources& r, std::size_t chunk, std::uint32_t depth) {
  streamer down(r.d2h, r.ev_d2h.data(), cudaMemcpyDeviceToHost, r.dev_src, r.pin_a, chunk, r.total, depth);
  streamer up(r.h2d, r.ev_h2d.data(), cudaMemcpyHostToDevice, r.dev_dst, r.pin_b, chunk, r.total, depth);
  const auto t0 = clock_type::now();
  bool a = false, b = false;
  while (!(a && b)) {
    if (!a) a = down.step();
    if (!b) b = up.step();
  }
  auto rate = [&](const streamer& s) { return static_cast<double>(r.total) / std::chrono::duration<double>(s.done_at - t0).count() / 1e9; };
  return {rate(down), rate(up)};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];  // the upper middle for an even count
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse_args(argc, argv);
  const auto t_start = clock_type::now();

  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0) {
    std::printf("[gdr-skip] copy_rates: no CUDA device: %s\n",
                e != cudaSuccess ? (std::string(cudaGetErrorString(e)) + " (" + cudaGetErrorName(e) + ")").c_str()
                                 : "cudaGetDeviceCount found 0 devices");
    return 0;
  }
  if (opt.device >= ndev) fail("--device %d: only %d CUDA device(s)", opt.device, ndev);
  if (opt.cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(opt.cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) fail("sched_setaffinity(%d): %s", opt.cpu, std::strerror(errno));
  }
  CK(cudaSetDevice(opt.device));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, opt.device));
  char bus[32] = "?";
  CK(cudaDeviceGetPCIBusId(bus, sizeof bus, opt.device));

  std::uint32_t max_depth = *std::max_element(opt.depths.begin(), opt.depths.end());
  std::uint64_t max_ring = 0;
  for (auto c : opt.chunks) max_ring = std::max<std::uint64_t>(max_ring, (c + slot_align - 1) / slot_align * slot_align * max_depth);
  resources r;
  // The rings are the fronts of the `total`-byte pinned buffers; those must
  // hold the largest ring too.
  r.total = static_cast<std::size_t>(opt.total);
  const std::size_t pin_bytes = static_cast<std::size_t>(std::max<std::uint64_t>(opt.total, max_ring));
  CK(cudaStreamCreateWithFlags(&r.d2h, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&r.h2d, cudaStreamNonBlocking));
  r.ev_d2h.resize(max_depth);
  r.ev_h2d.resize(max_depth);
  for (std::uint32_t i = 0; i < max_depth; ++i) {
    CK(cudaEventCreateWithFlags(&r.ev_d2h[i], cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&r.ev_h2d[i], cudaEventDisableTiming));
  }
  CK(cudaMalloc(reinterpret_cast<void**>(&r.dev_src), r.total));
  CK(cudaMalloc(reinterpret_cast<void**>(&r.dev_dst), r.total));
  CK(cudaHostAlloc(reinterpret_cast<void**>(&r.pin_a), pin_bytes, cudaHostAllocDefault));
  CK(cudaHostAlloc(reinterpret_cast<void**>(&r.pin_b), pin_bytes, cudaHostAllocDefault));
  CK(cudaMemset(r.dev_src, 0x5a, r.total));
  CK(cudaMemset(r.dev_dst, 0, r.total));
  std::memset(r.pin_a, 0xa5, pin_bytes);  // touched (and mapped) before timing
  std::memset(r.pin_b, 0, pin_bytes);
  CK(cudaDeviceSynchronize());
  std::fprintf(stderr, "copy_rates: %s (device %d, %s), %s per measurement, median of %d\n", prop.name, opt.device, bus,
               human(opt.total).c_str(), opt.reps);

  FILE* csv = nullptr;
  const char* header = "what,chunk,depth,total_bytes,gbps";
  std::printf("%s\n", header);
  std::fflush(stdout);
  if (!opt.csv.empty()) {
    csv = std::fopen(opt.csv.c_str(), "a");
    if (!csv) fail("open %s: %s", opt.csv.c_str(), std::strerror(errno));
    if (std::ftell(csv) == 0) std::fprintf(csv, "%s\n", header);
  }
  auto report = [&](const char* what, std::uint64_t chunk, std::uint32_t depth, double gbps) {
    char line[200];
    std::snprintf(line, sizeof line, "%s,%llu,%u,%llu,%.4f", what, static_cast<unsigned long long>(chunk), depth,
                  static_cast<unsigned long long>(opt.total), gbps);
    std::printf("%s\n", line);
    std::fflush(stdout);
    if (csv) {
      std::fprintf(csv, "%s\n", line);
      std::fflush(csv);
    }
    std::fprintf(stderr, "%-12s chunk %8s  depth %u: %7.2f GB/s\n", what, human(chunk).c_str(), depth, gbps);
  };
  // One untimed run, then the median of reps.
  auto measure = [&](auto&& f) {
    f();
    std::vector<double> v;
    for (int k = 0; k < opt.reps; ++k) v.push_back(f());
    return median(v);
  };

  for (auto chunk64 : opt.chunks) {
    const auto chunk = static_cast<std::size_t>(chunk64);
    report("memcpy_big", chunk, 0, measure([&] { return memcpy_big(r, chunk); }));
    for (auto depth : opt.depths) {
      report("d2h", chunk, depth, measure([&] { return one_direction(r, cudaMemcpyDeviceToHost, chunk, depth); }));
      report("h2d", chunk, depth, measure([&] { return one_direction(r, cudaMemcpyHostToDevice, chunk, depth); }));
      report("memcpy_ring", chunk, depth, measure([&] { return memcpy_ring(r, chunk, depth); }));
      report("chain", chunk, depth, measure([&] { return chain(r, chunk, depth); }));
      std::vector<double> down, up;
      bidir(r, chunk, depth);
      for (int k = 0; k < opt.reps; ++k) {
        auto [a, b] = bidir(r, chunk, depth);
        down.push_back(a);
        up.push_back(b);
      }
      report("bidir_d2h", chunk, depth, median(down));
      report("bidir_h2d", chunk, depth, median(up));
    }
  }
  if (csv) std::fclose(csv);
  std::fprintf(stderr, "copy_rates: done in %.1f s\n", seconds_since(t_start));
  return 0;
}
