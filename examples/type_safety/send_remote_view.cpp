// MISTAKE: sending a remote_view as if it were a message, ep.send(remote).
// A remote_view names the peer's registered memory; it is written with put
// and read with get. The message:
//   "gdr endpoint: ep.send(remote_view) - a remote_view names the peer's
//    registered memory and cannot be sent as a message. Write into it with
//    co_await ep.put(local_view, remote) or read it with co_await ep.get(...)"
#include <gdr/coro/task.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/transport/tcp.hpp>

gdr::task<> publish(gdr::tcp::endpoint& ep, gdr::remote_view<int, gdr::Host> remote) {
  co_await ep.send(remote);
}

int main() { return 0; }
