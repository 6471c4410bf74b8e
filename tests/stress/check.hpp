// The rules a stress run is checked against, from docs/GUIDE.md.
//
// Outcomes (sections 6-8). An operation succeeds, or fails with an error its
// circumstances allow: `cancelled` only if its stop fired, `timed_out` only
// if it had a timeout, `truncated` only for a receive of a larger message,
// `message_too_large` only above the peer's limit, `remote_access` only for
// a wrong key or a revoked window, `withdrawn` only for a receive (the peer
// stopped the send it had matched, GUIDE section 7), `closed` only after this
// side closed or dropped its endpoint, `peer_closed` only after the peer began to close,
// `connection_lost` only after the peer dropped its endpoint without a
// completed close, aborted its close (a close timeout), or was killed.
// Anything else (`protocol_error` between two endpoints of one build,
// `busy`, `device_error`...) is a failure. Once an endpoint is broken, later
// sends, puts and gets fail with its error, and receives either take a kept
// message or fail with it; an operation that fails with an endpoint error
// fails with the error the endpoint reports then.
//
// Messages (sections 4, 7, 8), per stream (a direction and a tag). Receives
// take messages in the order the sends started, in the order the receives
// started. A receive that succeeded holds exactly the bytes of one send; a
// truncated one the first bytes of a larger send. A send that was withdrawn
// (cancelled, timed_out, message_too_large) is never received; a receive
// that failed with `withdrawn` took none. A stopped
// receive takes one message or none ("may have cost a message"); a receive
// failed by its endpoint the same, except one failed by the peer's orderly
// close, which takes none. A successful send must be received unless the
// stream is lossy: the receiver closed or dropped its end, or the sender
// aborted (dropped without a completed close, aborted its close, was
// killed). A send that failed with an endpoint error may or may not have
// been delivered. `check_stream` searches every assignment of messages to
// receives these rules allow, and fails the stream if none exists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/protocol/options.hpp>

#include "tests/stress/journal.hpp"
#include "tests/stress/payload.hpp"
#include "tests/stress/plan.hpp"
#include "tests/stress/record.hpp"

