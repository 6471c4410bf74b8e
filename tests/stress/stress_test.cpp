// The stress test in CI: a fixed set of seeds over loopback, TCP, shared
// memory (with Device memory staged, and by CUDA IPC's stand-in) and with a
// killed peer process, in both run modes, each run in a forked child
// (runner.hpp) so that a crash or a hang names its seed. Operation counts and
// bounds shrink under sanitizers; GDR_STRESS_TEST_SEEDS sets how many seeds
// run per transport and mode. A failure prints the runner's line and the
// command that replays it alone.
#include <doctest/doctest.h>


#include <cstdlib>
#include <string>
#include <vector>

#include "tests/stress/runner.hpp"
#include "tests/support/skip.hpp"
#include "tests/support/watchdog.hpp"

namespace {

using namespace stress;

// The seeds it runs: 1..24 per transport and run mode (fewer operations
// under sanitizers, where the same seed draws a smaller plan), about half
// a minute on the default build; GDR_STRESS_TEST_SEEDS=N runs 1..N. The
// long runs (thousands of seeds) are tools/stress/run_seeds.sh's.
std::vector<std::uint64_t> seeds() {
  std::uint64_t n = 24;
  if (const char* s = std::getenv("GDR_STRESS_TEST_SEEDS"); s && *s) n = std::strtoull(s, nullptr, 10);
  std::vector<std::uint64_t> v;
  for (std::uint64_t i = 1; i <= n; ++i) v.push_back(i);
  return v;
}

void run_seeds(std::vector<transport_kind> ts, const std::vector<std::uint64_t>& list = seeds()) {
  warm_up();  // before the watchdog: a run arms its own alarm
  std::vector<run_config> runs;
  const run_config base = default_config();
  for (transport_kind t : ts)
    for (gdr::run_mode m : {gdr::run_mode::busy_poll, gdr::run_mode::sleep})
      for (std::uint64_t s : list) {
        run_config c = base;
        c.transport = t;
        c.mode = m;
        c.seed = s;
        runs.push_back(c);
      }
  const auto limit = base.bound + std::chrono::milliseconds(15000);
  gdr_test_support::watchdog dog(static_cast<unsigned>(runs.size() * (limit.count() / 1000) + 60));
  // A broken engine fails many seeds, some by hanging until their bound:
  // after a few failures the rest are left out, so that CI ends in time.
  unsigned failed = 0;
  run_forked(
      runs, 1, limit,
      [&](const run_outcome& r) {
        failed += r.ok ? 0 : 1;
        const std::string replay = strf("bazel-bin/tests/stress/stress --transport %s --mode %s --seed %llu",
                                        to_string(r.config.transport), to_string(r.config.mode),
                                        static_cast<unsigned long long>(r.config.seed));
        INFO(describe(r.config), ": ", r.first, "\n  replay: ", replay, "\n", r.output.substr(0, 6000));
        CHECK(r.ok);
      },
      [&] { return failed < 3; });
}

}  // namespace

#if STRESS_VERBS
// The verbs build (stress_verbs_test, in the Soft-RoCE guest): puts and gets
// into exposed host memory go direct, by the initiator's NIC, with wrong
// keys refused by the owner's NIC and the one-sided lane reset.
TEST_CASE("seeded random traffic over verbs, direct one-sided operations included, holds every rule") {
  if (std::string why = verbs_fixture::skip_reason(); !why.empty()) GDR_SKIP(why);
  run_seeds({transport_kind::verbs});
}

