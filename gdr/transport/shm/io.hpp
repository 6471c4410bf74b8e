/// \file
/// The shared-memory connection's members: the writer (frames into the
/// ring), the reader (frames out of the peer's ring), the loop's side (the
/// poller, the bell); the end is in ending.hpp, the descriptors in
/// descriptors.hpp, the GPU copies in gpu_copies.hpp. The design is in
/// connection.hpp.
#pragma once

#include <liburing.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include <gdr/log.hpp>
#include <gdr/protocol/engine/event_scope.hpp>
#include <gdr/transport/shm/connection.hpp>
#include <gdr/transport/shm/descriptors.hpp>
#include <gdr/transport/shm/ending.hpp>
#include <gdr/transport/shm/gpu_copies.hpp>

namespace gdr::detail::shm {

// ------------------------------------------------------------------ writer

inline void connection::link_post(frame& f) noexcept {
  f.queued = true;
  f.sealed = false;
  f.in_flight = false;
  f.written = 0;
  if (failed() || !live_) {
    // Nothing will be written: handed back from the loop, not from inside
    // the caller (an operation must not complete before it waits).
    drop(f);
    kick();
    return;
  }
  f.where = in_tx;
  txq_.push_back(&f);
  if (in_handler()) {
    write_deferred_ = true;  // at the handler's end (link_flush), with what else it posts
    return;
  }
  write_some(false);
}

inline bool connection::link_withdraw(frame& f) noexcept {
  if (!f.queued) return false;
  switch (f.where) {
    case in_tx:
      // Some of it in the ring: committed, unless the connection failed
      // (the peer never reads a frame cut short).
      if (f.sealed && !failed()) return false;
      txq_.erase(&f);
      break;
    case in_dropped: dropped_.erase(&f); break;
    // Whole in the ring (done, or waiting for the peer's copies): the peer
    // reads it even after this side failed (what a peer wrote before it
    // ended is read), so it is committed whatever happens.
    case in_done:
    case in_sent:
    default: return false;
  }
  if (&f == fence_for_) fence_for_ = nullptr;
  if (&f == fenced_) fenced_ = nullptr;
  f.where = nowhere;
  f.queued = false;
  return true;
}

inline void connection::write_some(bool in_event) noexcept {
  if (held_ || !live_ || failed()) return;
  const bool was_blocked = tx_blocked_;
  bool unpublished = false;
  auto publish = [&] {
    tx_.publish();
    unpublished = false;
    if (take_waiter(tx_.control().reader_waiting)) ring_peer();
  };
  while (frame* f = txq_.head) {
    const bool single = single_copy_out(*f);
    const bool ipc = ipc_out(*f);
    const std::size_t total = ring_bytes(*f);
    std::size_t room = tx_.room(total - f->written);
    if (room == 0) {
      if (tx_.corrupt()) ring_broken();
      break;
    }
    if (!f->sealed) {
      if (ipc && (!fence(*f) || !export_ipc(*f))) break;
      fenced_ = nullptr;
      seal(*f);
      if (ipc) f->encoded[ipc_mark] = ipc_kind_out_;
    }
    while (f->written < total) {
      if (room == 0 && (room = tx_.room(total - f->written)) == 0) break;
      std::size_t n;
      if (f->written < wire::header_size) {
        n = std::min(room, wire::header_size - f->written);
        tx_.put(f->encoded + f->written, n);
      } else if (ipc) {
        n = std::min(room, total - f->written);
        tx_.put(ipc_out_ + (f->written - wire::header_size), n);
      } else if (single) {
        // The payload's address, for the reader to copy from.
        std::byte a[sizeof(std::uint64_t)];
        const auto addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(f->payload));
        std::memcpy(a, &addr, sizeof a);
        n = std::min(room, total - f->written);
        tx_.put(a + (f->written - wire::header_size), n);
      } else {
        n = std::min({room, total - f->written, piece});
        tx_.put(f->payload + (f->written - wire::header_size), n);
      }
      f->written += n;
      room -= n;
      unpublished = true;
      // A large payload is published piece by piece: the reader copies
      // out while the rest is copied in.
      if (n == piece) publish();
    }
    if (f->written < total) break;  // the ring is full
    txq_.erase(f);
    ++stats_.frames_out;
    written(*f, in_event);
  }
  if (unpublished) publish();
  tx_blocked_ = !txq_.empty();
  if (tx_blocked_ && !was_blocked) ++stats_.ring_full;
}

