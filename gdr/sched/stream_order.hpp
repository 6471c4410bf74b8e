/// \file
/// `stream_order`: a CUDA stream that device copies are ordered after (an
/// operation's `op_options::after`, a copy engine's `copy()`). It lives
/// here, below the copy engines and the transfer vocabulary that carry it,
/// and needs no CUDA header: `cudaStream_t` is `CUstream_st*`.
#pragma once

// CUDA's stream type, named so that a stream can be carried without CUDA.
struct CUstream_st;

namespace gdr {

/// A CUDA stream an operation is ordered after (`op_options::after`): the
/// operation's device copies wait for the work already queued on `stream`
/// (a producer kernel) without a host synchronize. Made by
/// `gdr::cuda::after(stream)`. Empty: no ordering.
struct stream_order {
  CUstream_st* stream = nullptr;
  int device = -1;  ///< the stream's GPU
  explicit operator bool() const noexcept { return stream != nullptr; }
};

}  // namespace gdr
