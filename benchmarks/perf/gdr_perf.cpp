// gdr_perf: latency and bandwidth of gdr over message sizes, for a
// transport, an operation and the memory spaces of both sides, side by side
// in the same run with the programs that do the same job without gdr, with
// ratios, the path each size took, a table, a CSV and a gnuplot plot.
//
//   gdr_perf [--transport tcp|shm|loopback|verbs|ipc] [--op send|put|get|fetch_add]
//            [--space host|pinned|device[:N]] [--peer-space host|pinned|device[:N]]
//            [--sizes 8,4096,... | 8:1G[:xF]] [--mode busy|sleep] [--iters N]
//            [--vs raw,iperf3,ucx_perftest,perftest,mpi | none] [--csv F] [--plot F.png]
//            [--cpus S,C] [--bw-reps N] [--quick] [--verbs-ip IP] [--no-external]
//
// Defaults: TCP over loopback, send, host memory on both sides, busy-poll,
// and every peer that fits the run (see `peers_for`). `--sizes A:B` is A,
// 2A, 4A, ... up to B (`:x4` steps by 4); sizes take K, M and G suffixes.
// `--iters` sets the round trips per size (else fewer for larger sizes)
// and the messages of a bandwidth run. `--no-external` is `--vs raw`.
//
// Peers: raw (TCP send: blocking or spinning POSIX sockets, one send/recv per
// message), iperf3 (TCP send bandwidth), ucx_perftest (UCX's tcp transport:
// tag_lat/tag_bw for send, ucp_put_lat/ucp_put_bw for put, ucp_get for get).
// perftest (verbs: ib_send_*, ib_write_* for put, ib_read_* for get, on the
// same device), mpi (benchmarks/perf/mpi_pingpong.cpp under mpirun: Open
// MPI's tcp BTL for --transport tcp, its shared-memory BTL for shm and loopback;
// the binary beside gdr_perf, or GDR_PERF_MPI), cudamemcpy (Device to
// Device: cudaMemcpy device-to-device of the same size in one process:
// latency two synchronous copies, bandwidth a stream of them), memcpy (host
// memory: one CPU's memcpy of the same size in one process, the limit of a
// copy between processes; latency two copies, bandwidth a stream). A peer that does not fit
// the run, or is not installed, prints n/a with the reason.
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
#include "benchmarks/perf/gdr_ops.hpp"
#include "benchmarks/perf/harness.hpp"
#include "benchmarks/perf/raw_socket.hpp"

namespace {

struct options {
  std::vector<std::size_t> sizes;
  bool quick = false;
  std::vector<std::string> vs;  // empty: every peer that fits
  bool vs_given = false;
  int bw_reps = 3;
  std::size_t iters = 0;
  std::string csv = "gdr_perf.csv";
  std::string plot = "gdr_perf.png";
  perf::config cfg;
  perf::ops::spec sp;
};

[[noreturn]] void usage(int status) {
  std::fprintf(status == 0 ? stdout : stderr,
               "usage: gdr_perf [--transport tcp|shm|loopback|verbs|ipc] [--op send|put|get|fetch_add]\n"
               "                [--space host|pinned|device[:N]] [--peer-space host|pinned|device[:N]]\n"
               "                [--sizes 8,4096,... | 8:1G[:xF]] [--mode busy|sleep] [--iters N]\n"
               "                [--vs raw,iperf3,ucx_perftest,perftest,mpi | none] [--csv F] [--plot F.png]\n"
               "                [--cpus S,C] [--bw-reps N] [--quick] [--verbs-ip IP] [--no-external]\n");
  std::exit(status);
}

[[noreturn]] void bad(const std::string& why) {
  std::fprintf(stderr, "gdr_perf: %s\n", why.c_str());
  std::exit(2);
}

std::size_t parse_size(const std::string& s) {
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str()) bad("not a size: '" + s + "'");
  std::string suffix(end);
  if (suffix == "K" || suffix == "k") v <<= 10;
  else if (suffix == "M" || suffix == "m") v <<= 20;
  else if (suffix == "G" || suffix == "g") v <<= 30;
  else if (!suffix.empty()) bad("not a size: '" + s + "' (suffixes: K, M, G)");
  return static_cast<std::size_t>(v);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (;;) {
    std::size_t p = s.find(sep, start);
    out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) return out;
    start = p + 1;
  }
}

