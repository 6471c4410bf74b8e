// The GPU's half of the GPUDirect probe (gdr/transport/verbs/gpudirect.hpp),
// which runs wherever there is a GPU, with or without an RDMA device: on a
// GPU machine without a NIC it reads the GPU's attributes and then refuses
// at the NIC check; without a GPU it refuses at the driver check. Either way
// the refusal names its check and a zero-copy Device endpoint is not made.
#include <doctest/doctest.h>

#include <string>

#include <gdr/transport/verbs/gpudirect.hpp>

namespace {

bool has_cuda_driver() {
  const auto& cu = gdr::verbs::detail::load_cuda_driver();
  if (!cu.error.empty() || cu.cuInit(0) != 0) return false;
  int n = 0;
  return cu.cuDeviceGetCount(&n) == 0 && n > 0;
}

}  // namespace

TEST_CASE("without a NIC the probe reads the GPU's half, then refuses at the NIC check") {
  gdr::verbs::gpudirect_report r = gdr::verbs::detail::run_gpudirect_probe(0, nullptr);
  CHECK_FALSE(r.available);
  CHECK(r.route.empty());
  CHECK(r.reason.find("GPUDirect RDMA between GPU 0") != std::string::npos);
  if (!has_cuda_driver()) {
    MESSAGE("no CUDA driver or GPU here: " << r.reason);
    CHECK(r.failed_check == "cuda-driver");
    CHECK(r.gpu_dma_buf == -1);
    CHECK(r.writes_ordering == -1);
    return;
  }
  MESSAGE("GPU 0: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=" << r.gpu_dma_buf
          << " GPU_DIRECT_RDMA_WRITES_ORDERING=" << r.writes_ordering
          << " needs_flush=" << r.needs_flush << "; " << r.reason);
  CHECK(r.failed_check == "nic-dma-buf");
  CHECK(r.reason.find("no RDMA device") != std::string::npos);
  CHECK((r.gpu_dma_buf == 0 || r.gpu_dma_buf == 1));
  // CUflushGPUDirectRDMAWritesScope: NONE 0, OWNER 100, ALL_DEVICES 200.
  CHECK((r.writes_ordering == 0 || r.writes_ordering == 100 || r.writes_ordering == 200));
  CHECK(r.needs_flush == (r.writes_ordering < 100));
}

TEST_CASE("a GPU ordinal that does not exist is refused at the driver check, by number") {
  gdr::verbs::gpudirect_report r = gdr::verbs::detail::run_gpudirect_probe(4096, nullptr);
  CHECK_FALSE(r.available);
  CHECK(r.failed_check == "cuda-driver");
  if (has_cuda_driver()) CHECK(r.reason.find("no GPU 4096") != std::string::npos);
}

TEST_CASE("the probe of a pair runs once: the same report comes back") {
  const auto& a = gdr::verbs::probe_gpudirect(0, nullptr);
  const auto& b = gdr::verbs::probe_gpudirect(0, nullptr);
  CHECK(&a == &b);
  CHECK_FALSE(a.available);
}
