// Two network namespaces joined by a veth pair, created by the test itself
// and torn down when it ends (also when it fails): a two-host network on one
// machine. Addresses are 10.77.0.1/24 and 10.77.0.2/24, which exist only
// inside these namespaces.
//
// Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and the `ip` tool (iproute2);
// `create` returns nullptr with the reason when it cannot, for GDR_SKIP.
// Names carry the test's pid (gdrtest-<pid>-a/b), so concurrent runs do not
// collide; namespaces left by a run that was killed (its pid gone) are
// removed by the next one.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "tests/bootstrap/multiprocess.hpp"

namespace gdr_test {

class netns_pair {
 public:
  static constexpr const char* addr_a = "10.77.0.1";
  static constexpr const char* addr_b = "10.77.0.2";

  /// The pair, or nullptr and `why` when this machine does not allow it.
  static std::unique_ptr<netns_pair> create(std::string& why) {
    if (::geteuid() != 0) {
      why = "creating network namespaces needs root";
      return nullptr;
    }
    remove_stale();
    std::string pid = std::to_string(::getpid());
    std::unique_ptr<netns_pair> p(new netns_pair("gdrtest-" + pid + "-a", "gdrtest-" + pid + "-b"));
    // Both veth ends are created directly inside the namespaces: nothing is
    // added to the namespace the test runs in.
    const std::string va = "gdt" + pid + "a", vb = "gdt" + pid + "b";
    const std::vector<std::vector<std::string>> steps = {
        {"ip", "netns", "add", p->a_},
        {"ip", "netns", "add", p->b_},
        {"ip", "link", "add", va, "netns", p->a_, "type", "veth", "peer", "name", vb, "netns", p->b_},
        {"ip", "-n", p->a_, "addr", "add", std::string(addr_a) + "/24", "dev", va},
        {"ip", "-n", p->b_, "addr", "add", std::string(addr_b) + "/24", "dev", vb},
        {"ip", "-n", p->a_, "link", "set", "lo", "up"},
        {"ip", "-n", p->b_, "link", "set", "lo", "up"},
        {"ip", "-n", p->a_, "link", "set", va, "up"},
        {"ip", "-n", p->b_, "link", "set", vb, "up"},
    };
    for (const auto& argv : steps) {
      command_result r = run_command(argv, std::chrono::seconds(10));
      if (r.exit_code != 0) {
        why = "`";
        for (const auto& a : argv) why += a + " ";
        why.back() = '`';
        why += " failed (" + std::to_string(r.exit_code) + "): " + r.output;
        while (!why.empty() && why.back() == '\n') why.pop_back();
        return nullptr;  // the destructor removes what was made
      }
    }
    return p;
  }

  netns_pair(const netns_pair&) = delete;
  netns_pair& operator=(const netns_pair&) = delete;
  ~netns_pair() {
    // Deleting a namespace deletes the veth end inside it, and with it the pair.
    run_command({"ip", "netns", "del", a_}, std::chrono::seconds(10));
    run_command({"ip", "netns", "del", b_}, std::chrono::seconds(10));
  }

  const std::string& name_a() const { return a_; }
  const std::string& name_b() const { return b_; }

  /// Moves the calling process (a forked rank) into namespace `name`.
  static bool enter(const std::string& name) {
    int fd = ::open(("/var/run/netns/" + name).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    bool ok = ::setns(fd, CLONE_NEWNET) == 0;
    ::close(fd);
    return ok;
  }

 private:
  netns_pair(std::string a, std::string b) : a_(std::move(a)), b_(std::move(b)) {}

  // Namespaces "gdrtest-<pid>-x" whose pid no longer runs: left by a run that
  // was killed before its destructor ran.
  static void remove_stale() {
    DIR* d = ::opendir("/var/run/netns");
    if (d == nullptr) return;
    std::vector<std::string> stale;
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n.rfind("gdrtest-", 0) != 0) continue;
      long pid = std::strtol(n.c_str() + 8, nullptr, 10);
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) stale.push_back(n);
    }
    ::closedir(d);
    for (const auto& n : stale) run_command({"ip", "netns", "del", n}, std::chrono::seconds(10));
  }

  std::string a_, b_;
};

}  // namespace gdr_test
