// The checks made once a stress run has ended (every operation finished,
// every endpoint dropped): the outcome and message rules of check.hpp, and
// what the memory says:
//   * a receive stopped by its stop or timeout left its view as it was
//     (GUIDE section 7: "never leaves a half-written view behind");
//   * a successful receive wrote nothing in its view past the message;
//   * no view changed after its operation completed (late writes), and no
//     send's or put's source was written at all;
//   * a put that succeeded placed exactly its bytes in its region; one that
//     was refused (wrong key, revoked, too large) placed none; any other
//     failed put left each byte either old or new; likewise a get's view;
//   * the bytes of a window outside every region, and every byte of a get
//     window, never changed; no red zone of any block changed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/stress/check.hpp"
#include "tests/stress/journal.hpp"
#include "tests/stress/memory.hpp"
#include "tests/stress/payload.hpp"
#include "tests/stress/plan.hpp"
#include "tests/stress/record.hpp"
#include "tests/stress/session.hpp"

namespace stress {

namespace detail {

/// Each byte of `got` is the byte of `a` or of `b` at its place.
inline bool old_or_new(const std::vector<std::byte>& got, const std::vector<std::byte>& a,
                       const std::vector<std::byte>& b) {
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != a[i] && got[i] != b[i]) return false;
  return true;
}

inline std::vector<std::byte> slice(const std::vector<std::byte>& v, std::size_t off, std::size_t n) {
  return std::vector<std::byte>(v.begin() + static_cast<long>(off), v.begin() + static_cast<long>(off + n));
}

/// Whether an rma operation's failure means nothing was read or written.
inline bool refused(const op_record& o) {
  return !o.started || o.bad_key || is(o.rep.error, gdr::errc::remote_access) ||
         is(o.rep.error, gdr::errc::message_too_large);
}

/// Refused because the owner revoked its registration while the put was
/// under way (a good key): the segments checked before the revocation were
/// written (GUIDE section 7), so its region holds old and new bytes.
inline bool revoked_midway(const op_record& o) {
  return o.started && !o.bad_key && is(o.rep.error, gdr::errc::remote_access);
}

}  // namespace detail

/// Checks the windows of `owner` against the puts the peer planned:
/// `ops[k]` is the record of the peer's k-th rma op, or null where its
/// outcome is not known (a forked peer).
template <class Endpoint>
void verify_windows(const plan& p, session<Endpoint>& ss, int owner, const std::vector<const op_record*>& ops,
                    journal& j) {
  const int peer = 1 - owner;
  for (int g = 0; g < 2; ++g) {
    for (int d = 0; d < 2; ++d) {
      block* w = ss.side(owner).window[g][d];
      if (w == nullptr) continue;
      const space where = d ? space::device : space::host;
      const std::vector<std::byte> now = w->read();
      const std::vector<std::byte> init = window_init(p.seed, owner, g == 1, where, w->size());
      std::vector<char> covered(w->size(), 0);
      const auto& plans = p.side[peer].rma;
      for (std::size_t k = 0; k < plans.size(); ++k) {
        const rma_plan& rp = plans[k];
        if (rp.get != (g == 1) || rp.remote != where || g == 1) continue;
        for (std::size_t i = 0; i < rp.size; ++i) covered[rp.offset + i] = 1;
        const auto got = detail::slice(now, rp.offset, rp.size);
        const auto old = detail::slice(init, rp.offset, rp.size);
        const auto put = put_bytes(p.seed, peer, k, rp.size);
        const op_record* o = k < ops.size() ? ops[k] : nullptr;
        const std::string name = o ? o->name() : strf("put#%zu of side %d", k, peer);
        if (o && o->done && !o->rep.error && got != put) {
          j.fail("put-content", strf("%s succeeded, but its region holds other bytes (first at %ld)", name.c_str(),
                                     first_difference(got, put)));
        } else if (o && detail::refused(*o) && got != old && !(detail::revoked_midway(*o))) {
          j.fail("put-content", strf("%s (%s) was refused or never sent, yet its region changed", name.c_str(),
                                     outcome(*o).c_str()));
        } else if (!detail::old_or_new(got, old, put)) {
          j.fail("put-content", strf("%s (%s): its region holds bytes that are neither old nor new", name.c_str(),
                                     o ? outcome(*o).c_str() : "unknown"));
        }
      }
      for (std::size_t i = 0; i < now.size(); ++i) {
        if (!covered[i] && now[i] != init[i]) {
          j.fail("window-write", strf("side %d %s window (%s): byte %zu outside every put's region changed", owner,
                                      g ? "get" : "put", to_string(where), i));
          break;
        }
      }
    }
  }
}

