/// \file
/// Direct one-sided operations: a put, get or remote atomic whose remote
/// view carries a NIC key of the peer's domain (`set_direct_domain`) is
/// not a request to the peer's loop but work the transport posts to its
/// own NIC (verbs: RDMA WRITE, READ, atomics), which the peer's NIC checks
/// and serves with no action by the peer's CPU.
///
/// The engine's part is small and explicit: the operation enters
/// `stage::direct` and the `direct_` list; it is handed to the transport
/// (`link_direct`) at once, or at the end of the event if one is running
/// (`direct_due_`: the re-entrancy rule); from then on `op::direct_out_`
/// says the transport holds its memory, until `on_direct_done`, which the
/// transport calls exactly once. A stop takes it back if the NIC does not
/// have it yet (`link_direct_withdraw`), else it ends when the NIC does; a
/// failure of the endpoint completes it at once with the error and
/// finishes it when the transport gives it back (a queue pair in error
/// returns every work request flushed).
#pragma once

#include <algorithm>
#include <cstddef>
#include <system_error>

#include <gdr/protocol/engine/engine.hpp>

namespace gdr::detail::proto {

inline bool engine::launch_direct(op& o) noexcept {
  o.to(op::stage::direct);
  enlist(direct_, o);
  if (link_calls_now()) {
    o.direct_out_ = true;
    link_direct(o);
    return true;
  }
  try {
    direct_due_.push_back(&o);
  } catch (...) {
    complete(o, errno_code(ENOMEM));
    return true;
  }
  o.direct_due_ = true;
  due();
  return true;
}

inline void engine::on_direct_done(op& o, std::error_code ec) noexcept {
  assert(o.direct_out_ && "gdr: on_direct_done for an operation the transport does not hold");
  o.direct_out_ = false;
  if (o.result_set_) {
    try_finish(o);  // stopped or failed meanwhile: its memory is free now
    return;
  }
  if (!ec) {
    std::size_t n = o.size_;
    if (o.batch_ != nullptr) {
      n = 0;
      for (std::size_t i = 0; i < o.nbatch_; ++i) n += o.batch_[i].bytes;
    }
    o.bytes_ = n;
    o.path_ = transfer_path::one_sided_rdma;
  }
  complete(o, ec);
}

}  // namespace gdr::detail::proto
