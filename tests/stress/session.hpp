// One stress run's traffic: the workers that carry out a plan over a pair
// of endpoints, recording every operation (record.hpp) for the checks.
//
// Per stream (a direction and a tag) a sender starts its sends, up to its
// window at once, then a "fin" (the stream's last message, larger than any
// other so that even a truncated receive knows it); a receiver starts the
// plan's receives (the main phase, with stops and timeouts), then
// unstoppable receives one at a time until the fin (the final phase), then
// stops what is still pending; if the endpoint broke, it drains the kept
// messages. Per side, a worker starts the plan's puts and gets, and another
// carries out the side's event (a close, a drop) and its revocation. When all
// of that is done, each side still open closes (at once or one after the
// other), then drops its endpoint and revokes its windows.
//
// Everything runs on the scheduler's one thread. Workers wait on one queue
// (`waitq`) that every completion and event wakes. A side is "local" when
// this process runs it: both in one process, one in the forked TCP variant
// (the other side's workers run in the peer process).
#pragma once

#include <array>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/sched/timer.hpp>

#include "tests/stress/check.hpp"
#include "tests/stress/journal.hpp"
#include "tests/stress/memory.hpp"
#include "tests/stress/payload.hpp"
#include "tests/stress/plan.hpp"
#include "tests/stress/record.hpp"

namespace stress {

/// Coroutines waiting for "something changed"; `notify_all` resumes them
/// (inline: they re-check their condition and wait again).
class waitq {
 public:
  struct node {
    std::coroutine_handle<> h;
  };
  struct awaiter {
    waitq* q;
    node n{};
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) {
      n.h = h;
      q->nodes_.push_back(&n);
    }
    void await_resume() const noexcept {}
  };
  awaiter wait() noexcept { return awaiter{this}; }
  void notify_all() {
    std::vector<node*> list;
    list.swap(nodes_);
    for (node* n : list) std::exchange(n->h, {}).resume();
  }

 private:
  std::vector<node*> nodes_;
};

// ---- the bytes of puts, gets and windows, from the seed alone ----
inline std::vector<std::byte> put_bytes(std::uint64_t seed, int side, std::size_t index, std::size_t n) {
  return pattern_bytes(hash_of({seed, static_cast<std::uint64_t>(side), index, 0x707574}), n);
}
inline std::vector<std::byte> window_init(std::uint64_t seed, int owner, bool get, space sp, std::size_t n) {
  return pattern_bytes(hash_of({seed, static_cast<std::uint64_t>(owner), get ? 1u : 0u,
                                static_cast<std::uint64_t>(sp), 0x77696e}), n);
}

template <class Endpoint>
class session {
 public:
  struct side_state {
    Endpoint ep;
    bool local = false;
    bool dropped = false;
    block* window[2][2] = {{nullptr, nullptr}, {nullptr, nullptr}};  // [put/get][host/device]
    std::optional<gdr::registration<std::byte, gdr::Host>> hreg[2];
    std::optional<gdr::registration<std::byte, gdr::Device>> dreg[2];
    gdr::remote_view<std::byte, gdr::Host> peer_host[2];  // the peer's windows [put/get]
    gdr::remote_view<std::byte, gdr::Device> peer_dev[2];
    unsigned rma_out = 0;
  };

  struct stream_state {
    const stream_plan* p = nullptr;
    std::vector<op_record*> sends;  // by seq, the fin last
    std::vector<op_record*> recvs;  // in start order
    unsigned send_out = 0, recv_out = 0;
    bool sender_done = false, fin_seen = false, broken = false, receiver_done = false;
    bool fin_lost = false;  // the fin may have been taken by a stopped receive (see fin_taken_by_stop)
    std::size_t fin_size = 0;
    std::vector<std::byte> fin_bytes;
    std::stop_source stop;
    std::uint64_t end_tick = 0;
    std::string ended = "running";
  };

