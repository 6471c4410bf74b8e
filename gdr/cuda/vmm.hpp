/// \file
/// Device memory that another process can map: the CUDA virtual memory API
/// (`cuMemCreate` with POSIX file-descriptor handles), which is how
/// `gdr::buffer<T, Device>` allocates by default, and the importer's half
/// (mapping a peer's allocation from the descriptor it passed).
///
/// Why not `cudaMalloc` alone. Legacy IPC (`cudaIpcGetMemHandle`) shares
/// `cudaMalloc` memory, and gdr still uses it for memory it did not
/// allocate. But its handles map whole allocations only, cannot express
/// memory pools or virtual-memory segments, and go through the driver's own
/// name space. An allocation made with a POSIX file-descriptor handle is
/// shared as a file descriptor: it travels over the shared-memory
/// transport's Unix socket (`SCM_RIGHTS`), so only a process that was given
/// it can map it, and the memory lives while any process holds it.
///
/// The allocation. Size rounded up to the driver's granularity (2 MiB on
/// current GPUs), mapped read-write for its GPU, GPUDirect-RDMA capable
/// where the GPU supports that with the virtual memory API (so the verbs
/// transport can register it). Freeing synchronizes the device first, as
/// `cudaFree` does. With `vmm_use::automatic`, allocations below
/// `device_allocation::vmm_min_bytes` (1 MiB) use `cudaMalloc`, and legacy
/// IPC shares those (rounded up to 2 MiB all the same: "What an export
/// shares" below).
///
/// The process's rule is `vmm_use::automatic` by default;
/// `set_device_allocation({.vmm = vmm_use::never})` makes every buffer
/// `cudaMalloc`'s. A GPU that cannot share such memory gets `cudaMalloc`
/// memory either way. Copies into, out of and through a peer's mapping of
/// it run as fast as between `cudaMalloc` buffers (benchmarks/RESULTS.md).
///
/// What an export shares. CUDA IPC shares whole allocations, and
/// `cudaMalloc` suballocates small ones from larger blocks, which its
/// legacy IPC then shares whole, neighbours included (the CUDA C++
/// Programming Guide, "Interprocess Communication": share only allocations
/// of a 2 MiB multiple). So every Device buffer gdr makes is an allocation
/// of its own, shared alone: a `cudaMalloc` buffer is rounded up to a
/// multiple of 2 MiB (`ipc_block`), as the virtual memory API rounds to its
/// granularity, and the padding past the buffer is zeroed (on the legacy
/// default stream, which every copy and every export's fence waits for),
/// so a peer that maps a buffer reaches that buffer and zeros, nothing
/// else. `device_allocation::exclusive_blocks = false` lets small
/// `cudaMalloc` buffers share blocks again (less GPU memory; an export of
/// one then shares its neighbours).
///
/// The GPU's context. The driver calls below need none, but everything
/// after them does: an allocation makes the runtime's primary context
/// current, as `cudaMalloc` does, so that its cost (a quarter of a second
/// on an H100) is paid here and not by the first copy or send.
///
/// The registry. Every such allocation is recorded (base, size, handle,
/// a process-unique id), so the CUDA copy engine's export finds it from
/// any pointer inside it and exports the descriptor once (kept until the
/// allocation is freed). Ids have the top bit set, so they never equal a
/// driver buffer id of legacy memory.
///
/// Every driver call goes through `cudaGetDriverEntryPointByVersion`: gdr
/// does not link libcuda.
///
/// Thread-safety: allocation, free and lookup may run on any thread (one
/// mutex). The importer's calls run on the scheduler's thread.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <system_error>
#include <type_traits>

#include <gdr/cuda/device.hpp>
#include <gdr/cuda/error.hpp>
#include <gdr/error.hpp>

