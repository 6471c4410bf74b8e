// One stress run in this process: (transport, run mode, seed) in, the list
// of failures out. The run plans itself from the seed, makes a fresh
// scheduler with the guarded copy engine, a registry and a connected pair,
// runs the session, and then checks what the session and verify.hpp do not:
// the scheduler drains, no copy is left in flight, every pinned bounce
// buffer was released (so every engine is gone), and the process has the
// file descriptors and heap objects it had before.
//
// A run that goes past its bound, or where nothing completes for a while
// with something pending, prints its failures (the pending operations) and
// ends the process with status 3; a run whose loop itself
// is stuck is ended by SIGALRM (status 124). Both are meant for a forked
// child (runner.hpp), or for `--seed S` alone.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/sched/scheduler.hpp>

#include "tests/stress/alloc_count.hpp"
#include "tests/stress/fixture.hpp"
#include "tests/stress/journal.hpp"
#include "tests/stress/memory.hpp"
#include "tests/stress/plan.hpp"
#include "tests/stress/session.hpp"
#include "tests/stress/verify.hpp"

namespace stress {

inline const char* to_string(gdr::run_mode m) noexcept { return m == gdr::run_mode::busy_poll ? "busy" : "sleep"; }

/// Whether this build has a sanitizer (fewer operations, longer bounds).
inline constexpr bool sanitized =
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
    true;
#else
    false;
#endif
#else
    false;
#endif

struct run_config {
  transport_kind transport = transport_kind::loopback;
  gdr::run_mode mode = gdr::run_mode::sleep;
  std::uint64_t seed = 1;
  /// Operation counts (1: the default; GDR_STRESS_SCALE overrides).
  double scale = 1.0;
  bool log = false;
  /// A run longer than this is a hang (GDR_STRESS_BOUND_MS overrides), and
  /// so is one where nothing completes for `stall` (GDR_STRESS_STALL_MS).
  std::chrono::milliseconds bound{20000};
  std::chrono::milliseconds stall{3000};
  run_limits limits() const noexcept { return {bound, stall}; }
};

/// The defaults of this build and environment.
inline run_config default_config() {
  run_config c;
  c.scale = sanitized ? 0.4 : 1.0;
  c.bound = std::chrono::milliseconds(sanitized ? 60000 : 20000);
  c.stall = std::chrono::milliseconds(sanitized ? 10000 : 3000);
  if (const char* s = std::getenv("GDR_STRESS_SCALE"); s && *s) c.scale = std::atof(s);
  if (const char* s = std::getenv("GDR_STRESS_BOUND_MS"); s && *s) c.bound = std::chrono::milliseconds(std::atol(s));
  if (const char* s = std::getenv("GDR_STRESS_STALL_MS"); s && *s) c.stall = std::chrono::milliseconds(std::atol(s));
  return c;
}

inline std::string describe(const run_config& c) {
  return strf("seed=%llu transport=%s mode=%s", static_cast<unsigned long long>(c.seed), to_string(c.transport),
              to_string(c.mode));
}

/// Prints one `FAIL <run>: <kind>: <text>` line per failure (the first
/// line of its text; the rest, indented, below it) on stdout.
inline void print_failures(const run_config& c, const std::vector<failure>& fs) {
  for (const failure& f : fs) {
    const std::size_t nl = f.text.find('\n');
    std::printf("FAIL %s: %s: %s\n", describe(c).c_str(), f.kind.c_str(), f.text.substr(0, nl).c_str());
    if (nl != std::string::npos) std::printf("%s\n", f.text.substr(nl + 1).c_str());
  }
  std::fflush(stdout);
}

/// Open file descriptors of this process.
inline int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

/// The last resort against a stuck loop: SIGALRM ends the process.
inline void arm_alarm(std::chrono::milliseconds bound) {
  struct sigaction sa {};
  sa.sa_handler = [](int) {
    static const char msg[] =
        "FAIL stress: hang: the run did not end (SIGALRM): its loop stopped turning, or the scheduler never drained\n";
    [[maybe_unused]] ssize_t n = ::write(1, msg, sizeof msg - 1);
    ::_exit(124);
  };
  ::sigaction(SIGALRM, &sa, nullptr);
  ::alarm(static_cast<unsigned>(bound.count() / 1000 + 5));
}

/// A short plan of the run for `--log`.
inline void log_plan(const plan& p, journal& j) {
  if (!j.logging()) return;
  for (int i = 0; i < 2; ++i) {
    const side_plan& s = p.side[i];
    j.log("side %d: threshold %zu chunk %zu depth %zu reply_slots %zu store %zu B/%zu msgs max %llu; %zu rma; event %d"
          " (progress %u / %lld us, close timeout %lld us); revoke %d",
          i, s.opts.rendezvous_threshold, s.opts.staging.chunk, s.opts.staging.depth, s.opts.reply_slots,
          s.opts.unexpected_bytes, s.opts.unexpected_messages, static_cast<unsigned long long>(s.opts.max_message),
          s.rma.size(), static_cast<int>(s.event.what), s.event.when.by_progress ? s.event.when.progress : 0,
          static_cast<long long>(s.event.when.delay.count()), static_cast<long long>(s.event.close_timeout.count()),
          s.revoke);
  }
  for (const stream_plan& st : p.streams)
    j.log("stream %u->%u tag %u: %zu sends (window %u), %zu receives (window %u), largest %zu B", st.from,
          1 - st.from, st.tag, st.sends.size(), st.send_window, st.recvs.size(), st.recv_window, st.max_size);
}

/// The checks after the scheduler drained and before it goes.
inline void check_quiet(const guarded_copy_engine& ce, journal& j) {
  if (ce.in_flight() != 0) j.fail("copy-leak", strf("%zu copies still queued after the scheduler drained", ce.in_flight()));
  const std::size_t pinned = pinned_table::get().live.size();
  if (pinned != 0)
    j.fail("engine-leak", strf("%zu pinned bounce pools still allocated after both endpoints were dropped and the "
                               "scheduler drained (an engine was not freed)", pinned));
}

/// The records of side `s`'s rma operations, by plan index (null: never made).
inline std::vector<const op_record*> rma_records(const run_record& rr, const plan& p, int s) {
  std::vector<const op_record*> v(p.side[s].rma.size(), nullptr);
  for (const op_record& o : rr.ops)
    if (o.side == s && (o.kind == op_kind::put || o.kind == op_kind::get) && o.index < v.size()) v[o.index] = &o;
  return v;
}

/// Runs plan `p` of `c` over `Fixture` in this process (see the file comment).
template <class Fixture>
std::vector<failure> run_in_process(const run_config& c, const plan& p) {
  journal j(c.log);
  log_plan(p, j);
  arm_alarm(c.bound);
  // What a transport opens once per process and keeps (rdma_cm's device
  // contexts), opened before the count.
  if constexpr (requires { Fixture::prepare(); }) Fixture::prepare();
  const int fds_before = open_fds();
  const long objects_before = live_allocations();
  {
    arena mem;
    fault_reporter faults(mem);
    run_record rr;
    gdr::memory_registry reg;
    {
      gdr::scheduler sched({.mode = c.mode});
      guarded_copy_engine ce(sched, mem, j, hash_of({c.seed, 0x6365}), p.copy_delay);
      ce.ipc = p.transport == transport_kind::shm_ipc;
      ce.ipc_fds = ce.ipc && (hash_of({c.seed, 0x6664}) & 1) != 0;
      if (ce.ipc_fds) j.log("exports travel with a descriptor (shareable allocations)");
      session<typename Fixture::endpoint> ss(p, j, rr, mem, reg, 3, c.limits());
      ss.on_hang = [&] {
        print_failures(c, j.failures());
        ::_exit(3);
      };
      gdr::sync_wait(sched, [&]() -> gdr::task<> {
        auto pr = co_await Fixture::pair(sched, reg, p);
        ss.side(0).ep = std::move(pr.first);
        ss.side(1).ep = std::move(pr.second);
        if (!co_await ss.setup()) ss.skip_traffic();
        co_await ss.traffic();
      }());
      sched.drain();
      check_quiet(ce, j);
      verify_run(p, rr, ss, mem, j, false);
      for (int owner = 0; owner < 2; ++owner) verify_windows(p, ss, owner, rma_records(rr, p, 1 - owner), j);
    }
  }
  ::alarm(0);
  if (open_fds() != fds_before)
    j.fail("fd-leak", strf("%d file descriptors open before the run, %d after", fds_before, open_fds()));
  // (Only meaningful when nothing failed: the failures themselves are heap objects.)
  if (j.ok() && live_allocations() != objects_before)
    j.fail("heap-leak", strf("%ld heap objects alive after the run that were not before (engines, early messages, "
                             "frames...)", live_allocations() - objects_before));
  return j.failures();
}

template <class Fixture>
std::vector<failure> run_in_process(const run_config& c) {
  return run_in_process<Fixture>(c, make_plan(c.seed, c.transport, c.scale));
}

/// A plan with nothing that fails or stops: a few messages each way, host
/// and Device memory, a put and a get, an orderly close.
inline plan quiet_plan(transport_kind t) {
  plan p = make_plan(7, t, 0.3);
  for (side_plan& s : p.side) {
    s.opts = gdr::protocol_options{};
    s.opts.rendezvous_threshold = 4096;
    s.opts.staging.chunk = 8192;
    s.event = end_event{};
    s.revoke = false;
    for (rma_plan& r : s.rma) {
      r.stop = stop_plan{};
      r.bad_key = false;
    }
  }
  for (stream_plan& st : p.streams) {
    for (send_plan& s : st.sends) s.stop = stop_plan{};
    for (recv_plan& r : st.recvs) r.stop = stop_plan{};
  }
  return p;
}

/// Makes the process-wide objects that gdr and the C++ library make once
/// (so that they do not count as the first run's leaks), with quiet runs
/// over each transport in both run modes. Their failures are ignored here:
/// the real runs report them.
inline void warm_up() {
  run_config c;
  for (auto m : {gdr::run_mode::sleep, gdr::run_mode::busy_poll}) {
    c.mode = m;
    c.transport = transport_kind::loopback;
    (void)run_in_process<loopback_fixture>(c, quiet_plan(c.transport));
    c.transport = transport_kind::tcp;
    (void)run_in_process<tcp_fixture>(c, quiet_plan(c.transport));
    c.transport = transport_kind::shm;
    (void)run_in_process<shm_fixture>(c, quiet_plan(c.transport));
  }
}

}  // namespace stress
