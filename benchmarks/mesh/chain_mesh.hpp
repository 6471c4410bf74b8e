// The way connect_mesh built its step 3 before it was made parallel, kept
// here only so that the mesh benchmark measures before and after in the
// same run: rank i connects to every higher rank in turn, awaiting each
// hello's send (which waits for the peer's accept), and only then accepts
// its i lower ranks one after another. A rank therefore starts accepting
// only after every higher rank has, and the critical path grows with the
// square of the rank count. Steps 1, 2 and 4 are the library's own
// (gdr/bootstrap/detail/mesh_steps.hpp), as they were unchanged.
#pragma once

#include <array>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include <gdr/bootstrap/mesh.hpp>

namespace bench_chain {

namespace bsd = gdr::bootstrap::detail;

/// The chain over `net` (a `build_mesh` transport, see mesh.hpp).
template <gdr::bootstrap::rendezvous R, class Net>
gdr::task<gdr::bootstrap::mesh> connect_chain_mesh(R& rv, Net& net, const gdr::bootstrap::mesh_options& opts) {
  static constexpr const char* who = "connect_mesh (chain)";
  const bsd::mesh_table t = bsd::introduce_and_publish(rv, net, who, opts.listen_host);
  const std::chrono::milliseconds timeout = opts.timeout;
  std::vector<gdr::endpoint> peers(static_cast<std::size_t>(t.size));
  std::string failure = t.failure;

  // 3a. Connect to every higher rank in turn and introduce ourselves.
  const auto hello = bsd::mesh_hello(t.session, t.rank, t.size);
  for (int j = t.rank + 1; j < t.size && failure.empty(); ++j) {
    const std::string& where = t.where[static_cast<std::size_t>(j)];
    auto conn = net.connect(where, timeout);
    auto ep = co_await std::move(conn);
    if (!ep) {
      failure = "connecting to rank " + std::to_string(j) + ": " + ep.error().message();
      break;
    }
    auto send = ep->send(gdr::view<const std::byte, gdr::Host>(hello.data(), hello.size()),
                         bsd::timeout_options(timeout));
    gdr::result<std::size_t> sent = co_await std::move(send).as_result();
    if (!sent) {
      failure = "greeting rank " + std::to_string(j) + ": " + sent.error().message();
      break;
    }
    peers[static_cast<std::size_t>(j)] = std::move(*ep);
  }

  // 3b. Accept every lower rank, one at a time.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int missing = failure.empty() ? t.rank : 0;
  while (missing > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      failure = "lower ranks did not connect";
      break;
    }
    auto acc = net.accept(left);
    auto ep = co_await std::move(acc);
    if (!ep) {
      failure = "accepting: " + ep.error().message();
      break;
    }
    std::array<std::byte, 32> h{};
    auto recv = ep->recv(gdr::view<std::byte, gdr::Host>(h.data(), h.size()), bsd::timeout_options(left));
    gdr::result<std::size_t> got = co_await std::move(recv).as_result();
    const int r = got ? bsd::mesh_hello_rank(h, *got, t.session, t.size, t.rank) : -1;
    if (r < 0 || r >= t.rank || peers[static_cast<std::size_t>(r)].is_open()) continue;
    peers[static_cast<std::size_t>(r)] = std::move(*ep);
    --missing;
  }
  net.close();

  // 4. Everyone's outcome.
  auto outcomes = bsd::gather_step(rv, bsd::bytes_of(failure), who, "step 4 (every rank's outcome)");
  std::string report = failure;
  for (int r = 0; r < static_cast<int>(outcomes.size()) && report.empty(); ++r)
    if (!outcomes[static_cast<std::size_t>(r)].empty()) report = "rank " + std::to_string(r) + " failed";
  gdr::bootstrap::mesh m(t.rank, std::move(peers));
  if (!report.empty()) {
    co_await m.close();
    bsd::mesh_fail(who, t.rank, t.size, report);
  }
  co_return m;
}

}  // namespace bench_chain
