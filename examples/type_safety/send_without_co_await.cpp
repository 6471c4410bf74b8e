// MISTAKE: starting an operation without awaiting it, ep.send(v);
// An operation starts when it is awaited: without `co_await` nothing is
// sent. Every endpoint operation is [[nodiscard]], so the compiler warns
// ("ignoring return value ... nodiscard"), an error under -Werror.
#include <array>

#include <gdr/coro/task.hpp>
#include <gdr/transport/tcp.hpp>

gdr::task<> forget(gdr::tcp::endpoint& ep) {
  std::array<int, 4> v{1, 2, 3, 4};
  ep.send(gdr::host_view(v));  // should be: co_await ep.send(...)
  co_return;
}

int main() { return 0; }
