// gdr/transport/shm/fd_table.hpp: the shared-memory connection's two
// descriptor tables, on their own (no GPU, no connection): fake
// allocations, the writer's table and the reader's driven as the
// connection drives them, and the invariant checked at every step: every
// allocation the reader may hold mapped is in the writer's table (and so
// named in a free notice once freed), never one the writer forgot.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include <gdr/transport/shm/fd_table.hpp>

namespace d = gdr::detail::shm;

namespace {

bool fd_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }
int new_fd() { return ::eventfd(0, EFD_CLOEXEC); }

/// A writer's table, a reader's, and what the reader's copy engine maps,
/// for allocations 0..n-1 (base 0x1000 * (i + 1), id 100 + i).
struct model {
  explicit model(int n) : alive(static_cast<std::size_t>(n), true) {}
  d::fd_table_out out;
  d::fd_table_in in;
  std::vector<bool> alive;
  std::set<int> mapped;           // the reader's mappings, by allocation
  std::uint32_t pending = 0;      // the ring's `released` bits
  std::uint64_t passed = 0, replaced = 0, let_go = 0;

  static std::uint64_t base(int a) { return 0x1000u * static_cast<std::uint64_t>(a + 1); }
  static std::uint64_t id(int a) { return 100u + static_cast<std::uint64_t>(a); }
  static int which(std::uint64_t base) { return static_cast<int>(base / 0x1000u) - 1; }

  /// Sends allocation `a` (export_ipc, then the reader's parse of its frame);
  /// false: every slot waits for the reader to let go.
  bool send(int a) {
    const d::fd_table_out::lookup at = out.find(base(a), id(a), pending);
    if (at.held) {
      out.touch(at.slot);
      CHECK(in.held(at.slot, base(a), id(a)) >= 0);  // the reader has it in that slot
      CHECK(mapped.count(a) == 1);
      return true;
    }
    if (at.slot == d::fd_slots) return false;
    out.put(at.slot, base(a), id(a));
    ++passed;
    REQUIRE(in.take(at.slot, base(a), id(a), new_fd(), [&](const d::fd_table_in::allocation& o) {
      mapped.erase(which(o.base));
      ++replaced;
    }));
    mapped.insert(a);  // the reader's copy engine imports it for the frame
    return true;
  }
  /// This side frees `a`; its next poll names the slots, the reader lets them go.
  void free(int a) {
    alive[static_cast<std::size_t>(a)] = false;
    const std::uint32_t mask =
        out.take_freed([&](std::uint64_t b, std::uint64_t) { return alive[static_cast<std::size_t>(which(b))]; });
    CHECK((mask & pending) == 0);
    pending |= mask;
  }
  void reader_polls() {
    let_go += in.release(pending, [&](const d::fd_table_in::allocation& o) { mapped.erase(which(o.base)); });
    pending = 0;
  }
  /// The invariant: what the reader maps, the writer's table holds (alive
  /// or freed and named in `pending`, not yet let go).
  void check() const {
    for (int a : mapped) {
      CAPTURE(a);
      if (alive[static_cast<std::size_t>(a)]) CHECK(out.find(base(a), id(a), 0).held);
      else CHECK(pending != 0);  // freed: named in the notice the reader has yet to read
    }
    CHECK(mapped.size() <= d::fd_slots);
    CHECK(in.in_use() == mapped.size());
  }
};

}  // namespace

TEST_CASE("40 allocations sent and freed: each replaced one is let go as its slot is taken, none stays mapped") {
  model m(40);
  for (int a = 0; a < 40; ++a) {
    REQUIRE(m.send(a));
    m.check();
  }
  CHECK(m.passed == 40);
  CHECK(m.replaced == 24);  // the 24 that lost their slot, let go as they lost it
  CHECK(m.mapped.size() == 16);
  for (int a = 0; a < 40; ++a) {
    m.free(a);
    m.check();
  }
  m.reader_polls();
  m.check();
  CHECK(m.let_go == 16);
  CHECK(m.mapped.empty());  // before the fix: the 24 replaced ones
  CHECK(m.in.in_use() == 0);
  CHECK(m.out.in_use() == 0);
}

TEST_CASE("seventeen in a cycle: the least recently used goes, and comes back by a new descriptor") {
  model m(17);
  for (int round = 0; round < 3; ++round)
    for (int a = 0; a < 17; ++a) {
      REQUIRE(m.send(a));
      m.check();
    }
  CHECK(m.passed == 17 + 2 * 17);  // every send after the first round passes again
  CHECK(m.replaced == m.passed - 16);
  for (int a = 0; a < 17; ++a) m.free(a);
  m.reader_polls();
  CHECK(m.mapped.empty());
}

