/// \file
/// The protocol engine's class: its interface to endpoints and transports,
/// its state, and the declarations of its members, which are defined by
/// concern in the files beside this one (gdr/protocol/engine.hpp includes
/// them all; see its file comment for how the engine works).
#pragma once

#include <liburing.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/message.hpp>
#include <gdr/protocol/options.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/cancellable.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>

#include <gdr/protocol/engine/answers.hpp>
#include <gdr/protocol/engine/early_room.hpp>
#include <gdr/protocol/engine/fifo.hpp>
#include <gdr/protocol/engine/link.hpp>
#include <gdr/protocol/engine/op.hpp>
#include <gdr/protocol/engine/slots.hpp>
#include <gdr/protocol/engine/target.hpp>
#include <gdr/protocol/engine/withdrawals.hpp>

namespace gdr::detail::proto {

class engine {
 public:
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  scheduler& sched() const noexcept { return *sched_; }
  const protocol_options& options() const noexcept { return opts_; }
  /// The error new operations fail with (none while usable).
  std::error_code state_error() const noexcept {
    if (closing_ && !error_) return errc::closed;
    return error_;
  }
  transfer_path last_path() const noexcept { return last_path_; }
  /// The peer's limit from its hello (0 until it arrived).
  std::uint64_t peer_max_message() const noexcept { return peer_max_; }
  /// The counters (the transport's object, seen as the protocol's part).
  const protocol_stats& pstats() const noexcept { return *stats_; }
  /// The peer's capability bits from its hello.
  std::uint64_t peer_caps() const noexcept { return peer_caps_; }
  /// The peer's NIC domain whose keys this side's NIC uses (0: none).
  std::uint32_t direct_domain() const noexcept { return direct_domain_; }

  /// Rows a forced path excludes (`set_refused`): their operations fail
  /// with `errc::unsupported`.
  static constexpr std::uint8_t refuse_host = 1;    ///< host memory on both sides
  static constexpr std::uint8_t refuse_device = 2;  ///< device memory on either side (staged)
  /// Set once by the transport at set-up, from `decide_paths`.
  void set_refused(std::uint8_t rows) noexcept { refused_ = rows; }

  /// GPUDirect, CUDA IPC: the transport moves `Device` memory itself, so
  /// such operations are not staged (their rules: "Device memory with
  /// GPUDirect" in gdr/protocol/engine.hpp). Set once by the transport at
  /// set-up; `path`: what they report (`gpudirect_rdma`, `cuda_ipc`).
  void set_device_direct(bool on, transfer_path path = transfer_path::gpudirect_rdma) noexcept {
    device_direct_ = on;
    direct_path_ = path;
  }
  bool device_direct() const noexcept { return device_direct_; }

  /// Bounce buffers checked out now (tx, rx): zero when nothing staged is in flight.
  std::pair<std::size_t, std::size_t> bounce_in_use() const noexcept { return {tx_.in_use, rx_.in_use}; }

  /// The engine's state in one line, for a hang's diagnosis (what waits on
  /// which list, who holds each bounce slot, the credits): not stable.
  std::string describe() const;

  /// The endpoint is gone: abort (if still open); the engine frees itself
  /// once nothing is in flight and every operation has resumed.
  void abandon() noexcept;

  // ---------------------------------------------------------------- ops

  /// Starts `o` (from its await_suspend). True: pending; false: it
  /// completed at once (its result is set).
  bool begin(op& o) noexcept;

  /// A stop or a timeout reached `o` (its reason `why`). Loop thread,
  /// inside enter()/leave(). Handled at the end of the event (do_cancel),
  /// where the transport may be called.
  void cancel(op& o, std::error_code why) noexcept;

  // Every event runs between enter() and leave() (an event_scope). leave() resumes what
  // completed, makes the transport calls the event queued (the re-entrancy rule in
  // gdr/protocol/engine.hpp), lets the transport write what the resumed coroutines
  // queued, and frees an abandoned engine.
  void enter() noexcept { ++busy_; }
  void leave() noexcept;

 private:
  /// The stop of `o` ("Cancellation" in gdr/protocol/engine.hpp); the transport may be called.
  void do_cancel(op& o, std::error_code why) noexcept;

 public:
  void push_ready(op& o) noexcept;

  void note_attached() noexcept { ++attached_; }
  void note_detached() noexcept { --attached_; }

