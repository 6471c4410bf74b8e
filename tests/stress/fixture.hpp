// The transports the stress test runs over. A fixture makes a connected
// pair of endpoints on one scheduler with each side's options from the
// plan; run.hpp is written against this shape only, so a transport joins
// the test by adding a fixture here and a name to `transport_kind`.
//
// Built with STRESS_VERBS=1 (in the Soft-RoCE guest, as tests/verbs builds
// the conformance suite with CONFORMANCE_VERBS=1), the verbs fixture is
// compiled in too; it needs an RDMA device and says why it cannot run
// (`skip_reason()`) where there is none.
#pragma once

#include <string>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/shm.hpp>
#include <gdr/transport/tcp.hpp>

#include "tests/stress/plan.hpp"

#ifndef STRESS_VERBS
#define STRESS_VERBS 0
#endif
#if STRESS_VERBS
#include "tests/verbs/verbs_fixture.hpp"
#endif

namespace stress {

/// The TCP options of side `s` of plan `p`.
inline gdr::tcp::endpoint_options tcp_options(const plan& p, int s) {
  const side_plan& sp = p.side[s];
  gdr::tcp::endpoint_options o;
  o.protocol = sp.opts;
  o.rx_buffer = sp.rx_buffer;
  o.direct_read_threshold = sp.direct_read_threshold;
  o.spin_reads_in_busy_poll = sp.spin_reads;
  o.direct_writes_in_busy_poll = sp.direct_writes;
  if (p.transport == transport_kind::tcp_tight) {
    // Socket buffers of a few KiB (the kernel doubles what is asked), from
    // what the plan draws already, so that each seed draws the plan it draws
    // for "tcp": writes, the send's own fast write included, come back short.
    const int b = sp.rx_buffer <= 4096 ? 4608 : sp.rx_buffer <= 16384 ? 8192 : 16384;
    o.socket.send_buffer = b;
    o.socket.receive_buffer = b;
  }
  return o;
}

/// The shared-memory options of side `s` of plan `p`, drawn from what the
/// plan draws for TCP (so that existing seeds draw the same plans): rings
/// of 64 KiB to 1 MiB (16 times the staging buffer), small enough that
/// large messages wrap and wait for room; payloads from 4 or 16 KiB copied
/// by the peer straight from this process's memory, or none (a third of
/// the runs).
inline gdr::shm::endpoint_options shm_options(const plan& p, int s) {
  gdr::shm::endpoint_options o;
  o.protocol = p.side[s].opts;
  o.ring_bytes = 16 * p.side[s].rx_buffer;
  o.single_copy_threshold = p.side[s].direct_read_threshold < 4096 ? 0 : p.side[s].direct_read_threshold;
  return o;
}

/// Loopback: both ends on one scheduler, one option set (side 0's: the plan
/// gives both sides the same).
struct loopback_fixture {
  using endpoint = gdr::loopback::endpoint;
  static constexpr transport_kind kind = transport_kind::loopback;
  static std::string skip_reason() { return {}; }
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg, const plan& p) {
    co_return gdr::loopback::make_pair(s, s, reg, p.side[0].opts);
  }
};

/// TCP over 127.0.0.1: side 0 connects, side 1 is accepted.
struct tcp_fixture {
  using endpoint = gdr::tcp::endpoint;
  static constexpr transport_kind kind = transport_kind::tcp;
  static std::string skip_reason() { return {}; }
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg, const plan& p) {
    gdr::tcp::endpoint_options oa = tcp_options(p, 0), ob = tcp_options(p, 1);
    gdr::tcp::listener l(s, gdr::tcp::address::loopback(0), reg, ob);
    auto acc = l.accept();
    endpoint x = co_await gdr::tcp::connect(s, l.local_address(), {}, reg, oa);
    endpoint y = co_await std::move(acc);
    co_return std::pair<endpoint, endpoint>(std::move(x), std::move(y));
  }
};

/// TCP with socket buffers of a few KiB (`tcp_options`): short writes, a
/// window that closes often.
struct tcp_tight_fixture : tcp_fixture {
  static constexpr transport_kind kind = transport_kind::tcp_tight;
};

/// Shared memory: both ends on one scheduler in one process (side 0
/// connects, side 1 is accepted).
struct shm_fixture {
  using endpoint = gdr::shm::endpoint;
  static constexpr transport_kind kind = transport_kind::shm;
  static std::string skip_reason() { return {}; }
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg, const plan& p) {
    gdr::shm::listener l(s, {}, reg, shm_options(p, 1));
    auto [x, y] = co_await gdr::when_all(gdr::shm::connect(s, l.name(), reg, shm_options(p, 0)), l.accept());
    co_return std::pair<endpoint, endpoint>(std::move(x), std::move(y));
  }
};

/// Shared memory with Device memory by CUDA IPC: the copy engine's stand-in
/// (guarded_copy_engine with `ipc` on) copies out of the peer's Device
/// views, which only it may touch.
struct shm_ipc_fixture {
  using endpoint = gdr::shm::endpoint;
  static constexpr transport_kind kind = transport_kind::shm_ipc;
  static std::string skip_reason() { return {}; }
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg, const plan& p) {
    gdr::shm::endpoint_options oa = shm_options(p, 0), ob = shm_options(p, 1);
    oa.device = ob.device = gdr::shm::device_path::cuda_ipc;
    gdr::shm::listener l(s, {}, reg, ob);
    auto [x, y] = co_await gdr::when_all(gdr::shm::connect(s, l.name(), reg, oa), l.accept());
    co_return std::pair<endpoint, endpoint>(std::move(x), std::move(y));
  }
};

#if STRESS_VERBS
/// Verbs over the RDMA device at GDR_VERBS_IP (tests/verbs/verbs_fixture.hpp).
struct verbs_fixture {
  using endpoint = gdr::verbs::endpoint;
  static constexpr transport_kind kind = transport_kind::verbs;
  static std::string skip_reason() { return conformance::verbs_skip_reason(); }
  /// librdmacm opens every device's context on first use and keeps it for
  /// the process: opened here, before the run counts descriptors.
  static void prepare() {
    int n = 0;
    if (ibv_context** all = rdma_get_devices(&n)) rdma_free_devices(all);
  }
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg, const plan& p) {
    gdr::verbs::endpoint_options ea, eb;
    ea.protocol = p.side[0].opts;
    eb.protocol = p.side[1].opts;
    co_return co_await conformance::verbs_pair(s, reg, ea, eb);
  }
};
#endif

}  // namespace stress
