/// \file
/// `gdr::bootstrap::lazy_mesh`: a mesh whose connection to a peer is made on
/// first use. Building it costs each rank one listening socket and two
/// collectives (the address table), whatever the world size; the endpoint
/// to rank r is connected when this rank first sends to r, receives from r
/// or asks for r's endpoint, or when r does so first. A job in which each
/// rank talks to a few peers (a ring, a stencil, a tree) makes a few
/// connections per rank instead of n - 1, as NCCL and UCX do.
///
/// \code
///   auto rv = gdr::bootstrap::tcp_rendezvous::from_env();
///   gdr::scheduler sched;
///   gdr::sync_wait(sched, [&]() -> gdr::task<> {
///     gdr::bootstrap::lazy_mesh m = co_await gdr::bootstrap::connect_lazy_mesh(sched, rv);
///     int right = (m.rank() + 1) % m.size(), left = (m.rank() + m.size() - 1) % m.size();
///     co_await gdr::when_all(m.send(right, gdr::host_view(out)),    // connects to right
///                            m.recv(left, gdr::host_view(in)));     // connects to left
///     gdr::endpoint& ep = co_await m.peer(right);                   // already connected
///     co_await ep.put(gdr::host_view(out), remote);
///     rv.barrier();                                                 // nobody closes early
///     co_await m.close();
///   }());
/// \endcode
///
/// How it works
/// ============
/// Built like the full mesh (`gdr/bootstrap/mesh.hpp`), steps 1 and 2 only:
/// the session id, then every rank listens and allgathers its address. From
/// then on every rank keeps accepting, in a coroutine of its own on the
/// scheduler, until the mesh is closed. The link to each peer is in one of
/// four states: none, connecting (this rank's connection is under way),
/// answering (a peer's connection was taken, its verdict is on the way) and
/// ready. Users get the endpoint only when it is ready.
///
/// First use of peer p (from none): the link becomes connecting and this
/// rank connects to p and sends a hello (magic, session id, rank, world
/// size); p answers with a verdict, take or refuse, the first message on
/// that connection. Take: the link is ready, and every coroutine waiting for
/// it resumes. Only `max_connects_in_flight` connections of a rank are under
/// way at once; the others wait for a free turn.
///
/// Both sides agree on one connection, also when both connect at once. A
/// rank that reads a hello from p decides at once, without suspending:
///   * its link to p is none: take the connection;
///   * it is connecting (both connected at once): the connection made by the
///     lower rank wins: take p's if p is lower, refuse it if p is higher;
///   * it is answering or ready: refuse (a duplicate).
/// Taking makes the link answering; once the verdict is sent it is ready
/// (if it cannot be sent, the peer is gone: the link is none again). So when
/// a and b < a connect at once, a takes b's connection and b refuses a's (b
/// is connecting and a is higher), whatever the order in which the hellos
/// and verdicts cross: exactly one connection survives. A rank whose
/// connection was refused keeps its link connecting and waits, bounded by
/// `mesh_options::timeout`, for the peer's connection, which its accept side
/// then takes.
///
/// Progress. A connection is answered by the peer's scheduler: the peer must
/// be running it (awaiting anything, as it does for the one-sided requests
/// it serves). A peer blocked outside its scheduler (in a rendezvous
/// collective, or computing) answers when it returns to it; a first use
/// waits up to `mesh_options::timeout` for that.
///
/// Errors. A connection that cannot be made fails the waiting operations
/// with `errc::bootstrap_failed` and a sentence naming the peer, its address
/// and the step; the link goes back to none, so a later use tries again. An
/// endpoint that fails later (the peer died) stays in the link: its
/// operations fail as any endpoint's do (`errc::connection_lost`); it is not
/// reconnected.
///
/// Teardown. `co_await m.close()` stops accepting, fails the operations
/// still waiting for a connection with `errc::closed`, and closes every
/// connected endpoint in order. Close only once the peers are done with this
/// rank (a barrier): a peer's first use after that is refused. Destroying a
/// lazy mesh without closing it aborts its endpoints and stops its
/// coroutines, which finish on the scheduler's next turns (at the latest in
/// its destructor); destroying it while a coroutine waits on it is a bug
/// (asserted).
///
/// Thread-safety: everything on the scheduler's thread, as endpoints.
#pragma once

