/// \file
/// The verbs transport's data path: one RC queue pair under a protocol
/// engine (`gdr/protocol/engine.hpp`), and the transport's tag, options and
/// counters.
///
/// How it works
/// ============
/// A `connection` lives on the heap and belongs to one scheduler; everything
/// below runs on that scheduler's thread. Its work requests complete through
/// the scheduler's `cq_poller` (`gdr/transport/verbs/completion.hpp`): every
/// `wr_id` is a receive buffer or a send slot of this connection.
///
/// Frames. Every protocol frame starts as a SEND of a 72-byte verbs header
/// (`detail::verbs::wire_header`: the protocol header, a credit grant, and
/// for an `rtr` the receive buffer's address and remote key) followed by
/// the first payload bytes; a payload larger than one buffer continues in
/// further SENDs (`cont`), in order (RC delivers in order). A SEND of at
/// most the queue pair's inline limit goes inline, straight from the
/// user's buffer (the CPU copies it into the work request); a larger one is
/// copied into a registered send slot.
///
/// Rendezvous data. The receive that answers an announcement registers its
/// view and sends the address and key in its `rtr`. The sender registers the
/// message and posts unsignaled RDMA WRITEs and one signaled
/// `RDMA_WRITE_WITH_IMM` (immediate = the `rtr`'s token) straight from its
/// buffer into the receiver's: no copy on either side
/// (`transfer_path::host_zero_copy`). The immediate consumes a receive buffer
/// and gives the receiver a completion in order with the other frames; the
/// receiver then hands the engine the `data` header, with the bytes already
/// in place. Until that completion the receiver keeps its `rtr` frame (and so
/// the receive's memory, even if the receive was cancelled meanwhile): the
/// peer's NIC may be writing into it. A receive whose view cannot be
/// registered sends its `rtr` without a key and gets the data as SENDs
/// through the bounce buffers (`host_eager`).
///
/// Puts and gets. The protocol layer checks every access to exposed memory
/// at the target (key, range, permission, revocation: `memory_registry`),
/// so the target's NIC moves the bytes, never the initiator's with a key to
/// the target's memory: a request whose bytes do not fit one SEND carries
/// the address and key of the initiator's memory instead. The target checks
/// it, holds its lease, and reads a put's payload with RDMA READ straight
/// into the exposed memory (then answers `put_ack`), or writes a get's reply
/// with RDMA WRITE + WRITE_WITH_IMM straight from it (immediate = the
/// request id with bit 31 set: the reply itself). A refused request is
/// answered with a SEND and nothing is read or written; a revoked key
/// waits for the READ or WRITE in flight, as for any access. The initiator
/// holds its request frame (its memory registered, the operation
/// unfinished even if cancelled) until the answer has come. While a READ
/// runs, the frames behind it wait (placement is in order).
///
/// GPUDirect (`endpoint_options::gpudirect`). The engine marks what only
/// the NIC may move (`frame::nic_only`, `rx_plan::device`: GPU memory, and a
/// put's or get's host memory whose peer side is GPU memory). Such memory is
/// registered in the device's GPU cache (dma-buf or peermem), every such
/// request carries its key whatever its size, and every byte goes by RDMA
/// WRITE or READ. Where a SEND or a bounce-buffer copy would be needed
/// instead (a registration failed, the peer offered no key or sent SENDs),
/// the connection fails with `errc::gpudirect_unavailable` (`gpudirect_fail`).
/// On a GPU that needs it (`gpudirect_report::needs_flush`), each NIC write
/// into GPU memory ends with a one-byte READ through the device's loopback
/// queue pair (`gdr/transport/verbs/flush.hpp`) before its placement
/// completes; parsing waits meanwhile, as for a READ.
///
/// Completions. A frame whose bytes are all copied when its last SEND is
/// posted (inline, or into a send slot) is ended then: it waits in
/// `copied_` and goes back to the engine at the end of the handler
/// (`link_flush`). A frame that carries a key (an rtr, a large put's or
/// get's request), the close frame and an RDMA WRITE's frame end on their
/// work completion (a keyed one later still, see above). One send-queue
/// request in `signal_every` is signaled (and the one that takes the last
/// slot or queue entry, and one that ends a frame); the others carry
/// `unsignaled_work()`'s id, and those copied into a slot keep it until a
/// later signaled request completes (an RC send queue completes in order).
///
/// Credits. Each side posts `rx_depth` receive buffers before connecting and
/// tells the peer (connection private data). A SEND or WRITE_WITH_IMM
/// consumes one; every header carries the count of buffers this side has
/// consumed and posted again, so the peer knows what it may send. A sender
/// keeps one buffer in reserve for a credit-only message: when one side
/// owes many credits and has nothing to send, it sends one, so two sides
/// that both ran out can never wait for each other. Credits are read when a
/// completion arrives, also while the engine has paused on an earlier
/// header (back-pressure: the paused buffer and those behind it stay
/// consumed, and the sender stops).
///
/// Failure. An error completion, a queue pair event from the device, or
/// rdma_cm's DISCONNECTED (the peer's process closed its connection, or was
/// killed: the kernel sends the disconnect request) fails the engine; the
/// queue pair is moved to the error state, which flushes every posted work
/// request back (`IBV_WC_WR_FLUSH_ERR`). The connection is quiet, and may be
/// freed, once every work request has come back. A peer that vanishes
/// without a word (power, cable) is noticed by the transport's retries:
/// `endpoint_options::ack_timeout` and `retry_count` bound how long a work
/// request waits for an acknowledgement, and an idle connection sends a
/// keepalive (a zero-byte RDMA WRITE) every `endpoint_options::keepalive`,
/// so that a receive waiting on a dead peer fails within about a second
/// too (and unsignaled requests at the end of a burst are accounted for).
#pragma once

#include <infiniband/verbs.h>
#include <liburing.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/engine.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transport/verbs/completion.hpp>
#include <gdr/transport/verbs/memory.hpp>

namespace gdr {

namespace verbs {

/// The verbs transport's tag: the key of its rows in the path table.
struct endpoint_stats;
struct transport {
  static constexpr const char* name = "verbs";
  using stats_type = endpoint_stats;
};

/// Tuning of one endpoint. The defaults suit Soft-RoCE and a datacenter NIC.
struct endpoint_options {
  /// The protocol layer's tuning.
  protocol_options protocol{};
  /// Bytes of each receive buffer and send slot: the largest SEND.
  std::size_t buffer_size = 32 * 1024;
  /// Receive buffers posted (the peer's credits).
  unsigned rx_depth = 64;
  /// Send slots: the bounce buffers of SENDs not yet known to be read by
  /// the NIC.
  unsigned tx_depth = 64;
  /// Ask for a completion on every this-many send-queue work requests at
  /// most (sooner when slots or the send queue run short, and always for
  /// a frame that only its completion can end). 0: `tx_depth / 4`; 1:
  /// every work request is signaled.
  unsigned signal_every = 0;
  /// Inline data asked for at queue pair creation (the device may give
  /// less; `connection::max_inline()` says what it gave). 0: never inline.
  unsigned max_inline = 220;
  /// Users' buffers larger than this are not registered with the NIC (0:
  /// no limit): their bytes go through the bounce buffers instead, and a
  /// put served for a peer is read through a send slot. Bounds the memory
  /// one transfer pins.
  std::size_t registration_limit = 0;
  /// Keep registrations of users' buffers cached after their transfer
  /// (see `gdr/transport/verbs/memory.hpp`: then invalidate before freeing).
  bool cache_registrations = false;
  /// An idle connection probes its peer this often (a zero-byte RDMA
  /// WRITE); zero: never.
  std::chrono::milliseconds keepalive{500};
  /// Local ACK timeout exponent: 4.096 us * 2^ack_timeout per try (15: 134 ms).
  std::uint8_t ack_timeout = 15;
  /// Transport retries before a work request fails (at most 7).
  std::uint8_t retry_count = 7;
  /// Make a zero-copy `Device` endpoint: GPUDirect RDMA is probed for GPU
  /// `gpu` and this endpoint's NIC, and the endpoint is not made if it is
  /// not there (`errc::gpudirect_unavailable`, saying which check failed).
  bool gpudirect = false;
  /// The GPU a zero-copy `Device` endpoint serves (CUDA device ordinal).
  int gpu = 0;
};

/// Counters of one endpoint: the protocol layer's, and the transport's.
struct endpoint_stats : protocol_stats {
  std::uint64_t send_wrs = 0;        ///< SEND work requests (a frame's first buffer, and continuations)
  std::uint64_t inline_sends = 0;    ///< of which inline
  std::uint64_t fragments = 0;       ///< continuation SENDs of payloads larger than a buffer
  std::uint64_t write_wrs = 0;       ///< RDMA WRITE work requests (WITH_IMM included)
  std::uint64_t read_wrs = 0;        ///< RDMA READ work requests (puts this side serves)
  std::uint64_t rdma_received = 0;   ///< payloads the peer wrote straight into a receive or a get
  std::uint64_t rdma_read = 0;       ///< put payloads this side read from the peer's memory
  std::uint64_t credit_messages = 0; ///< credit-only SENDs
  std::uint64_t credit_stalls = 0;   ///< times a frame waited for credits
  std::uint64_t registrations = 0;   ///< users' buffers registered (or found cached)
  std::uint64_t device_registrations = 0;  ///< ... of which GPU memory (GPUDirect)
  std::uint64_t flushes = 0;         ///< GPUDirect flushes (loopback READs) before a Device receive completed
  std::uint64_t registration_failures = 0;  ///< ... that could not be: bounce buffers instead
  std::uint64_t keepalives = 0;      ///< keepalive probes sent
  std::uint64_t signaled_wrs = 0;    ///< send-queue work requests that asked for a completion
  std::uint64_t completions = 0;     ///< work completions of this connection (receives included)
};

}  // namespace verbs

namespace detail::verbs {

using gdr::verbs::endpoint_options;
using gdr::verbs::endpoint_stats;
using proto::frame;

/// What each side tells the other in rdma_cm's private data.
struct conn_params {
  std::uint32_t magic = 0x56524447u;  // "GDRV"
  std::uint16_t version = 2;  // 2: puts and gets by RDMA READ and WRITE
  std::uint16_t flags = 0;    // flag_gpudirect
  std::uint32_t rx_depth = 0;
  std::uint32_t buffer_size = 0;

