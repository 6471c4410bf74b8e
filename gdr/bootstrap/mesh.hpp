/// \file
/// `gdr::bootstrap::connect_mesh`: one TCP endpoint to every other rank,
/// built through a rendezvous (TCP or MPI). The steps below are the same
/// for every transport (`detail::build_mesh`); `gdr::verbs::connect_mesh`
/// (`gdr/bootstrap/verbs_mesh.hpp`) builds a mesh of verbs endpoints. A
/// mesh whose connections are made on first use instead is
/// `gdr::bootstrap::lazy_mesh` (`gdr/bootstrap/lazy_mesh.hpp`).
///
/// \code
///   auto rv = gdr::bootstrap::tcp_rendezvous::from_env();
///   gdr::scheduler sched;
///   gdr::sync_wait(sched, [&]() -> gdr::task<> {
///     gdr::bootstrap::mesh m = co_await gdr::bootstrap::connect_mesh(sched, rv);
///     int right = (m.rank() + 1) % m.size();
///     co_await m.peer(right).send(gdr::host_view(buf));
///     co_await m.close();
///   }());
/// \endcode
///
/// How it is built
/// ===============
/// 1. Every rank allgathers its host name and a random number; rank 0's
///    number becomes the mesh's session id.
/// 2. Every rank listens on an ephemeral port of its chosen address (below)
///    and allgathers "address:port".
/// 3. Every rank, at once: connects to every rank j > i and sends a hello (a
///    magic, the session id, i and the world size) as its first message,
///    with at most `mesh_options::max_connects_in_flight` connections under
///    way (the rest wait for a free one, in increasing rank order); and
///    accepts i connections, reading each one's hello, all at once, to learn
///    which lower rank it is. A connection whose hello is not of this
///    session (a stray client, another job) or names no lower rank is
///    closed and not counted; a silent one holds nobody up and is dropped
///    when the step ends. The same holds on both of a rank's listeners (TCP
///    and shared memory): a shared-memory connection's own handshake, too,
///    runs apart from the accepts, and one that fails it is closed. One
///    deadline (`mesh_options::timeout`) bounds the step; when it passes,
///    the rank names the lower ranks that did not connect and the higher
///    ones that did not answer.
/// 4. A final allgather of each rank's outcome: if any rank failed, every
///    rank throws, instead of some ranks waiting on a peer that gave up.
///
/// Which transport joins two ranks: shared memory (`gdr::shm`) when both
/// run on one node (the same boot id, IPC and network namespaces: what a
/// memfd and an abstract Unix socket need) and both chose it
/// (`mesh_options::same_node`, the default), TCP otherwise. Each rank
/// publishes its TCP address, its shared-memory listener's name and its
/// node's identity in step 2; `GDR_LOG=path` prints each endpoint's
/// transport with its paths.
/// Nothing waits for anything but the peer at the other end of a
/// connection: the listening sockets exist before any address is published,
/// the kernel completes TCP handshakes into the listen backlog, and every
/// rank accepts while it connects. Each rank makes n - 1 connections, at most
/// `max_connects_in_flight` of its own at a time, so what a rank does and
/// waits for grows with its connections, not with their square (the chain
/// this replaced, in which a rank accepted only after connecting and each
/// connection waited for the peer's accept, did; ranks that share a
/// machine's cores still add up their work: benchmarks/RESULTS.md, "Mesh
/// build time"). Connecting in increasing rank
/// order also spreads the load: at any moment a rank sees connections from
/// about `max_connects_in_flight` lower ranks.
///
/// Which address a rank listens on: `mesh_options::listen_host`, else
/// `GDR_MESH_HOST`, else the rendezvous' `address_hint()` (a TCP rendezvous
/// knows the address by which this rank reached rank 0), else 127.0.0.1 when
/// every rank runs on the same host (same host name), else the first IPv4
/// address of an interface that is up and not loopback.
///
/// Blocking: the rendezvous collectives block the scheduler's thread (setup
/// code; nothing else should run on it yet). `mesh_options::timeout` bounds
/// each collective and step 3 as a whole; failures throw `gdr::error` with
/// `errc::bootstrap_failed` and say which peer and which step (a rank that
/// does not arrive is named, by the ranks waiting for it in step 3 and by
/// the rendezvous in a collective).
///
/// Teardown: `co_await m.close()` closes every endpoint in order (flushing
/// sends); destroying a mesh with open endpoints aborts them (see
/// `tcp::endpoint`).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <gdr/bootstrap/detail/mesh_steps.hpp>
#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/coro/cancel.hpp>
#include <gdr/coro/scope.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/registration.hpp>
#include <gdr/memory/remote_view.hpp>  // detail::store_le64 / load_le64
#include <gdr/memory/view.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transport/shm/connect.hpp>
#include <gdr/transport/shm/endpoint.hpp>
#include <gdr/transport/tcp/connect.hpp>
#include <gdr/transport/tcp/endpoint.hpp>
#include <gdr/transport/tcp/listener.hpp>

