// tcp_pingpong_count: N 8-byte TCP ping-pongs between two endpoints on one
// busy-polling scheduler, for counting user-space instructions per round
// trip with callgrind (deterministic, unlike time on shared machines):
//
//   g++ -std=c++20 -O2 -DNDEBUG -I. benchmarks/tcp_pingpong_count.cpp -o pp -luring -lpthread
//   valgrind --tool=callgrind ./pp 2000; valgrind --tool=callgrind ./pp 4000
//   # instructions per round trip (both sides) = (Ir(4000) - Ir(2000)) / 2000
#include <array>
#include <cstdlib>

#include <gdr/coro/sync_wait.hpp>
#include <gdr/coro/when_all.hpp>
#include <gdr/transport/tcp.hpp>

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 1000;
  gdr::scheduler s({.mode = gdr::run_mode::busy_poll});
  gdr::tcp::listener l(s, "127.0.0.1:0");
  gdr::sync_wait(s, [&]() -> gdr::task<> {
    auto acc = l.accept();
    gdr::tcp::endpoint a = co_await gdr::tcp::connect(s, l.local_address());
    gdr::tcp::endpoint b = co_await std::move(acc);
    std::array<char, 8> x{}, y{};
    auto server = [&]() -> gdr::task<> {
      for (int i = 0; i < n; ++i) {
        co_await b.recv(gdr::host_view(y));
        co_await b.send(gdr::host_view(y));
      }
    };
    auto client = [&]() -> gdr::task<> {
      for (int i = 0; i < n; ++i) {
        co_await a.send(gdr::host_view(x));
        co_await a.recv(gdr::host_view(x));
      }
    };
    co_await gdr::when_all(server(), client());
    co_await a.close();
    co_await b.close();
  }());
}