#include <array>
#include <cassert>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include <gdr/bootstrap/detail/mesh_steps.hpp>
#include <gdr/bootstrap/mesh.hpp>
#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/coro/cancel.hpp>
#include <gdr/coro/task.hpp>
#include <gdr/error.hpp>
#include <gdr/memory/view.hpp>
#include <gdr/protocol/endpoint.hpp>
#include <gdr/sched/cancellable.hpp>
#include <gdr/sched/scheduler.hpp>
#include <gdr/sched/timer.hpp>
#include <gdr/transfer/common.hpp>

namespace gdr::bootstrap {

/// What a lazy mesh's rank did to make its connections.
struct lazy_mesh_stats {
  std::uint64_t connects = 0;         ///< connections this rank started (first uses, and retries)
  std::uint64_t accepted = 0;         ///< peers' connections taken
  std::uint64_t refused = 0;          ///< peers' connections refused (both connected at once and this one won, or a duplicate)
  std::uint64_t refused_by_peer = 0;  ///< this rank's connections the peer refused (its own won)
  std::uint64_t failed = 0;           ///< connection attempts that failed
};

class lazy_mesh;

namespace detail {

class lazy_state;

/// A lazy mesh around a state already started (`connect_lazy_mesh`; tests
/// build two in one thread this way, without a rendezvous).
lazy_mesh make_lazy_mesh(std::shared_ptr<lazy_state> s) noexcept;

/// The link to one peer: `co_await` gives its endpoint once connected.
/// Made by `lazy_mesh::peer`; lives in the awaiting coroutine's frame.
class link_wait : public gdr::detail::cancellable<link_wait> {
 public:
  link_wait(std::shared_ptr<lazy_state> s, int peer, op_options opts) noexcept
      : s_(std::move(s)), peer_(peer), opts_(std::move(opts)) {}
  link_wait(link_wait&&) noexcept = default;  // before it is awaited
  link_wait& operator=(link_wait&&) = delete;

  bool await_ready() noexcept;
  template <class P>
  void await_suspend(std::coroutine_handle<P> h) noexcept {
    h_ = h;
    prime();
    enlist();
    arm(opts_.stop, gdr::detail::stop_token_of(h), opts_.timeout);
  }
  /// The endpoint to the peer. Throws `gdr::error`.
  endpoint& await_resume();

 private:
  friend class gdr::detail::cancellable<link_wait>;
  friend class lazy_state;

  // The hooks of gdr::detail::cancellable (see gdr/sched/cancellable.hpp).
  scheduler& cancel_scheduler() const noexcept;
  void on_stop(std::error_code why) noexcept {
    delist();
    finish(why, why == errc::timed_out ? "the connection was not made within the operation's timeout"
                                       : "the wait for the connection was stopped");
  }
  void on_settled() noexcept { h_.resume(); }
  template <class F>
  void in_event(F&& f) noexcept {
    f();
  }

  void enlist() noexcept;
  void delist() noexcept;
  /// The outcome (from the mesh, or a stop): resumes once settled.
  void finish(std::error_code ec, const char* why) noexcept {
    if (done_) return;
    done_ = true;
    ec_ = ec;
    why_ = why;
    settle();
  }

