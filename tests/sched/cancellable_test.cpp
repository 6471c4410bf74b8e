// gdr/sched/cancellable.hpp: stop callbacks on the options' and the awaiting
// coroutine's tokens reach the operation on its loop's thread; a scheduler
// destroyed before the operation settles leaves no callback pointing at it.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <optional>
#include <stop_token>
#include <system_error>
#include <thread>

#include <gdr/sched/cancellable.hpp>
#include <gdr/sched/scheduler.hpp>

#include "tests/sched/sched_test_support.hpp"

using namespace std::chrono_literals;

namespace {

// An operation that waits until it is stopped or finished by hand: the
// smallest user of the base (no SQE of its own, as an endpoint receive
// waiting for a message has none).
class waiting_op : public gdr::detail::cancellable<waiting_op> {
 public:
  explicit waiting_op(gdr::scheduler& s) noexcept : s_(&s) {}

  void start(const std::stop_token& user) noexcept {
    prime();
    arm(user, std::stop_token{}, std::chrono::nanoseconds::zero());
  }
  void finish() noexcept { settle(); }

  gdr::scheduler& cancel_scheduler() const noexcept { return *s_; }
  void on_stop(std::error_code why) noexcept {
    stopped = why;
    stopped_on = std::this_thread::get_id();
    settle();
  }
  void on_settled() noexcept { ++settled_count; }
  template <class F>
  void in_event(F&& f) noexcept {
    f();
  }

  std::optional<std::error_code> stopped;
  std::thread::id stopped_on{};
  int settled_count = 0;

 private:
  gdr::scheduler* s_;
};

}  // namespace

TEST_CASE("a stop from another thread reaches the operation on its loop's thread") {
  sched_test::watchdog wd(30);
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  std::stop_source src;
  waiting_op op(s);
  op.start(src.get_token());
  std::thread([&] { src.request_stop(); }).join();
  CHECK_FALSE(op.stopped.has_value());  // posted, not run yet
  s.run_until([&] { return op.settled_count == 1; });
  REQUIRE(op.stopped.has_value());
  CHECK(*op.stopped == gdr::errc::cancelled);
  CHECK(op.stopped_on == std::this_thread::get_id());
}

TEST_CASE("an operation settled by its own outcome is no longer reached by a stop") {
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  std::stop_source src;
  waiting_op op(s);
  op.start(src.get_token());
  op.finish();
  CHECK(op.settled_count == 1);
  src.request_stop();
  s.run_once(false);
  CHECK_FALSE(op.stopped.has_value());
  CHECK(s.stats().remote == 0);  // nothing was posted
}

TEST_CASE("a stop requested after the operation's scheduler is gone calls nothing") {
  // The scheduler is destroyed while the operation waits (it has no SQE, so
  // the teardown finds nothing in flight). Before the fix its stop callback
  // still posted to the freed scheduler (ASan: heap-use-after-free in
  // scheduler::post from cancellable::post_stop).
  sched_test::watchdog wd(30);
  std::stop_source user_src;
  auto s = std::make_unique<gdr::scheduler>();
  auto op = std::make_unique<waiting_op>(*s);
  op->start(user_src.get_token());
  s.reset();
  user_src.request_stop();
  CHECK_FALSE(op->stopped.has_value());
  CHECK(op->settled_count == 0);
}