namespace gdr::bootstrap {

/// Which transport `connect_mesh` uses between two ranks of one node.
enum class same_node_transport : std::uint8_t {
  shm,  ///< shared memory (`gdr::shm`): the default
  tcp,  ///< TCP, as between nodes
};

/// How `connect_mesh` builds the mesh.
///
/// Not an aggregate, on purpose: GCC 12 destroys an aggregate temporary
/// twice when it is made inside a `co_await` expression, and
/// `co_await connect_mesh(sched, rv)` makes one from the default argument.
/// Set the fields on a named object.
struct mesh_options {
  mesh_options() noexcept {}  // NOLINT: user-provided on purpose (see above)

  /// The numeric address to listen on and publish (see the file comment for
  /// what is used when empty).
  std::string listen_host{};
  /// Bound on each step: each collective, and step 3 as a whole (every
  /// connect, hello and accept of this rank).
  std::chrono::milliseconds timeout{30'000};
  /// How many of its connections a rank has under way at once (connect and
  /// hello); the others wait for a free one. At least 1.
  int max_connects_in_flight = 32;
  /// The registry the endpoints serve peers' put/get from.
  memory_registry* registry = &default_registry();
  /// Options of every TCP endpoint.
  tcp::endpoint_options endpoint{};
  /// Between ranks of one node (the same boot, IPC and network namespace):
  /// shared memory, unless this says TCP (or `GDR_MESH_SAME_NODE=tcp` is
  /// set). Both ranks of a pair must agree: each publishes its choice, and
  /// a pair uses shared memory only if both chose it.
  same_node_transport same_node = same_node_transport::shm;
  /// Options of every shared-memory endpoint.
  shm::endpoint_options shm_endpoint{};
};

/// One connected endpoint per other rank. Move-only.
///
/// The endpoints are `gdr::endpoint`s: the transport to each peer is decided
/// at run time (the bootstrap connects them over TCP; a mesh built some other
/// way may mix transports, e.g. loopback to ranks in this process). Each
/// moves what every transport moves (Host and Pinned memory) with the same
/// operations and rules.
///
/// Thread-safety: as its endpoints: use them on the scheduler's thread.
class mesh {
 public:
  mesh() = default;
  /// A mesh of endpoints connected some other way: `peers[r]` leads to rank
  /// `r`; `peers[rank]` is unused.
  mesh(int rank, std::vector<endpoint> peers) noexcept : rank_(rank), peers_(std::move(peers)) {}
  mesh(mesh&&) noexcept = default;
  mesh& operator=(mesh&&) noexcept = default;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return static_cast<int>(peers_.size()); }

  /// The endpoint to rank `r` (`r != rank()`).
  endpoint& peer(int r) noexcept { return peers_[static_cast<std::size_t>(r)]; }
  const endpoint& peer(int r) const noexcept { return peers_[static_cast<std::size_t>(r)]; }

