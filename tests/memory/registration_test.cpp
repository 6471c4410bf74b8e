// gdr/memory/registration.hpp: the registry every remote access is checked
// against: range edges, overflow, keys, revocation, permissions, threads.
#include <doctest/doctest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <set>
#include <thread>
#include <vector>

#include <gdr/memory/registration.hpp>

using gdr::access;
using gdr::errc;

namespace {

// A view of `n` bytes at a made-up address: the registry records ranges and
// never dereferences them, so addresses near 2^64 can be tested.
gdr::view<std::byte, gdr::Host> fake_bytes(std::uintptr_t addr, std::size_t n) {
  return {reinterpret_cast<std::byte*>(addr), n};
}

bool ok(const gdr::result<std::byte*>& r) { return r.has_value(); }
bool denied(const gdr::result<std::byte*>& r) { return !r && r.error() == errc::remote_access; }

}  // namespace

static_assert(gdr::allows(access::read_write, access::read));
static_assert(gdr::allows(access::read_write, access::write));
static_assert(gdr::allows(access::read_write, access::read_write));
static_assert(gdr::allows(access::read, access::read));
static_assert(!gdr::allows(access::read, access::write));
static_assert(!gdr::allows(access::read, access::read_write));
static_assert(gdr::allows(access::write, access::write));
static_assert(!gdr::allows(access::write, access::read));

TEST_CASE("resolve accepts exactly the bytes inside a registration") {
  gdr::memory_registry reg;
  std::vector<std::byte> mem(100);
  auto r = reg.register_memory(gdr::host_view(mem).subview(10, 50));  // [10, 60)
  const auto base = reinterpret_cast<std::uint64_t>(mem.data()) + 10;
  const auto key = r.key();
  CHECK(ok(reg.resolve(base, 50, key, access::read)));       // the whole range
  CHECK(ok(reg.resolve(base, 1, key, access::read)));        // the first byte
  CHECK(ok(reg.resolve(base + 49, 1, key, access::read)));   // the last byte
  CHECK(ok(reg.resolve(base + 20, 30, key, access::write)));  // a tail
  CHECK(reg.resolve(base + 5, 3, key, access::read).value() == mem.data() + 15);
  CHECK(denied(reg.resolve(base - 1, 1, key, access::read)));   // one byte before
  CHECK(denied(reg.resolve(base - 1, 2, key, access::read)));   // straddles the start
  CHECK(denied(reg.resolve(base + 50, 1, key, access::read)));  // one byte after
  CHECK(denied(reg.resolve(base + 49, 2, key, access::read)));  // straddles the end
  CHECK(denied(reg.resolve(base, 51, key, access::read)));      // one byte too long
}

TEST_CASE("the host-side resolve refuses a registration of memory the host cannot dereference") {
  // A Device view at a made-up address (never dereferenced): registering it
  // works (an RDMA transport may reach it later), but a put or get that the
  // CPU would carry out is refused, whatever its range, key and permission.
  gdr::memory_registry reg;
  gdr::view<std::byte, gdr::Device> dev(reinterpret_cast<std::byte*>(std::uintptr_t{0x7f0000000000}), 4096, 0);
  auto r = reg.register_memory(dev);
  CHECK(reg.size() == 1);
  CHECK(denied(reg.resolve(0x7f0000000000, 16, r.key(), access::read)));
  CHECK(denied(reg.resolve(0x7f0000000000, 16, r.key(), access::write)));
  // Pinned memory is host memory: resolved like Host.
  std::vector<std::byte> mem(64);
  gdr::view<std::byte, gdr::Pinned> pinned(mem.data(), mem.size());
  auto p = reg.register_memory(pinned);
  CHECK(ok(reg.resolve(reinterpret_cast<std::uint64_t>(mem.data()), 64, p.key(), access::write)));
}

