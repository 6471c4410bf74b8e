// Uses gdr as an external Bazel repository (@gdr//:gdr) and includes it the
// way users do. Build and run: cd examples/consumer && ../../bazelw run //:app
#include <gdr/config.hpp>

#include <cstdio>

int main() {
  std::printf("gdr consumer: GDR_HAS_CUDA=%d GDR_HAS_VERBS=%d\n", GDR_HAS_CUDA, GDR_HAS_VERBS);
  return 0;
}
