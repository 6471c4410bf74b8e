// Device memory for the staged path's tests, on the machine at hand:
//   * built with CUDA (GDR_HAS_CUDA=1), real GPU memory (cudaMalloc) and the
//     CUDA copy engine (gdr::cuda::event_poller); without a usable GPU the
//     tests skip and say why;
//   * built without CUDA, host memory labelled gdr::Device and the CPU copy
//     engine (tests/protocol/cpu_copy_engine.hpp), so that the pipeline's
//     states are tested everywhere.
// `dev_mem` is a device allocation with host-side fill and read-back; `env`
// is what a scheduler needs for Device operations.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gdr/memory/view.hpp>
#include <gdr/sched/scheduler.hpp>

#if GDR_HAS_CUDA
#include <gdr/cuda/device.hpp>
#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/stream.hpp>
#include <gdr/cuda/vmm.hpp>
#include <gdr/error.hpp>
#else
#include "tests/protocol/cpu_copy_engine.hpp"
#endif

namespace staged {

/// How a `dev_mem` is allocated: `plain` as a caller's own GPU memory
/// (`cudaMalloc`; shared by legacy IPC), `shareable` as gdr allocates from
/// 1 MiB (the virtual memory API, shared by file descriptor; on the CPU,
/// the copy engine's stand-in, a memfd). `default_alloc` is the tests'
/// choice when they name none.
enum class dev_alloc { plain, shareable };
inline dev_alloc default_alloc = dev_alloc::plain;

#if GDR_HAS_CUDA
inline constexpr bool real_gpu = true;

/// Why Device tests cannot run here ("" when they can).
inline std::string unavailable() { return gdr::cuda::device_unavailable_reason(0); }

/// What a scheduler needs for Device operations: the CUDA event poller,
/// which is also its copy engine.
struct env {
  explicit env(gdr::scheduler& s) : ev(s) {}
  gdr::cuda::event_poller ev;
  // The CPU engine's knobs do not exist on a GPU (the tests that need them
  // skip there).
  static constexpr bool has_knobs = false;
  void hold() noexcept {}
  void release() noexcept {}
  void fail_copy(int) noexcept {}
  std::size_t in_flight() const noexcept { return 0; }
};

class dev_mem {
 public:
  explicit dev_mem(std::size_t n, int device = 0, dev_alloc how = default_alloc) : n_(n), device_(device) {
    if (how == dev_alloc::shareable) {
      auto b = gdr::cuda::vmm_registry::instance().allocate(n == 0 ? 1 : n, device);
      if (!b) throw gdr::error(b.error(), "dev_mem: the virtual memory API refused an allocation");
      p_ = reinterpret_cast<void*>(b->base);
      vmm_ = true;
      return;
    }
    gdr::cuda::device_guard g(device);
    if (cudaMalloc(&p_, n == 0 ? 1 : n) != cudaSuccess) throw std::bad_alloc();
  }
  dev_mem(const dev_mem&) = delete;
  dev_mem& operator=(const dev_mem&) = delete;
  ~dev_mem() {
    if (vmm_) {
      gdr::cuda::vmm_registry::instance().free(p_);
      return;
    }
    gdr::cuda::device_guard g(device_);
    (void)cudaFree(p_);
  }
  gdr::view<std::byte, gdr::Device> view() const noexcept { return {static_cast<std::byte*>(p_), n_, device_}; }
  // cudaMemcpy from pageable memory and cudaMemset may return before the
  // device has the bytes, and the staged path's copies run on streams that
  // do not wait for the legacy stream: both wait for the device.
  void fill(const std::vector<std::byte>& v) {
    gdr::cuda::device_guard g(device_);
    if (!v.empty()) (void)cudaMemcpy(p_, v.data(), std::min(v.size(), n_), cudaMemcpyHostToDevice);
    (void)cudaDeviceSynchronize();
  }
  void set(std::byte b) {
    gdr::cuda::device_guard g(device_);
    (void)cudaMemset(p_, static_cast<int>(b), n_);
    (void)cudaDeviceSynchronize();
  }
  std::vector<std::byte> read() const {
    std::vector<std::byte> v(n_);
    gdr::cuda::device_guard g(device_);
    if (n_ != 0) (void)cudaMemcpy(v.data(), p_, n_, cudaMemcpyDeviceToHost);
    return v;
  }
  std::size_t size() const noexcept { return n_; }

 private:
  void* p_ = nullptr;
  std::size_t n_;
  int device_ = 0;
  bool vmm_ = false;
};

#else
inline constexpr bool real_gpu = false;

inline std::string unavailable() { return {}; }

struct env {
  explicit env(gdr::scheduler& s) : ce(s) {}
  gdr_test_support::cpu_copy_engine ce;
  static constexpr bool has_knobs = true;
  void hold() noexcept { ce.hold(); }
  void release() noexcept { ce.release(); }
  void fail_copy(int n) noexcept { ce.fail_copy(n); }
  std::size_t in_flight() const noexcept { return ce.in_flight(); }
};

class dev_mem {
 public:
  explicit dev_mem(std::size_t n, int = 0, dev_alloc how = default_alloc) : n_(n) {
    if (how == dev_alloc::shareable) {
      p_ = static_cast<std::byte*>(gdr_test_support::fd_blocks::instance().allocate(n));
      fd_ = true;
    } else {
      own_.resize(n);
      p_ = own_.data();
    }
  }
  dev_mem(const dev_mem&) = delete;
  dev_mem& operator=(const dev_mem&) = delete;
  ~dev_mem() {
    if (fd_) gdr_test_support::fd_blocks::instance().free(p_);
  }
  gdr::view<std::byte, gdr::Device> view() noexcept { return {p_, n_, 0}; }
  void fill(const std::vector<std::byte>& v) {
    if (!v.empty() && n_ != 0) std::memcpy(p_, v.data(), std::min(v.size(), n_));
  }
  void set(std::byte b) { std::fill(p_, p_ + n_, b); }
  std::vector<std::byte> read() const { return {p_, p_ + n_}; }
  std::size_t size() const noexcept { return n_; }

 private:
  std::vector<std::byte> own_;
  std::byte* p_ = nullptr;
  std::size_t n_;
  bool fd_ = false;
};
#endif

}  // namespace staged
