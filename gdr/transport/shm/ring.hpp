/// \file
/// The shared-memory transport's ring: one direction of a connection, a
/// single-producer single-consumer byte ring in a memfd segment that the
/// writing process creates and the reading process maps.
///
/// Layout of a segment (all integers native-endian: both sides run on one
/// node):
///
/// \verbatim
///   offset  size  field
///   0       4     magic           "GDRS"
///   4       4     version         1
///   8       8     capacity        data bytes, a power of two
///   64      8     head            bytes ever written (the writer's)
///   128     8     tail            bytes ever consumed (the reader's)
///   192     4     reader_waiting  the reader sleeps until the writer rings its bell
///   196     4     writer_waiting  the writer sleeps until the reader rings its bell
///   200     8     copied          single-copy frames the reader has copied (the reader's)
///   256     capacity              the data
/// \endverbatim
///
/// Positions only grow (mod 2^64); a byte at position p lives at
/// `data[p & (capacity - 1)]`. The writer copies bytes in at its position and
/// then publishes `head` (release); the reader copies bytes out below `head`
/// (acquire) and then publishes `tail` (release), which gives their room
/// back. Neither side trusts the other's counter: `head - tail` above the
/// capacity is a protocol error.
///
/// Waking a sleeping side (no thread of its own, no futex): each process
/// has a bell, an eventfd its scheduler reads through io_uring while it
/// sleeps. A side about to sleep for lack of bytes (or of room) sets its
/// waiting flag, then looks again; the other side, after publishing, looks
/// at the flag and rings the bell if it was set. A full fence between the
/// store and the load on each side (Dekker) means that at least one of them
/// sees the other: no lost wake-up. The fence is the counters' and flags'
/// sequentially consistent stores and loads (on x86 a store is an `xchg`,
/// a load a plain load; `atomic_thread_fence` would do the same, but
/// ThreadSanitizer does not model fences). A side that busy-polls never
/// sets the flag, so the other side's check is one load of a cache line
/// nobody writes.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>

namespace gdr::detail::shm {

inline constexpr std::uint32_t segment_magic = 0x53524447u;  // "GDRS" little-endian
inline constexpr std::uint32_t segment_version = 1;
inline constexpr std::size_t control_bytes = 256;

/// The segment's control block (the layout above).
struct ring_control {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint64_t capacity;
  alignas(64) std::atomic<std::uint64_t> head;
  alignas(64) std::atomic<std::uint64_t> tail;
  alignas(64) std::atomic<std::uint32_t> reader_waiting;
  std::atomic<std::uint32_t> writer_waiting;
  std::atomic<std::uint64_t> copied;
  /// Descriptor slots (bit per slot) whose allocation the writer freed: the
  /// reader lets its descriptor and mapping go, then clears the bit; the
  /// writer passes nothing into a slot whose bit is set.
  std::atomic<std::uint32_t> released;
};
static_assert(sizeof(ring_control) <= control_bytes);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free,
              "the ring's counters are shared between processes: they must be lock-free");

/// A mapping of a segment (munmap on destruction).
class mapping {
 public:
  mapping() noexcept = default;
  mapping(void* base, std::size_t len) noexcept : base_(base), len_(len) {}
  mapping(mapping&& o) noexcept : base_(std::exchange(o.base_, nullptr)), len_(std::exchange(o.len_, 0)) {}
  mapping& operator=(mapping&& o) noexcept {
    if (this != &o) {
      reset();
      base_ = std::exchange(o.base_, nullptr);
      len_ = std::exchange(o.len_, 0);
    }
    return *this;
  }
  ~mapping() { reset(); }
  void reset() noexcept {
    if (base_ != nullptr) ::munmap(base_, len_);
    base_ = nullptr;
    len_ = 0;
  }
  void* get() const noexcept { return base_; }
  std::size_t size() const noexcept { return len_; }

 private:
  void* base_ = nullptr;
  std::size_t len_ = 0;
};

/// Bytes of a segment whose ring holds `capacity` bytes.
constexpr std::size_t segment_bytes(std::size_t capacity) noexcept { return control_bytes + capacity; }

/// One side's view of a ring: the writer's or the reader's. It keeps its own
/// position and publishes it; it reads the other side's counter only to
/// learn how far it may go.
class ring {
 public:
  ring() noexcept = default;
  /// Over a mapped segment whose control block says `capacity` (checked by
  /// the caller against the mapping's size).
  explicit ring(void* segment) noexcept
      : c_(static_cast<ring_control*>(segment)),
        data_(static_cast<std::byte*>(segment) + control_bytes),
        cap_(c_->capacity),
        mask_(cap_ - 1) {}

