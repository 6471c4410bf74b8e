// gdr/memory/registration_cache.hpp: hits, misses, alignment, no merging,
// LRU eviction within bounds, invalidation, failures (also out of memory),
// threads.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gdr/coro/scope.hpp>
#include <gdr/coro/sync_wait.hpp>
#include <gdr/memory/registration_cache.hpp>

#include "tests/support/alloc_failure.hpp"
#include "tests/support/capture_stderr.hpp"
#include "tests/support/watchdog.hpp"

using gdr::errc;

namespace {

// A backend that records what it registered: addresses are never touched, so
// tests use made-up ones. Shared state so the test can look at it while the
// cache owns the backend.
struct fake_state {
  std::mutex mu;
  std::map<int, std::pair<std::uintptr_t, std::size_t>> live;  // id -> range
  int next_id = 1;
  int registrations = 0;
  int deregistrations = 0;
  bool fail_next = false;
};

struct fake_backend {
  struct handle_type {
    int id = 0;
    std::uintptr_t base = 0;
    std::size_t len = 0;
  };
  fake_state* st;

  gdr::result<handle_type> register_range(std::uintptr_t addr, std::size_t len) noexcept {
    std::lock_guard lock(st->mu);
    if (std::exchange(st->fail_next, false)) return gdr::errno_code(ENOMEM);
    int id = st->next_id++;
    st->live[id] = {addr, len};
    ++st->registrations;
    return handle_type{id, addr, len};
  }
  void deregister(handle_type& h) noexcept {
    std::lock_guard lock(st->mu);
    REQUIRE(st->live.erase(h.id) == 1);  // never twice, never unknown
    ++st->deregistrations;
  }
};

static_assert(gdr::registration_backend<fake_backend>);
static_assert(gdr::registration_backend<gdr::registry_backend<gdr::Host>>);
static_assert(gdr::retiring_backend<gdr::registry_backend<gdr::Host>>);
static_assert(!gdr::retiring_backend<fake_backend>);

const void* at(std::uintptr_t a) { return reinterpret_cast<const void*>(a); }

using cache_t = gdr::registration_cache<fake_backend>;

gdr::registration_cache_options opts(std::size_t entries, std::size_t bytes = std::numeric_limits<std::size_t>::max(),
                                     std::size_t align = 4096) {
  gdr::registration_cache_options o;
  o.max_entries = entries;
  o.max_bytes = bytes;
  o.alignment = align;
  return o;
}

}  // namespace

TEST_CASE("a second acquire of a range, or of a part of it, hits the cached registration") {
  fake_state st;
  cache_t cache(fake_backend{&st});
  {
    auto l1 = cache.acquire(at(0x10000), 100).value();
    CHECK(l1.base() == 0x10000);
    CHECK(l1.length() == 4096);  // widened to a page
    auto l2 = cache.acquire(at(0x10010), 50).value();
    CHECK(l2.handle().id == l1.handle().id);
  }
  auto l3 = cache.acquire(at(0x10fff), 1).value();  // the last byte of the page
  CHECK(l3.handle().id == 1);
  CHECK(st.registrations == 1);
  auto s = cache.stats();
  CHECK(s.misses == 1);
  CHECK(s.hits == 2);
}

TEST_CASE("ranges are widened to the alignment so neighbouring buffers share a registration") {
  fake_state st;
  cache_t cache(fake_backend{&st}, opts(16, std::numeric_limits<std::size_t>::max(), 1 << 16));
  auto a = cache.acquire(at(0x12345), 10).value();
  CHECK(a.base() == 0x10000);
  CHECK(a.length() == 0x10000);
  auto b = cache.acquire(at(0x1ff00), 0x100).value();
  CHECK(b.handle().id == a.handle().id);
  // With alignment 1 the registration is exactly the range.
  fake_state st2;
  cache_t exact(fake_backend{&st2}, opts(16, std::numeric_limits<std::size_t>::max(), 1));
  auto e = exact.acquire(at(0x12345), 10).value();
  CHECK(e.base() == 0x12345);
  CHECK(e.length() == 10);
}

