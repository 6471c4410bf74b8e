/// \file
/// `gdr::tcp::listener`: a listening socket whose `accept()` is an io_uring
/// operation (`IORING_OP_ACCEPT`) returning a `tcp::endpoint`.
///
/// \code
///   gdr::tcp::listener l(sched, "127.0.0.1:0");        // port 0: the kernel picks one
///   std::string where = l.local_address().to_string();  // "127.0.0.1:43127": publish it
///   gdr::tcp::endpoint ep = co_await l.accept();
/// \endcode
///
/// For a bootstrap mesh: every rank makes a listener on port 0, publishes
/// `local_address()`, then accepts from the ranks that connect to it and
/// `tcp::connect`s to the others. Many accepts may be pending at once; each
/// takes one connection.
#pragma once

#include <sys/socket.h>

#include <atomic>
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

/// Awaitable of `listener::accept`: `co_await` gives a `tcp::endpoint` or
/// throws `gdr::error`; `.as_result()` gives `result<endpoint>`.
///
/// It refers to its listener's socket and reads the descriptor when it is
/// awaited: a listener closed (or moved from) in between fails it with
/// `errc::closed`. (A descriptor number kept from construction could by then
/// name another socket: the kernel reuses the lowest free number.) The
/// listener must therefore outlive the awaitable's `co_await`.
class accept_awaitable : public gdr::detail::tcp::socket_op<accept_awaitable, endpoint> {
 public:
  accept_awaitable(scheduler& s, const socket& listening, op_options opts, memory_registry& reg,
                   const endpoint_options& eopts) noexcept
      : socket_op(s, std::move(opts)), listening_(&listening), registry_(&reg), eopts_(eopts) {}
  accept_awaitable(accept_awaitable&&) noexcept = default;

  /// At submission: a closed listener has no socket to accept on.
  std::error_code submit_error() const noexcept {
    if (!listening_->valid()) return errc::closed;
    return {};
  }

  void prepare(io_uring_sqe* sqe) noexcept {
    // Read now, on the loop's thread, right after submit_error() saw it open.
    io_uring_prep_accept(sqe, listening_->native_handle(), nullptr, nullptr, SOCK_CLOEXEC);
  }

  result<endpoint> finish(std::error_code failed) noexcept {
    if (failed) {
      // A listener shut down under a pending accept reports EINVAL: say what
      // happened instead.
      if (failed == std::error_code(errno_code(EINVAL))) return errc::closed;
      return failed;
    }
    // From here the descriptor is owned (and closed on any failure below).
    socket sock(res_);
    try {
      if (options_inherited(sock)) return endpoint(endpoint::options_in_place{}, *sched_, std::move(sock), *registry_, eopts_);
      return endpoint(*sched_, std::move(sock), *registry_, eopts_);
    } catch (const gdr::error& e) {
      return e.code();
    } catch (...) {
      return errno_code(ENOMEM);
    }
  }

 private:
  /// Whether `sock` carries the listener's socket options already. Linux
  /// copies them from the listening socket into each accepted one; whether
  /// this kernel does is checked once per process (`getsockopt` of each on
  /// the first accepted socket), and the options are set again wherever it
  /// does not, or where `has` cannot tell (buffer sizes).
  bool options_inherited(const socket& sock) const noexcept {
    const socket_options& o = eopts_.socket;
    if (o.send_buffer > 0 || o.receive_buffer > 0) return false;
    static std::atomic<int> kernel_copies{-1};  // -1: not checked yet
    int v = kernel_copies.load(std::memory_order_relaxed);
    if (v < 0) {
      v = sock.has(o) ? 1 : 0;
      kernel_copies.store(v, std::memory_order_relaxed);
    }
    return v == 1;
  }

  const socket* listening_;  // the listener's own socket object
  memory_registry* registry_;
  endpoint_options eopts_;
};

