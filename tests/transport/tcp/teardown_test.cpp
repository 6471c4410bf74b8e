// Teardown in the order a program ends: TCP endpoints dropped without
// close(), their scheduler destroyed without drain(). Nothing may abort or
// leak (descriptors are counted here; run under --config=asan for memory).
// An endpoint that outlives its scheduler is a documented bug: the
// scheduler reports it, and destroying the endpoint later must still not
// touch the freed scheduler.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <gdr/sched/timer.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/transport/tcp/tcp_test_util.hpp"

namespace tcp = gdr::tcp;
using namespace std::chrono_literals;
using tcp_test::connected_pair;
using endpoint_pair = std::pair<tcp::endpoint, tcp::endpoint>;

namespace {

// One message each way, so both connections have read and written.
gdr::task<void> exchange(endpoint_pair& p) {
  std::array<int, 4> out{1, 2, 3, 4}, in{};
  co_await p.first.send(gdr::host_view(out));
  co_await p.second.recv(gdr::host_view(in));
  co_await p.second.send(gdr::host_view(in));
  co_await p.first.recv(gdr::host_view(out));
}

constexpr gdr::run_mode modes[] = {gdr::run_mode::sleep, gdr::run_mode::busy_poll};

}  // namespace

TEST_CASE("endpoints dropped without close, then their scheduler without drain: no abort, no descriptor left") {
  tcp_test::watchdog wd(60);
  for (gdr::run_mode mode : modes) {
    CAPTURE(static_cast<int>(mode));
    const int before = tcp_test::open_fds();
    {
      gdr::scheduler sched({.mode = mode});
      std::optional<endpoint_pair> eps;  // declared after the scheduler: destroyed first
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        eps.emplace(co_await connected_pair(sched));
        co_await exchange(*eps);
      }());
      CHECK(tcp_test::open_fds() > before);
    }
    CHECK(tcp_test::open_fds() == before);
  }
}

TEST_CASE("endpoints dropped at the end of their coroutine, scheduler destroyed without drain: nothing left") {
  tcp_test::watchdog wd(60);
  for (gdr::run_mode mode : modes) {
    CAPTURE(static_cast<int>(mode));
    const int before = tcp_test::open_fds();
    {
      gdr::scheduler sched({.mode = mode});
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        endpoint_pair p = co_await connected_pair(sched);
        co_await exchange(p);
      }());  // the endpoints are gone; their connections wait for the kernel
    }
    CHECK(tcp_test::open_fds() == before);
  }
}

TEST_CASE("an endpoint dropped with a receive pending, scheduler destroyed without drain: the receive fails and nothing is left") {
  tcp_test::watchdog wd(60);
  for (gdr::run_mode mode : modes) {
    CAPTURE(static_cast<int>(mode));
    const int before = tcp_test::open_fds();
    int done = 0;
    gdr::result<std::size_t> r = gdr::errc::busy;
    std::array<int, 1> in{};
    {
      gdr::scheduler sched({.mode = mode});
      std::optional<endpoint_pair> eps;
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        eps.emplace(co_await connected_pair(sched));
        tcp_test::spawn([&]() -> gdr::task<> { r = co_await eps->first.recv(gdr::host_view(in)).as_result(); }, done);
        co_await gdr::nop();
      }());
      CHECK(done == 0);  // still waiting for a message when the endpoints go
    }
    CHECK(done == 1);  // resumed by the scheduler's teardown, frame freed
    CHECK(r.error() == gdr::errc::closed);
    CHECK(tcp_test::open_fds() == before);
  }
}

TEST_CASE("a scheduler destroyed while its endpoints live reports them; destroying them later touches nothing freed") {
  // Documented misuse. In a child process, because the endpoints' memory is
  // leaked on purpose (their connections wait for completions that cannot
  // come): the child leaves with _exit, before LeakSanitizer's report. Under
  // ASan, a use of the freed scheduler ends the child with an error.
  tcp_test::watchdog wd(60);
  for (gdr::run_mode mode : modes) {
    CAPTURE(static_cast<int>(mode));
    int err[2];
    REQUIRE(::pipe(err) == 0);
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::dup2(err[1], 2);
      ::close(err[0]);
      auto sched = std::make_unique<gdr::scheduler>(gdr::scheduler_options{.mode = mode, .teardown_timeout = 100ms});
      std::optional<endpoint_pair> eps;
      gdr::sync_wait(*sched, [&]() -> gdr::task<> {
        eps.emplace(co_await connected_pair(*sched));
        co_await exchange(*eps);
      }());
      sched.reset();  // both connections' reads are in flight: reported after 100 ms
      eps.reset();    // must not touch the freed scheduler
      ::_exit(0);
    }
    ::close(err[1]);
    std::string text;
    char buf[512];
    for (ssize_t n; (n = ::read(err[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<std::size_t>(n));
    ::close(err[0]);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CAPTURE(text);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    CHECK(text.find("gdr scheduler: destroyed with 2 operation(s) still in flight after 100 ms") != std::string::npos);
  }
}
