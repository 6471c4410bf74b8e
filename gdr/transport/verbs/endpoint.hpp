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
/// moved straight between the users' buffers (RDMA WRITE), and a put or get
/// larger than one SEND buffer (the target's NIC reads the put's source with
/// RDMA READ, or writes the get's reply with RDMA WRITE, after checking the
/// access) is `transfer_path::host_zero_copy`; a message copied through the
/// bounce buffers (eager messages, small puts and gets, and payloads whose
/// memory could not be registered) is `host_eager`. `GDR_LOG=path` prints
/// the path decided for every row at set-up; `gpudirect()` says what the
/// GPUDirect probe found for an endpoint made with
/// `endpoint_options::gpudirect`.
///
/// Memory spaces: `Host` and `Pinned` move zero-copy. `Device` rows are
/// `probed`: an endpoint made with `endpoint_options::gpudirect` runs the
/// probe of its GPU and NIC (`gdr/transport/verbs/gpudirect.hpp`) and is not
/// made if it fails (`errc::gpudirect_unavailable`, naming the check). If
/// it passes, the NIC moves `Device` memory itself (registered through a
/// dma-buf or nvidia-peermem), and every byte of it goes by RDMA:
/// `transfer_path::gpudirect_rdma`. The CPU never touches it; where it
/// would have to, the operation or the connection fails with
/// `errc::gpudirect_unavailable` (see docs/VERBS.md, "GPU memory"). An
/// endpoint made without it stages `Device` memory through the protocol
/// layer's pipeline (`staged-pinned`), and `GDR_LOG=path` says so. Both
/// ends of a connection must agree on `gpudirect`.
///
/// Liveness: see `gdr/transport/verbs/connection.hpp` ("Failure").
#pragma once

#include <infiniband/verbs.h>

#include <string>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/protocol/endpoint.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transfer/path.hpp>
#include <gdr/transport/verbs/connection.hpp>
#include <gdr/transport/verbs/gpudirect.hpp>

namespace gdr {

// The verbs transport's rows of the path table (gdr/transfer/path.hpp):
// host memory on both sides moves zero-copy (RDMA from and into the users'
// buffers; small messages through the bounce buffers); Device memory, on
// either side, is probed: zero-copy through GPUDirect RDMA if the probe of
// the endpoint's GPU and NIC says so, else the endpoint is not made.
// An endpoint made without GPUDirect stages Device memory through the
// protocol layer's pipeline instead: the explicit choice (endpoint.decide).
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

/// Awaitable of `endpoint::notification()`: `co_await` gives the value of
/// the peer's next notifying put, or throws `gdr::error` (the endpoint
/// failed or closed; `errc::unsupported` where the endpoint has no
/// one-sided lane). Movable until awaited.
class notification_awaitable {
 public:
  explicit notification_awaitable(gdr::detail::verbs::connection* c) noexcept : c_(c) {}
  notification_awaitable(notification_awaitable&& o) noexcept : c_(o.c_) {}
  notification_awaitable& operator=(notification_awaitable&&) = delete;
  ~notification_awaitable() {
    if (c_ != nullptr) c_->drop_note_waiter(w_);
  }
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) noexcept {
    if (c_ == nullptr) {
      w_.ec = errc::closed;
      return false;
    }
    w_.h = h;
    return !c_->take_note(w_);
  }
  std::uint32_t await_resume() {
    if (w_.ec) throw gdr::error(w_.ec, "gdr::verbs: no notification will come");
    return w_.value;
  }

 private:
  gdr::detail::verbs::connection* c_;
  gdr::detail::verbs::note_waiter w_{};
};

