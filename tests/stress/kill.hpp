// The forked variants ("tcp-kill", "shm-kill"): the two sides of a plan run
// in two processes over TCP or shared memory, and the survivor SIGKILLs its peer at a moment the seed
// chooses. The survivor checks its own side: every operation pending at the
// kill ends within a bound with an allowed outcome (connection_lost, or
// what was already decided), every message it received is one the peer's
// plan sends (in order, intact), each byte of its windows is either as it
// was or what the peer's plan puts there, and nothing is left over: bounce
// buffers, registrations, engines, file descriptors, heap objects. The
// peer's outcomes are unknown here, so every peer event is allowed.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/scope.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/shm.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/stress/fixture.hpp"
#include "tests/stress/run.hpp"

namespace stress {

/// How the two processes of a forked run meet: the survivor listens and
/// tells the peer a name through a pipe; the peer connects.
struct tcp_net {
  using endpoint = gdr::tcp::endpoint;
  using listener = gdr::tcp::listener;
  static constexpr transport_kind kind = transport_kind::tcp_kill;
  static listener listen(gdr::scheduler& s, gdr::memory_registry& reg, const plan& p, int me) {
    return listener(s, gdr::tcp::address::loopback(0), reg, tcp_options(p, me));
  }
  static std::string name(const listener& l) { return std::to_string(l.local_address().port()); }
  static gdr::task<gdr::result<endpoint>> accept(listener& l) {
    co_return co_await l.accept(std::chrono::seconds(10)).as_result();
  }
  static gdr::task<endpoint> connect(gdr::scheduler& s, const std::string& name, gdr::memory_registry& reg,
                                     const plan& p, int me) {
    const auto port = static_cast<std::uint16_t>(std::stoul(name));
    co_return co_await gdr::tcp::connect(s, gdr::tcp::address::loopback(port), {}, reg, tcp_options(p, me));
  }
};
struct shm_net {
  using endpoint = gdr::shm::endpoint;
  using listener = gdr::shm::listener;
  static constexpr transport_kind kind = transport_kind::shm_kill;
  static listener listen(gdr::scheduler& s, gdr::memory_registry& reg, const plan& p, int me) {
    return listener(s, {}, reg, shm_options(p, me));
  }
  static std::string name(const listener& l) { return l.name(); }
  static gdr::task<gdr::result<endpoint>> accept(listener& l) {
    try {
      co_return co_await l.accept(std::chrono::seconds(10));
    } catch (const gdr::error& e) {
      co_return e.code();
    }
  }
  static gdr::task<endpoint> connect(gdr::scheduler& s, const std::string& name, gdr::memory_registry& reg,
                                     const plan& p, int me) {
    co_return co_await gdr::shm::connect(s, name, reg, shm_options(p, me));
  }
};

/// The peer process: runs its side until the end, then waits to be killed.
template <class Net>
[[noreturn]] void run_peer(const run_config& c, const plan& p, int read_fd) {
  const int me = 1 - p.survivor;
  // Dies with the survivor (a crash there must not leave this one holding
  // the runner's pipe), and says nothing unless the run logs.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  ::signal(SIGALRM, SIG_DFL);
  ::signal(SIGSEGV, SIG_DFL);
  if (!c.log) {
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(null, 2);
    ::close(null);
  }
  char name[128] = {};
  if (::read(read_fd, name, sizeof name) != sizeof name) ::_exit(2);
  ::close(read_fd);
  ::alarm(static_cast<unsigned>(c.bound.count() / 1000 + 10));
  {
    journal j(c.log);
    arena mem;
    run_record rr;
    gdr::memory_registry reg;
    gdr::scheduler sched({.mode = c.mode});
    guarded_copy_engine ce(sched, mem, j, hash_of({c.seed, 0x70656572}), p.copy_delay);
    session<typename Net::endpoint> ss(p, j, rr, mem, reg, 1u << me, c.limits());
    ss.on_hang = [] { ::_exit(3); };
    try {
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        ss.side(me).ep = co_await Net::connect(sched, name, reg, p, me);
        if (!co_await ss.setup()) ss.skip_traffic();
        co_await ss.traffic();
      }());
      sched.drain();
    } catch (...) {
    }
  }
  for (;;) ::pause();  // until the survivor's SIGKILL
}

