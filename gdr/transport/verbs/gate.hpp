/// \file
/// The placement of one verbs connection that waits for its NIC: a put this
/// side serves, whose payload its NIC reads from the peer's memory (RDMA
/// READ), and the GPUDirect flush that ends a NIC write into GPU memory (a
/// one-byte READ through the device's loopback queue pair, `flush.hpp`).
/// One gate for both, with its states written out; the connection's
/// members that drive it are in `rdma_read.hpp`. No NIC is needed to use
/// or test the states (tests/verbs/gate_test.cpp).
///
/// The contract
/// ============
/// While the gate is not `open`, parsing of the frames behind stops
/// (placement is in order). The states and what moves between them:
///
///   open ──start_read──▶ read_ready ──read_posted──▶ read_posted
///   read_posted ──read_returned: more to read──▶ read_ready
///   read_posted ──read_returned: all read, GPU memory that needs it──▶ flush_ready
///   read_posted ──read_returned: all read, or failed, or stopped──▶ open
///   open ──start_flush (a NIC write into GPU memory that needs it)──▶ flush_ready
///   flush_ready ──flush_posted──▶ flush_posted
///   flush_posted ──flush_returned: done, or given up──▶ open
///   flush_posted ──flush_returned: the flush queue pair failed, retry──▶ flush_ready
///
/// The engine may stop the placement in any state (`abort`, from
/// `link_abort_target`); what it gets back says whether the placement's
/// memory is free at once:
///   * open, read_ready: yes (no READ is in flight; the gate opens);
///   * read_posted: no: a READ may still be writing the memory; the gate
///     remembers the stop, opens when the READ comes back, and then the
///     engine is told (`on_target_released`);
///   * flush_ready: yes (the bytes are in place; nothing to flush for: the
///     gate opens);
///   * flush_posted: yes (the flush's READ writes only the flush queue
///     pair's scratch word); the gate remembers the stop and opens when the
///     READ comes back, without completing the placement.
/// A failed connection ends a gate that waits for resources (read_ready,
/// flush_ready) at once (`drop_waiting`); one with a READ in flight opens
/// when the READ comes back (flushed, or done).
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>

#include <gdr/transport/verbs/memory.hpp>

namespace gdr::detail::verbs {

/// The gate (see the file comment): its state, and what the waiting
/// placement needs.
class nic_gate {
 public:
  enum class state : std::uint8_t {
    open,          ///< nothing waits: frames are parsed
    read_ready,    ///< a served put's next READ waits for a send slot or queue entry
    read_posted,   ///< a READ of the put is in flight
    flush_ready,   ///< the flush waits for room on the device's flush queue pair
    flush_posted,  ///< the flush's READ is in flight
  };

  /// What abort() means for the placement's memory.
  enum class released : std::uint8_t {
    now,    ///< free now
    later,  ///< free when the READ in flight comes back (on_target_released)
  };

  state current() const noexcept { return s_; }
  bool is_open() const noexcept { return s_ == state::open; }
  /// A READ of this gate's is in flight (the connection is not quiet).
  bool in_flight() const noexcept { return s_ == state::read_posted || s_ == state::flush_posted; }
  /// The engine stopped the placement while a READ was in flight.
  bool stopped() const noexcept { return stopped_; }

  // ---- the put's READ

  /// A put to serve: `len` bytes from the peer's `raddr` (key `rkey`) into
  /// `dst`, GPU `device`'s memory or host memory (-1).
  void start_read(std::byte* dst, std::size_t len, std::uint64_t raddr, std::uint32_t rkey, int device) noexcept {
    move(state::open, state::read_ready);
    read = read_job{};
    read.dst = dst;
    read.len = len;
    read.raddr = raddr;
    read.rkey = rkey;
    read.device = device;
  }
  void read_posted() noexcept { move(state::read_ready, state::read_posted); }
  /// What a READ's return did: the state the gate is in now, and whether
  /// the engine had stopped the placement meanwhile.
  struct outcome {
    state now;
    bool stopped;
  };

  /// The READ in flight came back with `n` bytes (`ok`), or failed. `flush`:
  /// the bytes went into GPU memory that needs the flush, which follows
  /// (with the READ's registration still held) once all are read.
  outcome read_returned(std::size_t n, bool ok, bool flush) noexcept {
    assert(s_ == state::read_posted && "gdr verbs: a READ came back that the gate did not post");
    const bool stopped = stopped_;
    if (ok) read.done += n;
    if (!ok || stopped) return {open_now(), stopped};
    if (read.done < read.len) return {s_ = state::read_ready, false};
    if (!flush) return {open_now(), false};
    s_ = state::open;
    start_flush(read.dst);
    return {s_, false};
  }

  // ---- the flush

  /// A NIC write into GPU memory at `addr` that needs the flush.
  void start_flush(const std::byte* addr) noexcept {
    move(state::open, state::flush_ready);
    flush = flush_job{};
    flush.addr = addr;
  }
  void flush_posted() noexcept { move(state::flush_ready, state::flush_posted); }
  /// The flush's READ came back: done (`ok`), or failed; `retry`: try it
  /// again (on the flush queue pair made anew).
  outcome flush_returned(bool ok, bool retry) noexcept {
    assert(s_ == state::flush_posted && "gdr verbs: a flush came back that the gate did not post");
    const bool stopped = stopped_;
    if (!ok && retry && !stopped) {
      ++flush.retries;
      return {s_ = state::flush_ready, false};
    }
    return {open_now(), stopped};
  }

  // ---- the engine's stop, and failure

  /// The engine stops the placement (see the file comment).
  released abort() noexcept {
    switch (s_) {
      case state::open: return released::now;
      case state::read_ready:
      case state::flush_ready: open_now(); return released::now;
      case state::read_posted: stopped_ = true; return released::later;
      case state::flush_posted: stopped_ = true; return released::now;
    }
    return released::now;
  }

  /// The connection failed: a gate that waits for resources opens (no
  /// READ of its is in flight). True if it did.
  bool drop_waiting() noexcept {
    if (s_ != state::read_ready && s_ != state::flush_ready) return false;
    open_now();
    return true;
  }

  /// What a served put's READ needs.
  struct read_job {
    std::byte* dst = nullptr;
    std::size_t len = 0;
    std::size_t done = 0;
    std::uint64_t raddr = 0;
    std::uint32_t rkey = 0;
    int device = -1;                           ///< dst is memory of this GPU (GPUDirect)
    gdr::verbs::registration_hold reg{};       ///< dst's registration; none: READs go through a send slot
  } read;
  /// What the flush needs.
  struct flush_job {
    const std::byte* addr = nullptr;
    gdr::verbs::owned_mr key{};           ///< the grant's exact registration the peer wrote through, or
    gdr::verbs::registration_hold reg{};  ///< the GPU memory's cached registration (the READ's key)
    int retries = 0;                      ///< times the flush queue pair failed under it
  } flush;

 private:
  void move(state from, state to) noexcept {
    assert(s_ == from && "gdr verbs: a NIC gate transition from the wrong state");
    (void)from;
    s_ = to;
  }
  state open_now() noexcept {
    s_ = state::open;
    stopped_ = false;
    read = read_job{};    // ends the registration holds
    flush = flush_job{};
    return s_;
  }

  state s_ = state::open;
  bool stopped_ = false;
};

}  // namespace gdr::detail::verbs
