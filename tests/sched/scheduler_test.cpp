// gdr/sched/scheduler.hpp: modes, run_once, drain, inflight accounting,
// pollers, and the cross-thread entry points (post, schedule, wake through the
// eventfd and through IORING_OP_MSG_RING, and the fallback from one to the
// other).
#include <doctest/doctest.h>

#include <dirent.h>
#include <sys/utsname.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <stop_token>
#include <thread>
#include <utility>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/sched/sched_test_support.hpp"
#include "tests/support/skip.hpp"

using namespace std::chrono_literals;

namespace {

gdr::task<void> nops(int n) {
  for (int i = 0; i < n; ++i) co_await gdr::nop();
}
gdr::task<void> sleep(std::chrono::milliseconds d) { co_await gdr::sleep_for(d); }

// A completion source that can only be polled: it completes one waiting
// coroutine once its deadline has passed, and asks the loop to come back
// within `bound` while it waits (as a CUDA event poller does).
class deadline_poller final : public gdr::poller {
 public:
  explicit deadline_poller(std::chrono::nanoseconds bound) : bound_(bound) {}
  gdr::poll_status poll() noexcept override {
    ++polls;
    if (!waiter_) return {};
    if (std::chrono::steady_clock::now() < deadline_) return {false, bound_};
    std::exchange(waiter_, {}).resume();
    return {true, std::chrono::nanoseconds::max()};
  }
  const char* name() const noexcept override { return "deadline"; }
  auto wait_until(std::chrono::steady_clock::time_point t) noexcept {
    struct awaiter {
      deadline_poller* p;
      std::chrono::steady_clock::time_point t;
      bool await_ready() const noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) noexcept {
        p->deadline_ = t;
        p->waiter_ = h;
      }
      void await_resume() const noexcept {}
    };
    return awaiter{this, t};
  }
  int polls = 0;

 private:
  std::chrono::nanoseconds bound_;
  std::chrono::steady_clock::time_point deadline_{};
  std::coroutine_handle<> waiter_{};
};

}  // namespace

TEST_CASE("a NOP round trip completes through the ring in both modes") {
  for (gdr::run_mode mode : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    CAPTURE(static_cast<int>(mode));
    gdr::scheduler s({.mode = mode});
    CHECK(s.mode() == mode);
    gdr::sync_wait(s, nops(1000));
    CHECK(s.stats().completions == 1000);
    CHECK(s.inflight() == 0);
  }
}

TEST_CASE("busy-poll mode never sleeps in the kernel") {
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  gdr::sync_wait(s, sleep(2ms));
  CHECK(s.stats().sleeps == 0);
  CHECK(s.stats().iterations > 10);  // it spun while the timer ran
}

TEST_CASE("sleep mode blocks in the kernel while a timer runs") {
  gdr::scheduler s({.mode = gdr::run_mode::sleep});
  gdr::sync_wait(s, sleep(5ms));
  CHECK(s.stats().sleeps >= 1);
  CHECK(s.stats().iterations < 100);  // it did not spin
}

TEST_CASE("the mode can change between runs") {
  gdr::scheduler s({.mode = gdr::run_mode::sleep});
  s.set_mode(gdr::run_mode::busy_poll);
  gdr::sync_wait(s, sleep(1ms));
  CHECK(s.stats().sleeps == 0);
  s.set_mode(gdr::run_mode::sleep);
  // Long enough that the loop reaches its wait before the timer fires (a
  // 1 ms timer fired first once under ASan on a loaded machine: no sleep).
  gdr::sync_wait(s, sleep(20ms));
  CHECK(s.stats().sleeps >= 1);
}

TEST_CASE("run_once reports whether it did work and runs posted work in order") {
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  CHECK_FALSE(s.run_once());  // nothing to do: returns at once in busy-poll mode
  std::vector<int> order;
  struct node : gdr::remote_work {
    std::vector<int>* order;
    int id;
  };
  node nodes[3];
  for (int i = 0; i < 3; ++i) {
    nodes[i].order = &order;
    nodes[i].id = i;
    nodes[i].run = [](gdr::remote_work* w) noexcept {
      auto* n = static_cast<node*>(w);
      n->order->push_back(n->id);
    };
    s.post(&nodes[i]);
  }
  CHECK(s.run_once());
  CHECK(order == std::vector<int>{0, 1, 2});
  CHECK(s.stats().remote == 3);
}

TEST_CASE("run_once without blocking returns even in sleep mode") {
  gdr::scheduler s({.mode = gdr::run_mode::sleep});
  auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(s.run_once(false));
  CHECK(std::chrono::steady_clock::now() - t0 < 1s);
  CHECK(s.stats().sleeps == 0);
}

TEST_CASE("scheduler::current is the running loop's scheduler, and null outside") {
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  CHECK(gdr::scheduler::current() == nullptr);
  gdr::scheduler* seen = nullptr;
  struct node : gdr::remote_work {
    gdr::scheduler** seen;
  } n;
  n.seen = &seen;
  n.run = [](gdr::remote_work* w) noexcept { *static_cast<node*>(w)->seen = gdr::scheduler::current(); };
  s.post(&n);
  s.run_once();
  CHECK(seen == &s);
  CHECK(gdr::scheduler::current() == nullptr);
}

