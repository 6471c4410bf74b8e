/// \file
/// Path selection in one place: for a transport, an operation and the memory
/// spaces on both sides, one table says how the bytes move.
///
///   zero_copy    straight from and into the user's buffer;
///   staged       pipelined through `Pinned` bounce buffers;
///   probed       decided once, at endpoint set-up, by a run-time probe
///                (verbs with `Device`: is GPUDirect RDMA there?);
///   unsupported  does not compile; the error names the combination and
///                says what to do instead.
///
/// The table is `path_table<Transport, Op, Local, Remote>`, with a
/// conservative default (unsupported) and rows that each transport declares
/// beside its code, as Kokkos keeps `MemorySpaceAccess` and as UCX keys its
/// protocol choice on `(op, memory type)` (`ucp_proto_select_param_t`). Code
/// never compares spaces to pick a path: it asks the table.
///
/// Two moments use it:
///   * compile time: each endpoint operation calls
///     `require_path<Transport, Op, Local, Remote>()`; an unsupported row
///     fails there with its named diagnostic;
///   * set-up time: `decide_path<...>(force, probe)` turns the row (and a
///     `force_path` option) into a `path_decision`, or a set-up error, never
///     a silent downgrade; `log_path_decision` prints it when `GDR_LOG`
///     asks for `path` (like `UCX_PROTO_INFO=y`).
///
/// \code
///   // In an endpoint's send<T, S>: does not compile for Device over TCP.
///   constexpr gdr::path_kind k = gdr::require_path<gdr::tcp::transport, gdr::op::send, S>();
///
///   // At set-up, once per row the endpoint serves:
///   gdr::result<gdr::path_decision> d =
///       gdr::decide_path<gdr::tcp::transport, gdr::op::send, gdr::Pinned>(opts.force);
///   if (!d) return d.error();        // e.g. forcing staged where the row has no staged path
///   gdr::log_path_decision(*d);      // GDR_LOG=path: "gdr path: tcp send Pinned -> any: zero-copy ..."
/// \endcode
///
/// Reading an unsupported combination's error: the diagnostic is a class
/// template named after the problem, instantiated with the combination, so
/// gcc prints
///
///   In instantiation of 'struct gdr::path_error::A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_<
///       gdr::tcp::transport, gdr::op::send, gdr::Remote<gdr::Host>, gdr::AnySpace>':
///   error: static assertion failed: a remote_view cannot be sent: use ep.put / ep.get ...
///
/// and clang the same two facts in the other order.
///
/// The rows of today's transports (loopback, tcp) are at the end of this file,
/// each in its own marked section; they move beside their transports when
/// those include this header.
#pragma once

#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/log.hpp>
#include <gdr/memory/access.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/transfer/common.hpp>

