// MISTAKE: sending a container directly, ep.send(std::vector<...>). An
// endpoint moves memory whose space it knows: a gdr::view or gdr::buffer.
// The message:
//   "gdr endpoint: ep.send(x) takes a gdr::view or a gdr::buffer, which say
//    which memory space the bytes are in; x is neither. For host memory (a
//    std::vector, std::array or std::span) make a view with
//    gdr::host_view(x); ..."
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/transport/tcp.hpp>

gdr::task<> publish(gdr::tcp::endpoint& ep) {
  std::vector<int> v(16);
  co_await ep.send(v);
}

int main() { return 0; }
