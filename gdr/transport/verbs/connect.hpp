/// \file
/// Connection set-up through librdmacm, by IP address and port:
/// `verbs::connect` (active side) and `verbs::listener` (passive side).
///
/// Each step waits for its rdma_cm event without blocking the scheduler: an
/// event channel's descriptor is non-blocking and watched by an io_uring
/// poll. The active side binds its source address explicitly (an rdma_cm
/// id that is not bound picks a device by routing, which on a host with
/// several RDMA devices, or two rxe devices on one veth pair, may be the
/// wrong one).
///
/// Each side posts its receive buffers before the connection is
/// established and tells the peer how many there are, and how large, in
/// rdma_cm's private data (`detail::verbs::conn_params`).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <gdr/coro/cancel.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/timeout.hpp>
#include <gdr/error.hpp>
#include <gdr/log.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/uring_op.hpp>
#include <gdr/transfer/address.hpp>
#include <gdr/transport/verbs/connection.hpp>
#include <gdr/transport/verbs/endpoint.hpp>

namespace gdr::verbs {

/// An IP address and port ("10.0.0.1:7471", "[fe80::1]:7471"):
/// `gdr::address`, which TCP's endpoints use too.
using address = gdr::address;

namespace detail {

/// Awaits readability of a descriptor through the scheduler's ring.
class fd_readable : public gdr::detail::uring_awaitable<fd_readable, void> {
 public:
  fd_readable(scheduler& s, int fd) noexcept : uring_awaitable(s), fd_(fd) {}
  void prepare(io_uring_sqe* sqe) noexcept { io_uring_prep_poll_add(sqe, fd_, POLLIN); }
  result<void> finish() noexcept { return uring_error(res_ < 0 ? res_ : 0); }

 private:
  int fd_;
};

/// An rdma_cm event, copied out before it is acknowledged.
struct cm_event {
  rdma_cm_event_type type{};
  int status = 0;
  rdma_cm_id* id = nullptr;
  gdr::detail::verbs::conn_params peer{};
  bool has_params = false;
};

inline int set_nonblocking(int fd) noexcept {
  int fl = ::fcntl(fd, F_GETFL);
  return fl < 0 ? -1 : ::fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/// The next event of channel `ch`.
// The coroutines below are templates: gcc emits every non-template
// inline coroutine in each unit that sees it (benchmarks/compile_cost.sh).
template <class = void>
inline task<result<cm_event>> next_event(scheduler& s, rdma_event_channel* ch) {
  for (;;) {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ch, &ev) == 0) {
      cm_event e;
      e.type = ev->event;
      e.status = ev->status;
      e.id = ev->id;
      const auto& c = ev->param.conn;
      if (c.private_data != nullptr && c.private_data_len >= sizeof(e.peer)) {
        std::memcpy(&e.peer, c.private_data, sizeof(e.peer));
        e.has_params = true;
      }
      rdma_ack_cm_event(ev);
      co_return e;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) co_return errno_code(errno);
    result<void> r = co_await fd_readable(s, ch->fd).as_result();
    if (!r) co_return r.error();
  }
}

/// The set-up's failure when `step` got event `e` instead of the one it
/// waited for (and a line saying so).
inline std::error_code unexpected_event(const cm_event& e, const char* step) noexcept {
  gdr::detail::log("verbs", "%s: got %s (status %d)", step, rdma_event_str(e.type), e.status);
  switch (e.type) {
    case RDMA_CM_EVENT_REJECTED: return errno_code(ECONNREFUSED);
    case RDMA_CM_EVENT_UNREACHABLE: return errno_code(EHOSTUNREACH);
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_ERROR: return errno_code(e.status < 0 ? -e.status : EHOSTUNREACH);
    default: return errc::connection_lost;
  }
}

/// Waits for event `want` on `ch`; any other is the set-up's failure.
template <class = void>
inline task<result<cm_event>> expect(scheduler& s, rdma_event_channel* ch, rdma_cm_event_type want, const char* step) {
  result<cm_event> e = co_await next_event(s, ch);
  if (!e) co_return e.error();
  if (e->type != want) co_return unexpected_event(*e, step);
  co_return e;
}

/// The connection parameters rdma_cm carries for us.
inline rdma_conn_param conn_param(const gdr::detail::verbs::conn_params& mine, const endpoint_options& o) noexcept {
  rdma_conn_param p{};
  p.private_data = &mine;
  p.private_data_len = sizeof(mine);
  p.responder_resources = 1;
  p.initiator_depth = 1;
  p.retry_count = std::min<std::uint8_t>(o.retry_count, 7);
  p.rnr_retry_count = 7;  // credits keep the receiver ready; 7 = retry without limit
  return p;
}

inline std::error_code apply_id_options(rdma_cm_id* id, const endpoint_options& o) noexcept {
  std::uint8_t t = o.ack_timeout;
  if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof t) != 0) return errno_code(errno);
  return {};
}

