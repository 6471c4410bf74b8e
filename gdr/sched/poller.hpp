/// \file
/// Completion sources besides the scheduler's own io_uring: CUDA event FIFOs,
/// RDMA completion queues, TCP sockets read by busy-polling endpoints. The
/// scheduler polls each once per loop iteration.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>

namespace gdr {

/// What one poll of a completion source found.
struct poll_status {
  /// At least one operation completed (the loop should poll again at once).
  bool did_work = false;
  /// How long the loop may sleep in the kernel before polling this source
  /// again: `max()` = indefinitely (the source wakes the ring itself, or has
  /// nothing pending), zero = must not sleep (busy), anything else = a bound
  /// (a source that can only be polled, such as a CUDA event, while work is
  /// pending).
  std::chrono::nanoseconds sleep_bound = std::chrono::nanoseconds::max();
};

/// A completion source polled by the scheduler (seastar's `pollfn`, UCX's
/// progress callbacks). Pollers are owned by their creator and must be removed
/// from the scheduler before they are destroyed. A completion a poller makes
/// resumes a coroutine inline, and that coroutine may remove and destroy the
/// very poller that resumed it: `poll` must not touch its object after it
/// completes an operation (finish the bookkeeping first, complete last).
///
/// Thread-safety: `poll` is called only on the scheduler's thread.
class poller {
 public:
  virtual ~poller() = default;
  /// Completes whatever is ready; never blocks.
  virtual poll_status poll() noexcept = 0;
  /// A short name for diagnostics ("cuda-events", "verbs-cq").
  virtual const char* name() const noexcept = 0;
};

/// The kinds of poller a scheduler keeps one slot for: completion sources of
/// which a scheduler has at most one, and which an awaitable must find from
/// its scheduler on every await (`scheduler::poller_slot`). The kinds are
/// named here, and the poller types that fill them live in higher layers
/// (gdr/cuda/, gdr/transport/verbs/): so the slots are a fixed array inside the
/// scheduler, and sched/ includes none of those layers.
enum class poller_kind : unsigned char {
  cuda_events,  ///< `gdr::cuda::event_poller`
  copy_engine,  ///< `gdr::copy_engine` of the staged path (CUDA's is the event poller)
  verbs_cq,     ///< `gdr::verbs::cq_poller`: the scheduler's RDMA completion queues
};

namespace detail {
inline constexpr std::size_t poller_kind_count = 3;  // enumerators of poller_kind
}  // namespace detail

/// A poller type that has a slot in its scheduler: it derives from `poller`
/// and names its kind as `static constexpr poller_kind kind`.
template <class P>
concept slotted_poller = std::derived_from<P, poller> && requires {
  { P::kind } -> std::convertible_to<poller_kind>;
};

}  // namespace gdr