TEST_CASE("inflight counts submitted operations until their completion arrives") {
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  int done = 0;
  // Started from posted work, so that the sleeps are prepared inside the loop.
  struct starter : gdr::remote_work {
    int* done;
  } st;
  st.done = &done;
  st.run = [](gdr::remote_work* w) noexcept {
    auto* self = static_cast<starter*>(w);
    for (int i = 0; i < 5; ++i) sched_test::run_detached(sleep(std::chrono::milliseconds(1 + i)), *self->done);
  };
  s.post(&st);
  s.run_once(false);  // starts the five sleeps: prepared and submitted
  CHECK(s.inflight() == 5);
  CHECK(done == 0);
  s.drain();  // runs until nothing is in flight
  CHECK(s.inflight() == 0);
  CHECK(done == 5);
}

TEST_CASE("a cancelled operation stays in flight until its CQE arrives") {
  gdr::scheduler s;
  std::size_t during = 0, after_cancel = 0;
  std::stop_source src;
  auto body = [&]() -> gdr::task<void> {
    auto sleeper = [&]() -> gdr::task<void> { (void)co_await gdr::sleep_for(10s).as_result(); };
    auto canceller = [&]() -> gdr::task<void> {
      co_await gdr::nop();
      during = gdr::this_scheduler().inflight();  // the sleep (this NOP's CQE was reaped)
      src.request_stop();                         // queues an async cancel, nothing completes yet
      after_cancel = gdr::this_scheduler().inflight();
    };
    int n = 0;
    sched_test::run_detached(gdr::with_stop_token(src.get_token(), sleeper()), n);
    co_await canceller();
    while (n == 0) co_await gdr::nop();
  };
  gdr::sync_wait(s, body());
  CHECK(during == 1);
  CHECK(after_cancel == 1);  // the cancel request is not an operation of its own
  CHECK(s.inflight() == 0);
}

TEST_CASE("drain returns at once when nothing is pending") {
  gdr::scheduler s;
  auto t0 = std::chrono::steady_clock::now();
  s.drain();
  CHECK(std::chrono::steady_clock::now() - t0 < 1s);
}

TEST_CASE("a poller's sleep bound wakes a sleeping loop to poll again") {
  gdr::scheduler s({.mode = gdr::run_mode::sleep});
  deadline_poller p(1ms);
  s.add_poller(p);
  auto t0 = std::chrono::steady_clock::now();
  // 50 ms of 1 ms sleeps: at least two, even where the machine is loaded
  // and a sleep overruns its bound by several milliseconds (a 10 ms wait
  // once saw a single sleep under ThreadSanitizer in CI).
  gdr::sync_wait(s, [&]() -> gdr::task<> { co_await p.wait_until(std::chrono::steady_clock::now() + 50ms); }());
  auto took = std::chrono::steady_clock::now() - t0;
  s.remove_poller(p);
  CHECK(took >= 50ms);
  CHECK(took < 1s);
  CHECK(s.stats().sleeps >= 2);  // it slept between polls, bounded each time
  CHECK(p.polls >= 3);
  CHECK(p.polls < 5000);  // bounded sleeps, not a spin
  int before = p.polls;
  gdr::sync_wait(s, nops(1));
  CHECK(p.polls == before);  // removed: no longer polled
}

TEST_CASE("a coroutine resumed by a poller may destroy that poller and others, and add new ones") {
  // The pollers live on the heap, owned by the coroutine, so that using one
  // after it is gone is a heap use-after-free ASan reports. The scheduler
  // polls `first` and then `second`; the coroutine that `first` resumes
  // destroys both and adds a third, all inside first->poll().
  gdr::scheduler s({.mode = gdr::run_mode::sleep});
  bool third_polled = false;
  class flag_poller final : public gdr::poller {
   public:
    explicit flag_poller(bool* f) : f_(f) {}
    gdr::poll_status poll() noexcept override {
      *f_ = true;
      return {};
    }
    const char* name() const noexcept override { return "flag"; }

   private:
    bool* f_;
  };
  flag_poller third(&third_polled);
  auto body = [&]() -> gdr::task<> {
    auto first = std::make_unique<deadline_poller>(1ms);
    auto second = std::make_unique<deadline_poller>(1ms);
    s.add_poller(*first);
    s.add_poller(*second);
    co_await first->wait_until(std::chrono::steady_clock::now() + 2ms);
    // Resumed from inside first->poll(), before `second` is polled.
    s.remove_poller(*first);
    s.remove_poller(*second);
    first.reset();
    second.reset();
    s.add_poller(third);
    co_await gdr::nop();
  };
  gdr::sync_wait(s, body());
  CHECK(third_polled);
  s.remove_poller(third);
}

