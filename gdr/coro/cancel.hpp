/// \file
/// Cancellation helpers: a stop source linked to a parent token, a test for
/// "this failure is a cancellation", and running a task under another token
/// without an extra coroutine frame.
///
/// gdr cancels with `std::stop_token` (see `gdr/coro/task.hpp`): every task
/// inherits its awaiter's token, and every io_uring operation observes the
/// token of the coroutine that awaits it. The combinators (`when_any`,
/// `with_timeout`, `task_scope`) need tokens of their own that *also* fire when
/// the parent's fires; `linked_stop_source` is that.
///
/// \code
///   gdr::linked_stop_source child(co_await gdr::this_stop_token);
///   co_await gdr::with_stop_token(child.get_token(), work());   // parent's stop reaches work()
///   child.request_stop();                                        // ...and so does ours
/// \endcode
#pragma once

#include <coroutine>
#include <exception>
#include <optional>
#include <stop_token>
#include <system_error>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>

namespace gdr {

/// A `std::stop_source` that is also stopped when a parent token is.
///
/// Contract: construct it with the parent's token; `get_token()` hands out
/// tokens that fire on `request_stop()` or on the parent's stop request,
/// whichever comes first. If the parent was already stopped, the new source
/// is stopped on construction.
///
/// Thread-safety: like `std::stop_source`: `request_stop` and the parent's
/// stop may race from any threads. The parent's stop runs the callbacks of
/// this source's tokens on the thread that requested it. Destruction waits for
/// a parent-triggered callback running on another thread to finish (that is
/// `std::stop_callback`'s guarantee), so the source may live in a coroutine
/// frame. Not movable: the link points at this object.
class linked_stop_source {
 public:
  /// An unlinked source (stopped only by `request_stop`).
  linked_stop_source() = default;

  /// A source that follows `parent` (an empty token links to nothing).
  explicit linked_stop_source(const std::stop_token& parent) : link_(std::in_place, parent, forward{&source_}) {}

  linked_stop_source(const linked_stop_source&) = delete;
  linked_stop_source& operator=(const linked_stop_source&) = delete;

  /// A token that fires when this source or the parent is stopped.
  std::stop_token get_token() const noexcept { return source_.get_token(); }
  /// Requests stop; returns true if this call made the request.
  bool request_stop() noexcept { return source_.request_stop(); }
  /// True once stop was requested here or by the parent.
  bool stop_requested() const noexcept { return source_.stop_requested(); }

 private:
  struct forward {
    std::stop_source* target;
    void operator()() const noexcept { target->request_stop(); }
  };
  // Declared first so it is destroyed last: the link's callback points at it.
  std::stop_source source_{};
  std::optional<std::stop_callback<forward>> link_{};
};

/// True for the codes gdr operations fail with when their stop token fires:
/// `errc::cancelled`, and an operating-system `ECANCELED` (both compare equal
/// to `std::errc::operation_canceled`).
inline bool is_cancellation(std::error_code ec) noexcept {
  return ec == std::errc::operation_canceled;
}

/// True if `e` holds a `std::system_error` (such as `gdr::error`) whose code
/// is a cancellation. Costs a rethrow: not for the hot path.
inline bool is_cancellation(const std::exception_ptr& e) noexcept {
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const std::system_error& se) {
    return is_cancellation(se.code());
  } catch (...) {
    return false;
  }
}

namespace detail {

/// Awaits task `t` with stop token `st` in place of the awaiter's, without
/// the wrapping coroutine of `gdr::with_stop_token` (one allocation fewer;
/// the combinators use it on every child). `t` must be valid and not started.
template <class T>
struct token_awaiter {
  std::coroutine_handle<detail::task_promise<T>> h;
  std::stop_token st;  // lives in the awaiting frame for the whole await
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> parent) noexcept {
    h.promise().inherit_stop_token(st);
    return h.promise().start(h, parent);  // see promise_base::start
  }
  T await_resume() { return h.promise().take(); }
};

/// `co_await detail::await_with_token(t, st)`: see `token_awaiter`. `t`
/// keeps ownership of the coroutine and must outlive the await.
template <class T>
token_awaiter<T> await_with_token(task<T>& t, std::stop_token st) noexcept {
  return {t.handle(), std::move(st)};
}

}  // namespace detail

}  // namespace gdr
