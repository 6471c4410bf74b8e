// gdr_perf: latency and bandwidth of gdr's TCP endpoint over message sizes,
// side by side in the same run with a raw-socket ping-pong and stream, iperf3
// and ucx_perftest (UCX's tcp transport), with ratios, a table, a CSV and a
// gnuplot plot. Needs: loopback; iperf3, ucx_perftest and gnuplot if present.
//
//   gdr_perf [--quick] [--sizes 8,4096,...] [--mode busy|sleep] [--csv F] [--plot F.png]
//            [--cpus S,C] [--no-external] [--bw-reps N]
//
// Bandwidth: gdr and the raw stream run --bw-reps times each (default 3),
// alternating, and the medians are compared: a single stream run of large
// messages is a few dozen messages and swings by 2x on a shared machine.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/perf/external.hpp"
#include "benchmarks/perf/gdr_side.hpp"
#include "benchmarks/perf/harness.hpp"
#include "benchmarks/perf/raw_socket.hpp"

namespace {

struct options {
  std::vector<std::size_t> sizes;
  bool quick = false;
  bool external = true;
  int bw_reps = 3;
  gdr::run_mode mode = gdr::run_mode::busy_poll;
  std::string csv = "gdr_perf.csv";
  std::string plot = "gdr_perf.png";
  perf::config cfg;
};

std::vector<std::size_t> parse_sizes(const char* s) {
  std::vector<std::size_t> v;
  while (*s != 0) {
    char* end = nullptr;
    v.push_back(std::strtoull(s, &end, 10));
    s = (*end == ',') ? end + 1 : end;
  }
  return v;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gdr_perf: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") o.quick = true;
    else if (a == "--no-external") o.external = false;
    else if (a == "--sizes") o.sizes = parse_sizes(next());
    else if (a == "--mode") o.mode = std::string(next()) == "sleep" ? gdr::run_mode::sleep : gdr::run_mode::busy_poll;
    else if (a == "--csv") o.csv = next();
    else if (a == "--plot") o.plot = next();
    else if (a == "--cpus") std::sscanf(next(), "%d,%d", &o.cfg.server_cpu, &o.cfg.client_cpu);
    else if (a == "--bw-reps") o.bw_reps = std::max(1, std::atoi(next()));
    else {
      std::fprintf(stderr, "usage: gdr_perf [--quick] [--sizes 8,4096] [--mode busy|sleep] [--csv F] [--plot F]"
                           " [--cpus S,C] [--no-external] [--bw-reps N]\n");
      std::exit(a == "--help" ? 0 : 2);
    }
  }
  if (o.sizes.empty()) {
    if (o.quick) o.sizes = {8, 4096, 65536, 1 << 20};
    else o.sizes = {8, 64, 512, 4096, 32768, 262144, 1 << 21, 1 << 24, 1 << 26};
  }
  return o;
}

// Enough round trips for a stable median, fewer for large messages.
std::size_t lat_iters(std::size_t size, bool quick) {
  std::size_t n = (64u << 20) / (size + 1);
  n = std::clamp<std::size_t>(n, 20, quick ? 2000 : 20000);
  return n;
}
// About 512 MiB per stream run (64 MiB quick), at least 20 and at most 200k messages.
std::size_t bw_count(std::size_t size, bool quick) {
  std::size_t total = quick ? (64u << 20) : (512u << 20);
  return std::clamp<std::size_t>(total / size, 20, quick ? 50000 : 200000);
}

double ratio(double a, double b) { return (std::isnan(a) || std::isnan(b) || b == 0) ? NAN : a / b; }

void cell(std::string& line, double v, const char* fmt = "%10.2f") {
  char buf[32];
  if (std::isnan(v)) std::snprintf(buf, sizeof buf, "%10s", "n/a");
  else std::snprintf(buf, sizeof buf, fmt, v);
  line += buf;
}

double med(const perf::sample& s) { return s.empty() ? NAN : s.median(); }

}  // namespace

