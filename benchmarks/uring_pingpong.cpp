// uring_pingpong: the floor io_uring sets under a loop that sleeps. An
// 8-byte TCP ping-pong over 127.0.0.1 between two pinned processes, written
// without gdr in four ways:
//   raw        blocking send() and recv()
//   coop       io_uring, a single-shot recv armed per message (poll first),
//              ring flags COOP_TASKRUN | TASKRUN_FLAG (gdr's any-thread ring)
//   defer      the same with SINGLE_ISSUER | DEFER_TASKRUN (gdr's default ring)
//   multishot  DEFER_TASKRUN, one multishot recv into a provided-buffer ring,
//              armed once (the kernel keeps the socket's poll armed)
// Every io_uring way submits its send with the wait (one io_uring_enter per
// message and side) and blocks there, as gdr's sleep mode does. Repetitions
// alternate the ways; each prints the median round trip of its repetition,
// then the medians of those, and each way against raw.
//
//   g++ -std=c++20 -O2 -DNDEBUG benchmarks/uring_pingpong.cpp -o uring_pingpong -luring
//   ./uring_pingpong [--cpus A,B] [--reps N] [--iters N]
#include <liburing.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using clk = std::chrono::steady_clock;
enum class way { raw, coop, defer, multishot };
constexpr std::array<way, 4> ways{way::raw, way::coop, way::defer, way::multishot};
const char* name(way w) {
  switch (w) {
    case way::raw: return "raw";
    case way::coop: return "coop";
    case way::defer: return "defer";
    case way::multishot: return "multishot";
  }
  return "?";
}

constexpr std::size_t msg = 8;
constexpr unsigned nbufs = 16;  // provided buffers (multishot)
constexpr unsigned buf_size = 64;
int cpu_a = 2, cpu_b = 3, reps = 7, iters = 20000;
constexpr int warm = 1000;

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (sched_setaffinity(0, sizeof s, &s) != 0) die("sched_setaffinity");
}

void nodelay(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) die("TCP_NODELAY");
}

// One side's ring and, for multishot, its provided buffers.
struct ring_side {
  io_uring ring{};
  io_uring_buf_ring* br = nullptr;
  std::vector<char> bufs;
  way w;
  int fd;

  ring_side(way w_, int fd_) : w(w_), fd(fd_) {
    io_uring_params p{};
    p.flags = w == way::coop ? IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG
                             : IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
    if (int rc = io_uring_queue_init_params(64, &ring, &p); rc < 0) {
      errno = -rc;
      die("io_uring_queue_init_params");
    }
    if (w != way::multishot) return;
    void* mem = nullptr;
    if (posix_memalign(&mem, 4096, nbufs * sizeof(io_uring_buf)) != 0) die("posix_memalign");
    br = static_cast<io_uring_buf_ring*>(mem);
    io_uring_buf_ring_init(br);
    io_uring_buf_reg reg{};
    reg.ring_addr = reinterpret_cast<std::uint64_t>(br);
    reg.ring_entries = nbufs;
    reg.bgid = 0;
    if (int rc = io_uring_register_buf_ring(&ring, &reg, 0); rc < 0) {
      errno = -rc;
      die("io_uring_register_buf_ring");
    }
    bufs.resize(nbufs * buf_size);
    for (unsigned i = 0; i < nbufs; ++i)
      io_uring_buf_ring_add(br, bufs.data() + i * buf_size, buf_size, static_cast<unsigned short>(i),
                            io_uring_buf_ring_mask(nbufs), static_cast<int>(i));
    io_uring_buf_ring_advance(br, nbufs);
  }
  ~ring_side() {
    io_uring_queue_exit(&ring);  // unregisters the buffer ring too
    std::free(br);
  }

  io_uring_sqe* sqe() {
    io_uring_sqe* s = io_uring_get_sqe(&ring);
    if (s == nullptr) die("io_uring_get_sqe");
    return s;
  }
  void arm_recv(char* dst) {
    io_uring_sqe* s = sqe();
    if (w == way::multishot) {
      io_uring_prep_recv_multishot(s, fd, nullptr, 0, 0);
      s->flags |= IOSQE_BUFFER_SELECT;
      s->buf_group = 0;
    } else {
      io_uring_prep_recv(s, fd, dst, msg, 0);
      s->ioprio |= IORING_RECVSEND_POLL_FIRST;  // the socket is empty when it is armed
    }
    io_uring_sqe_set_data64(s, 2);
  }
  void send(const char* src) {
    io_uring_sqe* s = sqe();
    io_uring_prep_send(s, fd, src, msg, MSG_NOSIGNAL);
    io_uring_sqe_set_data64(s, 1);
  }
  // Submits what is queued and waits until a whole message is in `dst`.
  void wait_message(char* dst) {
    std::size_t got = 0;
    while (got < msg) {
      if (io_uring_submit_and_wait(&ring, 1) < 0) die("io_uring_submit_and_wait");
      io_uring_cqe* c;
      while (io_uring_peek_cqe(&ring, &c) == 0) {
        const std::uint64_t tag = c->user_data;
        const int res = c->res;
        const unsigned flags = c->flags;
        io_uring_cqe_seen(&ring, c);
        if (tag == 1) {  // a send
          if (res != static_cast<int>(msg)) die("send (short or failed)");
          continue;
        }
        if (res <= 0) {
          if (res == -ENOBUFS) die("recv: no provided buffer");
          errno = -res;
          die("recv");
        }
        if (w == way::multishot) {
          const unsigned bid = flags >> IORING_CQE_BUFFER_SHIFT;
          std::memcpy(dst + got, bufs.data() + bid * buf_size, static_cast<std::size_t>(res));
          io_uring_buf_ring_add(br, bufs.data() + bid * buf_size, buf_size, static_cast<unsigned short>(bid),
                                io_uring_buf_ring_mask(nbufs), 0);
          io_uring_buf_ring_advance(br, 1);
          if (!(flags & IORING_CQE_F_MORE)) arm_recv(dst);
        }
        got += static_cast<std::size_t>(res);
        if (got < msg && w != way::multishot) {
          io_uring_sqe* s = sqe();
          io_uring_prep_recv(s, fd, dst + got, msg - got, 0);
          io_uring_sqe_set_data64(s, 2);
        }
      }
    }
  }
};

