/// \file
/// `gdr::loopback`: two connected endpoints inside one process, for tests,
/// examples and the quickstart. The same operations and rules as every
/// transport (`gdr/protocol/endpoint.hpp`), no sockets: the transport hands
/// the protocol's frames from one end's scheduler to the other's.
///
/// \code
///   gdr::scheduler sched;
///   gdr::loopback::endpoint a, b;
///   std::tie(a, b) = gdr::loopback::make_pair(sched);  // (clang 14 cannot capture structured bindings)
///   gdr::sync_wait(sched, [&]() -> gdr::task<> {
///     std::array<int, 4> out{1, 2, 3, 4}, in{};
///     co_await a.send(gdr::host_view(out));             // kept by b: no receive yet
///     std::size_t n = co_await b.recv(gdr::host_view(in));  // 16 bytes, path host_eager
///   }());
///
/// (An operation starts when it is awaited, not when it is made: to have a
/// receive posted before a send, await both, e.g. with `gdr::when_all`.)
/// \endcode
///
/// How bytes move (and how many copies that is)
/// ============================================
/// Each direction of a pair is a queue of frames, guarded by one mutex per
/// pair. The sending end posts a frame (a header and a pointer to the
/// payload, which stays in the sender's memory); the receiving end's
/// scheduler takes it, and its protocol engine says where the payload goes:
/// the receiver's view (one `memcpy` straight from the sender's buffer,
/// `transfer_path::host_zero_copy`), or, for an early eager message, the
/// store of early messages (a second `memcpy` when the receive comes,
/// `host_eager`). The frame then goes back to the sender, whose operation
/// completes. A rendezvous message is announced first and copied straight
/// into the receive once it is posted. `put`/`get` are served by the peer's
/// engine from its registry, one `memcpy` between the views.
///
/// Threads and completion context
/// ==============================
/// Each end belongs to a scheduler: awaiting its operations is allowed only
/// on that scheduler's thread, and they resume there. The two ends may share
/// one scheduler or live on two schedulers on two threads; frames cross
/// with `scheduler::post` (thread-safe; the mutex orders the copy before the
/// sender's completion). An end's destruction aborts it: the peer's pending
/// operations fail with `errc::connection_lost`; `co_await ep.close()`
/// ends it in order (`errc::peer_closed` on the peer).
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <mutex>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/endpoint.hpp>
#include <gdr/protocol/engine.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transfer/path.hpp>

namespace gdr {

namespace loopback {

/// The loopback transport's tag, the key of its rows in the path table.
struct transport {
  static constexpr const char* name = "loopback";
  using stats_type = protocol_stats;
};

/// Tuning of a pair (both ends): the protocol layer's options.
using options = protocol_options;

/// Counters of one end (the protocol layer's).
using endpoint_stats = protocol_stats;

}  // namespace loopback

// The loopback transport's rows of the path table (gdr/transfer/path.hpp):
// one memcpy from the sender's buffer into the receiver's (early eager
// messages: two). Host and Pinned, either side, every operation:
// zero-copy. Device: unsupported until loopback stages through the copy
// engines. Remote<S> as the local side: unsupported.
template <>
inline constexpr const char* transport_name_v<loopback::transport> = "loopback";

template <class Op, class Local, class Remote>
struct path_table<loopback::transport, Op, Local, Remote>
    : detail::cpu_transport_rows<loopback::transport, Op, Local, Remote> {};

namespace detail::lb {

using proto::frame;
using frame_list = proto::fifo<frame, &frame::prev, &frame::next>;

class end;

/// Where a frame is (`frame::where`), under the pair's mutex.
enum where_t : std::uint8_t {
  nowhere = 0,
  outbound = 1,  // in its direction's queue, not taken yet
  taken = 2,     // the peer is placing it
  returning = 3, // on its way back to its sender (done_ queue)
};

/// The state both ends share. Guarded by `mu`.
struct pair_state {
  std::mutex mu;
  frame_list queue[2];    // queue[s]: frames from end s, for end 1 - s
  frame_list done[2];     // done[s]: end s's frames, back from the peer
  std::error_code done_ec[2];  // done[s] frames came back with this error (the peer is gone)
  end* ends[2] = {nullptr, nullptr};  // null once that end has shut down (takes no frames)
  end* obj[2] = {nullptr, nullptr};   // null once that end's object is gone
  bool rx_posted[2] = {false, false};  // end s's receive node is posted
  bool done_posted[2] = {false, false};
  bool peer_gone[2] = {false, false};  // end s is to learn that its peer went away
};

/// One end: the loopback transport under a protocol engine.
class end final : public proto::engine {
 public:
  end(scheduler& s, memory_registry& reg, const loopback::options& o, std::shared_ptr<pair_state> p, int side)
      : engine(s, reg, o, stats_, proto::caps::host), pair_(std::move(p)), side_(side) {
    rx_node_.self = this;
    rx_node_.run = &on_rx;
    done_node_.self = this;
    done_node_.run = &on_done;
  }

