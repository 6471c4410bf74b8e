/// \file
/// `gdr::when_any`: run several tasks concurrently; the first to finish wins,
/// the others are cancelled and awaited.
///
/// The children observe a stop token of their own, linked to the parent's:
/// when the first child finishes (with a value or an exception), stop is
/// requested for the rest, and `when_any` returns only after every child has
/// finished (structured: nothing outlives it). The losers' results and
/// exceptions (typically `errc::cancelled`) are dropped. If the winner threw,
/// its exception is rethrown.
///
/// \code
///   auto [index, value] = co_await gdr::when_any(ep1.recv_task(), ep2.recv_task());
/// \endcode
#pragma once

#include <cstddef>
#include <exception>
#include <optional>
#include <stop_token>
#include <utility>
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/error.hpp>

namespace gdr {

/// Which child won, and its value (`std::monostate` for `task<void>`).
template <class T>
struct when_any_result {
  std::size_t index;
  detail::non_void_t<T> value;
};

namespace detail {

template <class T>
struct any_state {
  std::stop_source stop;
  std::optional<std::size_t> winner;
  std::optional<non_void_t<T>> value;
  std::exception_ptr error;
};

template <class T>
task<void> any_child(task<T> t, std::size_t index, any_state<T>& st) {
  try {
    if constexpr (std::is_void_v<T>) {
      co_await with_stop_token(st.stop.get_token(), std::move(t));
      if (!st.winner) st.value.emplace();
    } else {
      auto v = co_await with_stop_token(st.stop.get_token(), std::move(t));
      if (!st.winner) st.value.emplace(std::move(v));
    }
  } catch (...) {
    if (!st.winner) st.error = std::current_exception();
  }
  if (!st.winner) {
    st.winner = index;
    st.stop.request_stop();
  }
}

}  // namespace detail

/// Runs the tasks in `ts` concurrently; returns the index and value of the
/// first to finish after cancelling and awaiting the others.
/// Precondition: `ts` is not empty (`errc::invalid_argument` otherwise).
template <class T>
task<when_any_result<T>> when_any(std::vector<task<T>> ts) {
  if (ts.empty()) throw error(errc::invalid_argument, "gdr::when_any: no tasks");
  detail::any_state<T> st;
  // The parent's stop request reaches every child through the linked source.
  std::stop_token parent = co_await this_stop_token;
  std::stop_callback link(parent, [&st]() noexcept { st.stop.request_stop(); });
  std::vector<task<void>> children;
  children.reserve(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) children.push_back(detail::any_child(std::move(ts[i]), i, st));
  co_await when_all(std::move(children));
  if (st.error) std::rethrow_exception(st.error);
  co_return when_any_result<T>{*st.winner, std::move(*st.value)};
}

/// Variadic form for tasks of one type.
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
