/// \file
/// CUDA IPC for the CUDA copy engine (`gdr::cuda::event_poller`): exporting
/// this process's device allocations, and the cache of the peers'
/// allocations imported here. The shared-memory transport's `Device` path
/// uses them through `copy_engine::ipc_export` / `ipc_copy`.
///
/// Export. gdr's own allocations of the virtual memory API (gdr/cuda/vmm.hpp:
/// every `gdr::buffer<T, Device>` from 1 MiB) are found in its registry and
/// exported as their file descriptor (`copy_engine::ipc_kind::fd`), which
/// the transport passes to the peer over its socket. Any other pointer is
/// looked up with the driver (`cuPointerGetAttributes`,
/// reached through `cudaGetDriverEntryPointByVersion`: no link against
/// libcuda): its allocation's start and size, its buffer id (unique in the
/// process: an address freed and allocated again gets another), its GPU,
/// whether it is managed memory, and whether the legacy IPC route can share
/// it (`cudaMalloc` memory can; memory of the virtual memory API or of a
/// memory pool, such as a caching allocator's expandable segments, cannot).
/// What cannot be shared fails with `errc::unsupported` and a sentence
/// saying what to do; nothing falls back to another path. The handle
/// (`cudaIpcGetMemHandle`) is made once per allocation and kept, keyed by
/// base address and checked by buffer id.
///
/// Import. A peer's allocation is opened once (`cudaIpcOpenMemHandle`, or,
/// for a descriptor, `vmm_map`: import, reserve, map, grant access to the
/// GPU that copies; the transport keeps the descriptor) and
/// kept in a cache keyed by (owner pid, GPU, base address); every hit is
/// checked against the buffer id the owner sent, so a stale mapping (the
/// owner freed the allocation and made another at the same address) is
/// never used: it is replaced. Entries are reference-counted while copies
/// use them; the cache is bounded by count and by the bytes of the
/// allocations it keeps open, evicting the least recently used entry that
/// no copy uses; `forget(pid)` closes a dead peer's entries (each once its
/// last copy is done). An allocation of this very process (both endpoints
/// in one process) is used as it is: the driver opens no handle of its own
/// process.
///
/// Bounds. A descriptor is the peer's word: its `size` is a claim. What a
/// copy may read is the import's extent (`entry::extent`): for a legacy
/// handle, and for this process's own memory, what the driver says the
/// allocation holds from the opened address on (`cuMemGetAddressRange`),
/// never more than the claim (`ipc_extent`); for a descriptor, the size
/// mapped (mapping more than the allocation holds fails in the driver).
/// `event_poller::ipc_copy` refuses a range outside it with
/// `errc::protocol_error` (`ipc_within`), so a peer that claims more than
/// it exported cannot make this GPU read past the opened allocation (an
/// illegal address, which poisons this process's context, or this
/// process's own memory beside the mapping).
///
/// Threads: the scheduler's thread only, like the poller.
#pragma once

#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <gdr/cuda/device.hpp>
#include <gdr/cuda/error.hpp>
#include <gdr/cuda/vmm.hpp>
#include <gdr/error.hpp>
#include <gdr/sched/copy_engine.hpp>

