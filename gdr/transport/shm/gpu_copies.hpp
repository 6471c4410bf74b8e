/// \file
/// The shared-memory reader's GPU copies (members of `connection`, declared
/// in connection.hpp): CUDA IPC copies out of the peer's memory, which the
/// reader reads on past, and pieces of the ring copied into `Device`
/// memory, which it waits for.
///
/// CUDA IPC jobs. Each descriptor frame the reader takes becomes a job, in
/// a ring of `max_ipc_jobs`, in the order read: its copy (on the copy
/// engine's IPC stream, so the copies of consecutive frames run back to
/// back and complete in order), or none (a payload nobody wants). A job
/// ends only at the head, once done (`settle_ipc`): the copy is counted
/// in `copied` for the writer (which completes its frames in that order),
/// then the engine's placement ends: a deferred one by its ticket, the
/// current one (ticket 0: the engine would not defer it, and the reader
/// waits for it) by `on_placed`, or released if the engine stopped it
/// meanwhile. A failed copy fails the connection before its placement
/// ends, and from a failure on nothing is counted or placed: the jobs
/// behind it end with the connection's error on both sides.
///
/// The reader goes on while jobs run only with frames `may_pass_copies`
/// allows (the next descriptor frames, matching and flow control, and
/// messages whose bytes are in the ring); at any other frame it stops
/// (`rx_waits_copies_`) until every job has ended. The peer's hang-up and
/// this side's socket shutdown wait for the jobs too (`hangup_due_`,
/// `end_due_`): the peer's memory is its own again once its copies are
/// counted.
#pragma once

#include <gdr/log.hpp>
#include <gdr/transport/shm/connection.hpp>

