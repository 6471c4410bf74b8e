/// \file
/// The verbs connection's placements that wait for the NIC (members of
/// `connection`, declared in `connection.hpp`): a put this side serves by
/// reading its payload from the peer's memory (RDMA READ), and the
/// GPUDirect flush (a one-byte loopback READ of GPU memory the NIC wrote).
///
/// Contract. While either runs, the frames behind it wait (placement is in
/// order). A put's READ goes straight into the exposed memory if it can be
/// registered, else buffer by buffer through a send slot; it takes no
/// credit (it consumes no receive buffer of the peer's). If the engine
/// stops the placement meanwhile (`link_abort_target`), the memory is free
/// only once the READ in flight has come back (`on_target_released`).
#pragma once

#include <gdr/transport/verbs/connection.hpp>

namespace gdr::detail::verbs {

/// The put being served reads its payload (`len` bytes from the peer's
/// `raddr`) into `dst`: straight into it if it can be registered, else
/// through a send slot, one buffer at a time.
inline void connection::start_read(std::byte* dst, std::size_t len, std::uint64_t raddr, std::uint32_t rkey, int device) noexcept {
  rd_.active = true;
  rd_.posted = rd_.aborted = false;
  rd_.dst = dst;
  rd_.len = len;
  rd_.done = 0;
  rd_.raddr = raddr;
  rd_.rkey = rkey;
  rd_.device = device;
  if (auto l = register_user(cache_for(device, recv_cache()), dst, len, device)) {
    rd_.reg = std::move(*l);
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
inline void connection::post_read() noexcept {
  if (!rd_.active || rd_.posted || rd_.aborted || shut_ || failed()) return;
  bool direct = static_cast<bool>(rd_.reg);
  std::size_t n = direct ? rd_.len - rd_.done : std::min(rd_.len - rd_.done, buf_);
  std::size_t chunk = direct ? rdma_chunk(n) : n;
  int nwr = static_cast<int>((n + chunk - 1) / chunk);
  if (free_tx_ == nullptr || sq_used_ + nwr > sq_depth_) return;
  tx_slot* t = take_tx();
  ibv_send_wr wrs[max_write_wrs];
  ibv_sge sges[max_write_wrs];
  const std::byte* into = direct ? rd_.dst + rd_.done : t->buf;
  std::uint32_t lkey = direct ? rd_.reg.handle()->lkey : tx_mr_.lkey();
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
inline void connection::read_done(std::size_t n, const std::byte* slot, std::error_code ec) noexcept {
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
  if (!rd_.reg) std::memcpy(rd_.dst + rd_.done, slot, n);
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

inline void connection::end_read() noexcept {
  rd_.reg.end();
  rd_ = pending_read{};
}

/// GPU memory the NIC has just written (at `addr`): READ one byte of it
/// through the loopback queue pair (`gdr/transport/verbs/flush.hpp`); the
/// placement completes when the READ does. Parsing waits meanwhile.
inline void connection::start_flush(const std::byte* addr) noexcept {
  if (failed() || shut_) return;
  fl_.active = true;
  fl_.addr = addr;
  auto l = dq_->device_mrs->acquire(addr, 1);  // found cached: the transfer's own registration
  if (!l) {
    fl_ = pending_flush{};
    gpudirect_fail("cannot register Device memory for its flush");
    return;
  }
  fl_.reg = gdr::verbs::registration_hold(std::move(*l), *dq_->device_mrs, addr, 1, vopts_.cache_registrations);
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
  wr.wr.rdma.rkey = fl_.reg.handle()->rkey;
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

inline void connection::end_flush() noexcept {
  fl_.reg.end();
  fl_ = pending_flush{};
}

inline void connection::on_flush(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
  connection* c = static_cast<flush_node*>(w)->c;
  c->enter();
  c->flush_done(wc);
  c->on_io_done();
  c->leave();  // may free c
}

inline void connection::flush_done(const ibv_wc& wc) noexcept {
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

}  // namespace gdr::detail::verbs
