// The external peers gdr_perf runs side by side: ucx_perftest over TCP
// (Debian's ucx-utils) and iperf3. Each is started as its own pair of
// processes, pinned like gdr's and the raw sockets', and its output parsed.
// A tool that is missing or fails gives an empty sample (printed as "n/a").
#pragma once

#include <cmath>
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

/// ucx_perftest's `test` (tag_lat, tag_bw, ucp_put_lat, ucp_put_bw, ucp_get)
/// over UCX's tcp transport only: a *_lat test gives a round trip (2 x its
/// one-way "typical" latency, what gdr's send-and-answer and its put or get,
/// which completes when the target answered, take), the others GB/s.
inline sample ucx(const config& cfg, const std::string& test, std::size_t size, std::size_t iters) {
  // A fetching atomic (ucp_fadd) waits for each answer: its latency is a
  // whole operation, where a *_lat ping-pong reports half a round trip.
  const bool fetching = test == "ucp_fadd" || test == "ucp_swap" || test == "ucp_cswap";
  const bool latency = fetching || (test.size() > 4 && test.compare(test.size() - 4, 4, "_lat") == 0);
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
                       " -t " + test + " -s " + std::to_string(size) +
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
    s.add(fetching ? lat50 : 2.0 * lat50);  // a *_lat test reports half a round trip
  } else {
    s.add(bw_all * 1e6 / 1e9);  // MB/s (10^6) -> GB/s
  }
  return s;
}

/// A perftest pair (`tool`: ib_send_lat, ib_write_bw, ...) on the RDMA
/// device whose address is `ip`: the server in the background, the client
/// retried until it connects. Latency tools give a round trip (ib_send_lat
/// and ib_write_lat report half of their ping-pong; ib_read_lat a read's
/// whole round trip), bandwidth tools GB/s. The device and GID index come
/// from GDR_VERBS_DEV / GDR_VERBS_GID (or the Soft-RoCE guest's RXEVM_DEV /
/// RXEVM_GID_INDEX); without them perftest picks its defaults.
inline sample perftest(const config& cfg, const std::string& tool, std::size_t size, std::size_t iters,
                       const std::string& ip) {
  sample s;
  if (!have(tool.c_str())) return s;
  const bool latency = tool.find("_lat") != std::string::npos;
  auto env = [](const char* a, const char* b) -> std::string {
    const char* v = std::getenv(a);
    if (v == nullptr) v = std::getenv(b);
    return v != nullptr ? v : "";
  };
  std::string dev = env("GDR_VERBS_DEV", "RXEVM_DEV"), gid = env("GDR_VERBS_GID", "RXEVM_GID_INDEX");
  std::uint16_t port = free_port();
  std::string args = (dev.empty() ? "" : " -d " + dev) + (gid.empty() ? "" : " -x " + gid) + " -s " +
                     std::to_string(size) + " -n " + std::to_string(iters) + " -p " + std::to_string(port);
  std::string t = "timeout " + std::to_string(cfg.deadline_s) + " taskset -c ";
  std::string server = t + std::to_string(cfg.server_cpu) + " " + tool + args + " >/dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return s;
  std::string client = t + std::to_string(cfg.client_cpu) + " " + tool + args + " " + ip + " 2>/dev/null";
  std::string out;
  for (int attempt = 0; attempt < 20; ++attempt) {
    ::usleep(300000);
    out = run_capture(client);
    if (out.find("#bytes") != std::string::npos) break;
  }
  // The result line starts with the size: latency "#bytes #iterations t_min[usec] t_max t_typical ...",
  // bandwidth "#bytes #iterations BW_peak[MB/sec] BW_average ...".
  std::size_t pos = 0;
  while ((pos = out.find('\n', pos)) != std::string::npos) {
    ++pos;
    unsigned long long b = 0, it = 0;
    double c1 = 0, c2 = 0, c3 = 0;
    if (std::sscanf(out.c_str() + pos, " %llu %llu %lf %lf %lf", &b, &it, &c1, &c2, &c3) == 5 && b == size &&
        std::isfinite(c2) && std::isfinite(c3)) {  // an emulated device's clock can give "inf
      if (latency) s.add(tool == "ib_read_lat" ? c3 : 2.0 * c3);  // t_typical
      else s.add(c2 * 1048576.0 / 1e9);                          // BW average, MB (2^20) per second
      break;
    }
  }
  return s;
}

/// The MPI ping-pong (benchmarks/perf/mpi_pingpong.cpp, binary `bin`) under
/// mpirun: rank 0 (the initiator) on the client's CPU, rank 1 on the
/// server's, with `mca` choosing Open MPI's transport. Fills `lat` (round
/// trip, us) and `bw` (GB/s); both stay empty if it did not run.
inline void mpi(const config& cfg, const std::string& bin, const std::string& mca, std::size_t size, std::size_t iters,
                std::size_t count, sample& lat, sample& bw) {
  if (!have("mpirun")) return;
  std::string args = " " + std::to_string(size) + " " + std::to_string(iters) + " " + std::to_string(count) + " " +
                     std::to_string(cfg.warmup);
  std::string cmd = "timeout " + std::to_string(cfg.deadline_s) + " mpirun --allow-run-as-root --oversubscribe " +
                    mca + " -np 1 taskset -c " + std::to_string(cfg.client_cpu) + " " + bin + args +
                    " : -np 1 taskset -c " + std::to_string(cfg.server_cpu) + " " + bin + args + " 2>/dev/null";
  std::string out = run_capture(cmd);
  auto pos = out.find("mpi_pingpong lat_us=");
  if (pos == std::string::npos) return;
  double l = 0, g = 0;
  if (std::sscanf(out.c_str() + pos, "mpi_pingpong lat_us=%lf gbps=%lf", &l, &g) != 2) return;
  lat.add(l);
  bw.add(g);
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
