/// \file
/// `gdr::basic_endpoint<Transport>`: the one endpoint API every transport
/// shares (send, recv, put, get, close, and what happened), over the
/// protocol engine (`gdr/protocol/engine.hpp`); and `gdr::endpoint`, the
/// same API over a transport chosen at run time (a mesh whose peers are
/// reached by different transports).
///
/// The memory spaces an endpoint moves are checked at compile time against
/// the transport's rows of the path table: a combination no path supports
/// does not compile, with a message that says what to do instead.
///
/// \code
///   gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, "127.0.0.1:5000");
///   co_await ep.send(gdr::host_view(out));                 // tag 0
///   co_await ep.send(gdr::host_view(meta), gdr::tag{1});   // an independent stream
///   std::size_t n = co_await ep.recv(gdr::host_view(in));  // the next tag-0 message
///   gdr::op_report r = co_await ep.recv(gdr::host_view(in)).report();  // never throws
///   co_await ep.close();
/// \endcode
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>
#include <gdr/protocol/engine.hpp>
#include <gdr/protocol/options.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transfer/path.hpp>

namespace gdr {

class endpoint;

/// Awaitable of every endpoint operation: `co_await` gives the byte count
/// (0 for close) or throws `gdr::error`; `co_await std::move(op).as_result()`
/// gives `result<std::size_t>`; `co_await std::move(op).report()` gives an
/// `op_report`. Forgetting the `co_await` is a warning (`[[nodiscard]]`).
using op_awaitable = detail::proto::op;

namespace detail::proto {

template <class>
inline constexpr bool always_false = false;

/// The view behind an operation's argument: a view itself, or what a
/// buffer hands out.
template <class T, class S>
constexpr view<T, S> as_view(view<T, S> v) noexcept {
  return v;
}
template <class B>
  requires requires(B& b) { b.view(); }
constexpr auto as_view(B& b) noexcept {
  return b.view();
}

/// The GPU of a view of device memory (staged: at least 0, also for a view
/// that does not say), or -1 for host memory.
template <class T, class S>
constexpr int device_of(view<T, S> v) noexcept {
  if constexpr (space_traits<S>::on_device) {
    return v.device() < 0 ? 0 : v.device();
  } else {
    return -1;
  }
}

/// Awaitable of a remote atomic (`fetch_add`, `compare_swap`): `co_await`
/// gives the word's value before the operation, or throws `gdr::error`;
/// `co_await std::move(op).as_result()` gives `result<std::uint64_t>`. A
/// get of 8 bytes underneath, whose answer lands in the awaitable itself.
class atomic_op : public op {
 public:
  atomic_op(engine* e, std::uint64_t code, std::uint64_t a, std::uint64_t b, std::uint64_t raddr, std::size_t rsize,
            std::uint64_t rkey, op_options opts) noexcept
      : op(e, kind::get, nullptr, sizeof(std::uint64_t), raddr, rsize, rkey, std::move(opts)) {
    set_atomic(code, a, b);
  }
  atomic_op(atomic_op&& o) noexcept : op(std::move(o)), old_(o.old_) {}
  atomic_op& operator=(atomic_op&&) = delete;

  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    set_buffer(reinterpret_cast<std::byte*>(&old_));  // where it lives from now on
    return op::await_suspend(h);
  }
  /// The word's value before the operation. Throws `gdr::error`.
  std::uint64_t await_resume() {
    (void)op::await_resume();
    return old_;
  }
  /// The same, but `co_await` returns `result<std::uint64_t>`.
  [[nodiscard]] auto as_result() && noexcept {
    struct adapter : atomic_op {
      explicit adapter(atomic_op&& o) noexcept : atomic_op(std::move(o)) {}
      [[nodiscard]] result<std::uint64_t> await_resume() noexcept {
        if (std::error_code ec = this->make_report().error) return ec;
        return this->old_;
      }
    };
    return adapter{std::move(*this)};
  }

