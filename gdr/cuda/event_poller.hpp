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
/// The staged path's copy engine
/// =============================
/// The poller is also the scheduler's `gdr::copy_engine`
/// (gdr/sched/copy_engine.hpp): it takes that slot too, unless another copy
/// engine already holds it (that one stays). `copy()` queues a
/// `cudaMemcpyAsync` on one of the poller's own streams, one per GPU and
/// direction, created on first use: so device-to-host and host-to-device
/// copies run on the GPU's two copy engines at once, and copies of one
/// direction complete in order. The streams are blocking ones (they wait for
/// the legacy default stream): a kernel or `cudaMemset` queued there before
/// a send is done before its bytes are copied out, as a program that knows
/// only the default stream expects; work on other streams is ordered by
/// `op_options::after` (without it, a send may copy bytes a kernel on another
/// stream is still writing). A first version used non-blocking streams, and
/// a test that filled device memory with `cudaMemcpy` from pageable memory
/// (which returns before its DMA is done) then sent it read stale bytes. An event recorded after the copy goes
/// into that stream's FIFO like any other, carried by a node the poller owns
/// (a freelist, grown when every node is in flight). `after` orders the copy
/// behind the work already on a user's stream with no host synchronize: an
/// event recorded on that stream, `cudaStreamWaitEvent` on the internal one,
/// and the event goes straight back to the pool (the wait keeps the state
/// the event had when it was called). A finished copy's node goes back to the
/// freelist before its completion runs, and at most 64 copies complete per
/// poll (their completions are kept in poll()'s frame, where destroying the
/// poller cannot reach them); more makes the loop poll again at once.
///
/// Ownership: the poller is created by the user, one per scheduler, and adds
/// itself to it (`event_poller events(sched);`); awaitables find it through
/// `event_poller::of(scheduler)`. It must outlive every operation queued on
/// it; its destructor waits for host functions still in flight (they point at
/// it) and destroys the pooled events and its copy streams. The staged path
/// finds it as `gdr::copy_engine::of(scheduler)`.
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
#include <gdr/cuda/ipc.hpp>
#include <gdr/cuda/stream.hpp>

#include <array>
#include <atomic>
#include <cassert>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/sched/copy_engine.hpp>
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
  /// Bounds of the cache of peers' allocations imported by CUDA IPC.
  ipc_cache_options ipc{};
};

/// Counters an `event_poller` keeps, for tests and benchmarks.
struct event_poller_stats {
  std::uint64_t enqueued = 0;        ///< operations queued
  std::uint64_t completed = 0;       ///< operations completed (success or error)
  std::uint64_t queries = 0;         ///< `cudaEventQuery` calls
  std::uint64_t events_created = 0;  ///< events created (the pool reuses them)
  std::uint64_t host_funcs = 0;      ///< host functions enqueued (strategy A)
  std::uint64_t host_func_failures = 0;  ///< `cudaLaunchHostFunc` failures (fell back to B)
  std::uint64_t copies = 0;          ///< copy-engine copies queued (also counted in `enqueued`)
  std::uint64_t copy_nodes = 0;      ///< nodes created to track them (the freelist reuses them)
  std::uint64_t streams_created = 0;  ///< internal copy streams (one per GPU and direction used)
  std::uint64_t fences = 0;          ///< `ipc_fence` calls (a Device payload about to be read by a peer)
  std::uint64_t fences_idle = 0;     ///< of them, answered by idle streams alone (no GPU work queued)
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
  bool copy_ = false;       // one of the poller's own copy nodes (copy_engine::copy)
  // cudaEventQuery's answer, between poll()'s two passes. cudaError_t values
  // stay below 2^15 (the largest, cudaErrorApiFailureBase, is 10000; a larger
  // one would be kept as cudaErrorUnknown); int16 keeps the operation at 32
  // bytes.
  std::int16_t query_ = 0;
};

/// The CUDA event poller of one scheduler, and its CUDA copy engine. See the
/// file comment.
///
/// Thread-safety: construction, destruction, `enqueue`, `copy` and `poll` on
/// the scheduler's thread (construction before the loop runs is fine); `of`,
/// `allocate_pinned` and `free_pinned` from any thread.
class event_poller final : public copy_engine {
 public:
  /// The scheduler's slot this poller takes (`scheduler::poller_slot`). It
  /// also takes the `copy_engine` slot when that one is free.
  static constexpr poller_kind kind = poller_kind::cuda_events;