void raw_send(int fd, const char* p) {
  if (::send(fd, p, msg, MSG_NOSIGNAL) != static_cast<ssize_t>(msg)) die("send");
}
void raw_recv(int fd, char* p) {
  std::size_t got = 0;
  while (got < msg) {
    ssize_t k = ::recv(fd, p + got, msg - got, 0);
    if (k <= 0) die("recv");
    got += static_cast<std::size_t>(k);
  }
}

void serve(way w, int fd, int n) {
  char buf[msg];
  if (w == way::raw) {
    for (int i = 0; i < n; ++i) {
      raw_recv(fd, buf);
      raw_send(fd, buf);
    }
    return;
  }
  ring_side r(w, fd);
  r.arm_recv(buf);
  for (int i = 0; i < n; ++i) {
    r.wait_message(buf);
    r.send(buf);
    if (w != way::multishot) r.arm_recv(buf);
  }
  if (io_uring_submit_and_wait(&r.ring, 1) < 0) die("io_uring_submit_and_wait");  // the last send's CQE
}

// The median round trip of `iters` after `warm`, in microseconds.
double drive(way w, int fd) {
  char out[msg] = {1, 2, 3, 4, 5, 6, 7, 8}, in[msg];
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iters));
  auto note = [&](int i, clk::time_point t0) {
    if (i >= warm) us.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
  };
  if (w == way::raw) {
    for (int i = 0; i < warm + iters; ++i) {
      auto t0 = clk::now();
      raw_send(fd, out);
      raw_recv(fd, in);
      note(i, t0);
    }
  } else {
    ring_side r(w, fd);
    r.arm_recv(in);
    for (int i = 0; i < warm + iters; ++i) {
      auto t0 = clk::now();
      r.send(out);
      r.wait_message(in);
      if (w != way::multishot) r.arm_recv(in);
      note(i, t0);
    }
  }
  if (std::memcmp(in, out, msg) != 0) die("echo differs");
  std::nth_element(us.begin(), us.begin() + static_cast<std::ptrdiff_t>(us.size() / 2), us.end());
  return us[us.size() / 2];
}

double run(way w) {
  int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (l < 0) die("socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(l, 1) != 0 ||
      ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    die("listen");
  pid_t child = ::fork();
  if (child < 0) die("fork");
  if (child == 0) {
    pin(cpu_b);
    int fd = ::accept(l, nullptr, nullptr);
    if (fd < 0) die("accept");
    nodelay(fd);
    serve(w, fd, warm + iters);
    ::close(fd);
    std::_Exit(0);
  }
  ::close(l);
  pin(cpu_a);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("connect");
  nodelay(fd);
  double us = drive(w, fd);
  ::close(fd);
  int st = 0;
  if (::waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st) != 0) die("server");
  return us;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--cpus" && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d,%d", &cpu_a, &cpu_b) != 2) die("--cpus A,B");
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--cpus A,B] [--reps N] [--iters N]\n", argv[0]);
      return 2;
    }
  }
  if (reps < 1 || iters < 1) die("--reps and --iters must be positive");
  std::vector<std::vector<double>> all(ways.size());
  for (int r = 0; r < reps; ++r) {
    std::printf("rep %d:", r + 1);
    for (std::size_t k = 0; k < ways.size(); ++k) {
      all[k].push_back(run(ways[k]));
      std::printf("  %s %.2f", name(ways[k]), all[k].back());
    }
    std::printf(" (us, median round trip)\n");
    std::fflush(stdout);
  }
  const double raw = median(all[0]);
  std::printf("median of %d, 8-byte round trip, cpus %d,%d:\n", reps, cpu_a, cpu_b);
  for (std::size_t k = 0; k < ways.size(); ++k)
    std::printf("  %-10s %7.2f us  %.3fx raw\n", name(ways[k]), median(all[k]), median(all[k]) / raw);
  return 0;
}
