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
/// where it goes through the rings).
///
/// `Device` memory (`endpoint_options::device`, decided in the handshake;
/// `device_ipc()` says which): by CUDA IPC where both processes can share
/// device memory, `transfer_path::cuda_ipc`: a `Device` payload is one GPU
/// copy straight out of the owner's allocation, made by the side that
/// receives it (the receiver of a send or of a get's answer, the target of
/// a put), after the owner's stream work that `gdr::cuda::after` names; a
/// send from `Device` memory goes by rendezvous at any size, and a `Device`
/// receive takes only messages moved straight into it (an eager host
/// message fails it with `errc::gpudirect_unavailable` and stays
/// receivable). Memory the driver cannot share (managed memory, an
/// allocator whose handles do not travel) fails the operation at once with
/// `errc::unsupported`. Otherwise `Device` memory is staged through pinned
/// bounce buffers on the side that owns it, as on TCP.
///
/// Liveness. The peer's process ending, killed or not, closes its Unix
/// socket: every pending and later operation fails with
/// `errc::connection_lost` as soon as this side's loop sees the hang-up
/// (no timeout to wait for). An orderly close by the peer fails them with
/// `errc::peer_closed`; a malformed frame, descriptor or word of the shared
/// memory (a head, tail or count out of bounds: the peer maps the rings and
/// may write anything there) with `errc::protocol_error`.
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
// through the rings; Device memory on either side probed: CUDA IPC where
// the handshake found both processes can share device memory, else staged
// (the endpoint's set-up decides and logs it; `endpoint_options::device`
// can require either).
template <>
inline constexpr const char* transport_name_v<shm::transport> = "shm";

template <class Op, class Local, class Remote>
struct path_table<shm::transport, Op, Local, Remote>
    : detail::cpu_transport_rows<shm::transport, Op, Local, Remote> {};

template <class Op, class Local>
  requires local_memory_space<Local> && (space_traits<Local>::on_device)
struct path_table<shm::transport, Op, Local, AnySpace> : path_row<path_kind::probed, transfer_path::cuda_ipc> {};

template <class Op, class Local, class Remote>
  requires local_memory_space<Local> && local_memory_space<Remote> &&
           (space_traits<Local>::on_device || space_traits<Remote>::on_device)
struct path_table<shm::transport, Op, Local, Remote> : path_row<path_kind::probed, transfer_path::cuda_ipc> {};

namespace shm {

class listener;

/// A connected shared-memory endpoint (see the file comment and
/// `gdr::basic_endpoint`). Move-only.
class endpoint : public basic_endpoint<transport> {
 public:
  /// An endpoint with no connection (what a moved-from one is).
  endpoint() noexcept = default;

  /// `Device` memory moves by CUDA IPC on this endpoint (else staged).
  bool device_ipc() const noexcept { return conn() != nullptr && conn()->stats().device_ipc; }
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
    bool ipc;
    std::string operator()(op_kind k, bool device) const {
      using gdr::detail::proto::size_text;
      if (device)
        return ipc ? std::string("every size by rendezvous: one GPU copy straight out of the owner's allocation (CUDA "
                                 "IPC, imported once and cached), made by the side that receives the bytes; host bytes "
                                 "for Device memory copied by the GPU out of the ring")
                   : gdr::detail::proto::staged_note(o->protocol);
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
    result<std::uint8_t> refused = decide(opts, parts.device_ipc, who.c_str());
    if (!refused) throw gdr::error(refused.error(), "gdr::shm::endpoint: the forced path is not one this transport offers");
    auto* c = new gdr::detail::shm::connection(sched, std::move(parts), registry, opts);
    c->set_refused(*refused);
    return c;
  }

  /// Decides the path of every row (`GDR_LOG=path` prints them) and returns
  /// the rows a forced path refuses: host rows through the rings; `Device`
  /// rows by CUDA IPC (`ipc`, agreed in the handshake) or staged.
  static result<std::uint8_t> decide(const endpoint_options& o, bool ipc, const char* who) {
    using namespace gdr::detail::proto;
    path_plan plan;
    std::error_code probe_error;
    const row_sizes words{&o, ipc};
    auto host_rows = [&]<class S>() {
      decide_row<transport, gdr::op::send, S, AnySpace>(o.protocol.force, who, plan, probe_error, words);
      decide_row<transport, gdr::op::recv, S, AnySpace>(o.protocol.force, who, plan, probe_error, words);
      decide_row<transport, gdr::op::put, S, Host>(o.protocol.force, who, plan, probe_error, words);
      decide_row<transport, gdr::op::get, S, Host>(o.protocol.force, who, plan, probe_error, words);
      decide_row<transport, gdr::op::put, S, Pinned>(o.protocol.force, who, plan, probe_error, words);
      decide_row<transport, gdr::op::get, S, Pinned>(o.protocol.force, who, plan, probe_error, words);
    };
    host_rows.template operator()<Host>();
    host_rows.template operator()<Pinned>();
    // The Device rows (probed in the table) as the handshake decided them.
    auto device_rows = [&](path_kind kind, transfer_path path) {
      auto row = [&]<class Op, class L, class R>() {
        path_decision d = row_decision<transport, Op, L, R>(o.protocol.force);
        d.decided = kind;
        d.path = path;
        d.endpoint = who;
        if (path_log_enabled()) log_row(d, words, Op::kind, true);
        ++plan.usable;
      };
      row.template operator()<gdr::op::send, Device, AnySpace>();
      row.template operator()<gdr::op::recv, Device, AnySpace>();
      auto remote = [&]<class L, class R>() {
        row.template operator()<gdr::op::put, L, R>();
        row.template operator()<gdr::op::get, L, R>();
      };
      remote.template operator()<Device, Host>();
      remote.template operator()<Device, Pinned>();
      remote.template operator()<Device, Device>();
      remote.template operator()<Host, Device>();
      remote.template operator()<Pinned, Device>();
    };
    if (ipc) {
      if (o.protocol.force == force_path::staged) plan.refused |= engine::refuse_device;
      else device_rows(path_kind::zero_copy, transfer_path::cuda_ipc);
    } else if (o.protocol.force == force_path::zero_copy) {
      plan.refused |= engine::refuse_device;
    } else {
      device_rows(path_kind::staged, transfer_path::staged_pinned);
    }
    if (plan.usable == 0) return errc::unsupported;
    return plan.refused;
  }
  gdr::detail::shm::connection* conn() const noexcept {
    return static_cast<gdr::detail::shm::connection*>(engine_ptr());
  }
};

}  // namespace shm

}  // namespace gdr
