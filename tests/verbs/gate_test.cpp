// The NIC gate's states (gdr/transport/verbs/gate.hpp): a served put's READ
// and the GPUDirect flush, and what a stop means for the placement's memory
// in each state. No NIC needed: runs everywhere.
#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

#include <gdr/transport/verbs/gate.hpp>

using gdr::detail::verbs::nic_gate;
using state = nic_gate::state;
using released = nic_gate::released;

namespace {
std::byte mem[4096];
}

TEST_CASE("a put's READs run one at a time until all are read, then the gate opens") {
  nic_gate g;
  CHECK(g.is_open());
  g.start_read(mem, 3000, 0x1000, 7, -1);
  CHECK(g.current() == state::read_ready);
  CHECK(!g.in_flight());
  g.read_posted();
  CHECK(g.in_flight());
  auto o = g.read_returned(1024, true, false);
  CHECK(o.now == state::read_ready);  // more to read
  CHECK(!o.stopped);
  CHECK(g.read.done == 1024);
  g.read_posted();
  o = g.read_returned(1976, true, false);
  CHECK(o.now == state::open);
  CHECK(g.is_open());
  CHECK(g.read.dst == nullptr);  // the job (and its registration) is gone
}

TEST_CASE("a READ into GPU memory that needs the flush is followed by the flush, then the gate opens") {
  nic_gate g;
  g.start_read(mem, 100, 0x1000, 7, 0);
  g.read_posted();
  auto o = g.read_returned(100, true, true);
  CHECK(o.now == state::flush_ready);
  CHECK(g.flush.addr == mem);
  g.flush_posted();
  CHECK(g.in_flight());
  o = g.flush_returned(true, false);
  CHECK(o.now == state::open);
  CHECK(!o.stopped);
}

TEST_CASE("a stop frees the memory at once unless a READ may still be writing it") {
  nic_gate g;
  CHECK(g.abort() == released::now);  // open: nothing to stop
  g.start_read(mem, 100, 0, 0, -1);
  CHECK(g.abort() == released::now);  // waiting for a slot: nothing in flight
  CHECK(g.is_open());
  g.start_read(mem, 100, 0, 0, -1);
  g.read_posted();
  CHECK(g.abort() == released::later);  // the READ may be writing
  CHECK(g.stopped());
  CHECK(g.current() == state::read_posted);
  auto o = g.read_returned(100, true, false);
  CHECK(o.now == state::open);
  CHECK(o.stopped);  // the connection tells the engine now (on_target_released)
  CHECK(!g.stopped());
  // A stopped READ that had more to read does not go on.
  g.start_read(mem, 200, 0, 0, -1);
  g.read_posted();
  CHECK(g.abort() == released::later);
  o = g.read_returned(100, true, false);
  CHECK(o.now == state::open);
  CHECK(o.stopped);
}

TEST_CASE("a stopped flush frees the memory at once; its READ, if out, still comes back") {
  nic_gate g;
  g.start_flush(mem);
  CHECK(g.abort() == released::now);  // waiting for room: dropped
  CHECK(g.is_open());
  g.start_flush(mem);
  g.flush_posted();
  CHECK(g.abort() == released::now);  // the READ writes only the scratch word
  CHECK(g.in_flight());               // the connection is not quiet until it is back
  auto o = g.flush_returned(true, false);
  CHECK(o.now == state::open);
  CHECK(o.stopped);  // no placement to complete
}

TEST_CASE("a failed flush is tried again once when asked, never after a stop") {
  nic_gate g;
  g.start_flush(mem);
  g.flush_posted();
  auto o = g.flush_returned(false, true);
  CHECK(o.now == state::flush_ready);
  CHECK(g.flush.retries == 1);
  g.flush_posted();
  o = g.flush_returned(false, false);  // given up: the connection fails
  CHECK(o.now == state::open);
  CHECK(!o.stopped);
  g.start_flush(mem);
  g.flush_posted();
  (void)g.abort();
  o = g.flush_returned(false, true);
  CHECK(o.now == state::open);  // stopped: no retry
}

TEST_CASE("a failed connection opens a gate that waits for resources, not one with a READ out") {
  nic_gate g;
  CHECK(!g.drop_waiting());
  g.start_read(mem, 100, 0, 0, -1);
  CHECK(g.drop_waiting());
  CHECK(g.is_open());
  g.start_read(mem, 100, 0, 0, -1);
  g.read_posted();
  CHECK(!g.drop_waiting());
  auto o = g.read_returned(0, false, false);  // flushed back
  CHECK(o.now == state::open);
  CHECK(!o.stopped);
  g.start_flush(mem);
  CHECK(g.drop_waiting());
  CHECK(g.is_open());
}