  session(const plan& p, journal& j, run_record& rr, arena& mem, gdr::memory_registry& reg, unsigned local_mask,
          run_limits limits)
      : p_(p), j_(j), rr_(rr), mem_(mem), reg_(reg), limits_(limits) {
    for (int i = 0; i < 2; ++i) s_[i].local = (local_mask >> i) & 1;
    for (const stream_plan& sp : p.streams) {
      stream_state st;
      st.p = &sp;
      st.fin_size = fin_size(sp, p.side[1 - sp.from].opts.max_message);
      st.fin_bytes = message_bytes(p.seed, {sp.from, sp.tag, static_cast<std::uint32_t>(sp.sends.size()), st.fin_size, true});
      streams_.push_back(std::move(st));
    }
  }
  session(const session&) = delete;
  session& operator=(const session&) = delete;

  side_state& side(int i) noexcept { return s_[i]; }
  std::vector<stream_state>& streams() noexcept { return streams_; }
  void notify() { q_.notify_all(); }
  /// The end phase also waits for this (the forked variant: the kill).
  std::function<bool()> end_gate = [] { return true; };

  /// Registers this side's windows and exchanges their descriptors with
  /// the peer (control tag). False if that failed (recorded). Starts the
  /// watchdog: call it first, then `traffic()`.
  gdr::task<bool> setup() {
    scope_.spawn(gdr::with_stop_token(aux_.get_token(), watchdog()));
    gdr::task_scope scope;
    bool ok = true;
    for (int i = 0; i < 2; ++i)
      if (s_[i].local) scope.spawn(exchange(i, ok));
    co_await scope.join();
    co_return ok;
  }

  /// Leaves out the traffic (the set-up failed): `traffic()` goes straight
  /// to the end phase.
  void skip_traffic() noexcept { skip_ = true; }

  /// Runs the traffic and the end phase (see the file comment).
  gdr::task<> traffic() {
    unsigned workers = 0;
    for (stream_state& st : streams_) {
      if (skip_) break;
      if (s_[st.p->from].local) {
        ++workers;
        scope_.spawn(counted(sender(st), workers));
      }
      if (s_[1 - st.p->from].local) {
        ++workers;
        scope_.spawn(counted(receiver(st), workers));
      }
    }
    unsigned events = 0;
    for (int i = 0; i < 2; ++i) {
      if (!s_[i].local || skip_) continue;
      ++workers;
      scope_.spawn(counted(rma_worker(i), workers));
      ++events;
      scope_.spawn(counted(event_worker(i), events));
      ++events;
      scope_.spawn(counted(revoke_worker(i), events));
    }
    while (workers > 0) co_await q_.wait();
    traffic_over_ = true;
    j_.log("traffic over");
    q_.notify_all();
    while (events > 0 || !end_gate()) co_await q_.wait();
    co_await end_phase();
    run_over_ = true;
    aux_.request_stop();
    co_await scope_.join();
  }

  /// Waits for `t` (a delay, or `t.progress` more completions), or until
  /// `done()` or the end of the traffic.
  template <class Done>
  gdr::task<> wait_trigger(trigger t, Done done) {
    if (t.by_progress) {
      const std::uint64_t target = progress_ + t.progress;
      while (progress_ < target && !done() && !traffic_over_) co_await q_.wait();
    } else if (t.delay.count() > 0) {
      (void)co_await gdr::sleep_for(t.delay).as_result();
    }
  }

  std::uint64_t progress() const noexcept { return progress_; }
  bool traffic_over() const noexcept { return traffic_over_; }

 private:
  // ---------------------------------------------------------------- set-up

