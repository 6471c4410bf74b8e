// gdr/transport/tcp/frame.hpp: the wire format (version 2) and its parser.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <gdr/protocol/options.hpp>
#include <gdr/transport/tcp/frame.hpp>

namespace tcp = gdr::tcp;
namespace proto = gdr::detail::proto;
using tcp::frame_header;
using tcp::frame_status;
using tcp::frame_type;

namespace {

using header_bytes = std::array<std::byte, tcp::wire::header_size>;

const std::uint64_t default_max = gdr::protocol_options{}.max_message;

header_bytes encode(const frame_header& h, std::uint32_t seq = 0) {
  header_bytes b{};
  tcp::encode_frame(h, seq, b.data());
  return b;
}

frame_status status_of(const header_bytes& b, std::uint64_t max = default_max) {
  return tcp::parse_frame(b, max).status;
}

// A valid header of each type, with every field its type uses set to
// something other than zero (so a round trip proves each one is carried).
frame_header sample(frame_type t) {
  frame_header h;
  h.type = t;
  switch (t) {
    case frame_type::hello:
      h.size = std::uint64_t{1} << 30;
      h.tag = proto::caps::host | proto::caps::device;
      h.id = proto::version;
      h.key = 64;  // reply slots
      break;
    case frame_type::eager:
      h.length = 12345;
      h.tag = 0x7700000000000007u;
      break;
    case frame_type::rts:
      h.size = 20u << 20;
      h.tag = 3;
      h.id = 0x0102030405060708u;
      break;
    case frame_type::rtr:
      h.id = 0x0102030405060708u;
      h.size = 4096;
      h.addr = 0xfeedface12345678u;
      break;
    case frame_type::data:
      h.length = 4096;
      h.addr = 0xfeedface12345678u;
      break;
    case frame_type::rts_cancel:
    case frame_type::rts_withdrawn: h.id = 99; break;
    case frame_type::put_request:
      h.length = 777;
      h.id = 5;
      h.addr = 0xdeadbeef000u;
      h.key = 42;
      break;
    case frame_type::put_ack:
      h.id = 5;
      h.st = proto::status::remote_access;
      break;
    case frame_type::get_request:
      h.size = 8192;
      h.id = 6;
      h.addr = 0xdeadbeef000u;
      h.key = 43;
      break;
    case frame_type::get_reply:
      h.id = 6;
      h.length = 8192;
      break;
    case frame_type::close: break;
    case frame_type::atomic_request:
      h.length = 16;
      h.size = 8;
      h.tag = proto::atomic_compare_swap;
      h.id = 7;
      h.addr = 0xdeadbeef008u;
      h.key = 44;
      break;
    case frame_type::credit:
      h.size = 256 * 1024;
      h.id = 1024;
      break;
  }
  return h;
}

constexpr std::array all_types = {
    frame_type::hello,       frame_type::eager,   frame_type::rts,         frame_type::rtr,
    frame_type::data,        frame_type::rts_cancel, frame_type::rts_withdrawn, frame_type::put_request,
    frame_type::put_ack,     frame_type::get_request, frame_type::get_reply, frame_type::close,
    frame_type::credit,      frame_type::atomic_request,
};
static_assert(all_types.size() == proto::msg_max - proto::msg_min + 1);

// The parser is usable at compile time: the layout is a compile-time fact.
constexpr bool roundtrip_at_compile_time() {
  frame_header h;
  h.type = frame_type::put_request;
  h.length = 4096;
  h.id = 3;
  h.addr = 0x1122334455667788u;
  h.key = 0x99;
  std::byte b[tcp::wire::header_size]{};
  tcp::encode_frame(h, 7, b);
  auto r = tcp::parse_frame(std::span<const std::byte>(b, sizeof b));
  return r.status == frame_status::ok && r.header == h && r.seq == 7 && b[0] == std::byte{'G'} &&
         b[3] == std::byte{'T'} && b[4] == std::byte{2} && b[5] == std::byte{8} && b[8] == std::byte{7} &&
         b[16] == std::byte{0x00} && b[17] == std::byte{0x10} && b[40] == std::byte{3} &&
         b[48] == std::byte{0x88} && b[55] == std::byte{0x11} && b[56] == std::byte{0x99};
}
static_assert(roundtrip_at_compile_time());
static_assert(tcp::wire::header_size == 64);
static_assert(tcp::wire::version == 2);
static_assert(proto::version == 2);

}  // namespace

