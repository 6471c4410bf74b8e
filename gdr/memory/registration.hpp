/// \file
/// Registered memory: what a peer may reach with one-sided `put`/`get`.
///
/// `register_memory(registry, view)` records a range of this process's memory
/// under a fresh random key and returns a move-only `registration` handle.
/// `registration::describe(rank)` gives the `remote_view` to send to a peer;
/// the peer names it in `ep.put(local, remote)` / `ep.get(local, remote)`. On
/// every incoming access the owner calls `memory_registry::resolve`: the bytes
/// must lie entirely inside one live registration with the right key and
/// permission, or the access fails with `errc::remote_access` and nothing is
/// read or written. Destroying (or `revoke()`-ing) the handle revokes the key
/// at once; keys are never reused within a registry.
///
/// The registry remembers whether the host may dereference the memory. The
/// host-side transports (loopback, TCP) move a put or get with the CPU, so
/// `resolve` refuses a registration of memory it cannot touch (`Device`):
/// a peer's put into GPU memory over TCP fails with `errc::remote_access`
/// instead of a CPU store to a device address.
///
/// Thread-safety: a registry may be used from any thread (registration is
/// rare, resolution frequent: a shared mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <utility>

#include <sys/random.h>

#include <gdr/error.hpp>
#include <gdr/memory/access.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>

namespace gdr {

/// What a peer may do with a registration.
enum class access : unsigned {
  read = 1,        ///< the peer may `get` from it
  write = 2,       ///< the peer may `put` into it
  read_write = 3,
};

constexpr bool allows(access granted, access wanted) noexcept {
  return (static_cast<unsigned>(granted) & static_cast<unsigned>(wanted)) == static_cast<unsigned>(wanted);
}

class memory_registry;

/// A live registration of `view<T, S>`; revokes itself when destroyed.
template <class T, class S>
class registration {
 public:
  registration() noexcept = default;
  registration(registration&& o) noexcept
      : reg_(std::exchange(o.reg_, nullptr)), view_(o.view_), key_(o.key_) {}
  registration& operator=(registration&& o) noexcept {
    if (this != &o) {
      revoke();
      reg_ = std::exchange(o.reg_, nullptr);
      view_ = o.view_;
      key_ = o.key_;
    }
    return *this;
  }
  registration(const registration&) = delete;
  registration& operator=(const registration&) = delete;
  ~registration() { revoke(); }

  /// The registered memory.
  view<T, S> local() const noexcept { return view_; }
  /// The access key a peer must present.
  std::uint64_t key() const noexcept { return key_; }
  /// Still registered.
  bool live() const noexcept { return reg_ != nullptr; }

  /// What a peer needs to reach this memory: send it in a message.
  /// `owner_rank` is this process's rank, as the bootstrap numbers peers.
  remote_view<std::remove_const_t<T>, S> describe(std::uint32_t owner_rank = 0) const noexcept {
    return {reinterpret_cast<std::uintptr_t>(view_.data()), view_.size(), key_, owner_rank};
  }

  /// Revokes the key now: later accesses fail with `errc::remote_access`.
  /// Accesses already being served finish (they resolved before).
  void revoke() noexcept;