  /// Counts a finished operation. Loop thread.
  void record(op& o) noexcept;

 protected:
  /// `stats` is the transport's counters object (a `protocol_stats` or a
  /// type derived from it), owned by the transport.
  engine(scheduler& s, memory_registry& reg, const protocol_options& o, protocol_stats& stats, std::uint64_t caps);
  virtual ~engine();

  /// Sends the hello. The transport calls it once, when it is ready to
  /// write (before any other frame can be posted).
  void start_protocol() noexcept;

  // ---------------------------------------------------------------- transport hooks

  virtual void link_post(frame& f) noexcept = 0;
  virtual bool link_withdraw(frame& f) noexcept = 0;
  virtual bool link_committed(const frame& f) const noexcept = 0;
  virtual void link_resume() noexcept = 0;
  /// Stop placing the current payload. True: its memory is free now; false:
  /// `on_target_released()` comes when it is.
  virtual bool link_abort_target() noexcept = 0;
  virtual void link_shutdown() noexcept = 0;
  /// End the connection in order (see "Close" in gdr/protocol/engine.hpp). True: ending,
  /// quiet once it has; `link_shutdown()` may follow. False: shut down.
  virtual bool link_close() noexcept {
    link_shutdown();
    return false;
  }
  /// The end of an outermost event handler, after the ready operations
  /// resumed. True: the transport did something that may have completed
  /// operations (leave() goes round again).
  virtual bool link_flush() noexcept = 0;
  virtual bool link_quiet() const noexcept = 0;
  /// The endpoint closed and the transport is quiet: release the
  /// connection's resources (a socket) now rather than at destruction.
  virtual void link_release() noexcept = 0;
  /// The path of a payload this transport placed (`direct`: straight from
  /// the wire or the sender into the destination) or sent.
  virtual transfer_path link_rx_path(bool direct) const noexcept = 0;
  virtual transfer_path link_tx_path() const noexcept = 0;
  /// Direct device memory: can the transport move `n` bytes of it at `p`
  /// to the peer? Else the error the operation fails with at once, and why.
  virtual std::error_code link_check_device(const void* p, std::size_t n, const char** why) noexcept {
    (void)p, (void)n, (void)why;
    return {};
  }
  /// The eager fast path (`enable_send_now`; called only when link calls
  /// are allowed): posts eager frame `f` whole at once, its bytes copied or
  /// inline, with nothing queued before it (true: the send is done). False:
  /// `link_post` follows at once (it keeps what a short write wrote).
  virtual bool link_send_now(frame& f) noexcept { return (void)f, false; }
  /// Direct one-sided operations (see engine/direct.hpp): post put, get or
  /// atomic `o` with the NIC (the transport owns it until on_direct_done,
  /// which comes exactly once, from an event of its own), and take back one
  /// the NIC has not been given yet (true: no on_direct_done follows).
  virtual void link_direct(op& o) noexcept { on_direct_done(o, errc::unsupported); }
  virtual bool link_direct_withdraw(op& o) noexcept {
    (void)o;
    return false;
  }
  /// Frees the engine (the transport's object): `delete this`.
  virtual void destroy() noexcept = 0;

 public:
  /// The peer as this transport names it ("10.0.0.2:4791"), for messages and logs.
  virtual std::string peer_name() const = 0;

 protected:
  // ---------------------------------------------------------------- transport events

  /// A header arrived (see gdr/protocol/engine.hpp). It must have passed
  /// `valid(h, options().max_message)`: the transport checks what it reads
  /// from the wire (TCP's `parse_frame` does) once, not here again. Must
  /// not change any state when it pauses.
  rx_plan on_header(const header& h) noexcept;

  /// The current target's `want` bytes are in place (`direct`: not through
  /// a staging copy of the transport's).
  void on_placed(bool direct) noexcept;

  /// A placement stopped by link_abort_target() no longer uses its memory.
  void on_target_released() noexcept { release_target(std::exchange(aborted_, target{})); }
  /// The current placement completes later, while the transport reads on
  /// (see "Deferred placements" in gdr/protocol/engine.hpp): its ticket,
  /// or 0 when it must complete before the next header (then on_placed).
  std::uint32_t defer_placement() noexcept;
  /// Deferred placement `ticket` is over: its bytes are in place (`ok`),
  /// or never will be (the transport failed the connection first).
  void on_deferred_placed(std::uint32_t ticket, bool ok, bool direct) noexcept;

