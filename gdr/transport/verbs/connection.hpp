/// \file
/// The verbs transport's connection: one RC queue pair under a protocol
/// engine (`gdr/protocol/engine.hpp`). This header holds the class, its
/// set-up and teardown, and the engine's hooks; the members of each phase
/// of its work are defined in headers of their own, included at the end of
/// this one (as NCCL splits its net_ib transport):
///
///   * `wire.hpp`       the connection parameters and the header of every SEND;
///   * `recv.hpp`       the receive ring: buffers, parsing in order, placing
///                      SENDs and WRITE_WITH_IMM payloads;
///   * `grants.hpp`     this side's memory the peer's NIC reaches (an rtr's
///                      receive, a large get's destination, a large put's
///                      source), the keys the peer gave, registrations;
///   * `send.hpp`       send slots, completion signalling, posting frames as
///                      SENDs or RDMA WRITEs, send completions;
///   * `rdma_read.hpp`  serving a put by RDMA READ, and the GPUDirect flush:
///                      placements that wait for the NIC;
///   * `rma.hpp`        the one-sided lane: direct puts, gets, atomics,
///                      batches, notifications and flushes on queue pairs
///                      of their own;
///   * `liveness.hpp`   device events, the keepalive, rdma_cm's events,
///                      failure.
///
/// The contract
/// ============
/// A `connection` lives on the heap and belongs to one scheduler; everything
/// runs on that scheduler's thread. Its work requests complete through the
/// scheduler's `cq_poller` (`completion.hpp`): every `wr_id` is a receive
/// buffer, a send slot or the flush node of this connection. Each
/// completion, device event, rdma_cm event and kick is one event of the
/// engine's (between `enter()` and `leave()`); the engine never calls a
/// `link_*` hook from inside one (it queues posts, withdrawals, aborts and
/// the shutdown, and makes them at the end of the outermost event), so a
/// hook never runs while this connection walks its own lists.
///
/// Frames go out in the order posted: SENDs of a 72-byte header and the
/// first payload bytes (inline up to the queue pair's limit, else copied
/// into a send slot), continuations for a payload larger than one buffer,
/// and rendezvous payloads, a get's reply or a served put by RDMA. A frame
/// is handed back (`on_sent`) once the user's memory is no longer needed:
/// at post for a copied frame (at the end of the event), on its work
/// completion for an RDMA WRITE and for the close frame, and for a frame
/// carrying a key only once the peer is also done with that memory.
///
/// Frames come in as receive completions, in order; each is parsed only
/// when the ones before it are placed: the engine's header (`on_header`),
/// then its payload, by memcpy out of the receive buffers or already in
/// place (written by the peer's NIC, or read by this side's). Back-pressure
/// is the credit window: a sender may consume only receive buffers the
/// peer has posted and said so.
///
/// Failure. An error completion, a queue pair event from the device, or
/// rdma_cm's DISCONNECTED (the peer's process closed its connection, or was
/// killed: the kernel sends the disconnect request) fails the engine; the
/// queue pair is moved to the error state, which flushes every posted work
/// request back (`IBV_WC_WR_FLUSH_ERR`). The connection is quiet, and may be
/// freed, once every work request has come back. A peer that vanishes
/// without a word (power, cable) is noticed by the transport's retries and
/// the keepalive (`liveness.hpp`).
#pragma once

#include <infiniband/verbs.h>
#include <liburing.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <cassert>
#include <deque>
#include <cerrno>
#include <chrono>
#include <coroutine>
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
#include <gdr/log.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/engine.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transport/verbs/completion.hpp>
#include <gdr/transport/verbs/credits.hpp>
#include <gdr/transport/verbs/flush.hpp>
#include <gdr/transport/verbs/gate.hpp>
#include <gdr/transport/verbs/gpudirect.hpp>
#include <gdr/transport/verbs/lane.hpp>
#include <gdr/transport/verbs/memory.hpp>
#include <gdr/transport/verbs/options.hpp>
#include <gdr/transport/verbs/wire.hpp>

