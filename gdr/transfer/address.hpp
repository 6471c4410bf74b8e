/// \file
/// `gdr::address`: an IPv4 or IPv6 address and port, the way every network
/// transport (TCP as `tcp::address`, verbs as `verbs::address`, through
/// rdma_cm) and the bootstrap name an endpoint: "10.0.0.1:7471",
/// "[fe80::1]:7471". Vocabulary below the transports, so that one of them
/// never includes another for it.
///
/// Only numeric addresses are parsed ("127.0.0.1:5000", "[::1]:5000",
/// "localhost:5000" as a convenience for 127.0.0.1): name resolution
/// (`getaddrinfo`) blocks, and nothing in gdr blocks its scheduler's thread.
/// Resolve names before, off the loop, if you must. Everything here is
/// `noexcept` and reports `std::error_code`.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <charconv>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <system_error>

#include <gdr/error.hpp>

namespace gdr {

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

}  // namespace gdr
