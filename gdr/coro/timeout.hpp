/// \file
/// `gdr::with_timeout`: a deadline for any task, on an io_uring timeout.
///
/// The task runs with a stop token that fires when `IORING_OP_TIMEOUT`
/// expires (or when the parent's token fires). If the deadline fired and the
/// task ended because of it (with any exception, typically `errc::cancelled`),
/// `with_timeout` throws `gdr::error(errc::timed_out)`; a parent's stop request
/// keeps its own outcome (`errc::cancelled`). When the task finishes first the
/// timer is cancelled. Both are awaited before `with_timeout` returns.
///
/// \code
///   std::size_t n = co_await gdr::with_timeout(2s, recv_message(ep));
/// \endcode
///
/// Completion context: the scheduler of the calling thread.
#pragma once

#include <chrono>
#include <exception>
#include <optional>
#include <stop_token>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/error.hpp>
#include <gdr/sched/timer.hpp>

namespace gdr {

namespace detail {

struct deadline_state {
  std::stop_source work;   // fired by the deadline or the parent
  std::stop_source timer;  // fired when the work finishes, or by the parent
  bool expired = false;
};

inline task<void> deadline_timer(scheduler& s, std::chrono::nanoseconds d, deadline_state& st) {
  result<void> r = co_await sleep_for(s, d).as_result();
  if (r) {  // the time passed (not cancelled): stop the work
    st.expired = true;
    st.work.request_stop();
  }
}

template <class T>
task<T> deadline_work(task<T> t, deadline_state& st) {
  struct stop_timer {
    deadline_state& st;
    ~stop_timer() { st.timer.request_stop(); }
  } guard{st};
  co_return co_await std::move(t);
}

}  // namespace detail

/// Runs `t` with a deadline `d` from now; see the file comment.
template <class T>
task<T> with_timeout(std::chrono::nanoseconds d, task<T> t) {
  scheduler& s = this_scheduler();
  detail::deadline_state st;
  std::stop_token parent = co_await this_stop_token;
  std::stop_callback link(parent, [&st]() noexcept {
    st.work.request_stop();
    st.timer.request_stop();
  });
  std::exception_ptr failure;
  std::optional<detail::non_void_t<T>> value;
  auto work = [&]() -> task<void> {
    try {
      if constexpr (std::is_void_v<T>) {
        co_await with_stop_token(st.work.get_token(), detail::deadline_work(std::move(t), st));
        value.emplace();
      } else {
        value.emplace(co_await with_stop_token(st.work.get_token(), detail::deadline_work(std::move(t), st)));
      }
    } catch (...) {
      failure = std::current_exception();
    }
  };
  co_await when_all(work(), with_stop_token(st.timer.get_token(), detail::deadline_timer(s, d, st)));
  if (failure) {
    if (st.expired && !parent.stop_requested()) throw error(errc::timed_out, "gdr::with_timeout");
    std::rethrow_exception(failure);
  }
  if constexpr (!std::is_void_v<T>) co_return std::move(*value);
}

}  // namespace gdr