namespace gdr {

// ============================================================== operations

/// The operations a path is chosen for, as a run-time value.
enum class op_kind : std::uint8_t {
  send,  ///< two-sided: this side's buffer goes to the peer's receive
  recv,  ///< two-sided: the peer's send lands in this side's buffer
  put,   ///< one-sided: this side's buffer is written into a peer's registration
  get,   ///< one-sided: a peer's registration is read into this side's buffer
};

/// A printable name ("send", "recv", "put", "get").
constexpr const char* to_string(op_kind k) noexcept {
  switch (k) {
    case op_kind::send: return "send";
    case op_kind::recv: return "recv";
    case op_kind::put: return "put";
    case op_kind::get: return "get";
  }
  return "?";
}

/// Operation tags, the `Op` of `path_table`. Types rather than enum values
/// so that a compile error prints `gdr::op::send`, not `(gdr::op_kind)0`.
namespace op {
/// Two-sided send.
struct send {
  static constexpr op_kind kind = op_kind::send;
};
/// Two-sided receive.
struct recv {
  static constexpr op_kind kind = op_kind::recv;
};
/// One-sided write into a peer's registration.
struct put {
  static constexpr op_kind kind = op_kind::put;
};
/// One-sided read from a peer's registration.
struct get {
  static constexpr op_kind kind = op_kind::get;
};
}  // namespace op

/// One of the `gdr::op` tags.
template <class Op>
concept path_operation = requires {
  { Op::kind } -> std::convertible_to<op_kind>;
};

/// `send` or `recv`: the peer picks its own buffer.
template <class Op>
concept two_sided_operation = path_operation<Op> && (Op::kind == op_kind::send || Op::kind == op_kind::recv);

// ================================================================== spaces

/// The `Remote` side of a two-sided operation. A send does not know which
/// space the peer receives into (the peer picks its buffer, maybe after the
/// data has left), so its row is keyed on the local space alone. Not a
/// memory space: no view or buffer can be made of it.
struct AnySpace {
  static constexpr const char* name = "any";
};

namespace detail {
template <class S>
inline constexpr const char* remote_space_name_v = "Remote<?>";
template <>
inline constexpr const char* remote_space_name_v<Host> = "Remote<Host>";
template <>
inline constexpr const char* remote_space_name_v<Pinned> = "Remote<Pinned>";
template <>
inline constexpr const char* remote_space_name_v<Device> = "Remote<Device>";
}  // namespace detail

/// The printable name of a space: "Host", "Pinned", "Device",
/// "Remote<Host>", ... and "any" for `AnySpace`.
template <class S>
constexpr const char* space_name() noexcept {
  if constexpr (is_remote_v<S>) {
    return detail::remote_space_name_v<typename S::peer_space>;
  } else {
    return S::name;
  }
}

// ============================================================= transports

/// The name a transport prints in path decisions ("tcp", "loopback").
/// Each transport specializes it beside its rows; a variable template so that
/// the tag may be an incomplete type.
template <class Transport>
inline constexpr const char* transport_name_v = "unnamed transport";

// ============================================================== the table

/// What the table says about a combination.
enum class path_kind : std::uint8_t {
  zero_copy,    ///< straight from and into the user's buffer
  staged,       ///< through `Pinned` bounce buffers
  probed,       ///< zero-copy if a run-time probe at endpoint set-up says so, else a set-up error
  unsupported,  ///< does not compile (`require_path`), refused at run time (`decide_path`)
};

/// A printable name ("zero-copy", "staged", "probed", "unsupported").
constexpr const char* to_string(path_kind k) noexcept {
  switch (k) {
    case path_kind::zero_copy: return "zero-copy";
    case path_kind::staged: return "staged";
    case path_kind::probed: return "probed";
    case path_kind::unsupported: return "unsupported";
  }
  return "?";
}

/// A row of the table that moves bytes. `Path` is what `last_path()` will
/// report for it (for a probed row: if the probe says yes).
template <path_kind Kind, transfer_path Path>
struct path_row {
  static_assert(Kind != path_kind::unsupported, "gdr::path_row: an unsupported row is gdr::unsupported_path_row");
  static constexpr path_kind kind = Kind;
  static constexpr transfer_path path = Path;
};

/// A row that does not move bytes. `Diagnostic<Transport, Op, Local,
/// Remote>` is the class template `require_path` instantiates to fail; its
/// name says what is wrong, its `static_assert` what to do instead (see
/// `gdr::path_error`).
template <template <class, class, class, class> class Diagnostic>
struct unsupported_path_row {
  static constexpr path_kind kind = path_kind::unsupported;
  static constexpr transfer_path path = transfer_path::none;
  template <class Transport, class Op, class Local, class Remote>
  using diagnostic = Diagnostic<Transport, Op, Local, Remote>;
};

/// The diagnostics of unsupported rows. Each is named after the problem
/// (stdexec names its diagnostics the same way) and is instantiated with the
/// combination, so the compiler's "in instantiation of" line reads
/// `A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_<gdr::tcp::transport, gdr::op::send,
/// gdr::Remote<gdr::Host>, gdr::AnySpace>`. A transport may add its own.
namespace path_error {

/// Always false. The diagnostics assert it so that the compilers also print
/// the combination beside the message ("'path_exists<...>' evaluates to
/// false", "static_assert failed due to requirement 'path_exists<...>'").
template <class Transport, class Op, class Local, class Remote>
inline constexpr bool path_exists = false;

/// The conservative default: the transport declares no row for this.
template <class Transport, class Op, class Local, class Remote>
struct NO_PATH_FOR_THIS_TRANSPORT_OPERATION_AND_SPACES_ {
  static_assert(path_exists<Transport, Op, Local, Remote>,
                "this transport declares no path for this operation between these memory spaces (gdr::path_table "
                "has no row for it, and the default is unsupported): use a transport that moves these spaces, or "
                "declare the row by specializing gdr::path_table<Transport, Op, Local, Remote> beside the transport");
};

/// A `remote_view` (a `Remote<S>` space) used as the local side.
template <class Transport, class Op, class Local, class Remote>
struct A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_ {
  static_assert(path_exists<Transport, Op, Local, Remote>,
                "a remote_view cannot be sent: use ep.put / ep.get (a remote_view names a peer's memory and is "
                "never the local side of an operation: co_await ep.put(local_view, remote) writes it, "
                "co_await ep.get(local_view, remote) reads it)");
};

}  // namespace path_error

/// The path table: how `Transport` moves the bytes of `Op` between a local
/// buffer in `Local` and the peer's memory in `Remote` (`AnySpace` for send
/// and recv). Conservative default: unsupported. Transports specialize it
/// (fully or partially) with `path_row` and `unsupported_path_row` rows.
template <class Transport, class Op, class Local, class Remote>
struct path_table : unsupported_path_row<path_error::NO_PATH_FOR_THIS_TRANSPORT_OPERATION_AND_SPACES_> {};

/// The row for a combination.
template <class Transport, class Op, class Local, class Remote = AnySpace>
using select_path = path_table<Transport, Op, Local, Remote>;

/// The kind of the row for a combination.
template <class Transport, class Op, class Local, class Remote = AnySpace>
inline constexpr path_kind select_path_v = select_path<Transport, Op, Local, Remote>::kind;

/// The table has a path (of any kind but unsupported) for the combination.
template <class Transport, class Op, class Local, class Remote = AnySpace>
concept has_path = select_path_v<Transport, Op, Local, Remote> != path_kind::unsupported;

/// The compile-time gate of an endpoint operation: returns the row's kind,
/// and for an unsupported row fails to compile with the row's diagnostic,
/// which names the combination and what to do instead.
///
/// `constexpr` rather than `consteval`: clang 14 adds "call to consteval
/// function is not a constant expression" after the diagnostic, noise that
/// hides the message.
template <class Transport, class Op, class Local, class Remote = AnySpace>
constexpr path_kind require_path() noexcept {
  static_assert(path_operation<Op>, "gdr::require_path<Transport, Op, Local, Remote>: Op must be gdr::op::send, "
                                    "gdr::op::recv, gdr::op::put or gdr::op::get");
  static_assert(memory_space<Local>, "gdr::require_path<Transport, Op, Local, Remote>: Local must be a memory "
                                     "space (gdr::Host, gdr::Pinned, gdr::Device)");
  static_assert(std::is_same_v<Remote, AnySpace> || local_memory_space<Remote>,
                "gdr::require_path<Transport, Op, Local, Remote>: Remote is the space on the peer's side "
                "(gdr::Host, gdr::Pinned, gdr::Device), or gdr::AnySpace for send and recv");
  using row = select_path<Transport, Op, Local, Remote>;
  if constexpr (row::kind == path_kind::unsupported) {
    // Completing the diagnostic type runs its static_assert.
    (void)sizeof(typename row::template diagnostic<Transport, Op, Local, Remote>);
  }
  return row::kind;
}

// ============================================================ forcing a path

/// An endpoint option: which path its operations must take. `automatic`
/// takes the row's; the others are for tests and benchmarks, and are refused
/// at set-up where the row does not offer them (never downgraded).
enum class force_path : std::uint8_t {
  automatic,  ///< the row's path (a probed row: the probe must succeed)
  zero_copy,  ///< only zero-copy (a probed row: the probe must succeed)
  staged,     ///< only through Pinned bounce buffers
};

/// A printable name ("automatic", "zero-copy", "staged").
constexpr const char* to_string(force_path f) noexcept {
  switch (f) {
    case force_path::automatic: return "automatic";
    case force_path::zero_copy: return "zero-copy";
    case force_path::staged: return "staged";
  }
  return "?";
}

/// The row offers what `f` asks for. A probed row offers zero-copy only,
/// subject to its probe; an unsupported row offers nothing.
constexpr bool path_offered(path_kind row, force_path f) noexcept {
  switch (row) {
    case path_kind::unsupported: return false;
    case path_kind::zero_copy: return f != force_path::staged;
    case path_kind::staged: return f != force_path::zero_copy;
    case path_kind::probed: return f != force_path::staged;
  }
  return false;
}

/// `path_offered` as the error an endpoint's set-up returns: empty, or
/// `errc::unsupported` (the path asked for is not one this row has).
inline std::error_code path_allowed(path_kind row, force_path f) noexcept {
  if (path_offered(row, f)) return {};
  return errc::unsupported;
}

// =========================================================== the decision

/// A path an endpoint decided on at set-up, for one row; what `GDR_LOG=path`
/// prints. The strings are static (names from the table) except `endpoint`,
/// which the caller owns and may leave null.
struct path_decision {
  const char* transport = "";     ///< `transport_name_v<Transport>`
  op_kind operation = op_kind::send;
  const char* local_space = "";   ///< `space_name<Local>()`
  const char* remote_space = "";  ///< `space_name<Remote>()`
  path_kind row = path_kind::unsupported;      ///< what the table says
  path_kind decided = path_kind::unsupported;  ///< zero_copy or staged: a probed row resolved
  transfer_path path = transfer_path::none;    ///< what `last_path()` will report
  force_path force = force_path::automatic;    ///< the option it was decided under
  const char* endpoint = nullptr;              ///< the endpoint, for the log ("10.0.0.2:4791")
  /// What happens by message size under this row (eager or rendezvous,
  /// copied or not), from the endpoint's options; set by the transport for
  /// the log only (empty: nothing to add).
  std::string sizes;
};

/// The probe of a transport with no run-time facts: every probed row fails
/// set-up. A real probe is a callable returning an empty `std::error_code`
/// when the zero-copy path is there, else why not
/// (`errc::gpudirect_unavailable`).
struct no_probe {
  std::error_code operator()() const noexcept { return errc::unsupported; }
};

/// The decision a row's table entry describes, before any check or probe
/// (`decide_path` starts from it; a transport that resolves a probed row
/// itself, e.g. to `staged`, sets `decided` and `path`).
template <class Transport, class Op, class Local, class Remote = AnySpace>
path_decision row_decision(force_path force) noexcept {
  using row = select_path<Transport, Op, Local, Remote>;
  path_decision d;
  d.transport = transport_name_v<Transport>;
  d.operation = Op::kind;
  d.local_space = space_name<Local>();
  d.remote_space = space_name<Remote>();
  d.row = row::kind;
  d.decided = row::kind;
  d.path = row::path;
  d.force = force;
  return d;
}

/// Decides the path of one row at endpoint set-up: checks `force` against
/// the row (`errc::unsupported` if it is not offered, also for an
/// unsupported row: this is the run-time form, it does not fail to compile),
/// and resolves a probed row by calling `probe` once (its error is the
/// set-up error: a failed probe never falls back to staging). The probe runs
/// for probed rows only.
template <class Transport, class Op, class Local, class Remote = AnySpace, class Probe = no_probe>
result<path_decision> decide_path(force_path force = force_path::automatic, [[maybe_unused]] Probe&& probe = Probe{}) {
  static_assert(path_operation<Op>, "gdr::decide_path: Op must be one of the gdr::op tags");
  using row = select_path<Transport, Op, Local, Remote>;
  if (std::error_code ec = path_allowed(row::kind, force)) return ec;
  path_decision d = row_decision<Transport, Op, Local, Remote>(force);
  if constexpr (row::kind == path_kind::probed) {
    if (std::error_code ec = std::forward<Probe>(probe)()) return ec;
    d.decided = path_kind::zero_copy;
  }
  return d;
}

/// One line, without a newline:
/// "gdr path: tcp [10.0.0.2:4791] send Pinned -> any: zero-copy (host-zero-copy)",
/// with ", probed" when a probe decided it and ", forced <f>" when forced.
inline std::string to_string(const path_decision& d) {
  std::string s = "gdr path: ";
  s += d.transport;
  if (d.endpoint != nullptr) {
    s += " [";
    s += d.endpoint;
    s += ']';
  }
  s += ' ';
  s += to_string(d.operation);
  s += ' ';
  s += d.local_space;
  s += " -> ";
  s += d.remote_space;
  s += ": ";
  s += to_string(d.decided);
  s += " (";
  s += to_string(d.path);
  s += ')';
  if (d.row == path_kind::probed) s += ", probed";
  if (d.force != force_path::automatic) {
    s += ", forced ";
    s += to_string(d.force);
  }
  if (!d.sizes.empty()) {
    s += "; by size: ";
    s += d.sizes;
  }
  return s;
}

/// `GDR_LOG` asks for path decisions (`path` or `all`). The environment is
/// read once, at the first call, and the answer kept: set `GDR_LOG` before
/// the first endpoint is made. Thread-safe.
inline bool path_log_enabled() noexcept {
  static const bool enabled = [] {
    return log_topic_enabled("path");
  }();
  return enabled;
}

/// Writes `to_string(d)` as one line (gdr/log.hpp) when
/// `path_log_enabled()`. Endpoints call it once per decision at set-up.
inline void log_path_decision(const path_decision& d) {
  if (!path_log_enabled()) return;
  const std::string line = to_string(d);
  detail::log_sink_slot().load(std::memory_order_acquire)(line);
}

// ===================================================== rows of the CPU transports

namespace detail {

/// The rows shared by the transports whose bytes the CPU moves (a socket's
/// `sendmsg`/`recvmsg`, a `memcpy`): host-accessible memory on both sides
/// moves zero-copy; device memory on either side is staged through Pinned
/// bounce buffers by the protocol layer, on the side that owns it; a
/// `Remote<S>` space is never the local side. Everything else keeps the
/// conservative default.
template <class Transport, class Op, class Local, class Remote>
struct cpu_transport_rows
    : unsupported_path_row<path_error::NO_PATH_FOR_THIS_TRANSPORT_OPERATION_AND_SPACES_> {};

template <class Transport, class Op, class Local, class Remote>
  requires host_accessible<Local> && host_accessible<Remote>
struct cpu_transport_rows<Transport, Op, Local, Remote>
    : path_row<path_kind::zero_copy, transfer_path::host_zero_copy> {};

// Send and receive: the local buffer is all this side moves.
template <class Transport, class Op, class Local>
  requires two_sided_operation<Op> && host_accessible<Local>
struct cpu_transport_rows<Transport, Op, Local, AnySpace>
    : path_row<path_kind::zero_copy, transfer_path::host_zero_copy> {};

// Device memory on either side: staged through Pinned bounce buffers by
// the protocol layer (gdr/sched/copy_engine.hpp), on the side that owns it.
template <class Transport, class Op, class Local, class Remote>
  requires local_memory_space<Local> && (space_traits<Local>::on_device) &&
           (std::is_same_v<Remote, AnySpace> || local_memory_space<Remote>)
struct cpu_transport_rows<Transport, Op, Local, Remote>
    : path_row<path_kind::staged, transfer_path::staged_pinned> {};

template <class Transport, class Op, class Local, class Remote>
  requires host_accessible<Local> && local_memory_space<Remote> && (space_traits<Remote>::on_device)
struct cpu_transport_rows<Transport, Op, Local, Remote>
    : path_row<path_kind::staged, transfer_path::staged_pinned> {};

template <class Transport, class Op, class S, class R>
struct cpu_transport_rows<Transport, Op, gdr::Remote<S>, R>
    : unsupported_path_row<path_error::A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_> {};

}  // namespace detail

}  // namespace gdr
