/// \file
/// Registered memory: what a peer may reach with one-sided `put`/`get`.
///
/// `register_memory(registry, view)` records a range of this process's memory
/// under a fresh random key and returns a move-only `registration` handle.
/// `registration::describe(rank)` gives the `remote_view` to send to a peer;
/// the peer names it in `ep.put(local, remote)` / `ep.get(local, remote)`. On
/// every incoming access the owner calls `memory_registry::acquire`: the bytes
/// must lie entirely inside one live registration with the right key and
/// permission, or the access fails with `errc::remote_access` and nothing is
/// read or written. Keys are never reused within a registry.
///
/// Revocation and accesses in flight
/// =================================
/// Serving an access can take several steps (TCP reads a put's payload over
/// several `recv`s; a verbs NIC DMAs until its completion). `acquire` returns
/// an `access_lease` that the server holds for all of them; the registry
/// counts the leases of each registration. `revoke()` refuses new accesses
/// at once and returns an awaitable that completes when no lease is left:
///
/// \code
///   auto reg = gdr::register_memory(registry, gdr::host_view(buf));
///   send_to_peer(reg.describe(my_rank));
///   ...
///   co_await reg.revoke();   // no access to buf is being served any more
///   buf.clear();             // now it may be freed
/// \endcode
///
/// `reg.revoke();` as a plain statement still revokes (revocation happens in
/// the call; the awaitable only waits), as does destroying the handle; the
/// memory must then stay allocated until the leases are gone, which only the
/// awaitable tells. Destroying a handle while leases are out does not block
/// the thread: it prints a one-line warning to stderr, because freeing the
/// memory next would let an access being served write freed memory. It warns
/// whether or not `revoke()` was called first: only a wait that is over (an
/// awaited `revoke()`) tells that no lease is left. This is
/// the model that verbs deregistration (`ibv_dereg_mr` only after the work
/// requests that use the MR complete) and CUDA IPC unmapping need.
///
/// NIC exposure. A registry attached to an RDMA protection domain (the verbs
/// transport attaches the one its endpoint uses) also registers each
/// registration with that NIC (`ibv_reg_mr`: remote read, write and atomics
/// as `access` allows), and `describe()` adds the NIC key to the view. A
/// verbs peer then puts, gets and adds with RDMA WRITE, READ and atomics
/// that the owner's NIC checks (range, rights) and its CPU never sees; no
/// lease is taken for them. `revoke()` deregisters at once, and the NIC
/// refuses every later access (the peer's operation fails with
/// `errc::remote_access`). `exposure::checked` keeps a registration off
/// the NICs, and off CUDA IPC (a shared-memory peer's get of `Device`
/// memory would otherwise map the owner's whole allocation): every access
/// is then served, and checked, by the owner's loop.
///
/// The registry remembers whether the host may dereference the memory. The
/// host-side transports (loopback, TCP) move a put or get with the CPU, so
/// `acquire` refuses a registration of memory it cannot touch (`Device`):
/// a peer's put into GPU memory over TCP fails with `errc::remote_access`
/// instead of a CPU store to a device address.
///
/// Thread-safety: a registry may be used from any thread (registration is
/// rare, acquisition frequent: a shared mutex for the table, an atomic count
/// per registration). A lease may be released on any thread; the awaitable
/// resumes its coroutine on the scheduler it was awaited on.
#pragma once

#include <algorithm>
#include <atomic>
#include <cassert>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>
#include <shared_mutex>
#include <utility>

#include <sys/random.h>

#include <gdr/error.hpp>
#include <gdr/log.hpp>
#include <gdr/memory/access.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>
#include <gdr/sched/operation.hpp>
#include <gdr/sched/scheduler.hpp>