/// Runs `c` (transport tcp-kill or shm-kill) as the survivor (see the file
/// comment).
template <class Net>
std::vector<failure> run_kill(const run_config& c) {
  const plan p = make_plan(c.seed, Net::kind, c.scale);
  const int me = p.survivor, peer = 1 - me;
  journal j(c.log);
  log_plan(p, j);
  const int fds_before = open_fds();
  const long objects_before = live_allocations();
  int pfd[2];
  if (::pipe(pfd) != 0) {
    j.fail("setup", "pipe failed");
    return j.failures();
  }
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    j.fail("setup", "fork failed");
    return j.failures();
  }
  if (pid == 0) {
    ::close(pfd[1]);
    run_peer<Net>(c, p, pfd[0]);
  }
  ::close(pfd[0]);
  arm_alarm(c.bound);
  bool killed = false;
  {
    arena mem;
    fault_reporter faults(mem);
    run_record rr;
    rr.ev[peer].unknown = true;
    gdr::memory_registry reg;
    {
      gdr::scheduler sched({.mode = c.mode});
      guarded_copy_engine ce(sched, mem, j, hash_of({c.seed, 0x6365}), p.copy_delay);
      session<typename Net::endpoint> ss(p, j, rr, mem, reg, 1u << me, c.limits());
      ss.on_hang = [&] {
        ::kill(pid, SIGKILL);
        print_failures(c, j.failures());
        ::_exit(3);
      };
      std::int64_t kill_us = 0;
      std::uint64_t kill_tick = 0;
      ss.end_gate = [&] { return killed; };
      // Operations still pending long after the kill: the survivor did not
      // notice its peer's death.
      ss.hang_kind = [&]() -> const char* {
        return killed && j.micros() - kill_us > (sanitized ? 6'000'000 : 2'000'000) ? "kill-unnoticed" : nullptr;
      };
      auto killer = [&]() -> gdr::task<> {
        const std::int64_t cap = j.micros() + 2'000'000;
        const std::uint64_t target = ss.progress() + p.kill_when.progress;
        if (p.kill_when.by_progress) {
          while (ss.progress() < target && !ss.traffic_over() && j.micros() < cap)
            (void)co_await gdr::sleep_for(std::chrono::microseconds(200)).as_result();
        } else if (p.kill_when.delay.count() > 0) {
          (void)co_await gdr::sleep_for(p.kill_when.delay).as_result();
        }
        ::kill(pid, SIGKILL);
        kill_tick = rr.ev[peer].killed = j.tick();
        kill_us = j.micros();
        killed = true;
        j.log("t%llu killed the peer (pid %d)", static_cast<unsigned long long>(kill_tick), static_cast<int>(pid));
        ss.notify();
      };
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        typename Net::listener l = Net::listen(sched, reg, p, me);
        char name[128] = {};
        const std::string n = Net::name(l);
        std::memcpy(name, n.data(), std::min(n.size(), sizeof name - 1));
        if (::write(pfd[1], name, sizeof name) != sizeof name) j.fail("setup", "could not tell the peer the name");
        ::close(pfd[1]);
        auto acc = co_await Net::accept(l);
        if (!acc) {
          j.fail("setup", strf("the peer did not connect: %s", acc.error().message().c_str()));
          ss.skip_traffic();
          killed = true;
          ::kill(pid, SIGKILL);
        } else {
          ss.side(me).ep = std::move(*acc);
          if (!co_await ss.setup()) ss.skip_traffic();
        }
        // (A named scope, not a conditional temporary inside the co_await:
        // GCC 12 destroys such temporaries twice.)
        gdr::task_scope k;
        if (!killed) k.spawn(killer());
        co_await ss.traffic();
        co_await k.join();
      }());
      sched.drain();
      ::waitpid(pid, nullptr, 0);
      // Every operation pending at the kill ended within the bound.
      const std::int64_t limit = sanitized ? 6'000'000 : 2'000'000;
      for (const op_record& o : rr.ops)
        if (o.started && kill_tick != 0 && o.start_tick < kill_tick && o.end_tick > kill_tick &&
            o.end_us - kill_us > limit)
          j.fail("kill-slow", strf("%s was pending at the kill and ended %lld ms after it (%s)", o.name().c_str(),
                                   static_cast<long long>((o.end_us - kill_us) / 1000), outcome(o).c_str()));
      check_quiet(ce, j);
      verify_run(p, rr, ss, mem, j, true);
      verify_windows(p, ss, me, std::vector<const op_record*>(p.side[peer].rma.size(), nullptr), j);
    }
  }
  ::alarm(0);
  if (open_fds() != fds_before)
    j.fail("fd-leak", strf("%d file descriptors open before the run, %d after", fds_before, open_fds()));
  if (j.ok() && live_allocations() != objects_before)
    j.fail("heap-leak", strf("%ld heap objects alive after the run that were not before",
                             live_allocations() - objects_before));
  return j.failures();
}

}  // namespace stress