  std::shared_ptr<lazy_state> s_;
  int peer_;
  op_options opts_;
  std::error_code ec_{};
  const char* why_ = "";   // static text, or the link's last failure (copied at resume)
  std::string failure_{};  // the link's failure, copied when it was reported
  std::coroutine_handle<> h_{};
  link_wait* prev_ = nullptr;
  link_wait* next_ = nullptr;
  bool listed_ = false;
  bool done_ = false;
};

/// A coroutine that nobody awaits: it runs a task of the mesh to its end,
/// holding the mesh's state alive, then tells the state it finished.
struct detached {
  struct promise_type {
    detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }  // the body catches everything
  };
};

/// The transport under a lazy mesh, erased (the mesh is one type for all).
struct lazy_net {
  virtual ~lazy_net() = default;
  virtual task<result<endpoint>> connect(const std::string& where, std::chrono::milliseconds t) = 0;
  virtual task<result<endpoint>> accept(std::chrono::milliseconds t) = 0;
  virtual void close() = 0;
};

/// `Net` (see `build_mesh`) as a `lazy_net`; `net` is the transport itself,
/// used directly for steps 1 and 2.
template <class Net>
struct lazy_net_of final : lazy_net {
  Net net;
  explicit lazy_net_of(Net n) : net(std::move(n)) {}
  task<result<endpoint>> connect(const std::string& where, std::chrono::milliseconds t) override {
    auto c = net.connect(where, t);
    auto r = co_await std::move(c);
    if (!r) co_return r.error();
    co_return endpoint(std::move(*r));
  }
  task<result<endpoint>> accept(std::chrono::milliseconds t) override {
    auto a = net.accept(t);
    std::string why;  // the accept loop goes on whatever the words
    auto r = co_await net_outcome(std::move(a), why);
    if (!r) co_return r.error();
    co_return endpoint(std::move(*r));
  }
  void close() override { net.close(); }
};

/// The verdict a rank answers a hello with: magic, then 1 (take) or 0.
inline constexpr std::uint64_t lazy_verdict_magic = 0x3156'534d'5244'4701ull;

/// Everything a lazy mesh is; shared by the `lazy_mesh` handle and by the
/// coroutines it runs (each holds it alive). Scheduler's thread only.
class lazy_state : public std::enable_shared_from_this<lazy_state> {
 public:
  static constexpr const char* who = "lazy_mesh";

  lazy_state(scheduler& s, const mesh_options& o) : sched_(&s), opts_(o) {}
  lazy_state(const lazy_state&) = delete;
  lazy_state& operator=(const lazy_state&) = delete;
  ~lazy_state() { assert(tasks_ == 0); }

  /// The transport (made before steps 1 and 2, which use it directly).
  template <class Net>
  Net& set_net(Net n) {
    auto p = std::make_unique<lazy_net_of<Net>>(std::move(n));
    Net& raw = p->net;
    net_ = std::move(p);
    return raw;
  }
  const mesh_options& options() const noexcept { return opts_; }

  /// After steps 1 and 2: the table, and the accept loop starts.
  void start(mesh_table t) {
    table_ = std::move(t);
    links_.resize(static_cast<std::size_t>(table_.size));
    spawn(accept_loop());
  }

  int rank() const noexcept { return table_.rank; }
  int size() const noexcept { return table_.size; }
  scheduler& sched() const noexcept { return *sched_; }
  const lazy_mesh_stats& stats() const noexcept { return stats_; }
  bool connected(int r) const noexcept {
    return r >= 0 && r < size() && links_[static_cast<std::size_t>(r)].state == link_state::ready;
  }
  bool closing() const noexcept { return closing_; }
  int connections() const noexcept {
    int c = 0;
    for (const auto& l : links_) c += l.state == link_state::ready;
    return c;
  }

  /// `close()`'s first half: nothing new starts; waiters fail with
  /// `errc::closed`; coroutines stop.
  void begin_close() noexcept {
    if (closing_) return;
    closing_ = true;
    stop_.request_stop();
    for (std::size_t r = 0; r < links_.size(); ++r) fail_waiters(static_cast<int>(r), errc::closed, "the mesh was closed");
    // Connections waiting for a turn give up (see connect_turn).
    std::deque<std::coroutine_handle<>> q = std::move(turns_);
    turns_.clear();
    for (auto h : q) h.resume();
  }
  /// The endpoints to close, in rank order.
  std::vector<endpoint*> open_endpoints() {
    std::vector<endpoint*> v;
    for (auto& l : links_)
      if (l.ep.is_open()) v.push_back(&l.ep);
    return v;
  }
  /// Awaits the mesh's coroutines (after `begin_close`), then stops listening.
  auto join() noexcept {
    struct awaiter {
      lazy_state* s;
      bool await_ready() const noexcept { return s->tasks_ == 0; }
      void await_suspend(std::coroutine_handle<> h) noexcept { s->closer_ = h; }
      void await_resume() const noexcept { s->net_->close(); }
    };
    return awaiter{this};
  }
  /// The handle was dropped without `close()`: abort, and let the
  /// coroutines finish on their own.
  void abandon() noexcept {
    for ([[maybe_unused]] const auto& l : links_)
      assert(l.waiters == nullptr && "lazy_mesh destroyed while a coroutine waits on it");
    begin_close();
    for (auto& l : links_) l.ep = endpoint();
  }