inline bool connection::fence(frame& f) noexcept {
  if (fenced_ == &f) return true;
  if (fence_inflight_) return false;
  bool now = false;
  const stream_order after = f.owner != nullptr ? f.owner->after() : stream_order{};
  if (ce_ == nullptr || ce_->ipc_fence(f.device, after, &fence_done_, now)) {
    export_failed_ = true;  // fails from the loop
    kick();
    return false;
  }
  if (now) return true;
  fence_inflight_ = true;
  fence_for_ = &f;
  return false;
}

inline void connection::on_fence_done(copy_engine::completion* node, std::error_code ec) noexcept {
  connection* c = static_cast<gpu_node*>(node)->self;
  proto::event_scope ev(*c);
  c->fence_inflight_ = false;
  if (ec) {
    if (!c->failed()) c->on_link_failed(ec);
  } else if (c->fence_for_ != nullptr && c->txq_.head == c->fence_for_) {
    c->fenced_ = c->fence_for_;
  }
  c->fence_for_ = nullptr;
  c->write_some(true);
  c->on_io_done();
}

inline bool connection::export_ipc(const frame& f) noexcept {
  copy_engine::ipc_memory m;
  std::uint64_t off = 0;
  const char* why = nullptr;
  if (ce_ == nullptr || ce_->ipc_export(f.payload, static_cast<std::size_t>(f.hdr.length), m, off, &why)) {
    // Not from here (inside the engine's call): from the loop.
    export_failed_ = true;
    gdr::detail::log("shm", "the Device memory at %p of a frame cannot be shared by CUDA IPC (%s); the connection "
                     "fails", static_cast<const void*>(f.payload), why != nullptr ? why : "no copy engine");
    kick();
    return false;
  }
  ipc_kind_out_ = static_cast<std::byte>(m.kind);
  std::uint32_t slot = 0;
  if (m.kind == copy_engine::ipc_kind::fd) {
    // Passed once: the peer keeps it in a slot while it is among the last
    // 16 this side passed (never in a slot the peer has yet to let go: its
    // allocation was freed).
    const fd_table_out::lookup at =
        fd_out_.find(m.base, m.buffer_id, tx_.control().released.load(std::memory_order_acquire));
    slot = at.slot;
    if (at.held) {
      ipc_kind_out_ = fd_held;
      fd_out_.touch(slot);
    } else if (slot == fd_slots) {
      // Every slot is one the peer has yet to let go: soon.
      sock_blocked_ = true;
      sock_retry_at_ = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
      return false;
    } else {
      if (!pass_fd(m, slot)) return false;
      fd_out_.put(slot, m.base, m.buffer_id);  // (what the slot held, the peer lets go as it takes this one)
    }
  }
  m.to_wire(ipc_out_);
  ipc_out_[0] = static_cast<std::byte>(slot);  // (the handle's place: unused by a descriptor)
  std::memcpy(ipc_out_ + copy_engine::ipc_memory::wire_size, &off, sizeof off);
  ++stats_.ipc_exports;
  return true;
}


inline void connection::written(frame& f, bool in_event) noexcept {
  const bool single = single_copy_out(f) || ipc_out(f);
  if (f.hdr.type == proto::msg::close) close_written_ = true;
  if (single || !sent_.empty()) {
    f.seq = single ? ++copies_out_ : copies_out_;
    f.where = in_sent;
    sent_.push_back(&f);
    // The peer's end is taken (peer_ended: not while a GPU copy defers
    // it): it copies nothing more, so the frame waits for nothing (a reply
    // slot or bounce buffer held here would hold the reader that still has
    // the peer's last frames to read). Its error is the end's: the peer's
    // close, or the connection lost.
    if (peer_gone_ && !hangup_due_) {
      settle_copied(in_event);
      release_sent();
    }
    return;
  }
  if (in_event) {
    f.where = nowhere;
    on_sent(f, {});
  } else {
    f.where = in_done;
    done_.push_back(&f);
    kick();
  }
}

