// Memory for the stress test, and the copy engine that stands in for a GPU.
//
// Every buffer an operation uses is a `block`: its own mapping, with red
// zones (bytes of a known pattern) just before and after the view, checked
// after the run ("nothing written outside a view"). A `Device` block is
// PROT_NONE at all times except while the test itself fills or reads it and
// while `guarded_copy_engine` copies into or out of it: a CPU load or store
// by the engine into Device memory is a SIGSEGV, which ends the run (the
// runner reports the seed). The copy engine is written after the idea of
// tests/protocol/cpu_copy_engine.hpp, with checks: each copy's device range
// must lie inside the view of a Device block that an operation or a
// registration is using *at the moment the copy runs* (a copy that runs after
// its operation completed is a late write), and its host range inside a
// pinned block the engine handed out. Copies complete from the loop, in order
// per direction, after a random number of loop turns drawn from the run's
// seed, so that copies interleave with the wire in many ways.
//
// Everything runs on the scheduler's one thread.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/memory/view.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/scheduler.hpp>

#include "tests/stress/journal.hpp"
#include "tests/stress/rng.hpp"

namespace stress {

enum class space : std::uint8_t { host, device };
inline const char* to_string(space s) noexcept { return s == space::host ? "host" : "dev"; }

/// Guard bytes on each side of every view.
inline constexpr std::size_t red_zone = 64;

inline std::size_t page_size() noexcept {
  static const std::size_t p = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return p;
}

/// One guarded allocation (see the file comment). Not movable: the copy
/// engine finds blocks by address.
class block {
 public:
  block(space sp, std::size_t n, std::uint64_t id, std::string name)
      : sp_(sp), size_(n), id_(id), name_(std::move(name)) {
    const std::size_t ps = page_size();
    mapped_ = (n + 2 * red_zone + ps - 1) / ps * ps;
    void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<std::byte*>(p);
    // The view ends at the mapping's end minus one red zone, so an overrun
    // past the red zone by the CPU faults even in host memory.
    data_ = base_ + mapped_ - red_zone - n;
    for (std::size_t i = 0; i < mapped_; ++i) base_[i] = guard_byte(i);
    protect();
  }
  block(const block&) = delete;
  block& operator=(const block&) = delete;
  ~block() { ::munmap(base_, mapped_); }

  space where() const noexcept { return sp_; }
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }
  const std::byte* map_begin() const noexcept { return base_; }
  const std::byte* map_end() const noexcept { return base_ + mapped_; }

  gdr::view<std::byte, gdr::Host> host_view() const noexcept { return {data_, size_}; }
  gdr::view<std::byte, gdr::Device> device_view() const noexcept { return {data_, size_, 0}; }

  /// Whether the copy engine may touch the view now (Device blocks: an
  /// operation using it is in flight, or it is a registered window).
  bool in_use() const noexcept { return in_use_; }
  void set_in_use(bool on) noexcept { in_use_ = on; }

  /// The test's own access: `f(bytes)` with the pages readable and writable.
  template <class F>
  void with_access(F&& f) {
    unprotect();
    f(data_);
    protect();
  }
  void write(std::size_t off, const std::byte* src, std::size_t n) {
    if (n == 0) return;
    with_access([&](std::byte* d) { std::memcpy(d + off, src, n); });
  }
  void fill(const std::vector<std::byte>& v) { write(0, v.data(), std::min(v.size(), size_)); }
  std::vector<std::byte> read() {
    std::vector<std::byte> v(size_);
    if (size_ != 0) with_access([&](std::byte* d) { std::memcpy(v.data(), d, size_); });
    return v;
  }
  /// The offset of the first guard byte that changed (before the view:
  /// negative), or 0 if none did.
  long damaged_guard() {
    long bad = 0;
    unprotect();
    const std::size_t lo = static_cast<std::size_t>(data_ - base_), hi = lo + size_;
    for (std::size_t i = 0; i < mapped_ && bad == 0; ++i) {
      if (i >= lo && i < hi) continue;
      if (base_[i] != guard_byte(i)) bad = i < lo ? -static_cast<long>(lo - i) : static_cast<long>(i - hi + 1);
    }
    protect();
    return bad;
  }

  /// Device pages for the copy engine (see guarded_copy_engine).
  void unprotect() noexcept {
    if (sp_ == space::device) ::mprotect(base_, mapped_, PROT_READ | PROT_WRITE);
  }
  void protect() noexcept {
    if (sp_ == space::device) ::mprotect(base_, mapped_, PROT_NONE);
  }