namespace stress {

inline bool is(std::error_code ec, gdr::errc e) { return ec == gdr::make_error_code(e); }
inline bool is_endpoint_error(std::error_code ec) {
  return is(ec, gdr::errc::closed) || is(ec, gdr::errc::peer_closed) || is(ec, gdr::errc::connection_lost) ||
         is(ec, gdr::errc::protocol_error);
}
inline bool is_stop(std::error_code ec) { return is(ec, gdr::errc::cancelled) || is(ec, gdr::errc::timed_out); }

inline std::string outcome(const op_record& o) {
  if (!o.done) return "pending";
  if (!o.rep.error) return strf("ok %zu B", o.rep.bytes);
  return o.rep.error.message() + (is(o.rep.error, gdr::errc::truncated) ? strf(" (%zu of %zu B)", o.rep.bytes,
                                                                                o.rep.message_size)
                                                                          : std::string());
}

/// Whether the peer's connection ended without an orderly close, before tick `t`.
inline bool aborted_before(const side_events& e, std::uint64_t t) {
  auto before = [t](std::uint64_t x) { return x != 0 && x < t; };
  const bool closed_ok = e.close_end != 0 && !e.close_result && (e.drop == 0 || e.close_end < e.drop);
  return (before(e.drop) && !closed_ok) || (e.close_aborted && before(e.close_start)) || before(e.killed);
}

/// The outcome rules (see the file comment) for one finished operation.
inline void check_outcome(const plan& p, const run_record& rr, const op_record& o, journal& j) {
  const side_events& me = rr.ev[o.side];
  const side_events& peer = rr.ev[1 - o.side];
  const std::uint64_t t = o.end_tick;
  auto before = [t](std::uint64_t x) { return x != 0 && x < t; };
  const std::error_code e = o.rep.error;
  const std::uint64_t peer_max = p.side[1 - o.side].opts.max_message;
  auto bad = [&](const char* kind, const std::string& why) {
    j.fail(kind, strf("%s: %s (%s)", o.name().c_str(), outcome(o).c_str(), why.c_str()));
  };

  if (!e) {
    if (o.kind != op_kind::recv && o.kind != op_kind::close && o.rep.bytes != o.size)
      bad("report", strf("reports %zu bytes", o.rep.bytes));
    if (o.kind == op_kind::recv && (o.rep.bytes != o.rep.message_size || o.rep.bytes > o.size))
      bad("report", strf("message_size %zu", o.rep.message_size));
    if ((o.kind == op_kind::send || o.kind == op_kind::put || o.kind == op_kind::get) && o.size > peer_max)
      bad("limit", "larger than the peer's max_message, yet it succeeded");
    if (o.kind == op_kind::get && o.size > p.side[o.side].opts.max_message)
      bad("limit", "a get larger than this side's max_message, yet it succeeded");
    if ((o.kind == op_kind::put || o.kind == op_kind::get) && o.bad_key) bad("rma-refusal", "a wrong key succeeded");
    if (o.kind == op_kind::put && !o.bad_key && !peer.unknown && peer.revoke[o.remote == space::device] != 0 &&
        peer.revoke[o.remote == space::device] < o.start_tick)
      bad("rma-refusal", "a put into a window revoked before it started succeeded");
    const bool dev = o.mem == space::device || ((o.kind == op_kind::put || o.kind == op_kind::get) &&
                                                o.remote == space::device);
    // (CUDA IPC moves Device memory on either side directly.)
    const bool ipc = p.transport == transport_kind::shm_ipc;
    const gdr::transfer_path device_path = ipc ? gdr::transfer_path::cuda_ipc : gdr::transfer_path::staged_pinned;
    if (o.kind != op_kind::close && dev && o.rep.path != device_path)
      bad("report", strf("Device memory, path %s", gdr::to_string(o.rep.path)));
    // (Host memory whose peer side is Device memory may report the staged
    // path: "Device memory on either side", GUIDE section 9.)
    // (Shared memory copies every host payload through its rings.)
    const bool shm = p.transport == transport_kind::shm || p.transport == transport_kind::shm_kill || ipc;
    const gdr::transfer_path bulk = shm ? gdr::transfer_path::shared_memory : gdr::transfer_path::host_zero_copy;
    // (Verbs moves puts and gets into exposed host memory with the NIC.)
    const bool direct = p.transport == transport_kind::verbs && (o.kind == op_kind::put || o.kind == op_kind::get) &&
                        o.rep.path == gdr::transfer_path::one_sided_rdma;
    if (o.kind != op_kind::close && !dev && !direct && o.rep.path != bulk &&
        o.rep.path != gdr::transfer_path::host_eager && o.rep.path != device_path)
      bad("report", strf("host memory, path %s", gdr::to_string(o.rep.path)));
  } else if (is(e, gdr::errc::cancelled)) {
    if (!o.stop_fired) bad("outcome", "cancelled, but its stop never fired");
  } else if (is(e, gdr::errc::timed_out)) {
    if (o.stop.timeout.count() == 0) bad("outcome", "timed out without a timeout");
  } else if (is(e, gdr::errc::withdrawn)) {
    // The peer withdrew the message this receive had matched (its send
    // stopped before the rtr reached it), where going back in line would
    // have let a later receive of the stream overtake it.
    if (o.kind != op_kind::recv) bad("outcome", "withdrawn, but not a receive");
  } else if (is(e, gdr::errc::truncated)) {
    if (o.kind != op_kind::recv || o.rep.message_size <= o.size || o.rep.bytes != o.size)
      bad("report", "truncated, but the sizes do not say so");
  } else if (is(e, gdr::errc::message_too_large)) {
    // (A get larger than this side's own limit fails too: its answer would
    // be a message this side does not accept.)
    const std::uint64_t own_max = p.side[o.side].opts.max_message;
    if (o.kind == op_kind::recv || o.kind == op_kind::close ||
        (o.size <= peer_max && !(o.kind == op_kind::get && o.size > own_max)))
      bad("outcome", strf("message_too_large under the peer's limit of %llu", static_cast<unsigned long long>(peer_max)));
  } else if (is(e, gdr::errc::remote_access)) {
    const std::uint64_t rv = peer.revoke[o.remote == space::device];
    if ((o.kind != op_kind::put && o.kind != op_kind::get) || (!o.bad_key && !peer.unknown && !(rv != 0 && rv < t)))
      bad("rma-refusal", "refused, yet its key was right and the window not revoked");
  } else if (is(e, gdr::errc::closed)) {
    if (!before(me.close_start) && !before(me.drop)) bad("outcome", "closed, but this side neither closed nor dropped");
  } else if (is(e, gdr::errc::peer_closed)) {
    if (!before(peer.close_start) && !peer.unknown) bad("outcome", "peer_closed, but the peer did not close");
  } else if (is(e, gdr::errc::connection_lost)) {
    if (!aborted_before(peer, t) && !peer.unknown)
      bad("connection-lost", peer.close_start != 0 && before(peer.close_start)
                                 ? "connection_lost although the peer closed in order"
                                 : "connection_lost although the peer neither dropped nor aborted");
  } else if (is(e, gdr::errc::gpudirect_unavailable)) {
    // A Device receive on a CUDA IPC endpoint takes only messages moved
    // straight into it: an eager host message fails it (and stays).
    if (p.transport != transport_kind::shm_ipc || o.kind != op_kind::recv || o.mem != space::device)
      bad("outcome", "gpudirect_unavailable outside a Device receive on a CUDA IPC endpoint");
  } else if (is(e, gdr::errc::protocol_error)) {
    bad("protocol-error", "between two endpoints of the same build");
  } else {
    bad("outcome", "an error no rule allows");
  }

  if (o.kind == op_kind::close) {
    if (e && !is(e, gdr::errc::timed_out)) bad("close", "close failed (closing a closed or failed endpoint succeeds)");
    return;
  }
  // A broken endpoint fails later operations with its error.
  // (A stop or timeout that fired is allowed too: which of the two wins is
  // not written down.)
  const bool stopped = (is(e, gdr::errc::cancelled) && o.stop_fired) || (is(e, gdr::errc::timed_out) && o.stop.timeout.count());
  if (o.state_at_start && !is(o.state_at_start, gdr::errc::closed) && o.kind != op_kind::recv && e != o.state_at_start &&
      !stopped)
    bad("broken-endpoint", strf("started on an endpoint broken with %s", o.state_at_start.message().c_str()));
  // (A kept message still matches a receive on a broken endpoint: it may
  // truncate it, or refuse a Device receive on a CUDA IPC endpoint.)
  if (o.state_at_start && o.kind == op_kind::recv && e && !is(e, gdr::errc::truncated) &&
      !is(e, gdr::errc::gpudirect_unavailable) && e != o.state_at_start &&
      !(is(o.state_at_start, gdr::errc::closed) && is_endpoint_error(e)) && !stopped)
    bad("broken-endpoint", strf("a receive started on an endpoint broken with %s", o.state_at_start.message().c_str()));
  // A send the peer declined while closing (GUIDE section 8) fails with
  // closed or peer_closed as that moment's state said, and so does an
  // operation this side's close ended (a request that would have followed
  // its close frame): the endpoint may have moved on (the peer's close
  // frame, or its drop) before the operation's coroutine ran.
  const bool declined = o.kind == op_kind::send && (is(e, gdr::errc::closed) || is(e, gdr::errc::peer_closed));
  const bool ended_by_close = is(e, gdr::errc::closed) && before(me.close_start);
  if (is_endpoint_error(e) && o.state_at_end && e != o.state_at_end && !declined && !ended_by_close)
    bad("broken-endpoint", strf("the endpoint said %s when it failed", o.state_at_end.message().c_str()));
  if ((o.kind == op_kind::send || o.kind == op_kind::recv) && o.rep.tag != o.tag)
    bad("report", strf("report names tag %llu", static_cast<unsigned long long>(o.rep.tag)));
}

/// One stream's sends (by sequence number; the fin last) and receives (in
/// start order). A null send is one whose outcome is not known here (a
/// forked peer's).
struct stream_view {
  const stream_plan* plan = nullptr;
  std::vector<const op_record*> sends;
  std::vector<std::vector<std::byte>> unknown_bytes;  ///< the bytes of each null send
  std::vector<std::size_t> unknown_size;
  std::vector<const op_record*> recvs;
  bool lossy = false;
  std::string how_it_ended;
};

namespace detail {

enum class send_class : std::uint8_t { ok, withdrawn, maybe };

inline send_class classify(const op_record* s) {
  if (s == nullptr) return send_class::maybe;
  if (!s->started) return send_class::withdrawn;
  const std::error_code e = s->rep.error;
  if (!e) return send_class::ok;
  if (is_stop(e) || is(e, gdr::errc::message_too_large)) return send_class::withdrawn;
  return send_class::maybe;
}

}  // namespace detail

/// The message rules (see the file comment) for one stream.
inline void check_stream(std::uint64_t seed, const stream_view& sv, journal& j) {
  using detail::send_class;
  const std::size_t n = sv.sends.size(), m = sv.recvs.size();
  std::vector<send_class> cls(n);
  std::vector<const std::vector<std::byte>*> bytes(n);
  std::vector<std::size_t> size(n);
  for (std::size_t k = 0; k < n; ++k) {
    cls[k] = detail::classify(sv.sends[k]);
    bytes[k] = sv.sends[k] ? &sv.sends[k]->sent : &sv.unknown_bytes[k];
    size[k] = sv.sends[k] ? sv.sends[k]->size : sv.unknown_size[k];
  }
  auto skippable = [&](std::size_t k) { return cls[k] != send_class::ok || sv.lossy; };
  auto consumable = [&](std::size_t k) { return cls[k] != send_class::withdrawn; };
  // Whether receive i may have taken message k, and whether it may have taken none.
  auto matches = [&](const op_record& r, std::size_t k) {
    const std::error_code e = r.rep.error;
    if (!e) return r.rep.bytes == size[k] && r.got.size() >= size[k] &&
                   std::equal(bytes[k]->begin(), bytes[k]->end(), r.got.begin());
    if (is(e, gdr::errc::truncated))
      return size[k] > r.size && r.rep.message_size == size[k] && r.got.size() == r.size &&
             std::equal(r.got.begin(), r.got.end(), bytes[k]->begin());
    if (is(e, gdr::errc::peer_closed)) return false;
    return true;
  };
  auto may_take_none = [&](const op_record& r) {
    const std::error_code e = r.rep.error;
    return e && !is(e, gdr::errc::truncated);
  };
  auto must_take_none = [&](const op_record& r) { return is(r.rep.error, gdr::errc::withdrawn); };

  std::vector<std::vector<char>> reach(m + 1, std::vector<char>(n + 1, 0));
  reach[0][0] = 1;
  std::size_t last_ok = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const op_record& r = *sv.recvs[i];
    for (std::size_t s = 0; s <= n; ++s) {
      if (!reach[i][s]) continue;
      if (may_take_none(r)) reach[i + 1][s] = 1;
      for (std::size_t k = s; k < n; ++k) {
        if (consumable(k) && !must_take_none(r) && matches(r, k)) reach[i + 1][k + 1] = 1;
        if (!skippable(k)) break;
      }
    }
    bool any = false;
    for (char c : reach[i + 1]) any = any || c;
    if (!any) break;
    last_ok = i + 1;
  }
  bool ok = false;
  if (last_ok == m) {
    for (std::size_t s = 0; s <= n && !ok; ++s) {
      if (!reach[m][s]) continue;
      bool rest = true;
      for (std::size_t k = s; k < n && rest; ++k) rest = skippable(k);
      ok = rest;
    }
  }
  if (ok) return;

