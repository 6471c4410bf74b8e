/// \file
/// The GPUDirect flush: a queue pair connected to itself, whose one-byte
/// RDMA READ of GPU memory makes the NIC's earlier writes into that memory
/// visible to the GPU.
///
/// Why: on a GPU whose `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`
/// is below `OWNER`, the NIC's PCIe writes into GPU memory may still be in
/// flight, or be seen out of order by the GPU's kernels, when the NIC
/// reports the transfer complete. A read that the NIC issues to the same
/// memory cannot pass those writes (PCIe ordering), so its completion says
/// they have landed: the receive, get or served put may then complete. This
/// is what NCCL does (`ncclIbIflush`); `cuFlushGPUDirectRDMAWrites` is the
/// driver's alternative. The connection to the peer cannot be used: its
/// READ would read the peer's memory. So each device of a scheduler gets
/// one loopback queue pair, made the first time an endpoint needs it, on
/// the device's completion queue; the READ lands in a registered scratch
/// word.
///
/// The queue. The queue pair takes `depth` READs at once (64); every
/// endpoint of the device with a flush to make shares it, one READ each at
/// a time. A flush that finds it full, or broken, waits in its queue of
/// waiters (`wait`), in order, and is woken when a READ comes back
/// (`returned`). A READ is counted until its completion has been taken from
/// the completion queue: a send queue's entry is free only then (NICs
/// differ in when they reuse it; this is the spec's rule).
///
/// Failure. A READ that completes in error puts the queue pair in the error
/// state (and every READ after it completes flushed): the queue is marked
/// broken, and once none of its READs is in flight the first flush that
/// wants it makes the queue pair anew (`remake`), on the port and GID of
/// its own connection. The flush that failed is tried again once
/// (`rdma_read.hpp`); a second failure fails its connection.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <cassert>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>

#include <gdr/error.hpp>
#include <gdr/transport/verbs/memory.hpp>

namespace gdr::verbs {

namespace detail {
/// `testing::limit_flush_depth`'s value (0: the default).
inline std::atomic<std::uint32_t>& flush_depth_limit() noexcept {
  static std::atomic<std::uint32_t> n{0};
  return n;
}
}  // namespace detail

namespace testing {
/// Flush queue pairs made from now on take at most `n` READs at once (0:
/// the default, 64): a test of the flush queue with a few endpoints. Never
/// for production.
inline void limit_flush_depth(std::uint32_t n) noexcept { detail::flush_depth_limit() = n; }
}  // namespace testing

/// Something waiting for room on the flush queue pair (an endpoint's
/// flush); `wake` is called once when it may try again.
struct flush_waiter {
  flush_waiter* next = nullptr;
  bool queued = false;
  void (*wake)(flush_waiter*) noexcept = nullptr;
};

/// A queue pair connected to itself, the scratch its READs land in, and
/// the queue of flushes waiting for room (see the file comment).
struct flush_qp {
  ibv_qp* qp = nullptr;
  std::unique_ptr<std::uint64_t> scratch;
  owned_mr mr;  ///< of `scratch`
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;

  /// READs in flight at most (the send queue's size).
  static constexpr std::uint32_t default_depth = 64;
  std::uint32_t depth = default_depth;
  /// READs posted whose completions have not been taken.
  std::uint32_t in_flight = 0;
  /// A READ failed: the queue pair is in the error state until remade.
  bool broken = false;
  /// Flushes waiting for room, in order.
  flush_waiter* head = nullptr;
  flush_waiter* tail = nullptr;
  /// Counters: READs posted, flushes that waited, queue pairs made anew.
  std::uint64_t posted = 0;
  std::uint64_t waits = 0;
  std::uint64_t remakes = 0;

  flush_qp() = default;
  flush_qp(const flush_qp&) = delete;
  flush_qp& operator=(const flush_qp&) = delete;
  ~flush_qp() {
    assert(head == nullptr && "gdr verbs: a flush queue pair destroyed with flushes waiting");
    mr.reset();
    if (qp != nullptr) ibv_destroy_qp(qp);
  }

  /// A READ may be posted now.
  bool room() const noexcept { return qp != nullptr && !broken && in_flight < depth; }
  /// The queue pair failed and none of its READs is in flight: make it anew.
  bool needs_remake() const noexcept { return broken && in_flight == 0; }

