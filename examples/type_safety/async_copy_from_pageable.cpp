// MISTAKE: queueing an asynchronous copy-engine copy from pageable memory.
// cudaMemcpyAsync would accept it and then block the host (or stage it
// unsafely); gdr::cuda::memcpy_async requires page-locked memory and says:
//   "gdr::cuda::memcpy_async: the source is pageable Host memory, and an
//    asynchronous copy needs page-locked memory ... gdr::buffer<T, gdr::Pinned>"
#include <system_error>
#include <vector>

#include <gdr/memory/cuda_copy.hpp>
#include <gdr/cuda/stream.hpp>
#include <gdr/memory/buffer.hpp>

std::error_code upload(std::vector<int>& host, gdr::buffer<int, gdr::Device>& dev, gdr::cuda::stream& s) {
  return gdr::cuda::memcpy_async(dev.view(), gdr::host_view(host), s);
}

int main() { return 0; }
