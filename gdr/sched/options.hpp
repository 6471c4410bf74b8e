/// \file
/// A scheduler's construction options, its run modes and its counters.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>

namespace gdr {

/// How the loop waits when there is nothing to do.
enum class run_mode {
  busy_poll,  ///< never block: poll the CQ and the pollers in a tight loop
  sleep,      ///< block in io_uring_enter until a completion or a poller bound
};

namespace detail {
/// `GDR_MASK_EXT_ARG=1` in the environment (see `scheduler_options::ext_arg`).
inline bool ext_arg_masked_by_env() noexcept {
  static const bool masked = [] {
    const char* v = std::getenv("GDR_MASK_EXT_ARG");
    return v != nullptr && v[0] == '1' && v[1] == '\0';
  }();
  return masked;
}
/// `GDR_SCHED_ANY_THREAD=1` in the environment (see `scheduler_options::single_thread`).
inline bool any_thread_by_env() noexcept {
  static const bool any = [] {
    const char* v = std::getenv("GDR_SCHED_ANY_THREAD");
    return v != nullptr && v[0] == '1' && v[1] == '\0';
  }();
  return any;
}
}  // namespace detail

/// Construction options of a scheduler.
struct scheduler_options {
  unsigned sq_entries = 256;          ///< io_uring submission queue size
  run_mode mode = run_mode::sleep;    ///< how the loop waits
  /// Other schedulers' threads wake this one with `IORING_OP_MSG_RING` when
  /// the kernel has it (probed once per process). False: they write its
  /// eventfd, as plain threads do (slower, ~2x; for kernels whose MSG_RING
  /// misbehaves, and for tests).
  bool msg_ring_wakeups = true;
  /// How long the destructor runs the loop to finish operations still in
  /// flight before it gives up on them (see "Teardown" in
  /// docs/SCHEDULER.md).
  std::chrono::milliseconds teardown_timeout{5000};
  /// Bounded sleeps pass their bound to `io_uring_enter` when the kernel has
  /// `IORING_FEAT_EXT_ARG` (Linux 5.11). False: the scheduler behaves as on an
  /// older kernel (liburing bounds the sleep with a timeout SQE; see "Bounded
  /// sleeps on kernels before 5.11" in docs/SCHEDULER.md), for tests of
  /// that path. The default is false when the environment has `GDR_MASK_EXT_ARG=1`
  /// (read once per process), so a whole test binary can run that way.
  bool ext_arg = !detail::ext_arg_masked_by_env();
  /// The loop runs on one thread: the first that runs it (`run_once`,
  /// `run_until`, `sync_wait`). The ring is then made with
  /// `IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN` (Linux 6.1),
  /// so the kernel keeps completion work for that thread's next wait instead
  /// of interrupting it: a sleeping loop wakes faster (benchmarks/RESULTS.md).
  /// Running the loop on another thread afterwards throws `gdr::error`
  /// (`errc::unsupported`); a scheduler may still be made on one thread,
  /// run on another and destroyed on the first (see "One thread per ring" in
  /// docs/SCHEDULER.md). False: any thread may run the loop, one at a
  /// time. On kernels without these flags the choice makes no difference.
  /// The default is false when the environment has `GDR_SCHED_ANY_THREAD=1`
  /// (read once per process), so a whole test binary can run that way.
  bool single_thread = !detail::any_thread_by_env();
};

/// Counters a scheduler keeps; cheap, for tests and benchmarks.
struct scheduler_stats {
  std::uint64_t iterations = 0;       ///< run_once calls
  std::uint64_t completions = 0;      ///< CQEs dispatched to operations
  std::uint64_t submits = 0;          ///< io_uring_enter calls made to submit or wait
  std::uint64_t sleeps = 0;           ///< times the loop blocked in the kernel
  std::uint64_t remote = 0;           ///< remote_work nodes run
  std::uint64_t msg_ring_failed = 0;  ///< wake-up messages this loop sent that failed (sent again by eventfd)
  std::uint64_t cancels_deferred = 0; ///< cancels that found no free SQE and waited in the pending list
  std::uint64_t wake_reads_deferred = 0;  ///< eventfd reads that found no free SQE and were armed an iteration later
};

}  // namespace gdr
