/// \file
/// `gdr::scheduler`: one event loop per thread, built on io_uring.
///
/// How it works (the whole design, by section: docs/SCHEDULER.md)
/// ============
/// Threads. A scheduler belongs to the thread that runs it (`run_until`,
/// `run_once`, `sync_wait`); everything that touches the ring, the pollers
/// and the operations happens there. Only `post()` (and `schedule()`,
/// cross-thread cancellation, built on it) and `wake()` are safe from other
/// threads. With `scheduler_options::single_thread` (the default) the ring
/// is bound to the first thread that runs the loop (SINGLE_ISSUER,
/// DEFER_TASKRUN: "One thread per ring").
///
/// Queues: the io_uring SQ (operations prepare SQEs with `get_sqe()`; one
/// `io_uring_enter` per iteration submits them all), the CQ (each CQE's
/// `user_data` is an `operation` whose `complete` resumes its coroutine), and
/// the remote queue (a lock-free stack other threads push onto, drained in
/// posting order once per iteration). Other completion sources (CUDA events,
/// RDMA CQs, TCP sockets while the loop busy-polls) are `poller`s.
///
/// One iteration (`run_once`): what waited for an SQE (the eventfd read,
/// cancels); the remote queue; every CQE (copied out and the CQ advanced
/// before dispatch); each poller; then, if nothing did work in `sleep` mode,
/// submit and block until a CQE or the shortest poller bound, else submit.
/// Another thread wakes a sleeping loop with `IORING_OP_MSG_RING` or an
/// eventfd write ("Sleeping and waking", "A wake-up is never lost");
/// "Cancellation", "Ownership" and "Teardown" say what happens to
/// operations stopped, in flight, and left when the scheduler ends.
#pragma once

#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <optional>
#include <stop_token>
#include <thread>
#include <utility>
#include <vector>

#include <gdr/config.hpp>
#include <gdr/error.hpp>
#include <gdr/log.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/options.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/stop_hook.hpp>
#include <gdr/sched/tsan_ring.hpp>
#include <gdr/sched/wake.hpp>

namespace gdr {

class scheduler;

namespace detail {
inline thread_local scheduler* current_scheduler = nullptr;

struct scheduler_testing;
}  // namespace detail

/// An io_uring event loop. See the file comment and docs/SCHEDULER.md.
///
/// Thread-safety: only `post`, `wake` and `schedule` may be used from other
/// threads; all else on the thread that runs the loop.
class scheduler {
 public:
  /// Creates the ring. Throws `gdr::error` (with the errno from
  /// `io_uring_queue_init`) when io_uring is unavailable, `std::bad_alloc`.
  explicit scheduler(scheduler_options opts = {}) : mode_(opts.mode), teardown_timeout_(opts.teardown_timeout) {
    // DEFER_TASKRUN (with SINGLE_ISSUER, which it needs; R_DISABLED so that
    // the loop's thread, not this one, becomes the issuer): completion work
    // waits for the issuer's next kernel entry. COOP_TASKRUN, where that is
    // refused: it is delivered at the next entry of any kind instead of
    // interrupting the thread. TASKRUN_FLAG with either tells the loop when
    // such an entry is due, so polling the CQ from user space still sees
    // them (reap). An older kernel refuses both: a plain ring.
    constexpr unsigned coop = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
    constexpr unsigned bound = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG |
                               IORING_SETUP_R_DISABLED;
    int rc = -EINVAL;
    for (unsigned flags : {opts.single_thread ? bound : coop, coop, 0u}) {
      io_uring_params p{};
      p.flags = flags;
      rc = io_uring_queue_init_params(opts.sq_entries, &ring_, &p);
      if (rc != -EINVAL) break;
    }
    if (rc < 0) throw error(errno_code(-rc), "io_uring_queue_init");
    bound_ = (ring_.flags & IORING_SETUP_R_DISABLED) != 0;
    // liburing reads the features the kernel reported from the ring, in the
    // wait with a timeout and in its CQ peeks: clearing the bit here is what
    // an older kernel looks like to both.
    if (!opts.ext_arg) ring_.features &= ~IORING_FEAT_EXT_ARG;
    assert(!(ring_.flags & (IORING_SETUP_SQE128 | IORING_SETUP_SQPOLL)) && "get_sqe assumes neither");
    detail::tsan_ring_handoff(ring_, true);
    // EFD_NONBLOCK matters: a blocking eventfd sends io_uring's read to a kernel
    // worker thread, 35-60 us a wake-up instead of ~2 us (measured here).
    int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      io_uring_queue_exit(&ring_);
      throw error(errno_code(err), "eventfd");
    }
    try {
      channel_ = new detail::wake_channel{};
      // Room for the cancels of a burst in which the kernel refuses the SQ;
      // a longer list allocates (see defer_cancel).
      pending_cancels_.reserve(16);
    } catch (...) {
      delete channel_;
      ::close(fd);
      io_uring_queue_exit(&ring_);
      throw;
    }
    channel_->fd = fd;
    stop_hooks_.prev = stop_hooks_.next = &stop_hooks_;
    if (opts.msg_ring_wakeups && detail::msg_ring_supported(ring_)) msg_ring_fd_ = ring_.ring_fd;
    wake_op_.self = this;
    wake_op_.complete = &wake_read_done;
    arm_wake_read();
  }