namespace gdr::cuda {

/// Bounds of the cache of imported allocations.
struct ipc_cache_options {
  std::size_t max_entries = 256;                   ///< allocations kept open at most
  std::uint64_t max_bytes = std::uint64_t{1} << 38;  ///< their bytes at most (256 GiB)
};

/// What the IPC part of the copy engine did.
struct ipc_stats {
  std::uint64_t exports = 0;          ///< payloads exported
  std::uint64_t fd_exports = 0;       ///< of them, gdr's virtual-memory allocations (a file descriptor travels)
  std::uint64_t handles_made = 0;     ///< `cudaIpcGetMemHandle` calls (one per allocation)
  std::uint64_t imports = 0;          ///< allocations opened (`cudaIpcOpenMemHandle`, or mapped from a descriptor)
  std::uint64_t fd_imports = 0;       ///< of them, mapped from a descriptor (the virtual memory API)
  std::uint64_t hits = 0;             ///< copies that found their allocation open
  std::uint64_t stale = 0;            ///< hits refused: the buffer id changed (replaced)
  std::uint64_t evictions = 0;        ///< entries closed to stay within the bounds
  std::uint64_t closed = 0;           ///< allocations closed (`cudaIpcCloseMemHandle`)
  std::uint64_t released = 0;         ///< entries let go because their owner said it freed them
  std::uint64_t last_import_ns = 0;   ///< how long the last import took
  std::uint64_t max_import_ns = 0;    ///< the longest
};

/// The bytes a copy may read from `at`, where an imported allocation
/// begins in this process: what the driver's range holding it
/// (`[range_base, range_base + range_size)`, from `cuMemGetAddressRange`)
/// has from `at` on, and never more than `claimed`, the size the owner's
/// descriptor says. 0 when `at` is not inside the range. Overflow-safe.
constexpr std::uint64_t ipc_extent(std::uint64_t at, std::uint64_t range_base, std::uint64_t range_size,
                                   std::uint64_t claimed) noexcept {
  if (at < range_base || at - range_base >= range_size) return 0;
  const std::uint64_t left = range_size - (at - range_base);
  return claimed < left ? claimed : left;
}

/// `[offset, offset + n)` lies inside the first `extent` bytes, whatever
/// the values (no overflow).
constexpr bool ipc_within(std::uint64_t offset, std::uint64_t n, std::uint64_t extent) noexcept {
  return n <= extent && offset <= extent - n;
}

namespace detail {

/// `cuMemGetAddressRange`, found once (through the runtime: no link
/// against libcuda); null where the driver does not have it.
struct address_range {
  using fn_t = CUresult (*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
  fn_t fn = nullptr;

  static const address_range& get() noexcept {
    static const address_range q = [] {
      address_range r;
      void* p = nullptr;
      cudaDriverEntryPointQueryResult status{};
      if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &status) ==
              cudaSuccess &&
          status == cudaDriverEntryPointSuccess && p != nullptr)
        r.fn = reinterpret_cast<fn_t>(p);
      else
        (void)cudaGetLastError();
      return r;
    }();
    return q;
  }
};

/// The driver entry point the export needs, found once.
struct pointer_query {
  using fn_t = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);
  fn_t fn = nullptr;

  static const pointer_query& get() noexcept {
    static const pointer_query q = [] {
      pointer_query r;
      void* p = nullptr;
      cudaDriverEntryPointQueryResult status{};
      if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &p, 12000, cudaEnableDefault, &status) ==
              cudaSuccess &&
          status == cudaDriverEntryPointSuccess)
        r.fn = reinterpret_cast<fn_t>(p);
      else
        (void)cudaGetLastError();
      return r;
    }();
    return q;
  }
};

}  // namespace detail

/// The IPC state of one copy engine (see the file comment).
class ipc_share {
 public:
  using memory = copy_engine::ipc_memory;

  /// An open allocation of a peer's; copies hold a reference.
  struct entry {
    std::byte* mapped = nullptr;  ///< where the allocation is in this process
    std::uint64_t buffer_id = 0;
    std::uint64_t size = 0;    ///< the descriptor's claim (a hit must match it)
    std::uint64_t extent = 0;  ///< the bytes from `mapped` a copy may read (see "Bounds")
    std::uint64_t last_use = 0;
    int refs = 0;
    int device = -1;
    bool own = false;      ///< this process's own memory: nothing to close
    bool vmm = false;      ///< mapped from a descriptor (`vmm_unmap` to close)
    std::uint64_t granted = 0;  ///< GPUs (bit per ordinal) that may access a `vmm` mapping
    bool retired = false;  ///< out of the cache: closed when its last copy is done
  };

  explicit ipc_share(ipc_cache_options o = {}) noexcept : opts_(o) {}
  ipc_share(const ipc_share&) = delete;
  ipc_share& operator=(const ipc_share&) = delete;
  ~ipc_share() {
    for (auto& [k, e] : open_) close(*e);
    for (auto& e : retired_) close(*e);
  }

