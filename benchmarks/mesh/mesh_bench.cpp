// mesh_bench: how long building the bootstrap mesh takes, for 8 to 256 ranks
// on one machine over 127.0.0.1 (ranks are threads of this process, each
// with its own scheduler, or forked processes), for:
//   chain      connect_mesh as it was before it was made parallel
//              (benchmarks/mesh/chain_mesh.hpp), measured in the same run;
//   full       connect_mesh: n - 1 connections per rank, made at once;
//   lazy       connect_lazy_mesh: the address table only, no connection;
//   lazy-ring  connect_lazy_mesh, then each rank's first send to its right
//              neighbour and first receive from its left one (2 connections
//              per rank, both sides connecting at once);
//   lazy-all   connect_lazy_mesh, then every pair's first send and receive
//              at once (n - 1 connections per rank, every one a tie-break).
// Each rank joins the TCP rendezvous, passes a barrier, then times the build
// (and the first uses); the build time of a job is the last rank's end minus
// the first rank's start. CPU time is each rank's own over the same span
// (the thread's, or the process's), summed; "CPU ms/rank" is that sum over
// the ranks, "CPU us/end" over the connection ends made (two a
// connection; for the lazy kinds it includes the two collectives). A
// conns/rank of -1: the ranks ended with different numbers of connections.
// The rendezvous and the close are not timed.
//
//   ./bazelw run -c opt //benchmarks:mesh_bench -- --mode threads --ranks 8,16,32,64,128,256 --reps 3
//   ./bazelw run -c opt //benchmarks:mesh_bench -- --mode procs --ranks 8,16,32,64,128,256 --reps 3
//   options: --kinds chain,full,lazy,lazy-ring,lazy-all  --max-chain N (largest world for chain)
//            --inflight N (mesh_options::max_connects_in_flight)  --csv FILE
//            --delay-ms D: every connect first sleeps D ms (on the scheduler,
//              costing no CPU), standing in for a network whose connection
//              set-up takes that long; then the build time shows the
//              structure (the longest chain of waits) rather than this
//              machine's two cores, which a local mesh of many ranks saturates
//            --small-endpoints: endpoints with a 4 KiB staging buffer and 4
//              reply slots (what making an endpoint costs, beside the mesh)
//
// Threads: one process holds every socket of the full mesh (about n * (n - 1)
// descriptors: 65,280 at 256 ranks), so the benchmark raises RLIMIT_NOFILE
// (to 2^20 when it may, as root may) and says so when it cannot.
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gdr/bootstrap/lazy_mesh.hpp>
#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/tcp_rendezvous.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/sched/timer.hpp>

#include "benchmarks/bench_util.hpp"
#include "benchmarks/mesh/chain_mesh.hpp"

namespace bs = gdr::bootstrap;
using namespace std::chrono_literals;