TEST_CASE("a partly covered range gets a registration of its own: entries are never merged") {
  fake_state st;
  cache_t cache(fake_backend{&st});
  auto a = cache.acquire(at(0x10000), 4096).value();  // [0x10000, 0x11000)
  auto b = cache.acquire(at(0x11000), 4096).value();  // adjacent: [0x11000, 0x12000)
  CHECK(a.handle().id != b.handle().id);
  // Spans both adjacent entries: neither covers it alone, so a third, overlapping one.
  auto c = cache.acquire(at(0x10800), 4096).value();
  CHECK(c.base() == 0x10000);
  CHECK(c.length() == 0x2000);
  CHECK(st.registrations == 3);
  CHECK(cache.size() == 3);
  // Now a range inside the big one hits it, and the small ones still exist.
  auto d = cache.acquire(at(0x10f00), 0x200).value();
  CHECK(d.handle().id == c.handle().id);
  auto e = cache.acquire(at(0x11000), 10).value();
  CHECK((e.handle().id == b.handle().id || e.handle().id == c.handle().id));
}

TEST_CASE("at the entry bound the least recently released idle entry is evicted first") {
  fake_state st;
  cache_t cache(fake_backend{&st}, opts(3));
  for (std::uintptr_t p : {0x10000u, 0x20000u, 0x30000u}) (void)cache.acquire(at(p), 8).value();  // released at once
  (void)cache.acquire(at(0x10000), 8).value();  // 0x10000 becomes the most recent
  auto l = cache.acquire(at(0x40000), 8).value();  // evicts 0x20000, the least recent
  CHECK(cache.stats().evictions == 1);
  CHECK(cache.size() == 3);
  {
    std::lock_guard lock(st.mu);
    for (auto& [id, range] : st.live) CHECK(range.first != 0x20000);
  }
  CHECK(cache.acquire(at(0x10000), 8).value().handle().id == 1);  // still cached: a hit
  CHECK(cache.stats().hits == 2);
}

TEST_CASE("leased entries are never evicted; with every entry leased a miss is busy") {
  fake_state st;
  cache_t cache(fake_backend{&st}, opts(2));
  auto a = cache.acquire(at(0x10000), 8).value();
  auto b = cache.acquire(at(0x20000), 8).value();
  gdr::result<cache_t::lease> c = cache.acquire(at(0x30000), 8);
  REQUIRE(!c);
  CHECK(c.error() == errc::busy);
  CHECK(st.registrations == 2);
  b.release();
  auto d = cache.acquire(at(0x30000), 8).value();  // evicts b, now idle
  CHECK(st.deregistrations == 1);
  CHECK(a.handle().id == 1);
  CHECK(cache.stats().failures == 1);
}

TEST_CASE("the byte bound evicts idle entries, and a range larger than it is refused") {
  fake_state st;
  cache_t cache(fake_backend{&st}, opts(100, 3 * 4096));
  for (std::uintptr_t p : {0x10000u, 0x20000u, 0x30000u}) (void)cache.acquire(at(p), 8).value();
  CHECK(cache.registered_bytes() == 3 * 4096);
  (void)cache.acquire(at(0x40000), 5000).value();  // two pages: evicts the two least recent
  CHECK(cache.stats().evictions == 2);
  CHECK(cache.registered_bytes() == 3 * 4096);
  gdr::result<cache_t::lease> big = cache.acquire(at(0x100000), 4 * 4096);
  REQUIRE(!big);
  CHECK(big.error() == errc::invalid_argument);
}

TEST_CASE("invalidate removes every overlapping entry: idle ones now, leased ones at release") {
  fake_state st;
  cache_t cache(fake_backend{&st});
  auto held = cache.acquire(at(0x10000), 8).value();       // [0x10000, 0x11000)
  (void)cache.acquire(at(0x11000), 8).value();             // [0x11000, 0x12000), idle
  (void)cache.acquire(at(0x12000), 8).value();             // [0x12000, 0x13000), idle
  (void)cache.acquire(at(0x20000), 8).value();             // far away
  CHECK(cache.invalidate(at(0x10ff0), 0x1010) == 2);        // [0x10ff0, 0x12000): the first two
  CHECK(st.deregistrations == 1);                           // the idle one only
  CHECK(cache.size() == 3);                                 // the held one is still registered
  // New acquires of invalidated addresses miss; the held lease still works.
  auto again = cache.acquire(at(0x10000), 8).value();
  CHECK(again.handle().id != held.handle().id);
  CHECK(held.handle().id == 1);
  held.release();
  CHECK(st.deregistrations == 2);
  // A range that only touches an entry's edge does not invalidate it.
  CHECK(cache.invalidate(at(0x13000), 0x1000) == 0);
  CHECK(cache.invalidate(at(0x1f000), 0x1000) == 0);
  CHECK(cache.invalidate(at(0x1f000), 0x1001) == 1);
}

