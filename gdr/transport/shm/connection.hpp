/// \file
/// The shared-memory transport behind `shm::endpoint`: two processes of one
/// node, each writing frames into a ring the other maps (ring.hpp), a Unix
/// socket between them whose hang-up is the peer's end, and a bell (an
/// eventfd) per side to wake a sleeping scheduler. It moves the protocol
/// layer's frames (`gdr/protocol/engine.hpp`) and nothing else: matching,
/// rendezvous, cancellation and failure rules live there. Its members are
/// defined in io.hpp beside it.
///
/// How it works
/// ============
/// A `connection` lives on the heap and belongs to one scheduler; everything
/// runs on that scheduler's thread.
///
/// Writer. The engine posts frames (a header and a pointer to the payload)
/// into one FIFO. The writer copies each frame, the TCP transport's 64-byte
/// wire header (gdr/transport/tcp/frame.hpp) and then its payload, into the
/// ring as far as there is room, publishing the ring's head after each
/// piece, so that the reader copies a large payload out while the rest is
/// still being copied in. A frame is *sealed* (numbered, committed) when its
/// first byte enters the ring; it is done (`on_sent`) when its last byte is
/// in. Frames posted inside an event handler are written at its end
/// (`link_flush`); frames posted from outside one (a coroutine's first
/// `co_await`) are copied at once and completed from the loop, since an
/// operation must not complete before it has suspended. A writer short of
/// room waits for the reader to give it back (the loop polls the ring; a
/// sleeping writer sets its flag and the reader rings its bell).
///
/// Single copy. A payload of `endpoint_options::single_copy_threshold` bytes
/// or more goes into the ring as its address only (8 bytes after the
/// header), where the handshake found that the peer may read this process:
/// the reader copies it straight from the writer's memory into its place
/// (`process_vm_readv`), then counts it in the ring's `copied`. The writer
/// keeps such a frame, and every frame written after it, on its `sent_`
/// list until the count says the reader has copied it: frames complete in
/// order, and a payload's memory is the sender's again only once the peer
/// is done reading it: counted, or, when the connection ends before, once
/// the peer has ended (a shut-down connection ends only its own half and
/// waits for the peer's hang-up, at most `close_linger`). A frame written
/// after the peer's hang-up (the peer, ending, drops what it reads) waits
/// for nothing: `sent_` is empty whenever the peer's end has been taken.
///
/// Device memory by CUDA IPC (`endpoint_options::device`, agreed in the
/// handshake). The engine then moves `Device` memory directly
/// (`engine::set_device_direct`): a frame whose payload is this process's
/// device memory goes into the ring as its header (byte 13, reserved in
/// the TCP format, set to 1) and a descriptor: the allocation exported by
/// the copy engine (`copy_engine::ipc_export`: the driver's handle, base,
/// size, buffer id, GPU, pid) and the payload's offset in it. gdr's own
/// allocations (the virtual memory API) travel as a file descriptor
/// instead: the writer passes it over the socket (`SCM_RIGHTS`, with the
/// allocation's id and base) before it writes the frame, and marks the
/// frame with 2; the reader takes the next descriptor off the socket when
/// it reads such a frame (it is there: the writer's `sendmsg` returned
/// before the frame was in the ring) and checks it names that allocation.
/// The reader keeps the last 16 such descriptors in slots the writer
/// assigns, so an allocation sent again goes as mark 3 and its slot, with
/// nothing passed. When this process frees such an allocation (the copy
/// engine's `ipc_frees` moves), the writer names the slots whose
/// allocation is gone in the ring's `released` bits at its next poll; the
/// reader closes those descriptors, has its copy engine let the mappings
/// go (`ipc_release`, once no copy uses them) and clears the bits, and no
/// descriptor goes into a slot before its bit is clear. When all 16 are
/// taken, the writer passes a new descriptor into the least recently used
/// slot and forgets the allocation it held; the reader, taking the new one,
/// lets the old one go the same way (the writer would never name it when
/// it is freed). So every allocation the peer may hold mapped is in the
/// writer's table, or its slot holds a replacement the reader takes with
/// the frame that names it, and a peer never keeps memory this side freed
/// (the tables and this invariant: fd_table.hpp). A full socket holds the
/// writer back (`sock_blocked_`, tried again after 100 us) and nothing
/// else. The reader checks the
/// descriptor against the header and the peer, and has its copy engine
/// copy the bytes straight out of the peer's allocation into their place
/// (`copy_engine::ipc_copy`: imported once, then cached). It reads on while
/// the copy runs when the engine defers the placement (a whole operation's
/// payload, a served put) and the next frame may pass it: the next
/// descriptor frame (its copy queues behind on the same stream, so
/// consecutive messages' copies run back to back), an empty rts, rtr,
/// credit or put ack, or a message whose bytes are in the ring; anything
/// else (a close, a put with its bytes in the ring, a get or atomic
/// request that must see the puts before it) waits until the copies are
/// done (gpu_copies.hpp). Each copy, in order, is then counted in
/// `copied`, as a single copy, and the writer completes the frame. Host
/// bytes whose place is `Device` memory (a host send into a `Device`
/// receive, a put into a `Device` registration) are copied by the GPU out
/// of the ring, a contiguous piece at a time, each consumed once its copy
/// is done.
///
/// Reader. The connection is one of its scheduler's pollers: each loop
/// iteration it looks at the peer's ring, and copies what arrived: a header
/// goes to the engine (`on_header`), which says where its payload goes, and
/// the payload is copied from the ring into it. While the engine pauses the
/// reader (back-pressure), nothing is consumed, and the writer is held back
/// by the ring filling up. A scheduler that sleeps arms its bell read (an
/// io_uring read of its eventfd) and sets its waiting flag in the ring first
/// (the flag protocol in ring.hpp).
///
/// Liveness. The Unix socket carries nothing after the handshake but those
/// descriptors. The
/// connection keeps a poll for its hang-up in flight: the peer's process
/// ending (killed or not) closes its socket, and the kernel reports it at
/// once. What the peer wrote before it ended is still read (the mapping
/// stays); if that does not end with its close frame, every pending
/// operation fails with `errc::connection_lost`.
///
/// Orderly end: after the close frames, each side shuts its socket for
/// writing and reads (and drops) what the peer still writes until the
/// peer's hang-up, bounded by `endpoint_options::close_linger`.
#pragma once