  gdr::task<> exchange(int i, bool& ok) {
    side_state& me = s_[i];
    const side_plan& sp = p_.side[i];
    std::vector<std::byte> wire(4 * gdr::remote_view<std::byte, gdr::Host>::wire_size);
    for (int g = 0; g < 2; ++g) {
      for (int d = 0; d < 2; ++d) {
        const space where = d ? space::device : space::host;
        block& b = mem_.make(where, sp.window[g][d], strf("side %d %s window (%s)", i, g ? "get" : "put", to_string(where)));
        b.fill(window_init(p_.seed, i, g == 1, where, b.size()));
        b.set_in_use(true);
        me.window[g][d] = &b;
        const auto acc = g ? gdr::access::read : gdr::access::read_write;
        std::array<std::byte, gdr::remote_view<std::byte, gdr::Host>::wire_size> w{};
        if (d == 0) {
          me.hreg[g].emplace(gdr::register_memory(reg_, b.host_view(), acc));
          w = me.hreg[g]->describe(static_cast<std::uint32_t>(i)).to_wire();
        } else {
          me.dreg[g].emplace(gdr::register_memory(reg_, b.device_view(), acc));
          w = me.dreg[g]->describe(static_cast<std::uint32_t>(i)).to_wire();
        }
        std::copy(w.begin(), w.end(), wire.begin() + (2 * g + d) * static_cast<std::ptrdiff_t>(w.size()));
      }
    }
    std::vector<std::byte> in(wire.size() + 8);
    gdr::view<std::byte, gdr::Host> out_v(wire.data(), wire.size()), in_v(in.data(), in.size());
    const gdr::tag ctl{control_tag};
    auto [sent, got] = co_await gdr::when_all(report_of(me.ep.send(out_v, ctl)), report_of(me.ep.recv(in_v, ctl)));
    if (sent.error || got.error || got.bytes != wire.size()) {
      j_.fail("setup", strf("side %d: the window exchange failed (send: %s, recv: %s, %zu B)", i,
                            sent.error.message().c_str(), got.error.message().c_str(), got.bytes));
      ok = false;
      co_return;
    }
    constexpr std::size_t rec = gdr::remote_view<std::byte, gdr::Host>::wire_size;
    auto span = [&](int k) { return std::span<const std::byte>(in.data() + k * rec, rec); };
    for (int g = 0; g < 2; ++g) {
      auto h = gdr::remote_view<std::byte, gdr::Host>::from_wire(span(2 * g));
      auto d = gdr::remote_view<std::byte, gdr::Device>::from_wire(span(2 * g + 1));
      if (!h || !d) {
        j_.fail("setup", strf("side %d: a window descriptor does not parse", i));
        ok = false;
        co_return;
      }
      me.peer_host[g] = *h;
      me.peer_dev[g] = *d;
    }
  }

  template <class Op>
  static gdr::task<gdr::op_report> report_of(Op op) {
    co_return co_await std::move(op).report();
  }

  // ---------------------------------------------------------------- operations

  gdr::op_awaitable make(side_state& me, op_record& o, gdr::op_options opts) {
    const bool dev = o.mem == space::device;
    const gdr::tag t{o.tag};
    switch (o.kind) {
      case op_kind::send:
        return dev ? me.ep.send(o.buf->device_view(), t, std::move(opts)) : me.ep.send(o.buf->host_view(), t, std::move(opts));
      case op_kind::recv:
        return dev ? me.ep.recv(o.buf->device_view(), t, std::move(opts)) : me.ep.recv(o.buf->host_view(), t, std::move(opts));
      case op_kind::close: return me.ep.close(std::move(opts));
      case op_kind::put:
      case op_kind::get: break;
    }
    const int g = o.kind == op_kind::get ? 1 : 0;
    const std::uint64_t salt = o.bad_key ? 0x5a5a5a5a5a5a5a5aull : 0;
    // A wrong key is wrong for the owner's loop and its NIC alike (a view
    // with a NIC key goes to the NIC on verbs: a direct operation).
    auto forge = [&](std::array<std::uint64_t, 2> nic) {
      for (auto& k : nic)
        if (k != 0) k ^= salt & 0xffffffffull;
      return nic;
    };
    if (o.remote == space::host) {
      auto r = me.peer_host[g].subview(o.offset, o.size);
      r = gdr::remote_view<std::byte, gdr::Host>(r.address(), r.size(), r.key() ^ salt, r.peer(), forge(r.nic_keys()));
      if (g == 0) return dev ? me.ep.put(o.buf->device_view(), r, std::move(opts)) : me.ep.put(o.buf->host_view(), r, std::move(opts));
      return dev ? me.ep.get(o.buf->device_view(), r, std::move(opts)) : me.ep.get(o.buf->host_view(), r, std::move(opts));
    }
    auto r = me.peer_dev[g].subview(o.offset, o.size);
    r = gdr::remote_view<std::byte, gdr::Device>(r.address(), r.size(), r.key() ^ salt, r.peer(), forge(r.nic_keys()));
    if (g == 0) return dev ? me.ep.put(o.buf->device_view(), r, std::move(opts)) : me.ep.put(o.buf->host_view(), r, std::move(opts));
    return dev ? me.ep.get(o.buf->device_view(), r, std::move(opts)) : me.ep.get(o.buf->host_view(), r, std::move(opts));
  }

