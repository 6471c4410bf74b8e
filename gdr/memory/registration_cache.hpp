/// \file
/// `gdr::registration_cache`: reuse expensive memory registrations (verbs
/// `ibv_reg_mr` costs tens of microseconds and pins pages) across operations
/// on the same buffers.
///
/// `acquire(addr, len)` returns a *lease* on a registration that covers the
/// range: an existing one (a hit) or a new one made through the backend (a
/// miss). While a lease lives, its registration is never deregistered; when
/// the last lease goes, the entry stays cached, idle, until it is evicted or
/// invalidated.
///
/// \code
///   gdr::registration_cache cache(my_verbs_backend{pd}, {.max_entries = 256});
///   auto lease = cache.acquire(buf.data(), buf.size_bytes()).value();
///   post_rdma_write(lease.handle()->lkey, ...);       // keep `lease` until the CQE
///   ...
///   cache.invalidate(buf.data(), buf.size_bytes());   // BEFORE free(buf)
///   free(buf);
/// \endcode
///
/// Policy
/// ======
/// * Ranges are widened to `alignment` (a page by default) before they are
///   registered, so neighbouring small buffers share a registration. Not for
///   a backend that registers exact ranges (`Backend::exact_ranges`, as
///   `registry_backend`, whose key gives a peer every byte of its
///   registration): there each range is registered as given, and only the
///   same range hits it, so a lease never exposes a byte beyond what was
///   acquired.
/// * No merging: a range that is only partly covered (by one entry, or by two
///   adjacent ones) gets a new registration of its own, which may overlap
///   existing ones. Overlapping registrations are legal for verbs and keep
///   every entry immutable, so a lease never changes under its holder.
/// * Bounded: at most `max_entries` registrations and `max_bytes` registered
///   bytes (leased and idle together). A miss that would exceed a bound
///   first deregisters idle entries, least recently used first; if every
///   entry is leased it fails with `errc::busy` (try again when leases are
///   released). A range larger than `max_bytes` on its own fails with
///   `errc::invalid_argument`.
///
/// Stale entries: the classic pitfall
/// ==================================
/// The cache knows addresses, not allocations. If memory is freed (or
/// `munmap`ped) and the same addresses are handed out again, a lookup hits the
/// old entry, whose registration pins the *old* pages: the NIC then reads and
/// writes memory the program no longer uses, silently. Nothing here can see a
/// `free`. So: **call `invalidate(addr, len)` for a range before freeing it**
/// (an allocator that owns its buffers can do this in its deallocate path).
/// Invalidation removes every entry overlapping the range at once: idle ones
/// are deregistered at once, leased ones when their last lease is released
/// (the memory must not be freed while an operation still uses it anyway).
/// UCX and Open MPI intercept `munmap`/`free` with memory hooks to do this for
/// the user; gdr does not patch the allocator, and says so here.
///
/// A backend whose registrations peers reach while they are served
/// (`registry_backend`: a peer's put into the memory runs while the owner's
/// transport holds an `access_lease`) also needs the wait before the free:
/// deregistering refuses new accesses but cannot wait for those being
/// served. Such a backend offers `retire`, and the cache then offers
/// `co_await invalidate_and_wait(addr, len)`, after which the memory may go.
/// A plain `invalidate` there does not wait; the registration it destroys
/// warns on stderr if an access is still being served.
///
/// Thread-safety: every member function may be called from any thread; one
/// mutex guards the cache, and backend calls are made while it is held (they
/// must not call back into the cache). A lease may be released on any thread.
#pragma once

#include <cassert>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>

