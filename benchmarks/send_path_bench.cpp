// send_path_bench: which io_uring write moves a stream of large messages
// fastest over loopback TCP. The TCP issue asked to try IORING_OP_SEND_ZC and
// registered buffers and to keep what measures faster; this is that
// measurement, on bare liburing so that only the write differs.
//
// A receiver process reads with blocking recv() into one buffer; the sender
// process (pinned to another CPU) writes `count` messages of `size` bytes,
// one write in flight, with:
//   send()            the system call, for reference
//   sendmsg           io_uring SENDMSG (what the TCP endpoint uses)
//   send              io_uring SEND
//   send fixed        io_uring SEND from a registered buffer (IORING_RECVSEND_FIXED_BUF)
//   send_zc           io_uring SEND_ZC (the endpoint's zero_copy_send_threshold)
//   send_zc fixed     io_uring SEND_ZC from a registered buffer
// A variant the kernel refuses prints why and is skipped. Rounds alternate
// the variants; medians of GB/s are printed with the ratio to sendmsg.
//
//   ./bazelw run -c opt //benchmarks:send_path_bench -- [size] [rounds] [cpu_rx,cpu_tx]
#include <liburing.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/bench_util.hpp"

namespace {

enum class kind { syscall, sendmsg, send, send_fixed, send_zc, send_zc_fixed };
constexpr kind kinds[] = {kind::syscall, kind::sendmsg, kind::send, kind::send_fixed, kind::send_zc, kind::send_zc_fixed};
const char* name(kind k) {
  switch (k) {
    case kind::syscall: return "send() system call";
    case kind::sendmsg: return "io_uring sendmsg";
    case kind::send: return "io_uring send";
    case kind::send_fixed: return "io_uring send, registered buffer";
    case kind::send_zc: return "io_uring send_zc";
    case kind::send_zc_fixed: return "io_uring send_zc, registered buffer";
  }
  return "?";
}

using bench::die;

// Writes `count` messages; returns GB/s, or a negative -errno if the kernel
// refused the variant.
double sender(int fd, kind k, std::size_t size, std::size_t count) {
  std::vector<char> buf(size, 1);
  io_uring ring;
  io_uring_params p{};
  p.flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;  // as gdr::scheduler
  if (io_uring_queue_init_params(8, &ring, &p) < 0) die("io_uring_queue_init_params");
  if (k == kind::send_fixed || k == kind::send_zc_fixed) {
    iovec reg{buf.data(), size};
    if (int rc = io_uring_register_buffers(&ring, &reg, 1); rc < 0) return rc;
  }
  auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < count; ++i) {
    std::size_t off = 0;
    while (off < size) {
      char* p0 = buf.data() + off;
      std::size_t len = size - off;
      long res = 0;
      if (k == kind::syscall) {
        res = ::send(fd, p0, len, MSG_NOSIGNAL);
        if (res < 0) res = -errno;
      } else {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring);
        iovec iov{p0, len};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        switch (k) {
          case kind::sendmsg: io_uring_prep_sendmsg(sqe, fd, &msg, MSG_NOSIGNAL); break;
          case kind::send: io_uring_prep_send(sqe, fd, p0, len, MSG_NOSIGNAL); break;
          case kind::send_fixed:
            io_uring_prep_send(sqe, fd, p0, len, MSG_NOSIGNAL);
            sqe->ioprio |= IORING_RECVSEND_FIXED_BUF;
            sqe->buf_index = 0;
            break;
          case kind::send_zc: io_uring_prep_send_zc(sqe, fd, p0, len, MSG_NOSIGNAL, 0); break;
          case kind::send_zc_fixed: io_uring_prep_send_zc_fixed(sqe, fd, p0, len, MSG_NOSIGNAL, 0, 0); break;
          case kind::syscall: break;
        }
        io_uring_submit(&ring);
        // One CQE, or for SEND_ZC the result (F_MORE) and then the
        // notification: the buffer is reusable only after it.
        bool more = true;
        while (more) {
          io_uring_cqe* cqe = nullptr;
          if (io_uring_wait_cqe(&ring, &cqe) != 0) die("io_uring_wait_cqe");
          if (!(cqe->flags & IORING_CQE_F_NOTIF)) res = cqe->res;
          more = (cqe->flags & IORING_CQE_F_MORE) != 0;
          io_uring_cqe_seen(&ring, cqe);
        }
      }
      if (res == -EINVAL || res == -EOPNOTSUPP || res == -EFAULT) {
        if (i == 0 && off == 0) return static_cast<double>(res);
      }
      if (res <= 0) die("write");
      off += static_cast<std::size_t>(res);
    }
  }
  double s = bench::seconds_since(t0);
  io_uring_queue_exit(&ring);
  return static_cast<double>(size) * static_cast<double>(count) / s / 1e9;
}