int main(int argc, char** argv) {
  options o = parse(argc, argv);
  std::FILE* csv = std::fopen(o.csv.c_str(), "w");
  if (csv == nullptr) perf::die("csv");
  std::fprintf(csv, "size,gdr_rtt_us,raw_rtt_us,ucx_rtt_us,gdr_gbps,raw_gbps,iperf3_gbps,ucx_gbps\n");
  std::printf("gdr_perf: TCP over loopback, server on CPU %d, client on CPU %d, gdr loop %s\n",
              o.cfg.server_cpu, o.cfg.client_cpu, o.mode == gdr::run_mode::busy_poll ? "busy-poll" : "sleep");
  std::printf("round trip (us, median) and bandwidth (GB/s, one stream); ratio = gdr / peer\n"
              "raw = blocking POSIX sockets, TCP_NODELAY, one send/recv per message; %s\n",
              o.mode == gdr::run_mode::busy_poll ? "busy-poll: the raw sockets spin on MSG_DONTWAIT too"
                                                  : "sleep: the raw sockets block in recv");
  std::string head = "      size   gdr_rtt   raw_rtt  gdr/raw   ucx_rtt  gdr/ucx    gdr_bw    raw_bw  gdr/raw"
                     "  iperf3_bw    ucx_bw  gdr/ucx";
  std::printf("%s\n", head.c_str());
  std::fflush(stdout);
  for (std::size_t size : o.sizes) {
    std::size_t li = lat_iters(size, o.quick), bc = bw_count(size, o.quick);
    auto progress = [&](const char* what) { std::fprintf(stderr, "gdr_perf: size %zu: %s...\n", size, what); };
    progress("gdr latency");
    double g_lat = med(perf::gdr_side::run_pingpong(o.cfg, o.mode, size, li));
    progress("raw latency");
    double r_lat = med(perf::raw::run_pingpong(o.cfg, size, li, o.mode == gdr::run_mode::busy_poll));
    double u_lat = NAN, u_bw = NAN, i_bw = NAN;
    if (o.external) {
      progress("ucx_perftest latency");
      u_lat = med(perf::external::ucx(o.cfg, true, size, li));
    }
    perf::sample g_bws, r_bws;
    for (int rep = 0; rep < o.bw_reps; ++rep) {
      progress("gdr bandwidth");
      for (double v : perf::gdr_side::run_stream(o.cfg, o.mode, size, bc).v) g_bws.add(v);
      progress("raw bandwidth");
      for (double v : perf::raw::run_stream(o.cfg, size, bc, o.mode == gdr::run_mode::busy_poll).v) r_bws.add(v);
    }
    double g_bw = med(g_bws), r_bw = med(r_bws);
    if (o.external) {
      progress("iperf3 bandwidth");
      i_bw = med(perf::external::iperf3(o.cfg, size, o.quick ? 1 : 2));
      progress("ucx_perftest bandwidth");
      u_bw = med(perf::external::ucx(o.cfg, false, size, std::min<std::size_t>(bc, 100000)));
    }
    std::string line;
    char sz[16];
    std::snprintf(sz, sizeof sz, "%10zu", size);
    line += sz;
    cell(line, g_lat); cell(line, r_lat); cell(line, ratio(g_lat, r_lat), "%9.2fx");
    cell(line, u_lat); cell(line, ratio(g_lat, u_lat), "%9.2fx");
    cell(line, g_bw, "%10.3f"); cell(line, r_bw, "%10.3f"); cell(line, ratio(g_bw, r_bw), "%9.2fx");
    cell(line, i_bw, "%11.3f"); cell(line, u_bw, "%10.3f"); cell(line, ratio(g_bw, u_bw), "%9.2fx");
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    std::fprintf(csv, "%zu,%g,%g,%g,%g,%g,%g,%g\n", size, g_lat, r_lat, u_lat, g_bw, r_bw, i_bw, u_bw);
    std::fflush(csv);
  }
  std::fclose(csv);
  if (perf::external::have("gnuplot") && !o.plot.empty()) {
    std::string cmd = "gnuplot -e \"set terminal pngcairo size 1200,480 noenhanced; set output '" + o.plot +
                      "'; set datafile separator ','; set key autotitle columnhead; set logscale x 2;"
                      " set multiplot layout 1,2; set title 'round trip (us), lower is better'; set logscale y;"
                      " set xlabel 'message bytes'; plot '" + o.csv + "' using 1:2 with linespoints, '' using 1:3 with"
                      " linespoints, '' using 1:4 with linespoints; unset logscale y;"
                      " set title 'bandwidth (GB/s), higher is better'; plot '" + o.csv + "' using 1:5 with"
                      " linespoints, '' using 1:6 with linespoints, '' using 1:7 with linespoints, '' using 1:8"
                      " with linespoints; unset multiplot\" 2>&1";
    if (std::system(cmd.c_str()) == 0) std::printf("gdr_perf: plot written to %s, data to %s\n", o.plot.c_str(), o.csv.c_str());
    else std::printf("gdr_perf: gnuplot failed; data in %s\n", o.csv.c_str());
  }
  return 0;
}