  /// Creates the poller and adds it to `s`, as its event poller and, unless
  /// `s` already has one, its copy engine. Throws `gdr::error`
  /// (`errc::invalid_argument`) if `s` already has an event poller.
  explicit event_poller(scheduler& s, event_poller_options opts = {}) : sched_(&s), opts_(opts), ipc_(opts.ipc) {
    wake_.sched = &s;
    if (!s.claim_poller_slot(*this))
      throw error(make_error_code(errc::invalid_argument),
                  "gdr::cuda::event_poller: this scheduler already has an event poller");
    // Another copy engine (a test's, say) keeps its slot; this poller is then
    // only the event poller.
    copy_slot_ = s.claim_poller_slot(static_cast<copy_engine&>(*this));
    try {
      s.add_poller(*this);  // once: one poll serves both roles
    } catch (...) {  // out of memory growing the poller list: leave no trace
      if (copy_slot_) s.release_poller_slot(static_cast<copy_engine&>(*this));
      s.release_poller_slot(*this);
      throw;
    }
  }

  event_poller(const event_poller&) = delete;
  event_poller& operator=(const event_poller&) = delete;

  /// Removes the poller from its scheduler, waits for host functions still in
  /// flight, and destroys the copy streams and the pooled events. Operations
  /// and copies still queued are a bug of the caller (their coroutines would
  /// never resume); asserted.
  ~event_poller() override {
    assert(pending_ == 0 && "gdr::cuda::event_poller destroyed with GPU operations pending");
    sched_->remove_poller(*this);
    if (copy_slot_) sched_->release_poller_slot(static_cast<copy_engine&>(*this));
    sched_->release_poller_slot(*this);
    // A host function runs after its event completed, possibly after the
    // operation was completed by polling; it still points at wake_.
    while (wake_.outstanding.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    // Nothing is pending, so the streams are idle (and cudaStreamDestroy
    // would let queued work finish anyway).
    for (auto& per_device : copy_streams_)
      for (cudaStream_t st : per_device)
        if (st != nullptr) check_or_log(cudaStreamDestroy(st), "cudaStreamDestroy (copy stream)");
    for (auto& pool : free_)
      for (cudaEvent_t e : pool) check_or_log(cudaEventDestroy(e), "cudaEventDestroy");
  }

  /// The poller attached to `s`, or nullptr. A pointer load from the
  /// scheduler's slot table: no lock, no search (every GPU await calls it).
  /// (`copy_engine::of(s)` finds the copy engine, usually this same poller.)
  static event_poller* of(const scheduler& s) noexcept { return s.poller_slot<event_poller>(); }

  /// Records an event on `stream` (of GPU `device`) after the work queued on
  /// it so far, and queues `op` to complete when that event has. With
  /// strategy (A) in sleep mode, also enqueues the waking host function.
  /// Returns `std::errc::not_enough_memory` (checked first), or the CUDA
  /// error if the event could not be recorded; then `op` is not queued and
  /// will not complete.
  std::error_code enqueue(cudaStream_t stream, int device, event_operation* op) noexcept {
    if (!reserve_fifo()) return make_error_code(std::errc::not_enough_memory);
    cudaEvent_t ev = nullptr;
    if (std::error_code ec = acquire_event(device, &ev)) return ec;
    if (std::error_code ec = check(cudaEventRecord(ev, stream), "cudaEventRecord")) {
      release_event(device, ev);
      return ec;
    }
    op->copy_ = false;
    push(stream, device, op, ev);
    return {};
  }

  /// `copy_engine::copy`: queues `cudaMemcpyAsync` on the poller's stream for
  /// GPU `device` and direction `d` (created on first use), after the work on
  /// `after.stream` when `after` is set, and completes `c` from `poll()` once
  /// an event recorded after the copy has completed: `ec` empty, or the CUDA
  /// error. Copies of one direction and GPU complete in the order queued.
  ///
  /// Returns, without completing `c`: `errc::invalid_argument` for `n == 0`,
  /// `device < 0`, a null pointer or `done`, or `after` without a device;
  /// `std::errc::not_enough_memory`; or the CUDA error of a call that
  /// failed (a missing GPU, a bad ordinal, a pointer the driver rejects). No
  /// copy touches `dst` or `src` after an error is returned. Loop thread only.
  std::error_code copy(direction d, int device, void* dst, const void* src, std::size_t n, stream_order after,
                       completion* c) noexcept override {
    if (n == 0 || device < 0 || dst == nullptr || src == nullptr || c == nullptr || c->done == nullptr ||
        (after && after.device < 0))
      return make_error_code(errc::invalid_argument);
    if (!reserve_fifo()) return make_error_code(std::errc::not_enough_memory);
    cudaStream_t s = nullptr;
    if (std::error_code ec = copy_stream(device, d, &s)) return ec;
    // Everything that can run out first, so that once the copy is queued
    // only recording its event remains.
    copy_node* node = take_node();
    if (node == nullptr) return make_error_code(std::errc::not_enough_memory);
    cudaEvent_t ev = nullptr;
    if (std::error_code ec = acquire_event(device, &ev)) {
      recycle(node);
      return ec;
    }
    std::error_code ec;
    if (after) ec = order_after(after, s);
    if (!ec) {
      const cudaMemcpyKind kind = d == direction::to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
      ec = check(cudaMemcpyAsync(dst, src, n, kind, s), "cudaMemcpyAsync");
      if (!ec && (ec = check(cudaEventRecord(ev, s), "cudaEventRecord"))) {
        // The copy is queued and cannot be recalled. The caller is told it
        // failed and may reuse the buffers: wait for the copy here (an
        // error path of an error path; a host wait is acceptable).
        check_or_log(cudaStreamSynchronize(s), "cudaStreamSynchronize (after a failed cudaEventRecord)");
      }
    }
    if (ec) {
      release_event(device, ev);
      recycle(node);
      return ec;
    }
    node->copy_ = true;
    node->done_ = c;
    push(s, device, node, ev);
    ++stats_.copies;
    return {};
  }

  /// `copy_engine::allocate_pinned`: `cudaHostAlloc(cudaHostAllocPortable)`
  /// (page-locked for every GPU), freed with `cudaFreeHost` (which needs
  /// no poller: an endpoint may free its bounce buffers after this poller
  /// is gone). `data` is null for `n == 0`, without a GPU, or out of memory.
  // ---------------------------------------------------------------- CUDA IPC (gdr/cuda/ipc.hpp)

  bool ipc_capable() const noexcept override { return ipc_share::capable(); }

  std::error_code ipc_export(const void* p, std::size_t n, ipc_memory& out, std::uint64_t& offset,
                             const char** why) noexcept override {
    return ipc_.export_memory(p, n, out, offset, why);
  }

  std::error_code ipc_copy(const ipc_memory& src, std::uint64_t offset, void* dst, int dst_device, std::size_t n,
                           stream_order after, completion* c) noexcept override;  // event_poller_ipc.hpp
  std::error_code ipc_fence(int device, stream_order after, completion* c, bool& done_now) noexcept override;
  /// No work left on GPU `device`'s legacy default stream, nor on `after`.
  static bool streams_idle(int device, stream_order after) noexcept;

  void ipc_forget(int pid) noexcept override { ipc_.forget(pid); }
  std::uint64_t ipc_frees() const noexcept override { return vmm_registry::instance().exported_frees(); }
  bool ipc_alive(std::uint64_t base, std::uint64_t buffer_id) const noexcept override {
    return vmm_registry::instance().alive(base, buffer_id);
  }
  void ipc_release(int pid, std::uint64_t base, std::uint64_t buffer_id) noexcept override {
    ipc_.release_freed(pid, base, buffer_id);
  }

  /// The CUDA IPC exports and the cache of imported allocations.
  const ipc_share& ipc() const noexcept { return ipc_; }

  pinned_block allocate_pinned(std::size_t n) noexcept override {
    if (n == 0) return {};
    void* p = nullptr;
    if (check(cudaHostAlloc(&p, n, cudaHostAllocPortable), "cudaHostAlloc")) return {};
    return {static_cast<std::byte*>(p), n, &free_pinned};
  }

  /// Frees what `allocate_pinned` returned; null is ignored.
  static void free_pinned(std::byte* p, std::size_t) noexcept {
    if (p != nullptr) check_or_log(cudaFreeHost(p), "cudaFreeHost");
  }

  /// Completes every operation whose event has finished: per stream, the
  /// FIFO's head while ready. Loop thread only (the scheduler calls it).
  ///
  /// The finished operations are first taken off their FIFOs and the
  /// poller's books closed; only then are they completed, and `this` is not
  /// touched after the first completion: completing one resumes a coroutine,
  /// and that coroutine may destroy this poller (a scope holding both the
  /// poller and the last copy ends right there), or enqueue more work. Copy
  /// nodes are the poller's own, so they go back to the freelist in the first
  /// pass and what their completions need is copied into this frame.
  poll_status poll() noexcept override {
    poll_status st;
    if (pending_ == 0) return st;
    event_operation* ready = nullptr;  // finished operations, in completion order
    event_operation** ready_tail = &ready;
    finished_copy copies[max_copies_per_poll];  // finished copies, in completion order
    std::size_t n_copies = 0;
    bool more = false;  // copies left for the next poll
    for (fifo& f : fifos_) {
      while (event_operation* op = f.head) {
        if (op->copy_ && n_copies == max_copies_per_poll) {
          more = true;
          break;
        }
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
        ++stats_.completed;
        if (op->copy_) {
          auto* node = static_cast<copy_node*>(op);
          copies[n_copies++] = {node->done_, node->query_};
          if (node->ipc_ != nullptr) ipc_.release(node->ipc_);  // the peer's allocation may close now
          recycle(node);
          continue;
        }
        *ready_tail = op;
        ready_tail = &op->next_;
      }
    }
    // Forget streams with nothing queued (streams come and go).
    std::erase_if(fifos_, [](const fifo& f) { return f.head == nullptr; });
    if (pending_ != 0) {
      // (A) covers a pending event only if a host function will fire for it.
      st.sleep_bound = unsignalled_ == 0 ? std::chrono::nanoseconds::max() : opts_.poll_interval;
    }
    st.did_work = ready != nullptr || n_copies != 0 || more;
    // From here on: locals only (see above).
    for (std::size_t i = 0; i < n_copies; ++i) {
      completion* c = copies[i].done;
      const cudaError_t e = static_cast<cudaError_t>(copies[i].query);
      c->done(c, e == cudaSuccess ? std::error_code{} : make_error_code(e));
    }
    while (event_operation* op = ready) {
      ready = op->next_;  // read first: completing may free *op
      op->complete(op, -static_cast<int>(op->query_), 0);  // 0 on success
    }
    return st;
  }

  const char* name() const noexcept override { return "cuda-events"; }

  /// Operations and copies queued and not yet completed.
  std::size_t pending() const noexcept { return pending_; }
  const event_poller_options& options() const noexcept { return opts_; }
  const event_poller_stats& stats() const noexcept { return stats_; }
  /// Host functions that have run (strategy A); written by the driver's thread.
  std::uint64_t host_funcs_run() const noexcept { return wake_.fired.load(std::memory_order_relaxed); }
  scheduler& sched() const noexcept { return *sched_; }
  /// Whether this poller holds its scheduler's `copy_engine` slot.
  bool is_copy_engine() const noexcept { return copy_slot_; }

 private:
  struct fifo {
    cudaStream_t stream = nullptr;
    event_operation* head = nullptr;
    event_operation* tail = nullptr;
  };

  // What a queued copy completes; the poller owns these (nodes_).
  struct copy_node : event_operation {
    completion* done_ = nullptr;
    ipc_share::entry* ipc_ = nullptr;  // the peer's allocation a CUDA IPC copy reads
  };

  // A finished copy, as poll() keeps it between its two passes.
  struct finished_copy {
    completion* done;
    std::int16_t query;
  };
  // Bounds poll()'s frame (16 bytes each). The staged path keeps a few chunks
  // in flight per endpoint, so one poll rarely finds more.
  static constexpr std::size_t max_copies_per_poll = 64;

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

  // Room for one more FIFO, so that push() cannot run out of memory once the
  // event is recorded: enqueue and copy call it before anything else (a
  // FIFO's vector only grows here, and poll() keeps its capacity).
  bool reserve_fifo() noexcept {
    if (fifos_.size() < fifos_.capacity()) return true;
    try {
      fifos_.reserve(fifos_.empty() ? 4 : 2 * fifos_.size());
    } catch (...) {  // std::bad_alloc
      return false;
    }
    return true;
  }

  // Within the capacity reserve_fifo made: never allocates.
  fifo& fifo_of(cudaStream_t s) noexcept {
    for (fifo& f : fifos_)
      if (f.stream == s) return f;
    assert(fifos_.size() < fifos_.capacity() && "event_poller: reserve_fifo() first");
    fifos_.push_back(fifo{s, nullptr, nullptr});
    return fifos_.back();
  }

  // Queues `op` behind event `ev`, already recorded on `stream`.
  void push(cudaStream_t stream, int device, event_operation* op, cudaEvent_t ev) noexcept {
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
  }

  // The poller's stream for copies in direction `d` on GPU `device`, created
  // on first use (a blocking stream: see below).
  std::error_code copy_stream(int device, direction d, cudaStream_t* out) noexcept {
    return copy_stream(device, d == direction::to_host ? std::size_t{0} : std::size_t{1}, out);
  }
  // The streams' slots per GPU: to host, to device, CUDA IPC copies.
  static constexpr std::size_t ipc_slot = 2;
  std::error_code copy_stream(int device, std::size_t i, cudaStream_t* out) noexcept {
    const auto dev = static_cast<std::size_t>(device);
    if (dev < copy_streams_.size() && copy_streams_[dev][i] != nullptr) {
      *out = copy_streams_[dev][i];
      return {};
    }
    // Streams belong to the device current at creation. A bad ordinal fails
    // here, before the table grows for it.
    cudaStream_t s = nullptr;
    {
      device_guard guard(device);
      if (guard.error()) return guard.error();
      // Blocking streams: work queued on the legacy default stream before a
      // copy (a kernel, a cudaMemset, a cudaMemcpy from pageable memory
      // whose DMA may still run) is done before the copy starts.
      if (std::error_code ec = check(cudaStreamCreateWithFlags(&s, cudaStreamDefault), "cudaStreamCreateWithFlags"))
        return ec;
    }
    try {
      if (dev >= copy_streams_.size()) copy_streams_.resize(dev + 1);
    } catch (...) {
      check_or_log(cudaStreamDestroy(s), "cudaStreamDestroy");
      return make_error_code(std::errc::not_enough_memory);
    }
    copy_streams_[dev][i] = s;
    ++stats_.streams_created;
    *out = s;
    return {};
  }

  // Makes `s` wait for the work already queued on `after.stream`, on the GPU.
  std::error_code order_after(stream_order after, cudaStream_t s) noexcept {
    cudaEvent_t ev = nullptr;
    if (std::error_code ec = acquire_event(after.device, &ev)) return ec;
    std::error_code ec = check(cudaEventRecord(ev, after.stream), "cudaEventRecord (after)");
    if (!ec) ec = check(cudaStreamWaitEvent(s, ev, 0), "cudaStreamWaitEvent");
    // Back to the pool at once, even if recorded again before `s` gets
    // there: the wait is on the event as it was when cudaStreamWaitEvent
    // was called.
    release_event(after.device, ev);
    return ec;
  }

  copy_node* take_node() noexcept {
    if (copy_node* n = free_nodes_) {
      free_nodes_ = static_cast<copy_node*>(n->next_);
      n->next_ = nullptr;
      return n;
    }
    try {
      nodes_.emplace_back();  // a deque: nodes never move
    } catch (...) {
      return nullptr;
    }
    ++stats_.copy_nodes;
    return &nodes_.back();
  }

  void recycle(copy_node* n) noexcept {
    n->copy_ = false;
    n->done_ = nullptr;
    n->ipc_ = nullptr;
    n->next_ = free_nodes_;
    free_nodes_ = n;
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
  std::vector<std::array<cudaStream_t, 3>> copy_streams_;  // per device: to_host, to_device, CUDA IPC
  std::deque<copy_node> nodes_;  // every copy node ever made
  copy_node* free_nodes_ = nullptr;  // those not in flight, linked by next_
  std::size_t pending_ = 0;
  std::size_t unsignalled_ = 0;
  bool copy_slot_ = false;  // holds the scheduler's copy_engine slot
  wake_state wake_;
  event_poller_stats stats_;
  ipc_share ipc_;
};

namespace detail {

/// Base of awaitables that queue GPU work on a stream and complete when an
/// event recorded after it has completed. `Derived::issue()` queues the work
/// (`noexcept`, returns an error code); `Derived` may set `ec_` before the
/// await (argument errors), which then completes at once.
///
/// Work queued cannot be recalled: if `issue()` succeeded and the event then
/// cannot be recorded (no event or memory to be had, the device guard
/// fails), the coroutine resumes with that error only after
/// `Derived::drain_issued()` has waited on the host for the stream to run the
/// work (`cudaStreamSynchronize`, as `event_poller::copy` does), so the
/// caller may release its buffers at once. A `Derived` that queues nothing
/// hides `drain_issued` with a no-op (`synchronize`).
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
      // The work just queued may still run: the caller must not see the
      // error before it has (see the class comment). An error path of an
      // error path: a host wait is acceptable.
      static_cast<Derived*>(this)->drain_issued();
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

  /// Waits on the host until the stream has run what `issue()` queued (the
  /// event after it could not be recorded). A `Derived` that queues nothing
  /// hides it with a no-op.
  void drain_issued() noexcept {
    check_or_log(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (after a failed cudaEventRecord)");
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
  /// Nothing was queued: no host wait on a stream that may run long work.
  void drain_issued() noexcept {}
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

#include <gdr/cuda/event_poller_ipc.hpp>
