/// \file
/// `gdr::tcp::endpoint`: one TCP connection to a peer, driven by the
/// scheduler's io_uring (in busy-poll mode, ready data moves with
/// non-blocking system calls made by the loop: `endpoint_options`,
/// `spin_reads_in_busy_poll` and `direct_writes_in_busy_poll`). The
/// operations and their rules are the protocol layer's, the same on every
/// transport (`gdr/protocol/endpoint.hpp`, `gdr/protocol/engine.hpp`):
/// tagged two-sided messages (`send`/`recv`), eager below
/// `protocol_options::rendezvous_threshold` and receiver-driven rendezvous
/// above it; one-sided access to the peer's registered memory
/// (`put`/`get`); orderly `close`.
///
/// \code
///   gdr::scheduler sched;
///   gdr::sync_wait(sched, [&]() -> gdr::task<> {
///     gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, "127.0.0.1:5000");
///     std::array<int, 4> out{1, 2, 3, 4}, in{};
///     co_await ep.send(gdr::host_view(out));                 // one message, 16 bytes
///     std::size_t n = co_await ep.recv(gdr::host_view(in));  // the peer's answer
///     co_await ep.close();
///   }());
/// \endcode
///
/// Paths (`last_path()`, `stats().by_path`): a send always goes from the
/// user's buffer to the kernel through an iovec, `transfer_path::host_zero_copy`
/// (no copy in user space; the kernel copies into its socket buffer unless
/// `zero_copy_send_threshold` selects SENDMSG_ZC). A receive is
/// `host_eager` when its payload came through the endpoint's staging buffer
/// or the store of early messages (one `memcpy`), `host_zero_copy` when the
/// kernel read it straight into the view.
///
/// Liveness. When the peer goes away (end of stream without a close frame,
/// reset), every pending and later operation fails with
/// `errc::connection_lost` at once: the kernel reports a killed peer's
/// socket immediately. A peer that vanishes silently (power, cable,
/// partition) is noticed by `socket_options::user_timeout` (30 s by
/// default) while data is unacknowledged, and by keepalive probes on an idle
/// connection; on Linux TCP_USER_TIMEOUT also bounds keepalive, so the
/// bound on an idle connection is max(keepalive_idle + probes,
/// user_timeout) - lower `user_timeout` to notice sooner. An orderly close
/// by the peer fails them with `errc::peer_closed`. A malformed or hostile
/// frame fails them with `errc::protocol_error` and closes the connection.
///
/// One-sided operations. The peer serves them in its own reader: each
/// request is checked with `memory_registry::acquire` (range, key,
/// permission, revocation) before any byte is read or written, and holds a
/// lease on the registration while it is served; refused accesses fail on
/// the initiator with `errc::remote_access`.
///
/// Threads. An endpoint belongs to one scheduler: start and await its
/// operations on that scheduler's thread; they resume there. Stop requests
/// may come from any thread.
#pragma once

#include <string>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/endpoint.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transfer/path.hpp>
#include <gdr/transport/tcp/close.hpp>
#include <gdr/transport/tcp/connection.hpp>
#include <gdr/transport/tcp/reader.hpp>
#include <gdr/transport/tcp/socket.hpp>
#include <gdr/transport/tcp/writer.hpp>

namespace gdr {

// The TCP transport's rows of the path table (gdr/transfer/path.hpp):
// `sendmsg` from the user's buffer, and large payloads read straight into
// it (the kernel still copies between it and the socket buffers). Host and
// Pinned, either side, every operation: zero-copy. Device: unsupported
// until the staged rows arrive (a socket cannot reach GPU memory).
// Remote<S> as the local side: unsupported.
template <>
inline constexpr const char* transport_name_v<tcp::transport> = "tcp";

template <class Op, class Local, class Remote>
struct path_table<tcp::transport, Op, Local, Remote>
    : detail::cpu_transport_rows<tcp::transport, Op, Local, Remote> {};

namespace tcp {

/// Awaitable of the endpoint's operations (see `gdr::op_awaitable`).
using operation_awaitable = gdr::op_awaitable;

/// A connected TCP endpoint (see the file comment and `gdr::basic_endpoint`).
/// Move-only.
class endpoint : public basic_endpoint<transport> {
 public:
  /// An endpoint with no connection (what a moved-from one is).
  endpoint() noexcept = default;