TEST_CASE("post from a plain thread wakes a sleeping loop through the eventfd") {
  sched_test::watchdog wd(30);
  gdr::scheduler s({.mode = gdr::run_mode::sleep});
  sched_test::counter_node n;
  std::thread poster([&] {
    std::this_thread::sleep_for(20ms);  // let the loop fall asleep
    s.post(&n);                         // no scheduler on this thread: eventfd
  });
  auto t0 = std::chrono::steady_clock::now();
  s.run_until([&] { return n.runs.load() == 1; });
  poster.join();
  CHECK(n.where.load() == std::this_thread::get_id());
  CHECK(s.stats().sleeps >= 1);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
}

namespace {

// A completion source that only bounds the loop's sleeps, as a CUDA event
// poller with work pending does.
class bound_poller final : public gdr::poller {
 public:
  explicit bound_poller(std::chrono::nanoseconds bound) : bound_(bound) {}
  gdr::poll_status poll() noexcept override { return {false, bound_}; }
  const char* name() const noexcept override { return "bound"; }

 private:
  std::chrono::nanoseconds bound_;
};

}  // namespace

TEST_CASE("without IORING_FEAT_EXT_ARG, posts from a plain thread during bounded sleeps wake the loop") {
  // Before Linux 5.11 liburing bounds a sleep with a timeout SQE of its own
  // (user_data LIBURING_UDATA_TIMEOUT, all ones). Woken by the eventfd read
  // of a post, the loop finds that timeout's CQE behind the read's: before
  // the fix dispatch took it for a MSG_RING completion (SIGSEGV).
  sched_test::watchdog wd(30);
  gdr::scheduler s({.mode = gdr::run_mode::sleep, .ext_arg = false});
  REQUIRE((s.ring()->features & IORING_FEAT_EXT_ARG) == 0);
  bound_poller p(50ms);
  s.add_poller(p);
  constexpr int rounds = 5;
  sched_test::counter_node nodes[rounds];
  std::thread poster([&] {
    for (auto& n : nodes) {
      std::this_thread::sleep_for(10ms);  // the loop is in a 50 ms sleep
      s.post(&n);                         // no scheduler on this thread: eventfd
    }
  });
  auto t0 = std::chrono::steady_clock::now();
  s.run_until([&] { return nodes[rounds - 1].runs.load() == 1; });
  poster.join();
  // And bounds that expire with nothing to wake the loop (liburing's own
  // CQE then ends the wait).
  for (int i = 0; i < 3; ++i) s.run_once();
  s.remove_poller(p);
  for (auto& n : nodes) CHECK(n.runs.load() == 1);
  CHECK(s.stats().sleeps >= rounds);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  CHECK(s.stats().completions == 0);  // liburing's timeouts are nobody's operations
}

TEST_CASE("GDR_MASK_EXT_ARG=1 masks IORING_FEAT_EXT_ARG for every scheduler; the option says so too") {
  const char* env = std::getenv("GDR_MASK_EXT_ARG");
  const bool masked = env != nullptr && std::string(env) == "1";
  MESSAGE(std::string(masked ? "GDR_MASK_EXT_ARG=1: this binary runs as on a kernel before 5.11"
                              : "GDR_MASK_EXT_ARG not set"));
  gdr::scheduler plain;
  CHECK(gdr::scheduler_options{}.ext_arg == !masked);
  if (masked) CHECK((plain.ring()->features & IORING_FEAT_EXT_ARG) == 0);
  gdr::scheduler off({.ext_arg = false});
  CHECK((off.ring()->features & IORING_FEAT_EXT_ARG) == 0);
  // Every kernel with MSG_RING (5.18) has EXT_ARG (5.11).
  gdr::scheduler on({.ext_arg = true});
  if (gdr::detail::msg_ring_supported(*on.ring())) CHECK((on.ring()->features & IORING_FEAT_EXT_ARG) != 0);
}

TEST_CASE("schedule() hands a coroutine from another thread to the loop's thread") {
  sched_test::watchdog wd(30);
  gdr::scheduler s;
  std::thread::id resumed_on;
  std::atomic<bool> moved{false};
  auto hop = [&]() -> gdr::task<> {
    co_await s.schedule();
    resumed_on = std::this_thread::get_id();
    moved = true;
  };
  auto t = hop();
  std::thread other([&] {
    std::this_thread::sleep_for(10ms);
    t.handle().resume();  // runs on this plain thread until schedule() posts it
  });
  s.run_until([&] { return moved.load(); });
  other.join();
  CHECK(resumed_on == std::this_thread::get_id());
}

TEST_CASE("schedule() on the loop's own thread completes inline") {
  gdr::scheduler s;
  auto before = s.stats().remote;
  gdr::sync_wait(s, [&]() -> gdr::task<> { co_await s.schedule(); }());
  CHECK(s.stats().remote == before + 1);  // only sync_wait's own start node
}

