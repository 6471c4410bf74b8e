/// \file
/// The one-sided lane of a verbs connection (members of `connection`,
/// declared in `connection.hpp`): puts, gets, atomics, batches, notifying
/// puts and flushes that this side's NIC posts straight into the peer's
/// exposed memory, with no action by the peer's CPU.
///
/// Queue pairs. Besides the message channel (the rdma_cm queue pair), each
/// side makes two RC queue pairs on the same device and completion queue:
/// `lane_init_` (this side's direct operations) and `lane_target_` (the
/// peer's land here; it holds the receives that notifying puts consume).
/// Their numbers and the side's NIC domain travel in the connection
/// parameters; each initiator queue pair is connected to the peer's target
/// queue pair once the connection is made (`lane_connect`, with rdma_cm's
/// address vector), PSNs from 0. A view whose NIC key belongs to the peer's
/// domain goes this way (`engine::set_direct_domain`); any other is served
/// by the peer's loop over the message channel, as on every transport.
///
/// Work. Each operation takes a job (`lane_job`, one of `one_sided_depth`;
/// an operation with none free waits in `lane_wait_`, in order) and becomes
/// pieces, one work request each: one piece (split at 1 GiB), or one per
/// block of a batch, posted as chains of up to 16 of which only the last is
/// signalled (a batch of 512 blocks asks for 32 completions, its operation
/// has one). Every work request names its job; RC completes them in order,
/// so a signalled one's completion accounts for the silent ones before it,
/// and the successful pieces of a job are always a prefix. Local memory: a small
/// put goes inline, a small get or an atomic lands in the job's registered
/// scratch and is copied out; larger memory uses the registration of the
/// registry's own exposure in this domain if one covers it, else the
/// device's registration cache (held until the job ends). A flush is one
/// zero-length WRITE: RC completes work requests in order, so its
/// completion says that every operation before it has been acknowledged by
/// the peer's NIC.
///
/// Flushing the peer's GPU memory. A NIC's writes into GPU memory may not be
/// visible to the GPU when the NIC acknowledges them (on GPUs whose
/// GPUDirect write ordering needs a flush; the owner's CPU, which would
/// flush its own receives, is not involved here). A READ by the same NIC
/// from that GPU memory is ordered after its writes on PCIe: when it
/// returns, they have landed. So a put into the peer's GPU memory marks it
/// unflushed (`lane_gpu_dirty_`, its first 8 bytes); a flush after it is a
/// READ of those bytes instead of a zero-length WRITE; and a notifying put
/// into GPU memory posts its WRITEs, a READ of what it wrote, then its
/// notification alone, fenced behind the READ, so that the owner hears of
/// it only once its GPU can see the bytes. Every GPU is treated so: the
/// READ is one more round trip, on the flush or the notification only.
/// (A flush reads from the last GPU region written: puts into GPU memory
/// on several of the peer's GPUs need a flush after each GPU's.)
///
/// Faults. A remote access error (a revoked, forged or wrong key, a range
/// the key does not cover, rights it does not grant) puts both queue pairs
/// of the lane in the error state; every later work request comes back
/// flushed. It is contained to the lane: the faulty operation fails with
/// `errc::remote_access`; the others keep their place. Once every work
/// request is back (after an error every work request completes, signalled
/// or not, and a marker posted after them says when the last has:
/// `lane_mark`), the initiator resets its queue pair (RESET, INIT) and
/// tells the peer over the message channel (`wire_header::lane`,
/// `lane_reset` with a generation); the peer resets its target queue pair
/// (RESET to RTS, receives posted again) and answers `lane_ready`; the
/// initiator connects again and posts every flushed piece again, in order.
/// A flushed piece was not executed by the peer's NIC (RC stops at the
/// faulty request), so nothing runs twice. The message channel and the
/// operations on it never notice. The lane's states are `lane_phase`, and
/// `lane_to` is the one place that moves between them.
///
/// Failure of the connection moves the lane's queue pairs to the error
/// state too: what is posted comes back flushed and fails with the
/// connection's error; what waits fails at once.
#pragma once