  /// Closes every endpoint in order (see `basic_endpoint::close`), one after
  /// the other; the first failure is rethrown after all were closed.
  // A template, so that a translation unit that never closes a mesh does not
  // compile this coroutine and everything it reaches (gcc emits every
  // non-template inline coroutine where it is defined: about 0.4 s of
  // `#include <gdr/gdr.hpp>`, benchmarks/compile_cost.sh).
  template <class = void>
  task<> close() {
    std::error_code first;
    for (auto& ep : peers_) {
      if (!ep.is_open()) continue;
      auto op = ep.close();  // made outside the co_await: see mesh_options
      result<std::size_t> r = co_await std::move(op).as_result();
      if (!r && !first) first = r.error();
    }
    throw_if(first, "gdr::bootstrap::mesh::close");
  }

 private:
  int rank_ = 0;
  std::vector<endpoint> peers_;  // peers_[rank_] is not connected
};

namespace detail {

/// What step 3 of `build_mesh` shares among its coroutines (one scheduler,
/// one thread: no locks).
///
/// One deadline bounds the whole step: a single timer (`watch_deadline`)
/// stops everything still under way when it passes, and says who is
/// missing. The connects, hellos and accepts carry no timeout of their own
/// (an io_uring timeout armed and cancelled per operation costs, at n - 1
/// connections a rank, more than the step's one); they end on the step's
/// stop token.
struct mesh_build {
  const mesh_table* table;
  std::chrono::milliseconds timeout;
  std::chrono::steady_clock::time_point deadline;
  std::vector<endpoint> peers;
  std::vector<char> greeting;  // greeting[j]: a connection to higher rank j is under way
  std::string failure;
  int next;     // the next higher rank to connect to
  int missing;  // lower ranks whose hello has not arrived
  int running;  // connect workers and the accept loop still working
  linked_stop_source stop_step;       // ends the whole step (and the timer)
  linked_stop_source stop_accepting;  // ends the accepts (every lower rank is in)
  task_scope readers{};

  mesh_build(const mesh_table& t, std::chrono::milliseconds to, std::stop_token parent)
      : table(&t), timeout(to), deadline(std::chrono::steady_clock::now() + to),
        peers(static_cast<std::size_t>(t.size)), greeting(static_cast<std::size_t>(t.size), 0), failure(t.failure),
        next(t.rank + 1), missing(t.failure.empty() ? t.rank : 0), running(0), stop_step(std::move(parent)),
        stop_accepting(stop_step.get_token()) {}

