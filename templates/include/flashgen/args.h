// flashgen kernel ABI: the argument block every generated forward entry point takes.
//
// Shared by the CPU and CUDA kernel families. Plain C layout (no torch headers) so that
// the Python side can fill it through ctypes and kernel translation units compile
// standalone. Bump FG_ABI_VERSION whenever a field changes.
#pragma once
#include <stdint.h>

#define FG_ABI_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

// Forward pass: out = softmax(mods(scale * q k^T), masked) v, lse = logsumexp of the same row.
// Layout (PyTorch SDPA's): q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d], out like q; strides are in
// elements, the last dim is contiguous (stride 1). lse is fp32, natural log, contiguous
// [B, Hq, Nq]; -inf for a row that sees no key (whose out row is 0).
typedef struct FgFwdArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int64_t q_stride_b, q_stride_h, q_stride_n;
  int64_t k_stride_b, k_stride_h, k_stride_n;
  int64_t v_stride_b, v_stride_h, v_stride_n;
  int64_t o_stride_b, o_stride_h, o_stride_n;
  float scale;         // softmax scale, natural units (the kernel folds log2(e) in itself)
  int32_t num_sms;     // CUDA: multiprocessor count of the device (0 if unknown); CPU: unused
  void* stream;        // CUDA: cudaStream_t to launch on; CPU: unused
  const void* params;  // the variant's generated Params struct (may be null when it is empty)
} FgFwdArgs;

// Status codes returned by entry points (0 = launched / done).
enum FgStatus {
  FG_OK = 0,
  FG_ERR_BAD_HEAD_DIM = 1,    // head_dim differs from the instantiation's
  FG_ERR_LAUNCH = 2,          // the launch failed; fg_*_error() names the CUDA error
  FG_ERR_SMEM_ATTR = 3,       // raising the dynamic shared-memory limit failed
  FG_ERR_ALIGNMENT = 4,       // a base pointer is not 16-byte aligned or a used stride is not a
                              // multiple of 16 bytes (CUDA); pass contiguous tensors instead
  FG_ERR_BAD_SHAPE = 5,       // negative/too-large sizes, heads_q % heads_kv != 0, null pointers
};

#ifdef __cplusplus
}
#endif
