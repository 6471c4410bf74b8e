/// \file
/// `gdr::when_any`: run several tasks concurrently; the first to finish wins,
/// the others are cancelled and awaited.
///
/// The children observe a stop token of their own, from a
/// `linked_stop_source` that follows the parent's token. When the first child
/// finishes, with a value or with an exception, stop is requested for the
/// rest; `when_any` returns only after every child has finished (structured:
/// nothing outlives it).
///
/// Outcomes:
///   * The winner's value is returned with its index; if the winner threw,
///     its exception is rethrown (so a parent's stop request typically shows
///     as the winner's `errc::cancelled`).
///   * The losers' outcomes are dropped, values and exceptions alike. A
///     loser's exception is most often `errc::cancelled`, the stop request
///     doing its job; but it is dropped whatever it is, because after a stop
///     request a transport may legitimately report other codes (`closed`,
///     `connection_lost`), and no rule here could tell a real failure from a
///     consequence of the cancellation. A caller who must see every outcome
///     uses `when_all` and cancels by hand.
///   * A stop request only stops the *waiting*: a loser whose operation
///     already completed (a receive that got its message) finishes normally
///     and its value is dropped too. Use `when_any` on operations whose loss
///     is harmless, or on tasks that put what they got somewhere safe.
///   * A child that never suspends, or ignores its token, runs to completion;
///     `when_any` waits for it.
///
/// \code
///   auto [index, value] = co_await gdr::when_any(recv_on(ep1), recv_on(ep2));
/// \endcode
///
/// Completion context: the thread on which the last child finished (the
/// scheduler's thread unless a child moved elsewhere).
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <optional>
#include <stop_token>
#include <type_traits>
#include <utility>
#include <vector>

#include <gdr/coro/cancel.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/error.hpp>

namespace gdr {

/// Which child won, and its value (`std::monostate` for `task<void>`).
template <class T>
struct when_any_result {
  std::size_t index;               ///< position of the winner among the arguments
  detail::non_void_t<T> value;     ///< the winner's value
};

namespace detail {

template <class T>
struct any_state {
  explicit any_state(const std::stop_token& parent) : stop(parent) {}
  linked_stop_source stop;
  // Children may finish on different threads (a child can move to another
  // scheduler): the winner is chosen by one atomic exchange.
  std::atomic<bool> decided{false};
  std::size_t winner = 0;
  std::optional<non_void_t<T>> value;
  std::exception_ptr error;
};

template <class T>
task<void> any_child(task<T> t, std::size_t index, any_state<T>& st) {
  std::optional<non_void_t<T>> v;
  std::exception_ptr e;
  try {
    if constexpr (std::is_void_v<T>) {
      co_await await_with_token(t, st.stop.get_token());
      v.emplace();
    } else {
      v.emplace(co_await await_with_token(t, st.stop.get_token()));
    }
  } catch (...) {
    e = std::current_exception();
  }
  if (!st.decided.exchange(true, std::memory_order_acq_rel)) {
    // The winner's writes reach the parent through when_all's acq_rel count.
    st.winner = index;
    st.value = std::move(v);
    st.error = std::move(e);
    st.stop.request_stop();
  }
}

}  // namespace detail

/// Runs the tasks in `ts` concurrently; returns the index and value of the
/// first to finish, after cancelling and awaiting the others (see the file
/// comment for what happens to them).
///
/// Contract: `ts` is not empty (throws `gdr::error(errc::invalid_argument)`
/// otherwise), every task valid and not started. The parent's stop request
/// reaches every child.
template <class T>
task<when_any_result<T>> when_any(std::vector<task<T>> ts) {
  if (ts.empty()) throw error(errc::invalid_argument, "gdr::when_any: no tasks");
  detail::any_state<T> st(co_await this_stop_token);
  std::vector<task<void>> children;
  children.reserve(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) children.push_back(detail::any_child(std::move(ts[i]), i, st));
  co_await when_all(std::move(children));
  if (st.error) std::rethrow_exception(st.error);
  co_return when_any_result<T>{st.winner, std::move(*st.value)};
}

/// Variadic form, for tasks of one type: `when_any(a(), b(), c())`.
template <class T, class... Ts>
  requires(std::is_same_v<task<T>, Ts> && ...)
task<when_any_result<T>> when_any(task<T> first, Ts... rest) {
  std::vector<task<T>> ts;
  ts.reserve(1 + sizeof...(rest));
  ts.push_back(std::move(first));
  (ts.push_back(std::move(rest)), ...);
  return when_any(std::move(ts));
}

}  // namespace gdr
