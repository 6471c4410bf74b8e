// The external peers gdr_perf runs side by side: ucx_perftest over TCP
// (Debian's ucx-utils) and iperf3. Each is started as its own pair of
// processes, pinned like gdr's and the raw sockets', and its output parsed.
// A tool that is missing or fails gives an empty sample (printed as "n/a").
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "benchmarks/perf/harness.hpp"

namespace perf::external {

inline bool have(const char* tool) {
  std::string cmd = std::string("command -v ") + tool + " >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

inline std::string run_capture(const std::string& cmd) {
  std::string out;
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, f) != nullptr) out += buf;
  ::pclose(f);
  return out;
}

/// ucx_perftest tag_lat (round trip = 2 x its one-way "typical" latency) or
/// tag_bw (GB/s), over UCX's tcp transport only.
inline sample ucx(const config& cfg, bool latency, std::size_t size, std::size_t iters) {
  sample s;
  if (!have("ucx_perftest")) return s;
  std::uint16_t port = free_port();
  std::string env = "UCX_TLS=tcp,self UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n ";
  std::string server = env + "timeout " + std::to_string(cfg.deadline_s) + " taskset -c " +
                       std::to_string(cfg.server_cpu) + " ucx_perftest -p " + std::to_string(port) +
                       " >/dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return s;
  std::string client = env + "timeout " + std::to_string(cfg.deadline_s) + " taskset -c " +
                       std::to_string(cfg.client_cpu) + " ucx_perftest 127.0.0.1 -p " + std::to_string(port) +
                       " -t " + (latency ? "tag_lat" : "tag_bw") + " -s " + std::to_string(size) +
                       " -n " + std::to_string(iters) + " -w " + std::to_string(cfg.warmup) + " 2>&1";
  std::string out;
  for (int attempt = 0; attempt < 20; ++attempt) {  // the server needs a moment to listen
    out = run_capture(client);
    if (out.find("Final:") != std::string::npos) break;
    ::usleep(100000);
  }
  auto pos = out.find("Final:");
  if (pos == std::string::npos) return s;
  // Final: iterations  lat50  lat_avg  lat_overall  bw_avg  bw_overall  rate_avg  rate_overall
  double it, lat50, lat_avg, lat_all, bw_avg, bw_all;
  if (std::sscanf(out.c_str() + pos, "Final: %lf %lf %lf %lf %lf %lf", &it, &lat50, &lat_avg, &lat_all, &bw_avg,
                  &bw_all) != 6)
    return s;
  if (latency) {
    s.add(2.0 * lat50);  // ucx_perftest reports half a round trip
  } else {
    s.add(bw_all * 1e6 / 1e9);  // MB/s (10^6) -> GB/s
  }
  return s;
}

/// iperf3, one stream of `size`-byte writes for `seconds`, GB/s received.
inline sample iperf3(const config& cfg, std::size_t size, int seconds) {
  sample s;
  if (!have("iperf3")) return s;
  std::uint16_t port = free_port();
  std::string server = "timeout " + std::to_string(cfg.deadline_s) + " taskset -c " + std::to_string(cfg.server_cpu) +
                       " iperf3 -s -1 -p " + std::to_string(port) + " >/dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return s;
  std::string client = "timeout " + std::to_string(cfg.deadline_s) + " taskset -c " +
                       std::to_string(cfg.client_cpu) + " iperf3 -c 127.0.0.1 -p " + std::to_string(port) +
                       " -l " + std::to_string(size) + " -t " + std::to_string(seconds) + " -f g 2>&1";
  std::string out;
  for (int attempt = 0; attempt < 20; ++attempt) {
    out = run_capture(client);
    if (out.find("receiver") != std::string::npos) break;
    ::usleep(100000);
  }
  // "[  5]   0.00-2.00   sec  2.50 GBytes  10.7 Gbits/sec                  receiver"
  auto end = out.find("receiver");
  if (end == std::string::npos) return s;
  auto line = out.rfind('\n', end);
  std::string l = out.substr(line == std::string::npos ? 0 : line + 1, end - line);
  auto g = l.find("Gbits/sec");
  if (g == std::string::npos) return s;
  auto start = l.rfind(' ', g - 2);
  s.add(std::atof(l.c_str() + start + 1) / 8.0);  // Gbit/s -> GB/s
  return s;
}

}  // namespace perf::external