namespace gdr {

/// What a peer may do with a registration.
enum class access : unsigned {
  read = 1,        ///< the peer may `get` from it
  write = 2,       ///< the peer may `put` into it
  read_write = 3,
};

/// `granted` includes every permission in `wanted`.
constexpr bool allows(access granted, access wanted) noexcept {
  return (static_cast<unsigned>(granted) & static_cast<unsigned>(wanted)) == static_cast<unsigned>(wanted);
}

class memory_registry;
class revoke_awaitable;

/// How a registration may be reached.
enum class exposure : unsigned char {
  /// Through every NIC domain the registry is exposed in (RDMA WRITE, READ
  /// and atomics by a verbs peer's NIC, no action by the owner), and served
  /// by the owner's loop on every other transport; over shared memory with
  /// CUDA IPC, a served get of `Device` memory hands the peer the owner's
  /// allocation to copy from, which it may keep mapped (docs/GUIDE.md, the
  /// trust table). The default.
  nic,
  /// Only through the owner's loop, which checks every access (range, key,
  /// revoked) before its own NIC, GPU or CPU moves the bytes: the checked
  /// mode. No NIC key, and no CUDA IPC mapping: the owner copies a get's
  /// `Device` bytes out itself (staged).
  checked,
};

/// An RDMA protection domain that exposes registrations to peers' NICs (the
/// verbs transport's, one per device and scheduler). A registry exposed in
/// it (`memory_registry::attach`) registers every `exposure::nic`
/// registration with it and withdraws it on revocation; the keys go into
/// `describe()`'s view. Called under the registry's lock: never calls back
/// into the registry.
class nic_domain {
 public:
  /// A NIC registration: its handle (for `withdraw`) and its remote key.
  struct exposed {
    void* handle = nullptr;
    std::uint32_t rkey = 0;
  };
  /// The domain's id as peers know it (nonzero; views carry it with the key).
  virtual std::uint32_t domain_id() const noexcept = 0;
  /// Registers `[addr, addr + len)` for the remote access `a` (and remote
  /// atomics where `a` allows writing). `device`: a `Device` registration's
  /// GPU (-1: host memory); a domain that cannot reach it returns
  /// `errc::unsupported` and the registration is not exposed there.
  virtual result<exposed> expose(std::uintptr_t addr, std::size_t len, access a, int device) noexcept = 0;
  /// Deregisters: the NIC refuses every later access with the key.
  virtual void withdraw(void* handle) noexcept = 0;
  /// `reg`, which was attached, is being destroyed (its exposures are
  /// withdrawn already): the domain must not `detach` from it.
  virtual void registry_gone(memory_registry& reg) noexcept = 0;

 protected:
  ~nic_domain() = default;
};

namespace detail {

/// A registration's exposure in one NIC domain.
struct nic_exposure {
  nic_domain* domain = nullptr;
  void* handle = nullptr;
  std::uint64_t packed = 0;  // domain id << 32 | rkey
};

/// What the registry keeps per registration. Its address is stable: it lives
/// in a `std::map` node, which moves from the live table to the draining
/// table by node handle when revoked with leases out.
struct registration_record {
  registration_record(std::uintptr_t b, std::size_t n, access p, bool host, std::uint64_t k, int dev = -1) noexcept
      : base(b), bytes(n), perm(p), host_accessible(host), key(k), device(dev) {}
  registration_record(const registration_record&) = delete;
  registration_record& operator=(const registration_record&) = delete;

