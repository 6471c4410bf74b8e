/// \file
/// `gdr::tcp::endpoint`: one TCP connection to a peer, driven by the
/// scheduler's io_uring (in busy-poll mode, ready data moves with
/// non-blocking system calls made by the loop: `endpoint_options`,
/// `spin_reads_in_busy_poll` and `direct_writes_in_busy_poll`). Two-sided
/// messages (`send`/`recv`), one-sided access to the peer's registered
/// memory (`put`/`get`), orderly `close`. Same API as
/// `gdr::loopback::endpoint`.
///
/// \code
///   gdr::scheduler sched;
///   gdr::sync_wait(sched, [&]() -> gdr::task<> {
///     gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, "127.0.0.1:5000");
///     std::array<int, 4> out{1, 2, 3, 4}, in{};
///     co_await ep.send(gdr::host_view(out));               // one message, 16 bytes
///     std::size_t n = co_await ep.recv(gdr::host_view(in));  // the peer's answer
///     co_await ep.close();
///   }());
/// \endcode
///
/// Messages. Message boundaries are kept: one `recv` takes exactly one
/// message. Sends go out in the order they were started, and receives are
/// matched to messages in the order they were started, however many are
/// pending. A message larger than the receive view fills the view, the rest is
/// read and dropped, and the receive fails with `errc::truncated` (nothing is
/// written past the view; the stream stays in step; the endpoint stays
/// usable).
///
/// Paths (`last_path()`, `stats().by_path`): a send always goes from the
/// user's buffer to the kernel through an iovec, `transfer_path::host_zero_copy`
/// (no copy in user space; the kernel copies into its socket buffer unless
/// `zero_copy_send_threshold` selects SENDMSG_ZC). A receive is
/// `host_eager` when its payload came through the endpoint's staging buffer
/// (small messages: one `memcpy`), `host_zero_copy` when the kernel read it
/// straight into the view (large messages; at most one staging read's worth
/// of the payload, which arrived with the header, is copied).
///
/// Flow control. A message that arrives before its `recv` is kept if it is
/// small (`endpoint_options::eager_limit`, up to `unexpected_capacity` bytes
/// in all); a larger one stops the endpoint reading its socket until a recv
/// is posted, so TCP holds the sender back and nothing is buffered without
/// bound. Requests and replies behind that message wait too (one stream):
/// post receives for large messages before waiting on one-sided operations
/// the peer sends after them.
///
/// Cancellation and timeouts. Every operation observes `op_options::stop`,
/// the awaiting coroutine's stop token (`errc::cancelled`) and
/// `op_options::timeout` (`errc::timed_out`, an io_uring timeout). The
/// coroutine resumes only once the kernel has returned every buffer the
/// operation lent it, so a buffer may be reused as soon as its operation
/// completes, whatever the outcome.
///   * A recv stops at once. If its message was arriving, the rest of that
///     message is read and dropped (the view may hold part of it); the next
///     recv gets the next message.
///   * A send is withdrawn only while it waits behind other frames. Once the
///     endpoint has handed it to the kernel (it is *committed*: the frames
///     after it are numbered already) a stop or a timeout is ignored: the
///     send completes when its last byte is written, or with the
///     connection's error. Sends cannot be cancelled anywhere (DESIGN-NOTES);
///     the stream is never corrupted. The connection's own liveness bound
///     (`socket_options::user_timeout`) bounds how long that takes when the
///     peer dies silently.
///   * A put or get stops at once, except while its request is being
///     written (it then completes right after). It may or may not have taken
///     effect on the peer: a reply that comes later is dropped.
///   * close() with a timeout or stop stops flushing: the connection is
///     aborted.
///
/// Failure. When the peer goes away (end of stream without a close frame,
/// reset, TCP_USER_TIMEOUT, keepalive), every pending and later operation
/// fails with `errc::connection_lost`, at once: the kernel reports a killed
/// peer's socket immediately. A malformed or hostile frame fails them with
/// `errc::protocol_error` and closes the connection. Messages that had fully
/// arrived (kept early messages) can still be received.
///
/// One-sided operations. The peer serves them in its own reader: each
/// request is checked with `memory_registry::resolve` (range, key,
/// permission, revocation) before any byte is read or written; refused
/// accesses fail on the initiator with `errc::remote_access`. Puts are
/// written straight into the registered memory, gets sent straight from it.
///
/// Threads. An endpoint belongs to one scheduler: start and await its
/// operations on that scheduler's thread; they resume there. Stop requests
/// may come from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/memory/view.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transport/common.hpp>
#include <gdr/transport/tcp/connection.hpp>
#include <gdr/transport/tcp/socket.hpp>