/// A connected verbs endpoint (see the file comment). Move-only. Made by
/// `verbs::connect` and `verbs::listener::accept`.
class endpoint : public basic_endpoint<transport> {
 public:
  /// The value of the peer's next notifying put into this side's memory
  /// (`put_notify`), in the order they arrived: the put's bytes are in
  /// place. A peer's notifications wait here until taken (`notify_depth`
  /// of them at the NIC; more hold the peer's one-sided operations until
  /// this side reads them).
  [[nodiscard]] notification_awaitable notification() const noexcept { return notification_awaitable(conn()); }
  /// The one-sided lane is connected: puts, gets and atomics into views
  /// this side's NIC reaches go directly (`transfer_path::one_sided_rdma`).
  bool one_sided() const noexcept { return conn() != nullptr && conn()->one_sided_ready(); }
  endpoint() noexcept = default;
  explicit endpoint(gdr::detail::verbs::connection* c) noexcept : basic_endpoint<transport>(c) {}

  /// The RDMA device carrying the connection ("rxe0", "mlx5_0").
  std::string device_name() const { return conn() != nullptr ? conn()->device_name() : std::string(); }
  /// Inline bytes its queue pair accepts (smaller SENDs go inline).
  unsigned max_inline() const noexcept { return conn() != nullptr ? conn()->max_inline() : 0; }
  /// With `endpoint_options::cache_registrations`: forget the NIC
  /// registrations of a buffer before freeing or unmapping it (the cache
  /// cannot see `free`, and a registration outliving its memory pins the
  /// old pages). A registration a transfer still uses goes when that
  /// transfer ends. Returns how many were dropped. Other endpoints on the
  /// same device and scheduler share the caches.
  std::size_t invalidate_registrations(const void* addr, std::size_t len) noexcept {
    return conn() != nullptr ? conn()->invalidate_registrations(addr, len) : 0;
  }
  /// What the GPUDirect probe found for this endpoint's GPU and NIC (its
  /// route: "dma-buf" or "peermem"; `needs_flush`), or null when the
  /// endpoint was made without `endpoint_options::gpudirect`.
  const gpudirect_report* gpudirect() const noexcept { return conn() != nullptr ? conn()->gpudirect() : nullptr; }
  /// The queue pair, for diagnostics and fault injection in tests.
  ibv_qp* native_qp() const noexcept { return conn() != nullptr ? conn()->qp() : nullptr; }
  /// The address, length and remote key of the memory this side last told
  /// its peer's NIC about (an rtr's receive, a large put's source or get's
  /// destination), for tests of what a peer can reach.
  key_info last_key_sent() const noexcept { return conn() != nullptr ? conn()->last_key_sent() : key_info{}; }
  /// For tests: holds this side's reader (`on`), as in a process that
  /// stopped, or lets it go on. While held, what the peer sends arrives
  /// (its NIC is answered) but no frame of it is read; let go, the frames
  /// are read in order. A gdr peer's reader never stops by itself (the
  /// early credits hold the sender back instead), so this is how a test
  /// keeps frames unread on the far side. Never for production.
  void hold_reading(bool on) noexcept {
    if (conn() != nullptr) conn()->hold_reading(on);
  }
  /// The GPUDirect flush's loopback queue pair this endpoint uses (shared by
  /// the endpoints of its device and scheduler; null when it has none), for
  /// diagnostics and fault injection in tests.
  ibv_qp* native_flush_qp() const noexcept { return conn() != nullptr ? conn()->flush_qp() : nullptr; }