  std::uintptr_t base;
  std::size_t bytes;
  access perm;
  bool host_accessible;  // space_traits<S>::host_accessible of the registered view
  std::uint64_t key;
  int device;  // the GPU ordinal of a Device registration, else -1
  /// (leases << 1) | revoked. One word, so that exactly one party sees the
  /// moment "revoked and no lease left": `revoke`, if no lease was out, or
  /// else the release of the last lease. That party finishes the revocation.
  std::atomic<std::uint64_t> state{0};
  /// The coroutines awaiting the revocation (guarded by the registry's mutex).
  revoke_awaitable* waiters = nullptr;
  /// `exposure::nic` (set before the record is published, then read only),
  /// and where it is exposed (guarded by the registry's mutex).
  bool nic = true;
  std::vector<nic_exposure> exposures;
};

inline constexpr std::uint64_t revoked_bit = 1;
inline constexpr std::uint64_t one_lease = 2;

}  // namespace detail

/// An access to registered memory being served: while it lives, revoking the
/// registration waits. Move-only; destroying it or calling `release()` ends
/// the access. Made by `memory_registry::acquire`; the registry must outlive
/// it.
///
/// Thread-safety: one lease is used by one thread at a time; it may be
/// released on any thread (and leases of one registration concurrently).
class access_lease {
 public:
  /// A lease that holds nothing (what a moved-from lease is).
  access_lease() noexcept = default;
  access_lease(access_lease&& o) noexcept
      : reg_(std::exchange(o.reg_, nullptr)), rec_(std::exchange(o.rec_, nullptr)),
        data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), device_(o.device_),
        exposed_(o.exposed_) {}
  access_lease& operator=(access_lease&& o) noexcept {
    if (this != &o) {
      release();
      reg_ = std::exchange(o.reg_, nullptr);
      rec_ = std::exchange(o.rec_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      device_ = o.device_;
      exposed_ = o.exposed_;
    }
    return *this;
  }
  access_lease(const access_lease&) = delete;
  access_lease& operator=(const access_lease&) = delete;
  ~access_lease() { release(); }

  /// The local address of the first byte of the access.
  std::byte* data() const noexcept { return data_; }
  /// The bytes of the access (the length `acquire` checked).
  std::size_t size() const noexcept { return size_; }
  /// The memory is a `Device` registration on GPU `device()` (the host must
  /// not touch it: a transport stages it through its copy engine).
  bool on_device() const noexcept { return device_ >= 0; }
  int device() const noexcept { return device_; }
  /// The registration is `exposure::nic`: a transport may hand the peer the
  /// memory itself (a CUDA IPC mapping of a get's answer); false
  /// (`exposure::checked`): only this side's own copies may touch it.
  bool exposed() const noexcept { return exposed_; }
  /// Holds an access (not moved from, not released).
  explicit operator bool() const noexcept { return rec_ != nullptr; }

  /// Ends the access now: the memory is no longer touched through this
  /// lease. If it was the last lease of a revoked registration, the
  /// coroutines awaiting that revocation are posted to their schedulers.
  /// Idempotent.
  void release() noexcept;

 private:
  friend class memory_registry;
  access_lease(memory_registry* reg, detail::registration_record* rec, std::byte* data, std::size_t size,
               int device, bool exposed) noexcept
      : reg_(reg), rec_(rec), data_(data), size_(size), device_(device), exposed_(exposed) {}
  memory_registry* reg_ = nullptr;
  detail::registration_record* rec_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  int device_ = -1;
  bool exposed_ = false;
};

/// What `revoke()` returns: the revocation has happened (new accesses are
/// refused); `co_await` it to wait until no access to the memory is being
/// served. Discarding it is allowed (`reg.revoke();` revokes without
/// waiting). Neither copyable nor movable: a waiting coroutine is linked
/// into the registry through it.
///
/// Completion context: if no lease is left when awaited, it does not
/// suspend. Otherwise the coroutine resumes on the scheduler it was awaited
/// on (`scheduler::current()`, asserted), posted there by whichever thread
/// released the last lease; no thread waits. Not cancellable: the wait is as
/// long as the accesses being served, which their transports bound (a lost
/// connection fails and releases them).
class revoke_awaitable : private remote_work {
 public:
  /// Nothing to wait for.
  revoke_awaitable() noexcept = default;
  revoke_awaitable(const revoke_awaitable&) = delete;
  revoke_awaitable& operator=(const revoke_awaitable&) = delete;
  /// Unlinks a coroutine still waiting (only when its frame is destroyed
  /// while suspended here).
  ~revoke_awaitable();

  /// No lease was out when the revocation happened (so the wait is over).
  /// A `false` may be stale: `await_suspend` looks again under the lock.
  bool await_ready() const noexcept { return reg_ == nullptr; }
  bool await_suspend(std::coroutine_handle<> h) noexcept;
  void await_resume() const noexcept {}

