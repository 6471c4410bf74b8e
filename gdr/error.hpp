/// \file
/// Errors in gdr: one `std::error_category` for gdr's own conditions, the
/// exception thrown at the `co_await` boundary, and `result<T>` for code that
/// must not throw.
///
/// Convention (STYLE.md, "Errors"): internals are `noexcept` and carry a
/// `std::error_code`; operating-system failures keep their errno value in
/// `std::system_category()`, CUDA failures keep theirs in gdr's CUDA category
/// (`gdr/cuda/error.hpp`). Awaiting an operation throws `gdr::error` on failure;
/// every operation also has a form that returns `result<T>` instead.
#pragma once

#include <cerrno>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>

#include <gdr/config.hpp>

namespace gdr {

/// gdr's own error conditions, grouped by what they break (as UCX groups
/// `ucs_status_t`): one operation, one endpoint, a device, or the configuration.
enum class errc : int {
  // ---- the operation failed; the endpoint is still usable ----
  cancelled = 1,    ///< a stop token fired before the operation completed
  timed_out,        ///< the operation's deadline passed first
  truncated,        ///< a message was larger than the receive buffer
  remote_access,    ///< one-sided access outside a registration, wrong key, or revoked
  busy,             ///< a resource (queue, ring) is full; try again later
  message_too_large,  ///< larger than the peer accepts (its limit, from the handshake); nothing was sent
  withdrawn,          ///< a receive's message was withdrawn by its sender (stopped or timed out) after the receive had matched it
  // ---- the endpoint is broken; every pending operation fails ----
  connection_lost = 100,  ///< the peer went away (closed, reset, killed, timed out)
  protocol_error,         ///< the peer sent a malformed or hostile frame
  closed,                 ///< the endpoint was closed locally
  peer_closed,            ///< the peer closed the connection in order (no crash)
  // ---- a device is missing or failed ----
  no_device = 200,        ///< no GPU (or no RDMA device) is usable
  device_error,           ///< the device reported a failure
  gpudirect_unavailable,  ///< a zero-copy GPU path was asked for and the probe says no
  // ---- the program or its environment is misconfigured ----
  invalid_argument = 300,  ///< an argument is out of its domain
  unsupported,             ///< the operation is not supported on this transport or space
  bootstrap_failed,        ///< peers could not find each other
};

namespace detail {

class gdr_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "gdr"; }

  std::string message(int value) const override {
    switch (static_cast<errc>(value)) {
      case errc::cancelled: return "operation cancelled";
      case errc::timed_out: return "operation timed out";
      case errc::truncated: return "message truncated: larger than the receive buffer";
      case errc::remote_access:
        return "remote access denied: outside the registration, wrong key, or revoked";
      case errc::busy: return "resource busy";
      case errc::message_too_large: return "message larger than the peer accepts";
      case errc::withdrawn:
        return "message withdrawn by its sender: its send was stopped or timed out before this receive's answer reached it";
      case errc::connection_lost: return "connection to the peer lost";
      case errc::protocol_error: return "protocol error: malformed frame from the peer";
      case errc::closed: return "endpoint closed";
      case errc::peer_closed: return "the peer closed the connection";
      case errc::no_device: return "no usable device";
      case errc::device_error: return "device error";
      case errc::gpudirect_unavailable:
        return "GPUDirect RDMA unavailable: a zero-copy device path was requested and cannot move these bytes";
      case errc::invalid_argument: return "invalid argument";
      case errc::unsupported: return "operation not supported";
      case errc::bootstrap_failed: return "bootstrap failed: peers could not connect";
    }
    return "unknown gdr error " + std::to_string(value);
  }

  std::error_condition default_error_condition(int value) const noexcept override {
    switch (static_cast<errc>(value)) {
      case errc::cancelled: return std::errc::operation_canceled;
      case errc::timed_out: return std::errc::timed_out;
      case errc::invalid_argument: return std::errc::invalid_argument;
      case errc::unsupported: return std::errc::not_supported;
      default: return {value, *this};
    }
  }
};

/// Constant-initialised: no guard to test on each use (error codes are
/// made on every operation's path).
inline constinit const gdr_category_impl gdr_category_instance{};

}  // namespace detail

/// The category of `gdr::errc` values.
inline const std::error_category& gdr_category() noexcept { return detail::gdr_category_instance; }

/// Makes `std::error_code ec = gdr::errc::timed_out;` work.
inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), gdr_category()};
}

/// An errno value (positive) as an error code in the system category.
inline std::error_code errno_code(int err) noexcept {
  return {err, std::system_category()};
}

/// The exception thrown where an awaited operation fails. `code()` is the
/// precise cause (a `gdr::errc`, an errno value, a CUDA error).
class error : public std::system_error {
 public:
  using std::system_error::system_error;
};

/// Throws `gdr::error` for a non-zero code; does nothing for success.
inline void throw_if(std::error_code ec, const char* what = nullptr) {
  if (ec) {
    if (what != nullptr) throw error(ec, what);
    throw error(ec);
  }
}

/// A value or an error, for hot loops and `noexcept` code.
///
/// `value()` throws `gdr::error` when it holds an error. `result<void>` holds
/// only an error code.
template <class T>
class [[nodiscard]] result {
 public:
  result(T value) noexcept(std::is_nothrow_move_constructible_v<T>)  // NOLINT: implicit
      : v_(std::in_place_index<0>, std::move(value)) {}
  result(std::error_code ec) noexcept : v_(std::in_place_index<1>, ec) {}  // NOLINT
  result(errc e) noexcept : v_(std::in_place_index<1>, make_error_code(e)) {}  // NOLINT

  bool has_value() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return has_value(); }

  std::error_code error() const noexcept {
    return has_value() ? std::error_code{} : std::get<1>(v_);
  }

  T& value() & {
    throw_if(error());
    return std::get<0>(v_);
  }
  const T& value() const& {
    throw_if(error());
    return std::get<0>(v_);
  }
  T&& value() && {
    throw_if(error());
    return std::get<0>(std::move(v_));
  }

  T* operator->() noexcept { return &std::get<0>(v_); }
  T& operator*() & noexcept { return std::get<0>(v_); }

 private:
  std::variant<T, std::error_code> v_;
};

template <>
class [[nodiscard]] result<void> {
 public:
  result() noexcept = default;
  result(std::error_code ec) noexcept : ec_(ec) {}  // NOLINT: implicit
  result(errc e) noexcept : ec_(make_error_code(e)) {}  // NOLINT: implicit

  bool has_value() const noexcept { return !ec_; }
  explicit operator bool() const noexcept { return has_value(); }
  std::error_code error() const noexcept { return ec_; }
  void value() const { throw_if(ec_); }

 private:
  std::error_code ec_;
};

}  // namespace gdr

template <>
struct std::is_error_code_enum<gdr::errc> : std::true_type {};