  /// Takes over a connected socket (its options are applied here), says
  /// hello to the peer and starts serving its one-sided requests from
  /// `registry`. Call on `sched`'s thread, or before `sched` runs. Throws
  /// `gdr::error` if the socket options cannot be set, `std::bad_alloc`.
  endpoint(scheduler& sched, socket sock, memory_registry& registry = default_registry(),
           const endpoint_options& opts = {})
      : basic_endpoint<transport>(make(sched, std::move(sock), registry, opts, true)) {}

  /// What the last protocol error was about (`frame_status::ok` if none).
  frame_status protocol_error_reason() const noexcept {
    return conn() != nullptr ? conn()->protocol_reason() : frame_status::ok;
  }
  /// The socket (-1 once closed), for diagnostics such as `getsockopt`.
  int native_handle() const noexcept { return conn() != nullptr ? conn()->fd() : -1; }

 private:
  friend class accept_awaitable;

  /// What each row does by message size (`GDR_LOG=path`): every byte a
  /// socket moves is copied by the kernel; "zero-copy" says gdr adds no
  /// copy of its own.
  struct row_sizes {
    const endpoint_options* o;
    std::string operator()(op_kind k, bool device) const {
      using gdr::detail::proto::size_text;
      if (device) return gdr::detail::proto::staged_note(o->protocol);
      const std::string t = size_text(o->protocol.rendezvous_threshold);
      const std::string d = size_text(o->direct_read_threshold);
      switch (k) {
        case op_kind::send:
          return "up to " + t + " eager (header and your bytes in one write), above rendezvous (rts, rtr, then your "
                 "bytes): written from your buffer either way (host-zero-copy)";
        case op_kind::recv:
          return "from " + d + " read straight into the view (host-zero-copy), below through the connection's buffer "
                 "and copied (host-eager); a message that came before its receive was kept in the early store and "
                 "is copied once (host-eager); eager up to the sender's threshold (" + t + " here), rendezvous above";
        case op_kind::put:
          return "your bytes written from your buffer after the request; the target reads them straight into its "
                 "memory from " + d + ", below through its buffer";
        case op_kind::get:
          return "the answer read straight into your view from " + d + " (host-zero-copy), below through the "
                 "connection's buffer (host-eager)";
      }
      return {};
    }
  };

  /// An accepted socket that carries `opts.socket` from its listener
  /// already (`listener` sets them on the listening socket): the same
  /// endpoint without the six `setsockopt` calls.
  struct options_in_place {};
  endpoint(options_in_place, scheduler& sched, socket sock, memory_registry& registry, const endpoint_options& opts)
      : basic_endpoint<transport>(make(sched, std::move(sock), registry, opts, false)) {}

  static gdr::detail::proto::engine* make(scheduler& sched, socket sock, memory_registry& registry,
                                           const endpoint_options& opts, bool apply) {
    if (apply)
      if (std::error_code ec = sock.apply(opts.socket)) throw gdr::error(ec, "gdr::tcp::endpoint: socket options");
    std::string who;
    if (path_log_enabled() || opts.protocol.force != force_path::automatic) {
      result<address> peer = sock.remote_address();
      who = peer ? peer->to_string() : std::string("?");
    }
    auto plan = gdr::detail::proto::decide_paths<transport>(opts.protocol.force, who.c_str(), row_sizes{&opts});
    if (!plan) throw gdr::error(plan.error(), "gdr::tcp::endpoint: the forced path is not one this transport offers");
    auto* c = new gdr::detail::tcp::connection(sched, std::move(sock), registry, opts);
    c->set_refused(plan->refused);
    return c;
  }
  gdr::detail::tcp::connection* conn() const noexcept {
    return static_cast<gdr::detail::tcp::connection*>(engine_ptr());
  }
};

}  // namespace tcp

}  // namespace gdr
