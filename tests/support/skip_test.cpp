// Sanity test of GDR_SKIP: the first case skips (and must not reach the
// failing check), the second runs. .ci/run counts 1 passed, 1 skipped.
#include "tests/support/skip.hpp"

#include <doctest/doctest.h>

#include <gdr/config.hpp>

TEST_CASE("GDR_SKIP ends the test case before the rest of its body") {
  GDR_SKIP("demonstrates the skip line");
  FAIL("unreachable: GDR_SKIP must return");
}

TEST_CASE("a test case without GDR_SKIP runs") {
  CHECK(GDR_HAS_CUDA == 0);
}
