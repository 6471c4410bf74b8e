/// \file
/// `gdr::remote_view<T, S>`: a description of a peer's registered memory (in
/// space `S` on the peer): its address there, its length, the key that grants
/// access, and the peer it belongs to.
///
/// A remote view is data, not a pointer: it is never dereferenced or copied
/// locally (`operator[]`, `begin` and `end` fail to compile with a
/// message saying to use `ep.get`/`ep.put`; there is no span and no
/// `gdr::copy`). It travels in a message
/// (`to_wire`/`from_wire`, a fixed 64-byte little-endian record, versioned)
/// and is handed to `ep.put(local, remote)` / `ep.get(local, remote)`.
///
/// Two ways in. The registry key (`key()`) is checked by the owner's loop on
/// every access it serves: range, key, and whether the registration was
/// revoked (every transport). The NIC keys (`nic_keys()`, up to two:
/// one per RDMA protection domain the owner's registry is exposed in, as
/// UCX packs one rkey per transport) let a verbs peer's NIC reach the memory
/// with no action by the owner: an RDMA WRITE, READ or atomic that the
/// owner's NIC checks against the registration (range, rights, revoked).
/// A view of a registration made `exposure::checked` carries none, and
/// says so (`owner_checked()`): a transport that would otherwise hand the
/// peer the memory itself (CUDA IPC, which maps the owner's whole
/// allocation) has every access served by the owner instead.
///
/// Wire record (little-endian u64 words): address, bytes, registry key,
/// peer | space << 32, element size | version << 32, then (version 2) two
/// NIC keys as domain << 32 | rkey (0: none) and a zero word; version 3 is
/// version 2 with that last word holding flags (bit 0: owner-checked), and
/// `to_wire` writes it only for a view that has a flag, so a peer that
/// reads version 2 reads every other view. A version-1 record (40 bytes,
/// version 0: the format before NIC keys) still parses, without NIC keys;
/// any other version, or an unknown flag, is refused.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include <gdr/error.hpp>
#include <gdr/memory/space.hpp>

namespace gdr {

namespace detail {
template <class S>
constexpr std::uint32_t space_code() noexcept;
template <> constexpr std::uint32_t space_code<Host>() noexcept { return 1; }
template <> constexpr std::uint32_t space_code<Pinned>() noexcept { return 2; }
template <> constexpr std::uint32_t space_code<Device>() noexcept { return 3; }

template <class D>
inline constexpr bool remote_false_v = false;

inline void store_le64(std::byte* p, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
inline std::uint64_t load_le64(const std::byte* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}
}  // namespace detail

/// The diagnostic for touching a peer's memory locally.
#define GDR_REMOTE_ACCESS_ERROR_                                                                  \
  "gdr::remote_view<T, S>: a peer's memory cannot be dereferenced, iterated or pointed at in "   \
  "this process (its address is the peer's). Read it with co_await ep.get(local_view, remote) " \
  "or write it with co_await ep.put(local_view, remote)."

/// A peer's memory: `count` elements of `T` at `addr` in the peer's space `S`.
template <class T, class S>
class remote_view {
  static_assert(local_memory_space<S>, "gdr::remote_view<T, S>: S is the space on the peer's side "
                                       "(gdr::Host, gdr::Pinned or gdr::Device), not Remote<...>");

 public:
  using element_type = T;
  using space = Remote<S>;
  using peer_space = S;

  /// Size of the wire record (`to_wire`).
  static constexpr std::size_t wire_size = 64;
  /// Size of the older record without NIC keys, which `from_wire` accepts.
  static constexpr std::size_t wire_size_v1 = 40;
  /// NIC keys a view carries at most.
  static constexpr std::size_t max_nic_keys = 2;

  constexpr remote_view() noexcept = default;
  constexpr remote_view(std::uint64_t addr, std::size_t count, std::uint64_t key, std::uint32_t peer) noexcept
      : addr_(addr), count_(count), key_(key), peer_(peer) {}
  /// With NIC keys: each `domain << 32 | rkey` (0: none); `owner_checked`:
  /// the registration is `exposure::checked`.
  constexpr remote_view(std::uint64_t addr, std::size_t count, std::uint64_t key, std::uint32_t peer,
                        std::array<std::uint64_t, max_nic_keys> nic, bool owner_checked = false) noexcept
      : addr_(addr), count_(count), key_(key), peer_(peer), nic_(nic), checked_(owner_checked) {}

  /// The address in the peer's address space (meaningless here).
  constexpr std::uint64_t address() const noexcept { return addr_; }
  constexpr std::size_t size() const noexcept { return count_; }
  constexpr std::size_t size_bytes() const noexcept { return count_ * sizeof(T); }
  /// The access key of the peer's registration (an rkey for verbs).
  constexpr std::uint64_t key() const noexcept { return key_; }
  /// The peer's rank (as the bootstrap numbers peers).
  constexpr std::uint32_t peer() const noexcept { return peer_; }
  /// The NIC keys, each `domain << 32 | rkey` (0: none).
  constexpr const std::array<std::uint64_t, max_nic_keys>& nic_keys() const noexcept { return nic_; }
  /// The view carries a NIC key of some domain: a verbs peer may reach it
  /// directly.
  constexpr bool nic_exposed() const noexcept { return nic_[0] != 0 || nic_[1] != 0; }
  /// The registration is `exposure::checked`: every access is served, and
  /// checked, by the owner's loop, on every transport (no NIC key, no
  /// CUDA IPC mapping of the owner's memory).
  constexpr bool owner_checked() const noexcept { return checked_; }

