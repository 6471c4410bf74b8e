/// \file
/// Blocking TCP helpers for bootstrap code, every wait bounded by a deadline
/// (`poll` on non-blocking sockets). Setup happens once per job, before any
/// scheduler runs, so plain sockets are the honest tool here; the data path
/// uses the io_uring TCP transport instead.
///
/// Convention: `noexcept`, an `std::error_code` result (errno values in the
/// system category; `errc::timed_out` when a deadline passes;
/// `errc::connection_lost` when the peer closes).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/unique_fd.hpp>

namespace gdr::detail::sock {

using clock = std::chrono::steady_clock;

/// An owned file descriptor (gdr/unique_fd.hpp).
using unique_fd = gdr::detail::unique_fd;

/// Splits "host:port" (or "[v6]:port"). Fails with `errc::invalid_argument`.
inline std::error_code split_host_port(std::string_view s, std::string& host, std::uint16_t& port) noexcept {
  std::size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == s.size()) return errc::invalid_argument;
  std::string_view h = s.substr(0, colon), p = s.substr(colon + 1);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  unsigned v = 0;
  auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), v);
  if (ec != std::errc{} || end != p.data() + p.size() || v > 65535) return errc::invalid_argument;
  host.assign(h);
  port = static_cast<std::uint16_t>(v);
  return {};
}

/// "host:port", bracketing IPv6 hosts.
inline std::string join_host_port(const std::string& host, std::uint16_t port) {
  bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

/// Resolves a numeric or named host for a TCP connection (first result).
inline std::error_code resolve(const std::string& host, std::uint16_t port, sockaddr_storage& out,
                               socklen_t& len) noexcept {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) return errc::invalid_argument;
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return {};
}

/// The numeric host of a socket address.
inline std::string numeric_host(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {};
  if (::getnameinfo(sa, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return {};
  return host;
}

/// The local address ("10.0.0.2") and port of a connected or bound socket.
inline std::error_code local_endpoint(int fd, std::string& host, std::uint16_t& port) noexcept {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return errno_code(errno);
  host = numeric_host(reinterpret_cast<sockaddr*>(&ss), len);
  port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return {};
}

inline int remaining_ms(clock::time_point deadline) noexcept {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
  if (left <= 0) return 0;
  return left > 1'000'000'000 ? 1'000'000'000 : static_cast<int>(left);
}

/// Waits until `fd` is ready for `events`, or the deadline passes.
inline std::error_code wait_for(int fd, short events, clock::time_point deadline) noexcept {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = remaining_ms(deadline);
    int rc = ::poll(&p, 1, ms);
    if (rc > 0) return {};
    if (rc == 0) return errc::timed_out;
    if (errno != EINTR) return errno_code(errno);
  }
}

/// Writes all of `[p, p + n)`. Never raises SIGPIPE.
inline std::error_code send_all(int fd, const void* p, std::size_t n, clock::time_point deadline) noexcept {
  auto* b = static_cast<const std::byte*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      b += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (std::error_code ec = wait_for(fd, POLLOUT, deadline)) return ec;
      continue;
    }
    if (k < 0 && (errno == EPIPE || errno == ECONNRESET)) return errc::connection_lost;
    return errno_code(errno);
  }
  return {};
}

/// Reads exactly `n` bytes into `p`; `errc::connection_lost` if the peer closes first.
inline std::error_code recv_all(int fd, void* p, std::size_t n, clock::time_point deadline) noexcept {
  auto* b = static_cast<std::byte*>(p);
  while (n > 0) {
    ssize_t k = ::recv(fd, b, n, MSG_DONTWAIT);
    if (k > 0) {
      b += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k == 0) return errc::connection_lost;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (std::error_code ec = wait_for(fd, POLLIN, deadline)) return ec;
      continue;
    }
    if (errno == ECONNRESET) return errc::connection_lost;
    return errno_code(errno);
  }
  return {};
}

inline void set_nodelay(int fd) noexcept {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/// Connects to `host:port`, retrying refused connections (the listener may
/// not be up yet) with a growing pause until the deadline.
inline std::error_code connect_retry(const std::string& host, std::uint16_t port, clock::time_point deadline,
                                     unique_fd& out) noexcept {
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (std::error_code ec = resolve(host, port, ss, len)) return ec;
  auto pause = std::chrono::milliseconds(10);
  std::error_code last = errc::timed_out;
  for (;;) {
    unique_fd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) return errno_code(errno);
    int rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&ss), len);
    if (rc != 0 && errno == EINPROGRESS) {
      std::error_code ec = wait_for(fd.get(), POLLOUT, deadline);
      if (ec) return ec == errc::timed_out ? last : ec;
      int err = 0;
      socklen_t el = sizeof err;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) {
      set_nodelay(fd.get());
      out = std::move(fd);
      return {};
    }
    // Refused / unreachable while the peer starts: try again until the deadline.
    if (errno != ECONNREFUSED && errno != ETIMEDOUT && errno != EHOSTUNREACH && errno != ENETUNREACH &&
        errno != ECONNRESET && errno != EAGAIN)
      return errno_code(errno);
    last = errno_code(errno);
    auto now = clock::now();
    if (now >= deadline) return last;
    std::this_thread::sleep_for(std::min<clock::duration>(pause, deadline - now));
    if (pause < std::chrono::milliseconds(200)) pause *= 2;
  }
}

/// A listening socket bound to `host:port` (port 0: any free port).
inline std::error_code listen_on(const std::string& host, std::uint16_t port, int backlog, unique_fd& out) noexcept {
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (std::error_code ec = resolve(host, port, ss, len)) return ec;
  unique_fd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) return errno_code(errno);
  int one = 1;
  // A restarted job may find the previous root's port in TIME_WAIT.
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) return errno_code(errno);
  if (::listen(fd.get(), backlog) != 0) return errno_code(errno);
  out = std::move(fd);
  return {};
}

/// Accepts one connection before the deadline.
inline std::error_code accept_until(int listen_fd, clock::time_point deadline, unique_fd& out) noexcept {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      set_nodelay(fd);
      out.reset(fd);
      return {};
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno_code(errno);
    if (std::error_code ec = wait_for(listen_fd, POLLIN, deadline)) return ec;
  }
}

/// Makes `fd` non-blocking (for a listening socket handed in by a launcher).
inline std::error_code set_nonblocking(int fd) noexcept {
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return errno_code(errno);
  return {};
}

/// The first IPv4 address of an interface that is up and not a loopback, or
/// empty. The last resort when nothing says which address peers should use.
inline std::string first_external_ipv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string found;
  for (ifaddrs* i = list; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    found = numeric_host(i->ifa_addr, sizeof(sockaddr_in));
  }
  ::freeifaddrs(list);
  return found;
}

/// This machine's host name, or empty.
inline std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return {};
  return buf;
}

}  // namespace gdr::detail::sock