namespace gdr {

/// What a registration cache registers through: `register_range` makes a
/// registration of `[addr, addr + len)` (verbs: `ibv_reg_mr`), `deregister`
/// releases one (`ibv_dereg_mr`). Both are `noexcept`; failure is a
/// `result` error, which `acquire` passes on.
template <class B>
concept registration_backend = requires(B& b, std::uintptr_t addr, std::size_t len, typename B::handle_type& h) {
  typename B::handle_type;
  requires std::movable<typename B::handle_type>;
  { b.register_range(addr, len) } noexcept -> std::same_as<result<typename B::handle_type>>;
  { b.deregister(h) } noexcept;
};

/// A backend that can wait for the uses of a registration to end:
/// `retire(h)` stops new uses of `h` at once (idempotent) and returns an
/// awaitable that completes when none is left (`registry_backend`: the
/// registration's `revoke()`). The cache then offers `invalidate_and_wait`.
template <class B>
concept retiring_backend = registration_backend<B> && requires(B& b, typename B::handle_type& h) { b.retire(h); };

namespace detail {
/// `Backend::exact_ranges` is true: the backend registers ranges as given
/// (see "Policy" in registration_cache.hpp).
template <class B>
inline constexpr bool exact_ranges_v = requires { requires B::exact_ranges; };
}  // namespace detail

/// Bounds and granularity of a registration cache.
struct registration_cache_options {
  /// Most registrations held at once (leased and idle).
  std::size_t max_entries = 1024;
  /// Most bytes registered at once (after widening to `alignment`).
  std::size_t max_bytes = std::numeric_limits<std::size_t>::max();
  /// Registered ranges start and end on multiples of this (a power of two; 1:
  /// exact). Ignored for a backend with `exact_ranges`: those are exact.
  std::size_t alignment = 4096;
};

/// Counters of a registration cache.
struct registration_cache_stats {
  std::uint64_t hits = 0;           ///< acquires served by an existing registration
  std::uint64_t misses = 0;         ///< acquires that registered (or tried to)
  std::uint64_t evictions = 0;      ///< idle entries deregistered to make room
  std::uint64_t invalidations = 0;  ///< entries removed by `invalidate`/`clear`
  std::uint64_t failures = 0;       ///< misses the backend refused, or `busy`
};

/// A cache of registrations keyed on address ranges. See the file comment
/// for the policy and for how users must invalidate freed memory.
template <registration_backend Backend>
class registration_cache {
 public:
  using handle_type = typename Backend::handle_type;

 private:
  struct entry {
    std::uintptr_t base;
    std::uintptr_t end;  // one past the last byte
    handle_type handle;
    std::size_t refs = 0;
    bool indexed = true;  // false once invalidated: no new hits, freed at the last release
    entry* lru_prev = nullptr;  // in the idle list while refs == 0 and indexed
    entry* lru_next = nullptr;
  };

 public:
  /// A held registration covering the acquired range. Move-only; releasing
  /// (destroying) it makes the entry idle again. The cache must outlive it.
  class lease {
   public:
    lease() noexcept = default;
    lease(lease&& o) noexcept : cache_(std::exchange(o.cache_, nullptr)), e_(std::exchange(o.e_, nullptr)) {}
    lease& operator=(lease&& o) noexcept {
      if (this != &o) {
        release();
        cache_ = std::exchange(o.cache_, nullptr);
        e_ = std::exchange(o.e_, nullptr);
      }
      return *this;
    }
    lease(const lease&) = delete;
    lease& operator=(const lease&) = delete;
    ~lease() { release(); }

    /// The backend's handle (verbs: the `ibv_mr*` with its lkey and rkey).
    const handle_type& handle() const noexcept { return e_->handle; }
    /// The registered range: widened to the cache's alignment, or exactly
    /// the acquired range for a backend with `exact_ranges`.
    std::uintptr_t base() const noexcept { return e_->base; }
    std::size_t length() const noexcept { return e_->end - e_->base; }
    /// Holds a registration (not moved from, not released).
    explicit operator bool() const noexcept { return e_ != nullptr; }

    /// Gives the registration back now. Idempotent.
    void release() noexcept {
      if (e_ != nullptr) std::exchange(cache_, nullptr)->release(std::exchange(e_, nullptr));
    }

   private:
    friend class registration_cache;
    lease(registration_cache* c, entry* e) noexcept : cache_(c), e_(e) {}
    registration_cache* cache_ = nullptr;
    entry* e_ = nullptr;
  };

  /// A cache registering through `backend`. `opts.alignment` must be a power
  /// of two (asserted).
  explicit registration_cache(Backend backend, registration_cache_options opts = {})
      : backend_(std::move(backend)), opts_(opts) {
    assert(opts_.alignment != 0 && (opts_.alignment & (opts_.alignment - 1)) == 0 &&
           "registration_cache: alignment must be a power of two");
  }
  registration_cache(const registration_cache&) = delete;
  registration_cache& operator=(const registration_cache&) = delete;