 private:
  std::byte guard_byte(std::size_t i) const noexcept {
    return static_cast<std::byte>(mix64(id_ * 0x10001 + i / 8) >> (8 * (i % 8)));
  }

  space sp_;
  std::size_t size_;
  std::uint64_t id_;
  std::string name_;
  std::byte* base_ = nullptr;
  std::size_t mapped_ = 0;
  std::byte* data_ = nullptr;
  bool in_use_ = false;
};

/// The blocks of one run, found by address.
class arena {
 public:
  block& make(space sp, std::size_t n, std::string name) {
    auto b = std::make_unique<block>(sp, n, ++next_id_, std::move(name));
    block& r = *b;
    by_addr_[reinterpret_cast<std::uintptr_t>(r.map_begin())] = std::move(b);
    return r;
  }
  /// The block whose mapping holds `p`, or null.
  block* find(const std::byte* p) const noexcept {
    auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = by_addr_.upper_bound(a);
    if (it == by_addr_.begin()) return nullptr;
    --it;
    block* b = it->second.get();
    return p < b->map_end() ? b : nullptr;
  }
  template <class F>
  void each(F&& f) const {
    for (auto& [a, b] : by_addr_) f(*b);
  }

 private:
  std::map<std::uintptr_t, std::unique_ptr<block>> by_addr_;
  std::uint64_t next_id_ = 0;
};

/// While a run's blocks exist: a SIGSEGV says whether the faulting address
/// is in a Device block (the CPU touched memory it must not), then the
/// fault is taken again by the handler that was there before (the
/// default's crash, or a sanitizer's report).
class fault_reporter {
 public:
  explicit fault_reporter(const arena& a) {
    current() = &a;
    struct sigaction sa {};
    sa.sa_sigaction = &on_fault;
    sa.sa_flags = SA_SIGINFO;
    ::sigaction(SIGSEGV, &sa, &old());
  }
  fault_reporter(const fault_reporter&) = delete;
  fault_reporter& operator=(const fault_reporter&) = delete;
  ~fault_reporter() {
    ::sigaction(SIGSEGV, &old(), nullptr);
    current() = nullptr;
  }

 private:
  static const arena*& current() noexcept {
    static const arena* a = nullptr;
    return a;
  }
  static struct sigaction& old() noexcept {
    static struct sigaction sa {};
    return sa;
  }
  static void on_fault(int, siginfo_t* si, void*) {
    const auto* addr = static_cast<const std::byte*>(si->si_addr);
    const block* b = current() ? current()->find(addr) : nullptr;
    char msg[512];
    int n;
    if (b != nullptr && b->where() == space::device)
      n = std::snprintf(msg, sizeof msg, "FAIL stress: device-touched: the CPU touched Device memory at byte %ld of %s\n",
                        static_cast<long>(addr - b->data()), b->name().c_str());
    else
      n = std::snprintf(msg, sizeof msg, "FAIL stress: crash: SIGSEGV at %p, outside every Device block\n",
                        si->si_addr);
    if (n > 0) {
      const ssize_t w = ::write(1, msg, static_cast<std::size_t>(std::min(n, 511)));
      (void)w;
    }
    ::sigaction(SIGSEGV, &old(), nullptr);  // returning re-executes the access under it
  }
};

/// Pinned blocks handed out and not yet released, process-wide: an
/// endpoint frees its bounce buffers after the copy engine may be gone.
struct pinned_table {
  std::vector<std::pair<std::byte*, std::size_t>> live;
  static pinned_table& get() {
    static pinned_table t;
    return t;
  }
  bool holds(const std::byte* p, std::size_t n) const noexcept {
    for (auto& [b, s] : live)
      if (p >= b && p + n <= b + s) return true;
    return false;
  }
};

class guarded_copy_engine final : public gdr::copy_engine {
 public:
  /// `max_delay`: each copy completes after 0..max_delay loop turns.
  guarded_copy_engine(gdr::scheduler& s, arena& mem, journal& j, std::uint64_t seed, unsigned max_delay)
      : sched_(&s), mem_(&mem), j_(&j), rng_(seed), max_delay_(max_delay) {
    if (!s.claim_poller_slot(static_cast<gdr::copy_engine&>(*this)))
      throw gdr::error(gdr::errc::invalid_argument, "guarded_copy_engine: the scheduler already has a copy engine");
    s.add_poller(*this);
  }
  guarded_copy_engine(const guarded_copy_engine&) = delete;
  guarded_copy_engine& operator=(const guarded_copy_engine&) = delete;
  ~guarded_copy_engine() override {
    sched_->remove_poller(*this);
    sched_->release_poller_slot(static_cast<gdr::copy_engine&>(*this));
    if (token_fd_ >= 0) ::close(token_fd_);
  }

