// MISTAKE: copying pageable Host memory (a std::vector) straight to the GPU.
// The access table has no direct path (the copy engine cannot DMA pageable
// pages asynchronously); it names the intermediate instead:
//   "gdr::copy: there is no direct copy between pageable Host memory and Device
//    memory ... Stage through a gdr::buffer<T, gdr::Pinned>"
#include <vector>

#include <gdr/coro/task.hpp>
#include <gdr/cuda/stream.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/memory/copy.hpp>

gdr::task<> upload(std::vector<float>& host, gdr::buffer<float, gdr::Device>& dev, gdr::cuda::stream& s) {
  co_await gdr::copy(dev, gdr::host_view(host), s);
}

int main() { return 0; }