 private:
  alignas(8) std::uint64_t old_ = 0;
};

/// A view, or something that hands one out (`buffer<T, S>`): what the
/// endpoint operations take.
template <class V>
concept viewable = requires(V& v) {
  typename std::remove_cvref_t<decltype(gdr::detail::proto::as_view(v))>::space;
};

/// `remote_view`s have overloads of their own (they are not messages).
template <class X>
inline constexpr bool is_remote_view_v = false;
template <class T, class S>
inline constexpr bool is_remote_view_v<remote_view<T, S>> = true;

/// Neither a view nor a remote_view: what send and recv say instead of
/// "required type ...::space is invalid".
template <class V>
concept not_viewable = !viewable<V> && !is_remote_view_v<std::remove_cvref_t<V>>;

/// What an endpoint's set-up decided (`decide_paths`).
struct path_plan {
  /// Rows the forced path excludes (`engine::refuse_host`,
  /// `engine::refuse_device`): their operations fail with
  /// `errc::unsupported`, never downgraded.
  std::uint8_t refused = 0;
  /// Rows that do move bytes under the forced path.
  int usable = 0;
};

/// A transport's words for what a row does by message size (`path_decision::
/// sizes`), asked only when `GDR_LOG=path` logs the rows: a function and
/// its context, so that the rows' many instantiations share one logging
/// function (set-up code in every program that makes an endpoint).
struct size_note {
  const void* ctx = nullptr;
  std::string (*fn)(const void*, op_kind, bool device) = nullptr;

  size_note() noexcept = default;
  /// From any callable `std::string(op_kind, bool)`, which must outlive it.
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, size_note>)
  size_note(const F& f) noexcept  // NOLINT: implicit by design
      : ctx(&f), fn([](const void* c, op_kind k, bool d) { return (*static_cast<const F*>(c))(k, d); }) {}
};

/// Logs row `d` (GDR_LOG=path) with `note`'s words for it.
[[gnu::cold, gnu::noinline]] inline void log_row(path_decision& d, size_note note, op_kind k, bool device) {
  if (note.fn != nullptr) d.sizes = note.fn(note.ctx, k, device);
  log_path_decision(d);
}

/// A byte count as the logs write it: "256 KiB", "4 MiB", "32696 B".
inline std::string size_text(std::uint64_t n) {
  if (n != 0 && n % (std::uint64_t{1} << 20) == 0) return std::to_string(n >> 20) + " MiB";
  if (n != 0 && n % 1024 == 0) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " B";
}

/// The staged rows' note: chunk and bounce buffers, and where the protocol
/// switches from eager to rendezvous.
inline std::string staged_note(const protocol_options& o) {
  return "chunks of " + size_text(o.staging.chunk) + " through " + std::to_string(o.staging.depth) +
         " pinned bounce buffers per direction, each copy overlapping the next chunk's transfer; eager up to " +
         size_text(o.rendezvous_threshold) + " (one chunk at most), rendezvous above";
}

/// Decides one row at set-up (see `decide_paths`).
template <class Transport, class Op, class Local, class Remote>
void decide_row(force_path force, const char* who, path_plan& plan, std::error_code& probe_error,
                size_note note = {}) {
  if constexpr (select_path_v<Transport, Op, Local, Remote> != path_kind::unsupported) {
    constexpr bool device = space_traits<Local>::on_device || space_traits<Remote>::on_device;
    result<path_decision> d = decide_path<Transport, Op, Local, Remote>(force);
    if (!d) {
      // A probe that says no fails the set-up; a row that does not offer
      // the forced path is refused.
      if (select_path_v<Transport, Op, Local, Remote> == path_kind::probed && force != force_path::staged) {
        if (!probe_error) probe_error = d.error();
      }
      plan.refused |= device ? engine::refuse_device : engine::refuse_host;
      return;
    }
    ++plan.usable;
    d->endpoint = who;
    if (path_log_enabled()) log_row(*d, note, Op::kind, device);
  }
}

