/// \file
/// The verbs connection's receive side (members of `connection`, declared
/// in `connection.hpp`): the ring of receive buffers and what arrives in it.
///
/// Contract. `rx_depth` buffers are posted before the connection is made;
/// each receive completion is one buffer consumed, kept in order in the
/// backlog until the engine has placed it, then posted again (one credit
/// back to the peer, carried by the next header this side sends). A SEND
/// carries a frame's header and first payload bytes, or a continuation of
/// the payload (`wire_header::cont`), or only credits. A WRITE_WITH_IMM
/// carries nothing in its buffer: its immediate names the grant the peer's
/// NIC has just filled (`grants.hpp`). Parsing stops while the engine holds
/// back (`pause`), while a placement waits for the NIC (`rdma_read.hpp`),
/// while a test holds the reader (`hold_reading`), and once the connection
/// failed; credits are still read from every completion that arrives
/// meanwhile.
///
/// A payload that comes as SENDs is copied into its destination buffer by
/// buffer; the engine may stop the placement between two buffers
/// (`link_abort_target`): the rest of the payload is read and dropped.
#pragma once

#include <gdr/transport/verbs/connection.hpp>

namespace gdr::detail::verbs {

inline std::error_code connection::post_recv(std::uint32_t i) noexcept {
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
inline void connection::repost(std::uint32_t i) noexcept {
  if (shut_) return;
  if (std::error_code ec = post_recv(i)) {
    if (!failed()) on_link_failed(ec);
    return;
  }
  credits_.reposted();
}

inline void connection::on_rx(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
  auto* slot = static_cast<rx_slot*>(w);
  connection* c = slot->c;
  if (c == nullptr) return;  // its connection is gone (teardown)
  proto::event_scope ev(*c);  // its end may free c
  c->rx_done(*slot, wc);
  c->on_io_done();
}

inline void connection::rx_done(rx_slot& slot, const ibv_wc& wc) noexcept {
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
    credits_.peer_granted(w.credits);
    if (w.kind == wire_header::credit) {
      repost(slot.index);
    } else if (w.kind == wire_header::lane) {
      lane_control(w);  // out of band: the lane's state, not the engine's
      repost(slot.index);
    } else {
      push_backlog({slot.index, wc.byte_len, 0, false});
    }
  }
  parse();
  pump_tx();
}

/// Teardown: receives a device never flushed back (see link_quiet). The
/// queue pair is gone, so nothing writes their buffers; their work objects
/// stay with the device's queue for a completion still to come.
inline void connection::orphan_receives() noexcept {
  if (rx_outstanding_ == 0 || dq_ == nullptr || !rx_slots_) return;
  for (std::uint32_t i = 0; i < rx_n_; ++i) rx_slots_[i].c = nullptr;
  try {
    dq_->orphans.push_back(std::shared_ptr<void>(rx_slots_.release(), [](void* p) { delete[] static_cast<rx_slot*>(p); }));
  } catch (...) {
    (void)rx_slots_.release();  // leaked rather than freed under a completion
  }
}

inline void connection::push_backlog(rx_item it) noexcept {
  // At most rx_n_ buffers are consumed and not yet reposted.
  assert(backlog_n_ < rx_n_);
  std::uint32_t at = backlog_head_ + backlog_n_;
  if (at >= rx_n_) at -= rx_n_;
  backlog_[at] = it;
  ++backlog_n_;
}

/// Hands the consumed buffers to the engine, in order, until it pauses.
inline void connection::parse() noexcept {
  while (!paused_ && !held_ && gate_.is_open() && !failed() && !shut_ && backlog_n_ != 0) {
    const rx_item& it = backlog_[backlog_head_];
    bool done = it.is_imm ? rx_write_arrived(it) : rx_buffer(it);
    if (!done) return;
    std::uint32_t index = it.index;
    if (++backlog_head_ == rx_n_) backlog_head_ = 0;
    --backlog_n_;
    repost(index);
  }
  if (peer_gone_ && !failed() && backlog_n_ == 0) on_link_failed(errc::connection_lost);
}

/// One SEND's bytes. False: paused or failed (the buffer stays).
inline bool connection::rx_buffer(const rx_item& it) noexcept {
  const std::byte* b = rx_mem_.get() + std::size_t{it.index} * buf_;
  wire_header w;
  std::memcpy(&w, b, wire_size);
  const std::byte* payload = b + wire_size;
  std::size_t avail = it.bytes - wire_size;
  if (cont_.active) {
    if (w.kind != wire_header::cont || avail > cont_.remaining || avail == 0) return protocol_fail();
    ++stats_.fragments;
    return place_sends(payload, avail);
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
  // Recorded before settle() below, which hands frames back to the engine:
  // a stop of this placement finds it (sends_placement).
  if (!by_read) cont_.begin(plan.dst, plan.want, h.length);
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
  return place_sends(payload, avail);
}

/// `avail` bytes of the payload being placed (`cont_`), from one SEND: the
/// wanted ones are copied, the rest dropped; the engine hears once all
/// wanted bytes are in place. False: failed.
inline bool connection::place_sends(const std::byte* payload, std::size_t avail) noexcept {
  std::size_t take = std::min(avail, cont_.want_left);
  if (take != 0) std::memcpy(cont_.dst + cont_.done, payload, take);
  cont_.done += take;
  cont_.want_left -= take;
  cont_.remaining -= avail;
  if (cont_.want_left == 0 && !cont_.notified) {
    cont_.notified = true;
    on_placed(false);
  }
  if (cont_.remaining == 0) cont_ = {};
  return !failed();
}

/// A WRITE_WITH_IMM: the rendezvous payload of the rtr, or the reply to
/// the get, that `imm` names is in place.
inline bool connection::rx_write_arrived(const rx_item& it) noexcept {
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
    // The receive completes once the flush says the bytes have landed; the
    // flush reads through the grant's registration, which it keeps till then.
    start_flush(plan.dst, std::move(w->key));
  } else {
    on_placed(true);
  }
  finish_grant(w);
  return !failed();
}

}  // namespace gdr::detail::verbs