namespace gdr::detail::shm {

inline bool connection::may_pass_copies(const proto::header& h, bool ipc) const noexcept {
  if (ipc) return ipc_count_ < max_ipc_jobs;
  switch (h.type) {
    // Matching and flow control, with nothing to place.
    case proto::msg::rts:
    case proto::msg::rtr:
    case proto::msg::credit:
    case proto::msg::put_ack: return h.length == 0;
    // A message whose bytes are in the ring: matched to its receive when
    // its header comes, as the messages before it were, into memory of
    // its own. Not one that comes as an address (`copied` counts those
    // in order with the copies).
    case proto::msg::eager:
    case proto::msg::data: return !single_copy_in(h);
    // A close would end the copies' operations; a put with its bytes in
    // the ring must not overtake a put's copy into the same memory; a get
    // or an atomic must see the puts before it; the rest are rare.
    default: return false;
  }
}

inline bool connection::start_ipc_copy(const proto::rx_plan& plan, const copy_engine::ipc_memory& m,
                                        std::uint64_t off) noexcept {
  skip_ = 0;
  ipc_job& j = ipc_jobs_[(ipc_head_ + ipc_count_) % max_ipc_jobs];
  j.ticket = 0;
  j.copying = false;
  j.finished = false;
  j.aborted = false;
  j.ec = {};
  if (plan.want == 0) {
    // Nothing of it wanted (a dropped message): its turn to be counted.
    ++ipc_count_;
    ipc_current_ = true;
    j.finished = true;
    settle_ipc();
    return !failed() && !reader_held();
  }
  // Ordered after what the receiving operation's `after` stream still does
  // with its memory, as a staged copy would be.
  if (std::error_code ec = ce_->ipc_copy(m, off, plan.dst, plan.device, plan.want, plan.after, &j)) {
    if (ec == errc::protocol_error) {
      // The range lies outside what the peer's allocation really holds: a
      // descriptor that claims more than it exported.
      gdr::detail::log("shm", "pid %d's CUDA IPC descriptor names bytes outside its allocation; the connection fails",
                       parts_.peer_pid);
      protocol_fail(gdr::tcp::frame_status::bad_field);
      return false;
    }
    gdr::detail::log("shm", "a CUDA IPC copy out of pid %d's memory could not be started (%s); the connection fails",
                     parts_.peer_pid, ec.message().c_str());
    on_link_failed(ec);
    return false;
  }
  ++ipc_count_;
  j.copying = true;
  stats_.ipc_max_in_flight = std::max<std::uint64_t>(stats_.ipc_max_in_flight, ipc_count_);
  j.ticket = defer_placement();
  if (j.ticket == 0) {
    ipc_current_ = true;  // placed in turn: the reader waits
    return false;
  }
  return true;
}

inline void connection::on_ipc_done(copy_engine::completion* node, std::error_code ec) noexcept {
  auto& j = *static_cast<ipc_job*>(node);
  connection* c = j.self;
  proto::event_scope ev(*c);
  j.finished = true;
  j.ec = ec;
  c->settle_ipc();
  c->after_gpu();
}

inline void connection::settle_ipc() noexcept {
  bool counted = false;
  while (ipc_count_ != 0 && ipc_jobs_[ipc_head_].finished) {
    ipc_job& j = ipc_jobs_[ipc_head_];
    const ipc_job done = j;
    j.finished = false;
    ipc_head_ = (ipc_head_ + 1) % max_ipc_jobs;
    --ipc_count_;
    const bool last = ipc_count_ == 0;
    if (done.ec && !failed()) on_link_failed(done.ec);  // first: the placement's operation fails with it
    // After a failure nothing more is counted: the peer's frames from
    // there on end with the connection's error, as this side's receives
    // do (the copies behind a failed one ran, but neither side uses them).
    const bool ok = !done.ec && !failed();
    if (ok) {
      if (done.copying) ++stats_.ipc_copies;
      if (done.ticket != 0 && !last) ++stats_.ipc_read_past;
      count_copied();
      counted = true;
    }
    if (done.ticket != 0) {
      on_deferred_placed(done.ticket, ok, true);
    } else {
      ipc_current_ = false;
      if (done.aborted) on_target_released();
      else if (ok) on_placed(true);
    }
  }
  if (counted && take_waiter(rx_.control().writer_waiting)) ring_peer();
  if (ipc_count_ == 0) {
    rx_waits_copies_ = false;
    // This side's end waited for the copies (the peer's memory is its own
    // again once they are counted): now.
    if (end_due_ >= 0) end_socket(std::exchange(end_due_, -1));
  }
}

inline void connection::start_ring_copy(std::size_t n) noexcept {
  std::size_t k = 0;
  const std::byte* src = rx_.span(0, n, k);
  // The first piece waits for the operation's `after` stream; the rest
  // queue behind it on the same stream.
  if (std::error_code ec = ce_->copy(copy_engine::direction::to_device, tgt_.device, tgt_.dst + tgt_.done, src, k,
                                     std::exchange(tgt_.after, stream_order{}), &ring_done_)) {
    on_link_failed(ec);
    return;
  }
  ring_copy_ = {};
  ring_copy_.active = true;
  ring_copy_.bytes = k;
  ++stats_.ring_gpu_copies;
}

inline void connection::on_ring_done(copy_engine::completion* node, std::error_code ec) noexcept {
  connection* c = static_cast<gpu_node*>(node)->self;
  proto::event_scope ev(*c);
  const ring_job j = std::exchange(c->ring_copy_, ring_job{});
  // A piece of the ring is in Device memory: its room goes back.
  c->rx_.consume(j.bytes);
  c->rx_.release();
  if (!j.aborted) c->tgt_.done += j.bytes;
  if (take_waiter(c->rx_.control().writer_waiting)) c->ring_peer();
  if (j.aborted) {
    c->on_target_released();
  } else if (ec && !c->failed()) {
    c->on_link_failed(ec);
  }
  c->after_gpu();
}

inline void connection::after_gpu() noexcept {
  if (reading()) pump();
  if (hangup_due_ && !gpu_busy()) {
    hangup_due_ = false;
    peer_ended();
    return_finished();
  }
  on_io_done();
}

}  // namespace gdr::detail::shm