/// An endpoint's set-up: decides the path of every row of the table it
/// serves (sends and receives of each local space, puts and gets between
/// each pair of spaces) under `force`, and logs each decision
/// (`GDR_LOG=path`). Rows that cannot honour `force` are refused (their
/// operations fail with `errc::unsupported`: never a downgrade). Fails
/// (`errc::unsupported`, or a probe's error) when a probe says no or when
/// no row is left: the endpoint is then not made. `who` names the endpoint
/// in the log.
template <class Transport>
result<path_plan> decide_paths(force_path force, const char* who, size_note note = {}) {
  path_plan plan;
  std::error_code probe_error;
  auto rows = [&]<class S>() {
    decide_row<Transport, gdr::op::send, S, AnySpace>(force, who, plan, probe_error, note);
    decide_row<Transport, gdr::op::recv, S, AnySpace>(force, who, plan, probe_error, note);
    auto remote = [&]<class R>() {
      decide_row<Transport, gdr::op::put, S, R>(force, who, plan, probe_error, note);
      decide_row<Transport, gdr::op::get, S, R>(force, who, plan, probe_error, note);
    };
    remote.template operator()<Host>();
    remote.template operator()<Pinned>();
    remote.template operator()<Device>();
  };
  rows.template operator()<Host>();
  rows.template operator()<Pinned>();
  rows.template operator()<Device>();
  if (probe_error) return probe_error;
  if (plan.usable == 0) return errc::unsupported;
  return plan;
}

}  // namespace detail::proto

/// One connected endpoint of transport `Transport` (see the file comment).
/// Move-only. Made by the transport (`tcp::connect`, `listener::accept`,
/// `loopback::make_pair`).
///
/// Destroying an open endpoint aborts its connection (pending operations
/// fail with `errc::closed`) and is safe at any time; the connection frees
/// itself once its transport is quiet. `co_await ep.close()` ends it in
/// order.
///
/// Thread-safety: operations are started and awaited on the endpoint's
/// scheduler's thread and resume there; `stats()` and `last_path()`
/// likewise. Stop requests may come from any thread. An operation awaited
/// on another thread fails at once with `errc::unsupported`, in every build,
/// and touches nothing of the endpoint (one comparison of the thread's
/// scheduler with the endpoint's, on every operation).
template <class Transport>
class basic_endpoint {
 public:
  /// The counters type of this transport.
  using stats_type = typename Transport::stats_type;

  /// An endpoint with no connection (what a moved-from one is): `is_open()`
  /// is false, and every operation on it (`close` too) fails with
  /// `errc::closed`, in every build.
  basic_endpoint() noexcept = default;
  /// Takes over engine `e` (made by the transport).
  explicit basic_endpoint(detail::proto::engine* e) noexcept : eng_(e) {}

  basic_endpoint(basic_endpoint&& o) noexcept : eng_(std::exchange(o.eng_, nullptr)) {}
  basic_endpoint& operator=(basic_endpoint&& o) noexcept {
    if (this != &o) {
      reset();
      eng_ = std::exchange(o.eng_, nullptr);
    }
    return *this;
  }
  basic_endpoint(const basic_endpoint&) = delete;
  basic_endpoint& operator=(const basic_endpoint&) = delete;
  ~basic_endpoint() { reset(); }

  /// Sends `v` (a view or a buffer) as one message of tag `t`. Completes
  /// with `v`'s size once `v` may be reused: the message is in the
  /// transport (eager) or has been written out (rendezvous, after the
  /// receiver's receive was posted).
  ///
  /// Errors: `errc::closed`, `errc::connection_lost`, `errc::peer_closed`,
  /// `errc::protocol_error`, `errc::message_too_large` (over the peer's
  /// limit; nothing sent), `errc::cancelled` / `errc::timed_out` (only while
  /// not committed: see `gdr/protocol/engine.hpp`).
  template <detail::proto::viewable V>
  [[nodiscard]] op_awaitable send(V&& v, tag t, op_options opts = {}) const noexcept {
    auto w = detail::proto::as_view(v);
    require_path<Transport, op::send, typename decltype(w)::space>();
    auto b = w.as_bytes();
    // The engine only reads through a send's pointer.
    op_awaitable o{eng_, op_awaitable::kind::send, const_cast<std::byte*>(b.data()), b.size(),
                   static_cast<std::uint64_t>(t), std::move(opts)};
    o.set_spaces(detail::proto::device_of(w), false);
    return o;
  }
  /// Sends `v` as one message of tag 0.
  template <detail::proto::viewable V>
  [[nodiscard]] op_awaitable send(V&& v, op_options opts = {}) const noexcept {
    return send(std::forward<V>(v), tag{0}, std::move(opts));
  }