 private:
  friend class memory_registry;
  revoke_awaitable(memory_registry* reg, std::uint64_t key) noexcept : reg_(reg), key_(key) {}
  memory_registry* reg_ = nullptr;  // null: nothing to wait for
  std::uint64_t key_ = 0;
  scheduler* sched_ = nullptr;
  std::coroutine_handle<> h_{};
  revoke_awaitable* next_waiter_ = nullptr;  // the record's list, under the registry's mutex
  bool linked_ = false;                      // in that list (under the registry's mutex)
};

/// A live registration of `view<T, S>`; revokes itself when destroyed.
template <class T, class S>
class registration {
 public:
  registration() noexcept = default;
  registration(registration&& o) noexcept
      : reg_(std::exchange(o.reg_, nullptr)), view_(o.view_), key_(o.key_), live_(std::exchange(o.live_, false)),
        exposure_(o.exposure_) {}
  registration& operator=(registration&& o) noexcept {
    if (this != &o) {
      revoke_on_drop();
      reg_ = std::exchange(o.reg_, nullptr);
      view_ = o.view_;
      key_ = o.key_;
      live_ = std::exchange(o.live_, false);
      exposure_ = o.exposure_;
    }
    return *this;
  }
  registration(const registration&) = delete;
  registration& operator=(const registration&) = delete;
  /// Revokes the key if `revoke()` has not. Does not wait: if an access is
  /// still being served (also after a `revoke()` not awaited to its end),
  /// warns on stderr (see the file comment); `co_await revoke()` first.
  ~registration() { revoke_on_drop(); }

  /// The registered memory.
  view<T, S> local() const noexcept { return view_; }
  /// The access key a peer must present.
  std::uint64_t key() const noexcept { return key_; }
  /// Registered and not revoked.
  bool live() const noexcept { return live_; }

  /// What a peer needs to reach this memory: send it in a message.
  /// `owner_rank` is this process's rank, as the bootstrap numbers peers.
  /// It carries the NIC keys of the registration's exposures (none once
  /// revoked, or made `exposure::checked`), and says whether it was made
  /// `exposure::checked` (`remote_view::owner_checked`).
  remote_view<std::remove_const_t<T>, S> describe(std::uint32_t owner_rank = 0) const noexcept;

  /// Revokes the key now: later accesses fail with `errc::remote_access`.
  /// Accesses being served go on; `co_await` the result to wait until none
  /// is left, before freeing the memory. Calling it again (or on the
  /// registry, `revoke(key())`) gives another awaitable for the same wait.
  revoke_awaitable revoke() noexcept;

 private:
  friend class memory_registry;
  registration(memory_registry* r, view<T, S> v, std::uint64_t key, exposure e) noexcept
      : reg_(r), view_(v), key_(key), live_(true), exposure_(e) {}
  void revoke_on_drop() noexcept;

  memory_registry* reg_ = nullptr;  // kept after revoke(): a later revoke() waits too
  view<T, S> view_{};
  std::uint64_t key_ = 0;
  bool live_ = false;
  exposure exposure_ = exposure::nic;
};

/// The table of this process's registrations, consulted on every remote
/// access. Transports take one (by reference) at construction;
/// `default_registry()` is the process-wide one. It must outlive its
/// registrations, leases and revoke awaitables.
class memory_registry {
 public:
  memory_registry() = default;
  memory_registry(const memory_registry&) = delete;
  memory_registry& operator=(const memory_registry&) = delete;
  /// Leases still out would point into it: a bug (asserted).
  ~memory_registry() {
    assert(draining_.empty() && no_leases() && "gdr::memory_registry destroyed while accesses hold leases");
    for (auto& [k, r] : live_) withdraw_all(r);
    for (nic_domain* d : domains_) d->registry_gone(*this);
  }