#include <gdr/transport/verbs/connection.hpp>

namespace gdr::detail::verbs {

inline void connection::lane_to(lane_phase p) noexcept {
  assert(lane_may_move(lane_phase_, p) && "gdr verbs: the one-sided lane moved where it may not");
  lane_phase_ = p;
}

// ---------------------------------------------------------------- set-up

inline ibv_qp* connection::lane_make_qp(std::uint32_t send_wrs, std::uint32_t recv_wrs) noexcept {
  ibv_qp_init_attr qa{};
  qa.send_cq = dq_->cq;
  qa.recv_cq = dq_->cq;
  qa.qp_type = IBV_QPT_RC;
  qa.sq_sig_all = 0;
  qa.cap.max_send_wr = std::max(send_wrs, 1u);
  qa.cap.max_recv_wr = std::max(recv_wrs, 1u);
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.cap.max_inline_data = vopts_.max_inline;
  ibv_qp* qp = ibv_create_qp(dq_->pd, &qa);
  if (qp == nullptr) {
    qa.cap.max_inline_data = 0;
    qp = ibv_create_qp(dq_->pd, &qa);
  }
  if (qp != nullptr && send_wrs != 0) lane_inline_ = qa.cap.max_inline_data;
  return qp;
}

inline void connection::lane_setup() {
  if (!vopts_.one_sided) return;
  lane_sink_.c = this;
  lane_depth_ = std::max(vopts_.one_sided_depth, 1u);
  lane_sq_ = std::max(vopts_.one_sided_wrs, 8u);
  lane_rx_n_ = std::max(vopts_.notify_depth, 1u);
  lane_jobs_.reset(new lane_job[lane_depth_]);
  for (std::uint32_t i = lane_depth_; i-- > 0;) {
    lane_job& j = lane_jobs_[i];
    j.c = this;
    j.complete = &on_lane_wc;
    j.ends.resize(static_cast<std::size_t>(lane_sq_));
    j.next_free = lane_free_;
    lane_free_ = &j;
  }
  auto mr = gdr::verbs::owned_mr::make(dq_->pd, lane_jobs_.get(), sizeof(lane_job) * lane_depth_,
                                       IBV_ACCESS_LOCAL_WRITE);
  if (!mr) throw gdr::error(mr.error(), "gdr::verbs: ibv_reg_mr (one-sided scratch)");
  lane_mr_ = std::move(*mr);
  lane_marker_.c = this;
  lane_marker_.complete = &on_lane_marker;
  lane_rx_.reset(new lane_rx[lane_rx_n_]);
  for (std::uint32_t i = 0; i < lane_rx_n_; ++i) {
    lane_rx_[i].c = this;
    lane_rx_[i].complete = &on_lane_rx;
  }
  lane_init_ = lane_make_qp(lane_sq_, 1);
  if (lane_init_ == nullptr) throw gdr::error(errno_code(errno), "gdr::verbs: ibv_create_qp (one-sided lane)");
  poller_->watch_qp(dq_, lane_init_, &lane_sink_);
  lane_target_ = lane_make_qp(0, lane_rx_n_);
  if (lane_target_ == nullptr) throw gdr::error(errno_code(errno), "gdr::verbs: ibv_create_qp (one-sided lane)");
  poller_->watch_qp(dq_, lane_target_, &lane_sink_);
  if (gpudirect_ != nullptr) dq_->domain->set_device_route(gdr::verbs::route_of(*gpudirect_));
  dq_->domain->attach(*lane_registry_);
}

inline void connection::lane_teardown() noexcept {
  assert(lane_out_ == 0);
  if (lane_rx_out_ != 0 && dq_ != nullptr) {
    // Receives not yet flushed back (Soft-RoCE on Linux 6.1 may never flush
    // the receive queue of a queue pair in the error state). They hold no
    // memory; their work objects stay with the device's queue, which
    // outlives every completion of it, and ignore what comes.
    for (std::uint32_t i = 0; i < lane_rx_n_; ++i) lane_rx_[i].c = nullptr;
    try {
      dq_->orphans.push_back(std::shared_ptr<void>(lane_rx_.release(), [](void* p) {
        delete[] static_cast<lane_rx*>(p);
      }));
    } catch (...) {
      (void)lane_rx_.release();  // leaked rather than freed under the NIC
    }
    lane_rx_out_ = 0;
  }
  for (ibv_qp** qp : {&lane_init_, &lane_target_}) {
    if (*qp == nullptr) continue;
    if (dq_ != nullptr) poller_->unwatch_qp(dq_, *qp);
    ibv_destroy_qp(*qp);
    *qp = nullptr;
  }
  for (std::uint32_t i = 0; lane_jobs_ && i < lane_depth_; ++i) lane_jobs_[i].hold.end();
  lane_mr_.reset();
}

/// Moves `qp` from RESET to RTS, connected to the peer's `dest` (its target
/// queue pair for this side's initiator, its initiator for this side's
/// target), on the connection's address vector; PSNs start at 0.
inline std::error_code connection::lane_connect(ibv_qp* qp, std::uint32_t dest, bool target) noexcept {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = id_->port_num;
  a.qp_access_flags = target ? IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC : 0;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    return errno_code(rc);
  a = {};
  int mask = 0;
  a.qp_state = IBV_QPS_RTR;
  if (rdma_init_qp_attr(id_, &a, &mask) != 0) return errno_code(errno);
  a.dest_qp_num = dest;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = lane_rd_atomic_;
  a.min_rnr_timer = 1;  // 0.01 ms: a notification's receive is posted again at once
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                 IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return errno_code(rc);
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = vopts_.ack_timeout;
  a.retry_cnt = std::min<std::uint8_t>(vopts_.retry_count, 7);
  a.rnr_retry = 7;  // a peer that reads its notifications late holds the lane, it does not break it
  a.sq_psn = 0;
  a.max_rd_atomic = lane_rd_atomic_;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                 IBV_QP_MAX_QP_RD_ATOMIC))
    return errno_code(rc);
  return {};
}