#include <liburing.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/protocol/engine.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transport/shm/fd_table.hpp>
#include <gdr/transport/shm/options.hpp>
#include <gdr/transport/shm/ring.hpp>
#include <gdr/transport/tcp/frame.hpp>

namespace gdr {

namespace detail::shm {

using gdr::shm::endpoint_options;
using gdr::shm::endpoint_stats;
using gdr::shm::fd_handle;
using proto::frame;
namespace wire = gdr::tcp::wire;

/// What the handshake hands a connection: the socket, both rings mapped,
/// this side's bell and the peer's.
struct link_parts {
  fd_handle sock;
  mapping tx_segment;  ///< the ring this side writes (its own memfd)
  mapping rx_segment;  ///< the ring the peer writes
  std::size_t tx_capacity = 0;  ///< the ring's capacity this side chose
  std::size_t rx_capacity = 0;  ///< the peer's ring's, as checked at set-up (never read from it again)
  fd_handle bell;       ///< this side's eventfd (read while sleeping)
  fd_handle peer_bell;  ///< the peer's (written to wake it)
  int peer_pid = 0;
  bool peer_reads_me = false;        ///< this side's large payloads go as addresses
  bool i_read_peer = false;          ///< the peer's large payloads come as addresses...
  std::size_t peer_single_copy = 0;  ///< ... from this size on
  bool device_ipc = false;           ///< Device memory moves by CUDA IPC (both sides agreed)
};

/// One shared-memory link: the transport under a protocol engine. See the
/// file comment.
class connection final : public proto::engine {
 public:
  /// Bytes of a large payload copied into the ring between two publishes
  /// of its head (the reader starts copying out meanwhile).
  static constexpr std::size_t piece = 64 * 1024;