  const stream_plan& sp = *sv.plan;
  std::string what;
  std::string kind;
  if (last_ok < m) {
    const op_record& r = *sv.recvs[last_ok];
    kind = "payload";
    const std::size_t held = r.rep.error ? r.got.size() : std::min(r.rep.bytes, r.got.size());
    const std::vector<std::byte> prefix(r.got.begin(), r.got.begin() + static_cast<long>(held));
    what = strf("receive %zu (%s, %s) fits no message the rules allow: it holds %s", last_ok, r.name().c_str(),
                outcome(r).c_str(), describe_bytes(prefix).c_str());
    // The sends of that size, and where their bytes differ.
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t want = r.rep.error ? r.rep.message_size : r.rep.bytes;
      if (size[k] != want) continue;
      const long at = first_difference(prefix, *bytes[k]);
      if (at < 0) kind = "order";  // the bytes of a message, received out of its place
      what += strf("; send %zu has that size, %s", k,
                   at < 0 ? "and the same bytes" : strf("first differing byte %ld (got %02x, sent %02x)", at,
                                                       static_cast<unsigned>(prefix[at]),
                                                       static_cast<unsigned>((*bytes[k])[at])).c_str());
    }
  } else {
    kind = "lost";
    what = "a message that succeeded was never received, on a stream that lost nothing";
  }
  std::string detail = strf("stream side %u -> %u tag %u (%s; ended: %s)\n  sends:", sp.from, 1 - sp.from, sp.tag,
                            sv.lossy ? "lossy" : "lossless", sv.how_it_ended.c_str());
  for (std::size_t k = 0; k < n; ++k)
    detail += strf(" [%zu %zuB %s %s]", k, size[k], sv.sends[k] ? to_string(sv.sends[k]->mem) : "?",
                   sv.sends[k] ? outcome(*sv.sends[k]).c_str() : "unknown");
  detail += "\n  recvs:";
  for (std::size_t i = 0; i < m; ++i) {
    const op_record& r = *sv.recvs[i];
    detail += strf(" [%zu view %zu %s %s: %s]", i, r.size, to_string(r.mem), outcome(r).c_str(),
                   r.rep.error && !is(r.rep.error, gdr::errc::truncated)
                       ? "-"
                       : describe_bytes(std::vector<std::byte>(
                                            r.got.begin(), r.got.begin() + static_cast<long>(std::min(r.rep.bytes, r.got.size()))))
                             .c_str());
  }
  j.fail(kind, strf("stream %u->%u tag %u: %s\n  %s", sp.from, 1 - sp.from, sp.tag, what.c_str(), detail.c_str()));
  (void)seed;
}

}  // namespace stress