namespace {

enum class kind { chain, full, lazy, lazy_ring, lazy_all };
const char* name_of(kind k) {
  switch (k) {
    case kind::chain: return "chain";
    case kind::full: return "full";
    case kind::lazy: return "lazy";
    case kind::lazy_ring: return "lazy-ring";
    case kind::lazy_all: return "lazy-all";
  }
  return "?";
}

// What one rank reports (in shared memory for forked ranks).
struct rank_report {
  std::int64_t start_ns = 0;  // CLOCK_MONOTONIC, after the start barrier
  std::int64_t end_ns = 0;    // built (and first uses done)
  std::int64_t cpu_ns = 0;    // this rank's CPU time in between
  int connections = -1;       // endpoints held at the end of the span
  int ok = 0;
};

std::int64_t mono_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}
std::int64_t cpu_ns(clockid_t c) {
  timespec ts{};
  ::clock_gettime(c, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

struct settings {
  bool threads = true;
  int inflight = 32;
  std::chrono::milliseconds delay{0};
  bool small_endpoints = false;
  std::chrono::milliseconds timeout{120'000};
};

// The TCP transport of the mesh, each connect delayed first (--delay-ms).
struct delayed_net {
  bs::detail::tcp_net tcp;
  std::chrono::milliseconds delay;
  std::string listen(const std::string& host) { return tcp.listen(host); }
  std::string published() const { return tcp.published(); }
  gdr::task<gdr::result<gdr::tcp::endpoint>> connect(const std::string& where, std::chrono::milliseconds t) {
    if (delay.count() > 0) {
      auto pause = gdr::sleep_for(*tcp.sched, delay);
      (void)co_await std::move(pause).as_result();
    }
    co_return co_await tcp.connect(where, t);
  }
  gdr::task<gdr::result<gdr::tcp::endpoint>> accept(std::chrono::milliseconds t) { return tcp.accept(t); }
  void close() { tcp.close(); }
};

// connect_lazy_mesh over delayed_net (the library's own is over tcp_net).
template <class R>
gdr::task<bs::lazy_mesh> connect_lazy(gdr::scheduler& sched, R& rv, const bs::mesh_options& o,
                                      std::chrono::milliseconds delay) {
  auto s = std::make_shared<bs::detail::lazy_state>(sched, o);
  auto& net = s->set_net(delayed_net{bs::detail::tcp_net{&sched, &s->options()}, delay});
  bs::detail::mesh_table t = bs::detail::introduce_and_publish(rv, net, "lazy_mesh", o.listen_host);
  if (!t.failure.empty()) throw gdr::error(gdr::errc::bootstrap_failed, t.failure);
  s->start(std::move(t));
  co_return bs::detail::make_lazy_mesh(std::move(s));
}

gdr::task<> first_uses(bs::lazy_mesh& m, kind k) {
  static const std::array<std::uint64_t, 1> out{42};
  const int n = m.size(), me = m.rank();
  std::vector<std::array<std::uint64_t, 1>> in(static_cast<std::size_t>(n));
  std::vector<gdr::task<std::size_t>> work;
  auto pair = [&](int p) {
    work.push_back(m.send(p, gdr::host_view(out)));
    work.push_back(m.recv(p, gdr::host_view(in[static_cast<std::size_t>(p)])));
  };
  if (k == kind::lazy_ring && n > 1) {
    work.push_back(m.send((me + 1) % n, gdr::host_view(out)));
    work.push_back(m.recv((me + n - 1) % n, gdr::host_view(in[0])));
  } else if (k == kind::lazy_all) {
    for (int p = 0; p < n; ++p)
      if (p != me) pair(p);
  }
  (void)co_await gdr::when_all(std::move(work));
}

// One rank of a job: join, barrier, build (timed), barrier, close.
void run_rank(int rank, int world, std::uint16_t port, int listen_fd, const std::string& job, kind k,
              const settings& s, rank_report& out) {
  bs::tcp_rendezvous_config c;
  c.root_port = port;
  c.rank = rank;
  c.world_size = world;
  c.job_id = job;
  c.timeout = s.timeout;
  c.listen_fd = rank == 0 ? listen_fd : -1;
  bs::tcp_rendezvous rv(c);
  gdr::scheduler sched;
  bs::mesh_options o;
  o.timeout = s.timeout;
  o.max_connects_in_flight = s.inflight;
  if (s.small_endpoints) {
    o.endpoint.rx_buffer = 4096;
    o.endpoint.protocol.reply_slots = 4;
  }
  const clockid_t clock = s.threads ? CLOCK_THREAD_CPUTIME_ID : CLOCK_PROCESS_CPUTIME_ID;
  gdr::sync_wait(sched, [&]() -> gdr::task<> {
    rv.barrier("start");
    out.start_ns = mono_ns();
    const std::int64_t cpu0 = cpu_ns(clock);
    if (k == kind::chain || k == kind::full) {
      // (Two awaits, not one `?:` of two: GCC 12 miscompiles a co_await
      // inside a conditional expression.)
      delayed_net net{bs::detail::tcp_net{&sched, &o}, s.delay};
      bs::mesh m;
      if (k == kind::chain) {
        m = co_await bench_chain::connect_chain_mesh(rv, net, o);
      } else {
        bs::detail::mesh_limits lim;  // what connect_mesh passes
        lim.timeout = o.timeout;
        lim.max_connects_in_flight = o.max_connects_in_flight;
        m = co_await bs::detail::build_mesh(rv, o.listen_host, lim, net);
      }
      out.end_ns = mono_ns();
      out.cpu_ns = cpu_ns(clock) - cpu0;
      out.connections = 0;
      for (int p = 0; p < m.size(); ++p) out.connections += m.peer(p).is_open();
      rv.barrier("end");
      co_await m.close();
    } else {
      bs::lazy_mesh m = co_await connect_lazy(sched, rv, o, s.delay);
      co_await first_uses(m, k);
      out.end_ns = mono_ns();
      out.cpu_ns = cpu_ns(clock) - cpu0;
      out.connections = m.connections();
      rv.barrier("end");
      co_await m.close();
    }
    out.ok = 1;
  }());
}

struct job_result {
  bool ok = false;
  double wall_ms = 0;
  double cpu_ms = 0;
  int min_conns = 0, max_conns = 0;
};

job_result run_job(int world, kind k, const settings& s) {
  std::uint16_t port = 0;
  int lfd = bench::listen_loopback(port);
  if (::listen(lfd, 4096) != 0) bench::die("listen");  // every rank connects at once
  const std::string job = bs::tcp_rendezvous_config::new_job_id();
  const std::size_t bytes = sizeof(rank_report) * static_cast<std::size_t>(world);
  void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) bench::die("mmap");
  auto* reports = new (mem) rank_report[static_cast<std::size_t>(world)]{};
  std::fflush(nullptr);
  if (s.threads) {
    std::vector<std::thread> ts;
    for (int r = 0; r < world; ++r)
      ts.emplace_back([&, r] {
        try {
          run_rank(r, world, port, lfd, job, k, s, reports[r]);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        }
      });
    for (auto& t : ts) t.join();
  } else {
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) {
      pid_t pid = ::fork();
      if (pid == 0) {
        int code = 1;
        try {
          if (r != 0) ::close(lfd);
          run_rank(r, world, port, lfd, job, k, s, reports[r]);
          code = 0;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        }
        std::fflush(nullptr);
        std::_Exit(code);
      }
      if (pid < 0) bench::die("fork");
      pids.push_back(pid);
    }
    for (pid_t p : pids) {
      int st = 0;
      ::waitpid(p, &st, 0);
    }
  }
  ::close(lfd);
  job_result res;
  res.ok = true;
  std::int64_t first = INT64_MAX, last = 0, cpu = 0;
  res.min_conns = world;
  for (int r = 0; r < world; ++r) {
    const rank_report& x = reports[r];
    res.ok = res.ok && x.ok;
    first = std::min(first, x.start_ns);
    last = std::max(last, x.end_ns);
    cpu += x.cpu_ns;
    res.min_conns = std::min(res.min_conns, x.connections);
    res.max_conns = std::max(res.max_conns, x.connections);
  }
  res.wall_ms = static_cast<double>(last - first) / 1e6;
  res.cpu_ms = static_cast<double>(cpu) / 1e6;
  ::munmap(mem, bytes);
  return res;
}

std::vector<int> parse_ints(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p != '\0';) {
    char* end = nullptr;
    v.push_back(static_cast<int>(std::strtol(p, &end, 10)));
    p = *end == ',' ? end + 1 : end;
  }
  return v;
}

