// flashgen CUDA mainloop building blocks shared by the forward (fwd_mainloop.cuh) and backward
// (bwd_mainloop.cuh) steps: the cp.async tile copy into padded shared memory, the ldmatrix lane
// offsets, and the mask tests of a partial tile (per element, or per row for row-exact masks).
// Layouts and the masking-by-tile-class rule: see fwd.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "flashgen/cuda/ptx.cuh"
#include "flashgen/cuda/scheduler.cuh"
#include "flashgen/variant.h"

namespace flashgen {
namespace cuda {

// Padded head dim (mma k granularity) and shared row pitch: kD = round_up(d, 16); rows are
// padded by 16 bytes (pitch kD + 8 elements), so kD/8 + 1 is odd and the 8 row addresses of
// every ldmatrix phase fall on 8 distinct 16-byte bank groups, and cp.async stays 16-byte aligned.
template <int kHeadDim>
struct HeadDim {
  static constexpr int kD = (kHeadDim + 15) / 16 * 16;
  static constexpr int kPitch = kD + 8;
  static constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks per row
};

// Copy rows [row0, row0 + kRows) of a [rows][d] matrix into shared memory (pitch kD + 8).
// Rows outside [row_begin, row_end) and padded columns past kHeadDim are zero-filled and never
// read, so K/V outside the visited key range (and past seqlen) cannot leak even as NaN.
// kCheckRows = false: the caller guarantees that every row is inside [row_begin, row_end)
// (interior tiles), which drops the per-chunk predicates.
template <class Element, int kHeadDim, int kThreads, int kRows, bool kCheckRows>
__device__ __forceinline__ void load_rows(uint32_t s_addr, const Element* g, int64_t stride_n,
                                          int row0, int row_begin, int row_end, int tid) {
  constexpr int kD = HeadDim<kHeadDim>::kD;
  constexpr int kPitch = HeadDim<kHeadDim>::kPitch;
  constexpr int kChunksPerRow = HeadDim<kHeadDim>::kChunksPerRow;
  constexpr int kChunks = kRows * kChunksPerRow;
  constexpr int kE = int(sizeof(Element));
  if constexpr (kThreads % kChunksPerRow == 0 && kChunks % kThreads == 0) {
    // Common case: each thread owns one 16-byte column and every kRowStep-th row, so one
    // running pointer serves all its chunks (keeps 64-bit address registers to a minimum).
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int cc = tid % kChunksPerRow;
    const int r0 = tid / kChunksPerRow;
    const bool col_ok = kD == kHeadDim || cc * 8 < kHeadDim;
    const Element* src = g + wide(row0 + r0) * stride_n + cc * 8;
#pragma unroll
    for (int i = 0; i < kChunks / kThreads; ++i) {
      const int row = row0 + r0 + i * kRowStep;
      const bool ok = col_ok && (!kCheckRows || (row >= row_begin && row < row_end));
      ptx::cp_async_16(s_addr + ((r0 + i * kRowStep) * kPitch + cc * 8) * kE, ok ? src : g, ok);
      src += kRowStep * stride_n;
    }
  } else {
    constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = tid + i * kThreads;
      if (kChunks % kThreads == 0 || c < kChunks) {
        const int r = c / kChunksPerRow;
        const int cc = c % kChunksPerRow;
        const bool ok = (!kCheckRows || (row0 + r >= row_begin && row0 + r < row_end)) &&
                        (kD == kHeadDim || cc * 8 < kHeadDim);
        const Element* src = ok ? g + wide(row0 + r) * stride_n + cc * 8 : g;
        ptx::cp_async_16(s_addr + (r * kPitch + cc * 8) * kE, src, ok);
      }
    }
  }
}

// Lane offsets inside a 16x16 ldmatrix block (see fwd.cuh): pattern A = rows (l&7)+((l>>3)&1)*8,
// col (l>>4)*8 (A operands, and .trans B operands); pattern B = rows (l&7)+(l>>4)*8, col
// ((l>>3)&1)*8 (non-trans B operands, and the .trans A operand of dQ = dS K).
__device__ __forceinline__ uint32_t lane_off_a(uint32_t lane, int pitch, int elem) {
  return (((lane & 7) + ((lane >> 3) & 1) * 8) * pitch + (lane >> 4) * 8) * elem;
}
__device__ __forceinline__ uint32_t lane_off_b(uint32_t lane, int pitch, int elem) {
  return (((lane & 7) + (lane >> 4) * 8) * pitch + ((lane >> 3) & 1) * 8) * elem;
}

// Per-element visibility on a partial tile: in bounds and kept. keep() runs on every element of
// the tile, out-of-range ones too (its result is then discarded; variant.h allows it), so its
// reads carry no branch and nvcc shares those of one row or column across the tile's elements
// (a document-id mask then costs two loads per row and column, not two per element).
// score() still only sees visible elements.
template <class Variant>
__device__ __forceinline__ bool visible(const typename Variant::Params& vp, int b, int h, int q,
                                        int kv, int kv_begin, int kv_end, int Nq, int Nk) {
  const bool in = kv >= kv_begin && kv < kv_end && q < Nq;
  if constexpr (Variant::kHasMask) {
    return in & Variant::keep(vp, b, h, q, kv, Nq, Nk);
  } else {
    return in;
  }
}

// Keys [lo, hi) of query row q within [kv_begin, kv_end): the variant's key range for the single
// row [q, q+1), clamped to [0, seqlen_k) (empty for q >= seqlen_q). When kRowBounds<Variant>
// (no mask, or Variant::kRowExact: the generator proved that the mask keeps one interval of keys
// per row: causal, windows, prefix-LM, key padding), visible(q, kv) <=> lo <= kv < hi, so a
// partial tile tests two bounds computed once per query row instead of the bounds and keep()
// per element.
template <class Variant>
inline constexpr bool kRowBounds = !Variant::kHasMask || Variant::kRowExact;

template <class Variant>
__device__ __forceinline__ void row_bounds(const typename Variant::Params& vp, int b, int h, int q,
                                           int kv_begin, int kv_end, int Nq, int Nk, int& lo,
                                           int& hi) {
  lo = hi = 0;
  if (q >= Nq) return;
  lo = imax(imin(imax(Variant::kv_lo(vp, b, h, q, q + 1, Nq, Nk), 0), Nk), kv_begin);
  hi = imin(imin(imax(Variant::kv_hi(vp, b, h, q, q + 1, Nq, Nk), 0), Nk), kv_end);
}

}  // namespace cuda
}  // namespace flashgen
