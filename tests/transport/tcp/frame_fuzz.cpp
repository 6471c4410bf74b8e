// libFuzzer target for the TCP frame parser (gdr/transport/tcp/frame.hpp).
//
// The input is treated as a byte stream the way a receiver walks it: parse a
// header, skip its payload, parse the next one, until the bytes run out or a
// header is refused. Checked on the way:
//   * the parser never reads outside the input (ASan) and never hits UB (UBSan);
//   * an accepted header re-encodes to exactly the bytes it came from (the
//     format has no slack: every field is checked);
//   * accepted headers obey the rules the endpoint relies on (no payload on
//     control frames, refusals carry no data, lengths within the limit);
//   * a refused header is refused with the same status every time.
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
    if (r.status != tcp::frame_status::ok) {
      if (tcp::parse_frame(in, limit).status != r.status) std::abort();  // deterministic
      break;
    }
    const tcp::frame_header& h = r.header;
    std::byte again[tcp::wire::header_size];
    tcp::encode_frame(h, again);
    if (std::memcmp(again, in.data(), tcp::wire::header_size) != 0) std::abort();
    if (h.length > limit) std::abort();
    std::uint64_t payload = tcp::payload_size(h);
    switch (h.type) {
      case tcp::frame_type::put_ack:
      case tcp::frame_type::close:
      case tcp::frame_type::get_request:
        if (payload != 0) std::abort();
        break;
      case tcp::frame_type::get_reply:
        if (h.status != tcp::wire_status::ok && payload != 0) std::abort();
        break;
      default: break;
    }
    if (h.flags != 0) std::abort();
    in = in.subspan(tcp::wire::header_size);
    if (payload >= in.size()) break;
    in = in.subspan(static_cast<std::size_t>(payload));
    ++frames;
  }
  return 0;
}
