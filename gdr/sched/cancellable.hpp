/// \file
/// Internal: the one way an operation with `op_options` observes its stop
/// tokens and its timeout. The endpoint operations of every transport
/// (`gdr/protocol/engine.hpp`) and TCP's connect and accept
/// (`gdr/transport/tcp/socket_op.hpp`) derive from it; only the scheduler's
/// bare io_uring awaitable (`uring_op.hpp`, one token, no timeout, the NOP
/// path) keeps its own, smaller form.
///
/// How it works. Once the operation is pending, `arm` registers a stop
/// callback on the options' token and on the awaiting coroutine's token, and
/// submits an io_uring timeout when there is one. A stop callback may run on
/// any thread: it only posts a node to the operation's scheduler. On the
/// loop's thread the node (or the timer's CQE, -ETIME) calls the derived
/// class's `on_stop(why)`, which withdraws or cancels the operation as its
/// rules say; `why` is `errc::cancelled`, `errc::timed_out` or `errc::busy`
/// (no SQE for the timer). When the operation's outcome is final and no
/// kernel request uses its memory, the derived class calls `settle`: the
/// callbacks are destroyed (which waits for one running on another thread),
/// the timer is cancelled (a cancel the scheduler never drops), and
/// `on_settled()` runs once the timer's CQE and a posted node, both of which
/// live in this object, are in. Only then may the operation's memory go.
/// While the callbacks are registered, a `detail::stop_hook` in this object is
/// linked into the scheduler: if the scheduler is destroyed first (the
/// operation will then never settle), it destroys the callbacks, and a stop
/// requested later calls nothing.
///
/// Derived provides, all called on the loop's thread:
///   scheduler& cancel_scheduler() const noexcept;
///   void on_stop(std::error_code why) noexcept;  // not called after settle()
///   void on_settled() noexcept;                  // resume, or hand to a ready list
///   template <class F> void in_event(F&& f) noexcept;  // runs f as an event
///       (a transport wraps it in its enter()/leave())
#pragma once

#include <liburing.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <stop_token>
#include <system_error>

#include <gdr/error.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>

namespace gdr::detail {

template <class Derived>
class cancellable {
 public:
  cancellable() noexcept = default;
  // Movable only before it is armed (there is nothing to move then).
  cancellable(cancellable&&) noexcept {}
  cancellable& operator=(cancellable&&) = delete;
  // settle() unlinked the hook already; this keeps the scheduler's list whole
  // if the memory goes another way (safe after the scheduler dropped it).
  ~cancellable() { unlink_stop_hook(hook_); }

 protected:
  /// The operation is about to start: from now on its own outcome is one
  /// event to wait for. Call before anything can settle it.
  void prime() noexcept { pending_ = 1; }

  /// The operation is pending. Registers the stop callbacks and submits the
  /// timer (`timeout` zero: none). Call once, on the loop's thread, after
  /// `prime()`, unless the operation settled already.
  void arm(const std::stop_token& user, std::stop_token&& coro, std::chrono::nanoseconds timeout) noexcept {
    // Most operations have neither a stoppable token nor a timeout: nothing
    // to set up then (this is on every small message's path).
    if (timeout.count() <= 0 && !user.stop_possible() && !coro.stop_possible()) return;
    arm_slow(user, std::move(coro), timeout);
  }

 private:
  [[gnu::noinline]] void arm_slow(const std::stop_token& user, std::stop_token&& coro,
                                  std::chrono::nanoseconds timeout) noexcept {
    node_.self = this;
    node_.run = &on_node;
    if (timeout.count() > 0 && !arm_timer(timeout)) {
      // No SQE for the timer (the SQ is full even after submitting): give up
      // through the loop, like a stop.
      reason_ = errc::busy;
      post_stop();
    }
    if (user.stop_possible()) stop_user_.emplace(user, canceller{this});
    if (coro.stop_possible()) stop_coro_.emplace(std::move(coro), canceller{this});
    if (stop_user_ || stop_coro_) {
      // So that a scheduler destroyed before this settles can destroy the
      // callbacks (a stop requested later would post to it).
      hook_.self = this;
      hook_.drop = &drop_stops;
      self().cancel_scheduler().link_stop_hook(hook_);
    }
  }

