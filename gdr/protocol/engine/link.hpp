/// \file
/// What the engine and a transport hand each other: an outgoing `frame`
/// (the protocol's header, its payload, the transport's bookkeeping of it)
/// and an `rx_plan` (where an incoming payload goes). The hooks a transport
/// implements and the events it calls are `engine`'s (engine/engine.hpp).
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>

#include <gdr/protocol/message.hpp>
#include <gdr/sched/stream_order.hpp>

namespace gdr::detail::proto {

class op;
struct reply_slot;
struct stage_slot;

/// An outgoing frame: the protocol's header and payload, plus the
/// transport's bookkeeping of it. Lives in an operation or a reply slot.
struct frame {
  /// A fresh frame: a zero header, no owner, no transport state.
  frame() noexcept : hdr{} { clear(); }
  /// A frame nothing has posted yet and that `reset` makes fresh before
  /// its first post: only what says it is not posted is set. (An operation
  /// holds three frames and uses the second and third only on its rarer
  /// paths; making them fresh cost a small send a tenth of its
  /// bookkeeping.)
  struct unposted_t {};
  explicit frame(unposted_t) noexcept {}

  union {
    header hdr;  ///< unset in an `unposted` frame until `reset`
  };
  const std::byte* payload;  ///< `hdr.length` bytes
  op* owner;                 ///< the operation it belongs to, or
  reply_slot* slot;          ///< the reply slot it belongs to (or neither: the engine's own)
  stage_slot* sslot;         ///< the staging slot it belongs to (a segment)
  /// The engine's outbox (frames posted inside an event, handed to the
  /// transport at its end): the next one, and whether it is there.
  frame* out_next = nullptr;
  bool in_outbox = false;
  /// Posted after this side's close frame: it goes back from the outbox
  /// unsent (`on_sent` with `errc::closed`), never to the transport.
  bool after_close = false;
  bool own_answer = false;  ///< an answer allocated for itself, freed once sent (engine/answers.hpp)
  bool own_announcement = false;  ///< a rendezvous send's announcement (engine/withdrawals.hpp)
  // ---- the transport's (queue links, progress, its encoding of the header) ----
  frame* prev;
  frame* next;
  std::size_t written;
  bool queued = false;  ///< in the transport's queue (posted, no on_sent yet)
  bool sealed;          ///< committed: can no longer be withdrawn
  bool in_flight;       ///< part of a write the kernel is doing now
  std::uint8_t where;   ///< which of the transport's lists holds it
  /// Set by the engine: the bytes this frame carries or names (a payload, an
  /// rtr's receive, a request's local memory) may be moved by the NIC only,
  /// never copied by the CPU: `Device` memory on a GPUDirect endpoint, or a
  /// put's or get's host memory whose peer side is `Device` memory.
  /// `device`: the GPU whose memory it is (-1: host memory). A transport
  /// that cannot move them by RDMA fails the connection with
  /// `errc::gpudirect_unavailable` instead of copying.
  bool nic_only;
  std::int8_t device;
  std::uint32_t seq;
  /// The transport's encoding of `hdr` (TCP: the wire header), written when
  /// the frame is sealed. Deliberately not initialised, like the fields
  /// of an unposted frame.
  alignas(8) std::byte encoded[64];

  /// Marks the frame as carrying or naming memory only the NIC may move
  /// (`nic_only`) of GPU `dev` (-1: host memory): see `nic_only`.
  void mark_nic(int dev, bool only) noexcept {
    nic_only = only;
    device = static_cast<std::int8_t>(dev < 0 ? -1 : dev);
  }

  /// Makes the frame a fresh one of `owner` (no transport state, a zero
  /// header), without touching `encoded`.
  void reset(op* o) noexcept {
    assert(!in_outbox && "gdr: a frame in the engine's outbox was reused");
    hdr = header{};
    clear();
    owner = o;
  }

 private:
  void clear() noexcept {
    payload = nullptr;
    owner = nullptr;
    slot = nullptr;
    sslot = nullptr;
    prev = next = nullptr;
    written = 0;
    queued = sealed = in_flight = false;
    where = 0;
    nic_only = false;
    device = -1;
    seq = 0;
  }
};

/// Where the transport is to put a payload (`engine::on_header`).
struct rx_plan {
  enum class action : std::uint8_t {
    place,  ///< `want` bytes to `dst`, then drop `discard` bytes, then on_placed()
    pause,  ///< nothing consumed: offer this header again after link_resume()
    fail,   ///< a protocol error: the header is not acceptable
  };
  action act = action::place;
  std::byte* dst = nullptr;
  std::size_t want = 0;
  std::uint64_t discard = 0;
  /// `dst` is `Device` memory of this GPU on a GPUDirect endpoint (-1: host
  /// memory): only the NIC may write it. A transport that would copy the
  /// payload with the CPU fails the connection (`errc::gpudirect_unavailable`).
  int device = -1;
  /// The stream work the placement waits for (the receiving operation's
  /// `op_options::after`, for a receive's or a get's payload): a transport
  /// whose GPU writes `dst` itself (CUDA IPC, a GPU copy out of a ring)
  /// orders that write after it.
  stream_order after{};
};

}  // namespace gdr::detail::proto
