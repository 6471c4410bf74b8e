// MISTAKE: copying between views of different element types (int -> float).
// A byte copy would not convert the values, and an element copy would be a
// different operation, so gdr refuses to guess:
//   "gdr::copy: the element types of dst and src differ. Copy between views of
//    the same T, or copy raw bytes: gdr::as_bytes(dst) and gdr::as_bytes(src)"
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/memory/copy.hpp>

gdr::task<> convert(std::vector<float>& dst, std::vector<int>& src) {
  co_await gdr::copy(gdr::host_view(dst), gdr::host_view(src));
}

int main() { return 0; }
