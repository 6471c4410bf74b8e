#include <doctest/doctest.h>

#include <gdr/verbs/probe.hpp>

#include <string>

#include "tests/support/skip.hpp"

TEST_CASE("the verbs probe runs once and explains a missing device") {
  const auto& a = gdr::verbs::probe();
  const auto& b = gdr::verbs::probe();
  CHECK(&a == &b);  // cached: one probe per process
  if (a.devices.empty()) {
    CHECK(a.devices_error);
    CHECK_FALSE(a.gpudirect());
    CHECK(a.why_not().find("no RDMA device") != std::string::npos);
    GDR_SKIP("no RDMA device here: " + a.why_not());
  }
  for (const auto& d : a.devices) MESSAGE("verbs device " << d.name << " dma-buf=" << d.dmabuf);
  CHECK(a.why_not().empty() == a.gpudirect());
}

TEST_CASE("require_gpudirect fails loudly with the probe's reason") {
  const auto& caps = gdr::verbs::probe();
  if (caps.gpudirect()) {
    CHECK_NOTHROW(gdr::verbs::require_gpudirect());
    return;
  }
  try {
    gdr::verbs::require_gpudirect();
    FAIL("require_gpudirect returned although the probe says no");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::gpudirect_unavailable);
    CHECK(std::string(e.what()).find(caps.why_not()) != std::string::npos);
  }
}