  /// Receives the next message of tag `t` into `v`. Completes with the
  /// message's size.
  ///
  /// Errors: as `send`, plus `errc::truncated` (the message was larger than
  /// `v`: `v` holds its first bytes; the error's text and `.report()` say
  /// how large it was).
  template <detail::proto::viewable V>
  [[nodiscard]] op_awaitable recv(V&& v, tag t, op_options opts = {}) const noexcept {
    auto w = detail::proto::as_view(v);
    using W = decltype(w);
    require_path<Transport, op::recv, typename W::space>();
    static_assert(!std::is_const_v<typename W::element_type>,
                  "gdr endpoint recv: cannot receive into a view of const elements");
    auto b = w.as_bytes();
    op_awaitable o{eng_, op_awaitable::kind::recv, b.data(), b.size(), static_cast<std::uint64_t>(t),
                   std::move(opts)};
    o.set_spaces(detail::proto::device_of(w), false);
    return o;
  }
  /// Receives the next message of tag 0 into `v`.
  template <detail::proto::viewable V>
  [[nodiscard]] op_awaitable recv(V&& v, op_options opts = {}) const noexcept {
    return recv(std::forward<V>(v), tag{0}, std::move(opts));
  }

  /// Anything else (a `std::vector`, a pointer, a span) is not a view: the
  /// endpoint moves memory whose space it knows.
  template <detail::proto::not_viewable V, class... A>
  op_awaitable send(V&&, A&&...) const noexcept {
    static_assert(detail::proto::always_false<V>,
                  "gdr endpoint: ep.send(x) takes a gdr::view or a gdr::buffer, which say which memory space the "
                  "bytes are in; x is neither. For host memory (a std::vector, std::array or std::span) make a "
                  "view with gdr::host_view(x); for pinned or device memory allocate a gdr::buffer<T, Space> and "
                  "pass it (or its .view()).");
    return {nullptr, op_awaitable::kind::send, nullptr, 0, 0, {}};
  }
  template <detail::proto::not_viewable V, class... A>
  op_awaitable recv(V&&, A&&...) const noexcept {
    static_assert(detail::proto::always_false<V>,
                  "gdr endpoint: ep.recv(x) takes a gdr::view or a gdr::buffer, which say which memory space the "
                  "bytes go to; x is neither. For host memory (a std::vector, std::array or std::span) make a "
                  "view with gdr::host_view(x); for pinned or device memory allocate a gdr::buffer<T, Space> and "
                  "pass it (or its .view()).");
    return {nullptr, op_awaitable::kind::recv, nullptr, 0, 0, {}};
  }

  /// A `remote_view` names the peer's memory: it cannot be sent or
  /// received as a message.
  template <class T, class S, class... A>
  op_awaitable send(remote_view<T, S>, A&&...) const noexcept {
    static_assert(detail::proto::always_false<T>,
                  "gdr endpoint: ep.send(remote_view) - a remote_view names the peer's registered memory and "
                  "cannot be sent as a message. Write into it with co_await ep.put(local_view, remote) or read "
                  "it with co_await ep.get(local_view, remote).");
    return {nullptr, op_awaitable::kind::send, nullptr, 0, 0, {}};
  }
  template <class T, class S, class... A>
  op_awaitable recv(remote_view<T, S>, A&&...) const noexcept {
    static_assert(detail::proto::always_false<T>,
                  "gdr endpoint: ep.recv(remote_view) - a remote_view names the peer's registered memory and "
                  "cannot receive a message. Read it with co_await ep.get(local_view, remote).");
    return {nullptr, op_awaitable::kind::recv, nullptr, 0, 0, {}};
  }

