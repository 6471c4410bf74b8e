// gdr/cuda/error.hpp: the CUDA error category and the one wrapper. Most run
// without a GPU (they need only the runtime library).
#include <doctest/doctest.h>

#include <ostream>
#include <string>

#include <gdr/cuda/error.hpp>

#include "tests/cuda/cuda_test_support.hpp"
#include "tests/support/skip.hpp"

TEST_CASE("cuda errors are error codes in the cuda category with the runtime's name and text") {
  std::error_code ec = gdr::cuda::make_error_code(cudaErrorMemoryAllocation);
  CHECK(std::string(ec.category().name()) == "cuda");
  CHECK(ec.value() == static_cast<int>(cudaErrorMemoryAllocation));
  CHECK(ec.message().find("cudaErrorMemoryAllocation") != std::string::npos);
  gdr::error e(ec, "cudaMalloc");
  CHECK(std::string(e.what()).find("cudaMalloc") != std::string::npos);
}

TEST_CASE("check passes success through and returns other errors") {
  CHECK_FALSE(gdr::cuda::check(cudaSuccess));
  std::error_code ec = gdr::cuda::check(cudaErrorInvalidValue, "test");
  CHECK(ec.value() == static_cast<int>(cudaErrorInvalidValue));
  CHECK(&ec.category() == &gdr::cuda::cuda_category());
}

TEST_CASE("check leaves no last error behind for a later unrelated call to find") {
  // Without a driver the runtime's own initialisation error is permanent
  // (every call returns it): nothing to clear.
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  // Make the runtime record a recoverable error: an invalid copy direction.
  cudaError_t e = cudaMemcpy(nullptr, nullptr, 1, static_cast<cudaMemcpyKind>(77));
  REQUIRE(e != cudaSuccess);
  std::error_code ec = gdr::cuda::check(e, "cudaMemcpy");
  CHECK(ec);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("context-poisoning errors are told apart from recoverable ones") {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorHardwareStackError,
                        cudaErrorIllegalInstruction, cudaErrorMisalignedAddress, cudaErrorInvalidAddressSpace,
                        cudaErrorInvalidPc, cudaErrorAssert, cudaErrorECCUncorrectable, cudaErrorLaunchTimeout}) {
    CHECK_MESSAGE(gdr::cuda::is_context_poisoning(e), cudaGetErrorName(e));
  }
  for (cudaError_t e : {cudaSuccess, cudaErrorNotReady, cudaErrorMemoryAllocation, cudaErrorInvalidValue,
                        cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorInvalidResourceHandle}) {
    CHECK_FALSE_MESSAGE(gdr::cuda::is_context_poisoning(e), cudaGetErrorName(e));
  }
}
