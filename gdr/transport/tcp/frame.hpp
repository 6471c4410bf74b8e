/// \file
/// The TCP transport's wire format, and a pure parser for it.
///
/// A connection carries, in each direction, a sequence of frames: a fixed
/// 40-byte header, then `payload_size(header)` bytes of payload. All integers
/// are little-endian.
///
/// \verbatim
///   offset size field    meaning
///   0      4    magic    "GDRT" (0x47 0x44 0x52 0x54)
///   4      1    version  1
///   5      1    type     frame_type (below)
///   6      2    flags    0 (no flag is defined in version 1; any bit set is an error)
///   8      4    seq      this frame's number in its direction: 0, 1, 2... (mod 2^32)
///   12     4    status   replies: wire_status (0 ok, 1 remote access denied); else 0
///   16     8    length   data, put_request, get_reply: payload bytes that follow;
///                        get_request: bytes asked for (nothing follows); else 0
///   24     8    addr     put/get_request: address in the receiver's memory;
///                        put_ack, get_reply: the seq of the request answered; else 0
///   32     8    key      put/get_request: the registration key; else 0
/// \endverbatim
///
/// Frame types:
///   * `data`: one two-sided message (`ep.send` -> `ep.recv`);
///   * `put_request` + payload: write the payload at addr/key; answered by a
///     `put_ack` once the bytes are in place (or refused);
///   * `get_request`: read `length` bytes at addr/key; answered by a
///     `get_reply` carrying exactly `length` bytes, or a refusal with none;
///   * `close`: the sender will send nothing more (orderly close).
///
/// Requests are answered in the order they arrive, so replies come back in
/// the order the requests were sent; `addr` of a reply names its request all
/// the same, and a reply that does not name the oldest unanswered request is a
/// protocol error.
///
/// Parsing is strict (`parse_frame`): wrong magic or version, an unknown
/// type, a flag bit, a field that must be zero and is not, or a length over
/// the receiver's limit is an error, and the receiver closes the connection
/// (`errc::protocol_error`). Nothing here allocates or keeps state: the parser
/// is safe to feed arbitrary bytes (`tests/transport/tcp/frame_fuzz.cpp`).
/// The sequence check is the endpoint's (it knows what it expects next).
///
/// Versioning: a receiver accepts only its own version. A later version
/// that changes the layout bumps `version`; one that only adds a frame type
/// or a flag must bump it too, because version-1 receivers reject both.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

namespace gdr::tcp {

/// Constants of the wire format.
namespace wire {
/// "GDRT" read as a little-endian 32-bit integer.
inline constexpr std::uint32_t magic = 0x54524447u;
/// The only version this code speaks.
inline constexpr std::uint8_t version = 1;
/// Bytes in every frame header.
inline constexpr std::size_t header_size = 40;
/// Default limit on a frame's `length` (data and put payloads, get sizes):
/// 1 GiB. A longer frame is a protocol error unless the receiver raised the
/// limit (`endpoint_options::max_message`).
inline constexpr std::uint64_t default_max_message = std::uint64_t{1} << 30;
}  // namespace wire

/// What a frame is (header byte 5).
enum class frame_type : std::uint8_t {
  data = 1,         ///< a two-sided message; `length` payload bytes follow
  put_request = 2,  ///< one-sided write; `length` payload bytes follow
  put_ack = 3,      ///< answer to a put_request (status)
  get_request = 4,  ///< one-sided read of `length` bytes; no payload
  get_reply = 5,    ///< answer to a get_request; `length` payload bytes follow when ok
  close = 6,        ///< orderly end of this direction
};

/// The status field of replies.
enum class wire_status : std::uint32_t {
  ok = 0,
  remote_access = 1,  ///< outside a registration, wrong key, revoked, or not permitted
};

/// A decoded frame header.
struct frame_header {
  frame_type type = frame_type::data;
  std::uint16_t flags = 0;
  std::uint32_t seq = 0;
  wire_status status = wire_status::ok;
  std::uint64_t length = 0;
  std::uint64_t addr = 0;
  std::uint64_t key = 0;

