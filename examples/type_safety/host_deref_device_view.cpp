// MISTAKE: reading GPU memory from the host through a view, `v[0]`.
// Device memory is not host-dereferenceable: on most systems this would be a
// segfault, on some a silent wrong value. gdr rejects it at compile time:
//   "gdr::view<T, S>: the host cannot dereference memory in space S (Device or
//    Remote). Copy it into a Host or Pinned buffer first ..."
#include <gdr/memory/view.hpp>

float first_element(gdr::view<float, gdr::Device> v) { return v[0]; }

int main() { return 0; }
