/// \file
/// The TCP transport's wire format (version 2), and a pure parser for it.
///
/// A connection carries, in each direction, a sequence of frames: a fixed
/// 64-byte header, then `header.length` bytes of payload. Each frame is one
/// protocol message (`gdr/protocol/message.hpp` says which fields each type
/// uses). All integers are little-endian.
///
/// \verbatim
///   offset size field    meaning
///   0      4    magic    "GDRT" (0x47 0x44 0x52 0x54)
///   4      1    version  2
///   5      1    type     the protocol message (gdr::detail::proto::msg)
///   6      2    flags    data: 1 = last segment, 3 = last and withdrawn (no
///                        bytes: the sender withdrew it); else 0 (any other
///                        bit, or a flag on another type, is an error)
///   8      4    seq      this frame's number in its direction: 0, 1, 2... (mod 2^32)
///   12     1    status   answers: 0 ok, 1 remote access denied; else 0
///   13     3    -        0
///   16     8    length   payload bytes that follow
///   24     8    size     rts: message bytes; rtr: bytes accepted; get_request:
///                        bytes asked for; hello: the largest message accepted
///   32     8    tag      eager, rts: the message's tag; hello: capabilities
///   40     8    id       rts, rtr, rts_cancel, rts_withdrawn: the send id;
///                        put/get requests and answers: the request id;
///                        hello: the protocol version
///   48     8    addr     rtr, data: the receive's token; put/get_request:
///                        address in the receiver's memory
///   56     8    key      put/get_request: the registration key
/// \endverbatim
///
/// The first frame each way is `hello` (version 2 only, so far). Version 1
/// (40-byte headers, no tags, no rendezvous) is refused with `bad_version`.
///
/// Parsing is strict (`parse_frame`): wrong magic or version, an unknown
/// type, a flag bit, a field that must be zero and is not, or a length over
/// the receiver's limit is an error, and the receiver closes the connection
/// (`errc::protocol_error`). Nothing here allocates or keeps state: the parser
/// is safe to feed arbitrary bytes (`tests/transport/tcp/frame_fuzz.cpp`).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include <gdr/protocol/message.hpp>

namespace gdr::tcp {

namespace wire {
/// "GDRT" read as a little-endian 32-bit integer.
inline constexpr std::uint32_t magic = 0x54524447u;
/// This format's version.
inline constexpr std::uint8_t version = 2;
/// Bytes of every frame header.
inline constexpr std::size_t header_size = 64;
}  // namespace wire

/// A protocol message's header (`gdr/protocol/message.hpp`).
using frame_header = gdr::detail::proto::header;
/// The message types, which are the frame types.
using frame_type = gdr::detail::proto::msg;

/// Why a header was refused.
enum class frame_status : std::uint8_t {
  ok,           ///< a valid header
  need_more,    ///< fewer than `wire::header_size` bytes given
  bad_magic,    ///< not a gdr frame (or the stream is out of step)
  bad_version,  ///< another version of the wire format
  bad_type,     ///< unknown frame type
  bad_flags,    ///< a flag bit set that the frame's type does not define
  bad_field,    ///< a field that must be zero is not, an unknown status, or out of order
  too_long,     ///< a length above the receiver's limit
};

/// A printable reason.
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

/// What `parse_frame` found.
struct frame_parse_result {
  frame_status status = frame_status::need_more;
  frame_header header{};
  std::uint32_t seq = 0;
};

namespace detail {

// Little-endian fields. At run time on a little-endian host one unaligned
// load or store each (byte loops were a third of the instructions per
// 8-byte message: gcc did not merge them); the loops remain for constant
// evaluation and big-endian hosts.
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

/// Bytes of payload that follow a header on the wire.
constexpr std::uint64_t payload_size(const frame_header& h) noexcept { return h.length; }

/// Writes `h` with sequence number `seq` as `wire::header_size` bytes at `out`.
constexpr void encode_frame(const frame_header& h, std::uint32_t seq, std::byte* out) noexcept {
  detail::put_le<std::uint32_t>(out + 0, wire::magic);
  detail::put_le<std::uint8_t>(out + 4, wire::version);
  detail::put_le<std::uint8_t>(out + 5, static_cast<std::uint8_t>(h.type));
  detail::put_le<std::uint16_t>(out + 6, h.flags);
  detail::put_le<std::uint32_t>(out + 8, seq);
  detail::put_le<std::uint32_t>(out + 12, static_cast<std::uint32_t>(h.st));  // status + 3 zero bytes
  detail::put_le<std::uint64_t>(out + 16, h.length);
  detail::put_le<std::uint64_t>(out + 24, h.size);
  detail::put_le<std::uint64_t>(out + 32, h.tag);
  detail::put_le<std::uint64_t>(out + 40, h.id);
  detail::put_le<std::uint64_t>(out + 48, h.addr);
  detail::put_le<std::uint64_t>(out + 56, h.key);
}

/// Parses the header at the start of `in`. `max_message` is this side's
/// limit on lengths. Never reads past `in`; never allocates.
constexpr frame_parse_result parse_frame(std::span<const std::byte> in,
                                         std::uint64_t max_message = std::uint64_t{1} << 30) noexcept {
  namespace proto = gdr::detail::proto;
  frame_parse_result r;
  if (in.size() < wire::header_size) return r;  // need_more
  const std::byte* p = in.data();
  if (detail::get_le<std::uint32_t>(p) != wire::magic) return {frame_status::bad_magic, {}, 0};
  if (detail::get_le<std::uint8_t>(p + 4) != wire::version) return {frame_status::bad_version, {}, 0};
  auto type = detail::get_le<std::uint8_t>(p + 5);
  if (type < proto::msg_min || type > proto::msg_max) return {frame_status::bad_type, {}, 0};
  frame_header& h = r.header;
  h.type = static_cast<frame_type>(type);
  h.flags = detail::get_le<std::uint16_t>(p + 6);
  r.seq = detail::get_le<std::uint32_t>(p + 8);
  auto status = detail::get_le<std::uint32_t>(p + 12);
  h.length = detail::get_le<std::uint64_t>(p + 16);
  h.size = detail::get_le<std::uint64_t>(p + 24);
  h.tag = detail::get_le<std::uint64_t>(p + 32);
  h.id = detail::get_le<std::uint64_t>(p + 40);
  h.addr = detail::get_le<std::uint64_t>(p + 48);
  h.key = detail::get_le<std::uint64_t>(p + 56);
  if (!proto::flags_allowed(h.type, h.flags)) return {frame_status::bad_flags, {}, 0};
  if (status > static_cast<std::uint8_t>(proto::status::no_memory)) return {frame_status::bad_field, {}, 0};
  h.st = static_cast<proto::status>(status);
  if (h.length > max_message) return {frame_status::too_long, {}, 0};
  if (!proto::valid(h, max_message)) return {frame_status::bad_field, {}, 0};
  r.status = frame_status::ok;
  return r;
}

}  // namespace gdr::tcp