TEST_CASE("resolve rejects ranges whose end overflows the address space") {
  gdr::memory_registry reg;
  constexpr std::uintptr_t top = std::numeric_limits<std::uintptr_t>::max();
  auto r = reg.register_memory(fake_bytes(top - 15, 16));  // the last 16 addresses
  const auto key = r.key();
  CHECK(ok(reg.resolve(top - 15, 16, key, access::read)));
  CHECK(ok(reg.resolve(top, 1, key, access::read)));
  CHECK(denied(reg.resolve(top, 2, key, access::read)));        // wraps to 0
  CHECK(denied(reg.resolve(top - 15, 17, key, access::read)));  // wraps
  CHECK(denied(reg.resolve(top - 3, std::numeric_limits<std::size_t>::max(), key, access::read)));
  // A low registration and a huge length whose sum wraps below its base.
  std::vector<std::byte> mem(64);
  auto low = reg.register_memory(gdr::host_view(mem));
  const auto base = reinterpret_cast<std::uint64_t>(mem.data());
  CHECK(denied(reg.resolve(base + 1, std::numeric_limits<std::size_t>::max(), low.key(), access::read)));
  CHECK(denied(reg.resolve(base + 8, std::numeric_limits<std::size_t>::max() - 7, low.key(), access::read)));
  CHECK(denied(reg.resolve(top, 64, low.key(), access::read)));
}

TEST_CASE("resolve rejects a wrong key, the zero key, and another registration's key") {
  gdr::memory_registry reg;
  std::vector<std::byte> a(32), b(32);
  auto ra = reg.register_memory(gdr::host_view(a));
  auto rb = reg.register_memory(gdr::host_view(b));
  const auto addr_a = reinterpret_cast<std::uint64_t>(a.data());
  CHECK(ok(reg.resolve(addr_a, 32, ra.key(), access::read)));
  CHECK(denied(reg.resolve(addr_a, 32, ra.key() ^ 1, access::read)));
  CHECK(denied(reg.resolve(addr_a, 32, 0, access::read)));
  CHECK(denied(reg.resolve(addr_a, 32, rb.key(), access::read)));  // b's key does not open a
}

TEST_CASE("a revoked registration refuses access at once, whether revoked, destroyed or replaced") {
  gdr::memory_registry reg;
  std::vector<std::byte> mem(32);
  const auto addr = reinterpret_cast<std::uint64_t>(mem.data());
  SUBCASE("revoke()") {
    auto r = reg.register_memory(gdr::host_view(mem));
    const auto key = r.key();
    r.revoke();
    CHECK(!r.live());
    CHECK(denied(reg.resolve(addr, 1, key, access::read)));
    r.revoke();  // idempotent
  }
  SUBCASE("destruction") {
    std::uint64_t key;
    {
      auto r = reg.register_memory(gdr::host_view(mem));
      key = r.key();
      CHECK(ok(reg.resolve(addr, 1, key, access::read)));
    }
    CHECK(denied(reg.resolve(addr, 1, key, access::read)));
  }
  SUBCASE("move assignment over a live registration") {
    auto r1 = reg.register_memory(gdr::host_view(mem));
    auto r2 = reg.register_memory(gdr::host_view(mem));
    const auto k1 = r1.key(), k2 = r2.key();
    r1 = std::move(r2);
    CHECK(denied(reg.resolve(addr, 1, k1, access::read)));
    CHECK(ok(reg.resolve(addr, 1, k2, access::read)));
    CHECK(r1.key() == k2);
    CHECK(!r2.live());  // NOLINT: moved-from is documented as not live
  }
  CHECK(reg.size() == 0);
}

TEST_CASE("a moved registration keeps its key live") {
  gdr::memory_registry reg;
  std::vector<std::byte> mem(8);
  auto r1 = reg.register_memory(gdr::host_view(mem));
  const auto key = r1.key();
  auto r2 = std::move(r1);
  CHECK(r2.live());
  CHECK(ok(reg.resolve(reinterpret_cast<std::uint64_t>(mem.data()), 8, key, access::read)));
  CHECK(reg.size() == 1);
}