std::vector<std::size_t> parse_sizes(const std::string& s) {
  std::vector<std::size_t> v;
  if (s.find(':') != std::string::npos) {
    std::vector<std::string> p = split(s, ':');
    if (p.size() < 2 || p.size() > 3) bad("--sizes A:B or A:B:xF");
    std::size_t a = parse_size(p[0]), b = parse_size(p[1]), f = 2;
    if (p.size() == 3) {
      if (p[2].empty() || p[2][0] != 'x') bad("--sizes A:B:xF: the step is a factor such as x4");
      f = parse_size(p[2].substr(1));
    }
    if (f < 2) bad("--sizes: the step factor must be at least 2");
    for (std::size_t x = std::max<std::size_t>(a, 1); x <= b; x *= f) v.push_back(x);
    if (a == 0) v.insert(v.begin(), 0);
    return v;
  }
  for (const std::string& x : split(s, ',')) v.push_back(parse_size(x));
  return v;
}

perf::ops::space_arg parse_space(const std::string& s) {
  perf::ops::space_arg a;
  std::vector<std::string> p = split(s, ':');
  if (p[0] == "host") a.kind = perf::ops::space::host;
  else if (p[0] == "pinned") a.kind = perf::ops::space::pinned;
  else if (p[0] == "device") a.kind = perf::ops::space::device;
  else bad("--space " + s + ": host, pinned or device[:N]");
  if (p.size() > 1) a.gpu = std::atoi(p[1].c_str());
  return a;
}

options parse(int argc, char** argv) {
  options o;
  bool peer_given = false;
  if (const char* ip = std::getenv("GDR_VERBS_IP")) o.sp.verbs_ip = ip;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) bad(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") usage(0);
    else if (a == "--quick") o.quick = true;
    else if (a == "--no-external") { o.vs = {"raw"}; o.vs_given = true; }
    else if (a == "--vs") {
      std::string v = next();
      o.vs = v == "none" ? std::vector<std::string>{} : split(v, ',');
      o.vs_given = true;
    }
    else if (a == "--sizes") o.sizes = parse_sizes(next());
    else if (a == "--mode") {
      std::string m = next();
      if (m != "busy" && m != "sleep") bad("--mode busy or sleep");
      o.sp.mode = m == "sleep" ? gdr::run_mode::sleep : gdr::run_mode::busy_poll;
    }
    else if (a == "--transport") o.sp.transport = next();
    else if (a == "--op") {
      std::string x = next();
      if (x == "send") o.sp.operation = perf::ops::op::send;
      else if (x == "put") o.sp.operation = perf::ops::op::put;
      else if (x == "get") o.sp.operation = perf::ops::op::get;
      else if (x == "fetch_add") o.sp.operation = perf::ops::op::fetch_add;
      else bad("--op send, put, get or fetch_add");
    }
    else if (a == "--space") o.sp.local = parse_space(next());
    else if (a == "--peer-space") { o.sp.peer = parse_space(next()); peer_given = true; }
    else if (a == "--iters") o.iters = parse_size(next());
    else if (a == "--verbs-ip") o.sp.verbs_ip = next();
    else if (a == "--csv") o.csv = next();
    else if (a == "--plot") o.plot = next();
    else if (a == "--cpus") {
      if (std::sscanf(next().c_str(), "%d,%d", &o.cfg.server_cpu, &o.cfg.client_cpu) != 2) bad("--cpus S,C");
    }
    else if (a == "--bw-reps") o.bw_reps = std::max(1, std::atoi(next().c_str()));
    else usage(2);
  }
  if (!peer_given) o.sp.peer = o.sp.local;
  if (o.sizes.empty()) {
    if (o.quick) o.sizes = {8, 4096, 65536, 1 << 20};
    else o.sizes = {8, 64, 512, 4096, 32768, 262144, 1 << 21, 1 << 24, 1 << 26};
  }
  return o;
}

