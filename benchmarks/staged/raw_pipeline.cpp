// raw_pipeline: the hand-written baseline for gdr's staged Device path over
// TCP. Two processes on 127.0.0.1 move `size` bytes Device -> Device per
// message, with the CUDA runtime and blocking sockets only (no gdr code):
//
//   raw     the pipeline: the sender copies `chunk`-byte pieces device-to-host
//           into a ring of `depth` pinned buffers (cudaMemcpyAsync on one
//           non-blocking stream, one event per chunk) and sends each piece as
//           soon as its copy is done, keeping up to `depth` copies queued
//           ahead of the socket; the receiver receives each piece into its
//           ring slot (recv MSG_WAITALL) and copies it host-to-device on its
//           own stream, reusing a slot only after that copy's event is done.
//   naive   one whole D2H copy into one pinned buffer, send it all, receive it
//           all into one pinned buffer, one whole H2D copy (pinned rather than
//           pageable: the best case for a program that does not pipeline).
//   pinned  the same transfer from and to pinned host memory, no GPU copies:
//           what the socket alone does.
//
// One message = a 48-byte header (its size; sizes need not be multiples of
// the chunk) and the payload. The receiver answers each message with one byte
// once the last H2D copy is complete, so a message's time (on the sender,
// from the first D2H copy queued to the answer) covers the whole
// Device -> Device transfer. GB/s = 1e9 bytes per second; median, min and max
// over the timed messages of a point.
//
// Processes: the sender is the parent. It listens on 127.0.0.1 port 0, then
// forks the receiver before either touches CUDA (a CUDA context does not
// survive fork; the device probe runs in a throwaway child); each then
// initializes CUDA itself. The receiver dies with the sender
// (PR_SET_PDEATHSIG), the sender kills the receiver on any error, and the
// receiver's exit status becomes the sender's. Both use GPU 0 unless
// --device / --recv-device say otherwise.
//
// --sweep: 1 MiB..1 GiB, 100 timed messages up to 4 MiB, 50 at 16 MiB, 20 at
// 64 MiB, 8 at 256 MiB, 3 at 1 GiB; a point stops early after
// --point-seconds (10) once it has 3.
//
// Output: one CSV line per (mode, size, chunk, depth) on stdout (and appended
// to --csv FILE), after a header line:
//   mode,size,chunk,depth,iters,median_gbps,min_gbps,max_gbps
// chunk and depth are 0 for naive and pinned (they do not apply). Readable
// lines and the total run time go to stderr. --verify checks every byte on
// the receiver (an offset-dependent pattern, plus a guard zone after the
// message) and prints no CSV, since its times include the checks.
//
// Needs a GPU; without one it prints "[gdr-skip] raw_pipeline: ..." and
// exits 0. Any error: a message on stderr and a non-zero exit status.
//
// Build without Bazel (what benchmarks/staged/build_and_run.sh does):
//   g++ -O2 -std=c++20 -isystem $CUDA_HOME/include benchmarks/staged/raw_pipeline.cpp
//       -o raw_pipeline $CUDA_HOME/lib64/libcudart_static.a -ldl -lrt -lpthread
// With Bazel: ./bazelw build -c opt //benchmarks/staged:raw_pipeline
//
// Run:
//   raw_pipeline --size 64M --chunk 1M --depth 4 --iters 20
//   raw_pipeline --sweep --modes raw,naive,pinned --chunks 256K,1M,4M --depths 2,4,8 --csv out.csv
//   raw_pipeline --verify --modes raw,naive,pinned --sizes 0,1,1M+3,64M+3 --chunks 256K,1M --depths 2,3
//   raw_pipeline --help        (every option: --wait spin|sync, --sockbuf, --cpus, ...)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/staged/units.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

// ---- errors: say what and where, then end the process -------------------------

const char* g_role = "raw_pipeline";  // "raw_pipeline[sender]" / "[receiver]" after the fork
pid_t g_child = 0;                     // the receiver, in the sender: killed if the sender fails

[[noreturn]] void fail(const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "%s: ERROR: %s\n", g_role, msg);
  if (g_child > 0) {  // no orphan: the receiver goes with the sender
    ::kill(g_child, SIGKILL);
    ::waitpid(g_child, nullptr, 0);
  }
  // _Exit, not exit: no atexit handlers, and no flush of a stdio buffer a
  // forked process may share with its parent.
  std::fflush(stdout);
  std::_Exit(1);
}

[[noreturn]] void fail_errno(const char* what) { fail("%s: %s", what, std::strerror(errno)); }

void check_cuda(cudaError_t e, const char* call, int line) {
  if (e != cudaSuccess) fail("line %d: %s: %s (%s)", line, call, cudaGetErrorString(e), cudaGetErrorName(e));
}
#define CK(call) check_cuda((call), #call, __LINE__)

// ---- options -----------------------------------------------------------------------

enum class mode : std::uint32_t { raw = 1, naive = 2, pinned = 3 };

const char* mode_name(mode m) {
  switch (m) {
    case mode::raw: return "raw";
    case mode::naive: return "naive";
    case mode::pinned: return "pinned";
  }
  return "?";
}

// How the host waits for a copy's event. Both are offered because which is
// faster depends on the driver: with the default cudaDeviceScheduleAuto and
// fewer CUDA contexts than CPUs, cudaEventSynchronize spins inside the driver
// too, so the two should be equal; build_and_run.sh measures both once and
// keeps the faster for the sweep. `spin` is the default: it is what gdr's
// event poller does (cudaEventQuery until ready).
enum class wait_mode : std::uint32_t { spin = 1, sync = 2 };

