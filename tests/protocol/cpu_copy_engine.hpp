// A copy engine for tests on machines without a GPU: "device" memory is
// ordinary host memory labelled gdr::Device, and copies are memcpys that
// complete from the scheduler's loop, in order per direction, like a CUDA
// stream's. It exists so that the staged path's states (chunking, slots,
// truncation, cancellation and peer death while copies run, copy failures)
// are exercised on every machine; the GPU machine runs the same tests on the
// CUDA copy engine (gdr::cuda::event_poller).
//
// Knobs: `hold()` keeps every copy pending until `release()` (a transfer
// stopped in the middle); `fail_copy(n)` fails the n-th copy from now with
// errc::device_error. Counters: copies, bytes, the most in flight, and the
// `after` streams it was given.
//
// CUDA IPC's stand-in (`ipc = true`): an export describes the bytes
// themselves (base = the pointer, the owner's pid), and a copy out of a
// peer's export reads them with `process_vm_readv` (or `memcpy` when the
// owner is this process), completing from the loop like the other copies.
// So the shared-memory transport's CUDA IPC path runs everywhere; the GPU
// machine runs it on the driver's IPC. `refuse_export` makes every export
// fail as memory the driver cannot share does.
#pragma once

#include <sys/uio.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <deque>
#include <new>
#include <system_error>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/scheduler.hpp>

namespace gdr_test_support {

class cpu_copy_engine final : public gdr::copy_engine {
 public:
  explicit cpu_copy_engine(gdr::scheduler& s) : sched_(&s) {
    if (!s.claim_poller_slot(static_cast<gdr::copy_engine&>(*this)))
      throw gdr::error(gdr::errc::invalid_argument, "cpu_copy_engine: the scheduler already has a copy engine");
    s.add_poller(*this);
  }
  cpu_copy_engine(const cpu_copy_engine&) = delete;
  cpu_copy_engine& operator=(const cpu_copy_engine&) = delete;
  ~cpu_copy_engine() override {
    sched_->remove_poller(*this);
    sched_->release_poller_slot(static_cast<gdr::copy_engine&>(*this));
  }

  std::error_code copy(direction d, int device, void* dst, const void* src, std::size_t n, gdr::stream_order after,
                       completion* c) noexcept override {
    if (n == 0 || device < 0 || dst == nullptr || src == nullptr || c == nullptr) return gdr::errc::invalid_argument;
    try {
      queue_[d == direction::to_host ? 0 : 1].push_back({c, dst, src, n, 0});
      if (after) afters.push_back(after.stream);
    } catch (...) {
      return gdr::errno_code(ENOMEM);
    }
    ++copies;
    bytes += n;
    ++in_flight_;
    if (in_flight_ > max_in_flight) max_in_flight = in_flight_;
    return {};
  }

  bool ipc_capable() const noexcept override { return ipc; }

  std::error_code ipc_export(const void* p, std::size_t n, ipc_memory& out, std::uint64_t& offset,
                             const char** why) noexcept override {
    if (!ipc || refuse_export) {
      if (why != nullptr) *why = "the test's copy engine refuses to share this memory";
      return gdr::errc::unsupported;
    }
    out = {};
    out.base = reinterpret_cast<std::uintptr_t>(p);
    out.size = n;
    out.buffer_id = 1;
    out.device = 0;
    out.pid = static_cast<std::int32_t>(::getpid());
    offset = 0;
    ++ipc_exports;
    return {};
  }

  std::error_code ipc_copy(const ipc_memory& src, std::uint64_t offset, void* dst, int, std::size_t n,
                           completion* c) noexcept override {
    if (!ipc || n == 0 || dst == nullptr || c == nullptr) return gdr::errc::invalid_argument;
    try {
      queue_[0].push_back({c, dst, reinterpret_cast<const void*>(static_cast<std::uintptr_t>(src.base + offset)), n,
                           src.pid == ::getpid() ? 0 : src.pid});
    } catch (...) {
      return gdr::errno_code(ENOMEM);
    }
    ++ipc_copies;
    ++in_flight_;
    if (in_flight_ > max_in_flight) max_in_flight = in_flight_;
    return {};
  }

  void ipc_forget(int) noexcept override { ++ipc_forgets; }

  pinned_block allocate_pinned(std::size_t n) noexcept override {
    auto* p = static_cast<std::byte*>(::operator new(n, std::align_val_t{64}, std::nothrow));
    if (p != nullptr) ++pinned_blocks;
    return {p, n, &release_block};
  }

  gdr::poll_status poll() noexcept override {
    gdr::poll_status st;
    if (in_flight_ == 0) return st;
    if (held_) {
      st.sleep_bound = std::chrono::milliseconds(1);
      return st;
    }
    // Take what completes now, then complete it (a completion may resume a
    // coroutine that queues more, or ends the test).
    std::vector<entry> ready;
    for (auto& q : queue_) {
      while (!q.empty()) {
        ready.push_back(q.front());
        q.pop_front();
      }
    }
    in_flight_ -= ready.size();
    for (entry& e : ready) {
      std::error_code ec;
      if (fail_in_ > 0 && --fail_in_ == 0) {
        ec = gdr::errc::device_error;
      } else if (e.pid != 0) {
        iovec local{e.dst, e.n};
        iovec remote{const_cast<void*>(e.src), e.n};
        if (::process_vm_readv(e.pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(e.n))
          ec = gdr::errc::device_error;
      } else {
        std::memcpy(e.dst, e.src, e.n);
      }
      e.c->done(e.c, ec);
    }
    st.did_work = !ready.empty();
    if (in_flight_ != 0) st.sleep_bound = std::chrono::nanoseconds(0);
    return st;
  }

  const char* name() const noexcept override { return "cpu-copies"; }

  void hold() noexcept { held_ = true; }
  void release() noexcept { held_ = false; }
  /// The n-th copy from now (1: the next) fails with errc::device_error.
  void fail_copy(int n) noexcept { fail_in_ = n; }
  std::size_t in_flight() const noexcept { return in_flight_; }

  std::size_t copies = 0;
  std::size_t bytes = 0;
  std::size_t max_in_flight = 0;
  std::size_t pinned_blocks = 0;
  std::vector<CUstream_st*> afters;
  bool ipc = false;            ///< the CUDA IPC stand-in is on
  bool refuse_export = false;  ///< every export fails (memory the driver cannot share)
  std::size_t ipc_exports = 0;
  std::size_t ipc_copies = 0;
  std::size_t ipc_forgets = 0;

 private:
  struct entry {
    completion* c;
    void* dst;
    const void* src;
    std::size_t n;
    int pid;  // the owner of src when another process (CUDA IPC's stand-in)
  };
  static void release_block(std::byte* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }

  gdr::scheduler* sched_;
  std::deque<entry> queue_[2];
  std::size_t in_flight_ = 0;
  bool held_ = false;
  int fail_in_ = 0;
};

}  // namespace gdr_test_support