  /// Takes over the handshake's parts, says hello and starts reading. Call
  /// on `s`'s thread, or before `s` runs. Throws `std::bad_alloc`.
  connection(scheduler& s, link_parts p, memory_registry& reg, const endpoint_options& o)
      : engine(s, reg, o.protocol, stats_, proto::caps::host), parts_(std::move(p)), opts_(o) {
    tx_ = ring(parts_.tx_segment.get(), parts_.tx_capacity);
    rx_ = ring(parts_.rx_segment.get(), parts_.rx_capacity);
    stats_.peer_reads_me = parts_.peer_reads_me;
    stats_.reads_peer = parts_.i_read_peer && parts_.peer_single_copy != 0;
    stats_.device_ipc = parts_.device_ipc;
    if (parts_.device_ipc) {
      ce_ = copy_engine::of(s);
      set_device_direct(true, transfer_path::cuda_ipc);
    }
    ring_done_.self = this;
    ring_done_.done = &on_ring_done;
    for (ipc_job& j : ipc_jobs_) {
      j.self = this;
      j.done = &on_ipc_done;
    }
    fence_done_.self = this;
    fence_done_.done = &on_fence_done;
    poller_.self = this;
    bell_op_.self = this;
    bell_op_.complete = &on_bell;
    watch_op_.self = this;
    watch_op_.complete = &on_watch;
    linger_op_.self = this;
    linger_op_.complete = &on_linger;
    kick_.self = this;
    kick_.run = &on_kick;
    sched().add_poller(poller_);
    polling_ = true;
    live_ = true;
    arm_watch();
    held_ = true;  // hello and the first credit leave together
    start_protocol();
    held_ = false;
    write_some(false);
  }

  const endpoint_stats& stats() const noexcept { return stats_; }
  int peer_pid() const noexcept { return parts_.peer_pid; }
  /// The parser's reason for the last protocol error, for diagnostics.
  gdr::tcp::frame_status protocol_reason() const noexcept { return protocol_reason_; }

  std::string peer_name() const override { return "pid " + std::to_string(parts_.peer_pid) + " (shared memory)"; }

 private:
  struct conn_op : operation {
    connection* self = nullptr;
  };
  struct kick_node : remote_work {
    connection* self = nullptr;
  };
  struct gpu_node : copy_engine::completion {
    connection* self = nullptr;
  };
  /// A piece of the ring being copied into Device memory (the reader waits).
  struct ring_job {
    bool active = false;
    bool aborted = false;  // the engine stopped the placement: release, do not place
    std::size_t bytes = 0;
  };
  /// A CUDA IPC frame's turn, in the order read: its copy out of the
  /// peer's memory, then its count in `copied` and its placement's end.
  struct ipc_job : copy_engine::completion {
    connection* self = nullptr;
    std::uint32_t ticket = 0;  // the engine's deferred placement; 0: the current one (the reader waits)
    bool copying = false;      // false: a dropped payload's turn, nothing to copy
    bool finished = false;
    bool aborted = false;      // the engine stopped the current placement: release, do not place
    std::error_code ec;
  };
  /// CUDA IPC copies in flight at most (the reader waits at the next).
  static constexpr std::uint32_t max_ipc_jobs = 32;
  struct ring_poller final : poller {
    connection* self = nullptr;
    poll_status poll() noexcept override { return self->poll_ring(); }
    const char* name() const noexcept override { return "shm-ring"; }
  };
  /// Which list holds a posted frame (`frame::where`).
  enum where_t : std::uint8_t { nowhere = 0, in_tx = 1, in_done = 2, in_dropped = 3, in_sent = 4 };
  /// Where the reader is putting the current payload.
  struct rx_target {
    bool active = false;
    std::byte* dst = nullptr;
    std::size_t want = 0;
    std::size_t done = 0;
    std::uint64_t discard = 0;
    int device = -1;  // dst is Device memory of this GPU: the GPU copies it out of the ring
    stream_order after{};  // its first GPU copy waits for this stream's work (the operation's `after`)
  };

  ~connection() override {
    if (polling_) sched().remove_poller(poller_);
  }
  void destroy() noexcept override { delete this; }

  // ---------------------------------------------------------------- the engine's hooks

