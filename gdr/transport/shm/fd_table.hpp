/// \file
/// The shared-memory connection's two descriptor tables (member objects of
/// `connection`): the writer's, which of this process's shareable device
/// allocations the peer holds a file descriptor of, in which of its slots;
/// and the reader's, the descriptors the peer passed, one per slot. How they
/// travel is in descriptors.hpp and "Device memory by CUDA IPC" in
/// connection.hpp.
///
/// The invariant both keep. The peer maps an allocation of this process's
/// that came by descriptor only while its descriptor is in one of the
/// peer's slots (and while copies out of it run), and the writer's table
/// mirrors those slots. An allocation leaves its slot in one of two ways:
///   * freed here: the writer's next look at its table (`take_freed`) names
///     the slot in the ring's `released` bits, and the reader lets it go
///     (`release`): descriptor and mapping;
///   * replaced: the writer passes another allocation's descriptor into the
///     slot (the least recently used, when all are taken) and forgets the
///     old one, which it will then never name when it is freed; so the
///     reader, taking the new descriptor (`take`), lets the old allocation
///     go at once, descriptor and mapping.
/// So every allocation the peer may hold mapped is in the writer's table,
/// or its slot holds a replacement the reader takes with the frame that
/// names it; none is held by the peer after it is freed here. (The price:
/// an allocation replaced and sent again is passed and imported again.)
///
/// Nothing in the reader's table trusts the peer: a slot out of range, a
/// descriptor for a slot that holds another allocation, a mask with bits of
/// no slot, are refused or ignored by the table itself.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <utility>

namespace gdr::detail::shm {

/// Descriptors kept per connection: the peer holds at most this many.
inline constexpr std::uint32_t fd_slots = 16;
static_assert(fd_slots <= 32, "the ring's `released` word has a bit per slot");

/// The writer's table (see the file comment).
class fd_table_out {
 public:
  struct lookup {
    std::uint32_t slot = fd_slots;  ///< fd_slots: none to pass into now (each waits for the peer to let it go)
    bool held = false;              ///< the peer holds the allocation's descriptor in `slot` already
  };

  /// The slot holding allocation `base`, `id` (`held`), or the one to pass
  /// it into: an empty one first, else the least recently used, never one
  /// of `pending` (freed slots the peer has yet to let go).
  lookup find(std::uint64_t base, std::uint64_t id, std::uint32_t pending) const noexcept {
    lookup r;
    for (std::uint32_t i = 0; i < fd_slots; ++i) {
      const entry& e = e_[i];
      if (e.used != 0 && e.base == base && e.id == id) return {i, true};
      if ((pending & (1u << i)) != 0) continue;
      if (r.slot == fd_slots || e.used < e_[r.slot].used) r.slot = i;  // empty (0) first, then the oldest
    }
    return r;
  }

  /// Allocation `base`, `id` was passed into `slot` (< fd_slots): what the
  /// slot held is forgotten (the peer lets it go as it takes this one).
  void put(std::uint32_t slot, std::uint64_t base, std::uint64_t id) noexcept {
    if (e_[slot].used == 0) ++in_use_;
    e_[slot] = {base, id, ++clock_};
  }

  /// The allocation in `slot` is used again (for least recently used).
  void touch(std::uint32_t slot) noexcept { e_[slot].used = ++clock_; }

  /// Empties the slots whose allocation `alive(base, id)` says is freed;
  /// the mask of them (what the peer is told).
  template <class Alive>
  std::uint32_t take_freed(Alive&& alive) {
    std::uint32_t mask = 0;
    for (std::uint32_t i = 0; i < fd_slots; ++i) {
      entry& e = e_[i];
      if (e.used == 0 || alive(e.base, e.id)) continue;
      e = {};
      --in_use_;
      mask |= 1u << i;
    }
    return mask;
  }

  /// Slots in use.
  std::uint32_t in_use() const noexcept { return in_use_; }

 private:
  struct entry {
    std::uint64_t base = 0, id = 0;
    std::uint64_t used = 0;  // when last used; 0: empty
  };
  entry e_[fd_slots]{};
  std::uint32_t in_use_ = 0;
  std::uint64_t clock_ = 0;
};

/// The reader's table (see the file comment). Owns its descriptors.
class fd_table_in {
 public:
  /// An allocation of the peer's that a slot held, for `let_go`.
  struct allocation {
    std::uint64_t base = 0, id = 0;
  };

  fd_table_in() noexcept = default;
  fd_table_in(const fd_table_in&) = delete;
  fd_table_in& operator=(const fd_table_in&) = delete;
  ~fd_table_in() { close_all(); }

  /// The descriptor `slot` holds for allocation `base`, `id`; -1 when the
  /// slot is out of range, empty, or another allocation's (the peer broke
  /// the protocol).
  int held(std::uint32_t slot, std::uint64_t base, std::uint64_t id) const noexcept {
    if (slot >= fd_slots) return -1;
    const entry& e = e_[slot];
    return e.fd >= 0 && e.base == base && e.id == id ? e.fd : -1;
  }

  /// Keeps `fd` (owned from now on) for allocation `base`, `id` in `slot`;
  /// false (and `fd` closed) when the slot is out of range. The allocation
  /// the slot held goes: its descriptor is closed and `let_go(allocation)`
  /// lets its mapping go (the writer forgot it when it passed this one).
  template <class LetGo>
  bool take(std::uint32_t slot, std::uint64_t base, std::uint64_t id, int fd, LetGo&& let_go) {
    if (slot >= fd_slots) {
      if (fd >= 0) ::close(fd);
      return false;
    }
    entry& e = e_[slot];
    if (e.fd >= 0) {
      const allocation old{e.base, e.id};
      ::close(std::exchange(e.fd, -1));
      --in_use_;
      let_go(old);
    }
    e = {base, id, fd};
    ++in_use_;
    return true;
  }

  /// The writer freed the allocations of the slots in `mask`: each held one
  /// goes (descriptor closed, `let_go`). Bits of no slot are ignored. How
  /// many went.
  template <class LetGo>
  std::uint32_t release(std::uint32_t mask, LetGo&& let_go) {
    std::uint32_t n = 0;
    for (std::uint32_t i = 0; i < fd_slots; ++i) {
      entry& e = e_[i];
      if ((mask & (1u << i)) == 0 || e.fd < 0) continue;
      const allocation old{e.base, e.id};
      ::close(std::exchange(e.fd, -1));
      e = {};
      --in_use_;
      ++n;
      let_go(old);
    }
    return n;
  }

  /// Closes every descriptor (the connection's end; the mappings go with
  /// the peer: `copy_engine::ipc_forget`).
  void close_all() noexcept {
    for (entry& e : e_)
      if (e.fd >= 0) {
        ::close(e.fd);
        e = {};
      }
    in_use_ = 0;
  }

  /// Slots holding a descriptor.
  std::uint32_t in_use() const noexcept { return in_use_; }

 private:
  struct entry {
    std::uint64_t base = 0, id = 0;
    int fd = -1;
  };
  entry e_[fd_slots]{};
  std::uint32_t in_use_ = 0;
};

}  // namespace gdr::detail::shm