TEST_CASE("posting from a thread with its own scheduler wakes a sleeping loop through MSG_RING") {
  sched_test::watchdog wd(30);
  gdr::scheduler target({.mode = gdr::run_mode::sleep});
  constexpr int rounds = 20;
  sched_test::counter_node nodes[rounds];
  std::atomic<int> through_ring{0};
  std::thread poster([&] {
    gdr::scheduler mine;
    gdr::sync_wait(mine, [&]() -> gdr::task<> {
      for (auto& n : nodes) {
        co_await gdr::sleep_for(5ms);  // let the target fall asleep
        // When the target sleeps, post() wakes it with an IORING_OP_MSG_RING
        // submitted on *this* thread's ring: its submit count moves.
        auto before = mine.stats().submits;
        target.post(&n);
        if (mine.stats().submits > before) through_ring.fetch_add(1);
      }
    }());
  });
  target.run_until([&] { return nodes[rounds - 1].runs.load() == 1; });
  poster.join();
  for (auto& n : nodes) CHECK(n.runs.load() == 1);
  CHECK(through_ring.load() >= 1);  // the target was asleep at least once
  CHECK(target.stats().sleeps >= 1);
}

TEST_CASE("many threads posting at once lose nothing") {
  sched_test::watchdog wd(60);
  gdr::scheduler s;
  constexpr int threads = 4, per = 2000;
  std::vector<sched_test::counter_node> nodes(threads * per);
  std::vector<std::thread> posters;
  for (int t = 0; t < threads; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < per; ++i) s.post(&nodes[static_cast<std::size_t>(t * per + i)]);
    });
  }
  s.run_until([&] {
    for (auto& n : nodes)
      if (n.runs.load() == 0) return false;
    return true;
  });
  for (auto& p : posters) p.join();
  s.run_once(false);
  int total = 0;
  for (auto& n : nodes) total += n.runs.load();
  CHECK(total == threads * per);
}

namespace {

// Runs `rounds` posts to `target` from a thread that runs a scheduler of its
// own, each after `target` has had time to fall asleep, while `target` runs
// until every node has run or 2 s have passed. A timer on `target` bounds
// its sleep, so a lost wake-up shows as a slow round instead of a hang.
struct cross_thread_posts {
  static constexpr int rounds = 20;
  sched_test::counter_node nodes[rounds];
  std::atomic<int> msg_rings_sent{0};          // the poster's ring submitted something for the post
  std::atomic<std::uint64_t> poster_failed{0};  // the poster's stats().msg_ring_failed at the end
  std::chrono::steady_clock::duration took{};

  void run(gdr::scheduler& target) {
    std::thread poster([&] {
      gdr::scheduler mine;
      gdr::sync_wait(mine, [&]() -> gdr::task<> {
        for (auto& n : nodes) {
          co_await gdr::sleep_for(5ms);  // let the target fall asleep
          auto before = mine.stats().submits;
          target.post(&n);
          if (mine.stats().submits > before) msg_rings_sent.fetch_add(1);
        }
      }());
      mine.drain();  // reaps the last messages' completions (a failed one falls back here)
      poster_failed = mine.stats().msg_ring_failed;
    });
    std::stop_source stop_bound;
    int bound_done = 0;
    auto t0 = std::chrono::steady_clock::now();
    gdr::sync_wait(target, [&]() -> gdr::task<> {
      auto bound = [&]() -> gdr::task<> { (void)co_await gdr::sleep_for(2s).as_result(); };
      sched_test::run_detached(gdr::with_stop_token(stop_bound.get_token(), bound()), bound_done);
      co_await gdr::nop();
    }());
    target.run_until([&] { return nodes[rounds - 1].runs.load() == 1 || bound_done == 1; });
    took = std::chrono::steady_clock::now() - t0;
    poster.join();
    stop_bound.request_stop();
    target.drain();
  }
};

}  // namespace

TEST_CASE("with MSG_RING wake-ups turned off, a loop's post wakes a sleeping loop through the eventfd") {
  sched_test::watchdog wd(30);
  gdr::scheduler target({.mode = gdr::run_mode::sleep, .msg_ring_wakeups = false});
  CHECK_FALSE(gdr::detail::scheduler_testing::wakes_by_msg_ring(target));
  cross_thread_posts t;
  t.run(target);
  for (auto& n : t.nodes) CHECK(n.runs.load() == 1);
  CHECK(t.took < 1s);                 // every wake-up arrived
  CHECK(t.msg_rings_sent.load() == 0);  // none through the poster's ring
  CHECK(target.stats().sleeps >= 1);
}

TEST_CASE("a MSG_RING wake-up the kernel fails is delivered through the target's eventfd") {
  sched_test::watchdog wd(30);
  gdr::scheduler target({.mode = gdr::run_mode::sleep});
  REQUIRE(gdr::detail::scheduler_testing::wakes_by_msg_ring(target));
  // The messages go to the target's eventfd, which is not a ring: the kernel
  // completes each with -EBADFD on the poster's ring.
  gdr::detail::scheduler_testing::misdirect_msg_ring(target);
  cross_thread_posts t;
  t.run(target);
  for (auto& n : t.nodes) CHECK(n.runs.load() == 1);
  CHECK(t.took < 1s);  // no round waited for the 2 s bound
  CHECK(t.msg_rings_sent.load() >= 1);  // the target was asleep at least once...
  CHECK(t.poster_failed.load() == static_cast<std::uint64_t>(t.msg_rings_sent.load()));  // ...and each message failed
  CHECK(target.stats().sleeps >= 1);
}

