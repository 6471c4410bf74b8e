// gdr::remote_view<T, S>: a peer's memory as data. Its wire record round-trips
// and rejects records that describe something else; local access does not
// compile (tests/type_safety).
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <ostream>  // doctest prints std::error_code through it

#include <gdr/memory/remote_view.hpp>

TEST_CASE("a remote view survives its wire record unchanged") {
  gdr::remote_view<std::uint64_t, gdr::Device> r(0x7f00'1234'5678'0000ULL, 1000, 0xdead'beef'cafe'f00dULL, 7);
  auto w = r.to_wire();
  static_assert(w.size() == gdr::remote_view<std::uint64_t, gdr::Device>::wire_size);
  auto back = gdr::remote_view<std::uint64_t, gdr::Device>::from_wire(w);
  REQUIRE(back.has_value());
  CHECK(back->address() == r.address());
  CHECK(back->size() == 1000);
  CHECK(back->size_bytes() == 8000);
  CHECK(back->key() == r.key());
  CHECK(back->peer() == 7);
}

TEST_CASE("the wire record is little-endian whatever the host order") {
  gdr::remote_view<std::byte, gdr::Host> r(0x0102030405060708ULL, 16, 0, 0);
  auto w = r.to_wire();
  CHECK(w[0] == std::byte{0x08});
  CHECK(w[7] == std::byte{0x01});
  CHECK(w[8] == std::byte{16});
}

TEST_CASE("a wire record for another space, element size or a short buffer is rejected") {
  gdr::remote_view<std::uint32_t, gdr::Pinned> r(4096, 4, 1, 2);
  auto w = r.to_wire();
  CHECK(gdr::remote_view<std::uint32_t, gdr::Device>::from_wire(w).error() == gdr::errc::invalid_argument);
  CHECK(gdr::remote_view<std::uint64_t, gdr::Pinned>::from_wire(w).error() == gdr::errc::invalid_argument);
  CHECK(gdr::remote_view<std::uint32_t, gdr::Pinned>::from_wire(std::span(w).first(39)).error() ==
        gdr::errc::invalid_argument);
  CHECK(gdr::remote_view<std::uint32_t, gdr::Pinned>::from_wire(w).has_value());
}

TEST_CASE("NIC keys travel in the version-2 record and through subviews; a version-1 record still parses") {
  using rv_t = gdr::remote_view<std::uint64_t, gdr::Host>;
  rv_t r(0x1000, 64, 0x55, 3, {(std::uint64_t{0xabcd} << 32) | 0x1234, 0});
  CHECK(r.nic_exposed());
  auto w = r.to_wire();
  auto back = rv_t::from_wire(w);
  REQUIRE(back.has_value());
  CHECK(back->nic_keys() == r.nic_keys());
  CHECK(back->subview(8, 8).nic_keys() == r.nic_keys());
  // The record before NIC keys: 40 bytes, version word 0; no NIC key.
  std::array<std::byte, 40> v1{};
  std::copy(w.begin(), w.begin() + 40, v1.begin());
  v1[36] = v1[37] = v1[38] = v1[39] = std::byte{0};
  auto old = rv_t::from_wire(v1);
  REQUIRE(old.has_value());
  CHECK(old->address() == 0x1000);
  CHECK(!old->nic_exposed());
  // A version-2 record cut short, an unknown version, or the reserved word set: refused.
  CHECK(rv_t::from_wire(std::span(w).first(63)).error() == gdr::errc::invalid_argument);
  auto v4 = w;
  v4[36] = std::byte{4};
  CHECK(rv_t::from_wire(v4).error() == gdr::errc::invalid_argument);
  auto reserved = w;
  reserved[60] = std::byte{1};
  CHECK(rv_t::from_wire(reserved).error() == gdr::errc::invalid_argument);
  CHECK(!rv_t(0, 1, 1, 0).nic_exposed());
}

TEST_CASE("an owner-checked view travels as version 3 with its flag; any other view stays version 2") {
  using rv_t = gdr::remote_view<std::uint64_t, gdr::Device>;
  rv_t plain(0x2000, 32, 0x77, 1, {});
  CHECK(!plain.owner_checked());
  auto w2 = plain.to_wire();
  CHECK(w2[36] == std::byte{2});  // what a reader of version 2 reads
  CHECK(!rv_t::from_wire(w2)->owner_checked());
  rv_t checked(0x2000, 32, 0x77, 1, {}, /*owner_checked=*/true);
  CHECK(checked.owner_checked());
  CHECK(checked.subview(4, 4).owner_checked());
  auto w3 = checked.to_wire();
  CHECK(w3[36] == std::byte{3});
  CHECK(w3[56] == std::byte{1});
  auto back = rv_t::from_wire(w3);
  REQUIRE(back.has_value());
  CHECK(back->owner_checked());
  CHECK(back->address() == 0x2000);
  CHECK(back->size() == 32);
  CHECK(back->key() == 0x77);
  // An unknown flag, or a flag in a version-2 record: refused.
  auto unknown = w3;
  unknown[56] = std::byte{3};
  CHECK(rv_t::from_wire(unknown).error() == gdr::errc::invalid_argument);
  auto flag_in_v2 = w3;
  flag_in_v2[36] = std::byte{2};
  CHECK(rv_t::from_wire(flag_in_v2).error() == gdr::errc::invalid_argument);
}

TEST_CASE("a length that is not a whole number of elements is rejected") {
  gdr::remote_view<std::byte, gdr::Host> bytes(0, 10, 0, 0);
  auto w = bytes.to_wire();
  // Claim 4-byte elements: 10 bytes is not a multiple of 4.
  w[32] = std::byte{4};
  CHECK(gdr::remote_view<std::uint32_t, gdr::Host>::from_wire(w).error() == gdr::errc::invalid_argument);
}

TEST_CASE("a remote subview moves the address by whole elements and clamps") {
  gdr::remote_view<std::uint32_t, gdr::Host> r(1000, 10, 5, 1);
  auto s = r.subview(3, 4);
  CHECK(s.address() == 1000 + 3 * 4);
  CHECK(s.size() == 4);
  CHECK(s.key() == 5);
  CHECK(s.peer() == 1);
  CHECK(r.subview(8, 9).size() == 2);
  CHECK(r.subview(11).size() == 0);
}
