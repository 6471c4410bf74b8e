/// \file
/// The shared-memory connection's descriptor passing: a device allocation
/// of gdr's own (the virtual memory API) travels to the peer as a file
/// descriptor over the connection's Unix socket (`SCM_RIGHTS`), ahead of
/// the frame that names it (see "Device memory by CUDA IPC" in
/// connection.hpp).
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <bit>
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

inline void connection::note_frees() noexcept {
  frees_seen_ = ce_->ipc_frees();
  const std::uint32_t mask =
      fd_out_.take_freed([&](std::uint64_t base, std::uint64_t id) { return ce_->ipc_alive(base, id); });
  if (mask == 0) return;
  stats_.fds_released += static_cast<std::uint64_t>(std::popcount(mask));
  tx_.control().released.fetch_or(mask, std::memory_order_release);
  if (take_waiter(tx_.control().reader_waiting)) ring_peer();
}

inline void connection::take_releases(std::uint32_t mask) noexcept {
  stats_.fds_let_go += fd_in_.release(mask, [&](const fd_table_in::allocation& a) { let_go(a); });
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
  if (n != static_cast<ssize_t>(sizeof b) || in.truncated() || fd < 0 || b.buffer_id != m.buffer_id ||
      b.base != m.base || b.slot != slot) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  // Kept in its slot. What the slot held goes: the writer passed this one
  // into it and forgot that one, so it goes now or never (fd_table.hpp).
  const bool kept = fd_in_.take(slot, m.base, m.buffer_id, fd, [&](const fd_table_in::allocation& a) {
    let_go(a);
    ++stats_.fds_replaced;
  });
  if (!kept) return -1;  // a slot out of range (the descriptor is closed)
  ++stats_.fds_taken;
  return fd;
}

}  // namespace gdr::detail::shm
