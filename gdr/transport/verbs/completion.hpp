/// \file
/// The RDMA completion queues of one scheduler: `verbs::cq_poller`, the
/// scheduler's `poller_kind::verbs_cq` poller.
///
/// How it works
/// ============
/// A scheduler has at most one `cq_poller`, made by the first verbs
/// connection or listener on it and freed after the last one is gone
/// (reference counted: connections free themselves asynchronously, after
/// their queue pairs have flushed). Per RDMA device it keeps a protection
/// domain, one completion channel and one completion queue that every queue
/// pair of that device on this scheduler shares.
///
/// Every work request's `wr_id` is the address of a `verbs::work`, whose
/// `complete` function pointer receives the work completion: no table, no
/// search, one indirect call per completion.
///
/// Each loop iteration `poll()` drains up to 32 completions per queue at a
/// time. In `run_mode::busy_poll` that is all: the loop never sleeps and the
/// queues are polled again next iteration. In `run_mode::sleep`, when a poll
/// finds nothing, the queue is armed (`ibv_req_notify_cq`, one-shot) and
/// polled once more (a completion that arrived before the arming raises no
/// event); the channel's descriptor (non-blocking) is watched by one
/// io_uring poll, so the loop sleeps in `io_uring_enter` like for any other
/// I/O. When the descriptor becomes readable the channel's events are read
/// (`ibv_get_cq_event`), acknowledged in batches (`ibv_ack_cq_events` takes a
/// lock: rdma-core's man page recommends batching), and the next `poll()`
/// drains the queue and re-arms it. While a connection has send work in
/// flight (`busy()`), the poller asks the loop not to sleep for a short while:
/// completions of a burst arrive microseconds apart, and a sleep-wake cycle
/// per completion would cost more than the polling.
///
/// Device events (`ibv_get_async_event`: port down, a queue pair's fatal
/// error) are read from each device's async descriptor (non-blocking) every
/// few milliseconds and handed to the registered connection of that queue
/// pair, which fails.
///
/// Thread-safety: everything on the scheduler's thread.
#pragma once

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <liburing.h>
#include <poll.h>
#include <time.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <utility>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/verbs/domain.hpp>
#include <gdr/transport/verbs/flush.hpp>
#include <gdr/transport/verbs/memory.hpp>

namespace gdr::verbs {

/// What a work completion completes: the `wr_id` of every work request a
/// verbs connection posts is the address of one (a receive buffer, a send
/// slot). Called once per completion, on the scheduler's thread.
struct work {
  using complete_fn = void (*)(work* self, const ibv_wc& wc) noexcept;
  complete_fn complete = nullptr;

  std::uint64_t wr_id() noexcept { return reinterpret_cast<std::uintptr_t>(this); }
  static work* from_wr_id(std::uint64_t v) noexcept { return reinterpret_cast<work*>(static_cast<std::uintptr_t>(v)); }
};

/// The `wr_id` of unsignaled work requests: they complete only in error
/// (flushed), and the signaled request after them accounts for them.
inline work* unsignaled_work() noexcept {
  static work w{[](work*, const ibv_wc&) noexcept {}};
  return &w;
}

/// A queue pair's owner, as its device's queue sees it: receives the
/// device's asynchronous events about the queue pair, and a periodic tick
/// (keepalives).
struct qp_event_sink {
  virtual void on_qp_event(ibv_event_type type) noexcept = 0;
  virtual void on_tick() noexcept = 0;

