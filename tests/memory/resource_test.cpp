// memory_resource<S>: where buffers get their bytes. Host and Pinned run
// everywhere; Pinned is checked to be really page-locked (VmLck grows when
// gdr locks the pages itself). Device runs where there is a GPU and otherwise
// checks that the failure says why.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include <gdr/memory/resource.hpp>

#include "tests/memory/memory_test_support.hpp"
#include "tests/support/skip.hpp"

// The sanitizers' common runtime (ASan, TSan) intercepts mlock and ignores it.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define GDR_TEST_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define GDR_TEST_SANITIZER 1
#endif
#endif
#ifndef GDR_TEST_SANITIZER
#define GDR_TEST_SANITIZER 0
#endif

namespace {
// Locked memory of this process in KiB, from /proc/self/status.
long vm_locked_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmLck:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}
}  // namespace

TEST_CASE("host allocations are 64-byte aligned and writable") {
  auto r = gdr::memory_resource<gdr::Host>::allocate(1000);
  REQUIRE(r.has_value());
  CHECK(r->method == gdr::alloc_method::aligned_new);
  CHECK(reinterpret_cast<std::uintptr_t>(r->ptr) % 64 == 0);
  std::memset(r->ptr, 0xab, 1000);
  gdr::memory_resource<gdr::Host>::deallocate(*r);
}

TEST_CASE("zero bytes allocate nothing in any space") {
  auto h = gdr::memory_resource<gdr::Host>::allocate(0);
  auto p = gdr::memory_resource<gdr::Pinned>::allocate(0);
  REQUIRE(h.has_value());
  REQUIRE(p.has_value());
  CHECK(h->ptr == nullptr);
  CHECK(p->method == gdr::alloc_method::none);
#if GDR_HAS_CUDA
  auto d = gdr::memory_resource<gdr::Device>::allocate(0, 0);
  REQUIRE(d.has_value());  // even with no GPU: nothing is asked of the driver
  CHECK(d->ptr == nullptr);
#endif
}

TEST_CASE("pinned memory is page-locked, by CUDA or by mlock") {
  const std::size_t bytes = 1 << 20;
  const long before = vm_locked_kib();
  auto r = gdr::memory_resource<gdr::Pinned>::allocate(bytes);
  if (!r) {
    // mlock may be refused by RLIMIT_MEMLOCK; the message must say so.
    std::string m = gdr::memory_resource<gdr::Pinned>::failure_message(r.error(), bytes);
    MESSAGE("pinned allocation failed: " << m);
    CHECK(m.find("RLIMIT_MEMLOCK") != std::string::npos);
    return;
  }
  std::memset(r->ptr, 0x5a, bytes);
  CHECK(static_cast<unsigned char*>(r->ptr)[bytes - 1] == 0x5a);
  if (r->method == gdr::alloc_method::mmap_mlock) {
    MESSAGE("Pinned via mmap+mlock (built without CUDA, or no GPU here): page-locked for NICs, unknown to CUDA");
#if GDR_TEST_SANITIZER
    // Nothing is locked under a sanitizer, so there is nothing to see in VmLck.
    MESSAGE("sanitizer build: mlock is a no-op here, VmLck not checked");
#else
    CHECK(vm_locked_kib() - before >= static_cast<long>(bytes / 1024));
#endif
  } else {
    CHECK(r->method == gdr::alloc_method::cuda_host_alloc);
  }
  gdr::memory_resource<gdr::Pinned>::deallocate(*r);
  if (r->method == gdr::alloc_method::mmap_mlock && !GDR_TEST_SANITIZER) CHECK(vm_locked_kib() == before);
}

TEST_CASE("the Pinned failure message points at the memlock limit") {
  std::string m = gdr::memory_resource<gdr::Pinned>::failure_message(gdr::errno_code(ENOMEM), 4096);
  CHECK(m.find("RLIMIT_MEMLOCK") != std::string::npos);
  CHECK(m.find("4096") != std::string::npos);
}

#if GDR_HAS_CUDA
TEST_CASE("device allocation fails with no_device and a reason, or allocates on the GPU") {
  auto r = gdr::memory_resource<gdr::Device>::allocate(4096, 0);
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) {
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error() == gdr::errc::no_device);
    std::string m = gdr::memory_resource<gdr::Device>::failure_message(r.error(), 4096, 0);
    CHECK(m.find(why) != std::string::npos);
    GDR_SKIP(why);
  }
  REQUIRE(r.has_value());
  CHECK(r->method == gdr::alloc_method::cuda_malloc);
  CHECK(r->device == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(r->ptr) % 256 == 0);
  gdr::memory_resource<gdr::Device>::deallocate(*r);
}

TEST_CASE("an out-of-range device ordinal is no_device, with the count in the message") {
  auto r = gdr::memory_resource<gdr::Device>::allocate(64, 4096);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error() == gdr::errc::no_device);
  std::string m = gdr::memory_resource<gdr::Device>::failure_message(r.error(), 64, 4096);
  MESSAGE(m);
  if (gdr_test::no_gpu_reason().empty()) CHECK(m.find("out of range") != std::string::npos);
}
#endif