  /// Writes `local` into the peer's registered memory at `remote` (at least
  /// as large). Completes with the byte count once the peer has placed the
  /// bytes and acknowledged them.
  ///
  /// Errors: `errc::remote_access` (outside a registration, wrong key,
  /// revoked, or not writable: the peer wrote nothing), `errc::invalid_argument`
  /// (`local` larger than `remote`), and the errors of `send`.
  template <detail::proto::viewable V, class U, class RS>
  [[nodiscard]] op_awaitable put(V&& local, remote_view<U, RS> remote, op_options opts = {}) const noexcept {
    auto w = detail::proto::as_view(local);
    using W = decltype(w);
    require_path<Transport, op::put, typename W::space, RS>();
    static_assert(std::is_same_v<std::remove_const_t<typename W::element_type>, std::remove_const_t<U>>,
                  "gdr endpoint put: the local and remote element types differ");
    auto b = w.as_bytes();
    op_awaitable o{eng_,          op_awaitable::kind::put, const_cast<std::byte*>(b.data()), b.size(),
                   remote.address(), remote.size_bytes(), remote.key(), std::move(opts)};
    o.set_spaces(detail::proto::device_of(w), space_traits<RS>::on_device);
    o.set_nic(remote.nic_keys());
    return o;
  }

  /// Reads `local`'s size of the peer's registered memory at `remote` (at
  /// least as large) into `local`. Errors as `put`, with read permission
  /// checked instead.
  template <detail::proto::viewable V, class U, class RS>
  [[nodiscard]] op_awaitable get(V&& local, remote_view<U, RS> remote, op_options opts = {}) const noexcept {
    auto w = detail::proto::as_view(local);
    using W = decltype(w);
    require_path<Transport, op::get, typename W::space, RS>();
    static_assert(!std::is_const_v<typename W::element_type>,
                  "gdr endpoint get: cannot read into a view of const elements");
    static_assert(std::is_same_v<typename W::element_type, std::remove_const_t<U>>,
                  "gdr endpoint get: the local and remote element types differ");
    auto b = w.as_bytes();
    op_awaitable o{eng_,          op_awaitable::kind::get, b.data(), b.size(), remote.address(), remote.size_bytes(),
                   remote.key(), std::move(opts)};
    o.set_spaces(detail::proto::device_of(w), space_traits<RS>::on_device);
    o.set_nic(remote.nic_keys());
    o.set_owner_checked(remote.owner_checked());
    return o;
  }

  /// A put that also tells the owner: `value` arrives with the bytes, and
  /// the owner's `co_await ep.notification()` gives it once they are in
  /// place (verbs: one RDMA WRITE with immediate). Needs a view the
  /// endpoint's NIC reaches directly (memory a verbs peer exposed); else
  /// `errc::unsupported`. Errors otherwise as `put`.
  template <detail::proto::viewable V, class U, class RS>
  [[nodiscard]] op_awaitable put_notify(V&& local, remote_view<U, RS> remote, std::uint32_t value,
                                        op_options opts = {}) const noexcept {
    op_awaitable o = put(local, remote, std::move(opts));
    o.set_notify(value);
    return o;
  }