  /// Can this process share device memory at all (a GPU, and the driver's
  /// pointer query)?
  static bool capable() noexcept {
    static const bool yes = device_unavailable_reason(0).empty() && detail::pointer_query::get().fn != nullptr &&
                            detail::address_range::get().fn != nullptr;
    return yes;
  }

  /// See `copy_engine::ipc_export`.
  std::error_code export_memory(const void* p, std::size_t n, memory& out, std::uint64_t& offset,
                                const char** why) noexcept {
    auto say = [&](const char* s) {
      if (why != nullptr) *why = s;
      return make_error_code(errc::unsupported);
    };
    // gdr's own allocations of the virtual memory API travel as a file
    // descriptor; everything else the driver knows, by its legacy handle.
    {
      vmm_block b;
      std::error_code ec;
      if (vmm_registry::instance().find_exported(p, n, b, ec)) {
        if (ec) return ec;
        out = {};
        out.kind = copy_engine::ipc_kind::fd;
        out.fd = b.fd;
        out.base = b.base;
        out.size = b.size;
        out.buffer_id = b.id;
        out.device = b.device;
        out.pid = static_cast<std::int32_t>(::getpid());
        offset = reinterpret_cast<std::uintptr_t>(p) - b.base;
        ++stats_.exports;
        ++stats_.fd_exports;
        return {};
      }
    }
    const detail::pointer_query& q = detail::pointer_query::get();
    if (q.fn == nullptr) return say("the CUDA driver's pointer query is not available");
    unsigned int type = 0, managed = 0, legacy = 0;
    int ordinal = -1;
    unsigned long long id = 0;
    CUdeviceptr start = 0;
    std::size_t size = 0;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                   CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                   CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                   CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                   CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                   CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void* data[] = {&type, &managed, &legacy, &ordinal, &id, &start, &size};
    if (q.fn(7, attrs, data, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE)
      return say("not device memory the CUDA driver knows: allocate it with gdr::buffer<T, gdr::Device> "
                 "(the virtual memory API or cudaMalloc), or set endpoint_options::device = staged");
    if (managed != 0)
      return say("managed memory (cudaMallocManaged) cannot be shared by CUDA IPC: allocate it with "
                 "gdr::buffer<T, gdr::Device>, or set endpoint_options::device = staged");
    if (legacy == 0)
      return say("an allocation the CUDA driver cannot share by cudaIpcGetMemHandle, and not gdr's (the virtual "
                 "memory API or a memory pool of another allocator, such as a caching allocator's expandable "
                 "segments): allocate it with gdr::buffer<T, gdr::Device>, or set endpoint_options::device = staged");
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    if (at < start || n > size || at - start > size - n) return say("the range runs past its allocation's end");
    auto it = handles_.find(start);
    if (it == handles_.end() || it->second.buffer_id != id) {
      cudaIpcMemHandle_t h{};
      {
        device_guard g(ordinal);
        if (g.error()) return g.error();
        if (std::error_code ec = check(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(start)), "cudaIpcGetMemHandle"))
          return ec;
      }
      ++stats_.handles_made;
      try {
        if (handles_.size() >= 4096) handles_.clear();  // a bound: the handles are made again when needed
        handle_entry& e = handles_[start];
        e.buffer_id = id;
        std::memcpy(e.handle, &h, sizeof h);
        it = handles_.find(start);
      } catch (...) {
        return make_error_code(std::errc::not_enough_memory);
      }
    }
    static_assert(sizeof(cudaIpcMemHandle_t) == sizeof out.handle);
    out.kind = copy_engine::ipc_kind::handle;
    out.fd = -1;
    std::memcpy(out.handle, it->second.handle, sizeof out.handle);
    out.base = start;
    out.size = size;
    out.buffer_id = id;
    out.device = ordinal;
    out.pid = static_cast<std::int32_t>(::getpid());
    offset = at - start;
    ++stats_.exports;
    return {};
  }

