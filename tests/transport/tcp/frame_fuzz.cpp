// libFuzzer target for the TCP frame parser (gdr/transport/tcp/frame.hpp,
// wire format version 2).
//
// The input is treated as a byte stream the way a receiver walks it: parse a
// header, skip its payload, parse the next one, until the bytes run out or a
// header is refused. Checked on the way:
//   * the parser never reads outside the input (ASan) and never hits UB (UBSan);
//   * it asks for more bytes exactly when fewer than a header are given;
//   * an accepted header re-encodes, with its sequence number, to exactly the
//     bytes it came from (the format has no slack: every field is checked);
//   * accepted headers obey the rules the protocol engine relies on
//     (gdr/protocol/message.hpp): no payload on types without one, refusals
//     carry no data, lengths and sizes within the limit, a hello names a
//     version and a limit and known capabilities only, unused fields zero,
//     the `last` flag on data frames only, `withdrawn` with it on empty ones;
//   * a refused header is refused with the same status every time, and
//     nothing of it is handed out.
// The first input byte picks the length limit, so small limits are explored too.
//
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -I. \
//       tests/transport/tcp/frame_fuzz.cpp -o frame_fuzz && ./frame_fuzz -max_total_time=20
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include <gdr/transport/tcp/frame.hpp>

namespace tcp = gdr::tcp;
namespace proto = gdr::detail::proto;

namespace {

// The rules of message.hpp's table, written out again independently of
// proto::valid.
bool obeys_rules(const tcp::frame_header& h, std::uint64_t limit) {
  if (h.length > limit) return false;
  // The flags belong to data frames: `last`, or `last` and `withdrawn` on
  // an empty one at offset 0 (the answer to an rtr whose send was
  // withdrawn).
  const bool withdrawn = h.flags == (proto::flag::last | proto::flag::withdrawn);
  if (h.flags != 0 && !(h.type == tcp::frame_type::data && (h.flags == proto::flag::last || withdrawn))) return false;
  if (withdrawn && (h.length != 0 || h.size != 0)) return false;
  bool answer = h.type == tcp::frame_type::put_ack || h.type == tcp::frame_type::get_reply;
  if (!answer && h.st != proto::status::ok) return false;
  if (!proto::has_payload(h.type) && h.length != 0) return false;
  switch (h.type) {
    case tcp::frame_type::hello:
      return h.id >= 2 && h.size != 0 && (h.tag & ~proto::caps::known) == 0;  // addr: its chunk, key: its reply slots
    case tcp::frame_type::eager: return h.size == 0 && h.id == 0 && h.addr == 0 && h.key == 0;
    case tcp::frame_type::rts: return h.size <= limit && h.addr == 0 && h.key == 0;
    case tcp::frame_type::rtr: return h.tag == 0;  // key: the largest segment it takes
    case tcp::frame_type::data: return h.size <= limit && h.tag == 0 && h.id == 0 && h.key == 0;  // size: offset
    case tcp::frame_type::rts_cancel:
    case tcp::frame_type::rts_withdrawn: return h.size == 0 && h.tag == 0 && h.addr == 0 && h.key == 0;
    case tcp::frame_type::put_request: return h.size == 0 && h.tag == 0;
    case tcp::frame_type::put_ack: return h.size == 0 && h.tag == 0 && h.addr == 0 && h.key == 0;
    case tcp::frame_type::get_request: return h.size <= limit && h.tag == 0;
    case tcp::frame_type::get_reply:
      return h.size == 0 && h.tag == 0 && h.addr == 0 && h.key == 0 &&
             (h.st == proto::status::ok || h.length == 0);
    case tcp::frame_type::close: return h.size == 0 && h.tag == 0 && h.id == 0 && h.addr == 0 && h.key == 0;
    case tcp::frame_type::credit: return h.tag == 0 && h.addr == 0 && h.key == 0;  // size: bytes, id: messages
    case tcp::frame_type::atomic_request:  // 1 fetch-and-add, 2 compare-and-swap; two 8-byte operands
      return h.length == 16 && h.size == 8 && (h.tag == 1 || h.tag == 2);
  }
  return false;  // not a known type
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  std::uint64_t limit = std::uint64_t{1} << (data[0] % 64);
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data) + 1, size - 1);
  int frames = 0;
  while (!in.empty() && frames < 10000) {
    tcp::frame_parse_result r = tcp::parse_frame(in, limit);
    if (r.status == tcp::frame_status::need_more) {
      if (in.size() >= tcp::wire::header_size) std::abort();
      break;
    }
    if (in.size() < tcp::wire::header_size) std::abort();  // judged a header it did not have
    if (r.status != tcp::frame_status::ok) {
      tcp::frame_parse_result again = tcp::parse_frame(in, limit);
      if (again.status != r.status) std::abort();  // deterministic
      if (!(r.header == tcp::frame_header{}) || r.seq != 0) std::abort();  // nothing of a refused header
      break;
    }
    const tcp::frame_header& h = r.header;
    std::byte again[tcp::wire::header_size];
    tcp::encode_frame(h, r.seq, again);
    if (std::memcmp(again, in.data(), tcp::wire::header_size) != 0) std::abort();
    if (!obeys_rules(h, limit)) std::abort();
    if (!proto::valid(h, limit)) std::abort();
    std::uint64_t payload = tcp::payload_size(h);
    if (payload != h.length) std::abort();
    in = in.subspan(tcp::wire::header_size);
    if (payload >= in.size()) break;
    in = in.subspan(static_cast<std::size_t>(payload));
    ++frames;
  }
  return 0;
}