TEST_CASE("seeds the long runs found hold over verbs: a lane that cannot reconnect as the peer closes waits for the close") {
  if (std::string why = verbs_fixture::skip_reason(); !why.empty()) GDR_SKIP(why);
  // A wrong key broke the lane; the peer closed in order while it was
  // reset, so it could not connect again: the operations it held failed
  // with EINVAL, then connection_lost, instead of the close's error.
  run_seeds({transport_kind::verbs}, {600160, 600219, 600627, 600730});
}
#else
TEST_CASE("every stream's fin has a size no other message of the stream has, even at the receiver's largest") {
  // Seed 401667 over TCP: the receiver took at most 4097 bytes and the
  // stream sent a 4097-byte message, so the fin fell back to 32 bytes, the
  // size of another message of the stream; a receive truncated to 2 bytes
  // of that message matched the fin's first 2 (the magic), the receiver
  // ended, and the real fin's send waited for ever (hang).
  unsigned fallbacks = 0;
  std::vector<std::uint64_t> list = {401667};
  for (std::uint64_t seed = 1; seed <= 3000; ++seed) list.push_back(seed);
  for (std::uint64_t seed : list) {
    const plan p = make_plan(seed, transport_kind::tcp, 1.0);
    for (const stream_plan& sp : p.streams) {
      const std::uint64_t limit = p.side[1 - sp.from].opts.max_message;
      const std::size_t fin = fin_size(sp, limit);
      CAPTURE(seed);
      CHECK(fin >= header_size);
      if (limit < header_size) continue;
      CHECK(fin <= limit);
      bool at_limit = false, shared = false;
      for (const send_plan& s : sp.sends) {
        shared = shared || s.size == fin;
        at_limit = at_limit || s.size == limit;
      }
      CHECK_FALSE(shared);
      fallbacks += at_limit ? 1 : 0;
    }
  }
  CHECK(fallbacks > 0);  // the rule's second half ran (seed 401667 at least)
}

TEST_CASE("seeded random traffic over loopback holds every rule, in both run modes") {
  run_seeds({transport_kind::loopback});
}

TEST_CASE("seeded random traffic over TCP holds every rule, in both run modes") {
  run_seeds({transport_kind::tcp});
}

TEST_CASE("seeded random traffic over TCP with socket buffers of a few KiB holds every rule, in both run modes") {
  // Writes come back short (a quarter of the runs, seeds 1-40), the
  // receiver's window closes: the paths that only a slow or full socket takes.
  run_seeds({transport_kind::tcp_tight});
}

TEST_CASE("seeded random traffic over shared memory holds every rule, in both run modes") {
  run_seeds({transport_kind::shm});
}

// Seeds a long run found failing, each fixed since; they run on the default
// plan sizes (under sanitizers the same seed draws a smaller plan, which may
// not reach the same moment).
TEST_CASE("seeded random traffic over shared memory with Device memory by CUDA IPC holds every rule, in both run modes") {
  run_seeds({transport_kind::shm_ipc});
}

TEST_CASE("seeds the first runs found hold over CUDA IPC: no single copy, a close after the copies, the hang-up after the reader") {
  // 568: a host payload sent as an address into a Device receive (single
  // copy and CUDA IPC together; now never both). 367: a put's source
  // released while the target's GPU copy of it was still queued (the
  // target ended its socket before the copy). 281, 238: an orderly close
  // read as a lost connection (the hang-up taken while the reader waited
  // for a GPU copy, before it had read the close frame). 516: a kept eager
  // message refusing a Device receive on a broken endpoint.
  run_seeds({transport_kind::shm_ipc}, {238, 281, 367, 516, 568});
}

TEST_CASE("seeds the long runs found hold over CUDA IPC: a closing side's unsent frames end with its close") {
  // 761032: the peer hung up after its close frame, which this side had
  // not read yet (its reader behind a pause, the copies in flight), while
  // this side was closing too: a receive whose rtr was never written
  // failed with peer_closed although the endpoint said closed. Frames that
  // never went now end with what the endpoint says, this side's close.
  run_seeds({transport_kind::shm_ipc}, {761032});
}

TEST_CASE("seeds the long runs found hold over CUDA IPC: frames written after the hang-up end with the end's error") {
  // 400342, 401848, 402060, 409538: the peer's endpoint broke and hung up
  // while a GPU copy deferred taking its end; frames written meanwhile
  // were released at once with peer_closed (the fix for frames written
  // after the hang-up, in its first form), although the peer had not
  // closed. They now wait for the end, which says the connection is lost.
  run_seeds({transport_kind::shm_ipc}, {400342, 401848, 402060, 409538});
}

TEST_CASE("seeds the long runs found hold over shared memory: a frame the peer read before it ended arrived") {
  // 781939: a receive's rtr waited in the writer's list behind a message
  // the peer was to copy from this side's memory (frames complete in
  // order). The peer read the rtr and sent the data, then closed and
  // ended; its end released the list with peer_closed, so the receive
  // failed and the message its sender saw succeed was lost. A frame that
  // is no copy itself and that the peer's reader has passed now completes.
  run_seeds({transport_kind::shm_ipc}, {781939});
}