inline std::error_code connection::lane_reset_qp(ibv_qp* qp) noexcept {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RESET;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE)) return errno_code(rc);
  return {};
}

inline std::error_code connection::lane_post_receives() noexcept {
  for (std::uint32_t i = 0; i < lane_rx_n_; ++i) {
    ibv_recv_wr wr{};
    wr.wr_id = lane_rx_[i].wr_id();
    wr.num_sge = 0;  // a WRITE_WITH_IMM brings only its immediate
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(lane_target_, &wr, &bad)) return errno_code(rc);
    ++lane_rx_out_;
  }
  return {};
}

/// The connection is made: connect the lane if both sides have one.
inline void connection::lane_start(const conn_params& peer) noexcept {
  if (lane_init_ == nullptr || peer.domain == 0 || peer.lane_init_qpn == 0 || peer.lane_target_qpn == 0) return;
  ibv_device_attr da{};
  lane_rd_atomic_ = 4;
  if (ibv_query_device(id_->verbs, &da) == 0)
    lane_rd_atomic_ = static_cast<std::uint8_t>(std::clamp(std::min(da.max_qp_rd_atom, da.max_qp_init_rd_atom), 1, 16));
  peer_lane_init_ = peer.lane_init_qpn;
  peer_lane_target_ = peer.lane_target_qpn;
  std::error_code ec = lane_connect(lane_target_, peer_lane_init_, true);
  if (!ec) ec = lane_post_receives();
  if (!ec) ec = lane_connect(lane_init_, peer_lane_target_, false);
  if (ec) {
    // The message channel works without it: every put and get is served.
    gdr::detail::log("verbs", "the one-sided lane could not be connected (%s): puts and gets are served by the peer",
                     ec.message().c_str());
    lane_to(lane_phase::shut);
    return;
  }
  lane_to(lane_phase::ready);
  set_direct_domain(peer.domain);
}

