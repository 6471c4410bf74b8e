/// \file
/// The CUDA IPC members of `gdr::cuda::event_poller` (declared there; the
/// exports and the cache of imported allocations are gdr/cuda/ipc.hpp's):
/// a copy straight out of a peer's allocation on the GPU's IPC stream,
/// checked against what the import really holds and ordered after the
/// importing operation's `after` stream, and the fence that orders a
/// peer's read of this process's memory after the work queued before it.
///
/// Both sides keep the operation's stream order: the owner's bytes are
/// read only after its fence (its default stream and its `after`), and
/// the importer's copy is queued behind an event recorded on its own
/// `after` stream (`cudaStreamWaitEvent` on the IPC stream: no host wait),
/// so a kernel still reading a receive's destination, or a `cudaMemsetAsync`
/// of it, runs before the copy writes it. The IPC stream is one per GPU and
/// keeps its copies in order: the copies queued behind a waiting one wait
/// too.
#pragma once

#include <gdr/cuda/event_poller.hpp>

namespace gdr::cuda {

inline std::error_code event_poller::ipc_copy(const ipc_memory& src, std::uint64_t offset, void* dst, int dst_device,
                                            std::size_t n, stream_order after, completion* c) noexcept {
  if (n == 0 || dst == nullptr || c == nullptr || c->done == nullptr || src.device < 0 ||
      !ipc_within(offset, n, src.size) || (after && after.device < 0))
    return make_error_code(errc::invalid_argument);
  if (!reserve_fifo()) return make_error_code(std::errc::not_enough_memory);
  const int device = dst_device >= 0 ? dst_device : src.device;
  cudaStream_t s = nullptr;
  if (std::error_code ec = copy_stream(device, ipc_slot, &s)) return ec;
  result<ipc_share::entry*> e = ipc_.acquire(src, device);
  if (!e) return e.error();
  // Within what the import holds, not what the peer claimed (ipc.hpp,
  // "Bounds"): nothing is queued for a range outside it.
  if (!ipc_within(offset, n, (*e)->extent)) {
    ipc_.release(*e);
    return make_error_code(errc::protocol_error);
  }
  copy_node* node = take_node();
  cudaEvent_t ev = nullptr;
  std::error_code ec = node == nullptr ? make_error_code(std::errc::not_enough_memory) : acquire_event(device, &ev);
  if (!ec && after) ec = order_after(after, s);
  if (!ec) {
    ec = check(cudaMemcpyAsync(dst, (*e)->mapped + offset, n, cudaMemcpyDefault, s), "cudaMemcpyAsync (CUDA IPC)");
    if (!ec && (ec = check(cudaEventRecord(ev, s), "cudaEventRecord")))
      check_or_log(cudaStreamSynchronize(s), "cudaStreamSynchronize (after a failed cudaEventRecord)");
  }
  if (ec) {
    if (ev != nullptr) release_event(device, ev);
    if (node != nullptr) recycle(node);
    ipc_.release(*e);
    return ec;
  }
  node->copy_ = true;
  node->done_ = c;
  node->ipc_ = *e;
  push(s, device, node, ev);
  ++stats_.copies;
  return {};
}

inline bool event_poller::streams_idle(int device, stream_order after) noexcept {
  auto idle = [](cudaStream_t st) {
    const cudaError_t q = cudaStreamQuery(st);
    if (q != cudaSuccess) (void)cudaGetLastError();  // not ready (or an error the event path reports)
    return q == cudaSuccess;
  };
  {
    device_guard g(device);
    if (g.error() || !idle(cudaStreamLegacy)) return false;
  }
  if (!after) return true;
  device_guard g(after.device);
  return !g.error() && idle(after.stream);
}

inline std::error_code event_poller::ipc_fence(int device, stream_order after, completion* c,
                                             bool& done_now) noexcept {
  done_now = false;
  if (device < 0 || c == nullptr || c->done == nullptr || (after && after.device < 0))
    return make_error_code(errc::invalid_argument);
  ++stats_.fences;
  // The usual case: the streams are idle (the caller synchronized, or its
  // work is done). A query queues nothing, where an event record is GPU
  // work of this process's context, which a GPU shared with the peer's
  // process must switch to.
  if (streams_idle(device, after)) {
    ++stats_.fences_idle;
    done_now = true;
    return {};
  }
  if (!reserve_fifo()) return make_error_code(std::errc::not_enough_memory);
  cudaStream_t s = nullptr;
  if (std::error_code ec = copy_stream(device, ipc_slot, &s)) return ec;
  cudaEvent_t legacy = nullptr, ordered = nullptr;
  if (std::error_code ec = acquire_event(device, &legacy)) return ec;
  std::error_code ec;
  {
    device_guard g(device);
    ec = g.error() ? g.error() : check(cudaEventRecord(legacy, cudaStreamLegacy), "cudaEventRecord (legacy stream)");
  }
  if (!ec && after && !(ec = acquire_event(after.device, &ordered)))
    ec = check(cudaEventRecord(ordered, after.stream), "cudaEventRecord (after)");
  // Done already (the usual case: the caller synchronized): no wait.
  auto done = [](cudaEvent_t e) {
    if (e == nullptr) return true;
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaErrorNotReady) (void)cudaGetLastError();
    return q == cudaSuccess;
  };
  if (!ec && done(legacy) && done(ordered)) {
    done_now = true;
  } else if (!ec) {
    ec = check(cudaStreamWaitEvent(s, legacy, 0), "cudaStreamWaitEvent");
    if (!ec && ordered != nullptr) ec = check(cudaStreamWaitEvent(s, ordered, 0), "cudaStreamWaitEvent");
  }
  release_event(device, legacy);
  if (ordered != nullptr) release_event(after.device, ordered);
  if (ec || done_now) return ec;
  copy_node* node = take_node();
  if (node == nullptr) return make_error_code(std::errc::not_enough_memory);
  cudaEvent_t ev = nullptr;
  if ((ec = acquire_event(device, &ev)) || (ec = check(cudaEventRecord(ev, s), "cudaEventRecord"))) {
    if (ev != nullptr) release_event(device, ev);
    recycle(node);
    return ec;
  }
  node->copy_ = true;
  node->done_ = c;
  push(s, device, node, ev);
  return {};
}

}  // namespace gdr::cuda
