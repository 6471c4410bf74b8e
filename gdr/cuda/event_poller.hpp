/// \file
/// `gdr::cuda::event_poller`: completes coroutines waiting on GPU work, from
/// the scheduler's own loop.
///
/// How it works
/// ============
/// An awaitable that puts work on a CUDA stream (a copy, a wait for the
/// stream) records a CUDA event after it and hands the poller an
/// `event_operation`: the event plus the operation to complete. The poller
/// keeps one FIFO per stream. Work on one stream finishes in order, so each
/// poll queries only the head of each FIFO and stops at the first event that
/// is not ready (as UCX's cuda_iface does): one `cudaEventQuery` (~0.27 us on
/// an H200 for a finished event) per stream per loop iteration, however many
/// operations are queued. A finished event goes back to a pool; events are
/// created once with `cudaEventDisableTiming` (no timestamp to write: the
/// cheapest kind to record and query) and reused.
///
/// Sleeping. A CUDA event cannot wake a thread by itself: nothing in the
/// kernel fires when it completes. In `run_mode::sleep` the poller has two
/// ways to let the loop sleep, chosen by `event_poller_options::wake`:
///   (A) `wake_strategy::host_func`: after recording the event, enqueue
///       `cudaLaunchHostFunc` on the same stream. The driver runs the callback
///       on its own thread once the stream reaches it (so after the event);
///       the callback calls `scheduler::wake()`, which writes the scheduler's
///       eventfd (opened `EFD_NONBLOCK`, with an io_uring read always pending),
///       and the loop wakes and polls. The callback must not call CUDA (the
///       driver forbids it), and it does not: it only writes an eventfd. While
///       every pending event has a callback, the poller lets the loop sleep
///       without bound. Cost: a host function holds the stream until it
///       returns, and the driver thread's wake-up adds latency.
///   (B) `wake_strategy::bounded_poll`: no callback; while events are pending
///       the poller asks the loop to sleep at most `poll_interval`, then polls
///       again. Cost: a timer wake-up every interval while GPU work is in
///       flight, and up to one interval of added latency.
/// In `run_mode::busy_poll` neither matters: the loop never sleeps, and (A)
/// enqueues no host function.
///
/// Default: (B), bounded polling at 20 us, chosen by measurement on an H200
/// (benchmarks/cuda_event_bench.cpp; numbers in benchmarks/RESULTS.md,
/// section (c)). Latency added to the raw spin loop's median, and process CPU:
///
///   GPU work before the event     (A) host_func        (B) 20 us           (B) 50 us
///   8 B H2D copy      (5.5 us)    +9.6 us,  90% core   +21.6 us, 29%       +52 us, 15%
///   16 MiB D2D       (13.6 us)    +31 us,   58%        +16.6 us, 36%       +47 us, 18%
///   256 MiB D2D       (135 us)    +31 us,   15%        +14.4 us, 21%       +33 us, 12%
///   1 GiB D2D         (513 us)    +74 us,    8%        +12.0 us, 23%       +39 us, 10%
///                                 (p99 +490 us)        (p99 +37 us)
///
/// (B) at 20 us adds 12-22 us at every size with a tight tail; (A) adds 10 us
/// only for the shortest work and 30-75 us otherwise, with a long tail (its
/// wake-up passes through the driver's callback thread, which gdr does not
/// control), and holds the stream while its callback runs. (A) wins on CPU for waits of half a millisecond or more (8%
/// against 23% of a core), so it stays available for long kernels on
/// CPU-starved hosts. Busy polling matches the raw loop (1.00-1.01x) at 100%
/// of a core. With nothing pending, the poller never limits the sleep.
///
/// Completion context: operations complete inside `poll()`, on the thread that
/// runs the scheduler, with `res` = 0 on success or the negated `cudaError_t`.
/// Context-poisoning CUDA errors abort (gdr/cuda/error.hpp).
///
/// Ownership: the poller is created by the user, one per scheduler, and adds
/// itself to it (`event_poller events(sched);`); awaitables find it through
/// `event_poller::of(scheduler)`. It must outlive every operation queued on
/// it; its destructor waits for host functions still in flight (they point at
/// it) and destroys the pooled events.
///
/// \code
///   gdr::scheduler sched;
///   gdr::cuda::event_poller events(sched);          // (B), 20 us
///   gdr::cuda::stream s(0);
///   gdr::sync_wait(sched, [&]() -> gdr::task<> {
///     co_await gdr::copy(dev, pinned, s);           // completes through `events`
///     co_await gdr::cuda::synchronize(s);           // everything on s so far
///   }());
/// \endcode
#pragma once

