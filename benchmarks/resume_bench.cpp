// (b) The cost of awaiting a gdr::task that completes synchronously, against
// the same work done with a minimal hand-written coroutine.
//
// gdr: a loop of `sum += co_await leaf(i)`, where `leaf` is a `gdr::task<int>`
// that `co_return`s at once: per await, one frame allocated, started, finished
// and freed, and the value handed back. Raw: the same with a coroutine type
// that has only what is needed (a trivial promise holding the int): create,
// `std::coroutine_handle::resume()`, read the value, `destroy()`. A third line,
// resuming one suspended coroutine over and over (no frame per op), is the
// floor of a resume alone. Both leaves are noinline so that neither gets its
// allocation elided (clang can elide the raw one, gcc 12 never does). Same
// process, pinned to one CPU, runs interleaved; prints ns/op and the ratio
// (median of the rounds). No I/O, no scheduler loop involved beyond start.
//
//   ./bazelw run -c opt //benchmarks:resume_bench -- [ops_per_round] [rounds] [cpu] [only]
//
// `only` = raw, gdr or floor runs that variant alone, once, without warm-up:
// for counting instructions with `valgrind --tool=callgrind`.
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <coroutine>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>

#include "benchmarks/bench_util.hpp"

#define BENCH_NOINLINE __attribute__((noinline))

namespace {

// Keeps the compiler from folding the sum away.
template <class T>
inline void keep(T& v) {
  asm volatile("" : "+r"(v) : : "memory");
}

// ---- gdr

BENCH_NOINLINE gdr::task<int> leaf(int i) { co_return i; }

gdr::task<long> gdr_loop(long n) {
  long sum = 0;
  for (long i = 0; i < n; ++i) {
    sum += co_await leaf(static_cast<int>(i));
    keep(sum);
  }
  co_return sum;
}

// ---- raw: the least a lazy coroutine returning an int needs

struct raw_task {
  struct promise_type {
    int value = 0;
    raw_task get_return_object() noexcept { return {std::coroutine_handle<promise_type>::from_promise(*this)}; }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_always final_suspend() noexcept { return {}; }
    void return_value(int v) noexcept { value = v; }
    void unhandled_exception() noexcept { std::terminate(); }
  };
  std::coroutine_handle<promise_type> h;
};

BENCH_NOINLINE raw_task raw_leaf(int i) { co_return i; }

long raw_loop(long n) {
  long sum = 0;
  for (long i = 0; i < n; ++i) {
    auto h = raw_leaf(static_cast<int>(i)).h;
    h.resume();
    sum += h.promise().value;
    h.destroy();
    keep(sum);
  }
  return sum;
}

// ---- the floor: resuming one coroutine that suspends again each time

struct resumable {
  struct promise_type {
    long count = 0;
    resumable get_return_object() noexcept { return {std::coroutine_handle<promise_type>::from_promise(*this)}; }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_always final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
  std::coroutine_handle<promise_type> h;
};

BENCH_NOINLINE resumable counter() {
  for (;;) {
    co_await std::suspend_always{};
    // Reached through h.promise() below; the loop itself is the work.
  }
}

long floor_loop(long n) {
  auto h = counter().h;
  for (long i = 0; i < n; ++i) {
    h.resume();
    keep(i);
  }
  h.destroy();
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  long ops = argc > 1 ? std::atol(argv[1]) : 10'000'000;
  int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  int cpu = argc > 3 ? std::atoi(argv[3]) : 1;
  bench::pin_to_cpu(cpu);
  std::printf("synchronous task await vs raw coroutine, %ld ops per round, %d rounds, pinned to CPU %d\n", ops, rounds,
              cpu);

  gdr::scheduler s;
  auto run_gdr = [&](long n) {
    auto t0 = std::chrono::steady_clock::now();
    long sum = gdr::sync_wait(s, gdr_loop(n));
    double ns = bench::seconds_since(t0) * 1e9 / static_cast<double>(n);
    if (sum != n * (n - 1) / 2) std::abort();
    return ns;
  };
  auto run_raw = [](long n) {
    auto t0 = std::chrono::steady_clock::now();
    long sum = raw_loop(n);
    double ns = bench::seconds_since(t0) * 1e9 / static_cast<double>(n);
    if (sum != n * (n - 1) / 2) std::abort();
    return ns;
  };
  auto run_floor = [](long n) {
    auto t0 = std::chrono::steady_clock::now();
    floor_loop(n);
    return bench::seconds_since(t0) * 1e9 / static_cast<double>(n);
  };
  if (argc > 4) {
    std::string only = argv[4];
    double ns = only == "raw" ? run_raw(ops) : only == "gdr" ? run_gdr(ops) : run_floor(ops);
    std::printf("%s: %.2f ns/op\n", only.c_str(), ns);
    return 0;
  }
  run_gdr(ops / 10);  // warm-up
  run_raw(ops / 10);

  std::vector<double> g, r, f, ratio;
  for (int k = 0; k < rounds; ++k) {
    double a = run_raw(ops);
    double b = run_gdr(ops);
    double c = run_floor(ops);
    r.push_back(a);
    g.push_back(b);
    f.push_back(c);
    ratio.push_back(b / a);
    std::printf("round %d: raw %.2f ns/op  gdr task %.2f ns/op (%.3fx)  resume floor %.2f ns/op\n", k, a, b, b / a, c);
  }
  std::printf("median: raw %.2f ns/op  gdr task %.2f ns/op  resume floor %.2f ns/op\n", bench::median(r),
              bench::median(g), bench::median(f));
  std::printf("ratio gdr/raw (median of rounds): %.3fx  (goal <= 1.2x)\n", bench::median(ratio));
  return 0;
}
