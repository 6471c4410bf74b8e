// gpu_pipeline: a producer kernel fills GPU buffers, coroutines send them to a
// second process over TCP on 127.0.0.1, and a consumer kernel there checks
// every word. GPU memory crosses TCP on gdr's staged path (pinned bounce
// buffers). Each side has two buffers and two streams (double buffering), so
// kernels, copies and the socket overlap; a send waits on the GPU for its fill
// kernel (gdr::cuda::after), with no host synchronize. Both sides print the
// path taken and the throughput. Needs io_uring and a GPU: without one it says
// why and exits 0.
//
// Bazel: ./bazelw run //examples:gpu_pipeline -- --count 64 --size 16M
// Without Bazel, on a GPU machine, from the repository root (sm_90: H100/H200;
// the g++ command is one line):
//   nvcc -std=c++20 -arch=sm_90 -O2 -c examples/gpu_pipeline_kernels.cu -o gpu_pipeline_kernels.o
//   g++ -std=c++20 -O2 -DGDR_HAS_CUDA=1 -I. -isystem $CUDA_HOME/include examples/gpu_pipeline.cpp
//       gpu_pipeline_kernels.o $CUDA_HOME/lib64/libcudart_static.a -luring -ldl -lrt -lpthread -o gpu_pipeline
// Run: ./gpu_pipeline [--count N] [--size BYTES[K|M|G]]   (default: 64 messages of 16M)
#include <gdr/gdr.hpp>

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <system_error>

#include "gpu_pipeline_kernels.h"

namespace {

using clk = std::chrono::steady_clock;
using device_words = gdr::buffer<std::uint32_t, gdr::Device>;

struct options {
  int count = 64;                            // messages
  std::size_t size = std::size_t{16} << 20;  // bytes per message, a multiple of 4
};

// "16M" -> 16 MiB (K, M, G are powers of 1024); 0 for anything else.
std::size_t parse_size(const char* s) {
  if (*s < '0' || *s > '9') return 0;
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(s, &end, 10);
  if (errno != 0) return 0;
  int shift = 0;
  switch (*end) {
    case 'K': case 'k': shift = 10; ++end; break;
    case 'M': case 'm': shift = 20; ++end; break;
    case 'G': case 'g': shift = 30; ++end; break;
    default: break;
  }
  if (*end != '\0' || v > (~0ull >> shift)) return 0;
  return static_cast<std::size_t>(v << shift);
}

options parse(int argc, char** argv) {
  options o;
  bool ok = true;
  for (int i = 1; i < argc && ok; ++i) {
    std::string a = argv[i];
    if (a == "--count" && i + 1 < argc) {
      std::size_t n = parse_size(argv[++i]);
      ok = n > 0 && n <= 1000000;
      o.count = static_cast<int>(n);
    } else if (a == "--size" && i + 1 < argc) {
      o.size = parse_size(argv[++i]);
      ok = o.size > 0 && o.size % sizeof(std::uint32_t) == 0;
    } else {
      ok = false;
    }
  }
  if (!ok) {
    const bool help = argc == 2 && std::strcmp(argv[1], "--help") == 0;
    std::fprintf(help ? stdout : stderr, "usage: gpu_pipeline [--count N] [--size BYTES[K|M|G]]\n"
                                         "  N messages (default 64) of BYTES each (a multiple of 4; default 16M)\n");
    std::exit(help ? 0 : 2);
  }
  return o;
}

// A kernel launch or a CUDA call that returned `e`: throws `gdr::error` unless
// it worked (gdr::cuda::check aborts on errors that poison the context).
void check(cudaError_t e, const char* what) {
  if (std::error_code ec = gdr::cuda::check(e, what)) throw gdr::error(ec, what);
}

// Messages i = lane, lane + 2, ... use buffer and stream `lane` and travel
// with tag `lane`: messages of one tag arrive in the order they were sent.
gdr::tag tag_of(int lane) { return gdr::tag{static_cast<std::uint64_t>(lane)}; }
std::uint32_t seed_of(int message) { return static_cast<std::uint32_t>(message); }

gdr::tcp::endpoint_options endpoint_options(const options& o) {
  gdr::tcp::endpoint_options eo;  // staging: 1 MiB chunks, 4 in flight per direction (the defaults)
  eo.protocol.max_message = std::max<std::uint64_t>(eo.protocol.max_message, o.size);
  return eo;
}

double gbps(std::size_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

// ---------------------------------------------------------------- producer

// One lane of the producer. Its buffer is refilled only after its previous
// send completed (the loop awaits it), and while this lane waits for its
// send, the other lane's coroutine launches its fill and sends: the fill of
// message i + 1 runs while message i is on its way.
gdr::task<> produce(const gdr::tcp::endpoint& ep, int lane, device_words& buf, const gdr::cuda::stream& s,
                    int count) {
  for (int i = lane; i < count; i += 2) {
    // Queued on the lane's stream; returns at once.
    check(launch_fill(buf.data(), buf.size(), seed_of(i), s.get()), "launch_fill");
    // The send's device-to-host copies wait on the GPU for the work queued on
    // `s` so far: the fill above. The coroutine resumes once the whole
    // message is out of `buf`.
    co_await ep.send(buf.view(), tag_of(lane), gdr::cuda::after(s));
  }
}

int run_producer(const options& o, std::uint16_t port) {
  // Busy polling: the loop spins on one core, so each finished copy (a CUDA
  // event) and each socket read is seen at once; in sleep mode the event
  // poller would look every 20 us, a gap in a pipeline of 1 MiB chunks.
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller events(sched);  // completes GPU work; the staged path's copy engine
  const std::size_t words = o.size / sizeof(std::uint32_t);
  gdr::cuda::stream streams[2] = {gdr::cuda::stream(0), gdr::cuda::stream(0)};
  device_words bufs[2] = {device_words(words, 0), device_words(words, 0)};
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, gdr::tcp::address::loopback(port), endpoint_options(o));
    auto t0 = clk::now();
    co_await gdr::when_all(produce(ep, 0, bufs[0], streams[0], o.count), produce(ep, 1, bufs[1], streams[1], o.count));
    double sec = std::chrono::duration<double>(clk::now() - t0).count();
    const std::size_t bytes = static_cast<std::size_t>(o.count) * o.size;
    std::printf("producer: %d messages of %zu bytes (%.1f MiB in all) filled and sent in %.3f s: %.2f GB/s, path %s\n",
                o.count, o.size, static_cast<double>(bytes) / (1 << 20), sec, gbps(bytes, sec),
                gdr::to_string(ep.last_path()));
    co_await ep.close();
  }());
  sched.drain();
  return 0;
}