  /// The first failure wins; it stops the rest of the step.
  void fail(std::string why) {
    if (failure.empty()) failure = std::move(why);
    readers.request_stop();
    stop_step.request_stop();
  }
  /// A worker or the accept loop is done; the last one ends the timer.
  void done() {
    if (--running == 0) stop_step.request_stop();
  }
  /// Who is missing when the deadline passes.
  std::string missing_ranks() const {
    std::vector<int> lower, higher;
    for (int i = 0; i < table->rank; ++i)
      if (!peers[static_cast<std::size_t>(i)].is_open()) lower.push_back(i);
    for (int j = table->rank + 1; j < table->size; ++j)
      if (greeting[static_cast<std::size_t>(j)]) higher.push_back(j);
    std::string s;
    if (!lower.empty()) s = ranks_list(lower) + " did not connect";
    if (!higher.empty()) s += (s.empty() ? "" : "; ") + ranks_list(higher) + " did not answer";
    return s.empty() ? "this rank's connections were not all made" : s;
  }
};

/// The step's one timer: at the deadline it fails the step, naming who is
/// missing; a stop (the step ended) ends it.
// The coroutines below are templates: gcc emits every non-template
// inline coroutine in each unit that sees it (benchmarks/compile_cost.sh).
template <class = void>
inline task<> watch_deadline(mesh_build& b) {
  auto t = sleep_until(b.deadline);
  result<void> r = co_await std::move(t).as_result();
  if (!r) co_return;
  b.fail("step 3 (connections): within " + std::to_string(b.timeout.count()) + " ms, " + b.missing_ranks());
}

/// The outcome of a `Net`'s connect or accept `op`, and in `why` what went
/// wrong: the words of the `gdr::error` it threw (which say more than its
/// code: the step of the transport's set-up that failed), else its error
/// code's message.
template <class E>
task<result<E>> net_outcome(task<result<E>> op, std::string& why) {
  try {
    result<E> r = co_await std::move(op);
    if (!r) why = r.error().message();
    co_return std::move(r);
  } catch (const error& e) {
    why = e.what();
    co_return e.code();
  }
}

/// One of `max_connects_in_flight` workers: connects to the next higher
/// rank and greets it, until none is left or something failed.
template <class Net>
task<> connect_higher(mesh_build& b, Net& net) {
  const mesh_table& t = *b.table;
  const auto hello = mesh_hello(t.session, t.rank, t.size);
  while (b.failure.empty() && b.next < t.size) {
    const int j = b.next++;
    const std::string& where = t.where[static_cast<std::size_t>(j)];
    b.greeting[static_cast<std::size_t>(j)] = 1;
    auto conn = net.connect(where, std::chrono::milliseconds(0));
    std::string why;
    auto ep = co_await net_outcome(std::move(conn), why);
    if (!ep) {
      b.fail("step 3 (connections): connecting to rank " + std::to_string(j) + " at " + where + ": " + why);
      break;
    }
    // Completes once the peer's endpoint said hello: once it accepted.
    auto send = ep->send(gdr::view<const std::byte, Host>(hello.data(), hello.size()));
    result<std::size_t> sent = co_await std::move(send).as_result();
    if (!sent) {
      b.fail("step 3 (connections): greeting rank " + std::to_string(j) + " at " + where + ": " +
             sent.error().message());
      break;
    }
    b.greeting[static_cast<std::size_t>(j)] = 0;
    b.peers[static_cast<std::size_t>(j)] = std::move(*ep);
  }
  b.done();
}

/// Reads the hello of one accepted connection and keeps it as the lower
/// rank it names, or closes it. A silent connection waits here, holding
/// nobody up, until the step ends.
template <class = void>
inline task<> read_mesh_hello(mesh_build& b, endpoint ep) {
  const mesh_table& t = *b.table;
  std::array<std::byte, mesh_hello_size + 8> h{};
  auto recv = ep.recv(gdr::view<std::byte, Host>(h.data(), h.size()));
  result<std::size_t> got = co_await std::move(recv).as_result();
  const int r = got ? mesh_hello_rank(h, *got, t.session, t.size, t.rank) : -1;
  if (r >= 0 && r < t.rank && !b.peers[static_cast<std::size_t>(r)].is_open() && b.failure.empty()) {
    b.peers[static_cast<std::size_t>(r)] = std::move(ep);
    if (--b.missing == 0) {
      // Everyone is here: the accept still pending, and hellos still being
      // read (stray clients), are not needed any more.
      b.stop_accepting.request_stop();
      b.readers.request_stop();
    }
    co_return;
  }
  // Not a rank of this mesh (or a duplicate): drop it.
  auto bye = ep.close(timeout_options(std::chrono::milliseconds(1000)));
  result<std::size_t> closed = co_await std::move(bye).as_result();
  (void)closed;  // whatever it was, it is gone
}

/// A connection from `Net`'s side listener (`node_net`: shared memory),
/// which is an endpoint only once its transport's handshake is done: runs
/// the handshake, then reads the hello as `read_mesh_hello` does. One that
/// fails the handshake (no gdr peer of that transport) is dropped; one that
/// says nothing waits here, holding nobody up, until the step ends (its
/// stop ends the handshake).
template <class Net, class C>
task<> open_and_read_hello(mesh_build& b, Net& net, C conn) {
  auto open = net.open_side(std::move(conn));
  std::string why;  // whatever it was, it is no rank of this mesh
  result<endpoint> ep = co_await net_outcome(std::move(open), why);
  if (ep) co_await read_mesh_hello(b, std::move(*ep));
}

/// Accepts on one of `Net`'s listeners until every lower rank is in,
/// handing each connection to a reader of its own (so that a silent one
/// holds nobody up): `net.accept`'s connections (endpoints), or with `Side`
/// `net.accept_side`'s (opened by their readers).
template <bool Side, class Net>
task<> accept_on(mesh_build& b, Net& net) {
  while (b.missing > 0 && b.failure.empty()) {
    auto acc = with_stop_token(b.stop_accepting.get_token(), [&] {
      if constexpr (Side) return net.accept_side();
      else return net.accept(std::chrono::milliseconds(0));
    }());
    std::string why;
    auto c = co_await net_outcome(std::move(acc), why);
    if (b.missing == 0 || !b.failure.empty()) break;  // stopped: done, or failed elsewhere
    if (!c) {
      b.fail("step 3 (connections): accepting: " + why);
      break;
    }
    if constexpr (Side) b.readers.spawn(open_and_read_hello(b, net, std::move(*c)));
    else b.readers.spawn(read_mesh_hello(b, endpoint(std::move(*c))));
  }
}

/// Accepts every lower rank, on each of `Net`'s listeners at once, then
/// waits for the readers.
template <class Net>
task<> accept_lower(mesh_build& b, Net& net) {
  std::vector<task<>> doors;
  doors.push_back(accept_on<false>(b, net));
  if constexpr (requires { net.accept_side(); })
    if (net.side_listening()) doors.push_back(accept_on<true>(b, net));
  co_await when_all(std::move(doors));
  co_await b.readers.join();
  b.done();
}

/// Bounds of `build_mesh`.
struct mesh_limits {
  std::chrono::milliseconds timeout{30'000};
  int max_connects_in_flight = 32;
};

/// Builds a mesh over the transport `net` stands for (the steps of the file
/// comment). `Net` gives:
///   * `std::string listen(const std::string& host)`: listens on `host`
///     (any port); returns why it could not, or nothing;
///   * `std::string published() const`: what other ranks connect to;
///   * `task<result<E>> connect(const std::string& where, std::chrono::milliseconds t)`
///     and `task<result<E>> accept(std::chrono::milliseconds t)`, `E` an
///     endpoint of the transport (converts to `gdr::endpoint`), bounded by
///     `t` (zero: by nothing but a stop request on the awaiting coroutine's
///     token); several connects may be under way at once, beside one
///     accept on each listener; a failure is an error code, or a
///     `gdr::error` thrown where the transport says more (its words end up
///     in the step's failure);
///   * optionally a side listener, accepted on beside the first, whose
///     connections become endpoints only after a handshake (`node_net`'s
///     shared memory): `bool side_listening() const`,
///     `task<result<C>> accept_side()` (the next connection, without its
///     handshake) and `task<result<E>> open_side(C)` (its handshake), both
///     bounded by a stop request only; each connection's handshake runs in
///     a coroutine of its own, so that one that says nothing holds nobody up;
///   * `void close()`: stops listening (no accept is under way then).
template <rendezvous R, class Net>
task<mesh> build_mesh(R& rv, std::string configured_host, mesh_limits lim, Net& net) {
  static constexpr const char* who = "connect_mesh";
  // 1, 2. Introductions, listening addresses.
  const mesh_table t = introduce_and_publish(rv, net, who, configured_host);

  // 3. Connect to the higher ranks and accept the lower ones, at once. (A
  // rank that could not listen, or learnt that another could not, skips to
  // step 4, where the failure reaches every rank.)
  std::stop_token parent = co_await this_stop_token;
  mesh_build b(t, lim.timeout, std::move(parent));
  if (b.failure.empty()) {
    std::vector<task<>> work;
    const int workers = std::min(std::max(lim.max_connects_in_flight, 1), t.size - 1 - t.rank);
    b.running = workers + 1;
    for (int w = 0; w < workers; ++w) work.push_back(connect_higher(b, net));
    work.push_back(accept_lower(b, net));
    work.push_back(watch_deadline(b));
    co_await with_stop_token(b.stop_step.get_token(), when_all(std::move(work)));
  }
  net.close();

  // 4. Everyone's outcome, so that no rank waits on a peer that gave up.
  std::vector<std::vector<std::byte>> outcomes;
  std::string report = b.failure;
  try {
    outcomes = gather_step(rv, bytes_of(b.failure), who, "step 4 (every rank's outcome)");
  } catch (const error& e) {
    if (report.empty()) report = reason_of(e);
  }
  for (int r = 0; r < static_cast<int>(outcomes.size()) && report.empty(); ++r)
    if (!outcomes[static_cast<std::size_t>(r)].empty())
      report = "rank " + std::to_string(r) + " failed: " + string_of(outcomes[static_cast<std::size_t>(r)]);
  mesh m(t.rank, std::move(b.peers));
  if (!report.empty()) {
    try {
      co_await m.close();
    } catch (const error&) {
      // Reporting the mesh failure matters more than a close failure.
    }
    if (report.rfind(mesh_prefix(who, t.rank, t.size), 0) == 0) throw error(errc::bootstrap_failed, report);
    mesh_fail(who, t.rank, t.size, report);
  }
  co_return m;
}

/// The TCP side of `build_mesh`.
struct tcp_net {
  scheduler* sched;
  const mesh_options* opts;
  std::optional<tcp::listener> listener{};

