/// \file
/// `gdr::shm::endpoint`: a connection to a process on the same node through
/// shared memory. The operations and their rules are the protocol layer's,
/// the same on every transport (`gdr/protocol/endpoint.hpp`): tagged
/// messages (eager below `protocol_options::rendezvous_threshold`,
/// receiver-driven rendezvous above), `put`/`get` on the peer's registered
/// memory, orderly `close`. `shm::listener` and `shm::connect`
/// (connect.hpp) make them.
///
/// \code
///   gdr::shm::listener l(sched);                    // an abstract Unix socket name
///   // in the other process: co_await gdr::shm::connect(sched, name)
///   gdr::shm::endpoint ep = co_await l.accept();
///   co_await ep.send(gdr::host_view(out));
/// \endcode
///
/// Paths (`last_path()`, `stats().by_path`): `transfer_path::shared_memory`.
/// A payload goes through the rings (below
/// `endpoint_options::single_copy_threshold`, when that is set; by default
/// always): the sender's CPU copies it into the ring it writes,
/// the receiver's CPU copies it out into the view (or into the store of
/// early messages, when no receive is posted yet: one copy more when it
/// comes); no system call moves it, and in busy-poll mode a message costs
/// none at all (a sleeping peer is woken by one eventfd write); a large
/// payload streams through, the two copies overlapping. From the threshold
/// on, a payload is copied once, by the receiver, straight from the sender's
/// memory (`process_vm_readv`), where the handshake found the peer may
/// read this process (`stats().peer_reads_me`; not across a ptrace
/// restriction such as Yama's `ptrace_scope` 1 between sibling processes,
/// where it goes through the rings). `Device` memory is staged through
/// pinned bounce buffers on the side that owns it, as on TCP.
///
/// Liveness. The peer's process ending, killed or not, closes its Unix
/// socket: every pending and later operation fails with
/// `errc::connection_lost` as soon as this side's loop sees the hang-up
/// (no timeout to wait for). An orderly close by the peer fails them with
/// `errc::peer_closed`; a malformed frame with `errc::protocol_error`.
///
/// Threads. An endpoint belongs to one scheduler: start and await its
/// operations on that scheduler's thread; they resume there.
#pragma once

#include <string>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/endpoint.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transfer/path.hpp>
#include <gdr/transport/shm/connection.hpp>
#include <gdr/transport/shm/io.hpp>
#include <gdr/transport/shm/options.hpp>

namespace gdr {

// The shared-memory transport's rows of the path table: host memory
// through the rings; Device memory staged, as on every CPU transport.
template <>
inline constexpr const char* transport_name_v<shm::transport> = "shm";

template <class Op, class Local, class Remote>
struct path_table<shm::transport, Op, Local, Remote>
    : detail::cpu_transport_rows<shm::transport, Op, Local, Remote> {};

namespace shm {

class listener;

/// A connected shared-memory endpoint (see the file comment and
/// `gdr::basic_endpoint`). Move-only.
class endpoint : public basic_endpoint<transport> {
 public:
  /// An endpoint with no connection (what a moved-from one is).
  endpoint() noexcept = default;

  /// The peer's process id (0 once closed).
  int peer_pid() const noexcept { return conn() != nullptr ? conn()->peer_pid() : 0; }
  /// What the last protocol error was about (`frame_status::ok` if none).
  gdr::tcp::frame_status protocol_error_reason() const noexcept {
    return conn() != nullptr ? conn()->protocol_reason() : gdr::tcp::frame_status::ok;
  }

  /// Over a finished handshake (`connect`, `listener::accept`). Throws
  /// `gdr::error` for a forced path this transport does not offer,
  /// `std::bad_alloc`.
  endpoint(scheduler& sched, gdr::detail::shm::link_parts parts, memory_registry& registry,
           const endpoint_options& opts)
      : basic_endpoint<transport>(make(sched, std::move(parts), registry, opts)) {}

 private:
  /// What each row does by message size (`GDR_LOG=path`).
  struct row_sizes {
    const endpoint_options* o;
    std::string operator()(op_kind k, bool device) const {
      using gdr::detail::proto::size_text;
      if (device) return gdr::detail::proto::staged_note(o->protocol);
      const std::string t = size_text(o->protocol.rendezvous_threshold);
      const std::string once =
          o->single_copy_threshold == 0
              ? std::string("; every payload through the rings (single copy off)")
              : "; payloads from " + size_text(o->single_copy_threshold) +
                    " copied once by the peer straight from this process's memory, where the handshake finds it may";
      switch (k) {
        case op_kind::send:
          return "up to " + t + " eager, above rendezvous (rts, rtr, then your bytes): copied by this CPU into the "
                 "shared ring (shared-memory)" + once;
        case op_kind::recv:
          return "copied out of the peer's ring into the view, or from the peer's memory when it sends large "
                 "payloads as addresses (shared-memory); a message that came before its receive was kept in the "
                 "early store and is copied once more";
        case op_kind::put: return "your bytes copied into the ring after the request; the target copies them out" + once;
        case op_kind::get: return "the answer copied out of the peer's ring (or its memory) into your view";
      }
      return {};
    }
  };

  static gdr::detail::proto::engine* make(scheduler& sched, gdr::detail::shm::link_parts parts,
                                           memory_registry& registry, const endpoint_options& opts) {
    std::string who = "pid " + std::to_string(parts.peer_pid);
    auto plan = gdr::detail::proto::decide_paths<transport>(opts.protocol.force, who.c_str(), row_sizes{&opts});
    if (!plan) throw gdr::error(plan.error(), "gdr::shm::endpoint: the forced path is not one this transport offers");
    auto* c = new gdr::detail::shm::connection(sched, std::move(parts), registry, opts);
    c->set_refused(plan->refused);
    return c;
  }
  gdr::detail::shm::connection* conn() const noexcept {
    return static_cast<gdr::detail::shm::connection*>(engine_ptr());
  }
};

}  // namespace shm

}  // namespace gdr