 protected:
  ~qp_event_sink() = default;
};

class cq_poller;

/// One RDMA device as a scheduler uses it: protection domain, completion
/// channel and completion queue.
struct device_queue {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  int cq_size = 0;   ///< entries of `cq`
  int reserved = 0;  ///< entries promised to queue pairs
  bool armed = false;
  unsigned unacked = 0;  ///< channel events read, not yet acknowledged
  /// The io_uring poll of the channel's descriptor.
  struct watch_op : operation {
    device_queue* self = nullptr;
    cq_poller* owner = nullptr;
    bool in_flight = false;
  } watch;
  std::vector<std::pair<ibv_qp*, qp_event_sink*>> sinks;
  /// Registrations of users' buffers that only this side's NIC uses (their
  /// keys never go to a peer), keyed by address range: RDMA READ
  /// destinations of served puts (local write); RDMA WRITE sources (local
  /// read). Memory a peer's NIC reaches is registered exactly, per grant,
  /// and never cached (`gdr/transport/verbs/grants.hpp`).
  std::unique_ptr<mr_cache> recv_mrs;
  std::unique_ptr<mr_cache> send_mrs;
  /// GPU memory of GPUDirect endpoints (`device_access`; made by the first
  /// such endpoint, with its probe's route).
  std::unique_ptr<mr_cache> device_mrs;
  /// The GPUDirect flush's loopback queue pair (made by the first endpoint
  /// whose GPU needs it).
  std::unique_ptr<flush_qp> flush;
  /// The protection domain as a NIC domain registries are exposed in
  /// (domain.hpp).
  std::unique_ptr<pd_domain> domain;
  /// Work objects of connections gone whose (empty) receives may still
  /// complete on this queue (rma.hpp, `lane_teardown`).
  std::vector<std::shared_ptr<void>> orphans;
};

namespace detail {
/// Completions taken per `ibv_poll_cq` call.
inline constexpr int poll_batch = 32;
/// Channel events read before they are acknowledged.
inline constexpr unsigned ack_batch = 16;
/// Entries of a device's completion queue (and so the room for queue pairs
/// on one scheduler: a connection takes its send and receive depth).
inline constexpr int cq_entries = 16384;
}  // namespace detail

/// Counters of a `cq_poller`.
struct cq_poller_stats {
  std::uint64_t polls = 0;        ///< `ibv_poll_cq` calls
  std::uint64_t completions = 0;  ///< work completions dispatched
  std::uint64_t arms = 0;         ///< `ibv_req_notify_cq` calls
  std::uint64_t events = 0;       ///< completion-channel events read
  std::uint64_t async_events = 0; ///< device events read
};

/// The completion queues of one scheduler (see the file comment).
class cq_poller final : public poller {
 public:
  /// The scheduler's slot this poller takes (`scheduler::poller_slot`).
  static constexpr poller_kind kind = poller_kind::verbs_cq;

  /// The poller of `s`, made if it has none; the caller holds a reference
  /// until `release()`. Scheduler's thread (or before it runs). Throws
  /// `std::bad_alloc`.
  static cq_poller& acquire(scheduler& s) {
    cq_poller* p = s.poller_slot<cq_poller>();
    if (p == nullptr) p = new cq_poller(s);
    ++p->refs_;
    return *p;
  }

  /// Drops a reference; the last one frees the poller (from the loop, once
  /// its channel watches have come back).
  void release() noexcept {
    assert(refs_ > 0);
    if (--refs_ == 0) retire();
  }

  /// The poller of `s`, or nullptr.
  static cq_poller* of(const scheduler& s) noexcept { return s.poller_slot<cq_poller>(); }

  cq_poller(const cq_poller&) = delete;
  cq_poller& operator=(const cq_poller&) = delete;

  scheduler& sched() const noexcept { return *sched_; }
  const cq_poller_stats& stats() const noexcept { return stats_; }

  /// The queue of device `ctx` with room for `entries` more completions
  /// (a queue pair's send plus receive depth): made at the first use of the
  /// device. Errors: the verbs call's errno, `errc::busy` if the queue is
  /// full of queue pairs.
  result<device_queue*> reserve(ibv_context* ctx, int entries) noexcept {
    device_queue* d = nullptr;
    for (auto& q : devices_)
      if (q->ctx == ctx) d = q.get();
    if (d == nullptr) {
      result<device_queue*> made = open(ctx);
      if (!made) return made.error();
      d = *made;
    }
    if (d->reserved + entries > d->cq_size) return errc::busy;
    d->reserved += entries;
    return d;
  }

  /// Gives back what `reserve` took.
  void unreserve(device_queue* d, int entries) noexcept { d->reserved -= entries; }

  /// Routes the device's asynchronous events about `qp` to `sink` until
  /// `unwatch_qp`.
  void watch_qp(device_queue* d, ibv_qp* qp, qp_event_sink* sink) {
    d->sinks.emplace_back(qp, sink);
  }
  void unwatch_qp(device_queue* d, ibv_qp* qp) noexcept {
    std::erase_if(d->sinks, [&](const auto& e) { return e.first == qp; });
  }

  /// A connection has send work in flight (+1) or no longer (-1): while any
  /// has, a sleeping loop wakes often instead of waiting for the channel.
  void note_busy(int delta) noexcept { busy_ += delta; }

  /// Drains every completion queue now (a connection that learned of its
  /// peer's departure takes what the peer sent before it left first).
  bool drain() noexcept {
    bool any = false;
    for (std::size_t i = 0; i < devices_.size(); ++i)
      while (poll_one(*devices_[i])) any = true;
    return any;
  }