/// Makes the connection on a resolved id, or fails. On failure nothing is
/// left but `id` and `ch` (which the caller destroys).
inline result<gdr::detail::verbs::connection*> make_connection(scheduler& s, rdma_cm_id* id, rdma_event_channel* ch,
                                                                 memory_registry& reg, const endpoint_options& o) {
  try {
    return new gdr::detail::verbs::connection(s, id, ch, reg, o, gdr::detail::proto::caps::host);
  } catch (const gdr::error& e) {
    return e.code();
  } catch (const std::bad_alloc&) {
    return errno_code(ENOMEM);
  }
}

}  // namespace detail

namespace detail {

/// `verbs::connect` once its addresses are parsed (by value: the task is
/// lazy, and the strings they came from may be gone when it starts).
template <class = void>
inline task<endpoint> connect_parsed(scheduler& s, result<address> dst, result<address> src, memory_registry& registry,
                                     endpoint_options opts) {
  if (!dst) throw gdr::error(dst.error(), "gdr::verbs::connect: destination address");
  if (!src) throw gdr::error(src.error(), "gdr::verbs::connect: source address");
  rdma_event_channel* ch = rdma_create_event_channel();
  if (ch == nullptr) throw gdr::error(errno_code(errno), "gdr::verbs::connect: rdma_create_event_channel");
  rdma_cm_id* id = nullptr;
  auto cleanup = [&] {
    if (id != nullptr) rdma_destroy_id(id);
    rdma_destroy_event_channel(ch);
  };
  if (detail::set_nonblocking(ch->fd) != 0 || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) {
    std::error_code ec = errno_code(errno);
    cleanup();
    throw gdr::error(ec, "gdr::verbs::connect: rdma_create_id");
  }
  std::error_code ec;
  const char* step = "";
  // Explicit source: the device that owns `from` carries the connection.
  if (rdma_resolve_addr(id, const_cast<sockaddr*>(src->native()), const_cast<sockaddr*>(dst->native()), 2000) != 0) {
    ec = errno_code(errno);
    step = "rdma_resolve_addr";
  } else if (result<detail::cm_event> e = co_await detail::expect(s, ch, RDMA_CM_EVENT_ADDR_RESOLVED, "resolve address"); !e) {
    ec = e.error();
    step = "address resolution";
  } else if ((ec = detail::apply_id_options(id, opts))) {
    step = "rdma_set_option";
  } else if (rdma_resolve_route(id, 2000) != 0) {
    ec = errno_code(errno);
    step = "rdma_resolve_route";
  } else if (result<detail::cm_event> r = co_await detail::expect(s, ch, RDMA_CM_EVENT_ROUTE_RESOLVED, "resolve route"); !r) {
    ec = r.error();
    step = "route resolution";
  }
  if (ec) {
    cleanup();
    throw gdr::error(ec, std::string("gdr::verbs::connect: ") + step);
  }
  std::string who = dst->to_string();
  result<std::uint8_t> refused = endpoint::decide(opts, id->verbs, who.c_str());
  if (!refused) {
    std::string why = endpoint::decide_reason(opts, id->verbs);  // while id (and its device) lives
    cleanup();
    throw gdr::error(refused.error(), why);
  }
  result<gdr::detail::verbs::connection*> c = detail::make_connection(s, id, ch, registry, opts);
  if (!c) {
    cleanup();
    throw gdr::error(c.error(), "gdr::verbs::connect: queue pair");
  }
  (*c)->set_refused(*refused);
  // From here the connection owns id and ch.
  gdr::detail::verbs::conn_params mine = (*c)->params();
  rdma_conn_param p = detail::conn_param(mine, opts);
  if (rdma_connect(id, &p) != 0) {
    ec = errno_code(errno);
    (*c)->discard();
    throw gdr::error(ec, "gdr::verbs::connect: rdma_connect");
  }
  result<detail::cm_event> est = co_await detail::next_event(s, ch);
  // The peer's parameters come with its acceptance, or with its rejection
  // when the two ends disagree (the listener says so in its private data).
  if (est && est->has_params && gdr::detail::verbs::params_ok(est->peer)) {
    if (const char* why = gdr::detail::verbs::params_disagree(mine, est->peer)) {
      (*c)->discard();
      throw gdr::error(errc::gpudirect_unavailable, why);
    }
  }
  if (est && est->type != RDMA_CM_EVENT_ESTABLISHED) est = detail::unexpected_event(*est, "connect");
  if (!est || !est->has_params || !gdr::detail::verbs::params_ok(est->peer)) {
    (*c)->discard();
    throw gdr::error(est ? std::error_code(errc::protocol_error) : est.error(), "gdr::verbs::connect: establishing");
  }
  (*c)->start(est->peer);
  co_return endpoint(*c);
}

}  // namespace detail

