/// \file
/// How an awaitable learns the stop token of the coroutine awaiting it.
///
/// A promise type that offers `stop_token()` (every gdr promise does, through
/// `detail::promise_base` in gdr/coro/task.hpp) is a `stoppable_promise`;
/// `stop_token_of(h)` and `stop_token_ref(h)` read its token from the
/// coroutine handle an awaitable's `await_suspend` receives, and give an empty
/// token for any other promise (a user's own coroutine type). The operations
/// in gdr/sched/ need only this, not the coroutine types: it lives here so
/// that the scheduler layer does not include gdr/coro/ (coro is built on
/// sched, not the other way round).
#pragma once

#include <concepts>
#include <coroutine>
#include <stop_token>

namespace gdr::detail {

/// An empty token with static storage: what a coroutine observes until it is
/// given or inherits one, and what `stop_token_ref` returns for a promise
/// without a token.
inline const std::stop_token no_stop_token{};

/// A promise type that can hand a stop token to the operations it awaits.
template <class P>
concept stoppable_promise = requires(const P& p) {
  { p.stop_token() } -> std::convertible_to<const std::stop_token&>;
};

/// The stop token of the coroutine behind `h`, or an empty one.
template <class P>
std::stop_token stop_token_of(std::coroutine_handle<P> h) noexcept {
  if constexpr (stoppable_promise<P>) {
    return h.promise().stop_token();
  } else {
    return {};
  }
}

/// The stop token object of the coroutine behind `h` (not a copy), or a
/// static empty one. Valid while that coroutine is suspended in an await.
template <class P>
const std::stop_token& stop_token_ref(std::coroutine_handle<P> h) noexcept {
  if constexpr (stoppable_promise<P>) {
    return h.promise().stop_token();
  } else {
    return no_stop_token;
  }
}

}  // namespace gdr::detail