 private:
  friend class link_wait;

  enum class link_state : std::uint8_t { none, connecting, answering, ready };
  struct link {
    link_state state = link_state::none;
    std::uint64_t gen = 0;  // counts state changes: a coroutine that set one knows whether it still holds
    endpoint ep{};
    link_wait* waiters = nullptr;  // doubly linked through prev_/next_
    std::string failure{};         // why the last attempt failed
  };

  link& at(int r) noexcept { return links_[static_cast<std::size_t>(r)]; }
  std::string prefix() const { return mesh_prefix(who, rank(), size()); }
  const std::string& where(int r) const { return table_.where[static_cast<std::size_t>(r)]; }

  // ---- the mesh's coroutines -------------------------------------------

  static detached run_detached(std::shared_ptr<lazy_state> self, task<> t) {
    try {
      co_await with_stop_token(self->stop_.get_token(), std::move(t));
    } catch (...) {
      // Each body reports its own failures; what escapes is a cancellation
      // or an allocation failure, and the link it was for says so.
    }
    if (--self->tasks_ == 0 && self->closer_) std::exchange(self->closer_, {}).resume();
  }
  void spawn(task<> t) {
    ++tasks_;
    try {
      run_detached(shared_from_this(), std::move(t));
    } catch (...) {
      --tasks_;
      throw;
    }
  }

  /// A turn among the `max_connects_in_flight` connections under way.
  /// Resumes with false when the mesh closed meanwhile (no turn taken).
  auto connect_turn() noexcept {
    struct awaiter {
      lazy_state* s;
      bool queued = false;
      bool await_ready() noexcept {
        if (s->in_flight_ < std::max(s->opts_.max_connects_in_flight, 1)) {
          ++s->in_flight_;
          return true;
        }
        return false;
      }
      bool await_suspend(std::coroutine_handle<> h) {
        s->turns_.push_back(h);
        queued = true;
        return true;
      }
      // Queued and resumed: a finishing connection handed its turn over,
      // unless the mesh is closing.
      bool await_resume() const noexcept { return !(queued && s->closing_); }
    };
    return awaiter{this};
  }
  void end_turn() noexcept {
    if (!closing_ && !turns_.empty()) {
      auto h = turns_.front();
      turns_.pop_front();
      h.resume();  // the turn passes to it
      return;
    }
    --in_flight_;
  }

  /// Starts connecting to `p` (its link becomes connecting).
  std::error_code start_connect(int p) noexcept {
    set_state(p, link_state::connecting);
    ++stats_.connects;
    try {
      spawn(connect_to(p));
    } catch (...) {
      set_state(p, link_state::none);
      return errno_code(ENOMEM);
    }
    return {};
  }

  // The coroutines below are templates: gcc emits every non-template
  // inline coroutine in each unit that sees it (benchmarks/compile_cost.sh).
  template <class = void>
  task<> connect_to(int p) {
    bool refused = false;
    {
      if (!co_await connect_turn()) co_return;
      struct turn_guard {
        lazy_state* s;
        ~turn_guard() { s->end_turn(); }
      } guard{this};
      std::string broke;
      try {
        refused = co_await attempt(p);
      } catch (const std::exception& e) {
        broke = e.what();  // allocation failures: the link must not stay connecting
      }
      if (!broke.empty() && !closing_) attempt_failed(p, "connecting to rank " + std::to_string(p) + ": " + broke);
    }
    // Refused: p's own connection is the link. Waiting for it holds no turn
    // (a turn held here would keep this rank's other connections waiting on
    // a lower rank's progress).
    if (refused) co_await await_peer(p);
  }