  /// Set once by a transport with direct one-sided operations: the NIC
  /// domain its peer exposes memory in (a put or get whose view carries a
  /// key of it goes to link_direct).
  void set_direct_domain(std::uint32_t domain) noexcept { direct_domain_ = domain; }
  /// Set once by a transport that implements `link_send_now`.
  void enable_send_now() noexcept { send_now_ = true; }
  /// Direct operation `o` is over: its bytes moved (`ec` empty) or not.
  void on_direct_done(op& o, std::error_code ec) noexcept;

  /// A kernel request of the transport completed: a close waiting for the
  /// transport to be quiet may finish.
  void on_io_done() noexcept { settle_close(); }

  /// Frame `f` is written (`ec` empty) or will never be (`ec`: the
  /// connection failed). Its payload memory is free.
  void on_sent(frame& f, std::error_code ec) noexcept;

  /// The connection broke (`errc::connection_lost`, `errc::protocol_error`,
  /// an errno code). Frames still posted come back through on_sent.
  void on_link_failed(std::error_code ec) noexcept { fail(ec); }

  /// Inside an event handler (between enter() and leave()).
  bool in_handler() const noexcept { return busy_ > 0; }
  bool failed() const noexcept { return static_cast<bool>(error_); }
  std::error_code error() const noexcept { return error_; }

 private:
  using target = placement;
  struct resume_node : remote_work {
    engine* self = nullptr;
  };

  /// Nothing is in flight and every operation has resumed (an abandoned engine may go).
  bool deletable() const noexcept;

  // ---------------------------------------------------------------- lists and the transport's calls
  //
  // Which list an operation is on is its `list_`, set only here.
  void enlist(op_list& l, op& o, bool front = false) noexcept;
  void delist(op& o) noexcept;

  // The re-entrancy rule: nothing done inside an event calls the transport.
  // Posts, withdrawals, aborts, resumes and the shutdown that an event
  // decides are queued and made at its end (drain(), from the outermost
  // leave()), when the transport has finished walking its own state.
  // Outside every event (an operation starting from await_suspend) they
  // are made at once.

  /// The transport may be called now.
  bool link_calls_now() const noexcept { return busy_ == 0 || draining_; }
  void due() noexcept { due_ = true; }

  /// Posts `f` now, or at the end of the event.
  void post(frame& f) noexcept;

  /// `f` is the engine's or the transport's until on_sent.
  static bool held_by_link(const frame& f) noexcept { return f.queued || f.in_outbox; }

  /// Takes `f` back: from the outbox at any time, from the transport only
  /// where it may be called. True: withdrawn (no on_sent will come).
  bool withdraw(frame& f) noexcept;

  /// The current placement's owner is gone: stop it (now, or at the end of
  /// the event if it is still dead then).
  void request_abort() noexcept;

  /// The placement in progress is for something that no longer wants it.
  bool current_target_dead() const noexcept;

  /// Takes a finishing `o` off the end-of-event queues (a stop or a finish
  /// queued for it must not reach it once it has resumed).
  void unlink_due(op& o) noexcept;

  /// Makes the transport calls the event queued, in order. True if it made
  /// any (what they complete is resumed by leave()).
  bool drain() noexcept;
  bool drain_due() noexcept;

  static rx_plan consumed() noexcept { return {}; }
  static rx_plan pause_plan() noexcept { return {rx_plan::action::pause, nullptr, 0, 0}; }
  static rx_plan fail_plan() noexcept { return {rx_plan::action::fail, nullptr, 0, 0}; }
  rx_plan place(target t, std::byte* dst, std::size_t want, std::uint64_t discard, int device = -1) noexcept;
  rx_plan drop(std::uint64_t n) noexcept;

  // ---------------------------------------------------------------- starting

  bool begin_recv(op& o) noexcept;

  /// A send, put or get.
  bool begin_out(op& o) noexcept;

  /// Puts `o`'s first frame on the wire (the peer's hello is known). True:
  /// pending; false: over, failed (`o.ec_`) or sent at once (the eager
  /// fast path, `link_send_now`; `ec_` clear).
  bool launch(op& o) noexcept;

  bool begin_close(op& o) noexcept;

