/// \file
/// Where the bytes of a `gdr::buffer<T, S>` come from: one resource per memory
/// space, `memory_resource<S>`, with `allocate` / `deallocate`.
///
///   Host    aligned `operator new` (64-byte alignment: a cache line, and what
///           vectorised copies like).
///   Pinned  with CUDA and a usable GPU: `cudaHostAlloc(cudaHostAllocPortable)`,
///           page-locked and registered with the driver for every device, so
///           the copy engines DMA it directly. Otherwise (`GDR_HAS_CUDA=0`, or a
///           CUDA build on a machine without a GPU): `mmap` + `mlock`. That
///           memory is page-locked too (the kernel will not move or swap it,
///           which is what a NIC needs), but no CUDA driver knows it, so it is
///           "pinned" for RDMA, not for CUDA; `allocation::method` says which
///           one a buffer got. `mlock` is bounded by `RLIMIT_MEMLOCK`
///           (`ulimit -l`); failure is an error with its errno, never a silent
///           fallback to pageable memory. (One exception outside gdr's
///           control: the sanitizers' runtime (ASan, TSan) intercepts `mlock`
///           and ignores it, so under them this memory is not actually locked.)
///   Device  As the process's rule says (`cuda::set_device_allocation`):
///           by default the CUDA virtual memory API (`cuMemCreate` with POSIX
///           file-descriptor handles: memory another process can map,
///           gdr/cuda/vmm.hpp) from 1 MiB where the GPU supports it, and
///           `cudaMalloc` below that, on other GPUs, or with `vmm_use::never`;
///           `allocation::method` says which a buffer got. Either way the
///           buffer is an allocation of its own that CUDA IPC shares alone:
///           a `cudaMalloc` one is rounded up to a multiple of 2 MiB (the
///           driver would otherwise put small ones in one block, which IPC
///           shares whole) and its padding zeroed, unless the rule's
///           `exclusive_blocks` is off (gdr/cuda/vmm.hpp). The device is made
///           current for the call and restored after. Without a GPU: `errc::no_device`, and
///           `failure_message` says why (no driver, no device, bad ordinal).
///           Without CUDA in the translation unit there is no Device resource:
///           `buffer<T, Device>` does not compile (see buffer.hpp).
///
/// Contract: `allocate` is `noexcept` and reports failure as an error code;
/// `failure_message` turns that code into the sentence the throwing layer
/// (`buffer`'s constructor) puts in `gdr::error`. Zero bytes allocate nothing
/// and touch no device.
///
/// Thread-safety: all functions may be called from any thread.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <system_error>

#include <gdr/config.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/space.hpp>

#if GDR_HAS_CUDA
#include <gdr/cuda/device.hpp>
#include <gdr/cuda/error.hpp>
#include <gdr/cuda/vmm.hpp>
#endif