  /// Registers `v` for remote access `a`. Zero-length views are rejected
  /// (`errc::invalid_argument`).
  template <class T, class S>
  registration<T, S> register_memory(view<T, S> v, access a = access::read_write, exposure e = exposure::nic) {
    static_assert(local_memory_space<S>, "gdr::register_memory: only local memory can be registered");
    if (v.data() == nullptr || v.size_bytes() == 0)
      throw error(errc::invalid_argument, "gdr::register_memory: empty view");
    std::unique_lock lock(mu_);
    std::uint64_t key;
    do {
      // 64 bits from the kernel's CSPRNG: a peer cannot predict a key from the
      // ones it has seen; a key still live or draining never repeats.
      if (::getrandom(&key, sizeof key, 0) != static_cast<ssize_t>(sizeof key))
        throw error(errno_code(errno), "gdr::register_memory: getrandom");
    } while (key == 0 || live_.contains(key) || draining_.contains(key));
    auto [it, fresh] = live_.try_emplace(key, reinterpret_cast<std::uintptr_t>(v.data()), v.size_bytes(), a,
                                         space_traits<S>::host_accessible, key,
                                         space_traits<S>::on_device ? v.device() : -1);
    it->second.nic = e == exposure::nic;
    if (std::error_code ec = expose_all(it->second)) {
      withdraw_all(it->second);
      live_.erase(it);
      throw error(ec, "gdr::register_memory: the NIC refused to register the memory for peers' direct access "
                      "(ibv_reg_mr; a low RLIMIT_MEMLOCK is the usual cause). Raise the limit, or register it with "
                      "gdr::exposure::checked: every access is then served by this process's loop");
    }
    try {
      by_base_.emplace(it->second.base, &it->second);
    } catch (...) {
      withdraw_all(it->second);
      live_.erase(it);
      throw;
    }
    return registration<T, S>(this, v, key, e);
  }

  /// Exposes the registry in NIC domain `d`: every `exposure::nic`
  /// registration, now and later, is registered with it (see `nic_domain`).
  /// A registration `d` cannot reach (GPU memory on a domain without
  /// GPUDirect) stays unexposed there. Idempotent. The domain must call
  /// `detach` before it goes.
  /// Attaching again exposes what is not yet exposed there (GPU memory, once
  /// the domain has learnt how to reach it).
  void attach(nic_domain& d) noexcept {
    std::unique_lock lock(mu_);
    if (std::find(domains_.begin(), domains_.end(), &d) == domains_.end()) {
      try {
        domains_.push_back(&d);
      } catch (...) {
        return;  // not exposed there: its views carry no key of it
      }
    }
    for (auto& [k, r] : live_) {
      if (!r.nic || std::any_of(r.exposures.begin(), r.exposures.end(),
                                [&](const detail::nic_exposure& x) { return x.domain == &d; }))
        continue;
      if (std::error_code ec = expose_in(r, d); ec && ec != make_error_code(errc::unsupported))
        gdr::detail::log("memory", "a registration of %zu bytes could not be exposed to a NIC: %s", r.bytes,
                         ec.message().c_str());
    }
  }
  /// Withdraws every registration from `d` and forgets it.
  void detach(nic_domain& d) noexcept {
    std::unique_lock lock(mu_);
    std::erase(domains_, &d);
    for (auto* table : {&live_, &draining_})
      for (auto& [k, r] : *table)
        std::erase_if(r.exposures, [&](detail::nic_exposure& x) {
          if (x.domain != &d) return false;
          d.withdraw(x.handle);
          return true;
        });
  }
  /// The handle (verbs: the `ibv_mr*`) of a live registration exposed in
  /// `d` that covers `[addr, addr + len)`, or null: this side's NIC may use
  /// it as the local memory of a direct operation instead of registering
  /// the range again.
  void* nic_handle(const void* addr, std::size_t len, const nic_domain& d) const noexcept {
    const auto a = reinterpret_cast<std::uintptr_t>(addr);
    std::shared_lock lock(mu_);
    auto it = by_base_.upper_bound(a);
    for (int n = 0; n < 16 && it != by_base_.begin(); ++n) {
      --it;
      const detail::registration_record& r = *it->second;
      if (len > r.bytes || a - r.base > r.bytes - len) continue;
      for (const detail::nic_exposure& x : r.exposures)
        if (x.domain == &d) return x.handle;
    }
    return nullptr;
  }