inline void connection::settle_copied(bool in_event) noexcept {
  // The reader's count, loaded once: it only grows, and never past the
  // copies written (else the peer broke it).
  const std::uint64_t now = tx_.control().copied.load(std::memory_order_seq_cst);
  if (static_cast<std::uint32_t>(now - copied_seen_) > copies_out_ - static_cast<std::uint32_t>(copied_seen_)) {
    ring_broken();
    return;
  }
  copied_seen_ = now;
  const auto copied = static_cast<std::uint32_t>(copied_seen_);
  while (frame* f = sent_.head) {
    if (static_cast<std::int32_t>(f->seq - copied) > 0) break;  // not yet (counts mod 2^32)
    sent_.pop_front();
    if (in_event) {
      f->where = nowhere;
      on_sent(*f, {});
    } else {
      f->where = in_done;
      done_.push_back(f);
      kick();
    }
  }
}

inline void connection::drop_unsent() noexcept {
  while (frame* f = txq_.pop_front()) drop(*f);
  tx_blocked_ = false;
  // Written, the peer's copies not counted: their memory is the sender's
  // again only once the peer has ended (it copies inside its loop, and its
  // loop ends its socket before it stops), or the bound has passed.
  if (peer_gone_) release_sent();
  if (!dropped_.empty()) kick();
}

inline void connection::release_sent() noexcept {
  // A frame that is no copy itself waits in sent_ only to complete in
  // order, behind one the peer had to copy. If the peer read it (the
  // reader's released position is past it), it arrived: an rtr the peer
  // answered must not fail its receive. sent_ holds every frame written
  // since its first, so the last ends where the writer is, less what it
  // has written of the frame it is writing now.
  // (A released ring, none.)
  const bool mapped = tx_.capacity() != 0;
  std::uint64_t at = tx_.position() - (txq_.head != nullptr ? txq_.head->written : 0);
  for (const frame* f = sent_.head; f != nullptr; f = f->next) at -= ring_bytes(*f);
  const std::uint64_t read_to = mapped ? tx_.peer_tail() : at;  // (checked: a broken one reads as the last good one)
  while (frame* f = sent_.pop_front()) {
    at += ring_bytes(*f);
    const bool copy = single_copy_out(*f) || ipc_out(*f);
    if (mapped && !copy && static_cast<std::int64_t>(read_to - at) >= 0) {
      f->where = in_done;
      done_.push_back(f);
    } else {
      drop(*f);
    }
  }
  if (!dropped_.empty() || !done_.empty()) kick();
}

inline void connection::return_finished() noexcept {
  while (frame* f = done_.pop_front()) {
    f->where = nowhere;
    on_sent(*f, {});
  }
  while (frame* f = dropped_.pop_front()) {
    f->where = nowhere;
    // Why it was never written (or never copied): what the endpoint says
    // (its failure, or this side's close: also when the peer has hung up
    // and its close frame is not read yet, behind a pause or the copies),
    // else the peer's end.
    std::error_code why = state_error();
    if (!why) why = make_error_code(peer_gone_ ? errc::peer_closed : errc::closed);
    on_sent(*f, why);
  }
}

// ------------------------------------------------------------------ reader

inline bool connection::copy_from_peer(const proto::rx_plan& plan, std::uint64_t from) noexcept {
  std::size_t done = 0;
  while (done < plan.want) {
    iovec local{plan.dst + done, plan.want - done};
    iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(from + done)), plan.want - done};
    ssize_t n = ::process_vm_readv(parts_.peer_pid, &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // EFAULT: an address the peer does not have (a malformed frame);
      // ESRCH, EPERM: the peer is gone, or no longer readable.
      if (n < 0 && errno == EFAULT) protocol_fail(gdr::tcp::frame_status::bad_field);
      else on_link_failed(errc::connection_lost);
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  ++stats_.single_copies;
  count_copied();
  skip_ = 0;
  on_placed(true);
  if (take_waiter(rx_.control().writer_waiting)) ring_peer();
  return !failed();
}

