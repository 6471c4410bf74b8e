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
// fail as memory the driver cannot share does. As the driver knows what an
// opened handle really holds, the stand-in remembers the bytes it exported
// (by base, in this engine) and refuses a copy of this process's memory
// outside them with errc::protocol_error; `overclaim` makes the next
// exports lie like a hostile peer: `overclaim` bytes more than they hold,
// and the payload named past its end. A copy's `after` is recorded in
// `afters`, as for the staged copies.
//
// The virtual memory API's stand-in: `fd_block`s are memfds mapped shared
// (what `cuMemCreate` with POSIX file-descriptor handles is to the GPU).
// They export as `ipc_kind::fd` with the memfd as the descriptor, which the
// transport passes over its socket; the importer maps the descriptor it is
// given (cached by owner pid and base, checked by id; the transport keeps
// the descriptor) and copies out of the mapping.
#pragma once

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <new>
#include <system_error>
#include <utility>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/scheduler.hpp>

namespace gdr_test_support {

/// One allocation shared by file descriptor (see the file comment).
struct fd_block {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  int fd = -1;
  std::uint64_t id = 0;
};

/// The process's fd blocks, by base.
class fd_blocks {
 public:
  static fd_blocks& instance() {
    static fd_blocks b;
    return b;
  }
  /// `n` bytes (at least one page) of a memfd mapped shared; throws on failure.
  void* allocate(std::size_t n) {
    const std::size_t size = std::max<std::size_t>(n, 1);
    int fd = ::memfd_create("gdr-test-fd-block", MFD_CLOEXEC);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      if (fd >= 0) ::close(fd);
      throw std::bad_alloc();
    }
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw std::bad_alloc();
    }
    std::lock_guard lk(mu_);
    blocks_[reinterpret_cast<std::uintptr_t>(p)] = {reinterpret_cast<std::uintptr_t>(p), size, fd, ++next_id_};
    return p;
  }
  void free(void* p) noexcept {
    std::lock_guard lk(mu_);
    auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == blocks_.end()) return;
    ::munmap(p, it->second.size);
    ::close(it->second.fd);
    blocks_.erase(it);
    frees_.fetch_add(1, std::memory_order_release);
  }
  /// Changes with every free (`copy_engine::ipc_frees`).
  std::uint64_t frees() const noexcept { return frees_.load(std::memory_order_acquire); }
  /// Is block `base` with id `id` still allocated?
  bool alive(std::uint64_t base, std::uint64_t id) {
    std::lock_guard lk(mu_);
    auto it = blocks_.find(static_cast<std::uintptr_t>(base));
    return it != blocks_.end() && it->second.id == id;
  }
  /// The block holding `[p, p + n)`.
  bool find(const void* p, std::size_t n, fd_block& out) {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lk(mu_);
    auto it = blocks_.upper_bound(at);
    if (it == blocks_.begin()) return false;
    --it;
    if (at - it->second.base >= it->second.size || n > it->second.size - (at - it->second.base)) return false;
    out = it->second;
    return true;
  }

 private:
  std::mutex mu_;
  std::map<std::uintptr_t, fd_block> blocks_;
  std::uint64_t next_id_ = 0;
  std::atomic<std::uint64_t> frees_{0};
};

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
    for (auto& [k, m] : mapped_) ::munmap(m.p, m.size);
    unmap_retired();
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
    out.device = 0;
    out.pid = static_cast<std::int32_t>(::getpid());
    ++ipc_exports;
    if (fd_block b; fd_blocks::instance().find(p, n, b)) {
      out.kind = ipc_kind::fd;
      out.fd = b.fd;  // borrowed, as the driver's export is
      out.base = b.base;
      out.size = b.size;
      out.buffer_id = b.id;
      offset = reinterpret_cast<std::uintptr_t>(p) - b.base;
      ++fd_exports;
      return {};
    }
    out.base = reinterpret_cast<std::uintptr_t>(p);
    out.size = n;
    out.buffer_id = 1;
    offset = 0;
    try {
      std::size_t& held = exported_[out.base];
      held = std::max(held, n);
    } catch (...) {
      return gdr::errno_code(ENOMEM);
    }
    if (overclaim != 0) {
      out.size = n + overclaim;
      offset = overclaim;  // past the bytes exported, inside the claim
    }
    return {};
  }

  std::error_code ipc_copy(const ipc_memory& src, std::uint64_t offset, void* dst, int, std::size_t n,
                           gdr::stream_order after, completion* c) noexcept override {
    if (!ipc || n == 0 || dst == nullptr || c == nullptr || offset > src.size || n > src.size - offset)
      return gdr::errc::invalid_argument;
    auto from = reinterpret_cast<const std::byte*>(static_cast<std::uintptr_t>(src.base));
    int pid = src.pid == ::getpid() ? 0 : src.pid;
    if (src.kind == ipc_kind::handle && pid == 0) {
      // What the "driver" knows this allocation holds, whatever the claim.
      auto it = exported_.find(src.base);
      const std::uint64_t extent = it == exported_.end() ? 0 : std::min<std::uint64_t>(it->second, src.size);
      if (n > extent || offset > extent - n) {
        ++ipc_refused;
        return gdr::errc::protocol_error;
      }
    }
    try {
      if (after) afters.push_back(after.stream);
    } catch (...) {
      return gdr::errno_code(ENOMEM);
    }
    if (src.kind == ipc_kind::fd) {
      if (src.fd < 0) return gdr::errc::invalid_argument;
      if (pid != 0) {
        result_of_map m = map(src);
        if (m.p == nullptr) return gdr::errno_code(m.err);
        from = m.p;
        pid = 0;  // read through this process's mapping
      }
    }
    try {
      queue_[0].push_back({c, dst, from + offset, n, pid});
    } catch (...) {
      return gdr::errno_code(ENOMEM);
    }
    ++ipc_copies;
    ++in_flight_;
    if (in_flight_ > max_in_flight) max_in_flight = in_flight_;
    return {};
  }

  void ipc_forget(int pid) noexcept override {
    ++ipc_forgets;
    for (auto it = mapped_.begin(); it != mapped_.end();) it = it->first.first == pid ? retire(it) : std::next(it);
    if (in_flight_ == 0) unmap_retired();
  }

  std::uint64_t ipc_frees() const noexcept override { return fd_blocks::instance().frees(); }
  bool ipc_alive(std::uint64_t base, std::uint64_t buffer_id) const noexcept override {
    try {
      return fd_blocks::instance().alive(base, buffer_id);
    } catch (...) {
      return true;  // (the lock failed) asked again at the next free
    }
  }
  void ipc_release(int pid, std::uint64_t base, std::uint64_t buffer_id) noexcept override {
    auto it = mapped_.find({pid, base});
    if (it == mapped_.end() || it->second.id != buffer_id) return;
    ++ipc_releases;
    retire(it);
    if (in_flight_ == 0) unmap_retired();
  }

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
        // The owner gone (killed mid-copy): what the transport sees too.
        if (::process_vm_readv(e.pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(e.n))
          ec = errno == ESRCH ? gdr::errc::connection_lost : gdr::errc::device_error;
      } else {
        std::memcpy(e.dst, e.src, e.n);
      }
      e.c->done(e.c, ec);
    }
    if (in_flight_ == 0) unmap_retired();
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
  std::size_t overclaim = 0;   ///< exports claim this many bytes more, and name the payload past its end
  std::size_t ipc_refused = 0;  ///< copies refused: outside what the export holds
  std::size_t ipc_exports = 0;
  std::size_t ipc_copies = 0;
  std::size_t ipc_forgets = 0;
  std::size_t ipc_releases = 0;  ///< peers' fd blocks let go because the peer freed them
  std::size_t fd_exports = 0;  ///< fd blocks exported
  std::size_t fd_imports = 0;  ///< fd blocks of a peer mapped here
  std::size_t fd_hits = 0;     ///< copies that found their peer's fd block mapped
  std::size_t fd_stale = 0;    ///< mappings replaced: the peer's block at that base changed
  std::size_t mapped() const noexcept { return mapped_.size(); }

 private:
  struct entry {
    completion* c;
    void* dst;
    const void* src;
    std::size_t n;
    int pid;  // the owner of src when another process (CUDA IPC's stand-in)
  };
  static void release_block(std::byte* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }

  struct mapping {
    std::byte* p = nullptr;
    std::size_t size = 0;
    std::uint64_t id = 0;
  };
  struct result_of_map {
    const std::byte* p = nullptr;
    int err = 0;
  };
  /// The peer's fd block `src`, mapped here (now, or before with the same id).
  result_of_map map(const ipc_memory& src) noexcept {
    const std::pair<int, std::uint64_t> k{src.pid, src.base};
    auto it = mapped_.find(k);
    if (it != mapped_.end()) {
      if (it->second.id == src.buffer_id && it->second.size == src.size) {
        ++fd_hits;
        return {it->second.p, 0};
      }
      ++fd_stale;
      retire(it);
    }
    // The descriptor came from the peer: a mapping longer than its file
    // would fault past the end (the driver refuses such an import alike).
    struct stat st {};
    if (::fstat(src.fd, &st) != 0 || st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) < src.size)
      return {nullptr, EINVAL};
    void* p = ::mmap(nullptr, src.size, PROT_READ | PROT_WRITE, MAP_SHARED, src.fd, 0);
    if (p == MAP_FAILED) return {nullptr, errno};
    try {
      mapped_[k] = {static_cast<std::byte*>(p), static_cast<std::size_t>(src.size), src.buffer_id};
    } catch (...) {
      ::munmap(p, src.size);
      return {nullptr, ENOMEM};
    }
    ++fd_imports;
    return {static_cast<std::byte*>(p), 0};
  }
  /// Takes a mapping out of `mapped_`: unmapped once no copy runs
  /// (`unmap_retired`). The entry after it.
  std::map<std::pair<int, std::uint64_t>, mapping>::iterator retire(
      std::map<std::pair<int, std::uint64_t>, mapping>::iterator it) noexcept {
    retired_.push_back(it->second);
    return mapped_.erase(it);
  }
  void unmap_retired() noexcept {
    for (mapping& m : retired_) ::munmap(m.p, m.size);
    retired_.clear();
  }

  gdr::scheduler* sched_;
  std::deque<entry> queue_[2];
  std::size_t in_flight_ = 0;
  bool held_ = false;
  int fail_in_ = 0;
  std::map<std::pair<int, std::uint64_t>, mapping> mapped_;  // peers' fd blocks, by (pid, base)
  std::map<std::uint64_t, std::size_t> exported_;            // this process's handle exports: base -> bytes
  std::vector<mapping> retired_;                             // unmapped once no copy runs
};

}  // namespace gdr_test_support