  /// `count` elements from `offset`, clamped to the view.
  constexpr remote_view subview(std::size_t offset, std::size_t count = static_cast<std::size_t>(-1)) const noexcept {
    if (offset > count_) offset = count_;
    if (count > count_ - offset) count = count_ - offset;
    return remote_view(addr_ + offset * sizeof(T), count, key_, peer_, nic_, checked_);
  }

  // ---- no local access: each of these says so at compile time -----------
  // (Without them the mistake would read "no match for operator[]", which
  // does not say what to do instead.)

  /// Not available: a peer's memory cannot be dereferenced here.
  template <class D = void>
  T& operator[](std::size_t) const noexcept {
    static_assert(detail::remote_false_v<D>, GDR_REMOTE_ACCESS_ERROR_);
    return *static_cast<T*>(nullptr);
  }
  /// Not available: a peer's memory cannot be iterated here.
  template <class D = void>
  T* begin() const noexcept {
    static_assert(detail::remote_false_v<D>, GDR_REMOTE_ACCESS_ERROR_);
    return nullptr;
  }
  /// Not available: a peer's memory cannot be iterated here.
  template <class D = void>
  T* end() const noexcept {
    static_assert(detail::remote_false_v<D>, GDR_REMOTE_ACCESS_ERROR_);
    return nullptr;
  }

  /// Serializes (version 2, or 3 for a view with a flag; see the file comment).
  std::array<std::byte, wire_size> to_wire() const noexcept {
    std::array<std::byte, wire_size> w{};
    const std::uint64_t flags = checked_ ? flag_owner_checked : 0;
    detail::store_le64(w.data() + 0, addr_);
    detail::store_le64(w.data() + 8, size_bytes());
    detail::store_le64(w.data() + 16, key_);
    detail::store_le64(w.data() + 24, static_cast<std::uint64_t>(peer_) |
                                          (static_cast<std::uint64_t>(detail::space_code<S>()) << 32));
    detail::store_le64(w.data() + 32, sizeof(T) | (std::uint64_t{flags != 0 ? 3u : 2u} << 32));
    detail::store_le64(w.data() + 40, nic_[0]);
    detail::store_le64(w.data() + 48, nic_[1]);
    detail::store_le64(w.data() + 56, flags);
    return w;
  }

  /// Parses a wire record of version 3 or 2 (64 bytes) or 1 (40 bytes, no
  /// NIC keys). Fails with `errc::invalid_argument` when the record is short
  /// for its version, of another version, names another space, another
  /// element size, a length that is not a whole number of elements, or has
  /// its reserved word set (version 2) or an unknown flag (version 3).
  static result<remote_view> from_wire(std::span<const std::byte> w) noexcept {
    if (w.size() < wire_size_v1) return errc::invalid_argument;
    std::uint64_t addr = detail::load_le64(w.data());
    std::uint64_t bytes = detail::load_le64(w.data() + 8);
    std::uint64_t key = detail::load_le64(w.data() + 16);
    std::uint64_t peer_space = detail::load_le64(w.data() + 24);
    std::uint64_t elem_version = detail::load_le64(w.data() + 32);
    const auto version = static_cast<std::uint32_t>(elem_version >> 32);
    const auto elem = static_cast<std::uint32_t>(elem_version);
    if (static_cast<std::uint32_t>(peer_space >> 32) != detail::space_code<S>()) return errc::invalid_argument;
    if (elem != sizeof(T) || bytes % sizeof(T) != 0) return errc::invalid_argument;
    std::array<std::uint64_t, max_nic_keys> nic{};
    std::uint64_t flags = 0;
    if (version == 2 || version == 3) {
      if (w.size() < wire_size) return errc::invalid_argument;
      flags = detail::load_le64(w.data() + 56);
      if ((version == 2 && flags != 0) || (flags & ~flag_owner_checked) != 0) return errc::invalid_argument;
      nic[0] = detail::load_le64(w.data() + 40);
      nic[1] = detail::load_le64(w.data() + 48);
    } else if (version != 0) {
      return errc::invalid_argument;
    }
    return remote_view(addr, bytes / sizeof(T), key, static_cast<std::uint32_t>(peer_space), nic,
                       (flags & flag_owner_checked) != 0);
  }

 private:
  static constexpr std::uint64_t flag_owner_checked = 1;  // the wire's flag word (version 3)

  std::uint64_t addr_ = 0;
  std::size_t count_ = 0;
  std::uint64_t key_ = 0;
  std::uint32_t peer_ = 0;
  std::array<std::uint64_t, max_nic_keys> nic_{};
  bool checked_ = false;
};

}  // namespace gdr