  void link_post(frame& f) noexcept override;
  bool link_withdraw(frame& f) noexcept override;
  bool link_committed(const frame& f) const noexcept override { return f.queued && f.sealed; }
  void link_resume() noexcept override {
    if (rx_paused_) {
      rx_paused_ = false;
      kick();  // the loop reads again (and a sleeping one wakes)
    }
  }
  bool link_abort_target() noexcept override {
    // Host payloads are copied inside one event: nothing is in flight into
    // them. A GPU copy may be: the memory is free once it completes.
    if (tgt_.active) {
      skip_ += (tgt_.want - tgt_.done - ring_copy_.bytes) + tgt_.discard;
      tgt_ = {};
    }
    if (ring_copy_.active) {
      ring_copy_.aborted = true;
      return false;
    }
    if (ipc_current_) {
      ipc_jobs_[(ipc_head_ + ipc_count_ - 1) % max_ipc_jobs].aborted = true;  // the newest
      return false;
    }
    return true;
  }
  std::error_code link_check_device(const void* p, std::size_t n, const char** why) noexcept override {
    copy_engine::ipc_memory m;
    std::uint64_t off = 0;
    return ce_ != nullptr ? ce_->ipc_export(p, n, m, off, why) : std::error_code(errc::unsupported);
  }
  void link_shutdown() noexcept override;
  bool link_close() noexcept override;
  bool link_flush() noexcept override {
    if (!write_deferred_) return false;
    write_deferred_ = false;
    write_some(true);
    return true;
  }
  bool link_quiet() const noexcept override {
    return !ending_ && !bell_inflight_ && !watch_inflight_ && !linger_inflight_ && !kick_posted_ &&
           done_.empty() && dropped_.empty() && sent_.empty() && !gpu_busy() && !fence_inflight_;
  }
  void link_release() noexcept override;
  transfer_path link_rx_path(bool) const noexcept override { return transfer_path::shared_memory; }
  transfer_path link_tx_path() const noexcept override { return transfer_path::shared_memory; }

  // ---------------------------------------------------------------- writer

