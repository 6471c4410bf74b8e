// gdr/transport/tcp/frame.hpp: the wire format and its parser.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <gdr/transport/tcp/frame.hpp>

namespace tcp = gdr::tcp;
using tcp::frame_header;
using tcp::frame_status;
using tcp::frame_type;

namespace {

std::array<std::byte, tcp::wire::header_size> encode(const frame_header& h) {
  std::array<std::byte, tcp::wire::header_size> b{};
  tcp::encode_frame(h, b.data());
  return b;
}

frame_status status_of(const std::array<std::byte, tcp::wire::header_size>& b,
                       std::uint64_t max = tcp::wire::default_max_message) {
  return tcp::parse_frame(b, max).status;
}

// The parser is usable at compile time: the layout is a compile-time fact.
constexpr bool roundtrip_at_compile_time() {
  frame_header h;
  h.type = frame_type::put_request;
  h.seq = 7;
  h.length = 4096;
  h.addr = 0x1122334455667788u;
  h.key = 0x99;
  std::byte b[tcp::wire::header_size]{};
  tcp::encode_frame(h, b);
  auto r = tcp::parse_frame(std::span<const std::byte>(b, sizeof b));
  return r.status == frame_status::ok && r.header == h && b[0] == std::byte{'G'} && b[3] == std::byte{'T'} &&
         b[24] == std::byte{0x88};
}
static_assert(roundtrip_at_compile_time());
static_assert(tcp::wire::header_size == 40);

}  // namespace

TEST_CASE("every frame type round-trips through encode and parse") {
  for (auto t : {frame_type::data, frame_type::put_request, frame_type::put_ack, frame_type::get_request,
                 frame_type::get_reply, frame_type::close}) {
    CAPTURE(static_cast<int>(t));
    frame_header h;
    h.type = t;
    h.seq = 0xfffffffe;
    if (t == frame_type::data || t == frame_type::put_request || t == frame_type::get_request ||
        t == frame_type::get_reply)
      h.length = 12345;
    if (t == frame_type::put_request || t == frame_type::get_request) {
      h.addr = 0xdeadbeef000;
      h.key = 42;
    }
    if (t == frame_type::put_ack || t == frame_type::get_reply) h.addr = 17;  // the request's seq
    auto r = tcp::parse_frame(encode(h));
    REQUIRE(r.status == frame_status::ok);
    CHECK(r.header == h);
  }
}

TEST_CASE("encoding at run time gives the bytes that constant evaluation gives") {
  // The run-time path stores whole fields (one memcpy each on little-endian
  // hosts); the constant-evaluated one writes byte by byte. Same wire bytes.
  constexpr auto h = [] {
    frame_header x;
    x.type = frame_type::get_reply;
    x.seq = 0x01020304;
    x.status = tcp::wire_status::remote_access;
    x.addr = 0xa0b0c0d0u;
    return x;
  }();
  constexpr auto at_compile_time = [&] {
    std::array<std::byte, tcp::wire::header_size> b{};
    tcp::encode_frame(h, b.data());
    return b;
  }();
  std::array<std::byte, tcp::wire::header_size> at_run_time{};
  frame_header copy = h;  // not a constant: the run-time path
  tcp::encode_frame(copy, at_run_time.data());
  CHECK(at_run_time == at_compile_time);
  CHECK(at_run_time[8] == std::byte{0x04});   // seq, least significant byte first
  CHECK(at_run_time[12] == std::byte{0x01});  // status
  auto r = tcp::parse_frame(at_run_time);
  REQUIRE(r.status == frame_status::ok);
  CHECK(r.header == h);
}

TEST_CASE("the payload that follows a header depends on its type") {
  frame_header h;
  h.length = 99;
  for (auto t : {frame_type::data, frame_type::put_request, frame_type::get_reply}) {
    h.type = t;
    CHECK(tcp::payload_size(h) == 99);
  }
  h.type = frame_type::get_request;  // the length is what is asked for, nothing follows
  CHECK(tcp::payload_size(h) == 0);
}

TEST_CASE("a short input asks for more bytes and is never read past") {
  frame_header h;
  auto b = encode(h);
  for (std::size_t n = 0; n < b.size(); ++n) {
    CHECK(tcp::parse_frame(std::span<const std::byte>(b.data(), n)).status == frame_status::need_more);
  }
}

TEST_CASE("each malformed header is refused with its reason") {
  frame_header ok;
  ok.type = frame_type::data;
  ok.length = 10;
  auto base = encode(ok);
  auto patched = [&](std::size_t at, std::uint8_t v) {
    auto b = base;
    b[at] = static_cast<std::byte>(v);
    return b;
  };
  CHECK(status_of(base) == frame_status::ok);
  CHECK(status_of(patched(0, 'g')) == frame_status::bad_magic);
  CHECK(status_of(patched(4, 0)) == frame_status::bad_version);
  CHECK(status_of(patched(4, 2)) == frame_status::bad_version);
  CHECK(status_of(patched(5, 0)) == frame_status::bad_type);
  CHECK(status_of(patched(5, 7)) == frame_status::bad_type);
  CHECK(status_of(patched(7, 0x80)) == frame_status::bad_flags);
  CHECK(status_of(patched(12, 2)) == frame_status::bad_field);  // unknown status
  CHECK(status_of(patched(12, 1)) == frame_status::bad_field);  // a status on a data frame
  CHECK(status_of(patched(24, 1)) == frame_status::bad_field);  // an address on a data frame
  CHECK(status_of(patched(39, 1)) == frame_status::bad_field);  // a key on a data frame

  frame_header big = ok;
  big.length = std::uint64_t{5} << 30;
  CHECK(status_of(encode(big)) == frame_status::too_long);
  CHECK(status_of(encode(big), std::uint64_t{8} << 30) == frame_status::ok);  // a raised limit
  big.type = frame_type::get_request;
  CHECK(status_of(encode(big)) == frame_status::too_long);  // asking for gigabytes is refused too

  frame_header ack;
  ack.type = frame_type::put_ack;
  ack.length = 1;
  CHECK(status_of(encode(ack)) == frame_status::bad_field);
  ack.length = 0;
  ack.addr = std::uint64_t{1} << 32;  // not a 32-bit sequence number
  CHECK(status_of(encode(ack)) == frame_status::bad_field);

  frame_header refusal;
  refusal.type = frame_type::get_reply;
  refusal.status = tcp::wire_status::remote_access;
  CHECK(status_of(encode(refusal)) == frame_status::ok);
  refusal.length = 8;  // a refusal carries no data
  CHECK(status_of(encode(refusal)) == frame_status::bad_field);

  frame_header close;
  close.type = frame_type::close;
  close.key = 1;
  CHECK(status_of(encode(close)) == frame_status::bad_field);
}

TEST_CASE("frame statuses have printable names") {
  CHECK(std::string(tcp::to_string(frame_status::bad_magic)) == "bad magic");
  CHECK(std::string(tcp::to_string(frame_status::too_long)) == "length over the limit");
}
