/// \file
/// `gdr::verbs::endpoint`: one RC queue pair to a peer, on the protocol
/// layer (`gdr/protocol/endpoint.hpp`): the operations and their rules are
/// those of every transport; a verbs endpoint converts to `gdr::endpoint`
/// and joins a mesh like any other.
///
/// \code
///   gdr::verbs::listener l(sched, "10.0.0.1:7471");             // one side
///   gdr::verbs::endpoint a = co_await l.accept();
///   gdr::verbs::endpoint b = co_await gdr::verbs::connect(       // the other
///       sched, "10.0.0.1:7471", "10.0.0.2:0");
///   co_await b.send(gdr::host_view(out));
///   co_await a.recv(gdr::host_view(in));
/// \endcode
///
/// Paths (`last_path()`, `stats().by_path`): a rendezvous payload the NIC
/// moved straight between the users' buffers (RDMA WRITE) is
/// `transfer_path::host_zero_copy` on both sides; a message copied through
/// the bounce buffers (eager messages, and rendezvous payloads whose
/// receive could not be registered) is `host_eager`. `GDR_LOG=path` prints
/// the path decided for every row at set-up; `gpudirect()` says what the
/// GPUDirect probe found for an endpoint made with
/// `endpoint_options::gpudirect`.
///
/// Memory spaces: `Host` and `Pinned` move zero-copy. `Device` rows are
/// `probed`: an endpoint made with `endpoint_options::gpudirect` runs the
/// probe of its GPU and NIC (`gdr/transport/verbs/gpudirect.hpp`) and is not
/// made if it fails (`errc::gpudirect_unavailable`, naming the check). An
/// endpoint made without it serves host memory only.
///
/// Liveness: see `gdr/transport/verbs/connection.hpp` ("Failure").
#pragma once

#include <infiniband/verbs.h>

#include <string>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/protocol/endpoint.hpp>
#include <gdr/transport/common.hpp>
#include <gdr/transport/path.hpp>
#include <gdr/transport/verbs/connection.hpp>
#include <gdr/transport/verbs/gpudirect.hpp>

namespace gdr {

// The verbs transport's rows of the path table (gdr/transport/path.hpp):
// host memory on both sides moves zero-copy (RDMA from and into the users'
// buffers; small messages through the bounce buffers); Device memory, on
// either side, is probed: zero-copy through GPUDirect RDMA if the probe of
// the endpoint's GPU and NIC says so, else the endpoint is not made.
// Staged Device rows come with the protocol layer's staged path.
template <>
inline constexpr const char* transport_name_v<verbs::transport> = "verbs";

template <class Op, class Local, class Remote>
struct path_table<verbs::transport, Op, Local, Remote>
    : detail::cpu_transport_rows<verbs::transport, Op, Local, Remote> {};

template <class Op, class Local>
  requires local_memory_space<Local> && (space_traits<Local>::on_device)
struct path_table<verbs::transport, Op, Local, AnySpace>
    : path_row<path_kind::probed, transfer_path::gpudirect_rdma> {};

template <class Op, class Local, class Remote>
  requires local_memory_space<Local> && local_memory_space<Remote> &&
           (space_traits<Local>::on_device || space_traits<Remote>::on_device)
struct path_table<verbs::transport, Op, Local, Remote>
    : path_row<path_kind::probed, transfer_path::gpudirect_rdma> {};

namespace verbs {

/// Awaitable of the endpoint's operations (see `gdr::op_awaitable`).
using operation_awaitable = gdr::op_awaitable;

/// A connected verbs endpoint (see the file comment). Move-only. Made by
/// `verbs::connect` and `verbs::listener::accept`.
class endpoint : public basic_endpoint<transport> {
 public:
  endpoint() noexcept = default;
  explicit endpoint(gdr::detail::verbs::connection* c) noexcept : basic_endpoint<transport>(c) {}

  /// The RDMA device carrying the connection ("rxe0", "mlx5_0").
  std::string device_name() const { return conn() != nullptr ? conn()->device_name() : std::string(); }
  /// Inline bytes its queue pair accepts (smaller SENDs go inline).
  unsigned max_inline() const noexcept { return conn() != nullptr ? conn()->max_inline() : 0; }
  /// The queue pair, for diagnostics and fault injection in tests.
  ibv_qp* native_qp() const noexcept { return conn() != nullptr ? conn()->qp() : nullptr; }

  /// Decides the path of every row the endpoint serves (`GDR_LOG=path`
  /// prints them): host rows always; `Device` rows only when `o.gpudirect`,
  /// by the probe of GPU `o.gpu` and `nic`. Returns `errc::unsupported`
  /// (a forced path no row offers) or `errc::gpudirect_unavailable`.
  static std::error_code decide(const endpoint_options& o, ibv_context* nic, const char* who) {
    using namespace gdr::detail::proto;
    std::error_code first;
    auto host_rows = [&]<class S>() {
      decide_row<transport, gdr::op::send, S, AnySpace>(o.protocol.force, who, first);
      decide_row<transport, gdr::op::recv, S, AnySpace>(o.protocol.force, who, first);
      decide_row<transport, gdr::op::put, S, S>(o.protocol.force, who, first);
      decide_row<transport, gdr::op::get, S, S>(o.protocol.force, who, first);
    };
    host_rows.template operator()<Host>();
    host_rows.template operator()<Pinned>();
    if (first || !o.gpudirect) return first;
    auto probe = [&]() -> std::error_code {
      return probe_gpudirect(o.gpu, nic).available ? std::error_code{} : std::error_code(errc::gpudirect_unavailable);
    };
    auto device_row = [&]<class Op, class R>() {
      result<path_decision> d = decide_path<transport, Op, Device, R>(o.protocol.force, probe);
      if (!d) {
        if (!first) first = d.error();
        return;
      }
      d->endpoint = who;
      log_path_decision(*d);
    };
    device_row.template operator()<gdr::op::send, AnySpace>();
    device_row.template operator()<gdr::op::recv, AnySpace>();
    device_row.template operator()<gdr::op::put, Device>();
    device_row.template operator()<gdr::op::get, Device>();
    return first;
  }

  /// The sentence that goes with `decide`'s error.
  static std::string decide_reason(const endpoint_options& o, ibv_context* nic) {
    if (o.gpudirect) {
      const gpudirect_report& r = probe_gpudirect(o.gpu, nic);
      if (!r.available) return "gdr::verbs: a zero-copy Device endpoint needs GPUDirect RDMA: " + r.reason;
    }
    return "gdr::verbs: the forced path is not one this transport offers";
  }

 private:
  gdr::detail::verbs::connection* conn() const noexcept {
    return static_cast<gdr::detail::verbs::connection*>(engine_ptr());
  }
};

}  // namespace verbs

}  // namespace gdr