  /// A put or get the transport's NIC moves (engine/direct.hpp).
  bool launch_direct(op& o) noexcept;

  /// Posts the close frame once nothing started before it is left to send.
  void maybe_post_close() noexcept;

  void cancel_send(op& o, std::error_code why) noexcept;

  /// Rendezvous send `s` ended before the peer's rtr came (its outcome is
  /// set): withdrawn at once; its announcement tells the peer (an
  /// rts_cancel, unless the rts could still be taken back), and answers a
  /// late rtr (engine/withdrawals.hpp).
  void end_announcement(op& s) noexcept;
  /// The peer answered `s`'s rts (its rtr, or an unasked rts_withdrawn):
  /// its announcement is over.
  void take_announcement(op& s) noexcept;
  /// An announcement's frame is back from the transport: what is due next
  /// goes (the rts_cancel, the answer to a late rtr), or it is freed.
  void announcement_sent(announcement& a, std::error_code ec) noexcept;
  void post_announcement(announcement& a, announcement::due what) noexcept;

  // ---------------------------------------------------------------- completing

  /// Decides `o`'s outcome (the first decision wins), takes it out of its
  /// list, and finishes it once the transport is done with its memory.
  void complete(op& o, std::error_code ec) noexcept;

  /// Finishes `o` if its outcome is decided and the transport no longer
  /// uses its memory; where that takes a call of the transport, at the end
  /// of the event.
  void try_finish(op& o) noexcept;

  void finish_now(op& o) noexcept;
  /// finish_now's end, for an operation none of whose frames, slots or
  /// copies are out.
  void finish_unlinked(op& o) noexcept;

  /// Takes `o`'s frames back from the transport where it allows. True when
  /// none is left with it.
  bool frames_released(op& o) noexcept;

  /// A late frame of the peer's is now recognised (withdrawals_), or,
  /// without memory for that (`ok` false), the endpoint fails.
  void remembered(bool ok) noexcept;

  // ---------------------------------------------------------------- failure

  /// The endpoint is unusable: fail everything with `ec` (in order). Frames
  /// the transport still holds come back through on_sent. `in_order`: the
  /// close frame went out or the peer's came; the transport ends the
  /// connection in order (link_close) instead of aborting it.
  void fail(std::error_code ec, bool in_order = false) noexcept;

  /// How the connection ends (fail, link_close, link_shutdown). Explicit,
  /// so that an abort reaches an orderly end still under way exactly once.
  enum class link_end : std::uint8_t {
    open,        // not ending
    close_due,   // end in order at the end of the event (drain)
    abort_due,   // shut down at the end of the event (drain)
    ending,      // link_close() is under way: quiet once it has ended
    shut,        // ended, or shut down
  };

  bool link_end_due() const noexcept { return link_end_ == link_end::close_due || link_end_ == link_end::abort_due; }

  /// Ends the connection now: in order, or by shutting it down.
  void end_link(bool in_order) noexcept;

  /// An orderly end under way (or due) becomes an abort (close's timeout or stop, the endpoint dropped).
  void abort_link() noexcept;

  /// A close succeeds once the connection has ended; it finishes when
  /// the transport is quiet.
  void settle_close() noexcept;

  /// Stops the placement in progress; its resources are released now or,
  /// if the kernel still writes into them, at on_target_released().
  void abort_current() noexcept;

  void release_target(const target& t) noexcept;
  /// Target `t`'s bytes are in place (on_placed's work, for a deferred one too).
  void placed(const target& t, bool direct) noexcept;

  // ---------------------------------------------------------------- receiving

  op* find_recv(std::uint64_t tag) noexcept;
  void take_recv(op& r) noexcept;

  /// Hands receive `o` the first message kept for its tag: none kept,
  /// `done` (received now: `o.ec_` says how), or `pending` (its rtr went,
  /// or its bytes are on their way into Device memory).
  enum class kept : std::uint8_t { none, done, pending };
  kept take_kept(op& o) noexcept;

  /// The sender withdrew the message that awaiting receive `r` had
  /// matched: `r` goes back in line for the next one, or fails with
  /// `errc::withdrawn` where that would break the order of its tag.
  void repost_recv(op& r) noexcept;

  /// The receive an eager message of `len` bytes with `tag` goes to. A
  /// GPUDirect `Device` receive ahead of it fails instead (`refuses_eager`):
  /// the message goes on to the next receive, or is kept.
  op* recv_for_eager(std::uint64_t tag, std::size_t len) noexcept;