TEST_CASE("without invalidation a freed and reused address range hits the stale registration") {
  // The pitfall the header warns about, made visible: the cache cannot see
  // free(); the user must call invalidate() first.
  fake_state st;
  cache_t cache(fake_backend{&st});
  int first = cache.acquire(at(0x50000), 64).value().handle().id;
  // "free" the buffer and "allocate" a new one at the same address:
  CHECK(cache.acquire(at(0x50000), 64).value().handle().id == first);  // stale hit
  cache.invalidate(at(0x50000), 64);  // what the user must do before freeing
  CHECK(cache.acquire(at(0x50000), 64).value().handle().id != first);
}

TEST_CASE("a backend failure is passed on and nothing is cached") {
  fake_state st;
  cache_t cache(fake_backend{&st});
  st.fail_next = true;
  gdr::result<cache_t::lease> r = cache.acquire(at(0x10000), 8);
  REQUIRE(!r);
  CHECK(r.error() == std::errc::not_enough_memory);
  CHECK(cache.size() == 0);
  CHECK(cache.acquire(at(0x10000), 8).has_value());
  CHECK(cache.stats().failures == 1);
}

TEST_CASE("empty and wrapping ranges are invalid; a range ending at the top of the address space works") {
  fake_state st;
  cache_t cache(fake_backend{&st});
  constexpr std::uintptr_t top = std::numeric_limits<std::uintptr_t>::max();
  CHECK(cache.acquire(at(0x10000), 0).error() == errc::invalid_argument);
  CHECK(cache.acquire(at(top - 3), 8).error() == errc::invalid_argument);
  CHECK(cache.acquire(at(0x10000), std::numeric_limits<std::size_t>::max()).error() == errc::invalid_argument);
  // [top - 100, top): its end cannot be rounded up to a page without wrapping.
  auto l = cache.acquire(at(top - 100), 100).value();
  CHECK(l.base() == (top & ~std::uintptr_t{4095}));
  CHECK(l.base() + l.length() == top);
  CHECK(cache.acquire(at(top - 10), 5).value().handle().id == l.handle().id);
  CHECK(cache.invalidate(at(top - 1), 1000) == 1);  // clamped at the top, no wrap
}

TEST_CASE("clear deregisters every idle entry and the destructor the rest") {
  fake_state st;
  {
    cache_t cache(fake_backend{&st});
    auto held = cache.acquire(at(0x10000), 8).value();
    (void)cache.acquire(at(0x20000), 8).value();
    cache.clear();
    CHECK(st.deregistrations == 1);
    held.release();
    CHECK(st.deregistrations == 2);
    (void)cache.acquire(at(0x30000), 8).value();
  }
  CHECK(st.deregistrations == 3);
  CHECK(st.live.empty());
}

TEST_CASE("the registry backend caches gdr registrations that resolve for peers") {
  gdr::memory_registry reg;
  std::vector<std::byte> mem(10000);
  gdr::registration_cache cache(gdr::registry_backend<gdr::Host>(reg, gdr::access::write), opts(8));
  auto lease = cache.acquire(gdr::host_view(mem).subview(100, 200)).value();
  auto rv = lease.handle().describe(3);
  CHECK(rv.size() == 200);
  CHECK(reg.resolve(rv.address(), 200, rv.key(), gdr::access::write).has_value());
  lease.release();
  cache.clear();
  CHECK(!reg.resolve(rv.address(), 200, rv.key(), gdr::access::write));
  CHECK(reg.size() == 0);
}

TEST_CASE("concurrent acquire, release and invalidate keep the cache consistent") {
  fake_state st;
  {
    cache_t cache(fake_backend{&st}, opts(16));
    std::atomic<int> wrong{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t) {
      ts.emplace_back([&, t] {
        for (int i = 0; i < 3000; ++i) {
          std::uintptr_t p = 0x100000 + static_cast<std::uintptr_t>((i * 7 + t) % 40) * 0x1000;
          gdr::result<cache_t::lease> l = cache.acquire(at(p + 16), 32);
          if (l) {
            if (l->base() > p + 16 || l->base() + l->length() < p + 48) ++wrong;
          } else if (l.error() != errc::busy) {
            ++wrong;
          }
          if (i % 50 == t) cache.invalidate(at(p), 0x1000);
        }
      });
    }
    for (auto& th : ts) th.join();
    CHECK(wrong == 0);
    CHECK(cache.size() <= 16);
  }
  CHECK(st.live.empty());
  CHECK(st.registrations == st.deregistrations);
}

