/// \file
/// Making shared-memory endpoints: `shm::listener` (a Unix stream socket,
/// by path or abstract name) and `shm::connect`, and the handshake both run
/// over the socket through the scheduler's io_uring.
///
/// \code
///   gdr::shm::listener l(sched);                        // "@gdr-..." (an abstract name the kernel picks)
///   std::string name = l.name();                        // give it to the peer (fork, bootstrap, ...)
///   gdr::shm::endpoint a = co_await l.accept();         // in this process
///   gdr::shm::endpoint b = co_await gdr::shm::connect(sched, name);  // in the peer's
/// \endcode
///
/// Handshake. Each side creates the ring it will write: a memfd of
/// `segment_bytes(ring_bytes)`, sealed against shrinking and growing (the
/// peer maps it, and a segment that shrank under the mapping would kill the
/// reader with SIGBUS), mapped and formatted (ring.hpp), and an eventfd, its
/// bell. It sends a 48-byte hello (magic "GDRH", version 1, its ring's
/// size, its pid, a probe word) with both descriptors (`SCM_RIGHTS`), and receives the
/// peer's. The peer's segment is checked (its seals and size before it is
/// mapped, then a fresh control block whose capacity fits the mapping and
/// is the hello's); anything else fails the handshake with
/// `errc::protocol_error`. Both capacities are held in `link_parts` from
/// then on: the peer maps both segments and may rewrite their capacity
/// words at any time, and a ring built from such a word would copy frames
/// past the end of its mapping. The peer's pid is the kernel's
/// (`SO_PEERCRED`), not what its hello says. Then each side tries to read a
/// word of the peer's memory whose address and value the peer's hello gave
/// (`process_vm_readv`), and tells the peer whether it could (one byte
/// each way): a side whose peer can read it sends its large payloads as
/// addresses (`endpoint_options::single_copy_threshold`). The hello's
/// device word says how this side moves `Device` memory (staged, CUDA IPC
/// if the peer can, CUDA IPC or nothing: `endpoint_options::device`); both
/// sides decide alike, and one that requires CUDA IPC fails the handshake
/// with a peer that stages (`errc::unsupported`).
///
/// Each step (connect or accept, the hello out, the hello in) is bounded by
/// the `op_options` given: `timeout` each, `stop` throughout.
#pragma once

#include <fcntl.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/transfer/common.hpp>
#include <gdr/transport/shm/endpoint.hpp>
#include <gdr/transport/shm/fd_message.hpp>
#include <gdr/transport/shm/ring.hpp>
#include <gdr/transport/tcp/socket_op.hpp>

namespace gdr {

namespace detail::shm {

/// One io_uring call on a Unix socket: connect, accept, sendmsg or recvmsg.
/// `co_await` gives its result (a byte count or a descriptor) or throws
/// `gdr::error`.
class unix_call : public gdr::detail::tcp::socket_op<unix_call, int> {
 public:
  enum class kind : std::uint8_t { connect, accept, sendmsg, recvmsg };
  unix_call(scheduler& s, op_options o, kind k, int fd, msghdr* m = nullptr, const sockaddr_un* to = nullptr,
            socklen_t to_len = 0) noexcept
      : socket_op(s, std::move(o)), kind_(k), fd_(fd), msg_(m), to_(to), to_len_(to_len) {}
  unix_call(unix_call&&) noexcept = default;

  void prepare(io_uring_sqe* sqe) noexcept {
    switch (kind_) {
      case kind::connect: io_uring_prep_connect(sqe, fd_, reinterpret_cast<const sockaddr*>(to_), to_len_); break;
      case kind::accept: io_uring_prep_accept(sqe, fd_, nullptr, nullptr, SOCK_CLOEXEC); break;
      case kind::sendmsg: io_uring_prep_sendmsg(sqe, fd_, msg_, MSG_NOSIGNAL); break;
      case kind::recvmsg: io_uring_prep_recvmsg(sqe, fd_, msg_, MSG_CMSG_CLOEXEC); break;
    }
  }
  result<int> finish(std::error_code failed) noexcept {
    if (failed) return failed;
    return res_;
  }