  ~end() override {
    std::lock_guard lock(p().mu);
    p().obj[side_] = nullptr;
  }

  /// Both ends exist: say hello.
  void start() noexcept { start_protocol(); }

 private:
  struct node : remote_work {
    end* self = nullptr;
  };

  pair_state& p() const noexcept { return *pair_; }
  int peer() const noexcept { return 1 - side_; }

  void destroy() noexcept override { delete this; }

 public:
  std::string peer_name() const override { return side_ == 0 ? "loopback end 1" : "loopback end 0"; }

 private:

  // ---------------------------------------------------------------- the engine's hooks

  void link_post(frame& f) noexcept override {
    f.queued = true;
    std::lock_guard lock(p().mu);
    if (shut_ || p().ends[peer()] == nullptr) {
      // Nothing will take it: hand it back from the loop (an operation
      // must not complete inside the call that started it).
      f.where = returning;
      p().done[side_].push_back(&f);
      if (!p().done_ec[side_]) p().done_ec[side_] = errc::connection_lost;
      post_done_locked(side_);
      return;
    }
    f.where = outbound;
    f.sealed = false;
    p().queue[side_].push_back(&f);
    post_rx_locked(peer());
  }

  bool link_withdraw(frame& f) noexcept override {
    std::lock_guard lock(p().mu);
    if (f.sealed) return false;  // the peer took it: on_sent comes
    switch (f.where) {
      case outbound: p().queue[side_].erase(&f); break;
      case returning: p().done[side_].erase(&f); break;
      default: return false;
    }
    f.where = nowhere;
    f.queued = false;
    return true;
  }

  bool link_committed(const frame& f) const noexcept override {
    std::lock_guard lock(p().mu);
    return f.sealed;
  }

  void link_resume() noexcept override {
    std::lock_guard lock(p().mu);
    if (paused_) {
      paused_ = false;
      post_rx_locked(side_);
    }
  }

  // Placement is a memcpy inside one handler: never in progress here.
  bool link_abort_target() noexcept override { return true; }

  void link_shutdown() noexcept override {
    std::lock_guard lock(p().mu);
    if (shut_) return;
    shut_ = true;
    p().ends[side_] = nullptr;
    // Our frames nobody took come back with the error; the peer's frames
    // queued for us go back to it, and it learns we are gone.
    std::error_code ec = error();
    if (!p().done_ec[side_]) p().done_ec[side_] = ec;
    if (return_untaken(side_)) post_done_locked(side_);
    if (p().obj[peer()] != nullptr) {
      // The peer's frames queued for us will never be taken. If it closed
      // (we took its close frame), they came after that close: they fail
      // as its close does, with closed, not as a broken connection.
      if (!p().done_ec[peer()]) p().done_ec[peer()] = ec == errc::peer_closed ? errc::closed : errc::connection_lost;
      if (return_untaken(peer())) post_done_locked(peer());
    }
    // The peer learns that we are gone, unless it is the one that closed
    // (it fails with errc::closed once its close frame is back).
    if (p().ends[peer()] != nullptr && ec != errc::peer_closed) {
      p().peer_gone[peer()] = true;
      post_rx_locked(peer());
    }
  }

