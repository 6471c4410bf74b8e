// Helpers for the loopback tests: a watchdog that ends a hung test, and a
// fire-and-forget coroutine to start many operations at once.
#pragma once

#include <chrono>
#include <coroutine>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <span>
#include <stop_token>
#include <system_error>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/transfer/common.hpp>

#include "tests/support/watchdog.hpp"

namespace gdr_test {

using watchdog = gdr_test_support::watchdog;

// A coroutine that starts at once and is never awaited: runs `f()` (a
// coroutine lambda, kept alive in this frame: a lambda coroutine's captures
// live in the closure, not in its own frame), then counts it in `done` (and
// in `failed` if it threw).
struct detached {
  struct promise_type {
    detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

template <class F>
detached spawn(F f, int& done, int& failed) {
  try {
    co_await f();
  } catch (...) {
    ++failed;
  }
  ++done;
}

// op_options with a stop token and an optional timeout.
inline gdr::op_options stop_opts(std::stop_token st, std::chrono::nanoseconds timeout = {}) {
  return {std::move(st), timeout};
}

// op_options with only a timeout.
inline gdr::op_options timeout_opts(std::chrono::nanoseconds timeout) { return {timeout}; }

// Awaits `op` (a send, recv, put or get) and returns its error, or success.
template <class Op>
gdr::task<std::error_code> error_of(Op op) {
  gdr::result<std::size_t> r = co_await std::move(op).as_result();
  co_return r.error();
}

// FNV-1a over bytes: a checksum for message contents.
inline std::uint64_t fnv1a(std::span<const std::byte> b) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (std::byte x : b) h = (h ^ static_cast<std::uint64_t>(x)) * 1099511628211ull;
  return h;
}

}  // namespace gdr_test