  /// Runs operation `o` (whose buffer is filled) with its stop plan; counts
  /// it down in `*out` when it ends.
  gdr::task<> run_op(op_record& o, std::stop_source src, unsigned* out) {
    side_state& me = s_[o.side];
    if (me.dropped) {
      if (out) --*out;
      q_.notify_all();
      co_return;
    }
    gdr::op_options opts;
    if (o.stop.pre_stopped || o.stop.stop) opts.stop = src.get_token();
    if (o.stop.timeout.count() != 0) opts.timeout = o.stop.timeout;
    if (o.stop.pre_stopped) {
      o.stop_fired = true;
      src.request_stop();
    }
    o.started = true;
    o.start_tick = j_.tick();
    o.start_us = j_.micros();
    o.state_at_start = me.ep.error();
    if (o.buf) o.buf->set_in_use(true);
    if (j_.logging())
      j_.log("t%llu start %s%s%s", static_cast<unsigned long long>(o.start_tick), o.name().c_str(),
             o.stop.any() ? " [stoppable]" : "", o.state_at_start ? " (endpoint broken)" : "");
    const gdr::op_report rep = co_await make(me, o, std::move(opts)).report();
    o.done = true;
    o.end_tick = j_.tick();
    o.end_us = j_.micros();
    o.rep = rep;
    if (!me.dropped) o.state_at_end = me.ep.error();
    if (o.buf) {
      std::vector<std::byte> now = o.buf->read();
      o.end_digest = digest(now);
      if (o.kind == op_kind::recv || o.kind == op_kind::get) o.got = std::move(now);
      o.buf->set_in_use(false);
    }
    ++progress_;
    if (j_.logging())
      j_.log("t%llu end   %s: %s [%s]", static_cast<unsigned long long>(o.end_tick), o.name().c_str(),
             outcome(o).c_str(), gdr::to_string(rep.path));
    if (out) --*out;
    q_.notify_all();
  }

  gdr::task<> stopper(op_record& o, std::stop_source src) {
    co_await wait_trigger(o.stop.when, [&o] { return o.done; });
    if (!o.done && o.started) {
      o.stop_fired = true;
      j_.log("stop  %s", o.name().c_str());
      src.request_stop();
    }
  }

  /// Starts `o` in the scope, with its stopper; receives under their
  /// stream's stop.
  void spawn(op_record& o, unsigned* out, stream_state* st = nullptr) {
    std::stop_source src;
    if (out) ++*out;
    if (st)
      scope_.spawn(gdr::with_stop_token(st->stop.get_token(), run_op(o, src, out)));
    else
      scope_.spawn(run_op(o, src, out));
    if (o.stop.stop && o.started && !o.done) scope_.spawn(gdr::with_stop_token(aux_.get_token(), stopper(o, src)));
  }

  op_record& new_op(op_kind k, int side, std::uint8_t tag, std::uint32_t index, std::size_t size, space mem,
                    std::vector<std::byte> fill) {
    op_record& o = rr_.add();
    o.kind = k;
    o.side = static_cast<std::uint8_t>(side);
    o.tag = tag;
    o.index = index;
    o.size = size;
    o.mem = mem;
    o.buf = &mem_.make(mem, size, o.name());
    o.buf->fill(fill);
    if (k == op_kind::send || k == op_kind::put)
      o.sent = std::move(fill);
    else
      o.init = std::move(fill);
    return o;
  }

  // ---------------------------------------------------------------- workers

  gdr::task<> counted(gdr::task<> t, unsigned& n) {
    try {
      co_await std::move(t);
    } catch (const std::exception& e) {
      j_.fail("test-bug", strf("a worker of the test threw: %s", e.what()));
    }
    --n;
    q_.notify_all();
  }

