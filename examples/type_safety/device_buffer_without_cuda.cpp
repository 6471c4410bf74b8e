// MISTAKE: allocating GPU memory in a target built without CUDA (it depends
// on //gdr:core only, so GDR_HAS_CUDA=0 and there is no cudaMalloc to call).
// Instead of a link error far away, the buffer says what to change:
//   "gdr::buffer<T, gdr::Device> needs CUDA, and this translation unit is built
//    without it (GDR_HAS_CUDA=0). Depend on //gdr:cuda ..."
#include <gdr/memory/buffer.hpp>

int main() {
  gdr::buffer<float, gdr::Device> d(1024);
  return static_cast<int>(d.size());
}