 private:
  kind kind_;
  int fd_;
  msghdr* msg_;
  const sockaddr_un* to_;
  socklen_t to_len_;
};

/// What each side says first.
struct hello_msg {
  std::uint32_t magic;    // "GDRH"
  std::uint32_t version;  // 1
  std::uint64_t ring_bytes;
  std::int32_t pid;
  std::uint32_t device;       // Device memory: 0 staged, 1 CUDA IPC if the peer can, 2 CUDA IPC or nothing
  std::uint64_t probe_addr;   // a word of the sender's memory the peer tries to read (0: do not)
  std::uint64_t probe_value;  // what it holds
  std::uint64_t single_copy;  // the sender's single_copy_threshold (0: never)
};
static_assert(sizeof(hello_msg) == 48);
inline constexpr std::uint32_t hello_magic = 0x48524447u;  // "GDRH"

[[noreturn]] inline void fail_errno(const char* what) { throw gdr::error(errno_code(errno), what); }

/// A socket address for `name`: "@x" is the abstract name x, anything
/// else a path.
inline sockaddr_un unix_address(const std::string& name, socklen_t& len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const bool abstract = !name.empty() && name[0] == '@';
  if (name.empty() || name.size() >= sizeof a.sun_path)
    throw gdr::error(make_error_code(errc::invalid_argument),
                     "gdr::shm: a socket name is 1 to " + std::to_string(sizeof a.sun_path - 1) + " bytes: '" + name + "'");
  std::memcpy(a.sun_path, name.data(), name.size());
  if (abstract) a.sun_path[0] = '\0';
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  return a;
}

/// The ring this side writes: a sealed memfd, mapped and formatted for
/// `capacity` bytes (what `want` rounds to; held here from now on).
inline mapping make_ring(std::size_t want, fd_handle& mem, std::size_t& capacity) {
  const std::size_t cap = std::clamp<std::size_t>(std::bit_ceil(std::max<std::size_t>(want, 1)), 64 * 1024, std::size_t{1} << 30);
  const std::size_t bytes = segment_bytes(cap);
  mem = fd_handle(::memfd_create("gdr-shm-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!mem.valid()) fail_errno("gdr::shm: memfd_create");
  if (::ftruncate(mem.get(), static_cast<off_t>(bytes)) != 0) fail_errno("gdr::shm: ftruncate of the ring");
  if (::fcntl(mem.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) fail_errno("gdr::shm: sealing the ring");
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mem.get(), 0);
  if (p == MAP_FAILED) fail_errno("gdr::shm: mapping the ring");
  ring::format(p, cap);
  capacity = cap;
  return mapping(p, bytes);
}

/// Maps the peer's ring from its memfd, after checking it; `capacity` is
/// its capacity as checked (and as its hello said), the one this side uses
/// from now on.
inline mapping map_peer_ring(int fd, std::uint64_t hello_bytes, std::size_t& capacity) {
  auto refuse = [](const char* why) -> mapping {
    throw gdr::error(make_error_code(errc::protocol_error), std::string("gdr::shm: the peer's ring ") + why);
  };
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    return refuse("is not sealed against resizing");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(control_bytes) ||
      st.st_size > static_cast<off_t>(segment_bytes(std::size_t{1} << 30)))
    return refuse("has an impossible size");
  const auto bytes = static_cast<std::size_t>(st.st_size);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail_errno("gdr::shm: mapping the peer's ring");
  mapping m(p, bytes);
  capacity = ring::valid_capacity(p, bytes);
  if (capacity == 0) return refuse("has no valid control block");
  if (capacity != hello_bytes) return refuse("is not the size its hello says");
  return m;
}

/// This side's word on `Device` memory for the hello (see `hello_msg`).
inline std::uint32_t device_word(scheduler& s, const endpoint_options& o) {
  const copy_engine* ce = copy_engine::of(s);
  const bool can = ce != nullptr && ce->ipc_capable();
  switch (o.device) {
    case gdr::shm::device_path::staged: return 0;
    case gdr::shm::device_path::automatic: return can && o.protocol.force != force_path::staged ? 1 : 0;
    case gdr::shm::device_path::cuda_ipc:
      if (!can)
        throw gdr::error(make_error_code(errc::unsupported),
                         "gdr::shm: device = cuda_ipc, but this process cannot share device memory: it needs a GPU "
                         "and a gdr::cuda::event_poller on the endpoint's scheduler, made before the endpoint");
      return 2;
  }
  return 0;
}

/// Both ends' words on `Device` memory: CUDA IPC if both can; an error if
/// one requires it and the other stages.
inline bool agree_device(std::uint32_t mine, std::uint32_t theirs) {
  if (theirs > 2) throw gdr::error(make_error_code(errc::protocol_error), "gdr::shm: the peer's hello has an unknown device word");
  if (mine == 2 && theirs == 0)
    throw gdr::error(make_error_code(errc::unsupported),
                     "gdr::shm: device = cuda_ipc here, but the peer stages Device memory (its device option is "
                     "staged, or it has no copy engine that can share device memory)");
  if (mine == 0 && theirs == 2)
    throw gdr::error(make_error_code(errc::unsupported),
                     "gdr::shm: the peer requires CUDA IPC for Device memory (device = cuda_ipc), and this side stages "
                     "it (device = staged, or no gdr::cuda::event_poller that can share device memory)");
  return mine != 0 && theirs != 0;
}

/// The handshake over a connected Unix socket (see the file comment).
inline task<link_parts> handshake(scheduler& s, fd_handle sock, const endpoint_options& o, op_options oo) {
  link_parts parts;
  const std::uint32_t device = device_word(s, o);
  fd_handle mem;
  parts.tx_segment = make_ring(o.ring_bytes, mem, parts.tx_capacity);
  parts.bell = fd_handle(::eventfd(0, EFD_CLOEXEC));
  if (!parts.bell.valid()) fail_errno("gdr::shm: eventfd");

  std::uint64_t probe = 0;
  while (probe == 0)
    if (::getrandom(&probe, sizeof probe, 0) != static_cast<ssize_t>(sizeof probe)) probe = 0x9e3779b97f4a7c15ull;
  hello_msg mine{hello_magic,
                 1,
                 parts.tx_capacity,
                 static_cast<std::int32_t>(::getpid()),
                 device,
                 o.single_copy_threshold != 0 ? reinterpret_cast<std::uintptr_t>(&probe) : 0,
                 probe,
                 o.single_copy_threshold};
  fd_message<2> out(&mine, sizeof mine);
  out.put_fds({mem.get(), parts.bell.get()});
  int sent = co_await unix_call(s, oo, unix_call::kind::sendmsg, sock.get(), &out.h);
  if (sent != static_cast<int>(sizeof mine))
    throw gdr::error(make_error_code(errc::connection_lost), "gdr::shm: the handshake's hello was cut short");
  mem.reset();  // the peer holds its own descriptor now; the mapping stays

  hello_msg theirs{};
  fd_message<2> in(&theirs, sizeof theirs);
  int got = co_await unix_call(s, oo, unix_call::kind::recvmsg, sock.get(), &in.h);
  // Take the descriptors first, so that every way out closes them.
  fd_handle peer_mem, peer_bell;
  int nfds = 0;
  in.each_fd([&](int fd) {
    if (nfds == 0) peer_mem.reset(fd);
    else if (nfds == 1) peer_bell.reset(fd);
    else ::close(fd);
    ++nfds;
  });
  if (got == 0) throw gdr::error(make_error_code(errc::connection_lost), "gdr::shm: the peer left during the handshake");
  if (got != static_cast<int>(sizeof theirs) || theirs.magic != hello_magic || in.truncated() ||
      nfds != 2)
    throw gdr::error(make_error_code(errc::protocol_error), "gdr::shm: the peer's hello is not a gdr shared-memory hello");
  if (theirs.version != 1)
    throw gdr::error(make_error_code(errc::protocol_error),
                     "gdr::shm: the peer speaks version " + std::to_string(theirs.version) + " of the handshake, this side 1");
  parts.device_ipc = agree_device(device, theirs.device);
  parts.rx_segment = map_peer_ring(peer_mem.get(), theirs.ring_bytes, parts.rx_capacity);
  parts.peer_bell = std::move(peer_bell);
  ucred cred{};
  socklen_t cl = sizeof cred;
  parts.peer_pid = ::getsockopt(sock.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0 ? cred.pid : theirs.pid;

  // May this side read the peer's memory? Then the peer may send it
  // addresses instead of bytes. (`probe` above stays alive until the
  // peer's verdict on it has come.)
  std::uint8_t can = 0;
  if (theirs.probe_addr != 0 && theirs.single_copy != 0) {
    std::uint64_t v = 0;
    iovec local{&v, sizeof v};
    iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(theirs.probe_addr)), sizeof v};
    can = ::process_vm_readv(parts.peer_pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof v) &&
          v == theirs.probe_value;
  }
  std::uint8_t heard = 0;
  iovec can_iov{&can, 1}, heard_iov{&heard, 1};
  msghdr m1{};
  m1.msg_iov = &can_iov;
  m1.msg_iovlen = 1;
  msghdr m2{};
  m2.msg_iov = &heard_iov;
  m2.msg_iovlen = 1;
  if (co_await unix_call(s, oo, unix_call::kind::sendmsg, sock.get(), &m1) != 1 ||
      co_await unix_call(s, oo, unix_call::kind::recvmsg, sock.get(), &m2) != 1 || heard > 1)
    throw gdr::error(make_error_code(errc::protocol_error), "gdr::shm: the handshake's second step failed");
  // With CUDA IPC no payload goes as an address: the receiver could not
  // copy it with the CPU into Device memory (both sides know it alike).
  parts.i_read_peer = can != 0 && !parts.device_ipc;
  parts.peer_single_copy = parts.i_read_peer ? static_cast<std::size_t>(theirs.single_copy) : 0;
  parts.peer_reads_me = heard != 0 && o.single_copy_threshold != 0 && !parts.device_ipc;
  parts.sock = std::move(sock);
  co_return parts;
}

}  // namespace detail::shm

namespace shm {

/// Connects to the listener named `name` ("@abstract" or a path) and runs
/// the handshake. Throws `gdr::error`: the connect's errno (`ECONNREFUSED`,
/// `ENOENT` when nobody listens), `errc::protocol_error` for a peer that is
/// not a gdr shared-memory listener, `errc::timed_out`, `errc::cancelled`.
inline task<endpoint> connect(scheduler& sched, std::string name, memory_registry& registry = default_registry(),
                              endpoint_options opts = {}, op_options oo = {}) {
  using gdr::detail::shm::unix_call;
  socklen_t len = 0;
  sockaddr_un to = gdr::detail::shm::unix_address(name, len);
  fd_handle sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) gdr::detail::shm::fail_errno("gdr::shm::connect: socket");
  co_await unix_call(sched, oo, unix_call::kind::connect, sock.get(), nullptr, &to, len);
  gdr::detail::shm::link_parts parts = co_await gdr::detail::shm::handshake(sched, std::move(sock), opts, oo);
  co_return endpoint(sched, std::move(parts), registry, opts);
}

/// A listening Unix socket that makes shared-memory endpoints. Move-only.
/// Thread-safety: `accept`, `close`, moves and destruction on the
/// scheduler's thread.
class listener {
 public:
  /// Listens on `name`: "@x" (the abstract name x: no file, gone with the
  /// process), a path (a socket file, removed by `close`), or empty (an
  /// abstract name the kernel picks; see `name()`). Throws `gdr::error`.
  explicit listener(scheduler& sched, std::string name = {}, memory_registry& registry = default_registry(),
                    const endpoint_options& opts = {}, int backlog = SOMAXCONN)
      : sched_(&sched), registry_(&registry), opts_(opts) {
    sock_ = fd_handle(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!sock_.valid()) gdr::detail::shm::fail_errno("gdr::shm::listener: socket");
    if (name.empty()) {
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      // The address family alone: the kernel binds a fresh abstract name.
      if (::bind(sock_.get(), reinterpret_cast<sockaddr*>(&a), sizeof(sa_family_t)) != 0)
        gdr::detail::shm::fail_errno("gdr::shm::listener: bind");
      socklen_t len = sizeof a;
      if (::getsockname(sock_.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
        gdr::detail::shm::fail_errno("gdr::shm::listener: getsockname");
      name_ = "@" + std::string(a.sun_path + 1, len - offsetof(sockaddr_un, sun_path) - 1);
    } else {
      socklen_t len = 0;
      sockaddr_un a = gdr::detail::shm::unix_address(name, len);
      if (::bind(sock_.get(), reinterpret_cast<sockaddr*>(&a), len) != 0)
        throw gdr::error(errno_code(errno), "gdr::shm::listener: bind " + name);
      name_ = std::move(name);
      path_ = name_[0] != '@';
    }
    if (::listen(sock_.get(), backlog) != 0) gdr::detail::shm::fail_errno("gdr::shm::listener: listen");
  }
  listener(listener&& o) noexcept
      : sched_(o.sched_), registry_(o.registry_), opts_(o.opts_), sock_(std::move(o.sock_)),
        name_(std::move(o.name_)), path_(std::exchange(o.path_, false)) {}
  listener& operator=(listener&&) = delete;
  ~listener() { close(); }

  /// The name to connect to (what `connect` takes).
  const std::string& name() const noexcept { return name_; }

  /// Waits for the next connection and runs the handshake. `opts.timeout`
  /// bounds each step, `opts.stop` cancels it. The listener must outlive
  /// the `co_await`.
  task<endpoint> accept(op_options oo = {}) const {
    fd_handle conn = co_await accept_connection(oo);
    co_return co_await handshake(std::move(conn), oo);
  }

  /// `accept` in two halves, for a caller that runs each connection's
  /// handshake apart from its accepts (so that a connection that says
  /// nothing holds up no other: the bootstrap mesh). This one waits for the
  /// next connection and gives its socket; `oo` as for `accept`.
  task<fd_handle> accept_connection(op_options oo = {}) const {
    using gdr::detail::shm::unix_call;
    if (!sock_.valid()) throw gdr::error(make_error_code(errc::closed), "gdr::shm::listener: closed");
    int fd = co_await unix_call(*sched_, oo, unix_call::kind::accept, sock_.get());
    co_return fd_handle(fd);
  }
  /// The second half: runs the handshake on `conn` (from
  /// `accept_connection`) and makes its endpoint. `oo` bounds each step.
  task<endpoint> handshake(fd_handle conn, op_options oo = {}) const {
    gdr::detail::shm::link_parts parts = co_await gdr::detail::shm::handshake(*sched_, std::move(conn), opts_, oo);
    co_return endpoint(*sched_, std::move(parts), *registry_, opts_);
  }

  /// Stops listening (pending accepts fail); a socket file is removed.
  void close() noexcept {
    if (!sock_.valid()) return;
    ::shutdown(sock_.get(), SHUT_RDWR);
    sock_.reset();
    if (path_) ::unlink(name_.c_str());
    path_ = false;
  }

 private:
  scheduler* sched_;
  memory_registry* registry_;
  endpoint_options opts_;
  fd_handle sock_{};
  std::string name_;
  bool path_ = false;
};

}  // namespace shm

}  // namespace gdr
