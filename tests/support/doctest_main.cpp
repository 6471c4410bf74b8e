// doctest's main() for every gdr_test (linked by tools/gdr_test.bzl).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
