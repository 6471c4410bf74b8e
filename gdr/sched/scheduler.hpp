/// \file
/// `gdr::scheduler`: one event loop per thread, built on io_uring.
///
/// How it works
/// ============
/// Threads. A scheduler belongs to the thread that runs it (`run_until`,
/// `run_once`, `sync_wait`). Everything that touches the ring, the pollers and
/// the operations happens on that thread. The only entry points safe from other
/// threads are `post()` (and what is built on it: `schedule()`, cross-thread
/// cancellation) and `wake()`.
///
/// Queues. There are three:
///   1. the io_uring submission queue: operations prepare SQEs with `get_sqe()`;
///      nothing enters the kernel until the loop submits, so SQEs prepared by
///      many coroutines in one iteration go in one `io_uring_enter` (a syscall
///      costs ~1.2 us here, a NOP ~90 ns in batches of 32: batching matters);
///   2. the io_uring completion queue: each CQE's `user_data` is the address of
///      an `operation`, whose `complete` function pointer resumes its coroutine;
///   3. the remote queue: a lock-free intrusive stack of `remote_work` nodes
///      pushed by other threads, drained (in posting order) once per iteration.
/// Other completion sources (CUDA events, RDMA CQs, the sockets of TCP
/// endpoints while the loop busy-polls) are `poller`s, polled once per
/// iteration after the CQ.
///
/// One iteration (`run_once`): drain the remote queue; reap every available
/// CQE (copied out, CQ advanced, then dispatched, so a completion handler may
/// prepare new SQEs freely); poll each poller; then, if nothing did work and
/// the mode is `sleep`, submit and block in `io_uring_enter` until a CQE
/// arrives or the shortest poller bound elapses; otherwise submit without
/// waiting.
///
/// Sleeping and waking. In `busy_poll` mode the loop never blocks (lowest
/// latency, one core spent). In `sleep` mode it blocks in the kernel. Another
/// thread wakes it by posting: it pushes a node, then, if the loop says it is
/// asleep, sends a message to the ring: `IORING_OP_MSG_RING` when the poster runs
/// a scheduler of its own (fastest, 2.9-3.8 us), else a write to an eventfd the
/// ring always has a read pending on. The "asleep" flag and the queue are both
/// sequentially consistent, so a push racing with the loop going to sleep is
/// seen by one side or the other (Dekker).
///
/// Ownership. The scheduler owns the ring, the eventfd and the remote queue's
/// head. Operations are owned by their coroutines (they live in coroutine
/// frames); an operation must outlive its last completion, which is why a
/// cancelled operation still waits for its CQE before its coroutine resumes.
/// Pollers are owned by whoever added them.
#pragma once

#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <optional>
#include <stop_token>
#include <thread>
#include <utility>
#include <vector>

#include <gdr/config.hpp>
#include <gdr/error.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/poller.hpp>

#if GDR_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace gdr {

/// How the loop waits when there is nothing to do.
enum class run_mode {
  busy_poll,  ///< never block: poll the CQ and the pollers in a tight loop
  sleep,      ///< block in io_uring_enter until a completion or a poller bound
};

/// Construction options of a scheduler.
struct scheduler_options {
  unsigned sq_entries = 256;          ///< io_uring submission queue size
  run_mode mode = run_mode::sleep;    ///< how the loop waits
};

/// Counters a scheduler keeps; cheap, for tests and benchmarks.
struct scheduler_stats {
  std::uint64_t iterations = 0;   ///< run_once calls
  std::uint64_t completions = 0;  ///< CQEs dispatched to operations
  std::uint64_t submits = 0;      ///< io_uring_enter calls made to submit or wait
  std::uint64_t sleeps = 0;       ///< times the loop blocked in the kernel
  std::uint64_t remote = 0;       ///< remote_work nodes run
};

class scheduler;

namespace detail {
inline thread_local scheduler* current_scheduler = nullptr;

// user_data values that are not operations. Heap and stack addresses are never
// this small.
inline constexpr std::uint64_t ignore_tag = 0;  // cancel requests, MSG_RING sources
inline constexpr std::uint64_t wake_tag = 1;    // MSG_RING wake-ups from other rings
}  // namespace detail

