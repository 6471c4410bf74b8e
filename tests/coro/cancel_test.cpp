// gdr/coro/cancel.hpp: linked stop sources and recognising cancellations.
#include <doctest/doctest.h>

#include <cerrno>
#include <exception>
#include <stdexcept>
#include <stop_token>
#include <thread>

#include <gdr/coro/cancel.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/timer.hpp>

using namespace std::chrono_literals;

TEST_CASE("a linked stop source stops when its parent does") {
  std::stop_source parent;
  gdr::linked_stop_source child(parent.get_token());
  std::stop_token t = child.get_token();
  CHECK_FALSE(t.stop_requested());
  parent.request_stop();
  CHECK(t.stop_requested());
  CHECK(child.stop_requested());
}

TEST_CASE("stopping a linked source does not stop its parent") {
  std::stop_source parent;
  gdr::linked_stop_source child(parent.get_token());
  CHECK(child.request_stop());
  CHECK_FALSE(child.request_stop());  // only the first call makes the request
  CHECK_FALSE(parent.stop_requested());
}

TEST_CASE("a source linked to an already stopped parent starts stopped") {
  std::stop_source parent;
  parent.request_stop();
  gdr::linked_stop_source child(parent.get_token());
  CHECK(child.stop_requested());
}

TEST_CASE("a source linked to an empty token stops only by itself") {
  gdr::linked_stop_source child{std::stop_token{}};
  CHECK(child.get_token().stop_possible());
  CHECK_FALSE(child.stop_requested());
  gdr::linked_stop_source unlinked;
  unlinked.request_stop();
  CHECK(unlinked.stop_requested());
}

TEST_CASE("a parent stopped from another thread while the linked source dies is safe") {
  // The link's destructor waits for a callback running on another thread.
  for (int i = 0; i < 2000; ++i) {
    std::stop_source parent;
    std::thread t;
    {
      gdr::linked_stop_source child(parent.get_token());
      t = std::thread([&] { parent.request_stop(); });
    }
    t.join();
  }
}

TEST_CASE("is_cancellation recognises gdr's and the system's cancellation codes") {
  CHECK(gdr::is_cancellation(gdr::make_error_code(gdr::errc::cancelled)));
  CHECK(gdr::is_cancellation(gdr::errno_code(ECANCELED)));
  CHECK_FALSE(gdr::is_cancellation(gdr::make_error_code(gdr::errc::timed_out)));
  CHECK_FALSE(gdr::is_cancellation(std::error_code{}));
  CHECK(gdr::is_cancellation(std::make_exception_ptr(gdr::error(gdr::errc::cancelled))));
  CHECK_FALSE(gdr::is_cancellation(std::make_exception_ptr(gdr::error(gdr::errc::closed))));
  CHECK_FALSE(gdr::is_cancellation(std::make_exception_ptr(std::runtime_error("x"))));
  CHECK_FALSE(gdr::is_cancellation(std::exception_ptr{}));
}

TEST_CASE("an operation under a linked token is cancelled by the parent's stop") {
  gdr::scheduler s;
  std::stop_source parent;
  auto direct = [&]() -> gdr::task<std::error_code> {
    gdr::linked_stop_source child(co_await gdr::this_stop_token);
    std::thread t([&] {
      std::this_thread::sleep_for(2ms);
      parent.request_stop();
    });
    auto r = co_await gdr::with_stop_token(child.get_token(), []() -> gdr::task<std::error_code> {
      co_return (co_await gdr::sleep_for(10s).as_result()).error();
    }());
    t.join();
    co_return r;
  };
  CHECK(gdr::sync_wait(s, direct(), parent.get_token()) == gdr::errc::cancelled);
  CHECK(s.inflight() == 0);
}
