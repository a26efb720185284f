// flashgen CUDA block classifier: which (query block, key block) pairs of a Variant's mask are
// empty, partial or full (args.h, FgClassifyArgs). It is what flashgen.block_mask runs on a GPU
// (FlexAttention's create_block_mask without an N x N tensor) and what the ops run per call for
// masks without a closed-form key range.
//
//   template <class Variant>
//   int flashgen::cuda::launch_classify(const FgClassifyArgs& args);   // FgStatus; no host sync
//
// One warp per block. A block outside its row block's closed-form key range [kv_lo, kv_hi) is
// empty and one inside it that Variant::tile_full proves full is full, both without touching an
// element; any other block evaluates keep() on its in-bounds elements, a row at a time with the
// lanes across the keys, until it is known to be partial (with Variant::kRowExact, two compares
// per row against that row's own range instead), and reduces "any kept" / "all kept" over the
// warp.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "flashgen/args.h"
#include "flashgen/cuda/host.cuh"
#include "flashgen/cuda/status.cuh"
#include "flashgen/variant.h"

namespace flashgen {
namespace cuda {

template <class Variant>
struct ClassifyParams {
  int8_t* out;
  const int* cu_q;
  const int* cu_k;
  int heads, seqlen_q, seqlen_k, block_r, block_c, rows, cols;
  typename Variant::Params vp;
};

// One warp per block: warp w of CTA (x, y, z) classifies block (row x, column y * kWarps + w) of
// (b, h) = (z / heads, z % heads).
constexpr int kClassifyWarps = 8;

template <class Variant>
__global__ void __launch_bounds__(kClassifyWarps * 32)
    classify_kernel(const __grid_constant__ ClassifyParams<Variant> p) {
  const int r = blockIdx.x;
  const int c = blockIdx.y * kClassifyWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (c >= p.cols) return;
  const int bh = blockIdx.z;
  const int b = bh / p.heads, h = bh % p.heads;
  int Nq = p.seqlen_q, Nk = p.seqlen_k;
  if (p.cu_q) {
    Nq = __ldg(p.cu_q + b + 1) - __ldg(p.cu_q + b);
    Nk = __ldg(p.cu_k + b + 1) - __ldg(p.cu_k + b);
  }
  int8_t* out = p.out + (int64_t(bh) * p.rows + r) * p.cols + c;
  const int q_lo = r * p.block_r;
  const int q_hi = imin(q_lo + p.block_r, Nq);
  const int kv0 = c * p.block_c;
  const int kv1 = imin(kv0 + p.block_c, Nk);
  int cls;
  if (q_lo >= Nq || kv0 >= Nk) {
    cls = 0;  // the block lies past this (sequence's) end
  } else {
    const int lo = imin(imax(Variant::kv_lo(p.vp, b, h, q_lo, q_hi, Nq, Nk), 0), Nk);
    const int hi = imin(imax(Variant::kv_hi(p.vp, b, h, q_lo, q_hi, Nq, Nk), 0), Nk);
    if (kv0 >= hi || kv1 <= lo || lo >= hi) {
      cls = 0;  // no key of the block is in the row block's range
    } else if (!Variant::kHasMask ||
               (kv0 >= lo && kv1 <= hi && Variant::tile_full(p.vp, b, h, q_lo, q_hi, kv0, kv1, Nq, Nk))) {
      cls = 2;
    } else {
      bool any = false, all = true;
      const int rows = q_hi - q_lo;
      if constexpr (Variant::kRowExact) {
        for (int i = lane; i < rows; i += 32) {
          const int q = q_lo + i;
          const int a = imax(Variant::kv_lo(p.vp, b, h, q, q + 1, Nq, Nk), kv0);
          const int z = imin(Variant::kv_hi(p.vp, b, h, q, q + 1, Nq, Nk), kv1);
          any |= a < z;
          all &= a <= kv0 && z >= kv1;
        }
      } else {
        const int cw = kv1 - kv0;
        for (int i = 0; i < rows; ++i) {  // a row per step, the warp's lanes across its keys
          const int q = q_lo + i;
          for (int j = lane; j < cw; j += 32) {
            const bool k = Variant::keep(p.vp, b, h, q, kv0 + j, Nq, Nk);
            any |= k;
            all &= k;
          }
          if (__any_sync(0xffffffffu, any) && __any_sync(0xffffffffu, !all)) break;  // partial
        }
      }
      any = __any_sync(0xffffffffu, any);
      all = __all_sync(0xffffffffu, all);
      cls = all ? 2 : any ? 1 : 0;
    }
  }
  if (lane == 0) *out = int8_t(cls);
}

template <class Variant>
int launch_classify(const FgClassifyArgs& a) {
  detail::reference_hooks<Variant>();
  detail::clear_error();
  if (a.batch < 0 || a.heads < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.seqlen_q > FG_MAX_SEQLEN ||
      a.seqlen_k > FG_MAX_SEQLEN || a.block_r <= 0 || a.block_c <= 0 ||
      a.rows != (a.seqlen_q + a.block_r - 1) / a.block_r ||
      a.cols != (a.seqlen_k + a.block_c - 1) / a.block_c || a.batch * a.heads > 2147483647 ||
      a.rows > 2147483647 || (a.cu_seqlens_q == nullptr) != (a.cu_seqlens_k == nullptr)) {
    return detail::fail(FG_ERR_BAD_SHAPE,
                        "classify: sizes out of range or inconsistent (batch %lld, heads %lld, "
                        "seqlens %lld x %lld, blocks %d x %d, grid %d x %d)",
                        (long long)a.batch, (long long)a.heads, (long long)a.seqlen_q,
                        (long long)a.seqlen_k, a.block_r, a.block_c, a.rows, a.cols);
  }
  if (a.batch == 0 || a.heads == 0 || a.rows == 0 || a.cols == 0) return FG_OK;
  if (!a.out) return detail::fail(FG_ERR_BAD_SHAPE, "classify: null output");
  ClassifyParams<Variant> p;
  memset(&p, 0, sizeof(p));
  p.out = a.out;
  p.cu_q = a.cu_seqlens_q;
  p.cu_k = a.cu_seqlens_k;
  p.heads = int(a.heads);
  p.seqlen_q = int(a.seqlen_q);
  p.seqlen_k = int(a.seqlen_k);
  p.block_r = a.block_r;
  p.block_c = a.block_c;
  p.rows = a.rows;
  p.cols = a.cols;
  detail::copy_variant_params(p.vp, a.params);
  const dim3 grid(unsigned(a.rows), unsigned((a.cols + kClassifyWarps - 1) / kClassifyWarps),
                  unsigned(a.batch * a.heads));
  if (grid.y > 65535 || grid.z > 65535) {
    return detail::fail(FG_ERR_BAD_SHAPE, "classify: batch x heads (%lld) or block columns / 8 "
                        "(%d) exceed 65535", (long long)(a.batch * a.heads), a.cols);
  }
  classify_kernel<Variant><<<grid, kClassifyWarps * 32, 0, static_cast<cudaStream_t>(a.stream)>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "classify kernel launch", err);
  return FG_OK;
}

}  // namespace cuda
}  // namespace flashgen