  /// Moves end `s`'s frames that nobody took to its done queue. Under the
  /// mutex. True if any moved.
  bool return_untaken(int s) noexcept {
    bool any = false;
    for (frame* f = p().queue[s].head; f != nullptr;) {
      frame* next = f->next;
      if (f->where == outbound) {  // a frame being taken is returned by the taker
        p().queue[s].erase(f);
        f->where = returning;
        p().done[s].push_back(f);
        any = true;
      }
      f = next;
    }
    return any;
  }

  bool link_flush() noexcept override { return false; }

  bool link_quiet() const noexcept override {
    std::lock_guard lock(p().mu);
    return !p().rx_posted[side_] && !p().done_posted[side_] && p().done[side_].empty() &&
           p().queue[side_].empty();
  }

  void link_release() noexcept override {}

  transfer_path link_rx_path(bool) const noexcept override { return transfer_path::host_zero_copy; }
  transfer_path link_tx_path() const noexcept override { return transfer_path::host_zero_copy; }

  // ---------------------------------------------------------------- moving frames

  void post_rx_locked(int s) noexcept {
    end* e = p().ends[s];
    if (e == nullptr || p().rx_posted[s]) return;
    p().rx_posted[s] = true;
    e->sched().post(&e->rx_node_);
  }
  void post_done_locked(int s) noexcept {
    if (p().done_posted[s]) return;
    end* e = p().obj[s];
    if (e == nullptr) return;
    p().done_posted[s] = true;
    e->sched().post(&e->done_node_);
  }

  /// Takes the peer's frames, in order, and hands them to the engine.
  static void on_rx(remote_work* w) noexcept {
    end* e = static_cast<node*>(w)->self;
    proto::event_scope ev(*e);  // its end may free e
    e->receive();
    e->on_io_done();
  }

  void receive() noexcept {
    frame_list& in = p().queue[peer()];
    for (;;) {
      frame* f = nullptr;
      {
        std::lock_guard lock(p().mu);
        if (p().peer_gone[side_]) {
          p().peer_gone[side_] = false;
          p().rx_posted[side_] = false;
        } else if (shut_ || paused_ || in.empty()) {
          p().rx_posted[side_] = false;
          break;
        } else {
          f = in.head;
          f->where = taken;
          f->sealed = true;
        }
      }
      if (f == nullptr) {
        on_link_failed(errc::connection_lost);
        break;
      }
      proto::rx_plan plan = on_header(f->hdr);
      if (plan.act == proto::rx_plan::action::pause) {
        std::lock_guard lock(p().mu);
        f->where = outbound;  // stays at the head; offered again after link_resume
        f->sealed = false;
        paused_ = true;
        p().rx_posted[side_] = false;
        break;
      }
      if (plan.act == proto::rx_plan::action::place && plan.want != 0)
        std::memcpy(plan.dst, f->payload, plan.want);
      if (plan.act == proto::rx_plan::action::place) on_placed(true);
      {
        std::lock_guard lock(p().mu);
        in.erase(f);
        f->where = returning;
        p().done[peer()].push_back(f);
        post_done_locked(peer());
      }
      if (plan.act == proto::rx_plan::action::fail && !failed()) on_link_failed(errc::protocol_error);
    }
  }

  /// Frames back from the peer: their operations may complete.
  static void on_done(remote_work* w) noexcept {
    end* e = static_cast<node*>(w)->self;
    proto::event_scope ev(*e);  // its end may free e
    e->take_back();
    e->on_io_done();
  }

