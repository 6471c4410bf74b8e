// The GPU's half of the GPUDirect probe (gdr/transport/verbs/gpudirect.hpp),
// which runs wherever there is a GPU, with or without an RDMA device: on a
// GPU machine without a NIC it reads the GPU's attributes and then refuses
// at the NIC check; without a GPU it refuses at the driver check. Either way
// the refusal names its check and a zero-copy Device endpoint is not made.
//
// The registration route's GPU half runs here too: device memory exported
// as a dma-buf (what `ibv_reg_dmabuf_mr` is then given), at the offset of
// an address that is not page-aligned.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gdr/transport/verbs/gpudirect.hpp>

#include "tests/support/skip.hpp"

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

TEST_CASE("device memory exports as a dma-buf of whole pages, with the address's offset in it") {
  if (!has_cuda_driver()) GDR_SKIP("no CUDA driver or GPU here");
  const auto& cu = gdr::verbs::detail::load_cuda_driver();
  gdr::verbs::detail::CUdevice_t dev = 0;
  void* ctx = nullptr;
  REQUIRE(cu.cuDeviceGet(&dev, 0) == 0);
  REQUIRE(cu.cuDevicePrimaryCtxRetain(&ctx, dev) == 0);
  REQUIRE(cu.cuCtxSetCurrent(ctx) == 0);
  gdr::verbs::detail::CUdeviceptr_t p = 0;
  REQUIRE(cu.cuMemAlloc(&p, std::size_t{3} << 20) == 0);
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t addr = p + 12345;
  auto d = gdr::verbs::detail::export_dmabuf(addr, 100000);
  int gpu_dma_buf = 0;
  cu.cuDeviceGetAttribute(&gpu_dma_buf, gdr::verbs::detail::cu_attr_dma_buf_supported, dev);
  if (gpu_dma_buf == 0) {
    CHECK_FALSE(d);  // the driver cannot export: the registration fails, loudly
  } else {
    REQUIRE(d);
    CHECK(d->fd >= 0);
    CHECK(d->offset == addr % page);
    CHECK(d->length % page == 0);
    CHECK(d->length >= d->offset + 100000);
    CHECK(d->length < d->offset + 100000 + page);
    // A dma-buf tells its size.
    off_t size = ::lseek(d->fd, 0, SEEK_END);
    MESSAGE("dma-buf of " << d->length << " bytes at offset " << d->offset << ": lseek says " << size);
    if (size >= 0) CHECK(static_cast<std::uint64_t>(size) == d->length);
    ::close(d->fd);
  }
  // Host memory is not device memory: the route refuses it.
  std::vector<std::byte> h(4096);
  auto e = gdr::verbs::detail::export_dmabuf(reinterpret_cast<std::uintptr_t>(h.data()), h.size());
  CHECK_FALSE(e);
  cu.cuMemFree(p);
  cu.cuDevicePrimaryCtxRelease(dev);
}