// ---------------------------------------------------------------- the engine's hooks

inline void connection::link_direct(proto::op& o) noexcept {
  o.direct_next = nullptr;
  if (lane_phase_ == lane_phase::shut || failed() || shut_) {
    on_direct_done(o, failed() ? error() : std::error_code(errc::connection_lost));
    return;
  }
  if (lane_wait_head_ == nullptr && lane_post_alone(o)) return;
  (lane_wait_tail_ != nullptr ? lane_wait_tail_->direct_next : lane_wait_head_) = &o;
  lane_wait_tail_ = &o;
  lane_pump();
}

inline bool connection::link_direct_withdraw(proto::op& o) noexcept {
  proto::op* prev = nullptr;
  for (proto::op* x = lane_wait_head_; x != nullptr; prev = x, x = x->direct_next) {
    if (x != &o) continue;
    (prev != nullptr ? prev->direct_next : lane_wait_head_) = o.direct_next;
    if (lane_wait_tail_ == &o) lane_wait_tail_ = prev;
    o.direct_next = nullptr;
    return true;
  }
  // A job none of whose pieces the NIC has seen.
  for (lane_job* j = lane_active_.head; j != nullptr; j = j->next) {
    if (j->o != &o) continue;
    if (j->posted != 0 || j->out != 0) return false;
    lane_active_.erase(j);
    lane_free_job(*j);
    return true;
  }
  return false;
}

// ---------------------------------------------------------------- posting

/// Piece `i` of job `j`: local offset, remote offset, bytes.
inline lane_piece connection::lane_piece_of(const lane_job& j, std::size_t i) noexcept {
  const proto::op& o = *j.o;
  if (const block* b = o.batch(); b != nullptr) return {b[i].local, b[i].remote, b[i].bytes};
  const std::size_t off = i * lane_piece_max;
  return {off, off, std::min(lane_piece_max, o.local_size() - off)};
}

/// Gives waiting operations jobs, and posts pieces while the send queue
/// has room, in order.
inline void connection::lane_pump() noexcept {
  if (lane_phase_ != lane_phase::ready) return;
  while (lane_wait_head_ != nullptr && lane_free_ != nullptr) {
    proto::op* o = lane_wait_head_;
    lane_wait_head_ = o->direct_next;
    if (lane_wait_head_ == nullptr) lane_wait_tail_ = nullptr;
    o->direct_next = nullptr;
    lane_job* j = &lane_take(*o);
    if (o->is_flush()) {
      j->pieces = 1;
    } else if (o->batch() != nullptr) {
      j->pieces = o->batch_size();
    } else {
      j->pieces = std::max<std::size_t>(1, (o->local_size() + lane_piece_max - 1) / lane_piece_max);
    }
    j->data_pieces = j->pieces;
    lane_plan_gpu_flush(*j);
    if (std::error_code ec = lane_local_memory(*j)) {
      lane_free_job(*j);
      on_direct_done(*o, ec);
      continue;
    }
    if (j->pieces == 0) {  // an empty batch
      lane_free_job(*j);
      on_direct_done(*o, {});
      continue;
    }
    lane_active_.push_back(j);
  }
  for (lane_job* j = lane_active_.head; j != nullptr; j = j->next) {
    if (j->posted == j->pieces || j->faulted) continue;
    if (!lane_post(*j)) return;  // the send queue is full
  }
}

