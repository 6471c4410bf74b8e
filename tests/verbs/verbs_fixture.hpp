// The verbs transport in the conformance suite: two endpoints in one
// process, connected through rdma_cm over one RDMA device, both on one
// scheduler. The device's IP address comes from GDR_VERBS_IP (or
// RXEVM_IP, which the Soft-RoCE guest sets); without an address or a
// device the fixture says why and the suite skips.
#pragma once

#include <cstdlib>
#include <string>
#include <utility>

#include <gdr/coro/task.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/transport/verbs.hpp>
#include <gdr/transport/verbs/probe.hpp>

namespace conformance {

/// The IP address of the RDMA device the verbs tests use, or empty.
inline std::string verbs_ip() {
  for (const char* v : {"GDR_VERBS_IP", "RXEVM_IP"})
    if (const char* s = std::getenv(v); s != nullptr && *s != '\0') return s;
  return {};
}

/// Why verbs tests cannot run here (empty: they can).
inline std::string verbs_skip_reason() {
  const auto& caps = gdr::verbs::probe();
  if (caps.devices.empty()) return caps.why_not();
  if (verbs_ip().empty()) return "no IP address of an RDMA device given (set GDR_VERBS_IP)";
  return {};
}

/// A connected verbs pair over the device at `verbs_ip()`.
inline gdr::task<std::pair<gdr::verbs::endpoint, gdr::verbs::endpoint>> verbs_pair(
    gdr::scheduler& s, gdr::memory_registry& reg, gdr::verbs::endpoint_options a, gdr::verbs::endpoint_options b) {
  std::string ip = verbs_ip();
  gdr::verbs::listener l(s, ip + ":0", reg, b);
  std::string to = ip + ":" + std::to_string(l.port());
  auto [x, y] = co_await gdr::when_all(gdr::verbs::connect(s, to, ip + ":0", reg, a), l.accept());
  co_return std::pair<gdr::verbs::endpoint, gdr::verbs::endpoint>(std::move(x), std::move(y));
}

struct verbs_fixture {
  using endpoint = gdr::verbs::endpoint;
  static constexpr const char* name = "verbs";
  static std::string skip_reason() { return verbs_skip_reason(); }
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg,
                                                        gdr::protocol_options a, gdr::protocol_options b) {
    gdr::verbs::endpoint_options ea, eb;
    ea.protocol = a;
    eb.protocol = b;
    co_return co_await verbs_pair(s, reg, ea, eb);
  }
};

/// Verbs endpoints made with `endpoint_options::gpudirect`, on the test
/// stand-in's probe (gdr::verbs::testing: no GPU needed): host memory must
/// behave on them exactly as on any endpoint.
struct verbs_gpudirect_fixture {
  using endpoint = gdr::verbs::endpoint;
  static constexpr const char* name = "verbs-gpudirect";
  static std::string skip_reason() { return verbs_skip_reason(); }
  static gdr::task<std::pair<endpoint, endpoint>> pair(gdr::scheduler& s, gdr::memory_registry& reg,
                                                        gdr::protocol_options a, gdr::protocol_options b) {
    gdr::verbs::testing::stand_in_host_memory_for_device(true);
    gdr::verbs::endpoint_options ea, eb;
    ea.protocol = a;
    eb.protocol = b;
    ea.gpudirect = eb.gpudirect = true;
    auto p = co_await verbs_pair(s, reg, ea, eb);
    if (p.first.gpudirect() == nullptr || p.second.gpudirect() == nullptr)
      throw gdr::error(gdr::errc::invalid_argument, "verbs_gpudirect_fixture: not GPUDirect endpoints");
    co_return p;
  }
};

}  // namespace conformance