  void take_back() noexcept {
    for (;;) {
      frame* f = nullptr;
      std::error_code ec;
      {
        std::lock_guard lock(p().mu);
        f = p().done[side_].pop_front();
        if (f == nullptr) {
          p().done_posted[side_] = false;
          break;
        }
        f->where = nowhere;
        // A frame the peer consumed succeeded even if the peer went away
        // afterwards; one handed back untaken carries the error.
        ec = f->sealed ? std::error_code{} : p().done_ec[side_];
      }
      // Handed back because the peer is gone: the connection failed, and
      // the endpoint says so before this frame's operation completes (as
      // TCP's does), not after, when the peer-gone event comes round.
      if (ec == errc::connection_lost) on_link_failed(ec);
      on_sent(*f, ec);
    }
  }

  std::shared_ptr<pair_state> pair_;
  int side_;
  protocol_stats stats_{};
  node rx_node_{};
  node done_node_{};
  bool paused_ = false;  // guarded by the pair's mutex
  bool shut_ = false;    // guarded by the pair's mutex
};

}  // namespace detail::lb

namespace loopback {

/// Awaitable of the endpoint's operations (see `gdr::op_awaitable`).
using transfer_awaitable = gdr::op_awaitable;

/// One end of an in-process connection. Move-only; destroying it aborts it.
using endpoint = basic_endpoint<transport>;

/// Makes a connected pair whose ends live on two schedulers (two threads, or
/// the same one). `registry` is consulted for the peer's `put`/`get` by
/// both ends (one process, one table). Throws `std::bad_alloc`, or
/// `gdr::error` (`errc::unsupported`) when `opts.force` asks for a path this
/// transport does not offer.
///
/// \code
///   gdr::scheduler sa, sb;   // run on two threads
///   auto [a, b] = gdr::loopback::make_pair(sa, sb);
/// \endcode
inline std::pair<endpoint, endpoint> make_pair(scheduler& a, scheduler& b, memory_registry& registry = default_registry(),
                                               const options& opts = {}) {
  // What each row does by size (GDR_LOG=path): one memcpy from the sender's
  // buffer into the receiver's view, or into the early store first when the
  // receive is not posted yet.
  auto note = [&opts](op_kind k, bool device) -> std::string {
    using gdr::detail::proto::size_text;
    if (device) return gdr::detail::proto::staged_note(opts);
    const std::string t = size_text(opts.rendezvous_threshold);
    switch (k) {
      case op_kind::send:
      case op_kind::recv:
        return "up to " + t + " eager, above rendezvous; copied once from the sender's buffer into the view "
               "(host-zero-copy), or first into the early store when it came before its receive (host-eager)";
      case op_kind::put:
      case op_kind::get: return "copied once between your buffer and the peer's memory";
    }
    return {};
  };
  auto plan = gdr::detail::proto::decide_paths<transport>(opts.force, "pair", note);
  if (!plan) throw gdr::error(plan.error(), "gdr::loopback::make_pair: the forced path is not one this transport offers");
  auto st = std::make_shared<gdr::detail::lb::pair_state>();
  auto* ea = new gdr::detail::lb::end(a, registry, opts, st, 0);
  gdr::detail::lb::end* eb = nullptr;
  try {
    eb = new gdr::detail::lb::end(b, registry, opts, st, 1);
  } catch (...) {
    delete ea;
    throw;
  }
  {
    std::lock_guard lock(st->mu);
    st->ends[0] = st->obj[0] = ea;
    st->ends[1] = st->obj[1] = eb;
  }
  ea->set_refused(plan->refused);
  eb->set_refused(plan->refused);
  ea->start();
  eb->start();
  return {endpoint(ea), endpoint(eb)};
}

/// Makes a connected pair whose ends both live on scheduler `s`.
inline std::pair<endpoint, endpoint> make_pair(scheduler& s, memory_registry& registry = default_registry(),
                                               const options& opts = {}) {
  return make_pair(s, s, registry, opts);
}

}  // namespace loopback

}  // namespace gdr
