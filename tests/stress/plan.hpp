// One stress run, planned from its seed before anything runs: the protocol
// options of each side, the streams of messages (a direction and a tag:
// its sends and its receives, each with a size, a memory space, and maybe a
// stop or a timeout), each side's puts and gets, and the events that end
// the run early (a close, a dropped endpoint, a revocation; for the forked
// TCP variant, the peer's SIGKILL). The plan is pure data: the same seed
// and transport give the same plan in any process, so a forked peer derives
// its half from the seed too.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <gdr/protocol/options.hpp>

#include "tests/stress/memory.hpp"
#include "tests/stress/payload.hpp"
#include "tests/stress/rng.hpp"

namespace stress {

using namespace std::chrono_literals;

enum class transport_kind : std::uint8_t { loopback, tcp, tcp_kill, verbs, shm, shm_kill, shm_ipc, tcp_tight };
inline const char* to_string(transport_kind t) noexcept {
  switch (t) {
    case transport_kind::loopback: return "loopback";
    case transport_kind::tcp: return "tcp";
    case transport_kind::tcp_kill: return "tcp-kill";
    case transport_kind::verbs: return "verbs";
    case transport_kind::shm: return "shm";
    case transport_kind::shm_kill: return "shm-kill";
    case transport_kind::shm_ipc: return "shm-ipc";
    case transport_kind::tcp_tight: return "tcp-tight";
  }
  return "?";
}

/// When something happens: a delay after a start, or once the run has
/// completed `progress` more operations (whichever the plan says).
struct trigger {
  bool by_progress = false;
  std::uint32_t progress = 0;
  std::chrono::microseconds delay{0};
};

/// How an operation may be stopped.
struct stop_plan {
  bool pre_stopped = false;   ///< its stop source is stopped before it starts
  bool stop = false;          ///< stopped at `when` after it starts
  trigger when{};
  std::chrono::microseconds timeout{0};  ///< 0: none
  bool any() const noexcept { return pre_stopped || stop || timeout.count() != 0; }
};

struct send_plan {
  std::size_t size = 0;
  space mem = space::host;
  stop_plan stop{};
};

struct recv_plan {
  std::size_t view = 0;
  space mem = space::host;
  stop_plan stop{};
};

/// The messages of one direction and tag.
struct stream_plan {
  std::uint8_t from = 0;  ///< the sending side
  std::uint8_t tag = 0;
  std::vector<send_plan> sends;
  std::vector<recv_plan> recvs;  ///< the main phase; then unstoppable receives until the fin
  std::size_t max_size = 0;
  unsigned send_window = 1, recv_window = 1;
};

/// One put or get by a side into one of the peer's windows.
struct rma_plan {
  bool get = false;
  space local = space::host;
  space remote = space::host;  ///< which of the peer's windows (its space)
  std::size_t size = 0;
  std::size_t offset = 0;      ///< where in that window
  bool bad_key = false;        ///< a wrong key: must fail with remote_access
  stop_plan stop{};
};

/// A side's close or drop in the middle of the traffic.
struct end_event {
  enum class kind : std::uint8_t { none, close, drop, close_then_drop } what = kind::none;
  trigger when{};
  std::chrono::microseconds close_timeout{0};  ///< 0: none
};

struct side_plan {
  gdr::protocol_options opts{};
  // TCP only.
  std::size_t rx_buffer = 64 * 1024;
  std::size_t direct_read_threshold = 16 * 1024;
  bool spin_reads = true, direct_writes = true;

