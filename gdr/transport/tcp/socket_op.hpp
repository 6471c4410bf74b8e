/// \file
/// Internal: the base of TCP's one-SQE operations (accept, connect), with
/// `op_options`: like `gdr::detail::uring_awaitable`, plus the options' own
/// stop token and a timeout, which is an io_uring linked timeout
/// (`IORING_OP_LINK_TIMEOUT`), so the kernel cancels the operation itself.
///
/// As everywhere in gdr, the coroutine resumes only at the operation's own
/// CQE: a cancelled accept that raced with a connection still returns it
/// (and it is used, not leaked).
#pragma once

#include <liburing.h>

#include <atomic>
#include <cerrno>
#include <coroutine>
#include <optional>
#include <stop_token>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/common.hpp>

namespace gdr::detail::tcp {

/// CRTP base. `Derived` provides `void prepare(io_uring_sqe*) noexcept` and
/// `result<T> finish(std::error_code failed) noexcept`, where `failed` is the
/// operation's error (cancelled, timed_out, an errno), empty when `res_`
/// holds a result. It may provide `std::error_code submit_error() noexcept`,
/// asked at submission (in `await_suspend`, before an SQE is taken): an error
/// fails the operation at once, with nothing submitted.
template <class Derived, class T>
class socket_op : public operation {
 public:
  socket_op(scheduler& s, op_options opts) noexcept : sched_(&s), opts_(std::move(opts)) { complete = &on_complete; }

  // Movable only before it is awaited (it is then only its parameters).
  socket_op(socket_op&& o) noexcept
      : operation(o), sched_(o.sched_), opts_(std::move(o.opts_)), early_(o.early_) {}
  socket_op& operator=(socket_op&&) = delete;

  bool await_ready() const noexcept { return static_cast<bool>(early_); }

  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    std::stop_token st = stop_token_of(h);
    if (st.stop_requested() || opts_.stop.stop_requested()) {
      early_ = errc::cancelled;
      return false;
    }
    if constexpr (requires(Derived& d) { d.submit_error(); }) {
      if (std::error_code ec = static_cast<Derived*>(this)->submit_error()) {
        early_ = ec;
        return false;
      }
    }
    io_uring* ring = sched_->ring();
    bool timed = opts_.timeout.count() > 0;
    // A link must not be split across two submissions: make room for both
    // SQEs first.
    if (io_uring_sq_space_left(ring) < (timed ? 2u : 1u)) sched_->submit();
    io_uring_sqe* sqe = sched_->get_sqe();
    if (sqe == nullptr) {
      early_ = errc::busy;
      return false;
    }
    static_cast<Derived*>(this)->prepare(sqe);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(this));
    if (timed) {
      if (io_uring_sqe* t = io_uring_get_sqe(ring)) {
        sqe->flags |= IOSQE_IO_LINK;
        auto d = opts_.timeout;
        ts_.tv_sec = static_cast<long long>(d.count() / 1'000'000'000);
        ts_.tv_nsec = static_cast<long long>(d.count() % 1'000'000'000);
        // The kernel copies the timespec when it takes the SQE, and its CQE
        // (-ETIME or -ECANCELED) carries no operation: nothing here is used
        // after this operation's own CQE.
        io_uring_prep_link_timeout(t, &ts_, 0);
        io_uring_sqe_set_data64(t, gdr::detail::ignore_tag);
      }
    }
    sched_->note_submitted();
    waiter_ = h;
    cancel_.self = this;
    cancel_.run = &on_cancel_node;
    if (opts_.stop.stop_possible()) stop_user_.emplace(opts_.stop, canceller{this});
    if (st.stop_possible()) stop_coro_.emplace(std::move(st), canceller{this});
    return true;
  }

  T await_resume() { return outcome().value(); }

  /// The same operation, but `co_await` returns `result<T>` and never throws.
  auto as_result() && noexcept {
    struct adapter : Derived {
      explicit adapter(Derived&& d) noexcept : Derived(std::move(d)) {}
      result<T> await_resume() noexcept { return this->outcome(); }
    };
    return adapter{static_cast<Derived&&>(*this)};
  }

 protected:
  result<T> outcome() noexcept {
    auto* d = static_cast<Derived*>(this);
    if (early_) return d->finish(early_);
    if (res_ >= 0) return d->finish({});
    if (res_ == -ECANCELED) {
      // Our stop request, or the linked timeout firing.
      return d->finish(stopped_.load(std::memory_order_relaxed) || opts_.timeout.count() <= 0
                           ? std::error_code(errc::cancelled)
                           : std::error_code(errc::timed_out));
    }
    return d->finish(errno_code(-res_));
  }

  scheduler* sched_;
  op_options opts_;
  std::error_code early_{};  // failed before submission
  int res_ = 0;

 private:
  struct canceller {
    socket_op* self;
    void operator()() const noexcept {
      self->stopped_.store(true, std::memory_order_relaxed);
      // Only the loop's thread may touch the ring: always go through it.
      if (!self->cancel_posted_.exchange(true, std::memory_order_acq_rel)) self->sched_->post(&self->cancel_);
    }
  };
  struct cancel_node : remote_work {
    socket_op* self = nullptr;
  };

  static void on_cancel_node(remote_work* w) noexcept {
    socket_op* self = static_cast<cancel_node*>(w)->self;
    self->cancel_ran_ = true;
    if (self->completed_) {
      self->waiter_.resume();  // on_complete left the resumption to us
    } else {
      self->sched_->cancel(self);
    }
  }

  static void on_complete(operation* op, int res, std::uint32_t) noexcept {
    auto* self = static_cast<socket_op*>(op);
    self->res_ = res;
    self->completed_ = true;
    // Destroying a callback waits for one running on another thread; after
    // this no callback can post the cancel node.
    self->stop_user_.reset();
    self->stop_coro_.reset();
    // A posted cancel node lives in this frame: let it resume us.
    if (self->cancel_posted_.load(std::memory_order_acquire) && !self->cancel_ran_) return;
    self->waiter_.resume();
  }

  std::coroutine_handle<> waiter_{};
  __kernel_timespec ts_{};
  std::optional<std::stop_callback<canceller>> stop_user_{};
  std::optional<std::stop_callback<canceller>> stop_coro_{};
  cancel_node cancel_{};
  std::atomic<bool> cancel_posted_{false};
  std::atomic<bool> stopped_{false};
  bool cancel_ran_ = false;
  bool completed_ = false;
};

}  // namespace gdr::detail::tcp
