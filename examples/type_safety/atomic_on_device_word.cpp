// MISTAKE: a remote atomic on a word of the peer's Device memory. The
// peer's CPU does the atomic, and no CPU may touch Device memory. The
// compiler says:
//   "gdr remote atomics: the word must be in the peer's host memory (Host or
//    Pinned): a CPU does the atomic, and no CPU may touch Device memory"
#include <cstdint>

#include <gdr/transport/tcp.hpp>

gdr::task<std::uint64_t> bump(gdr::tcp::endpoint& ep, gdr::remote_view<std::uint64_t, gdr::Device> counter) {
  co_return co_await ep.fetch_add(counter, 1);
}

int main() { return 0; }
