// quickstart: a small coroutine pipeline on one gdr::scheduler. Timers run
// concurrently on io_uring; a host buffer is staged into pinned memory; where
// a GPU exists the bytes go Pinned -> Device -> Pinned on the copy engine and
// complete through CUDA events; then real messages cross an in-process
// loopback pair and a TCP connection on 127.0.0.1, with one-sided put/get on
// registered memory. Needs: io_uring; a GPU is optional (it says why not).
#include <gdr/gdr.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

using namespace std::chrono_literals;

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::uint64_t checksum(std::span<const std::uint32_t> s) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::uint32_t x : s) h = (h ^ x) * 1099511628211ull;
  return h;
}

// 1. Three timers at once: the scheduler submits them in one batch and the
//    loop sleeps in the kernel until each expires.
gdr::task<> sleep(std::chrono::milliseconds d) { co_await gdr::sleep_for(d); }

gdr::task<> timers() {
  auto t0 = std::chrono::steady_clock::now();
  co_await gdr::when_all(sleep(10ms), sleep(20ms), sleep(30ms));
  std::printf("1. timers: slept 10, 20 and 30 ms concurrently in %.1f ms\n", ms_since(t0));
}

// 2-3. Host -> Pinned on the CPU; Pinned -> Device -> Pinned on the GPU's copy
//      engine when there is one, then the device buffer sent as a message
//      (the staged path).
gdr::task<> memory(std::vector<std::uint32_t>& data) {
  gdr::buffer<std::uint32_t, gdr::Pinned> pinned(data.size());
  co_await gdr::copy(pinned, gdr::host_view(data));
  std::printf("2. memory: %zu KiB Host -> Pinned on the CPU, checksum %s\n", pinned.size_bytes() / 1024,
              checksum(pinned.span()) == checksum(data) ? "matches" : "DIFFERS");
#if GDR_HAS_CUDA
  if (!gdr::cuda::probe_devices().usable()) {
    std::printf("3. GPU: none here (%s); the GPU step is skipped\n", gdr::cuda::probe_devices().reason.c_str());
    co_return;
  }
  gdr::cuda::event_poller events(gdr::this_scheduler());
  gdr::cuda::stream stream(0);
  gdr::buffer<std::uint32_t, gdr::Device> dev(data.size(), 0);
  gdr::buffer<std::uint32_t, gdr::Pinned> back(data.size());
  auto t0 = std::chrono::steady_clock::now();
  co_await gdr::copy(dev, pinned, stream);   // copy engine, H2D
  co_await gdr::copy(back, dev, stream);     // copy engine, D2H
  double ms = ms_since(t0);
  std::printf("3. GPU: Pinned -> Device -> Pinned, 2 x %zu KiB on the copy engine in %.2f ms, checksum %s\n",
              back.size_bytes() / 1024, ms, checksum(back.span()) == checksum(data) ? "matches" : "DIFFERS");
  {
    // The same GPU memory as a message between two endpoints: staged
    // through pinned bounce buffers, the copies completing through `events`.
    auto pair = gdr::loopback::make_pair(gdr::this_scheduler());
    gdr::buffer<std::uint32_t, gdr::Device> dev2(data.size(), 0);
    auto send = [&]() -> gdr::task<std::size_t> { co_return co_await pair.first.send(dev); };
    auto recv = [&]() -> gdr::task<std::size_t> { co_return co_await pair.second.recv(dev2); };
    auto [sent, got] = co_await gdr::when_all(send(), recv());
    (void)sent;
    co_await gdr::copy(back, dev2, stream);
    std::printf("   Device -> Device as one message over a loopback pair: %zu KiB, path %s, checksum %s\n",
                got / 1024, gdr::to_string(pair.second.last_path()),
                checksum(back.span()) == checksum(data) ? "matches" : "DIFFERS");
  }
  // gdr::view<std::uint32_t, gdr::Device> v = dev; v[0];  // would not compile: host dereference of Device memory
#else
  std::printf("3. GPU: this build has no CUDA (depend on //gdr:cuda)\n");
#endif
}

// 4. An in-process endpoint pair: message boundaries, and the path taken.
gdr::task<> loopback(gdr::scheduler& sched) {
  auto pair = gdr::loopback::make_pair(sched);
  auto& a = pair.first;  // references, not structured bindings: clang 14
  auto& b = pair.second; // cannot capture those in the lambdas below
  std::vector<int> out{1, 2, 3, 4}, in(16);
  auto sender = [&]() -> gdr::task<> { co_await a.send(gdr::host_view(std::as_const(out))); };
  auto receiver = [&]() -> gdr::task<std::size_t> { co_return co_await b.recv(gdr::host_view(in)); };
  auto [ignored, n] = co_await gdr::when_all(sender(), receiver());
  (void)ignored;
  std::printf("4. loopback: one message of %zu bytes from a to b, path %s\n", n, gdr::to_string(b.last_path()));
}

