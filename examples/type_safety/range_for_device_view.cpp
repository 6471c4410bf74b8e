// MISTAKE: iterating a Device view on the host with a range-for.
// `begin()`/`end()` of a Device view would hand out pointers the host must
// not dereference, so they do not compile; the message is the view's:
//   "gdr::view<T, S>: the host cannot dereference memory in space S ..."
// Copy into a Pinned buffer (co_await gdr::copy(pinned, dev, stream)) and loop over that.
#include <gdr/memory/view.hpp>

double sum(gdr::view<const double, gdr::Device> v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

int main() { return 0; }