// ---------------------------------------------------------------- consumer

// One lane of the consumer. A receive into the buffer must not overwrite it
// while the previous check kernel still reads it: `after(s)` makes the
// receive's host-to-device copies wait on the GPU for that kernel.
gdr::task<> consume(const gdr::tcp::endpoint& ep, int lane, device_words& buf, const gdr::cuda::stream& s,
                    unsigned long long* errors, int count) {
  check(cudaMemsetAsync(errors, 0, sizeof *errors, s.get()), "cudaMemsetAsync");  // before the lane's checks
  for (int i = lane; i < count; i += 2) {
    std::size_t n = co_await ep.recv(buf.view(), tag_of(lane), gdr::cuda::after(s));
    if (n != buf.size_bytes())
      throw std::runtime_error("message " + std::to_string(i) + " has " + std::to_string(n) + " bytes, not " +
                               std::to_string(buf.size_bytes()));
    // Ordered after the receive's copies: it completed, and the copies ran
    // on the GPU before it did.
    check(launch_check(buf.data(), buf.size(), seed_of(i), errors, s.get()), "launch_check");
  }
  co_await gdr::cuda::synchronize(s);  // the lane's last check kernel
}

// Listens on 127.0.0.1, port 0, writes the port the kernel chose into
// `port_fd`, then receives and checks. Returns 0 when every word matched.
int run_consumer(const options& o, int port_fd) {
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});  // as the producer, for the same reason
  gdr::cuda::event_poller events(sched);
  const std::size_t words = o.size / sizeof(std::uint32_t);
  gdr::cuda::stream streams[2] = {gdr::cuda::stream(0), gdr::cuda::stream(0)};
  device_words bufs[2] = {device_words(words, 0), device_words(words, 0)};
  gdr::buffer<unsigned long long, gdr::Device> errors(2, 0);  // one counter per lane
  gdr::buffer<unsigned long long, gdr::Pinned> host_errors(2);
  gdr::tcp::listener listener(sched, gdr::tcp::address::loopback(0), endpoint_options(o));
  std::uint16_t port = listener.local_address().port();
  if (::write(port_fd, &port, sizeof port) != static_cast<ssize_t>(sizeof port))
    throw std::system_error(errno, std::generic_category(), "writing the port to the producer");
  ::close(port_fd);
  unsigned long long mismatches = 0;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    gdr::tcp::endpoint ep = co_await listener.accept();
    auto t0 = clk::now();
    co_await gdr::when_all(consume(ep, 0, bufs[0], streams[0], errors.data(), o.count),
                           consume(ep, 1, bufs[1], streams[1], errors.data() + 1, o.count));
    double sec = std::chrono::duration<double>(clk::now() - t0).count();
    // Both lanes' streams are idle: any stream may carry the copy.
    co_await gdr::copy(host_errors, errors, streams[0]);
    mismatches = host_errors[0] + host_errors[1];
    const std::size_t bytes = static_cast<std::size_t>(o.count) * o.size;
    std::printf("consumer: %d messages of %zu bytes (%.1f MiB in all) received and checked in %.3f s: %.2f GB/s, "
                "path %s; %llu mismatched words\n",
                o.count, o.size, static_cast<double>(bytes) / (1 << 20), sec, gbps(bytes, sec),
                gdr::to_string(ep.last_path()), mismatches);
    co_await ep.close();
  }());
  sched.drain();
  return mismatches == 0 ? 0 : 1;
}

