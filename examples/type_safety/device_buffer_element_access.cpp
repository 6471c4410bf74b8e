// MISTAKE: writing one element of a GPU buffer from the host, `d[0] = 1`.
// A buffer follows its view's rules, so the message is the view's:
//   "gdr::view<T, S>: the host cannot dereference memory in space S (Device or
//    Remote). Copy it into a Host or Pinned buffer first ..."
#include <gdr/memory/buffer.hpp>

void reset(gdr::buffer<int, gdr::Device>& d) { d[0] = 1; }

int main() { return 0; }
