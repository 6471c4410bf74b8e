/// \file
/// CUDA errors in gdr: one `std::error_category` for `cudaError_t`, and one
/// wrapper, `cuda::check`, that every CUDA runtime call in gdr goes through.
///
/// The convention (STYLE.md "Errors": wrap each C API once):
///   1. `cudaSuccess` is no error. `cudaErrorNotReady` is not an error either,
///      but a state; the few calls that return it (`cudaEventQuery`,
///      `cudaStreamQuery`) test for it before calling `check`.
///   2. Any other value is also recorded by the runtime as the thread's "last
///      error", where a later, unrelated `cudaGetLastError()` would find it
///      again. `check` clears it (one `cudaGetLastError()`), so an error is
///      reported once, by the call that caused it.
///   3. Some errors poison the CUDA context: after an illegal address, a
///      failed launch or an uncorrectable ECC error, every later call on the
///      context fails, and no state on the device can be trusted. They cannot
///      be cleared. As in Kokkos, these are fatal: `check` logs one line to
///      stderr and calls `std::abort()`. Continuing would turn one precise
///      error into a stream of unrelated ones far from the cause.
///   4. Everything else is returned as a `std::error_code` in `cuda_category()`
///      and travels, unlogged, to the `co_await` (or constructor) that throws
///      `gdr::error` with it. Only where an error cannot travel (destructors)
///      does gdr log it: "log once, where the error starts".
///
/// Thread-safety: every function here may be called from any thread.
#pragma once

#include <gdr/config.hpp>

#if !GDR_HAS_CUDA
#error "gdr/cuda/*.hpp needs CUDA: depend on //gdr:cuda (it defines GDR_HAS_CUDA=1 and links cudart)"
#endif

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <system_error>

#include <gdr/error.hpp>
#include <gdr/log.hpp>

namespace gdr::cuda {

namespace detail {

class cuda_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "cuda"; }
  std::string message(int value) const override {
    auto e = static_cast<cudaError_t>(value);
    // Both strings are static in the runtime and need no driver.
    return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
  }
};

/// Constant-initialised, as gdr_category's (no guard on each error code).
inline constinit const cuda_category_impl cuda_category_instance{};

}  // namespace detail

/// The category of `cudaError_t` values.
inline const std::error_category& cuda_category() noexcept { return detail::cuda_category_instance; }

/// A `cudaError_t` as an error code (`cudaSuccess` gives no error).
inline std::error_code make_error_code(cudaError_t e) noexcept {
  return {static_cast<int>(e), cuda_category()};
}

/// True for errors that poison the CUDA context (the "sticky" errors of the
/// CUDA runtime documentation): every later call fails and device memory may
/// be corrupt. `check` treats them as fatal.
///
/// The list follows the runtime's documentation of each code ("the process
/// must be terminated and relaunched", "the context cannot be used").
constexpr bool is_context_poisoning(cudaError_t e) noexcept {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorTensorMemoryLeak:
      return true;
    default:
      return false;
  }
}

namespace detail {

/// Writes "gdr: <what>: <message>" to stderr. Used only where an error cannot
/// be returned (destructors, fatal errors).
inline void log_error(std::error_code ec, const char* what) noexcept {
  gdr::detail::log("cuda", "%s: %s", what != nullptr ? what : "CUDA call", ec.message().c_str());
}

[[noreturn]] inline void fatal(cudaError_t e, const char* what) noexcept {
  // Several threads may hit the same poisoned context: print one line.
  static std::atomic_flag printed = ATOMIC_FLAG_INIT;
  if (!printed.test_and_set()) {
    gdr::detail::log("cuda",
                "fatal error in %s: %s: %s. The CUDA context is poisoned "
                "(every later call would fail); aborting.",
                what != nullptr ? what : "a CUDA call", cudaGetErrorName(e), cudaGetErrorString(e));
  }
  std::abort();
}

}  // namespace detail

/// The one wrapper for `cudaError_t` results (see the file comment).
///
/// Returns no error for `cudaSuccess`; otherwise clears the runtime's
/// last-error state and returns the error, or aborts for a context-poisoning
/// error. `what` names the call for the fatal message (e.g. "cudaMemcpyAsync").
/// Does not log non-fatal errors: the caller returns them.
inline std::error_code check(cudaError_t e, const char* what = nullptr) noexcept {
  if (GDR_LIKELY(e == cudaSuccess)) return {};
  if (is_context_poisoning(e)) detail::fatal(e, what);
  // Clear the per-thread last error so it is not reported again by an
  // unrelated call that checks cudaGetLastError().
  (void)cudaGetLastError();
  return make_error_code(e);
}

/// `check` for code that cannot return an error (destructors): logs a
/// non-fatal error once, here, and carries on.
inline void check_or_log(cudaError_t e, const char* what) noexcept {
  if (std::error_code ec = check(e, what)) detail::log_error(ec, what);
}

}  // namespace gdr::cuda