inline bool connection::parse_one(std::size_t& avail) noexcept {
  std::byte h[wire::header_size];
  rx_.peek(h, 0, wire::header_size);
  const std::byte mark = h[ipc_mark];
  const bool ipc = ipc_marked(mark);
  if (ipc) {
    if (!parts_.device_ipc) {
      protocol_fail(gdr::tcp::frame_status::bad_field);  // not agreed
      return false;
    }
    if (avail < wire::header_size + ipc_body) return false;  // its descriptor comes with it: soon
    h[ipc_mark] = std::byte{0};
  }
  gdr::tcp::frame_parse_result r = gdr::tcp::parse_frame(std::span<const std::byte>(h), options().max_message);
  if (r.status != gdr::tcp::frame_status::ok) {
    protocol_fail(r.status);
    return false;
  }
  if (r.seq != rx_seq_) {
    protocol_fail(gdr::tcp::frame_status::bad_field);  // out of step
    return false;
  }
  if (ipc_count_ != 0 && !may_pass_copies(r.header, ipc)) {
    rx_waits_copies_ = true;  // read again once the copies are done (settle_ipc)
    return false;
  }
  copy_engine::ipc_memory m;
  std::uint64_t off = 0;
  if (ipc) {
    std::byte body[ipc_body];
    rx_.peek(body, wire::header_size, ipc_body);
    m = copy_engine::ipc_memory::from_wire(body);
    std::memcpy(&off, body + copy_engine::ipc_memory::wire_size, sizeof off);
    // The peer's own device memory, and the payload inside the allocation.
    if (r.header.length == 0 || m.pid != parts_.peer_pid || m.device < 0 || off > m.size ||
        r.header.length > m.size - off) {
      protocol_fail(gdr::tcp::frame_status::bad_field);
      return false;
    }
  }
  const bool single = !ipc && single_copy_in(r.header);
  if (single && avail < wire::header_size + sizeof(std::uint64_t)) return false;  // its address comes with it: soon
  // The peer counted its copies of this side's payloads before it wrote
  // this frame: take them first (a close frame must not fail a send whose
  // bytes the peer already has).
  if (!sent_.empty()) settle_copied(true);
  if (failed()) return false;  // (the count was broken)
  proto::rx_plan plan = on_header(r.header);
  switch (plan.act) {
    case proto::rx_plan::action::pause:
      rx_paused_ = true;
      return false;
    case proto::rx_plan::action::fail:
      if (!failed()) protocol_fail(gdr::tcp::frame_status::bad_field);
      return false;
    case proto::rx_plan::action::place: break;
  }
  ++rx_seq_;
  ++stats_.frames_in;
  if (ipc) {
    rx_.consume(wire::header_size + ipc_body);
    avail -= wire::header_size + ipc_body;
    if (mark == std::byte{2} || mark == fd_held) {
      m.kind = copy_engine::ipc_kind::fd;
      const auto slot = static_cast<std::uint32_t>(m.handle[0]);
      if (mark == fd_held) {
        m.fd = fd_in_.held(slot, m.base, m.buffer_id);  // passed before and kept: it must be that allocation's
      } else {
        m.fd = take_fd(m, slot);
      }
      if (m.fd < 0) {
        protocol_fail(gdr::tcp::frame_status::bad_field);
        return false;
      }
    }
    return start_ipc_copy(plan, m, off);
  }
  if (single) {
    std::uint64_t from = 0;
    rx_.peek(reinterpret_cast<std::byte*>(&from), wire::header_size, sizeof from);
    rx_.consume(wire::header_size + sizeof from);
    avail -= wire::header_size + sizeof from;
    return copy_from_peer(plan, from);
  }
  rx_.consume(wire::header_size);
  avail -= wire::header_size;
  if (r.header.type == proto::msg::close) saw_close_ = true;
  tgt_ = {};
  tgt_.active = true;
  tgt_.dst = plan.dst;
  tgt_.want = plan.want;
  tgt_.discard = plan.discard;
  tgt_.device = plan.device;
  tgt_.after = plan.after;
  return !failed();
}