struct options {
  std::vector<mode> modes{mode::raw};
  std::vector<std::uint64_t> sizes;
  std::vector<std::uint64_t> chunks{1u << 20};
  std::vector<std::uint32_t> depths{4};
  long iters = -1;   // -1: by size (sweep table), 20 otherwise, 3 with --verify
  long warmup = -1;  // -1: by size
  bool sweep = false;
  bool verify = false;
  wait_mode wait = wait_mode::spin;
  std::uint64_t sockbuf = 0;  // 0: the kernel's default (autotuning)
  int device = 0;
  int recv_device = -1;  // -1: same as device
  int cpu_send = -1, cpu_recv = -1;
  std::string csv;
  double point_seconds = 10;  // stop a point's timed messages after this (at least 3 kept)
  unsigned timeout = 1200;    // the whole run, seconds (SIGALRM ends it)
};

using staged_bench::GiB, staged_bench::KiB, staged_bench::MiB, staged_bench::human;
constexpr std::uint64_t guard_bytes = 64 * KiB;  // after the message on the receiver: must stay untouched
constexpr std::uint8_t fill_byte = 0x5a;        // what the receiver's buffers hold before a verified message
constexpr std::size_t slot_align = 4096;

void usage(FILE* f) {
  std::fprintf(f,
               "usage: raw_pipeline [options]\n"
               "  --size S | --sizes S,S,..   message sizes (K/M/G = KiB/MiB/GiB, '1M+3' allowed); default 64M\n"
               "  --chunk C | --chunks C,..   raw: bytes per pipelined copy (default 1M)\n"
               "  --depth D | --depths D,..   raw: pinned buffers per side, copies in flight (default 4)\n"
               "  --iters N --warmup N        timed and untimed messages per point (default: by size)\n"
               "  --naive | --pinned | --modes raw,naive,pinned   what to measure (default raw)\n"
               "  --sweep                     sizes 1M,4M,16M,64M,256M,1G with fewer iterations for large ones\n"
               "  --verify                    check every received byte; no CSV (times include the checks)\n"
               "  --wait spin|sync            wait for copies by cudaEventQuery spin (default) or cudaEventSynchronize\n"
               "  --sockbuf B                 SO_SNDBUF/SO_RCVBUF on both sockets (default 0: kernel autotuning)\n"
               "  --device N --recv-device N  GPU of the sender / receiver (default 0 / same)\n"
               "  --cpus S,R                  pin the sender and the receiver to these CPUs\n"
               "  --point-seconds T           end a point's timed messages after T s, keeping >= 3 (default 10)\n"
               "  --timeout T                 end the whole run after T s (default 1200)\n"
               "  --csv FILE                  also append the CSV lines to FILE\n");
}

bool parse_u64(const std::string& s, std::uint64_t& out) {
  // "<n>[K|M|G][+<n>[K|M|G]]...": binary units, sums allowed (1M+3).
  out = 0;
  std::size_t i = 0;
  if (s.empty()) return false;
  while (i < s.size()) {
    std::size_t j = i;
    std::uint64_t v = 0;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') {
      if (v > (UINT64_MAX - 9) / 10) return false;
      v = v * 10 + static_cast<std::uint64_t>(s[j] - '0');
      ++j;
    }
    if (j == i) return false;
    std::uint64_t unit = 1;
    if (j < s.size() && (s[j] == 'K' || s[j] == 'k')) unit = KiB, ++j;
    else if (j < s.size() && (s[j] == 'M' || s[j] == 'm')) unit = MiB, ++j;
    else if (j < s.size() && (s[j] == 'G' || s[j] == 'g')) unit = GiB, ++j;
    if (v > UINT64_MAX / unit) return false;
    out += v * unit;
    if (j == s.size()) return true;
    if (s[j] != '+') return false;
    i = j + 1;
    if (i == s.size()) return false;
  }
  return true;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t b = 0;
  for (;;) {
    std::size_t e = s.find(',', b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) return out;
    b = e + 1;
  }
}

[[noreturn]] void bad_arg(const char* fmt, const std::string& v) {
  std::fprintf(stderr, "raw_pipeline: ");
  std::fprintf(stderr, fmt, v.c_str());
  std::fprintf(stderr, " (raw_pipeline --help lists the options)\n");
  std::exit(2);
}

std::vector<std::uint64_t> parse_list(const std::string& v, const char* what) {
  std::vector<std::uint64_t> out;
  for (const auto& s : split(v)) {
    std::uint64_t x = 0;
    if (!parse_u64(s, x)) bad_arg((std::string("bad ") + what + ": '%s'").c_str(), s);
    out.push_back(x);
  }
  return out;
}

long parse_long(const std::string& v, const char* what) {
  std::uint64_t x = 0;
  if (!parse_u64(v, x) || x > 1000000000) bad_arg((std::string("bad ") + what + ": '%s'").c_str(), v);
  return static_cast<long>(x);
}

