// gdr/cuda/stream.hpp: an owning stream; without a GPU construction fails
// with no_device and the probe's reason.
#include <doctest/doctest.h>

#include <ostream>
#include <string>
#include <type_traits>
#include <utility>

#include <gdr/cuda/stream.hpp>

#include "tests/cuda/cuda_test_support.hpp"
#include "tests/support/skip.hpp"

static_assert(!std::is_copy_constructible_v<gdr::cuda::stream>);
static_assert(std::is_nothrow_move_constructible_v<gdr::cuda::stream>);

TEST_CASE("without a GPU a stream cannot be made, and the error says why") {
  std::string why = gdr_test::no_gpu_reason();
  if (why.empty()) GDR_SKIP("a GPU is present: the no-GPU path does not apply");
  try {
    gdr::cuda::stream s(0);
    FAIL("a stream was created without a GPU");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::no_device);
    CHECK(std::string(e.what()).find(why) != std::string::npos);
  }
  CHECK(gdr::cuda::stream::create(0).error() == gdr::errc::no_device);
}

TEST_CASE("a new stream is idle, belongs to its device, and moves") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::cuda::stream s(0);
  CHECK(s.get() != nullptr);
  CHECK(s.device() == 0);
  CHECK(s.query().value());
  unsigned flags = 0;
  REQUIRE(cudaStreamGetFlags(s.get(), &flags) == cudaSuccess);
  CHECK((flags & cudaStreamNonBlocking) != 0);
  cudaStream_t raw = s.get();
  gdr::cuda::stream t(std::move(s));
  CHECK(t.get() == raw);
  CHECK(s.get() == nullptr);  // NOLINT: moved-from state
  auto r = gdr::cuda::stream::create(0);
  REQUIRE(r.has_value());
  CHECK(r->get() != nullptr);
}

TEST_CASE("an out-of-range device ordinal is no_device") {
  CHECK_THROWS_AS(gdr::cuda::stream(1 << 20), gdr::error);
}
