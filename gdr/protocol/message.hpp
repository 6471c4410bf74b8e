/// \file
/// The protocol layer's vocabulary: the messages two endpoints exchange,
/// whatever transport carries them, and the check every received header
/// passes before the protocol acts on it.
///
/// A transport carries each message as a header plus, for some types, a
/// payload of `header::length` bytes that follows it (TCP encodes the header
/// in its frame format, `gdr/transport/tcp/frame.hpp`; loopback hands the
/// struct over as it is). Which fields a type uses:
///
/// | type            | payload  | fields                                                    |
/// |-----------------|----------|-----------------------------------------------------------|
/// | `hello`         | none     | `size` = largest message accepted, `tag` = capabilities,  |
/// |                 |          | `id` = protocol version, `addr` = largest payload of one  |
/// |                 |          | frame into staged memory (its chunk; 0 = no limit), `key` |
/// |                 |          | = its reply slots: the put and get requests the peer may  |
/// |                 |          | have unanswered at once (0 = no limit)                    |
/// | `eager`         | message  | `tag`                                                     |
/// | `rts`           | none     | `size` = message bytes, `tag`, `id` = sender's send id    |
/// | `rtr`           | none     | `id` = send id, `size` = bytes accepted, `addr` = token,  |
/// |                 |          | `key` = largest data frame it takes (0 = one frame)       |
/// | `data`          | segment  | `addr` = the receiver's token (from its `rtr`), `size` =  |
/// |                 |          | the segment's offset, flag `last` on the final segment;   |
/// |                 |          | flags `last` and `withdrawn`, no bytes, offset 0: the     |
/// |                 |          | answer to an `rtr` whose send the sender withdrew before  |
/// |                 |          | that `rtr` reached it                                     |
/// | `rts_cancel`    | none     | `id` = send id                                            |
/// | `rts_withdrawn` | none     | `id` = send id                                            |
/// | `put_request`   | bytes    | `id` = request id, `addr`, `key`                          |
/// | `put_ack`       | none     | `id` = request id, `status`                               |
/// | `get_request`   | none     | `size` = bytes asked, `id` = request id, `addr`, `key`    |
/// | `get_reply`     | bytes    | `id` = request id, `status` (no payload unless ok)        |
/// | `close`         | none     | -                                                         |
/// | `credit`        | none     | `size` = bytes, `id` = messages this side may now take    |
/// |                 |          | more of, eager or announced, beyond what it already took  |
/// | `atomic_request`| 16 bytes | `tag` = 1 fetch-and-add, 2 compare-and-swap, `size` = 8,  |
/// |                 |          | `id` = request id, `addr`, `key`; payload: the operand    |
/// |                 |          | (or the expected value) and the value to swap in; the     |
/// |                 |          | answer is a `get_reply` of the word's old value           |
///
/// Every field a type does not use must be zero: a header that breaks that,
/// or names a length over the receiver's limit, is a protocol error.
///
/// Segments. A rendezvous message's bytes travel as one `data` frame, or as
/// several (at consecutive offsets, in order, the last flagged) when either
/// side stages them through bounce buffers: a sender of `Device` memory sends
/// each chunk as it is copied out, and a receiver into `Device` memory asks
/// for frames no larger than its bounce buffers (`rtr`'s `key`). Puts and
/// gets that touch `Device` memory on either side are split the same way into
/// several requests, each answered on its own.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gdr::detail::proto {

/// The protocol's version, sent in `hello`. Version 1 was TCP's first frame
/// format (no tags, no rendezvous, no handshake).
inline constexpr std::uint64_t version = 2;

/// Message types. The values are on the wire.
enum class msg : std::uint8_t {
  hello = 1,          ///< first message each way: limits and capabilities
  eager = 2,          ///< a whole small message
  rts = 3,            ///< ready to send: a large message is waiting on the sender
  rtr = 4,            ///< ready to receive: a receive matched an `rts`
  data = 5,           ///< a large message's bytes, into the receive named by its token
  rts_cancel = 6,     ///< the sender withdraws an `rts` no receive has matched
  rts_withdrawn = 7,  ///< no receive will take that `rts`: the answer to `rts_cancel` (else an `rtr` comes), or unasked from a closing receiver
  put_request = 8,    ///< one-sided write into the receiver's registered memory
  put_ack = 9,        ///< answer to `put_request`
  get_request = 10,   ///< one-sided read of the receiver's registered memory
  get_reply = 11,     ///< answer to `get_request`, with the bytes when ok
  close = 12,         ///< orderly end: the sender sends nothing more
  credit = 13,        ///< room for more eager and announced messages (after hello: the first grant)
  atomic_request = 14,  ///< one-sided atomic on an 8-byte word of the receiver's registered memory
};
inline constexpr std::uint8_t msg_min = 1;
inline constexpr std::uint8_t msg_max = 14;

/// A printable name ("eager", "rts", ...).
constexpr const char* to_string(msg m) noexcept {
  switch (m) {
    case msg::hello: return "hello";
    case msg::eager: return "eager";
    case msg::rts: return "rts";
    case msg::rtr: return "rtr";
    case msg::data: return "data";
    case msg::rts_cancel: return "rts_cancel";
    case msg::rts_withdrawn: return "rts_withdrawn";
    case msg::put_request: return "put_request";
    case msg::put_ack: return "put_ack";
    case msg::get_request: return "get_request";
    case msg::get_reply: return "get_reply";
    case msg::close: return "close";
    case msg::credit: return "credit";
    case msg::atomic_request: return "atomic_request";
  }
  return "?";
}