  /// The peer's allocation `m`, open (imported now, or found in the cache
  /// with the same buffer id), with one more reference; `release` it when
  /// the copy is done.
  /// `device`: the GPU that copies (a mapping from a descriptor is made
  /// accessible to it). `m.fd` is borrowed: imported from when the
  /// allocation is not mapped yet, never closed here.
  result<entry*> acquire(const memory& m, int device) noexcept {
    const key k{m.pid, m.device, m.base};
    auto it = open_.find(k);
    if (it != open_.end()) {
      entry& e = *it->second;
      if (e.buffer_id == m.buffer_id && e.size == m.size) {
        if (std::error_code ec = grant(e, device)) return ec;
        ++stats_.hits;
        ++e.refs;
        e.last_use = ++clock_;
        return &e;
      }
      ++stats_.stale;  // freed and allocated again at the same address
      retire(it);
    }
    evict_for(std::min<std::uint64_t>(m.size, opts_.max_bytes));  // (a claim: a hostile one may be huge)
    auto e = std::make_unique<entry>();
    e->buffer_id = m.buffer_id;
    e->size = m.size;
    e->device = m.device;
    if (m.pid == ::getpid()) {
      e->own = true;
      e->mapped = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(m.base));
      device_guard g(m.device);
      if (g.error()) return g.error();
      if (std::error_code ec = measure(*e, m.size)) return ec;
    } else if (m.kind == copy_engine::ipc_kind::fd) {
      if (m.fd < 0) return make_error_code(errc::invalid_argument);
      const auto t0 = std::chrono::steady_clock::now();
      result<void*> p = vmm_map(m.fd, static_cast<std::size_t>(m.size), device);
      if (!p) return p.error();
      note_import(t0);
      ++stats_.fd_imports;
      e->vmm = true;
      e->granted = device >= 0 && device < 64 ? std::uint64_t{1} << device : 0;
      e->mapped = static_cast<std::byte*>(*p);
      e->extent = m.size;  // mapped whole: the driver refuses a size the allocation does not have
    } else {
      cudaIpcMemHandle_t h;
      std::memcpy(&h, m.handle, sizeof h);
      void* p = nullptr;
      device_guard g(m.device);
      if (g.error()) return g.error();
      const auto t0 = std::chrono::steady_clock::now();
      if (std::error_code ec = check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))
        return ec;
      note_import(t0);
      e->mapped = static_cast<std::byte*>(p);
      // The handle opened what the owner allocated, whatever size it
      // claims: the driver says how much that is.
      if (std::error_code ec = measure(*e, m.size)) {
        close(*e);
        return ec;
      }
    }
    e->refs = 1;
    e->last_use = ++clock_;
    entry* raw = e.get();
    try {
      open_.emplace(k, std::move(e));
    } catch (...) {
      close(*raw);
      return make_error_code(std::errc::not_enough_memory);
    }
    bytes_ += raw->extent;
    return raw;
  }

  /// A copy that used `e` is done.
  void release(entry* e) noexcept {
    if (--e->refs != 0 || !e->retired) return;
    close(*e);
    std::erase_if(retired_, [e](const std::unique_ptr<entry>& r) { return r.get() == e; });
  }

  /// Process `pid` ended: its entries are closed (those in use once their
  /// copies are done).
  void forget(int pid) noexcept {
    retire_where([&](const key& k, const entry&) { return std::get<0>(k) == pid; });
  }

  /// Process `pid` freed its allocation at `base` with id `buffer_id`
  /// (it told this side): that entry is closed, once no copy uses it.
  /// Another allocation at that address (another id) stays.
  void release_freed(int pid, std::uint64_t base, std::uint64_t buffer_id) noexcept {
    stats_.released += retire_where([&](const key& k, const entry& e) {
      return std::get<0>(k) == pid && std::get<2>(k) == base && e.buffer_id == buffer_id;
    });
  }

  /// Entries open now, and their bytes.
  std::size_t size() const noexcept { return open_.size(); }
  std::uint64_t bytes() const noexcept { return bytes_; }
  const ipc_stats& stats() const noexcept { return stats_; }

 private:
  using key = std::tuple<int, int, std::uint64_t>;  // owner pid, GPU, base address
  struct handle_entry {
    std::uint64_t buffer_id = 0;
    std::byte handle[64]{};
  };

  void note_import(std::chrono::steady_clock::time_point t0) noexcept {
    const auto ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    stats_.last_import_ns = ns;
    if (ns > stats_.max_import_ns) stats_.max_import_ns = ns;
    ++stats_.imports;
  }

  /// `e.extent`: the bytes the driver's range holding `e.mapped` has from
  /// there, at most `claimed`. Inside a `device_guard` of `e.device`.
  static std::error_code measure(entry& e, std::uint64_t claimed) noexcept {
    const detail::address_range& q = detail::address_range::get();
    if (q.fn == nullptr) return make_error_code(errc::unsupported);
    // A driver call needs a current context: the runtime makes its
    // primary one current here (the guard switches only when the device
    // differs).
    if (std::error_code ec = check(cudaSetDevice(e.device), "cudaSetDevice")) return ec;
    CUdeviceptr base = 0;
    std::size_t size = 0;
    const auto at = reinterpret_cast<CUdeviceptr>(e.mapped);
    if (std::error_code ec = detail::drv(q.fn(&base, &size, at), "cuMemGetAddressRange")) return ec;
    e.extent = ipc_extent(at, base, size, claimed);
    return {};
  }

  /// A mapping from a descriptor, accessible to GPU `device` too.
  static std::error_code grant(entry& e, int device) noexcept {
    if (!e.vmm || device < 0 || device >= 64 || (e.granted & (std::uint64_t{1} << device)) != 0) return {};
    if (std::error_code ec = vmm_grant(e.mapped, static_cast<std::size_t>(e.size), device)) return ec;
    e.granted |= std::uint64_t{1} << device;
    return {};
  }

  void close(entry& e) noexcept {
    if (e.own || e.mapped == nullptr) return;
    if (e.vmm) {
      vmm_unmap(e.mapped, static_cast<std::size_t>(e.size));
      e.mapped = nullptr;
      ++stats_.closed;
      return;
    }
    device_guard g(e.device);
    check_or_log(cudaIpcCloseMemHandle(e.mapped), "cudaIpcCloseMemHandle");
    e.mapped = nullptr;
    ++stats_.closed;
  }

  /// Takes `it` out of the cache: closed now, or once no copy uses it.
  void retire(std::map<key, std::unique_ptr<entry>>::iterator it) noexcept {
    std::unique_ptr<entry> e = std::move(it->second);
    bytes_ -= e->extent;
    open_.erase(it);
    if (e->refs == 0) {
      close(*e);
      return;
    }
    e->retired = true;
    try {
      retired_.push_back(std::move(e));
    } catch (...) {
      // Out of memory keeping it: it stays open (mapped) until exit.
      (void)e.release();
    }
  }

  /// Retires every entry `pred(key, entry)` picks; how many.
  template <class Pred>
  std::uint64_t retire_where(Pred pred) noexcept {
    std::uint64_t n = 0;
    for (auto it = open_.begin(); it != open_.end();) {
      auto next = std::next(it);
      if (pred(it->first, *it->second)) {
        retire(it);
        ++n;
      }
      it = next;
    }
    return n;
  }

  /// Room for an allocation of `bytes`: evicts the least recently used
  /// entries no copy uses.
  void evict_for(std::uint64_t bytes) noexcept {
    while (!open_.empty() && (open_.size() + 1 > opts_.max_entries || bytes_ + bytes > opts_.max_bytes)) {
      auto victim = open_.end();
      for (auto it = open_.begin(); it != open_.end(); ++it)
        if (it->second->refs == 0 && (victim == open_.end() || it->second->last_use < victim->second->last_use))
          victim = it;
      if (victim == open_.end()) return;  // all in use: over the bound until copies finish
      ++stats_.evictions;
      retire(victim);
    }
  }

  ipc_cache_options opts_;
  std::map<key, std::unique_ptr<entry>> open_;
  std::vector<std::unique_ptr<entry>> retired_;
  std::unordered_map<std::uint64_t, handle_entry> handles_;  // this process's exports, by base address
  std::uint64_t bytes_ = 0;
  std::uint64_t clock_ = 0;
  ipc_stats stats_;
};

}  // namespace gdr::cuda