options parse_args(int argc, char** argv) {
  options o;
  bool modes_set = false, sizes_set = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) bad_arg("%s needs a value", a);
      return argv[++i];
    };
    auto set_modes = [&](std::vector<mode> m) {
      if (modes_set) bad_arg("%s: give one of --naive, --pinned, --modes", a);
      modes_set = true;
      o.modes = std::move(m);
    };
    if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (a == "--size" || a == "--sizes") {
      o.sizes = parse_list(value(), "size");
      sizes_set = true;
    } else if (a == "--chunk" || a == "--chunks") {
      o.chunks = parse_list(value(), "chunk");
    } else if (a == "--depth" || a == "--depths") {
      o.depths.clear();
      for (auto d : parse_list(value(), "depth")) o.depths.push_back(static_cast<std::uint32_t>(std::min<std::uint64_t>(d, 1u << 30)));
    } else if (a == "--iters") {
      o.iters = parse_long(value(), "iters");
    } else if (a == "--warmup") {
      o.warmup = parse_long(value(), "warmup");
    } else if (a == "--sweep") {
      o.sweep = true;
    } else if (a == "--verify") {
      o.verify = true;
    } else if (a == "--naive") {
      set_modes({mode::naive});
    } else if (a == "--pinned") {
      set_modes({mode::pinned});
    } else if (a == "--modes") {
      std::vector<mode> m;
      for (const auto& s : split(value())) {
        if (s == "raw") m.push_back(mode::raw);
        else if (s == "naive") m.push_back(mode::naive);
        else if (s == "pinned") m.push_back(mode::pinned);
        else bad_arg("unknown mode '%s' (raw, naive, pinned)", s);
      }
      set_modes(std::move(m));
    } else if (a == "--wait") {
      std::string v = value();
      if (v == "spin") o.wait = wait_mode::spin;
      else if (v == "sync") o.wait = wait_mode::sync;
      else bad_arg("--wait: '%s' (spin or sync)", v);
    } else if (a == "--sockbuf") {
      std::string v = value();
      if (!parse_u64(v, o.sockbuf) || o.sockbuf > (1u << 30)) bad_arg("bad --sockbuf: '%s'", v);
    } else if (a == "--device") {
      o.device = static_cast<int>(parse_long(value(), "device"));
    } else if (a == "--recv-device") {
      o.recv_device = static_cast<int>(parse_long(value(), "recv-device"));
    } else if (a == "--cpus") {
      auto c = parse_list(value(), "cpus");
      if (c.size() != 2 || c[0] > 4096 || c[1] > 4096) bad_arg("--cpus: want two CPU numbers, S,R", a);
      o.cpu_send = static_cast<int>(c[0]);
      o.cpu_recv = static_cast<int>(c[1]);
    } else if (a == "--point-seconds") {
      o.point_seconds = static_cast<double>(parse_long(value(), "point-seconds"));
    } else if (a == "--timeout") {
      o.timeout = static_cast<unsigned>(parse_long(value(), "timeout"));
    } else if (a == "--csv") {
      o.csv = value();
    } else {
      bad_arg("unknown argument '%s'", a);
    }
  }
  if (o.recv_device < 0) o.recv_device = o.device;
  if (o.sweep && sizes_set) bad_arg("%s: --sweep picks the sizes; leave out --size", std::string("--sweep"));
  if (o.sweep) o.sizes = {1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB};
  if (o.sizes.empty()) {
    // --verify: the sizes that catch chunk arithmetic (empty, tiny, around a
    // chunk boundary, not a multiple of anything).
    if (o.verify) o.sizes = {0, 1, 4095, 256 * KiB - 1, 256 * KiB + 1, 1 * MiB, 1 * MiB + 3, 4 * MiB + 7, 64 * MiB + 3};
    else o.sizes = {64 * MiB};
  }
  for (auto s : o.sizes)
    if (s > 64 * GiB) bad_arg("size %s above 64 GiB", std::to_string(s));
  for (auto c : o.chunks)
    if (c == 0 || c > 1 * GiB) bad_arg("chunk %s: want 1 byte .. 1 GiB", std::to_string(c));
  for (auto d : o.depths)
    if (d == 0 || d > 64) bad_arg("depth %s: want 1 .. 64", std::to_string(d));
  if (o.chunks.empty() || o.depths.empty()) bad_arg("%s", std::string("empty --chunks or --depths"));
  if (o.iters == 0) bad_arg("%s", std::string("--iters must be at least 1"));
  if (o.point_seconds <= 0) o.point_seconds = 1e9;
  return o;
}

// Timed and untimed messages for a size: about 2 GiB per point at most,
// 3 for 1 GiB (the brief's bound of a few minutes for the whole sweep).
long iters_for(const options& o, std::uint64_t size) {
  if (o.iters > 0) return o.iters;
  if (o.verify) return 3;
  if (!o.sweep) return 20;
  if (size <= 4 * MiB) return 100;
  if (size <= 16 * MiB) return 50;
  if (size <= 64 * MiB) return 20;
  if (size <= 256 * MiB) return 8;
  return 3;
}

long warmup_for(const options& o, std::uint64_t size) {
  if (o.warmup >= 0) return o.warmup;
  if (o.verify) return 0;
  if (size <= 16 * MiB) return 5;
  if (size <= 64 * MiB) return 2;
  return 1;
}

// ---- the byte pattern: a hash of the offset, so a chunk in the wrong place shows ----

static_assert(std::endian::native == std::endian::little, "the pattern is written as little-endian words");

inline std::uint64_t mix64(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline std::uint8_t pattern_byte(std::uint64_t off) { return static_cast<std::uint8_t>(mix64(off >> 3) >> (8 * (off & 7))); }

void fill_pattern(std::uint8_t* p, std::uint64_t off, std::size_t n) {
  std::size_t i = 0;
  for (; i < n && ((off + i) & 7) != 0; ++i) p[i] = pattern_byte(off + i);
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w = mix64((off + i) >> 3);
    std::memcpy(p + i, &w, 8);
  }
  for (; i < n; ++i) p[i] = pattern_byte(off + i);
}

// Number of bytes of p[0, n) that are not the pattern at offsets [off, off+n);
// the first such offset in *first_bad.
std::uint64_t count_bad_pattern(const std::uint8_t* p, std::uint64_t off, std::size_t n, std::uint64_t* first_bad) {
  std::uint64_t bad = 0;
  std::size_t i = 0;
  auto byte_check = [&](std::size_t k) {
    if (p[k] != pattern_byte(off + k)) {
      if (bad++ == 0) *first_bad = off + k;
    }
  };
  for (; i < n && ((off + i) & 7) != 0; ++i) byte_check(i);
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w = mix64((off + i) >> 3), got;
    std::memcpy(&got, p + i, 8);
    if (got != w)
      for (std::size_t k = i; k < i + 8; ++k) byte_check(k);
  }
  for (; i < n; ++i) byte_check(i);
  return bad;
}

