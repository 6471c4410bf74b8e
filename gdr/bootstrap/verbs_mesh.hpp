/// \file
/// `gdr::verbs::connect_mesh`: the bootstrap's mesh (`gdr/bootstrap/mesh.hpp`)
/// over RDMA verbs: one RC endpoint to every other rank, set up through
/// rdma_cm, after the same rendezvous (TCP, or MPI under `mpirun`/`srun`)
/// and the same steps: a session id, listen and publish, connect to every
/// higher rank and greet it while accepting every lower one (at once, at
/// most `mesh_options::max_connects_in_flight` connections of a rank's own
/// under way), and a final allgather so that every rank fails when one does.
///
/// \code
///   auto rv = gdr::bootstrap::tcp_rendezvous::from_env();
///   gdr::verbs::mesh_options o;
///   o.listen_host = "10.0.0.1";        // this rank's address on its RDMA device
///   gdr::bootstrap::mesh m = co_await gdr::verbs::connect_mesh(sched, rv, o);
///   co_await m.peer(right).send(gdr::host_view(buf));   // gdr::endpoint, over verbs
/// \endcode
///
/// The address: rdma_cm finds the RDMA device by the IP address of its
/// network interface, so a rank listens on, publishes and connects from
/// (binds its source to) `mesh_options::listen_host`, else `GDR_MESH_HOST`,
/// else the rendezvous' address hint, else the first IPv4 address of an
/// interface that is up and not loopback (never 127.0.0.1: rdma_cm cannot
/// route over `lo`). Every wait is bounded by `mesh_options::timeout`;
/// failures throw `gdr::error(errc::bootstrap_failed)` naming the peer and
/// the step.
#pragma once

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>

#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/timeout.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/verbs.hpp>

namespace gdr::verbs {

/// How `connect_mesh` builds a verbs mesh. Set the fields on a named object
/// (see `bootstrap::mesh_options` for why it is not an aggregate).
struct mesh_options {
  mesh_options() noexcept {}  // NOLINT: user-provided on purpose

  /// This rank's numeric address on its RDMA device (see the file comment
  /// for what is used when empty).
  std::string listen_host{};
  /// Bound on each step: each collective, and the connections as a whole.
  std::chrono::milliseconds timeout{30'000};
  /// How many of its connections a rank has under way at once; the others
  /// wait for a free one. At least 1. (Ranks connect in increasing order,
  /// so a rank sees requests from about this many lower ranks at a time,
  /// within the listener's rdma_cm backlog of 64.)
  int max_connects_in_flight = 32;
  /// The registry the endpoints serve peers' put/get from.
  memory_registry* registry = &default_registry();
  /// Options of every endpoint.
  endpoint_options endpoint{};
};

namespace detail {

/// The verbs side of `bootstrap::detail::build_mesh`.
struct mesh_net {
  scheduler* sched;
  const mesh_options* opts;
  std::optional<listener> l{};
  std::string host{};

  static std::string bracket(const std::string& h) { return h.find(':') != std::string::npos ? "[" + h + "]" : h; }

  std::string listen(const std::string& h) {
    host = h;
    try {
      l.emplace(*sched, bracket(h) + ":0", *opts->registry, opts->endpoint);
    } catch (const error& e) {
      return "cannot listen on " + h + " (rdma_cm: is it the address of an RDMA device's interface?): " + e.what();
    }
    return {};
  }
  std::string published() const { return bracket(host) + ":" + std::to_string(l->port()); }
  // `t` zero: no bound of its own (build_mesh's step has one deadline). A
  // failure is thrown on as it is: its words name the rdma_cm step.
  static task<result<endpoint>> bounded(std::chrono::milliseconds t, task<endpoint> op) {
    if (t.count() > 0) co_return co_await with_timeout(t, std::move(op));
    co_return co_await std::move(op);
  }
  // The coroutines below are templates: gcc emits every non-template
  // inline coroutine in each unit that sees it (benchmarks/compile_cost.sh).
  template <class = void>
  task<result<endpoint>> connect(const std::string& where, std::chrono::milliseconds t) {
    return bounded(t, verbs::connect(*sched, where, bracket(host) + ":0", *opts->registry, opts->endpoint));
  }
  task<result<endpoint>> accept(std::chrono::milliseconds t) { return bounded(t, l->accept()); }
  void close() { l.reset(); }
};

}  // namespace detail

/// Builds a mesh of verbs endpoints (see the file comment).
template <bootstrap::rendezvous R>
task<bootstrap::mesh> connect_mesh(scheduler& sched, R& rv, mesh_options opts = {}) {
  std::string host = opts.listen_host;
  if (host.empty())
    if (const char* env = std::getenv("GDR_MESH_HOST")) host = env;
  if (host.empty()) host = rv.address_hint();
  if (host.empty() || host == "127.0.0.1" || host == "::1") host = gdr::detail::sock::first_external_ipv4();
  detail::mesh_net net{&sched, &opts};
  bootstrap::detail::mesh_limits lim;
  lim.timeout = opts.timeout;
  lim.max_connects_in_flight = opts.max_connects_in_flight;
  co_return co_await bootstrap::detail::build_mesh(rv, host, lim, net);
}

}  // namespace gdr::verbs