// 5. TCP on 127.0.0.1 through io_uring: an echo server and a client as two
//    coroutines on the same loop, then one-sided put/get into registered memory.
gdr::task<> tcp(gdr::scheduler& sched) {
  gdr::tcp::listener listener(sched, "127.0.0.1:0");
  std::string where = listener.local_address().to_string();
  std::vector<std::uint32_t> window(1024, 0);
  gdr::registration reg = gdr::register_memory(gdr::host_view(window));

  auto server = [&]() -> gdr::task<> {
    gdr::tcp::endpoint ep = co_await listener.accept();
    std::vector<std::byte> buf(4096);
    // Publish the registered window: the peer may now put into it and get from it.
    auto wire = reg.describe(0).to_wire();
    co_await ep.send(gdr::view<const std::byte, gdr::Host>(wire.data(), wire.size()));
    for (;;) {
      std::size_t n = co_await ep.recv(gdr::host_view(buf));
      if (n == 0) break;  // an empty message ends the echo
      co_await ep.send(gdr::view<const std::byte, gdr::Host>(buf.data(), n));
    }
    co_await ep.close();
  };

  auto client = [&]() -> gdr::task<> {
    gdr::tcp::endpoint ep = co_await gdr::tcp::connect(sched, where);
    std::array<std::byte, gdr::remote_view<std::uint32_t, gdr::Host>::wire_size> wire{};
    co_await ep.recv(gdr::host_view(wire));
    auto remote = gdr::remote_view<std::uint32_t, gdr::Host>::from_wire(wire).value();

    std::vector<std::byte> msg(4096, std::byte{7}), echo(4096);
    auto t0 = std::chrono::steady_clock::now();
    constexpr int rounds = 100;
    for (int i = 0; i < rounds; ++i) {
      co_await ep.send(gdr::view<const std::byte, gdr::Host>(msg.data(), msg.size()));
      co_await ep.recv(gdr::host_view(echo));
    }
    double us = ms_since(t0) * 1000.0 / rounds;
    std::printf("5. tcp: %d echoes of 4 KiB with %s, %.1f us per round trip, last path %s\n", rounds,
                where.c_str(), us, gdr::to_string(ep.last_path()));

    std::vector<std::uint32_t> mine(256);
    std::iota(mine.begin(), mine.end(), 1000u);
    co_await ep.put(gdr::host_view(std::as_const(mine)), remote.subview(512, 256));
    std::vector<std::uint32_t> check(256);
    co_await ep.get(gdr::host_view(check), remote.subview(512, 256));
    std::printf("   put 1 KiB into the peer's registered window and got it back: %s\n",
                check == mine ? "equal" : "DIFFERENT");
    // 256 elements from element 900 run past the 1024-element window: the peer refuses.
    gdr::remote_view<std::uint32_t, gdr::Host> past(remote.address() + 900 * sizeof(std::uint32_t), 256,
                                                    remote.key(), remote.peer());
    auto denied = co_await ep.get(gdr::host_view(check), past).as_result();
    std::printf("   a get that runs past the window: %s\n", denied.error().message().c_str());
    co_await ep.send(gdr::view<const std::byte, gdr::Host>(msg.data(), 0));
    co_await ep.close();
  };

  co_await gdr::when_all(server(), client());
}

gdr::task<> pipeline(gdr::scheduler& sched) {
  co_await timers();
  std::vector<std::uint32_t> data(256 * 1024);
  std::iota(data.begin(), data.end(), 0u);
  co_await memory(data);
  co_await loopback(sched);
  co_await tcp(sched);
}

}  // namespace

int main() {
  try {
    gdr::scheduler sched;
    std::printf("gdr quickstart: one io_uring scheduler, %s mode\n",
                sched.mode() == gdr::run_mode::sleep ? "sleep" : "busy-poll");
    gdr::sync_wait(sched, pipeline(sched));
    std::printf("done: %llu completions, %llu kernel entries\n",
                static_cast<unsigned long long>(sched.stats().completions),
                static_cast<unsigned long long>(sched.stats().submits));
    return 0;
  } catch (const gdr::error& e) {
    std::fprintf(stderr, "quickstart failed: %s\n", e.what());
    return 1;
  }
}