/// GPUDirect write ordering (see "Flushing the peer's GPU memory" in the
/// file comment): a put into the peer's GPU memory marks it unflushed; a
/// flush then reads from it; a notifying put reads from what it wrote
/// before its notification. Planned when the job is made, in posting order.
inline void connection::lane_plan_gpu_flush(lane_job& j) noexcept {
  proto::op& o = *j.o;
  if (o.is_flush()) {
    if (lane_gpu_dirty_.bytes != 0) {
      j.flush_read = true;
      j.flush_at = std::exchange(lane_gpu_dirty_, lane_target{});
    }
    return;
  }
  if (!o.remote_device() || o.is_get() || o.atomic_code() != 0 || j.pieces == 0) return;
  const lane_piece first = lane_piece_of(j, 0);
  if (first.bytes == 0) return;
  const lane_target written{o.remote_address() + first.remote, o.nic_key(direct_domain()),
                            static_cast<std::uint32_t>(std::min<std::size_t>(first.bytes, sizeof(std::uint64_t)))};
  if (o.notifies()) {
    j.flush_read = true;
    j.flush_at = written;
    j.pieces += 2;  // the READ, then the notification alone
  } else {
    lane_gpu_dirty_ = written;
  }
}

/// A free job for `o`, every field as a new job's (`lane_free_` must not
/// be empty).
inline lane_job& connection::lane_take(proto::op& o) noexcept {
  lane_job& j = *lane_free_;
  lane_free_ = j.next_free;
  j.o = &o;
  j.posted = j.done = j.out = j.failed = j.ends_head = j.ends_used = 0;
  j.ec = {};
  j.bounce = false;
  j.inl = false;
  j.faulted = false;
  j.flush_read = false;
  j.flush_at = {};
  j.lkey = 0;
  return j;
}

/// The common case on its own: an operation that finds nothing waiting
/// before it, a free job and room in the send queue, and is one small work
/// request on host memory (an atomic, a get into the scratch, an inline
/// put; no flush, notification or batch, nothing into the peer's GPU
/// memory) is posted here, as lane_pump and lane_post would post it, without
/// their general planning. False: the general path takes it (also when the
/// post fails, so that the failure is handled there).
inline bool connection::lane_post_alone(proto::op& o) noexcept {
  if (lane_phase_ != lane_phase::ready || lane_free_ == nullptr || lane_out_ >= lane_sq_) return false;
  // A job still short of posting all its pieces goes first (RC order).
  if (lane_active_.tail != nullptr && lane_active_.tail->posted != lane_active_.tail->pieces) return false;
  const std::size_t n = o.local_size();
  if (n == 0 || o.is_flush() || o.batch() != nullptr || o.notifies() || o.local_device() >= 0) return false;
  // A put into the peer's GPU memory marks it for a flush (lane_plan_gpu_flush).
  if (!o.is_get() && o.atomic_code() == 0 && o.remote_device()) return false;
  lane_job& j = lane_take(o);
  if (!lane_small_memory(j)) {  // it needs a registration: the general path
    lane_free_job(j);
    return false;
  }
  j.pieces = j.data_pieces = 1;
  ibv_sge sge{};
  ibv_send_wr wr{};
  wr.wr_id = j.wr_id();
  wr.send_flags = IBV_SEND_SIGNALED;
  lane_data_wr(j, {0, 0, n}, o.nic_key(direct_domain()), true, wr, sge);
  ibv_send_wr* bad = nullptr;
  if (GDR_UNLIKELY(ibv_post_send(lane_init_, &wr, &bad) != 0)) {
    lane_free_job(j);
    return false;
  }
  if (lane_out_ == 0) poller_->note_busy(1);  // as lane_post
  j.posted = j.out = 1;
  j.ends[0] = 1;
  j.ends_used = 1;
  ++lane_out_;
  ++stats_.direct_wrs;
  lane_active_.push_back(&j);
  return true;
}