  std::string listen(const std::string& host) {
    const bool v6 = host.find(':') != std::string::npos;
    result<tcp::address> at = tcp::address::parse((v6 ? "[" + host + "]" : host) + ":0");
    if (!at) return "cannot listen on \"" + host + "\": not a numeric address";
    try {
      listener.emplace(*sched, *at, *opts->registry, opts->endpoint);
    } catch (const error& e) {
      return std::string("cannot listen on ") + host + ": " + e.what();
    }
    return {};
  }
  std::string published() const { return listener->local_address().to_string(); }
  template <class = void>
  task<result<tcp::endpoint>> connect(const std::string& where, std::chrono::milliseconds t) {
    auto conn = tcp::connect(*sched, where, detail::timeout_options(t), *opts->registry, opts->endpoint);
    co_return co_await std::move(conn).as_result();
  }
  template <class = void>
  task<result<tcp::endpoint>> accept(std::chrono::milliseconds t) {
    auto acc = listener->accept(detail::timeout_options(t));
    co_return co_await std::move(acc).as_result();
  }
  void close() {
    if (listener) listener->close();
  }
};

/// This node as shared memory sees it: the boot id, and the IPC and
/// network namespaces (a memfd crosses namespaces, an abstract socket name
/// does not). Empty if it cannot be read.
inline std::string node_identity() {
  std::string id;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char b[64] = {};
    if (std::fgets(b, sizeof b, f) != nullptr) id = b;
    std::fclose(f);
  }
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  for (const char* ns : {"/proc/self/ns/ipc", "/proc/self/ns/net"}) {
    char b[64] = {};
    ssize_t n = ::readlink(ns, b, sizeof b - 1);
    if (n <= 0 || id.empty()) return {};
    id += ",";
    id.append(b, static_cast<std::size_t>(n));
  }
  return id;
}

/// The side of `build_mesh` that picks the transport per peer: TCP, and
/// shared memory to ranks of this node (see the file comment). What it
/// publishes: "tcp address|shm name|node identity" (a rank that publishes
/// a plain address is reached over TCP). Lower ranks of this node connect
/// to the shared-memory listener (the side listener), the others to TCP's.
struct node_net {
  tcp_net tcp;
  std::optional<shm::listener> shm_listener{};
  std::string node{};