  /// Decides the path of every row the endpoint serves (`GDR_LOG=path`
  /// prints them) and returns the rows a forced path refuses
  /// (`engine::refuse_host`, `engine::refuse_device`):
  ///   * host rows: zero-copy;
  ///   * `Device` rows, with `o.gpudirect`: the probe of GPU `o.gpu` and
  ///     `nic` decides: a yes makes them zero-copy (`gpudirect-rdma`; a GPU
  ///     whose `needs_flush` gets the flush), a no fails the set-up
  ///     (`errc::gpudirect_unavailable`, never a fallback to staging);
  ///   * `Device` rows without `o.gpudirect`: staged through the protocol
  ///     layer's pipeline (pinned bounce buffers), the explicit choice.
  static result<std::uint8_t> decide(const endpoint_options& o, ibv_context* nic, const char* who) {
    using namespace gdr::detail::proto;
    path_plan plan;
    std::error_code probe_error;
    auto note = [&o](op_kind k, bool device) { return row_sizes(o, k, device); };
    auto host_rows = [&]<class S>() {
      decide_row<transport, gdr::op::send, S, AnySpace>(o.protocol.force, who, plan, probe_error, note);
      decide_row<transport, gdr::op::recv, S, AnySpace>(o.protocol.force, who, plan, probe_error, note);
      decide_row<transport, gdr::op::put, S, S>(o.protocol.force, who, plan, probe_error, note);
      decide_row<transport, gdr::op::get, S, S>(o.protocol.force, who, plan, probe_error, note);
    };
    host_rows.template operator()<Host>();
    host_rows.template operator()<Pinned>();
    // The Device rows (probed in the table) as this endpoint moves them.
    auto device_rows = [&](path_kind kind, transfer_path path) {
      auto row = [&]<class Op, class R>() {
        path_decision d = row_decision<transport, Op, Device, R>(o.protocol.force);
        d.decided = kind;
        d.path = path;
        d.endpoint = who;
        if (path_log_enabled()) log_row(d, note, Op::kind, true);
        ++plan.usable;
      };
      row.template operator()<gdr::op::send, AnySpace>();
      row.template operator()<gdr::op::recv, AnySpace>();
      row.template operator()<gdr::op::put, Device>();
      row.template operator()<gdr::op::get, Device>();
    };
    if (o.gpudirect) {
      if (!probe_gpudirect(o.gpu, nic).available) return errc::gpudirect_unavailable;  // decide_reason says why
      if (o.protocol.force == force_path::staged) {
        plan.refused |= engine::refuse_device;  // a GPUDirect endpoint does not stage
      } else {
        device_rows(path_kind::zero_copy, transfer_path::gpudirect_rdma);
      }
    } else if (o.protocol.force == force_path::zero_copy) {
      plan.refused |= engine::refuse_device;
    } else {
      device_rows(path_kind::staged, transfer_path::staged_pinned);
    }
    if (plan.usable == 0) return errc::unsupported;
    return plan.refused;
  }

  /// What a row does by message size (`GDR_LOG=path`). The host rows'
  /// limits use this side's `buffer_size`; the connection uses the smaller
  /// of both sides'. Device rows: GPUDirect (`o.gpudirect`) or staged.
  static std::string row_sizes(const endpoint_options& o, op_kind k, bool device) {
    using gdr::detail::proto::size_text;
    if (device)
      return o.gpudirect ? std::string("every size: only the NIC reads and writes the GPU memory (registered with "
                                       "it), after the stream's work; no bounce buffer, no CPU copy")
                         : gdr::detail::proto::staged_note(o.protocol);
    const std::size_t header = sizeof(gdr::detail::verbs::wire_header);
    const std::size_t buf = std::max<std::size_t>(o.buffer_size, 1024);
    const std::string inl = size_text(o.max_inline > header ? o.max_inline - header : 0);
    const std::string t = size_text(o.protocol.rendezvous_threshold);
    const std::string one = size_text(buf - header);
    switch (k) {
      case op_kind::send:
        return "up to " + inl + " one inline SEND, up to " + t + " SENDs copied through registered buffers of " +
               size_text(buf) + " (host-eager), above: the NIC writes from your buffer into the receive's (RDMA "
               "WRITE, host-zero-copy)";
      case op_kind::recv:
        return "up to the sender's threshold (" + t + " here) copied from the receive buffers (host-eager), above: "
               "written by the peer's NIC straight into the view (host-zero-copy)";
      case op_kind::put:
        return "up to " + one + " (buffer_size less the 72-byte header, with the smaller of both sides' buffer_size) "
               "inside the request SEND (host-eager), above: the target's NIC reads your buffer (RDMA READ, "
               "host-zero-copy)";
      case op_kind::get:
        return "up to " + one + " answered in a SEND (host-eager), above: the target's NIC writes straight into "
               "your view (RDMA WRITE, host-zero-copy)";
    }
    return {};
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
