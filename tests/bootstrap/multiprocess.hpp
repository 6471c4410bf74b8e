// Helpers for the bootstrap tests: run ranks in forked processes with a
// bound on the whole run, run commands with a bound, and pick a free port.
//
// Every child is started here and ended here, by its pid; every wait has a
// deadline, so a broken bootstrap fails a test instead of hanging it.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include <gdr/error.hpp>

extern char** environ;

namespace gdr_test {

/// Exit codes of a rank process.
enum rank_exit : int {
  rank_ok = 0,
  rank_failed = 1,            // a check failed (the child printed why)
  rank_bootstrap_failed = 3,  // threw gdr::error(errc::bootstrap_failed)
  rank_other_error = 4,       // threw something else
  rank_killed = 100,          // did not finish in time: killed by the parent
};

/// Waits for `pid` until `deadline`; on timeout kills it (SIGKILL) and reaps it.
inline int wait_or_kill(pid_t pid, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    }
    if (r < 0) return rank_other_error;
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return rank_killed;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

/// Runs `fn(rank)` for each rank in `ranks` in its own forked process and
/// returns the exit codes, in the same order. `fn` returns an exit code; an
/// exception becomes rank_bootstrap_failed or rank_other_error (and is
/// printed). The whole run is bounded by `timeout`.
template <class F>
std::vector<int> run_ranks(const std::vector<int>& ranks, std::chrono::milliseconds timeout, F fn) {
  std::fflush(nullptr);  // no duplicated buffered output in the children
  std::vector<pid_t> pids;
  for (int rank : ranks) {
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = rank_other_error;
      try {
        code = fn(rank);
      } catch (const gdr::error& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        code = e.code() == gdr::errc::bootstrap_failed ? rank_bootstrap_failed : rank_other_error;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      }
      std::fflush(nullptr);
      ::_exit(code);  // no atexit handlers of the test runner in the child
    }
    pids.push_back(pid);
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int> codes;
  for (pid_t pid : pids) codes.push_back(pid < 0 ? rank_other_error : wait_or_kill(pid, deadline));
  return codes;
}

/// Ranks 0 .. n-1.
inline std::vector<int> first_ranks(int n) {
  std::vector<int> r;
  for (int i = 0; i < n; ++i) r.push_back(i);
  return r;
}

/// A socket listening on 127.0.0.1 on a free port (for rank 0 to take over,
/// so that no two tests race for a port).
inline int listen_loopback(std::uint16_t& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 64) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  port = ntohs(a.sin_port);
  return fd;
}

/// Result of a command run with `run_command`.
struct command_result {
  int exit_code = -1;  // rank_killed when it ran out of time
  std::string output;  // stdout and stderr together
};

/// Runs `argv` (searched in PATH) with extra environment `env` ("K=V",
/// replacing a variable of the same name),
/// capturing its output, for at most `timeout`. On timeout it gets SIGTERM,
/// then SIGKILL 5 s later (mpirun uses the grace period to end its ranks).
inline command_result run_command(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                                  const std::vector<std::string>& env = {}) {
  command_result res;
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return res;
  // The read end only: a grandchild that outlives the command may keep the
  // write end open, and the final drain must not wait for it.
  ::fcntl(pipefd[0], F_SETFL, O_NONBLOCK);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The environment, with `env`'s variables replacing those of the same name
  // (getenv returns the first match, so duplicates would be ignored).
  std::vector<std::string> env_store;
  auto name_of = [](const std::string& kv) { return kv.substr(0, kv.find('=') + 1); };
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    bool replaced = false;
    for (const auto& x : env) replaced |= name_of(x) == name_of(kv);
    if (!replaced) env_store.push_back(std::move(kv));
  }
  for (const auto& e : env) env_store.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(pipefd[1]);
  if (rc != 0) {
    ::close(pipefd[0]);
    res.output = "cannot start " + argv[0];
    return res;
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  bool termed = false;
  for (;;) {
    pollfd p{pipefd[0], POLLIN, 0};
    ::poll(&p, 1, 20);
    if (p.revents & (POLLIN | POLLHUP)) {
      char buf[4096];
      ssize_t n = ::read(pipefd[0], buf, sizeof buf);
      if (n > 0) res.output.append(buf, static_cast<std::size_t>(n));
    }
    int status = 0;
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      // Drain what is left.
      char buf[4096];
      ssize_t n;
      while ((n = ::read(pipefd[0], buf, sizeof buf)) > 0) res.output.append(buf, static_cast<std::size_t>(n));
      if (res.exit_code != rank_killed)
        res.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    auto now = std::chrono::steady_clock::now();
    if (!termed && now >= deadline) {
      ::kill(pid, SIGTERM);
      termed = true;
      res.exit_code = rank_killed;
      deadline = now + std::chrono::seconds(5);
    } else if (termed && now >= deadline) {
      ::kill(pid, SIGKILL);
      deadline = now + std::chrono::hours(1);  // reaped on the next round
    }
  }
  ::close(pipefd[0]);
  return res;
}

}  // namespace gdr_test
