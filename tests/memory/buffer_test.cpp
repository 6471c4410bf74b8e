// gdr::buffer<T, S>: owning, move-only, allocated through the space's
// resource. Host and Pinned run everywhere; Device runs on a GPU and, without
// one, checks that construction fails with no_device and says why.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gdr/memory/buffer.hpp>

#include "tests/memory/memory_test_support.hpp"
#include "tests/support/skip.hpp"

static_assert(!std::is_copy_constructible_v<gdr::buffer<int, gdr::Host>>);
static_assert(!std::is_copy_assignable_v<gdr::buffer<int, gdr::Pinned>>);
static_assert(std::is_nothrow_move_constructible_v<gdr::buffer<int, gdr::Host>>);
static_assert(std::is_nothrow_move_assignable_v<gdr::buffer<int, gdr::Pinned>>);
static_assert(std::is_convertible_v<gdr::buffer<int, gdr::Host>&, gdr::view<int, gdr::Host>>);
static_assert(std::is_convertible_v<const gdr::buffer<int, gdr::Pinned>&, gdr::view<const int, gdr::Pinned>>);

TEST_CASE_TEMPLATE("a host-accessible buffer holds count elements the host can use", S, gdr::Host, gdr::Pinned) {
  gdr::buffer<std::uint32_t, S> b(1000);
  CHECK(b.size() == 1000);
  CHECK(b.size_bytes() == 4000);
  CHECK_FALSE(b.empty());
  CHECK(b.device() == -1);
  std::iota(b.begin(), b.end(), 1u);
  CHECK(b[0] == 1);
  CHECK(b[999] == 1000);
  CHECK(std::accumulate(b.begin(), b.end(), std::uint64_t{0}) == 1000ull * 1001 / 2);
  gdr::view<std::uint32_t, S> v = b.view();
  CHECK(v.data() == b.data());
  CHECK(v.size() == b.size());
  CHECK(b.span().size() == 1000);
  const auto& cb = b;
  CHECK(cb[5] == 6);
  CHECK(cb.view().data() == b.data());
}

TEST_CASE_TEMPLATE("moving a buffer moves ownership and leaves the source empty", S, gdr::Host, gdr::Pinned) {
  gdr::buffer<int, S> a(16);
  std::fill(a.begin(), a.end(), 7);
  int* p = a.data();
  gdr::buffer<int, S> b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.size() == 16);
  CHECK(a.data() == nullptr);  // NOLINT: testing the moved-from state
  CHECK(a.size() == 0);
  gdr::buffer<int, S> c(4);
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(c[15] == 7);
  CHECK(b.empty());  // NOLINT
}

TEST_CASE_TEMPLATE("an empty buffer allocates nothing", S, gdr::Host, gdr::Pinned) {
  gdr::buffer<double, S> e;
  CHECK(e.empty());
  CHECK(e.data() == nullptr);
  CHECK(e.method() == gdr::alloc_method::none);
  gdr::buffer<double, S> z(0);
  CHECK(z.empty());
  CHECK(z.begin() == z.end());
}

TEST_CASE("a pinned buffer says how it was page-locked") {
  gdr::buffer<char, gdr::Pinned> b(4096);
#if GDR_HAS_CUDA
  if (gdr_test::no_gpu_reason().empty()) {
    CHECK(b.method() == gdr::alloc_method::cuda_host_alloc);
  } else {
    CHECK(b.method() == gdr::alloc_method::mmap_mlock);
  }
#else
  CHECK(b.method() == gdr::alloc_method::mmap_mlock);
#endif
}

TEST_CASE("an element count whose byte size overflows is invalid_argument, not a short allocation") {
  using u64_buffer = gdr::buffer<std::uint64_t, gdr::Host>;
  const std::size_t too_many = u64_buffer::max_size() + 1;
  CHECK_THROWS_AS(u64_buffer{too_many}, gdr::error);
  auto r = u64_buffer::allocate(too_many);
  CHECK(r.error() == gdr::errc::invalid_argument);
}

TEST_CASE("the non-throwing allocate returns a usable buffer") {
  auto r = gdr::buffer<int, gdr::Host>::allocate(8);
  REQUIRE(r.has_value());
  gdr::buffer<int, gdr::Host> b = std::move(r).value();
  b[7] = 3;
  CHECK(b[7] == 3);
}