#include <gdr/cuda/device.hpp>
#include <gdr/cuda/error.hpp>
#include <gdr/cuda/stream.hpp>

#include <atomic>
#include <cassert>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>

namespace gdr::cuda {

/// How an `event_poller` lets a sleeping loop notice finished GPU work (see
/// the file comment).
enum class wake_strategy {
  host_func,     ///< (A) `cudaLaunchHostFunc` after each event wakes the loop's eventfd
  bounded_poll,  ///< (B) the loop sleeps at most `poll_interval` while events are pending
};

/// Construction options of an `event_poller`.
struct event_poller_options {
  /// The sleep-mode strategy; (B) by default, chosen by measurement (file comment).
  wake_strategy wake = wake_strategy::bounded_poll;
  /// For (B): the longest the loop sleeps while GPU work is pending. Also the
  /// fallback for (A) when a host function could not be enqueued.
  std::chrono::nanoseconds poll_interval = std::chrono::microseconds(20);
};

/// Counters an `event_poller` keeps, for tests and benchmarks.
struct event_poller_stats {
  std::uint64_t enqueued = 0;        ///< operations queued
  std::uint64_t completed = 0;       ///< operations completed (success or error)
  std::uint64_t queries = 0;         ///< `cudaEventQuery` calls
  std::uint64_t events_created = 0;  ///< events created (the pool reuses them)
  std::uint64_t host_funcs = 0;      ///< host functions enqueued (strategy A)
  std::uint64_t host_func_failures = 0;  ///< `cudaLaunchHostFunc` failures (fell back to B)
};

class event_poller;

/// What an `event_poller` completes: an `operation` plus the CUDA event it
/// waits for. Awaitables derive from it and live in the coroutine frame.
///
/// Contract: set `complete` before handing it to `event_poller::enqueue`; it
/// is called once, with `res` = 0 when the event completed or the negated
/// `cudaError_t` when querying it failed. The fields are the poller's.
class event_operation : public operation {
 private:
  friend class event_poller;
  cudaEvent_t event_ = nullptr;
  event_operation* next_ = nullptr;
  int device_ = 0;
  bool signalled_ = false;  // a host function will wake the loop for it
  // cudaEventQuery's answer, between poll()'s two passes. cudaError_t values
  // stay below 2^15 (the largest, cudaErrorApiFailureBase, is 10000; a larger
  // one would be kept as cudaErrorUnknown); int16 keeps the operation at 32
  // bytes.
  std::int16_t query_ = 0;
};

/// The CUDA event poller of one scheduler. See the file comment.
///
/// Thread-safety: construction, destruction, `enqueue` and `poll` on the
/// scheduler's thread (construction before the loop runs is fine); `of` from
/// any thread.
class event_poller final : public poller {
 public:
  /// The scheduler's slot this poller takes (`scheduler::poller_slot`).
  static constexpr poller_kind kind = poller_kind::cuda_events;

  /// Creates the poller and adds it to `s`. Throws `gdr::error`
  /// (`errc::invalid_argument`) if `s` already has one.
  explicit event_poller(scheduler& s, event_poller_options opts = {}) : sched_(&s), opts_(opts) {
    wake_.sched = &s;
    if (!s.claim_poller_slot(*this))
      throw error(make_error_code(errc::invalid_argument),
                  "gdr::cuda::event_poller: this scheduler already has an event poller");
    try {
      s.add_poller(*this);
    } catch (...) {  // out of memory growing the poller list: leave no trace
      s.release_poller_slot(*this);
      throw;
    }
  }