std::uint64_t count_not_fill(const std::uint8_t* p, std::uint64_t off, std::size_t n, std::uint64_t* first_bad) {
  std::uint64_t bad = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (p[i] != fill_byte && bad++ == 0) *first_bad = off + i;
  return bad;
}

// ---- sockets: whole writes and reads, EINTR retried -------------------------------

void send_iov(int fd, iovec* iov, int cnt) {
  std::size_t left = 0;
  for (int i = 0; i < cnt; ++i) left += iov[i].iov_len;
  while (left > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<std::size_t>(cnt);
    ssize_t k = ::sendmsg(fd, &m, MSG_NOSIGNAL);  // EPIPE instead of SIGPIPE if the peer is gone
    if (k < 0) {
      if (errno == EINTR) continue;
      fail_errno("sendmsg");
    }
    if (k == 0) fail("sendmsg sent nothing with %zu bytes left", left);
    auto done = static_cast<std::size_t>(k);
    left -= done;
    // Drop what went out: whole iovecs, then the front of the next one.
    while (cnt > 0 && done >= iov->iov_len) {
      done -= iov->iov_len;
      ++iov;
      --cnt;
    }
    if (cnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + done;
      iov->iov_len -= done;
    }
  }
}

void send_all(int fd, const void* p, std::size_t n) {
  iovec v{const_cast<void*>(p), n};
  send_iov(fd, &v, 1);
}

void recv_all(int fd, void* p, std::size_t n) {
  auto* b = static_cast<char*>(p);
  while (n > 0) {
    // MSG_WAITALL still returns early on a signal or an error: loop.
    ssize_t k = ::recv(fd, b, n, MSG_WAITALL);
    if (k < 0) {
      if (errno == EINTR) continue;
      fail_errno("recv");
    }
    if (k == 0) fail("the peer closed the connection with %zu bytes still expected", n);
    b += k;
    n -= static_cast<std::size_t>(k);
  }
}

void set_sockopts(int fd, const options& o, bool nodelay) {
  if (o.sockbuf > 0) {
    // Set before listen/connect: the window scale is fixed at the handshake.
    // Setting them turns off the kernel's autotuning, and the kernel caps
    // them at net.core.{w,r}mem_max (the effective values are printed).
    int v = static_cast<int>(o.sockbuf);
    if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v) != 0) fail_errno("setsockopt SO_SNDBUF");
    if (::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof v) != 0) fail_errno("setsockopt SO_RCVBUF");
  }
  if (nodelay) {
    int one = 1;
    if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) fail_errno("setsockopt TCP_NODELAY");
  }
}

std::string describe_sockbufs(int fd) {
  int snd = 0, rcv = 0;
  socklen_t l = sizeof snd;
  ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &snd, &l);
  l = sizeof rcv;
  ::getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcv, &l);
  return "SO_SNDBUF " + std::to_string(snd) + ", SO_RCVBUF " + std::to_string(rcv);
}

// ---- the wire -------------------------------------------------------------------

constexpr std::uint32_t frame_magic = 0x47535447;  // "GTSG"
enum class frame_kind : std::uint32_t { config = 1, message = 2, quit = 3 };

// One header for everything the sender tells the receiver. config: prepare
// for `mode`, `chunk`, `depth`, messages up to `size` bytes, `verify`, and
// answer 'R'. message: `size` payload bytes follow; answer 'A' once they are
// on the device ('V': the check failed). quit: exit.
struct frame {
  std::uint32_t magic;
  std::uint32_t kind;
  std::uint32_t mode;
  std::uint32_t depth;
  std::uint64_t chunk;
  std::uint64_t size;
  std::uint64_t seq;
  std::uint32_t verify;
  std::uint32_t wait;
};
static_assert(sizeof(frame) == 48);

constexpr char reply_ready = 'R', reply_ack = 'A', reply_corrupt = 'V';

// ---- CUDA helpers ----------------------------------------------------------------

void wait_event(cudaEvent_t e, wait_mode w) {
  if (w == wait_mode::sync) {
    CK(cudaEventSynchronize(e));
    return;
  }
  for (;;) {
    cudaError_t r = cudaEventQuery(e);
    if (r == cudaSuccess) return;
    if (r != cudaErrorNotReady) check_cuda(r, "cudaEventQuery", __LINE__);
  }
}

std::size_t slot_stride(std::uint64_t chunk) { return (static_cast<std::size_t>(chunk) + slot_align - 1) / slot_align * slot_align; }

// Buffers of one process, grown when a point needs more, never freed
// mid-run, never (re)allocated inside a timed message.
struct gpu_side {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;
  std::uint8_t* dev = nullptr;  // sender: the source (pattern); receiver: the destination
  std::size_t dev_cap = 0;
  std::uint8_t* ring = nullptr;  // raw: depth slots of slot_stride(chunk)
  std::size_t ring_cap = 0;
  std::uint8_t* big = nullptr;  // naive and pinned: one whole message
  std::size_t big_cap = 0;

  void init(int dev_index) {
    device = dev_index;
    CK(cudaSetDevice(device));
    CK(cudaFree(nullptr));  // create the context now, not in the first timed message
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }

  void need_events(std::size_t n) {
    while (events.size() < n) {
      cudaEvent_t e;
      CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      events.push_back(e);
    }
  }

  // Returns true when it (re)allocated.
  bool need_dev(std::size_t n) {
    if (n <= dev_cap) return false;
    if (dev) CK(cudaFree(dev));
    dev = nullptr;
    dev_cap = 0;
    CK(cudaMalloc(reinterpret_cast<void**>(&dev), n));
    dev_cap = n;
    return true;
  }

  void need_ring(std::size_t n) {
    if (n <= ring_cap) return;
    if (ring) CK(cudaFreeHost(ring));
    ring = nullptr;
    ring_cap = 0;
    CK(cudaHostAlloc(reinterpret_cast<void**>(&ring), n, cudaHostAllocDefault));
    ring_cap = n;
  }

