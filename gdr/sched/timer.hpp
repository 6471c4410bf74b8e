/// \file
/// Time on the scheduler: `sleep_for`, `sleep_until` and `nop`, each one
/// io_uring operation (`IORING_OP_TIMEOUT`, `IORING_OP_NOP`), cancellable through
/// the awaiting coroutine's stop token.
///
/// \code
///   co_await gdr::sleep_for(5ms);                        // throws errc::cancelled if stopped
///   gdr::result<void> r = co_await gdr::sleep_for(5ms).as_result();
/// \endcode
#pragma once

#include <chrono>

#include <gdr/sched/uring_op.hpp>

namespace gdr {

namespace detail {

inline __kernel_timespec to_timespec(std::chrono::nanoseconds d) noexcept {
  if (d.count() < 0) d = std::chrono::nanoseconds::zero();
  __kernel_timespec ts{};
  ts.tv_sec = static_cast<long long>(d.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long long>(d.count() % 1'000'000'000);
  return ts;
}

}  // namespace detail

/// Awaitable returned by `sleep_for` / `sleep_until`. Completes when the time
/// has passed (success) or when cancelled (`errc::cancelled`).
class timer_awaitable : public detail::uring_awaitable<timer_awaitable, void> {
 public:
  timer_awaitable(scheduler& s, __kernel_timespec ts, bool absolute) noexcept
      : uring_awaitable(s), ts_(ts), absolute_(absolute) {}

  void prepare(io_uring_sqe* sqe) noexcept {
    // The kernel reads ts_ at submission; it lives in this awaitable, which is in
    // the coroutine frame until the CQE, so it outlives the submission anyway.
    io_uring_prep_timeout(sqe, &ts_, 0, absolute_ ? IORING_TIMEOUT_ABS : 0);
  }

  result<void> finish() noexcept {
    // -ETIME is a timeout that expired: the normal outcome of a sleep.
    if (res_ == -ETIME || res_ >= 0) return {};
    return uring_error(res_);
  }

 private:
  __kernel_timespec ts_;
  bool absolute_;
};

/// Sleeps `d` on scheduler `s`.
inline timer_awaitable sleep_for(scheduler& s, std::chrono::nanoseconds d) noexcept {
  return {s, detail::to_timespec(d), false};
}

/// Sleeps `d` on the scheduler of the calling thread.
inline timer_awaitable sleep_for(std::chrono::nanoseconds d) noexcept {
  return sleep_for(this_scheduler(), d);
}

/// Sleeps until `t` (CLOCK_MONOTONIC, which `std::chrono::steady_clock` is on Linux).
inline timer_awaitable sleep_until(scheduler& s, std::chrono::steady_clock::time_point t) noexcept {
  return {s, detail::to_timespec(t.time_since_epoch()), true};
}
inline timer_awaitable sleep_until(std::chrono::steady_clock::time_point t) noexcept {
  return sleep_until(this_scheduler(), t);
}

/// One `IORING_OP_NOP` round trip through the ring: the cheapest operation,
/// used to measure the scheduler itself.
class nop_awaitable : public detail::uring_awaitable<nop_awaitable, void> {
 public:
  using uring_awaitable::uring_awaitable;
  void prepare(io_uring_sqe* sqe) noexcept { io_uring_prep_nop(sqe); }
  result<void> finish() noexcept { return uring_error(res_); }
};

inline nop_awaitable nop(scheduler& s) noexcept { return nop_awaitable{s}; }
inline nop_awaitable nop() noexcept { return nop_awaitable{this_scheduler()}; }

}  // namespace gdr
