/// \file
/// TCP building blocks below the endpoint: `tcp::address` ("host:port"
/// parsing and formatting), `tcp::socket` (an owned file descriptor) and
/// `tcp::socket_options` (what every gdr connection sets on its socket).
///
/// Only numeric addresses are parsed ("127.0.0.1:5000", "[::1]:5000",
/// "localhost:5000" as a convenience for 127.0.0.1): name resolution
/// (`getaddrinfo`) blocks, and nothing in gdr blocks its scheduler's thread.
/// Resolve names before, off the loop, if you must.
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
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <gdr/error.hpp>

namespace gdr::tcp {

/// An IPv4 or IPv6 socket address (a `sockaddr_storage` and its length).
///
/// Thread-safety: a value.
class address {
 public:
  /// The empty address (family AF_UNSPEC); `valid()` is false.
  address() noexcept = default;

  /// Parses "a.b.c.d:port", "[v6]:port", "localhost:port" (127.0.0.1),
  /// "*:port" or ":port" (every IPv4 interface, for listeners). Port 0 asks
  /// the kernel for a free port when binding. Fails with
  /// `errc::invalid_argument` on anything else (host names included: see the
  /// file comment).
  static result<address> parse(std::string_view text) noexcept {
    std::size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return errc::invalid_argument;
    std::string_view host = text.substr(0, colon);
    std::string_view port_text = text.substr(colon + 1);
    unsigned port = 0;
    auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (ec != std::errc{} || end != port_text.data() + port_text.size() || port_text.empty() || port > 65535)
      return errc::invalid_argument;
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      return ipv6(host.substr(1, host.size() - 2), static_cast<std::uint16_t>(port));
    }
    if (host.empty() || host == "*") return any_ipv4(static_cast<std::uint16_t>(port));
    if (host == "localhost") host = "127.0.0.1";
    return ipv4(host, static_cast<std::uint16_t>(port));
  }

  /// 127.0.0.1:`port`.
  static address loopback(std::uint16_t port = 0) noexcept {
    address a;
    auto* in = a.as<sockaddr_in>();
    in->sin_family = AF_INET;
    in->sin_port = htons(port);
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.len_ = sizeof(sockaddr_in);
    return a;
  }

  /// [::1]:`port`.
  static address loopback6(std::uint16_t port = 0) noexcept {
    address a;
    auto* in6 = a.as<sockaddr_in6>();
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(port);
    in6->sin6_addr = in6addr_loopback;
    a.len_ = sizeof(sockaddr_in6);
    return a;
  }

  /// 0.0.0.0:`port` (every IPv4 interface).
  static address any_ipv4(std::uint16_t port = 0) noexcept {
    address a = loopback(port);
    a.as<sockaddr_in>()->sin_addr.s_addr = htonl(INADDR_ANY);
    return a;
  }

  /// An address the kernel filled in (`getsockname`, `accept`).
  static address from_native(const sockaddr* sa, socklen_t len) noexcept {
    address a;
    if (len > sizeof a.storage_) len = sizeof a.storage_;
    std::memcpy(&a.storage_, sa, len);
    a.len_ = len;
    return a;
  }

  bool valid() const noexcept { return family() == AF_INET || family() == AF_INET6; }
  int family() const noexcept { return storage_.ss_family; }
  std::uint16_t port() const noexcept {
    if (family() == AF_INET) return ntohs(as<sockaddr_in>()->sin_port);
    if (family() == AF_INET6) return ntohs(as<sockaddr_in6>()->sin6_port);
    return 0;
  }

  /// "127.0.0.1:5000" or "[::1]:5000"; "" for an invalid address. The
  /// inverse of `parse` for every valid address.
  std::string to_string() const {
    char host[INET6_ADDRSTRLEN] = {};
    if (family() == AF_INET) {
      ::inet_ntop(AF_INET, &as<sockaddr_in>()->sin_addr, host, sizeof host);
      return std::string(host) + ":" + std::to_string(port());
    }
    if (family() == AF_INET6) {
      ::inet_ntop(AF_INET6, &as<sockaddr_in6>()->sin6_addr, host, sizeof host);
      return "[" + std::string(host) + "]:" + std::to_string(port());
    }
    return {};
  }

  const sockaddr* native() const noexcept { return reinterpret_cast<const sockaddr*>(&storage_); }
  sockaddr* native() noexcept { return reinterpret_cast<sockaddr*>(&storage_); }
  socklen_t native_size() const noexcept { return len_; }

  friend bool operator==(const address& a, const address& b) noexcept {
    return a.len_ == b.len_ && std::memcmp(&a.storage_, &b.storage_, a.len_) == 0;
  }

 private:
  template <class T>
  T* as() noexcept {
    return reinterpret_cast<T*>(&storage_);
  }
  template <class T>
  const T* as() const noexcept {
    return reinterpret_cast<const T*>(&storage_);
  }

  static result<address> ipv4(std::string_view host, std::uint16_t port) noexcept {
    char buf[INET_ADDRSTRLEN] = {};
    if (host.size() >= sizeof buf) return errc::invalid_argument;
    std::memcpy(buf, host.data(), host.size());
    address a = loopback(port);
    if (::inet_pton(AF_INET, buf, &a.as<sockaddr_in>()->sin_addr) != 1) return errc::invalid_argument;
    return a;
  }

  static result<address> ipv6(std::string_view host, std::uint16_t port) noexcept {
    char buf[INET6_ADDRSTRLEN] = {};
    if (host.size() >= sizeof buf) return errc::invalid_argument;
    std::memcpy(buf, host.data(), host.size());
    address a = loopback6(port);
    if (::inet_pton(AF_INET6, buf, &a.as<sockaddr_in6>()->sin6_addr) != 1) return errc::invalid_argument;
    return a;
  }

  sockaddr_storage storage_{};
  socklen_t len_ = 0;
};

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
    if (std::error_code ec = set_int(IPPROTO_TCP, TCP_NODELAY, 1)) return ec;
    if (o.user_timeout.count() > 0) {
      auto ms = o.user_timeout.count() > 0x7fffffff ? 0x7fffffff : static_cast<int>(o.user_timeout.count());
      if (std::error_code ec = set_int(IPPROTO_TCP, TCP_USER_TIMEOUT, ms)) return ec;
    }
    if (o.keepalive_idle.count() > 0) {
      if (std::error_code ec = set_int(SOL_SOCKET, SO_KEEPALIVE, 1)) return ec;
      if (std::error_code ec = set_int(IPPROTO_TCP, TCP_KEEPIDLE, static_cast<int>(o.keepalive_idle.count()))) return ec;
      if (std::error_code ec = set_int(IPPROTO_TCP, TCP_KEEPINTVL, static_cast<int>(o.keepalive_interval.count())))
        return ec;
      if (std::error_code ec = set_int(IPPROTO_TCP, TCP_KEEPCNT, o.keepalive_count)) return ec;
    }
    if (o.send_buffer > 0)
      if (std::error_code ec = set_int(SOL_SOCKET, SO_SNDBUF, o.send_buffer)) return ec;
    if (o.receive_buffer > 0)
      if (std::error_code ec = set_int(SOL_SOCKET, SO_RCVBUF, o.receive_buffer)) return ec;
    return {};
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