// One measurement in two fresh processes; the sender's result comes back
// through a pipe.
double measure(kind k, std::size_t size, std::size_t count, int cpu_rx, int cpu_tx) {
  std::uint16_t port = 0;
  int l = bench::listen_loopback(port);
  pid_t rx = ::fork();
  if (rx == 0) {
    bench::pin_to_cpu(cpu_rx);
    int s = ::accept(l, nullptr, nullptr);
    std::vector<char> buf(size);
    for (;;) {
      ssize_t n = ::recv(s, buf.data(), buf.size(), 0);
      if (n <= 0) std::_Exit(0);
    }
  }
  ::close(l);
  int pipefd[2];
  if (::pipe(pipefd) != 0) die("pipe");
  pid_t tx = ::fork();
  if (tx == 0) {
    bench::pin_to_cpu(cpu_tx);
    double r = sender(bench::connect_loopback(port), k, size, count);
    if (::write(pipefd[1], &r, sizeof r) != sizeof r) std::_Exit(2);
    std::_Exit(0);
  }
  ::close(pipefd[1]);
  double r = -1;
  if (::read(pipefd[0], &r, sizeof r) != sizeof r) r = -1;
  ::close(pipefd[0]);
  ::waitpid(tx, nullptr, 0);
  ::waitpid(rx, nullptr, 0);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t size = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (1u << 20);
  int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  int cpu_rx = 0, cpu_tx = 1;
  if (argc > 3) std::sscanf(argv[3], "%d,%d", &cpu_rx, &cpu_tx);
  std::size_t count = std::max<std::size_t>(16, (std::size_t{1} << 30) / size);  // 1 GiB a run
  std::vector<std::vector<double>> gbps(std::size(kinds));
  std::vector<std::string> refused(std::size(kinds));
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t i = 0; i < std::size(kinds); ++i) {
      if (!refused[i].empty()) continue;
      double v = measure(kinds[i], size, count, cpu_rx, cpu_tx);
      if (v < 0) {
        refused[i] = v == -1 ? std::string("the run failed") : std::strerror(static_cast<int>(-v));
        continue;
      }
      gbps[i].push_back(v);
    }
  }
  std::printf("send_path_bench: loopback TCP stream of %zu-byte messages, 1 GiB a run, receiver CPU %d, sender CPU %d,"
              " median of %d rounds\n", size, cpu_rx, cpu_tx, rounds);
  double base = gbps[1].empty() ? 0 : bench::median(gbps[1]);
  for (std::size_t i = 0; i < std::size(kinds); ++i) {
    if (!refused[i].empty() || gbps[i].empty()) {
      std::printf("  %-36s refused: %s\n", name(kinds[i]), refused[i].c_str());
      continue;
    }
    double m = bench::median(gbps[i]);
    std::printf("  %-36s %7.3f GB/s   %.2fx sendmsg\n", name(kinds[i]), m, base > 0 ? m / base : 0.0);
  }
  return 0;
}