// Enough round trips for a stable median, fewer for large messages.
std::size_t lat_iters(const options& o, std::size_t size) {
  if (o.iters != 0) return o.iters;
  std::size_t n = (64u << 20) / (size + 1);
  return std::clamp<std::size_t>(n, 20, o.quick ? 2000 : 20000);
}
// About 512 MiB per stream run (64 MiB quick), at least 20 and at most 200k messages.
std::size_t bw_count(const options& o, std::size_t size) {
  if (o.iters != 0) return o.iters;
  std::size_t total = o.quick ? (64u << 20) : (512u << 20);
  return std::clamp<std::size_t>(total / std::max<std::size_t>(size, 1), 20, o.quick ? 50000 : 200000);
}

double ratio(double a, double b) { return (std::isnan(a) || std::isnan(b) || b == 0) ? NAN : a / b; }

void cell(std::string& line, double v, const char* fmt, int width) {
  char buf[48];
  if (std::isnan(v)) std::snprintf(buf, sizeof buf, "%*s", width, "n/a");
  else std::snprintf(buf, sizeof buf, fmt, v);
  line += buf;
}

double med(const perf::sample& s) { return s.empty() ? NAN : s.median(); }

/// The MPI peer's program: GDR_PERF_MPI, else mpi_pingpong beside this
/// binary (empty: none).
std::string& self_dir() {
  static std::string d;
  return d;
}
std::string mpi_binary() {
  if (const char* e = std::getenv("GDR_PERF_MPI"); e != nullptr && *e != 0) return e;
  std::string b = self_dir() + "mpi_pingpong";
  return ::access(b.c_str(), X_OK) == 0 ? b : std::string();
}

/// A program beside gdr: what it measures for this run, or why it cannot.
struct peer {
  std::string name;
  std::string unfit;  // why it does not run here (empty: it runs)
  double lat = NAN, bw = NAN;
};

/// The peers `o` asks for, each with the reason it does not fit, if so.
std::vector<peer> peers_for(const options& o) {
  using perf::ops::op;
  using perf::ops::space;
  const auto& sp = o.sp;
  const bool tcp_host = sp.transport == "tcp" && sp.local.kind != space::device && sp.peer.kind != space::device;
  std::vector<std::string> names = o.vs;
  if (!o.vs_given) {
    if (tcp_host && sp.operation == op::send) names = {"raw", "iperf3", "ucx_perftest"};
    else if (tcp_host) names = {"ucx_perftest"};
    else if (sp.transport == "verbs") names = {"perftest"};
    else if (sp.transport == "shm" && sp.local.kind != space::device && sp.peer.kind != space::device &&
             sp.operation == op::send)
      names = {"mpi"};
    else if (sp.local.kind == space::device && sp.peer.kind == space::device)
      names = {"cudamemcpy"};
  }
  std::vector<peer> out;
  for (const std::string& n : names) {
    peer p{n, {}};
    if (n == "raw" || n == "iperf3") {
      if (!tcp_host || sp.operation != op::send) p.unfit = n + " compares TCP sends of host memory only";
    } else if (n == "ucx_perftest") {
      if (!tcp_host) p.unfit = "ucx_perftest runs over UCX's tcp transport with host memory here (UCX 1.16 without CUDA)";
    } else if (n == "perftest") {
      const bool verbs_host = sp.transport == "verbs" && sp.local.kind != space::device && sp.peer.kind != space::device;
      if (!verbs_host) p.unfit = "perftest compares the verbs transport with host memory";
      else if (!perf::external::have("ib_send_lat")) p.unfit = "perftest is not installed";
    } else if (n == "mpi") {
      const bool host = sp.local.kind != space::device && sp.peer.kind != space::device;
      if (sp.operation != op::send || !host ||
          (sp.transport != "tcp" && sp.transport != "loopback" && sp.transport != "shm"))
        p.unfit = "the MPI ping-pong compares sends of host memory over TCP (Open MPI's tcp BTL) or shm and "
                  "loopback (its shared-memory BTL)";
      else if (!perf::external::have("mpirun")) p.unfit = "mpirun is not installed";
      else if (mpi_binary().empty()) p.unfit = "no mpi_pingpong beside gdr_perf (./bazelw build //benchmarks:mpi_pingpong, or GDR_PERF_MPI)";
    } else if (n == "cudamemcpy") {
      if (sp.local.kind != space::device || sp.peer.kind != space::device)
        p.unfit = "cudamemcpy compares Device to Device transfers with a local device-to-device copy";
    } else if (n == "memcpy") {
      if (sp.local.kind == space::device || sp.peer.kind == space::device)
        p.unfit = "memcpy compares host transfers with one CPU's local copy";
    } else {
      bad("--vs " + n + ": raw, iperf3, ucx_perftest, perftest, mpi, cudamemcpy, memcpy or none");
    }
    if (p.unfit.empty() && n != "raw" && n != "perftest" && n != "mpi" && n != "cudamemcpy" && n != "memcpy" &&
        !perf::external::have(n.c_str()))
      p.unfit = n + " is not installed";
    out.push_back(p);
  }
  return out;
}