  /// One connection to `p` (see the file comment), under a turn. True when
  /// p refused it and its own connection is to come.
  template <class = void>
  task<bool> attempt(int p) {
    // The peer's connection may have been taken while this one waited.
    if (closing_ || at(p).state != link_state::connecting) co_return false;
    const std::chrono::milliseconds t = opts_.timeout;
    const std::string step = "connecting to rank " + std::to_string(p) + " at " + where(p);
    auto conn = net_->connect(where(p), t);
    result<endpoint> ep = co_await std::move(conn);
    if (closing_) co_return false;
    if (!ep) {
      attempt_failed(p, step + ": " + ep.error().message());
      co_return false;
    }
    const auto hello = mesh_hello(table_.session, rank(), size());
    auto send = ep->send(gdr::view<const std::byte, Host>(hello.data(), hello.size()), timeout_options(t));
    result<std::size_t> sent = co_await std::move(send).as_result();
    if (closing_) co_return false;
    if (!sent) {
      attempt_failed(p, step + ": greeting it: " + sent.error().message());
      co_return false;
    }
    std::array<std::byte, 16> v{};
    auto recv = ep->recv(gdr::view<std::byte, Host>(v.data(), v.size()), timeout_options(t));
    result<std::size_t> got = co_await std::move(recv).as_result();
    if (closing_) co_return false;
    if (!got || *got != v.size() || gdr::detail::load_le64(v.data()) != lazy_verdict_magic) {
      attempt_failed(p, step + ": its verdict: " + (got ? std::string("malformed") : got.error().message()));
      co_return false;
    }
    if (gdr::detail::load_le64(v.data() + 8) == 1) {
      // Taken: p holds this connection as the link, so this rank does too.
      // (The link is normally still connecting: p took it because its own
      // link was none, or connecting with this rank lower, and in both
      // cases this rank refuses p's connection. It may be none or answering
      // when p's own attempt failed meanwhile, and a connection of p's that
      // this rank is answering is dead; it loses to this one.)
      if (at(p).state != link_state::ready) link_ready(p, std::move(*ep));  // ready: cannot happen; keep the first
      co_return false;
    }
    // Refused: p was connecting too and is the lower rank, or holds a
    // connection to this rank already. Its own connection is the one; this
    // one is dropped (p closes its side).
    ++stats_.refused_by_peer;
    co_return true;
  }

  /// After a refusal: waits, bounded by the mesh's timeout, for p's own
  /// connection to become the link.
  template <class = void>
  task<> await_peer(int p) {
    if (closing_ || at(p).state != link_state::connecting) co_return;
    const std::chrono::milliseconds t = opts_.timeout;
    link_wait w(shared_from_this(), p, timeout_options(t));
    std::error_code why;
    try {
      (void)co_await w;
    } catch (const error& e) {
      why = e.code();
    }
    // Ready, closed, or failed by the accept side (which told the waiters).
    if (closing_ || at(p).state != link_state::connecting) co_return;
    attempt_failed(p, "rank " + std::to_string(p) + " refused this rank's connection (its own was under way) but its " +
                          "own did not arrive within " + std::to_string(t.count()) + " ms (" + why.message() + ")");
  }

  template <class = void>
  task<> accept_loop() {
    // No deadline: the loop ends when the mesh stops it.
    constexpr std::chrono::milliseconds forever = std::chrono::hours(24 * 365);
    while (!closing_) {
      auto acc = net_->accept(forever);
      result<endpoint> ep = co_await std::move(acc);
      if (closing_) co_return;
      if (!ep) {
        if (is_cancellation(ep.error()) || ep.error() == errc::closed) co_return;
        // Out of descriptors or memory, or a connection reset while queued:
        // try again shortly.
        auto pause = sleep_for(*sched_, std::chrono::milliseconds(50));
        (void)co_await std::move(pause).as_result();
        continue;
      }
      spawn(answer(std::move(*ep)));
    }
  }