std::vector<kind> parse_kinds(const std::string& s) {
  std::vector<kind> v;
  std::size_t at = 0;
  while (at <= s.size()) {
    std::size_t comma = s.find(',', at);
    std::string w = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    for (kind k : {kind::chain, kind::full, kind::lazy, kind::lazy_ring, kind::lazy_all})
      if (w == name_of(k)) v.push_back(k);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  std::vector<int> worlds{8, 16, 32, 64, 128, 256};
  std::vector<kind> kinds{kind::chain, kind::full, kind::lazy, kind::lazy_ring, kind::lazy_all};
  int reps = 3, max_chain = 256;
  const char* csv_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mesh_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--mode") s.threads = std::string(next()) != "procs";
    else if (a == "--ranks") worlds = parse_ints(next());
    else if (a == "--kinds") kinds = parse_kinds(next());
    else if (a == "--reps") reps = std::atoi(next());
    else if (a == "--max-chain") max_chain = std::atoi(next());
    else if (a == "--inflight") s.inflight = std::atoi(next());
    else if (a == "--csv") csv_path = next();
    else if (a == "--delay-ms") s.delay = std::chrono::milliseconds(std::atoi(next()));
    else if (a == "--small-endpoints") s.small_endpoints = true;
    else {
      std::fprintf(stderr, "mesh_bench: unknown option %s (see the file comment)\n", a.c_str());
      return 2;
    }
  }
  rlimit nofile{};
  ::getrlimit(RLIMIT_NOFILE, &nofile);
  rlimit want{1u << 20, 1u << 20};
  if (::setrlimit(RLIMIT_NOFILE, &want) != 0) {
    want.rlim_cur = want.rlim_max = nofile.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &want);
  }
  ::getrlimit(RLIMIT_NOFILE, &nofile);
  std::printf("# mesh_bench: ranks are %s on 127.0.0.1; %u CPUs; RLIMIT_NOFILE %llu; max_connects_in_flight %d; "
              "connect delay %lld ms; %s endpoints; %d reps, medians\n",
              s.threads ? "threads" : "processes", std::thread::hardware_concurrency(),
              static_cast<unsigned long long>(nofile.rlim_cur), s.inflight, static_cast<long long>(s.delay.count()),
              s.small_endpoints ? "small" : "default", reps);
  std::FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv) std::fprintf(csv, "mode,ranks,kind,rep,ok,wall_ms,cpu_ms,min_conns,max_conns\n");
  std::printf("%6s %-10s %10s %10s %10s %14s %12s\n", "ranks", "kind", "conns/rank", "build ms", "CPU ms",
              "CPU ms/rank", "CPU us/end");
  for (int world : worlds) {
    for (kind k : kinds) {
      if (k == kind::chain && world > max_chain) continue;
      std::vector<double> wall, cpu;
      int conns = -1;
      bool all_ok = true;
      for (int rep = 0; rep < reps; ++rep) {
        job_result r = run_job(world, k, s);
        all_ok = all_ok && r.ok;
        if (csv)
          std::fprintf(csv, "%s,%d,%s,%d,%d,%.3f,%.3f,%d,%d\n", s.threads ? "threads" : "procs", world, name_of(k), rep,
                       r.ok ? 1 : 0, r.wall_ms, r.cpu_ms, r.min_conns, r.max_conns);
        if (!r.ok) continue;
        wall.push_back(r.wall_ms);
        cpu.push_back(r.cpu_ms);
        conns = r.min_conns == r.max_conns ? r.max_conns : -1;
      }
      const double w = median(wall), c = median(cpu);
      // Connection ends made in the job: each connection has two.
      const double ends = conns > 0 ? static_cast<double>(world) * conns : 0;
      std::printf("%6d %-10s %10d %10.1f %10.1f %14.2f %12.1f%s\n", world, name_of(k), conns, w, c, c / world,
                  ends > 0 ? c * 1000 / ends : 0.0, all_ok ? "" : "  (some runs failed)");
      std::fflush(stdout);
    }
  }
  if (csv) std::fclose(csv);
}
