/// \file
/// How other threads wake a scheduler: its eventfd, shared with the
/// MSG_RING wake-ups in flight to it, and the user_data tags that are not
/// operations (see "A wake-up is never lost" in docs/SCHEDULER.md).
#pragma once

#include <liburing.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace gdr::detail {

// user_data values that are not operations. Heap and stack addresses are never
// this small.
inline constexpr std::uint64_t ignore_tag = 0;  // cancel requests, link timeouts
inline constexpr std::uint64_t wake_tag = 1;    // MSG_RING wake-ups from other rings
// Set in the user_data of a MSG_RING wake-up sent from this ring, whose other
// bits are the target's wake_channel. Operations are at least 8-byte aligned,
// so their addresses never have it.
inline constexpr std::uint64_t message_bit = 1;

/// A scheduler's eventfd, shared by the scheduler and by the MSG_RING
/// wake-ups in flight to it (see "A wake-up is never lost" in
/// docs/SCHEDULER.md). The last reference closes the descriptor.
struct wake_channel {
  int fd = -1;
  std::atomic<std::uint32_t> refs{1};

  void acquire() noexcept { refs.fetch_add(1, std::memory_order_relaxed); }
  void release() noexcept {
    // acq_rel: every holder's use of `fd` happens before the close.
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      ::close(fd);
      delete this;
    }
  }
  /// Wakes the ring that reads this eventfd. Any thread.
  void signal() const noexcept {
    std::uint64_t one = 1;
    // A full counter (EAGAIN) means a wake-up is pending anyway.
    [[maybe_unused]] ssize_t n = ::write(fd, &one, sizeof one);
  }
};

/// Whether this kernel has IORING_OP_MSG_RING, asked once per process (of the
/// first scheduler's ring: io_uring_get_probe would set up a ring of its own).
inline bool msg_ring_supported(io_uring& ring) noexcept {
  static const bool supported = [&ring] {
    io_uring_probe* p = io_uring_get_probe_ring(&ring);
    if (p == nullptr) return false;  // no IORING_REGISTER_PROBE (before 5.6): older than MSG_RING too
    bool yes = io_uring_opcode_supported(p, IORING_OP_MSG_RING) != 0;
    io_uring_free_probe(p);
    return yes;
  }();
  return supported;
}

}  // namespace gdr::detail