  bool need_big(std::size_t n) {
    if (n <= big_cap) return false;
    if (big) CK(cudaFreeHost(big));
    big = nullptr;
    big_cap = 0;
    CK(cudaHostAlloc(reinterpret_cast<void**>(&big), n, cudaHostAllocDefault));
    big_cap = n;
    return true;
  }

  void sync() { CK(cudaStreamSynchronize(stream)); }
};

// The device buffer gets the pattern from a host block, 16 MiB at a time.
void fill_device_pattern(gpu_side& g, std::size_t n) {
  std::vector<std::uint8_t> host(std::min<std::size_t>(n, 16 * MiB));
  for (std::size_t off = 0; off < n; off += host.size()) {
    std::size_t len = std::min(host.size(), n - off);
    fill_pattern(host.data(), off, len);
    CK(cudaMemcpyAsync(g.dev + off, host.data(), len, cudaMemcpyHostToDevice, g.stream));
    g.sync();  // the host block is reused
  }
}

// ---- the receiver (the child process) ----------------------------------------------

struct receiver {
  const options& opt;
  int fd;
  gpu_side g;
  std::vector<std::uint8_t> check_buf;  // verify: device bytes copied back here

  // Current point.
  mode m = mode::raw;
  std::uint64_t chunk = 0, cap = 0;
  std::uint32_t depth = 0;
  bool verify = false;
  wait_mode wait = wait_mode::spin;
  std::uint64_t next_seq = 0;

  receiver(const options& o, int sock) : opt(o), fd(sock) {}

  void configure(const frame& f) {
    m = static_cast<mode>(f.mode);
    if (m != mode::raw && m != mode::naive && m != mode::pinned) fail("config: unknown mode %u", f.mode);
    chunk = f.chunk;
    depth = f.depth;
    cap = f.size;
    verify = f.verify != 0;
    wait = static_cast<wait_mode>(f.wait);
    if (wait != wait_mode::spin && wait != wait_mode::sync) fail("config: unknown wait mode %u", f.wait);
    next_seq = 0;
    if (m == mode::raw) {
      if (chunk == 0 || depth == 0 || depth > 64) fail("config: chunk %llu depth %u", static_cast<unsigned long long>(chunk), depth);
      g.need_ring(slot_stride(chunk) * depth);
      g.need_events(depth);
    } else {
      g.need_events(1);
    }
    if (m != mode::pinned) g.need_dev(cap + guard_bytes);
    if (m != mode::raw) g.need_big(cap + guard_bytes);
    if (verify) reset_for_verify(cap);
  }

  // Before a verified message: every byte it may touch, plus the guard, holds fill_byte.
  void reset_for_verify(std::uint64_t size) {
    std::size_t n = size + guard_bytes;
    if (m == mode::pinned) {
      std::memset(g.big, fill_byte, n);
    } else {
      CK(cudaMemsetAsync(g.dev, fill_byte, n, g.stream));
      g.sync();
    }
  }

  // Every byte of the message against the pattern, and the guard after it.
  bool check(std::uint64_t size) {
    std::size_t n = size + guard_bytes;
    std::uint64_t bad = 0, first = 0, gbad = 0, gfirst = 0;
    auto check_block = [&](const std::uint8_t* p, std::size_t off, std::size_t len) {
      std::size_t data_end = std::min<std::size_t>(off + len, size);
      std::uint64_t f = 0;
      if (off < data_end) {
        std::uint64_t b = count_bad_pattern(p, off, data_end - off, &f);
        if (b && !bad) first = f;
        bad += b;
      }
      std::size_t gstart = std::max<std::size_t>(off, size);
      if (gstart < off + len) {
        std::uint64_t b = count_not_fill(p + (gstart - off), gstart, off + len - gstart, &f);
        if (b && !gbad) gfirst = f;
        gbad += b;
      }
    };
    if (m == mode::pinned) {
      check_block(g.big, 0, n);
    } else {
      if (check_buf.empty()) check_buf.resize(16 * MiB);
      for (std::size_t off = 0; off < n; off += check_buf.size()) {
        std::size_t len = std::min(check_buf.size(), n - off);
        CK(cudaMemcpyAsync(check_buf.data(), g.dev + off, len, cudaMemcpyDeviceToHost, g.stream));
        g.sync();
        check_block(check_buf.data(), off, len);
      }
    }
    if (bad || gbad) {
      std::fprintf(stderr,
                   "%s: VERIFY FAILED: %s size %llu chunk %llu depth %u message %llu: %llu wrong bytes "
                   "(first at offset %llu), %llu bytes written past the end (first at %llu)\n",
                   g_role, mode_name(m), static_cast<unsigned long long>(size), static_cast<unsigned long long>(chunk),
                   depth, static_cast<unsigned long long>(next_seq - 1), static_cast<unsigned long long>(bad),
                   static_cast<unsigned long long>(first), static_cast<unsigned long long>(gbad),
                   static_cast<unsigned long long>(gfirst));
      return false;
    }
    return true;
  }