  /// Deregisters everything. Leases must all have been released and no
  /// `invalidate_and_wait` may be waiting (asserted).
  ~registration_cache() {
    std::lock_guard lock(mu_);
    assert(leased_ == 0 && "registration_cache destroyed while leases are held");
    assert(retiring_ == 0 && "registration_cache destroyed while invalidate_and_wait waits");
    for (auto& [range, e] : index_) destroy(e);
    index_.clear();
  }

  /// A lease on a registration covering `[addr, addr + len)`: a cached one
  /// or, on a miss, a new one (evicting idle entries if a bound requires).
  ///
  /// Errors: `errc::invalid_argument` (empty range, a range that wraps
  /// around the address space, or one larger than `max_bytes`),
  /// `errc::busy` (bounds reached and every entry leased),
  /// `std::errc::not_enough_memory` (no memory for the cache's own entry: the
  /// new registration is undone), or the backend's error. Nothing is cached
  /// on failure.
  result<lease> acquire(const void* addr, std::size_t len) noexcept {
    const auto lo = reinterpret_cast<std::uintptr_t>(addr);
    if (len == 0 || len > std::numeric_limits<std::uintptr_t>::max() - lo) return errc::invalid_argument;
    const std::uintptr_t hi = lo + len;
    std::lock_guard lock(mu_);
    if (entry* e = find_hit(lo, hi)) {
      ++stats_.hits;
      return take(e);
    }
    ++stats_.misses;
    const std::uintptr_t mask = exact_ ? 0 : opts_.alignment - 1;
    const std::uintptr_t base = lo & ~mask;
    // Round the end up, unless that would wrap (the last page of the space).
    const std::uintptr_t end = hi > std::numeric_limits<std::uintptr_t>::max() - mask ? hi : (hi + mask) & ~mask;
    const std::size_t bytes = end - base;
    if (bytes > opts_.max_bytes) {
      ++stats_.failures;
      return errc::invalid_argument;
    }
    while (index_.size() + zombies_ + retiring_ >= opts_.max_entries || bytes > opts_.max_bytes - bytes_) {
      if (lru_tail_ == nullptr) {
        ++stats_.failures;
        return errc::busy;
      }
      ++stats_.evictions;
      remove(lru_tail_);
    }
    result<handle_type> h = backend_.register_range(base, bytes);
    if (!h) {
      ++stats_.failures;
      return h.error();
    }
    auto* e = new (std::nothrow) entry{base, end, std::move(*h)};
    if (e == nullptr) {
      backend_.deregister(*h);
      ++stats_.failures;
      return make_error_code(std::errc::not_enough_memory);
    }
    try {
      index_.emplace(std::pair{base, end}, e);
    } catch (...) {  // std::bad_alloc for the map's node
      backend_.deregister(e->handle);
      delete e;
      ++stats_.failures;
      return make_error_code(std::errc::not_enough_memory);
    }
    bytes_ += bytes;
    if (bytes > max_len_) max_len_ = bytes;
    return take(e);
  }

  /// `acquire` for the bytes of a local view.
  template <class T, class S>
  result<lease> acquire(view<T, S> v) noexcept {
    static_assert(local_memory_space<S>, "gdr::registration_cache: only local memory can be registered");
    return acquire(static_cast<const void*>(v.data()), v.size_bytes());
  }

  /// Removes every entry overlapping `[addr, addr + len)`: later acquires of
  /// those addresses register anew. Call it before freeing memory (see the
  /// file comment). Idle entries are deregistered now, leased ones when
  /// released. Returns how many entries were removed. Allocates nothing.
  std::size_t invalidate(const void* addr, std::size_t len) noexcept {
    const auto lo = reinterpret_cast<std::uintptr_t>(addr);
    const std::uintptr_t hi = len > std::numeric_limits<std::uintptr_t>::max() - lo
                                  ? std::numeric_limits<std::uintptr_t>::max()
                                  : lo + len;
    if (hi == lo) return 0;
    std::lock_guard lock(mu_);
    std::size_t removed = 0;
    // Entries starting more than max_len_ below `lo` end before it.
    auto it = index_.lower_bound({lo > max_len_ ? lo - max_len_ : 0, 0});
    while (it != index_.end() && it->first.first < hi) {
      entry* e = it->second;
      const bool overlaps = it->first.second > lo;
      ++it;  // before remove() erases e's node (no other iterator is invalidated)
      if (overlaps) {
        remove(e);
        ++removed;
      }
    }
    stats_.invalidations += removed;
    return removed;
  }

