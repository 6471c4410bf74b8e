/// \file
/// What an engine holds for its peer and for the staged path: reply slots
/// (a frame this side owes, with what it holds), bounce buffers and their
/// pools, and early messages (eager bytes or announcements kept for a
/// receive). The engine's code that hands them out is in bounce_pool.hpp
/// and matching.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include <gdr/memory/registration.hpp>
#include <gdr/protocol/engine/link.hpp>
#include <gdr/sched/copy_engine.hpp>

namespace gdr::detail::proto {

class engine;

/// A frame this side owes its peer (an answer), with what it holds.
/// Allocated one at a time when a request finds none free (see "Reply
/// slots" in the engine).
struct reply_slot {
  frame f;
  access_lease lease{};  ///< a get's source memory, held until written
  reply_slot* next_free = nullptr;
  reply_slot* next_made = nullptr;  ///< every slot the engine allocated (freed with it)
  stage_slot* bounce = nullptr;  ///< a get from Device memory: the bytes' bounce buffer
  // A get from Device memory waiting for a tx bounce buffer (serve_wait_):
  reply_slot* wait_next = nullptr;
  std::uint64_t wait_id = 0;
  std::size_t wait_len = 0;
  // An atomic being served: its operation, its operands (the request's
  // payload) and the word's old value (the answer's).
  std::uint64_t atomic = 0;
  alignas(8) std::byte atomic_args[16]{};
  std::uint64_t atomic_old = 0;
};

/// An engine's reply slots (see "Reply slots" in engine/one_sided.hpp):
/// every one it made, kept once made and freed with it; the free ones; the
/// gets of Device memory that wait for a bounce buffer with theirs; and
/// the spare, which answers `no_memory` when no slot can be allocated.
struct reply_pool {
  reply_slot* free = nullptr;
  reply_slot* serve_wait_head = nullptr;  ///< gets of Device memory waiting for a tx bounce buffer
  reply_slot* serve_wait_tail = nullptr;
  reply_slot* made = nullptr;  ///< every slot allocated (`next_made`)
  std::size_t made_count = 0;
  std::size_t limit = 0;       ///< the credits granted in the hello: at most this many are made
  reply_slot spare{};
  bool spare_busy = false;

  reply_pool() noexcept { spare.f.slot = &spare; }
  reply_pool(const reply_pool&) = delete;
  reply_pool& operator=(const reply_pool&) = delete;
  ~reply_pool() {
    while (reply_slot* s = made) {
      made = s->next_made;
      delete s;
    }
  }
};

/// One segment of the staged path in flight: a bounce buffer of
/// `staging_options::chunk` bytes (rx: the bytes received, copied to the
/// device next; tx: the bytes copied from the device, sent next), the frame
/// that carries it (tx), and its copy's completion. A tx slot also carries
/// the segments of host memory that a peer's bounce buffers limit (then its
/// buffer is not used).
struct stage_slot : copy_engine::completion {
  engine* eng = nullptr;
  op* owner = nullptr;      ///< the operation it serves, or
  reply_slot* rs = nullptr; ///< the peer's request it serves
  std::byte* mem = nullptr; ///< its bounce buffer
  frame f;
  std::size_t off = 0;      ///< where its bytes are in the operation's memory
  std::size_t len = 0;
  std::uint64_t req = 0;    ///< a served request's id
  stage_slot* next = nullptr;  ///< the free list, or its operation's list
  bool rx = false;
  bool copying = false;  ///< a copy into or out of it is queued
  bool ready = false;    ///< tx: its bytes are in place, the frame not yet posted
  bool posted = false;   ///< tx: its frame is posted
  bool credited = false; ///< tx: a put's or get's request: its credit is taken (with the buffer)
};

/// The bounce buffers of one direction of an endpoint.
struct stage_pool {
  std::unique_ptr<stage_slot[]> slots;
  std::size_t count = 0;
  std::size_t in_use = 0;
  stage_slot* free = nullptr;
  copy_engine::pinned_block block{};  ///< `count * chunk` pinned bytes, once needed

  ~stage_pool() {
    if (block.data != nullptr && block.release != nullptr) block.release(block.data, block.size);
  }
};

/// An early message: eager bytes kept, or an announcement (`rts`).
struct early_msg {
  early_msg* prev = nullptr;
  early_msg* next = nullptr;
  std::uint64_t tag = 0;
  std::uint64_t size = 0;  ///< message bytes
  std::uint64_t sid = 0;   ///< rts: the sender's send id
  bool rts = false;
  std::unique_ptr<std::byte[]> bytes;  ///< eager: the message
};

}  // namespace gdr::detail::proto
