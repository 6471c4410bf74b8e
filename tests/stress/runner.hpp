// Runs stress runs in forked children, so that a crash (a SIGSEGV from the
// engine touching Device memory, an assertion, a sanitizer report) or a hang
// is reported with its seed instead of ending everything. Each child runs
// one (transport, mode, seed), prints `FAIL ...` lines for what failed and
// exits 0 only if nothing did; the parent collects its output, ends it
// after a time limit, and turns a signal or a silent non-zero exit into a
// failure line of its own. Up to `jobs` children run at once.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tests/stress/fixture.hpp"
#include "tests/stress/kill.hpp"
#include "tests/stress/run.hpp"

namespace stress {

/// Runs `c` in this process over its transport; prints its failures.
/// True if nothing failed.
inline bool run_and_print(const run_config& c) {
  std::vector<failure> fs;
  switch (c.transport) {
    case transport_kind::loopback: fs = run_in_process<loopback_fixture>(c); break;
    case transport_kind::tcp: fs = run_in_process<tcp_fixture>(c); break;
    case transport_kind::tcp_tight: fs = run_in_process<tcp_tight_fixture>(c); break;
    case transport_kind::tcp_kill: fs = run_kill<tcp_net>(c); break;
    case transport_kind::shm: fs = run_in_process<shm_fixture>(c); break;
    case transport_kind::shm_kill: fs = run_kill<shm_net>(c); break;
    case transport_kind::shm_ipc: fs = run_in_process<shm_ipc_fixture>(c); break;
    case transport_kind::verbs:
#if STRESS_VERBS
      if (std::string why = verbs_fixture::skip_reason(); !why.empty()) {
        std::printf("SKIP %s: %s\n", describe(c).c_str(), why.c_str());
        return true;
      }
      fs = run_in_process<verbs_fixture>(c);
#else
      fs.push_back({"setup", "this build has no verbs transport (STRESS_VERBS=0)"});
#endif
      break;
  }
  print_failures(c, fs);
  return fs.empty();
}

struct run_outcome {
  run_config config;
  bool ok = false;
  std::string first;   ///< the first failure line, without "FAIL <run>: "
  std::string output;  ///< everything the child printed
  double seconds = 0;  ///< how long the child ran
};

namespace detail {

struct child {
  run_config config;
  pid_t pid = -1;
  int fd = -1;
  std::string output;
  std::chrono::steady_clock::time_point start, deadline;
  bool timed_out = false;
};

inline child start_child(const run_config& c, std::chrono::milliseconds limit) {
  child ch;
  ch.config = c;
  int p[2];
  if (::pipe(p) != 0) return ch;
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[0]);
    ::dup2(p[1], 1);
    ::dup2(p[1], 2);
    ::close(p[1]);
    const bool ok = run_and_print(c);
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(ok ? 0 : 1);
  }
  ::close(p[1]);
  ch.pid = pid;
  ch.fd = p[0];
  ch.start = std::chrono::steady_clock::now();
  ch.deadline = ch.start + limit;
  return ch;
}

inline run_outcome finish_child(child& ch) {
  if (ch.timed_out) ::kill(ch.pid, SIGKILL);
  int status = 0;
  ::waitpid(ch.pid, &status, 0);
  if (ch.fd >= 0) ::close(ch.fd);
  run_outcome r;
  r.config = ch.config;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - ch.start).count();
  r.output = std::move(ch.output);
  const std::string prefix = "FAIL " + describe(ch.config) + ": ";
  if (auto at = r.output.find("FAIL "); at != std::string::npos) {
    auto end = r.output.find('\n', at);
    r.first = r.output.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (r.first.rfind(prefix, 0) == 0) r.first = r.first.substr(prefix.size());
    else if (r.first.rfind("FAIL stress: ", 0) == 0) r.first = r.first.substr(13);
  }
  r.ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && !ch.timed_out;
  if (ch.timed_out) {
    r.first = "hang: the child ran past its time limit and was killed" + (r.first.empty() ? "" : " (" + r.first + ")");
  } else if (WIFSIGNALED(status)) {
    // (The fault reporter of memory.hpp may have said what the crash was.)
    const std::string sig = strf("signal %d (%s)", WTERMSIG(status), ::strsignal(WTERMSIG(status)));
    r.first = r.first.empty() ? "crash: " + sig : r.first + " [" + sig + "]";
  } else if (!r.ok && r.first.empty()) {
    // A sanitizer's report, or an assertion: the first line that says so.
    std::string why = strf("exit status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    for (const char* key : {"ERROR: AddressSanitizer", "runtime error", "WARNING: ThreadSanitizer", "Assertion",
                            "terminate called"}) {
      if (auto at = r.output.find(key); at != std::string::npos) {
        auto end = r.output.find('\n', at);
        why = "sanitizer/abort: " + r.output.substr(at, std::min<std::size_t>(end - at, 200));
        break;
      }
    }
    r.first = why;
  }
  return r;
}

}  // namespace detail

/// Runs the configs `next()` gives (until it gives none), each in a forked
/// child with time limit `limit`, `jobs` at once; calls `done(outcome)` as
/// each ends (in the order they end).
inline void run_forked(const std::function<std::optional<run_config>()>& next, unsigned jobs,
                       std::chrono::milliseconds limit, const std::function<void(const run_outcome&)>& done) {
  std::deque<detail::child> live;
  bool more = true;
  if (jobs == 0) jobs = 1;
  while (more || !live.empty()) {
    while (live.size() < jobs && more) {
      std::optional<run_config> c = next();
      if (!c) {
        more = false;
        break;
      }
      detail::child ch = detail::start_child(*c, limit);
      if (ch.pid < 0) {
        done({ch.config, false, "setup: could not fork", {}, 0});
        continue;
      }
      live.push_back(std::move(ch));
    }
    if (live.empty()) break;
    std::vector<pollfd> fds;
    for (auto& ch : live) fds.push_back({ch.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 50);
    const auto now = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < live.size();) {
      detail::child& ch = live[i];
      bool eof = false;
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buf[4096];
        const ssize_t n = ::read(ch.fd, buf, sizeof buf);
        if (n > 0) {
          if (ch.output.size() < (1u << 20)) ch.output.append(buf, static_cast<std::size_t>(n));
        } else {
          eof = true;
        }
      }
      if (!eof && now > ch.deadline) {
        ch.timed_out = true;
        eof = true;
      }
      if (eof) {
        done(detail::finish_child(ch));
        live.erase(live.begin() + static_cast<long>(i));
        fds.erase(fds.begin() + static_cast<long>(i));
      } else {
        ++i;
      }
    }
  }
}

/// The same over a list, stopping early once `keep_going()` says no.
inline void run_forked(const std::vector<run_config>& runs, unsigned jobs, std::chrono::milliseconds limit,
                       const std::function<void(const run_outcome&)>& done,
                       const std::function<bool()>& keep_going = [] { return true; }) {
  std::size_t i = 0;
  run_forked(
      [&]() -> std::optional<run_config> {
        if (i >= runs.size() || !keep_going()) return std::nullopt;
        return runs[i++];
      },
      jobs, limit, done);
}

}  // namespace stress