  void receive_raw(std::uint64_t size) {
    const std::size_t stride = slot_stride(chunk);
    const std::uint64_t n = (size + chunk - 1) / chunk;
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint32_t s = static_cast<std::uint32_t>(i % depth);
      // The slot's previous H2D copy (chunk i - depth) must be done before
      // the socket overwrites it.
      if (i >= depth) wait_event(g.events[s], wait);
      const std::uint64_t off = i * chunk;
      const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, size - off));
      std::uint8_t* slot = g.ring + s * stride;
      recv_all(fd, slot, len);
      CK(cudaMemcpyAsync(g.dev + off, slot, len, cudaMemcpyHostToDevice, g.stream));
      CK(cudaEventRecord(g.events[s], g.stream));
    }
    // One stream, in order: the last chunk's event covers every copy.
    if (n > 0) wait_event(g.events[(n - 1) % depth], wait);
  }

  void receive_naive(std::uint64_t size) {
    recv_all(fd, g.big, size);
    if (size > 0) {
      // The naive program's whole cudaMemcpy, written as the async copy on
      // this process's stream and a wait (same cost, and it uses the same
      // wait as the pipeline).
      CK(cudaMemcpyAsync(g.dev, g.big, size, cudaMemcpyHostToDevice, g.stream));
      CK(cudaEventRecord(g.events[0], g.stream));
      wait_event(g.events[0], wait);
    }
  }

  // Returns the process exit status.
  int run() {
    for (;;) {
      frame f{};
      recv_all(fd, &f, sizeof f);
      if (f.magic != frame_magic) fail("bad frame magic 0x%08x (framing lost)", f.magic);
      switch (static_cast<frame_kind>(f.kind)) {
        case frame_kind::quit:
          return 0;
        case frame_kind::config: {
          configure(f);
          char r = reply_ready;
          send_all(fd, &r, 1);
          break;
        }
        case frame_kind::message: {
          if (f.seq != next_seq) fail("message %llu, expected %llu (framing lost)", static_cast<unsigned long long>(f.seq), static_cast<unsigned long long>(next_seq));
          if (f.size > cap) fail("message of %llu bytes above the %llu prepared", static_cast<unsigned long long>(f.size), static_cast<unsigned long long>(cap));
          if (f.mode != static_cast<std::uint32_t>(m) || f.chunk != chunk || f.depth != depth) fail("message does not match the configured point");
          ++next_seq;
          switch (m) {
            case mode::raw: receive_raw(f.size); break;
            case mode::naive: receive_naive(f.size); break;
            case mode::pinned: recv_all(fd, g.big, f.size); break;
          }
          char r = reply_ack;
          if (verify) {
            if (!check(f.size)) r = reply_corrupt;
            else reset_for_verify(f.size);
          }
          send_all(fd, &r, 1);
          if (r == reply_corrupt) return 1;
          break;
        }
        default:
          fail("unknown frame kind %u", f.kind);
      }
    }
  }
};

// ---- the sender (the parent process): drives the points, measures, prints ----------

struct point_result {
  long iters = 0;
  double median = 0, min = 0, max = 0;  // GB/s
};

struct sender {
  const options& opt;
  int fd;
  gpu_side g;
  std::uint64_t max_size = 0;
  bool big_has_pattern = false;

  sender(const options& o, int sock) : opt(o), fd(sock) {}

  void prepare(mode m, std::uint64_t chunk, std::uint32_t depth) {
    if (m != mode::pinned && g.need_dev(std::max<std::uint64_t>(max_size, 1))) fill_device_pattern(g, g.dev_cap);
    if (m == mode::raw) {
      g.need_ring(slot_stride(chunk) * depth);
      g.need_events(depth);
    } else {
      g.need_events(1);
      if (g.need_big(std::max<std::uint64_t>(max_size, 1))) big_has_pattern = false;
      // Pinned mode sends this buffer as it is. (Naive mode's D2H copies
      // rewrite it with the same bytes, from the patterned source.)
      if (!big_has_pattern) {
        fill_pattern(g.big, 0, g.big_cap);
        big_has_pattern = true;
      }
    }
  }

  void send_raw(frame& f) {
    const std::uint64_t size = f.size, chunk = f.chunk;
    const std::uint32_t depth = f.depth;
    const std::size_t stride = slot_stride(chunk);
    const std::uint64_t n = (size + chunk - 1) / chunk;
    auto issue = [&](std::uint64_t i) {
      const std::uint64_t off = i * chunk;
      const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, size - off));
      const std::uint32_t s = static_cast<std::uint32_t>(i % depth);
      CK(cudaMemcpyAsync(g.ring + s * stride, g.dev + off, len, cudaMemcpyDeviceToHost, g.stream));
      CK(cudaEventRecord(g.events[s], g.stream));
    };
    std::uint64_t issued = 0;
    while (issued < n && issued < depth) issue(issued++);
    if (n == 0) send_all(fd, &f, sizeof f);
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint32_t s = static_cast<std::uint32_t>(i % depth);
      const std::uint64_t off = i * chunk;
      const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, size - off));
      wait_event(g.events[s], opt.wait);
      if (i == 0) {
        iovec v[2] = {{&f, sizeof f}, {g.ring + s * stride, len}};  // the header rides with the first chunk
        send_iov(fd, v, 2);
      } else {
        send_all(fd, g.ring + s * stride, len);
      }
      // A blocking send has copied the slot into the socket: reuse it for
      // chunk i + depth at once.
      if (issued < n) issue(issued++);
    }
  }

  void send_naive(frame& f) {
    if (f.size > 0) {
      CK(cudaMemcpyAsync(g.big, g.dev, f.size, cudaMemcpyDeviceToHost, g.stream));
      CK(cudaEventRecord(g.events[0], g.stream));
      wait_event(g.events[0], opt.wait);
    }
    iovec v[2] = {{&f, sizeof f}, {g.big, f.size}};
    send_iov(fd, v, 2);
  }

  point_result run_point(mode m, std::uint64_t size, std::uint64_t chunk, std::uint32_t depth) {
    const long iters = iters_for(opt, size), warmup = warmup_for(opt, size);
    prepare(m, chunk, depth);
    frame cf{frame_magic, static_cast<std::uint32_t>(frame_kind::config), static_cast<std::uint32_t>(m), depth, chunk,
             max_size, 0, opt.verify ? 1u : 0u, static_cast<std::uint32_t>(opt.wait)};
    send_all(fd, &cf, sizeof cf);
    char r = 0;
    recv_all(fd, &r, 1);
    if (r != reply_ready) fail("receiver answered '%c' to the configuration", r);

    std::vector<double> gbps;
    const auto t_point = clock_type::now();
    for (long k = 0;; ++k) {
      frame f{frame_magic, static_cast<std::uint32_t>(frame_kind::message), static_cast<std::uint32_t>(m), depth, chunk,
              size, static_cast<std::uint64_t>(k), cf.verify, cf.wait};
      const auto t0 = clock_type::now();
      switch (m) {
        case mode::raw: send_raw(f); break;
        case mode::naive: send_naive(f); break;
        case mode::pinned: {
          iovec v[2] = {{&f, sizeof f}, {g.big, size}};
          send_iov(fd, v, 2);
          break;
        }
      }
      recv_all(fd, &r, 1);
      const double t = std::chrono::duration<double>(clock_type::now() - t0).count();
      if (r == reply_corrupt)
        fail("the receiver found wrong bytes: %s size %llu chunk %llu depth %u message %ld", mode_name(m),
             static_cast<unsigned long long>(size), static_cast<unsigned long long>(chunk), depth, k);
      if (r != reply_ack) fail("receiver answered '%c' to message %ld", r, k);
      if (k >= warmup) gbps.push_back(static_cast<double>(size) / t / 1e9);
      const long timed = static_cast<long>(gbps.size());
      if (timed >= iters) break;
      // Bounded run time: a slow point keeps at least 3 timed messages.
      if (timed >= std::min(3L, iters) && std::chrono::duration<double>(clock_type::now() - t_point).count() > opt.point_seconds) break;
    }
    std::sort(gbps.begin(), gbps.end());
    point_result res;
    res.iters = static_cast<long>(gbps.size());
    res.min = gbps.front();
    res.max = gbps.back();
    res.median = gbps[gbps.size() / 2];  // the upper middle for an even count
    return res;
  }
};