namespace {

// A backend that allocates nothing, for tests that make allocations fail.
struct counting_backend {
  using handle_type = int;
  int* registered;
  int* deregistered;
  gdr::result<int> register_range(std::uintptr_t, std::size_t) noexcept { return ++*registered; }
  void deregister(int&) noexcept { ++*deregistered; }
};

}  // namespace

TEST_CASE("out of memory for its index, acquire fails with not_enough_memory and undoes the registration") {
  // Before the fix the index's allocation threw inside noexcept acquire():
  // std::terminate.
  int registered = 0, deregistered = 0;
  gdr::registration_cache<counting_backend> cache(counting_backend{&registered, &deregistered});
  gdr::result<gdr::registration_cache<counting_backend>::lease> r = gdr::errc::busy;
  long failed = 0;
  {
    gdr_test_support::failing_allocations oom(1);  // the entry, not the index's node
    r = cache.acquire(at(0x10000), 8);
    failed = oom.failed();
  }
  CHECK(failed == 1);
  REQUIRE(!r);
  CHECK(r.error() == std::errc::not_enough_memory);
  CHECK(registered == 1);
  CHECK(deregistered == 1);  // undone
  CHECK(cache.size() == 0);
  CHECK(cache.registered_bytes() == 0);
  CHECK(cache.stats().failures == 1);
  CHECK(cache.acquire(at(0x10000), 8).has_value());  // and the cache still works
}

TEST_CASE("invalidate and clear allocate nothing, so they work out of memory") {
  // Before the fix both collected the entries in a vector first: an
  // allocation failure inside noexcept functions, std::terminate.
  int registered = 0, deregistered = 0;
  gdr::registration_cache<counting_backend> cache(counting_backend{&registered, &deregistered});
  for (std::uintptr_t p : {0x10000u, 0x11000u, 0x12000u, 0x20000u, 0x30000u}) (void)cache.acquire(at(p), 8).value();
  auto held = cache.acquire(at(0x20000), 8).value();
  std::size_t invalidated = 0;
  long failed = 0;
  {
    gdr_test_support::failing_allocations oom;
    invalidated = cache.invalidate(at(0x10000), 0x11000);  // [0x10000, 0x21000): four entries
    failed = oom.failed();
  }
  CHECK(failed == 0);
  CHECK(invalidated == 4);
  CHECK(deregistered == 3);  // the held one at its release
  {
    gdr_test_support::failing_allocations oom;
    cache.clear();
    failed = oom.failed();
  }
  CHECK(failed == 0);
  CHECK(deregistered == 4);
  held.release();
  CHECK(deregistered == 5);
  CHECK(cache.size() == 0);
  CHECK(cache.stats().invalidations == 5);
}

namespace {

std::uint64_t address_of(const std::byte* p) { return reinterpret_cast<std::uint64_t>(p); }

using registry_cache = gdr::registration_cache<gdr::registry_backend<gdr::Host>>;

gdr::task<> invalidate_and_wait_into(registry_cache& cache, const std::byte* p, std::size_t n,
                                     gdr::result<std::size_t>& out, bool& done) {
  out = co_await cache.invalidate_and_wait(p, n);
  done = true;
}

}  // namespace

