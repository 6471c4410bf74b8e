// MISTAKE: spelling a peer's memory as a local view, view<T, Remote<Host>>.
// A view is a pointer in this process; a peer's memory is described by
// gdr::remote_view instead. The message:
//   "gdr::view<T, Remote<S>>: a peer's memory is described by
//    gdr::remote_view<T, S>, reachable only through ep.put/ep.get"
#include <gdr/memory/view.hpp>

gdr::view<char, gdr::Remote<gdr::Host>> peer_bytes;

int main() { return 0; }