namespace gdr::tcp {

/// Awaitable of `send`, `recv`, `put`, `get` and `close`: `co_await` gives the
/// byte count (0 for close) or throws `gdr::error`;
/// `co_await std::move(op).as_result()` (or `gdr::try_await(op)`) gives
/// `result<std::size_t>` and never throws.
using operation_awaitable = gdr::detail::tcp::endpoint_op;

/// A connected TCP endpoint (see the file comment). Move-only.
///
/// Made by `tcp::connect`, `listener::accept`, or from a connected socket.
/// Destroying an open endpoint aborts the connection (pending operations
/// fail with `errc::closed`); the kernel hands its buffers back later, so
/// keep the scheduler running (`sched.drain()`) before destroying it. After
/// `co_await ep.close()`, nothing is left in flight.
///
/// Thread-safety: operations are started and awaited on the endpoint's
/// scheduler's thread and resume there; `stats()`, `last_path()` likewise.
class endpoint {
 public:
  /// An endpoint with no connection (what a moved-from one is): `is_open()`
  /// is false; starting an operation on it is a bug.
  endpoint() noexcept = default;

  /// Takes over a connected socket (its options are applied here) and
  /// starts serving the peer's one-sided requests from `registry`. Call on
  /// `sched`'s thread, or before `sched` runs. Throws `gdr::error` if the
  /// socket options cannot be set, `std::bad_alloc`.
  endpoint(scheduler& sched, socket sock, memory_registry& registry = default_registry(),
           const endpoint_options& opts = {}) {
    if (std::error_code ec = sock.apply(opts.socket)) throw gdr::error(ec, "gdr::tcp::endpoint: socket options");
    conn_ = new gdr::detail::tcp::connection(sched, std::move(sock), registry, opts);
  }

  endpoint(endpoint&& o) noexcept : conn_(std::exchange(o.conn_, nullptr)) {}
  endpoint& operator=(endpoint&& o) noexcept {
    if (this != &o) {
      reset();
      conn_ = std::exchange(o.conn_, nullptr);
    }
    return *this;
  }
  endpoint(const endpoint&) = delete;
  endpoint& operator=(const endpoint&) = delete;
  ~endpoint() { reset(); }

  /// Sends `v` as one message. Completes with `v.size_bytes()` once the
  /// whole message is in the kernel: `v` may be reused when it resumes.
  ///
  /// Errors: `errc::closed`, `errc::connection_lost`, `errc::protocol_error`,
  /// `errc::cancelled` / `errc::timed_out` (only while not yet committed: see
  /// the file comment), `errc::invalid_argument` (larger than
  /// `endpoint_options::max_message`). Spaces: Host and Pinned; any other
  /// fails to compile.
  template <class T, class S>
  operation_awaitable send(view<T, S> v, op_options opts = {}) const noexcept {
    gdr::detail::tcp::check_space<S>();
    auto b = v.as_bytes();
    // The writer only reads through this pointer; one pointer type serves
    // both directions.
    return {conn_, operation_awaitable::kind::send, const_cast<std::byte*>(b.data()), b.size(), std::move(opts)};
  }

  /// Receives one message into `v`. Completes with the message's size.
  ///
  /// Errors: as `send`, plus `errc::truncated` (the message was larger than
  /// `v`: `v` holds its first `v.size_bytes()` bytes, the rest is dropped).
  template <class T, class S>
  operation_awaitable recv(view<T, S> v, op_options opts = {}) const noexcept {
    gdr::detail::tcp::check_space<S>();
    static_assert(!std::is_const_v<T>, "gdr::tcp::endpoint::recv: cannot receive into a view of const elements");
    auto b = v.as_bytes();
    return {conn_, operation_awaitable::kind::recv, b.data(), b.size(), std::move(opts)};
  }

