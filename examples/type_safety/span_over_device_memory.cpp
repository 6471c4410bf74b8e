// MISTAKE: turning a Device view into a std::span, which any code may then
// dereference on the host. The conversion exists only for host-accessible
// spaces; here it fails with:
//   "gdr::view<T, S> -> std::span<T>: a std::span is host-dereferenceable, and
//    memory in space S (Device) is not. Keep the gdr::view, or copy ..."
#include <span>

#include <gdr/memory/view.hpp>

std::span<int> as_span(gdr::view<int, gdr::Device> v) { return v; }

int main() { return 0; }
