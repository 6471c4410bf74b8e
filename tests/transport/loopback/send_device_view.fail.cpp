// Must not compile: the loopback transport cannot move Device memory (yet).
// tests/transport/loopback:sending_a_device_view_fails_to_compile expects the
// transport's own diagnostic, not a template error deep inside.
#include <gdr/coro/task.hpp>
#include <gdr/transport/loopback.hpp>

gdr::task<> send_device(gdr::loopback::endpoint& ep, float* device_ptr) {
  gdr::view<float, gdr::Device> v(device_ptr, 16, 0);
  co_await ep.send(v);
}

int main() {}