  /// Writes `local` into the peer's registered memory at `remote` (at least
  /// as large). Completes with the byte count once the peer has written the
  /// bytes and acknowledged them.
  ///
  /// Errors: `errc::remote_access` (outside a registration, wrong key,
  /// revoked, or not writable: the peer wrote nothing), `errc::invalid_argument`
  /// (`local` larger than `remote`), and the errors of `send`.
  template <class T, class S, class U, class RS>
  operation_awaitable put(view<T, S> local, remote_view<U, RS> remote, op_options opts = {}) const noexcept {
    gdr::detail::tcp::check_space<S>();
    gdr::detail::tcp::check_space<RS>();
    static_assert(std::is_same_v<std::remove_const_t<T>, std::remove_const_t<U>>,
                  "gdr::tcp::endpoint::put: the local and remote element types differ");
    auto b = local.as_bytes();
    return {conn_,          operation_awaitable::kind::put, const_cast<std::byte*>(b.data()), b.size(),
            remote.address(), remote.size_bytes(), remote.key(), std::move(opts)};
  }

  /// Reads `local.size_bytes()` bytes of the peer's registered memory at
  /// `remote` (at least as large) into `local`. Errors as `put`, with read
  /// permission checked instead.
  template <class T, class S, class U, class RS>
  operation_awaitable get(view<T, S> local, remote_view<U, RS> remote, op_options opts = {}) const noexcept {
    gdr::detail::tcp::check_space<S>();
    gdr::detail::tcp::check_space<RS>();
    static_assert(!std::is_const_v<T>, "gdr::tcp::endpoint::get: cannot read into a view of const elements");
    static_assert(std::is_same_v<T, std::remove_const_t<U>>,
                  "gdr::tcp::endpoint::get: the local and remote element types differ");
    auto b = local.as_bytes();
    return {conn_,          operation_awaitable::kind::get, b.data(), b.size(),
            remote.address(), remote.size_bytes(), remote.key(), std::move(opts)};
  }

  /// Closes the connection in order: waits for the sends already started
  /// to be written, sends a close frame and ends the stream (FIN), then
  /// fails the operations still pending (receives, unanswered puts/gets)
  /// with `errc::closed`. The peer's pending operations fail with
  /// `errc::connection_lost` after it has received everything sent before.
  /// Completes once the socket is closed and the kernel holds no buffer of
  /// this endpoint. A timeout or stop aborts the flush (`errc::timed_out` /
  /// `errc::cancelled`). Closing a failed or closed endpoint succeeds.
  operation_awaitable close(op_options opts = {}) const noexcept {
    return {conn_, operation_awaitable::kind::close, nullptr, 0, std::move(opts)};
  }

  /// Holds a connection that has neither failed nor been closed.
  bool is_open() const noexcept { return conn_ != nullptr && !conn_->state_error(); }
  /// Why the endpoint stopped working (`errc::connection_lost`,
  /// `errc::protocol_error`, `errc::closed`), or no error while open.
  std::error_code error() const noexcept { return conn_ ? conn_->state_error() : std::error_code(errc::closed); }
  /// The path of the last successful operation.
  transfer_path last_path() const noexcept { return conn_ ? conn_->last_path() : transfer_path::none; }
  /// Counters of this endpoint.
  const endpoint_stats& stats() const noexcept {
    static const endpoint_stats none{};
    return conn_ ? conn_->stats() : none;
  }
  /// What the last protocol error was about (`frame_status::ok` if none).
  frame_status protocol_error_reason() const noexcept {
    return conn_ ? conn_->protocol_reason() : frame_status::ok;
  }
  /// The scheduler whose thread runs this endpoint.
  scheduler& get_scheduler() const noexcept { return conn_->sched(); }
  /// The socket (-1 once closed), for diagnostics such as `getsockopt`.
  int native_handle() const noexcept { return conn_ ? conn_->fd() : -1; }

 private:
  void reset() noexcept {
    if (conn_ != nullptr) std::exchange(conn_, nullptr)->abandon();
  }

  gdr::detail::tcp::connection* conn_ = nullptr;
};

}  // namespace gdr::tcp