  node_net(scheduler& s, const mesh_options& o) : tcp{&s, &o} {
    const char* env = std::getenv("GDR_MESH_SAME_NODE");
    const bool want = o.same_node == same_node_transport::shm && !(env != nullptr && std::string(env) == "tcp");
    if (want) node = node_identity();
  }

  std::string listen(const std::string& host) {
    std::string why = tcp.listen(host);
    if (!why.empty() || node.empty()) return why;
    try {
      shm_listener.emplace(*tcp.sched, std::string(), *tcp.opts->registry, tcp.opts->shm_endpoint);
    } catch (const error&) {
      node.clear();  // no shared memory here: TCP to everyone
    }
    return {};
  }
  std::string published() const {
    return node.empty() ? tcp.published() : tcp.published() + "|" + shm_listener->name() + "|" + node;
  }
  /// Rank r's shared-memory name if it is on this node and chose it, else empty.
  std::string shm_name_of(const std::string& where) const {
    const auto a = where.find('|');
    if (node.empty() || a == std::string::npos) return {};
    const auto b = where.find('|', a + 1);
    if (b == std::string::npos || where.substr(b + 1) != node) return {};
    return where.substr(a + 1, b - a - 1);
  }
  template <class = void>
  task<result<endpoint>> connect(const std::string& where, std::chrono::milliseconds t) {
    if (std::string name = shm_name_of(where); !name.empty()) {
      try {
        shm::endpoint ep =
            co_await shm::connect(*tcp.sched, name, *tcp.opts->registry, tcp.opts->shm_endpoint, timeout_options(t));
        co_return endpoint(std::move(ep));
      } catch (const error& e) {
        throw error(e.code(), std::string("shared memory: ") + e.what());
      }
    }
    result<tcp::endpoint> r = co_await tcp.connect(where.substr(0, where.find('|')), t);
    if (!r) co_return r.error();
    co_return endpoint(std::move(*r));
  }
  /// The TCP listener's next connection.
  template <class = void>
  task<result<endpoint>> accept(std::chrono::milliseconds t) {
    result<tcp::endpoint> r = co_await tcp.accept(t);
    if (!r) co_return r.error();
    co_return endpoint(std::move(*r));
  }
  /// The side listener: shared memory. `accept_side` gives its next
  /// connection before the handshake, which `open_side` runs (in the
  /// connection's own reader): one that is no gdr peer, or says nothing,
  /// fails or waits there, apart from the accepts.
  bool side_listening() const noexcept { return shm_listener.has_value(); }
  template <class = void>
  task<result<shm::fd_handle>> accept_side() {
    try {
      co_return co_await shm_listener->accept_connection();
    } catch (const error& e) {
      throw error(e.code(), std::string("shared memory: ") + e.what());
    }
  }
  template <class = void>
  task<result<endpoint>> open_side(shm::fd_handle conn) {
    shm::endpoint ep = co_await shm_listener->handshake(std::move(conn));
    co_return endpoint(std::move(ep));
  }
  void close() {
    tcp.close();
    if (shm_listener) shm_listener->close();
  }
};

}  // namespace detail

/// Builds the mesh through `rv` (see the file comment): TCP, and shared
/// memory between ranks of one node. Collective: every rank calls it with
/// the same `rv` world. Throws `gdr::error` (`errc::bootstrap_failed`).
template <rendezvous R>
task<mesh> connect_mesh(scheduler& sched, R& rv, mesh_options opts = {}) {
  detail::node_net net(sched, opts);
  detail::mesh_limits lim;
  lim.timeout = opts.timeout;
  lim.max_connects_in_flight = opts.max_connects_in_flight;
  co_return co_await detail::build_mesh(rv, opts.listen_host, lim, net);
}

}  // namespace gdr::bootstrap
