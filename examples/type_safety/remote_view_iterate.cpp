// MISTAKE: looping over a peer's memory with a range-for.
// Iteration needs local pointers; a remote view has none. The message:
//   "gdr::remote_view<T, S>: a peer's memory cannot be dereferenced, iterated
//    or pointed at in this process ..." and names ep.get / ep.put.
#include <gdr/memory/remote_view.hpp>

int count_nonzero(gdr::remote_view<int, gdr::Host> remote) {
  int n = 0;
  for (int x : remote) n += x != 0;
  return n;
}

int main() { return 0; }
