/// \file
/// What the protocol layer's staged path needs from a copy engine, and how it
/// is tuned.
///
/// `Device` memory crosses a transport that moves host bytes (TCP, loopback,
/// verbs without GPUDirect) through `Pinned` bounce buffers: the sender copies
/// each chunk device-to-host and sends it from the bounce buffer while the
/// next chunk is copied; the receiver places each chunk in a bounce buffer and
/// copies it host-to-device while the next one arrives. The pipeline itself is
/// the protocol engine's (`gdr/protocol/engine.hpp`); the copies are a
/// `copy_engine`'s, found through the endpoint's scheduler:
///
///   * `gdr::cuda::event_poller` is the CUDA one: one stream per direction and
///     GPU (both copy engines work at once), completion through CUDA events
///     polled by the scheduler, `cudaHostAlloc` for the bounce buffers. Making
///     the event poller (`gdr::cuda::event_poller events(sched);`) is all a
///     program does to send `Device` memory.
///   * Tests on machines without a GPU use a copy engine that moves bytes with
///     the CPU and completes from the scheduler's loop, so the pipeline's
///     states (chunking, truncation, cancellation, peer death mid-transfer)
///     are exercised everywhere; the H200 runs the same suite on CUDA's.
///
/// Without a copy engine on the scheduler a `Device` operation fails with
/// `errc::no_device`, saying so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <system_error>

#include <gdr/error.hpp>
#include <gdr/sched/poller.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/stream_order.hpp>

namespace gdr {

/// An asynchronous copy engine for the staged path: device-to-host and
/// host-to-device copies that complete on the scheduler's thread, and pinned
/// host memory for the bounce buffers. A scheduler has at most one (it is a
/// slotted poller); endpoints find it with `copy_engine::of(sched)`.
class copy_engine : public poller {
 public:
  static constexpr poller_kind kind = poller_kind::copy_engine;

  enum class direction : std::uint8_t {
    to_host,    ///< device to pinned host memory
    to_device,  ///< pinned host memory to device
  };

  /// What a queued copy completes: `done(c, ec)` runs once, on the
  /// scheduler's thread, from the engine's `poll()` (never inside `copy`),
  /// with an empty `ec` on success.
  struct completion {
    void (*done)(completion*, std::error_code) noexcept = nullptr;
  };

  /// Queues a copy of `n` bytes (`n > 0`) from `src` to `dst` on GPU
  /// `device`, in direction `d`. Copies of one direction and GPU run and
  /// complete in the order queued. `after`, when set, orders this copy after
  /// the work already queued on that stream, without a host synchronize.
  /// Returns an error (and will not complete `c`) if it could not be queued.
  virtual std::error_code copy(direction d, int device, void* dst, const void* src, std::size_t n,
                               stream_order after, completion* c) noexcept = 0;

  /// Pinned host memory and how to free it. `release` must not need the
  /// copy engine object: an endpoint may free its bounce buffers after the
  /// engine is gone.
  struct pinned_block {
    std::byte* data = nullptr;
    std::size_t size = 0;
    void (*release)(std::byte*, std::size_t) noexcept = nullptr;
  };

  /// `n` bytes of pinned host memory (`data` null if it could not be had).
  /// Called once per bounce pool, never on the data path.
  virtual pinned_block allocate_pinned(std::size_t n) noexcept = 0;

  // ------------------------------------------------------------ CUDA IPC
  //
  // Device memory shared with another process of the node (the
  // shared-memory transport's `Device` path): the owner exports the
  // allocation holding a buffer, the descriptor travels, and the other
  // process imports it (once: the engine keeps a cache of mappings) and
  // copies straight out of it on its GPU.

  /// How an exported allocation travels.
  enum class ipc_kind : std::uint8_t {
    handle = 1,  ///< the driver's legacy IPC handle, in `handle` (`cudaMalloc` memory)
    fd = 2,      ///< a file descriptor (the virtual memory API), passed beside the descriptor
  };

  /// What the owner of device memory sends the importer: the allocation
  /// that holds the bytes, never more. Trivially copyable; `wire_size`
  /// bytes on the wire (`to_wire`, `from_wire`). `kind` and `fd` are not
  /// in those bytes: the transport carries them (the kind in its frame,
  /// the descriptor over its socket).
  struct ipc_memory {
    std::byte handle[64]{};       ///< the driver's handle (`cudaIpcMemHandle_t`), for `ipc_kind::handle`
    std::uint64_t base = 0;       ///< the allocation's address in the owner's process
    std::uint64_t size = 0;       ///< the allocation's bytes
    std::uint64_t buffer_id = 0;  ///< the driver's id of the allocation: an address freed and reused gets another
    std::int32_t device = -1;     ///< the owner's GPU ordinal
    std::int32_t pid = 0;         ///< the owner's process id
    ipc_kind kind = ipc_kind::handle;
    /// `ipc_kind::fd`: the allocation's descriptor, borrowed both ways: from
    /// `ipc_export`, the owner's own (the transport passes a copy to the
    /// peer); into `ipc_copy`, the importer's copy, which the transport
    /// keeps (the engine imports from it when it has no mapping yet).
    int fd = -1;

