/// \file
/// GPUDirect RDMA for one (GPU, NIC) pair: can this NIC read and write this
/// GPU's memory, and must a receive into it be flushed before the GPU reads
/// it? Probed once per pair and process, with the first check that failed
/// named, so that a zero-copy `Device` endpoint that cannot be had fails at
/// set-up with `errc::gpudirect_unavailable` and a reason a user can act on,
/// never a silent fallback (the failure mode of NVIDIA/nccl#1676).
///
/// The checks, in order (`gdr/transport/verbs/probe.hpp` has the node-level ones):
///   1. `cuda-driver`: the CUDA driver library (libcuda.so.1) loads and
///      `cuInit` succeeds; the GPU exists.
///   2. `gpu-dma-buf`: `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (else the
///      peermem route is tried at step 3).
///   3. `nic-dma-buf` / `peermem`: the NIC's `ibv_reg_dmabuf_mr` with fd -1
///      fails with EBADF (the kernel got as far as the descriptor), or the
///      nvidia-peermem module is loaded (its sysfs files).
///   4. `registration`: a real 2 MiB device buffer is registered with the
///      NIC (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`, or
///      `ibv_reg_mr` through peermem): a module can be loaded and still not
///      work (NVIDIA/nccl#1939).
///   5. `pcie-distance`: the GPU and the NIC share a PCIe switch (their
///      sysfs paths share a bridge below the root port); through the CPU's
///      host bridge, GPUDirect is slower than staging (NVIDIA/nccl#465).
///
/// The flush rule comes from `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`:
/// below `OWNER` (100), NIC writes into GPU memory may become visible to
/// the GPU's own kernels out of order, and a receive must be flushed (an
/// RDMA READ of one byte on a loopback queue pair, as NCCL does) before
/// the coroutine that hands it to GPU work resumes. `needs_flush` reports it.
///
/// The CUDA driver is loaded at run time (`dlopen`), so the verbs transport
/// links without CUDA and a machine without a GPU gets a reason, not a link
/// error.
#pragma once

#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/transport/verbs/probe.hpp>

