// MISTAKE: a local copy into a peer's memory, gdr::copy(remote, local).
// Remote memory is reached only through a transport endpoint (a put or get
// with the registration's key), never by a local copy. The message:
//   "gdr::copy: one side is a gdr::remote_view, a peer's memory. It is reachable
//    only through a transport endpoint: co_await ep.put(local_view, remote) ..."
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/memory/copy.hpp>
#include <gdr/memory/remote_view.hpp>

gdr::task<> publish(gdr::remote_view<int, gdr::Host> remote, std::vector<int>& local) {
  co_await gdr::copy(remote, gdr::host_view(local));
}

int main() { return 0; }