  /// Moves a list of blocks in one operation, with one completion: block
  /// `i` is `blocks[i].bytes` bytes from byte `blocks[i].local` of `local`
  /// to byte `blocks[i].remote` of `remote` (the hand-off of a KV cache:
  /// hundreds of blocks of a pool). Every block is checked against both
  /// views before anything moves (`errc::invalid_argument`). The blocks
  /// array must stay alive until the operation completes. Needs a view the
  /// endpoint's NIC reaches directly (verbs: chained RDMA WRITEs); else
  /// `errc::unsupported`. Completes with the bytes moved.
  template <detail::proto::viewable V, class U, class RS>
  [[nodiscard]] op_awaitable put_batch(V&& local, remote_view<U, RS> remote, std::span<const block> blocks,
                                       op_options opts = {}) const noexcept {
    op_awaitable o = put(local, remote, std::move(opts));
    o.set_batch(blocks.data(), blocks.size());
    return o;
  }
  /// The same from `remote` into `local` (chained RDMA READs).
  template <detail::proto::viewable V, class U, class RS>
  [[nodiscard]] op_awaitable get_batch(V&& local, remote_view<U, RS> remote, std::span<const block> blocks,
                                       op_options opts = {}) const noexcept {
    op_awaitable o = get(local, remote, std::move(opts));
    o.set_batch(blocks.data(), blocks.size());
    return o;
  }

  /// Completes once every direct one-sided operation this side started
  /// before it has completed at the peer (remote completion, as UCX's
  /// flush): on verbs a zero-length RDMA WRITE after them, which RC
  /// completes only after every earlier one. A served put completes only
  /// once the owner has placed its bytes, so where nothing is direct it
  /// completes at once.
  [[nodiscard]] op_awaitable flush(op_options opts = {}) const noexcept {
    op_awaitable o{eng_, op_awaitable::kind::put, nullptr, 0, 0, 0, 0, std::move(opts)};
    o.set_flush();
    return o;
  }

  /// Adds `value` to the 8-byte word at `remote` (its first element: an
  /// address that is a multiple of 8, in the peer's registered host
  /// memory, readable and writable) atomically, and gives the word's value
  /// before. The peer's loop does it (with `std::atomic_ref`), atomic
  /// against every other initiator's atomics on that word and the owner's
  /// own `std::atomic_ref` on it; a plain put racing it is not.
  ///
  /// Errors: `errc::invalid_argument` (an address not a multiple of 8),
  /// `errc::remote_access` (outside a registration, wrong key, revoked,
  /// not readable and writable, or Device memory: nothing changed), and the
  /// errors of `send`.
  template <class RS>
  [[nodiscard]] detail::proto::atomic_op fetch_add(remote_view<std::uint64_t, RS> remote, std::uint64_t value,
                                                   op_options opts = {}) const noexcept {
    static_assert(!space_traits<RS>::on_device,
                  "gdr remote atomics: the word must be in the peer's host memory (Host or Pinned): a CPU does the "
                  "atomic, and no CPU may touch Device memory");
    detail::proto::atomic_op o{eng_,           detail::proto::atomic_fetch_add, value, 0, remote.address(),
                               remote.size_bytes(), remote.key(),  std::move(opts)};
    o.set_nic(remote.nic_keys());
    return o;
  }

  /// Replaces the 8-byte word at `remote` with `desired` if it holds
  /// `expected`, atomically, and gives the word's value before (equal to
  /// `expected` when it swapped). Rules and errors as `fetch_add`.
  template <class RS>
  [[nodiscard]] detail::proto::atomic_op compare_swap(remote_view<std::uint64_t, RS> remote, std::uint64_t expected,
                                                      std::uint64_t desired, op_options opts = {}) const noexcept {
    static_assert(!space_traits<RS>::on_device,
                  "gdr remote atomics: the word must be in the peer's host memory (Host or Pinned): a CPU does the "
                  "atomic, and no CPU may touch Device memory");
    detail::proto::atomic_op o{eng_,           detail::proto::atomic_compare_swap, expected, desired, remote.address(),
                               remote.size_bytes(), remote.key(),  std::move(opts)};
    o.set_nic(remote.nic_keys());
    return o;
  }

