// What it costs to give a peer a key that covers exactly the granted bytes
// for exactly the grant's life, against the cached registration the verbs
// transport hands out today (issue 15, defect 12). Raw verbs, no gdr: two
// RC queue pairs of one device connected to each other; "the peer" (QP B)
// RDMA WRITEs `size` bytes into "this side's" buffer (QP A's), once per
// grant, with each kind of key:
//
//   mr       the buffer's registration, made once and reused (what a
//            cached registration gives: its key outlives the grant and
//            covers its whole, page-widened, registered range);
//   mw       a type 2 memory window bound to exactly the granted bytes
//            before the grant (IBV_WR_BIND_MW on QP A) and invalidated
//            after it (IBV_WR_LOCAL_INV); the registration under it is made
//            once, with no remote access of its own;
//   exact    a registration of exactly the granted bytes, made before the
//            grant and dropped after it (ibv_reg_mr, ibv_dereg_mr).
//
// Each line: kind, size, median and 90th percentile microseconds per grant
// (key made, WRITE done, key gone). Then what the device says about memory
// windows and three checks that the window's key is as narrow as promised
// (a WRITE a byte before the window, a WRITE with the key of an
// invalidated window, a WRITE with the key of the registration under it:
// each must fail with a remote access error).
//
//   key_scope_bench DEVICE GID_INDEX [ITERATIONS]     # in the Soft-RoCE guest:
//   key_scope_bench rxe0 $RXEVM_GID_INDEX 200
#include <infiniband/verbs.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

struct ctx {
  ibv_context* dev = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq_a = nullptr;
  ibv_cq* cq_b = nullptr;
  ibv_qp* a = nullptr;
  ibv_qp* b = nullptr;
  int gid_index = 0;
};

ibv_qp* make_qp(ctx& c, ibv_cq* cq) {
  ibv_qp_init_attr qa{};
  qa.send_cq = cq;
  qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = 64;
  qa.cap.max_recv_wr = 4;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  ibv_qp* q = ibv_create_qp(c.pd, &qa);
  if (q == nullptr) die("ibv_create_qp");
  return q;
}

void connect_qp(ctx& c, ibv_qp* q, std::uint32_t dest) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) die("INIT");
  ibv_gid gid{};
  if (ibv_query_gid(c.dev, 1, c.gid_index, &gid)) die("ibv_query_gid");
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dest;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = gid;
  a.ah_attr.grh.sgid_index = static_cast<std::uint8_t>(c.gid_index);
  a.ah_attr.grh.hop_limit = 1;
  a.ah_attr.port_num = 1;
  if (ibv_modify_qp(q, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    die("RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  if (ibv_modify_qp(q, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC))
    die("RTS");
}

void make_pair(ctx& c) {
  if (c.a) ibv_destroy_qp(c.a);
  if (c.b) ibv_destroy_qp(c.b);
  c.a = make_qp(c, c.cq_a);
  c.b = make_qp(c, c.cq_b);
  connect_qp(c, c.a, c.b->qp_num);
  connect_qp(c, c.b, c.a->qp_num);
}

/// Waits for one completion on `cq` (10 s at most: then IBV_WC_GENERAL_ERR,
/// saying so); returns its status.
ibv_wc_status wait(ibv_cq* cq) {
  ibv_wc wc{};
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    int n = ibv_poll_cq(cq, 1, &wc);
    if (n < 0) die("ibv_poll_cq");
    if (n == 1) return wc.status;
    if (std::chrono::steady_clock::now() > until) {
      std::printf("(no completion in 10 s)\n");
      return IBV_WC_GENERAL_ERR;
    }
  }
}

ibv_wc_status post_wait(ibv_qp* q, ibv_cq* cq, ibv_send_wr& wr) {
  wr.send_flags |= IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(q, &wr, &bad)) {
    errno = rc;
    die("ibv_post_send");
  }
  return wait(cq);
}

/// QP B writes `len` bytes from `src` (key `lkey`) to `raddr` (key `rkey`).
ibv_wc_status peer_write(ctx& c, const void* src, std::uint32_t lkey, std::uint64_t raddr, std::uint32_t rkey,
                         std::size_t len) {
  ibv_sge sge{reinterpret_cast<std::uintptr_t>(src), static_cast<std::uint32_t>(len), lkey};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return post_wait(c.b, c.cq_b, wr);
}