namespace gdr::detail::verbs {

using gdr::verbs::endpoint_options;
using gdr::verbs::endpoint_stats;
using proto::frame;

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
      : engine(s, reg, o.protocol, stats_, caps), id_(id), ch_(ch), vopts_(o), lane_registry_(&reg) {
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
    flush_waiter_.c = this;
    flush_waiter_.wake = &on_flush_room;
    try {
      setup();
    } catch (...) {
      // The caller keeps the id and its channel; only what setup() made goes.
      lane_teardown();
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
    credits_.start(peer.rx_depth);
    frag_ = std::min<std::size_t>(buf_, peer.buffer_size);
    established_ = true;
    proto::event_scope ev(*this);
    if (needs_flush() && !dq_->flush) {
      // Now that rdma_cm has set the connection's address vector up.
      auto f = gdr::verbs::make_flush_qp(dq_->pd, dq_->cq, id_);
      if (f) {
        dq_->flush = std::move(*f);
      } else {
        gdr::detail::log("verbs", "the GPUDirect flush's loopback queue pair: %s", f.error().message().c_str());
        gpudirect_fail("no flush for a GPU that needs one");
      }
    }
    lane_start(peer);
    start_protocol();
    arm_cm_watch();
    ++activity_;
  }

  /// What this side tells the peer.
  conn_params params() const noexcept {
    conn_params p;
    p.rx_depth = static_cast<std::uint32_t>(rx_n_);
    p.buffer_size = static_cast<std::uint32_t>(buf_);
    if (gpudirect_ != nullptr) p.flags |= conn_params::flag_gpudirect;
    if (lane_init_ != nullptr) {
      p.domain = dq_->domain->domain_id();
      p.lane_init_qpn = lane_init_->qp_num;
      p.lane_target_qpn = lane_target_->qp_num;
    }
    return p;
  }

  /// What the GPUDirect probe found for this endpoint's GPU and NIC (null: not GPUDirect).
  const gdr::verbs::gpudirect_report* gpudirect() const noexcept { return gpudirect_; }
  /// GPUDirect: NIC writes into GPU memory end with a flush.
  bool needs_flush() const noexcept { return gpudirect_ != nullptr && gpudirect_->needs_flush; }

  ibv_qp* qp() const noexcept { return id_ != nullptr ? id_->qp : nullptr; }
  /// The last address, length and key this side sent its peer.
  gdr::verbs::key_info last_key_sent() const noexcept { return last_key_; }
  /// Tests: holds this side's reader (`on`), as in a process that stopped,
  /// or lets it go on. While held, what the peer sends still arrives (the
  /// NIC takes it into the posted buffers, and the credits it carries are
  /// counted) but none of it reaches the engine; let go, it is parsed in
  /// order (from the loop). The peer's early credits keep a gdr peer's
  /// reader from ever stopping by itself: this is how a test makes frames
  /// wait unread on the far side.
  void hold_reading(bool on) noexcept {
    held_ = on;
    if (!on && !failed() && backlog_n_ != 0) kick();
  }
  /// The device's GPUDirect flush queue pair, if it has one.
  ibv_qp* flush_qp() const noexcept { return dq_ != nullptr && dq_->flush ? dq_->flush->qp : nullptr; }
  /// Forgets the cached registrations overlapping the range (every cache
  /// of this connection's device); one a transfer still uses goes
  /// when that transfer ends. Returns how many were dropped.
  std::size_t invalidate_registrations(const void* addr, std::size_t len) noexcept {
    if (dq_ == nullptr) return 0;
    std::size_t n = recv_cache().invalidate(addr, len) + send_cache().invalidate(addr, len);
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

  std::string peer_name() const override;

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
    gdr::verbs::registration_hold src{};  // the RDMA source's registration
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
    gdr::verbs::owned_mr key;  // a registration of exactly [addr, addr + len): its key went out
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
  /// A payload placed from SENDs, buffer by buffer (recv.hpp), recorded
  /// before anything else can reach the engine, so that a stop of the
  /// placement (`link_abort_target`) always finds it (issue 15, defect 6).
  struct sends_placement {
    bool active = false;          // a payload is being placed
    std::byte* dst = nullptr;     // where the wanted bytes go (null: dropped)
    std::size_t done = 0;         // bytes placed
    std::size_t want_left = 0;    // bytes still wanted
    std::uint64_t remaining = 0;  // payload bytes still to come
    bool notified = false;        // on_placed was called (or the placement was stopped)

    void begin(std::byte* to, std::size_t want, std::uint64_t length) noexcept {
      *this = sends_placement{true, to, 0, want, length, false};
    }
    /// The engine stopped the placement: the rest is read and dropped.
    void stop() noexcept {
      dst = nullptr;
      want_left = 0;
      notified = true;
    }
  };
  struct flush_node : gdr::verbs::work {
    connection* c = nullptr;
  };
  struct flush_wait_node : gdr::verbs::flush_waiter {
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
    lane_setup();
    enable_send_now();
  }

  /// Frees what setup() made. The queue pair must have no work request
  /// outstanding (flushed, or never posted).
  void teardown() noexcept {
    lane_teardown();
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
    if (dq_ != nullptr && dq_->flush) dq_->flush->cancel(flush_waiter_);
    gate_ = nic_gate{};
    for (std::uint32_t i = 0; tx_slots_ && i < tx_n_; ++i) tx_slots_[i].src.end();
    orphan_receives();
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
  /// Probes the peer if the connection has been idle for the keepalive
  /// interval (called by the poller's tick; liveness.hpp).
  void keepalive_tick() noexcept;

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

  /// The eager fast path (engine.hpp; send.hpp).
  bool link_send_now(frame& f) noexcept override;

  bool link_withdraw(frame& f) noexcept override;  // send.hpp

  bool link_committed(const frame& f) const noexcept override { return f.queued && f.sealed; }

  void link_resume() noexcept override {
    if (paused_) kick();
  }

  bool link_abort_target() noexcept override {
    if (!gate_.is_open()) {
      // A put's READ or a flush (gate.hpp says when the memory is free).
      if (gate_.current() == nic_gate::state::flush_ready) dq_->flush->cancel(flush_waiter_);
      if (gate_.abort() == nic_gate::released::later) return false;
      if (gate_.is_open()) kick();  // parsing goes on from the loop
      return true;
    }
    // Placement is a memcpy per buffer: between buffers nothing touches the
    // destination. The rest of the payload is dropped.
    if (cont_.active) cont_.stop();
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
    lane_shutdown(failed() ? error() : std::error_code(errc::closed));
    // Copied frames not yet handed back: the failure may have come before
    // the NIC sent them, so they end with the error (dropped_), not as sent.
    while (frame* f = copied_.pop_front()) drop(*f);
    while (frame* f = tx_.head) {
      // (A partly posted one too: no flushed completion names it.)
      tx_.erase(f);
      drop(*f);
    }
    // Memory the peer was to write into or read from: the queue pair is in
    // error, so it is free again. A frame still being sent comes back
    // flushed (tx_done); one already sent is handed back here.
    for (auto it = grants_.begin(); it != grants_.end();) {
      if (it->sent) {
        drop(*it->f);
        it = grants_.erase(it);
      } else {
        it->key.reset();
        ++it;
      }
    }
    // A READ in flight comes back flushed (a flush, done); one waiting for
    // a slot or for the flush queue pair never goes.
    if (gate_.current() == nic_gate::state::flush_ready) dq_->flush->cancel(flush_waiter_);
    gate_.drop_waiting();
    if (cm_watch_in_flight_) sched().cancel(&cm_watch_);
    backlog_n_ = 0;  // nothing more is parsed
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
    // Receives are not waited for once the queue pair is in the error
    // state: it takes nothing more into their buffers, and a device may
    // never flush them back (Soft-RoCE on Linux 6.1 does not, at times;
    // teardown keeps their work objects alive for a late completion).
    return (shut_ || (rx_outstanding_ == 0 && lane_rx_out_ == 0)) && sq_used_ == 0 && tx_busy_ == 0 &&
           !cm_watch_in_flight_ && !kick_posted_ && dropped_.empty() && copied_.empty() && !gate_.in_flight() &&
           lane_out_ == 0 && !lane_marker_.posted;
  }

  void link_release() noexcept override {}

  transfer_path link_rx_path(bool direct) const noexcept override {
    return direct ? transfer_path::host_zero_copy : transfer_path::host_eager;
  }
  transfer_path link_tx_path() const noexcept override { return tx_path_; }
  void link_direct(proto::op& o) noexcept override;
  bool link_direct_withdraw(proto::op& o) noexcept override;

 private:
  // ---- recv.hpp: the receive ring, parsing, SENDs and WRITE_WITH_IMM placed
  std::error_code post_recv(std::uint32_t i) noexcept;
  void repost(std::uint32_t i) noexcept;
  static void on_rx(gdr::verbs::work* w, const ibv_wc& wc) noexcept;
  void rx_done(rx_slot& slot, const ibv_wc& wc) noexcept;
  void push_backlog(rx_item it) noexcept;
  void orphan_receives() noexcept;
  void parse() noexcept;
  bool rx_buffer(const rx_item& it) noexcept;
  bool place_sends(const std::byte* payload, std::size_t avail) noexcept;
  bool rx_write_arrived(const rx_item& it) noexcept;

  // ---- grants.hpp: this side's memory the peer's NIC reaches, the peer's keys, registrations
  std::vector<grant>::iterator find_grant(grant_kind kind, std::uint64_t token) noexcept;
  void settle(grant_kind kind, std::uint64_t id) noexcept;
  void finish_grant(std::vector<grant>::iterator g) noexcept;
  std::vector<grant>::iterator grant_of(const frame& f) noexcept;
  void remember_remote(bool get_reply, std::uint64_t token, std::uint64_t raddr, std::uint32_t rkey) noexcept;
  void attach_receive(frame& f) noexcept;
  bool attach_request(frame& f) noexcept;
  void add_grant(frame& f, grant_kind kind, std::uint64_t token, const std::byte* addr, std::size_t len,
                 int device) noexcept;
  result<gdr::verbs::owned_mr> register_exact(const void* addr, std::size_t len, int device, int access) noexcept;
  result<gdr::verbs::registration_hold> register_user(gdr::verbs::mr_cache& cache, const void* addr, std::size_t len,
                                                      int device) noexcept;
  gdr::verbs::mr_cache& cache_for(int device, gdr::verbs::mr_cache& host) noexcept;
  gdr::verbs::mr_cache& recv_cache() noexcept;
  gdr::verbs::mr_cache& send_cache() noexcept;
  std::vector<remote_dst>::iterator find_remote(bool get_reply, std::uint64_t token) noexcept;

  // ---- send.hpp: send slots, signalling, posting frames (SENDs and RDMA WRITEs), send completions
  static std::size_t sent_bytes(const frame& f) noexcept;
  tx_slot* take_tx() noexcept;
  void free_tx(tx_slot* t) noexcept;
  void free_held(tx_slot* t) noexcept;
  bool signal_next(int n, bool needed, bool frees_slot) const noexcept;
  bool hand_back_copied() noexcept;
  void release_unsignaled() noexcept;
  void pump_tx() noexcept;
  bool post_frame(frame& f) noexcept;
  static std::size_t rdma_chunk(std::size_t len) noexcept;
  static void rdma_chain(ibv_send_wr* wrs, ibv_sge* sges, ibv_wr_opcode op, const std::byte* local,
                         std::uint32_t lkey, std::uint64_t remote, std::uint32_t rkey, std::size_t len,
                         std::size_t chunk, tx_slot& t) noexcept;
  int post_rdma(frame& f, const remote_dst& r, std::uint64_t offset, std::uint32_t imm, bool tell_at_end) noexcept;
  bool post_send_wrs(ibv_send_wr* wrs, int n, tx_slot* t) noexcept;
  bool post_sends(frame& f) noexcept;
  void maybe_send_credits() noexcept;
  bool post_header(wire_header w, bool signal) noexcept;
  static void on_tx(gdr::verbs::work* w, const ibv_wc& wc) noexcept;
  void tx_done(tx_slot& t, const ibv_wc& wc) noexcept;

  // ---- rdma_read.hpp: serving a put by RDMA READ, and the GPUDirect flush
  void start_read(std::byte* dst, std::size_t len, std::uint64_t raddr, std::uint32_t rkey, int device) noexcept;
  void post_read() noexcept;
  void read_done(std::size_t n, const std::byte* slot, std::error_code ec) noexcept;
  void start_flush(const std::byte* addr, gdr::verbs::owned_mr key) noexcept;
  void post_flush() noexcept;
  static void on_flush(gdr::verbs::work* w, const ibv_wc& wc) noexcept;
  static void on_flush_room(gdr::verbs::flush_waiter* w) noexcept;
  void flush_done(const ibv_wc& wc) noexcept;

  // ---- rma.hpp: the one-sided lane (its types: lane.hpp)
 public:
  /// Takes a notification if one is there (true), else queues `w`.
  bool take_note(note_waiter& w) noexcept;
  /// Unqueues `w` (its coroutine is destroyed while waiting).
  void drop_note_waiter(note_waiter& w) noexcept;
  /// The one-sided lane is connected and usable now.
  bool one_sided_ready() const noexcept { return lane_phase_ == lane_phase::ready; }

 private:
  void lane_to(lane_phase p) noexcept;
  ibv_qp* lane_make_qp(std::uint32_t send_wrs, std::uint32_t recv_wrs) noexcept;
  void lane_setup();
  void lane_teardown() noexcept;
  std::error_code lane_connect(ibv_qp* qp, std::uint32_t dest, bool target) noexcept;
  static std::error_code lane_reset_qp(ibv_qp* qp) noexcept;
  std::error_code lane_post_receives() noexcept;
  void lane_start(const conn_params& peer) noexcept;
  lane_piece lane_piece_of(const lane_job& j, std::size_t i) noexcept;
  void lane_plan_gpu_flush(lane_job& j) noexcept;
  void lane_pump() noexcept;
  lane_job& lane_take(proto::op& o) noexcept;
  bool lane_post_alone(proto::op& o) noexcept;
  bool lane_small_memory(lane_job& j) noexcept;
  std::error_code lane_local_memory(lane_job& j) noexcept;
  void lane_data_wr(const lane_job& j, const lane_piece& p, std::uint32_t rkey, bool last, ibv_send_wr& wr,
                    ibv_sge& sge) noexcept;
  bool lane_post(lane_job& j) noexcept;
  static void on_lane_wc(gdr::verbs::work* w, const ibv_wc& wc) noexcept;
  void lane_done(lane_job& j, const ibv_wc& wc) noexcept;
  void lane_end_job(lane_job& j, std::error_code ec) noexcept;
  void lane_free_job(lane_job& j) noexcept;
  void lane_break() noexcept;
  void lane_mark() noexcept;
  static void on_lane_marker(gdr::verbs::work* w, const ibv_wc& wc) noexcept;
  void lane_marked() noexcept;
  void lane_begin_reset() noexcept;
  void lane_control(const wire_header& w) noexcept;
  void lane_try_target_reset() noexcept;
  void lane_send_control() noexcept;
  static void on_lane_rx(gdr::verbs::work* w, const ibv_wc& wc) noexcept;
  void lane_rx_done(lane_rx& r, const ibv_wc& wc) noexcept;
  void wake_note_waiters() noexcept;
  void lane_shutdown(std::error_code ec) noexcept;
  void lane_lost(std::error_code ec, const char* why) noexcept;

  // ---- liveness.hpp: device events, keepalive, rdma_cm events, failure, kicks
  void on_tick() noexcept override;
  void on_qp_event(ibv_event_type type) noexcept override;
  void arm_cm_watch() noexcept;
  static void on_cm_readable(operation* o, int, std::uint32_t) noexcept;
  void cm_events() noexcept;
  bool protocol_fail() noexcept;
  bool gpudirect_fail(const char* why) noexcept;
  void fail_wc(const ibv_wc& wc) noexcept;
  void drop(frame& f) noexcept;
  void kick() noexcept;
  static void on_kick(remote_work* w) noexcept;

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
  bool held_ = false;  // hold_reading (tests)
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
  gdr::verbs::key_info last_key_{};  // the last key a frame carried (last_key_sent)
  credit_ledger credits_{};        // the peer's buffers this side may consume, and this side's owed
  int rx_outstanding_ = 0;         // receive work requests posted

  // receive side
  std::unique_ptr<rx_item[]> backlog_;
  // A ring of rx_n_: the oldest item's index and how many are kept
  // (wrapped by comparison: a division per message is not free, and
  // counters taken modulo a size that is not a power of two would collide
  // when they wrap).
  std::uint32_t backlog_head_ = 0;
  std::uint32_t backlog_n_ = 0;
  sends_placement cont_{};  // a payload arriving in SENDs, buffer by buffer
  std::vector<grant> grants_;
  std::vector<remote_dst> remotes_;
  nic_gate gate_{};                // a served put's READ, or the GPUDirect flush (gate.hpp)
  flush_node flush_work_{};
  flush_wait_node flush_waiter_{};  // in the flush queue pair's queue while waiting for room

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

  // the one-sided lane (rma.hpp)
  memory_registry* lane_registry_;
  lane_phase lane_phase_ = lane_phase::off;
  ibv_qp* lane_init_ = nullptr;
  ibv_qp* lane_target_ = nullptr;
  lane_event_sink lane_sink_{};
  lane_marker lane_marker_{};
  std::error_code lane_error_{};  // why the lane is shut
  std::uint32_t peer_lane_init_ = 0, peer_lane_target_ = 0;  // the peer's queue pair numbers
  lane_target lane_gpu_dirty_{};  // the last direct put into the peer's GPU memory since a flush
  std::uint8_t lane_rd_atomic_ = 1;
  unsigned lane_inline_ = 0;
  std::uint32_t lane_depth_ = 0;  // jobs
  int lane_sq_ = 0, lane_out_ = 0;  // send-queue entries, and work requests in flight
  std::uint32_t lane_rx_n_ = 0;
  int lane_rx_out_ = 0;           // notification receives posted
  std::unique_ptr<lane_job[]> lane_jobs_;
  gdr::verbs::owned_mr lane_mr_;  // of lane_jobs_ (their scratch)
  std::unique_ptr<lane_rx[]> lane_rx_;
  lane_job* lane_free_ = nullptr;
  proto::fifo<lane_job, &lane_job::prev, &lane_job::next> lane_active_{};  // jobs in order
  proto::op* lane_wait_head_ = nullptr;  // operations waiting for a job (op::direct_next)
  proto::op* lane_wait_tail_ = nullptr;
  std::uint32_t lane_gen_ = 0;       // this side's resets
  std::uint32_t lane_peer_gen_ = 0;  // the peer's latest reset
  std::uint8_t lane_ctl_due_ = 0;    // lane control messages to send (lane_ctl_reset, lane_ctl_ready)
  bool lane_target_reset_due_ = false;
  std::chrono::steady_clock::time_point lane_lost_at_{};  // the lane could not be brought back (lane_lost)
  std::deque<std::uint32_t> notes_;  // notifications not yet taken
  std::error_code note_error_{};
  note_waiter* note_head_ = nullptr;  // waiting for a notification, in order
  note_waiter* note_tail_ = nullptr;
};

}  // namespace gdr::detail::verbs

// The members of each phase (see the file comment).
#include <gdr/transport/verbs/grants.hpp>
#include <gdr/transport/verbs/liveness.hpp>
#include <gdr/transport/verbs/rdma_read.hpp>
#include <gdr/transport/verbs/recv.hpp>
#include <gdr/transport/verbs/rma.hpp>
#include <gdr/transport/verbs/rma_faults.hpp>
#include <gdr/transport/verbs/send.hpp>
