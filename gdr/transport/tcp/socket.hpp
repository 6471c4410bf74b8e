/// \file
/// TCP building blocks below the endpoint: `tcp::address` ("host:port"
/// parsing and formatting: `gdr::address`, gdr/transfer/address.hpp),
/// `tcp::socket` (an owned file descriptor) and `tcp::socket_options` (what
/// every gdr connection sets on its socket).
///
/// Everything here is `noexcept` and reports `std::error_code` (errno values in
/// the system category); the awaitables built on it (`listener::accept`,
/// `tcp::connect`) throw `gdr::error` at `co_await`.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/transfer/address.hpp>

namespace gdr::tcp {

/// An IPv4 or IPv6 socket address: `gdr::address` (gdr/transfer/address.hpp),
/// shared with the verbs transport and the bootstrap.
using address = gdr::address;

/// What gdr sets on every connected socket (both the connecting and the
/// accepting side).
///
/// `TCP_NODELAY` is always on: gdr writes whole frames (header and payload
/// in one `sendmsg`), so Nagle's algorithm could only delay a small message
/// behind an unacknowledged one (the 40 ms delayed-ACK stall).
///
/// Liveness. A peer that vanishes without a FIN or RST (power loss, cable,
/// partition) is noticed within about 10 s with the defaults, whether the
/// connection is busy or idle:
///   * busy (data unacknowledged): `user_timeout`, 10 s;
///   * idle: keepalive, 5 s of silence, then 5 probes 1 s apart: 10 s.
/// On Linux `TCP_USER_TIMEOUT` also caps keepalive (tcp(7): it "will
/// override keepalive"): an idle connection is dropped after
/// max(user_timeout, keepalive_idle + keepalive_count * keepalive_interval)
/// at most, roughly. Keep the two equal, as the defaults do, so that one
/// number describes both; lower both to notice sooner.
struct socket_options {
  /// `TCP_USER_TIMEOUT`: how long transmitted data may stay unacknowledged,
  /// or the peer's receive window stay closed, before the kernel drops the
  /// connection (ETIMEDOUT: `errc::connection_lost`). Zero: the kernel
  /// default (about 15 minutes of retransmissions, `tcp_retries2`).
  ///
  /// Caveat (linux net/ipv4/tcp_timer.c, `tcp_probe_timer`, since 5.11): the
  /// zero-window case counts too, even when the peer answers every probe. A
  /// receiver stops reading only when early eager messages exceed its store
  /// (`protocol_options::unexpected_bytes`; large messages wait as
  /// announcements and never shut the window); a peer that receives nothing
  /// for this long while being flooded with small messages is dropped. Raise
  /// it for such peers.
  std::chrono::milliseconds user_timeout{10'000};
  /// `SO_KEEPALIVE` with `TCP_KEEPIDLE`/`TCP_KEEPINTVL`/`TCP_KEEPCNT`:
  /// probes an idle connection so a silent peer is noticed even when
  /// nothing is being sent. 0 idle turns keepalive off.
  std::chrono::seconds keepalive_idle{5};
  std::chrono::seconds keepalive_interval{1};
  int keepalive_count = 5;
  /// `SO_SNDBUF` / `SO_RCVBUF` in bytes; 0 keeps the kernel's autotuning
  /// (recommended: setting them disables autotuning).
  int send_buffer = 0;
  int receive_buffer = 0;
};

/// An owned socket file descriptor; closes it when destroyed. Move-only.
///
/// Thread-safety: as a file descriptor.
class socket {
 public:
  socket() noexcept = default;
  explicit socket(int fd) noexcept : fd_(fd) {}
  socket(socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  socket& operator=(socket&& o) noexcept {
    if (this != &o) {
      close();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  socket(const socket&) = delete;
  socket& operator=(const socket&) = delete;
  ~socket() { close(); }

  /// A new TCP socket (close-on-exec) of the family of `a`.
  static result<socket> open_stream(const address& a) noexcept {
    int fd = ::socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
    if (fd < 0) return errno_code(errno);
    return socket(fd);
  }

  bool valid() const noexcept { return fd_ >= 0; }
  int native_handle() const noexcept { return fd_; }
  /// Gives up ownership.
  int release() noexcept { return std::exchange(fd_, -1); }
  void close() noexcept {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }

  /// Applies `o` and TCP_NODELAY (see `socket_options`).
  std::error_code apply(const socket_options& o) const noexcept {
    option_list l(o);
    for (std::size_t i = 0; i < l.n; ++i)
      if (std::error_code ec = set_int(l.v[i].level, l.v[i].name, l.v[i].value)) return ec;
    return {};
  }

  /// Whether the options `apply(o)` sets are in place already (an accepted
  /// socket inherits them from its listener on Linux); `getsockopt` each.
  /// False when `o` sets buffer sizes (the kernel reports those doubled).
  bool has(const socket_options& o) const noexcept {
    if (o.send_buffer > 0 || o.receive_buffer > 0) return false;
    option_list l(o);
    for (std::size_t i = 0; i < l.n; ++i)
      if (get_int(l.v[i].level, l.v[i].name) != l.v[i].value) return false;
    return true;
  }

  /// `getsockopt` of an int (-1 if it fails).
  int get_int(int level, int name) const noexcept {
    int v = -1;
    socklen_t len = sizeof v;
    if (::getsockopt(fd_, level, name, &v, &len) != 0) return -1;
    return v;
  }

  /// `setsockopt` of an int.
  std::error_code set_int(int level, int name, int value) const noexcept {
    if (::setsockopt(fd_, level, name, &value, sizeof value) != 0) return errno_code(errno);
    return {};
  }

  /// The address this socket is bound to (`getsockname`).
  result<address> local_address() const noexcept {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return errno_code(errno);
    return address::from_native(reinterpret_cast<sockaddr*>(&ss), len);
  }

  /// The peer's address (`getpeername`).
  result<address> remote_address() const noexcept {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return errno_code(errno);
    return address::from_native(reinterpret_cast<sockaddr*>(&ss), len);
  }

 private:
  /// The `setsockopt` calls `o` asks for, in order (what `apply` sets and
  /// `has` checks).
  struct option_list {
    struct entry {
      int level, name, value;
    };
    entry v[8];
    std::size_t n = 0;
    explicit option_list(const socket_options& o) noexcept {
      add(IPPROTO_TCP, TCP_NODELAY, 1);
      if (o.user_timeout.count() > 0)
        add(IPPROTO_TCP, TCP_USER_TIMEOUT,
            o.user_timeout.count() > 0x7fffffff ? 0x7fffffff : static_cast<int>(o.user_timeout.count()));
      if (o.keepalive_idle.count() > 0) {
        add(SOL_SOCKET, SO_KEEPALIVE, 1);
        add(IPPROTO_TCP, TCP_KEEPIDLE, static_cast<int>(o.keepalive_idle.count()));
        add(IPPROTO_TCP, TCP_KEEPINTVL, static_cast<int>(o.keepalive_interval.count()));
        add(IPPROTO_TCP, TCP_KEEPCNT, o.keepalive_count);
      }
      if (o.send_buffer > 0) add(SOL_SOCKET, SO_SNDBUF, o.send_buffer);
      if (o.receive_buffer > 0) add(SOL_SOCKET, SO_RCVBUF, o.receive_buffer);
    }
    void add(int level, int name, int value) noexcept { v[n++] = {level, name, value}; }
  };

  int fd_ = -1;
};

}  // namespace gdr::tcp

namespace gdr::detail::tcp {

/// The error an established connection reports for a failed socket call or
/// io_uring result `res` (negative errno; 0 is end of stream): the peer is
/// gone, whatever the reason the kernel gives (EOF, ECONNRESET, EPIPE,
/// ETIMEDOUT from TCP_USER_TIMEOUT or keepalive, EHOSTUNREACH...). Callers
/// handle -ECANCELED (their own cancellation) before asking.
inline std::error_code connection_error(int /*res*/) noexcept { return errc::connection_lost; }

}  // namespace gdr::detail::tcp