  poll_status poll() noexcept override {
    bool did = false;
    for (std::size_t i = 0; i < devices_.size(); ++i) did |= poll_one(*devices_[i]);
    const bool busy_mode = sched_->mode() == run_mode::busy_poll;
    poll_async(busy_mode);
    if (did) {
      // The spin window is for sleep mode only: a busy loop never sleeps,
      // and reading the clock on every completion is not free (a system
      // call where the clock source has no vDSO, as in emulators).
      if (!busy_mode) last_work_ = std::chrono::steady_clock::now();
      return {.did_work = true, .sleep_bound = std::chrono::nanoseconds::zero()};
    }
    if (busy_mode || retiring_) return {};
    // Send work in flight: completions are due within microseconds; spin a
    // little before paying a sleep and a wake-up.
    if (busy_ > 0 && std::chrono::steady_clock::now() - last_work_ < spin_window) {
      return {.did_work = false, .sleep_bound = std::chrono::nanoseconds::zero()};
    }
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      device_queue& d = *devices_[i];
      if (!d.armed) {
        ++stats_.arms;
        if (ibv_req_notify_cq(d.cq, 0) == 0) d.armed = true;
        // A completion that came before the arming raises no event.
        if (poll_one(d)) did = true;
      }
      if (!d.watch.in_flight) submit_watch(d);
    }
    poll_status st;
    st.did_work = did;
    // Device events are read by polling: wake at least this often while
    // queue pairs exist.
    st.sleep_bound = did ? std::chrono::nanoseconds::zero() : async_interval;
    return st;
  }

  const char* name() const noexcept override { return "verbs-cq"; }

  /// How long a sleeping loop keeps polling after a completion while send
  /// work is in flight.
  static constexpr std::chrono::microseconds spin_window{50};
  /// How often device events are looked for.
  static constexpr std::chrono::milliseconds async_interval{100};

 private:
  explicit cq_poller(scheduler& s) : sched_(&s) {
    retire_node_.self = this;
    retire_node_.run = &on_retire;
    bool claimed = s.claim_poller_slot(*this);
    assert(claimed && "gdr::verbs::cq_poller: the scheduler's slot is taken");
    (void)claimed;
    try {
      s.add_poller(*this);
    } catch (...) {
      s.release_poller_slot(*this);
      throw;
    }
  }

  ~cq_poller() override {
    for (auto& d : devices_) {
      d->domain.reset();  // its registrations go before the protection domain
      d->recv_mrs.reset();
      d->send_mrs.reset();
      d->device_mrs.reset();
      d->flush.reset();
      if (d->unacked != 0) ibv_ack_cq_events(d->cq, d->unacked);
      if (d->cq != nullptr && ibv_destroy_cq(d->cq) != 0) std::perror("gdr verbs: ibv_destroy_cq");
      if (d->channel != nullptr) ibv_destroy_comp_channel(d->channel);
      if (d->pd != nullptr && ibv_dealloc_pd(d->pd) != 0) std::perror("gdr verbs: ibv_dealloc_pd");
    }
  }

  result<device_queue*> open(ibv_context* ctx) noexcept {
    auto d = std::unique_ptr<device_queue>(new (std::nothrow) device_queue);
    if (!d) return errno_code(ENOMEM);
    d->ctx = ctx;
    d->watch.self = d.get();
    d->watch.owner = this;
    d->watch.complete = &on_watch;
    auto fail = [&](int err) -> result<device_queue*> {
      if (d->cq != nullptr) ibv_destroy_cq(d->cq);
      if (d->channel != nullptr) ibv_destroy_comp_channel(d->channel);
      if (d->pd != nullptr) ibv_dealloc_pd(d->pd);
      return errno_code(err != 0 ? err : EIO);
    };
    errno = 0;
    if ((d->pd = ibv_alloc_pd(ctx)) == nullptr) return fail(errno);
    if ((d->channel = ibv_create_comp_channel(ctx)) == nullptr) return fail(errno);
    if (set_nonblocking(d->channel->fd) != 0) return fail(errno);
    ibv_device_attr attr{};
    int size = detail::cq_entries;
    if (ibv_query_device(ctx, &attr) == 0 && attr.max_cqe > 0) size = std::min(size, attr.max_cqe);
    if ((d->cq = ibv_create_cq(ctx, size, nullptr, d->channel, 0)) == nullptr) return fail(errno);
    d->cq_size = d->cq->cqe;
    try {
      d->recv_mrs = std::make_unique<mr_cache>(mr_backend{d->pd, local_write_access});
      d->send_mrs = std::make_unique<mr_cache>(mr_backend{d->pd, local_read_access});
      d->domain = std::make_unique<pd_domain>(d->pd);
    } catch (...) {
      return fail(ENOMEM);
    }
    // The device's async descriptor: read without blocking (shared with
    // librdmacm's own context, which does not read it).
    set_nonblocking(ctx->async_fd);
    try {
      devices_.push_back(std::move(d));
    } catch (...) {
      return fail(ENOMEM);
    }
    return devices_.back().get();
  }

  static int set_nonblocking(int fd) noexcept {
    int fl = ::fcntl(fd, F_GETFL);
    if (fl < 0) return -1;
    return ::fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  }