/// Status of an answer (`put_ack`, `get_reply`). Values are on the wire.
enum class status : std::uint8_t {
  ok = 0,
  remote_access = 1,  ///< outside a registration, wrong key, revoked, or not permitted
  no_memory = 2,      ///< the target could not allocate the reply slot to serve it
};

/// Capability bits of `hello`'s `tag`.
namespace caps {
inline constexpr std::uint64_t host = 1u << 0;       ///< accepts Host and Pinned memory
inline constexpr std::uint64_t device = 1u << 1;     ///< can stage Device memory (staged path)
inline constexpr std::uint64_t gpudirect = 1u << 2;  ///< GPUDirect RDMA probed and working
inline constexpr std::uint64_t atomics = 1u << 3;    ///< serves `atomic_request`
inline constexpr std::uint64_t known = host | device | gpudirect | atomics;
}  // namespace caps

/// `atomic_request`'s operations (its `tag`).
inline constexpr std::uint64_t atomic_fetch_add = 1;
inline constexpr std::uint64_t atomic_compare_swap = 2;

/// Flag bits of `header::flags`.
namespace flag {
inline constexpr std::uint16_t last = 1u << 0;  ///< `data`: the message's final segment
/// `data`, always with `last`, length and offset 0: the sender withdrew the
/// message (its send was stopped or timed out) before the receiver's `rtr`
/// reached it; no bytes come, and the receive fails with `errc::withdrawn`.
inline constexpr std::uint16_t withdrawn = 1u << 1;
}  // namespace flag

/// The flags a header of type `m` may carry: `flag::last` on `data`, or
/// `last` with `withdrawn`; none elsewhere.
constexpr bool flags_allowed(msg m, std::uint16_t flags) noexcept {
  return flags == 0 || (m == msg::data && (flags == flag::last || flags == (flag::last | flag::withdrawn)));
}

/// One protocol message's header (see the file comment for the fields each
/// type uses).
struct header {
  msg type = msg::eager;
  status st = status::ok;
  std::uint16_t flags = 0;  ///< `flag::last` on `data`; zero elsewhere
  std::uint64_t length = 0;  ///< payload bytes that follow
  std::uint64_t size = 0;
  std::uint64_t tag = 0;
  std::uint64_t id = 0;
  std::uint64_t addr = 0;
  std::uint64_t key = 0;

  friend constexpr bool operator==(const header&, const header&) noexcept = default;
};

/// Bytes of payload that follow a header of this type on the wire.
constexpr bool has_payload(msg m) noexcept {
  return m == msg::eager || m == msg::data || m == msg::put_request || m == msg::get_reply || m == msg::atomic_request;
}

/// Checks the fields of a received header: unused fields zero, known
/// status, payload within `max_message` (this side's limit). True if valid.
/// The transport checks its own framing (magic, version, order) first.
constexpr bool valid(const header& h, std::uint64_t max_message) noexcept {
  if (!flags_allowed(h.type, h.flags)) return false;
  if (static_cast<std::uint8_t>(h.st) > static_cast<std::uint8_t>(status::no_memory)) return false;
  bool st_zero = h.st == status::ok;
  if (!has_payload(h.type) && h.length != 0) return false;
  if (h.length > max_message) return false;
  switch (h.type) {
    case msg::hello:
      return st_zero && (h.tag & ~caps::known) == 0 && h.id >= 2 && h.size != 0;
    case msg::eager: return st_zero && h.size == 0 && h.id == 0 && h.addr == 0 && h.key == 0;
    case msg::rts: return st_zero && h.addr == 0 && h.key == 0 && h.size <= max_message;
    case msg::rtr: return st_zero && h.tag == 0;
    case msg::data:
      return st_zero && h.tag == 0 && h.id == 0 && h.key == 0 && h.size <= max_message &&
             ((h.flags & flag::withdrawn) == 0 || (h.length == 0 && h.size == 0));
    case msg::rts_cancel:
    case msg::rts_withdrawn:
    case msg::close:
      return st_zero && h.size == 0 && h.tag == 0 && h.addr == 0 && h.key == 0 &&
             (h.type != msg::close || h.id == 0);
    case msg::put_request: return st_zero && h.size == 0 && h.tag == 0;
    case msg::get_request: return st_zero && h.tag == 0 && h.size <= max_message;
    case msg::put_ack: return h.size == 0 && h.tag == 0 && h.addr == 0 && h.key == 0;
    case msg::get_reply:
      return h.size == 0 && h.tag == 0 && h.addr == 0 && h.key == 0 && (st_zero || h.length == 0);
    case msg::credit: return st_zero && h.tag == 0 && h.addr == 0 && h.key == 0;
    case msg::atomic_request:
      return st_zero && h.length == 2 * sizeof(std::uint64_t) && h.size == sizeof(std::uint64_t) &&
             (h.tag == atomic_fetch_add || h.tag == atomic_compare_swap);
  }
  return false;
}

}  // namespace gdr::detail::proto
