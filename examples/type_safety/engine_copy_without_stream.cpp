// MISTAKE: a Pinned -> Device copy without a stream, as if it were a memcpy.
// The copy engine needs a stream to queue on and an event to complete
// through; the two-argument gdr::copy is for CPU pairs only. The message:
//   "gdr::copy(dst, src): this pair runs on a GPU copy engine ... and needs a
//    stream: co_await gdr::copy(dst, src, stream) with a gdr::cuda::stream"
#include <gdr/coro/task.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/memory/copy.hpp>

gdr::task<> upload(gdr::buffer<int, gdr::Device>& dev, gdr::buffer<int, gdr::Pinned>& pinned) {
  co_await gdr::copy(dev, pinned);
}

int main() { return 0; }