TEST_CASE("a failed MSG_RING wake-up reaped after its target is gone touches nothing of it") {
  // The target is destroyed while the poster's failed message is still
  // unreaped; the fallback then writes an eventfd that the message keeps
  // open (ASan sees any use of the freed target; the fd count sees a leak).
  sched_test::watchdog wd(30);
  int fds_before = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++fds_before;
    ::closedir(d);
  }
  {
    gdr::scheduler poster({.mode = gdr::run_mode::busy_poll});
    auto target = std::make_unique<gdr::scheduler>(gdr::scheduler_options{.mode = gdr::run_mode::sleep});
    gdr::detail::scheduler_testing::misdirect_msg_ring(*target);
    // A poller wakes the target from inside the poster's loop, as a post
    // to a sleeping loop would: the message is sent from the poster's ring,
    // after this iteration's reaping, so its CQE waits for the next one.
    struct waker final : gdr::poller {
      gdr::scheduler* target = nullptr;
      gdr::poll_status poll() noexcept override {
        if (target != nullptr) std::exchange(target, nullptr)->wake();
        return {};
      }
      const char* name() const noexcept override { return "waker"; }
    } w;
    w.target = target.get();
    poster.add_poller(w);
    poster.run_once(false);  // the message is submitted; its CQE is not reaped
    poster.remove_poller(w);
    target.reset();          // the target's eventfd stays open for the message
    poster.drain();          // reaps the failed message: writes that eventfd, then closes it
    CHECK(poster.stats().msg_ring_failed == 1);
  }
  int fds_after = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++fds_after;
    ::closedir(d);
  }
  CHECK(fds_after == fds_before);
}

TEST_CASE("MSG_RING support is probed from the kernel, and Linux 5.18 or later has it") {
  gdr::scheduler s;
  utsname u{};
  REQUIRE(::uname(&u) == 0);
  int major = 0, minor = 0;
  REQUIRE(std::sscanf(u.release, "%d.%d", &major, &minor) == 2);
  bool new_enough = major > 5 || (major == 5 && minor >= 18);
  CHECK(gdr::detail::msg_ring_supported(*s.ring()) == new_enough);
  CHECK(gdr::detail::scheduler_testing::wakes_by_msg_ring(s) == new_enough);
}

namespace {

// Makes io_uring_enter on `s`'s ring fail (EBADF) until `restore()`, as a
// kernel that refuses to take the SQ (EAGAIN, or EBUSY on older kernels)
// does: liburing enters the ring through `enter_ring_fd`. SQEs prepared
// meanwhile stay in the SQ; no completion is lost.
struct refused_submissions {
  io_uring* ring;
  int saved;
  explicit refused_submissions(gdr::scheduler& s) noexcept
      : ring(s.ring()), saved(std::exchange(s.ring()->enter_ring_fd, -1)) {}
  void restore() noexcept { ring->enter_ring_fd = saved; }
};

gdr::task<void> sleep_into(gdr::result<void>& out, std::chrono::nanoseconds d) {
  out = co_await gdr::sleep_for(d).as_result();
}

}  // namespace

TEST_CASE("a cancel that finds no free SQE waits for the next iteration instead of being dropped") {
  sched_test::watchdog wd(30);
  gdr::scheduler s({.sq_entries = 4});
  std::stop_source stop_first, stop_rest;
  gdr::result<void> first = gdr::errc::busy;
  gdr::result<void> rest[4] = {gdr::errc::busy, gdr::errc::busy, gdr::errc::busy, gdr::errc::busy};
  int first_done = 0, rest_done = 0;
  std::size_t pending = 0;
  std::chrono::steady_clock::duration took{};
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    sched_test::run_detached(gdr::with_stop_token(stop_first.get_token(), sleep_into(first, 3s)), first_done);
    co_await gdr::nop();  // the first sleep is in the kernel; the SQ is empty
    refused_submissions refused(s);
    // Four more sleeps fill the SQ (4 entries), and the kernel will not take it.
    for (auto& r : rest) sched_test::run_detached(gdr::with_stop_token(stop_rest.get_token(), sleep_into(r, 10s)), rest_done);
    auto t0 = std::chrono::steady_clock::now();
    stop_first.request_stop();  // its cancel finds no SQE
    pending = s.pending_cancels();
    refused.restore();
    for (int i = 0; i < 1000 && first_done == 0; ++i) co_await gdr::sleep_for(1ms);
    took = std::chrono::steady_clock::now() - t0;
    stop_rest.request_stop();
    while (rest_done < 4 || first_done < 1) co_await gdr::sleep_for(1ms);
  }());
  CHECK(pending == 1);
  CHECK(s.stats().cancels_deferred == 1);
  CHECK(first.error() == gdr::errc::cancelled);
  CHECK(took < 1s);  // cancelled, not expired after 3 s
  for (auto& r : rest) CHECK(r.error() == gdr::errc::cancelled);
  CHECK(s.pending_cancels() == 0);
  CHECK(s.inflight() == 0);
}