  /// Copies what fits of the queued frames into the ring. `in_event`: inside
  /// an event handler, where finished frames complete at once; else they
  /// complete from the loop (kick).
  void write_some(bool in_event) noexcept;
  /// Does `f` go as its payload's address (see "Single copy")?
  bool single_copy_out(const frame& f) const noexcept {
    return parts_.peer_reads_me && f.hdr.length != 0 && f.hdr.length >= opts_.single_copy_threshold;
  }
  /// Does the peer's frame with header `h` come as an address?
  bool single_copy_in(const proto::header& h) const noexcept {
    return parts_.i_read_peer && parts_.peer_single_copy != 0 && h.length != 0 && h.length >= parts_.peer_single_copy;
  }
  /// Does `f` go as a CUDA IPC descriptor (its payload is this process's
  /// device memory)?
  bool ipc_out(const frame& f) const noexcept { return parts_.device_ipc && f.device >= 0 && f.hdr.length != 0; }
  /// A CUDA IPC frame's body: the exported allocation and the offset.
  static constexpr std::size_t ipc_body = copy_engine::ipc_memory::wire_size + sizeof(std::uint64_t);
  /// The header byte that marks a CUDA IPC frame (reserved in the TCP
  /// format): `copy_engine::ipc_kind` (1, the driver's handle in the
  /// descriptor; 2, a file descriptor passed over the socket).
  static constexpr std::size_t ipc_mark = 13;
  static bool ipc_marked(std::byte b) noexcept {
    return b == std::byte{1} || b == std::byte{2} || b == std::byte{3};
  }
  /// The mark of a descriptor frame whose file descriptor the peer holds
  /// already (in the slot the descriptor's first byte names).
  static constexpr std::byte fd_held{3};
  /// Bytes `f` takes in the ring.
  std::size_t ring_bytes(const frame& f) const noexcept {
    if (ipc_out(f)) return wire::header_size + ipc_body;
    return wire::header_size + (single_copy_out(f) ? sizeof(std::uint64_t) : static_cast<std::size_t>(f.hdr.length));
  }
  /// Exports the device memory of the frame about to be sealed into
  /// `ipc_out_` (and, for an allocation that travels as a file descriptor,
  /// passes the descriptor over the socket first, so that it is there
  /// before the frame is). False: not now (the socket is full:
  /// `sock_blocked_`), or it cannot be shared: the connection fails (from
  /// the loop) with `errc::unsupported`.
  bool export_ipc(const frame& f) noexcept;
  /// Passes `m.fd` over the socket, with its allocation's id and base and
  /// the peer's slot to keep it in.
  bool pass_fd(const copy_engine::ipc_memory& m, std::uint32_t slot) noexcept;
  /// Takes the descriptor the peer passed for the frame whose allocation is
  /// `m` (the next message on the socket) into slot `slot` (what the slot
  /// held is let go: fd_table.hpp); -1 when it is not there or not that
  /// allocation's (a protocol error).
  int take_fd(const copy_engine::ipc_memory& m, std::uint32_t slot) noexcept;
  /// This process freed an allocation (the copy engine's `ipc_frees`
  /// moved): the slots of the peer's whose allocation is gone are named in
  /// the ring's `released` bits, and emptied here.
  void note_frees() noexcept;
  /// The peer freed the allocations of the slots in `mask`: their
  /// descriptors and mappings go, and the bits are cleared.
  void take_releases(std::uint32_t mask) noexcept;
  /// The peer's allocation `a` left its slot (freed, or replaced): its
  /// mapping here goes (once no copy uses it).
  void let_go(const fd_table_in::allocation& a) noexcept {
    if (ce_ != nullptr) ce_->ipc_release(parts_.peer_pid, a.base, a.id);
  }
  /// The CUDA IPC frame `f` may go once the work queued on its GPU before
  /// it (the legacy default stream, and its operation's `after` stream) is
  /// done: true when it is; false while the fence runs (the writer waits;
  /// `on_fence_done` goes on) or when it failed.
  bool fence(frame& f) noexcept;
  static void on_fence_done(copy_engine::completion* c, std::error_code ec) noexcept;
  /// A frame is in the ring: done now, or once the single-copy frames before
  /// it (and itself) are copied. Its `seq` (its wire number is in
  /// `encoded` by then) becomes the count of single-copy frames written up
  /// to it.
  void written(frame& f, bool in_event) noexcept;
  /// Completes the frames of `sent_` the reader has copied.
  void settle_copied(bool in_event) noexcept;
  void seal(frame& f) noexcept {
    f.seq = tx_seq_++;
    gdr::tcp::encode_frame(f.hdr, f.seq, f.encoded);
    f.sealed = true;
  }
  void drop(frame& f) noexcept {
    f.where = in_dropped;
    dropped_.push_back(&f);
  }
  void drop_unsent() noexcept;
  /// The frames of `sent_` will not be copied (the peer ended, or the
  /// bound passed): they complete with the connection's error.
  void release_sent() noexcept;
  /// How long a shut-down connection holds payloads the peer may still be
  /// copying, waiting for its end.
  std::chrono::milliseconds hold_bound() const noexcept {
    return opts_.close_linger.count() > 0 ? opts_.close_linger : std::chrono::milliseconds(2000);
  }
  /// Hands back the frames done outside an event and those dropped.
  void return_finished() noexcept;
  /// Rings the peer's bell (it sleeps waiting for bytes or room).
  void ring_peer() noexcept {
    std::uint64_t one = 1;
    ssize_t r = ::write(parts_.peer_bell.get(), &one, sizeof one);
    (void)r;  // only EAGAIN at a counter near 2^64 (never), or a closed peer: nothing to wake
    ++stats_.bells_rung;
  }

  // ---------------------------------------------------------------- reader