namespace gdr::cuda {

/// When `gdr::buffer<T, Device>` uses the virtual memory API.
enum class vmm_use : std::uint8_t {
  automatic,  ///< from `vmm_min_bytes`, where the GPU supports it (the default)
  always,     ///< every size, where the GPU supports it
  never,      ///< `cudaMalloc` only
};

/// The process's rule for Device allocations (see the file comment).
struct device_allocation {
  vmm_use vmm = vmm_use::automatic;
  std::size_t vmm_min_bytes = std::size_t{1} << 20;
  /// Each `cudaMalloc` buffer is an allocation of its own, a multiple of
  /// `ipc_block`, its padding zeroed: CUDA IPC shares it alone (see the
  /// file comment). false: the driver may put small buffers in one block.
  bool exclusive_blocks = true;
};

/// What CUDA IPC shares at least: a `cudaMalloc` allocation of a multiple
/// of this is a block of its own (see the file comment).
inline constexpr std::size_t ipc_block = std::size_t{2} << 20;

/// `bytes` rounded up to a multiple of `unit` (a power of two); `bytes`
/// itself where that would overflow (an allocation that size fails anyway).
constexpr std::size_t round_up_to(std::size_t bytes, std::size_t unit) noexcept {
  if (bytes > static_cast<std::size_t>(-1) - (unit - 1)) return bytes;
  return (bytes + unit - 1) & ~(unit - 1);
}

namespace detail {

inline std::atomic<int>& vmm_use_setting() noexcept {
  static std::atomic<int> v{static_cast<int>(vmm_use::automatic)};
  return v;
}
inline std::atomic<std::size_t>& vmm_min_setting() noexcept {
  static std::atomic<std::size_t> v{std::size_t{1} << 20};
  return v;
}
inline std::atomic<bool>& exclusive_blocks_setting() noexcept {
  static std::atomic<bool> v{true};
  return v;
}

/// The driver's virtual-memory entry points, found once.
struct vmm_api {
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*granularity)(std::size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,
                     unsigned long long) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*address_free)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t) = nullptr;
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long) = nullptr;
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;

  bool loaded() const noexcept { return import_handle != nullptr; }

  static const vmm_api& get() noexcept {
    static const vmm_api api = [] {
      vmm_api a;
      bool all = true;
      auto find = [&](const char* name, auto& fn) {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult status{};
        if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status) == cudaSuccess &&
            status == cudaDriverEntryPointSuccess && p != nullptr) {
          fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
        } else {
          (void)cudaGetLastError();
          all = false;
        }
      };
      find("cuDeviceGet", a.device_get);
      find("cuDeviceGetAttribute", a.device_attribute);
      find("cuMemGetAllocationGranularity", a.granularity);
      find("cuMemCreate", a.create);
      find("cuMemRelease", a.release);
      find("cuMemAddressReserve", a.reserve);
      find("cuMemAddressFree", a.address_free);
      find("cuMemMap", a.map);
      find("cuMemUnmap", a.unmap);
      find("cuMemSetAccess", a.set_access);
      find("cuMemExportToShareableHandle", a.export_handle);
      find("cuMemImportFromShareableHandle", a.import_handle);
      if (!all) a = vmm_api{};
      return a;
    }();
    return api;
  }
};

/// A driver result as gdr's CUDA error (the driver's and the runtime's
/// codes share their numbers for everything these calls return).
inline std::error_code drv(CUresult r, const char* what) noexcept {
  return r == CUDA_SUCCESS ? std::error_code{} : check(static_cast<cudaError_t>(r), what);
}

/// What the GPU of ordinal `device` can do with the virtual memory API.
struct vmm_caps {
  bool shareable = false;  ///< allocations with POSIX file-descriptor handles
  bool gpudirect = false;  ///< the GPUDirect RDMA flag on such allocations
  CUdevice dev = 0;
};

inline vmm_caps query_caps(int device) noexcept {
  vmm_caps c;
  const vmm_api& api = vmm_api::get();
  if (!api.loaded() || api.device_get(&c.dev, device) != CUDA_SUCCESS) return c;
  int vmm = 0, fd = 0, rdma = 0;
  if (api.device_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, c.dev) != CUDA_SUCCESS ||
      api.device_attribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, c.dev) !=
          CUDA_SUCCESS)
    return c;
  (void)api.device_attribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, c.dev);
  c.shareable = vmm != 0 && fd != 0;
  c.gpudirect = rdma != 0;
  return c;
}

inline CUmemAllocationProp vmm_prop(const vmm_caps& c) noexcept {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = c.dev;
  p.allocFlags.gpuDirectRDMACapable = c.gpudirect ? 1 : 0;
  return p;
}

inline std::error_code grant(CUdeviceptr va, std::size_t size, int device) noexcept {
  const vmm_api& api = vmm_api::get();
  CUdevice dev = 0;
  if (std::error_code ec = drv(api.device_get(&dev, device), "cuDeviceGet")) return ec;
  CUmemAccessDesc d{};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = dev;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return drv(api.set_access(va, size, &d, 1), "cuMemSetAccess");
}

}  // namespace detail

/// Sets the process's rule for Device allocations (any thread; allocations
/// made after it follow it).
inline void set_device_allocation(device_allocation a) noexcept {
  detail::vmm_use_setting().store(static_cast<int>(a.vmm), std::memory_order_relaxed);
  detail::vmm_min_setting().store(a.vmm_min_bytes, std::memory_order_relaxed);
  detail::exclusive_blocks_setting().store(a.exclusive_blocks, std::memory_order_relaxed);
}