  /// Reads an accepted connection's hello and answers it (see the file
  /// comment for the rule).
  template <class = void>
  task<> answer(endpoint ep) {
    std::array<std::byte, mesh_hello_size + 8> h{};
    auto recv = ep.recv(gdr::view<std::byte, Host>(h.data(), h.size()),
                        timeout_options(std::min(opts_.timeout, hello_bound)));
    result<std::size_t> got = co_await std::move(recv).as_result();
    const int p = got ? mesh_hello_rank(h, *got, table_.session, size(), rank()) : -1;
    if (closing_) co_return;
    if (p < 0) {
      // Not a rank of this mesh: drop it.
      auto bye = ep.close(timeout_options(std::chrono::milliseconds(1000)));
      (void)co_await std::move(bye).as_result();
      co_return;
    }
    // Decide and take without suspending in between: the link's state is
    // the one the rule saw.
    link& l = at(p);
    const bool take = l.state == link_state::none || (l.state == link_state::connecting && p < rank());
    std::array<std::byte, 16> v{};
    gdr::detail::store_le64(v.data(), lazy_verdict_magic);
    gdr::detail::store_le64(v.data() + 8, take ? 1 : 0);
    if (!take) {
      ++stats_.refused;
      auto no = ep.send(gdr::view<const std::byte, Host>(v.data(), v.size()), timeout_options(opts_.timeout));
      (void)co_await std::move(no).as_result();
      auto bye = ep.close(timeout_options(std::chrono::milliseconds(1000)));
      (void)co_await std::move(bye).as_result();
      co_return;
    }
    ++stats_.accepted;
    set_state(p, link_state::answering);  // users wait until the verdict is out
    const std::uint64_t mine = at(p).gen;
    auto yes = ep.send(gdr::view<const std::byte, Host>(v.data(), v.size()), timeout_options(opts_.timeout));
    result<std::size_t> sent = co_await std::move(yes).as_result();
    // Closing, or this rank's own connection won meanwhile (see attempt):
    // this one is not the link.
    if (closing_ || at(p).gen != mine) co_return;
    // The peer went away before the link was of any use (it gave up
    // waiting, say): the link is none again, and a later use tries anew.
    if (!sent) {
      ++stats_.failed;
      co_return link_failed(p, "answering rank " + std::to_string(p) + ": " + sent.error().message());
    }
    link_ready(p, std::move(ep));
  }

  // ---- links -------------------------------------------------------------

  void set_state(int p, link_state st) noexcept {
    at(p).state = st;
    ++at(p).gen;
  }
  void link_ready(int p, endpoint ep) {
    set_state(p, link_state::ready);
    at(p).ep = std::move(ep);
    wake_waiters(p);
  }
  /// This rank's own attempt failed: the link fails, unless it is no longer
  /// the attempt's (the peer's connection was taken meanwhile).
  void attempt_failed(int p, std::string why) {
    ++stats_.failed;
    if (at(p).state == link_state::connecting) link_failed(p, std::move(why));
  }
  void link_failed(int p, std::string why) {
    link& l = at(p);
    set_state(p, link_state::none);
    l.ep = endpoint();
    l.failure = prefix() + why;
    fail_waiters(p, errc::bootstrap_failed, nullptr);
  }
  /// Takes the list first: a resumed waiter may wait again (a new attempt).
  link_wait* take_waiters(int p) noexcept {
    link_wait* w = std::exchange(at(p).waiters, nullptr);
    for (link_wait* i = w; i != nullptr; i = i->next_) i->listed_ = false;
    return w;
  }
  void wake_waiters(int p) noexcept {
    for (link_wait* w = take_waiters(p); w != nullptr;) {
      link_wait* next = w->next_;
      w->finish({}, "");
      w = next;
    }
  }
  /// `why` null: the link's failure sentence.
  void fail_waiters(int p, std::error_code ec, const char* why) noexcept {
    for (link_wait* w = take_waiters(p); w != nullptr;) {
      link_wait* next = w->next_;
      if (why == nullptr) {
        try {
          w->failure_ = at(p).failure;
        } catch (...) {
          w->failure_.clear();
        }
      }
      w->finish(ec, why == nullptr ? "" : why);
      w = next;
    }
  }