  gdr::task<> sender(stream_state& st) {
    const stream_plan& sp = *st.p;
    side_state& me = s_[sp.from];
    for (std::uint32_t i = 0; i < sp.sends.size(); ++i) {
      const send_plan& s = sp.sends[i];
      op_record& o = new_op(op_kind::send, sp.from, sp.tag, i, s.size, s.mem,
                            message_bytes(p_.seed, {sp.from, sp.tag, i, s.size, false}));
      o.stop = s.stop;
      st.sends.push_back(&o);
    }
    const auto nfin = static_cast<std::uint32_t>(sp.sends.size());
    op_record& fin = new_op(op_kind::send, sp.from, sp.tag, nfin, st.fin_size, space::host, st.fin_bytes);
    fin.fin = true;
    st.sends.push_back(&fin);
    for (std::size_t i = 0; i < sp.sends.size(); ++i) {
      while (st.send_out >= sp.send_window) co_await q_.wait();
      if (me.dropped) break;
      spawn(*st.sends[i], &st.send_out);
    }
    while (st.send_out > 0) co_await q_.wait();
    if (!me.dropped) spawn(fin, &st.send_out);
    while (st.send_out > 0) co_await q_.wait();
    st.sender_done = true;
    q_.notify_all();
  }

  void start_recv(stream_state& st, std::size_t view, space mem, stop_plan stop, recv_phase phase) {
    // (Drain receives come after the stream's stop, and are not under it.)
    const stream_plan& sp = *st.p;
    const int me = 1 - sp.from;
    const auto index = static_cast<std::uint32_t>(st.recvs.size());
    op_record& o = new_op(op_kind::recv, me, sp.tag, index, view, mem,
                          pattern_bytes(hash_of({p_.seed, static_cast<std::uint64_t>(me), sp.tag, index, 0x726376}), view));
    o.stop = stop;
    o.phase = phase;
    st.recvs.push_back(&o);
    spawn(o, &st.recv_out, phase == recv_phase::drain ? nullptr : &st);
  }

  /// What a finished receive of `st` tells the stream: the fin, or a broken endpoint.
  void note_recv(stream_state& st, const op_record& o) {
    const std::error_code e = o.rep.error;
    const std::vector<std::byte>& fin = st.fin_bytes;
    if ((!e && o.rep.bytes == st.fin_size) || (is(e, gdr::errc::truncated) && o.rep.message_size == st.fin_size)) {
      const std::size_t n = std::min(o.got.size(), fin.size());
      if (std::equal(o.got.begin(), o.got.begin() + static_cast<long>(n), fin.begin())) st.fin_seen = true;
    }
    if (is_endpoint_error(e)) st.broken = true;
  }

  gdr::task<> receiver(stream_state& st) {
    const stream_plan& sp = *st.p;
    side_state& me = s_[1 - sp.from];
    std::size_t noted = 0;  // receives before it are done and noted (they end out of order)
    auto over = [&] {
      for (; noted < st.recvs.size() && st.recvs[noted]->done; ++noted) note_recv(st, *st.recvs[noted]);
      for (std::size_t k = noted; k < st.recvs.size(); ++k)
        if (st.recvs[k]->done) note_recv(st, *st.recvs[k]);
      if (!st.fin_seen && !st.fin_lost) st.fin_lost = fin_taken_by_stop(st);
      return st.fin_seen || st.fin_lost || st.broken || me.dropped;
    };
    for (const recv_plan& rp : sp.recvs) {
      while (st.recv_out >= sp.recv_window && !over()) co_await q_.wait();
      if (over()) break;
      start_recv(st, rp.view, rp.mem, rp.stop, recv_phase::main);
    }
    while (st.recv_out > 0 && !over()) co_await q_.wait();
    // The final phase: one unstoppable receive at a time until the fin.
    for (std::uint32_t k = 0; !over(); ++k) {
      start_recv(st, st.fin_size, k % 3 == 1 ? space::device : space::host, stop_plan{}, recv_phase::final);
      op_record& last = *st.recvs.back();
      while (!last.done && !over()) co_await q_.wait();
    }
    if (st.fin_seen || st.fin_lost) {
      st.ended = st.fin_seen ? "fin" : "the fin may have been taken by a stopped receive";
      for (op_record* r : st.recvs)
        if (!r->done) {
          r->stream_stop = true;
          r->stop_fired = true;
        }
      st.stop.request_stop();
    }
    while (st.recv_out > 0) co_await q_.wait();
    over();
    if (st.broken && !me.dropped) {
      // The endpoint broke: what it had kept can still be received.
      st.ended = "endpoint broken, kept messages drained";
      for (std::size_t k = 0; k < sp.sends.size() + 2 && !me.dropped; ++k) {
        start_recv(st, st.fin_size, space::host, stop_plan{}, recv_phase::drain);
        while (st.recv_out > 0) co_await q_.wait();
        const std::error_code e = st.recvs.back()->rep.error;
        if (e && !is(e, gdr::errc::truncated)) break;
      }
    } else if (me.dropped && !st.fin_seen) {
      st.ended = "this side dropped";
    }
    st.receiver_done = true;
    st.end_tick = j_.tick();
    j_.log("stream %u->%u tag %u: receiver done (%s)", sp.from, 1 - sp.from, sp.tag, st.ended.c_str());
    q_.notify_all();
  }