  /// `invalidate(addr, len)` for a backend that can wait for the uses of
  /// its registrations (`retiring_backend`: `registry_backend`, whose
  /// registrations peers reach while they are served): removes every entry
  /// overlapping the range, stops new uses of them at once, and completes
  /// when no use of any is left; only then may the memory be freed.
  ///
  /// Returns how many entries were removed; `errc::busy`, removing nothing,
  /// while a lease on one of them is held (release it first: the memory
  /// cannot go under it anyway). Await it inside a scheduler's loop (the
  /// backend's wait resumes there); the cache must outlive the wait. Throws
  /// `std::bad_alloc` when its frame cannot be allocated.
  ///
  /// \code
  ///   co_await cache.invalidate_and_wait(buf.data(), buf.size_bytes());
  ///   free(buf);   // no peer's access to it is being served
  /// \endcode
  task<result<std::size_t>> invalidate_and_wait(const void* addr, std::size_t len)
    requires retiring_backend<Backend>
  {
    entry* retiring = nullptr;  // taken out of the index, chained through lru_next
    std::size_t removed = 0;
    {
      const auto lo = reinterpret_cast<std::uintptr_t>(addr);
      const std::uintptr_t hi = len > std::numeric_limits<std::uintptr_t>::max() - lo
                                    ? std::numeric_limits<std::uintptr_t>::max()
                                    : lo + len;
      std::lock_guard lock(mu_);
      const auto first = index_.lower_bound({lo > max_len_ ? lo - max_len_ : 0, 0});
      for (auto it = first; it != index_.end() && it->first.first < hi; ++it)
        if (it->first.second > lo && it->second->refs != 0) co_return errc::busy;
      for (auto it = first; it != index_.end() && it->first.first < hi;) {
        entry* e = it->second;
        if (it->first.second <= lo) {
          ++it;
          continue;
        }
        it = index_.erase(it);
        e->indexed = false;
        lru_unlink(e);  // idle: it was on the idle list
        e->lru_next = retiring;
        retiring = e;
        ++retiring_;
        ++removed;
      }
      stats_.invalidations += removed;
    }
    // Every use is stopped first, then each wait: an entry waited for later
    // serves no new use meanwhile. Outside the lock: no one else reaches
    // these entries any more (not indexed, not leased).
    for (entry* e = retiring; e != nullptr; e = e->lru_next) (void)backend_.retire(e->handle);
    for (entry* e = retiring; e != nullptr; e = e->lru_next) co_await backend_.retire(e->handle);
    std::lock_guard lock(mu_);
    while (entry* e = retiring) {
      retiring = e->lru_next;
      --retiring_;
      destroy(e);
    }
    co_return removed;
  }

  /// Invalidates every entry. Allocates nothing.
  void clear() noexcept {
    std::lock_guard lock(mu_);
    std::size_t removed = 0;
    for (auto it = index_.begin(); it != index_.end(); ++removed) remove((it++)->second);
    stats_.invalidations += removed;
  }

  /// Registrations held now (cached, invalidated but leased, and being
  /// retired by `invalidate_and_wait`).
  std::size_t size() const noexcept {
    std::lock_guard lock(mu_);
    return index_.size() + zombies_ + retiring_;
  }
  /// Bytes registered now.
  std::size_t registered_bytes() const noexcept {
    std::lock_guard lock(mu_);
    return bytes_;
  }
  /// A copy of the counters.
  registration_cache_stats stats() const noexcept {
    std::lock_guard lock(mu_);
    return stats_;
  }
  /// The backend (for its own counters or settings).
  Backend& backend() noexcept { return backend_; }

 private:
  static constexpr bool exact_ = detail::exact_ranges_v<Backend>;

  // ---- all under mu_ ----

  // The entry a lease on [lo, hi) may use: one covering it, or for exact
  // ranges, one of exactly it.
  entry* find_hit(std::uintptr_t lo, std::uintptr_t hi) noexcept {
    if constexpr (exact_) {
      auto it = index_.find({lo, hi});
      return it != index_.end() ? it->second : nullptr;
    } else {
      return find_covering(lo, hi);
    }
  }