  /// The endpoint moves `Device` memory with its NIC (GPUDirect). Both ends
  /// must agree: a staging end would send and want `Device` bytes through
  /// bounce buffers, which a GPUDirect end never copies.
  static constexpr std::uint16_t flag_gpudirect = 1;
};
static_assert(sizeof(conn_params) == 16);

/// Why two ends' parameters cannot make a connection (null: they can).
inline const char* params_disagree(const conn_params& mine, const conn_params& peer) noexcept {
  bool a = (mine.flags & conn_params::flag_gpudirect) != 0;
  bool b = (peer.flags & conn_params::flag_gpudirect) != 0;
  if (a && !b)
    return "gdr::verbs: the peer's endpoint stages Device memory (it was made without endpoint_options::gpudirect), "
           "this one moves it with the NIC: make both ends with the same endpoint_options::gpudirect";
  if (!a && b)
    return "gdr::verbs: the peer's endpoint moves Device memory with the NIC (endpoint_options::gpudirect), this one "
           "stages it: make both ends with the same endpoint_options::gpudirect";
  return nullptr;
}

inline bool params_ok(const conn_params& p) noexcept {
  return p.magic == 0x56524447u && p.version == 2 && p.rx_depth >= 2 && p.buffer_size >= 256;
}

/// What starts every SEND (host byte order: both ends run this library on
/// the same architecture).
struct wire_header {
  enum kind_t : std::uint8_t { frame = 1, cont = 2, credit = 3 };
  std::uint8_t kind = 0;
  std::uint8_t type = 0;
  std::uint8_t status = 0;
  std::uint8_t flags = 0;     ///< the protocol header's flags (`proto::flag::last` on data)
  std::uint32_t credits = 0;  ///< receive buffers the sender has consumed and posted again (mod 2^32)
  std::uint64_t length = 0;
  std::uint64_t size = 0;
  std::uint64_t tag = 0;
  std::uint64_t id = 0;
  std::uint64_t addr = 0;
  std::uint64_t key = 0;
  std::uint64_t raddr = 0;  ///< rtr, get_request: where the bytes go; put_request: where they are (0: SENDs)
  std::uint32_t rkey = 0;   ///< its remote key
  std::uint32_t pad1 = 0;
};
static_assert(sizeof(wire_header) == 72);
inline constexpr std::size_t wire_size = sizeof(wire_header);

/// The protocol header a frame header carries, or why not.
inline bool decode(const wire_header& w, std::uint64_t max, proto::header& h) noexcept {
  if (w.kind != wire_header::frame || w.pad1 != 0) return false;
  if (w.type < proto::msg_min || w.type > proto::msg_max) return false;
  if (w.status > static_cast<std::uint8_t>(proto::status::remote_access)) return false;
  h = proto::header{};
  h.type = static_cast<proto::msg>(w.type);
  h.st = static_cast<proto::status>(w.status);
  h.flags = w.flags;
  h.length = w.length;
  h.size = w.size;
  h.tag = w.tag;
  h.id = w.id;
  h.addr = w.addr;
  h.key = w.key;
  if (!proto::valid(h, max)) return false;
  // Only an rtr, a put request (its source) and a get request (its
  // destination) name a buffer of their sender.
  bool names_buffer = h.type == proto::msg::rtr || h.type == proto::msg::put_request || h.type == proto::msg::get_request;
  if (!names_buffer && (w.raddr != 0 || w.rkey != 0)) return false;
  return true;
}

/// The immediate of a WRITE_WITH_IMM: which memory of the receiver's it
/// filled. Bit 31 tells a get's reply (`token`: the receiver's request id)
/// from a rendezvous message (`token`: the receiver's rtr token, which is
/// the sender's id); the two id spaces are separate, so the bit keeps equal
/// low bits apart. 31 bits of the token tell apart everything in flight.
constexpr std::uint32_t imm_of(bool get_reply, std::uint64_t token) noexcept {
  return (get_reply ? 0x80000000u : 0u) | (static_cast<std::uint32_t>(token) & 0x7fffffffu);
}

/// `a` is later than `b` in 32-bit serial arithmetic.
constexpr bool after(std::uint32_t a, std::uint32_t b) noexcept { return static_cast<std::int32_t>(a - b) > 0; }

/// Maps a failed work completion to the endpoint's error.
inline std::error_code wc_error(ibv_wc_status s) noexcept {
  switch (s) {
    case IBV_WC_SUCCESS: return {};
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_REM_OP_ERR: return errc::protocol_error;
    default: return errc::connection_lost;
  }
}

/// One RC queue pair: the verbs transport under a protocol engine. See the
/// file comment.
class connection final : public proto::engine, private gdr::verbs::qp_event_sink {
 public:
  /// Largest RDMA WRITE work request of a rendezvous payload (larger ones
  /// are split, at most `max_write_wrs` requests per payload).
  static constexpr std::size_t write_chunk = std::size_t{8} << 20;
  static constexpr std::size_t max_write_wrs = 32;

  /// Makes the queue pair of `id` (whose device is resolved) on `s`'s
  /// completion queue, registers the bounce buffers and posts the receives.
  /// The connection sends nothing until `start()`. Throws `gdr::error`.
  connection(scheduler& s, rdma_cm_id* id, rdma_event_channel* ch, memory_registry& reg,
             const endpoint_options& o, std::uint64_t caps)
      : engine(s, reg, o.protocol, stats_, caps), id_(id), ch_(ch), vopts_(o) {
    buf_ = std::max<std::size_t>(vopts_.buffer_size, 1024);
    rx_n_ = std::max(vopts_.rx_depth, 4u);
    tx_n_ = std::max(vopts_.tx_depth, 4u);
    sq_depth_ = static_cast<int>(tx_n_ + max_write_wrs * 2);
    signal_every_ = std::clamp(vopts_.signal_every != 0 ? vopts_.signal_every : tx_n_ / 4, 1u, tx_n_);
    kick_.self = this;
    kick_.run = &on_kick;
    cm_watch_.self = this;
    cm_watch_.complete = &on_cm_readable;
    poller_ = &gdr::verbs::cq_poller::acquire(s);
    if (vopts_.gpudirect) {
      // The endpoint's decide() has found the probe's yes (it refuses a no).
      gpudirect_ = &gdr::verbs::probe_gpudirect(vopts_.gpu, id->verbs);
      set_device_direct(true);
    }
    flush_work_.c = this;
    flush_work_.complete = &on_flush;
    try {
      setup();
    } catch (...) {
      // The caller keeps the id and its channel; only what setup() made goes.
      if (id_->qp != nullptr) {
        if (dq_ != nullptr) poller_->unwatch_qp(dq_, id_->qp);
        rdma_destroy_qp(id_);
      }
      id_ = nullptr;
      ch_ = nullptr;
      teardown();
      throw;
    }
  }

  /// The connection is established and the peer's parameters known: say
  /// hello, start watching rdma_cm's events.
  void start(const conn_params& peer) noexcept {
    peer_rx_ = peer.rx_depth;
    frag_ = std::min<std::size_t>(buf_, peer.buffer_size);
    established_ = true;
    enter();
    if (needs_flush() && !dq_->flush) {
      // Now that rdma_cm has set the connection's address vector up.
      auto f = gdr::verbs::make_flush_qp(dq_->pd, dq_->cq, id_);
      if (f) {
        dq_->flush = std::move(*f);
      } else {
        std::fprintf(stderr, "gdr verbs: the GPUDirect flush's loopback queue pair: %s\n",
                     f.error().message().c_str());
        gpudirect_fail("no flush for a GPU that needs one");
      }
    }
    start_protocol();
    arm_cm_watch();
    ++activity_;
    leave();
  }

  /// What this side tells the peer.
  conn_params params() const noexcept {
    conn_params p;
    p.rx_depth = static_cast<std::uint32_t>(rx_n_);
    p.buffer_size = static_cast<std::uint32_t>(buf_);
    if (gpudirect_ != nullptr) p.flags |= conn_params::flag_gpudirect;
    return p;
  }

  /// What the GPUDirect probe found for this endpoint's GPU and NIC (null:
  /// not a GPUDirect endpoint).
  const gdr::verbs::gpudirect_report* gpudirect() const noexcept { return gpudirect_; }
  /// GPUDirect: NIC writes into GPU memory end with a flush.
  bool needs_flush() const noexcept { return gpudirect_ != nullptr && gpudirect_->needs_flush; }

  ibv_qp* qp() const noexcept { return id_ != nullptr ? id_->qp : nullptr; }
  /// The device's GPUDirect flush queue pair, if it has one.
  ibv_qp* flush_qp() const noexcept { return dq_ != nullptr && dq_->flush ? dq_->flush->qp : nullptr; }
  /// Forgets the cached registrations overlapping the range (every cache
  /// of this connection's device); one a transfer still uses goes
  /// when that transfer ends. Returns how many were dropped.
  std::size_t invalidate_registrations(const void* addr, std::size_t len) noexcept {
    if (dq_ == nullptr) return 0;
    std::size_t n = recv_cache().invalidate(addr, len) + send_cache().invalidate(addr, len) +
                    read_cache().invalidate(addr, len);
    if (dq_->device_mrs) n += dq_->device_mrs->invalidate(addr, len);
    return n;
  }
  rdma_cm_id* cm_id() const noexcept { return id_; }
  const endpoint_stats& stats() const noexcept { return stats_; }
  /// Inline bytes the queue pair accepts.
  unsigned max_inline() const noexcept { return max_inline_; }
  /// The device's name ("rxe0", "mlx5_0").
  std::string device_name() const {
    return id_ != nullptr && id_->verbs != nullptr ? ibv_get_device_name(id_->verbs->device) : "";
  }

