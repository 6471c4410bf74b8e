// gdr/cuda/device.hpp: the probe says why there is no GPU; on a GPU it
// reports the device and its GPUDirect RDMA attribute.
#include <doctest/doctest.h>

#include <ostream>
#include <string>

#include <gdr/cuda/device.hpp>

#include "tests/cuda/cuda_test_support.hpp"
#include "tests/support/skip.hpp"

TEST_CASE("the probe either finds a GPU or says why not") {
  const auto& p = gdr::cuda::probe_devices();
  CHECK(&p == &gdr::cuda::probe_devices());  // runs once
  CHECK(p.runtime_version == CUDART_VERSION);
  if (p.usable()) {
    CHECK(p.reason.empty());
    CHECK(p.count > 0);
    CHECK(gdr::cuda::device_count().value() == p.count);
  } else {
    MESSAGE("probe: " << p.reason);
    CHECK_FALSE(p.reason.empty());
    CHECK(p.count == 0);
    CHECK(gdr::cuda::device_count().error() == gdr::errc::no_device);
    // The reason names the runtime's verdict, so the cause can be told apart.
    CHECK((p.reason.find("driver") != std::string::npos || p.reason.find("device") != std::string::npos));
    if (p.status == cudaErrorInsufficientDriver && p.driver_version == 0)
      CHECK(p.reason.find("no CUDA driver") != std::string::npos);
  }
}

TEST_CASE("a negative or too large ordinal is unavailable, with a reason") {
  CHECK_FALSE(gdr::cuda::device_unavailable_reason(-1).empty());
  CHECK_FALSE(gdr::cuda::device_unavailable_reason(1 << 20).empty());
  CHECK(gdr::cuda::gpudirect_rdma_supported(1 << 20).error() == gdr::errc::no_device);
}

TEST_CASE("a GPU reports its name, capability and GPUDirect RDMA attribute") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  auto info = gdr::cuda::query_device(0);
  REQUIRE(info.has_value());
  auto rdma = gdr::cuda::gpudirect_rdma_supported(0);
  REQUIRE(rdma.has_value());
  MESSAGE("device 0: " << info->name << ", sm_" << info->cc_major << info->cc_minor << ", "
                       << (info->total_memory >> 30) << " GiB, GPUDirect RDMA attribute " << *rdma);
  CHECK(info->cc_major >= 3);
  CHECK(gdr::cuda::device_unavailable_reason(0).empty());
}

TEST_CASE("device_guard switches the current device for a scope and restores it") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  const int n = gdr::cuda::device_count().value();
  int before = -1;
  REQUIRE(cudaGetDevice(&before) == cudaSuccess);
  const int other = n > 1 ? (before + 1) % n : before;
  {
    gdr::cuda::device_guard g(other);
    CHECK_FALSE(g.error());
    int now = -1;
    REQUIRE(cudaGetDevice(&now) == cudaSuccess);
    CHECK(now == other);
  }
  int after = -1;
  REQUIRE(cudaGetDevice(&after) == cudaSuccess);
  CHECK(after == before);
}