    static constexpr std::size_t wire_size = 96;
    void to_wire(std::byte* out) const noexcept {
      std::memcpy(out, handle, 64);
      std::memcpy(out + 64, &base, 8);
      std::memcpy(out + 72, &size, 8);
      std::memcpy(out + 80, &buffer_id, 8);
      std::memcpy(out + 88, &device, 4);
      std::memcpy(out + 92, &pid, 4);
    }
    static ipc_memory from_wire(const std::byte* in) noexcept {
      ipc_memory m;
      std::memcpy(m.handle, in, 64);
      std::memcpy(&m.base, in + 64, 8);
      std::memcpy(&m.size, in + 72, 8);
      std::memcpy(&m.buffer_id, in + 80, 8);
      std::memcpy(&m.device, in + 88, 4);
      std::memcpy(&m.pid, in + 92, 4);
      return m;
    }
  };

  /// Can this engine share device memory between processes (`ipc_export`,
  /// `ipc_copy`)? Asked once per endpoint, at its set-up.
  virtual bool ipc_capable() const noexcept { return false; }

  /// Exports the allocation holding `[p, p + n)`, device memory of this
  /// process: fills `out` and the offset of `p` in it. `errc::unsupported`
  /// (with `*why` set to a sentence saying what to do) for memory the
  /// driver cannot share: not device memory, managed memory, memory of an
  /// allocator whose handles do not travel.
  virtual std::error_code ipc_export(const void* p, std::size_t n, ipc_memory& out, std::uint64_t& offset,
                                     const char** why) noexcept {
    (void)p, (void)n, (void)out, (void)offset;
    if (why != nullptr) *why = "this copy engine cannot share device memory between processes";
    return errc::unsupported;
  }

  /// Queues a copy of `n` bytes (`n > 0`) at `offset` in the peer's
  /// exported allocation `src` into `dst`: device memory of GPU
  /// `dst_device`, or host memory (-1). The allocation is imported on first
  /// use and kept (per owner process, GPU and base address, checked by
  /// buffer id) while copies use it. `after`, when set, orders the copy
  /// after the work already queued on that stream (the importing
  /// operation's `op_options::after`: a kernel still reading `dst`), as
  /// for `copy`. `c` completes as for `copy`.
  /// `src.fd` (`ipc_kind::fd`) is borrowed: used to import the allocation
  /// if it is not mapped yet.
  ///
  /// The descriptor is the peer's word, so its `size` is only a claim: the
  /// range is checked against what the import really holds (the driver's
  /// extent of the opened allocation, never more than the claim), and one
  /// outside it is refused with `errc::protocol_error` (nothing copied),
  /// which fails the peer's connection.
  virtual std::error_code ipc_copy(const ipc_memory& src, std::uint64_t offset, void* dst, int dst_device,
                                   std::size_t n, stream_order after, completion* c) noexcept {
    (void)src, (void)offset, (void)dst, (void)dst_device, (void)n, (void)after, (void)c;
    return errc::unsupported;
  }

  /// Device memory of GPU `device` is about to be read by a peer's GPU:
  /// completes `c` once the work queued before now on that GPU's legacy
  /// default stream and on `after` (if set) is done, the order a staged
  /// copy would have kept. `done_now` (and `c` never completes): it is done
  /// already.
  virtual std::error_code ipc_fence(int device, stream_order after, completion* c, bool& done_now) noexcept {
    (void)device, (void)after, (void)c;
    done_now = true;
    return {};
  }

  /// Process `pid` ended (or its last connection did): its mappings are
  /// let go (each once no copy uses it).
  virtual void ipc_forget(int pid) noexcept { (void)pid; }

  // Allocations that travel as a file descriptor (`ipc_kind::fd`) live
  // while any process holds them. So that a peer does not keep one the
  // owner freed, the owner's transport tells the peer when one it passed is
  // freed:
  /// A count that changes whenever this process frees an allocation it
  /// exported as a file descriptor (any thread; compared, never summed).
  virtual std::uint64_t ipc_frees() const noexcept { return 0; }
  /// Is this process's allocation `base` with id `buffer_id`, exported as a
  /// file descriptor, still allocated?
  virtual bool ipc_alive(std::uint64_t base, std::uint64_t buffer_id) const noexcept {
    (void)base, (void)buffer_id;
    return true;
  }
  /// Process `pid` freed its allocation `base` with id `buffer_id`: its
  /// mapping here is let go (once no copy uses it).
  virtual void ipc_release(int pid, std::uint64_t base, std::uint64_t buffer_id) noexcept {
    (void)pid, (void)base, (void)buffer_id;
  }

  /// The copy engine of `s`, or null.
  static copy_engine* of(const scheduler& s) noexcept { return s.poller_slot<copy_engine>(); }
};

}  // namespace gdr