  /// Whether the fin of `st` may be gone for good: it was sent, a receive
  /// of the stream stopped after it started (a stopped receive may take a
  /// message), and no receive of the stream ended for a while since. Only
  /// then may the receiver stop waiting for it; the checks decide whether
  /// the fin was really taken by a stopped receive.
  bool fin_taken_by_stop(const stream_state& st) const {
    if (!s_[st.p->from].local || !st.sender_done || st.sends.empty()) return false;
    const op_record& fin = *st.sends.back();
    if (!fin.started || !fin.done || fin.rep.error) return false;
    std::int64_t last = fin.end_us;
    bool candidate = false;
    for (const op_record* r : st.recvs) {
      if (!r->done) continue;
      last = std::max(last, r->end_us);
      candidate = candidate || (is_stop(r->rep.error) && r->end_tick > fin.start_tick);
    }
    return candidate && j_.micros() - last > std::chrono::duration_cast<std::chrono::microseconds>(limits_.stall).count() / 3;
  }

  gdr::task<> rma_worker(int i) {
    side_state& me = s_[i];
    const side_plan& sp = p_.side[i];
    for (std::uint32_t k = 0; k < sp.rma.size(); ++k) {
      const rma_plan& rp = sp.rma[k];
      while (me.rma_out >= sp.rma_window) co_await q_.wait();
      if (me.dropped) break;
      const op_kind kind = rp.get ? op_kind::get : op_kind::put;
      op_record& o = new_op(kind, i, 0, k, rp.size, rp.local,
                            rp.get ? pattern_bytes(hash_of({p_.seed, static_cast<std::uint64_t>(i), k, 0x67696e}), rp.size)
                                   : put_bytes(p_.seed, i, k, rp.size));
      o.remote = rp.remote;
      o.offset = rp.offset;
      o.bad_key = rp.bad_key;
      o.stop = rp.stop;
      spawn(o, &me.rma_out);
    }
    while (me.rma_out > 0) co_await q_.wait();
  }

  gdr::task<> close_side(int i, std::chrono::microseconds timeout) {
    side_state& me = s_[i];
    side_events& ev = rr_.ev[i];
    if (me.dropped) co_return;
    op_record& o = rr_.add();
    o.kind = op_kind::close;
    o.side = static_cast<std::uint8_t>(i);
    o.stop.timeout = timeout;
    if (ev.close_start == 0) ev.close_start = j_.now_tick() + 1;  // run_op's start tick
    co_await run_op(o, std::stop_source(), nullptr);
    if (ev.close_end == 0) {
      ev.close_end = o.end_tick;
      ev.close_result = o.rep.error;
      ev.close_aborted = is_stop(o.rep.error);
    }
  }

  void drop_side(int i) {
    side_state& me = s_[i];
    if (me.dropped) return;
    rr_.ev[i].drop = j_.tick();
    j_.log("t%llu drop side %d", static_cast<unsigned long long>(rr_.ev[i].drop), i);
    me.dropped = true;
    me.ep = Endpoint{};
    q_.notify_all();
  }