  /// Hands kept eager bytes to receive `r` (one copy); returns its outcome.
  static std::error_code deliver_early(op& r, const early_msg& m) noexcept;

  /// Receive `r` takes the announced message `sid` of `size` bytes: it
  /// answers rtr with a token and the bytes it accepts.
  void match_rts(op& r, std::uint64_t size, std::uint64_t sid) noexcept;

  void resume_reading() noexcept;
  rx_plan pause_reading() noexcept;

  rx_plan rx_hello(const header& h) noexcept;

  /// The peer's handshake is complete (its hello, and its first credit
  /// where it counts them): what waited for it goes out.
  void handshake_done() noexcept;

  /// Room for more early messages at the peer. The first one ends the
  /// peer's handshake: what waited for it goes out.
  rx_plan rx_credit(const header& h) noexcept;

  /// A kept eager message of `len` bytes with room for its first `room`
  /// (all of it by default), or null when memory is short (the caller
  /// pauses reading).
  static early_msg* new_eager_msg(std::uint64_t tag, std::size_t len, std::size_t room = ~std::size_t{0}) noexcept;

  rx_plan rx_eager(const header& h) noexcept;

  rx_plan rx_rts(const header& h) noexcept;

  rx_plan rx_rtr(const header& h) noexcept;

  rx_plan rx_data(const header& h) noexcept;

  rx_plan rx_rts_cancel(const header& h) noexcept;

  /// Tells the sender of announcement `id` that no receive here will take
  /// it: the answer to its rts_cancel, or, unasked, from a closing side
  /// (rx_rts_withdrawn). In a frame of its own, not a reply slot: the
  /// sender's reply-slot credits count only puts and gets. Counted in the
  /// answer budget (engine/answers.hpp): the caller checked its room, or
  /// the answer is `owed` (the announcements kept when close() starts).
  void answer_withdrawn(std::uint64_t id, bool owed = false) noexcept;

  /// Receiving ends when close() starts: the messages kept here will never
  /// be received. Kept bytes are dropped; the senders of kept announcements
  /// learn it now, each by its own rts_withdrawn, and not from this side's
  /// close frame, which waits for this side's own announced sends (two ends
  /// closing at once with announcements nobody will receive each way waited
  /// for each other). Either way the room is granted back: a peer with
  /// sends waiting for credit must not wait for this side's close frame,
  /// which may be waiting for them.
  void drop_kept_messages() noexcept;

  rx_plan rx_rts_withdrawn(const header& h) noexcept;

  rx_plan rx_put_request(const header& h) noexcept;

  rx_plan rx_get_request(const header& h) noexcept;

  rx_plan rx_answer(const header& h) noexcept;
  rx_plan rx_atomic_request(const header& h) noexcept;

  // ---------------------------------------------------------------- the staged path
  //
  // Device memory moves through bounce buffers (`stage_slot`s, one pool per
  // direction): out through a device-to-host copy into a tx slot whose frame
  // then carries it, in through an rx slot the transport places a frame's
  // payload into, then a host-to-device copy. An operation moves as
  // segments of at most one chunk; each segment is a slot, and its op
  // counts the bytes done. `pump` hands segments to slots while slots are
  // free (an op waits in tx_wait_ otherwise) and posts the ready ones in
  // order; copies complete through the scheduler's copy engine
  // (`copy_done`). An op finishes only once none of its copies runs and it
  // holds no slot.

  // ---------------------------------------------------------------- GPUDirect
  //
  // On a GPUDirect endpoint the transport's NIC reads and writes `Device`
  // memory itself, so nothing is staged; instead the CPU must never touch
  // it. The engine keeps it out of every frame the CPU would copy (a send
  // from Device memory announces itself at any size; a Device receive
  // refuses eager bytes) and marks what only the NIC may move: frames
  // (`frame::nic_only`, `frame::device`) and placements (`rx_plan::device`).

  /// A GPUDirect Device receive cannot take `len` eager bytes (they are in
  /// host memory already, and only the CPU could copy them): it fails with
  /// this reason, and the message waits for another receive.
  static bool refuses_eager(op& r, std::size_t len) noexcept;