TEST_CASE("random sends and frees keep the reader's mappings inside the writer's table") {
  for (std::uint64_t seed = 1; seed <= 50; ++seed) {
    CAPTURE(seed);
    std::uint64_t x = seed;
    auto next = [&] { return x = x * 6364136223846793005ull + 1442695040888963407ull, static_cast<int>(x >> 33); };
    model m(64);
    for (int step = 0; step < 400; ++step) {
      const int a = next() % 64;
      switch (next() % 4) {
        case 0:
        case 1:
          if (m.alive[static_cast<std::size_t>(a)] && !m.send(a)) m.reader_polls();  // full of freed slots: the reader lets go first
          break;
        case 2:
          if (m.alive[static_cast<std::size_t>(a)]) m.free(a);
          break;
        default: m.reader_polls();
      }
      m.check();
    }
    for (int a = 0; a < 64; ++a)
      if (m.alive[static_cast<std::size_t>(a)]) m.free(a);
    m.reader_polls();
    CHECK(m.mapped.empty());
  }
}

TEST_CASE("the reader's table refuses what a peer may send: a slot out of range, another allocation's slot, stray bits") {
  d::fd_table_in in;
  int let_go = 0;
  auto count = [&](const d::fd_table_in::allocation&) { ++let_go; };
  const int far = new_fd();
  CHECK_FALSE(in.take(d::fd_slots, 1, 2, far, count));
  CHECK_FALSE(fd_open(far));  // closed, not kept
  CHECK_FALSE(in.take(~0u, 1, 2, -1, count));
  CHECK(in.held(d::fd_slots, 1, 2) == -1);
  CHECK(in.held(~0u, 1, 2) == -1);
  CHECK(in.held(3, 1, 2) == -1);  // empty
  const int fd = new_fd();
  REQUIRE(in.take(3, 0x1000, 7, fd, count));
  CHECK(in.held(3, 0x1000, 7) == fd);
  CHECK(in.held(3, 0x1000, 8) == -1);  // another allocation (the id)
  CHECK(in.held(3, 0x2000, 7) == -1);  // another allocation (the base)
  CHECK(in.held(4, 0x1000, 7) == -1);  // another slot
  // Bits of no slot, and of empty slots: nothing.
  CHECK(in.release(~std::uint32_t{0} & ~(1u << 3), count) == 0);
  CHECK(let_go == 0);
  CHECK(fd_open(fd));
  // The same allocation passed again into its slot: the old descriptor goes
  // (and its mapping: imported again from the new one).
  const int again = new_fd();
  REQUIRE(in.take(3, 0x1000, 7, again, count));
  CHECK(let_go == 1);
  CHECK_FALSE(fd_open(fd));
  CHECK(in.release(~std::uint32_t{0}, count) == 1);
  CHECK(let_go == 2);
  CHECK_FALSE(fd_open(again));
  CHECK(in.in_use() == 0);
}

TEST_CASE("the writer's table never picks a slot the reader has yet to let go") {
  d::fd_table_out out;
  for (std::uint32_t i = 0; i < d::fd_slots; ++i) {
    const auto at = out.find(0x1000 * (i + 1), i, 0);
    REQUIRE_FALSE(at.held);
    REQUIRE(at.slot == i);  // the empty ones, in order
    out.put(at.slot, 0x1000 * (i + 1), i);
  }
  CHECK(out.find(0x999000, 99, 0).slot == 0);               // the least recently used
  CHECK(out.find(0x999000, 99, 1u).slot == 1);              // not one pending
  CHECK(out.find(0x999000, 99, 0xffffu).slot == d::fd_slots);  // none: wait
  out.touch(1);
  CHECK(out.find(0x999000, 99, 1u).slot == 2);
  CHECK(out.find(0x2000, 1, 0xffffu).held);  // held, pending or not
}

TEST_CASE("the reader's table closes every descriptor at its end") {
  std::vector<int> fds;
  {
    d::fd_table_in in;
    for (std::uint32_t i = 0; i < d::fd_slots; ++i) {
      fds.push_back(new_fd());
      REQUIRE(in.take(i, i, i, fds.back(), [](const auto&) {}));
    }
  }
  for (int fd : fds) CHECK_FALSE(fd_open(fd));
}