  gdr::task<> event_worker(int i) {
    const end_event& e = p_.side[i].event;
    if (e.what == end_event::kind::none) co_return;
    co_await wait_trigger(e.when, [] { return false; });
    if (e.what == end_event::kind::close || e.what == end_event::kind::close_then_drop)
      co_await close_side(i, e.close_timeout);
    if (e.what == end_event::kind::drop || e.what == end_event::kind::close_then_drop) drop_side(i);
  }

  gdr::task<> revoke_window(int i, int g, int d) {
    side_state& me = s_[i];
    if (g == 0 && rr_.ev[i].revoke[d] == 0) rr_.ev[i].revoke[d] = j_.tick();
    if (d == 0 && me.hreg[g]) {
      co_await me.hreg[g]->revoke();
      me.hreg[g].reset();
    }
    if (d == 1 && me.dreg[g]) {
      co_await me.dreg[g]->revoke();
      me.dreg[g].reset();
    }
    if (me.window[g][d]) me.window[g][d]->set_in_use(false);
  }

  gdr::task<> revoke_worker(int i) {
    const side_plan& sp = p_.side[i];
    if (!sp.revoke) co_return;
    co_await wait_trigger(sp.revoke_when, [] { return false; });
    const int d = sp.revoke_space == space::device ? 1 : 0;
    j_.log("revoke side %d put window (%s)", i, to_string(sp.revoke_space));
    co_await revoke_window(i, 0, d);
    j_.log("revoked side %d put window (%s)", i, to_string(sp.revoke_space));
  }

  gdr::task<> end_phase() {
    // Close what is still open: both at once, or one after the other.
    auto open = [&](int i) { return s_[i].local && !s_[i].dropped && rr_.ev[i].close_start == 0; };
    if (p_.close_order == 0) {
      gdr::task_scope both;
      for (int i = 0; i < 2; ++i)
        if (open(i)) both.spawn(close_side(i, {}));
      co_await both.join();
    } else {
      const int first = p_.close_order == 1 ? 0 : 1;
      for (int i : {first, 1 - first})
        if (open(i)) co_await close_side(i, {});
    }
    for (int i = 0; i < 2; ++i) {
      side_state& me = s_[i];
      if (!me.local || me.dropped) continue;
      const auto deadline = j_.micros() + 1'000'000;
      while (me.ep.bounce_buffers_in_use() != std::pair<std::size_t, std::size_t>{0, 0} && j_.micros() < deadline)
        (void)co_await gdr::sleep_for(std::chrono::milliseconds(1)).as_result();
      auto [tx, rx] = me.ep.bounce_buffers_in_use();
      if (tx != 0 || rx != 0)
        j_.fail("bounce-leak", strf("side %d: %zu tx and %zu rx bounce buffers still out after its close", i, tx, rx));
    }
    for (int i = 0; i < 2; ++i)
      if (s_[i].local) drop_side(i);
    for (int i = 0; i < 2; ++i)
      if (s_[i].local)
        for (int g = 0; g < 2; ++g)
          for (int d = 0; d < 2; ++d) co_await revoke_window(i, g, d);
    if (reg_.size() != 0 || reg_.draining() != 0)
      j_.fail("registration-leak", strf("%zu registrations live and %zu draining after every revoke", reg_.size(),
                                        reg_.draining()));
  }