TEST_CASE("permissions: read-only refuses writes, write-only refuses reads") {
  gdr::memory_registry reg;
  std::vector<std::byte> mem(16);
  const auto addr = reinterpret_cast<std::uint64_t>(mem.data());
  auto ro = reg.register_memory(gdr::host_view(mem), access::read);
  auto wo = reg.register_memory(gdr::host_view(mem), access::write);
  auto rw = reg.register_memory(gdr::host_view(mem), access::read_write);
  CHECK(ok(reg.resolve(addr, 16, ro.key(), access::read)));
  CHECK(denied(reg.resolve(addr, 16, ro.key(), access::write)));
  CHECK(denied(reg.resolve(addr, 16, wo.key(), access::read)));
  CHECK(ok(reg.resolve(addr, 16, wo.key(), access::write)));
  CHECK(ok(reg.resolve(addr, 16, rw.key(), access::read)));
  CHECK(ok(reg.resolve(addr, 16, rw.key(), access::write)));
  CHECK(denied(reg.resolve(addr, 16, ro.key(), access::read_write)));
}

TEST_CASE("keys are non-zero and unique across many registrations") {
  gdr::memory_registry reg;
  std::vector<std::byte> mem(8);
  std::set<std::uint64_t> keys;
  std::vector<gdr::registration<std::byte, gdr::Host>> live;
  for (int i = 0; i < 5000; ++i) {
    auto r = reg.register_memory(gdr::host_view(mem));
    CHECK(r.key() != 0);
    keys.insert(r.key());
    if (i % 2 == 0) live.push_back(std::move(r));  // the others are revoked at once
  }
  CHECK(keys.size() == 5000);
  CHECK(reg.size() == 2500);
}

TEST_CASE("describe gives the remote view a peer needs, and it survives the wire") {
  gdr::memory_registry reg;
  std::vector<std::uint32_t> mem(10);
  auto r = reg.register_memory(gdr::host_view(mem));
  auto rv = r.describe(7);
  CHECK(rv.address() == reinterpret_cast<std::uint64_t>(mem.data()));
  CHECK(rv.size() == 10);
  CHECK(rv.size_bytes() == 40);
  CHECK(rv.key() == r.key());
  CHECK(rv.peer() == 7);
  auto back = gdr::remote_view<std::uint32_t, gdr::Host>::from_wire(rv.to_wire()).value();
  CHECK(back.address() == rv.address());
  CHECK(back.size() == rv.size());
  CHECK(back.key() == rv.key());
  CHECK(back.peer() == 7);
  // The wire record names the space and element size: a mismatch is refused.
  CHECK(!gdr::remote_view<std::uint32_t, gdr::Pinned>::from_wire(rv.to_wire()));
  CHECK(!gdr::remote_view<std::uint64_t, gdr::Host>::from_wire(rv.to_wire()));
  CHECK(reg.resolve(back.address(), back.size_bytes(), back.key(), access::write).has_value());
}

TEST_CASE("registering an empty view is an invalid argument") {
  gdr::memory_registry reg;
  std::vector<std::byte> mem(4);
  CHECK_THROWS_AS(reg.register_memory(gdr::host_view(mem).first(0)), gdr::error);
  try {
    (void)reg.register_memory(gdr::view<std::byte, gdr::Host>());
  } catch (const gdr::error& e) {
    CHECK(e.code() == errc::invalid_argument);
  }
  CHECK(reg.size() == 0);
}

TEST_CASE("the registry survives concurrent registration, revocation and resolution") {
  gdr::memory_registry reg;
  constexpr int threads = 4, rounds = 2000;
  std::vector<std::vector<std::byte>> mem(threads, std::vector<std::byte>(256));
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      const auto addr = reinterpret_cast<std::uint64_t>(mem[t].data());
      for (int i = 0; i < rounds; ++i) {
        auto r = reg.register_memory(gdr::host_view(mem[t]), i % 2 ? access::read : access::read_write);
        if (!reg.resolve(addr + i % 200, 56, r.key(), access::read)) ++wrong;
        if (i % 2 && reg.resolve(addr, 1, r.key(), access::write)) ++wrong;
        const auto key = r.key();
        r.revoke();
        if (reg.resolve(addr, 1, key, access::read)) ++wrong;
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK(wrong == 0);
  CHECK(reg.size() == 0);
}