/// Local memory that needs no registration: an atomic's or a small get's
/// lands in the job's registered scratch, a small put's goes inline. True:
/// `j` is set up so. (GPU memory is never either: only the NIC touches it.)
inline bool connection::lane_small_memory(lane_job& j) noexcept {
  const proto::op& o = *j.o;
  const std::size_t n = o.local_size();
  const int dev = o.local_device();
  if (o.atomic_code() != 0 || (dev < 0 && o.is_get() && o.batch() == nullptr && n <= lane_small)) {
    j.bounce = true;
    j.lkey = lane_mr_.lkey();
    return true;
  }
  if (dev < 0 && !o.is_get() && o.batch() == nullptr && n <= lane_inline_) {
    j.inl = true;
    return true;
  }
  return false;
}

/// Finds the local memory's key for job `j` (see the file comment).
inline std::error_code connection::lane_local_memory(lane_job& j) noexcept {
  proto::op& o = *j.o;
  const std::size_t n = o.local_size();
  if (o.is_flush() || n == 0 || lane_small_memory(j)) return {};
  const int dev = o.local_device();
  if (dev < 0) {
    if (void* h = lane_registry_->nic_handle(o.local_data(), n, *dq_->domain); h != nullptr) {
      j.lkey = static_cast<ibv_mr*>(h)->lkey;
      return {};
    }
  }
  gdr::verbs::mr_cache& cache = cache_for(dev, o.is_get() ? recv_cache() : send_cache());
  auto h = register_user(cache, o.local_data(), n, dev);
  if (!h) return h.error();
  j.lkey = h->handle()->lkey;
  j.hold = std::move(*h);
  return {};
}

/// The work request that moves piece `p` of job `j`'s bytes (an atomic, a
/// READ, or a WRITE, with the notification if `last` and the operation
/// notifies), its local memory in `sge`. The caller has zeroed both and
/// sets wr_id, next and the signal flag.
inline void connection::lane_data_wr(const lane_job& j, const lane_piece& p, std::uint32_t rkey, bool last,
                                     ibv_send_wr& wr, ibv_sge& sge) noexcept {
  const proto::op& o = *j.o;
  if (o.atomic_code() != 0) {
    wr.opcode = o.atomic_code() == proto::atomic_fetch_add ? IBV_WR_ATOMIC_FETCH_AND_ADD : IBV_WR_ATOMIC_CMP_AND_SWP;
    wr.wr.atomic.remote_addr = o.remote_address();
    wr.wr.atomic.rkey = rkey;
    wr.wr.atomic.compare_add = o.atomic_arg(0);
    wr.wr.atomic.swap = o.atomic_arg(1);
    sge.addr = reinterpret_cast<std::uintptr_t>(j.scratch);
    sge.length = sizeof(std::uint64_t);
    sge.lkey = j.lkey;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    return;
  }
  wr.opcode = o.is_get() ? IBV_WR_RDMA_READ : (last && o.notifies() ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE);
  if (wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) wr.imm_data = o.notify_value();
  wr.wr.rdma.remote_addr = o.remote_address() + p.remote;
  wr.wr.rdma.rkey = rkey;
  if (p.bytes == 0) {
    wr.num_sge = 0;
    return;
  }
  sge.addr = j.bounce ? reinterpret_cast<std::uintptr_t>(j.scratch)
                      : reinterpret_cast<std::uintptr_t>(o.local_data() + p.local);
  sge.length = static_cast<std::uint32_t>(p.bytes);
  sge.lkey = j.lkey;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  if (j.inl) wr.send_flags |= IBV_SEND_INLINE;
}