TEST_CASE("a cancel without an SQE for an operation whose completion is being dispatched is not kept") {
  // Two NOPs complete in one batch. The first one's coroutine asks, with the
  // SQ full and refused, to cancel the second: that one is finishing anyway,
  // and a cancel kept for later could reach a new operation at its address.
  sched_test::watchdog wd(30);
  gdr::scheduler s({.sq_entries = 4});
  std::stop_source stop_second, stop_rest;
  gdr::result<void> rest[4] = {gdr::errc::busy, gdr::errc::busy, gdr::errc::busy, gdr::errc::busy};
  gdr::result<void> second = gdr::errc::busy;
  int done = 0, rest_done = 0;
  std::size_t pending = 1;
  auto first = [&]() -> gdr::task<> {
    co_await gdr::nop();
    refused_submissions refused(s);
    for (auto& r : rest) sched_test::run_detached(gdr::with_stop_token(stop_rest.get_token(), sleep_into(r, 10s)), rest_done);
    stop_second.request_stop();
    pending = s.pending_cancels();
    refused.restore();
  };
  auto second_nop = [&]() -> gdr::task<> { second = co_await gdr::nop().as_result(); };
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    sched_test::run_detached(first(), done);
    sched_test::run_detached(gdr::with_stop_token(stop_second.get_token(), second_nop()), done);
    while (done < 2) co_await gdr::nop();
    stop_rest.request_stop();
    while (rest_done < 4) co_await gdr::sleep_for(1ms);
  }());
  CHECK(pending == 0);
  CHECK(s.stats().cancels_deferred == 0);
  CHECK(second.has_value());  // the NOP had completed
}

TEST_CASE("a kept cancel whose operation completes before it is sent is forgotten") {
  // The cancel of a NOP is kept (SQ full and refused) by posted work that
  // runs before the NOP's completion is reaped; the completion then makes
  // the kept cancel moot before any SQE is free for it.
  sched_test::watchdog wd(30);
  gdr::scheduler s({.sq_entries = 4});
  std::stop_source stop_nop, stop_rest;
  gdr::result<void> rest[4] = {gdr::errc::busy, gdr::errc::busy, gdr::errc::busy, gdr::errc::busy};
  gdr::result<void> nop_result = gdr::errc::busy;
  int nop_done = 0, rest_done = 0;
  std::size_t kept = 0, pending_at_completion = 1;
  std::optional<refused_submissions> refused;
  struct canceller : gdr::remote_work {
    std::function<void()> f;
  } w;
  w.run = [](gdr::remote_work* n) noexcept { static_cast<canceller*>(n)->f(); };
  w.f = [&] {
    refused.emplace(s);
    for (auto& r : rest) sched_test::run_detached(gdr::with_stop_token(stop_rest.get_token(), sleep_into(r, 10s)), rest_done);
    stop_nop.request_stop();
    kept = s.pending_cancels();
  };
  auto the_nop = [&]() -> gdr::task<> {
    nop_result = co_await gdr::nop().as_result();
    pending_at_completion = s.pending_cancels();
    refused->restore();
  };
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    sched_test::run_detached(gdr::with_stop_token(stop_nop.get_token(), the_nop()), nop_done);
    s.post(&w);  // runs next iteration, before that iteration reaps the NOP
    while (nop_done == 0) co_await gdr::nop();
    stop_rest.request_stop();
    while (rest_done < 4) co_await gdr::sleep_for(1ms);
  }());
  CHECK(kept == 1);
  CHECK(pending_at_completion == 0);
  CHECK(nop_result.has_value());
  CHECK(s.stats().cancels_deferred == 1);
}

namespace {

// An operation made by hand, so that a test can submit it again at the same
// address: it records each completion's result.
struct hand_op : gdr::operation {
  std::vector<int> results;
  std::function<void(hand_op&, int)> then;  // runs after recording, if set
  hand_op() {
    complete = [](gdr::operation* op, int res, std::uint32_t) noexcept {
      auto* self = static_cast<hand_op*>(op);
      self->results.push_back(res);
      if (self->then) self->then(*self, res);
    };
  }
};

void submit_nop(gdr::scheduler& s, hand_op& op) {
  io_uring_sqe* sqe = s.get_sqe();
  REQUIRE(sqe != nullptr);
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data(sqe, static_cast<gdr::operation*>(&op));
  s.note_submitted();
}

void submit_timeout(gdr::scheduler& s, hand_op& op, __kernel_timespec& ts) {
  io_uring_sqe* sqe = s.get_sqe();
  REQUIRE(sqe != nullptr);
  io_uring_prep_timeout(sqe, &ts, 0, 0);
  io_uring_sqe_set_data(sqe, static_cast<gdr::operation*>(&op));
  s.note_submitted();
}

}  // namespace

