// Must NOT compile: a TCP endpoint cannot send GPU memory. The diagnostic
// must say that device memory needs a staged path or another transport.
#include <gdr/transport/tcp.hpp>

gdr::task<> f(gdr::tcp::endpoint& ep, gdr::view<float, gdr::Device> d) {
  co_await ep.send(d);
}