  /// The NIC keys of live registration `key` (zeros where none).
  std::array<std::uint64_t, 2> nic_keys(std::uint64_t key) const noexcept {
    std::array<std::uint64_t, 2> out{};
    std::shared_lock lock(mu_);
    auto it = live_.find(key);
    if (it == live_.end()) return out;
    for (std::size_t i = 0; i < out.size() && i < it->second.exposures.size(); ++i)
      out[i] = it->second.exposures[i].packed;
    return out;
  }

  /// The owner's check of a remote access that the CPU will carry out, and
  /// the start of serving it: `[addr, addr + len)` must lie inside the live
  /// registration `key`, which must allow `a` and be memory the host may
  /// dereference. Returns a lease on the bytes (hold it until the last byte
  /// is read or written), or `errc::remote_access`. `staged`: the caller
  /// can also serve `Device` memory (through a copy engine; the lease says
  /// `on_device()`) instead of refusing it.
  result<access_lease> acquire(std::uint64_t addr, std::size_t len, std::uint64_t key, access a,
                               bool staged = false) noexcept {
    std::shared_lock lock(mu_);
    detail::registration_record* r = find_checked(addr, len, key, a, staged);
    if (r == nullptr) return errc::remote_access;
    // Relaxed is enough: a revoke reads the count under the exclusive lock,
    // which orders it after this shared section; the release that ends the
    // lease is the acq_rel operation that publishes the access.
    r->state.fetch_add(detail::one_lease, std::memory_order_relaxed);
    return access_lease(this, r, reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(addr)), len, r->device,
                        r->nic);
  }