/// The process's rule for Device allocations.
inline device_allocation current_device_allocation() noexcept {
  return {static_cast<vmm_use>(detail::vmm_use_setting().load(std::memory_order_relaxed)),
          detail::vmm_min_setting().load(std::memory_order_relaxed),
          detail::exclusive_blocks_setting().load(std::memory_order_relaxed)};
}

/// Can GPU `device` allocate memory shareable by file descriptor? Asked of
/// the driver once per device.
inline bool vmm_shareable(int device) noexcept {
  static constexpr int max_devices = 64;
  static std::atomic<signed char> known[max_devices] = {};  // 0 unknown, 1 yes, -1 no
  if (device < 0 || device >= max_devices) return false;
  signed char k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    k = detail::query_caps(device).shareable ? 1 : -1;
    known[device].store(k, std::memory_order_relaxed);
  }
  return k > 0;
}

/// One allocation of the virtual memory API, as the registry keeps it.
struct vmm_block {
  std::uintptr_t base = 0;
  std::size_t size = 0;  ///< rounded up to the granularity
  std::uint64_t id = 0;  ///< unique in the process, top bit set
  int device = -1;
  int fd = -1;  ///< its exported descriptor (-1 until first exported); the registry's
};

/// The process's allocations of the virtual memory API (see the file comment).
class vmm_registry {
 public:
  static vmm_registry& instance() noexcept {
    static vmm_registry r;
    return r;
  }