namespace detail {

/// Runs the set-up `t` under `o`, as TCP's connect and accept are: its
/// stop token as well as the caller's cancels it, and its timeout ends it
/// with `errc::timed_out` (every step waits on the event channel through
/// the scheduler's ring, so a stop reaches whichever step is waiting, and
/// the step cleans up what it made).
template <class T>
task<T> bounded(task<T> t, op_options o) {
  if (o.stop.stop_possible()) {
    linked_stop_source src(co_await this_stop_token);
    std::stop_callback relay(o.stop, [&src]() noexcept { src.request_stop(); });
    if (o.timeout.count() > 0) co_return co_await with_stop_token(src.get_token(), with_timeout(o.timeout, std::move(t)));
    co_return co_await with_stop_token(src.get_token(), std::move(t));
  }
  if (o.timeout.count() > 0) co_return co_await with_timeout(o.timeout, std::move(t));
  co_return co_await std::move(t);
}

}  // namespace detail

/// Connects to `to` from the local address `from` (its port 0: any), both
/// IP addresses of an RDMA device (RoCE: of the device's network
/// interface). Returns the endpoint once rdma_cm has established the
/// connection. Throws `gdr::error`: the rdma_cm step's errno
/// (`ECONNREFUSED` when nobody listens yet: retry), `errc::no_device`,
/// `errc::gpudirect_unavailable` (asked for GPUDirect and the probe said no).
/// Both strings are read here, when the task is made: they need not outlive
/// it (`connect(s, where, host + ":0")` is fine).
///
/// \code
///   gdr::verbs::endpoint ep = co_await gdr::verbs::connect(sched, "10.0.0.2:7471", "10.0.0.1:0");
/// \endcode
template <class = void>
inline task<endpoint> connect(scheduler& s, std::string_view to, std::string_view from,
                              memory_registry& registry = default_registry(), endpoint_options opts = {}) {
  return detail::connect_parsed(s, address::parse(to), address::parse(from), registry, std::move(opts));
}

/// The same, bounded by `o` as `tcp::connect` is: `o.timeout` ends it with
/// `errc::timed_out` (nobody listening answers at once with `ECONNREFUSED`;
/// a peer that does not answer takes up to rdma_cm's own limits without
/// one), `o.stop` cancels it (`errc::cancelled`).
///
/// \code
///   auto ep = co_await gdr::verbs::connect(sched, "10.0.0.2:7471", "10.0.0.1:0", {5s});
/// \endcode
template <class = void>
inline task<endpoint> connect(scheduler& s, std::string_view to, std::string_view from, op_options o,
                              memory_registry& registry = default_registry(), endpoint_options opts = {}) {
  return detail::bounded(connect(s, to, from, registry, std::move(opts)), std::move(o));
}

/// Accepts connections on an IP address and port of an RDMA device.
/// Move-only; destroy it before its scheduler.
class listener {
 public:
  /// Binds and listens on `at` ("10.0.0.1:7471"; port 0 picks a free one).
  /// Endpoints it accepts serve one-sided requests from `registry` and are
  /// tuned by `opts`. Throws `gdr::error`.
  listener(scheduler& s, std::string_view at, memory_registry& registry = default_registry(),
           const endpoint_options& opts = {})
      : sched_(&s), registry_(&registry), opts_(opts) {
    result<address> a = address::parse(at);
    if (!a) throw gdr::error(a.error(), "gdr::verbs::listener: address");
    ch_ = rdma_create_event_channel();
    if (ch_ == nullptr) throw gdr::error(errno_code(errno), "gdr::verbs::listener: rdma_create_event_channel");
    if (detail::set_nonblocking(ch_->fd) != 0 || rdma_create_id(ch_, &id_, nullptr, RDMA_PS_TCP) != 0 ||
        rdma_bind_addr(id_, const_cast<sockaddr*>(a->native())) != 0 || rdma_listen(id_, 64) != 0) {
      std::error_code ec = errno_code(errno);
      close();
      throw gdr::error(ec, "gdr::verbs::listener: bind and listen");
    }
  }
  listener(listener&& o) noexcept
      : sched_(o.sched_), registry_(o.registry_), opts_(o.opts_), ch_(std::exchange(o.ch_, nullptr)),
        id_(std::exchange(o.id_, nullptr)) {}
  listener& operator=(listener&&) = delete;
  ~listener() { close(); }