inline void connection::pump() noexcept {
  bool corrupt = false;
  std::size_t avail = rx_.readable(corrupt);
  // One call reads at most this much, so that a peer streaming without
  // end does not hold the loop.
  std::size_t budget = 4 * rx_.capacity();
  bool took = false;
  auto give_back = [&] {
    rx_.release();
    took = false;
    if (take_waiter(rx_.control().writer_waiting)) ring_peer();
  };
  auto take = [&](std::size_t n) {
    rx_.consume(n);
    avail -= n;
    budget -= std::min(budget, n);
    took = true;
  };
  while (!corrupt && live_ && !failed() && !reader_held()) {
    if (tgt_.active && tgt_.done == tgt_.want && !ending_) {
      target_done();  // (an empty payload is in place at once)
      continue;
    }
    const bool need_header = !ending_ && skip_ == 0 && !tgt_.active;
    if (avail == 0 || (need_header && avail < wire::header_size)) {
      if (took) give_back();
      if (budget == 0) break;
      std::size_t again = rx_.readable(corrupt);
      if (again == avail) break;  // nothing new
      avail = again;
      continue;
    }
    if (ending_) {
      // The orderly end: what the peer still writes is dropped.
      tgt_ = {};
      skip_ = 0;
      take(avail);
      continue;
    }
    if (rx_paused_) break;
    if (skip_ != 0) {
      auto n = static_cast<std::size_t>(std::min<std::uint64_t>(skip_, avail));
      take(n);
      skip_ -= n;
      continue;
    }
    if (tgt_.active) {
      std::size_t n = std::min(tgt_.want - tgt_.done, avail);
      if (n != 0 && tgt_.device >= 0) {
        // Host bytes into Device memory: the GPU copies them out of the
        // ring; the reader waits for it.
        if (took) give_back();
        start_ring_copy(n);
        break;
      }
      if (n != 0) {
        rx_.peek(tgt_.dst + tgt_.done, 0, n);
        tgt_.done += n;
        take(n);
        if (n >= piece) give_back();  // room for the writer's next pieces now
      }
      continue;
    }
    const std::size_t before = avail;
    const bool go_on = parse_one(avail);
    took = took || avail != before;
    if (!go_on) break;
  }
  if (corrupt && !failed()) protocol_fail(gdr::tcp::frame_status::bad_field);
  if (took) give_back();
}

inline bool connection::unread_ends_with_close() const noexcept {
  bool corrupt = false;
  const std::size_t avail = rx_.readable(corrupt);
  if (corrupt) return false;
  std::size_t at = 0;
  bool close_last = false;
  while (avail - at >= wire::header_size) {
    std::byte h[wire::header_size];
    rx_.peek(h, at, wire::header_size);
    const std::byte mark = std::exchange(h[ipc_mark], std::byte{0});
    gdr::tcp::frame_parse_result r = gdr::tcp::parse_frame(std::span<const std::byte>(h), options().max_message);
    if (r.status != gdr::tcp::frame_status::ok) return false;
    h[ipc_mark] = mark;
    close_last = r.header.type == proto::msg::close;
    const bool ipc = ipc_marked(h[ipc_mark]);
    const std::uint64_t body = ipc ? ipc_body : single_copy_in(r.header) ? sizeof(std::uint64_t) : r.header.length;
    if (body > avail - at - wire::header_size) return false;  // cut off in its payload
    at += wire::header_size + static_cast<std::size_t>(body);
  }
  return at == avail && close_last;
}

// ------------------------------------------------------------------ the loop's side

