// flashgen CUDA: status reporting for generated entry points.
//
// Every entry point returns an FgStatus (args.h). When it is not FG_OK, a human-readable reason
// (the CUDA error string for launch failures, the offending argument otherwise) is kept in a
// per-thread buffer that last_error_string() returns until the next call on the same thread.
// A generated translation unit exports it as
//
//   extern "C" const char* fg_NAME_error(void) { return flashgen::cuda::last_error_string(); }
//
// or, equivalently, FG_DEFINE_ERROR_ENTRY(fg_NAME_error).
#pragma once
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>

#include "flashgen/args.h"

namespace flashgen {
namespace cuda {

namespace detail {
inline char* error_buffer() {
  static thread_local char buf[512] = "";
  return buf;
}

inline void clear_error() { error_buffer()[0] = '\0'; }

// Record a formatted reason and return `status` (so callers can `return fail(...)`).
inline int fail(int status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(error_buffer(), 512, fmt, ap);
  va_end(ap);
  return status;
}

inline int fail_cuda(int status, const char* what, cudaError_t err) {
  return fail(status, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}
}  // namespace detail

// Reason for the last non-FG_OK status returned on this thread ("" after a successful call).
inline const char* last_error_string() { return detail::error_buffer(); }

}  // namespace cuda
}  // namespace flashgen

#define FG_DEFINE_ERROR_ENTRY(NAME) \
  extern "C" const char* NAME(void) { return flashgen::cuda::last_error_string(); }