  entry* find_covering(std::uintptr_t lo, std::uintptr_t hi) noexcept {
    // Candidates start at or below `lo`; walk down from the last of them.
    // An entry starting below hi - max_len_ cannot reach `hi`.
    auto it = index_.upper_bound({lo, std::numeric_limits<std::uintptr_t>::max()});
    const std::uintptr_t floor = hi > max_len_ ? hi - max_len_ : 0;
    while (it != index_.begin()) {
      --it;
      if (it->first.first < floor) break;
      if (it->first.second >= hi) return it->second;
    }
    return nullptr;
  }

  lease take(entry* e) noexcept {
    if (e->refs++ == 0) lru_unlink(e);
    ++leased_;
    return lease(this, e);
  }

  void release(entry* e) noexcept {
    std::lock_guard lock(mu_);
    --leased_;
    if (--e->refs != 0) return;
    if (e->indexed) {
      lru_push_front(e);
    } else {
      --zombies_;
      destroy(e);
    }
  }

  /// Takes `e` out of the index (and the idle list); deregisters it now if
  /// idle, else at its last release.
  void remove(entry* e) noexcept {
    index_.erase({e->base, e->end});
    e->indexed = false;
    if (e->refs == 0) {
      lru_unlink(e);
      destroy(e);
    } else {
      ++zombies_;
    }
  }

  void destroy(entry* e) noexcept {
    backend_.deregister(e->handle);
    bytes_ -= e->end - e->base;
    delete e;
  }

  // The idle list: most recently released at the front, evicted from the tail.
  void lru_push_front(entry* e) noexcept {
    e->lru_prev = nullptr;
    e->lru_next = lru_head_;
    (lru_head_ ? lru_head_->lru_prev : lru_tail_) = e;
    lru_head_ = e;
  }
  void lru_unlink(entry* e) noexcept {
    if (e->lru_prev == nullptr && e->lru_next == nullptr && lru_head_ != e) return;  // not linked
    (e->lru_prev ? e->lru_prev->lru_next : lru_head_) = e->lru_next;
    (e->lru_next ? e->lru_next->lru_prev : lru_tail_) = e->lru_prev;
    e->lru_prev = e->lru_next = nullptr;
  }

  Backend backend_;
  registration_cache_options opts_;
  mutable std::mutex mu_;
  std::map<std::pair<std::uintptr_t, std::uintptr_t>, entry*> index_;  // by (base, end)
  entry* lru_head_ = nullptr;
  entry* lru_tail_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t max_len_ = 0;  // longest entry ever indexed: bounds the backward scans
  std::size_t leased_ = 0;
  std::size_t zombies_ = 0;  // invalidated entries still leased
  std::size_t retiring_ = 0;  // entries invalidate_and_wait waits for
  registration_cache_stats stats_{};
};

/// A backend that registers ranges in a `memory_registry` (for transports
/// whose "registration" is a gdr key, such as loopback and TCP; a verbs
/// backend registers with `ibv_reg_mr` instead). Handles are
/// `registration<std::byte, S>`: `handle().describe(rank)` is what a peer
/// needs, and it reaches exactly the acquired range (`exact_ranges`) with
/// exactly the access given here. Free memory after
/// `co_await cache.invalidate_and_wait(...)`, which waits for the peers'
/// accesses being served (`retire`).
template <class S = Host>
class registry_backend {
 public:
  using handle_type = registration<std::byte, S>;
  /// A key gives a peer every byte of its registration: never widen one.
  static constexpr bool exact_ranges = true;

  /// Registrations in `reg` that allow peers `a`, and nothing more (a cache
  /// per access, as verbs keeps one per set of access flags).
  registry_backend(memory_registry& reg, access a) noexcept : reg_(&reg), access_(a) {}

  result<handle_type> register_range(std::uintptr_t addr, std::size_t len) noexcept {
    try {
      return reg_->register_memory(view<std::byte, S>(reinterpret_cast<std::byte*>(addr), len), access_);
    } catch (const error& e) {
      return e.code();
    } catch (...) {
      return make_error_code(std::errc::not_enough_memory);
    }
  }
  /// Revokes now; the handle's destruction warns if an access is still
  /// being served (`retire` waits for them instead).
  void deregister(handle_type& h) noexcept { h.revoke(); }
  /// Revokes now (idempotent); `co_await` the result to wait until no
  /// access to the registration is being served.
  revoke_awaitable retire(handle_type& h) noexcept { return h.revoke(); }

 private:
  memory_registry* reg_;
  access access_;
};

}  // namespace gdr