  /// Ends a run that went past its bound, or in which something is pending
  /// and nothing completed for `limits_.stall`, listing what is pending.
  gdr::task<> watchdog() {
    const std::int64_t limit = std::chrono::duration_cast<std::chrono::microseconds>(limits_.bound).count();
    const std::int64_t stall = std::chrono::duration_cast<std::chrono::microseconds>(limits_.stall).count();
    std::uint64_t seen = progress_;
    std::int64_t since = j_.micros();
    while (!run_over_) {
      if (!(co_await gdr::sleep_for(std::chrono::milliseconds(20)).as_result())) co_return;
      if (run_over_) co_return;
      q_.notify_all();  // (for waits on time: fin_taken_by_stop)
      const std::int64_t now = j_.micros();
      if (progress_ != seen) {
        seen = progress_;
        since = now;
      }
      bool any = false;
      for (const op_record& o : rr_.ops) any = any || (o.started && !o.done);
      const bool stalled = any && now - since > stall;
      if (now < limit && !stalled) continue;
      std::string pending;
      int n = 0;
      for (const op_record& o : rr_.ops)
        if (o.started && !o.done && n++ < 40)
          pending += strf("\n  pending since %lld ms: %s%s", static_cast<long long>((j_.micros() - o.start_us) / 1000),
                          o.name().c_str(), o.stop.any() ? " [stoppable]" : "");
      for (const stream_state& st : streams_) {
        const bool tx = s_[st.p->from].local, rx = s_[1 - st.p->from].local;
        if ((tx && !st.sender_done) || (rx && !st.receiver_done))
          pending += strf("\n  stream %u->%u tag %u: sender %s, receiver %s, %u sends and %u receives out", st.p->from,
                          1 - st.p->from, st.p->tag, !tx ? "remote" : st.sender_done ? "done" : "running",
                          !rx ? "remote" : st.receiver_done ? "done" : "running", st.send_out, st.recv_out);
      }
      for (int i = 0; i < 2; ++i)
        if (s_[i].local)
          pending += strf("\n  side %d: %s, endpoint error '%s', bounce %zu/%zu, paused %llu times, %llu early "
                          "messages and %llu announcements kept so far",
                          i, s_[i].dropped ? "dropped" : "held", s_[i].ep.error().message().c_str(),
                          s_[i].ep.bounce_buffers_in_use().first, s_[i].ep.bounce_buffers_in_use().second,
                          static_cast<unsigned long long>(s_[i].ep.stats().paused),
                          static_cast<unsigned long long>(s_[i].ep.stats().unexpected),
                          static_cast<unsigned long long>(s_[i].ep.stats().unexpected_rts));
      for (int i = 0; i < 2; ++i)
        if (s_[i].local && !s_[i].dropped)
          pending += strf("\n  side %d inside: %s", i, s_[i].ep.debug_state().c_str());
      bool only_closes = n > 0;
      for (const op_record& o : rr_.ops)
        if (o.started && !o.done && o.kind != op_kind::close) only_closes = false;
      // (Nothing pending while the traffic runs: a worker of the test waits
      // for nothing that will come.)
      const char* kind = only_closes ? "hang-close" : n == 0 ? (traffic_over_ ? "hang-end" : "test-stuck") : "hang";
      // Signatures of known stalls, so that a catalogue can group them.
      bool zero_rma = n > 0, slots_full = false;
      for (const op_record& o : rr_.ops)
        if (o.started && !o.done &&
            !((o.kind == op_kind::put || o.kind == op_kind::get) && o.size == 0 &&
              (o.mem == space::device || o.remote == space::device)))
          zero_rma = false;
      for (int i = 0; i < 2; ++i)
        if (s_[i].local && !s_[i].dropped && s_[i].ep.bounce_buffers_in_use().first >= p_.side[i].opts.staging.depth)
          slots_full = true;
      if (std::string(kind) == "hang" && zero_rma) kind = "hang-zero-rma";
      else if (std::string(kind) == "hang" && slots_full) kind = "hang-tx-slots";
      if (const char* k = hang_kind()) kind = k;
      j_.fail(kind, strf("%s (%d operations pending, traffic %s)%s",
                         stalled ? strf("nothing completed for %lld ms", static_cast<long long>((now - since) / 1000)).c_str()
                                 : strf("the run went past its bound of %lld ms", static_cast<long long>(limit / 1000)).c_str(),
                         n, traffic_over_ ? "over" : "running", pending.c_str()));
      on_hang();
    }
  }

 public:
  /// What a hang does (the runner prints the failures and ends the process).
  std::function<void()> on_hang = [] {};
  /// A more precise kind for a hang, or null.
  std::function<const char*()> hang_kind = []() -> const char* { return nullptr; };

 private:
  const plan& p_;
  journal& j_;
  run_record& rr_;
  arena& mem_;
  gdr::memory_registry& reg_;
  run_limits limits_;
  side_state s_[2];
  std::vector<stream_state> streams_;
  waitq q_;
  gdr::task_scope scope_;
  std::stop_source aux_;
  std::uint64_t progress_ = 0;
  bool traffic_over_ = false;
  bool run_over_ = false;
  bool skip_ = false;
};

}  // namespace stress