  /// `acquire`'s check without a lease. Deprecated for serving accesses
  /// that span several steps (a revocation does not wait for them; use
  /// `acquire`); kept until the transports switch.
  result<std::byte*> resolve(std::uint64_t addr, std::size_t len, std::uint64_t key, access a) const noexcept {
    std::shared_lock lock(mu_);
    if (find_checked(addr, len, key, a) == nullptr) return errc::remote_access;
    return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(addr));
  }

  /// Revokes `key` now: later accesses fail with `errc::remote_access`.
  /// `co_await` the result to wait until no lease of it is left. A key
  /// already revoked gives an awaitable for the same wait (ready if it is
  /// over); an unknown key one that is ready.
  revoke_awaitable revoke(std::uint64_t key) noexcept {
    std::unique_lock lock(mu_);
    auto it = live_.find(key);
    if (it == live_.end()) {
      if (draining_.contains(key)) return revoke_awaitable(this, key);
      return revoke_awaitable();
    }
    // The NICs refuse the keys from now on (a NIC access in flight ends
    // before deregistration returns).
    withdraw_all(it->second);
    for (auto b = by_base_.lower_bound(it->second.base); b != by_base_.end() && b->first == it->second.base; ++b) {
      if (b->second == &it->second) {
        by_base_.erase(b);
        break;
      }
    }
    // No acquire runs under the exclusive lock: from here the count only falls.
    const std::uint64_t old = it->second.state.fetch_or(detail::revoked_bit, std::memory_order_acq_rel);
    if ((old >> 1) == 0) {
      live_.erase(it);
      return revoke_awaitable();
    }
    // A node handle moves the record without copying it or allocating:
    // the leases keep pointing at it.
    draining_.insert(live_.extract(it));
    return revoke_awaitable(this, key);
  }

  /// Live registrations.
  std::size_t size() const noexcept {
    std::shared_lock lock(mu_);
    return live_.size();
  }

  /// Revoked registrations that still have leases out.
  std::size_t draining() const noexcept {
    std::shared_lock lock(mu_);
    return draining_.size();
  }

  /// The revoked registration `key` still has leases out: its revocation
  /// is not over (false for a key live or unknown).
  bool revocation_pending(std::uint64_t key) const noexcept {
    std::shared_lock lock(mu_);
    return draining_.contains(key);
  }

 private:
  friend class access_lease;
  friend class revoke_awaitable;

  // Under mu_ (shared or exclusive).
  detail::registration_record* find_checked(std::uint64_t addr, std::size_t len, std::uint64_t key, access a,
                                            bool staged = false) const noexcept {
    auto it = live_.find(key);
    if (it == live_.end()) return nullptr;
    const detail::registration_record& e = it->second;
    // Overflow-safe containment: addr >= base && len <= size && addr - base <= size - len.
    if (addr < e.base || len > e.bytes || addr - e.base > e.bytes - len) return nullptr;
    if (!allows(e.perm, a)) return nullptr;
    if (!e.host_accessible && !(staged && e.device >= 0)) return nullptr;
    return const_cast<detail::registration_record*>(&e);
  }

  // Under the exclusive lock.
  std::error_code expose_in(detail::registration_record& r, nic_domain& d) noexcept {
    result<nic_domain::exposed> x = d.expose(r.base, r.bytes, r.perm, r.device);
    if (!x) return x.error();
    try {
      r.exposures.push_back({&d, x->handle, static_cast<std::uint64_t>(d.domain_id()) << 32 | x->rkey});
    } catch (...) {
      d.withdraw(x->handle);
      return errno_code(ENOMEM);
    }
    return {};
  }
  std::error_code expose_all(detail::registration_record& r) noexcept {
    if (!r.nic) return {};
    for (nic_domain* d : domains_)
      if (std::error_code ec = expose_in(r, *d); ec && ec != make_error_code(errc::unsupported)) return ec;
    return {};
  }
  void withdraw_all(detail::registration_record& r) noexcept {
    for (detail::nic_exposure& x : r.exposures) x.domain->withdraw(x.handle);
    r.exposures.clear();
  }

  bool no_leases() const noexcept {
    for (const auto& [key, r] : live_)
      if ((r.state.load(std::memory_order_relaxed) >> 1) != 0) return false;
    return true;
  }

  void release(detail::registration_record* r) noexcept {
    // acq_rel: every lease holder's accesses to the memory happen before
    // the party that sees the count reach zero, hence before the waiters
    // resume (and free the memory).
    const std::uint64_t old = r->state.fetch_sub(detail::one_lease, std::memory_order_acq_rel);
    if (old == (detail::one_lease | detail::revoked_bit)) finish_revocation(r);
  }

  // The last lease of a revoked registration is gone: drop the record and
  // hand every waiter to its scheduler. The list is taken under the lock;
  // the posting happens after it, because a resumed coroutine may at once
  // call into this registry.
  void finish_revocation(detail::registration_record* r) noexcept;

  void unlink(revoke_awaitable* w) noexcept;

  mutable std::shared_mutex mu_;
  std::map<std::uint64_t, detail::registration_record> live_;
  std::map<std::uint64_t, detail::registration_record> draining_;  // revoked, leases out
  std::vector<nic_domain*> domains_;  // where exposure::nic registrations are exposed
  std::multimap<std::uintptr_t, detail::registration_record*> by_base_;  // live registrations by address
};

// ---------------------------------------------------------------- out of line

inline void access_lease::release() noexcept {
  if (rec_ != nullptr) {
    data_ = nullptr;
    size_ = 0;
    std::exchange(reg_, nullptr)->release(std::exchange(rec_, nullptr));
  }
}

inline void memory_registry::finish_revocation(detail::registration_record* r) noexcept {
  revoke_awaitable* w;
  {
    std::unique_lock lock(mu_);
    w = std::exchange(r->waiters, nullptr);
    for (revoke_awaitable* i = w; i != nullptr; i = i->next_waiter_) i->linked_ = false;
    draining_.erase(r->key);  // r is gone
  }
  while (w != nullptr) {
    // Read before posting: once posted, the coroutine may run and free `w`.
    revoke_awaitable* next = w->next_waiter_;
    if (w->sched_ != nullptr) {
      w->sched_->post(w);
    } else {
      w->h_.resume();  // awaited outside a scheduler (asserted in debug builds)
    }
    w = next;
  }
}

