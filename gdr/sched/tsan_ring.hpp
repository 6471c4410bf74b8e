/// \file
/// Internal: makes ThreadSanitizer see a ring's memory change hands when a
/// scheduler is destroyed and another made (`scheduler`'s constructor and
/// destructor). No-op without TSan.
#pragma once

#include <liburing.h>

#include <cstddef>

#include <gdr/config.hpp>

#if GDR_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace gdr::detail {

/// liburing maps and unmaps the rings with raw system calls, which TSan does
/// not see: when a ring freed on one thread is mapped again at the same
/// address by another, TSan takes the first SQE writes of the new ring for a
/// race with the old one's. Each page of a ring is a TSan sync object: the
/// destructor releases it (`acquire` false), the constructor acquires it, so
/// the reuse is ordered as a free and a malloc would be.
inline void tsan_ring_handoff([[maybe_unused]] io_uring& ring, [[maybe_unused]] bool acquire) noexcept {
#if GDR_TSAN
  auto pages = [acquire](void* base, std::size_t size) {
    constexpr std::size_t page = 4096;
    auto* b = static_cast<char*>(base);
    for (std::size_t off = 0; off < size; off += page) {
      if (acquire)
        __tsan_acquire(b + off);
      else
        __tsan_release(b + off);
    }
  };
  pages(ring.sq.ring_ptr, ring.sq.ring_sz);
  if (ring.cq.ring_ptr != ring.sq.ring_ptr) pages(ring.cq.ring_ptr, ring.cq.ring_sz);
  pages(ring.sq.sqes, std::size_t{ring.sq.ring_entries} * sizeof(io_uring_sqe));
#endif
}

}  // namespace gdr::detail
