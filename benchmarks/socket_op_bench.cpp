// socket_op_bench: what one socket operation costs the way the TCP endpoint
// could issue it, on a connected loopback TCP socket, in one pinned process.
// The numbers behind two choices in gdr/transport/tcp/connection.hpp:
//
//   1. A receive attempt on an empty socket (what a busy-polling reader does
//      while it waits): a recv(MSG_DONTWAIT) system call, against the same
//      attempt as an io_uring SQE (submit, then reap its -EAGAIN CQE). The
//      endpoint spins with the system call.
//   2. Writing a small frame (a 40-byte header and 8 bytes of payload): an
//      io_uring SENDMSG with two iovecs, against an io_uring SEND of the
//      frame copied into one buffer, and a send() system call for reference.
//      The endpoint copies batches of up to connection::small_write bytes.
//
// Rounds alternate the variants; medians are printed, with ratios.
//
//   ./bazelw run -c opt //benchmarks:socket_op_bench -- [rounds] [cpu]
#include <liburing.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "benchmarks/bench_util.hpp"

namespace {

using bench::die;

struct socket_pair {
  int client = -1;  // writes
  int server = -1;  // reads
  socket_pair() {
    std::uint16_t port = 0;
    int l = bench::listen_loopback(port);
    client = bench::connect_loopback(port);
    server = ::accept(l, nullptr, nullptr);
    ::close(l);
  }
  ~socket_pair() {
    ::close(client);
    ::close(server);
  }
};

struct ring {
  io_uring r;
  ring() {
    io_uring_params p{};
    p.flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;  // as gdr::scheduler
    if (io_uring_queue_init_params(64, &r, &p) < 0) die("io_uring_queue_init_params");
  }
  ~ring() { io_uring_queue_exit(&r); }
  int run_one() {
    io_uring_submit(&r);
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe(&r, &cqe) != 0) die("io_uring_wait_cqe");
    int res = cqe->res;
    io_uring_cqe_seen(&r, cqe);
    return res;
  }
};

using clk = std::chrono::steady_clock;
double us_per(clk::time_point t0, long n) {
  return std::chrono::duration<double, std::micro>(clk::now() - t0).count() / static_cast<double>(n);
}

// 1. Receive attempts on an empty socket.
double attempt_syscall(socket_pair& s, long n) {
  char buf[4096];
  auto t0 = clk::now();
  for (long i = 0; i < n; ++i) {
    if (::recv(s.server, buf, sizeof buf, MSG_DONTWAIT) != -1 || errno != EAGAIN) die("recv: not empty");
  }
  return us_per(t0, n);
}

double attempt_uring(socket_pair& s, ring& u, long n) {
  char buf[4096];
  auto t0 = clk::now();
  for (long i = 0; i < n; ++i) {
    io_uring_prep_recv(io_uring_get_sqe(&u.r), s.server, buf, sizeof buf, MSG_DONTWAIT);
    if (u.run_one() != -EAGAIN) die("io_uring recv: not empty");
  }
  return us_per(t0, n);
}

// 2. Small frames; the reader drains every 64 frames so the socket never fills.
enum class write_kind { uring_sendmsg, uring_send_copy, syscall_send };

double small_writes(socket_pair& s, ring& u, long n, write_kind k) {
  constexpr std::size_t hdr_len = 40, payload_len = 8, frame = hdr_len + payload_len;
  char hdr[hdr_len] = {1}, payload[payload_len] = {2}, flat[frame], sink[64 * frame];
  iovec iov[2] = {{hdr, hdr_len}, {payload, payload_len}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = 2;
  auto t0 = clk::now();
  for (long i = 0; i < n; ++i) {
    int res = 0;
    switch (k) {
      case write_kind::uring_sendmsg:
        io_uring_prep_sendmsg(io_uring_get_sqe(&u.r), s.client, &msg, MSG_NOSIGNAL);
        res = u.run_one();
        break;
      case write_kind::uring_send_copy:
        std::memcpy(flat, hdr, hdr_len);
        std::memcpy(flat + hdr_len, payload, payload_len);
        io_uring_prep_send(io_uring_get_sqe(&u.r), s.client, flat, frame, MSG_NOSIGNAL);
        res = u.run_one();
        break;
      case write_kind::syscall_send:
        std::memcpy(flat, hdr, hdr_len);
        std::memcpy(flat + hdr_len, payload, payload_len);
        res = static_cast<int>(::send(s.client, flat, frame, MSG_NOSIGNAL));
        break;
    }
    if (res != static_cast<int>(frame)) die("short or failed write");
    if (i % 64 == 63) {
      std::size_t left = sizeof sink;
      while (left > 0) {
        ssize_t got = ::recv(s.server, sink, left, 0);
        if (got <= 0) die("drain");
        left -= static_cast<std::size_t>(got);
      }
    }
  }
  return us_per(t0, n);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  int cpu = argc > 2 ? std::atoi(argv[2]) : 0;
  bench::pin_to_cpu(cpu);
  socket_pair s;
  ring u;
  constexpr long attempts = 200'000, writes = 64 * 1000;
  std::vector<double> sys_attempt, uring_attempt, sendmsg, send_copy, sys_send;
  for (int r = 0; r < rounds; ++r) {
    sys_attempt.push_back(attempt_syscall(s, attempts));
    uring_attempt.push_back(attempt_uring(s, u, attempts));
    sendmsg.push_back(small_writes(s, u, writes, write_kind::uring_sendmsg));
    send_copy.push_back(small_writes(s, u, writes, write_kind::uring_send_copy));
    sys_send.push_back(small_writes(s, u, writes, write_kind::syscall_send));
  }
  double a_sys = bench::median(sys_attempt), a_uring = bench::median(uring_attempt);
  double w_msg = bench::median(sendmsg), w_copy = bench::median(send_copy), w_sys = bench::median(sys_send);
  std::printf("socket_op_bench: loopback TCP, CPU %d, median of %d rounds (us per operation)\n", cpu, rounds);
  std::printf("receive attempt on an empty socket:\n");
  std::printf("  recv(MSG_DONTWAIT) system call      %7.3f\n", a_sys);
  std::printf("  io_uring recv(MSG_DONTWAIT) SQE+CQE %7.3f   %.2fx the system call\n", a_uring, a_uring / a_sys);
  std::printf("48-byte frame (40-byte header + 8 bytes):\n");
  std::printf("  io_uring sendmsg, 2 iovecs          %7.3f\n", w_msg);
  std::printf("  io_uring send, copied to one buffer %7.3f   %.3fx sendmsg\n", w_copy, w_copy / w_msg);
  std::printf("  send() system call, copied          %7.3f   %.3fx sendmsg\n", w_sys, w_sys / w_msg);
  return 0;
}