/// Everything but the windows (see the file comment), for the local sides.
template <class Endpoint>
void verify_run(const plan& p, const run_record& rr, session<Endpoint>& ss, arena& mem, journal& j, bool peer_unknown) {
  for (const op_record& o : rr.ops)
    if (o.started && o.done) check_outcome(p, rr, o, j);

  for (const op_record& o : rr.ops) {
    if (!o.started || !o.done || o.buf == nullptr) continue;
    const std::vector<std::byte> now = o.buf->read();
    if (digest(now) != o.end_digest)
      j.fail("late-write", strf("%s (%s): its view changed after it completed", o.name().c_str(), outcome(o).c_str()));
    if ((o.kind == op_kind::send || o.kind == op_kind::put) && now != o.sent)
      j.fail("source-written", strf("%s: its source bytes were written (first at %ld)", o.name().c_str(),
                                    first_difference(now, o.sent)));
    const std::error_code e = o.rep.error;
    if (o.kind == op_kind::recv) {
      // A stopped or failed receive's view is unspecified (GUIDE section
      // 7): part of its message may be there. What it must not hold is
      // anything written after it completed (late-write, above) or
      // outside it (the red zones).
      if (!e && o.rep.bytes <= o.got.size() &&
          !std::equal(o.got.begin() + static_cast<long>(o.rep.bytes), o.got.end(),
                      o.init.begin() + static_cast<long>(o.rep.bytes)))
        j.fail("recv-past-message", strf("%s got %zu bytes but wrote past them in its view", o.name().c_str(),
                                         o.rep.bytes));
    }
    if (o.kind == op_kind::get) {
      const int owner = 1 - o.side;
      const auto& sp = p.side[owner].window[1][o.remote == space::device ? 1 : 0];
      const auto want = detail::slice(window_init(p.seed, owner, true, o.remote, sp), o.offset, o.size);
      if (!e && o.got != want)
        j.fail("get-content", strf("%s succeeded with other bytes (first at %ld)", o.name().c_str(),
                                   first_difference(o.got, want)));
      else if (e && detail::refused(o) && o.got != o.init)
        j.fail("get-content", strf("%s (%s) was refused or never sent, yet its view changed", o.name().c_str(),
                                   outcome(o).c_str()));
      else if (e && !detail::old_or_new(o.got, o.init, want))
        j.fail("get-content", strf("%s (%s): its view holds bytes that are neither old nor the window's",
                                   o.name().c_str(), outcome(o).c_str()));
    }
  }

  for (auto& st : ss.streams()) {
    const stream_plan& sp = *st.p;
    const int rx = 1 - sp.from, tx = sp.from;
    if (!ss.side(rx).local) continue;
    stream_view sv;
    sv.plan = &sp;
    if (ss.side(tx).local) {
      for (op_record* s : st.sends) sv.sends.push_back(s);
      sv.unknown_bytes.resize(sv.sends.size());
      sv.unknown_size.resize(sv.sends.size());
    } else {
      for (std::uint32_t k = 0; k <= sp.sends.size(); ++k) {
        const bool fin = k == sp.sends.size();
        const std::size_t n = fin ? st.fin_size : sp.sends[k].size;
        sv.sends.push_back(nullptr);
        sv.unknown_size.push_back(n);
        sv.unknown_bytes.push_back(message_bytes(p.seed, {sp.from, sp.tag, k, n, fin}));
      }
    }
    for (op_record* r : st.recvs) sv.recvs.push_back(r);
    const side_events& et = rr.ev[tx];
    const side_events& er = rr.ev[rx];
    const bool receiver_cut = (er.drop != 0 && er.drop < st.end_tick) || (er.close_start != 0 && er.close_start < st.end_tick);
    sv.lossy = peer_unknown || aborted_before(et, ~std::uint64_t{0}) || receiver_cut;
    sv.how_it_ended = st.ended;
    check_stream(p.seed, sv, j);
  }

  mem.each([&](block& b) {
    if (long bad = b.damaged_guard())
      j.fail("red-zone", strf("%s: a byte %ld %s its view changed", b.name().c_str(), bad < 0 ? -bad : bad,
                              bad < 0 ? "before" : "past"));
  });
}

}  // namespace stress
