// A hand-made shared-memory peer for the shm transport's tests: it runs the
// handshake of gdr/transport/shm/connect.hpp itself, over a blocking Unix
// socket, as a `plan` says (any part may be broken on purpose), and from
// then on writes what it likes into the ring it writes (the one the
// endpoint reads), into the endpoint's ring (which every peer maps
// read-write) and onto the socket. Blocking system calls only, no scheduler
// and no doctest: it runs in a forked child or in a thread beside the
// endpoint's loop.
//
//   shm_raw::peer p;
//   if (!p.connect(listener_name, plan, [](shm_raw::peer& p) { /* before the last handshake byte */ })) ...;
//   p.hello();                                  // the protocol's hello, frame 0
//   p.frame(eager_header, payload);             // frame 1, into its ring
//   p.publish();                                // the head, and the endpoint's bell
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gdr/protocol/message.hpp>
#include <gdr/protocol/options.hpp>
#include <gdr/transport/shm.hpp>
#include <gdr/transport/tcp/frame.hpp>

namespace shm_raw {

namespace d = gdr::detail::shm;
using clock_type = std::chrono::steady_clock;

/// What the raw side makes and says in the handshake; each may be broken.
struct plan {
  std::size_t capacity = 64 * 1024;  ///< its ring's capacity
  std::size_t extra_bytes = 0;       ///< bytes of its segment past `segment_bytes(capacity)`
  bool seal = true;                  ///< its memfd sealed against resizing
  std::uint32_t segment_magic = d::segment_magic;
  std::uint32_t segment_version = d::segment_version;
  std::optional<std::uint64_t> segment_capacity;  ///< the control block's capacity word (none: `capacity`)
  std::uint32_t magic = d::hello_magic;
  std::uint32_t version = 1;
  std::uint64_t ring_bytes = 0;  ///< the hello's (0: `capacity`)
  std::uint32_t device = 0;      ///< the hello's device word (1: CUDA IPC if the endpoint can)
  std::size_t hello_size = sizeof(d::hello_msg);
  int fds = 2;                ///< descriptors with the hello: its memfd, its bell, then more bells
  std::uint8_t can_read = 0;  ///< its step-two byte: 1 says it can read the endpoint (which then may send addresses)
};

/// A message on the socket with `fds` (any number).
inline bool send_with_fds(int sock, const void* p, std::size_t n, std::span<const int> fds) {
  iovec iov{const_cast<void*>(p), n};
  msghdr h{};
  h.msg_iov = &iov;
  h.msg_iovlen = 1;
  std::vector<char> ctl(CMSG_SPACE(sizeof(int) * std::max<std::size_t>(fds.size(), 1)));
  if (!fds.empty()) {
    h.msg_control = ctl.data();
    h.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&h);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  return ::sendmsg(sock, &h, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
}

class peer {
 public:
  peer() = default;
  peer(const peer&) = delete;
  peer& operator=(const peer&) = delete;
  ~peer() {
    if (mine_ != nullptr) ::munmap(mine_, mine_len_);
    if (theirs_ != nullptr) ::munmap(theirs_, theirs_len_);
    for (int fd : {sock_, mem_, bell_, their_bell_})
      if (fd >= 0) ::close(fd);
  }

  /// Connects to `name` and runs the handshake as `p` says. `before_last`
  /// runs once the endpoint has checked this side's ring and sent its last
  /// handshake byte (its ring is mapped: `theirs()`), before this side's
  /// last byte, after which the endpoint builds its connection. False when
  /// the endpoint refused the handshake (it hung up) or a call failed.
  template <class F>
  bool connect(const std::string& name, const plan& p, F&& before_last) {
    socklen_t len = 0;
    sockaddr_un to = d::unix_address(name, len);
    sock_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock_ < 0 || ::connect(sock_, reinterpret_cast<sockaddr*>(&to), len) != 0) return false;
    cap_ = p.capacity;
    mine_len_ = d::segment_bytes(cap_) + p.extra_bytes;
    mem_ = ::memfd_create("gdr-test-raw-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (mem_ < 0 || ::ftruncate(mem_, static_cast<off_t>(mine_len_)) != 0) return false;
    if (p.seal && ::fcntl(mem_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) return false;
    void* m = ::mmap(nullptr, mine_len_, PROT_READ | PROT_WRITE, MAP_SHARED, mem_, 0);
    if (m == MAP_FAILED) return false;
    mine_ = static_cast<std::byte*>(m);
    d::ring::format(mine_, cap_);
    mine().magic.store(p.segment_magic);
    mine().version.store(p.segment_version);
    mine().capacity.store(p.segment_capacity.value_or(cap_));
    bell_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);  // what the endpoint rings: never read here
    if (bell_ < 0) return false;

    d::hello_msg h{p.magic, p.version, p.ring_bytes != 0 ? p.ring_bytes : cap_, static_cast<std::int32_t>(::getpid()),
                   p.device, 0, 0, 0};
    std::vector<int> fds;
    for (int i = 0; i < p.fds; ++i) fds.push_back(i == 0 ? mem_ : bell_);
    std::byte hello_bytes[sizeof h + 16]{};
    std::memcpy(hello_bytes, &h, sizeof h);
    if (!send_with_fds(sock_, hello_bytes, std::min(p.hello_size, sizeof hello_bytes), fds)) return false;

    d::hello_msg theirs{};
    d::fd_message<2> in(&theirs, sizeof theirs);
    const ssize_t got = ::recvmsg(sock_, &in.h, MSG_CMSG_CLOEXEC);
    int k = 0;
    int their_mem = -1;
    in.each_fd([&](int fd) {
      if (k == 0) their_mem = fd;
      else if (k == 1) their_bell_ = fd;
      else ::close(fd);
      ++k;
    });
    if (got != static_cast<ssize_t>(sizeof theirs) || their_mem < 0 || their_bell_ < 0) {
      if (their_mem >= 0) ::close(their_mem);
      return false;
    }
    struct stat st {};
    if (::fstat(their_mem, &st) != 0) {
      ::close(their_mem);
      return false;
    }
    theirs_len_ = static_cast<std::size_t>(st.st_size);
    void* t = ::mmap(nullptr, theirs_len_, PROT_READ | PROT_WRITE, MAP_SHARED, their_mem, 0);
    ::close(their_mem);
    if (t == MAP_FAILED) return false;
    theirs_ = static_cast<std::byte*>(t);
    their_cap_ = d::ring::valid_capacity(theirs_, theirs_len_);
    if (their_cap_ == 0) return false;

    // The endpoint's last byte first: it has checked this side's ring then.
    std::uint8_t theirs_can = 0;
    if (::recv(sock_, &theirs_can, 1, 0) != 1) return false;
    before_last(*this);
    if (::send(sock_, &p.can_read, 1, MSG_NOSIGNAL) != 1) return false;
    ucred cred{};
    socklen_t cl = sizeof cred;
    if (::getsockopt(sock_, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0) endpoint_pid_ = cred.pid;
    return true;
  }
  bool connect(const std::string& name, const plan& p = {}) {
    return connect(name, p, [](peer&) {});
  }

  // ---------------------------------------------------------------- its own ring

  d::ring_control& mine() const noexcept { return *reinterpret_cast<d::ring_control*>(mine_); }
  std::size_t capacity() const noexcept { return cap_; }
  std::uint64_t head() const noexcept { return head_; }
  /// Room in its ring: what the endpoint's tail gives back.
  std::size_t room() const noexcept { return cap_ - static_cast<std::size_t>(head_ - mine().tail.load()); }

  /// Copies `n` bytes in at the head (wrapping), unpublished. No room check:
  /// a test that writes more than the endpoint read overwrites it.
  void put(const void* p, std::size_t n) noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    for (std::size_t done = 0; done < n;) {
      const std::size_t at = static_cast<std::size_t>(head_) & (cap_ - 1);
      const std::size_t k = std::min(n - done, cap_ - at);
      std::memcpy(mine_ + d::control_bytes + at, b + done, k);
      done += k;
      head_ += k;
    }
  }
  /// The number of its next frame (the hello is 0).
  std::uint32_t seq = 0;
  /// The next frame: `h` numbered `seq` (then counted), byte 13 set to
  /// `mark`, and `body`; put, unpublished.
  void frame(const gdr::tcp::frame_header& h, std::span<const std::byte> body = {}, std::uint8_t mark = 0) {
    std::byte b[gdr::tcp::wire::header_size];
    gdr::tcp::encode_frame(h, seq++, b);
    b[13] = static_cast<std::byte>(mark);
    put(b, sizeof b);
    put(body.data(), body.size());
  }
  /// The protocol's hello as the next frame (a hand-made peer's: no credits
  /// to count).
  void hello(std::uint64_t max_message = gdr::protocol_options{}.max_message) {
    gdr::tcp::frame_header h;
    h.type = gdr::tcp::frame_type::hello;
    h.size = max_message;
    h.tag = gdr::detail::proto::caps::host;
    h.id = gdr::detail::proto::version;
    frame(h);
  }
  /// Publishes the head (or `at`, whatever it is) and rings the endpoint's bell.
  void publish() noexcept { publish_at(head_); }
  void publish_at(std::uint64_t at) noexcept {
    mine().head.store(at);
    ring_bell();
  }
  void ring_bell() noexcept {
    std::uint64_t one = 1;
    (void)!::write(their_bell_, &one, sizeof one);
  }

  // ---------------------------------------------------------------- the endpoint's ring

  d::ring_control& theirs() const noexcept { return *reinterpret_cast<d::ring_control*>(theirs_); }
  std::size_t their_capacity() const noexcept { return their_cap_; }
  std::uint64_t tail() const noexcept { return tail_; }
  /// Bytes the endpoint published past this side's tail.
  std::uint64_t readable() const noexcept { return theirs().head.load() - tail_; }
  void peek(void* dst, std::size_t skip, std::size_t n) const noexcept {
    auto* out = static_cast<std::byte*>(dst);
    for (std::size_t done = 0; done < n;) {
      const std::size_t at = static_cast<std::size_t>(tail_ + skip + done) & (their_cap_ - 1);
      const std::size_t k = std::min(n - done, their_cap_ - at);
      std::memcpy(out + done, theirs_ + d::control_bytes + at, k);
      done += k;
    }
  }
  /// Consumes `n` bytes and gives the room back (waking a waiting writer).
  void consume(std::size_t n) noexcept {
    tail_ += n;
    theirs().tail.store(tail_);
    ring_bell();
  }
  /// The endpoint's next frame, its payload read out (consumed as it goes:
  /// a payload may be larger than the ring). A frame of `address_from`
  /// bytes or more carries an 8-byte address instead. False if it did not
  /// come whole by `deadline`, or is not a frame.
  bool next_frame(gdr::tcp::frame_parse_result& r, std::vector<std::byte>& payload, clock_type::time_point deadline,
                  std::uint64_t address_from = ~std::uint64_t{0}) {
    std::byte h[gdr::tcp::wire::header_size];
    if (!wait_readable(sizeof h, deadline)) return false;
    peek(h, 0, sizeof h);
    r = gdr::tcp::parse_frame(std::span<const std::byte>(h), ~std::uint64_t{0});
    if (r.status != gdr::tcp::frame_status::ok) return false;
    consume(sizeof h);
    const std::uint64_t body = r.header.length >= address_from ? sizeof(std::uint64_t) : r.header.length;
    payload.resize(static_cast<std::size_t>(body));
    for (std::size_t got = 0; got < payload.size();) {
      if (!wait_readable(1, deadline)) return false;
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(readable(), payload.size() - got));
      peek(payload.data() + got, 0, k);
      consume(k);
      got += k;
    }
    return true;
  }
  bool wait_readable(std::uint64_t n, clock_type::time_point deadline) const {
    while (readable() < n) {
      if (clock_type::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    return true;
  }

  // ---------------------------------------------------------------- the socket

  int socket() const noexcept { return sock_; }
  int endpoint_pid() const noexcept { return endpoint_pid_; }
  /// Passes `fd` as the transport does (descriptors.hpp): with the
  /// allocation's id, base and the slot to keep it in.
  bool pass_fd(int fd, std::uint64_t buffer_id, std::uint64_t base, std::uint32_t slot) {
    d::fd_msg::body b{buffer_id, base, slot, 0};
    return send_with_fds(sock_, &b, sizeof b, std::span<const int>(&fd, fd >= 0 ? 1 : 0));
  }
  /// Waits until the endpoint hangs up, at most `limit`; true if it did.
  bool wait_hangup(std::chrono::milliseconds limit) const {
    pollfd pf{sock_, POLLRDHUP, 0};
    return ::poll(&pf, 1, static_cast<int>(limit.count())) == 1;
  }

 private:
  int sock_ = -1, mem_ = -1, bell_ = -1, their_bell_ = -1;
  std::byte* mine_ = nullptr;
  std::size_t mine_len_ = 0, cap_ = 0;
  std::uint64_t head_ = 0;
  std::byte* theirs_ = nullptr;
  std::size_t theirs_len_ = 0, their_cap_ = 0;
  std::uint64_t tail_ = 0;
  int endpoint_pid_ = 0;
};

}  // namespace shm_raw