/// Posts what fits of job `j`'s pieces. False: the send queue is full.
/// Pieces go as chains of work requests; only every `signal_every`-th, the
/// last of the job and the last of each call are signalled (the rest
/// complete silently with them, in order).
inline bool connection::lane_post(lane_job& j) noexcept {
  constexpr std::size_t chain = 16;
  proto::op& o = *j.o;
  const std::uint32_t domain = direct_domain();
  const std::uint32_t rkey = o.is_flush() ? 0 : o.nic_key(domain);
  while (j.posted < j.pieces) {
    const std::size_t room = static_cast<std::size_t>(lane_sq_ - lane_out_);
    if (room == 0) return false;
    const std::size_t n = std::min({chain, room, j.pieces - j.posted});
    ibv_send_wr wrs[chain];
    ibv_sge sges[chain];
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t i = j.posted + k;
      ibv_send_wr& wr = wrs[k];
      ibv_sge& sge = sges[k];
      wr = ibv_send_wr{};
      sge = ibv_sge{};
      wr.wr_id = j.wr_id();  // every one names its job: a flushed one comes back too
      wr.next = k + 1 < n ? &wrs[k + 1] : nullptr;
      if (k + 1 == n) wr.send_flags = IBV_SEND_SIGNALED;  // the last of the chain
      if (j.flush_read && (o.is_flush() || i == j.data_pieces)) {
        // The flush of the peer's GPU memory: its NIC reads after its writes.
        wr.opcode = IBV_WR_RDMA_READ;
        wr.wr.rdma.remote_addr = j.flush_at.addr;
        wr.wr.rdma.rkey = j.flush_at.rkey;
        sge.addr = reinterpret_cast<std::uintptr_t>(j.scratch);
        sge.length = j.flush_at.bytes;
        sge.lkey = lane_mr_.lkey();
        wr.sg_list = &sge;
        wr.num_sge = 1;
        ++stats_.gpu_flush_reads;
        continue;
      }
      if (o.is_flush()) {
        wr.opcode = IBV_WR_RDMA_WRITE;  // zero bytes: no key is checked
        wr.num_sge = 0;
        continue;
      }
      if (i > j.data_pieces) {
        // A notifying put into GPU memory: the notification alone, once
        // the READ before it is done (the fence).
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = o.notify_value();
        wr.send_flags |= IBV_SEND_FENCE;
        wr.wr.rdma.remote_addr = j.flush_at.addr;
        wr.wr.rdma.rkey = j.flush_at.rkey;
        wr.num_sge = 0;
        continue;
      }
      // (a flushed job's notification is its own piece: not the last here)
      lane_data_wr(j, lane_piece_of(j, i), rkey, i + 1 == j.pieces, wr, sge);
    }
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(lane_init_, wrs, &bad)) {
      // Nothing of the chain from `bad` on was posted; what was is counted
      // (a signalled one among it or not: the marker accounts for it).
      const std::size_t ok = static_cast<std::size_t>(bad - wrs);
      if (lane_out_ == 0 && ok != 0) poller_->note_busy(1);
      j.posted += ok;
      j.out += ok;
      lane_out_ += static_cast<int>(ok);
      stats_.direct_wrs += ok;
      gdr::detail::log("verbs", "ibv_post_send on the one-sided lane: %s", std::strerror(rc));
      if (!j.ec) j.ec = errno_code(rc);
      lane_break();
      return false;
    }
    if (lane_out_ == 0) poller_->note_busy(1);  // completions come microseconds apart: poll, do not sleep
    j.posted += n;
    j.out += n;
    std::size_t at = j.ends_head + j.ends_used;  // the ring of ends: no division per operation
    if (at >= j.ends.size()) at -= j.ends.size();
    j.ends[at] = j.posted;
    ++j.ends_used;
    lane_out_ += static_cast<int>(n);
    stats_.direct_wrs += n;
  }
  return true;
}

// ---------------------------------------------------------------- completions

inline void connection::on_lane_wc(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
  auto* j = static_cast<lane_job*>(w);
  connection* c = j->c;
  proto::event_scope ev(*c);  // its end may free c
  c->lane_done(*j, wc);
  c->on_io_done();
}

