/// \file
/// One message on the shared-memory transport's Unix socket: a buffer of
/// bytes, and room for up to `N` file descriptors (`SCM_RIGHTS`). The
/// handshake passes the ring's memfd and the bell with it (connect.hpp);
/// the connection passes a shareable device allocation's descriptor
/// (descriptors.hpp).
///
///   fd_message<1> m(&body, sizeof body);
///   m.put_fds({fd});                 // sending
///   ::sendmsg(sock, &m.h, flags);
///   m.each_fd([](int fd) { ... });   // after receiving into it
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstring>

namespace gdr::detail::shm {

template <std::size_t N>
struct fd_message {
  iovec iov;
  alignas(cmsghdr) char ctl[CMSG_SPACE(N * sizeof(int))]{};
  msghdr h{};

  fd_message(void* bytes, std::size_t n) noexcept : iov{bytes, n} {
    h.msg_iov = &iov;
    h.msg_iovlen = 1;
    h.msg_control = ctl;
    h.msg_controllen = sizeof ctl;
  }
  fd_message(const fd_message&) = delete;  // `h` points into it
  fd_message& operator=(const fd_message&) = delete;

  /// The `N` descriptors to send (borrowed: the receiver gets copies).
  void put_fds(const int (&fds)[N]) noexcept {
    cmsghdr* c = CMSG_FIRSTHDR(&h);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(N * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds, sizeof fds);
  }

  /// `f(fd)` for every descriptor that came, in order (the caller owns them).
  template <class F>
  void each_fd(F&& f) const {
    for (cmsghdr* c = CMSG_FIRSTHDR(&h); c != nullptr; c = CMSG_NXTHDR(const_cast<msghdr*>(&h), c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < k; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        f(fd);
      }
    }
  }

  /// The control data was cut short (descriptors beyond the room were lost).
  bool truncated() const noexcept { return (h.msg_flags & MSG_CTRUNC) != 0; }
};

}  // namespace gdr::detail::shm