  /// Queues `w` until a READ comes back.
  void wait(flush_waiter& w) noexcept {
    if (w.queued) return;
    w.next = nullptr;
    w.queued = true;
    (tail != nullptr ? tail->next : head) = &w;
    tail = &w;
    ++waits;
  }
  /// Takes `w` out of the queue (its endpoint no longer flushes).
  void cancel(flush_waiter& w) noexcept {
    if (!w.queued) return;
    flush_waiter* prev = nullptr;
    for (flush_waiter* x = head; x != &w; x = x->next) prev = x;
    (prev != nullptr ? prev->next : head) = w.next;
    if (tail == &w) tail = prev;
    w.next = nullptr;
    w.queued = false;
  }
  /// Wakes the first waiter, if any (it tries again, and wakes the next one
  /// if there is room still).
  void wake_one() noexcept {
    flush_waiter* w = head;
    if (w == nullptr) return;
    head = w->next;
    if (head == nullptr) tail = nullptr;
    w->next = nullptr;
    w->queued = false;
    w->wake(w);
  }
  /// A READ's completion was taken (`error`: it failed, and the queue pair
  /// with it). Wakes a waiter if one may go now.
  void returned(bool error) noexcept {
    assert(in_flight > 0);
    --in_flight;
    if (error) broken = true;
    if (room() || needs_remake()) wake_one();
  }

  /// Makes the queue pair (again) on `pd` and `cq`, on the port and GID
  /// that rdma_cm chose for the connected `id` (so that it runs where the
  /// connection's writes came in). Errors: the verbs call's errno.
  result<void> connect(ibv_pd* p, ibv_cq* c, rdma_cm_id* id) noexcept;
};

inline result<void> flush_qp::connect(ibv_pd* p, ibv_cq* c, rdma_cm_id* id) noexcept {
  assert(in_flight == 0);
  if (qp != nullptr) {
    ibv_destroy_qp(qp);
    qp = nullptr;
    ++remakes;
  }
  pd = p;
  cq = c;
  broken = false;
  if (std::uint32_t limit = detail::flush_depth_limit(); limit != 0) depth = limit;
  ibv_qp_init_attr qa{};
  qa.send_cq = cq;
  qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = default_depth;
  qa.cap.max_recv_wr = 1;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  errno = 0;
  qp = ibv_create_qp(pd, &qa);
  if (qp == nullptr) return errno_code(errno != 0 ? errno : ENOMEM);
  auto fail = [&](int rc) -> result<void> {
    ibv_destroy_qp(qp);
    qp = nullptr;
    return errno_code(rc != 0 ? rc : EINVAL);
  };
  // INIT: the responder half accepts READs (of GPU memory registered with
  // remote read access).
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = id->port_num;
  a.qp_access_flags = IBV_ACCESS_REMOTE_READ;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    return fail(rc);
  // RTR: the connection's address vector (its source GID index, MTU), with
  // this queue pair's own GID and number as the destination.
  a = {};
  int mask = 0;
  a.qp_state = IBV_QPS_RTR;
  if (rdma_init_qp_attr(id, &a, &mask) != 0) return fail(errno);
  ibv_gid own{};
  if (int rc = ibv_query_gid(id->verbs, id->port_num, a.ah_attr.grh.sgid_index, &own)) return fail(rc);
  a.ah_attr.grh.dgid = own;
  a.ah_attr.port_num = id->port_num;
  a.dest_qp_num = qp->qp_num;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                 IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return fail(rc);
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                 IBV_QP_MAX_QP_RD_ATOMIC))
    return fail(rc);
  return {};
}

/// Makes the loopback queue pair on `pd` and `cq` (see `flush_qp::connect`).
/// Errors: the verbs call's errno.
inline result<std::unique_ptr<flush_qp>> make_flush_qp(ibv_pd* pd, ibv_cq* cq, rdma_cm_id* id) noexcept {
  auto f = std::unique_ptr<flush_qp>(new (std::nothrow) flush_qp);
  if (!f) return errno_code(ENOMEM);
  f->scratch.reset(new (std::nothrow) std::uint64_t(0));
  if (!f->scratch) return errno_code(ENOMEM);
  auto mr = owned_mr::make(pd, f->scratch.get(), sizeof(std::uint64_t), IBV_ACCESS_LOCAL_WRITE);
  if (!mr) return mr.error();
  f->mr = std::move(*mr);
  if (result<void> r = f->connect(pd, cq, id); !r) return r.error();
  return f;
}

}  // namespace gdr::verbs
