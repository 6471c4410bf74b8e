// The stress runner (usage also in tests/stress/BUILD.bazel):
//
//   stress --seed S [--transport T] [--mode M] [--log]
//       replays one seed in this process (under gdb, ASan, with --log to
//       see every operation); T and M default to all, one after the other.
//   stress --seeds A:B [--transport T] [--mode M] [--jobs J] [-v]
//       runs seeds A..B-1, each (transport, mode, seed) in a forked child
//       with a time limit; one line per failing run, then a summary.
//   stress --time SECONDS [--seeds A:] ...
//       consecutive seeds from A (default 1) until the time is up.
//
// T: loopback | tcp | tcp-tight | tcp-kill | shm | shm-kill | shm-ipc | all
// (those seven; verbs in a build with STRESS_VERBS=1). tcp-tight is tcp with
// socket buffers of a few KiB (short writes). M: busy | sleep | all. Exit
// status 0 when every run passed.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tests/stress/runner.hpp"

namespace {

using namespace stress;

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "stress: %s\nusage: stress (--seed S | --seeds A:B | --time SECONDS [--seeds A:]) "
               "[--transport loopback|tcp|tcp-tight|tcp-kill|shm|shm-kill|shm-ipc|all] [--mode busy|sleep|all] [--jobs J] [--log] [-v]\n",
               why);
  std::exit(2);
}

std::vector<transport_kind> transports_of(const std::string& s) {
  if (s == "loopback") return {transport_kind::loopback};
  if (s == "tcp") return {transport_kind::tcp};
  if (s == "tcp-tight") return {transport_kind::tcp_tight};
  if (s == "tcp-kill") return {transport_kind::tcp_kill};
  if (s == "verbs") return {transport_kind::verbs};
  if (s == "shm") return {transport_kind::shm};
  if (s == "shm-kill") return {transport_kind::shm_kill};
  if (s == "shm-ipc") return {transport_kind::shm_ipc};
  if (s == "all") {
    std::vector<transport_kind> v{transport_kind::loopback, transport_kind::tcp,      transport_kind::tcp_tight,
                                  transport_kind::tcp_kill, transport_kind::shm,      transport_kind::shm_kill,
                                  transport_kind::shm_ipc};
    if (STRESS_VERBS) v.push_back(transport_kind::verbs);
    return v;
  }
  usage("unknown transport");
}

std::vector<gdr::run_mode> modes_of(const std::string& s) {
  if (s == "busy") return {gdr::run_mode::busy_poll};
  if (s == "sleep") return {gdr::run_mode::sleep};
  if (s == "all") return {gdr::run_mode::busy_poll, gdr::run_mode::sleep};
  usage("unknown mode");
}

}  // namespace

int main(int argc, char** argv) {
  std::string transport = "all", mode = "all";
  bool one = false, log = false, verbose = false, warm = true;
  std::uint64_t seed = 1, first = 1, last = 0;
  double seconds = 0;
  unsigned jobs = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--seed") {
      one = true;
      seed = std::strtoull(value().c_str(), nullptr, 10);
    } else if (a == "--seeds") {
      const std::string r = value();
      const auto colon = r.find(':');
      if (colon == std::string::npos) usage("--seeds takes A:B");
      first = std::strtoull(r.substr(0, colon).c_str(), nullptr, 10);
      last = colon + 1 < r.size() ? std::strtoull(r.substr(colon + 1).c_str(), nullptr, 10) : 0;
    } else if (a == "--time") {
      seconds = std::atof(value().c_str());
    } else if (a == "--transport") {
      transport = value();
    } else if (a == "--mode") {
      mode = value();
    } else if (a == "--jobs") {
      jobs = static_cast<unsigned>(std::atoi(value().c_str()));
    } else if (a == "--log") {
      log = true;
    } else if (a == "-v") {
      verbose = true;
    } else if (a == "--no-warm-up") {
      warm = false;  // (the heap-leak check may then count gdr's first-use objects)
    } else {
      usage(("unknown argument " + a).c_str());
    }
  }
  const auto ts = transports_of(transport);
  const auto ms = modes_of(mode);
  run_config base = default_config();
  base.log = log;

  if (warm) warm_up();
  if (one) {
    bool ok = true;
    for (auto t : ts)
      for (auto m : ms) {
        run_config c = base;
        c.transport = t;
        c.mode = m;
        c.seed = seed;
        const bool pass = run_and_print(c);
        std::printf("%s %s\n", pass ? "PASS" : "FAILED", describe(c).c_str());
        ok = ok && pass;
      }
    return ok ? 0 : 1;
  }
  if (last == 0 && seconds <= 0) usage("give --seed, --seeds A:B or --time");
  if (last != 0 && last <= first) usage("--seeds A:B needs A < B");

  // Seeds in order, each over every transport and mode; with --time, until
  // the time is up.
  const auto stop_at = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::uint64_t s = first;
  std::size_t k = 0;
  auto next = [&]() -> std::optional<run_config> {
    if (k == ts.size() * ms.size()) {
      k = 0;
      ++s;
    }
    if (last != 0 && s >= last) return std::nullopt;
    if (seconds > 0 && std::chrono::steady_clock::now() >= stop_at) return std::nullopt;
    run_config c = base;
    c.transport = ts[k / ms.size()];
    c.mode = ms[k % ms.size()];
    c.seed = s;
    ++k;
    return c;
  };
  std::map<std::string, std::pair<unsigned, unsigned>> tally;  // "transport mode" -> (runs, failed)
  std::map<std::string, unsigned> kinds;
  std::map<std::uint64_t, bool> seed_ok;
  unsigned total = 0, failed = 0;
  double pass_seconds = 0;
  const auto limit = base.bound + std::chrono::milliseconds(15000);
  run_forked(
      next, jobs, limit,
      [&](const run_outcome& r) {
        ++total;
        auto [it, fresh] = seed_ok.emplace(r.config.seed, true);
        it->second = it->second && r.ok;
        if (r.ok) pass_seconds += r.seconds;
        auto& t = tally[std::string(to_string(r.config.transport)) + " " + to_string(r.config.mode)];
        ++t.first;
        if (!r.ok) {
          ++failed;
          ++t.second;
          ++kinds[r.first.substr(0, r.first.find(':'))];
          std::printf("FAIL %s: %s\n  replay: stress --transport %s --mode %s --seed %llu\n", describe(r.config).c_str(),
                      r.first.c_str(), to_string(r.config.transport), to_string(r.config.mode),
                      static_cast<unsigned long long>(r.config.seed));
          if (verbose) std::printf("%s\n", r.output.c_str());
          std::fflush(stdout);
        }
      });
  for (auto& [k, v] : tally)
    std::printf("stress: %s: %u runs, %u failed (%.0f%% passed)\n", k.c_str(), v.first, v.second,
                v.first ? 100.0 * (v.first - v.second) / v.first : 0.0);
  for (auto& [k, n] : kinds) std::printf("stress: failure kind %s: %u runs\n", k.c_str(), n);
  unsigned seeds_failed = 0;
  for (auto& [sd, ok] : seed_ok) seeds_failed += ok ? 0 : 1;
  if (total > failed)
    std::printf("stress: a passing run took %.2f s on average\n", pass_seconds / (total - failed));
  std::printf("stress: %zu seeds, %u failed (%u runs of a transport and mode, %u failed)\n", seed_ok.size(),
              seeds_failed, total, failed);
  return failed == 0 ? 0 : 1;
}