// ---- processes: probe, fork, connect ------------------------------------------------

// cudaGetDeviceCount in a throwaway child: the process that forks the
// receiver must not have touched CUDA (a CUDA context does not survive fork).
// Returns the count, or -1 with the reason in *why.
int probe_devices(std::string* why) {
  int p[2];
  if (::pipe(p) != 0) fail_errno("pipe");
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid < 0) fail_errno("fork");
  if (pid == 0) {
    ::close(p[0]);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    char msg[512];
    int len;
    if (e != cudaSuccess) len = std::snprintf(msg, sizeof msg, "E%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
    else len = std::snprintf(msg, sizeof msg, "N%d", n);
    ssize_t w = ::write(p[1], msg, static_cast<std::size_t>(std::min<int>(len, sizeof msg - 1)));
    std::_Exit(w > 0 ? 0 : 1);
  }
  ::close(p[1]);
  std::string got;
  char buf[256];
  for (;;) {
    ssize_t k = ::read(p[0], buf, sizeof buf);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    got.append(buf, static_cast<std::size_t>(k));
  }
  ::close(p[0]);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0)
    if (errno != EINTR) fail_errno("waitpid (probe)");
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || got.empty())
    fail("the CUDA probe process failed (status 0x%x, said '%s')", st, got.c_str());
  if (got[0] == 'E') {
    *why = got.substr(1);
    return -1;
  }
  int n = std::atoi(got.c_str() + 1);
  if (n <= 0) *why = "cudaGetDeviceCount found 0 devices";
  return n > 0 ? n : -1;
}

int listen_loopback(const options& o, std::uint16_t& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail_errno("socket");
  set_sockopts(fd, o, false);  // an accepted socket inherits the buffer sizes
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;  // any free port; the child learns it through the fork
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fail_errno("bind 127.0.0.1:0");
  if (::listen(fd, 1) != 0) fail_errno("listen");
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) fail_errno("getsockname");
  port = ntohs(a.sin_port);
  return fd;
}

// Accepts the receiver's connection; fails if the receiver dies first or
// does not connect within 60 s (no hang on a child that never came up).
int accept_child(int lfd, pid_t child) {
  const auto t0 = clock_type::now();
  for (;;) {
    pollfd p{lfd, POLLIN, 0};
    int r = ::poll(&p, 1, 200);
    if (r < 0 && errno != EINTR) fail_errno("poll (accept)");
    if (r > 0) {
      int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) return fd;
      if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) fail_errno("accept");
    }
    int st = 0;
    pid_t w = ::waitpid(child, &st, WNOHANG);
    if (w == child) {
      g_child = 0;
      fail("the receiver exited before connecting (status 0x%x)", st);
    }
    if (std::chrono::duration<double>(clock_type::now() - t0).count() > 60) fail("the receiver did not connect within 60 s");
  }
}

int connect_loopback(const options& o, std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail_errno("socket");
  set_sockopts(fd, o, true);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    // Interrupted by a signal, the connection goes on in the background:
    // wait for it and take its result.
    if (errno != EINTR) fail_errno("connect");
    pollfd p{fd, POLLOUT, 0};
    while (::poll(&p, 1, -1) < 0)
      if (errno != EINTR) fail_errno("poll (connect)");
    int err = 0;
    socklen_t l = sizeof err;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l) != 0) fail_errno("getsockopt SO_ERROR");
    if (err != 0) fail("connect: %s", std::strerror(err));
  }
  return fd;
}

void pin_cpu(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (::sched_setaffinity(0, sizeof set, &set) != 0) fail_errno("sched_setaffinity (--cpus)");
}

std::string device_line(int dev) {
  cudaDeviceProp p{};
  CK(cudaGetDeviceProperties(&p, dev));
  char bus[32] = "?";
  CK(cudaDeviceGetPCIBusId(bus, sizeof bus, dev));
  return std::string(p.name) + " (device " + std::to_string(dev) + ", " + bus + ")";
}

