/// \file
/// The verbs connection's placements that wait for the NIC (members of
/// `connection`, declared in `connection.hpp`): a put this side serves by
/// reading its payload from the peer's memory (RDMA READ), and the
/// GPUDirect flush (a one-byte loopback READ of GPU memory the NIC wrote).
///
/// Contract. Both go through the connection's one gate (`gate.hpp`, whose
/// states and transitions are written there): while it is not open, the
/// frames behind wait (placement is in order). A put's READ goes straight
/// into the exposed memory if it can be registered, else buffer by buffer
/// through a send slot; it takes no credit (it consumes no receive buffer
/// of the peer's). If the engine stops the placement meanwhile
/// (`link_abort_target`), the memory is free only once a READ in flight has
/// come back (`on_target_released`). The flush shares the device's flush
/// queue pair (`flush.hpp`) with every endpoint of the device: it waits
/// for room there, and after the queue pair failed it is tried once more
/// on a queue pair made anew.
#pragma once

#include <gdr/log.hpp>
#include <gdr/transport/verbs/connection.hpp>

namespace gdr::detail::verbs {

/// The put being served reads its payload (`len` bytes from the peer's
/// `raddr`) into `dst`: straight into it if it can be registered, else
/// through a send slot, one buffer at a time.
inline void connection::start_read(std::byte* dst, std::size_t len, std::uint64_t raddr, std::uint32_t rkey,
                                   int device) noexcept {
  gate_.start_read(dst, len, raddr, rkey, device);
  if (auto l = register_user(cache_for(device, recv_cache()), dst, len, device)) {
    gate_.read.reg = std::move(*l);
  } else {
    ++stats_.registration_failures;
    if (device >= 0) {
      // Through a send slot, the CPU would copy into GPU memory.
      gate_.drop_waiting();
      gpudirect_fail("cannot register exposed Device memory with the NIC for a put");
      return;
    }
  }
  post_read();
}

/// Posts the next READ of the put being served, if resources allow (else
/// pump_tx tries again when a send slot comes back). READs take no credit:
/// they consume no receive buffer of the peer's.
inline void connection::post_read() noexcept {
  if (gate_.current() != nic_gate::state::read_ready || shut_ || failed()) return;
  nic_gate::read_job& r = gate_.read;
  bool direct = static_cast<bool>(r.reg);
  std::size_t n = direct ? r.len - r.done : std::min(r.len - r.done, buf_);
  std::size_t chunk = direct ? rdma_chunk(n) : n;
  int nwr = static_cast<int>((n + chunk - 1) / chunk);
  if (free_tx_ == nullptr || sq_used_ + nwr > sq_depth_) return;
  tx_slot* t = take_tx();
  ibv_send_wr wrs[max_write_wrs];
  ibv_sge sges[max_write_wrs];
  const std::byte* into = direct ? r.dst + r.done : t->buf;
  std::uint32_t lkey = direct ? r.reg.handle()->lkey : tx_mr_.lkey();
  rdma_chain(wrs, sges, IBV_WR_RDMA_READ, into, lkey, r.raddr + r.done, r.rkey, n, chunk, *t);
  t->read = true;
  t->read_bytes = n;
  t->covered = static_cast<std::uint32_t>(nwr);
  if (!post_send_wrs(wrs, nwr, t)) return;  // failed: the connection fails, link_shutdown ends the gate
  gate_.read_posted();
  stats_.read_wrs += static_cast<std::uint64_t>(nwr);
}

/// A READ of `n` bytes completed (or failed: `ec`), through send slot
/// buffer `slot` when the destination is not registered.
inline void connection::read_done(std::size_t n, const std::byte* slot, std::error_code ec) noexcept {
  if (gate_.current() != nic_gate::state::read_posted) return;
  nic_gate::read_job& r = gate_.read;
  if (!ec && !gate_.stopped() && !r.reg) std::memcpy(r.dst + r.done, slot, n);
  nic_gate::outcome out = gate_.read_returned(n, !ec, needs_flush() && r.device >= 0);
  if (out.stopped) {
    // The engine stopped the placement while the READ ran: its memory is
    // free now.
    on_target_released();
  } else if (ec) {
    return;  // the connection failed: the engine stops the placement
  }
  switch (out.now) {
    case nic_gate::state::read_ready: post_read(); return;
    case nic_gate::state::flush_ready:
      ++stats_.rdma_read;
      post_flush();  // the put is placed once the flush says the bytes have landed
      return;
    default:
      if (!out.stopped) {
        ++stats_.rdma_read;
        on_placed(true);
      }
      parse();  // the frames behind it
      return;
  }
}

/// GPU memory the NIC has just written (at `addr`, registered by `key`, the
/// grant the peer wrote through): READ one byte of it through the device's
/// flush queue pair (`flush.hpp`); the placement completes when the READ
/// does. Parsing waits meanwhile.
inline void connection::start_flush(const std::byte* addr, gdr::verbs::owned_mr key) noexcept {
  if (failed() || shut_) return;
  gate_.start_flush(addr);
  gate_.flush.key = std::move(key);
  post_flush();
}

/// Posts the gate's flush if the device's flush queue pair has room, else
/// waits in its queue (woken by a kick); makes the queue pair anew once a
/// failed one has nothing in flight.
inline void connection::post_flush() noexcept {
  if (gate_.current() != nic_gate::state::flush_ready) return;
  if (failed() || shut_) {
    gate_.drop_waiting();  // nobody is waiting for these bytes any more
    return;
  }
  gdr::verbs::flush_qp& q = *dq_->flush;
  if (q.needs_remake()) {
    if (result<void> r = q.connect(dq_->pd, dq_->cq, id_); !r) {
      gdr::detail::log("verbs", "making the GPUDirect flush's queue pair again: %s", r.error().message().c_str());
      gate_.drop_waiting();
      gpudirect_fail("no flush queue pair");
      return;
    }
  }
  if (!q.room()) {
    if (!flush_waiter_.queued) ++stats_.flush_waits;
    q.wait(flush_waiter_);
    return;
  }
  nic_gate::flush_job& fj = gate_.flush;
  if (!fj.key && !fj.reg) {
    auto l = dq_->device_mrs->acquire(fj.addr, 1);  // found cached: the transfer's own registration
    if (!l) {
      gate_.drop_waiting();
      gpudirect_fail("cannot register Device memory for its flush");
      return;
    }
    fj.reg = gdr::verbs::registration_hold(std::move(*l), *dq_->device_mrs, fj.addr, 1, vopts_.cache_registrations);
  }
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uintptr_t>(q.scratch.get());
  sge.length = 1;
  sge.lkey = q.mr.lkey();
  ibv_send_wr wr{};
  wr.wr_id = flush_work_.wr_id();
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = reinterpret_cast<std::uintptr_t>(fj.addr);
  wr.wr.rdma.rkey = fj.key ? fj.key.rkey() : fj.reg.handle()->rkey;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(q.qp, &wr, &bad)) {  // returns an errno value
    gate_.drop_waiting();
    gdr::detail::log("verbs", "posting the GPUDirect flush: %s", std::strerror(rc));
    gpudirect_fail("the flush could not be posted");
    return;
  }
  ++q.in_flight;
  ++q.posted;
  gate_.flush_posted();
  ++activity_;
  if (busy_noted_++ == 0) poller_->note_busy(1);
  if (q.room()) q.wake_one();  // room for the next one waiting, if any
}