namespace gdr::verbs {

/// What the probe of one (GPU, NIC) pair found.
struct gpudirect_report {
  bool available = false;     ///< every check passed
  std::string failed_check;   ///< the first check that failed ("cuda-driver", ...), empty if none
  std::string reason;         ///< a sentence: what failed and what to do
  std::string route;          ///< "dma-buf" or "peermem" when available
  bool needs_flush = false;   ///< receives into this GPU need a flush (writes ordering below OWNER)
  /// The GPU's half, read before any NIC check (-1: not read, the driver or
  /// the GPU is missing): `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` and
  /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
  int gpu_dma_buf = -1;
  int writes_ordering = -1;
  int gpu = -1;
  std::string nic;
};

namespace detail {

// The few driver entry points the probe needs, with their C types.
using CUresult_t = int;
using CUdevice_t = int;
using CUdeviceptr_t = unsigned long long;
struct cuda_driver {
  void* lib = nullptr;
  CUresult_t (*cuInit)(unsigned) = nullptr;
  CUresult_t (*cuDeviceGetCount)(int*) = nullptr;
  CUresult_t (*cuDeviceGet)(CUdevice_t*, int) = nullptr;
  CUresult_t (*cuDeviceGetAttribute)(int*, int, CUdevice_t) = nullptr;
  CUresult_t (*cuDeviceGetPCIBusId)(char*, int, CUdevice_t) = nullptr;
  CUresult_t (*cuDevicePrimaryCtxRetain)(void**, CUdevice_t) = nullptr;
  CUresult_t (*cuDevicePrimaryCtxRelease)(CUdevice_t) = nullptr;
  CUresult_t (*cuCtxSetCurrent)(void*) = nullptr;
  CUresult_t (*cuMemAlloc)(CUdeviceptr_t*, std::size_t) = nullptr;
  CUresult_t (*cuMemFree)(CUdeviceptr_t) = nullptr;
  CUresult_t (*cuMemGetHandleForAddressRange)(void*, CUdeviceptr_t, std::size_t, int, unsigned long long) = nullptr;
  CUresult_t (*cuPointerGetAttribute)(void*, int, CUdeviceptr_t) = nullptr;
  CUresult_t (*cuCtxPushCurrent)(void*) = nullptr;
  CUresult_t (*cuCtxPopCurrent)(void**) = nullptr;
  std::string error;
};

// Values from cuda.h (CUdevice_attribute, CUmemRangeHandleType).
inline constexpr int cu_attr_gpu_direct_rdma_writes_ordering = 118;
inline constexpr int cu_attr_dma_buf_supported = 124;
inline constexpr int cu_mem_range_handle_dma_buf_fd = 1;
inline constexpr int cu_writes_ordering_owner = 100;
inline constexpr int cu_pointer_attribute_device_ordinal = 9;

inline const cuda_driver& load_cuda_driver() {
  static cuda_driver d = [] {
    cuda_driver x;
    x.lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (x.lib == nullptr) {
      const char* e = ::dlerror();
      x.error = e != nullptr ? e : "libcuda.so.1 not found";
      return x;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(x.lib, name));
      if (fn == nullptr && x.error.empty()) x.error = std::string("libcuda.so.1 has no ") + name;
    };
    sym(x.cuInit, "cuInit");
    sym(x.cuDeviceGetCount, "cuDeviceGetCount");
    sym(x.cuDeviceGet, "cuDeviceGet");
    sym(x.cuDeviceGetAttribute, "cuDeviceGetAttribute");
    sym(x.cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
    sym(x.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(x.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    sym(x.cuCtxSetCurrent, "cuCtxSetCurrent");
    sym(x.cuMemAlloc, "cuMemAlloc_v2");
    sym(x.cuMemFree, "cuMemFree_v2");
    sym(x.cuMemGetHandleForAddressRange, "cuMemGetHandleForAddressRange");
    sym(x.cuPointerGetAttribute, "cuPointerGetAttribute");
    sym(x.cuCtxPushCurrent, "cuCtxPushCurrent_v2");
    sym(x.cuCtxPopCurrent, "cuCtxPopCurrent_v2");
    return x;
  }();
  return d;
}

/// The canonical sysfs path of a PCI device ("/sys/devices/pci0000:00/0000:00:01.0/...").
inline std::string pci_path(const std::string& sysfs_link) {
  char buf[PATH_MAX];
  if (::realpath(sysfs_link.c_str(), buf) == nullptr) return {};
  return buf;
}

/// How the GPU and the NIC connect: "switch" (a common bridge below the
/// root port), "host-bridge" (the same root complex only), "system"
/// (different root complexes), or "unknown".
inline std::string pcie_relation(const std::string& gpu_path, const std::string& nic_path) {
  if (gpu_path.empty() || nic_path.empty()) return "unknown";
  // Components: "", "sys", "devices", "pci0000:00", "0000:00:01.0", ...
  auto split = [](const std::string& p) {
    std::vector<std::string> v;
    std::size_t i = 0;
    while (i <= p.size()) {
      std::size_t j = p.find('/', i);
      if (j == std::string::npos) j = p.size();
      v.push_back(p.substr(i, j - i));
      i = j + 1;
    }
    return v;
  };
  auto a = split(gpu_path), b = split(nic_path);
  std::size_t common = 0;
  while (common < a.size() && common < b.size() && a[common] == b[common]) ++common;
  if (common < 4) return "system";        // not even the same root complex
  if (common == 4) return "host-bridge";  // the root complex only
  return "switch";                        // at least the root port or a switch in common
}

inline gpudirect_report run_gpudirect_probe(int gpu, ibv_context* nic) {
  gpudirect_report r;
  r.gpu = gpu;
  r.nic = nic != nullptr ? ibv_get_device_name(nic->device) : "";
  auto fail = [&](const char* check, std::string why) {
    r.failed_check = check;
    r.reason = "GPUDirect RDMA between GPU " + std::to_string(gpu) + " and " + (r.nic.empty() ? "the NIC" : r.nic) +
               " is not available: " + check + ": " + why;
    return r;
  };
  const cuda_driver& cu = load_cuda_driver();
  if (!cu.error.empty()) return fail("cuda-driver", "cannot use the CUDA driver (" + cu.error + ")");
  if (int e = cu.cuInit(0); e != 0) return fail("cuda-driver", "cuInit failed (CUresult " + std::to_string(e) + ")");
  int count = 0;
  cu.cuDeviceGetCount(&count);
  CUdevice_t dev = 0;
  if (gpu < 0 || gpu >= count || cu.cuDeviceGet(&dev, gpu) != 0)
    return fail("cuda-driver", "no GPU " + std::to_string(gpu) + " (" + std::to_string(count) + " present)");
  int gpu_dmabuf = 0;
  cu.cuDeviceGetAttribute(&gpu_dmabuf, cu_attr_dma_buf_supported, dev);
  int ordering = 0;
  cu.cuDeviceGetAttribute(&ordering, cu_attr_gpu_direct_rdma_writes_ordering, dev);
  r.needs_flush = ordering < cu_writes_ordering_owner;
  r.gpu_dma_buf = gpu_dmabuf;
  r.writes_ordering = ordering;
  if (nic == nullptr) return fail("nic-dma-buf", "no RDMA device");
  bool nic_dmabuf = detail::probe_dmabuf(nic);
  bool peermem = detail::peermem_loaded();
  bool use_dmabuf = gpu_dmabuf != 0 && nic_dmabuf;
  if (!use_dmabuf && !peermem) {
    if (gpu_dmabuf == 0)
      return fail("gpu-dma-buf", "the GPU does not support dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0; "
                                 "open kernel modules and CUDA 11.7 or later are needed) and nvidia-peermem is not loaded");
    return fail("nic-dma-buf", "the NIC's driver has no dma-buf registration (ibv_reg_dmabuf_mr with fd -1 did not "
                               "fail with EBADF) and nvidia-peermem is not loaded");
  }
  // A real registration of device memory.
  void* ctx = nullptr;
  if (cu.cuDevicePrimaryCtxRetain(&ctx, dev) != 0 || cu.cuCtxSetCurrent(ctx) != 0)
    return fail("registration", "cannot make a CUDA context");
  constexpr std::size_t n = std::size_t{2} << 20;
  CUdeviceptr_t p = 0;
  std::string reg_error;
  if (cu.cuMemAlloc(&p, n) != 0) {
    reg_error = "cuMemAlloc of 2 MiB failed";
  } else {
    ibv_pd* pd = ibv_alloc_pd(nic);
    ibv_mr* mr = nullptr;
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (pd == nullptr) {
      reg_error = "ibv_alloc_pd failed";
    } else if (use_dmabuf) {
      int fd = -1;
      if (cu.cuMemGetHandleForAddressRange(&fd, p, n, cu_mem_range_handle_dma_buf_fd, 0) != 0 || fd < 0) {
        reg_error = "cuMemGetHandleForAddressRange gave no dma-buf";
      } else {
        errno = 0;
        mr = ibv_reg_dmabuf_mr(pd, 0, n, p, fd, access);
        if (mr == nullptr) reg_error = std::string("ibv_reg_dmabuf_mr: ") + std::strerror(errno);
        ::close(fd);
      }
      r.route = "dma-buf";
    } else {
      errno = 0;
      mr = ibv_reg_mr(pd, reinterpret_cast<void*>(static_cast<std::uintptr_t>(p)), n, access);
      if (mr == nullptr) reg_error = std::string("ibv_reg_mr of device memory (peermem): ") + std::strerror(errno);
      r.route = "peermem";
    }
    if (mr != nullptr) ibv_dereg_mr(mr);
    if (pd != nullptr) ibv_dealloc_pd(pd);
    cu.cuMemFree(p);
  }
  cu.cuDevicePrimaryCtxRelease(dev);
  if (!reg_error.empty()) return fail("registration", reg_error);
  // PCIe distance.
  char bus[32] = {};
  std::string gpu_path;
  if (cu.cuDeviceGetPCIBusId(bus, sizeof bus, dev) == 0) {
    std::string id = bus;
    for (char& ch : id) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    gpu_path = pci_path("/sys/bus/pci/devices/" + id);
  }
  std::string nic_path = pci_path("/sys/class/infiniband/" + r.nic + "/device");
  std::string rel = pcie_relation(gpu_path, nic_path);
  if (rel == "system" || rel == "host-bridge")
    return fail("pcie-distance", "the GPU and the NIC meet only at the CPU (" + rel +
                                     "): GPUDirect RDMA would be slower than staging through host memory");
  r.available = true;
  return r;
}

/// A dma-buf of device memory: the descriptor (its owner closes it), and
/// where the asked-for address lies in it.
struct dmabuf_range {
  int fd = -1;
  std::uint64_t offset = 0;  ///< of the asked-for address from the dma-buf's start
  std::size_t length = 0;    ///< bytes of the dma-buf (whole pages)
};

/// Exports the page-aligned range of device memory covering `len` bytes at
/// `addr` as a dma-buf (`cuMemGetHandleForAddressRange` wants whole host
/// pages), in the primary context of the GPU that owns the memory. Errors:
/// `errc::gpudirect_unavailable` (no driver), EFAULT (not device memory),
/// EINVAL (the driver refused the range).
inline result<dmabuf_range> export_dmabuf(std::uintptr_t addr, std::size_t len) noexcept {
  const cuda_driver& cu = load_cuda_driver();
  if (!cu.error.empty() || cu.cuInit(0) != 0) return errc::gpudirect_unavailable;
  int ordinal = -1;
  if (cu.cuPointerGetAttribute(&ordinal, cu_pointer_attribute_device_ordinal, addr) != 0 || ordinal < 0)
    return errno_code(EFAULT);
  CUdevice_t dev = 0;
  void* ctx = nullptr;
  if (cu.cuDeviceGet(&dev, ordinal) != 0 || cu.cuDevicePrimaryCtxRetain(&ctx, dev) != 0) return errno_code(ENODEV);
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t base = addr & ~(page - 1);
  const std::uintptr_t end = (addr + len + page - 1) & ~(page - 1);
  int fd = -1;
  CUresult_t rc = -1;
  if (cu.cuCtxPushCurrent(ctx) == 0) {
    rc = cu.cuMemGetHandleForAddressRange(&fd, base, end - base, cu_mem_range_handle_dma_buf_fd, 0);
    void* popped = nullptr;
    cu.cuCtxPopCurrent(&popped);
  }
  cu.cuDevicePrimaryCtxRelease(dev);
  if (rc != 0 || fd < 0) return errno_code(EINVAL);
  return dmabuf_range{fd, addr - base, end - base};
}

/// Registers `len` bytes of device memory at `addr` with `pd` through a
/// dma-buf: `ibv_reg_dmabuf_mr` at the address's offset in it, with the
/// device address as the I/O virtual address (so that peers name it by
/// its address, as for host memory). The descriptor is closed again: the
/// registration keeps the dma-buf alive.
inline result<ibv_mr*> register_dmabuf(ibv_pd* pd, std::uintptr_t addr, std::size_t len, int access) noexcept {
  result<dmabuf_range> d = export_dmabuf(addr, len);
  if (!d) return d.error();
  errno = 0;
  ibv_mr* mr = ibv_reg_dmabuf_mr(pd, d->offset, len, addr, d->fd, access);
  int err = errno;
  ::close(d->fd);
  if (mr == nullptr) return errno_code(err != 0 ? err : EINVAL);
  return mr;
}

/// Stand-in "device" memory that a test made inaccessible to the CPU, and a
/// mapping of the same pages that is not (see `testing::stand_in_alias`).
struct stand_in_alias_entry {
  std::uintptr_t device = 0;
  std::uintptr_t host = 0;
  std::size_t len = 0;
};
inline std::mutex& stand_in_alias_mutex() noexcept {
  static std::mutex m;
  return m;
}
inline std::vector<stand_in_alias_entry>& stand_in_aliases() noexcept {
  static std::vector<stand_in_alias_entry> v;
  return v;
}
/// The readable address of stand-in device memory at `addr` (`len` bytes
/// inside one alias), or 0 if it has none.
inline std::uintptr_t stand_in_host_of(std::uintptr_t addr, std::size_t len) noexcept {
  std::lock_guard lock(stand_in_alias_mutex());
  for (const auto& e : stand_in_aliases())
    if (addr >= e.device && addr - e.device + len <= e.len) return e.host + (addr - e.device);
  return 0;
}

/// The test stand-in's switch (see `gdr::verbs::testing`): 0 off, 1 on,
/// 2 on and reporting that receives need the flush.
inline std::atomic<int>& stand_in_flag() noexcept {
  static std::atomic<int> on{0};
  return on;
}

}  // namespace detail

/// Testing the GPUDirect data path where there is no GPU
/// ======================================================
/// `stand_in_host_memory_for_device(true)` makes the probe say yes for
/// every (GPU, NIC) pair, with route "host-stand-in", and device memory is
/// then registered with plain `ibv_reg_mr`: a test hands the endpoints
/// `Device` views of host memory (`gdr::view<T, gdr::Device>(ptr, n, 0)`)
/// and gets the real verbs data path of a GPUDirect endpoint, every byte
/// moved by the NIC. Made `PROT_NONE` after its registration is cached,
/// such memory faults on any CPU access while the NIC still reaches it: a
/// test of "the CPU never touches Device memory". `needs_flush` makes the
/// report say that NIC writes need the flush (a GPU below `OWNER`), so the
/// flush's loopback READ runs too. Never for production: nothing checks
/// that the memory is host memory.
///
/// A real GPU's memory is registered through a dma-buf, never through the
/// CPU's mapping of it. `stand_in_alias(device, host, len)` gives the
/// stand-in the same: `device` is the address the test hands out as Device
/// memory (made inaccessible to the CPU whenever it likes), `host` a second
/// mapping of the same pages (a memfd mapped twice) that stays readable;
/// the stand-in registers any part of `device` through `host`, with the
/// device address as the address the NIC uses (`ibv_reg_mr_iova`), so a
/// registration made while `device` is `PROT_NONE` works as a dma-buf one
/// would. `stand_in_unalias(device)` forgets it (before unmapping).
namespace testing {
inline void stand_in_host_memory_for_device(bool on, bool needs_flush = false) noexcept {
  detail::stand_in_flag() = on ? (needs_flush ? 2 : 1) : 0;
}
inline void stand_in_alias(const void* device, const void* host, std::size_t len) {
  std::lock_guard lock(detail::stand_in_alias_mutex());
  detail::stand_in_aliases().push_back(
      {reinterpret_cast<std::uintptr_t>(device), reinterpret_cast<std::uintptr_t>(host), len});
}
inline void stand_in_unalias(const void* device) noexcept {
  std::lock_guard lock(detail::stand_in_alias_mutex());
  std::erase_if(detail::stand_in_aliases(),
                [&](const auto& e) { return e.device == reinterpret_cast<std::uintptr_t>(device); });
}
}  // namespace testing

/// The GPUDirect probe of GPU `gpu` and NIC `nic`, run once per pair and
/// process and cached. Thread-safe.
inline const gpudirect_report& probe_gpudirect(int gpu, ibv_context* nic) {
  if (int mode = detail::stand_in_flag(); mode != 0) {
    static const gpudirect_report stand_in[2] = {[] {
      gpudirect_report r;
      r.available = true;
      r.route = "host-stand-in";
      r.reason = "a test stand-in: host memory plays Device memory (gdr::verbs::testing)";
      r.writes_ordering = detail::cu_writes_ordering_owner;
      return r;
    }(), [] {
      gpudirect_report r;
      r.available = true;
      r.route = "host-stand-in";
      r.reason = "a test stand-in: host memory plays Device memory of a GPU that needs the flush";
      r.needs_flush = true;
      r.writes_ordering = 0;
      return r;
    }()};
    return stand_in[mode - 1];
  }
  static std::mutex mu;
  static std::map<std::pair<int, std::string>, gpudirect_report> done;
  std::string name = nic != nullptr ? ibv_get_device_name(nic->device) : "";
  std::lock_guard lock(mu);
  auto key = std::make_pair(gpu, name);
  auto it = done.find(key);
  if (it == done.end()) it = done.emplace(key, detail::run_gpudirect_probe(gpu, nic)).first;
  return it->second;
}

}  // namespace gdr::verbs