TEST_CASE("seeds the long runs found hold over TCP: nothing follows a close frame") {
  // A put or get moved as segments posted its next request after the close
  // frame had been posted; the peer, its reader paused for an rx bounce
  // buffer, saw the end of stream behind a get_request instead of behind
  // the close frame and failed with connection_lost although the peer had
  // closed in order (both run modes; 13 of 134,302 runs).
  run_seeds({transport_kind::tcp}, {5644, 6326, 8744, 9564, 10741, 14056});
}

TEST_CASE("seeds the long runs found hold over TCP: a request's credit before its bounce buffer") {
  // Each side's only tx bounce buffer held a put's or get's request that
  // waited for a credit; the credits were held by this side's requests
  // that the peer served, and the peer's answers (gets of its Device
  // memory) waited for the peer's only tx bounce buffer, held the same
  // way: both sides waited for ever (hang-tx-slots, both run modes).
  run_seeds({transport_kind::tcp}, {28854, 47697});
  // The first version of that fix gave a request's credit back a second
  // time once its frame was written: the peer received more requests than
  // it has reply slots and paused; loopback pairs hung.
  run_seeds({transport_kind::loopback}, {50169, 50237, 61623});
}

TEST_CASE("seeds the long runs found hold over shared memory: the peer's end answering this side's close") {
  // This side's close frame was written behind payloads the peer copies
  // from this side's memory; the peer copied them, read the close and
  // ended before this side had taken the copy count, so the close frame
  // was not yet done and the peer's hang-up read as a lost connection
  // (both run modes; 3 of about 2,000 seeds).
  run_seeds({transport_kind::shm}, {5246, 5254, 5644});
}

TEST_CASE("seeds the long runs found hold over shared memory: committed frames, copies the peer will never make") {
  // A frame whole in the ring (done, or behind a payload the peer copies)
  // was withdrawn after this side failed, so a send reported timed_out or
  // cancelled while the peer, which reads what was written before the end,
  // received it (order failures: 10177, 100610, 103609, 103759). A peer in
  // its orderly end drops what it reads without copying, so payloads it
  // would copy held this side's bounce buffers, and its reader's pause,
  // until the connection's bound (103639, hang-tx-slots). Found on 16 cores.
  run_seeds({transport_kind::shm}, {10177, 100610, 103609, 103639, 103759});
}

TEST_CASE("seeds the long runs found hold over shared memory: a stopped send the peer answered after it ended") {
  // A Device send was stopped after the peer's receive matched it: its
  // rts_cancel waited in order behind a payload the peer copies, the peer
  // (closing) answered with an rtr and ended, and this side, its reader
  // paused, failed the send with peer_closed when the peer's hang-up
  // released the unread frames. The rtr, read after that, named no send
  // any more: a protocol error failed every other operation (both modes;
  // 1 of 13,289 seeds on 16 cores).
  run_seeds({transport_kind::shm}, {308687});
}

TEST_CASE("seeds the long runs found hold over shared memory: a close aborted while the peer could still copy") {
  // A shut-down connection holds payloads the peer may be copying until
  // the peer's end; the end came, the payloads were released, but the
  // linger timer that bounded the hold kept the connection from being
  // quiet, so the close took 2 s after the peer was killed (kill-slow).
  run_seeds({transport_kind::shm_kill}, {10087, 10117, 100960, 101840, 102023, 102188});
}

TEST_CASE("seeds the long runs found hold over shared memory: a frame written after the peer's hang-up") {
  // The peer closed (its hang-up came) while this side's reader was paused
  // on a reply slot whose answer waited for the peer's copy; the answers
  // written after the hang-up waited in sent_ for a copy that never came,
  // so the slot stayed taken, the reader paused, and the peer's close frame
  // unread: nothing completed after the peer was killed (kill-unnoticed).
  // Timing: before the fix these failed about once in 20 runs on a loaded
  // machine, rarely on an idle one (seed 16 of the list below too).
  run_seeds({transport_kind::shm_kill}, {1474, 8829});
}

TEST_CASE("a TCP peer process SIGKILLed at a random moment fails the survivor's operations in bounded time") {
  run_seeds({transport_kind::tcp_kill});
}

TEST_CASE("a shared-memory peer process SIGKILLed at a random moment fails the survivor's operations in bounded time") {
  run_seeds({transport_kind::shm_kill});
}
#endif