inline void memory_registry::unlink(revoke_awaitable* w) noexcept {
  std::unique_lock lock(mu_);
  if (!w->linked_) return;
  auto it = draining_.find(w->key_);
  if (it == draining_.end()) return;
  for (revoke_awaitable** p = &it->second.waiters; *p != nullptr; p = &(*p)->next_waiter_) {
    if (*p == w) {
      *p = w->next_waiter_;
      break;
    }
  }
  w->linked_ = false;
}

inline revoke_awaitable::~revoke_awaitable() {
  if (reg_ != nullptr && h_) reg_->unlink(this);
}

inline bool revoke_awaitable::await_suspend(std::coroutine_handle<> h) noexcept {
  assert(scheduler::current() != nullptr && "co_await revoke(): await it inside a gdr::scheduler's loop");
  std::unique_lock lock(reg_->mu_);
  auto it = reg_->draining_.find(key_);
  if (it == reg_->draining_.end()) return false;  // the last lease went meanwhile
  h_ = h;
  sched_ = scheduler::current();
  run = [](remote_work* self) noexcept { static_cast<revoke_awaitable*>(self)->h_.resume(); };
  next_waiter_ = std::exchange(it->second.waiters, this);
  linked_ = true;
  return true;
}

template <class T, class S>
remote_view<std::remove_const_t<T>, S> registration<T, S>::describe(std::uint32_t owner_rank) const noexcept {
  std::array<std::uint64_t, 2> nic{};
  if (reg_ != nullptr && live_) nic = reg_->nic_keys(key_);
  return {reinterpret_cast<std::uintptr_t>(view_.data()), view_.size(), key_, owner_rank, nic,
          exposure_ == exposure::checked};
}

template <class T, class S>
revoke_awaitable registration<T, S>::revoke() noexcept {
  if (reg_ == nullptr) return revoke_awaitable();
  live_ = false;
  return reg_->revoke(key_);
}

template <class T, class S>
void registration<T, S>::revoke_on_drop() noexcept {
  if (reg_ == nullptr) return;  // empty, or moved from
  bool served;
  if (live_) {
    live_ = false;
    served = !reg_->revoke(key_).await_ready();
  } else {
    // revoke() was called; if its wait is not over, freeing the memory
    // next is the same mistake. (Asking only, not revoking again: the key
    // is this handle's only while it was live.)
    served = reg_->revocation_pending(key_);
  }
  if (served) {
    // Destructors do not block, and this one cannot wait: say it once, here,
    // where the mistake starts.
    gdr::detail::log("memory",
                "a registration of %zu bytes at %p was destroyed while a peer's access to it is being "
                "served; keep the memory allocated until it ends: co_await reg.revoke() before freeing it",
                view_.size_bytes(), static_cast<const void*>(view_.data()));
  }
}

/// The process-wide registry that endpoints use unless given another.
inline memory_registry& default_registry() {
  static memory_registry r;
  return r;
}

/// Registers `v` in `reg` (see `memory_registry::register_memory`).
template <class T, class S>
registration<T, S> register_memory(memory_registry& reg, view<T, S> v, access a = access::read_write,
                                   exposure e = exposure::nic) {
  return reg.register_memory(v, a, e);
}

/// Registers `v` in the process-wide registry.
template <class T, class S>
registration<T, S> register_memory(view<T, S> v, access a = access::read_write, exposure e = exposure::nic) {
  return default_registry().register_memory(v, a, e);
}

/// Registers all of `b` (a `gdr::buffer`, or anything with a `view()`) in
/// the process-wide registry: `gdr::register_memory(buf)`.
template <class B>
  requires requires(B& b) { b.view(); }
auto register_memory(B& b, access a = access::read_write, exposure e = exposure::nic) {
  return default_registry().register_memory(b.view(), a, e);
}

/// Registers all of `b` in `reg`.
template <class B>
  requires requires(B& b) { b.view(); }
auto register_memory(memory_registry& reg, B& b, access a = access::read_write, exposure e = exposure::nic) {
  return reg.register_memory(b.view(), a, e);
}

}  // namespace gdr
