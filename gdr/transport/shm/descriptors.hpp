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
  std::uint32_t pick = 0;
  for (std::uint32_t i = 0; i < fd_slots; ++i) {
    const fd_slot_out& e = fd_out_[i];
    if (e.used != 0 && e.base == m.base && e.id == m.buffer_id) {
      slot = i;
      return true;
    }
    if (e.used < fd_out_[pick].used) pick = i;  // an empty one (0) first, else the least recently used
  }
  slot = pick;
  return false;
}

inline bool connection::pass_fd(const copy_engine::ipc_memory& m, std::uint32_t slot) noexcept {
  fd_msg::body b{m.buffer_id, m.base, slot, 0};
  iovec iov{&b, sizeof b};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))]{};
  msghdr out{};
  out.msg_iov = &iov;
  out.msg_iovlen = 1;
  out.msg_control = ctl;
  out.msg_controllen = sizeof ctl;
  cmsghdr* c = CMSG_FIRSTHDR(&out);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &m.fd, sizeof m.fd);
  const ssize_t n = ::sendmsg(parts_.sock.get(), &out, MSG_DONTWAIT | MSG_NOSIGNAL);
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
  iovec iov{&b, sizeof b};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))]{};
  msghdr in{};
  in.msg_iov = &iov;
  in.msg_iovlen = 1;
  in.msg_control = ctl;
  in.msg_controllen = sizeof ctl;
  const ssize_t n = ::recvmsg(parts_.sock.get(), &in, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  int fd = -1;
  if (n > 0) {
    for (cmsghdr* h = CMSG_FIRSTHDR(&in); h != nullptr; h = CMSG_NXTHDR(&in, h)) {
      if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < k; ++i) {
        int x;
        std::memcpy(&x, CMSG_DATA(h) + i * sizeof(int), sizeof x);
        if (fd < 0) fd = x;
        else ::close(x);  // one per message: more is the peer's error
      }
    }
  }
  // The peer passed it before it wrote the frame: it is here, and it is
  // the allocation the frame names, or the peer broke the protocol.
  if (n != static_cast<ssize_t>(sizeof b) || (in.msg_flags & MSG_CTRUNC) != 0 || fd < 0 ||
      b.buffer_id != m.buffer_id || b.base != m.base || b.slot != slot || slot >= fd_slots) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  // Kept in its slot (the one there before is no longer the writer's).
  fd_slot_in& e = fd_in_[slot];
  if (e.fd >= 0) ::close(e.fd);
  e = {m.base, m.buffer_id, fd};
  ++stats_.fds_taken;
  return fd;
}

}  // namespace gdr::detail::shm