/// An io_uring event loop. See the file comment for the design.
///
/// Thread-safety: only `post`, `wake` and `schedule` may be used from other
/// threads; all else on the thread that runs the loop.
class scheduler {
 public:
  /// Creates the ring. Throws `gdr::error` (with the errno from
  /// `io_uring_queue_init`) when io_uring is unavailable.
  explicit scheduler(scheduler_options opts = {}) : mode_(opts.mode) {
    io_uring_params p{};
    // COOP_TASKRUN: completions are delivered at the next kernel entry instead of
    // interrupting the thread; TASKRUN_FLAG tells liburing when such an entry is
    // due, so polling the CQ from user space still sees them.
    p.flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
    int rc = io_uring_queue_init_params(opts.sq_entries, &ring_, &p);
    if (rc == -EINVAL) {  // older kernel: plain ring
      p = io_uring_params{};
      rc = io_uring_queue_init_params(opts.sq_entries, &ring_, &p);
    }
    if (rc < 0) throw error(errno_code(-rc), "io_uring_queue_init");
    assert(!(ring_.flags & (IORING_SETUP_SQE128 | IORING_SETUP_SQPOLL)) && "get_sqe assumes neither");
    tsan_ring_handoff(true);
    // EFD_NONBLOCK matters: a blocking eventfd sends io_uring's read to a kernel
    // worker thread, 35-60 us a wake-up instead of ~2 us (measured here).
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) {
      int err = errno;
      io_uring_queue_exit(&ring_);
      throw error(errno_code(err), "eventfd");
    }
    wake_op_.self = this;
    wake_op_.complete = &wake_read_done;
    arm_wake_read();
  }

  scheduler(const scheduler&) = delete;
  scheduler& operator=(const scheduler&) = delete;

  /// Destroys the ring. Operations still in flight are a bug of the caller
  /// (their coroutines would never resume); asserted in debug builds.
  ~scheduler() {
    assert(inflight_ == 0 && "scheduler destroyed with operations in flight");
    assert(remote_head_.load() == nullptr && "scheduler destroyed with posted work");
    tsan_ring_handoff(false);
    io_uring_queue_exit(&ring_);
    ::close(wake_fd_);
  }

  /// The scheduler running on this thread, or nullptr.
  static scheduler* current() noexcept { return detail::current_scheduler; }

  run_mode mode() const noexcept { return mode_; }
  void set_mode(run_mode m) noexcept { mode_ = m; }
  const scheduler_stats& stats() const noexcept { return stats_; }
  /// Operations submitted whose final completion has not arrived yet.
  std::size_t inflight() const noexcept { return inflight_; }
  /// The ring, for code that needs liburing calls gdr does not wrap.
  io_uring* ring() noexcept { return &ring_; }

  // ---------------------------------------------------------------- SQEs

  /// A free SQE, or nullptr if the SQ is full even after submitting what is
  /// queued. The caller must fill it and set its user_data, then call
  /// `note_submitted()` for SQEs whose completions reach an operation.
  io_uring_sqe* get_sqe() noexcept {
    // liburing's io_uring_get_sqe without its branches for SQE128 and SQPOLL
    // rings, which gdr never creates (checked in the constructor): the
    // fetch is on every operation's path (benchmarks/RESULTS.md, (a)).
    io_uring_sq& sq = ring_.sq;
    const unsigned tail = sq.sqe_tail;
    if (GDR_LIKELY(tail - IO_URING_READ_ONCE(*sq.khead) < sq.ring_entries)) {
      sq.sqe_tail = tail + 1;
      return &sq.sqes[tail & sq.ring_mask];
    }
    submit();
    return io_uring_get_sqe(&ring_);
  }

  /// Counts one more operation whose final CQE is outstanding.
  void note_submitted() noexcept { ++inflight_; }
  /// For operations completed by a poller instead of a CQE: counts one
  /// counted by `note_submitted` as done.
  void note_done() noexcept { --inflight_; }

  /// Submits queued SQEs now (the loop does this each iteration anyway).
  void submit() noexcept {
    if (io_uring_sq_ready(&ring_) == 0) return;
    ++stats_.submits;
    io_uring_submit(&ring_);
  }

  /// Asks the kernel to cancel the operation `op` (async cancel). Its
  /// completion still arrives, with -ECANCELED unless it finished first.
  /// Loop thread only.
  void cancel(operation* op) noexcept {
    io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return;  // SQ full: the operation completes on its own
    io_uring_prep_cancel64(sqe, op->user_data(), 0);
    io_uring_sqe_set_data64(sqe, detail::ignore_tag);
  }

  // ---------------------------------------------------------------- pollers

  /// Adds a completion source; polled every iteration until removed.
  /// Either may be called from inside a poller's `poll()` (a completion
  /// resumed a coroutine that created or destroyed a poller).
  void add_poller(poller& p) {
    pollers_.push_back(&p);
    ++pollers_changed_;
  }
  void remove_poller(poller& p) noexcept {
    std::erase(pollers_, &p);
    ++pollers_changed_;
  }

  /// This scheduler's poller of type `P` (the one holding the slot of
  /// `P::kind`), or nullptr. One load, no lock and no search: awaitables call
  /// it on every await. Safe from any thread; the pointer stays valid while
  /// that poller lives, which is its owner's business.
  template <slotted_poller P>
  P* poller_slot() const noexcept {
    // Acquire pairs with the release in claim_poller_slot: a thread that sees
    // the pointer sees the poller as constructed up to its claim.
    return static_cast<P*>(poller_slots_[slot_index<P>()].load(std::memory_order_acquire));
  }

  /// Puts `p` in the slot of `P::kind` if the slot is empty. Returns false,
  /// and changes nothing, if another poller holds it: a scheduler has at most
  /// one poller of each kind. Does not add `p` to the polled set
  /// (`add_poller` does). Safe from any thread.
  template <slotted_poller P>
  bool claim_poller_slot(P& p) noexcept {
    poller* expected = nullptr;
    return poller_slots_[slot_index<P>()].compare_exchange_strong(expected, &p, std::memory_order_acq_rel,
                                                                  std::memory_order_acquire);
  }

  /// Empties the slot of `P::kind` if `p` holds it (for `p`'s destructor).
  template <slotted_poller P>
  void release_poller_slot(P& p) noexcept {
    poller* expected = &p;
    poller_slots_[slot_index<P>()].compare_exchange_strong(expected, nullptr, std::memory_order_release,
                                                           std::memory_order_relaxed);
  }

  // ---------------------------------------------------------------- remote

  /// Hands `w` to this scheduler's thread; `w->run` is called there once, in
  /// posting order. Safe from any thread, and from `w`-owning coroutines about
  /// to suspend. `w` must stay alive until it has run.
  void post(remote_work* w) noexcept {
    remote_work* head = remote_head_.load(std::memory_order_relaxed);
    do {
      w->next = head;
    } while (!remote_head_.compare_exchange_weak(head, w, std::memory_order_seq_cst,
                                                 std::memory_order_relaxed));
    // Dekker pairing with run_once: push (seq_cst) then read `sleeping_` (seq_cst);
    // the loop writes `sleeping_` then reads the queue. One side sees the other.
    if (sleeping_.load(std::memory_order_seq_cst)) wake();
  }

  /// Wakes the loop if it sleeps in the kernel. Safe from any thread.
  void wake() noexcept {
    scheduler* from = current();
    if (from != nullptr && from != this) {
      // The poster has a ring of its own: message our ring directly.
      if (io_uring_sqe* sqe = from->get_sqe()) {
        io_uring_prep_msg_ring(sqe, ring_.ring_fd, 0, detail::wake_tag, 0);
        io_uring_sqe_set_data64(sqe, detail::ignore_tag);
        from->submit();
        return;
      }
    }
    std::uint64_t one = 1;
    // A full counter (EAGAIN) means a wake-up is pending anyway.
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }

  /// Awaitable that resumes the awaiting coroutine on this scheduler's
  /// thread. Completes inline if already there.
  auto schedule() noexcept {
    struct awaiter : remote_work {
      scheduler* s;
      std::coroutine_handle<> h;
      bool await_ready() const noexcept { return current() == s; }
      void await_suspend(std::coroutine_handle<> c) noexcept {
        h = c;
        run = [](remote_work* w) noexcept { static_cast<awaiter*>(w)->h.resume(); };
        s->post(this);
      }
      void await_resume() const noexcept {}
    };
    return awaiter{{}, this, {}};
  }

  /// Runs the work posted so far, now. Loop thread only; for operations that
  /// must see their own posted node run before they finish.
  bool run_posted() noexcept { return drain_remote(); }

  // ---------------------------------------------------------------- running

  /// One loop iteration (see the file comment). `may_block` permits sleeping
  /// in sleep mode. Returns true if any work was done.
  bool run_once(bool may_block = true) {
    binding bind(this);
    ++stats_.iterations;
    bool worked = drain_remote();
    worked |= reap();
    auto bound = std::chrono::nanoseconds::max();
    // By index, and re-read: a poll may add or remove pollers (see
    // add_poller). If the set changed, one may have been skipped, so the loop
    // goes round again instead of sleeping on an incomplete bound.
    std::uint64_t changed = pollers_changed_;
    for (std::size_t i = 0; i < pollers_.size(); ++i) {
      poll_status s = pollers_[i]->poll();
      worked |= s.did_work;
      if (s.sleep_bound < bound) bound = s.sleep_bound;
    }
    worked |= changed != pollers_changed_;
    if (!worked && may_block && mode_ == run_mode::sleep && bound.count() > 0) {
      sleep(bound);
    } else {
      submit();
    }
    return worked;
  }

  /// Runs the loop until `done()` returns true (checked between iterations).
  template <class Pred>
  void run_until(Pred&& done) {
    while (!done()) run_once(true);
  }

  /// Runs until no operation is in flight and no posted work is queued.
  void drain() {
    run_until([this] { return inflight_ == 0 && remote_head_.load() == nullptr; });
  }

 private:
  // liburing maps and unmaps the rings with raw system calls, which TSan does
  // not see: when a ring freed on one thread is mapped again at the same
  // address by another, TSan takes the first SQE writes of the new ring for a
  // race with the old one's. Each page of a ring is a TSan sync object: the
  // destructor releases it, the constructor acquires it, so the reuse is
  // ordered as a free and a malloc would be. No-op without TSan.
  void tsan_ring_handoff([[maybe_unused]] bool acquire) noexcept {
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
    pages(ring_.sq.ring_ptr, ring_.sq.ring_sz);
    if (ring_.cq.ring_ptr != ring_.sq.ring_ptr) pages(ring_.cq.ring_ptr, ring_.cq.ring_sz);
    pages(ring_.sq.sqes, std::size_t{ring_.sq.ring_entries} * sizeof(io_uring_sqe));
#endif
  }

  template <class P>
  static constexpr std::size_t slot_index() noexcept {
    static_assert(static_cast<std::size_t>(P::kind) < detail::poller_kind_count,
                  "poller_kind_count does not count every poller_kind");
    return static_cast<std::size_t>(P::kind);
  }

  struct binding {
    scheduler* prev;
    explicit binding(scheduler* s) noexcept : prev(std::exchange(detail::current_scheduler, s)) {}
    ~binding() { detail::current_scheduler = prev; }
    binding(const binding&) = delete;
    binding& operator=(const binding&) = delete;
  };

  struct wake_op : operation {
    scheduler* self = nullptr;
  };

  static void wake_read_done(operation* op, int, std::uint32_t) noexcept {
    // The count read is irrelevant: the remote queue is drained every iteration.
    static_cast<wake_op*>(op)->self->arm_wake_read();
  }

  void arm_wake_read() noexcept {
    io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return;  // unreachable: only called with a free SQ slot
    io_uring_prep_read(sqe, wake_fd_, &wake_buf_, sizeof wake_buf_, 0);
    // Not counted in inflight_: it is the loop's own, always pending.
    io_uring_sqe_set_data(sqe, static_cast<operation*>(&wake_op_));
  }

  bool drain_remote() noexcept {
    if (remote_head_.load(std::memory_order_relaxed) == nullptr) return false;
    remote_work* list = remote_head_.exchange(nullptr, std::memory_order_acquire);
    // The stack is LIFO: reverse it so work runs in posting order.
    remote_work* fifo = nullptr;
    while (list != nullptr) {
      remote_work* next = list->next;
      list->next = fifo;
      fifo = list;
      list = next;
    }
    while (fifo != nullptr) {
      remote_work* next = fifo->next;  // `run` may free the node
      ++stats_.remote;
      fifo->run(fifo);
      fifo = next;
    }
    return true;
  }

  bool reap() noexcept {
    struct completion {
      std::uint64_t user_data;
      int res;
      std::uint32_t flags;
    };
    constexpr unsigned batch = 64;
    bool worked = false;
    for (;;) {
      unsigned n = io_uring_cq_ready(&ring_);
      if (n == 0) {
        // Completions can be held in the kernel until its next entry (task
        // work under COOP_TASKRUN, or an overflowed CQ); the kernel says so in
        // the SQ ring's flags. This is what io_uring_peek_batch_cqe checks,
        // inlined: that call was a tenth of the loop's own instructions per
        // NOP (benchmarks/RESULTS.md, (a)).
        if (!(IO_URING_READ_ONCE(*ring_.sq.kflags) & (IORING_SQ_CQ_OVERFLOW | IORING_SQ_TASKRUN))) break;
        io_uring_get_events(&ring_);
        n = io_uring_cq_ready(&ring_);
        if (n == 0) break;
      }
      if (n > batch) n = batch;
      completion done[batch];
      const unsigned head = *ring_.cq.khead;
      const unsigned mask = ring_.cq.ring_mask;
      for (unsigned i = 0; i < n; ++i) {
        const io_uring_cqe& c = ring_.cq.cqes[(head + i) & mask];  // 16-byte CQEs: no CQE32 ring
        done[i] = {c.user_data, c.res, c.flags};
      }
      // Advance before dispatching: handlers may submit and even wait.
      io_uring_cq_advance(&ring_, n);
      for (unsigned i = 0; i < n; ++i) dispatch(done[i].user_data, done[i].res, done[i].flags);
      worked = true;
      if (n < batch) break;
    }
    return worked;
  }

  void dispatch(std::uint64_t user_data, int res, std::uint32_t flags) noexcept {
    static_assert(detail::ignore_tag == 0 && detail::wake_tag == 1);
    if (GDR_UNLIKELY(user_data <= detail::wake_tag)) return;  // not an operation
    operation* op = operation::from_user_data(user_data);
    if (GDR_LIKELY(op != &wake_op_)) {
      ++stats_.completions;
      if (!(flags & IORING_CQE_F_MORE)) --inflight_;
    }
    op->complete(op, res, flags);
  }

  void sleep(std::chrono::nanoseconds bound) {
    // Announce the sleep, then look at the remote queue once more (see post()).
    sleeping_.store(true, std::memory_order_seq_cst);
    if (remote_head_.load(std::memory_order_seq_cst) != nullptr) {
      sleeping_.store(false, std::memory_order_relaxed);
      submit();
      return;
    }
    ++stats_.sleeps;
    ++stats_.submits;
    io_uring_cqe* cqe = nullptr;
    if (bound == std::chrono::nanoseconds::max()) {
      io_uring_submit_and_wait(&ring_, 1);
    } else {
      __kernel_timespec ts{};
      ts.tv_sec = static_cast<long long>(bound.count() / 1'000'000'000);
      ts.tv_nsec = static_cast<long long>(bound.count() % 1'000'000'000);
      io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr);
    }
    sleeping_.store(false, std::memory_order_relaxed);
  }

  io_uring ring_{};
  run_mode mode_;
  int wake_fd_ = -1;
  std::uint64_t wake_buf_ = 0;
  wake_op wake_op_{};
  std::size_t inflight_ = 0;
  std::vector<poller*> pollers_;
  std::uint64_t pollers_changed_ = 0;  // bumped by add_poller and remove_poller
  // Written when a poller is constructed or destroyed, read on every await
  // that needs one: atomics so that poller_slot() is safe from any thread.
  std::atomic<poller*> poller_slots_[detail::poller_kind_count]{};
  std::atomic<remote_work*> remote_head_{nullptr};
  std::atomic<bool> sleeping_{false};
  scheduler_stats stats_{};
};

/// The scheduler running on this thread. Precondition: called from inside a
/// scheduler's loop (a coroutine started by `sync_wait` or `run_until`).
inline scheduler& this_scheduler() noexcept {
  assert(scheduler::current() != nullptr && "no gdr::scheduler runs on this thread");
  return *scheduler::current();
}

}  // namespace gdr