  /// Writes a fresh control block for `capacity` bytes (a power of two) at
  /// `segment` (the creator, before the segment is shared).
  static void format(void* segment, std::size_t capacity) noexcept {
    auto* c = ::new (segment) ring_control{};
    c->magic = segment_magic;
    c->version = segment_version;
    c->capacity = capacity;
    c->head.store(0, std::memory_order_relaxed);
    c->tail.store(0, std::memory_order_relaxed);
    c->copied.store(0, std::memory_order_relaxed);
  }

  /// Is the control block at `segment`, of a mapping of `bytes` bytes, one
  /// this version can use? (Its counters are not checked: the peer may
  /// have written its first frames already; every read checks them.)
  static bool valid(const void* segment, std::size_t bytes) noexcept {
    if (bytes < control_bytes) return false;
    const auto* c = static_cast<const ring_control*>(segment);
    return c->magic == segment_magic && c->version == segment_version && c->capacity >= 4096 &&
           std::has_single_bit(c->capacity) && segment_bytes(c->capacity) <= bytes;
  }

  std::size_t capacity() const noexcept { return cap_; }
  ring_control& control() const noexcept { return *c_; }

  // ---------------------------------------------------------------- the writer's side

  /// Room for bytes: what the reader's tail last seen leaves, and if that
  /// is less than `want`, what its tail leaves now (acquire). Reading the
  /// tail only when short keeps the reader's cache line where it is (one
  /// transfer between the cores less per message). A tail ahead of what
  /// was written (a corrupt peer) reads as no room.
  std::size_t room(std::size_t want = 1) noexcept {
    std::uint64_t used = pos_ - tail_seen_;
    if (cap_ - used < want) {
      tail_seen_ = c_->tail.load(std::memory_order_seq_cst);
      used = pos_ - tail_seen_;
    }
    return used > cap_ ? 0 : cap_ - static_cast<std::size_t>(used);
  }
  /// Copies `n` bytes (at most `room()`) in at the writer's position.
  void put(const std::byte* src, std::size_t n) noexcept {
    std::size_t at = static_cast<std::size_t>(pos_) & mask_;
    std::size_t first = std::min(n, cap_ - at);
    std::memcpy(data_ + at, src, first);
    if (first < n) std::memcpy(data_, src + first, n - first);
    pos_ += n;
  }
  /// Makes what was put visible to the reader.
  void publish() noexcept { c_->head.store(pos_, std::memory_order_seq_cst); }

  // ---------------------------------------------------------------- the reader's side

  /// Bytes readable now (the writer's head, acquire); `corrupt` set when the
  /// head claims more than the ring holds.
  std::size_t readable(bool& corrupt) const noexcept {
    std::uint64_t n = c_->head.load(std::memory_order_seq_cst) - pos_;
    corrupt = n > cap_;
    return corrupt ? 0 : static_cast<std::size_t>(n);
  }
  /// Copies `n` readable bytes starting `skip` bytes past the reader's
  /// position, without consuming them.
  void peek(std::byte* dst, std::size_t skip, std::size_t n) const noexcept {
    std::size_t at = static_cast<std::size_t>(pos_ + skip) & mask_;
    std::size_t first = std::min(n, cap_ - at);
    std::memcpy(dst, data_ + at, first);
    if (first < n) std::memcpy(dst + first, data_, n - first);
  }
  /// The readable bytes `skip` past the reader's position, in place: a
  /// pointer and how many of the next `n` follow it before the ring wraps.
  const std::byte* span(std::size_t skip, std::size_t n, std::size_t& contiguous) const noexcept {
    std::size_t at = static_cast<std::size_t>(pos_ + skip) & mask_;
    contiguous = std::min(n, cap_ - at);
    return data_ + at;
  }
  /// Consumes `n` bytes (after peeking them, or to drop them).
  void consume(std::size_t n) noexcept { pos_ += n; }
  /// Gives the consumed room back to the writer.
  void release() noexcept { c_->tail.store(pos_, std::memory_order_seq_cst); }

  /// The position of this side (bytes written or consumed so far).
  std::uint64_t position() const noexcept { return pos_; }

 private:
  ring_control* c_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t cap_ = 0;
  std::size_t mask_ = 0;
  std::uint64_t pos_ = 0;
  std::uint64_t tail_seen_ = 0;  // the writer's: the reader's tail when last read
};

/// The writer after publishing, or the reader after releasing (both
/// sequentially consistent stores): should the other side's bell ring?
/// (`flag`: the other side's waiting flag.)
inline bool take_waiter(std::atomic<std::uint32_t>& flag) noexcept {
  return flag.load(std::memory_order_seq_cst) != 0 && flag.exchange(0, std::memory_order_seq_cst) != 0;
}

/// A side about to sleep: says so, then the caller looks once more (with
/// sequentially consistent loads).
inline void announce_wait(std::atomic<std::uint32_t>& flag) noexcept { flag.store(1, std::memory_order_seq_cst); }

}  // namespace gdr::detail::shm