  /// Closes the endpoint in order: waits for the sends already started to go
  /// out (a rendezvous send until the peer's receive has taken it; a send
  /// waiting for the peer's handshake until it arrived), tells the peer,
  /// then fails what is still pending (receives, unanswered puts and gets)
  /// with `errc::closed`. The peer's pending operations fail with
  /// `errc::peer_closed` after it has received everything sent before.
  /// Completes once the transport holds nothing of this endpoint. A timeout
  /// or stop aborts the flush (`errc::timed_out` / `errc::cancelled`).
  /// Closing a failed or closed endpoint succeeds (one that holds no
  /// connection has nothing to close: `errc::closed`).
  [[nodiscard]] op_awaitable close(op_options opts = {}) const noexcept {
    return {eng_, op_awaitable::kind::close, nullptr, 0, 0, std::move(opts)};
  }

  /// Holds a connection that has neither failed nor been closed.
  bool is_open() const noexcept { return eng_ != nullptr && !eng_->state_error(); }
  /// Why the endpoint stopped working (`errc::connection_lost`,
  /// `errc::peer_closed`, `errc::protocol_error`, `errc::closed`), or no
  /// error while open.
  std::error_code error() const noexcept { return eng_ ? eng_->state_error() : std::error_code(errc::closed); }
  /// The path of the last successful operation.
  transfer_path last_path() const noexcept { return eng_ ? eng_->last_path() : transfer_path::none; }
  /// Counters of this endpoint.
  const stats_type& stats() const noexcept {
    static const stats_type none{};
    return eng_ ? static_cast<const stats_type&>(eng_->pstats()) : none;
  }
  /// The scheduler whose thread runs this endpoint. Only for one that holds
  /// a connection (failed or not), not a default-constructed or moved-from one.
  scheduler& get_scheduler() const noexcept { return eng_->sched(); }
  /// The peer as the transport names it ("10.0.0.2:4791" for TCP), for
  /// messages and logs.
  std::string peer_name() const { return eng_ ? eng_->peer_name() : std::string("(none)"); }
  /// Bounce buffers of the staged path checked out now (sending, receiving):
  /// both zero when no staged transfer is in flight.
  std::pair<std::size_t, std::size_t> bounce_buffers_in_use() const noexcept {
    return eng_ ? eng_->bounce_in_use() : std::pair<std::size_t, std::size_t>{0, 0};
  }
  /// The protocol engine's inner state in one line (each waiting
  /// operation's list and stage, who holds each bounce buffer, the
  /// credits): for diagnosing a stall, not a stable format.
  std::string debug_state() const { return eng_ ? eng_->describe() : std::string("(no connection)"); }
  /// The largest message the peer accepts (0 until its handshake arrived).
  std::uint64_t peer_max_message() const noexcept { return eng_ ? eng_->peer_max_message() : 0; }

 protected:
  detail::proto::engine* engine_ptr() const noexcept { return eng_; }
  detail::proto::engine* release() noexcept { return std::exchange(eng_, nullptr); }

 private:
  template <class>
  friend class basic_endpoint;
  friend class endpoint;

  void reset() noexcept {
    if (eng_ != nullptr) std::exchange(eng_, nullptr)->abandon();
  }

  detail::proto::engine* eng_ = nullptr;
};

/// The tag of a transport chosen at run time (`gdr::endpoint`): it moves
/// what every transport moves (host memory).
struct any_transport {
  static constexpr const char* name = "any";
  using stats_type = protocol_stats;
};

template <>
inline constexpr const char* transport_name_v<any_transport> = "any";

template <class Op, class Local, class Remote>
struct path_table<any_transport, Op, Local, Remote>
    : detail::cpu_transport_rows<any_transport, Op, Local, Remote> {};

/// An endpoint whose transport was chosen at run time: made from any
/// transport's endpoint (`gdr::endpoint e = std::move(tcp_ep);`), with the
/// same operations and rules. Memory spaces are checked against what every
/// transport moves (Host and Pinned).
class endpoint : public basic_endpoint<any_transport> {
 public:
  endpoint() noexcept = default;
  /// Takes over `o`'s connection.
  template <class Transport>
  endpoint(basic_endpoint<Transport>&& o) noexcept  // NOLINT: implicit by design
      : basic_endpoint<any_transport>(o.release()) {}
};

}  // namespace gdr
