// gdr::address (gdr/transfer/address.hpp): an IP address and port, parsed
// and printed, that every network transport names endpoints by.
#include <doctest/doctest.h>

#include <sys/socket.h>

#include <type_traits>

#include <gdr/transfer/address.hpp>
#include <gdr/transport/tcp/socket.hpp>

static_assert(std::is_same_v<gdr::tcp::address, gdr::address>, "TCP names endpoints by gdr::address");

TEST_CASE("an address prints as it was parsed, IPv4 and IPv6") {
  for (const char* text : {"10.0.0.1:7471", "127.0.0.1:0", "[fe80::1]:7471", "[::1]:65535"}) {
    CAPTURE(text);
    auto a = gdr::address::parse(text);
    REQUIRE(a);
    CHECK(a->valid());
    CHECK(a->to_string() == text);
  }
  CHECK(gdr::address::parse("[fe80::1]:7471")->family() == AF_INET6);
  CHECK(gdr::address::parse("10.0.0.1:7471")->port() == 7471);
}

TEST_CASE("names, missing ports and out-of-range ports are refused") {
  for (const char* bad : {"", "10.0.0.1", "10.0.0.1:", "10.0.0.1:70000", "host.example:1", "[::1:1"}) {
    CAPTURE(bad);
    CHECK(gdr::address::parse(bad).error() == gdr::errc::invalid_argument);
  }
  CHECK(!gdr::address{}.valid());
  CHECK(gdr::address{}.to_string().empty());
}
