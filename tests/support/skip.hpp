/// \file
/// GDR_SKIP(reason): end the current doctest TEST_CASE early because the
/// machine lacks something it needs (a GPU, an RDMA device, a driver).
///
/// Bazel 4 has no "skipped" test status, so a skip is a line on stdout,
/// `[gdr-skip] <test case name>: <reason>`, that .ci/run counts as skipped
/// instead of passed. Use it directly in the TEST_CASE body (it `return`s from
/// the enclosing function), before any SUBCASE:
///
///     TEST_CASE("a device buffer round-trips through the NIC") {
///       if (!has_rdma_device()) GDR_SKIP("no RDMA device");
///       ...
///     }
#pragma once

#include <doctest/doctest.h>

#include <iostream>

// doctest::detail::g_cs (the runner's state) is only declared in the
// translation unit that implements doctest; getContextOptions() is the public
// way to the test case being run.
#define GDR_SKIP(reason)                                                       \
  do {                                                                         \
    std::cout << "[gdr-skip] "                                                 \
              << ::doctest::getContextOptions()->currentTest->m_name << ": "   \
              << (reason) << std::endl;                                        \
    return;                                                                    \
  } while (0)