#if GDR_HAS_CUDA
TEST_CASE("a device buffer is on its GPU, or fails with no_device saying why") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) {
    try {
      gdr::buffer<float, gdr::Device> d(256);
      FAIL("a Device buffer was allocated although the probe says: " << why);
    } catch (const gdr::error& e) {
      CHECK(e.code() == gdr::errc::no_device);
      CHECK(std::string(e.what()).find(why) != std::string::npos);
    }
    CHECK(gdr::buffer<float, gdr::Device>::allocate(256).error() == gdr::errc::no_device);
    GDR_SKIP(why);
  }
  gdr::buffer<float, gdr::Device> d(1 << 20, 0);
  CHECK(d.size() == (1u << 20));
  CHECK(d.device() == 0);
  // The process's rule, vmm_use::automatic by default: 4 MiB is shareable
  // memory where the GPU can make it.
  CHECK(d.method() == (gdr::cuda::vmm_shareable(0) ? gdr::alloc_method::cuda_vmm : gdr::alloc_method::cuda_malloc));
  CHECK(d.view().device() == 0);
  cudaPointerAttributes attr{};
  REQUIRE(cudaPointerGetAttributes(&attr, d.data()) == cudaSuccess);
  CHECK(attr.type == cudaMemoryTypeDevice);
  CHECK(attr.device == 0);
  gdr::buffer<float, gdr::Device> moved = std::move(d);
  CHECK(moved.device() == 0);
  CHECK(d.data() == nullptr);  // NOLINT
}

TEST_CASE("with vmm_use::automatic a device buffer from 1 MiB is shareable memory of the virtual memory API, smaller ones cudaMalloc's") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  if (!gdr::cuda::vmm_shareable(0)) GDR_SKIP("GPU 0 cannot allocate memory shareable by file descriptor");
  const std::size_t before = gdr::cuda::vmm_registry::instance().size();
  gdr::cuda::set_device_allocation({.vmm = gdr::cuda::vmm_use::automatic});
  {
    gdr::buffer<std::byte, gdr::Device> small(64 * 1024), big((3u << 20) + 5);
    CHECK(small.method() == gdr::alloc_method::cuda_malloc);
    CHECK(big.method() == gdr::alloc_method::cuda_vmm);
    CHECK(gdr::cuda::vmm_registry::instance().size() == before + 1);
    // Device memory like any other: the runtime knows it, and copies work.
    cudaPointerAttributes attr{};
    REQUIRE(cudaPointerGetAttributes(&attr, big.data() + 12345) == cudaSuccess);
    CHECK(attr.type == cudaMemoryTypeDevice);
    CHECK(attr.device == 0);
    std::vector<std::byte> in(big.size()), out(big.size());
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::byte>(i * 7 + 1);
    REQUIRE(cudaMemcpy(big.data(), in.data(), in.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemset(big.data(), 0x5a, 5) == cudaSuccess);
    REQUIRE(cudaMemcpy(out.data(), big.data(), out.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    for (std::size_t i = 0; i < 5; ++i) in[i] = std::byte{0x5a};
    CHECK(out == in);
    // Its descriptor is made once, on the first export, and kept.
    gdr::cuda::vmm_block b1, b2;
    std::error_code ec;
    REQUIRE(gdr::cuda::vmm_registry::instance().find_exported(big.data() + 100, 10, b1, ec));
    REQUIRE(!ec);
    REQUIRE(gdr::cuda::vmm_registry::instance().find_exported(big.data(), big.size(), b2, ec));
    CHECK(b1.fd >= 0);
    CHECK(b1.fd == b2.fd);
    CHECK(b1.base == reinterpret_cast<std::uintptr_t>(big.data()));
    CHECK(b1.size >= big.size());
    CHECK((b1.id >> 63) == 1);
    CHECK_FALSE(gdr::cuda::vmm_registry::instance().find_exported(small.data(), 1, b1, ec));
    CHECK_FALSE(gdr::cuda::vmm_registry::instance().find_exported(big.data(), b2.size + 1, b1, ec));
  }
  CHECK(gdr::cuda::vmm_registry::instance().size() == before);
  // The process's rule: never, then always, then back.
  gdr::cuda::set_device_allocation({.vmm = gdr::cuda::vmm_use::never});
  gdr::buffer<std::byte, gdr::Device> plain(8u << 20);
  CHECK(plain.method() == gdr::alloc_method::cuda_malloc);
  gdr::cuda::set_device_allocation({.vmm = gdr::cuda::vmm_use::always});
  gdr::buffer<std::byte, gdr::Device> tiny(8);
  CHECK(tiny.method() == gdr::alloc_method::cuda_vmm);
  gdr::cuda::set_device_allocation({});
  CHECK(gdr::cuda::current_device_allocation().vmm == gdr::cuda::vmm_use::automatic);
}

TEST_CASE("a pinned buffer on a GPU machine is known to CUDA as host memory") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::buffer<int, gdr::Pinned> p(1024);
  cudaPointerAttributes attr{};
  REQUIRE(cudaPointerGetAttributes(&attr, p.data()) == cudaSuccess);
  CHECK(attr.type == cudaMemoryTypeHost);
}
#endif
