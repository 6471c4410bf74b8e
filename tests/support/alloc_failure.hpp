// Allocation failures on demand, for tests of out-of-memory paths.
//
// A test binary that includes this header (from its one source file: the
// definitions below are not inline) replaces the global operator new and
// new[], plain and nothrow, with malloc-based ones that fail when armed;
// each form is replaced, since a sanitizer runtime replaces them one by one.
// Over-aligned forms are left to the library (never failed).
//
//   {
//     gdr_test_support::failing_allocations oom;      // every allocation of this thread fails
//     CHECK(cache.acquire(p, n).error() == std::errc::not_enough_memory);
//   }
//   gdr_test_support::failing_allocations after_one(1);  // the first succeeds, the rest fail
//
// Only the arming thread's allocations fail; others are not affected.
//
// It also counts the bytes this thread holds through operator new (what it
// allocated minus what it freed, as malloc_usable_size sees them), for tests
// of what an object costs:
//
//   long long before = gdr_test_support::live_bytes();
//   ... make it ...
//   CHECK(gdr_test_support::live_bytes() - before <= budget);
//
// and the largest single request this thread made (counted before it may
// fail: asking for 512 GiB counts even though it throws), for tests of what
// a peer's word may make this process allocate:
//
//   gdr_test_support::reset_largest_request();
//   ... serve a hostile peer ...
//   CHECK(gdr_test_support::largest_request() <= bound);
// Include it as "tests/support/alloc_failure.hpp" from tests that depend on
// //tests/support:alloc_failure.
#pragma once

#include <malloc.h>

#include <cstddef>
#include <cstdlib>
#include <new>

namespace gdr_test_support {

namespace alloc_failure_detail {
// Constant-initialised thread_locals: usable from operator new at any time.
// -1: not armed; otherwise allocations left to succeed before failing.
inline thread_local long succeed_left = -1;
inline thread_local long failed = 0;
inline thread_local long long live = 0;  // bytes allocated minus bytes freed, this thread
inline thread_local std::size_t largest = 0;  // the largest request since reset_largest_request()

inline void* allocate(std::size_t n) noexcept {
  if (n > largest) largest = n;
  if (succeed_left == 0) {
    ++failed;
    return nullptr;
  }
  if (succeed_left > 0) --succeed_left;
  void* p = std::malloc(n != 0 ? n : 1);
  if (p != nullptr) live += static_cast<long long>(::malloc_usable_size(p));
  return p;
}

inline void release(void* p) noexcept {
  if (p == nullptr) return;
  live -= static_cast<long long>(::malloc_usable_size(p));
  std::free(p);
}
}  // namespace alloc_failure_detail

/// The bytes this thread's operator new allocated minus those this thread's
/// operator delete freed (usable sizes), since the thread started.
inline long long live_bytes() noexcept { return alloc_failure_detail::live; }

/// The largest request this thread made through operator new since the
/// last `reset_largest_request()` (or since it started).
inline std::size_t largest_request() noexcept { return alloc_failure_detail::largest; }
inline void reset_largest_request() noexcept { alloc_failure_detail::largest = 0; }

/// While it lives, the calling thread's allocations through operator new
/// fail (`std::bad_alloc`, or null for the nothrow forms) after the first
/// `succeed_first` of them. Not nestable.
class failing_allocations {
 public:
  explicit failing_allocations(long succeed_first = 0) noexcept {
    alloc_failure_detail::failed = 0;
    alloc_failure_detail::succeed_left = succeed_first;
  }
  ~failing_allocations() { alloc_failure_detail::succeed_left = -1; }
  failing_allocations(const failing_allocations&) = delete;
  failing_allocations& operator=(const failing_allocations&) = delete;

  /// Allocations refused so far.
  long failed() const noexcept { return alloc_failure_detail::failed; }
};

}  // namespace gdr_test_support

void* operator new(std::size_t n) {
  if (void* p = gdr_test_support::alloc_failure_detail::allocate(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = gdr_test_support::alloc_failure_detail::allocate(n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return gdr_test_support::alloc_failure_detail::allocate(n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return gdr_test_support::alloc_failure_detail::allocate(n);
}
void operator delete(void* p) noexcept { gdr_test_support::alloc_failure_detail::release(p); }
void operator delete[](void* p) noexcept { gdr_test_support::alloc_failure_detail::release(p); }
void operator delete(void* p, std::size_t) noexcept { gdr_test_support::alloc_failure_detail::release(p); }
void operator delete[](void* p, std::size_t) noexcept { gdr_test_support::alloc_failure_detail::release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { gdr_test_support::alloc_failure_detail::release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { gdr_test_support::alloc_failure_detail::release(p); }