TEST_CASE("every message type round-trips through encode and parse, with its sequence number") {
  for (frame_type t : all_types) {
    CAPTURE(proto::to_string(t));
    frame_header h = sample(t);
    REQUIRE(proto::valid(h, default_max));
    for (std::uint32_t seq : {0u, 1u, 0xfffffffeu, 0xffffffffu}) {
      CAPTURE(seq);
      auto r = tcp::parse_frame(encode(h, seq));
      REQUIRE(r.status == frame_status::ok);
      CHECK(r.header == h);
      CHECK(r.seq == seq);
    }
  }
}

TEST_CASE("encoding at run time gives the bytes that constant evaluation gives") {
  // The run-time path stores whole fields (one memcpy each on little-endian
  // hosts); the constant-evaluated one writes byte by byte. Same wire bytes.
  constexpr auto h = [] {
    frame_header x;
    x.type = frame_type::rtr;
    x.id = 0x1112131415161718u;
    x.size = 0x2122232425262728u;
    x.addr = 0xa0b0c0d0e0f00010u;
    return x;
  }();
  constexpr auto at_compile_time = [&] {
    header_bytes b{};
    tcp::encode_frame(h, 0x01020304u, b.data());
    return b;
  }();
  header_bytes at_run_time{};
  frame_header copy = h;  // not a constant: the run-time path
  tcp::encode_frame(copy, 0x01020304u, at_run_time.data());
  CHECK(at_run_time == at_compile_time);
  CHECK(at_run_time[4] == std::byte{2});      // version
  CHECK(at_run_time[5] == std::byte{4});      // rtr
  CHECK(at_run_time[8] == std::byte{0x04});   // seq, least significant byte first
  CHECK(at_run_time[11] == std::byte{0x01});
  CHECK(at_run_time[24] == std::byte{0x28});  // size
  CHECK(at_run_time[40] == std::byte{0x18});  // id
  CHECK(at_run_time[48] == std::byte{0x10});  // addr
  CHECK(at_run_time[63] == std::byte{0});     // key
  auto r = tcp::parse_frame(at_run_time);
  REQUIRE(r.status == frame_status::ok);
  CHECK(r.header == h);
  CHECK(r.seq == 0x01020304u);

  // A status is one byte at offset 12, followed by three zero bytes.
  frame_header refusal;
  refusal.type = frame_type::get_reply;
  refusal.st = proto::status::remote_access;
  auto b = encode(refusal);
  CHECK(b[12] == std::byte{1});
  CHECK(b[13] == std::byte{0});
}

TEST_CASE("only eager, data, put_request, get_reply and atomic_request carry a payload") {
  for (frame_type t : all_types) {
    CAPTURE(proto::to_string(t));
    bool payload = t == frame_type::eager || t == frame_type::data || t == frame_type::put_request ||
                   t == frame_type::get_reply || t == frame_type::atomic_request;
    CHECK(proto::has_payload(t) == payload);
    frame_header h = sample(t);
    CHECK(tcp::payload_size(h) == h.length);
    if (!payload) {
      // A length on a type without payload is refused.
      h.length = 1;
      CHECK(status_of(encode(h)) == frame_status::bad_field);
    }
  }
}