  scheduler* sched_;
  mesh_options opts_;
  std::unique_ptr<lazy_net> net_{};
  mesh_table table_{};
  std::vector<link> links_{};
  lazy_mesh_stats stats_{};
  std::stop_source stop_{};
  bool closing_ = false;
  int tasks_ = 0;                      // detached coroutines running
  std::coroutine_handle<> closer_{};   // close() waiting for them
  int in_flight_ = 0;                  // connections holding a turn
  std::deque<std::coroutine_handle<>> turns_{};  // connections waiting for one
};

inline scheduler& link_wait::cancel_scheduler() const noexcept { return s_->sched(); }

inline bool link_wait::await_ready() noexcept {
  if (!s_ || s_->closing()) {
    ec_ = errc::closed;
    why_ = "the mesh was closed";
    return true;
  }
  if (peer_ < 0 || peer_ >= s_->size() || peer_ == s_->rank()) {
    ec_ = errc::invalid_argument;
    why_ = "no such peer";
    return true;
  }
  auto& l = s_->at(peer_);
  if (l.state == lazy_state::link_state::none) {
    if (std::error_code ec = s_->start_connect(peer_)) {
      ec_ = ec;
      return true;
    }
  }
  return l.state == lazy_state::link_state::ready;
}

inline void link_wait::enlist() noexcept {
  auto& head = s_->at(peer_).waiters;
  prev_ = nullptr;
  next_ = head;
  if (head != nullptr) head->prev_ = this;
  head = this;
  listed_ = true;
}

inline void link_wait::delist() noexcept {
  if (!listed_) return;
  auto& head = s_->at(peer_).waiters;
  if (prev_ != nullptr) prev_->next_ = next_;
  else head = next_;
  if (next_ != nullptr) next_->prev_ = prev_;
  listed_ = false;
}

inline endpoint& link_wait::await_resume() {
  if (ec_) {
    std::string what = !failure_.empty() ? failure_ : mesh_prefix(lazy_state::who, s_ ? s_->rank() : -1,
                                                                  s_ ? s_->size() : 0) +
                                                          "rank " + std::to_string(peer_) + ": " + why_;
    throw error(ec_, what);
  }
  return s_->at(peer_).ep;
}

}  // namespace detail

/// A mesh whose endpoints are connected on first use (see the file
/// comment). Move-only.
class lazy_mesh {
 public:
  lazy_mesh() = default;
  lazy_mesh(lazy_mesh&&) noexcept = default;
  lazy_mesh& operator=(lazy_mesh&& o) noexcept {
    if (this != &o) {
      drop();
      s_ = std::move(o.s_);
    }
    return *this;
  }
  ~lazy_mesh() { drop(); }

  int rank() const noexcept { return s_ ? s_->rank() : 0; }
  int size() const noexcept { return s_ ? s_->size() : 0; }

  /// `co_await m.peer(r)`: the endpoint to rank `r`, connected first if this
  /// is the first use of `r` (by either side). `opts` bound that wait (its
  /// stop token, its timeout); the connection itself is bounded by
  /// `mesh_options::timeout`, and finishes for later use when the wait is
  /// stopped. Throws `gdr::error`: `errc::bootstrap_failed` (the connection
  /// could not be made; the sentence says why), `errc::closed`,
  /// `errc::invalid_argument` (`r` is this rank or outside the world),
  /// `errc::cancelled`, `errc::timed_out`. The reference stays valid until
  /// the mesh is closed or destroyed.
  [[nodiscard]] detail::link_wait peer(int r, op_options opts = {}) const noexcept { return {s_, r, std::move(opts)}; }

  /// Sends `v` to rank `r` (tag `t`), connecting first on first use. `opts`
  /// bound the wait for the connection and then the send (see `peer` and
  /// `basic_endpoint::send`). Completes with the bytes sent.
  template <gdr::detail::proto::viewable V>
  task<std::size_t> send(int r, V&& v, tag t = tag{0}, op_options opts = {}) const {
    return send_view(r, gdr::detail::proto::as_view(v), t, std::move(opts));
  }
  /// Receives the next message of tag `t` from rank `r` into `v`,
  /// connecting first on first use. Completes with the message's size.
  template <gdr::detail::proto::viewable V>
  task<std::size_t> recv(int r, V&& v, tag t = tag{0}, op_options opts = {}) const {
    return recv_view(r, gdr::detail::proto::as_view(v), t, std::move(opts));
  }

