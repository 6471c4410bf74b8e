/// \file
/// `co_await gdr::tcp::connect(sched, "127.0.0.1:5000")`: opens a TCP
/// connection through the scheduler's io_uring (`IORING_OP_CONNECT`) and
/// returns a `tcp::endpoint`.
///
/// \code
///   gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, "127.0.0.1:5000", {2s});
///   // or, without exceptions:
///   gdr::result<gdr::tcp::endpoint> r = co_await gdr::tcp::connect(sched, addr).as_result();
/// \endcode
///
/// Errors: the connect's errno (`ECONNREFUSED` when nobody listens yet: a
/// bootstrap retries on it), `errc::invalid_argument` for an unparsable
/// address, `errc::cancelled`, `errc::timed_out` (the kernel cancels the
/// connect through a linked timeout).
#pragma once

#include <string_view>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transport/tcp/endpoint.hpp>
#include <gdr/transport/tcp/socket.hpp>
#include <gdr/transport/tcp/socket_op.hpp>

namespace gdr::tcp {

/// Awaitable of `tcp::connect`: `co_await` gives a `tcp::endpoint` or
/// throws `gdr::error`; `.as_result()` gives `result<endpoint>`.
class connect_awaitable : public gdr::detail::tcp::socket_op<connect_awaitable, endpoint> {
 public:
  connect_awaitable(scheduler& s, result<address> to, op_options opts, memory_registry& reg,
                    const endpoint_options& eopts) noexcept
      : socket_op(s, std::move(opts)), registry_(&reg), eopts_(eopts) {
    if (!to) {
      early_ = to.error();
      return;
    }
    to_ = *to;
    result<socket> sock = socket::open_stream(to_);
    if (!sock) {
      early_ = sock.error();
      return;
    }
    sock_ = std::move(*sock);
  }
  connect_awaitable(connect_awaitable&&) noexcept = default;

  void prepare(io_uring_sqe* sqe) noexcept {
    // The kernel copies the address when it starts the connect; it lives in
    // this awaitable until the CQE anyway.
    io_uring_prep_connect(sqe, sock_.native_handle(), to_.native(), to_.native_size());
  }

  result<endpoint> finish(std::error_code failed) noexcept {
    if (failed) return failed;
    try {
      return endpoint(*sched_, std::move(sock_), *registry_, eopts_);
    } catch (const gdr::error& e) {
      return e.code();
    } catch (...) {
      return errno_code(ENOMEM);
    }
  }

 private:
  address to_{};
  socket sock_{};
  memory_registry* registry_;
  endpoint_options eopts_;
};

/// Connects to `to` ("host:port", see `address::parse`). `opts.timeout`
/// bounds the connect, `opts.stop` cancels it. The endpoint serves the
/// peer's one-sided requests from `registry` and is tuned by `eopts`.
inline connect_awaitable connect(scheduler& sched, const address& to, op_options opts = {},
                                 memory_registry& registry = default_registry(),
                                 const endpoint_options& eopts = {}) noexcept {
  return {sched, to, std::move(opts), registry, eopts};
}

/// Connects to `to` with endpoint options `eopts` (and the process-wide
/// registry); `opts` bounds or cancels the connect.
///
///   gdr::tcp::endpoint_options eo;
///   eo.socket.user_timeout = 2s;
///   auto ep = co_await gdr::tcp::connect(sched, "10.0.0.2:5000", eo);
inline connect_awaitable connect(scheduler& sched, std::string_view to, const endpoint_options& eopts,
                                 op_options opts = {}) noexcept {
  return {sched, address::parse(to), std::move(opts), default_registry(), eopts};
}
inline connect_awaitable connect(scheduler& sched, const address& to, const endpoint_options& eopts,
                                 op_options opts = {}) noexcept {
  return {sched, to, std::move(opts), default_registry(), eopts};
}

/// Connects to the address in `to`, parsed by `address::parse`.
inline connect_awaitable connect(scheduler& sched, std::string_view to, op_options opts = {},
                                 memory_registry& registry = default_registry(),
                                 const endpoint_options& eopts = {}) noexcept {
  return {sched, address::parse(to), std::move(opts), registry, eopts};
}

}  // namespace gdr::tcp