  /// `bytes` of memory on GPU `device` (the current device is switched for
  /// the call). `errc::unsupported` when the GPU cannot share such memory
  /// (the caller then uses `cudaMalloc`); otherwise the driver's error.
  result<vmm_block> allocate(std::size_t bytes, int device) noexcept {
    const detail::vmm_api& api = detail::vmm_api::get();
    if (bytes == 0 || !vmm_shareable(device)) return errc::unsupported;
    device_guard g(device);
    if (g.error()) return g.error();
    // The runtime's context, as cudaMalloc would make it (see the file comment).
    if (std::error_code ec = check(cudaFree(nullptr), "cudaFree (making the GPU's context)")) return ec;
    const detail::vmm_caps caps = detail::query_caps(device);
    const CUmemAllocationProp prop = detail::vmm_prop(caps);
    std::size_t gran = 0;
    if (std::error_code ec =
            detail::drv(api.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity"))
      return ec;
    if (gran == 0) gran = std::size_t{2} << 20;
    const std::size_t size = (bytes + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle h = 0;
    if (std::error_code ec = detail::drv(api.create(&h, size, &prop, 0), "cuMemCreate")) return ec;
    CUdeviceptr va = 0;
    std::error_code ec = detail::drv(api.reserve(&va, size, gran, 0, 0), "cuMemAddressReserve");
    if (ec) {
      (void)api.release(h);
      return ec;
    }
    if ((ec = detail::drv(api.map(va, size, 0, h, 0), "cuMemMap"))) {
      (void)api.address_free(va, size);
      (void)api.release(h);
      return ec;
    }
    // The padding past `bytes` travels with every export: zeros, not what
    // this process's freed memory held (see the file comment).
    if (!(ec = detail::grant(va, size, device)) && size > bytes)
      ec = check(cudaMemsetAsync(reinterpret_cast<void*>(va + bytes), 0, size - bytes, cudaStreamLegacy),
                 "cudaMemsetAsync (the padding of a virtual-memory allocation)");
    if (ec) {
      (void)api.unmap(va, size);
      (void)api.address_free(va, size);
      (void)api.release(h);
      return ec;
    }
    vmm_block b{static_cast<std::uintptr_t>(va), size, 0, device, -1};
    try {
      std::lock_guard lk(mu_);
      b.id = (std::uint64_t{1} << 63) | ++next_id_;
      blocks_.emplace(b.base, record{b, h});
    } catch (...) {
      (void)api.unmap(va, size);
      (void)api.address_free(va, size);
      (void)api.release(h);
      return errno_code(ENOMEM);
    }
    return b;
  }

  /// Frees the allocation at `base` (made by `allocate`): waits for its GPU
  /// as `cudaFree` does, unmaps it and lets its handle and descriptor go.
  /// An importer that still maps it keeps the memory until it unmaps (a
  /// shared-memory peer is told, `exported_frees`, and lets it go).
  void free(const void* base) noexcept {
    record r;
    {
      std::lock_guard lk(mu_);
      auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(base));
      if (it == blocks_.end()) return;
      r = it->second;
      blocks_.erase(it);
    }
    const detail::vmm_api& api = detail::vmm_api::get();
    {
      device_guard g(r.block.device);
      check_or_log(cudaDeviceSynchronize(), "cudaDeviceSynchronize (freeing a virtual-memory allocation)");
    }
    const auto va = static_cast<CUdeviceptr>(r.block.base);
    if (std::error_code ec = detail::drv(api.unmap(va, r.block.size), "cuMemUnmap")) detail::log_error(ec, "cuMemUnmap");
    (void)api.address_free(va, r.block.size);
    (void)api.release(r.handle);
    if (r.block.fd >= 0) {
      ::close(r.block.fd);
      frees_.fetch_add(1, std::memory_order_release);  // its descriptor went to peers, maybe: they hear of it
    }
  }

  /// Changes whenever an allocation whose descriptor was exported is freed
  /// (`copy_engine::ipc_frees`).
  std::uint64_t exported_frees() const noexcept { return frees_.load(std::memory_order_acquire); }

  /// Is allocation `base` with id `id` still allocated?
  bool alive(std::uint64_t base, std::uint64_t id) const noexcept {
    std::lock_guard lk(mu_);
    auto it = blocks_.find(static_cast<std::uintptr_t>(base));
    return it != blocks_.end() && it->second.block.id == id;
  }

  /// The allocation holding `[p, p + n)`, with its descriptor exported (once,
  /// then kept); false when no allocation of the registry holds it. `ec`
  /// is set when one does but the export failed.
  bool find_exported(const void* p, std::size_t n, vmm_block& out, std::error_code& ec) noexcept {
    ec = {};
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lk(mu_);
    auto it = blocks_.upper_bound(at);
    if (it == blocks_.begin()) return false;
    --it;
    record& r = it->second;
    if (at - r.block.base >= r.block.size || n > r.block.size - (at - r.block.base)) return false;
    if (r.block.fd < 0) {
      int fd = -1;
      ec = detail::drv(detail::vmm_api::get().export_handle(&fd, r.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                       "cuMemExportToShareableHandle");
      if (ec) return true;
      r.block.fd = fd;
    }
    out = r.block;
    return true;
  }

  /// Allocations alive now.
  std::size_t size() const {
    std::lock_guard lk(mu_);
    return blocks_.size();
  }

 private:
  struct record {
    vmm_block block;
    CUmemGenericAllocationHandle handle = 0;
  };
  vmm_registry() = default;

  mutable std::mutex mu_;
  std::map<std::uintptr_t, record> blocks_;
  std::uint64_t next_id_ = 0;
  std::atomic<std::uint64_t> frees_{0};
};

/// The importer's half: maps a peer's allocation from its descriptor `fd`
/// (the caller's: not closed here) for access by GPU `device`. The mapping
/// holds the memory until `vmm_unmap`.
inline result<void*> vmm_map(int fd, std::size_t size, int device) noexcept {
  const detail::vmm_api& api = detail::vmm_api::get();
  if (!api.loaded()) return errc::unsupported;
  CUmemGenericAllocationHandle h = 0;
  std::error_code ec = detail::drv(
      api.import_handle(&h, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      "cuMemImportFromShareableHandle");
  if (ec) return ec;
  CUdeviceptr va = 0;
  if ((ec = detail::drv(api.reserve(&va, size, 0, 0, 0), "cuMemAddressReserve"))) {
    (void)api.release(h);
    return ec;
  }
  ec = detail::drv(api.map(va, size, 0, h, 0), "cuMemMap");
  (void)api.release(h);  // the mapping holds it now
  if (!ec) ec = detail::grant(va, size, device);
  if (ec) {
    (void)api.unmap(va, size);
    (void)api.address_free(va, size);
    return ec;
  }
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(va));
}

/// Lets GPU `device` access a mapping made by `vmm_map` for another.
inline std::error_code vmm_grant(void* p, std::size_t size, int device) noexcept {
  return detail::grant(reinterpret_cast<CUdeviceptr>(p), size, device);
}

/// Undoes `vmm_map`.
inline void vmm_unmap(void* p, std::size_t size) noexcept {
  const detail::vmm_api& api = detail::vmm_api::get();
  const auto va = reinterpret_cast<CUdeviceptr>(p);
  if (std::error_code ec = detail::drv(api.unmap(va, size), "cuMemUnmap")) detail::log_error(ec, "cuMemUnmap");
  (void)api.address_free(va, size);
}

}  // namespace gdr::cuda