  /// This side can serve device memory (it has a copy engine).
  bool can_stage() const noexcept { return copy_engine::of(*sched_) != nullptr; }

  /// The segment of this side's own device memory: one chunk, or less if
  /// the peer's bounce buffers are smaller.
  std::size_t own_segment() const noexcept;

  /// The largest message `o` sends eager: the threshold, and from device
  /// memory within one bounce buffer (copied out whole, then sent).
  std::size_t eager_limit(const op& o) const noexcept;

  /// Whether `o` may start: its rows are not refused, and a staged one has
  /// a copy engine and its bounce buffers.
  std::error_code staging_check(op& o) noexcept;
  /// The operation's memory spaces are allowed here and what they need
  /// exists (staging_check); false: `o.ec_` says why. Host memory on an
  /// endpoint that forces no path needs no check (the common small
  /// operation: an error code returned through a call costs more than it).
  bool spaces_allowed(op& o) noexcept;

  /// Makes `p`'s slots, and its pinned memory if `mem`.
  std::error_code ensure_pool(stage_pool& p, bool mem) noexcept;

  stage_slot* take(stage_pool& p) noexcept;

  /// Gives slot `b` back (unlinking it from its op), then lets whoever
  /// waits for one go on.
  void release_slot(stage_slot& b) noexcept;

  void unlink_segment(op& o, stage_slot& b) noexcept;

  /// A slot came free: a paused reader may go on, and so may the ops
  /// waiting for one.
  void slot_freed(bool rx) noexcept;

  /// `o` is to be pumped at the end of the current event.
  void defer_pump(op& o) noexcept;

  /// What segment bookkeeping left for the end of the event: waiters for
  /// freed slots, and pumps. True if it did anything.
  bool run_deferred() noexcept;
  void resume_ready() noexcept;

  /// Gets of Device memory served in arrival order as tx bounce buffers
  /// come free, before this side's own operations (they hold the peer's
  /// reply-slot credits).
  void serve_waiting_gets() noexcept;

  /// Gives every waiting get's reply slot back (the endpoint failed).
  void drop_waiting_gets() noexcept;

  void kick_waiters(bool rx) noexcept;

  void wait_for_slot(op& o, bool rx) noexcept;
  void stop_waiting(op& o) noexcept;

  /// Queues a copy for slot `b`; `o` is the op whose memory it touches
  /// (null: a served request's). Its first copy is ordered after
  /// `op_options::after`.
  std::error_code start_copy(stage_slot& b, copy_engine::direction d, int device, void* dst, const void* src,
                             std::size_t n, op* o) noexcept;

  static void on_copy_done(copy_engine::completion* c, std::error_code ec) noexcept;

  void copy_done(stage_slot& b, std::error_code ec) noexcept;

  void copy_failed(op& o, std::error_code ec) noexcept;

  /// A served request's copy finished (`b.rx`: a put into device memory,
  /// answered now; else a get from it, sent from the bounce buffer now).
  void served_copy_done(stage_slot& b, reply_slot& s, std::error_code ec) noexcept;

  /// The transport is to place `len` bytes of `r`'s message (at `off`) into
  /// bounce buffer `b`, then drop `discard`.
  rx_plan place_in_bounce(op& r, stage_slot& b, std::size_t off, std::size_t len, std::uint64_t discard) noexcept;

  /// Bytes are in rx slot `b`: copy them to the device.
  void placed_in_bounce(stage_slot& b) noexcept;

  /// A counted op has all its bytes in place.
  void finish_counted(op& o, bool direct) noexcept;

  /// A kept eager message for device memory: copied into bounce buffers
  /// (as they come free), a chunk at a time, then to the device.
  void deliver_early_staged(op& o, early_msg* m) noexcept;

  void try_deliver_early(op& o) noexcept;

  /// A staged eager send: one chunk copied out, then sent.
  bool launch_staged_eager(op& o) noexcept;

  /// A put or get that touches device memory (either side): requests of at
  /// most one segment each, at most `depth` unanswered.
  bool launch_segmented(op& o) noexcept;

  void attach_segment(op& o, stage_slot& b, std::size_t off, std::size_t len) noexcept;

  /// Hands `o`'s next segments to free tx slots (copying device memory out
  /// into them) and posts those ready, in order.
  void pump(op& o) noexcept;

  /// Posts `o`'s segments whose bytes are ready, in offset order.
  void post_ready(op& o) noexcept;