namespace gdr {

/// How an allocation was made (and so how it is released).
enum class alloc_method : std::uint8_t {
  none,             ///< nothing allocated (zero bytes, or moved from)
  aligned_new,      ///< Host: aligned `operator new`
  cuda_host_alloc,  ///< Pinned: `cudaHostAlloc`, known to the CUDA driver
  mmap_mlock,       ///< Pinned without a CUDA driver: `mmap` + `mlock`
  cuda_malloc,      ///< Device: `cudaMalloc`
  cuda_vmm,         ///< Device: the virtual memory API, shareable by file descriptor (gdr/cuda/vmm.hpp)
};

/// One allocation: what `memory_resource<S>::allocate` returns and
/// `deallocate` takes back.
struct allocation {
  void* ptr = nullptr;
  std::size_t bytes = 0;  ///< as requested (mmap rounds up internally)
  int device = -1;        ///< GPU ordinal for Device memory, -1 otherwise
  alloc_method method = alloc_method::none;
};

/// The allocator of memory space `S`. Only `Host`, `Pinned` and (with CUDA)
/// `Device` have one.
template <class S>
struct memory_resource;

namespace detail {
inline constexpr std::size_t host_alignment = 64;

inline std::size_t page_round_up(std::size_t bytes) noexcept {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

inline result<allocation> mmap_mlock_allocate(std::size_t bytes) noexcept {
  const std::size_t len = page_round_up(bytes);
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return errno_code(errno);
  // mlock faults every page in and keeps it resident and in place.
  if (::mlock(p, len) != 0) {
    int err = errno;
    ::munmap(p, len);
    return errno_code(err);
  }
  return allocation{p, bytes, -1, alloc_method::mmap_mlock};
}

inline void mmap_mlock_deallocate(const allocation& a) noexcept {
  const std::size_t len = page_round_up(a.bytes);
  ::munlock(a.ptr, len);
  ::munmap(a.ptr, len);
}
}  // namespace detail

/// Host memory: aligned `operator new`. Fails only with `ENOMEM`.
template <>
struct memory_resource<Host> {
  /// `bytes` of pageable memory aligned to 64 bytes; `device` is ignored.
  static result<allocation> allocate(std::size_t bytes, int /*device*/ = -1) noexcept {
    if (bytes == 0) return allocation{};
    void* p = ::operator new(bytes, std::align_val_t{detail::host_alignment}, std::nothrow);
    if (p == nullptr) return errno_code(ENOMEM);
    return allocation{p, bytes, -1, alloc_method::aligned_new};
  }
  static void deallocate(const allocation& a) noexcept {
    if (a.ptr != nullptr) ::operator delete(a.ptr, std::align_val_t{detail::host_alignment});
  }
  /// The sentence for `gdr::error` when `allocate` failed with `ec`.
  static std::string failure_message(std::error_code ec, std::size_t bytes, int /*device*/ = -1) {
    return "gdr::buffer<T, Host>: allocating " + std::to_string(bytes) + " bytes failed: " + ec.message();
  }
};

/// Page-locked host memory (see the file comment for the two methods).
template <>
struct memory_resource<Pinned> {
  /// `bytes` of page-locked memory; `device` is ignored (the CUDA allocation
  /// is portable: pinned for every device).
  static result<allocation> allocate(std::size_t bytes, int /*device*/ = -1) noexcept {
    if (bytes == 0) return allocation{};
#if GDR_HAS_CUDA
    if (cuda::probe_devices().usable()) {
      void* p = nullptr;
      if (std::error_code ec = cuda::check(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "cudaHostAlloc"))
        return ec;
      return allocation{p, bytes, -1, alloc_method::cuda_host_alloc};
    }
    // No GPU here: nothing could use CUDA registration anyway; lock the pages
    // so NICs may still DMA them.
#endif
    return detail::mmap_mlock_allocate(bytes);
  }
  static void deallocate(const allocation& a) noexcept {
    switch (a.method) {
      case alloc_method::mmap_mlock: detail::mmap_mlock_deallocate(a); break;
#if GDR_HAS_CUDA
      case alloc_method::cuda_host_alloc: cuda::check_or_log(cudaFreeHost(a.ptr), "cudaFreeHost"); break;
#endif
      default: break;
    }
  }
  /// The sentence for `gdr::error` when `allocate` failed with `ec`.
  static std::string failure_message(std::error_code ec, std::size_t bytes, int /*device*/ = -1) {
    std::string m = "gdr::buffer<T, Pinned>: page-locking " + std::to_string(bytes) + " bytes failed: " + ec.message();
    if (ec.category() == std::system_category() && (ec.value() == ENOMEM || ec.value() == EPERM || ec.value() == EAGAIN))
      m += " (mlock is limited by RLIMIT_MEMLOCK: raise `ulimit -l`, or run with CAP_IPC_LOCK)";
    return m;
  }
};

#if GDR_HAS_CUDA
/// GPU memory on device `device` (the virtual memory API or `cudaMalloc`).
template <>
struct memory_resource<Device> {
  /// `bytes` of memory on GPU `device`. `errc::no_device` when there is no
  /// usable GPU of that ordinal; a CUDA error code when the allocation fails
  /// (`cudaErrorMemoryAllocation`: out of device memory).
  static result<allocation> allocate(std::size_t bytes, int device = 0) noexcept {
    if (bytes == 0) return allocation{nullptr, 0, device, alloc_method::none};
    try {
      if (!cuda::device_unavailable_reason(device).empty()) return errc::no_device;
    } catch (...) {  // std::bad_alloc while composing the reason
      return errno_code(ENOMEM);
    }
    const cuda::device_allocation rule = cuda::current_device_allocation();
    if (rule.vmm == cuda::vmm_use::always || (rule.vmm == cuda::vmm_use::automatic && bytes >= rule.vmm_min_bytes)) {
      result<cuda::vmm_block> b = cuda::vmm_registry::instance().allocate(bytes, device);
      if (b) return allocation{reinterpret_cast<void*>(b->base), bytes, device, alloc_method::cuda_vmm};
      if (b.error() != errc::unsupported) return b.error();  // the GPU cannot: cudaMalloc
    }
    cuda::device_guard guard(device);
    if (guard.error()) return guard.error();
    // A block of its own (gdr/cuda/vmm.hpp, "What an export shares").
    const std::size_t size = rule.exclusive_blocks ? cuda::round_up_to(bytes, cuda::ipc_block) : bytes;
    void* p = nullptr;
    if (std::error_code ec = cuda::check(cudaMalloc(&p, size), "cudaMalloc")) return ec;
    if (size > bytes) {
      if (std::error_code ec = cuda::check(cudaMemsetAsync(static_cast<std::byte*>(p) + bytes, 0, size - bytes,
                                                           cudaStreamLegacy),
                                           "cudaMemsetAsync (a Device buffer's padding)")) {
        cuda::check_or_log(cudaFree(p), "cudaFree");
        return ec;
      }
    }
    return allocation{p, bytes, device, alloc_method::cuda_malloc};
  }
  static void deallocate(const allocation& a) noexcept {
    // cudaFree needs no current device: unified addressing knows the owner.
    if (a.method == alloc_method::cuda_malloc) cuda::check_or_log(cudaFree(a.ptr), "cudaFree");
    if (a.method == alloc_method::cuda_vmm) cuda::vmm_registry::instance().free(a.ptr);
  }
  /// The sentence for `gdr::error` when `allocate` failed with `ec`; for
  /// `errc::no_device` it says why (no driver, no device, bad ordinal).
  static std::string failure_message(std::error_code ec, std::size_t bytes, int device = 0) {
    std::string m = "gdr::buffer<T, Device>: allocating " + std::to_string(bytes) + " bytes on device " +
                    std::to_string(device) + " failed: ";
    if (ec == errc::no_device) return m + cuda::device_unavailable_reason(device);
    return m + ec.message();
  }
};
#endif

}  // namespace gdr
