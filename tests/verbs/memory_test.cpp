// Registration holds (gdr/transport/verbs/memory.hpp): a transfer's lease on
// a cached registration whose end does what the cache policy asks for. On a
// registration cache over a counting backend: no NIC needed, runs
// everywhere.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <gdr/error.hpp>
#include <gdr/memory/registration_cache.hpp>
#include <gdr/transport/verbs/memory.hpp>

namespace {

/// Counts live registrations; a handle is a number.
struct counting_backend {
  using handle_type = int;
  int* live = nullptr;
  gdr::result<int> register_range(std::uintptr_t, std::size_t) noexcept { return ++*live; }
  void deregister(int&) noexcept { --*live; }
};

using cache_t = gdr::registration_cache<counting_backend>;
using hold_t = gdr::verbs::basic_registration_hold<cache_t>;

hold_t hold_of(cache_t& c, const std::byte* p, std::size_t n, bool keep) {
  auto l = c.acquire(p, n);
  REQUIRE(l);
  return hold_t(std::move(*l), c, p, n, keep);
}

}  // namespace

TEST_CASE("a hold's end drops its registration from the cache unless registrations stay cached") {
  int live = 0;
  cache_t c(counting_backend{&live});
  std::vector<std::byte> buf(10000);
  {
    hold_t h = hold_of(c, buf.data(), buf.size(), false);
    CHECK(h);
    CHECK(live == 1);
  }
  CHECK(live == 0);  // not cached: gone with the hold
  CHECK(c.size() == 0);
  {
    hold_t h = hold_of(c, buf.data(), buf.size(), true);
  }
  CHECK(live == 1);  // cached: stays, idle
  CHECK(c.size() == 1);
  c.clear();
  CHECK(live == 0);
}

TEST_CASE("a hold ends once, however it ends: end(), assignment, a move, or a container erasing it") {
  int live = 0;
  cache_t c(counting_backend{&live});
  std::vector<std::byte> a(5000), b(5000);
  hold_t h = hold_of(c, a.data(), a.size(), false);
  h.end();
  CHECK(!h);
  CHECK(live == 0);
  h.end();  // idempotent
  h = hold_of(c, a.data(), a.size(), false);
  CHECK(live == 1);
  h = hold_of(c, b.data(), b.size(), false);  // the first one ends
  CHECK(live == 1);
  hold_t moved = std::move(h);
  CHECK(!h);
  CHECK(live == 1);
  // What the connection's grants are: held in a vector, erased in any order.
  struct grant {
    int id;
    hold_t reg;
  };
  std::vector<grant> grants;
  std::vector<std::vector<std::byte>> mem(4, std::vector<std::byte>(5000));
  for (int i = 0; i < 4; ++i) grants.push_back({i, hold_of(c, mem[i].data(), mem[i].size(), false)});
  CHECK(live == 5);
  grants.erase(grants.begin() + 1);
  CHECK(live == 4);
  grants.clear();
  CHECK(live == 1);
  moved = hold_t{};
  CHECK(live == 0);
}

TEST_CASE("a hold that ends drops a cached entry of its range that another transfer still leases only when that one ends") {
  int live = 0;
  cache_t c(counting_backend{&live});
  std::vector<std::byte> buf(10000);
  hold_t first = hold_of(c, buf.data(), buf.size(), false);
  hold_t second = hold_of(c, buf.data() + 100, 1000, false);  // a hit: the same registration
  CHECK(live == 1);
  second.end();
  CHECK(live == 1);  // still leased by the first
  CHECK(c.size() == 1);  // taken out of the index, freed at its last release
  first.end();
  CHECK(live == 0);
}
