// flashgen CUDA host prelude, shared by the launchers (launch_fwd_tiled, launch_bwd_tiled,
// launch_classify): the checks of a call's sizes, packed-batch metadata, block lists, pointer
// alignment and strides (each failure returns an FgStatus with a reason, status.cuh, that the
// Python side turns into an error), the copy of the fields every attention kernel's Params has
// (row strides, scale, dropout, block lists, the variant's parameters), and the once-per-device
// dynamic shared-memory opt-in. Host code only.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "flashgen/args.h"
#include "flashgen/cuda/scheduler.cuh"
#include "flashgen/cuda/status.cuh"
#include "flashgen/variant.h"

namespace flashgen {
namespace cuda {
namespace detail {

// Reference every hook: a kernel skips keep() without a mask and score() without a score mod,
// the forward never calls the backward's dscore()/param_grad(), and a generated variant in an
// anonymous namespace would otherwise draw "declared but never referenced" warnings for them.
template <class Variant>
inline void reference_hooks() {
  (void)&Variant::keep;
  (void)&Variant::score;
  (void)&Variant::tile_full;
  (void)&Variant::dscore;
  (void)&Variant::param_grad;
  (void)&Variant::param_grad_enabled;
  (void)Variant::kHasScoreMod;
  (void)Variant::kHasParamGrad;
  (void)Variant::kHasDropout;
  (void)Variant::kRowExact;
}

constexpr int64_t kIntMax = 2147483647;

// An attention call's sizes (FgFwdArgs / FgBwdArgs): head_dim is the kernel's; batch, heads and
// seqlens >= 0, batch and heads in int32 (heads_kv too when check_kv_heads), seqlens at most
// FG_MAX_SEQLEN; heads_q a multiple of heads_kv; packed (varlen) metadata (args.h) present iff
// the instantiation takes packed batches, with totals in [0, 2^31).
template <class Args>
inline int check_sizes(const Args& a, int head_dim, bool packed_kernel, bool check_kv_heads) {
  if (a.head_dim != head_dim) {
    return fail(FG_ERR_BAD_HEAD_DIM, "head_dim %lld differs from this kernel's %d",
                (long long)a.head_dim, head_dim);
  }
  const bool kv_bad = check_kv_heads && (a.heads_kv < 0 || a.heads_kv > kIntMax);
  if (a.batch < 0 || a.heads_q < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.batch > kIntMax ||
      a.heads_q > kIntMax || kv_bad || a.seqlen_q > FG_MAX_SEQLEN || a.seqlen_k > FG_MAX_SEQLEN) {
    return fail(FG_ERR_BAD_SHAPE,
                "sizes out of range: batch %lld, heads_q %lld, heads_kv %lld, seqlen_q %lld, "
                "seqlen_k %lld (each must be >= 0; batch and heads fit in int32, seqlens at most "
                "2^30)",
                (long long)a.batch, (long long)a.heads_q, (long long)a.heads_kv,
                (long long)a.seqlen_q, (long long)a.seqlen_k);
  }
  if (a.heads_q > 0 && (a.heads_kv <= 0 || a.heads_q % a.heads_kv != 0)) {
    return fail(FG_ERR_BAD_SHAPE, "heads_q %lld is not a multiple of heads_kv %lld",
                (long long)a.heads_q, (long long)a.heads_kv);
  }
  // Packed (varlen) batches (args.h): per-sequence rows from cu_seqlens, batch strides unused.
  const bool packed = a.cu_seqlens_q != nullptr;
  if (packed != packed_kernel) {
    return fail(FG_ERR_BAD_SHAPE, packed_kernel ? "this instantiation takes packed batches: "
                                                  "cu_seqlens_q must be set"
                                                : "this instantiation takes padded batches: "
                                                  "cu_seqlens_q must be null");
  }
  if (packed && (!a.cu_seqlens_k || a.total_q < 0 || a.total_k < 0 || a.total_q > kIntMax ||
                 a.total_k > kIntMax)) {
    return fail(FG_ERR_BAD_SHAPE,
                "packed batch: cu_seqlens_k must be set with cu_seqlens_q, totals "
                "(%lld, %lld) in [0, 2^31)", (long long)a.total_q, (long long)a.total_k);
  }
  return FG_OK;
}

// Block lists (args.h, FgBlockLists): present iff the instantiation is kSparse, for rows x cols
// tiles of block_r x block_c, strides >= 0 (the host checks the rest: flashgen/sparsity.py).
inline int check_block_lists(const FgBlockLists& l, bool sparse, const char* name, int64_t rows,
                             int64_t cols, int block_r, int block_c) {
  if ((l.data != nullptr) != sparse) {
    return fail(FG_ERR_BAD_SHAPE, sparse ? "this instantiation is block-sparse: %s must be set"
                                         : "this instantiation is dense: %s must be null", name);
  }
  if (!sparse) return FG_OK;
  if (l.rows != rows || l.cols != cols || l.block_r != block_r || l.block_c != block_c ||
      l.stride_b < 0 || l.stride_h < 0) {
    return fail(FG_ERR_BAD_SHAPE,
                "%s: lists of %d x %d tiles of %d x %d (strides %lld, %lld) do not fit this "
                "kernel's %lld x %lld tiles of %d x %d",
                name, l.rows, l.cols, l.block_r, l.block_c, (long long)l.stride_b,
                (long long)l.stride_h, (long long)rows, (long long)cols, block_r, block_c);
  }
  return FG_OK;
}
// Lists of a query-major kernel of block_m x block_n tiles (kv lists) or of a key-major one
// (q lists: pass seqlen_k, seqlen_q and the key tile first).
inline int check_tile_lists(const FgBlockLists& l, bool sparse, const char* name, int64_t n_rows,
                            int64_t n_cols, int block_r, int block_c) {
  return check_block_lists(l, sparse, name, (n_rows + block_r - 1) / block_r,
                           (n_cols + block_c - 1) / block_c, block_r, block_c);
}
inline BlockLists block_lists(const FgBlockLists& l) {
  return BlockLists{reinterpret_cast<const int*>(l.data), l.stride_b, l.stride_h, l.cols,
                    l.full_kept};
}

inline bool misaligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; }
// A stride only matters where its dimension has more than one index.
inline bool bad_stride(int64_t stride, int64_t extent, int64_t elems16) {
  return extent > 1 && (stride % elems16) != 0;
}
// A [batch, heads, rows, d] tensor the kernels read or write in 16-byte chunks: base 16-byte
// aligned, strides multiples of elems16 elements where their dimension has more than one index.
inline bool bad_tensor(const void* ptr, int64_t sb, int64_t sh, int64_t sn, int64_t nb,
                       int64_t heads, int64_t rows, int64_t elems16) {
  return misaligned(ptr) || bad_stride(sb, nb, elems16) || bad_stride(sh, heads, elems16) ||
         bad_stride(sn, rows, elems16);
}
inline bool misaligned4(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) != 0; }
inline int fail_alignment(const char* what, int64_t elems16) {
  return fail(FG_ERR_ALIGNMENT,
              "%s: base pointers must be 16-byte aligned (lse/softmax_d/dlse 4-byte) and "
              "batch/head/row strides multiples of %lld elements (last dim contiguous)",
              what, (long long)elems16);
}

// Row strides of a tensor into a kernel's Params (the batch stride is unused, 0, when packed).
inline void set_strides(int64_t& sb, int64_t& sh, int64_t& sn, int64_t b, int64_t h, int64_t n,
                        bool packed) {
  sb = packed ? 0 : b, sh = h, sn = n;
}

// The variant's parameters (args.params, null allowed when they are empty) into a kernel's
// by-value argument.
template <class VParams>
inline void copy_variant_params(VParams& vp, const void* params) {
  if constexpr (!std::is_empty<VParams>::value) {
    if (params) memcpy(&vp, params, sizeof(vp));
  }
}

// The fields every attention kernel's Params has besides its tensors: the scale (natural and
// log2 units), dropout (read only with Variant::kHasDropout), the block lists and the variant's
// parameters.
template <class Variant, class P, class Args>
inline void fill_common(P& p, const Args& a, const FgBlockLists& lists) {
  p.scale = a.scale;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.dropout.state = Variant::kHasDropout ? a.dropout_state : nullptr;
  p.dropout.threshold = a.dropout_threshold;
  p.dropout.scale = a.dropout_scale;
  p.blk = block_lists(lists);
  copy_variant_params(p.vp, a.params);
}

// A diagnostic switch (A/B timing), read per launch before anything is launched: environment
// variable `name` unset -> `dflt`, `off` -> 0, `on` -> 1; anything else is FG_ERR_BAD_SHAPE
// naming the variable and its values.
inline int switch_env(const char* name, const char* off, const char* on, bool dflt, int& value) {
  const char* env = getenv(name);
  if (!env) {
    value = dflt;
  } else if (strcmp(env, off) == 0 || strcmp(env, on) == 0) {
    value = strcmp(env, on) == 0;
  } else {
    return fail(FG_ERR_BAD_SHAPE, "%s=%s: expected %s or %s (or unset)", name, env, off, on);
  }
  return FG_OK;
}

// The backwards' (both CUDA families) FLASHGEN_DROPOUT_BWD_SHARE=1 | 0: lane pairs share their
// Philox calls (dropout.cuh, dropout_bits_kv_pair; the same keep mask); on by default (H100, d 128,
// causal, p 0.1: forward+backward 1.05-1.08x the unshared form, gradients bit-equal); 0 (unread)
// without dropout. It goes into the backward's Params only
// (dropout_pair_share): the forwards' parameter layout, and so their register allocation, stays.
template <class Variant>
inline int dropout_share_env(int& value) {
  value = 0;
  if constexpr (Variant::kHasDropout) return switch_env("FLASHGEN_DROPOUT_BWD_SHARE", "0", "1", true, value);
  return FG_OK;
}

// Raise a kernel's dynamic shared-memory limit once per (kernel, device).
template <class KernelPtr>
inline int ensure_smem(KernelPtr kernel, int smem, std::atomic<uint64_t>& configured, int dev,
                       const char* what) {
  const uint64_t bit = dev >= 0 && dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit != 0 && (configured.load(std::memory_order_acquire) & bit)) return FG_OK;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
  }
  if (err != cudaSuccess) {
    cudaGetLastError();  // the failed attribute call must not poison the next launch check
    return fail(FG_ERR_SMEM_ATTR,
                "cannot raise dynamic shared memory of the %s to %d bytes on device %d: %s",
                what, smem, dev, cudaGetErrorString(err));
  }
  configured.fetch_or(bit, std::memory_order_acq_rel);
  return FG_OK;
}

// Largest dynamic shared memory a block may opt into on a device, cached (0 if unknown).
inline int max_smem_optin(int dev) {
  static std::atomic<int> cache[64];
  if (dev >= 0 && dev < 64) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v) return v;
  }
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (dev >= 0 && dev < 64) cache[dev].store(bytes, std::memory_order_relaxed);
  return bytes;
}

// gridDim.x for `work` items (at least 1), at most `cap`: CTAs loop over the rest (scheduler.cuh).
inline int grid_for(int64_t work, int64_t cap) {
  if (work < 1) work = 1;
  return int(work < cap ? work : cap);
}

}  // namespace detail
}  // namespace cuda
}  // namespace flashgen
