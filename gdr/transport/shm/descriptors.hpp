/// \file
/// The shared-memory connection's descriptor passing: a device allocation
/// of gdr's own (the virtual memory API) travels to the peer as a file
/// descriptor over the connection's Unix socket (`SCM_RIGHTS`), ahead of
/// the frame that names it (see "Device memory by CUDA IPC" in
/// connection.hpp).
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>

#include <gdr/log.hpp>
#include <gdr/transport/shm/connection.hpp>
#include <gdr/transport/shm/fd_message.hpp>

namespace gdr::detail::shm {

namespace fd_msg {
// What travels with a passed descriptor: the allocation's id and base, so
// that the reader knows it takes the one its frame names.
struct body {
  std::uint64_t buffer_id;
  std::uint64_t base;
  std::uint32_t slot;
  std::uint32_t reserved;
};
}  // namespace fd_msg

inline bool connection::fd_slot_for(const copy_engine::ipc_memory& m, std::uint32_t& slot) const noexcept {
  // Not a slot the peer has yet to let go (its allocation was freed).
  const std::uint32_t pending = tx_.control().released.load(std::memory_order_acquire);
  std::uint32_t pick = fd_slots;
  for (std::uint32_t i = 0; i < fd_slots; ++i) {
    const fd_slot_out& e = fd_out_[i];
    if (e.used != 0 && e.base == m.base && e.id == m.buffer_id) {
      slot = i;
      return true;
    }
    if ((pending & (1u << i)) != 0) continue;
    if (pick == fd_slots || e.used < fd_out_[pick].used) pick = i;  // an empty one (0) first, else the least recently used
  }
  slot = pick;  // fd_slots: every slot waits for the peer (export_ipc tries again soon)
  return false;
}

inline void connection::note_frees() noexcept {
  frees_seen_ = ce_->ipc_frees();
  std::uint32_t mask = 0;
  for (std::uint32_t i = 0; i < fd_slots; ++i) {
    fd_slot_out& e = fd_out_[i];
    if (e.used == 0 || ce_->ipc_alive(e.base, e.id)) continue;
    e = {};
    --fds_out_;
    mask |= 1u << i;
    ++stats_.fds_released;
  }
  if (mask == 0) return;
  tx_.control().released.fetch_or(mask, std::memory_order_release);
  if (take_waiter(tx_.control().reader_waiting)) ring_peer();
}

inline void connection::take_releases(std::uint32_t mask) noexcept {
  for (std::uint32_t i = 0; i < fd_slots; ++i) {
    if ((mask & (1u << i)) == 0) continue;
    fd_slot_in& e = fd_in_[i];
    if (e.fd < 0) continue;
    if (ce_ != nullptr) ce_->ipc_release(parts_.peer_pid, e.base, e.id);
    ::close(e.fd);
    e = {};
    --fds_in_;
    ++stats_.fds_let_go;
  }
  rx_.control().released.fetch_and(~mask, std::memory_order_acq_rel);
  if (take_waiter(rx_.control().writer_waiting)) ring_peer();  // a writer waiting for a slot
}

inline bool connection::pass_fd(const copy_engine::ipc_memory& m, std::uint32_t slot) noexcept {
  fd_msg::body b{m.buffer_id, m.base, slot, 0};
  fd_message<1> out(&b, sizeof b);
  out.put_fds({m.fd});
  const ssize_t n = ::sendmsg(parts_.sock.get(), &out.h, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n == static_cast<ssize_t>(sizeof b)) {
    sock_blocked_ = false;
    ++stats_.fds_passed;
    return true;
  }
  const int err = n < 0 ? errno : EPROTO;
  if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ENOBUFS) {
    // The peer has not taken the descriptors before it yet: try again soon.
    if (!sock_blocked_) ++stats_.fd_socket_full;
    sock_blocked_ = true;
    sock_retry_at_ = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
    return false;
  }
  if (err == EPIPE || err == ECONNRESET) return false;  // the peer ended: its hang-up ends this side
  // Not from here (inside the engine's call): from the loop.
  fail_due_ = errno_code(err);
  gdr::detail::log("shm", "passing a device allocation's descriptor to pid %d failed (%s); the connection fails",
                   parts_.peer_pid, fail_due_.message().c_str());
  kick();
  return false;
}

inline int connection::take_fd(const copy_engine::ipc_memory& m, std::uint32_t slot) noexcept {
  fd_msg::body b{};
  fd_message<1> in(&b, sizeof b);
  const ssize_t n = ::recvmsg(parts_.sock.get(), &in.h, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  int fd = -1;
  if (n > 0) {
    in.each_fd([&](int x) {
      if (fd < 0) fd = x;
      else ::close(x);  // one per message: more is the peer's error
    });
  }
  // The peer passed it before it wrote the frame: it is here, and it is
  // the allocation the frame names, or the peer broke the protocol.
  if (n != static_cast<ssize_t>(sizeof b) || in.truncated() || fd < 0 ||
      b.buffer_id != m.buffer_id || b.base != m.base || b.slot != slot || slot >= fd_slots) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  // Kept in its slot (the one there before is no longer the writer's).
  fd_slot_in& e = fd_in_[slot];
  if (e.fd >= 0) ::close(e.fd);
  else ++fds_in_;
  e = {m.base, m.buffer_id, fd};
  ++stats_.fds_taken;
  return fd;
}

}  // namespace gdr::detail::shm
