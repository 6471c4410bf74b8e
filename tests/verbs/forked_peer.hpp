// A verbs peer in a child process, for the tests that kill it: forked before
// this process touches rdma_cm or registers memory (a forked child shares the
// parent's verbs objects otherwise). The child registers a window of host
// memory, connects to the port this side tells it, writes its window's
// `remote_view` wire record (with the NIC key, now that its device's domain
// has it) and waits to be killed (60 s at most).
//
//   forked_peer peer(ip, 32u << 20);
//   ... in this side's coroutine:
//   gdr::verbs::listener l(sched, ip + ":0");
//   peer.tell_port(l.port());
//   gdr::verbs::endpoint ep = co_await l.accept();
//   auto window = peer.window();
//   ... ::kill(peer.pid(), SIGKILL) ...
//   CHECK(WIFSIGNALED(peer.wait()));
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/verbs.hpp>

namespace gdr_test_support {

class forked_peer {
 public:
  using window_view = gdr::remote_view<std::byte, gdr::Host>;

  forked_peer(const std::string& ip, std::size_t window_bytes) {
    int ready[2], port[2];
    REQUIRE(::pipe(ready) == 0);
    REQUIRE(::pipe(port) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) run_child(ip, window_bytes, port[0], ready[1]);  // never returns
    ::close(ready[1]);
    ::close(port[0]);
    ready_ = ready[0];
    port_ = port[1];
  }
  forked_peer(const forked_peer&) = delete;
  forked_peer& operator=(const forked_peer&) = delete;
  ~forked_peer() {
    ::close(ready_);
    ::close(port_);
    if (!waited_) {  // a test that failed before its kill
      ::kill(pid_, SIGKILL);
      wait();
    }
  }

  pid_t pid() const noexcept { return pid_; }

  /// Tells the child where this side listens.
  void tell_port(std::uint16_t p) { REQUIRE(::write(port_, &p, sizeof p) == static_cast<ssize_t>(sizeof p)); }

  /// The child's window, once it is connected.
  window_view window() {
    std::array<std::byte, window_view::wire_size> w{};
    REQUIRE(::read(ready_, w.data(), w.size()) == static_cast<ssize_t>(w.size()));
    gdr::result<window_view> rv = window_view::from_wire(w);
    REQUIRE(rv);
    return *rv;
  }

  /// Waits for the child to end; its status.
  int wait() {
    waited_ = true;
    ::waitpid(pid_, &status_, 0);
    return status_;
  }

 private:
  [[noreturn]] static void run_child(const std::string& ip, std::size_t bytes, int port_fd, int ready_fd) {
    std::uint16_t port = 0;
    if (::read(port_fd, &port, sizeof port) != sizeof port) ::_exit(2);
    std::vector<std::byte> window(bytes);
    auto reg = gdr::register_memory(gdr::host_view(window));
    gdr::scheduler s;
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      auto ep = co_await gdr::verbs::connect(s, ip + ":" + std::to_string(port), ip + ":0");
      auto w = reg.describe(0).to_wire();
      (void)!::write(ready_fd, w.data(), w.size());
      co_await gdr::sleep_for(s, std::chrono::seconds(60));
    }());
    ::_exit(0);
  }

  pid_t pid_ = -1;
  int ready_ = -1;
  int port_ = -1;
  int status_ = 0;
  bool waited_ = false;
};

}  // namespace gdr_test_support