 private:
  friend class memory_registry;
  registration(memory_registry* r, view<T, S> v, std::uint64_t key) noexcept : reg_(r), view_(v), key_(key) {}
  memory_registry* reg_ = nullptr;
  view<T, S> view_{};
  std::uint64_t key_ = 0;
};

/// TEMPORARY (replaced by the registry's leases): an access being served.
class access_lease {
 public:
  access_lease() noexcept = default;
  explicit access_lease(std::byte* p, std::size_t n) noexcept : p_(p), n_(n) {}
  access_lease(access_lease&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
  access_lease& operator=(access_lease&& o) noexcept {
    p_ = std::exchange(o.p_, nullptr);
    n_ = o.n_;
    return *this;
  }
  std::byte* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  void release() noexcept { p_ = nullptr; }

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

/// The table of this process's registrations, consulted on every remote
/// access. Transports take one (by reference) at construction;
/// `default_registry()` is the process-wide one.
class memory_registry {
 public:
  memory_registry() = default;
  memory_registry(const memory_registry&) = delete;
  memory_registry& operator=(const memory_registry&) = delete;

  /// Registers `v` for remote access `a`. Zero-length views are rejected
  /// (`errc::invalid_argument`).
  template <class T, class S>
  registration<T, S> register_memory(view<T, S> v, access a = access::read_write) {
    static_assert(local_memory_space<S>, "gdr::register_memory: only local memory can be registered");
    if (v.data() == nullptr || v.size_bytes() == 0)
      throw error(errc::invalid_argument, "gdr::register_memory: empty view");
    std::unique_lock lock(mu_);
    std::uint64_t key;
    do {
      // 64 bits from the kernel's CSPRNG: a peer cannot predict a key from the
      // ones it has seen; a live key never repeats.
      if (::getrandom(&key, sizeof key, 0) != static_cast<ssize_t>(sizeof key))
        throw error(errno_code(errno), "gdr::register_memory: getrandom");
    } while (key == 0 || by_key_.contains(key));
    by_key_.emplace(key, entry{reinterpret_cast<std::uintptr_t>(v.data()), v.size_bytes(), a,
                               space_traits<S>::host_accessible});
    return registration<T, S>(this, v, key);
  }

  /// The owner's check of a remote access that the CPU will carry out:
  /// `[addr, addr + len)` must lie inside the live registration `key`, which
  /// must allow `a` and be memory the host may dereference. Returns the local
  /// address, or `errc::remote_access`.
  result<std::byte*> resolve(std::uint64_t addr, std::size_t len, std::uint64_t key, access a) const noexcept {
    std::shared_lock lock(mu_);
    auto it = by_key_.find(key);
    if (it == by_key_.end()) return errc::remote_access;
    const entry& e = it->second;
    // Overflow-safe containment: addr >= base && len <= size && addr - base <= size - len.
    if (addr < e.base || len > e.bytes || addr - e.base > e.bytes - len) return errc::remote_access;
    if (!allows(e.perm, a)) return errc::remote_access;
    if (!e.host_accessible) return errc::remote_access;
    return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(addr));
  }

  /// TEMPORARY: resolve as a lease.
  result<access_lease> acquire(std::uint64_t addr, std::size_t len, std::uint64_t key, access a) noexcept {
    result<std::byte*> r = resolve(addr, len, key, a);
    if (!r) return r.error();
    return access_lease(*r, len);
  }

  /// Live registrations.
  std::size_t size() const noexcept {
    std::shared_lock lock(mu_);
    return by_key_.size();
  }

  void revoke(std::uint64_t key) noexcept {
    std::unique_lock lock(mu_);
    by_key_.erase(key);
  }

 private:
  struct entry {
    std::uintptr_t base;
    std::size_t bytes;
    access perm;
    bool host_accessible;  // space_traits<S>::host_accessible of the registered view
  };
  mutable std::shared_mutex mu_;
  std::map<std::uint64_t, entry> by_key_;
};

template <class T, class S>
void registration<T, S>::revoke() noexcept {
  if (reg_ != nullptr) std::exchange(reg_, nullptr)->revoke(key_);
}

/// The process-wide registry that endpoints use unless given another.
inline memory_registry& default_registry() {
  static memory_registry r;
  return r;
}

/// Registers `v` in `reg` (see `memory_registry::register_memory`).
template <class T, class S>
registration<T, S> register_memory(memory_registry& reg, view<T, S> v, access a = access::read_write) {
  return reg.register_memory(v, a);
}

/// Registers `v` in the process-wide registry.
template <class T, class S>
registration<T, S> register_memory(view<T, S> v, access a = access::read_write) {
  return default_registry().register_memory(v, a);
}

}  // namespace gdr