  /// Reads what the peer's ring holds: headers to the engine, payloads to
  /// their places (or dropped while ending). Inside an event.
  void pump() noexcept;
  /// Takes the header at the reader's position (`avail` bytes readable);
  /// false: stop pumping (paused, failed, or a single-copy frame's address
  /// not there yet).
  bool parse_one(std::size_t& avail) noexcept;
  /// Copies a single-copy payload from the peer's memory (`from`) into its
  /// place, then counts it as copied. False: the connection failed.
  bool copy_from_peer(const proto::rx_plan& plan, std::uint64_t from) noexcept;
  /// Starts the GPU copy of a CUDA IPC frame's payload (`m` and `off`,
  /// checked) into its place. False: stop pumping (the reader waits for
  /// the copy, or it failed). gpu_copies.hpp.
  bool start_ipc_copy(const proto::rx_plan& plan, const copy_engine::ipc_memory& m, std::uint64_t off) noexcept;
  /// May the frame with header `h` (`ipc`: a descriptor frame) be read
  /// while CUDA IPC copies run?
  bool may_pass_copies(const proto::header& h, bool ipc) const noexcept;
  static void on_ipc_done(copy_engine::completion* c, std::error_code ec) noexcept;
  /// Ends the CUDA IPC jobs at the head that are done, in order.
  void settle_ipc() noexcept;
  /// Starts the GPU copy of the next contiguous piece (at most `n` bytes)
  /// of the current host payload out of the ring into Device memory.
  void start_ring_copy(std::size_t n) noexcept;
  static void on_ring_done(copy_engine::completion* c, std::error_code ec) noexcept;
  /// After a GPU copy's completion: what waited for it.
  void after_gpu() noexcept;
  bool gpu_busy() const noexcept { return ring_copy_.active || ipc_count_ != 0; }
  /// The reader waits for a GPU copy.
  bool reader_held() const noexcept { return ring_copy_.active || ipc_current_ || rx_waits_copies_; }
  /// The peer's copies counted one more: tell it (the count is kept here:
  /// the word in the peer's segment is the peer's to scribble on).
  void count_copied() noexcept { rx_.control().copied.store(++copies_counted_, std::memory_order_seq_cst); }
  void target_done() noexcept {
    rx_target t = std::exchange(tgt_, rx_target{});
    skip_ = t.discard;
    on_placed(false);
  }
  /// After the peer's end, while paused: do the bytes not yet read (from
  /// the paused header on) end with a whole close frame?
  bool unread_ends_with_close() const noexcept;
  void protocol_fail(gdr::tcp::frame_status why) noexcept {
    protocol_reason_ = why;
    on_link_failed(errc::protocol_error);
  }
  /// The peer broke a word of the shared memory this side reads (a tail or
  /// a count out of bounds): the connection fails with protocol_error, at
  /// once inside an event, else from the loop.
  void ring_broken() noexcept {
    if (failed()) return;
    if (in_handler()) return protocol_fail(gdr::tcp::frame_status::bad_field);
    protocol_reason_ = gdr::tcp::frame_status::bad_field;
    fail_due_ = make_error_code(errc::protocol_error);
    kick();
  }

  // ---------------------------------------------------------------- the loop's side

  bool reading() const noexcept { return live_ && !rx_paused_ && !failed() && !reader_held(); }
  poll_status poll_ring() noexcept;
  /// Nothing to do and the loop may sleep: set the waiting flags, look
  /// again, and keep the bell's read in flight.
  poll_status arm() noexcept;
  void arm_bell() noexcept;
  static void on_bell(operation* o, int res, std::uint32_t) noexcept;
  void kick() noexcept {
    if (kick_posted_) return;
    kick_posted_ = true;
    sched().post(&kick_);
  }
  static void on_kick(remote_work* w) noexcept;

  // ---------------------------------------------------------------- the end

  void arm_watch() noexcept;
  static void on_watch(operation* o, int res, std::uint32_t) noexcept;
  /// The peer's socket hung up (its process, or its side, ended): read
  /// what it wrote, decide whether the end was orderly, release what it
  /// will not copy.
  void peer_ended() noexcept;
  /// The orderly end is over (the peer's hang-up came, or the linger
  /// expired): stop everything in flight.
  void end_done() noexcept;
  void cancel_bell() noexcept {
    if (bell_inflight_ && !bell_cancelled_) {
      bell_cancelled_ = true;
      sched().cancel(&bell_op_);
    }
  }
  void arm_linger(std::chrono::milliseconds bound) noexcept;
  /// Ends this side of the socket (`SHUT_WR` or `SHUT_RDWR`): the peer sees
  /// it as this side's end, and takes back the payloads this side has not
  /// copied. While a GPU copy out of the peer's memory runs, not yet: at
  /// its completion (`end_due_`).
  void end_socket(int how) noexcept {
    if (!parts_.sock.valid()) return;
    if (ipc_count_ != 0) {
      end_due_ = std::max(end_due_, how);
      return;
    }
    ::shutdown(parts_.sock.get(), how);
  }
  void end_linger() noexcept {
    if (linger_inflight_ && !linger_cancelled_) {
      linger_cancelled_ = true;
      sched().cancel(&linger_op_);
    }
  }
  static void on_linger(operation* o, int, std::uint32_t) noexcept;

  // ---------------------------------------------------------------- state

