// Deliberately buggy: must FAIL under --config=asan (checks the config).
#include <doctest/doctest.h>

TEST_CASE("use-after-free is caught under --config=asan") {
  int* p = new int[4];
  delete[] p;
  volatile int x = p[1];  // heap-use-after-free, seen by ASan only
  (void)x;
}
