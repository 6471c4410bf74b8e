/// \file
/// The verbs connection's grants (members of `connection`, declared in
/// `connection.hpp`): memory of this side that the peer's NIC reaches, and
/// the keys of the peer's memory this side was given.
///
/// Contract. A frame that carries an address and key of this side's memory
/// (an rtr's receive, a large get's destination, a large put's source) makes
/// a grant before it goes out; the grant holds the registration and the
/// frame, and the frame is handed back to the engine only when both its
/// SEND has completed and the peer is done with the memory (the data or the
/// answer arrived), or when the queue pair is in the error state (the
/// peer's NIC cannot reach it any more). So the operation that owns the
/// memory cannot finish, and its memory cannot be freed, while the peer may
/// still write or read it. The peer's keys (an rtr's, a get request's) are
/// kept until this side's RDMA to them is posted.
///
/// Keys. The registration behind a grant's key covers exactly the granted
/// bytes and lives exactly as long as the grant: it is made for the grant
/// (`register_exact`, never from a cache, whose entries are widened to
/// pages and may cover more) and dropped with it, so the peer's NIC can
/// reach nothing around the granted bytes and nothing after (issue 15,
/// defect 12; the measurements behind the choice are in docs/VERBS.md,
/// "Keys"). Host memory within `registration_limit`, else the bounce
/// buffers; GPU memory of a GPUDirect endpoint always (a dma-buf of the
/// range), else the connection fails.
#pragma once

#include <gdr/log.hpp>
#include <gdr/transport/verbs/connection.hpp>

