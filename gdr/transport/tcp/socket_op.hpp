/// \file
/// Internal: the base of TCP's one-SQE operations (accept, connect), with
/// `op_options`: the operation's SQE, and the stop tokens and timeout of
/// every operation with options (`gdr/sched/cancellable.hpp`): a stop or the
/// timeout submits an `IORING_OP_ASYNC_CANCEL` for the SQE.
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
#include <gdr/sched/cancellable.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>

namespace gdr::detail::tcp {

/// CRTP base. `Derived` provides `void prepare(io_uring_sqe*) noexcept` and
/// `result<T> finish(std::error_code failed) noexcept`, where `failed` is the
/// operation's error (cancelled, timed_out, an errno), empty when `res_`
/// holds a result. It may provide `std::error_code submit_error() noexcept`,
/// asked at submission (in `await_suspend`, before an SQE is taken): an error
/// fails the operation at once, with nothing submitted.
template <class Derived, class T>
class socket_op : public operation, private gdr::detail::cancellable<socket_op<Derived, T>> {
  using stops = gdr::detail::cancellable<socket_op<Derived, T>>;
  friend stops;

 public:
  socket_op(scheduler& s, op_options opts) noexcept : sched_(&s), opts_(std::move(opts)) { complete = &on_complete; }

  // Movable only before it is awaited (it is then only its parameters).
  socket_op(socket_op&& o) noexcept
      : operation(o), stops(std::move(o)), sched_(o.sched_), opts_(std::move(o.opts_)), early_(o.early_) {}
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
    io_uring_sqe* sqe = sched_->get_sqe();
    if (sqe == nullptr) {
      early_ = errc::busy;
      return false;
    }
    static_cast<Derived*>(this)->prepare(sqe);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(this));
    sched_->note_submitted();
    waiter_ = h;
    this->prime();
    this->arm(opts_.stop, std::move(st), opts_.timeout);
    return true;
  }

  T await_resume() { return outcome().value(); }

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
    // Our cancel after a stop or the timeout: say which.
    if (res_ == -ECANCELED && stopped_) return d->finish(stopped_);
    return d->finish(errno_code(-res_));
  }

  scheduler* sched_;
  op_options opts_;
  std::error_code early_{};  // failed before submission
  int res_ = 0;

 private:
  // The stop and timeout mechanism's hooks (gdr/sched/cancellable.hpp).
  scheduler& cancel_scheduler() const noexcept { return *sched_; }
  void on_stop(std::error_code why) noexcept {
    if (completed_ || stopped_) return;
    stopped_ = why;
    sched_->cancel(this);  // the CQE (-ECANCELED, or the result if it won) settles it
  }
  void on_settled() noexcept { waiter_.resume(); }
  template <class F>
  void in_event(F&& f) noexcept {
    f();
  }

  static void on_complete(operation* op, int res, std::uint32_t) noexcept {
    auto* self = static_cast<socket_op*>(op);
    self->res_ = res;
    self->completed_ = true;
    self->settle();  // resumes once a posted stop and the timer are done with this object
  }

  std::coroutine_handle<> waiter_{};
  std::error_code stopped_{};  // why a stop or the timeout cancelled it
  bool completed_ = false;
};

}  // namespace gdr::detail::tcp