  /// The port it listens on (the one the kernel chose for port 0): what a
  /// peer passes to `connect` with this side's address.
  std::uint16_t port() const noexcept { return id_ != nullptr ? ntohs(rdma_get_src_port(id_)) : 0; }

  /// The next connection, established. Throws `gdr::error`. `o.timeout`
  /// bounds the wait (`errc::timed_out`), `o.stop` cancels it
  /// (`errc::cancelled`), as `tcp::listener::accept`'s do; a connection
  /// request not yet taken when either fires stays for the next accept.
  task<endpoint> accept(op_options o = {}) { return detail::bounded(accept_one(), std::move(o)); }

 private:
  template <class = void>
  task<endpoint> accept_one() {
    for (;;) {
      result<detail::cm_event> req = co_await detail::next_event(*sched_, ch_);
      if (!req) throw gdr::error(req.error(), "gdr::verbs::listener::accept");
      if (req->type != RDMA_CM_EVENT_CONNECT_REQUEST) continue;
      rdma_cm_id* id = req->id;
      if (!req->has_params || !gdr::detail::verbs::params_ok(req->peer)) {
        rdma_reject(id, nullptr, 0);
        rdma_destroy_id(id);
        continue;
      }
      // The connection's events go to a channel of its own.
      rdma_event_channel* ch = rdma_create_event_channel();
      if (ch == nullptr || detail::set_nonblocking(ch->fd) != 0 || rdma_migrate_id(id, ch) != 0) {
        std::error_code ec = errno_code(errno);
        rdma_reject(id, nullptr, 0);
        rdma_destroy_id(id);
        if (ch != nullptr) rdma_destroy_event_channel(ch);
        throw gdr::error(ec, "gdr::verbs::listener::accept: event channel");
      }
      gdr::detail::verbs::conn_params flags;  // what this side would say about GPUDirect
      if (opts_.gpudirect) flags.flags |= gdr::detail::verbs::conn_params::flag_gpudirect;
      if (const char* why = gdr::detail::verbs::params_disagree(flags, req->peer)) {
        // Refused with this side's parameters, so that the peer says why too.
        flags.rx_depth = req->peer.rx_depth;
        flags.buffer_size = req->peer.buffer_size;
        rdma_reject(id, &flags, sizeof flags);
        rdma_destroy_id(id);
        rdma_destroy_event_channel(ch);
        throw gdr::error(errc::gpudirect_unavailable, why);
      }
      std::error_code ec = detail::apply_id_options(id, opts_);
      std::string who = "accepted";
      std::uint8_t refused = 0;
      if (!ec) {
        result<std::uint8_t> d = endpoint::decide(opts_, id->verbs, who.c_str());
        if (d) refused = *d;
        else ec = d.error();
      }
      if (ec) {
        std::string why = ec == errc::gpudirect_unavailable || ec == errc::unsupported
                              ? endpoint::decide_reason(opts_, id->verbs)
                              : std::string("gdr::verbs::listener::accept");
        rdma_reject(id, nullptr, 0);
        rdma_destroy_id(id);
        rdma_destroy_event_channel(ch);
        throw gdr::error(ec, why);
      }
      result<gdr::detail::verbs::connection*> c = detail::make_connection(*sched_, id, ch, *registry_, opts_);
      if (!c) {
        rdma_reject(id, nullptr, 0);
        rdma_destroy_id(id);
        rdma_destroy_event_channel(ch);
        throw gdr::error(c.error(), "gdr::verbs::listener::accept: queue pair");
      }
      (*c)->set_refused(refused);
      gdr::detail::verbs::conn_params mine = (*c)->params();
      rdma_conn_param p = detail::conn_param(mine, opts_);
      if (rdma_accept(id, &p) != 0) {
        std::error_code aec = errno_code(errno);
        (*c)->discard();
        throw gdr::error(aec, "gdr::verbs::listener::accept: rdma_accept");
      }
      result<detail::cm_event> est = co_await detail::expect(*sched_, ch, RDMA_CM_EVENT_ESTABLISHED, "accept");
      if (!est) {
        (*c)->discard();
        throw gdr::error(est.error(), "gdr::verbs::listener::accept: establishing");
      }
      (*c)->start(req->peer);
      co_return endpoint(*c);
    }
  }

  void close() noexcept {
    if (id_ != nullptr) rdma_destroy_id(std::exchange(id_, nullptr));
    if (ch_ != nullptr) rdma_destroy_event_channel(std::exchange(ch_, nullptr));
  }

  scheduler* sched_;
  memory_registry* registry_;
  endpoint_options opts_;
  rdma_event_channel* ch_ = nullptr;
  rdma_cm_id* id_ = nullptr;
};

}  // namespace gdr::verbs
