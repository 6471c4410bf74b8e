// (a) io_uring NOP through gdr's scheduler against a raw liburing NOP loop.
//
// gdr: `depth` coroutines, each looping `co_await gdr::nop()`, under
// `when_all`, in busy_poll and in sleep mode. Raw: one loop that prepares
// `depth` NOPs, submits them with one io_uring_enter, and reaps the `depth`
// CQEs. Same ring size and setup flags, same batch depth, same process, pinned
// to one CPU, runs interleaved; prints ops/s and gdr/raw ratios (the median of
// the rounds). Needs only io_uring.
//
//   ./bazelw run -c opt //benchmarks:nop_bench -- [ops_per_round] [rounds] [cpu] [only]
//
// `only` = raw, busy or sleep runs that variant alone, once, without warm-up:
// for counting instructions with `valgrind --tool=callgrind`.
#include <liburing.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/sched/timer.hpp>

#include "benchmarks/bench_util.hpp"

namespace {

constexpr unsigned depth = 32;
constexpr unsigned ring_entries = 256;  // gdr's default scheduler_options::sq_entries

// The raw loop, with the same setup flags as gdr::scheduler.
double raw_ops_per_s(long ops) {
  io_uring ring;
  io_uring_params p{};
  p.flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
  if (io_uring_queue_init_params(ring_entries, &ring, &p) < 0) {
    std::perror("io_uring_queue_init_params");
    std::exit(1);
  }
  long rounds = ops / depth;
  auto t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < rounds; ++r) {
    for (unsigned i = 0; i < depth; ++i) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, i + 1);
    }
    io_uring_submit(&ring);
    unsigned reaped = 0;
    while (reaped < depth) {
      io_uring_cqe* cqes[depth];
      unsigned n = io_uring_peek_batch_cqe(&ring, cqes, depth - reaped);
      if (n == 0) {
        io_uring_cqe* cqe;
        io_uring_wait_cqe(&ring, &cqe);
        continue;
      }
      for (unsigned i = 0; i < n; ++i) {
        if (cqes[i]->res < 0) std::abort();
      }
      io_uring_cq_advance(&ring, n);
      reaped += n;
    }
  }
  double s = bench::seconds_since(t0);
  io_uring_queue_exit(&ring);
  return static_cast<double>(rounds * depth) / s;
}

gdr::task<void> nop_loop(long n) {
  for (long i = 0; i < n; ++i) co_await gdr::nop();
}

double gdr_ops_per_s(long ops, gdr::run_mode mode) {
  gdr::scheduler s({.sq_entries = ring_entries, .mode = mode});
  long per = ops / depth;
  std::vector<gdr::task<void>> loops;
  for (unsigned i = 0; i < depth; ++i) loops.push_back(nop_loop(per));
  auto t0 = std::chrono::steady_clock::now();
  gdr::sync_wait(s, gdr::when_all(std::move(loops)));
  double secs = bench::seconds_since(t0);
  if (s.stats().completions != static_cast<std::uint64_t>(per * depth)) std::abort();
  return static_cast<double>(per * depth) / secs;
}

}  // namespace

int main(int argc, char** argv) {
  long ops = argc > 1 ? std::atol(argv[1]) : 2'000'000;
  int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  int cpu = argc > 3 ? std::atoi(argv[3]) : 1;
  if (argc > 4) {
    std::string only = argv[4];
    double r = only == "raw"    ? raw_ops_per_s(ops)
               : only == "busy" ? gdr_ops_per_s(ops, gdr::run_mode::busy_poll)
                                : gdr_ops_per_s(ops, gdr::run_mode::sleep);
    std::printf("%s: %.2f Mops/s\n", only.c_str(), r / 1e6);
    return 0;
  }
  bench::pin_to_cpu(cpu);

  std::printf("io_uring NOP, %u in flight, %ld ops per round, %d rounds, pinned to CPU %d\n", depth, ops, rounds,
              cpu);
  // Warm-up: page in the rings and the allocator.
  raw_ops_per_s(ops / 10);
  gdr_ops_per_s(ops / 10, gdr::run_mode::busy_poll);

  std::vector<double> raw, busy, sleep, r_busy, r_sleep;
  for (int r = 0; r < rounds; ++r) {
    double a = raw_ops_per_s(ops);
    double b = gdr_ops_per_s(ops, gdr::run_mode::busy_poll);
    double c = gdr_ops_per_s(ops, gdr::run_mode::sleep);
    raw.push_back(a);
    busy.push_back(b);
    sleep.push_back(c);
    r_busy.push_back(b / a);
    r_sleep.push_back(c / a);
    std::printf("round %d: raw %.2f Mops/s  gdr busy_poll %.2f (%.3fx)  gdr sleep %.2f (%.3fx)\n", r, a / 1e6,
                b / 1e6, b / a, c / 1e6, c / a);
  }
  std::printf("median: raw %.2f Mops/s (%.1f ns/op)  gdr busy_poll %.2f Mops/s (%.1f ns/op)  gdr sleep %.2f Mops/s "
              "(%.1f ns/op)\n",
              bench::median(raw) / 1e6, 1e9 / bench::median(raw), bench::median(busy) / 1e6,
              1e9 / bench::median(busy), bench::median(sleep) / 1e6, 1e9 / bench::median(sleep));
  std::printf("ratio gdr/raw (median of rounds): busy_poll %.3fx  sleep %.3fx  (goal >= 0.9x)\n",
              bench::median(r_busy), bench::median(r_sleep));
  return 0;
}
