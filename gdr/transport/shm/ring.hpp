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
///   208     4     released        descriptor slots the writer freed (connection.hpp)
///   256     capacity              the data
/// \endverbatim
///
/// Positions only grow (mod 2^64); a byte at position p lives at
/// `data[p & (capacity - 1)]`. The writer copies bytes in at its position and
/// then publishes `head` (release); the reader copies bytes out below `head`
/// (acquire) and then publishes `tail` (release), which gives their room
/// back.
///
/// The peer maps the segment read-write and may write any word of it at any
/// time (a stale rank, a buggy or hostile process): neither side trusts
/// anything it reads there. The capacity is read once, when the segment is
/// checked at set-up (`valid_capacity`), and each side holds it in its own
/// memory from then on: the writer's own ring's from its own choice, the
/// reader's from that check; the word in the segment is never read again.
/// Each counter of the other side's is loaded once into a local, checked
/// against what this side holds, then used: a head more than the capacity
/// ahead of the reader (or behind it), a tail behind the last one seen or
/// past what was written, is a corrupt ring (`readable`'s flag,
/// `corrupt()`), which the connection fails with `errc::protocol_error`.
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

/// The segment's control block (the layout above). Every field is an
/// atomic: the peer may write any of them while this side reads.
struct ring_control {
  std::atomic<std::uint32_t> magic;
  std::atomic<std::uint32_t> version;
  std::atomic<std::uint64_t> capacity;  ///< read once, at set-up (`ring::valid_capacity`)
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
static_assert(offsetof(ring_control, capacity) == 8 && offsetof(ring_control, head) == 64 &&
              offsetof(ring_control, tail) == 128 && offsetof(ring_control, reader_waiting) == 192 &&
              offsetof(ring_control, copied) == 200 && offsetof(ring_control, released) == 208,
              "the segment's layout (the table above) is shared with the peer: fixed");
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
/// learn how far it may go, and checks it first.
class ring {
 public:
  ring() noexcept = default;
  /// Over a mapped segment of at least `segment_bytes(capacity)` bytes whose
  /// ring holds `capacity` bytes: the capacity this side chose for its own
  /// ring, or the one `valid_capacity` read from the peer's at set-up. Never
  /// the word in the segment again: the peer may have rewritten it since.
  ring(void* segment, std::size_t capacity) noexcept
      : c_(static_cast<ring_control*>(segment)),
        data_(static_cast<std::byte*>(segment) + control_bytes),
        cap_(capacity),
        mask_(capacity - 1) {}

  /// Writes a fresh control block for `capacity` bytes (a power of two) at
  /// `segment` (the creator, before the segment is shared).
  static void format(void* segment, std::size_t capacity) noexcept {
    auto* c = ::new (segment) ring_control{};
    c->magic.store(segment_magic, std::memory_order_relaxed);
    c->version.store(segment_version, std::memory_order_relaxed);
    c->capacity.store(capacity, std::memory_order_relaxed);
    c->head.store(0, std::memory_order_relaxed);
    c->tail.store(0, std::memory_order_relaxed);
    c->copied.store(0, std::memory_order_relaxed);
  }

  /// The capacity of the control block at `segment`, of a mapping of
  /// `bytes` bytes, if it is one this version can use; else 0. Each word is
  /// read once: what is returned is what was checked, whatever the peer
  /// writes there afterwards. (Its counters are not checked: the peer may
  /// have written its first frames already; every read checks them.)
  static std::size_t valid_capacity(const void* segment, std::size_t bytes) noexcept {
    if (bytes < control_bytes) return 0;
    const auto* c = static_cast<const ring_control*>(segment);
    const std::uint32_t magic = c->magic.load(std::memory_order_relaxed);
    const std::uint32_t version = c->version.load(std::memory_order_relaxed);
    const std::uint64_t cap = c->capacity.load(std::memory_order_relaxed);
    const bool ok = magic == segment_magic && version == segment_version && cap >= 4096 && std::has_single_bit(cap) &&
                    cap <= bytes - control_bytes;
    return ok ? static_cast<std::size_t>(cap) : 0;
  }

  std::size_t capacity() const noexcept { return cap_; }
  ring_control& control() const noexcept { return *c_; }
  /// The peer broke a counter this side read (a tail behind the last one
  /// seen or past what was written): nothing more is written.
  bool corrupt() const noexcept { return corrupt_; }

  // ---------------------------------------------------------------- the writer's side

  /// The reader's tail (acquire), checked: between the last one seen and
  /// what was written. Else the peer broke it: `corrupt()` from then on,
  /// and the last good one.
  std::uint64_t peer_tail() noexcept {
    const std::uint64_t t = c_->tail.load(std::memory_order_seq_cst);
    if (t - tail_seen_ > pos_ - tail_seen_) corrupt_ = true;
    if (corrupt_) return tail_seen_;
    return tail_seen_ = t;
  }
  /// Room for bytes: what the reader's tail last seen leaves, and if that
  /// is less than `want`, what its tail leaves now. Reading the tail only
  /// when short keeps the reader's cache line where it is (one transfer
  /// between the cores less per message). A corrupt tail leaves none.
  /// (`pos_ - tail_seen_` is at most the capacity: the writer puts no more
  /// than the room, and a tail seen is never past what was written.)
  std::size_t room(std::size_t want = 1) noexcept {
    if (cap_ - (pos_ - tail_seen_) < want) peer_tail();
    return corrupt_ ? 0 : cap_ - static_cast<std::size_t>(pos_ - tail_seen_);
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

  /// Bytes readable now (the writer's head, acquire, loaded once); `corrupt`
  /// set when the head claims more than the ring holds (or is behind the
  /// reader).
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
  std::uint64_t tail_seen_ = 0;  // the writer's: the reader's tail when last read (and checked)
  bool corrupt_ = false;         // the writer's: the reader's tail was broken
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