  std::string peer_name() const override {
    if (id_ == nullptr) return "(closed)";
    sockaddr* a = rdma_get_peer_addr(id_);
    char ip[INET6_ADDRSTRLEN] = "?";
    unsigned port = ntohs(rdma_get_dst_port(id_));
    if (a->sa_family == AF_INET) {
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a)->sin_addr, ip, sizeof ip);
      return std::string(ip) + ":" + std::to_string(port);
    }
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a)->sin6_addr, ip, sizeof ip);
    return "[" + std::string(ip) + "]:" + std::to_string(port);
  }

 private:
  // ---------------------------------------------------------------- slots

  struct rx_slot : gdr::verbs::work {
    connection* c = nullptr;
    std::uint32_t index = 0;
  };
  struct tx_slot : gdr::verbs::work {
    connection* c = nullptr;
    frame* f = nullptr;      // the frame this work request ends, if any
    std::uint32_t covered = 1;  // send-queue entries this completion frees (unsignaled ones before it too)
    tx_slot* held = nullptr;    // slots of unsignaled SENDs before it, which this completion frees
    bool keepalive = false;
    bool rdma = false;          // f's payload went by RDMA WRITE
    bool read = false;          // an RDMA READ of a put being served
    std::size_t read_bytes = 0; // ... of this many bytes
    std::byte* buf = nullptr;   // this slot's bounce buffer
    gdr::verbs::mr_cache::lease lease{};  // the RDMA source's registration
    gdr::verbs::mr_cache* lease_cache = nullptr;  // ... and its cache
    const std::byte* lease_addr = nullptr;
    std::size_t lease_len = 0;
    tx_slot* next_free = nullptr;
  };
  /// A consumed receive buffer waiting for the engine (in order).
  struct rx_item {
    std::uint32_t index;
    std::uint32_t bytes;
    std::uint32_t imm;
    bool is_imm;
  };
  /// Memory of this side that the peer's NIC writes into or reads from:
  /// a frame this side sent carried its address and key.
  enum class grant_kind : std::uint8_t {
    recv,  ///< a rendezvous receive (the rtr's); the peer WRITEs the message
    get,   ///< a get's destination (the get_request's); the peer WRITEs the reply
    put,   ///< a put's source (the put_request's); the peer READs it
  };
  struct grant {
    grant_kind kind;
    std::uint64_t token;  // recv: the rtr's token; get, put: this side's request id
    const std::byte* addr;
    std::size_t len;
    gdr::verbs::mr_cache::lease lease;
    gdr::verbs::mr_cache* cache;  // the lease's
    frame* f;        // the frame that carried the key: held (no on_sent) until both below
    bool sent;       // its SEND completed
    bool done;       // the peer is done with the memory: the data or the answer arrived
  };
  /// Where the peer's rtr or get_request said bytes go.
  struct remote_dst {
    bool get_reply;        // a get_request's destination (else an rtr's)
    std::uint64_t token;   // the rtr's token, or the get's request id
    std::uint64_t raddr;
    std::uint32_t rkey;
  };
  /// A put this side serves by reading its payload from the peer's memory
  /// into the exposed memory (`dst`); the engine's placement waits for it,
  /// and so does parsing of the frames behind it.
  struct pending_read {
    bool active = false;
    bool posted = false;   // a READ is in flight
    bool aborted = false;  // the engine dropped the placement meanwhile
    std::byte* dst = nullptr;
    std::size_t len = 0;
    std::size_t done = 0;
    std::uint64_t raddr = 0;
    std::uint32_t rkey = 0;
    gdr::verbs::mr_cache::lease lease{};  // dst's registration; without one, READs go through a send slot
    gdr::verbs::mr_cache* cache = nullptr;  // the lease's
    int device = -1;                        // dst is memory of this GPU (GPUDirect)
  };
  /// A GPUDirect flush: the placement it ends waits for its READ.
  struct pending_flush {
    bool active = false;
    bool posted = false;   // the READ is in flight
    bool aborted = false;  // the engine dropped the placement meanwhile
    const std::byte* addr = nullptr;
    gdr::verbs::mr_cache::lease lease{};  // the GPU memory's registration, for the READ's key
  };
  struct flush_node : gdr::verbs::work {
    connection* c = nullptr;
  };
  struct kick_node : remote_work {
    connection* self = nullptr;
  };
  struct cm_op : operation {
    connection* self = nullptr;
  };
  // in_copied: every byte is in the send queue (inline, or in a slot); the
  // frame waits in copied_ only to be handed back outside the engine's calls.
  enum where_t : std::uint8_t { nowhere = 0, in_tx = 1, in_posted = 2, in_dropped = 3, in_copied = 4 };

  // ---------------------------------------------------------------- set-up and teardown

  void setup() {
    ibv_context* ctx = id_->verbs;
    if (ctx == nullptr) throw gdr::error(errc::no_device, "gdr::verbs: the rdma_cm id has no device");
    int entries = sq_depth_ + static_cast<int>(rx_n_) + (needs_flush() ? 1 : 0);
    result<gdr::verbs::device_queue*> dq = poller_->reserve(ctx, entries);
    if (!dq) throw gdr::error(dq.error(), "gdr::verbs: completion queue");
    dq_ = *dq;
    reserved_ = entries;
    if (gpudirect_ != nullptr && !dq_->device_mrs)
      dq_->device_mrs = std::make_unique<gdr::verbs::mr_cache>(
          gdr::verbs::mr_backend{dq_->pd, gdr::verbs::device_access, gdr::verbs::route_of(*gpudirect_)});
    rx_mem_.reset(new (std::align_val_t{4096}) std::byte[rx_n_ * buf_]);
    tx_mem_.reset(new (std::align_val_t{4096}) std::byte[tx_n_ * buf_]);
    auto rxm = gdr::verbs::owned_mr::make(dq_->pd, rx_mem_.get(), rx_n_ * buf_, IBV_ACCESS_LOCAL_WRITE);
    if (!rxm) throw gdr::error(rxm.error(), "gdr::verbs: ibv_reg_mr (receive buffers)");
    rx_mr_ = std::move(*rxm);
    auto txm = gdr::verbs::owned_mr::make(dq_->pd, tx_mem_.get(), tx_n_ * buf_, IBV_ACCESS_LOCAL_WRITE);
    if (!txm) throw gdr::error(txm.error(), "gdr::verbs: ibv_reg_mr (send slots)");
    tx_mr_ = std::move(*txm);
    rx_slots_.reset(new rx_slot[rx_n_]);
    tx_slots_.reset(new tx_slot[tx_n_]);
    backlog_.reset(new rx_item[rx_n_]);
    for (std::uint32_t i = 0; i < rx_n_; ++i) {
      rx_slots_[i].c = this;
      rx_slots_[i].index = i;
      rx_slots_[i].complete = &on_rx;
    }
    for (std::uint32_t i = tx_n_; i-- > 0;) {
      tx_slot& t = tx_slots_[i];
      t.c = this;
      t.complete = &on_tx;
      t.buf = tx_mem_.get() + std::size_t{i} * buf_;
      t.next_free = free_tx_;
      free_tx_ = &t;
    }
    ibv_qp_init_attr qa{};
    qa.send_cq = dq_->cq;
    qa.recv_cq = dq_->cq;
    qa.qp_type = IBV_QPT_RC;
    qa.sq_sig_all = 0;
    qa.cap.max_send_wr = static_cast<std::uint32_t>(sq_depth_);
    qa.cap.max_recv_wr = rx_n_;
    qa.cap.max_send_sge = 2;
    qa.cap.max_recv_sge = 1;
    qa.cap.max_inline_data = vopts_.max_inline;
    if (rdma_create_qp(id_, dq_->pd, &qa) != 0) {
      // Some devices give less inline data than asked: try without.
      qa.cap.max_inline_data = 0;
      if (rdma_create_qp(id_, dq_->pd, &qa) != 0) throw gdr::error(errno_code(errno), "gdr::verbs: rdma_create_qp");
    }
    max_inline_ = qa.cap.max_inline_data;
    poller_->watch_qp(dq_, id_->qp, this);
    for (std::uint32_t i = 0; i < rx_n_; ++i)
      if (std::error_code ec = post_recv(i)) throw gdr::error(ec, "gdr::verbs: ibv_post_recv");
  }

  /// Frees what setup() made. The queue pair must have no work request
  /// outstanding (flushed, or never posted).
  void teardown() noexcept {
    if (id_ != nullptr) {
      if (id_->qp != nullptr) {
        if (dq_ != nullptr) poller_->unwatch_qp(dq_, id_->qp);
        rdma_destroy_qp(id_);
      }
      rdma_destroy_id(id_);
      id_ = nullptr;
    }
    if (ch_ != nullptr) {
      rdma_destroy_event_channel(ch_);
      ch_ = nullptr;
    }
    grants_.clear();
    rd_ = pending_read{};
    fl_ = pending_flush{};
    for (std::uint32_t i = 0; tx_slots_ && i < tx_n_; ++i) tx_slots_[i].lease.release();
    rx_mr_.reset();
    tx_mr_.reset();
    if (dq_ != nullptr) {
      poller_->unreserve(dq_, reserved_);
      dq_ = nullptr;
    }
    if (poller_ != nullptr) std::exchange(poller_, nullptr)->release();
  }

  ~connection() override { teardown(); }

  void destroy() noexcept override { delete this; }

 public:
  /// A connection whose set-up failed before it started: fail and free it
  /// once its queue pair has flushed (through the engine's abandon).
  void discard() noexcept { abandon(); }

 private:
  // ---------------------------------------------------------------- the engine's hooks

  void link_post(frame& f) noexcept override {
    f.queued = true;
    f.sealed = false;
    f.in_flight = false;
    f.written = 0;
    if (failed() || shut_) {
      drop(f);
      kick();
      return;
    }
    // encoded[0]: whether the frame carries a key (1), or will not (2), or
    // is not decided yet (0: a put or get request decides when it is posted).
    f.encoded[0] = std::byte{0};
    if (f.hdr.type == proto::msg::rtr) attach_receive(f);
    if (failed()) {  // a Device receive that could not be registered
      drop(f);
      kick();
      return;
    }
    f.where = in_tx;
    tx_.push_back(&f);
    if (established_) pump_tx();
  }

  bool link_withdraw(frame& f) noexcept override {
    if (!f.queued || (f.sealed && !failed())) return false;
    if (f.where == in_tx) {
      if (f.sealed) return false;
      tx_.erase(&f);
    } else if (f.where == in_dropped) {
      dropped_.erase(&f);
    } else {
      return false;
    }
    f.where = nowhere;
    f.queued = false;
    if (f.encoded[0] == std::byte{1}) {
      // Registered for a request that never went out: the peer never saw the key.
      auto g = grant_of(f);
      if (g != grants_.end()) {
        release_grant(*g);
        grants_.erase(g);
      }
    }
    return true;
  }

  bool link_committed(const frame& f) const noexcept override { return f.queued && f.sealed; }

  void link_resume() noexcept override {
    if (paused_) kick();
  }

  bool link_abort_target() noexcept override {
    if (fl_.active) {
      // The bytes are in place; only the flush's READ (which writes nothing
      // of the user's) is in flight.
      fl_.aborted = true;
      return true;
    }
    if (rd_.active) {
      // A READ into the destination may be in flight: the memory is free
      // when it has completed (on_target_released).
      if (rd_.posted) {
        rd_.aborted = true;
        return false;
      }
      end_read();
      kick();  // parsing goes on from the loop
      return true;
    }
    // Placement is a memcpy per buffer: between buffers nothing touches the
    // destination. The rest of the payload is dropped.
    if (cont_.active) {
      cont_.dst = nullptr;
      cont_.want_left = 0;
      cont_.notified = true;
    }
    return true;
  }

  void link_shutdown() noexcept override {
    if (shut_) return;
    shut_ = true;
    paused_ = false;
    if (id_ != nullptr && id_->qp != nullptr) {
      // The error state flushes every posted work request back, and the
      // peer's NIC can no longer write into this side's memory.
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_ERR;
      ibv_modify_qp(id_->qp, &a, IBV_QP_STATE);
    }
    if (established_ && id_ != nullptr) rdma_disconnect(id_);  // the peer learns at once
    // Copied frames not yet handed back: the failure may have come before
    // the NIC sent them, so they end with the error (dropped_), not as sent.
    while (frame* f = copied_.pop_front()) drop(*f);
    while (frame* f = tx_.head) {
      tx_.erase(f);
      if (f->sealed) {
        // Partly posted: its flushed completions cannot end it (no
        // completion names it), so it is handed back here.
        drop(*f);
      } else {
        drop(*f);
      }
    }
    // Memory the peer was to write into or read from: the queue pair is in
    // error, so it is free again. A frame still being sent comes back
    // flushed (tx_done); one already sent is handed back here.
    for (auto it = grants_.begin(); it != grants_.end();) {
      if (it->sent) {
        drop(*it->f);
        it = grants_.erase(it);
      } else {
        it->lease.release();
        ++it;
      }
    }
    // A READ in flight comes back flushed; one waiting for a slot never goes.
    if (rd_.active && !rd_.posted) end_read();
    if (cm_watch_in_flight_) sched().cancel(&cm_watch_);
    backlog_head_ = backlog_tail_;  // nothing more is parsed
    cont_ = {};
    release_unsignaled();
    kick();
  }

  // Copied frames are handed back here, at the end of the outermost event
  // handler (leave(), once the resumed coroutines have run): no engine
  // call is on the stack, so on_sent cannot re-enter one (link_post is
  // called from inside begin_out, whose bookkeeping goes on after it
  // returns). It costs nothing when the list is empty, and a frame posted
  // in a handler comes back in that same handler, whereas a kick() is one
  // more trip through the scheduler's remote queue. A frame posted outside
  // any handler (an operation starting from a caller's co_await) has no
  // leave() to come: pump_tx kicks, and on_kick's leave() lands here.
  bool link_flush() noexcept override { return hand_back_copied(); }

  bool link_quiet() const noexcept override {
    return rx_outstanding_ == 0 && sq_used_ == 0 && tx_busy_ == 0 && !cm_watch_in_flight_ && !kick_posted_ &&
           dropped_.empty() && copied_.empty() && !fl_.posted;
  }

  void link_release() noexcept override {}

  transfer_path link_rx_path(bool direct) const noexcept override {
    return direct ? transfer_path::host_zero_copy : transfer_path::host_eager;
  }
  transfer_path link_tx_path() const noexcept override { return tx_path_; }

  // ---------------------------------------------------------------- qp events

  void on_tick() noexcept override { keepalive_tick(); }

  void on_qp_event(ibv_event_type type) noexcept override {
    enter();
    if (!failed()) {
      std::fprintf(stderr, "gdr verbs: %s: device event %s: the connection fails\n", peer_name().c_str(),
                   ibv_event_type_str(type));
      on_link_failed(errc::connection_lost);
    }
    on_io_done();
    leave();
  }

  // ---------------------------------------------------------------- receiving

  std::error_code post_recv(std::uint32_t i) noexcept {
    ibv_sge sge{};
    sge.addr = reinterpret_cast<std::uintptr_t>(rx_mem_.get() + std::size_t{i} * buf_);
    sge.length = static_cast<std::uint32_t>(buf_);
    sge.lkey = rx_mr_.lkey();
    ibv_recv_wr wr{};
    wr.wr_id = rx_slots_[i].wr_id();
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    int rc = ibv_post_recv(id_->qp, &wr, &bad);  // returns an errno value
    if (rc != 0) return errno_code(rc);
    ++rx_outstanding_;
    return {};
  }

  /// A consumed buffer goes back to the queue: one more credit for the peer.
  void repost(std::uint32_t i) noexcept {
    if (shut_) return;
    if (std::error_code ec = post_recv(i)) {
      if (!failed()) on_link_failed(ec);
      return;
    }
    ++reposted_;
  }

  static void on_rx(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
    auto* slot = static_cast<rx_slot*>(w);
    connection* c = slot->c;
    c->enter();
    c->rx_done(*slot, wc);
    c->on_io_done();
    c->leave();  // may free c
  }

  void rx_done(rx_slot& slot, const ibv_wc& wc) noexcept {
    --rx_outstanding_;
    ++stats_.completions;
    ++activity_;
    if (wc.status != IBV_WC_SUCCESS) {
      if (!failed()) fail_wc(wc);
      return;
    }
    if (shut_) return;
    std::byte* b = rx_mem_.get() + std::size_t{slot.index} * buf_;
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      push_backlog({slot.index, 0, wc.imm_data, true});
    } else {
      if (wc.byte_len < wire_size) {
        protocol_fail();
        return;
      }
      wire_header w;
      std::memcpy(&w, b, wire_size);
      if (after(w.credits, peer_granted_)) peer_granted_ = w.credits;
      if (w.kind == wire_header::credit) {
        repost(slot.index);
      } else {
        push_backlog({slot.index, wc.byte_len, 0, false});
      }
    }
    parse();
    pump_tx();
  }

  void push_backlog(rx_item it) noexcept {
    // At most rx_n_ buffers are consumed and not yet reposted.
    backlog_[backlog_tail_ % rx_n_] = it;
    ++backlog_tail_;
  }

  /// Hands the consumed buffers to the engine, in order, until it pauses.
  void parse() noexcept {
    while (!paused_ && !rd_.active && !fl_.active && !failed() && !shut_ && backlog_head_ != backlog_tail_) {
      const rx_item& it = backlog_[backlog_head_ % rx_n_];
      bool done = it.is_imm ? rx_write_arrived(it) : rx_buffer(it);
      if (!done) return;
      std::uint32_t index = it.index;
      ++backlog_head_;
      repost(index);
    }
    if (peer_gone_ && !failed() && backlog_head_ == backlog_tail_) on_link_failed(errc::connection_lost);
  }

  /// One SEND's bytes. False: paused or failed (the buffer stays).
  bool rx_buffer(const rx_item& it) noexcept {
    const std::byte* b = rx_mem_.get() + std::size_t{it.index} * buf_;
    wire_header w;
    std::memcpy(&w, b, wire_size);
    const std::byte* payload = b + wire_size;
    std::size_t avail = it.bytes - wire_size;
    if (cont_.active) {
      if (w.kind != wire_header::cont || avail > cont_.remaining || avail == 0) return protocol_fail();
      std::size_t take = std::min(avail, cont_.want_left);
      if (take != 0) std::memcpy(cont_.dst + cont_.done, payload, take);
      cont_.done += take;
      cont_.want_left -= take;
      cont_.remaining -= avail;
      ++stats_.fragments;
      if (cont_.want_left == 0 && !cont_.notified) {
        cont_.notified = true;
        on_placed(false);
      }
      if (cont_.remaining == 0) cont_ = {};
      return !failed();
    }
    proto::header h;
    if (!decode(w, options().max_message, h)) return protocol_fail();
    if (avail > h.length) return protocol_fail();
    // A put whose request names its source: the payload is read from there.
    bool by_read = h.type == proto::msg::put_request && w.rkey != 0;
    if (by_read && avail != 0) return protocol_fail();
    // Where bytes go, before the engine sees the header: it may answer at once.
    if (h.type == proto::msg::rtr && w.rkey != 0) remember_remote(false, h.addr, w.raddr, w.rkey);
    if (h.type == proto::msg::get_request && w.rkey != 0) remember_remote(true, h.id, w.raddr, w.rkey);
    // The answer to a put this side's peer read: the put's path.
    bool answers_grant = h.type == proto::msg::put_ack || h.type == proto::msg::get_reply;
    if (h.type == proto::msg::put_ack && find_grant(grant_kind::put, h.id) != grants_.end())
      tx_path_ = transfer_path::host_zero_copy;
    proto::rx_plan plan = on_header(h);
    switch (plan.act) {
      case proto::rx_plan::action::pause: paused_ = true; return false;
      case proto::rx_plan::action::fail: return protocol_fail();
      case proto::rx_plan::action::place: break;
    }
    if (plan.device >= 0 && plan.want != 0 && !by_read)
      return gpudirect_fail("the peer sent bytes for Device memory in SENDs, which the CPU would have to copy");
    if (answers_grant) settle(h.type == proto::msg::put_ack ? grant_kind::put : grant_kind::get, h.id);
    // A rendezvous message that came as SENDs although the receive offered
    // its key (the sender could not register its side): no WRITE will come.
    if (h.type == proto::msg::data && (h.flags & proto::flag::last) != 0) settle(grant_kind::recv, h.addr);
    if (by_read) {
      if (plan.want == 0) {
        on_placed(false);  // refused, or empty: nothing to read
        return !failed();
      }
      start_read(plan.dst, plan.want, w.raddr, w.rkey, plan.device);
      return !failed();
    }
    std::size_t take = std::min(avail, plan.want);
    if (take != 0) std::memcpy(plan.dst, payload, take);
    if (avail == h.length) {
      on_placed(false);
      return !failed();
    }
    cont_.active = true;
    cont_.dst = plan.dst;
    cont_.done = take;
    cont_.want_left = plan.want - take;
    cont_.remaining = h.length - avail;
    cont_.notified = false;
    if (cont_.want_left == 0) {
      cont_.notified = true;
      on_placed(false);
    }
    return !failed();
  }

  /// A WRITE_WITH_IMM: the rendezvous payload of the rtr, or the reply to
  /// the get, that `imm` names is in place.
  bool rx_write_arrived(const rx_item& it) noexcept {
    bool get = (it.imm & 0x80000000u) != 0;
    grant_kind kind = get ? grant_kind::get : grant_kind::recv;
    auto w = std::find_if(grants_.begin(), grants_.end(),
                          [&](const grant& x) { return x.kind == kind && imm_of(get, x.token) == it.imm; });
    if (w == grants_.end()) return protocol_fail();
    proto::header h;
    if (get) {
      h.type = proto::msg::get_reply;  // the whole of what the get asked for
      h.st = proto::status::ok;
      h.id = w->token;
    } else {
      h.type = proto::msg::data;
      h.flags = proto::flag::last;  // the whole of what the rtr accepted, at offset 0
      h.addr = w->token;
    }
    h.length = w->len;
    proto::rx_plan plan = on_header(h);
    if (plan.act == proto::rx_plan::action::pause) {
      paused_ = true;
      return false;
    }
    if (plan.act == proto::rx_plan::action::fail) return protocol_fail();
    // The engine places the bytes where the receive's (the get's) view is:
    // where the peer wrote them. A dropped one (cancelled receive) has no dst.
    if (plan.want != 0 && plan.dst != w->addr) {
      if (plan.device >= 0) return gpudirect_fail("RDMA data for Device memory landed elsewhere");
      std::memmove(plan.dst, w->addr, plan.want);
    }
    ++stats_.rdma_received;
    w->done = true;
    if (needs_flush() && plan.device >= 0 && plan.want != 0) {
      start_flush(plan.dst);  // the receive completes once the flush says the bytes have landed
    } else {
      on_placed(true);
    }
    finish_grant(w);
    return !failed();
  }

  std::vector<grant>::iterator find_grant(grant_kind kind, std::uint64_t token) noexcept {
    return std::find_if(grants_.begin(), grants_.end(),
                        [&](const grant& g) { return g.kind == kind && g.token == token; });
  }

  /// The peer answered the put or get `id`: it no longer touches the memory.
  void settle(grant_kind kind, std::uint64_t id) noexcept {
    auto g = find_grant(kind, id);
    if (g == grants_.end()) return;
    g->done = true;
    finish_grant(g);
  }

  /// Ends a grant once both its frame's SEND and the peer's access are
  /// done: the registration goes, the frame comes back to the engine.
  void finish_grant(std::vector<grant>::iterator g) noexcept {
    if (!g->sent || !g->done) return;
    frame* f = g->f;
    release_grant(*g);
    grants_.erase(g);
    on_sent(*f, {});
  }

  void release_grant(grant& g) noexcept { release_lease(g.lease, g.addr, g.len, g.cache); }

  /// The grant a frame carries the key of (encoded[0] == 1), or end().
  std::vector<grant>::iterator grant_of(const frame& f) noexcept {
    return std::find_if(grants_.begin(), grants_.end(), [&](const grant& g) { return g.f == &f; });
  }

  void remember_remote(bool get_reply, std::uint64_t token, std::uint64_t raddr, std::uint32_t rkey) noexcept {
    for (auto& r : remotes_)
      if (r.get_reply == get_reply && r.token == token) {
        r.raddr = raddr;
        r.rkey = rkey;
        return;
      }
    try {
      remotes_.push_back({get_reply, token, raddr, rkey});
    } catch (...) {
      // Without the key the data goes as SENDs.
    }
  }

  /// An rtr about to go out: register the receive's view and send its key.
  void attach_receive(frame& f) noexcept {
    f.encoded[0] = std::byte{2};
    // A receive into staged (Device) memory asks for segments no larger than
    // its bounce buffers (`key`): those come as SENDs into the bounce
    // buffers, never by RDMA into the device pointer.
    if (f.owner == nullptr || f.hdr.size == 0 || f.hdr.key != 0) return;
    std::byte* dst = f.owner->buffer_data();
    auto len = static_cast<std::size_t>(f.hdr.size);
    add_grant(f, grant_kind::recv, f.hdr.addr, dst, len, f.device);
    if (f.nic_only && f.encoded[0] != std::byte{1})
      gpudirect_fail("cannot register the memory of a Device receive with the NIC");
  }

  /// A put or get request about to go out for the first time: if its bytes
  /// do not fit one SEND, register the initiator's memory and send its key,
  /// so that the target's NIC moves them (READ of a put's source, WRITE of
  /// a get's reply) and no CPU copies them on either side. Only an
  /// operation of its own (not a staged segment); the frame is then held
  /// until the answer has come. GPUDirect: a request whose bytes only the
  /// NIC may move (`nic_only`) carries its key at any size, or fails the
  /// connection. False: it failed.
  bool attach_request(frame& f) noexcept {
    f.encoded[0] = std::byte{2};
    if (f.owner == nullptr || f.sslot != nullptr || f.slot != nullptr) return true;
    bool put = f.hdr.type == proto::msg::put_request;
    auto len = static_cast<std::size_t>(put ? f.hdr.length : f.hdr.size);
    if (len == 0 || (len <= frag_ - wire_size && !f.nic_only)) return true;
    const std::byte* addr = put ? f.payload : f.owner->buffer_data();
    add_grant(f, put ? grant_kind::put : grant_kind::get, f.hdr.id, addr, len, f.device);
    if (f.nic_only && f.encoded[0] != std::byte{1})
      return gpudirect_fail("cannot register the memory of a put or get whose bytes only the NIC may move");
    return true;
  }

  void add_grant(frame& f, grant_kind kind, std::uint64_t token, const std::byte* addr, std::size_t len,
                 int device) noexcept {
    gdr::verbs::mr_cache& cache = cache_for(device, kind == grant_kind::put ? read_cache() : recv_cache());
    auto l = register_user(cache, addr, len, device);
    if (!l) {
      ++stats_.registration_failures;
      return;
    }
    try {
      grants_.push_back({kind, token, addr, len, std::move(*l), &cache, &f, false, false});
    } catch (...) {
      return;
    }
    f.encoded[0] = std::byte{1};  // this frame carries a key
  }

  /// The payload bytes a frame's SENDs carry: none for a put whose target
  /// reads them.
  static std::size_t sent_bytes(const frame& f) noexcept {
    bool read = f.hdr.type == proto::msg::put_request && f.encoded[0] == std::byte{1};
    return read ? 0 : static_cast<std::size_t>(f.hdr.length);
  }

  /// A user's buffer registered (or found cached), within the limit (host
  /// memory only: GPU memory has no other way to go). `device`: the GPU
  /// whose memory it is, or -1.
  result<gdr::verbs::mr_cache::lease> register_user(gdr::verbs::mr_cache& cache, const void* addr, std::size_t len,
                                                    int device) noexcept {
    if (device < 0 && vopts_.registration_limit != 0 && len > vopts_.registration_limit) return errno_code(E2BIG);
    auto l = cache.acquire(addr, len);
    if (l) {
      ++stats_.registrations;
      if (device >= 0) ++stats_.device_registrations;
    } else if (device >= 0) {
      std::fprintf(stderr, "gdr verbs: registering %zu bytes of GPU %d memory failed: %s\n", len, device,
                   l.error().message().c_str());
    }
    return l;
  }

  /// The cache of memory of GPU `device` (-1: `host`, the host cache for
  /// the access needed). On a GPUDirect endpoint a `Device` view's memory
  /// is GPU memory; elsewhere no frame names a device.
  gdr::verbs::mr_cache& cache_for(int device, gdr::verbs::mr_cache& host) noexcept {
    return device >= 0 && dq_->device_mrs ? *dq_->device_mrs : host;
  }

  gdr::verbs::mr_cache& recv_cache() noexcept { return *dq_->recv_mrs; }
  gdr::verbs::mr_cache& send_cache() noexcept { return *dq_->send_mrs; }
  gdr::verbs::mr_cache& read_cache() noexcept { return *dq_->read_mrs; }

  /// Ends a transfer's lease on its registration in `cache` (null with an
  /// empty lease), and forgets the registration unless they are cached.
  void release_lease(gdr::verbs::mr_cache::lease& l, const void* addr, std::size_t len,
                     gdr::verbs::mr_cache* cache) noexcept {
    if (!l) return;
    l.release();
    if (!vopts_.cache_registrations) cache->invalidate(addr, len);
  }

  // ---------------------------------------------------------------- sending

  std::uint32_t in_flight() const noexcept { return sent_ - peer_granted_; }
  bool credit_for(bool credit_only) const noexcept {
    std::uint32_t limit = credit_only ? peer_rx_ : peer_rx_ - 1;
    return in_flight() < limit;
  }

  tx_slot* take_tx() noexcept {
    tx_slot* t = free_tx_;
    if (t != nullptr) {
      free_tx_ = t->next_free;
      ++tx_busy_;
    }
    return t;
  }
  void free_tx(tx_slot* t) noexcept {
    t->f = nullptr;
    t->keepalive = false;
    t->rdma = false;
    t->read = false;
    t->read_bytes = 0;
    t->covered = 1;
    t->held = nullptr;
    t->next_free = free_tx_;
    free_tx_ = t;
    --tx_busy_;
  }

  /// Frees the slots of a chain of unsignaled SENDs (linked by next_free).
  void free_held(tx_slot* t) noexcept {
    while (t != nullptr) {
      tx_slot* next = t->next_free;
      free_tx(t);
      t = next;
    }
  }

  /// Whether the send-queue work request about to be posted (the last of
  /// `n`; its slot already taken) asks for a completion. `needed`: only
  /// its completion ends its frame; `frees_slot`: it is inline, its slot
  /// goes back at once. Otherwise one in `signal_every_` does, and the one
  /// that takes the last free slot or send-queue entry: the unsignaled
  /// requests before it would otherwise hold them with no completion to
  /// come. A higher mark than "none left" signals every SEND while slots
  /// are what limits a sender (it then hovers at the mark: 288 of 302
  /// SENDs signaled with tx_depth 16 and a mark of 4).
  /// A run of unsignaled SENDs that nothing follows keeps its entries (and
  /// the slots of those that were copied into one) until the next
  /// signaled request: the next post, the close frame, or the keepalive
  /// of an idle connection; a failure releases them (release_unsignaled).
  /// Signalling the last one queued instead would signal every SEND of a
  /// sender that waits for each (it is always the last).
  bool signal_next(int n, bool needed, bool frees_slot) const noexcept {
    if (needed || unsignaled_wrs_ + n >= static_cast<int>(signal_every_)) return true;
    if (!frees_slot && free_tx_ == nullptr) return true;
    return sq_used_ + n >= sq_depth_;
  }

  /// Copied frames are sent as far as this side is concerned: each gets
  /// its on_sent. Only where no engine call is on the stack (see
  /// link_flush). True: some were.
  bool hand_back_copied() noexcept {
    if (copied_.empty()) return false;
    while (frame* f = copied_.pop_front()) {
      f->where = nowhere;
      tx_path_ = transfer_path::host_eager;
      on_sent(*f, {});
    }
    return true;
  }

  /// The queue pair is in the error state and no signaled work request is
  /// left to come back: the unsignaled ones after the last of them will
  /// not be accounted for by a completion (a flushed unsignaled request
  /// may complete, to unsignaled_work(), or not). Nothing is posted any
  /// more, so their slots are not written again; the memory goes only
  /// after the queue pair is destroyed (teardown).
  void release_unsignaled() noexcept {
    if (!shut_ || busy_noted_ != 0) return;
    free_held(std::exchange(held_head_, nullptr));
    held_tail_ = nullptr;
    sq_used_ -= unsignaled_wrs_;
    unsignaled_wrs_ = 0;
  }

  /// Posts what resources allow, in order.
  void pump_tx() noexcept {
    if (!established_ || shut_) return;
    if (rd_.active && !rd_.posted) post_read();
    while (frame* f = tx_.head) {
      copied_frame_ = nullptr;
      if (shut_ || !post_frame(*f)) break;
      tx_.erase(f);
      if (copied_frame_ == f) {
        // Its memory is no longer needed; it goes back from a safe place.
        f->where = in_copied;
        copied_.push_back(f);
      } else {
        f->where = in_posted;
      }
    }
    // Outside any handler no leave() follows to hand the copied frames
    // back (link_flush): the kick's handler does.
    if (!copied_.empty() && !in_handler()) kick();
    maybe_send_credits();
  }

  /// Posts (the rest of) `f`. True when all of it is posted.
  bool post_frame(frame& f) noexcept {
    if (!f.sealed) {
      switch (f.hdr.type) {
        case proto::msg::data: {
          auto r = find_remote(false, f.hdr.addr);
          if (r == remotes_.end()) {
            if (f.nic_only && f.hdr.length != 0)
              return gpudirect_fail("the receive of a send from Device memory offered no key (it could not "
                                    "register its memory): the bytes cannot move without the CPU");
            break;
          }
          // A segment (a staged sender's chunk) lands at its offset; only
          // the message's last one carries the immediate.
          bool last = (f.hdr.flags & proto::flag::last) != 0;
          int res = post_rdma(f, *r, f.hdr.size, imm_of(false, f.hdr.addr), last);
          if (res > 0) {
            if (last) remotes_.erase(r);  // segments before the last keep it
            return true;
          }
          if (res == 0) return false;  // waits for resources
          remotes_.erase(r);            // could not register: SENDs instead
          if (f.nic_only) return gpudirect_fail("cannot register the Device memory of a send with the NIC");
          break;
        }
        case proto::msg::get_reply: {
          auto r = find_remote(true, f.hdr.id);
          if (r == remotes_.end()) {
            if (f.nic_only && f.hdr.st == proto::status::ok && f.hdr.length != 0)
              return gpudirect_fail("a get of exposed Device memory came without the key of its destination");
            break;
          }
          if (f.hdr.st == proto::status::ok && f.hdr.length != 0) {
            // Straight from the exposed memory into the get's destination;
            // the immediate is the answer.
            int res = post_rdma(f, *r, 0, imm_of(true, f.hdr.id), true);
            if (res == 0) return false;
            remotes_.erase(r);
            if (res > 0) return true;
            if (f.nic_only) return gpudirect_fail("cannot register exposed Device memory with the NIC");
            break;  // could not register: the reply goes as SENDs
          }
          remotes_.erase(r);  // a refusal: the answer goes as a SEND
          break;
        }
        case proto::msg::put_request:
        case proto::msg::get_request:
          if (f.encoded[0] == std::byte{0} && !attach_request(f)) return false;
          break;
        default: break;
      }
    }
    return post_sends(f);
  }

  std::vector<remote_dst>::iterator find_remote(bool get_reply, std::uint64_t token) noexcept {
    return std::find_if(remotes_.begin(), remotes_.end(),
                        [&](const remote_dst& x) { return x.get_reply == get_reply && x.token == token; });
  }

  /// The size of each work request when `len` bytes move by RDMA: at least
  /// `write_chunk`, and at most `max_write_wrs` requests in all.
  static std::size_t rdma_chunk(std::size_t len) noexcept {
    return std::max(write_chunk, (len + max_write_wrs - 1) / max_write_wrs);
  }

  /// Fills `wrs` (and `sges`) with a chain of `op` requests moving `len`
  /// bytes between local `local` (key `lkey`) and remote `remote` (key
  /// `rkey`), `chunk` bytes each; only the last is signaled, with slot
  /// `t`'s id.
  static void rdma_chain(ibv_send_wr* wrs, ibv_sge* sges, ibv_wr_opcode op, const std::byte* local,
                         std::uint32_t lkey, std::uint64_t remote, std::uint32_t rkey, std::size_t len,
                         std::size_t chunk, tx_slot& t) noexcept {
    int nwr = static_cast<int>((len + chunk - 1) / chunk);
    for (int i = 0; i < nwr; ++i) {
      std::size_t off = static_cast<std::size_t>(i) * chunk;
      sges[i] = {};
      sges[i].addr = reinterpret_cast<std::uintptr_t>(local) + off;
      sges[i].length = static_cast<std::uint32_t>(std::min(chunk, len - off));
      sges[i].lkey = lkey;
      ibv_send_wr& wr = wrs[i];
      wr = {};
      wr.sg_list = &sges[i];
      wr.num_sge = 1;
      wr.opcode = op;
      wr.wr.rdma.remote_addr = remote + off;
      wr.wr.rdma.rkey = rkey;
      bool last = i + 1 == nwr;
      wr.send_flags = last ? IBV_SEND_SIGNALED : 0;
      wr.wr_id = last ? t.wr_id() : gdr::verbs::unsignaled_work()->wr_id();
      wr.next = last ? nullptr : &wrs[i + 1];
    }
  }

  /// The payload of `f` by RDMA WRITE to `r`'s buffer at `offset`, the last
  /// request WITH_IMM `imm` if `tell`. 1: posted; 0: no resources yet; -1:
  /// its buffer cannot be registered.
  int post_rdma(frame& f, const remote_dst& r, std::uint64_t offset, std::uint32_t imm, bool tell_at_end) noexcept {
    auto len = static_cast<std::size_t>(f.hdr.length);
    std::size_t chunk = rdma_chunk(len);
    int nwr = static_cast<int>((len + chunk - 1) / chunk);
    if (!credit_for(false) || free_tx_ == nullptr || sq_used_ + nwr > sq_depth_) {
      if (!credit_for(false)) ++stats_.credit_stalls;
      return 0;
    }
    gdr::verbs::mr_cache& cache = cache_for(f.device, send_cache());
    auto l = register_user(cache, f.payload, len, f.device);
    if (!l) {
      ++stats_.registration_failures;
      return -1;
    }
    tx_slot* t = take_tx();
    ibv_send_wr wrs[max_write_wrs];
    ibv_sge sges[max_write_wrs];
    rdma_chain(wrs, sges, IBV_WR_RDMA_WRITE, f.payload, l->handle()->lkey, r.raddr + offset, r.rkey, len, chunk, *t);
    if (tell_at_end) {
      wrs[nwr - 1].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wrs[nwr - 1].imm_data = imm;
    }
    t->f = &f;
    t->covered = static_cast<std::uint32_t>(nwr);
    t->rdma = true;
    t->lease = std::move(*l);
    t->lease_cache = &cache;
    t->lease_addr = f.payload;
    t->lease_len = len;
    if (!post_send_wrs(wrs, nwr, t)) return 0;  // failed: link_shutdown hands f back
    f.sealed = true;
    f.written = len;
    ++sent_;
    stats_.write_wrs += static_cast<std::uint64_t>(nwr);
    return 1;
  }

  /// Posts `n` chained work requests ending with slot `t`'s. False: the
  /// post failed (the connection fails; `t` is freed). A signaled last
  /// request also accounts for the unsignaled ones posted before it: an
  /// RC send queue completes in order, so its completion says the NIC is
  /// done with them too. An unsignaled one keeps its slot until then if
  /// the NIC reads its bounce buffer; an inline one gives it back now.
  bool post_send_wrs(ibv_send_wr* wrs, int n, tx_slot* t) noexcept {
    const ibv_send_wr& last = wrs[n - 1];
    bool signaled = (last.send_flags & IBV_SEND_SIGNALED) != 0;
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(id_->qp, wrs, &bad);  // returns an errno value
    if (rc != 0) {
      // The frame stays where it is (on tx_): the failure hands it back.
      release_lease(t->lease, t->lease_addr, t->lease_len, t->lease_cache);
      free_tx(t);
      if (!failed()) on_link_failed(errno_code(rc));
      return false;
    }
    sq_used_ += n;
    ++activity_;
    if (!signaled) {
      unsignaled_wrs_ += n;
      if ((last.send_flags & IBV_SEND_INLINE) != 0 && last.opcode == IBV_WR_SEND) {
        free_tx(t);
      } else {
        t->next_free = nullptr;
        (held_tail_ != nullptr ? held_tail_->next_free : held_head_) = t;
        held_tail_ = t;
      }
      return true;
    }
    t->covered += static_cast<std::uint32_t>(unsignaled_wrs_);
    t->held = std::exchange(held_head_, nullptr);
    held_tail_ = nullptr;
    unsignaled_wrs_ = 0;
    ++stats_.signaled_wrs;
    if (busy_noted_++ == 0) poller_->note_busy(1);
    return true;
  }

  /// The frame (or its rest) as SENDs through the bounce buffers. Its
  /// bytes are all copied when its last SEND is posted, so that ends it
  /// (copied_frame_, handed back by pump_tx), except a frame carrying a key
  /// (held until the peer is done with the memory) and a close: its completion is what says that
  /// everything before it arrived, and the engine shuts the queue pair
  /// down once it has it.
  bool post_sends(frame& f) noexcept {
    std::size_t len = sent_bytes(f);
    // GPUDirect: bytes only the NIC may move never go into a SEND (the CPU
    // would read them). post_frame has failed the connection before this
    // for every known case; this is the last line.
    if (f.nic_only && len != 0 && !f.sealed) return gpudirect_fail("Device bytes were about to be copied into a SEND");
    const std::size_t room = frag_ - wire_size;
    const bool ends_at_post = f.encoded[0] != std::byte{1} && f.hdr.type != proto::msg::close;
    for (;;) {
      bool first = !f.sealed;
      if (!first && f.written == len) return true;
      if (!credit_for(false)) {
        ++stats_.credit_stalls;
        return false;
      }
      if (free_tx_ == nullptr || sq_used_ + 1 > sq_depth_) return false;
      std::size_t chunk = std::min(len - f.written, room);
      bool last = f.written + chunk == len;
      tx_slot* t = take_tx();
      wire_header w;
      w.kind = first ? wire_header::frame : wire_header::cont;
      if (first) {
        w.type = static_cast<std::uint8_t>(f.hdr.type);
        w.status = static_cast<std::uint8_t>(f.hdr.st);
        w.flags = static_cast<std::uint8_t>(f.hdr.flags);
        w.length = f.hdr.length;
        w.size = f.hdr.size;
        w.tag = f.hdr.tag;
        w.id = f.hdr.id;
        w.addr = f.hdr.addr;
        w.key = f.hdr.key;
        if (f.encoded[0] == std::byte{1}) {
          auto g = grant_of(f);
          if (g != grants_.end()) {
            w.raddr = reinterpret_cast<std::uintptr_t>(g->addr);
            w.rkey = g->lease.handle()->rkey;
          }
        }
      }
      w.credits = reposted_;
      granted_ = reposted_;
      const std::byte* src = f.payload + f.written;
      ibv_sge sge[2]{};
      ibv_send_wr wr{};
      wr.opcode = IBV_WR_SEND;
      const bool inlined = wire_size + chunk <= max_inline_;
      const bool signaled = signal_next(1, last && !ends_at_post, inlined);
      wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
      wr.wr_id = signaled ? t->wr_id() : gdr::verbs::unsignaled_work()->wr_id();
      if (inlined) {
        // Inline: the provider copies header and payload into the work
        // request now; nothing is read later.
        std::memcpy(t->buf, &w, wire_size);
        sge[0].addr = reinterpret_cast<std::uintptr_t>(t->buf);
        sge[0].length = static_cast<std::uint32_t>(wire_size);
        sge[1].addr = reinterpret_cast<std::uintptr_t>(src);
        sge[1].length = static_cast<std::uint32_t>(chunk);
        wr.num_sge = chunk != 0 ? 2 : 1;
        wr.send_flags |= IBV_SEND_INLINE;
        ++stats_.inline_sends;
      } else {
        std::memcpy(t->buf, &w, wire_size);
        if (chunk != 0) std::memcpy(t->buf + wire_size, src, chunk);
        sge[0].addr = reinterpret_cast<std::uintptr_t>(t->buf);
        sge[0].length = static_cast<std::uint32_t>(wire_size + chunk);
        sge[0].lkey = tx_mr_.lkey();
        wr.num_sge = 1;
      }
      wr.sg_list = sge;
      if (last && !ends_at_post) t->f = &f;
      if (!post_send_wrs(&wr, 1, t)) return false;
      f.sealed = true;
      f.written += chunk;
      ++sent_;
      ++stats_.send_wrs;
      if (last) {
        if (ends_at_post) copied_frame_ = &f;
        return true;
      }
    }
  }

  /// Sends a credit-only message when the peer may be waiting for credits
  /// and nothing else carries them.
  void maybe_send_credits() noexcept {
    if (!established_ || shut_ || failed()) return;
    std::uint32_t owed = reposted_ - granted_;
    if (owed == 0 || owed < rx_n_ / 2) return;
    if (tx_.head != nullptr && credit_for(false)) return;  // the next frame carries them
    if (!credit_for(true) || free_tx_ == nullptr || sq_used_ + 1 > sq_depth_) return;
    tx_slot* t = take_tx();
    wire_header w;
    w.kind = wire_header::credit;
    w.credits = reposted_;
    granted_ = reposted_;
    std::memcpy(t->buf, &w, wire_size);
    ibv_sge sge{};
    sge.addr = reinterpret_cast<std::uintptr_t>(t->buf);
    sge.length = static_cast<std::uint32_t>(wire_size);
    sge.lkey = tx_mr_.lkey();
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_SEND;
    const bool inlined = wire_size <= max_inline_;
    const bool signaled = signal_next(1, false, inlined);
    wr.send_flags = (signaled ? IBV_SEND_SIGNALED : 0) | (inlined ? IBV_SEND_INLINE : 0);
    wr.wr_id = signaled ? t->wr_id() : gdr::verbs::unsignaled_work()->wr_id();
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (!post_send_wrs(&wr, 1, t)) return;
    ++sent_;
    ++stats_.credit_messages;
  }

  static void on_tx(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
    if (w == nullptr) return;
    auto* t = static_cast<tx_slot*>(w);
    connection* c = t->c;
    c->enter();
    c->tx_done(*t, wc);
    c->on_io_done();
    c->leave();  // may free c
  }

  void tx_done(tx_slot& t, const ibv_wc& wc) noexcept {
    ++stats_.completions;
    sq_used_ -= static_cast<int>(t.covered);
    if (--busy_noted_ == 0) poller_->note_busy(-1);
    ++activity_;
    // Frames copied before this request are sent: they go back before the
    // frame this completion ends (a close among them fails the rest).
    if (wc.status == IBV_WC_SUCCESS) hand_back_copied();
    frame* f = t.f;
    bool rdma = t.rdma;
    bool read = t.read;
    std::size_t read_bytes = t.read_bytes;
    const std::byte* slot_buf = t.buf;  // not written again before read_done: nothing posts in between
    release_lease(t.lease, t.lease_addr, t.lease_len, t.lease_cache);
    free_held(t.held);
    free_tx(&t);
    std::error_code ec;
    if (wc.status != IBV_WC_SUCCESS) {
      if (!failed()) fail_wc(wc);
      ec = error();
    }
    if (read) read_done(read_bytes, slot_buf, ec);
    if (f != nullptr) {
      if (f->where == in_posted) f->where = nowhere;
      if (f->encoded[0] == std::byte{1}) {
        auto g = grant_of(*f);
        if (g != grants_.end()) {
          if (!ec && !shut_) {
            // Held until the peer is done with the memory (see the file comment).
            g->sent = true;
            finish_grant(g);
            pump_tx();
            return;
          }
          grants_.erase(g);  // the queue pair is in error: the peer's NIC no longer reaches it
          if (!ec) ec = error() ? error() : std::error_code(errc::connection_lost);
        }
      }
      tx_path_ = rdma ? transfer_path::host_zero_copy : transfer_path::host_eager;
      on_sent(*f, ec);
    }
    pump_tx();
    release_unsignaled();
  }

  // ---------------------------------------------------------------- serving a put by RDMA READ

  /// The put being served reads its payload (`len` bytes from the peer's
  /// `raddr`) into `dst`: straight into it if it can be registered, else
  /// through a send slot, one buffer at a time.
  void start_read(std::byte* dst, std::size_t len, std::uint64_t raddr, std::uint32_t rkey, int device) noexcept {
    rd_.active = true;
    rd_.posted = rd_.aborted = false;
    rd_.dst = dst;
    rd_.len = len;
    rd_.done = 0;
    rd_.raddr = raddr;
    rd_.rkey = rkey;
    rd_.cache = &cache_for(device, recv_cache());
    rd_.device = device;
    if (auto l = register_user(*rd_.cache, dst, len, device)) {
      rd_.lease = std::move(*l);
    } else {
      ++stats_.registration_failures;
      if (device >= 0) {
        // Through a send slot, the CPU would copy into GPU memory.
        end_read();
        gpudirect_fail("cannot register exposed Device memory with the NIC for a put");
        return;
      }
    }
    post_read();
  }

  /// Posts the next READ of the put being served, if resources allow (else
  /// pump_tx tries again when a send slot comes back). READs take no credit:
  /// they consume no receive buffer of the peer's.
  void post_read() noexcept {
    if (!rd_.active || rd_.posted || rd_.aborted || shut_ || failed()) return;
    bool direct = static_cast<bool>(rd_.lease);
    std::size_t n = direct ? rd_.len - rd_.done : std::min(rd_.len - rd_.done, buf_);
    std::size_t chunk = direct ? rdma_chunk(n) : n;
    int nwr = static_cast<int>((n + chunk - 1) / chunk);
    if (free_tx_ == nullptr || sq_used_ + nwr > sq_depth_) return;
    tx_slot* t = take_tx();
    ibv_send_wr wrs[max_write_wrs];
    ibv_sge sges[max_write_wrs];
    const std::byte* into = direct ? rd_.dst + rd_.done : t->buf;
    std::uint32_t lkey = direct ? rd_.lease.handle()->lkey : tx_mr_.lkey();
    rdma_chain(wrs, sges, IBV_WR_RDMA_READ, into, lkey, rd_.raddr + rd_.done, rd_.rkey, n, chunk, *t);
    t->read = true;
    t->read_bytes = n;
    t->covered = static_cast<std::uint32_t>(nwr);
    if (!post_send_wrs(wrs, nwr, t)) return;  // failed: the connection fails, end_read follows
    rd_.posted = true;
    stats_.read_wrs += static_cast<std::uint64_t>(nwr);
  }

  /// A READ of `n` bytes completed (or failed: `ec`), through send slot
  /// buffer `slot` when the destination is not registered.
  void read_done(std::size_t n, const std::byte* slot, std::error_code ec) noexcept {
    if (!rd_.active) return;
    rd_.posted = false;
    if (ec) {
      // The connection failed: the engine has stopped the placement and
      // waits for its memory, free now that the READ has come back.
      bool aborted = rd_.aborted;
      end_read();
      if (aborted) on_target_released();
      return;
    }
    if (!rd_.lease) std::memcpy(rd_.dst + rd_.done, slot, n);
    rd_.done += n;
    if (rd_.done < rd_.len && !rd_.aborted) {
      post_read();
      return;
    }
    bool aborted = rd_.aborted;
    bool flush = !aborted && needs_flush() && rd_.device >= 0;
    if (flush) start_flush(rd_.dst);  // before end_read gives up its registration
    end_read();
    if (aborted) {
      on_target_released();
    } else {
      ++stats_.rdma_read;
      if (!flush) on_placed(true);  // else when the flush is done
    }
    parse();  // the frames behind it
  }

  void end_read() noexcept {
    release_lease(rd_.lease, rd_.dst, rd_.len, rd_.cache);
    rd_ = pending_read{};
  }

  // ---------------------------------------------------------------- the GPUDirect flush

  /// GPU memory the NIC has just written (at `addr`): READ one byte of it
  /// through the loopback queue pair (`gdr/transport/verbs/flush.hpp`); the
  /// placement completes when the READ does. Parsing waits meanwhile.
  void start_flush(const std::byte* addr) noexcept {
    if (failed() || shut_) return;
    fl_.active = true;
    fl_.addr = addr;
    auto l = dq_->device_mrs->acquire(addr, 1);  // found cached: the transfer's own registration
    if (!l) {
      fl_ = pending_flush{};
      gpudirect_fail("cannot register Device memory for its flush");
      return;
    }
    fl_.lease = std::move(*l);
    ibv_sge sge{};
    sge.addr = reinterpret_cast<std::uintptr_t>(dq_->flush->scratch.get());
    sge.length = 1;
    sge.lkey = dq_->flush->mr.lkey();
    ibv_send_wr wr{};
    wr.wr_id = flush_work_.wr_id();
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = reinterpret_cast<std::uintptr_t>(addr);
    wr.wr.rdma.rkey = fl_.lease.handle()->rkey;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(dq_->flush->qp, &wr, &bad)) {  // returns an errno value
      end_flush();
      std::fprintf(stderr, "gdr verbs: posting the GPUDirect flush: %s\n", std::strerror(rc));
      gpudirect_fail("the flush could not be posted");
      return;
    }
    fl_.posted = true;
    ++activity_;
    if (busy_noted_++ == 0) poller_->note_busy(1);
  }

  void end_flush() noexcept {
    release_lease(fl_.lease, fl_.addr, 1, dq_->device_mrs.get());
    fl_ = pending_flush{};
  }

  static void on_flush(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
    connection* c = static_cast<flush_node*>(w)->c;
    c->enter();
    c->flush_done(wc);
    c->on_io_done();
    c->leave();  // may free c
  }

  void flush_done(const ibv_wc& wc) noexcept {
    if (--busy_noted_ == 0) poller_->note_busy(-1);
    ++activity_;
    bool aborted = fl_.aborted;
    end_flush();
    if (wc.status != IBV_WC_SUCCESS) {
      std::fprintf(stderr, "gdr verbs: the GPUDirect flush's READ failed: %s\n", ibv_wc_status_str(wc.status));
      gpudirect_fail("the flush failed");
    } else if (!aborted && !failed()) {
      ++stats_.flushes;
      on_placed(true);
    }
    release_unsignaled();
    parse();  // the frames behind it
    pump_tx();
  }

  // ---------------------------------------------------------------- keepalive

 public:
  /// Probes the peer if the connection has been idle for the keepalive
  /// interval (called by the poller's tick).
  void keepalive_tick() noexcept {
    if (!established_ || shut_ || failed() || vopts_.keepalive.count() == 0) return;
    // Called every ~100 ms (the poller's tick): activity since the last
    // tick restarts the idle time; reading the clock per completion would
    // cost more than the whole keepalive.
    auto now = std::chrono::steady_clock::now();
    if (activity_ != tick_activity_) {
      tick_activity_ = activity_;
      last_activity_ = now;
      return;
    }
    if (now - last_activity_ < vopts_.keepalive) return;
    if (free_tx_ == nullptr || sq_used_ + 1 > sq_depth_) return;
    tx_slot* t = take_tx();
    t->keepalive = true;
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE;  // zero bytes: no memory, no key checked
    // Always signaled: a failed unsignaled request completes to
    // unsignaled_work(), which tells no one, and the probe is there to
    // fail. It also accounts for unsignaled SENDs that nothing followed.
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr_id = t->wr_id();
    wr.num_sge = 0;
    enter();
    if (post_send_wrs(&wr, 1, t)) ++stats_.keepalives;
    leave();  // cannot free this: the probe is in flight, or the failure still flushes
  }

 private:
  // ---------------------------------------------------------------- rdma_cm events

  void arm_cm_watch() noexcept {
    if (cm_watch_in_flight_ || shut_ || ch_ == nullptr) return;
    io_uring_sqe* sqe = sched().get_sqe();
    if (sqe == nullptr) return;
    io_uring_prep_poll_add(sqe, ch_->fd, POLLIN);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(&cm_watch_));
    sched().note_submitted();
    cm_watch_in_flight_ = true;
  }

  static void on_cm_readable(operation* o, int, std::uint32_t) noexcept {
    connection* c = static_cast<cm_op*>(o)->self;
    c->enter();
    c->cm_watch_in_flight_ = false;
    c->cm_events();
    c->on_io_done();
    c->leave();
  }

  void cm_events() noexcept {
    rdma_cm_event* ev = nullptr;
    while (ch_ != nullptr && rdma_get_cm_event(ch_, &ev) == 0) {
      rdma_cm_event_type type = ev->event;
      rdma_ack_cm_event(ev);
      switch (type) {
        case RDMA_CM_EVENT_DISCONNECTED:
        case RDMA_CM_EVENT_DEVICE_REMOVAL:
        case RDMA_CM_EVENT_TIMEWAIT_EXIT:
          if (!failed() && !shut_) {
            // What the peer sent before leaving is already in the
            // completion queue: take it first.
            poller_->drain();
            if (!failed() && !shut_) {
              if (paused_ && backlog_head_ != backlog_tail_) {
                peer_gone_ = true;  // after the kept frames (parse)
              } else {
                on_link_failed(errc::connection_lost);
              }
            }
          }
          break;
        default: break;
      }
    }
    if (!shut_) arm_cm_watch();
  }

  // ---------------------------------------------------------------- failure

  bool protocol_fail() noexcept {
    if (!failed()) on_link_failed(errc::protocol_error);
    return false;
  }

  /// GPUDirect: bytes only the NIC may move cannot be moved by it. Loud,
  /// and never a copy instead: the connection fails, and every pending
  /// operation with it (`errc::gpudirect_unavailable`).
  bool gpudirect_fail(const char* why) noexcept {
    if (!failed()) {
      std::fprintf(stderr, "gdr verbs: %s: GPUDirect: %s: the connection fails\n", peer_name().c_str(), why);
      on_link_failed(errc::gpudirect_unavailable);
    }
    return false;
  }

  void fail_wc(const ibv_wc& wc) noexcept {
    if (wc.status != IBV_WC_WR_FLUSH_ERR)
      std::fprintf(stderr, "gdr verbs: %s: work completion failed: %s\n", peer_name().c_str(),
                   ibv_wc_status_str(wc.status));
    on_link_failed(wc_error(wc.status));
  }

  void drop(frame& f) noexcept {
    f.where = in_dropped;
    dropped_.push_back(&f);
  }

  void kick() noexcept {
    if (kick_posted_) return;
    kick_posted_ = true;
    sched().post(&kick_);
  }

  static void on_kick(remote_work* w) noexcept {
    connection* c = static_cast<kick_node*>(w)->self;
    c->enter();
    c->kick_posted_ = false;
    while (frame* f = c->dropped_.pop_front()) {
      f->where = nowhere;
      c->on_sent(*f, c->error() ? c->error() : std::error_code(errc::connection_lost));
    }
    // Paused by the engine, or by a READ that ended without its completion
    // (an aborted placement): go on with the frames behind.
    if (!c->failed() && (c->paused_ || c->backlog_head_ != c->backlog_tail_)) {
      c->paused_ = false;
      c->parse();
      c->pump_tx();
    }
    c->on_io_done();
    c->leave();
  }

  // ---------------------------------------------------------------- state

  rdma_cm_id* id_;
  rdma_event_channel* ch_;
  endpoint_options vopts_;
  const gdr::verbs::gpudirect_report* gpudirect_ = nullptr;  // a GPUDirect endpoint's probe
  endpoint_stats stats_{};
  gdr::verbs::cq_poller* poller_ = nullptr;
  gdr::verbs::device_queue* dq_ = nullptr;
  int reserved_ = 0;
  std::size_t buf_ = 0;    // bytes per buffer (this side)
  std::size_t frag_ = 0;   // bytes per SEND (the smaller of both sides' buffers)
  std::uint32_t rx_n_ = 0;
  std::uint32_t tx_n_ = 0;
  int sq_depth_ = 0;
  int sq_used_ = 0;
  unsigned max_inline_ = 0;
  bool established_ = false;
  bool shut_ = false;
  bool paused_ = false;
  bool peer_gone_ = false;
  transfer_path tx_path_ = transfer_path::host_eager;
  std::chrono::steady_clock::time_point last_activity_{};  // when a tick last saw activity
  std::uint64_t activity_ = 0;       // completions and posts so far
  std::uint64_t tick_activity_ = 0;  // ... as the last tick saw them
  int busy_noted_ = 0;

  // buffers
  struct aligned_delete {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{4096}); }
  };
  std::unique_ptr<std::byte[], aligned_delete> rx_mem_;
  std::unique_ptr<std::byte[], aligned_delete> tx_mem_;
  gdr::verbs::owned_mr rx_mr_;
  gdr::verbs::owned_mr tx_mr_;
  std::unique_ptr<rx_slot[]> rx_slots_;
  std::unique_ptr<tx_slot[]> tx_slots_;
  tx_slot* free_tx_ = nullptr;
  int tx_busy_ = 0;

  // credits
  std::uint32_t peer_rx_ = 2;      // the peer's receive buffers
  std::uint32_t sent_ = 0;         // SENDs and WRITE_WITH_IMMs posted (each takes one)
  std::uint32_t peer_granted_ = 0; // the peer's latest grant
  std::uint32_t reposted_ = 0;     // this side's buffers consumed and posted again
  std::uint32_t granted_ = 0;      // the grant last sent
  int rx_outstanding_ = 0;         // receive work requests posted

  // receive side
  std::unique_ptr<rx_item[]> backlog_;
  std::uint32_t backlog_head_ = 0;
  std::uint32_t backlog_tail_ = 0;
  struct {
    bool active = false;
    std::byte* dst = nullptr;
    std::size_t done = 0;
    std::size_t want_left = 0;
    std::uint64_t remaining = 0;
    bool notified = false;
  } cont_;
  std::vector<grant> grants_;
  std::vector<remote_dst> remotes_;
  pending_read rd_{};
  pending_flush fl_{};
  flush_node flush_work_{};

  // send side
  proto::fifo<frame, &frame::prev, &frame::next> tx_{};
  proto::fifo<frame, &frame::prev, &frame::next> dropped_{};
  proto::fifo<frame, &frame::prev, &frame::next> copied_{};  // copied at post, on_sent not yet called
  frame* copied_frame_ = nullptr;  // set by post_sends when it posted the last SEND of a copied frame
  unsigned signal_every_ = 1;      // at most this many send-queue requests per signaled one
  int unsignaled_wrs_ = 0;         // send-queue entries posted unsignaled since the last signaled one
  tx_slot* held_head_ = nullptr;   // their slots that the NIC still reads (bounce buffers), in order
  tx_slot* held_tail_ = nullptr;

  kick_node kick_{};
  bool kick_posted_ = false;
  cm_op cm_watch_{};
  bool cm_watch_in_flight_ = false;
};

}  // namespace detail::verbs

}  // namespace gdr