inline void connection::on_flush(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
  connection* c = static_cast<flush_node*>(w)->c;
  proto::event_scope ev(*c);  // its end may free c
  c->flush_done(wc);
  c->on_io_done();
}

inline void connection::on_flush_room(gdr::verbs::flush_waiter* w) noexcept {
  static_cast<flush_wait_node*>(w)->c->kick();  // on_kick posts the flush
}

inline void connection::flush_done(const ibv_wc& wc) noexcept {
  if (--busy_noted_ == 0) poller_->note_busy(-1);
  ++activity_;
  const bool ok = wc.status == IBV_WC_SUCCESS;
  if (!ok && wc.status != IBV_WC_WR_FLUSH_ERR)
    gdr::detail::log("verbs", "the GPUDirect flush's READ failed: %s", ibv_wc_status_str(wc.status));
  // Once more on a queue pair made anew: the failure may have been another
  // endpoint's, whose READ put the shared queue pair in the error state.
  const bool retry = !ok && gate_.flush.retries == 0 && !failed() && !shut_;
  nic_gate::outcome out = gate_.flush_returned(ok, retry);
  dq_->flush->returned(!ok);  // may wake another endpoint's flush
  if (out.now == nic_gate::state::flush_ready) {
    post_flush();
  } else if (!out.stopped && !failed()) {
    if (ok) {
      ++stats_.flushes;
      on_placed(true);
    } else {
      gpudirect_fail("the flush failed");
    }
  }
  release_unsignaled();
  parse();  // the frames behind it
  pump_tx();
}

}  // namespace gdr::detail::verbs