  /// A segment's frame is written (or failed).
  void segment_sent(stage_slot& b, std::error_code ec) noexcept;

  /// Takes back what `o`'s segments still hold: frames not yet committed
  /// are withdrawn, idle slots freed. True once it holds none.
  bool release_segments(op& o) noexcept;

  /// An rtr for a send moved in segments (from device memory, or into the
  /// peer's device memory).
  rx_plan rtr_segmented(op& s, const header& h) noexcept;

  /// An answer to one request of a segmented put or get.
  rx_plan segment_answer(op& o, const header& h) noexcept;

  // ---------------------------------------------------------------- early credits
  //
  // Early credits: see the file comment of engine/two_sided.hpp.

  /// This side has taken one early message of `bytes` (eager) or an
  /// announcement (0): the peer may send it again.
  void owe(std::uint64_t bytes) noexcept;

  /// The error an operation whose frame failed with `ec` completes with:
  /// the endpoint's own if it has failed already.
  std::error_code failure_of(std::error_code ec) const noexcept { return error_ ? error_ : ec; }

  /// Sends what is owed once it is a quarter of the room (and no credit
  /// frame is on its way already).
  void maybe_grant() noexcept;

  /// `o` spent credit on a message the peer will never see: give it back.
  void refund(op& o) noexcept;

  /// A staged eager send's frame is posted (or it ended without one): the
  /// sends behind it may go.
  void release_order(op& o) noexcept;

  /// Sends that waited for credit go out, in order, while it lasts.
  void run_send_waiters() noexcept;

  // ---------------------------------------------------------------- credits
  //
  // Credits. A put or get request holds one of the target's reply slots
  // until its answer is written. The target says in its hello how many it
  // has; the initiator keeps that many requests unanswered at most, and a
  // request beyond them waits here (a whole put or get in credit_wait_, a
  // segment of a staged one by its op in credit_pumps_) until an answer
  // comes back. So requests never find the slots all taken by the peer's
  // own traffic, and puts and gets in both directions cannot stop each
  // other's readers.

  void credit_back() noexcept;
  /// Spends a credit on the request that bounce buffer `b` will carry.
  void take_credit(stage_slot& b) noexcept;
  void wait_for_credit(op& o) noexcept;

  /// Credits came back: whoever waits for one goes on, in order.
  void run_credit_waiters() noexcept;

  // ---------------------------------------------------------------- answers

  // Reply slots: see the file comment of engine/one_sided.hpp.

  reply_slot* take_slot() noexcept;

  /// No free slot: a new one if the credits allow it and memory is there,
  /// else the spare (when no slot could be allocated and it is free), else
  /// null (every slot is in use: the caller pauses).
  reply_slot* make_slot() noexcept;

  /// The error a put or get fails with for a refusing answer.
  static std::error_code answer_error(status st) noexcept;
  /// A bounce buffer of `p` for serving request `id` (reply slot `s`, lease
  /// `l` on device memory, `len` bytes). Null when none is free: the lease
  /// and the reply slot are given back, nothing changed (the caller pauses).
  stage_slot* bounce_for_request(stage_pool& p, reply_slot* s, access_lease& l, std::uint64_t id,
                                 std::size_t len) noexcept;

  /// Returns a slot taken a moment ago, without resuming a paused reader
  /// (the header that took it is about to pause).
  void put_back_slot(reply_slot* s) noexcept;

  void free_slot(reply_slot* s) noexcept;
  /// Performs the atomic slot `s` holds (its operands placed) and answers.
  void serve_atomic(reply_slot& s, std::uint64_t id) noexcept;
  void send_answer(reply_slot* s, msg type, std::uint64_t id, status st, const std::byte* payload,
                   std::size_t len, int device = -1) noexcept;

  // ---------------------------------------------------------------- resuming

  void post_resume() noexcept;

  static void on_resume_node(remote_work* w) noexcept;

  // ---------------------------------------------------------------- state