/// One peer's latency and bandwidth at `size`.
void measure_peer(const options& o, peer& p, std::size_t size) {
  using perf::ops::op;
  const bool busy = o.sp.mode == gdr::run_mode::busy_poll;
  const std::size_t li = lat_iters(o, size), bc = bw_count(o, size);
  if (p.name == "raw") {
    p.lat = med(perf::raw::run_pingpong(o.cfg, size, li, busy));
    perf::sample bws;
    for (int rep = 0; rep < o.bw_reps; ++rep)
      for (double v : perf::raw::run_stream(o.cfg, size, bc, busy).v) bws.add(v);
    p.bw = med(bws);
  } else if (p.name == "iperf3") {
    p.bw = med(perf::external::iperf3(o.cfg, size, o.quick ? 1 : 2));
  } else if (p.name == "mpi") {
    const std::string mca = o.sp.transport == "tcp"
                                ? "--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo"
                                : "--mca pml ob1 --mca btl vader,self";
    perf::sample l, b;
    perf::external::mpi(o.cfg, mpi_binary(), mca, size, li, bc, l, b);
    p.lat = med(l);
    p.bw = med(b);
  } else if (p.name == "cudamemcpy") {
    perf::sample l, b;
    for (int rep = 0; rep < o.bw_reps; ++rep)
      if (!perf::ops::local_device_copy(o.sp.local.gpu, size, li, bc, l, b)) break;
    p.lat = med(l);
    p.bw = med(b);
  } else if (p.name == "memcpy") {
    perf::sample l, b;
    for (int rep = 0; rep < o.bw_reps; ++rep) perf::ops::local_host_copy(size, li, bc, l, b);
    p.lat = med(l);
    p.bw = med(b);
  } else if (p.name == "perftest") {
    const char* base = o.sp.operation == op::send ? "ib_send" : o.sp.operation == op::put ? "ib_write" : "ib_read";
    p.lat = med(perf::external::perftest(o.cfg, std::string(base) + "_lat", size, std::min<std::size_t>(li, 10000),
                                         o.sp.verbs_ip));
    p.bw = med(perf::external::perftest(o.cfg, std::string(base) + "_bw", size, std::min<std::size_t>(bc, 20000),
                                        o.sp.verbs_ip));
  } else if (p.name == "ucx_perftest") {
    const char* lat_test = o.sp.operation == op::send   ? "tag_lat"
                           : o.sp.operation == op::put ? "ucp_put_lat"
                           : o.sp.operation == op::fetch_add ? "ucp_fadd"
                                                             : nullptr;
    const char* bw_test = o.sp.operation == op::send   ? "tag_bw"
                          : o.sp.operation == op::put ? "ucp_put_bw"
                          : o.sp.operation == op::fetch_add ? "ucp_add"
                                                            : "ucp_get";
    if (lat_test != nullptr) p.lat = med(perf::external::ucx(o.cfg, lat_test, size, li));
    p.bw = med(perf::external::ucx(o.cfg, bw_test, size, std::min<std::size_t>(bc, 100000)));
  }
}