inline void connection::lane_done(lane_job& j, const ibv_wc& wc) noexcept {
  ++stats_.completions;
  ++activity_;
  if (wc.status == IBV_WC_SUCCESS) {
    // A signalled one: it and every piece of the job before it are done.
    assert(j.ends_used != 0);
    const std::size_t end = j.ends[j.ends_head];
    if (++j.ends_head == j.ends.size()) j.ends_head = 0;
    --j.ends_used;
    const std::size_t k = end - j.done;
    j.done = end;
    j.out -= k;
    lane_out_ -= static_cast<int>(k);
    if (lane_out_ == 0) poller_->note_busy(-1);
    if (j.out == 0 && j.done == j.pieces && lane_phase_ == lane_phase::ready) lane_end_job(j, j.ec);
    if (lane_phase_ == lane_phase::ready) lane_pump();
    return;
  }
  // In error, or flushed: from here on every work request of the lane
  // comes back, signalled or not, and the marker after them says when all
  // have (lane_marked).
  ++j.failed;
  if (wc.status != IBV_WC_WR_FLUSH_ERR && !j.ec) {
    if (wc.status == IBV_WC_REM_ACCESS_ERR || wc.status == IBV_WC_REM_INV_REQ_ERR ||
        wc.status == IBV_WC_LOC_PROT_ERR || wc.status == IBV_WC_REM_OP_ERR) {
      ++stats_.direct_faults;
      j.ec = errc::remote_access;  // the peer's NIC refused it (or this side's key did not cover its memory)
    } else {
      j.ec = wc_error(wc.status);
    }
    gdr::detail::log("verbs", "one-sided work request failed: %s", ibv_wc_status_str(wc.status));
  }
  lane_break();
}

/// The marker came back: every work request posted before it is back.
/// Each job's pieces that did not come back in error are done (the
/// silent ones among them completed before the fault); the faulty job
/// fails; the flushed ones are posted again after the reset, or fail if
/// the lane is shut.
inline void connection::on_lane_marker(gdr::verbs::work* w, const ibv_wc&) noexcept {
  connection* c = static_cast<lane_marker*>(w)->c;
  proto::event_scope ev(*c);
  c->lane_marked();
  c->on_io_done();
}

inline void connection::lane_marked() noexcept {
  lane_marker_.posted = false;
  if (lane_out_ != 0) poller_->note_busy(-1);
  lane_out_ = 0;
  const bool shut = lane_phase_ == lane_phase::shut;
  const std::error_code end_error = lane_error_;
  for (lane_job* j = lane_active_.head; j != nullptr;) {
    lane_job* next = j->next;
    j->done += j->out - std::min(j->failed, j->out);
    j->posted = j->done;
    j->out = j->failed = j->ends_head = j->ends_used = 0;
    if (j->ec == errc::remote_access && !shut) {
      // Refused: it fails when the lane is back. If the peer is gone by
      // then (a killed process's memory goes before its connection), it
      // fails as the connection does: that is what happened.
      j->faulted = true;
    } else if (j->ec) {
      lane_end_job(*j, j->ec);
    } else if (j->done == j->pieces) {
      lane_end_job(*j, {});
    } else if (shut) {
      lane_end_job(*j, end_error);
    }
    j = next;
  }
  if (lane_phase_ == lane_phase::broken) lane_begin_reset();
}

/// Job `j` is over: its operation completes (a small get's or an atomic's
/// bytes copied out first), the job is free, and a waiting operation may
/// take it.
inline void connection::lane_end_job(lane_job& j, std::error_code ec) noexcept {
  proto::op& o = *j.o;
  if (!ec && j.bounce && o.local_size() != 0) std::memcpy(o.local_data(), j.scratch, o.local_size());
  lane_active_.erase(&j);
  lane_free_job(j);
  on_direct_done(o, ec);
}

inline void connection::lane_free_job(lane_job& j) noexcept {
  j.hold.end();
  j.o = nullptr;
  j.next_free = lane_free_;
  lane_free_ = &j;
}

}  // namespace gdr::detail::verbs
