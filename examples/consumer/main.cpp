// Uses gdr as an external Bazel repository (@gdr//:gdr) and includes it the
// way users do: one coroutine sleeps on gdr's io_uring scheduler. Needs
// io_uring. Build and run: cd examples/consumer && ../../bazelw run //:app
#include <gdr/gdr.hpp>

#include <chrono>
#include <cstdio>

using namespace std::chrono_literals;

gdr::task<int> answer() {
  co_await gdr::sleep_for(1ms);
  co_return 42;
}

int main() {
  gdr::scheduler sched;
  int v = gdr::sync_wait(sched, answer());
  std::printf("gdr consumer: a coroutine on gdr's scheduler returned %d (GDR_HAS_CUDA=%d, GDR_HAS_VERBS=%d)\n", v,
              GDR_HAS_CUDA, GDR_HAS_VERBS);
  return v == 42 ? 0 : 1;
}
