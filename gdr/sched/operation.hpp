/// \file
/// The operation base: what every completion source (io_uring, CUDA events,
/// RDMA CQs) resumes. An operation's address is its identity in the kernel and
/// the hardware: the io_uring `user_data`, and later the verbs `wr_id`.
///
/// There is no `std::function` and no allocation per operation: the operation
/// lives in the awaiting coroutine's frame, and completion is one indirect call
/// through a plain function pointer (as libunifex `completion_base` and stdexec's
/// io_uring context do).
#pragma once

#include <cstdint>

namespace gdr {

/// Base of everything a poller completes.
///
/// Contract: `complete` is called exactly once per completion event, on the
/// thread that runs the owning scheduler. Multi-shot sources (io_uring
/// `IORING_CQE_F_MORE`, zero-copy send notifications) call it once per event;
/// the operation must stay alive until the last one.
struct operation {
  /// `res` follows the io_uring convention: >= 0 success (a byte count, a file
  /// descriptor...), negative errno on failure. `flags` are the CQE flags.
  using complete_fn = void (*)(operation* self, int res, std::uint32_t flags) noexcept;

  complete_fn complete = nullptr;

  /// The value placed in `io_uring_sqe::user_data` / `ibv_send_wr::wr_id`.
  std::uint64_t user_data() noexcept { return reinterpret_cast<std::uintptr_t>(this); }
  static operation* from_user_data(std::uint64_t v) noexcept {
    return reinterpret_cast<operation*>(static_cast<std::uintptr_t>(v));
  }
};

/// A unit of work handed to a scheduler from any thread (`scheduler::post`).
/// Intrusive: the node lives in the poster's memory until `run` is called.
struct remote_work {
  using run_fn = void (*)(remote_work* self) noexcept;
  run_fn run = nullptr;
  remote_work* next = nullptr;
};

}  // namespace gdr
