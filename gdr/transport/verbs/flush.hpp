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
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>

#include <gdr/error.hpp>
#include <gdr/transport/verbs/memory.hpp>

namespace gdr::verbs {

/// A queue pair connected to itself, and the scratch its READs land in.
struct flush_qp {
  ibv_qp* qp = nullptr;
  std::unique_ptr<std::uint64_t> scratch;
  owned_mr mr;  ///< of `scratch`

  flush_qp() = default;
  flush_qp(const flush_qp&) = delete;
  flush_qp& operator=(const flush_qp&) = delete;
  ~flush_qp() {
    mr.reset();
    if (qp != nullptr) ibv_destroy_qp(qp);
  }

  /// Work requests in flight at most (one per connection flushing).
  static constexpr std::uint32_t depth = 64;
};

/// Makes the loopback queue pair on `pd` and `cq`, on the port and GID
/// that rdma_cm chose for the connected `id` (so that it runs where the
/// connection's writes came in). Errors: the verbs call's errno.
inline result<std::unique_ptr<flush_qp>> make_flush_qp(ibv_pd* pd, ibv_cq* cq, rdma_cm_id* id) noexcept {
  auto f = std::unique_ptr<flush_qp>(new (std::nothrow) flush_qp);
  if (!f) return errno_code(ENOMEM);
  f->scratch.reset(new (std::nothrow) std::uint64_t(0));
  if (!f->scratch) return errno_code(ENOMEM);
  auto mr = owned_mr::make(pd, f->scratch.get(), sizeof(std::uint64_t), IBV_ACCESS_LOCAL_WRITE);
  if (!mr) return mr.error();
  f->mr = std::move(*mr);
  ibv_qp_init_attr qa{};
  qa.send_cq = cq;
  qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = flush_qp::depth;
  qa.cap.max_recv_wr = 1;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  errno = 0;
  f->qp = ibv_create_qp(pd, &qa);
  if (f->qp == nullptr) return errno_code(errno != 0 ? errno : ENOMEM);
  // INIT: the responder half accepts READs (of GPU memory registered with
  // remote read access).
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = id->port_num;
  a.qp_access_flags = IBV_ACCESS_REMOTE_READ;
  if (int rc = ibv_modify_qp(f->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    return errno_code(rc);
  // RTR: the connection's address vector (its source GID index, MTU), with
  // this queue pair's own GID and number as the destination.
  a = {};
  int mask = 0;
  a.qp_state = IBV_QPS_RTR;
  if (rdma_init_qp_attr(id, &a, &mask) != 0) return errno_code(errno != 0 ? errno : EINVAL);
  ibv_gid own{};
  if (int rc = ibv_query_gid(id->verbs, id->port_num, a.ah_attr.grh.sgid_index, &own)) return errno_code(rc);
  a.ah_attr.grh.dgid = own;
  a.ah_attr.port_num = id->port_num;
  a.dest_qp_num = f->qp->qp_num;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  if (int rc = ibv_modify_qp(f->qp, &a,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                 IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return errno_code(rc);
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  if (int rc = ibv_modify_qp(f->qp, &a,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                 IBV_QP_MAX_QP_RD_ATOMIC))
    return errno_code(rc);
  return f;
}

}  // namespace gdr::verbs
