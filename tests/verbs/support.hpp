// What the verbs transport's own tests share: the skip rule (a real RDMA
// device and its address, else the test says why and skips), byte patterns,
// views, a fresh connected pair on a fresh scheduler, and the GPUDirect
// stand-in's memory (pages the CPU can be locked out of while the NIC still
// reaches them).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/transport/verbs.hpp>

#include "tests/support/skip.hpp"
#include "tests/support/watchdog.hpp"
#include "tests/verbs/verbs_fixture.hpp"

#define REQUIRE_VERBS()                                  \
  do {                                                   \
    std::string why_ = conformance::verbs_skip_reason(); \
    if (!why_.empty()) GDR_SKIP(why_);                   \
  } while (0)

namespace verbs_test {

inline void fill(std::byte* p, std::size_t n, std::uint32_t seed) {
  std::uint32_t x = 2654435761u * (seed + 1);
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<std::byte>(x);
  }
}

inline std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  fill(v.data(), n, seed);
  return v;
}

inline bool all_are(const std::vector<std::byte>& v, std::byte b) {
  return std::all_of(v.begin(), v.end(), [b](std::byte x) { return x == b; });
}

inline gdr::view<std::byte, gdr::Host> host(std::vector<std::byte>& v) { return {v.data(), v.size()}; }
inline gdr::view<const std::byte, gdr::Host> chost(const std::vector<std::byte>& v) { return {v.data(), v.size()}; }
/// Host memory labelled `Device` (GPU 0): what the CPU copy engine and the
/// GPUDirect stand-in take for GPU memory.
inline gdr::view<std::byte, gdr::Device> device(std::vector<std::byte>& v) { return {v.data(), v.size(), 0}; }

template <class Op>
gdr::task<gdr::op_report> report_of(Op op) {
  co_return co_await std::move(op).report();
}

/// Runs `body(a, b)` over a fresh verbs pair on `sched`.
template <class Body>
void with_pair_on(gdr::scheduler& sched, Body body, gdr::verbs::endpoint_options oa = {},
                  gdr::verbs::endpoint_options ob = {}) {
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    auto p = co_await conformance::verbs_pair(sched, gdr::default_registry(), oa, ob);
    co_await body(p.first, p.second);
  }());
  sched.drain();
}

/// Runs `body(a, b)` over a fresh verbs pair on a fresh scheduler, under a
/// watchdog.
template <class Body>
void with_pair(Body body, gdr::verbs::endpoint_options oa = {}, gdr::verbs::endpoint_options ob = {},
               unsigned seconds = 60) {
  gdr_test_support::watchdog dog(seconds);
  gdr::scheduler sched;
  with_pair_on(sched, std::move(body), oa, ob);
}

/// Turns the GPUDirect stand-in on for one test (gdr::verbs::testing).
struct stand_in {
  explicit stand_in(bool needs_flush = false) {
    gdr::verbs::testing::stand_in_host_memory_for_device(true, needs_flush);
  }
  ~stand_in() { gdr::verbs::testing::stand_in_host_memory_for_device(false); }
  stand_in(const stand_in&) = delete;
  stand_in& operator=(const stand_in&) = delete;
};

/// Pages that play GPU 0's memory for the stand-in: `lock()` makes them
/// inaccessible to the CPU. A second mapping of the same pages (a memfd
/// mapped twice) stays readable, and the stand-in registers through it
/// (`gdr::verbs::testing::stand_in_alias`), as a dma-buf registration
/// reaches GPU memory without the CPU's mapping: registrations made while
/// locked work. `aliased = false`: no such mapping, so that a registration
/// made while locked fails (a GPU buffer the driver will not export).
class nic_memory {
 public:
  explicit nic_memory(std::size_t n, bool aliased = true) : n_(round(n)) {
    if (!aliased) {
      void* p = ::mmap(nullptr, n_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      REQUIRE(p != MAP_FAILED);
      p_ = static_cast<std::byte*>(p);
      return;
    }
    fd_ = ::memfd_create("gdr-nic-memory", MFD_CLOEXEC);
    REQUIRE(fd_ >= 0);
    REQUIRE(::ftruncate(fd_, static_cast<off_t>(n_)) == 0);
    void* p = ::mmap(nullptr, n_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    void* a = ::mmap(nullptr, n_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    REQUIRE(p != MAP_FAILED);
    REQUIRE(a != MAP_FAILED);
    p_ = static_cast<std::byte*>(p);
    alias_ = static_cast<std::byte*>(a);
    gdr::verbs::testing::stand_in_alias(p_, alias_, n_);
  }
  ~nic_memory() {
    if (alias_ != nullptr) {
      gdr::verbs::testing::stand_in_unalias(p_);
      ::munmap(alias_, n_);
      ::close(fd_);
    }
    ::munmap(p_, n_);
  }
  nic_memory(const nic_memory&) = delete;
  nic_memory& operator=(const nic_memory&) = delete;

  void lock() { REQUIRE(::mprotect(p_, n_, PROT_NONE) == 0); }
  void unlock() { REQUIRE(::mprotect(p_, n_, PROT_READ | PROT_WRITE) == 0); }
  std::byte* data() const { return p_; }
  gdr::view<std::byte, gdr::Device> device(std::size_t n, std::size_t off = 0) const {
    return gdr::view<std::byte, gdr::Device>(p_ + off, n, 0);
  }
  gdr::view<std::byte, gdr::Device> device() const { return device(n_); }
  std::size_t size() const { return n_; }

 private:
  static std::size_t round(std::size_t n) {
    auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    return (std::max<std::size_t>(n, 1) + page - 1) / page * page;
  }
  std::byte* p_ = nullptr;
  std::byte* alias_ = nullptr;
  int fd_ = -1;
  std::size_t n_ = 0;
};

}  // namespace verbs_test