TEST_CASE("the registry backend exposes exactly the acquired range, with the access asked for") {
  // A peer's put of the whole remote view, served as a transport serves it.
  // Before the fix the key covered the page around the 100 bytes (ASan:
  // heap-buffer-overflow at the view's start), and allowed reads too.
  gdr::memory_registry reg;
  auto mem = std::make_unique<std::byte[]>(100);  // on the heap: ASan sees the bytes around it
  const std::uint64_t at100 = address_of(mem.get());
  registry_cache cache(gdr::registry_backend<gdr::Host>(reg, gdr::access::write));  // default options: pages
  auto lease = cache.acquire(mem.get(), 100).value();
  const auto rv = lease.handle().describe(0);
  {
    auto put = reg.acquire(rv.address(), rv.size_bytes(), rv.key(), gdr::access::write);
    REQUIRE(put.has_value());
    std::memset(put->data(), 0x5a, put->size());
  }
  CHECK(rv.address() == at100);
  CHECK(rv.size_bytes() == 100);
  CHECK(lease.base() == at100);
  CHECK(lease.length() == 100);
  CHECK_FALSE(reg.acquire(at100 - 1, 1, rv.key(), gdr::access::write));    // a byte before
  CHECK_FALSE(reg.acquire(at100 + 100, 1, rv.key(), gdr::access::write));  // a byte after
  CHECK_FALSE(reg.acquire(at100, 1, rv.key(), gdr::access::read));         // not asked for
  // A part of the range is a range of its own: it does not lend the key of
  // the whole (which would expose more than was acquired).
  auto part = cache.acquire(mem.get() + 10, 20).value();
  CHECK(part.handle().key() != lease.handle().key());
  CHECK(part.handle().describe(0).size_bytes() == 20);
  // The same range again is a hit.
  CHECK(cache.acquire(mem.get(), 100).value().handle().key() == lease.handle().key());
  CHECK(cache.stats().hits == 1);
  part.release();
  lease.release();
  cache.clear();
  CHECK(reg.size() == 0);
}

TEST_CASE("invalidate_and_wait refuses while a lease is held, then waits for the peers' accesses being served") {
  // Before the fix invalidation could not wait: invalidate() revoked and
  // returned while a peer's put was still being served, and freeing the
  // memory next let the put write freed memory (ASan: heap-use-after-free).
  gdr_test_support::watchdog wd(30);
  gdr::scheduler s;
  gdr::memory_registry reg;
  auto mem = std::make_unique<std::byte[]>(100);
  registry_cache cache(gdr::registry_backend<gdr::Host>(reg, gdr::access::write));
  auto lease = cache.acquire(mem.get(), 100).value();
  const auto rv = lease.handle().describe(0);
  gdr::access_lease put = reg.acquire(rv.address(), 100, rv.key(), gdr::access::write).value();  // being served
  gdr::result<std::size_t> refused = std::size_t{0}, waited = gdr::errc::busy;
  bool refused_done = false, waited_done = false, done_before_release = true, new_access_refused = false;
  std::string said = gdr_test_support::capture_stderr([&] {
    gdr::sync_wait(s, [&]() -> gdr::task<> {
      co_await invalidate_and_wait_into(cache, mem.get(), 100, refused, refused_done);  // a lease is held
      lease.release();
      gdr::task_scope scope;
      scope.spawn(invalidate_and_wait_into(cache, mem.get(), 100, waited, waited_done));
      done_before_release = waited_done;
      new_access_refused = !reg.acquire(rv.address(), 1, rv.key(), gdr::access::write);
      std::thread peer([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::memset(put.data(), 1, put.size());  // the rest of the put
        put.release();
      });
      co_await scope.join();
      peer.join();
    }());
  });
  mem.reset();  // now no access is being served
  CHECK(refused_done);
  REQUIRE(!refused);
  CHECK(refused.error() == gdr::errc::busy);
  CHECK_FALSE(done_before_release);
  CHECK(new_access_refused);  // stopped at once, waited for after
  CHECK(waited_done);
  CHECK(waited.value() == 1);
  CHECK(cache.size() == 0);
  CHECK(reg.size() == 0);
  CHECK(reg.draining() == 0);
  CHECK(said.empty());  // waited for: no warning
}

TEST_CASE("a plain invalidate of a registry registration with an access being served warns") {
  // It cannot wait; the registration it destroys says so (before the fix
  // deregistration revoked first, which silenced the warning).
  gdr::memory_registry reg;
  auto mem = std::make_unique<std::byte[]>(64);
  registry_cache cache(gdr::registry_backend<gdr::Host>(reg, gdr::access::write));
  const auto rv = cache.acquire(mem.get(), 64).value().handle().describe(0);
  gdr::access_lease put = reg.acquire(rv.address(), 64, rv.key(), gdr::access::write).value();
  std::string said = gdr_test_support::capture_stderr([&] { CHECK(cache.invalidate(mem.get(), 64) == 1); });
  CHECK(said.find("destroyed while a peer's access to it is being served") != std::string::npos);
  put.release();
  CHECK(reg.draining() == 0);
}
