/// \file
/// What users set and read on every endpoint, whatever its transport: tags,
/// the protocol's tuning, its counters, and the per-operation report.
#pragma once

#include <cstddef>
#include <cstdint>
#include <system_error>

#include <gdr/transfer/common.hpp>
#include <gdr/transfer/path.hpp>

namespace gdr {

/// A message's tag. Receives match messages of their own tag only, in the
/// order both were started; independent streams of messages share an
/// endpoint by using different tags. `gdr::tag{0}` is the default.
///
///   co_await ep.send(v, gdr::tag{7});
///   co_await ep.recv(w, gdr::tag{7});
enum class tag : std::uint64_t {};

/// Which protocol carried a message (`op_report::protocol`).
enum class wire_protocol : std::uint8_t {
  none,        ///< no message (put, get, close, or nothing moved)
  eager,       ///< the whole message in one go, kept by the receiver if early
  rendezvous,  ///< announced first; the bytes moved once the receive was posted
};

/// A printable name ("eager", "rendezvous", "none").
constexpr const char* to_string(wire_protocol p) noexcept {
  switch (p) {
    case wire_protocol::none: return "none";
    case wire_protocol::eager: return "eager";
    case wire_protocol::rendezvous: return "rendezvous";
  }
  return "?";
}

/// Tuning of an endpoint's staged path (`protocol_options::staging`).
struct staging_options {
  /// Bytes per chunk: one device-to-host or host-to-device copy, one bounce
  /// buffer, and the largest frame payload this side takes into staged
  /// memory (told to the peer in the handshake). 4 MiB by measurement on an
  /// H200 (benchmarks/RESULTS.md, "staged path"): over TCP between two
  /// processes 4 MiB chunks beat 256 KiB and 1 MiB ones at every size from
  /// 1 MiB to 1 GiB, and in one process (the pipeline alone) they reach the
  /// host memcpy's rate; smaller chunks pay the per-chunk cost of the copy
  /// calls and events more often.
  std::size_t chunk = std::size_t{4} << 20;
  /// Bounce buffers per direction per endpoint: how many chunks may be in
  /// flight at once (copying or on the wire). Allocated (pinned) once, at the
  /// endpoint's first staged operation of that direction, and reused: the
  /// defaults pin 16 MiB per direction of an endpoint that moves Device
  /// memory. Depths 2, 4 and 8 measured alike; 4 leaves room for a second
  /// message.
  std::size_t depth = 4;
};

/// Tuning of the protocol layer of one endpoint (every transport).
struct protocol_options {
  /// Messages larger than this go by rendezvous: only an announcement
  /// travels until the receive is posted, then the bytes move straight into
  /// it. Smaller ones are sent at once, straight into a posted receive, or
  /// kept by the receiver if early. A rendezvous costs one round trip more
  /// when the receive is already posted; at 256 KiB that is about 25% of a
  /// TCP ping-pong on loopback and at 2 MiB about 3%, while a stream with
  /// several messages in flight hides it (benchmarks/RESULTS.md). Above the
  /// bandwidth-delay product of a datacenter link (about 100 KiB,
  /// shared/PROTOCOL-LAYER.md lesson 5) either way fills the link.
  std::size_t rendezvous_threshold = 256 * 1024;
  /// The most bytes of early eager messages (no receive posted yet) kept per
  /// endpoint. Granted to the peer in advance: past it the peer announces
  /// its messages instead of sending them eager (back-pressure, never loss).
  std::size_t unexpected_bytes = 1024 * 1024;
  /// The most early messages (eager or announced) kept per endpoint; past
  /// it the peer's sends wait on its side until receives take some.
  std::size_t unexpected_messages = 4096;
  /// The peer's one-sided requests (put, get) served at once, and answers
  /// owed to it; the peer keeps at most this many unanswered (told in the
  /// hello), the rest wait on its side. A slot (about 270 bytes) is
  /// allocated when a request first needs it and kept; an idle endpoint
  /// holds none. A request that finds no memory for one fails alone with
  /// `std::errc::not_enough_memory` on the peer's side.
  std::size_t reply_slots = 64;
  /// The longest message, put or get this side accepts; told to the peer in
  /// the handshake, so that a larger send fails alone on the sender with
  /// `errc::message_too_large` instead of breaking the connection.
  std::uint64_t max_message = std::uint64_t{1} << 30;
  /// Which path the endpoint's operations must take (for tests and
  /// benchmarks). Decided at set-up for every row of the path table the
  /// endpoint serves; a path a row does not offer fails the set-up
  /// (`errc::unsupported`), it is never downgraded. `GDR_LOG=path` prints
  /// each decision.
  force_path force = force_path::automatic;
  /// The staged path of `Device` memory (`gdr/sched/copy_engine.hpp`).
  staging_options staging{};
};

/// Counters of one endpoint's protocol layer, updated on its scheduler's
/// thread. Transports extend it with their own (`tcp::endpoint_stats`).
struct protocol_stats : transfer_stats {
  std::uint64_t eager_sends = 0;       ///< sends that went eager
  std::uint64_t rendezvous_sends = 0;  ///< sends that went by rendezvous
  std::uint64_t unexpected = 0;        ///< eager messages kept because no receive was posted
  std::uint64_t unexpected_rts = 0;    ///< announcements kept because no receive was posted
  std::uint64_t paused = 0;            ///< times reading stopped for back-pressure
  std::uint64_t withdrawn = 0;         ///< announced sends withdrawn before their receive's rtr came (a stop,
                                       ///< a timeout, a failed copy), or declined by a closing peer
  std::uint64_t late_rtrs = 0;         ///< of those, sends whose receive had matched them already: its rtr came
                                       ///< late and was answered that nothing comes (`errc::withdrawn` there)
  std::uint64_t answers_most = 0;      ///< the most answers this side made for the peer (to its `rts_cancel`, to
                                       ///< an `rts` while closing) that waited to be written at once; reading
                                       ///< pauses at `unexpected_messages` of them
  std::uint64_t truncated = 0;         ///< receives that got a larger message than their view
  std::uint64_t served_puts = 0;       ///< the peer's puts applied to registered memory
  std::uint64_t served_gets = 0;       ///< the peer's gets answered with data
  std::uint64_t refused = 0;           ///< the peer's puts/gets refused (errc::remote_access on its side)
  std::uint64_t no_memory = 0;         ///< the peer's puts/gets refused for want of memory for a reply slot
                                       ///< (`std::errc::not_enough_memory` on its side)
  std::uint64_t staged_chunks = 0;     ///< device copies of the staged path (chunks through bounce buffers)
};

/// Everything known about one finished operation:
/// `co_await std::move(op).report()`.
struct op_report {
  std::error_code error{};              ///< empty on success
  std::size_t bytes = 0;                ///< bytes moved into or out of the caller's view
  std::size_t message_size = 0;         ///< receives: the message's full size (> bytes when truncated)
  std::uint64_t tag = 0;                ///< the message's tag (sends and receives)
  transfer_path path = transfer_path::none;
  wire_protocol protocol = wire_protocol::none;
};

}  // namespace gdr
