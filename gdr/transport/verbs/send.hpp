/// \file
/// The verbs connection's send side (members of `connection`, declared in
/// `connection.hpp`): send slots, completion signalling, posting frames as
/// SENDs or RDMA WRITEs, and send completions.
///
/// Contract. Frames are posted in the order the engine queued them, each
/// as far as resources allow (credits, send slots, send-queue entries); the
/// rest waits for the next completion. A SEND up to the inline limit is
/// copied into the work request; a larger one into a registered send slot;
/// a rendezvous payload or a get's reply to a peer that gave its key goes
/// by RDMA WRITE from the user's memory, registered for the duration. One
/// send-queue request in `signal_every` asks for a completion (and the one
/// that takes the last slot or queue entry, and one whose completion ends a
/// frame); the others carry `unsignaled_work()`'s id, and those copied into
/// a slot keep it until a later signaled request completes (an RC send
/// queue completes in order).
#pragma once

#include <gdr/transport/verbs/connection.hpp>

namespace gdr::detail::verbs {

/// The payload bytes a frame's SENDs carry: none for a put whose target
/// reads them.
inline std::size_t connection::sent_bytes(const frame& f) noexcept {
  bool read = f.hdr.type == proto::msg::put_request && f.encoded[0] == std::byte{1};
  return read ? 0 : static_cast<std::size_t>(f.hdr.length);
}

inline auto connection::take_tx() noexcept -> tx_slot* {
  tx_slot* t = free_tx_;
  if (t != nullptr) {
    free_tx_ = t->next_free;
    ++tx_busy_;
  }
  return t;
}

inline void connection::free_tx(tx_slot* t) noexcept {
  t->f = nullptr;
  t->keepalive = false;
  t->rdma = false;
  t->read = false;
  t->read_bytes = 0;
  t->covered = 1;
  t->held = nullptr;
  t->next_free = free_tx_;
  free_tx_ = t;
  --tx_busy_;
}

/// Frees the slots of a chain of unsignaled SENDs (linked by next_free).
inline void connection::free_held(tx_slot* t) noexcept {
  while (t != nullptr) {
    tx_slot* next = t->next_free;
    free_tx(t);
    t = next;
  }
}

/// Whether the send-queue work request about to be posted (the last of
/// `n`; its slot already taken) asks for a completion. `needed`: only
/// its completion ends its frame; `frees_slot`: it is inline, its slot
/// goes back at once. Otherwise one in `signal_every_` does, and the one
/// that takes the last free slot or send-queue entry: the unsignaled
/// requests before it would otherwise hold them with no completion to
/// come. A higher mark than "none left" signals every SEND while slots
/// are what limits a sender (it then hovers at the mark: 288 of 302
/// SENDs signaled with tx_depth 16 and a mark of 4).
/// A run of unsignaled SENDs that nothing follows keeps its entries (and
/// the slots of those that were copied into one) until the next
/// signaled request: the next post, the close frame, or the keepalive
/// of an idle connection; a failure releases them (release_unsignaled).
/// Signalling the last one queued instead would signal every SEND of a
/// sender that waits for each (it is always the last).
inline bool connection::signal_next(int n, bool needed, bool frees_slot) const noexcept {
  if (needed || unsignaled_wrs_ + n >= static_cast<int>(signal_every_)) return true;
  if (!frees_slot && free_tx_ == nullptr) return true;
  return sq_used_ + n >= sq_depth_;
}

/// Copied frames are sent as far as this side is concerned: each gets
/// its on_sent. Only where no engine call is on the stack (see
/// link_flush). True: some were.
inline bool connection::hand_back_copied() noexcept {
  if (copied_.empty()) return false;
  while (frame* f = copied_.pop_front()) {
    f->where = nowhere;
    tx_path_ = transfer_path::host_eager;
    on_sent(*f, {});
  }
  return true;
}

/// The queue pair is in the error state and no signaled work request is
/// left to come back: the unsignaled ones after the last of them will
/// not be accounted for by a completion (a flushed unsignaled request
/// may complete, to unsignaled_work(), or not). Nothing is posted any
/// more, so their slots are not written again; the memory goes only
/// after the queue pair is destroyed (teardown).
inline void connection::release_unsignaled() noexcept {
  if (!shut_ || busy_noted_ != 0) return;
  free_held(std::exchange(held_head_, nullptr));
  held_tail_ = nullptr;
  sq_used_ -= unsignaled_wrs_;
  unsignaled_wrs_ = 0;
}

/// Posts what resources allow, in order.
inline void connection::pump_tx() noexcept {
  if (!established_ || shut_) return;
  if (gate_.current() == nic_gate::state::read_ready) post_read();
  while (frame* f = tx_.head) {
    copied_frame_ = nullptr;
    if (shut_ || !post_frame(*f)) break;
    tx_.erase(f);
    if (copied_frame_ == f) {
      // Its memory is no longer needed; it goes back from a safe place.
      f->where = in_copied;
      copied_.push_back(f);
    } else {
      f->where = in_posted;
    }
  }
  // Outside any handler no leave() follows to hand the copied frames
  // back (link_flush): the kick's handler does.
  if (!copied_.empty() && !in_handler()) kick();
  maybe_send_credits();
}

/// Takes back a frame the NIC has not been given (the engine's withdraw).
inline bool connection::link_withdraw(frame& f) noexcept {
  if (!f.queued || (f.sealed && !failed())) return false;
  if (f.where == in_tx) {
    if (f.sealed) return false;
    tx_.erase(&f);
  } else if (f.where == in_dropped) {
    dropped_.erase(&f);
  } else {
    return false;
  }
  f.where = nowhere;
  f.queued = false;
  if (f.encoded[0] == std::byte{1}) {
    // Registered for a request that never went out: the peer never saw the key.
    auto g = grant_of(f);
    if (g != grants_.end()) grants_.erase(g);  // its registration ends with it
  }
  return true;
}

/// The eager fast path (engine.hpp): a message that fits one SEND, with
/// nothing of this side's queued before it and the credit and room to go
/// now, is posted inline or copied into a send buffer here; the frame is
/// never queued. Anything else goes by link_post.
inline bool connection::link_send_now(frame& f) noexcept {
  if (!established_ || shut_ || failed() || tx_.head != nullptr || lane_ctl_due_ != 0) return false;
  if (f.hdr.type != proto::msg::eager || f.nic_only || wire_size + f.hdr.length > frag_) return false;
  if (!credits_.can_consume(1) || free_tx_ == nullptr || sq_used_ + 1 > sq_depth_) return false;
  if (gate_.current() == nic_gate::state::read_ready) return false;  // pump_tx posts that first
  f.sealed = false;
  f.written = 0;
  f.encoded[0] = std::byte{2};  // carries no key
  copied_frame_ = nullptr;
  // One SEND: posted whole or not at all (a failed post fails the
  // connection; the frame then goes by link_post, which drops it).
  if (!post_sends(f) || copied_frame_ != &f) {
    copied_frame_ = nullptr;
    f.sealed = false;
    f.written = 0;
    return false;
  }
  copied_frame_ = nullptr;
  tx_path_ = transfer_path::host_eager;  // what the engine reports for it (link_tx_path)
  ++stats_.fast_sends;
  return true;
}

/// Posts (the rest of) `f`. True when all of it is posted.
inline bool connection::post_frame(frame& f) noexcept {
  if (!f.sealed) {
    switch (f.hdr.type) {
      case proto::msg::data: {
        auto r = find_remote(false, f.hdr.addr);
        if ((f.hdr.flags & proto::flag::withdrawn) != 0) {
          // The answer to an rtr whose send was withdrawn: no bytes, so no
          // WRITE; a SEND, whose `last` flag ends the receive's grant there.
          if (r != remotes_.end()) remotes_.erase(r);
          break;
        }
        if (r == remotes_.end()) {
          if (f.nic_only && f.hdr.length != 0)
            return gpudirect_fail("the receive of a send from Device memory offered no key (it could not "
                                  "register its memory): the bytes cannot move without the CPU");
          break;
        }
        // A segment (a staged sender's chunk) lands at its offset; only
        // the message's last one carries the immediate.
        bool last = (f.hdr.flags & proto::flag::last) != 0;
        int res = post_rdma(f, *r, f.hdr.size, imm_of(false, f.hdr.addr), last);
        if (res > 0) {
          if (last) remotes_.erase(r);  // segments before the last keep it
          return true;
        }
        if (res == 0) return false;  // waits for resources
        remotes_.erase(r);            // could not register: SENDs instead
        if (f.nic_only) return gpudirect_fail("cannot register the Device memory of a send with the NIC");
        break;
      }
      case proto::msg::get_reply: {
        auto r = find_remote(true, f.hdr.id);
        if (r == remotes_.end()) {
          if (f.nic_only && f.hdr.st == proto::status::ok && f.hdr.length != 0)
            return gpudirect_fail("a get of exposed Device memory came without the key of its destination");
          break;
        }
        if (f.hdr.st == proto::status::ok && f.hdr.length != 0) {
          // Straight from the exposed memory into the get's destination;
          // the immediate is the answer.
          int res = post_rdma(f, *r, 0, imm_of(true, f.hdr.id), true);
          if (res == 0) return false;
          remotes_.erase(r);
          if (res > 0) return true;
          if (f.nic_only) return gpudirect_fail("cannot register exposed Device memory with the NIC");
          break;  // could not register: the reply goes as SENDs
        }
        remotes_.erase(r);  // a refusal: the answer goes as a SEND
        break;
      }
      case proto::msg::put_request:
      case proto::msg::get_request:
        if (f.encoded[0] == std::byte{0} && !attach_request(f)) return false;
        break;
      default: break;
    }
  }
  return post_sends(f);
}

/// The size of each work request when `len` bytes move by RDMA: at least
/// `write_chunk`, and at most `max_write_wrs` requests in all.
inline std::size_t connection::rdma_chunk(std::size_t len) noexcept {
  return std::max(write_chunk, (len + max_write_wrs - 1) / max_write_wrs);
}

/// Fills `wrs` (and `sges`) with a chain of `op` requests moving `len`
/// bytes between local `local` (key `lkey`) and remote `remote` (key
/// `rkey`), `chunk` bytes each; only the last is signaled, with slot
/// `t`'s id.
inline void connection::rdma_chain(ibv_send_wr* wrs, ibv_sge* sges, ibv_wr_opcode op, const std::byte* local,
                         std::uint32_t lkey, std::uint64_t remote, std::uint32_t rkey, std::size_t len,
                         std::size_t chunk, tx_slot& t) noexcept {
  int nwr = static_cast<int>((len + chunk - 1) / chunk);
  for (int i = 0; i < nwr; ++i) {
    std::size_t off = static_cast<std::size_t>(i) * chunk;
    sges[i] = {};
    sges[i].addr = reinterpret_cast<std::uintptr_t>(local) + off;
    sges[i].length = static_cast<std::uint32_t>(std::min(chunk, len - off));
    sges[i].lkey = lkey;
    ibv_send_wr& wr = wrs[i];
    wr = {};
    wr.sg_list = &sges[i];
    wr.num_sge = 1;
    wr.opcode = op;
    wr.wr.rdma.remote_addr = remote + off;
    wr.wr.rdma.rkey = rkey;
    bool last = i + 1 == nwr;
    wr.send_flags = last ? IBV_SEND_SIGNALED : 0;
    wr.wr_id = last ? t.wr_id() : gdr::verbs::unsignaled_work()->wr_id();
    wr.next = last ? nullptr : &wrs[i + 1];
  }
}

/// The payload of `f` by RDMA WRITE to `r`'s buffer at `offset`, the last
/// request WITH_IMM `imm` if `tell`. 1: posted; 0: no resources yet; -1:
/// its buffer cannot be registered.
inline int connection::post_rdma(frame& f, const remote_dst& r, std::uint64_t offset, std::uint32_t imm, bool tell_at_end) noexcept {
  auto len = static_cast<std::size_t>(f.hdr.length);
  std::size_t chunk = rdma_chunk(len);
  int nwr = static_cast<int>((len + chunk - 1) / chunk);
  // Only the request that carries the immediate lands in a receive of the
  // peer's: a segment before the last takes no credit.
  if (!credits_.can_consume(tell_at_end ? 1 : 0)) {
    ++stats_.credit_stalls;
    return 0;
  }
  if (free_tx_ == nullptr || sq_used_ + nwr > sq_depth_) return 0;
  gdr::verbs::mr_cache& cache = cache_for(f.device, send_cache());
  auto l = register_user(cache, f.payload, len, f.device);
  if (!l) {
    ++stats_.registration_failures;
    return -1;
  }
  tx_slot* t = take_tx();
  ibv_send_wr wrs[max_write_wrs];
  ibv_sge sges[max_write_wrs];
  rdma_chain(wrs, sges, IBV_WR_RDMA_WRITE, f.payload, l->handle()->lkey, r.raddr + offset, r.rkey, len, chunk, *t);
  if (tell_at_end) {
    wrs[nwr - 1].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wrs[nwr - 1].imm_data = imm;
  }
  t->f = &f;
  t->covered = static_cast<std::uint32_t>(nwr);
  t->rdma = true;
  t->src = std::move(*l);
  if (!post_send_wrs(wrs, nwr, t)) return 0;  // failed: link_shutdown hands f back
  f.sealed = true;
  f.written = len;
  stats_.write_wrs += static_cast<std::uint64_t>(nwr);
  return 1;
}

/// Posts `n` chained work requests ending with slot `t`'s. False: the
/// post failed (the connection fails; `t` is freed). A signaled last
/// request also accounts for the unsignaled ones posted before it: an
/// RC send queue completes in order, so its completion says the NIC is
/// done with them too. An unsignaled one keeps its slot until then if
/// the NIC reads its bounce buffer; an inline one gives it back now.
inline bool connection::post_send_wrs(ibv_send_wr* wrs, int n, tx_slot* t) noexcept {
  const ibv_send_wr& last = wrs[n - 1];
  bool signaled = (last.send_flags & IBV_SEND_SIGNALED) != 0;
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(id_->qp, wrs, &bad);  // returns an errno value
  if (rc != 0) {
    // The frame stays where it is (on tx_): the failure hands it back.
    t->src.end();
    free_tx(t);
    if (!failed()) on_link_failed(errno_code(rc));
    return false;
  }
  sq_used_ += n;
  // The one place credits are taken: what this chain consumes of the
  // peer's receive queue (credits.hpp), whatever kind of request it is.
  credits_.consumed(receives_consumed(wrs));
  ++activity_;
  if (!signaled) {
    unsignaled_wrs_ += n;
    if ((last.send_flags & IBV_SEND_INLINE) != 0 && last.opcode == IBV_WR_SEND) {
      free_tx(t);
    } else {
      t->next_free = nullptr;
      (held_tail_ != nullptr ? held_tail_->next_free : held_head_) = t;
      held_tail_ = t;
    }
    return true;
  }
  t->covered += static_cast<std::uint32_t>(unsignaled_wrs_);
  t->held = std::exchange(held_head_, nullptr);
  held_tail_ = nullptr;
  unsignaled_wrs_ = 0;
  ++stats_.signaled_wrs;
  if (busy_noted_++ == 0) poller_->note_busy(1);
  return true;
}

/// The frame (or its rest) as SENDs through the bounce buffers. Its
/// bytes are all copied when its last SEND is posted, so that ends it
/// (copied_frame_, handed back by pump_tx), except a frame carrying a key
/// (held until the peer is done with the memory) and a close: its completion is what says that
/// everything before it arrived, and the engine shuts the queue pair
/// down once it has it.
inline bool connection::post_sends(frame& f) noexcept {
  std::size_t len = sent_bytes(f);
  // GPUDirect: bytes only the NIC may move never go into a SEND (the CPU
  // would read them). post_frame has failed the connection before this
  // for every known case; this is the last line.
  if (f.nic_only && len != 0 && !f.sealed) return gpudirect_fail("Device bytes were about to be copied into a SEND");
  const std::size_t room = frag_ - wire_size;
  const bool ends_at_post = f.encoded[0] != std::byte{1} && f.hdr.type != proto::msg::close;
  for (;;) {
    bool first = !f.sealed;
    if (!first && f.written == len) return true;
    if (!credits_.can_consume(1)) {
      ++stats_.credit_stalls;
      return false;
    }
    if (free_tx_ == nullptr || sq_used_ + 1 > sq_depth_) return false;
    std::size_t chunk = std::min(len - f.written, room);
    bool last = f.written + chunk == len;
    tx_slot* t = take_tx();
    wire_header w;
    w.kind = first ? wire_header::frame : wire_header::cont;
    if (first) {
      w.type = static_cast<std::uint8_t>(f.hdr.type);
      w.status = static_cast<std::uint8_t>(f.hdr.st);
      w.flags = static_cast<std::uint8_t>(f.hdr.flags);
      w.length = f.hdr.length;
      w.size = f.hdr.size;
      w.tag = f.hdr.tag;
      w.id = f.hdr.id;
      w.addr = f.hdr.addr;
      w.key = f.hdr.key;
      if (f.encoded[0] == std::byte{1}) {
        auto g = grant_of(f);
        if (g != grants_.end()) {
          w.raddr = reinterpret_cast<std::uintptr_t>(g->addr);
          w.rkey = g->key.rkey();
          last_key_ = {w.raddr, g->len, w.rkey};
        }
      }
    }
    w.credits = credits_.grant();
    const std::byte* src = f.payload + f.written;
    ibv_sge sge[2]{};
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_SEND;
    const bool inlined = wire_size + chunk <= max_inline_;
    const bool signaled = signal_next(1, last && !ends_at_post, inlined);
    wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    wr.wr_id = signaled ? t->wr_id() : gdr::verbs::unsignaled_work()->wr_id();
    if (inlined) {
      // Inline: the provider copies header and payload into the work
      // request now; nothing is read later.
      std::memcpy(t->buf, &w, wire_size);
      sge[0].addr = reinterpret_cast<std::uintptr_t>(t->buf);
      sge[0].length = static_cast<std::uint32_t>(wire_size);
      sge[1].addr = reinterpret_cast<std::uintptr_t>(src);
      sge[1].length = static_cast<std::uint32_t>(chunk);
      wr.num_sge = chunk != 0 ? 2 : 1;
      wr.send_flags |= IBV_SEND_INLINE;
      ++stats_.inline_sends;
    } else {
      std::memcpy(t->buf, &w, wire_size);
      if (chunk != 0) std::memcpy(t->buf + wire_size, src, chunk);
      sge[0].addr = reinterpret_cast<std::uintptr_t>(t->buf);
      sge[0].length = static_cast<std::uint32_t>(wire_size + chunk);
      sge[0].lkey = tx_mr_.lkey();
      wr.num_sge = 1;
    }
    wr.sg_list = sge;
    if (last && !ends_at_post) t->f = &f;
    if (!post_send_wrs(&wr, 1, t)) return false;
    f.sealed = true;
    f.written += chunk;
    ++stats_.send_wrs;
    if (last) {
      if (ends_at_post) copied_frame_ = &f;
      return true;
    }
  }
}

/// Sends a credit-only message when the peer may be waiting for credits
/// and nothing else carries them.
inline void connection::maybe_send_credits() noexcept {
  if (!established_ || shut_ || failed()) return;
  if (lane_ctl_due_ != 0) lane_send_control();
  // The next frame carries them if it has the credit to go.
  if (!credits_.credit_message_due(rx_n_, tx_.head != nullptr && credits_.can_consume(1))) return;
  if (!credits_.can_consume(1, true) || free_tx_ == nullptr || sq_used_ + 1 > sq_depth_) return;
  wire_header w;
  w.kind = wire_header::credit;
  if (!post_header(w, false)) return;
  ++stats_.credit_messages;
}

/// Posts a SEND of header `w` alone, carrying the credits owed, from a free
/// send slot (the caller checked the room and the peer's credit).
/// `signal`: signalled always, else when `signal_next` says.
inline bool connection::post_header(wire_header w, bool signal) noexcept {
  tx_slot* t = take_tx();
  w.credits = credits_.grant();
  std::memcpy(t->buf, &w, wire_size);
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uintptr_t>(t->buf);
  sge.length = static_cast<std::uint32_t>(wire_size);
  sge.lkey = tx_mr_.lkey();
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND;
  const bool inlined = wire_size <= max_inline_;
  const bool signaled = signal_next(1, signal, inlined);
  wr.send_flags = (signaled ? IBV_SEND_SIGNALED : 0) | (inlined ? IBV_SEND_INLINE : 0);
  wr.wr_id = signaled ? t->wr_id() : gdr::verbs::unsignaled_work()->wr_id();
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return post_send_wrs(&wr, 1, t);
}

inline void connection::on_tx(gdr::verbs::work* w, const ibv_wc& wc) noexcept {
  if (w == nullptr) return;
  auto* t = static_cast<tx_slot*>(w);
  connection* c = t->c;
  proto::event_scope ev(*c);  // its end may free c
  c->tx_done(*t, wc);
  c->on_io_done();
}

inline void connection::tx_done(tx_slot& t, const ibv_wc& wc) noexcept {
  ++stats_.completions;
  sq_used_ -= static_cast<int>(t.covered);
  if (--busy_noted_ == 0) poller_->note_busy(-1);
  ++activity_;
  // Frames copied before this request are sent: they go back before the
  // frame this completion ends (a close among them fails the rest).
  if (wc.status == IBV_WC_SUCCESS) hand_back_copied();
  frame* f = t.f;
  bool rdma = t.rdma;
  bool read = t.read;
  std::size_t read_bytes = t.read_bytes;
  const std::byte* slot_buf = t.buf;  // not written again before read_done: nothing posts in between
  t.src.end();
  free_held(t.held);
  free_tx(&t);
  std::error_code ec;
  if (wc.status != IBV_WC_SUCCESS) {
    if (!failed()) fail_wc(wc);
    ec = error();
  }
  if (read) read_done(read_bytes, slot_buf, ec);
  if (f != nullptr) {
    if (f->where == in_posted) f->where = nowhere;
    if (f->encoded[0] == std::byte{1}) {
      auto g = grant_of(*f);
      if (g != grants_.end()) {
        if (!ec && !shut_) {
          // Held until the peer is done with the memory (see the file comment).
          g->sent = true;
          finish_grant(g);
          pump_tx();
          return;
        }
        grants_.erase(g);  // the queue pair is in error: the peer's NIC no longer reaches it
        if (!ec) ec = error() ? error() : std::error_code(errc::connection_lost);
      }
    }
    tx_path_ = rdma ? transfer_path::host_zero_copy : transfer_path::host_eager;
    on_sent(*f, ec);
  }
  pump_tx();
  release_unsignaled();
}

}  // namespace gdr::detail::verbs