namespace gdr::detail::verbs {

inline auto connection::find_grant(grant_kind kind, std::uint64_t token) noexcept -> std::vector<grant>::iterator {
  return std::find_if(grants_.begin(), grants_.end(),
                      [&](const grant& g) { return g.kind == kind && g.token == token; });
}

/// The peer answered the put or get `id`: it no longer touches the memory.
inline void connection::settle(grant_kind kind, std::uint64_t id) noexcept {
  auto g = find_grant(kind, id);
  if (g == grants_.end()) return;
  g->done = true;
  finish_grant(g);
}

/// Ends a grant once both its frame's SEND and the peer's access are
/// done: the registration goes, the frame comes back to the engine.
inline void connection::finish_grant(std::vector<grant>::iterator g) noexcept {
  if (!g->sent || !g->done) return;
  frame* f = g->f;
  grants_.erase(g);  // its registration ends with it
  on_sent(*f, {});
}

/// The grant a frame carries the key of (encoded[0] == 1), or end().
inline auto connection::grant_of(const frame& f) noexcept -> std::vector<grant>::iterator {
  return std::find_if(grants_.begin(), grants_.end(), [&](const grant& g) { return g.f == &f; });
}

inline void connection::remember_remote(bool get_reply, std::uint64_t token, std::uint64_t raddr, std::uint32_t rkey) noexcept {
  for (auto& r : remotes_)
    if (r.get_reply == get_reply && r.token == token) {
      r.raddr = raddr;
      r.rkey = rkey;
      return;
    }
  try {
    remotes_.push_back({get_reply, token, raddr, rkey});
  } catch (...) {
    // Without the key the data goes as SENDs.
  }
}

/// An rtr about to go out: register the receive's view and send its key.
inline void connection::attach_receive(frame& f) noexcept {
  f.encoded[0] = std::byte{2};
  // A receive into staged (Device) memory asks for segments no larger than
  // its bounce buffers (`key`): those come as SENDs into the bounce
  // buffers, never by RDMA into the device pointer.
  if (f.owner == nullptr || f.hdr.size == 0 || f.hdr.key != 0) return;
  std::byte* dst = f.owner->buffer_data();
  auto len = static_cast<std::size_t>(f.hdr.size);
  add_grant(f, grant_kind::recv, f.hdr.addr, dst, len, f.device);
  if (f.nic_only && f.encoded[0] != std::byte{1})
    gpudirect_fail("cannot register the memory of a Device receive with the NIC");
}

/// A put or get request about to go out for the first time: if its bytes
/// do not fit one SEND, register the initiator's memory and send its key,
/// so that the target's NIC moves them (READ of a put's source, WRITE of
/// a get's reply) and no CPU copies them on either side. Only an
/// operation of its own (not a staged segment); the frame is then held
/// until the answer has come. GPUDirect: a request whose bytes only the
/// NIC may move (`nic_only`) carries its key at any size, or fails the
/// connection. False: it failed.
inline bool connection::attach_request(frame& f) noexcept {
  f.encoded[0] = std::byte{2};
  if (f.owner == nullptr || f.sslot != nullptr || f.slot != nullptr) return true;
  bool put = f.hdr.type == proto::msg::put_request;
  auto len = static_cast<std::size_t>(put ? f.hdr.length : f.hdr.size);
  if (len == 0 || (len <= frag_ - wire_size && !f.nic_only)) return true;
  const std::byte* addr = put ? f.payload : f.owner->buffer_data();
  add_grant(f, put ? grant_kind::put : grant_kind::get, f.hdr.id, addr, len, f.device);
  if (f.nic_only && f.encoded[0] != std::byte{1})
    return gpudirect_fail("cannot register the memory of a put or get whose bytes only the NIC may move");
  return true;
}

inline void connection::add_grant(frame& f, grant_kind kind, std::uint64_t token, const std::byte* addr, std::size_t len,
                 int device) noexcept {
  int access = kind == grant_kind::put ? gdr::verbs::remote_read_access : gdr::verbs::remote_write_access;
  // The flush of a Device receive or get reads one byte through this key
  // (rdma_read.hpp).
  if (device >= 0 && needs_flush()) access |= IBV_ACCESS_REMOTE_READ;
  auto key = register_exact(addr, len, device, access);
  if (!key) {
    ++stats_.registration_failures;
    return;
  }
  try {
    grants_.push_back({kind, token, addr, len, std::move(*key), &f, false, false});
  } catch (...) {
    return;
  }
  f.encoded[0] = std::byte{1};  // this frame carries a key
}

/// A registration of exactly `[addr, addr + len)`, made for one grant and
/// never cached: the key the peer gets covers the granted bytes and nothing
/// around them, and it dies with the grant (issue 15, defect 12; docs/VERBS.md,
/// "Keys"). Within the registration limit for host memory; GPU memory of a
/// GPUDirect endpoint through its route (a dma-buf of exactly the range).
inline auto connection::register_exact(const void* addr, std::size_t len, int device, int access) noexcept
    -> result<gdr::verbs::owned_mr> {
  if (device < 0 && vopts_.registration_limit != 0 && len > vopts_.registration_limit) return errno_code(E2BIG);
  gdr::verbs::mr_route route =
      device >= 0 && gpudirect_ != nullptr ? gdr::verbs::route_of(*gpudirect_) : gdr::verbs::mr_route::host;
  gdr::verbs::mr_backend backend{dq_->pd, access, route};
  result<ibv_mr*> mr = backend.register_range(reinterpret_cast<std::uintptr_t>(addr), len);
  if (!mr) {
    if (device >= 0)
      gdr::detail::log("verbs", "registering %zu bytes of GPU %d memory failed: %s", len, device,
                  mr.error().message().c_str());
    return mr.error();
  }
  ++stats_.registrations;
  if (device >= 0) ++stats_.device_registrations;
  return gdr::verbs::owned_mr::adopt(*mr);
}

/// A user's buffer registered (or found cached), within the limit (host
/// memory only: GPU memory has no other way to go). `device`: the GPU
/// whose memory it is, or -1.
inline auto connection::register_user(gdr::verbs::mr_cache& cache, const void* addr, std::size_t len,
                                      int device) noexcept -> result<gdr::verbs::registration_hold> {
  if (device < 0 && vopts_.registration_limit != 0 && len > vopts_.registration_limit) return errno_code(E2BIG);
  auto l = cache.acquire(addr, len);
  if (!l) {
    if (device >= 0)
      gdr::detail::log("verbs", "registering %zu bytes of GPU %d memory failed: %s", len, device,
                  l.error().message().c_str());
    return l.error();
  }
  ++stats_.registrations;
  if (device >= 0) ++stats_.device_registrations;
  return gdr::verbs::registration_hold(std::move(*l), cache, addr, len, vopts_.cache_registrations);
}

/// The cache of memory of GPU `device` (-1: `host`, the host cache for
/// the access needed). On a GPUDirect endpoint a `Device` view's memory
/// is GPU memory; elsewhere no frame names a device.
inline gdr::verbs::mr_cache& connection::cache_for(int device, gdr::verbs::mr_cache& host) noexcept {
  return device >= 0 && dq_->device_mrs ? *dq_->device_mrs : host;
}

inline gdr::verbs::mr_cache& connection::recv_cache() noexcept { return *dq_->recv_mrs; }

inline gdr::verbs::mr_cache& connection::send_cache() noexcept { return *dq_->send_mrs; }


inline auto connection::find_remote(bool get_reply, std::uint64_t token) noexcept -> std::vector<remote_dst>::iterator {
  return std::find_if(remotes_.begin(), remotes_.end(),
                      [&](const remote_dst& x) { return x.get_reply == get_reply && x.token == token; });
}

}  // namespace gdr::detail::verbs