  event_poller(const event_poller&) = delete;
  event_poller& operator=(const event_poller&) = delete;

  /// Removes the poller from its scheduler, waits for host functions still in
  /// flight, and destroys the pooled events. Operations still queued are a
  /// bug of the caller (their coroutines would never resume); asserted.
  ~event_poller() override {
    assert(pending_ == 0 && "gdr::cuda::event_poller destroyed with GPU operations pending");
    sched_->remove_poller(*this);
    sched_->release_poller_slot(*this);
    // A host function runs after its event completed, possibly after the
    // operation was completed by polling; it still points at wake_.
    while (wake_.outstanding.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    for (auto& pool : free_)
      for (cudaEvent_t e : pool) check_or_log(cudaEventDestroy(e), "cudaEventDestroy");
  }

  /// The poller attached to `s`, or nullptr. A pointer load from the
  /// scheduler's slot table: no lock, no search (every GPU await calls it).
  static event_poller* of(const scheduler& s) noexcept { return s.poller_slot<event_poller>(); }

  /// Records an event on `stream` (of GPU `device`) after the work queued on
  /// it so far, and queues `op` to complete when that event has. With
  /// strategy (A) in sleep mode, also enqueues the waking host function.
  /// Returns the CUDA error if the event could not be recorded (then `op` is
  /// not queued and will not complete).
  std::error_code enqueue(cudaStream_t stream, int device, event_operation* op) noexcept {
    cudaEvent_t ev = nullptr;
    if (std::error_code ec = acquire_event(device, &ev)) return ec;
    if (std::error_code ec = check(cudaEventRecord(ev, stream), "cudaEventRecord")) {
      release_event(device, ev);
      return ec;
    }
    op->event_ = ev;
    op->device_ = device;
    op->next_ = nullptr;
    op->signalled_ = false;
    if (opts_.wake == wake_strategy::host_func && sched_->mode() == run_mode::sleep) {
      wake_.outstanding.fetch_add(1, std::memory_order_relaxed);
      if (cudaLaunchHostFunc(stream, &on_host_func, &wake_) == cudaSuccess) {
        op->signalled_ = true;
        ++stats_.host_funcs;
      } else {
        // Not fatal for the operation: it is still polled, with a bound.
        (void)cudaGetLastError();
        wake_.outstanding.fetch_sub(1, std::memory_order_relaxed);
        ++stats_.host_func_failures;
      }
    }
    if (!op->signalled_) ++unsignalled_;
    fifo& f = fifo_of(stream);
    if (f.tail != nullptr) {
      f.tail->next_ = op;
    } else {
      f.head = op;
    }
    f.tail = op;
    ++pending_;
    ++stats_.enqueued;
    return {};
  }

  /// Completes every operation whose event has finished: per stream, the
  /// FIFO's head while ready. Loop thread only (the scheduler calls it).
  ///
  /// The finished operations are first taken off their FIFOs and the
  /// poller's books closed; only then are they completed, and `this` is not
  /// touched after the first completion: completing one resumes a coroutine,
  /// and that coroutine may destroy this poller (a scope holding both the
  /// poller and the last copy ends right there), or enqueue more work.
  poll_status poll() noexcept override {
    poll_status st;
    if (pending_ == 0) return st;
    event_operation* ready = nullptr;  // finished operations, in completion order
    event_operation** ready_tail = &ready;
    for (fifo& f : fifos_) {
      while (event_operation* op = f.head) {
        ++stats_.queries;
        cudaError_t e = cudaEventQuery(op->event_);
        if (e == cudaErrorNotReady) {
          // Later events on this stream cannot be done either: stop here.
          (void)cudaGetLastError();
          break;
        }
        f.head = op->next_;
        if (f.head == nullptr) f.tail = nullptr;
        --pending_;
        if (!op->signalled_) --unsignalled_;
        (void)check(e, "cudaEventQuery");  // aborts on a poisoned context
        op->query_ = static_cast<std::int16_t>(static_cast<int>(e) <= INT16_MAX ? e : cudaErrorUnknown);
        release_event(op->device_, op->event_);
        op->event_ = nullptr;
        op->next_ = nullptr;
        *ready_tail = op;
        ready_tail = &op->next_;
        ++stats_.completed;
      }
    }
    // Forget streams with nothing queued (streams come and go).
    std::erase_if(fifos_, [](const fifo& f) { return f.head == nullptr; });
    if (pending_ != 0) {
      // (A) covers a pending event only if a host function will fire for it.
      st.sleep_bound = unsignalled_ == 0 ? std::chrono::nanoseconds::max() : opts_.poll_interval;
    }
    st.did_work = ready != nullptr;
    // From here on: locals only (see above).
    while (event_operation* op = ready) {
      ready = op->next_;  // read first: completing may free *op
      op->complete(op, -static_cast<int>(op->query_), 0);  // 0 on success
    }
    return st;
  }

  const char* name() const noexcept override { return "cuda-events"; }

  /// Operations queued and not yet completed.
  std::size_t pending() const noexcept { return pending_; }
  const event_poller_options& options() const noexcept { return opts_; }
  const event_poller_stats& stats() const noexcept { return stats_; }
  /// Host functions that have run (strategy A); written by the driver's thread.
  std::uint64_t host_funcs_run() const noexcept { return wake_.fired.load(std::memory_order_relaxed); }
  scheduler& sched() const noexcept { return *sched_; }

 private:
  struct fifo {
    cudaStream_t stream = nullptr;
    event_operation* head = nullptr;
    event_operation* tail = nullptr;
  };

  // What a host function touches: the scheduler to wake, and a count the
  // destructor waits on. Lives in the poller, which is not movable.
  struct wake_state {
    scheduler* sched = nullptr;
    std::atomic<int> outstanding{0};
    std::atomic<std::uint64_t> fired{0};
  };

  // Runs on a CUDA driver thread: no CUDA calls allowed, none made.
  static void CUDART_CB on_host_func(void* p) {
    auto* w = static_cast<wake_state*>(p);
    w->fired.fetch_add(1, std::memory_order_relaxed);
    w->sched->wake();
    // Last touch of *w: the destructor may free it once this is seen.
    w->outstanding.fetch_sub(1, std::memory_order_release);
  }

  fifo& fifo_of(cudaStream_t s) {
    for (fifo& f : fifos_)
      if (f.stream == s) return f;
    fifos_.push_back(fifo{s, nullptr, nullptr});
    return fifos_.back();
  }

  std::error_code acquire_event(int device, cudaEvent_t* out) noexcept {
    if (device < 0) return make_error_code(errc::invalid_argument);
    if (static_cast<std::size_t>(device) < free_.size() && !free_[device].empty()) {
      *out = free_[device].back();
      free_[device].pop_back();
      return {};
    }
    // Events belong to the device current at creation; they can only be
    // recorded on that device's streams.
    device_guard guard(device);
    if (guard.error()) return guard.error();
    if (std::error_code ec = check(cudaEventCreateWithFlags(out, cudaEventDisableTiming), "cudaEventCreateWithFlags"))
      return ec;
    ++stats_.events_created;
    return {};
  }

  void release_event(int device, cudaEvent_t e) noexcept {
    try {
      if (static_cast<std::size_t>(device) >= free_.size()) free_.resize(device + 1);
      free_[device].push_back(e);
    } catch (...) {  // out of memory growing the pool: drop the event instead
      check_or_log(cudaEventDestroy(e), "cudaEventDestroy");
    }
  }

  scheduler* sched_;
  event_poller_options opts_;
  std::vector<fifo> fifos_;
  std::vector<std::vector<cudaEvent_t>> free_;  // per device ordinal
  std::size_t pending_ = 0;
  std::size_t unsignalled_ = 0;
  wake_state wake_;
  event_poller_stats stats_;
};

namespace detail {

/// Base of awaitables that queue GPU work on a stream and complete when an
/// event recorded after it has completed. `Derived::issue()` queues the work
/// (`noexcept`, returns an error code); `Derived` may set `ec_` before the
/// await (argument errors), which then completes at once.
template <class Derived>
class stream_awaitable : public event_operation {
 public:
  stream_awaitable(cudaStream_t s, int device) noexcept : stream_(s), device_(device) {}
  stream_awaitable(stream_awaitable&& o) noexcept
      : event_operation(), stream_(o.stream_), device_(o.device_), ec_(o.ec_), what_(o.what_) {}
  stream_awaitable& operator=(stream_awaitable&&) = delete;