TEST_CASE("a short input asks for more bytes and is never read past") {
  frame_header h = sample(frame_type::eager);
  auto b = encode(h);
  for (std::size_t n = 0; n < b.size(); ++n) {
    // A copy of exactly n bytes: ASan catches a read past it.
    std::vector<std::byte> shorter(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
    CHECK(tcp::parse_frame(std::span<const std::byte>(shorter.data(), n)).status == frame_status::need_more);
  }
  std::vector<std::byte> exact(b.begin(), b.end());
  CHECK(tcp::parse_frame(exact).status == frame_status::ok);
}

TEST_CASE("each malformed header is refused with its reason") {
  frame_header ok = sample(frame_type::data);
  auto base = encode(ok);
  auto patched = [&](std::size_t at, std::uint8_t v) {
    auto b = base;
    b[at] = static_cast<std::byte>(v);
    return b;
  };
  CHECK(status_of(base) == frame_status::ok);
  CHECK(status_of(patched(0, 'g')) == frame_status::bad_magic);
  CHECK(status_of(patched(3, 'X')) == frame_status::bad_magic);
  CHECK(status_of(patched(4, 0)) == frame_status::bad_version);
  CHECK(status_of(patched(4, 1)) == frame_status::bad_version);  // version 1: 40-byte headers, refused
  CHECK(status_of(patched(4, 3)) == frame_status::bad_version);
  CHECK(status_of(patched(5, 0)) == frame_status::bad_type);
  CHECK(status_of(patched(5, proto::msg_max + 1)) == frame_status::bad_type);
  CHECK(status_of(patched(5, 0xff)) == frame_status::bad_type);
  CHECK(status_of(patched(6, 0x01)) == frame_status::ok);  // `last`: data frames only
  CHECK(status_of(patched(6, 0x02)) == frame_status::bad_flags);  // `withdrawn` only with `last`
  CHECK(status_of(patched(6, 0x04)) == frame_status::bad_flags);
  CHECK(status_of(patched(7, 0x80)) == frame_status::bad_flags);
  {
    // `last` and `withdrawn`: the answer to an rtr whose send was withdrawn,
    // with no bytes, at offset 0.
    frame_header w = sample(frame_type::data);
    w.flags = proto::flag::last | proto::flag::withdrawn;
    w.length = 0;
    w.size = 0;
    CHECK(status_of(encode(w)) == frame_status::ok);
    w.length = 1;
    CHECK(status_of(encode(w)) == frame_status::bad_field);
    w.length = 0;
    w.size = 4096;
    CHECK(status_of(encode(w)) == frame_status::bad_field);
  }
  {
    auto eager = encode(sample(frame_type::eager));
    eager[6] = std::byte{0x01};
    CHECK(status_of(eager) == frame_status::bad_flags);  // `last` means nothing on other types
  }
  CHECK(status_of(patched(12, 2)) == frame_status::bad_field);  // unknown status
  CHECK(status_of(patched(12, 1)) == frame_status::bad_field);  // a status on a data frame
  for (std::size_t at : {13, 14, 15}) {
    CAPTURE(at);
    CHECK(status_of(patched(at, 1)) == frame_status::bad_field);  // reserved bytes after the status
  }
  CHECK(status_of(patched(24, 1)) == frame_status::ok);  // a data frame's size is its segment's offset
  CHECK(status_of(patched(31, 0x80)) == frame_status::bad_field);  // an offset past any message
  CHECK(status_of(patched(32, 1)) == frame_status::bad_field);  // a tag on a data frame
  CHECK(status_of(patched(40, 1)) == frame_status::bad_field);  // an id on a data frame
  CHECK(status_of(patched(63, 1)) == frame_status::bad_field);  // a key on a data frame
  // The sequence number is the connection's business, not the parser's.
  CHECK(status_of(patched(8, 0xff)) == frame_status::ok);

  // Lengths over the receiver's limit.
  frame_header big = sample(frame_type::eager);
  big.length = std::uint64_t{5} << 30;
  CHECK(status_of(encode(big)) == frame_status::too_long);
  CHECK(status_of(encode(big), std::uint64_t{8} << 30) == frame_status::ok);  // a raised limit
  big.length = ~std::uint64_t{0};
  CHECK(status_of(encode(big)) == frame_status::too_long);
  CHECK(status_of(encode(sample(frame_type::eager)), 100) == frame_status::too_long);  // a lowered one
  // Sizes over the limit (announced or asked for) break the rules of their type.
  frame_header rts = sample(frame_type::rts);
  rts.size = default_max + 1;
  CHECK(status_of(encode(rts)) == frame_status::bad_field);
  frame_header get = sample(frame_type::get_request);
  get.size = std::uint64_t{8} << 30;  // asking for gigabytes is refused
  CHECK(status_of(encode(get)) == frame_status::bad_field);
  CHECK(status_of(encode(get), std::uint64_t{8} << 30) == frame_status::ok);
}

TEST_CASE("each type's unused fields must be zero, as proto::valid says") {
  struct rule {
    frame_type type;
    std::size_t offset;  // a field the type does not use
    const char* field;
  };
  const rule rules[] = {
      {frame_type::eager, 24, "size"},        {frame_type::eager, 40, "id"},
      {frame_type::eager, 48, "addr"},        {frame_type::eager, 56, "key"},
      {frame_type::rts, 48, "addr"},          {frame_type::rts, 56, "key"},
      {frame_type::rtr, 32, "tag"},           {frame_type::data, 32, "tag"},
      {frame_type::data, 40, "id"},           {frame_type::data, 56, "key"},
      {frame_type::rts_cancel, 24, "size"},   {frame_type::rts_cancel, 32, "tag"},
      {frame_type::rts_cancel, 48, "addr"},   {frame_type::rts_cancel, 56, "key"},
      {frame_type::rts_withdrawn, 24, "size"}, {frame_type::rts_withdrawn, 32, "tag"},
      {frame_type::rts_withdrawn, 48, "addr"}, {frame_type::rts_withdrawn, 56, "key"},
      {frame_type::put_request, 24, "size"},  {frame_type::put_request, 32, "tag"},
      {frame_type::put_ack, 24, "size"},      {frame_type::put_ack, 32, "tag"},
      {frame_type::put_ack, 48, "addr"},      {frame_type::put_ack, 56, "key"},
      {frame_type::get_request, 32, "tag"},   {frame_type::get_reply, 24, "size"},
      {frame_type::get_reply, 32, "tag"},     {frame_type::get_reply, 48, "addr"},
      {frame_type::get_reply, 56, "key"},     {frame_type::close, 24, "size"},
      {frame_type::close, 32, "tag"},         {frame_type::close, 40, "id"},
      {frame_type::close, 48, "addr"},        {frame_type::close, 56, "key"},
      {frame_type::credit, 32, "tag"},        {frame_type::credit, 48, "addr"},
      {frame_type::credit, 56, "key"},        {frame_type::atomic_request, 24, "size"},
      {frame_type::atomic_request, 32, "tag"},
  };
  for (const rule& r : rules) {
    CAPTURE(proto::to_string(r.type));
    CAPTURE(r.field);
    auto b = encode(sample(r.type));
    REQUIRE(status_of(b) == frame_status::ok);
    b[r.offset + 7] = std::byte{0x01};  // the field's most significant byte
    CHECK(status_of(b) == frame_status::bad_field);
  }

  // Only answers carry a status.
  for (frame_type t : all_types) {
    CAPTURE(proto::to_string(t));
    frame_header h = sample(t);
    h.st = proto::status::remote_access;
    if (t == frame_type::get_reply) h.length = 0;  // a refusal carries no data
    bool answer = t == frame_type::put_ack || t == frame_type::get_reply;
    CHECK(status_of(encode(h)) == (answer ? frame_status::ok : frame_status::bad_field));
  }

  frame_header refusal = sample(frame_type::get_reply);
  refusal.st = proto::status::remote_access;
  refusal.length = 8;  // a refusal carrying data
  CHECK(status_of(encode(refusal)) == frame_status::bad_field);

  // hello: a version of at least 2, a limit, known capability bits only.
  frame_header hello = sample(frame_type::hello);
  hello.id = 1;
  CHECK(status_of(encode(hello)) == frame_status::bad_field);
  hello.id = 0;
  CHECK(status_of(encode(hello)) == frame_status::bad_field);
  hello = sample(frame_type::hello);
  hello.size = 0;
  CHECK(status_of(encode(hello)) == frame_status::bad_field);
  hello = sample(frame_type::hello);
  hello.tag = proto::caps::known + 1;
  CHECK(status_of(encode(hello)) == frame_status::bad_field);
  hello.tag = proto::caps::known;
  CHECK(status_of(encode(hello)) == frame_status::ok);
}

TEST_CASE("frame statuses and message types have printable names") {
  CHECK(std::string(tcp::to_string(frame_status::ok)) == "ok");
  CHECK(std::string(tcp::to_string(frame_status::need_more)) == "need more bytes");
  CHECK(std::string(tcp::to_string(frame_status::bad_magic)) == "bad magic");
  CHECK(std::string(tcp::to_string(frame_status::bad_version)) == "unsupported version");
  CHECK(std::string(tcp::to_string(frame_status::bad_type)) == "unknown frame type");
  CHECK(std::string(tcp::to_string(frame_status::bad_flags)) == "unknown flags");
  CHECK(std::string(tcp::to_string(frame_status::bad_field)) == "malformed field");
  CHECK(std::string(tcp::to_string(frame_status::too_long)) == "length over the limit");
  for (frame_type t : all_types) CHECK(std::string(proto::to_string(t)) != "?");
  CHECK(std::string(proto::to_string(frame_type::rts_withdrawn)) == "rts_withdrawn");
  CHECK(std::string(proto::to_string(static_cast<frame_type>(0))) == "?");
}