  scheduler* sched_;
  std::shared_ptr<const bool> sched_alive_;  // the scheduler's alive_flag()
  memory_registry* registry_;
  protocol_options opts_;
  protocol_stats* stats_;
  transfer_path last_path_ = transfer_path::none;
  std::error_code error_{};
  bool closing_ = false;
  bool abandoned_ = false;
  bool got_hello_ = false;
  bool paused_ = false;
  std::uint64_t peer_max_ = 0;
  std::uint64_t peer_caps_ = 0;
  std::uint64_t next_id_ = 1;
  std::uint64_t matches_ = 0;  // messages handed to receives so far (repost_recv)
  op* close_op_ = nullptr;
  bool close_posted_ = false;
  std::size_t rendezvous_out_ = 0;  // rendezvous sends whose data is posted, not yet written
  int busy_ = 0;
  std::size_t attached_ = 0;  // operations suspended and not yet resumed
  op* ready_head_ = nullptr;
  op* ready_tail_ = nullptr;
  resume_node resume_node_{};
  bool resume_posted_ = false;
  frame hello_{};
  target cur_{};
  target aborted_{};  // a placement stopped while the kernel wrote into it
  std::vector<std::pair<std::uint32_t, target>> deferred_;  // placements the transport completes later
  std::uint32_t next_ticket_ = 1;

  op_list held_{};           // waiting for the peer's hello
  op_list announced_{};      // rendezvous sends: rts posted
  op_list recvs_{};          // posted receives, unmatched
  op_list awaiting_data_{};  // receives that sent rtr
  op_list rma_{};            // puts and gets awaiting their answer
  fifo<early_msg, &early_msg::prev, &early_msg::next> early_{};
  std::size_t early_bytes_ = 0;
  withdrawals withdrawals_;  // the peer's late frames for what ended here first (dropped or answered)
  answer_budget answers_;    // the answers this side allocated for the peer, not yet written
  reply_pool replies_{};  // the reply slots this side made for the peer's requests (engine/slots.hpp)
  // ---- the staged path ----
  std::size_t chunk_ = 0;          // bytes per bounce buffer
  std::uint64_t peer_seg_ = 0;     // the peer's chunk (its hello), 0: no limit
  std::uint8_t refused_ = 0;       // rows a forced path excludes (refuse_host, refuse_device)
  bool device_direct_ = false;     // GPUDirect, CUDA IPC: Device memory is moved by the transport, not staged
  transfer_path direct_path_ = transfer_path::gpudirect_rdma;  // what those operations report
  std::size_t copies_ = 0;         // copies in flight (ops' and served requests')
  stage_pool tx_{};
  stage_pool rx_{};
  std::vector<op*> tx_wait_;       // ops waiting for a tx slot
  std::vector<op*> rx_wait_;       // ops waiting for an rx slot
  op_list staging_{};              // staged ops in no other list
  bool kick_tx_ = false;          // tx slots came free: waiters go on (run_deferred)
  bool kick_rx_ = false;
  bool deferred_due_ = false;     // one of kick_tx_, kick_rx_, pumps_, credit_due_ is set (run_deferred)
  std::vector<op*> pumps_;        // ops to pump at the end of the event
  early_room room_{};  // early credits, both ways, and the sends that wait for them (engine/early_room.hpp)
  // ---- credits: the peer's reply slots this side may still use ----
  std::uint64_t credits_ = 0;
  bool credit_due_ = false;        // credits came back and someone waits (run_deferred)
  op_list credit_wait_{};          // puts and gets waiting for a credit
  std::vector<op*> credit_pumps_;  // staged puts and gets whose next segment waits for one
  // ---- direct one-sided operations ----
  std::uint32_t direct_domain_ = 0;  // the peer's NIC domain (0: none)
  bool send_now_ = false;            // the transport has link_send_now (enable_send_now)
  op_list direct_{};                 // with the transport, or about to be (direct_due_)
  std::vector<op*> direct_due_;      // handed to link_direct at the end of the event
  // ---- the transport calls an event queued (drain) ----
  bool draining_ = false;
  /// Something waits for drain(): a frame in the outbox, a stop, a finish,
  /// an abort, the reader's resumption or the link's end. Set with each of
  /// them (`due`), so that drain() costs one test when nothing does.
  bool due_ = false;
  link_end link_end_ = link_end::open;
  bool abort_due_ = false;
  bool resume_due_ = false;
  frame* outbox_head_ = nullptr;
  frame* outbox_tail_ = nullptr;
  op* stops_head_ = nullptr;
  op* stops_tail_ = nullptr;
  op* finishes_head_ = nullptr;
  op* finishes_tail_ = nullptr;
};

}  // namespace gdr::detail::proto