  bool await_ready() const noexcept { return static_cast<bool>(ec_); }

  bool await_suspend(std::coroutine_handle<> h) noexcept {
    scheduler* s = scheduler::current();
    event_poller* p = s != nullptr ? event_poller::of(*s) : nullptr;
    if (p == nullptr) {
      ec_ = make_error_code(errc::invalid_argument);
      what_ = "gdr: no gdr::cuda::event_poller is attached to this thread's scheduler "
              "(create one: gdr::cuda::event_poller events(sched);)";
      return false;
    }
    if ((ec_ = static_cast<Derived*>(this)->issue())) return false;
    if ((ec_ = p->enqueue(stream_, device_, this))) {
      what_ = "gdr: recording a CUDA event";
      return false;
    }
    waiter_ = h;
    complete = &on_complete;
    return true;
  }

  /// Throws `gdr::error` if the work could not be queued or failed.
  void await_resume() const {
    if (ec_) throw error(ec_, what_);
  }

  /// The same operation, but `co_await` returns `result<void>` and never throws.
  auto as_result() && noexcept {
    struct adapter : Derived {
      explicit adapter(Derived&& d) noexcept : Derived(std::move(d)) {}
      result<void> await_resume() const noexcept { return this->ec_; }
    };
    return adapter{static_cast<Derived&&>(*this)};
  }

