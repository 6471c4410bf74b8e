// MISTAKE: dereferencing a peer's memory as if it were local, `remote[0]`.
// A remote_view holds the peer's address, meaningless in this process. The
// compiler says:
//   "gdr::remote_view<T, S>: a peer's memory cannot be dereferenced, iterated
//    or pointed at in this process ... Read it with co_await ep.get(local_view, remote)"
#include <cstdint>

#include <gdr/memory/remote_view.hpp>

std::uint64_t peek(gdr::remote_view<std::uint64_t, gdr::Pinned> remote) { return remote[0]; }

int main() { return 0; }
