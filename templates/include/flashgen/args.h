// flashgen kernel ABI: the argument blocks the generated forward and backward entry points take.
//
// Shared by the CPU and CUDA kernel families. Plain C layout (no torch headers) so that
// the Python side can fill it through ctypes and kernel translation units compile
// standalone. Bump FG_ABI_VERSION whenever a field changes.
#pragma once
#include <stdint.h>

#define FG_ABI_VERSION 3

#ifdef __cplusplus
extern "C" {
#endif

// Dropout on P (FlashAttention's fused dropout, Alg. 2 and 4), read only by variants with
// kHasDropout (the spec declares `dropout`). dropout_state null: no dropout. Otherwise it points
// to {seed, offset}, two int64 (bit patterns of uint64) on the inputs' device -- a device read,
// so nothing syncs the host and a captured CUDA graph replays with the values of each replay.
// Element (b, h, q, kv) (h the query head, absolute positions) is kept iff
// fg_dropout_keep(seed, offset, b * heads_q + h, q, kv, dropout_threshold) (philox.h), and
// kept probabilities are multiplied by dropout_scale; the softmax statistics (m, l, lse) are
// those of the undropped P. The host computes threshold = round(p * 2^24) and scale = 1 / (1 - p)
// (flashgen/philox.py), so every family uses the same integers.
// The op refuses dropout_p > 0 before any launch on a family that does not apply it yet
// (flashgen.ops.DROPOUT_BACKENDS).

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
  const int64_t* dropout_state;  // nullable: int64[2] {seed, offset}; see "Dropout" above
  uint32_t dropout_threshold;     // keep iff (the element's Philox word >> 8) >= threshold
  float dropout_scale;            // 1 / (1 - p)
} FgFwdArgs;

// Backward pass (recomputation, FlashAttention-2 Alg. 2): from q, k, v, out, dout and the saved
// lse, write dq [like q], dk, dv [like k/v]. Nothing else is saved by the forward.
//   D = rowsum(dout ∘ out); P = exp(scale·q kᵀ (masked) − lse); dV = Pᵀ dO; dP = dO Vᵀ;
//   dS = P ∘ (dP − D); dQ = scale · dS K; dK = scale · dSᵀ Q.
// GQA: dk/dv of a kv head are the sums over its query heads (h // (heads_q / heads_kv)).
// Workspaces are allocated by the caller (the Python side) and zero-filled where noted:
//   dq_accum: fp32 [B, Hq, Nq, d] contiguous, zeroed (dQ accumulation across K/V tiles);
//   softmax_d: fp32 [B, Hq, Nq] contiguous (D; the kernel writes it);
//   dk_accum, dv_accum: fp32 [B, Hkv, Nk, d] contiguous, zeroed; used when heads_q != heads_kv
//     (each query head adds its share) -- the entry point then converts them into dk, dv.
// deterministic != 0: bitwise-repeatable results (no order-dependent floating-point atomics).
// Rows that see no key (lse == -inf) get dq = 0 and contribute nothing.
// dlse (nullable, fp32 [B, Hq, Nq] contiguous): the gradient flowing into the returned lse; since
// d lse_i / d s_ij = P_ij, it enters as D_i = rowsum(dout_i ∘ out_i) − dlse_i.
typedef struct FgBwdArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  const float* lse;
  void* dq;
  void* dk;
  void* dv;
  float* dq_accum;
  float* softmax_d;
  float* dk_accum;
  float* dv_accum;
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int64_t q_stride_b, q_stride_h, q_stride_n;
  int64_t k_stride_b, k_stride_h, k_stride_n;
  int64_t v_stride_b, v_stride_h, v_stride_n;
  int64_t o_stride_b, o_stride_h, o_stride_n;
  int64_t do_stride_b, do_stride_h, do_stride_n;
  int64_t dq_stride_b, dq_stride_h, dq_stride_n;
  int64_t dk_stride_b, dk_stride_h, dk_stride_n;
  int64_t dv_stride_b, dv_stride_h, dv_stride_n;
  float scale;
  int32_t num_sms;
  int32_t deterministic;
  void* stream;
  const void* params;
  const float* dlse;  // nullable; see above
  // The forward's dropout values: the backward regenerates the same keep mask from them.
  const int64_t* dropout_state;
  uint32_t dropout_threshold;
  float dropout_scale;
} FgBwdArgs;

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
