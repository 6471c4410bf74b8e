/// \file
/// What the protocol layer's staged path needs from a copy engine, and how it
/// is tuned.
///
/// `Device` memory crosses a transport that moves host bytes (TCP, loopback,
/// verbs without GPUDirect) through `Pinned` bounce buffers: the sender copies
/// each chunk device-to-host and sends it from the bounce buffer while the
/// next chunk is copied; the receiver places each chunk in a bounce buffer and
/// copies it host-to-device while the next one arrives. The pipeline itself is
/// the protocol engine's (`gdr/protocol/engine.hpp`); the copies are a
/// `copy_engine`'s, found through the endpoint's scheduler:
///
///   * `gdr::cuda::event_poller` is the CUDA one: one stream per direction and
///     GPU (both copy engines work at once), completion through CUDA events
///     polled by the scheduler, `cudaHostAlloc` for the bounce buffers. Making
///     the event poller (`gdr::cuda::event_poller events(sched);`) is all a
///     program does to send `Device` memory.
///   * Tests on machines without a GPU use a copy engine that moves bytes with
///     the CPU and completes from the scheduler's loop, so the pipeline's
///     states (chunking, truncation, cancellation, peer death mid-transfer)
///     are exercised everywhere; the H200 runs the same suite on CUDA's.
///
/// Without a copy engine on the scheduler a `Device` operation fails with
/// `errc::no_device`, saying so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <system_error>

#include <gdr/error.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/stream_order.hpp>

namespace gdr {

/// An asynchronous copy engine for the staged path: device-to-host and
/// host-to-device copies that complete on the scheduler's thread, and pinned
/// host memory for the bounce buffers. A scheduler has at most one (it is a
/// slotted poller); endpoints find it with `copy_engine::of(sched)`.
class copy_engine : public poller {
 public:
  static constexpr poller_kind kind = poller_kind::copy_engine;

  enum class direction : std::uint8_t {
    to_host,    ///< device to pinned host memory
    to_device,  ///< pinned host memory to device
  };

  /// What a queued copy completes: `done(c, ec)` runs once, on the
  /// scheduler's thread, from the engine's `poll()` (never inside `copy`),
  /// with an empty `ec` on success.
  struct completion {
    void (*done)(completion*, std::error_code) noexcept = nullptr;
  };

  /// Queues a copy of `n` bytes (`n > 0`) from `src` to `dst` on GPU
  /// `device`, in direction `d`. Copies of one direction and GPU run and
  /// complete in the order queued. `after`, when set, orders this copy after
  /// the work already queued on that stream, without a host synchronize.
  /// Returns an error (and will not complete `c`) if it could not be queued.
  virtual std::error_code copy(direction d, int device, void* dst, const void* src, std::size_t n,
                               stream_order after, completion* c) noexcept = 0;

  /// Pinned host memory and how to free it. `release` must not need the
  /// copy engine object: an endpoint may free its bounce buffers after the
  /// engine is gone.
  struct pinned_block {
    std::byte* data = nullptr;
    std::size_t size = 0;
    void (*release)(std::byte*, std::size_t) noexcept = nullptr;
  };

  /// `n` bytes of pinned host memory (`data` null if it could not be had).
  /// Called once per bounce pool, never on the data path.
  virtual pinned_block allocate_pinned(std::size_t n) noexcept = 0;

  /// The copy engine of `s`, or null.
  static copy_engine* of(const scheduler& s) noexcept { return s.poller_slot<copy_engine>(); }
};

}  // namespace gdr