  scheduler(const scheduler&) = delete;
  scheduler& operator=(const scheduler&) = delete;

  /// Finishes what is in flight, then destroys the ring: runs the loop on
  /// this thread until no operation, posted work or wake-up message is
  /// outstanding, for at most `scheduler_options::teardown_timeout`; what is
  /// left then is reported on stderr and abandoned (see "Teardown" in
  /// docs/SCHEDULER.md; on another thread than a bound ring's, "One thread
  /// per ring"). Not from inside this scheduler's own loop. Other threads
  /// must have stopped posting to it, as for any object being destroyed.
  ~scheduler() {
    finish_inflight();
    drop_stop_hooks();
    *alive_ = false;
    detail::tsan_ring_handoff(ring_, false);
    io_uring_queue_exit(&ring_);
    // Wake-up messages still in flight to this ring keep the eventfd open
    // until their completions are reaped by their senders.
    channel_->release();
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

  /// Whether this scheduler still exists, for an object that may outlive
  /// it by misuse (an endpoint destroyed after its scheduler must touch
  /// nothing of it: see "Teardown" in docs/SCHEDULER.md). False once the
  /// destructor has finished the loop. Copied by such objects when made.
  std::shared_ptr<const bool> alive_flag() const noexcept { return alive_; }

  /// Counts one more operation whose final CQE is outstanding (or other
  /// work the loop must finish before it is quiescent: see `note_done`).
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
  /// Never dropped: without a free SQE the request waits for the next
  /// iteration (see "Cancellation" in docs/SCHEDULER.md). `op` must be in
  /// flight. Loop thread only.
  void cancel(operation* op) noexcept {
    io_uring_sqe* sqe = get_sqe();
    if (GDR_UNLIKELY(sqe == nullptr)) {
      defer_cancel(op->user_data());
      return;
    }
    prep_cancel(sqe, op->user_data());
  }

  /// Cancels requested without a free SQE, waiting for the next iteration.
  std::size_t pending_cancels() const noexcept { return pending_cancels_.size(); }

  /// Links the hook of an operation whose stop callbacks post to this
  /// scheduler, for as long as they are registered (see `detail::stop_hook`;
  /// `detail::unlink_stop_hook` ends it). `h.drop` must be set. Loop thread
  /// only.
  void link_stop_hook(detail::stop_hook& h) noexcept {
    assert(h.drop != nullptr && h.prev == nullptr);
    h.prev = &stop_hooks_;
    h.next = stop_hooks_.next;
    stop_hooks_.next->prev = &h;
    stop_hooks_.next = &h;
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

  /// Wakes the loop if it sleeps in the kernel. Safe from any thread while
  /// this scheduler exists. From a thread that runs a scheduler of its own,
  /// the wake-up is a MSG_RING message sent from that ring, whose completion
  /// that loop reaps (a failed one is sent again through the eventfd).
  void wake() noexcept {
    scheduler* from = current();
    if (from != nullptr && from != this && msg_ring_fd_ >= 0) {
      if (io_uring_sqe* sqe = from->get_sqe()) {
        // The message's reference to the eventfd: its completion, reaped by
        // `from` perhaps after this scheduler is gone, may need it.
        channel_->acquire();
        // The kernel resolves msg_ring_fd_ during the submit below, while
        // this scheduler (our caller's target) still exists.
        io_uring_prep_msg_ring(sqe, msg_ring_fd_, 0, detail::wake_tag, 0);
        io_uring_sqe_set_data64(sqe, reinterpret_cast<std::uintptr_t>(channel_) | detail::message_bit);
        ++from->messages_inflight_;
        from->submit();
        return;
      }
    }
    channel_->signal();
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

  /// One loop iteration (see "One iteration" in docs/SCHEDULER.md). `may_block` permits sleeping
  /// in sleep mode. Returns true if any work was done.
  bool run_once(bool may_block = true) { return iterate(may_block, std::chrono::nanoseconds::max()); }

  /// Makes this thread the one that runs the loop, as every iteration does
  /// first: a `single_thread` ring is bound to the first thread that runs
  /// it, and on any other this throws `gdr::error` (`errc::unsupported`). For
  /// code that queues work for this thread's loop and then runs it
  /// (`sync_wait`): called before queuing, a refusal leaves nothing queued.
  void claim_thread() {
    if (GDR_UNLIKELY(bound_ && owner_ != &detail::current_scheduler)) claim_ring();
  }

  /// Runs the loop until `done()` returns true (checked between iterations).
  template <class Pred>
  void run_until(Pred&& done) {
    while (!done()) run_once(true);
  }

  /// Runs until no operation is in flight, no posted work is queued and the
  /// wake-up messages this loop sent to others have completed.
  void drain() {
    run_until([this] { return quiescent(); });
  }

 private:
  friend struct detail::scheduler_testing;

  // A CQE as reap() copies it out of the ring.
  struct completion {
    std::uint64_t user_data;
    int res;
    std::uint32_t flags;
  };

  // A batch of CQEs being dispatched by reap(), in its frame; `outer` is the
  // batch of the loop whose handler runs this one's loop, if any.
  struct batch_frame {
    const completion* cqes;
    unsigned next;  // the first CQE not dispatched yet
    unsigned size;
    const batch_frame* outer;
  };

  // run_once, with sleeps no longer than `cap` (the destructor's deadline).
  bool iterate(bool may_block, std::chrono::nanoseconds cap) {
    claim_thread();
    binding bind(this);
    ++stats_.iterations;
    if (GDR_UNLIKELY(!pending_cancels_.empty() || !wake_armed_)) flush_kept();
    bool worked = drain_remote();
    worked |= reap();
    auto bound = cap;
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
    // Without its eventfd read the loop would sleep through posts: it spins
    // until flush_kept has armed the read again.
    if (!worked && may_block && mode_ == run_mode::sleep && bound.count() > 0 && wake_armed_) {
      sleep(bound);
    } else {
      submit();
    }
    return worked;
  }

  bool quiescent() const noexcept {
    return inflight_ == 0 && messages_inflight_ == 0 && remote_head_.load() == nullptr;
  }

  // Whether this thread may enter the ring: any thread unless it is bound
  // to one (single_thread), and then the one it is bound to, or any while it
  // is not bound yet. `&current_scheduler` is the thread's address for this.
  bool loop_thread() const noexcept {
    return !bound_ || owner_ == nullptr || owner_ == &detail::current_scheduler;
  }

  // The first iteration of a single-thread ring binds it to its thread (the
  // kernel takes submissions from this thread only, from now on); a later
  // one on another thread is refused.
  [[gnu::noinline]] void claim_ring() {
    if (owner_ != nullptr)
      throw error(make_error_code(errc::unsupported),
                  "gdr::scheduler: run on a thread other than the one that first ran it; its ring "
                  "is bound to that thread (scheduler_options::single_thread = false lets any "
                  "thread run it)");
    // The system call itself: liburing 2.3's shared library does not export
    // io_uring_enable_rings.
    if (::syscall(__NR_io_uring_register, ring_.ring_fd, IORING_REGISTER_ENABLE_RINGS, nullptr, 0) != 0)
      throw error(errno_code(errno), "io_uring_register(IORING_REGISTER_ENABLE_RINGS)");
    owner_ = &detail::current_scheduler;
  }

  // The destructor's loop (see "Teardown" in docs/SCHEDULER.md). On a
  // thread other than the one its ring is bound to it enters no ring: only
  // what reaches the CQ without a kernel entry is reaped ("One thread per
  // ring").
  void finish_inflight() noexcept {
    using clock = std::chrono::steady_clock;
    if (quiescent()) return;
    const bool here = loop_thread();
    const clock::time_point deadline = clock::now() + teardown_timeout_;
    for (;;) {
      clock::time_point now = clock::now();
      if (now >= deadline) break;
      if (here) {
        iterate(true, deadline - now);
      } else if (!reap_elsewhere()) {
        std::this_thread::yield();
      }
      if (quiescent()) return;
    }
    // One line, where the problem shows; the destructor must not throw or
    // abort (a program ending with work outstanding should still end).
    gdr::detail::log("scheduler",
                here ? "destroyed with %zu operation(s) still in flight after %lld ms of teardown; "
                       "abandoning them (their coroutines will not resume, what they hold is leaked)"
                     : "destroyed on a thread other than the one that ran its loop, with %zu operation(s) "
                       "still in flight after %lld ms; abandoning them (their coroutines will not resume, "
                       "what they hold is leaked; single_thread binds the ring to the loop's thread)",
                inflight_ + messages_inflight_, static_cast<long long>(teardown_timeout_.count()));
  }

  // An iteration without a kernel entry (finish_inflight on another thread).
  bool reap_elsewhere() noexcept {
    binding bind(this);
    bool worked = drain_remote();
    worked |= reap(false);
    for (std::size_t i = 0; i < pollers_.size(); ++i) worked |= pollers_[i]->poll().did_work;
    return worked;
  }

  // The destructor, after finish_inflight: the operations still pending will
  // never complete here; their stop callbacks must not reach this scheduler
  // (see "Teardown" in docs/SCHEDULER.md).
  void drop_stop_hooks() noexcept {
    while (stop_hooks_.next != &stop_hooks_) {
      detail::stop_hook* h = stop_hooks_.next;
      // Unlinked first: the operation's own unlink_stop_hook, if it ever
      // runs, must not reach this scheduler's list.
      detail::unlink_stop_hook(*h);
      h->drop(h);
    }
  }

  void prep_cancel(io_uring_sqe* sqe, std::uint64_t target) noexcept {
    io_uring_prep_cancel64(sqe, target, 0);
    io_uring_sqe_set_data64(sqe, detail::ignore_tag);
  }

  // No SQE for a cancel (the kernel refused the SQ): keep it for flush_kept.
  [[gnu::noinline]] void defer_cancel(std::uint64_t target) noexcept {
    // Its operation's final CQE may wait in the batch being dispatched (a
    // handler earlier in it asked for the cancel): then it is finishing
    // anyway, and a cancel sent later could reach a new operation at the
    // same address. Only CQEs not dispatched yet count: one already
    // dispatched (the handler's own, or an earlier one) ended an operation
    // whose address may now hold the new one this cancel is for. Handlers
    // may run a loop, so the batches of the loops below count too.
    for (const batch_frame* b = batch_; b != nullptr; b = b->outer)
      for (unsigned i = b->next; i < b->size; ++i)
        if (b->cqes[i].user_data == target && !(b->cqes[i].flags & IORING_CQE_F_MORE)) return;
    ++stats_.cancels_deferred;
    try {
      pending_cancels_.push_back(target);  // no allocation within the reserved 16
      return;
    } catch (const std::bad_alloc&) {
    }
    // No memory either: wait here for the kernel to take the SQ rather than
    // lose the cancel (an operation stopped in vain can wait forever).
    for (;;) {
      submit();
      if (io_uring_sqe* sqe = io_uring_get_sqe(&ring_)) {
        prep_cancel(sqe, target);
        return;
      }
      std::this_thread::yield();
    }
  }

  // Start of an iteration: the eventfd read, if it is not armed, and the
  // pending cancels go into the SQ, as many as fit.
  [[gnu::noinline]] void flush_kept() noexcept {
    if (!wake_armed_) arm_wake_read();
    std::size_t sent = 0;
    for (; sent < pending_cancels_.size(); ++sent) {
      io_uring_sqe* sqe = get_sqe();
      if (sqe == nullptr) break;
      prep_cancel(sqe, pending_cancels_[sent]);
    }
    pending_cancels_.erase(pending_cancels_.begin(), pending_cancels_.begin() + static_cast<std::ptrdiff_t>(sent));
  }

  // The operations whose final CQEs are in `done` no longer need a cancel.
  [[gnu::noinline]] void forget_cancels(const completion* done, unsigned n) noexcept {
    for (unsigned i = 0; i < n; ++i)
      if (!(done[i].flags & IORING_CQE_F_MORE)) std::erase(pending_cancels_, done[i].user_data);
  }

  // A MSG_RING wake-up this loop sent has completed (the poster's side).
  [[gnu::noinline]] void message_done(std::uint64_t user_data, int res) noexcept {
    auto* ch = reinterpret_cast<detail::wake_channel*>(static_cast<std::uintptr_t>(user_data & ~detail::message_bit));
    --messages_inflight_;
    if (res < 0) {
      // EBADFD, EOVERFLOW, EINVAL (no MSG_RING after all)...: the target
      // (alive or not) gets the wake-up through its eventfd.
      ++stats_.msg_ring_failed;
      ch->signal();
    }
    ch->release();
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
    if (GDR_UNLIKELY(sqe == nullptr)) {
      // The SQ is full and the kernel refuses it: armed by flush_kept at the
      // start of the next iteration ("Sleeping and waking" in
      // docs/SCHEDULER.md). A wake-up written meanwhile stays in the eventfd's
      // count, and the read armed later returns it at once.
      if (wake_armed_) ++stats_.wake_reads_deferred;
      wake_armed_ = false;
      return;
    }
    io_uring_prep_read(sqe, channel_->fd, &wake_buf_, sizeof wake_buf_, 0);
    // Not counted in inflight_: it is the loop's own, always pending.
    io_uring_sqe_set_data(sqe, static_cast<operation*>(&wake_op_));
    wake_armed_ = true;
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

  // `may_enter` false: what is in the CQ only (reap_elsewhere).
  bool reap(bool may_enter = true) noexcept {
    constexpr unsigned batch = 64;
    bool worked = false;
    for (;;) {
      unsigned n = io_uring_cq_ready(&ring_);
      if (n == 0) {
        // Completions can be held in the kernel until its next entry (task
        // work under DEFER_ or COOP_TASKRUN, or an overflowed CQ); the kernel says so in
        // the SQ ring's flags. This is what io_uring_peek_batch_cqe checks,
        // inlined: that call was a tenth of the loop's own instructions per
        // NOP (benchmarks/RESULTS.md, (a)).
        if (!may_enter || !(IO_URING_READ_ONCE(*ring_.sq.kflags) & (IORING_SQ_CQ_OVERFLOW | IORING_SQ_TASKRUN))) break;
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
      if (GDR_UNLIKELY(!pending_cancels_.empty())) forget_cancels(done, n);
      // What defer_cancel looks at: the CQEs after the one being dispatched
      // (restored after: a handler may run a loop).
      batch_frame frame{done, 0, n, batch_};
      batch_ = &frame;
      for (unsigned i = 0; i < n; ++i) {
        frame.next = i + 1;
        dispatch(done[i].user_data, done[i].res, done[i].flags);
      }
      batch_ = frame.outer;
      worked = true;
      if (n < batch) break;
    }
    return worked;
  }

  void dispatch(std::uint64_t user_data, int res, std::uint32_t flags) noexcept {
    static_assert(detail::ignore_tag == 0 && detail::wake_tag == 1 && alignof(operation) > detail::message_bit);
    static_assert(LIBURING_UDATA_TIMEOUT & detail::message_bit, "liburing's timeout tag is tested on the odd branch");
    if (GDR_UNLIKELY(user_data <= detail::wake_tag)) return;  // not an operation
    if (GDR_UNLIKELY(user_data & detail::message_bit)) {
      // liburing's own timeout of a bounded sleep, without IORING_FEAT_EXT_ARG
      // (see "Bounded sleeps on kernels before 5.11"): not ours to complete.
      if (user_data == LIBURING_UDATA_TIMEOUT) return;
      message_done(user_data, res);
      return;
    }
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
  // single_thread: the ring is bound to one thread, `owner_` (the address of
  // its `current_scheduler`), null until the first iteration enables it.
  bool bound_ = false;
  const void* owner_ = nullptr;
  run_mode mode_;
  std::chrono::milliseconds teardown_timeout_;
  detail::wake_channel* channel_ = nullptr;  // our eventfd; one reference is ours
  // Where other loops send MSG_RING wake-ups: our ring, or -1 when they
  // write the eventfd instead.
  int msg_ring_fd_ = -1;
  std::uint64_t wake_buf_ = 0;
  wake_op wake_op_{};
  std::size_t inflight_ = 0;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // alive_flag()
  std::size_t messages_inflight_ = 0;  // MSG_RING wake-ups sent from this ring, not reaped yet
  std::vector<std::uint64_t> pending_cancels_;  // user_data of operations to cancel
  const batch_frame* batch_ = nullptr;  // the CQEs being dispatched (for defer_cancel)
  bool wake_armed_ = false;  // the eventfd read is in the SQ or the kernel
  // The stop hooks of pending operations: a circular list through this
  // sentinel (set up in the constructor; the scheduler does not move).
  detail::stop_hook stop_hooks_{};
  std::vector<poller*> pollers_;
  std::uint64_t pollers_changed_ = 0;  // bumped by add_poller and remove_poller
  // Written when a poller is constructed or destroyed, read on every await
  // that needs one: atomics so that poller_slot() is safe from any thread.
  std::atomic<poller*> poller_slots_[detail::poller_kind_count]{};
  std::atomic<remote_work*> remote_head_{nullptr};
  std::atomic<bool> sleeping_{false};
  scheduler_stats stats_{};
};

namespace detail {

/// Test access to a scheduler's wake-up path, for tests of its failure
/// handling, and to its poller set. Not for production use.
struct scheduler_testing {
  /// Makes other loops' MSG_RING wake-ups to `s` fail in the kernel: they
  /// are sent to its eventfd, which is not a ring (EBADFD). Call before
  /// other threads post to `s`.
  static void misdirect_msg_ring(scheduler& s) noexcept { s.msg_ring_fd_ = s.channel_->fd; }
  /// Whether other loops wake `s` with MSG_RING (false: through its eventfd).
  static bool wakes_by_msg_ring(const scheduler& s) noexcept { return s.msg_ring_fd_ >= 0; }
  /// How many pollers `s` polls each iteration (a poller in two slots is
  /// still polled once).
  static std::size_t poller_count(const scheduler& s) noexcept { return s.pollers_.size(); }
};

}  // namespace detail

/// The scheduler running on this thread. Precondition: called from inside a
/// scheduler's loop (a coroutine started by `sync_wait` or `run_until`).
inline scheduler& this_scheduler() noexcept {
  assert(scheduler::current() != nullptr && "no gdr::scheduler runs on this thread");
  return *scheduler::current();
}

}  // namespace gdr
