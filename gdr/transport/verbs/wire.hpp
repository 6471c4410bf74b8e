/// \file
/// The verbs transport's wire: what each side tells the other when the
/// connection is made (`conn_params`, in rdma_cm's private data), the header
/// that starts every SEND (`wire_header`), how a header is checked before
/// the engine sees it (`decode`), the immediate of a WRITE_WITH_IMM
/// (`imm_of`), and how a failed work completion maps to the endpoint's
/// error (`wc_error`).
///
/// Contract: both ends run this library on the same architecture (host byte
/// order). Nothing read from the wire reaches the engine unless `decode`
/// accepted it: a frame of an unknown kind, type or status, a header the
/// protocol layer's `valid` refuses, or a key on a frame that names no
/// buffer of its sender is a protocol error, and the connection fails.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <system_error>

#include <gdr/error.hpp>
#include <gdr/protocol/message.hpp>

namespace gdr::detail::verbs {

/// What each side tells the other in rdma_cm's private data.
struct conn_params {
  std::uint32_t magic = 0x56524447u;  // "GDRV"
  std::uint16_t version = 3;  // 2: puts and gets by RDMA READ and WRITE; 3: the one-sided lane
  std::uint16_t flags = 0;    // flag_gpudirect
  std::uint32_t rx_depth = 0;
  std::uint32_t buffer_size = 0;
  /// The one-sided lane (rma.hpp): this side's NIC domain (0: it exposes
  /// nothing and posts nothing directly), and the queue pairs it initiates
  /// on and is the target of.
  std::uint32_t domain = 0;
  std::uint32_t lane_init_qpn = 0;
  std::uint32_t lane_target_qpn = 0;
  std::uint32_t pad = 0;

  /// The endpoint moves `Device` memory with its NIC (GPUDirect). Both ends
  /// must agree: a staging end would send and want `Device` bytes through
  /// bounce buffers, which a GPUDirect end never copies.
  static constexpr std::uint16_t flag_gpudirect = 1;
};
static_assert(sizeof(conn_params) == 32);

/// Why two ends' parameters cannot make a connection (null: they can).
inline const char* params_disagree(const conn_params& mine, const conn_params& peer) noexcept {
  bool a = (mine.flags & conn_params::flag_gpudirect) != 0;
  bool b = (peer.flags & conn_params::flag_gpudirect) != 0;
  if (a && !b)
    return "gdr::verbs: the peer's endpoint stages Device memory (it was made without endpoint_options::gpudirect), "
           "this one moves it with the NIC: make both ends with the same endpoint_options::gpudirect";
  if (!a && b)
    return "gdr::verbs: the peer's endpoint moves Device memory with the NIC (endpoint_options::gpudirect), this one "
           "stages it: make both ends with the same endpoint_options::gpudirect";
  return nullptr;
}

inline bool params_ok(const conn_params& p) noexcept {
  return p.magic == 0x56524447u && p.version == 3 && p.rx_depth >= 2 && p.buffer_size >= 256 && p.pad == 0;
}

/// What starts every SEND (host byte order: both ends run this library on
/// the same architecture).
struct wire_header {
  /// `lane`: the one-sided lane's control (rma.hpp): `type` is
  /// `lane_reset` or `lane_ready`, `id` the lane's generation.
  enum kind_t : std::uint8_t { frame = 1, cont = 2, credit = 3, lane = 4 };
  static constexpr std::uint8_t lane_reset = 1;
  static constexpr std::uint8_t lane_ready = 2;
  std::uint8_t kind = 0;
  std::uint8_t type = 0;
  std::uint8_t status = 0;
  std::uint8_t flags = 0;     ///< the protocol header's flags (`proto::flag::last` on data)
  std::uint32_t credits = 0;  ///< receive buffers the sender has consumed and posted again (mod 2^32)
  std::uint64_t length = 0;
  std::uint64_t size = 0;
  std::uint64_t tag = 0;
  std::uint64_t id = 0;
  std::uint64_t addr = 0;
  std::uint64_t key = 0;
  std::uint64_t raddr = 0;  ///< rtr, get_request: where the bytes go; put_request: where they are (0: SENDs)
  std::uint32_t rkey = 0;   ///< its remote key
  std::uint32_t pad1 = 0;
};
static_assert(sizeof(wire_header) == 72);
inline constexpr std::size_t wire_size = sizeof(wire_header);

/// The protocol header a frame header carries, or why not.
inline bool decode(const wire_header& w, std::uint64_t max, proto::header& h) noexcept {
  if (w.kind != wire_header::frame || w.pad1 != 0) return false;
  if (w.type < proto::msg_min || w.type > proto::msg_max) return false;
  if (w.status > static_cast<std::uint8_t>(proto::status::no_memory)) return false;
  h = proto::header{};
  h.type = static_cast<proto::msg>(w.type);
  h.st = static_cast<proto::status>(w.status);
  h.flags = w.flags;
  h.length = w.length;
  h.size = w.size;
  h.tag = w.tag;
  h.id = w.id;
  h.addr = w.addr;
  h.key = w.key;
  if (!proto::valid(h, max)) return false;
  // Only an rtr, a put request (its source) and a get request (its
  // destination) name a buffer of their sender.
  bool names_buffer = h.type == proto::msg::rtr || h.type == proto::msg::put_request || h.type == proto::msg::get_request;
  if (!names_buffer && (w.raddr != 0 || w.rkey != 0)) return false;
  return true;
}

/// The immediate of a WRITE_WITH_IMM: which memory of the receiver's it
/// filled. Bit 31 tells a get's reply (`token`: the receiver's request id)
/// from a rendezvous message (`token`: the receiver's rtr token, which is
/// the sender's id); the two id spaces are separate, so the bit keeps equal
/// low bits apart. 31 bits of the token tell apart everything in flight.
constexpr std::uint32_t imm_of(bool get_reply, std::uint64_t token) noexcept {
  return (get_reply ? 0x80000000u : 0u) | (static_cast<std::uint32_t>(token) & 0x7fffffffu);
}

/// Maps a failed work completion to the endpoint's error.
inline std::error_code wc_error(ibv_wc_status s) noexcept {
  switch (s) {
    case IBV_WC_SUCCESS: return {};
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_REM_OP_ERR: return errc::protocol_error;
    default: return errc::connection_lost;
  }
}

}  // namespace gdr::detail::verbs