ibv_wc_status bind(ctx& c, ibv_mw* mw, ibv_mr* mr, const void* addr, std::size_t len, std::uint32_t& rkey) {
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_BIND_MW;
  wr.bind_mw.mw = mw;
  wr.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
  wr.bind_mw.bind_info.mr = mr;
  wr.bind_mw.bind_info.addr = reinterpret_cast<std::uintptr_t>(addr);
  wr.bind_mw.bind_info.length = len;
  wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
  ibv_wc_status s = post_wait(c.a, c.cq_a, wr);
  if (s == IBV_WC_SUCCESS) rkey = mw->rkey = wr.bind_mw.rkey;
  return s;
}

ibv_wc_status invalidate(ctx& c, std::uint32_t rkey) {
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_LOCAL_INV;
  wr.invalidate_rkey = rkey;
  return post_wait(c.a, c.cq_a, wr);
}

struct stat {
  double median, p90;
};
stat summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[std::min(v.size() - 1, v.size() * 9 / 10)]};
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int failed_checks = 0;
void check(bool ok, const char* what) {
  std::printf("check %-58s %s\n", what, ok ? "ok" : "FAILED");
  if (!ok) ++failed_checks;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s DEVICE GID_INDEX [ITERATIONS]\n", argv[0]);
    return 2;
  }
  const int iters = argc > 3 ? std::atoi(argv[3]) : 200;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  ctx c;
  c.gid_index = std::atoi(argv[2]);
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  for (int i = 0; i < n && c.dev == nullptr; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), argv[1]) == 0) c.dev = ibv_open_device(list[i]);
  if (c.dev == nullptr) die("no such device");
  ibv_device_attr attr{};
  if (ibv_query_device(c.dev, &attr)) die("ibv_query_device");
  const bool mw = (attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW) != 0;
  const bool mw2b = (attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0;
  const bool mw2a = (attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2A) != 0;
  std::printf("device %s: memory windows %d, type 2A %d, type 2B %d, max_mw %d\n", argv[1], mw, mw2a, mw2b,
              attr.max_mw);
  if ((c.pd = ibv_alloc_pd(c.dev)) == nullptr) die("ibv_alloc_pd");
  if ((c.cq_a = ibv_create_cq(c.dev, 256, nullptr, nullptr, 0)) == nullptr) die("ibv_create_cq");
  if ((c.cq_b = ibv_create_cq(c.dev, 256, nullptr, nullptr, 0)) == nullptr) die("ibv_create_cq");
  make_pair(c);

  const std::size_t max = std::size_t{16} << 20;
  auto* dst = static_cast<std::byte*>(std::aligned_alloc(4096, max));
  auto* src = static_cast<std::byte*>(std::aligned_alloc(4096, max));
  std::memset(dst, 0, max);
  std::memset(src, 0x5a, max);
  ibv_mr* src_mr = ibv_reg_mr(c.pd, src, max, 0);
  ibv_mr* remote_mr = ibv_reg_mr(c.pd, dst, max, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  // Under windows: no remote access of its own, only binding.
  ibv_mr* bind_mr = ibv_reg_mr(c.pd, dst, max, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  if (src_mr == nullptr || remote_mr == nullptr) die("ibv_reg_mr");
  ibv_mw* win = (mw && bind_mr != nullptr) ? ibv_alloc_mw(c.pd, IBV_MW_TYPE_2) : nullptr;
  std::printf("window: MW_BIND registration %s, type 2 window %s\n", bind_mr ? "made" : "refused",
              win ? "allocated" : "not allocated");

  std::printf("%-6s %10s %10s %10s\n", "kind", "bytes", "median_us", "p90_us");
  for (std::size_t size : {std::size_t{4096}, std::size_t{65536}, std::size_t{1} << 20, max}) {
    const int reps = size >= max ? std::max(iters / 10, 5) : iters;
    std::vector<double> t_mr, t_mw, t_exact, t_bind, t_inv, t_reg, t_dereg;
    for (int r = 0; r < reps; ++r) {
      double t0 = now_us();
      if (peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst), remote_mr->rkey, size))
        die("write (mr)");
      t_mr.push_back(now_us() - t0);

      if (win != nullptr) {
        std::uint32_t rkey = 0;
        t0 = now_us();
        if (bind(c, win, bind_mr, dst, size, rkey)) die("bind");
        double t1 = now_us();
        if (peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst), rkey, size)) die("write (mw)");
        double t2 = now_us();
        if (invalidate(c, rkey)) die("invalidate");
        double t3 = now_us();
        t_mw.push_back(t3 - t0);
        t_bind.push_back(t1 - t0);
        t_inv.push_back(t3 - t2);
      }

      t0 = now_us();
      ibv_mr* m = ibv_reg_mr(c.pd, dst, size, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
      if (m == nullptr) die("ibv_reg_mr (exact)");
      double t1 = now_us();
      if (peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst), m->rkey, size)) die("write (exact)");
      double t2 = now_us();
      ibv_dereg_mr(m);
      double t3 = now_us();
      t_exact.push_back(t3 - t0);
      t_reg.push_back(t1 - t0);
      t_dereg.push_back(t3 - t2);
    }
    auto line = [&](const char* kind, const std::vector<double>& v) {
      if (v.empty()) return;
      stat s = summarize(v);
      std::printf("%-6s %10zu %10.1f %10.1f\n", kind, size, s.median, s.p90);
    };
    line("mr", t_mr);
    line("mw", t_mw);
    line("exact", t_exact);
    line(" bind", t_bind);
    line(" inv", t_inv);
    line(" reg", t_reg);
    line(" dereg", t_dereg);
  }

  // An exact registration's key, for comparison: its bounds are the
  // registration's own.
  make_pair(c);
  ibv_mr* m = ibv_reg_mr(c.pd, dst + 4096 + 100, 1000, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (m == nullptr) die("ibv_reg_mr (exact)");
  check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst + 4096 + 100), m->rkey, 1000) ==
            IBV_WC_SUCCESS,
        "a WRITE inside an exact registration succeeds");
  check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst + 4096 + 99), m->rkey, 1) ==
            IBV_WC_REM_ACCESS_ERR,
        "a WRITE one byte before an exact registration is refused");
  make_pair(c);
  check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst + 4096 + 1100), m->rkey, 1) ==
            IBV_WC_REM_ACCESS_ERR,
        "a WRITE one byte after an exact registration is refused");
  make_pair(c);
  std::uint32_t old = m->rkey;
  ibv_dereg_mr(m);
  check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst + 4096 + 100), old, 1) ==
            IBV_WC_REM_ACCESS_ERR,
        "a WRITE with a dropped registration's key is refused");
  if (win != nullptr) {
    const std::size_t len = 8192;
    std::uint32_t rkey = 0;
    // A refusal puts both queue pairs in the error state: each check gets
    // fresh ones, and a fresh window (a type 2 window stays bound to the
    // queue pair it was bound on).
    auto fresh = [&]() -> bool {
      make_pair(c);
      ibv_dealloc_mw(win);
      win = ibv_alloc_mw(c.pd, IBV_MW_TYPE_2);
      if (win == nullptr) die("ibv_alloc_mw");
      return bind(c, win, bind_mr, dst + 4096, len, rkey) == IBV_WC_SUCCESS;
    };
    if (!fresh()) die("bind");
    check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst + 4096), rkey, len) ==
              IBV_WC_SUCCESS,
          "a WRITE inside the window succeeds");
    check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst + 4095), rkey, 1) ==
              IBV_WC_REM_ACCESS_ERR,
          "a WRITE one byte before the window is refused");
    check(fresh(), "a fresh window binds on new queue pairs");
    check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst + 4096 + len), rkey, 1) ==
              IBV_WC_REM_ACCESS_ERR,
          "a WRITE one byte after the window is refused");
    check(fresh() && invalidate(c, rkey) == IBV_WC_SUCCESS, "a fresh window binds and is invalidated");
    check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst + 4096), rkey, 1) ==
              IBV_WC_REM_ACCESS_ERR,
          "a WRITE with an invalidated window's key is refused");
    check(fresh(), "a fresh window binds on new queue pairs");
    check(peer_write(c, src, src_mr->lkey, reinterpret_cast<std::uintptr_t>(dst), bind_mr->rkey, 1) ==
              IBV_WC_REM_ACCESS_ERR,
          "a WRITE with the key of the registration under it is refused");
  }
  return failed_checks == 0 ? 0 : 1;
}