// Waits for the consumer to exit and returns its exit status, or -1 if it
// was killed. One still running after `grace` (waiting for a producer that
// failed before it connected) is killed.
int reap(pid_t pid, std::chrono::seconds grace) {
  int status = 0;
  const auto deadline = clk::now() + grace;
  pid_t r;
  while ((r = ::waitpid(pid, &status, WNOHANG)) == 0) {
    if (clk::now() >= deadline) {
      ::kill(pid, SIGKILL);
      r = ::waitpid(pid, &status, 0);
      break;
    }
    ::usleep(10 * 1000);
  }
  if (r != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) {
    std::perror("gpu_pipeline: pipe");
    return 1;
  }
  // Fork before any CUDA call: a process that initialized CUDA must not fork
  // a child that uses CUDA. Each process probes the GPU after the fork.
  std::fflush(stdout);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) {
    std::perror("gpu_pipeline: fork");
    return 1;
  }
  if (child == 0) {
    // The consumer. It dies with the producer, its parent (also if the
    // parent died before the prctl).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) std::_Exit(1);
    ::close(pipe_fds[0]);
    int rc = 0;
    // Without a GPU: exit quietly, closing the pipe; the producer sees the
    // same machine and says why.
    if (gdr::cuda::device_unavailable_reason(0).empty()) {
      try {
        rc = run_consumer(o, pipe_fds[1]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "gpu_pipeline consumer: %s\n", e.what());
        rc = 1;
      }
    }
    std::fflush(stdout);
    std::_Exit(rc);
  }

  // The producer.
  ::close(pipe_fds[1]);
  int rc = 0;
  if (std::string why = gdr::cuda::device_unavailable_reason(0); !why.empty()) {
    std::printf("gpu_pipeline: no GPU here (%s); nothing to do\n", why.c_str());
    std::fflush(stdout);
    ::close(pipe_fds[0]);
    reap(child, std::chrono::seconds(10));
    return 0;
  }
  std::uint16_t port = 0;
  if (::read(pipe_fds[0], &port, sizeof port) != static_cast<ssize_t>(sizeof port)) {
    std::fprintf(stderr, "gpu_pipeline: the consumer did not start\n");
    rc = 1;
  }
  ::close(pipe_fds[0]);
  if (rc == 0) {
    try {
      rc = run_producer(o, port);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gpu_pipeline producer: %s\n", e.what());
      rc = 1;
    }
  }
  std::fflush(stdout);
  // After a success the consumer is finishing its last check; after a
  // failure it may be waiting for a connection that will not come.
  const int child_rc = reap(child, std::chrono::seconds(rc == 0 ? 30 : 5));
  if (child_rc != 0) {
    if (child_rc < 0) std::fprintf(stderr, "gpu_pipeline: the consumer was killed\n");
    else std::fprintf(stderr, "gpu_pipeline: the consumer failed (exit %d)\n", child_rc);
    rc = 1;
  }
  return rc;
}