 protected:

  /// The outcome is final and no kernel request uses the operation's memory:
  /// `on_settled()` follows once the timer and a posted stop are done with
  /// this object (at once if neither is out). Call once.
  void settle() noexcept {
    settled_ = true;
    // Destroying a stop callback waits for one running on another thread;
    // after this no callback can post the node any more.
    stop_user_.reset();
    stop_coro_.reset();
    unlink_stop_hook(hook_);
    if (posted_.load(std::memory_order_acquire) && !node_ran_) ++pending_;  // the node lives here
    if (timer_armed_ && !timer_fired_) self().cancel_scheduler().cancel(&timer_);
    release();
  }

  /// `settle()` ran.
  bool settled() const noexcept { return settled_; }

 private:
  struct canceller {
    cancellable* self;
    void operator()() const noexcept { self->post_stop(); }
  };
  struct stop_node : remote_work {
    cancellable* self = nullptr;
  };
  struct timer_node : operation {
    cancellable* self = nullptr;
  };
  struct hook_node : stop_hook {
    cancellable* self = nullptr;
  };

  // The scheduler is being destroyed and this will never settle: no stop
  // request may reach it any more (see `detail::stop_hook`).
  static void drop_stops(stop_hook* h) noexcept {
    cancellable* c = static_cast<hook_node*>(h)->self;
    c->stop_user_.reset();
    c->stop_coro_.reset();
  }

  Derived& self() noexcept { return static_cast<Derived&>(*this); }

  bool arm_timer(std::chrono::nanoseconds d) noexcept {
    scheduler& s = self().cancel_scheduler();
    io_uring_sqe* sqe = s.get_sqe();
    if (sqe == nullptr) return false;
    ts_.tv_sec = static_cast<long long>(d.count() / 1'000'000'000);
    ts_.tv_nsec = static_cast<long long>(d.count() % 1'000'000'000);
    timer_.self = this;
    timer_.complete = &on_timer;
    io_uring_prep_timeout(sqe, &ts_, 0, 0);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(&timer_));
    s.note_submitted();
    timer_armed_ = true;
    ++pending_;
    return true;
  }

  // Any thread (a stop callback). Only posts: the loop's thread does the rest.
  void post_stop() noexcept {
    if (!posted_.exchange(true, std::memory_order_acq_rel)) self().cancel_scheduler().post(&node_);
  }

  static void on_node(remote_work* w) noexcept {
    cancellable* c = static_cast<stop_node*>(w)->self;
    c->self().in_event([c]() noexcept {
      c->node_ran_ = true;
      if (c->settled_) {
        c->release();  // settle() waited for this node
      } else {
        c->self().on_stop(c->reason_);
      }
    });
  }

  static void on_timer(operation* t, int res, std::uint32_t) noexcept {
    cancellable* c = static_cast<timer_node*>(t)->self;
    c->self().in_event([c, res]() noexcept {
      c->timer_fired_ = true;
      // -ETIME: the timeout expired. -ECANCELED: settle() removed it.
      if (res == -ETIME && !c->settled_) c->self().on_stop(errc::timed_out);
      c->release();
    });
  }

  void release() noexcept {
    if (--pending_ == 0) self().on_settled();
  }

  std::optional<std::stop_callback<canceller>> stop_user_{};
  std::optional<std::stop_callback<canceller>> stop_coro_{};
  std::atomic<bool> posted_{false};
  std::error_code reason_{errc::cancelled};  // what a posted stop reports
  stop_node node_{};
  timer_node timer_{};
  hook_node hook_{};
  __kernel_timespec ts_{};
  int pending_ = 0;  // events still to come: the operation's own outcome, the timer, a posted stop
  bool timer_armed_ = false;
  bool timer_fired_ = false;
  bool node_ran_ = false;
  bool settled_ = false;
};

}  // namespace gdr::detail