void on_timeout(int) {
  // Async-signal-safe calls only.
  static const char msg[] = "raw_pipeline[sender]: ERROR: --timeout reached; killing the receiver\n";
  ssize_t w = ::write(2, msg, sizeof msg - 1);
  (void)w;
  if (g_child > 0) ::kill(g_child, SIGKILL);
  ::_exit(1);
}

[[noreturn]] void child_main(const options& o, std::uint16_t port, pid_t parent) {
  g_role = "raw_pipeline[receiver]";
  // If the sender dies, so does the receiver (and check the parent did not
  // die before this line: then we were already re-parented).
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail_errno("prctl(PR_SET_PDEATHSIG)");
  if (::getppid() != parent) fail("the sender exited before the receiver started");
  pin_cpu(o.cpu_recv);
  int fd = connect_loopback(o, port);
  receiver r(o, fd);
  r.g.init(o.recv_device);
  std::fprintf(stderr, "%s: %s, %s\n", g_role, device_line(o.recv_device).c_str(), describe_sockbufs(fd).c_str());
  int rc = r.run();
  ::close(fd);
  std::_Exit(rc);
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse_args(argc, argv);
  const auto t_start = clock_type::now();

  std::string why;
  int ndev = probe_devices(&why);
  if (ndev < 0) {
    std::printf("[gdr-skip] raw_pipeline: no CUDA device: %s\n", why.c_str());
    return 0;
  }
  if (opt.device >= ndev || opt.recv_device >= ndev)
    fail("--device %d / --recv-device %d: only %d CUDA device(s)", opt.device, opt.recv_device, ndev);

  std::uint16_t port = 0;
  int lfd = listen_loopback(opt, port);
  const pid_t parent = ::getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t child = ::fork();  // before any CUDA call in this process
  if (child < 0) fail_errno("fork");
  if (child == 0) {
    ::close(lfd);
    child_main(opt, port, parent);
  }
  g_child = child;
  g_role = "raw_pipeline[sender]";
  // The whole run is bounded: on SIGALRM the sender says so, kills the
  // receiver and exits 1 (PR_SET_PDEATHSIG would end the receiver anyway).
  if (opt.timeout > 0) {
    ::signal(SIGALRM, on_timeout);
    ::alarm(opt.timeout);
  }
  int fd = accept_child(lfd, child);
  ::close(lfd);
  set_sockopts(fd, opt, true);
  pin_cpu(opt.cpu_send);

  sender s(opt, fd);
  s.g.init(opt.device);
  for (auto sz : opt.sizes) s.max_size = std::max(s.max_size, sz);
  std::fprintf(stderr, "%s: %s, %s, TCP_NODELAY, wait %s, port %u\n", g_role, device_line(opt.device).c_str(),
               describe_sockbufs(fd).c_str(), opt.wait == wait_mode::spin ? "spin (cudaEventQuery)" : "sync (cudaEventSynchronize)",
               static_cast<unsigned>(port));

  FILE* csv = nullptr;
  if (!opt.verify) {
    const char* header = "mode,size,chunk,depth,iters,median_gbps,min_gbps,max_gbps";
    std::printf("%s\n", header);
    std::fflush(stdout);
    if (!opt.csv.empty()) {
      csv = std::fopen(opt.csv.c_str(), "a");
      if (!csv) fail_errno(("open " + opt.csv).c_str());
      if (std::ftell(csv) == 0) std::fprintf(csv, "%s\n", header);
    }
  }

  int points = 0;
  auto run = [&](mode m, std::uint64_t chunk, std::uint32_t depth) {
    for (auto size : opt.sizes) {
      point_result r = s.run_point(m, size, chunk, depth);
      ++points;
      if (opt.verify) {
        std::fprintf(stderr, "verify OK: %-6s size %llu (%s) chunk %s depth %u, %ld messages\n", mode_name(m),
                     static_cast<unsigned long long>(size), human(size).c_str(), m == mode::raw ? human(chunk).c_str() : "-",
                     depth, r.iters);
        continue;
      }
      char line[256];
      std::snprintf(line, sizeof line, "%s,%llu,%llu,%u,%ld,%.4f,%.4f,%.4f", mode_name(m), static_cast<unsigned long long>(size),
                    static_cast<unsigned long long>(chunk), depth, r.iters, r.median, r.min, r.max);
      std::printf("%s\n", line);
      std::fflush(stdout);
      if (csv) {
        std::fprintf(csv, "%s\n", line);
        std::fflush(csv);
      }
      std::fprintf(stderr, "%-6s %9s  chunk %8s  depth %u: %7.2f GB/s median (min %.2f, max %.2f), %ld messages\n",
                   mode_name(m), human(size).c_str(), m == mode::raw ? human(chunk).c_str() : "-", depth, r.median, r.min,
                   r.max, r.iters);
    }
  };
  for (mode m : opt.modes) {
    if (m == mode::raw) {
      for (auto c : opt.chunks)
        for (auto d : opt.depths) run(m, c, d);
    } else {
      run(m, 0, 0);  // chunk and depth do not apply
    }
  }
  if (csv) std::fclose(csv);

  frame q{frame_magic, static_cast<std::uint32_t>(frame_kind::quit), 0, 0, 0, 0, 0, 0, 0};
  send_all(fd, &q, sizeof q);
  int st = 0;
  while (::waitpid(child, &st, 0) < 0)
    if (errno != EINTR) fail_errno("waitpid (receiver)");
  g_child = 0;
  ::close(fd);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    if (WIFSIGNALED(st)) fail("the receiver was killed by signal %d", WTERMSIG(st));
    fail("the receiver exited with status %d", WEXITSTATUS(st));
  }
  std::fprintf(stderr, "raw_pipeline: %d points%s in %.1f s\n", points, opt.verify ? " verified" : "",
               std::chrono::duration<double>(clock_type::now() - t_start).count());
  return 0;
}
