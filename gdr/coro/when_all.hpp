/// \file
/// `gdr::when_all`: run several tasks concurrently and wait for all of them.
///
/// The children start one after another on the awaiting thread (each runs
/// until its first suspension before the next starts) and then interleave at
/// their suspension points; on one scheduler they never run in parallel.
/// Every child is awaited to completion, even when one fails: no child
/// outlives the `co_await`. Each child observes the parent's stop token, so
/// cancelling the parent cancels all of them. If any child throws, the first
/// exception (in completion order) is rethrown after all have finished; the
/// others are dropped. `when_all` does not cancel the siblings of a failed
/// child: a caller who wants that uses `when_any`, or a `task_scope` and its
/// `request_stop()`.
///
/// `void` results: a `task<void>` contributes `std::monostate` to the tuple
/// (so that positions keep their meaning), and the range form over
/// `task<void>` returns `void`.
///
/// \code
///   auto [a, b] = co_await gdr::when_all(fetch(x), fetch(y));   // std::tuple<A, B>
///   std::vector<int> all = co_await gdr::when_all(std::move(tasks));
/// \endcode
///
/// Completion context: the parent resumes on the thread on which the last
/// child finished (the scheduler's thread, unless a child moved elsewhere).
/// Cost: one coroutine frame per child for the wrapper that counts it, plus
/// the `when_all` frame itself.
#pragma once

#include <array>
#include <atomic>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <optional>
#include <stop_token>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <gdr/coro/task.hpp>

namespace gdr {

namespace detail {

/// `void` as a storable value.
template <class T>
using non_void_t = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

/// Shared by the children of one join: counts unfinished children plus one
/// reference held by the starter, and resumes the parent when the count
/// reaches zero. Atomic because a child may finish on another thread (one
/// that moved to another scheduler).
struct join_counter {
  std::atomic<std::size_t> count{0};
  std::coroutine_handle<> parent{};
  std::exception_ptr first_error{};
  std::atomic<bool> has_error{false};

  void record(std::exception_ptr e) noexcept {
    // First failure wins; the flag makes concurrent failures safe. The write
    // is published to the parent by the acq_rel decrement in release().
    if (!has_error.exchange(true, std::memory_order_acq_rel)) first_error = std::move(e);
  }
  /// Drops one reference; true if it was the last.
  bool release() noexcept { return count.fetch_sub(1, std::memory_order_acq_rel) == 1; }
};

/// The coroutine wrapping one child: it awaits the child, stores the value or
/// the exception, and at its final suspension hands control to the parent if
/// it was the last one to finish.
class join_child {
 public:
  struct promise_type : owning_promise_base {
    join_counter* counter = nullptr;
    join_child get_return_object() noexcept {
      return join_child{std::coroutine_handle<promise_type>::from_promise(*this)};
    }
    struct final_awaiter {
      bool await_ready() const noexcept { return false; }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) const noexcept {
        join_counter* c = h.promise().counter;
        // Symmetric transfer to the parent: no stack growth however the
        // children finished.
        if (c->release()) return c->parent;
        return std::noop_coroutine();
      }
      void await_resume() const noexcept {}
    };
    final_awaiter final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { counter->record(std::current_exception()); }
  };

  join_child() noexcept = default;
  join_child(join_child&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  join_child& operator=(join_child&& o) noexcept {
    if (this != &o) {
      if (h_) h_.destroy();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  ~join_child() {
    if (h_) h_.destroy();
  }

  /// Starts the child under `counter`, observing `stop`.
  void start(join_counter& counter, const std::stop_token& stop) noexcept {
    h_.promise().counter = &counter;
    h_.promise().set_stop_token(stop);
    h_.resume();
  }

 private:
  explicit join_child(std::coroutine_handle<promise_type> h) noexcept : h_(h) {}
  std::coroutine_handle<promise_type> h_{};
};

template <class T>
join_child make_join_child(task<T>& t, std::optional<non_void_t<T>>& out) {
  if constexpr (std::is_void_v<T>) {
    co_await t;
    out.emplace();
  } else {
    out.emplace(co_await t);
  }
}

/// Starts `children`, suspends the parent until all have finished.
template <class Children>
struct join_awaiter {
  Children& children;
  join_counter& counter;
  bool await_ready() const noexcept { return false; }
  template <class P>
  bool await_suspend(std::coroutine_handle<P> parent) noexcept {
    counter.parent = parent;
    std::stop_token st = stop_token_of(parent);
    counter.count.store(std::size(children) + 1, std::memory_order_relaxed);
    for (join_child& c : children) c.start(counter, st);
    // Drop the starter's reference: if every child finished synchronously the
    // parent continues at once without suspending.
    return !counter.release();
  }
  void await_resume() const noexcept {}
};

template <class... Ts, std::size_t... I>
task<std::tuple<non_void_t<Ts>...>> when_all_impl(std::index_sequence<I...>, task<Ts>... ts) {
  std::tuple<std::optional<non_void_t<Ts>>...> out;
  std::array<join_child, sizeof...(Ts)> children{make_join_child(ts, std::get<I>(out))...};
  join_counter counter;
  co_await join_awaiter<std::array<join_child, sizeof...(Ts)>>{children, counter};
  if (counter.first_error) std::rethrow_exception(counter.first_error);
  co_return std::tuple<non_void_t<Ts>...>(std::move(*std::get<I>(out))...);
}

}  // namespace detail

/// Runs every task concurrently and returns their results as a tuple, in
/// argument order, once all have finished (`std::monostate` for
/// `task<void>`).
///
/// Contract: every task is valid and not yet started. The children observe
/// the awaiting coroutine's stop token. Rethrows the first exception (in
/// completion order) after all have finished. Lazy like any task: nothing
/// starts until the result is awaited.
template <class... Ts>
task<std::tuple<detail::non_void_t<Ts>...>> when_all(task<Ts>... ts) {
  return detail::when_all_impl(std::index_sequence_for<Ts...>{}, std::move(ts)...);
}

/// Runs every task in `ts` concurrently and returns their results in the
/// order of `ts` (nothing for `task<void>`) once all have finished.
///
/// Contract: as the variadic form. An empty vector completes at once.
template <class T>
task<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>> when_all(std::vector<task<T>> ts) {
  std::vector<std::optional<detail::non_void_t<T>>> out(ts.size());
  std::vector<detail::join_child> children;
  children.reserve(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) children.push_back(detail::make_join_child(ts[i], out[i]));
  detail::join_counter counter;
  co_await detail::join_awaiter<std::vector<detail::join_child>>{children, counter};
  if (counter.first_error) std::rethrow_exception(counter.first_error);
  if constexpr (!std::is_void_v<T>) {
    std::vector<T> values;
    values.reserve(out.size());
    for (auto& o : out) values.push_back(std::move(*o));
    co_return values;
  }
}

}  // namespace gdr