/// A peer's column label.
std::string label(const peer& p) { return p.name == "ucx_perftest" ? "ucx" : p.name; }

std::string space_name(const perf::ops::space_arg& s) {
  std::string n = perf::ops::name(s.kind);
  if (s.kind == perf::ops::space::device) n += ":" + std::to_string(s.gpu);
  return n;
}

void plot(const options& o, const std::vector<peer>& peers) {
  if (o.plot.empty() || !perf::external::have("gnuplot")) return;
  // Columns: 1 size, 2 gdr_lat, 3 gdr_bw, then per peer lat, bw (path is 4).
  std::string lat = "'" + o.csv + "' using 1:2 with linespoints title 'gdr'";
  std::string bw = "'" + o.csv + "' using 1:3 with linespoints title 'gdr'";
  for (std::size_t i = 0; i < peers.size(); ++i) {
    const int c = 5 + 2 * static_cast<int>(i);
    if (peers[i].name != "iperf3")  // bandwidth only
      lat += ", '' using 1:" + std::to_string(c) + " with linespoints title '" + peers[i].name + "'";
    bw += ", '' using 1:" + std::to_string(c + 1) + " with linespoints title '" + peers[i].name + "'";
  }
  std::string title = o.sp.transport + " " + perf::ops::name(o.sp.operation) + " " + space_name(o.sp.local) + " -> " +
                      space_name(o.sp.peer);
  std::string cmd = "gnuplot -e \"set terminal pngcairo size 1200,480 noenhanced; set output '" + o.plot +
                    "'; set datafile separator ','; set datafile missing 'nan'; set logscale x 2; set logscale y;"
                    " set xlabel 'message bytes'; set multiplot layout 1,2 title '" + title + "';"
                    " set title 'latency (us), lower is better'; plot " + lat + ";"
                    " set title 'bandwidth (GB/s), higher is better'; plot " + bw + "; unset multiplot\" 2>&1";
  if (std::system(cmd.c_str()) == 0) std::printf("gdr_perf: plot written to %s, data to %s\n", o.plot.c_str(), o.csv.c_str());
  else std::printf("gdr_perf: gnuplot failed; data in %s\n", o.csv.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* slash = std::strrchr(argv[0], '/')) self_dir().assign(argv[0], static_cast<std::size_t>(slash + 1 - argv[0]));
  options o = parse(argc, argv);
  if (o.sp.operation == perf::ops::op::fetch_add && o.sp.peer.kind == perf::ops::space::device)
    bad("--op fetch_add: the word is in the peer's host memory (a CPU does the atomic): not --peer-space device");
  if (std::string why = perf::ops::cannot_run(o.sp); !why.empty()) bad(why);
  std::vector<peer> peers = peers_for(o);
  const auto& sp = o.sp;
  const bool busy = sp.mode == gdr::run_mode::busy_poll;

  std::FILE* csv = std::fopen(o.csv.c_str(), "w");
  if (csv == nullptr) perf::die("csv");
  std::fprintf(csv, "size,gdr_lat_us,gdr_gbps,path");
  for (const peer& p : peers) std::fprintf(csv, ",%s_lat_us,%s_gbps", p.name.c_str(), p.name.c_str());
  std::fprintf(csv, ",gdr_p99_us\n");  // last, so the plot's columns stay where they were

  std::printf("gdr_perf: %s %s, %s -> %s, server on CPU %d, client on CPU %d, loops %s\n", sp.transport.c_str(),
              perf::ops::name(sp.operation), space_name(sp.local).c_str(), space_name(sp.peer).c_str(),
              o.cfg.server_cpu, o.cfg.client_cpu, busy ? "busy-poll" : "sleep");
  std::printf("latency: %s (us, median; gdr_p99 its 99th percentile); bandwidth: a window of operations in flight (GB/s, median of %d)\n",
              sp.operation == perf::ops::op::send ? "round trip of a send answered by a send"
                                                  : "one operation, completed when the target answered",
              o.bw_reps);
  for (const peer& p : peers)
    if (!p.unfit.empty()) std::printf("  %s: n/a (%s)\n", p.name.c_str(), p.unfit.c_str());
  std::string head = "      size   gdr_lat   gdr_p99    gdr_bw  path          ";
  for (const peer& p : peers) {
    char h[128];
    const std::string lat = label(p) + "_lat", bw = label(p) + "_bw";
    std::snprintf(h, sizeof h, " %11s   ratio %11s   ratio", lat.c_str(), bw.c_str());
    head += h;
  }
  std::printf("%s\n", head.c_str());
  std::fflush(stdout);

  for (std::size_t si = 0; si < o.sizes.size(); ++si) {
    const std::size_t size = o.sizes[si];
    auto progress = [&](const std::string& what) {
      std::fprintf(stderr, "gdr_perf: [%zu/%zu] size %zu: %s...\n", si + 1, o.sizes.size(), size, what.c_str());
    };
    perf::ops::measured lat, bw;
    perf::sample bws;
    try {
      progress("gdr latency");
      lat = perf::ops::run(o.cfg, sp, size, lat_iters(o, size), true);
      for (int rep = 0; rep < o.bw_reps; ++rep) {
        progress("gdr bandwidth");
        bw = perf::ops::run(o.cfg, sp, size, bw_count(o, size), false);
        for (double v : bw.v.v) bws.add(v);
      }
    } catch (const std::exception& e) {
      bad(std::string("the gdr run failed: ") + e.what());
    }
    if (lat.v.empty() || bws.empty()) bad("the gdr run of size " + std::to_string(size) + " failed (its messages are above)");
    for (peer& p : peers) {
      p.lat = p.bw = NAN;
      if (!p.unfit.empty()) continue;
      progress(p.name);
      measure_peer(o, p, size);
    }
    const double g_lat = med(lat.v), g_p99 = lat.v.quantile(0.99), g_bw = med(bws);
    const std::string path = !bw.path.empty() ? bw.path : lat.path;
    std::string line;
    char sz[64];
    std::snprintf(sz, sizeof sz, "%10zu", size);
    line += sz;
    cell(line, g_lat, "%10.2f", 10);
    cell(line, g_p99, "%10.2f", 10);
    cell(line, g_bw, "%10.3f", 10);
    std::snprintf(sz, sizeof sz, "  %-14s", path.empty() ? "?" : path.c_str());
    line += sz;
    for (const peer& p : peers) {
      cell(line, p.lat, " %11.2f", 12);
      cell(line, ratio(g_lat, p.lat), " %7.2fx", 9);
      cell(line, p.bw, " %11.3f", 12);
      cell(line, ratio(g_bw, p.bw), " %7.2fx", 9);
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    std::fprintf(csv, "%zu,%g,%g,%s", size, g_lat, g_bw, path.c_str());
    for (const peer& p : peers) std::fprintf(csv, ",%g,%g", p.lat, p.bw);
    std::fprintf(csv, ",%g\n", g_p99);
    std::fflush(csv);
  }
  std::fclose(csv);
  plot(o, peers);
  return 0;
}