  friend constexpr bool operator==(const frame_header&, const frame_header&) noexcept = default;
};

/// Why a header was refused (or that more bytes are needed).
enum class frame_status : std::uint8_t {
  ok,           ///< a valid header
  need_more,    ///< fewer than `wire::header_size` bytes given
  bad_magic,    ///< not a gdr frame (or the stream is out of step)
  bad_version,  ///< another version of the protocol
  bad_type,     ///< unknown frame type
  bad_flags,    ///< a flag bit set (none is defined)
  bad_field,    ///< a field that must be zero is not, or an unknown status
  too_long,     ///< `length` above the receiver's limit
};

/// A printable name for a frame status.
constexpr const char* to_string(frame_status s) noexcept {
  switch (s) {
    case frame_status::ok: return "ok";
    case frame_status::need_more: return "need more bytes";
    case frame_status::bad_magic: return "bad magic";
    case frame_status::bad_version: return "unsupported version";
    case frame_status::bad_type: return "unknown frame type";
    case frame_status::bad_flags: return "unknown flags";
    case frame_status::bad_field: return "malformed field";
    case frame_status::too_long: return "length over the limit";
  }
  return "?";
}

/// The result of `parse_frame`: `header` is meaningful only when `status` is `ok`.
struct frame_parse_result {
  frame_status status = frame_status::need_more;
  frame_header header{};
};

namespace detail {

// Little-endian fields. At run time on a little-endian host one unaligned
// load or store each (the byte loops below were a third of the instructions
// per 8-byte message: gcc did not merge them); the loops remain for
// constant evaluation and big-endian hosts.
template <class U>
constexpr void put_le(std::byte* p, U v) noexcept {
  static_assert(std::is_unsigned_v<U>);
  if (!std::is_constant_evaluated() && std::endian::native == std::endian::little) {
    std::memcpy(p, &v, sizeof v);
    return;
  }
  for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
template <class U>
constexpr U get_le(const std::byte* p) noexcept {
  static_assert(std::is_unsigned_v<U>);
  if (!std::is_constant_evaluated() && std::endian::native == std::endian::little) {
    U v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) v = static_cast<U>(v | (static_cast<U>(p[i]) << (8 * i)));
  return v;
}

}  // namespace detail

/// Bytes that follow a valid header on the wire.
constexpr std::uint64_t payload_size(const frame_header& h) noexcept {
  switch (h.type) {
    case frame_type::data:
    case frame_type::put_request:
    case frame_type::get_reply: return h.length;
    default: return 0;
  }
}

/// Writes `h` as 40 bytes at `out` (which must have room for them).
constexpr void encode_frame(const frame_header& h, std::byte* out) noexcept {
  detail::put_le<std::uint32_t>(out + 0, wire::magic);
  detail::put_le<std::uint8_t>(out + 4, wire::version);
  detail::put_le<std::uint8_t>(out + 5, static_cast<std::uint8_t>(h.type));
  detail::put_le<std::uint16_t>(out + 6, h.flags);
  detail::put_le<std::uint32_t>(out + 8, h.seq);
  detail::put_le<std::uint32_t>(out + 12, static_cast<std::uint32_t>(h.status));
  detail::put_le<std::uint64_t>(out + 16, h.length);
  detail::put_le<std::uint64_t>(out + 24, h.addr);
  detail::put_le<std::uint64_t>(out + 32, h.key);
}

/// Decodes and validates the header at the start of `in` (bytes after the
/// first 40 are ignored). `max_message` limits `length`. Never reads past
/// `in`, never allocates, constant time.
constexpr frame_parse_result parse_frame(std::span<const std::byte> in,
                                         std::uint64_t max_message = wire::default_max_message) noexcept {
  frame_parse_result r;
  if (in.size() < wire::header_size) return r;  // need_more
  const std::byte* p = in.data();
  if (detail::get_le<std::uint32_t>(p) != wire::magic) return {frame_status::bad_magic, {}};
  if (detail::get_le<std::uint8_t>(p + 4) != wire::version) return {frame_status::bad_version, {}};
  auto type = detail::get_le<std::uint8_t>(p + 5);
  if (type < static_cast<std::uint8_t>(frame_type::data) || type > static_cast<std::uint8_t>(frame_type::close))
    return {frame_status::bad_type, {}};
  frame_header& h = r.header;
  h.type = static_cast<frame_type>(type);
  h.flags = detail::get_le<std::uint16_t>(p + 6);
  h.seq = detail::get_le<std::uint32_t>(p + 8);
  auto status = detail::get_le<std::uint32_t>(p + 12);
  h.length = detail::get_le<std::uint64_t>(p + 16);
  h.addr = detail::get_le<std::uint64_t>(p + 24);
  h.key = detail::get_le<std::uint64_t>(p + 32);
  if (h.flags != 0) return {frame_status::bad_flags, {}};
  if (status > static_cast<std::uint32_t>(wire_status::remote_access)) return {frame_status::bad_field, {}};
  h.status = static_cast<wire_status>(status);

  bool ok = true;
  switch (h.type) {
    case frame_type::data: ok = status == 0 && h.addr == 0 && h.key == 0; break;
    case frame_type::put_request:
    case frame_type::get_request: ok = status == 0; break;
    case frame_type::put_ack: ok = h.length == 0 && h.key == 0 && h.addr <= 0xffffffffu; break;
    case frame_type::get_reply:
      ok = h.key == 0 && h.addr <= 0xffffffffu && (h.status == wire_status::ok || h.length == 0);
      break;
    case frame_type::close: ok = status == 0 && h.length == 0 && h.addr == 0 && h.key == 0; break;
  }
  if (!ok) return {frame_status::bad_field, {}};
  if (h.length > max_message) return {frame_status::too_long, {}};
  r.status = frame_status::ok;
  return r;
}

}  // namespace gdr::tcp