inline poll_status connection::poll_ring() noexcept {
  if (!live_) return {};
  // An allocation whose descriptor the peer holds was freed: the peer
  // hears of it (only where this side passed any).
  if (fd_out_.in_use() != 0 && ce_->ipc_frees() != frees_seen_) note_frees();
  bool corrupt = false;
  const bool rx_ready = reading() && (rx_.readable(corrupt) != 0 || corrupt);
  // A descriptor the full socket refused is tried again after a while,
  // at every poll when busy-polling.
  const bool tx_ready = tx_blocked_ && !failed() && (tx_.room() != 0 || tx_.corrupt()) &&
                        (!sock_blocked_ || sched().mode() == run_mode::busy_poll ||
                         std::chrono::steady_clock::now() >= sock_retry_at_);
  const bool copies_ready =
      !sent_.empty() && tx_.control().copied.load(std::memory_order_seq_cst) != copied_seen_;
  const std::uint32_t released = fd_in_.in_use() != 0 ? rx_.control().released.load(std::memory_order_acquire) : 0;
  if (rx_ready || tx_ready || copies_ready || released != 0) {
    {
      proto::event_scope ev(*this);
      if (copies_ready) settle_copied(true);
      if (rx_ready) pump();
      // After the frames before the notice: the peer freed those
      // allocations once the operations that named them were done.
      if (released != 0) take_releases(released);
      if (tx_blocked_) write_some(true);
    }  // may have freed this
    return {.did_work = true};
  }
  if (sched().mode() != run_mode::busy_poll) return arm();
  return {};
}

inline poll_status connection::arm() noexcept {
  const bool want_rx = reading();
  const bool want_tx = tx_blocked_ && !failed();
  const bool want_copies = !sent_.empty() && !failed();
  if (!want_rx && !want_tx && !want_copies) return {};
  if (want_rx) announce_wait(rx_.control().reader_waiting);
  if (want_tx || want_copies) announce_wait(tx_.control().writer_waiting);
  bool corrupt = false;
  if ((want_rx && (rx_.readable(corrupt) != 0 || corrupt)) || (want_tx && (tx_.room() != 0 || tx_.corrupt())) ||
      (want_copies && tx_.control().copied.load(std::memory_order_seq_cst) != copied_seen_) ||
      (fd_in_.in_use() != 0 && rx_.control().released.load(std::memory_order_acquire) != 0))
    return {.did_work = true};
  arm_bell();
  if (!bell_inflight_) return {.sleep_bound = std::chrono::milliseconds(1)};  // no SQE: look again soon
  if (want_tx && sock_blocked_) return {.sleep_bound = std::chrono::microseconds(100)};
  return {};
}

inline void connection::arm_bell() noexcept {
  if (bell_inflight_ || !live_) return;
  io_uring_sqe* sqe = sched().get_sqe();
  if (sqe == nullptr) return;
  io_uring_prep_read(sqe, parts_.bell.get(), &bell_value_, sizeof bell_value_, 0);
  io_uring_sqe_set_data(sqe, static_cast<operation*>(&bell_op_));
  sched().note_submitted();
  bell_inflight_ = true;
  ++stats_.bell_waits;
}

inline void connection::on_bell(operation* o, int, std::uint32_t) noexcept {
  connection* c = static_cast<conn_op*>(o)->self;
  proto::event_scope ev(*c);
  c->bell_inflight_ = false;
  c->bell_cancelled_ = false;
  // What woke it is read by the loop's next poll of the ring.
  c->on_io_done();
}

inline void connection::on_kick(remote_work* w) noexcept {
  connection* c = static_cast<kick_node*>(w)->self;
  proto::event_scope ev(*c);
  c->kick_posted_ = false;
  if (c->export_failed_ && !c->failed()) c->on_link_failed(errc::unsupported);
  if (c->fail_due_ && !c->failed()) c->on_link_failed(c->fail_due_);
  c->return_finished();
  if (!c->sent_.empty()) c->settle_copied(true);
  if (c->reading()) c->pump();
  if (c->tx_blocked_) c->write_some(true);
  c->on_io_done();
}

}  // namespace gdr::detail::shm