TEST_CASE("a cancel without an SQE for a new operation at the address of one dispatched earlier in the batch is kept") {
  // Two NOPs, `first` and `second`, complete in one batch. The handler of
  // `second` submits a new, long operation at `first`'s address, then, with
  // the SQ full and refused, cancels it. `first`'s CQE in the batch was
  // dispatched already: it says nothing of the new operation, whose cancel
  // must be kept (before the fix it was dropped: the timeout ran its 10 s).
  sched_test::watchdog wd(30);
  gdr::scheduler s({.sq_entries = 4});
  hand_op first, second, fillers[3];
  __kernel_timespec ten_s{.tv_sec = 10, .tv_nsec = 0};
  std::size_t kept = 0;
  second.then = [&](hand_op&, int) {
    submit_timeout(s, first, ten_s);  // the SQ: 1 of 4
    for (auto& f : fillers) submit_nop(s, f);  // full
    refused_submissions refused(s);
    s.cancel(&first);  // no SQE: kept, or (before) dropped
    kept = s.pending_cancels();
    refused.restore();
  };
  submit_nop(s, first);
  submit_nop(s, second);
  s.submit();
  auto t0 = std::chrono::steady_clock::now();
  s.run_until([&] { return first.results.size() == 2 || std::chrono::steady_clock::now() - t0 > 2s; });
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(kept == 1);
  CHECK(s.stats().cancels_deferred == 1);
  REQUIRE(first.results.size() >= 1);
  CHECK(first.results[0] == 0);  // the NOP
  CHECK(took < 1s);              // the timeout was cancelled, not expired
  if (first.results.size() < 2) s.cancel(&first);  // (before the fix) end it now
  s.drain();
  REQUIRE(first.results.size() == 2);
  CHECK(first.results[1] == -ECANCELED);
  CHECK(s.pending_cancels() == 0);
}

TEST_CASE("an eventfd read refused an SQE is armed again, and a later post from a plain thread still wakes the loop") {
  // A post from a plain thread wakes the sleeping loop through its eventfd.
  // In the next iteration, before the read's completion is reaped, posted
  // work fills the SQ and makes the kernel refuse it, so the read cannot be
  // armed again from its completion; a poller lifts the refusal after the
  // reaping. Before the fix the read was dropped there, and the next post
  // from a plain thread woke nobody: the loop slept until its 2 s bound.
  sched_test::watchdog wd(30);
  gdr::scheduler s({.sq_entries = 4, .mode = gdr::run_mode::sleep});
  hand_op fillers[4];
  std::optional<refused_submissions> refused;
  struct fill_node : gdr::remote_work {
    std::function<void()> f;
  } fill;
  fill.run = [](gdr::remote_work* w) noexcept { static_cast<fill_node*>(w)->f(); };
  fill.f = [&] {
    for (auto& f : fillers) submit_nop(s, f);  // 4 of 4
    refused.emplace(s);
  };
  struct lift_poller final : gdr::poller {
    std::optional<refused_submissions>* refused = nullptr;
    gdr::poll_status poll() noexcept override {
      if (refused->has_value()) {
        (*refused)->restore();
        refused->reset();
      }
      return {false, 2s};  // bounds every sleep: a lost wake-up shows as a slow round
    }
    const char* name() const noexcept override { return "lift"; }
  } lift;
  lift.refused = &refused;
  s.add_poller(lift);
  sched_test::counter_node later;
  std::atomic<std::int64_t> posted_at{0};
  std::thread poster([&] {
    std::this_thread::sleep_for(20ms);  // the loop sleeps
    s.post(&fill);                      // eventfd: its read completes
    std::this_thread::sleep_for(50ms);  // the loop sleeps again
    posted_at = std::chrono::steady_clock::now().time_since_epoch().count();
    s.post(&later);
  });
  s.run_until([&] { return later.runs.load() == 1; });
  auto ran_at = std::chrono::steady_clock::now();
  poster.join();
  s.drain();
  s.remove_poller(lift);
  auto delay = ran_at - std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(posted_at.load()));
  for (auto& f : fillers) CHECK(f.results == std::vector<int>{0});
  CHECK(s.stats().wake_reads_deferred == 1);  // the refusal did hit the read
  CHECK(delay < 1s);                           // the later post woke the loop
}