/// A bound, listening TCP socket. Move-only.
///
/// Thread-safety: `accept`, `close`, moves and destruction on the
/// scheduler's thread (an accept reads the socket when it is awaited); the
/// rest anywhere.
class listener {
 public:
  /// Binds to `at` (port 0: any free port; see `local_address`) and
  /// listens. Accepted endpoints live on `sched`, serve one-sided requests
  /// from `registry` and are tuned by `eopts`. Throws `gdr::error` (the
  /// errno of socket/bind/listen).
  listener(scheduler& sched, const address& at, memory_registry& registry = default_registry(),
           const endpoint_options& eopts = {}, int backlog = SOMAXCONN)
      : sched_(&sched), registry_(&registry), eopts_(eopts) {
    result<socket> s = socket::open_stream(at);
    if (!s) throw gdr::error(s.error(), "gdr::tcp::listener: socket");
    sock_ = std::move(*s);
    // A restarted job may rebind its port while old connections linger in
    // TIME_WAIT.
    if (std::error_code ec = sock_.set_int(SOL_SOCKET, SO_REUSEADDR, 1)) throw gdr::error(ec, "gdr::tcp::listener");
    // Accepted sockets inherit the endpoint's socket options from here
    // (see accept_awaitable::options_inherited): set once, not per accept.
    if (std::error_code ec = sock_.apply(eopts_.socket)) throw gdr::error(ec, "gdr::tcp::listener: socket options");
    if (::bind(sock_.native_handle(), at.native(), at.native_size()) != 0)
      throw gdr::error(errno_code(errno), "gdr::tcp::listener: bind " + at.to_string());
    if (::listen(sock_.native_handle(), backlog) != 0) throw gdr::error(errno_code(errno), "gdr::tcp::listener: listen");
  }

  /// Binds to the address in `at`, parsed by `address::parse`.
  listener(scheduler& sched, std::string_view at, memory_registry& registry = default_registry(),
           const endpoint_options& eopts = {}, int backlog = SOMAXCONN)
      : listener(sched, parse_or_throw(at), registry, eopts, backlog) {}

  /// Binds to `at` with endpoint options `eopts` (the process-wide registry).
  ///
  ///   gdr::tcp::endpoint_options eo;
  ///   eo.protocol.rendezvous_threshold = 256 * 1024;
  ///   gdr::tcp::listener l(sched, "*:5000", eo);
  listener(scheduler& sched, std::string_view at, const endpoint_options& eopts)
      : listener(sched, parse_or_throw(at), default_registry(), eopts) {}
  listener(scheduler& sched, const address& at, const endpoint_options& eopts)
      : listener(sched, at, default_registry(), eopts) {}

  listener(listener&&) noexcept = default;
  listener& operator=(listener&& o) noexcept {
    if (this != &o) {
      close();
      sched_ = o.sched_;
      registry_ = o.registry_;
      eopts_ = o.eopts_;
      sock_ = std::move(o.sock_);
    }
    return *this;
  }
  ~listener() { close(); }

  /// Waits for the next connection. `opts.timeout` bounds the wait
  /// (`errc::timed_out`), `opts.stop` cancels it; after `close()`, pending
  /// and later accepts fail with `errc::closed`, and so do accepts built
  /// before but awaited after it. The listener must outlive the `co_await`.
  accept_awaitable accept(op_options opts = {}) const noexcept {
    return {*sched_, sock_, std::move(opts), *registry_, eopts_};
  }

  /// The listening socket (-1 once closed or moved from), for diagnostics
  /// such as `getsockopt`.
  int native_handle() const noexcept { return sock_.native_handle(); }

  /// The bound address, with the port the kernel chose for port 0.
  address local_address() const noexcept {
    result<address> a = sock_.local_address();
    return a ? *a : address{};
  }

  /// Stops listening: pending accepts complete with `errc::closed`
  /// (shutting a listening socket down wakes its accepts with EINVAL).
  void close() noexcept {
    if (sock_.valid()) {
      ::shutdown(sock_.native_handle(), SHUT_RDWR);
      sock_.close();
    }
  }

 private:
  static address parse_or_throw(std::string_view at) {
    result<address> a = address::parse(at);
    if (!a) throw gdr::error(a.error(), "gdr::tcp::listener: bad address");
    return *a;
  }

  scheduler* sched_;
  memory_registry* registry_;
  endpoint_options eopts_;
  socket sock_{};
};

}  // namespace gdr::tcp