  link_parts parts_;
  endpoint_options opts_;
  endpoint_stats stats_{};
  gdr::tcp::frame_status protocol_reason_ = gdr::tcp::frame_status::ok;
  ring tx_{};
  ring rx_{};
  ring_poller poller_{};
  bool polling_ = false;  // poller_ is one of the scheduler's pollers
  bool live_ = false;     // the rings may be used (false after shutdown or release)
  kick_node kick_{};
  bool kick_posted_ = false;

  // writer
  proto::fifo<frame, &frame::prev, &frame::next> txq_{};
  proto::fifo<frame, &frame::prev, &frame::next> done_{};     // written outside an event: complete from the loop
  proto::fifo<frame, &frame::prev, &frame::next> dropped_{};  // never written (failed)
  proto::fifo<frame, &frame::prev, &frame::next> sent_{};     // written, waiting for the reader's copies
  std::uint32_t copies_out_ = 0;  // single-copy frames written
  std::uint64_t copied_seen_ = 0;  // the reader's count when last read (and checked)
  std::uint32_t tx_seq_ = 0;
  bool held_ = false;            // the constructor's hello and credit: written together
  bool write_deferred_ = false;  // frames posted in a handler, written at its end
  bool close_written_ = false;   // this side's close frame is in the ring
  bool tx_blocked_ = false;      // frames wait for room in the ring
  bool export_failed_ = false;   // a Device payload could not be shared: fail from the loop
  std::error_code fail_due_;     // the socket refused a descriptor, or the peer broke a shared word: fail from the loop
  bool sock_blocked_ = false;    // the socket is full: a descriptor waits (retried at sock_retry_at_)
  std::chrono::steady_clock::time_point sock_retry_at_{};
  std::byte ipc_out_[ipc_body];  // the descriptor of txq_.head, when it is a CUDA IPC frame
  std::byte ipc_kind_out_{1};    // and its kind (the header's mark)
  fd_table_out fd_out_{};         // which of this side's allocations the peer holds descriptors of (fd_table.hpp)
  fd_table_in fd_in_{};           // the descriptors the peer passed, kept
  std::uint64_t frees_seen_ = 0;  // the copy engine's ipc_frees() when last looked at
  gpu_node fence_done_{};
  const frame* fence_for_ = nullptr;  // the frame whose fence runs
  const frame* fenced_ = nullptr;     // the frame whose fence is done (until it is sealed)
  bool fence_inflight_ = false;

  // reader
  rx_target tgt_{};
  std::uint64_t skip_ = 0;
  std::uint32_t rx_seq_ = 0;
  std::uint64_t copies_counted_ = 0;  // the peer's single-copy and CUDA IPC frames this side copied (`copied`)
  bool rx_paused_ = false;
  bool saw_close_ = false;  // the peer's close frame was read
  bool peer_gone_ = false;  // the socket hung up: the peer ended (in order or not)
  copy_engine* ce_ = nullptr;  // CUDA IPC: the scheduler's copy engine
  gpu_node ring_done_{};
  ring_job ring_copy_{};
  ipc_job ipc_jobs_[max_ipc_jobs]{};  // a ring of them: ipc_count_ from ipc_head_
  std::uint32_t ipc_head_ = 0;
  std::uint32_t ipc_count_ = 0;
  bool ipc_current_ = false;      // the newest job is the current placement: the reader waits for it
  bool rx_waits_copies_ = false;  // the next frame may not pass the copies in flight
  bool hangup_due_ = false;  // the peer's hang-up came while a GPU copy ran: taken when none does
  int end_due_ = -1;  // a shutdown of the socket waiting for the CUDA IPC copies (SHUT_WR, SHUT_RDWR)

  // the bell, the watch, the orderly end
  conn_op bell_op_{};
  std::uint64_t bell_value_ = 0;
  bool bell_inflight_ = false;
  bool bell_cancelled_ = false;
  conn_op watch_op_{};
  bool watch_inflight_ = false;
  bool watch_cancelled_ = false;
  bool ending_ = false;
  conn_op linger_op_{};
  bool linger_inflight_ = false;
  bool linger_cancelled_ = false;
  __kernel_timespec linger_ts_{};
};

}  // namespace detail::shm

}  // namespace gdr