namespace {

// Captures what the process writes to stderr between construction and
// `text()` (a pipe replaces fd 2 meanwhile; the text must fit in the pipe).
class stderr_capture {
 public:
  stderr_capture() {
    REQUIRE(::pipe(fds_) == 0);
    std::fflush(stderr);
    saved_ = ::dup(2);
    ::dup2(fds_[1], 2);
  }
  std::string text() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    ::close(fds_[1]);
    std::string out;
    char buf[512];
    for (ssize_t n; (n = ::read(fds_[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
    ::close(fds_[0]);
    return out;
  }

 private:
  int fds_[2] = {-1, -1};
  int saved_ = -1;
};

}  // namespace

TEST_CASE("destroying a scheduler without drain finishes the operations still in flight") {
  sched_test::watchdog wd(30);
  int done = 0;
  auto t0 = std::chrono::steady_clock::now();
  {
    gdr::scheduler s;
    struct starter : gdr::remote_work {
      int* done;
    } st;
    st.done = &done;
    st.run = [](gdr::remote_work* w) noexcept {
      auto* self = static_cast<starter*>(w);
      for (int i = 0; i < 5; ++i) sched_test::run_detached(sleep(std::chrono::milliseconds(10 + i)), *self->done);
    };
    s.post(&st);
    s.run_once(false);  // starts the five sleeps
    CHECK(s.inflight() == 5);
  }  // no drain(): the destructor runs the loop until they complete
  CHECK(done == 5);  // resumed, and their frames freed (LeakSanitizer would see them)
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
}

namespace {

// A one-byte read from a pipe nobody writes, in memory of the test's own (no
// coroutine frame to leak): it never completes, and the test fails if it does.
struct never_read : gdr::operation {
  char c = 0;
  never_read() {
    complete = [](gdr::operation*, int, std::uint32_t) noexcept { FAIL("an abandoned operation completed"); };
  }
  // Prepares it on `s` (submitted with the loop's next submission).
  void start(gdr::scheduler& s, int fd) {
    io_uring_sqe* sqe = s.get_sqe();
    REQUIRE(sqe != nullptr);
    io_uring_prep_read(sqe, fd, &c, 1, 0);
    io_uring_sqe_set_data(sqe, static_cast<gdr::operation*>(this));
    s.note_submitted();
  }
};

}  // namespace

TEST_CASE("destroying a scheduler whose operation never completes gives up after the teardown bound and says so") {
  sched_test::watchdog wd(30);
  int p[2];
  REQUIRE(::pipe(p) == 0);
  never_read op;  // abandoned by the destructor, never completed
  stderr_capture err;
  auto t0 = std::chrono::steady_clock::now();
  {
    gdr::scheduler s({.teardown_timeout = 100ms});
    op.start(s, p[0]);
    s.submit();
  }
  auto took = std::chrono::steady_clock::now() - t0;
  std::string text = err.text();
  ::close(p[0]);
  ::close(p[1]);
  CHECK(took >= 100ms);
  CHECK(took < 2s);
  CHECK(text.find("gdr scheduler: destroyed with 1 operation(s) still in flight after 100 ms") != std::string::npos);
  CHECK(std::count(text.begin(), text.end(), '\n') == 1);  // one line
}

namespace {

bool bound_to_a_thread(gdr::scheduler& s) {
  return (s.ring()->flags & (IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN)) != 0;
}

}  // namespace

TEST_CASE("a single-thread scheduler is made on one thread, runs on another, refuses a third, and ends on the first") {
  sched_test::watchdog wd(30);
  if (!gdr::scheduler_options{}.single_thread) GDR_SKIP("GDR_SCHED_ANY_THREAD=1: rings any thread may run");
  auto s = std::make_unique<gdr::scheduler>(gdr::scheduler_options{.teardown_timeout = 200ms});
  if (!bound_to_a_thread(*s)) GDR_SKIP("the kernel refuses IORING_SETUP_DEFER_TASKRUN (before Linux 6.1)");
  int p[2];
  REQUIRE(::pipe(p) == 0);
  // Started by the loop's thread, which then exits with it in flight.
  never_read op;
  std::thread loop([&] {
    gdr::sync_wait(*s, nops(3));
    op.start(*s, p[0]);
    s->run_once(false);
    CHECK(s->inflight() == 1);
  });
  loop.join();
  // Another thread may not run it.
  bool refused = false;
  try {
    s->run_once(false);
  } catch (const gdr::error& e) {
    refused = true;
    CHECK(e.code() == gdr::errc::unsupported);
    CHECK(std::string(e.what()).find("single_thread") != std::string::npos);
  }
  CHECK(refused);
  // Nor claim it (what sync_wait asks before it queues its task).
  CHECK_THROWS_AS(s->claim_thread(), gdr::error);
  // The destructor, here, cannot enter the ring to finish the read: it gives
  // up after the teardown bound and says why.
  stderr_capture err;
  auto t0 = std::chrono::steady_clock::now();
  s.reset();
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 200ms);
  CHECK(took < 2s);
  std::string text = err.text();
  CHECK(text.find("gdr scheduler: destroyed on a thread other than the one that ran its loop, with 1 operation(s)") !=
        std::string::npos);
  CHECK(std::count(text.begin(), text.end(), '\n') == 1);
  ::close(p[0]);
  ::close(p[1]);
  // Made here, run on another thread, ended here with nothing in flight: the
  // common case, silent and at once.
  {
    stderr_capture quiet;
    gdr::scheduler q;
    std::thread t([&] { gdr::sync_wait(q, sleep(1ms)); });
    t.join();
    CHECK(quiet.text().empty());
  }
}

TEST_CASE("a scheduler with single_thread = false may be run by one thread after another") {
  sched_test::watchdog wd(30);
  gdr::scheduler s({.single_thread = false});
  CHECK_FALSE(bound_to_a_thread(s));
  std::thread a([&] { gdr::sync_wait(s, nops(3)); });
  a.join();
  s.claim_thread();  // any thread may
  gdr::sync_wait(s, nops(3));
  std::thread b([&] { gdr::sync_wait(s, sleep(1ms)); });
  b.join();
}