  /// Holds a connection to `r` now (no first use needed).
  bool connected(int r) const noexcept { return s_ && s_->connected(r); }
  /// How many peers this rank holds a connection to.
  int connections() const noexcept { return s_ ? s_->connections() : 0; }
  /// What this rank did to make its connections.
  lazy_mesh_stats stats() const noexcept { return s_ ? s_->stats() : lazy_mesh_stats{}; }

  /// Stops accepting, fails the operations still waiting for a connection
  /// (`errc::closed`), closes every connected endpoint in order (see
  /// `basic_endpoint::close`), then waits for the mesh's coroutines. The
  /// first close failure is rethrown after all were closed. `stats()` and
  /// `connected()` still answer afterwards.
  // A template for the reason `mesh::close` is one (compile cost).
  template <class = void>
  task<> close() {
    if (!s_) co_return;
    std::shared_ptr<detail::lazy_state> s = s_;
    s->begin_close();
    std::error_code first;
    for (endpoint* ep : s->open_endpoints()) {
      auto op = ep->close();  // made outside the co_await: see mesh_options
      result<std::size_t> r = co_await std::move(op).as_result();
      if (!r && !first) first = r.error();
    }
    co_await s->join();
    throw_if(first, "gdr::bootstrap::lazy_mesh::close");
  }

 private:
  friend lazy_mesh detail::make_lazy_mesh(std::shared_ptr<detail::lazy_state>) noexcept;

  explicit lazy_mesh(std::shared_ptr<detail::lazy_state> s) noexcept : s_(std::move(s)) {}

  template <class T, class S>
  task<std::size_t> send_view(int r, view<T, S> v, tag t, op_options opts) const {
    auto w = peer(r, opts);
    endpoint& ep = co_await std::move(w);
    auto op = ep.send(v, t, std::move(opts));
    co_return co_await std::move(op);
  }
  template <class T, class S>
  task<std::size_t> recv_view(int r, view<T, S> v, tag t, op_options opts) const {
    auto w = peer(r, opts);
    endpoint& ep = co_await std::move(w);
    auto op = ep.recv(v, t, std::move(opts));
    co_return co_await std::move(op);
  }

  void drop() noexcept {
    if (s_) std::exchange(s_, nullptr)->abandon();
  }

  std::shared_ptr<detail::lazy_state> s_;
};

inline lazy_mesh detail::make_lazy_mesh(std::shared_ptr<detail::lazy_state> s) noexcept {
  return lazy_mesh(std::move(s));
}

/// Builds a lazy mesh over TCP through `rv` (steps 1 and 2 of the full
/// mesh; see the file comment): no connection is made yet. Collective:
/// every rank calls it with the same `rv` world. `opts.listen_host` as for
/// `connect_mesh`; `opts.timeout` bounds the collectives and each
/// connection made later; `opts.max_connects_in_flight` the connections
/// under way at once. Throws `gdr::error(errc::bootstrap_failed)`, on every
/// rank when one cannot listen.
template <rendezvous R>
task<lazy_mesh> connect_lazy_mesh(scheduler& sched, R& rv, mesh_options opts = {}) {
  auto s = std::make_shared<detail::lazy_state>(sched, opts);
  auto& net = s->set_net(detail::tcp_net{&sched, &s->options()});
  detail::mesh_table t = detail::introduce_and_publish(rv, net, detail::lazy_state::who, opts.listen_host);
  if (!t.failure.empty()) detail::mesh_fail(detail::lazy_state::who, t.rank, t.size, "step 2 (listening addresses): " + t.failure);
  s->start(std::move(t));
  co_return detail::make_lazy_mesh(std::move(s));
}

}  // namespace gdr::bootstrap