  std::error_code copy(direction d, int device, void* dst, const void* src, std::size_t n, gdr::stream_order,
                       completion* c) noexcept override {
    if (n == 0 || device != 0 || dst == nullptr || src == nullptr || c == nullptr) {
      j_->fail("copy-engine", strf("copy(%s, device %d, %zu bytes): an argument is out of its domain",
                                   d == direction::to_host ? "to_host" : "to_device", device, n));
      return gdr::errc::invalid_argument;
    }
    const auto* dev = static_cast<const std::byte*>(d == direction::to_host ? src : dst);
    const auto* host = static_cast<const std::byte*>(d == direction::to_host ? dst : src);
    check(dev, host, n, "queued");
    try {
      queue_[d == direction::to_host ? 0 : 1].push_back(
          {c, static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), n, d,
           static_cast<unsigned>(rng_.below(max_delay_ + 1))});
    } catch (...) {
      return gdr::errno_code(ENOMEM);
    }
    ++in_flight_;
    ++copies;
    return {};
  }

  // CUDA IPC's stand-in (`ipc`): an export names the Device view's bytes
  // themselves, and a copy out of it (into a Device view, or host memory)
  // is the engine's like any other: only it touches Device memory.
  bool ipc_capable() const noexcept override { return ipc; }

  std::error_code ipc_export(const void* p, std::size_t n, ipc_memory& out, std::uint64_t& offset,
                             const char** why) noexcept override {
    const auto* d = static_cast<const std::byte*>(p);
    block* b = mem_->find(d);
    if (!ipc || b == nullptr || b->where() != space::device || d < b->data() || d + n > b->data() + b->size()) {
      j_->fail("ipc-export", strf("an export of %zu bytes outside every Device view", n));
      if (why != nullptr) *why = "not a Device view";
      return gdr::errc::unsupported;
    }
    out = {};
    out.base = reinterpret_cast<std::uintptr_t>(p);
    out.size = n;
    out.buffer_id = 1;
    out.device = 0;
    out.pid = static_cast<std::int32_t>(::getpid());
    offset = 0;
    if (ipc_fds) {
      // As gdr's own allocations go: with a descriptor (borrowed), which
      // the transport passes over its socket.
      if (token_fd_ < 0) token_fd_ = ::memfd_create("stress-ipc-token", MFD_CLOEXEC);
      if (token_fd_ < 0) return gdr::errno_code(errno);
      out.kind = ipc_kind::fd;
      out.fd = token_fd_;
    }
    ++ipc_exports;
    return {};
  }

  std::error_code ipc_copy(const ipc_memory& src, std::uint64_t offset, void* dst, int dst_device, std::size_t n,
                           gdr::stream_order, completion* c) noexcept override {
    // A descriptor that came with the copy (the transport's, borrowed) must
    // be the one exported: the same file.
    if (src.kind == ipc_kind::fd) {
      struct stat got {}, want {};
      if (src.fd < 0 || token_fd_ < 0 || ::fstat(src.fd, &got) != 0 || ::fstat(token_fd_, &want) != 0 ||
          got.st_ino != want.st_ino || got.st_dev != want.st_dev)
        j_->fail("ipc-fd", strf("an ipc_copy's descriptor (%d) is not the one its owner exported", src.fd));
      ++fds_taken;
    } else if (ipc_fds) {
      j_->fail("ipc-fd", "an ipc_copy of an allocation exported with a descriptor came without it");
    }
    const auto* from = reinterpret_cast<const std::byte*>(static_cast<std::uintptr_t>(src.base + offset));
    if (!ipc || n == 0 || dst == nullptr || c == nullptr || offset + n > src.size || src.pid != ::getpid()) {
      j_->fail("copy-engine", strf("ipc_copy of %zu bytes: an argument is out of its domain", n));
      return gdr::errc::invalid_argument;
    }
    if (dst_device >= 0) check(static_cast<const std::byte*>(dst), nullptr, n, "queued");
    check(from, nullptr, n, "queued");
    try {
      queue_[0].push_back({c, static_cast<std::byte*>(dst), from, n, direction::to_host,
                           static_cast<unsigned>(rng_.below(max_delay_ + 1)), true, dst_device >= 0});
    } catch (...) {
      return gdr::errno_code(ENOMEM);
    }
    ++in_flight_;
    ++copies;
    return {};
  }

  pinned_block allocate_pinned(std::size_t n) noexcept override {
    void* p = ::mmap(nullptr, n == 0 ? 1 : n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return {};
    pinned_table::get().live.emplace_back(static_cast<std::byte*>(p), n);
    return {static_cast<std::byte*>(p), n, &release_block};
  }

  gdr::poll_status poll() noexcept override {
    gdr::poll_status st;
    if (in_flight_ == 0) return st;
    for (auto& q : queue_) {
      for (auto& e : q)
        if (e.delay > 0) --e.delay;
    }
    // Take what completes now (in order per direction), then complete it: a
    // completion may queue more copies or end the run.
    std::vector<entry> ready;
    for (auto& q : queue_) {
      while (!q.empty() && q.front().delay == 0) {
        ready.push_back(q.front());
        q.pop_front();
      }
    }
    in_flight_ -= ready.size();
    for (entry& e : ready) {
      const std::byte* dev = e.d == direction::to_host ? e.src : e.dst;
      const std::byte* host = e.d == direction::to_host ? e.dst : e.src;
      std::error_code ec;
      if (e.ipc) {
        // Out of the peer's Device view into a Device view or host memory.
        block* s = check(e.src, nullptr, e.n, "run");
        block* d = e.dst_device ? check(e.dst, nullptr, e.n, "run") : nullptr;
        if (s != nullptr && (d != nullptr || !e.dst_device)) {
          s->unprotect();
          if (d != nullptr && d != s) d->unprotect();
          std::memcpy(e.dst, e.src, e.n);
          if (d != nullptr && d != s) d->protect();
          s->protect();
        } else {
          ec = gdr::errc::device_error;
        }
      } else if (block* b = check(dev, host, e.n, "run")) {
        b->unprotect();
        std::memcpy(e.dst, e.src, e.n);
        b->protect();
      } else {
        ec = gdr::errc::device_error;
      }
      e.c->done(e.c, ec);
    }
    st.did_work = !ready.empty();
    if (in_flight_ != 0) st.sleep_bound = std::chrono::nanoseconds(0);
    return st;
  }

  const char* name() const noexcept override { return "stress-guarded-copies"; }
  std::size_t in_flight() const noexcept { return in_flight_; }
  std::size_t copies = 0;
  bool ipc = false;  ///< CUDA IPC's stand-in is on (a shm-ipc run)
  /// ... and exports travel with a descriptor, as gdr's shareable
  /// allocations do (half of the shm-ipc runs, by seed).
  bool ipc_fds = false;
  std::size_t ipc_exports = 0;
  std::size_t fds_taken = 0;

 private:
  struct entry {
    completion* c;
    std::byte* dst;
    const std::byte* src;
    std::size_t n;
    direction d;
    unsigned delay;
    bool ipc = false;         // a CUDA IPC copy out of a peer's Device view
    bool dst_device = false;  // ... into a Device view (else host memory)
  };

  /// The Device block the copy may touch, or null (and a failure recorded)
  /// if it may not touch it; a block not in use is recorded but returned
  /// (the bytes land, and the late-write check sees them too).
  block* check(const std::byte* dev, const std::byte* host, std::size_t n, const char* when) {
    // (null `host`: a CUDA IPC copy's Device side alone. With CUDA IPC a
    // host payload reaches Device memory straight from the ring, not
    // through a pinned block.)
    if (host != nullptr && !ipc && !pinned_table::get().holds(host, n))
      j_->fail("copy-host-range", strf("a %s copy of %zu bytes uses host memory outside every pinned block", when, n));
    block* b = mem_->find(dev);
    if (b == nullptr || b->where() != space::device || dev < b->data() || dev + n > b->data() + b->size()) {
      j_->fail("copy-device-range",
               strf("a %s copy of %zu bytes reaches outside every Device view%s%s", when, n, b ? " (near " : "",
                    b ? (b->name() + ")").c_str() : ""));
      return nullptr;
    }
    if (!b->in_use())
      j_->fail("copy-late", strf("a %s copy of %zu bytes touches %s, whose operation had completed (or not begun)",
                                 when, n, b->name().c_str()));
    return b;
  }

  static void release_block(std::byte* p, std::size_t n) noexcept {
    auto& live = pinned_table::get().live;
    for (auto it = live.begin(); it != live.end(); ++it)
      if (it->first == p) {
        live.erase(it);
        break;
      }
    ::munmap(p, n == 0 ? 1 : n);
  }

  gdr::scheduler* sched_;
  arena* mem_;
  journal* j_;
  rng rng_;
  unsigned max_delay_;
  std::deque<entry> queue_[2];
  std::size_t in_flight_ = 0;
  int token_fd_ = -1;  // the descriptor exports carry (ipc_fds)
};

}  // namespace stress