  std::vector<rma_plan> rma;
  unsigned rma_window = 1;
  /// Sizes of this side's windows, [put/get][host/device] (at least 64 bytes).
  std::size_t window[2][2] = {{64, 64}, {64, 64}};
  end_event event{};
  bool revoke = false;  ///< revokes its put window (of `revoke_space`) at `revoke_when`
  space revoke_space = space::host;
  trigger revoke_when{};
};

struct plan {
  std::uint64_t seed = 0;
  transport_kind transport = transport_kind::loopback;
  side_plan side[2];
  std::vector<stream_plan> streams;
  unsigned ntags = 1;
  unsigned copy_delay = 0;  ///< the copy engine's largest delay, in loop turns
  /// The end of a run with both sides still open: 0 both close at once, 1
  /// side 0 first, 2 side 1 first.
  unsigned close_order = 0;
  /// tcp-kill, shm-kill: the side that survives, and when the other is killed.
  std::uint8_t survivor = 0;
  trigger kill_when{};
};

inline const std::uint8_t control_tag = 200;

namespace detail {

inline trigger random_trigger(rng& r, unsigned max_progress) {
  trigger t;
  if (r.chance(40)) {
    t.by_progress = true;
    t.progress = static_cast<std::uint32_t>(r.below(max_progress + 1));
  } else {
    t.delay = std::chrono::microseconds(r.pick<unsigned>({0, 10, 100, 500, 1000, 3000, 10000}));
  }
  return t;
}

inline stop_plan random_stop(rng& r, unsigned stop_pct, unsigned timeout_pct) {
  stop_plan s;
  if (r.chance(stop_pct)) {
    if (r.chance(15)) {
      s.pre_stopped = true;
    } else {
      s.stop = true;
      s.when = random_trigger(r, 6);
    }
  }
  if (r.chance(timeout_pct))
    s.timeout = std::chrono::microseconds(r.pick<unsigned>({1, 20, 200, 1000, 5000, 30000}));
  return s;
}

/// A size at or around a boundary that matters to the protocol.
inline std::size_t random_size(rng& r, const gdr::protocol_options& tx, const gdr::protocol_options& rx) {
  const std::size_t thr = tx.rendezvous_threshold, ct = tx.staging.chunk, cr = rx.staging.chunk;
  switch (r.below(12)) {
    case 0: return r.pick<std::size_t>({0, 1, 2});
    case 1: return r.pick<std::size_t>({header_size - 1, header_size, header_size + 1});
    case 2: return thr - std::min<std::size_t>(thr, r.below(2));
    case 3: return thr + 1;
    case 4: return ct - r.below(2);
    case 5: return ct + 1;
    case 6: return cr + r.below(3) - 1;
    case 7: return r.pick<std::size_t>({2, 3}) * ct + r.below(3) - 1;
    case 8: return r.between(2, std::max<std::size_t>(2, thr));
    case 9: return r.between(thr, 4 * std::max(ct, cr));
    default: return r.between(0, 2 * thr + 64);
  }
}

inline gdr::protocol_options random_options(rng& r) {
  gdr::protocol_options o;
  o.rendezvous_threshold = r.pick<std::size_t>({0, 1024, 4096, 4096, 16384});
  o.staging.chunk = r.pick<std::size_t>({4096, 8192, 8192, 16384});
  o.staging.depth = r.pick<std::size_t>({1, 2, 3, 4});
  o.reply_slots = r.pick<std::size_t>({1, 2, 4, 8, 64});
  o.unexpected_bytes = r.pick<std::size_t>({o.rendezvous_threshold, 2 * o.rendezvous_threshold + 100, 16384, 65536,
                                            1 << 20});
  o.unexpected_messages = r.pick<std::size_t>({1, 2, 4, 16, 4096});
  if (r.chance(10)) o.max_message = r.between(o.staging.chunk, 3 * o.staging.chunk);
  return o;
}

}  // namespace detail

/// The plan of run `seed` over `t`; `scale` (0..1] shrinks the operation
/// counts (sanitizer builds).
inline plan make_plan(std::uint64_t seed, transport_kind t, double scale) {
  using namespace detail;
  plan p;
  p.seed = seed;
  p.transport = t;
  rng r(seed);
  rng ro = r.fork(1), rs = r.fork(2), rm = r.fork(3), re = r.fork(4);

  for (auto& s : p.side) {
    s.opts = random_options(ro);
    s.rx_buffer = ro.pick<std::size_t>({4096, 16384, 65536});
    s.direct_read_threshold = ro.pick<std::size_t>({512, 4096, 16384});
    s.spin_reads = ro.chance(70);
    s.direct_writes = ro.chance(70);
  }
  // A loopback pair has one option set for both ends.
  if (t == transport_kind::loopback) p.side[1].opts = p.side[0].opts;
  p.copy_delay = ro.pick<unsigned>({0, 0, 1, 3, 8});

  const unsigned max_ops = std::max(1u, static_cast<unsigned>(10 * scale));
  p.ntags = static_cast<unsigned>(rs.between(1, 4));
  for (std::uint8_t from = 0; from < 2; ++from) {
    for (std::uint8_t tag = 0; tag < p.ntags; ++tag) {
      stream_plan st;
      st.from = from;
      st.tag = tag;
      const auto& tx = p.side[from].opts;
      const auto& rx = p.side[1 - from].opts;
      const std::size_t n = rs.between(0, max_ops);
      for (std::size_t i = 0; i < n; ++i) {
        send_plan sp;
        sp.size = random_size(rs, tx, rx);
        sp.mem = rs.chance(35) ? space::device : space::host;
        sp.stop = random_stop(rs, 12, 8);
        st.max_size = std::max(st.max_size, sp.size);
        st.sends.push_back(sp);
      }
      st.max_size = std::max(st.max_size, header_size);  // the fin
      const std::size_t m = rs.between(0, n + 2);
      for (std::size_t i = 0; i < m; ++i) {
        recv_plan rp;
        rp.view = rs.chance(70) ? st.max_size + rs.below(2) * rs.below(65) : random_size(rs, tx, rx);
        rp.mem = rs.chance(35) ? space::device : space::host;
        rp.stop = random_stop(rs, 15, 15);
        st.recvs.push_back(rp);
      }
      st.send_window = rs.pick<unsigned>({1, 1, 2, 4});
      st.recv_window = rs.pick<unsigned>({1, 2, 4});
      p.streams.push_back(std::move(st));
    }
  }

  for (int s = 0; s < 2; ++s) {
    side_plan& me = p.side[s];
    side_plan& peer = p.side[1 - s];
    const std::size_t n = rm.between(0, std::max(1u, max_ops / 2 + 1));
    me.rma_window = rm.pick<unsigned>({1, 2, 4});
    for (std::size_t i = 0; i < n; ++i) {
      rma_plan op;
      op.get = rm.chance(50);
      op.local = rm.chance(35) ? space::device : space::host;
      op.remote = rm.chance(35) ? space::device : space::host;
      op.size = random_size(rm, me.opts, peer.opts);
      op.bad_key = rm.chance(5);
      op.stop = random_stop(rm, 10, 10);
      // Each op has its own region of the peer's window, 16 guard bytes apart.
      std::size_t& w = peer.window[op.get ? 1 : 0][op.remote == space::device ? 1 : 0];
      op.offset = w;
      w += op.size + 16;
      me.rma.push_back(op);
    }
  }

  // Events that end the traffic early.
  const unsigned regime = static_cast<unsigned>(re.below(100));
  auto close_ev = [&](end_event& e, bool drop) {
    e.what = drop ? end_event::kind::drop : end_event::kind::close;
    e.when = random_trigger(re, 40);
    if (!drop && re.chance(40))
      e.close_timeout = std::chrono::microseconds(re.pick<unsigned>({1, 100, 2000, 20000, 200000}));
    if (!drop && re.chance(20)) e.what = end_event::kind::close_then_drop;
  };
  const int who = static_cast<int>(re.below(2));
  if (regime < 40) {
    // clean: both close at the end
  } else if (regime < 60) {
    close_ev(p.side[who].event, false);
  } else if (regime < 75) {
    close_ev(p.side[who].event, true);
  } else if (regime < 85) {
    close_ev(p.side[0].event, false);
    close_ev(p.side[1].event, false);
  } else {
    close_ev(p.side[who].event, false);
    close_ev(p.side[1 - who].event, true);
  }
  p.close_order = static_cast<unsigned>(re.below(3));
  for (auto& s : p.side) {
    if (re.chance(15)) {
      s.revoke = true;
      s.revoke_space = re.chance(50) ? space::device : space::host;
      s.revoke_when = random_trigger(re, 30);
    }
  }
  p.survivor = static_cast<std::uint8_t>(re.below(2));
  p.kill_when = random_trigger(re, 60);
  if (!p.kill_when.by_progress) p.kill_when.delay = std::chrono::microseconds(re.between(0, 40000));
  return p;
}

/// The size of the stream's fin (its last message, which ends the
/// receiver's phase), given the largest message its receiver accepts: a
/// size no other message of the stream has, so that a receive of it says
/// so even truncated (every message begins with the same magic, and a
/// receive truncated to a few bytes shows nothing else). Larger than every
/// message the receiver accepts, or else the largest size the stream does
/// not send.
inline std::size_t fin_size(const stream_plan& sp, std::uint64_t limit) {
  std::size_t largest = 0;
  for (const send_plan& s : sp.sends)
    if (s.size <= limit) largest = std::max(largest, s.size);
  const std::size_t above = std::max(header_size, largest + 1);
  if (above <= limit) return above;
  auto sent = [&](std::size_t n) {
    return std::any_of(sp.sends.begin(), sp.sends.end(), [&](const send_plan& s) { return s.size == n; });
  };
  auto n = static_cast<std::size_t>(limit);
  while (n > header_size && sent(n)) --n;
  return std::max(n, header_size);
}

}  // namespace stress