 protected:
  cudaStream_t stream_;
  int device_;
  std::error_code ec_{};
  const char* what_ = "gdr: CUDA operation";

 private:
  static void on_complete(operation* op, int res, std::uint32_t) noexcept {
    auto* self = static_cast<stream_awaitable*>(op);
    if (res < 0) {
      self->ec_ = make_error_code(static_cast<cudaError_t>(-res));
      self->what_ = "gdr: GPU work on the stream failed";
    }
    self->waiter_.resume();
  }

  std::coroutine_handle<> waiter_{};
};

/// `synchronize(stream)`: no work of its own, just the event.
class synchronize_awaitable : public stream_awaitable<synchronize_awaitable> {
 public:
  using stream_awaitable::stream_awaitable;
  std::error_code issue() noexcept { return {}; }
};

}  // namespace detail

/// Completes when all work queued on `s` so far has finished, without
/// blocking the thread (the asynchronous `cudaStreamSynchronize`).
///
/// Needs an `event_poller` on the awaiting coroutine's scheduler. Throws
/// `gdr::error` at the `co_await` if there is none or the GPU reports an
/// error; `co_await std::move(op).as_result()` returns it instead. Not
/// cancellable: GPU work cannot be recalled, so the wait ends when it ends.
/// Completion context: the scheduler's thread, inside its event poller.
inline detail::synchronize_awaitable synchronize(const stream& s) noexcept {
  return detail::synchronize_awaitable(s.get(), s.device());
}

/// The same for a raw CUDA stream of GPU `device` (streams from other libraries).
inline detail::synchronize_awaitable synchronize(cudaStream_t s, int device) noexcept {
  return detail::synchronize_awaitable(s, device);
}

}  // namespace gdr::cuda