  /// One batch from `d`'s queue. True if it found completions.
  bool poll_one(device_queue& d) noexcept {
    ibv_wc wc[detail::poll_batch];
    ++stats_.polls;
    int n = ibv_poll_cq(d.cq, detail::poll_batch, wc);
    if (n <= 0) return false;  // n < 0: the queue itself failed (overrun); nothing to dispatch
    stats_.completions += static_cast<std::uint64_t>(n);
    // Each completion may resume coroutines, which may make or end
    // connections; `d` stays (devices are kept until the poller goes).
    for (int i = 0; i < n; ++i) {
      work* w = work::from_wr_id(wc[i].wr_id);
      w->complete(w, wc[i]);
    }
    return true;
  }

  void submit_watch(device_queue& d) noexcept {
    io_uring_sqe* sqe = sched_->get_sqe();
    if (sqe == nullptr) return;  // tried again next iteration
    io_uring_prep_poll_add(sqe, d.channel->fd, POLLIN);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(&d.watch));
    sched_->note_submitted();
    d.watch.in_flight = true;
  }

  static void on_watch(operation* o, int, std::uint32_t) noexcept {
    auto* w = static_cast<device_queue::watch_op*>(o);
    device_queue& d = *w->self;
    w->in_flight = false;
    cq_poller* self = w->owner;
    // Read every event the channel has (non-blocking); the queue is polled
    // and re-armed by the poll() of this iteration.
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    while (ibv_get_cq_event(d.channel, &cq, &ctx) == 0) {
      ++d.unacked;
      d.armed = false;
      ++self->stats_.events;
    }
    if (d.unacked >= detail::ack_batch) {
      ibv_ack_cq_events(d.cq, d.unacked);
      d.unacked = 0;
    }
    if (self->retiring_) self->maybe_free();
  }

  static std::chrono::nanoseconds coarse_now() noexcept {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
  }

  void poll_async(bool busy_mode) noexcept {
    // A busy loop turns over every microsecond or so: look at the clock
    // only every so many turns. A sleeping loop wakes at least every
    // async_interval, and looks every time. The coarse clock (the
    // kernel's last tick, read without a system call): a 100 ms interval
    // needs no more, and the precise clock is a system call where the
    // clock source has no vDSO (emulators), which a busy loop would pay
    // in the middle of a message's path.
    if (busy_mode && ++async_turns_ < async_stride) return;
    async_turns_ = 0;
    const std::chrono::nanoseconds now = coarse_now();
    if (now - last_async_ < async_interval) return;
    last_async_ = now;
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      device_queue& d = *devices_[i];
      ibv_async_event ev{};
      while (ibv_get_async_event(d.ctx, &ev) == 0) {
        ++stats_.async_events;
        ibv_qp* qp = nullptr;
        switch (ev.event_type) {
          case IBV_EVENT_QP_FATAL:
          case IBV_EVENT_QP_REQ_ERR:
          case IBV_EVENT_QP_ACCESS_ERR:
          case IBV_EVENT_PATH_MIG_ERR:
          case IBV_EVENT_QP_LAST_WQE_REACHED:
            qp = ev.element.qp;
            break;
          default: break;
        }
        ibv_event_type type = ev.event_type;
        bool port_down = type == IBV_EVENT_PORT_ERR || type == IBV_EVENT_DEVICE_FATAL;
        ibv_ack_async_event(&ev);
        // Snapshot: a sink may unwatch itself while handling the event.
        auto sinks = d.sinks;
        for (auto& [q, sink] : sinks)
          if (port_down || q == qp) sink->on_qp_event(type);
      }
      auto sinks = d.sinks;
      for (auto& e : sinks) e.second->on_tick();
    }
  }

  /// The last reference is gone: leave the scheduler once no channel watch
  /// is in the ring.
  void retire() noexcept {
    retiring_ = true;
    sched_->remove_poller(*this);
    sched_->release_poller_slot(*this);
    for (auto& d : devices_)
      if (d->watch.in_flight) sched_->cancel(&d->watch);
    maybe_free();
  }

  void maybe_free() noexcept {
    for (auto& d : devices_)
      if (d->watch.in_flight) return;
    if (retire_posted_) return;
    retire_posted_ = true;
    // From the loop: the caller may be in the middle of a completion.
    sched_->post(&retire_node_);
  }

  struct retire_work : remote_work {
    cq_poller* self = nullptr;
  };
  static void on_retire(remote_work* w) noexcept {
    delete static_cast<retire_work*>(w)->self;
  }

  scheduler* sched_;
  std::vector<std::unique_ptr<device_queue>> devices_;
  std::size_t refs_ = 0;
  int busy_ = 0;
  bool retiring_ = false;
  bool retire_posted_ = false;
  retire_work retire_node_{};
  std::chrono::steady_clock::time_point last_work_{};
  std::chrono::nanoseconds last_async_{};
  static constexpr unsigned async_stride = 64;
  unsigned async_turns_ = 0;
  cq_poller_stats stats_{};
};

}  // namespace gdr::verbs
