// flashgen CUDA backward kernel skeleton (sm_80+, runs on sm_90a): FlashAttention-2 backward
// (Dao 2023, arXiv 2307.08691, Algorithm 2) with mma.sync tensor cores, specialised by a
// generated Variant (flashgen/variant.h).
//
//   template <class Variant, class Element /* __half | __nv_bfloat16 */, int kHeadDim,
//             class Tile /* BwdTile */, class DqTileT /* DqTile */, bool kPacked = false,
//             bool kSparse = false>
//   int flashgen::cuda::launch_bwd_tiled(const FgBwdArgs& args);   // FgStatus; no host sync
//
// kPacked instantiations (launch_bwd_tiled<..., true>) take packed (varlen) batches (args.h): the
// main kernel's items are (key tile up to max_seqlen_k, kv head share, sequence), DqKernel's
// (query tile up to max_seqlen_q, query head, sequence); an item past its sequence's end does
// nothing, and every other item runs on its sequence as a padded batch of that sequence's
// lengths (BwdKernel::localize). The element-wise kernels (preprocess, convert) treat the
// packed rows as one batch of total rows. Padded instantiations compile the code they had before.
//
// kSparse instantiations take block lists (args.h, "Block sparsity"; tiles: the translation unit exports them): the main
// kernel's CTA walks, for each query head of its share, only the query tiles that the q list of its
// key tile names (FgBwdArgs::q_blocks) and that its closed-form range lets see the tile; DqKernel
// walks its query tile's kv list (FgBwdArgs::kv_blocks) as the forward does. Listed-partial tiles
// take the per-element mask; full ones the usual tile test (minus tile_full with full_kept).
//
// Supported head dims: every multiple of 8 from 8 to 256 (padded internally to kD = round_up(d,
// 16) like the forward). Every Variant the forward takes is supported: masks (kv_lo / kv_hi /
// tile_full / keep, evaluated per batch and query head), score mods (kHasScoreMod, through
// dscore) and parameter gradients (kHasParamGrad, through param_grad). Variant::Params comes
// from FgBwdArgs::params (null allowed when it is empty) and is passed to the kernels by value.
//
// Score mods (the contract's "Backward with a score mod"): per in-bounds kept element
//   s = scale·q·k (natural units);  s' = score(s);  P = exp(s' − lse);
//   dS' = P ∘ (dP − D);  dS = dS' · dscore(s), selected as exactly 0 where dS' == 0;
//   dQ = scale·dS K,  dK = scale·dSᵀ Q,  dV = Pᵀ dO  (tensor cores, as without a score mod);
// masked or out-of-bounds elements get P = dS = 0 by selection and never reach a hook, so a
// non-finite score/dscore there (or at a P that underflowed to 0) cannot leak into dq/dk/dv.
// With kHasParamGrad, param_grad(dS', s, b, h, q, kv, ...) runs once per in-bounds kept element
// with dS' != 0: in the main kernel only (never in DqKernel), by one warp when kWarpsD = 2 splits
// a key slab over two warps. The variant accumulates parameter gradients with fg_atomic_add
// (float atomics) into buffers the caller owns (and zero-fills), so they are not bitwise
// repeatable even in the deterministic mode. Score-mod instantiations use smaller tiles (the
// tables in flashgen/tiles.py).
//
// ---------------------------------------------------------------------------------------------
// Launch sequence (all on args.stream, no host synchronisation):
//
//  1. bwd_preprocess_kernel: D = rowsum(dout ∘ out) − dlse (dlse when non-null: the gradient of
//     the returned lse, d lse_i / d s_ij = P_ij) in fp32 into softmax_d; in the
//     non-deterministic mode it also zero-fills dq_accum (and dk_accum/dv_accum when the GQA
//     split below is used), so the caller does NOT have to zero any workspace.
//  2. BwdKernel (the main kernel), one CTA per (key tile of kBlockN keys, kv head [, query-head
//     share], batch). K and V of the tile stay in shared memory; the CTA walks every query tile
//     that can see its keys (for each query head of the GQA group), and for each:
//        S^T = K Q^T, dP^T = V dO^T                     (warp w owns keys 16w..16w+15)
//        P^T = exp2(scale·log2e·S^T − log2e·LSE)         (0 by selection where masked)
//        dS^T = P^T ∘ (dP^T − D)
//          (score mod: P^T = exp2(log2e·score(scale·S^T) − log2e·LSE), dS^T = dscore ∘ that,
//           and param_grad; see score_grads)
//        dV += P^T dO,  dK += dS^T Q                     (P^T, dS^T straight from registers)
//        non-deterministic: dS^T -> shared memory; after a barrier, dQ_partial = dS K on all
//        warps, added to dq_accum with fp32 atomics (red.global.add.v2.f32 on sm_90).
//        (BwdTile::kDeferDq moves this to the start of the next step instead.)
//     Epilogue: dK·scale, dV in the input dtype (or fp32 atomics into dk_accum/dv_accum for a
//     split GQA group).
//     A device whose shared memory cannot hold the non-deterministic main kernel but can hold
//     the deterministic one (e.g. sm_86/89, 99 KB, at kD = 80) takes the deterministic path
//     below instead. Shared memory per CTA (bytes; non-deterministic main / deterministic main /
//     DqKernel): kD = 64: 93,184 / 74,752 / 55,296; kD = 128: 158,720 / 140,288 / 104,448;
//     kD = 256: 140,800 / 135,680 / 135,168; with a score mod at kD = 128: 115,200 / 104,960 /
//     104,448. So kD >= 96 needs sm_80 or sm_90 (like the forward's larger tiles); sm_86/89 get
//     FG_ERR_SMEM_ATTR there.
//  3. dq: non-deterministic: bwd_convert_kernel, dq = scale · dq_accum in the input dtype.
//     deterministic: DqKernel, one CTA per (query tile, query head, batch) recomputes S, P, dP,
//     dS (with the score-mod chain rule, without param_grad) for its rows over all visible key
//     tiles and accumulates dQ = dS K in registers (no atomics for dq/dk/dv, dq_accum unused):
//     bitwise-repeatable, ~7/5 of the tensor-core work.
//  4. GQA split (non-deterministic only): when (key tiles × kv heads × batch) is at most half
//     the multiprocessor count, the query heads of a group are shared among several CTAs which
//     add dK, dV into dk_accum/dv_accum (fp32 atomics); bwd_convert_kernel then writes dk, dv.
//     Otherwise (and always in deterministic mode) one CTA loops over the whole group and writes
//     dk/dv directly: dk_accum/dv_accum are then unused.
//
// Query tiles that see a key tile are found generically with Variant::kv_lo/kv_hi, per query
// head (a mask may depend on b and h, and one K/V-major CTA serves all query heads of its GQA
// share): every lane of a warp tests q tiles lane, lane+32, ... of each head of the share and the
// warp reduces min/max, so the CTA walks [m_first, m_last] once per head and skips (with a
// uniform test on that head's range) any (head, tile) pair that cannot see the key tile. K/V rows
// are loaded for the union of the ranges. Without a mask the ranges are the whole key range for
// every head, and one scan serves all heads. (With BwdTile::kRotate the walk starts at an offset
// proportional to the key tile index and wraps around.)
// Tile classification as in the forward: the per-element path (bounds + Variant::keep) runs
// only on tiles that cross that (head, query tile)'s [kv_lo, kv_hi), seqlen_k or seqlen_q, or
// where Variant::tile_full says the mask is partial; there, with bwd_detail::kRowBounds (no mask
// or Variant::kRowExact), each query row's key interval is computed once per tile and tested with
// two compares per element instead. The bare path therefore only sees in-bounds
// elements, which is what lets it call score/dscore/param_grad without per-element bounds tests
// (the same holds in DqKernel).
//
// Rows with LSE = -inf (no visible key) use +inf instead, so P = exp2(x - inf) = 0 there: their
// dq is 0 and they add nothing to dk/dv (with a score mod dS' = 0 too, so dscore's value and
// param_grad are skipped). Keys no query sees get dk = dv = 0 exactly. K/V rows of a tile outside
// the union of the visible ranges are zero-filled in shared memory.
//
// ---------------------------------------------------------------------------------------------
// Fragment layouts: see fwd.cuh. The main kernel uses
//   S^T = K Q^T:   A = K rows of the warp (ldmatrix, Q's pattern in the forward),
//                  B(k=d, n=q) = Q[q][d] (ldmatrix non-trans, K's pattern in the forward)
//   dP^T = V dO^T: same with V and dO
//   dV += P^T dO:  A = P^T from the S^T accumulators (C->A register reuse),
//                  B(k=q, n=d) = dO[q][d] (ldmatrix.trans, V's pattern in the forward)
//   dK += dS^T Q:  same with dS^T and Q
//   dQ = dS K:     A(row=q, k=kv) = sdS[kv][q] (ldmatrix.trans with K's lane pattern: matrices
//                  (kv0-7,q0-7),(kv0-7,q8-15),(kv8-15,q0-7),(kv8-15,q8-15) = a0..a3),
//                  B(k=kv, n=d) = K[kv][d] (ldmatrix.trans, V's pattern)
// dS^T is stored as sdS[kv][q] with 32-bit stores of the packed A fragments (pitch kBlockM+8:
// conflict-free stores and ldmatrix).
#pragma once
#include <limits.h>

#include "flashgen/cuda/fwd.cuh"

// Upper bound on gridDim.x of the backward kernels (tests lower it to exercise the CTA loops).
#ifndef FLASHGEN_BWD_MAX_GRID
#define FLASHGEN_BWD_MAX_GRID 2147483647
#endif

namespace flashgen {
namespace cuda {

// Explicit element -> float conversions: torch's extension builds define
// __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__, which remove the implicit ones.
__device__ __forceinline__ float elem_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float elem_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }


namespace bwd_detail {

// 4-byte async copy (zero-filled when pred is false), for the per-row LSE and D vectors whose
// rows are not 16-byte aligned in general.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(pred ? 4 : 0)
               : "memory");
}

// dst[0] += a, dst[1] += b in fp32 (dst 8-byte aligned); one vector reduction on sm_90.
__device__ __forceinline__ void atomic_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// Copy rows [row0, row0 + kRows) of a [rows][d] matrix into shared memory (pitch kD + 8).
// Rows outside [row_begin, row_end) and the padded columns past kHeadDim are zero-filled.
template <class Element, int kHeadDim, int kThreads, int kRows, bool kCheckRows>
__device__ __forceinline__ void load_rows(uint32_t s_addr, const Element* g, int64_t stride_n,
                                          int row0, int row_begin, int row_end, int tid) {
  constexpr int kD = (kHeadDim + 15) / 16 * 16;
  constexpr int kPitch = kD + 8;
  constexpr int kChunksPerRow = kD / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  constexpr int kE = int(sizeof(Element));
  if constexpr (kThreads % kChunksPerRow == 0 && kChunks % kThreads == 0) {
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

// threadIdx.x through volatile asm: the compiler re-reads it where it is used instead of keeping
// values derived from it live (or spilled) across the main loop.
__device__ __forceinline__ int tid_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(r));
  return int(r);
}

// Per-element visibility on a partial tile: in bounds and kept. keep() runs on every element of
// the tile, out-of-range ones too (its result is then discarded; variant.h allows it), so its
// reads carry no branch and nvcc shares those of one row or column across the tile's elements
// (a document-id mask then costs two loads per row and column, not two per element).
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
// per row), visible(q, kv) <=> lo <= kv < hi, so a partial tile tests two bounds computed once
// per query row instead of the bounds and keep() per element (as fwd.cuh's row_bounds).
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

// LSE (natural log) -> log2 units, with -inf (row sees no key) mapped to +inf so that
// P = exp2(x - inf) = 0 for the whole row.
__device__ __forceinline__ float lse_log2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
}

// The chain rule through a score mod for one in-bounds, kept element (q < seqlen_q, kv <
// seqlen_k, keep() true; the callers guarantee it, so the hooks never see anything else):
//   s = scale * x (x = q.k, the raw accumulator);  P = exp2(log2e * score(s) - lse2);
//   dS' = P * dp_minus_d;  dS = dS' * dscore(s), selected as exactly 0 where dS' == 0 so that a
//   non-finite dscore at a zero-probability entry cannot leak.
// kParamGrad && param_grad_here: param_grad(dS', s, ...) for elements with dS' != 0 (the variant
// adds atomically); param_grad_here lets exactly one of several warps that recompute the same
// element make the call.
template <class Variant, bool kParamGrad>
__device__ __forceinline__ void score_grads(const typename Variant::Params& vp, float x, float scale,
                                            float lse2, float dp_minus_d, int b, int h, int q,
                                            int kv, int Nq, int Nk, bool param_grad_here,
                                            float& pv, float& ds) {
  const float s = x * scale;
  pv = ptx::exp2_approx(
      fmaf(Variant::score(vp, s, b, h, q, kv, Nq, Nk), 1.4426950408889634f, -lse2));
  const float dsp = pv * dp_minus_d;
  const float dsc = Variant::dscore(vp, s, b, h, q, kv, Nq, Nk);
  ds = dsp != 0.f ? dsp * dsc : 0.f;
  if constexpr (kParamGrad) {
    if (param_grad_here && dsp != 0.f) Variant::param_grad(vp, dsp, s, b, h, q, kv, Nq, Nk);
  }
}

// Lane offsets inside a 16x16 ldmatrix block (see fwd.cuh): kPattern A = rows (l&7)+((l>>3)&1)*8,
// col (l>>4)*8 (A operands, and .trans B operands); pattern B = rows (l&7)+(l>>4)*8, col
// ((l>>3)&1)*8 (non-trans B operands, and the .trans A operand of dQ = dS K).
__device__ __forceinline__ uint32_t lane_off_a(uint32_t lane, int pitch, int elem) {
  return (((lane & 7) + ((lane >> 3) & 1) * 8) * pitch + (lane >> 4) * 8) * elem;
}
__device__ __forceinline__ uint32_t lane_off_b(uint32_t lane, int pitch, int elem) {
  return (((lane & 7) + (lane >> 4) * 8) * pitch + ((lane >> 3) & 1) * 8) * elem;
}

}  // namespace bwd_detail

// ---------------------------------------------------------------------------------------------
// Tile configurations.

// Main kernel: kWarps warps; warp w owns the 16 keys of slab w / kWarpsD and the head-dim
// 16-column pairs p ≡ w % kWarpsD (mod kWarpsD) of dK/dV (kWarpsD = 2 splits the dK/dV
// accumulators of large head dims over two warps, which then both compute the slab's S^T and
// dP^T). kBlockN = 16 * kWarps / kWarpsD keys per CTA; kBlockM query rows per inner step. In the
// dQ = dS K GEMM the warps form a kWarpsMdq x (kWarps / kWarpsMdq) grid over (q rows, d pairs).
// Two options, both off by default (H200, bf16, B*N = 16K tokens, d = 64/128, N = 1K..16K: each
// within +-3% of the default, no consistent gain; kDeferDq also costs 18 KB of shared memory):
// kDeferDq (non-deterministic mode): the dQ GEMM + atomics of step i run at the start of step
// i+1, right after its barrier, from a double-buffered dS^T (one barrier per step instead of
// two). Default: dQ right after the step, behind a second barrier, one dS^T buffer.
// kRotate: CTA n starts its walk over the visible query tiles at offset n*count/num_key_tiles
// (wrapping around), so that the CTAs of one head add into different rows of dq_accum at any
// time. Default: every CTA walks from its first visible query tile.
template <int kBlockM_, int kWarps_, int kWarpsD_, int kWarpsMdq_, bool kDeferDq_ = false,
          bool kRotate_ = false>
struct BwdTile {
  static constexpr bool kDeferDq = kDeferDq_;
  static constexpr bool kRotate = kRotate_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kWarpsD = kWarpsD_;
  static constexpr int kWarpsMdq = kWarpsMdq_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = 16 * kWarps / kWarpsD;
  static_assert(kWarpsD == 1 || kWarpsD == 2, "kWarpsD must be 1 or 2");
  static_assert(kWarps % kWarpsD == 0, "kWarps must be a multiple of kWarpsD");
  static_assert(kBlockM % 16 == 0 && kBlockM >= 16, "kBlockM must be a multiple of 16");
  static_assert(kWarps % kWarpsMdq == 0 && kBlockM % (16 * kWarpsMdq) == 0 &&
                    kBlockM / kWarpsMdq <= 32,
                "the dQ GEMM gives each warp 16 or 32 query rows");
  static_assert(2 * kBlockM <= 32 * kThreads, "LSE/D staging");
};

// Deterministic dQ kernel: kWarps warps x 16 query rows, kBlockN keys per K/V tile.
template <int kWarps_, int kBlockN_>
struct DqTile {
  static constexpr int kWarps = kWarps_;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kThreads = kWarps * 32;
  static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16");
};

// The tiles of an instantiation (main kernel and DqKernel) are chosen in Python
// (flashgen/tiles.py, with the measurements behind its tables) and rendered into the generated
// translation unit, which calls launch_bwd_tiled with them.

// ---------------------------------------------------------------------------------------------
// Preprocessing: D = rowsum(dout ∘ out) (fp32), optional zero-fill of the fp32 workspaces.

template <class Element>
struct BwdPreParams {
  const Element* o;
  const Element* dout;
  int64_t o_sb, o_sh, o_sn, do_sb, do_sh, do_sn;
  float* dsum;        // [rows]
  const float* dlse;  // [rows] or null: D = rowsum(dout ∘ out) - dlse
  float* dq_accum;  // [rows, d] or null (not zeroed)
  int64_t rows;     // B * Hq * Nq
  int heads_q, seqlen_q;
  float* zero_a;  // zero-filled [zero_count] when non-null (dk_accum)
  float* zero_b;  // (dv_accum)
  int64_t zero_count;  // multiple of 4
};

template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_preprocess_kernel(const BwdPreParams<Element> p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kTpr = kChunks <= 1 ? 1 : kChunks <= 2 ? 2 : kChunks <= 4 ? 4 : kChunks <= 8 ? 8
                       : kChunks <= 16 ? 16 : 32;  // threads per row
  static_assert(kChunks <= 32, "head dim <= 256");
  constexpr int kRowsPerBlock = 256 / kTpr;
  const int tid = threadIdx.x;
  const int c = tid % kTpr;
  const int64_t stride = int64_t(gridDim.x) * kRowsPerBlock;
  for (int64_t base = int64_t(blockIdx.x) * kRowsPerBlock; base < p.rows; base += stride) {
    const int64_t row = base + tid / kTpr;
    float acc = 0.f;
    if (row < p.rows && c < kChunks) {
      const int64_t bh = row / p.seqlen_q;
      const int q = int(row - bh * p.seqlen_q);
      const int h = int(bh % p.heads_q);
      const int64_t b = bh / p.heads_q;
      const uint4 ov = *reinterpret_cast<const uint4*>(p.o + b * p.o_sb + wide(h) * p.o_sh +
                                                       wide(q) * p.o_sn + c * 8);
      const uint4 dv = *reinterpret_cast<const uint4*>(p.dout + b * p.do_sb + wide(h) * p.do_sh +
                                                       wide(q) * p.do_sn + c * 8);
      const Element* oe = reinterpret_cast<const Element*>(&ov);
      const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc = fmaf(elem_to_float(oe[i]), elem_to_float(de[i]), acc);
      if (p.dq_accum) {
        float4* z = reinterpret_cast<float4*>(p.dq_accum + row * kHeadDim + c * 8);
        z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int off = kTpr / 2; off >= 1; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < p.rows && c == 0) p.dsum[row] = p.dlse ? acc - p.dlse[row] : acc;
  }
  if (p.zero_a) {
    const int64_t n4 = p.zero_count / 4;
    for (int64_t i = int64_t(blockIdx.x) * 256 + tid; i < n4; i += int64_t(gridDim.x) * 256) {
      reinterpret_cast<float4*>(p.zero_a)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      reinterpret_cast<float4*>(p.zero_b)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#else
  __trap();
#endif
}

// dst[b, h, n, :] = Element(mul * src[(b*H + h)*N + n, :]) for all rows (src contiguous fp32).
template <class Element>
struct BwdConvertParams {
  const float* src;
  Element* dst;
  int64_t rows;
  int heads, seqlen;
  int64_t sb, sh, sn;
  float mul;
};

template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_convert_kernel(const BwdConvertParams<Element> p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kChunks = kHeadDim / 8;
  const int64_t total = p.rows * kChunks;
  for (int64_t i = int64_t(blockIdx.x) * 256 + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * 256) {
    const int64_t row = i / kChunks;
    const int c = int(i - row * kChunks);
    const int64_t bh = row / p.seqlen;
    const int n = int(row - bh * p.seqlen);
    const int h = int(bh % p.heads);
    const int64_t b = bh / p.heads;
    const float4* s = reinterpret_cast<const float4*>(p.src + row * kHeadDim + c * 8);
    const float4 x = s[0], y = s[1];
    uint4 out;
    out.x = ptx::pack2<Element>(x.x * p.mul, x.y * p.mul);
    out.y = ptx::pack2<Element>(x.z * p.mul, x.w * p.mul);
    out.z = ptx::pack2<Element>(y.x * p.mul, y.y * p.mul);
    out.w = ptx::pack2<Element>(y.z * p.mul, y.w * p.mul);
    *reinterpret_cast<uint4*>(p.dst + b * p.sb + wide(h) * p.sh + wide(n) * p.sn + c * 8) = out;
  }
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Main kernel.

template <class Variant, class Element, int kHeadDim, class Tile, bool kComputeDq,
          bool kPacked = false, bool kSparse = false>
struct BwdKernel {
  static_assert(kHeadDim >= 8 && kHeadDim <= 256 && kHeadDim % 8 == 0,
                "flashgen CUDA backward supports head_dim in {8, 16, 24, ..., 256} (multiples of "
                "8 up to 256)");
  static_assert(std::is_same<Element, __half>::value || std::is_same<Element, __nv_bfloat16>::value,
                "flashgen CUDA backward supports __half and __nv_bfloat16 inputs");
  using VParams = typename Variant::Params;
  static_assert(std::is_trivially_copyable<VParams>::value,
                "Variant::Params must be trivially copyable (it is passed by value to the kernel)");

  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kWarps = Tile::kWarps;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kWarpsD = Tile::kWarpsD;
  static constexpr int kWarpsMdq = Tile::kWarpsMdq;
  static constexpr int kWarpsDdq = kWarps / kWarpsMdq;
  static constexpr int kQAtomsDq = kBlockM / kWarpsMdq / 16;
  static constexpr int kD = (kHeadDim + 15) / 16 * 16;
  static constexpr int kPitch = kD + 8;
  static constexpr int kChunksPerRow = kD / 8;
  static constexpr int kDPairs = kD / 16;
  static constexpr int kPairsKV = (kDPairs + kWarpsD - 1) / kWarpsD;   // dK/dV pairs per warp
  static constexpr int kPairsDq = (kDPairs + kWarpsDdq - 1) / kWarpsDdq;  // dQ pairs per warp
  static constexpr int kMBlocks = kBlockM / 8;  // 8-query accumulator blocks of S^T
  static constexpr int kPitchS = kBlockM + 8;   // sdS pitch (elements)
  static constexpr int kE = int(sizeof(Element));
  // Shared memory (bytes): K, V tiles; Q and dO rings (2 stages); dS^T (1 or 2 buffers, none in
  // the deterministic mode); LSE, D rings.
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kBlockN * kPitch * kE;
  static constexpr int kOffQ = kOffV + kBlockN * kPitch * kE;
  static constexpr int kStageQ = kBlockM * kPitch * kE;
  static constexpr int kOffDO = kOffQ + 2 * kStageQ;
  static constexpr int kOffS = kOffDO + 2 * kStageQ;
  static constexpr bool kDeferDq = Tile::kDeferDq;
  static constexpr int kSBufs = kComputeDq ? (kDeferDq ? 2 : 1) : 0;  // dS^T buffers
  static constexpr int kSBuf = kBlockN * kPitchS * kE;
  static constexpr int kOffL = kOffS + kSBufs * kSBuf;
  static constexpr int kOffDs = kOffL + 2 * kBlockM * 4;
  static constexpr int kSmem = kOffDs + 2 * kBlockM * 4;
  static constexpr float kLog2e = 1.4426950408889634f;

  struct Params {
    const Element* q;
    const Element* k;
    const Element* v;
    const Element* dout;
    const float* lse;
    const float* dsum;
    Element* dk;
    Element* dv;
    float* dq_accum;
    float* dk_accum;  // used when num_splits > 1
    float* dv_accum;
    const int* cu_q;  // kPacked: cu_seqlens_q / cu_seqlens_k (args.h, packed batches)
    const int* cu_k;
    int64_t total_q, total_k;
    int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn;
    int64_t dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn;
    int64_t total_work;  // num_n_tiles * num_splits * heads_kv * batch
    int heads_q, heads_kv, group, num_splits, heads_per_split;
    int seqlen_q, seqlen_k, num_m_tiles, num_n_tiles;
    float scale, scale_log2;
    DropoutArgs dropout;  // read only with Variant::kHasDropout (state null: off)
    BlockLists blk;       // kSparse: q lists, a row per key tile (args.h)
    VParams vp;
  };

  // First row of (batch b, query head h) in the per-row fp32 buffers (lse, dsum, dq_accum
  // rows) and of (b, kv head hkv) in dk_accum / dv_accum: padded [B, H, N] rows; packed
  // [H, total] rows, offset by the sequence's start (already added to the pointers, localize).
  static __device__ __forceinline__ int64_t q_rows(const Params& p, int b, int h) {
    return kPacked ? wide(h) * p.total_q : (wide(b) * p.heads_q + h) * int64_t(p.seqlen_q);
  }
  static __device__ __forceinline__ int64_t k_rows(const Params& p, int b, int hkv) {
    return kPacked ? wide(hkv) * p.total_k : (wide(b) * p.heads_kv + hkv) * int64_t(p.seqlen_k);
  }
  // Packed batches: the Params of sequence sp, as if it were a padded batch of its own lengths
  // (pointers moved to its first rows; batch strides are 0).
  static __device__ __forceinline__ Params localize(const Params& p, const SeqSpan& sp) {
    Params lp = p;
    lp.seqlen_q = sp.len_q;
    lp.seqlen_k = sp.len_k;
    lp.num_m_tiles = (sp.len_q + kBlockM - 1) / kBlockM;
    lp.q += wide(sp.q0) * p.q_sn;
    lp.dout += wide(sp.q0) * p.do_sn;
    lp.k += wide(sp.k0) * p.k_sn;
    lp.v += wide(sp.k0) * p.v_sn;
    lp.dk += wide(sp.k0) * p.dk_sn;
    lp.dv += wide(sp.k0) * p.dv_sn;
    lp.lse += sp.q0;
    lp.dsum += sp.q0;
    if (p.dq_accum) lp.dq_accum += wide(sp.q0) * kHeadDim;
    if (p.dk_accum) lp.dk_accum += wide(sp.k0) * kHeadDim;
    if (p.dv_accum) lp.dv_accum += wide(sp.k0) * kHeadDim;
    return lp;
  }

  struct Range {
    int begin, end;
  };
  // Keys the query tile m of (batch b, query head h) may see, clamped to [0, seqlen_k] (as in
  // the forward).
  static __device__ __forceinline__ Range kv_range(const Params& p, int b, int h, int m) {
    const int q_lo = m * kBlockM;
    const int q_hi = imin(q_lo + kBlockM, p.seqlen_q);
    Range r;
    r.begin = imin(imax(Variant::kv_lo(p.vp, b, h, q_lo, q_hi, p.seqlen_q, p.seqlen_k), 0),
                   p.seqlen_k);
    r.end = imin(imax(Variant::kv_hi(p.vp, b, h, q_lo, q_hi, p.seqlen_q, p.seqlen_k), 0),
                 p.seqlen_k);
    return r;
  }
  static __device__ __forceinline__ bool sees(const Range& r, int kv0) {
    return r.begin < r.end && r.begin < kv0 + kBlockN && r.end > kv0;
  }
  // Advance (gi, m) to the next step of the CTA's walk: the heads h0 + gi of its share in order,
  // for each the query tiles m_start, m_start + 1, ..., m_last, m_first, ..., m_start - 1, minus
  // the (head, tile) pairs that cannot see key tile kv0. gi == n_heads: the walk is over.
  // Without a mask every head sees the same tiles (all keys), m_start is one of them, and a wrap
  // back to m_start simply moves on to the next head.
  static __device__ __forceinline__ void next_step(const Params& p, int b, int h0, int n_heads,
                                                   int m_first, int m_last, int m_start, int kv0,
                                                   int& gi, int& m) {
    if constexpr (Variant::kHasMask) {
      do {
        m = m == m_last ? m_first : m + 1;
        if (m == m_start) ++gi;
      } while (gi < n_heads && !sees(kv_range(p, b, h0 + gi, m), kv0));
    } else {
      do {
        m = m == m_last ? m_first : m + 1;
      } while (m != m_start && !sees(kv_range(p, b, h0, m), kv0));
      if (m == m_start) ++gi;
    }
  }

  // kSparse: advance (gi, idx) to the next listed (head, query tile) pair of key tile n_tile that
  // can see it: the heads h0 + gi of the share in order, for each its q list (partial tiles
  // first). Sets m and whether the list calls that tile partial; gi == n_heads: the walk is over.
  static __device__ __forceinline__ void next_listed(const Params& p, int b, int h0, int n_heads,
                                                     int n_tile, int kv0, int& gi, int& idx,
                                                     int& m, bool& partial) {
    for (;;) {
      const BlockRow row = block_row(p.blk, b, h0 + gi, n_tile);
      if (++idx >= row.n_all) {
        idx = -1;
        if (++gi >= n_heads) return;
        continue;
      }
      m = __ldg(row.idx + idx);
      partial = idx < row.n_part;
      if (m >= 0 && m < p.num_m_tiles && sees(kv_range(p, b, h0 + gi, m), kv0)) return;
    }
  }

  struct Item {
    int n_tile, split, hkv, b;
  };
  // Key tile fastest (CTAs of one head run together and share its Q/dO in L2), lowest key tile
  // first (the heaviest under causal / bottom-aligned masks).
  static __device__ __forceinline__ Item decode_item(const Params& p, int iter) {
    int64_t w = int64_t(ptx::ctaid_x()) + int64_t(iter) * ptx::nctaid_x();
    Item it;
    int64_t r = w / p.num_n_tiles;
    it.n_tile = int(w - r * p.num_n_tiles);
    w = r;
    r = w / p.num_splits;
    it.split = int(w - r * p.num_splits);
    w = r;
    r = w / p.heads_kv;
    it.hkv = int(w - r * p.heads_kv);
    it.b = int(r);
    return it;
  }

  // First query head of the item's share of its GQA group (heads_per_split heads).
  static __device__ __forceinline__ int first_head(const Params& p, const Item& it) {
    return it.hkv * p.group + it.split * p.heads_per_split;
  }

  // Q, dO rows of query tile m (head h) and their LSE / D into stage `stage`.
  static __device__ __forceinline__ void load_q_tile(const Params& p, uint32_t smem_base,
                                                     int stage, int b, int h, int m, int tid) {
    const int q_lo = m * kBlockM;
    const int Nq = p.seqlen_q;
    const Element* q_g = p.q + wide(b) * p.q_sb + wide(h) * p.q_sh;
    const Element* do_g = p.dout + wide(b) * p.do_sb + wide(h) * p.do_sh;
    const uint32_t sQ = smem_base + kOffQ + stage * kStageQ;
    const uint32_t sdO = smem_base + kOffDO + stage * kStageQ;
    if (q_lo + kBlockM <= Nq) {
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockM, false>(sQ, q_g, p.q_sn, q_lo, 0,
                                                                          Nq, tid);
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockM, false>(sdO, do_g, p.do_sn, q_lo,
                                                                          0, Nq, tid);
    } else {
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sQ, q_g, p.q_sn, q_lo, 0,
                                                                         Nq, tid);
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sdO, do_g, p.do_sn, q_lo,
                                                                         0, Nq, tid);
    }
    const int64_t row0 = q_rows(p, b, h);
#pragma unroll
    for (int i = 0; i < (2 * kBlockM + kThreads - 1) / kThreads; ++i) {
      const int c = tid + i * kThreads;
      if (c < 2 * kBlockM) {
        const bool is_d = c >= kBlockM;
        const int r = is_d ? c - kBlockM : c;
        const int q = q_lo + r;
        const bool ok = q < Nq;
        const float* src = (is_d ? p.dsum : p.lse) + (ok ? row0 + q : 0);
        const uint32_t dst = smem_base + (is_d ? kOffDs : kOffL) + (stage * kBlockM + r) * 4;
        bwd_detail::cp_async_4(dst, src, ok);
      }
    }
  }

  // P^T and dS^T from the S^T / dP^T accumulators of one (query tile, key slab). kParamGrad:
  // call param_grad (only instantiated when Variant::kHasParamGrad; the caller picks it when
  // Variant::param_grad_enabled, so that without parameter gradients no atomic sits between
  // the elements and the score's parameter reads are loaded once per call, not per element).
  template <bool kMasked, bool kParamGrad>
  static __device__ __forceinline__ void probs_grads(const Params& p, float (&st)[kMBlocks][4],
                                                     float (&dpt)[kMBlocks][4], const float* sL,
                                                     const float* sD, int b, int h, int q_lo,
                                                     int kv_row0, const Range& r, int wd,
                                                     int lane) {
    const int g = lane >> 2, t = lane & 3;
    [[maybe_unused]] const float c = p.scale_log2;  // unused with a score mod
    // Dropout (FlashAttention, Alg. 4): the forward's keep mask Z, regenerated (dropout.cuh;
    // here rows are keys, so a group is kv {g, g + 8} x q {c, c + 8} of m-blocks j, j + 1).
    // With P~ = P * Z / (1 - p): dV = P~^T dO, dP = dP~ * Z / (1 - p), dS = P * (dP - D), D as
    // without dropout (rowsum(dO * O) with O = P~ V).
    [[maybe_unused]] uint32_t keep[kMBlocks / 2][2] = {};
    [[maybe_unused]] float zs = 1.f;
    [[maybe_unused]] bool drop = false;
    if constexpr (Variant::kHasDropout) {
      drop = p.dropout.state != nullptr;
      if (drop) {
        zs = p.dropout.scale;
        const DropoutKey key = dropout_key(p.dropout, int64_t(b) * p.heads_q + h);
#pragma unroll
        for (int jp = 0; jp < kMBlocks / 2; ++jp) {
#pragma unroll
          for (int e0 = 0; e0 < 2; ++e0) {
            keep[jp][e0] = dropout_bits(key, q_lo + jp * 16 + 2 * t + e0, kv_row0 + g);
          }
        }
      }
    }
    constexpr bool kBounds = kMasked && bwd_detail::kRowBounds<Variant>;
#pragma unroll
    for (int j = 0; j < kMBlocks; ++j) {
      const float2 lse = *reinterpret_cast<const float2*>(sL + j * 8 + 2 * t);
      const float2 dd = *reinterpret_cast<const float2*>(sD + j * 8 + 2 * t);
      const float l[2] = {bwd_detail::lse_log2(lse.x), bwd_detail::lse_log2(lse.y)};
      const float d[2] = {dd.x, dd.y};
      // Query columns q_lo + j * 8 + 2t + {0, 1}: their key bounds once, for both key rows.
      [[maybe_unused]] int lo[2] = {0, 0}, hi[2] = {0, 0};
      if constexpr (kBounds) {
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          bwd_detail::row_bounds<Variant>(p.vp, b, h, q_lo + j * 8 + 2 * t + e1, r.begin, r.end,
                                          p.seqlen_q, p.seqlen_k, lo[e1], hi[e1]);
        }
      }
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int q = q_lo + j * 8 + 2 * t + e1;
          const int e = e1 | (e2 << 1);
          const int kv = kv_row0 + g + e2 * 8;
          // Visibility (kMasked): the bounds, or (below, where the baseline evaluates it)
          // bounds + keep() per element.
          bool vis = true;
          if constexpr (kBounds) vis = kv >= lo[e1] && kv < hi[e1];
          float dp = dpt[j][e];
          bool kept = true;
          if constexpr (Variant::kHasDropout) {
            kept = !drop || ((keep[j >> 1][e1] >> ((j & 1) | (e2 << 1))) & 1u);
            dp = kept ? dp * zs : 0.f;
          }
          float pv = 0.f, ds = 0.f;
          if constexpr (Variant::kHasScoreMod) {
            // Hooks only on in-bounds kept elements; everything else is P = dS = 0 by selection.
            if constexpr (kMasked && !kBounds) {
              vis = bwd_detail::visible<Variant>(p.vp, b, h, q, kv, r.begin, r.end, p.seqlen_q,
                                                 p.seqlen_k);
            }
            if (vis) {
              // With kWarpsD == 2 both warps of a key slab compute it; the wd == 0 one reports.
              bwd_detail::score_grads<Variant, kParamGrad>(
                  p.vp, st[j][e], p.scale, l[e1], dp - d[e1], b, h, q, kv, p.seqlen_q,
                  p.seqlen_k, kWarpsD == 1 || wd == 0, pv, ds);
            }
          } else {
            pv = ptx::exp2_approx(fmaf(st[j][e], c, -l[e1]));
            ds = pv * (dp - d[e1]);
            if constexpr (kMasked) {
              if constexpr (!kBounds) {
                vis = bwd_detail::visible<Variant>(p.vp, b, h, q, kv, r.begin, r.end,
                                                   p.seqlen_q, p.seqlen_k);
              }
              pv = vis ? pv : 0.f;
              ds = vis ? ds : 0.f;
            }
          }
          if constexpr (Variant::kHasDropout) pv = kept ? pv * zs : 0.f;  // P~ for dV
          st[j][e] = pv;
          dpt[j][e] = ds;
        }
      }
    }
  }

  static __device__ __forceinline__ void run_item(const Params& p, int iter, uint32_t smem_base,
                                                  unsigned char* smem) {
    const Item item = decode_item(p, iter);
    const int b = item.b;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wd = warp % kWarpsD;
    const int warp_kv0 = (warp / kWarpsD) * 16;
    const int Nq = p.seqlen_q, Nk = p.seqlen_k;
    const int kv0 = item.n_tile * kBlockN;

    // Which (query head, query tile) pairs see this key tile (warp-parallel scan, every warp
    // does it): lane l tests the query tiles l, l + 32, ... of every head of the CTA's share
    // (a mask may depend on the query head; without one all heads see every key), and the warp
    // reduces the span [m_first, m_last] of tiles that some head needs and the union
    // [vis_lo, vis_hi) of their key ranges.
    const int scan_heads = Variant::kHasMask ? p.heads_per_split : 1;
    int m_first = INT_MAX, m_last = -1, vis_lo = INT_MAX, vis_hi = 0;
    for (int m = lane; m < p.num_m_tiles; m += 32) {
      for (int gi = 0; gi < scan_heads; ++gi) {
        const Range r = kv_range(p, b, first_head(p, item) + gi, m);
        if (sees(r, kv0)) {
          m_first = imin(m_first, m);
          m_last = imax(m_last, m);
          vis_lo = imin(vis_lo, r.begin);
          vis_hi = imax(vis_hi, r.end);
        }
      }
    }
    m_first = __reduce_min_sync(0xffffffffu, m_first);
    m_last = __reduce_max_sync(0xffffffffu, m_last);
    vis_lo = __reduce_min_sync(0xffffffffu, vis_lo);
    vis_hi = __reduce_max_sync(0xffffffffu, vis_hi);

    float dk[kPairsKV * 2][4], dv[kPairsKV * 2][4];
#pragma unroll
    for (int i = 0; i < kPairsKV * 2; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
    }

    const int n_heads = p.heads_per_split;
    const int h0 = first_head(p, item);
    const uint32_t sK = smem_base + kOffK;
    const uint32_t sV = smem_base + kOffV;
    // kSparse: the first listed (head, query tile) pair that sees this key tile, if any.
    int gi = 0, m = m_first, idx = -1;
    bool partial = false;
    if constexpr (kSparse) {
      if (m_first <= m_last) next_listed(p, b, h0, n_heads, item.n_tile, kv0, gi, idx, m, partial);
    }

    if (kSparse ? gi < n_heads && m_first <= m_last : m_first <= m_last) {
      const Element* k_g = p.k + wide(b) * p.k_sb + wide(item.hkv) * p.k_sh;
      const Element* v_g = p.v + wide(b) * p.v_sb + wide(item.hkv) * p.v_sh;
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sK, k_g, p.k_sn, kv0,
                                                                         vis_lo, vis_hi, tid);
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sV, v_g, p.v_sn, kv0,
                                                                         vis_lo, vis_hi, tid);
      // The walk (next_step) starts at m_start and wraps around [m_first, m_last]; its first step
      // is the first visible (head, tile) pair from (h0, m_start) on, which exists because some
      // head of the share sees this key tile. (Without a mask m_start itself is made visible.)
      int m_start = m_first;
      if constexpr (Tile::kRotate && !kSparse) {
        const int count = m_last - m_first + 1;
        m_start += int(int64_t(item.n_tile) * count / p.num_n_tiles) % count;
        if constexpr (!Variant::kHasMask) {
          while (!sees(kv_range(p, b, h0, m_start), kv0)) {
            m_start = m_start == m_last ? m_first : m_start + 1;
          }
        }
      }
      int it = 0;
      if constexpr (!kSparse) {
        m = m_start;
        if constexpr (Variant::kHasMask) {
          if (!sees(kv_range(p, b, h0, m), kv0)) {
            next_step(p, b, h0, n_heads, m_first, m_last, m_start, kv0, gi, m);
          }
        }
      }
      load_q_tile(p, smem_base, 0, b, h0 + gi, m, tid);
      ptx::cp_async_commit();

      int h_prev = 0, m_prev = 0;  // the step whose dQ is still pending (kDeferDq)
      for (;; ++it) {
        const int stage = it & 1;
        ptx::cp_async_wait<0>();
        __syncthreads();
        // Next (head, query tile) of this CTA; its copies overlap all GEMMs of this step.
        int gi_n = gi, m_n = m, idx_n = idx;
        bool partial_n = false;
        if constexpr (kSparse) {
          next_listed(p, b, h0, n_heads, item.n_tile, kv0, gi_n, idx_n, m_n, partial_n);
        } else {
          next_step(p, b, h0, n_heads, m_first, m_last, m_start, kv0, gi_n, m_n);
        }
        if (gi_n < n_heads) {
          load_q_tile(p, smem_base, stage ^ 1, b, h0 + gi_n, m_n, tid);
          ptx::cp_async_commit();
        }
        if constexpr (kComputeDq && kDeferDq) {
          // dQ of the previous step: its dS^T (buffer stage ^ 1) was published by the barrier.
          if (it > 0) dq_step(p, smem_base, stage ^ 1, b, h_prev, m_prev, warp, lane);
        }
        step(p, smem_base, smem, stage, b, h0 + gi, m, kv0, warp_kv0, wd, warp, lane, dk, dv,
             partial);
        if (gi_n >= n_heads) break;
        h_prev = h0 + gi;
        m_prev = m;
        gi = gi_n;
        m = m_n;
        idx = idx_n;
        partial = partial_n;
      }
      if constexpr (kComputeDq && kDeferDq) {
        __syncthreads();
        dq_step(p, smem_base, it & 1, b, h0 + gi, m, warp, lane);
      }
    }

    // Epilogue.
    __syncthreads();  // every warp is done with sK / sV
    const float sc = p.scale;
    if (p.num_splits > 1) {
      // Part of a GQA group: add into the fp32 workspaces.
      const int64_t base = k_rows(p, b, item.hkv);
#pragma unroll
      for (int pi = 0; pi < kPairsKV; ++pi) {
        const int pp = wd + pi * kWarpsD;
        if (kPairsKV * kWarpsD == kDPairs || pp < kDPairs) {
#pragma unroll
          for (int blk = 0; blk < 2; ++blk) {
            const int col = pp * 16 + blk * 8;
            if (kD == kHeadDim || col < kHeadDim) {
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const int kv = kv0 + warp_kv0 + g + half * 8;
                if (kv < Nk) {
                  const int64_t off = (base + kv) * kHeadDim + col + 2 * t;
                  bwd_detail::atomic_add2(p.dk_accum + off, dk[2 * pi + blk][2 * half] * sc,
                                          dk[2 * pi + blk][2 * half + 1] * sc);
                  bwd_detail::atomic_add2(p.dv_accum + off, dv[2 * pi + blk][2 * half],
                                          dv[2 * pi + blk][2 * half + 1]);
                }
              }
            }
          }
        }
      }
      return;
    }
    Element* sKe = reinterpret_cast<Element*>(smem + kOffK);
    Element* sVe = reinterpret_cast<Element*>(smem + kOffV);
#pragma unroll
    for (int pi = 0; pi < kPairsKV; ++pi) {
      const int pp = wd + pi * kWarpsD;
      if (kPairsKV * kWarpsD == kDPairs || pp < kDPairs) {
#pragma unroll
        for (int blk = 0; blk < 2; ++blk) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int idx = (warp_kv0 + g + half * 8) * kPitch + pp * 16 + blk * 8 + 2 * t;
            *reinterpret_cast<uint32_t*>(sKe + idx) = ptx::pack2<Element>(
                dk[2 * pi + blk][2 * half] * sc, dk[2 * pi + blk][2 * half + 1] * sc);
            *reinterpret_cast<uint32_t*>(sVe + idx) =
                ptx::pack2<Element>(dv[2 * pi + blk][2 * half], dv[2 * pi + blk][2 * half + 1]);
          }
        }
      }
    }
    __syncthreads();
    const Item item_e = decode_item(p, iter);
    const int tid_e = bwd_detail::tid_x();
    Element* dk_g = p.dk + wide(item_e.b) * p.dk_sb + wide(item_e.hkv) * p.dk_sh;
    Element* dv_g = p.dv + wide(item_e.b) * p.dv_sb + wide(item_e.hkv) * p.dv_sh;
    constexpr int kOutChunks = kBlockN * kChunksPerRow;
#pragma unroll
    for (int i = 0; i < (kOutChunks + kThreads - 1) / kThreads; ++i) {
      const int c = tid_e + i * kThreads;
      if (kOutChunks % kThreads == 0 || c < kOutChunks) {
        const int r = c / kChunksPerRow;
        const int cc = c % kChunksPerRow;
        const int kv = item_e.n_tile * kBlockN + r;
        if (kv < Nk && (kD == kHeadDim || cc * 8 < kHeadDim)) {
          *reinterpret_cast<uint4*>(dk_g + wide(kv) * p.dk_sn + cc * 8) =
              *reinterpret_cast<const uint4*>(sKe + r * kPitch + cc * 8);
          *reinterpret_cast<uint4*>(dv_g + wide(kv) * p.dv_sn + cc * 8) =
              *reinterpret_cast<const uint4*>(sVe + r * kPitch + cc * 8);
        }
      }
    }
  }

  // One (query head h, query tile m) step against the CTA's key tile.
  static __device__ __forceinline__ void step(const Params& p, uint32_t smem_base,
                                              unsigned char* smem, int stage, int b, int h, int m,
                                              int kv0, int warp_kv0, int wd, int warp, int lane,
                                              float (&dk)[kPairsKV * 2][4],
                                              float (&dv)[kPairsKV * 2][4],
                                              bool listed_partial) {
    const int Nq = p.seqlen_q, Nk = p.seqlen_k;
    const int q_lo = m * kBlockM;
    bool need_mask;
    {
      // Tile class first, so that only one predicate stays live across the GEMMs. kSparse: the
      // lists' partial tiles take the mask; their full ones skip keep() when full_kept.
      const int q_hi = imin(q_lo + kBlockM, Nq);
      const Range r = kv_range(p, b, h, m);
      need_mask = (kSparse && listed_partial) || kv0 < r.begin || kv0 + kBlockN > r.end ||
                  q_hi - q_lo < kBlockM ||
                  (Variant::kHasMask && !(kSparse && p.blk.full_kept) &&
                   !Variant::tile_full(p.vp, b, h, q_lo, q_hi, kv0, kv0 + kBlockN, Nq, Nk));
    }
    const uint32_t sK = smem_base + kOffK;
    const uint32_t sV = smem_base + kOffV;
    const uint32_t sQ = smem_base + kOffQ + stage * kStageQ;
    const uint32_t sdO = smem_base + kOffDO + stage * kStageQ;
    const float* sL = reinterpret_cast<const float*>(smem + kOffL) + stage * kBlockM;
    const float* sD = reinterpret_cast<const float*>(smem + kOffDs) + stage * kBlockM;
    const uint32_t off_a = bwd_detail::lane_off_a(lane, kPitch, kE);
    const uint32_t off_b = bwd_detail::lane_off_b(lane, kPitch, kE);

    // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys.
    float st[kMBlocks][4], dpt[kMBlocks][4];
#pragma unroll
    for (int j = 0; j < kMBlocks; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t ak[4];
      ptx::ldmatrix_x4(ak, sK + (warp_kv0 * kPitch + kk * 16) * kE + off_a);
#pragma unroll
      for (int np = 0; np < kBlockM / 16; ++np) {
        uint32_t bq[4];
        ptx::ldmatrix_x4(bq, sQ + (np * 16 * kPitch + kk * 16) * kE + off_b);
        ptx::mma_16816<Element>(st[2 * np], ak, bq[0], bq[1]);
        ptx::mma_16816<Element>(st[2 * np + 1], ak, bq[2], bq[3]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t av[4];
      ptx::ldmatrix_x4(av, sV + (warp_kv0 * kPitch + kk * 16) * kE + off_a);
#pragma unroll
      for (int np = 0; np < kBlockM / 16; ++np) {
        uint32_t bo[4];
        ptx::ldmatrix_x4(bo, sdO + (np * 16 * kPitch + kk * 16) * kE + off_b);
        ptx::mma_16816<Element>(dpt[2 * np], av, bo[0], bo[1]);
        ptx::mma_16816<Element>(dpt[2 * np + 1], av, bo[2], bo[3]);
      }
    }

    if (Variant::kHasParamGrad && Variant::param_grad_enabled(p.vp)) {
      if constexpr (Variant::kHasParamGrad) {
        if (need_mask) {
          probs_grads<true, true>(p, st, dpt, sL, sD, b, h, q_lo, kv0 + warp_kv0,
                                  kv_range(p, b, h, m), wd, lane);
        } else {
          probs_grads<false, true>(p, st, dpt, sL, sD, b, h, q_lo, kv0 + warp_kv0, Range{0, 0},
                                   wd, lane);
        }
      }
    } else if (need_mask) {
      probs_grads<true, false>(p, st, dpt, sL, sD, b, h, q_lo, kv0 + warp_kv0,
                               kv_range(p, b, h, m), wd, lane);
    } else {
      probs_grads<false, false>(p, st, dpt, sL, sD, b, h, q_lo, kv0 + warp_kv0, Range{0, 0}, wd,
                                lane);
    }

    // dV += P^T dO.
#pragma unroll
    for (int u = 0; u < kBlockM / 16; ++u) {
      uint32_t a[4];
      a[0] = ptx::pack2<Element>(st[2 * u][0], st[2 * u][1]);
      a[1] = ptx::pack2<Element>(st[2 * u][2], st[2 * u][3]);
      a[2] = ptx::pack2<Element>(st[2 * u + 1][0], st[2 * u + 1][1]);
      a[3] = ptx::pack2<Element>(st[2 * u + 1][2], st[2 * u + 1][3]);
#pragma unroll
      for (int pi = 0; pi < kPairsKV; ++pi) {
        const int pp = wd + pi * kWarpsD;
        if (kPairsKV * kWarpsD == kDPairs || pp < kDPairs) {
          uint32_t bv[4];
          ptx::ldmatrix_x4_trans(bv, sdO + (u * 16 * kPitch + pp * 16) * kE + off_a);
          ptx::mma_16816<Element>(dv[2 * pi], a, bv[0], bv[1]);
          ptx::mma_16816<Element>(dv[2 * pi + 1], a, bv[2], bv[3]);
        }
      }
    }
    // dK += dS^T Q (the scale is applied in the epilogue); dS^T -> shared memory for dQ.
    Element* sdS = reinterpret_cast<Element*>(smem + kOffS);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int u = 0; u < kBlockM / 16; ++u) {
      uint32_t a[4];
      a[0] = ptx::pack2<Element>(dpt[2 * u][0], dpt[2 * u][1]);
      a[1] = ptx::pack2<Element>(dpt[2 * u][2], dpt[2 * u][3]);
      a[2] = ptx::pack2<Element>(dpt[2 * u + 1][0], dpt[2 * u + 1][1]);
      a[3] = ptx::pack2<Element>(dpt[2 * u + 1][2], dpt[2 * u + 1][3]);
      if constexpr (kComputeDq) {
        if (kWarpsD == 1 || wd == 0) {
          Element* row_g = sdS + (kDeferDq ? stage * (kSBuf / kE) : 0) + (warp_kv0 + g) * kPitchS +
                           u * 16 + 2 * t;
          *reinterpret_cast<uint32_t*>(row_g) = a[0];
          *reinterpret_cast<uint32_t*>(row_g + 8 * kPitchS) = a[1];
          *reinterpret_cast<uint32_t*>(row_g + 8) = a[2];
          *reinterpret_cast<uint32_t*>(row_g + 8 * kPitchS + 8) = a[3];
        }
      }
#pragma unroll
      for (int pi = 0; pi < kPairsKV; ++pi) {
        const int pp = wd + pi * kWarpsD;
        if (kPairsKV * kWarpsD == kDPairs || pp < kDPairs) {
          uint32_t bq[4];
          ptx::ldmatrix_x4_trans(bq, sQ + (u * 16 * kPitch + pp * 16) * kE + off_a);
          ptx::mma_16816<Element>(dk[2 * pi], a, bq[0], bq[1]);
          ptx::mma_16816<Element>(dk[2 * pi + 1], a, bq[2], bq[3]);
        }
      }
    }

    if constexpr (kComputeDq && !kDeferDq) {
      __syncthreads();  // dS^T of every warp is in sdS
      dq_step(p, smem_base, 0, b, h, m, warp, lane);
    }
  }

  // dQ_partial = dS K for query tile m of head h (dS^T in buffer sbuf) added to dq_accum.
  static __device__ __forceinline__ void dq_step(const Params& p, uint32_t smem_base, int sbuf,
                                                 int b, int h, int m, int warp, int lane) {
    {
      const int Nq = p.seqlen_q;
      const int q_lo = m * kBlockM;
      const int g = lane >> 2, t = lane & 3;
      const uint32_t sK = smem_base + kOffK;
      const uint32_t off_a = bwd_detail::lane_off_a(lane, kPitch, kE);
      const int wm = warp / kWarpsDdq, wq = warp % kWarpsDdq;
      const int row0 = wm * kQAtomsDq * 16;
      const uint32_t sS = smem_base + kOffS + sbuf * kSBuf;
      const uint32_t off_s = bwd_detail::lane_off_b(lane, kPitchS, kE);
      float dq[kQAtomsDq][kPairsDq * 2][4];
#pragma unroll
      for (int qa = 0; qa < kQAtomsDq; ++qa) {
#pragma unroll
        for (int i = 0; i < kPairsDq * 2; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) dq[qa][i][e] = 0.f;
        }
      }
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[kQAtomsDq][4];
#pragma unroll
        for (int qa = 0; qa < kQAtomsDq; ++qa) {
          ptx::ldmatrix_x4_trans(a[qa], sS + (kk * 16 * kPitchS + row0 + qa * 16) * kE + off_s);
        }
#pragma unroll
        for (int pi = 0; pi < kPairsDq; ++pi) {
          const int pp = wq + pi * kWarpsDdq;
          if (kPairsDq * kWarpsDdq == kDPairs || pp < kDPairs) {
            uint32_t bk[4];
            ptx::ldmatrix_x4_trans(bk, sK + (kk * 16 * kPitch + pp * 16) * kE + off_a);
#pragma unroll
            for (int qa = 0; qa < kQAtomsDq; ++qa) {
              ptx::mma_16816<Element>(dq[qa][2 * pi], a[qa], bk[0], bk[1]);
              ptx::mma_16816<Element>(dq[qa][2 * pi + 1], a[qa], bk[2], bk[3]);
            }
          }
        }
      }
      float* dqa = p.dq_accum + q_rows(p, b, h) * kHeadDim;
#pragma unroll
      for (int qa = 0; qa < kQAtomsDq; ++qa) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int q = q_lo + row0 + qa * 16 + g + half * 8;
          if (q < Nq) {
            float* row_p = dqa + wide(q) * kHeadDim + 2 * t;
#pragma unroll
            for (int pi = 0; pi < kPairsDq; ++pi) {
              const int pp = wq + pi * kWarpsDdq;
              if (kPairsDq * kWarpsDdq == kDPairs || pp < kDPairs) {
#pragma unroll
                for (int blk = 0; blk < 2; ++blk) {
                  const int col = pp * 16 + blk * 8;
                  if (kD == kHeadDim || col < kHeadDim) {
                    bwd_detail::atomic_add2(row_p + col, dq[qa][2 * pi + blk][2 * half],
                                            dq[qa][2 * pi + blk][2 * half + 1]);
                  }
                }
              }
            }
          }
        }
      }
    }
  }

  static __device__ __forceinline__ void run(const Params& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t base = ptx::smem_addr(smem_raw);
    for (int iter = 0; int64_t(blockIdx.x) + int64_t(iter) * gridDim.x < p.total_work; ++iter) {
      if (iter > 0) __syncthreads();  // shared memory of the previous item is free
      if constexpr (kPacked) {
        // Key tiles are counted up to max_seqlen_k: one past its sequence's keys has nothing
        // to write (keys no query sees still get their zeros from the items that hold them).
        const Item item = decode_item(p, iter);
        const SeqSpan sp = seq_span(p.cu_q, p.cu_k, item.b, p.seqlen_q, p.seqlen_k);
        if (item.n_tile * kBlockN >= sp.len_k) continue;
        run_item(localize(p, sp), iter, base, smem_raw);
      } else {
        run_item(p, iter, base, smem_raw);
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    bwd_kernel(const __grid_constant__ typename Kernel::Params params) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  Kernel::run(params);
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Deterministic dQ kernel (query-major, recomputes S/P/dP/dS; no atomics).

template <class Variant, class Element, int kHeadDim, class Tile, bool kPacked = false,
          bool kSparse = false>
struct DqKernel {
  using VParams = typename Variant::Params;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kD = (kHeadDim + 15) / 16 * 16;
  static constexpr int kPitch = kD + 8;
  static constexpr int kChunksPerRow = kD / 8;
  static constexpr int kNBlocks = kBlockN / 8;
  static constexpr int kDBlocks = kD / 8;
  static constexpr int kE = int(sizeof(Element));
  static constexpr int kQElems = kBlockM * kPitch;
  static constexpr int kKVElems = kBlockN * kPitch;
  // sQ, sdO, then K ring (2 stages), V ring (2 stages).
  static constexpr int kSmem = (2 * kQElems + 4 * kKVElems) * kE;

  struct Params {
    const Element* q;
    const Element* k;
    const Element* v;
    const Element* dout;
    const float* lse;
    const float* dsum;
    Element* dq;
    const int* cu_q;  // kPacked: cu_seqlens_q / cu_seqlens_k (args.h, packed batches)
    const int* cu_k;
    int64_t total_q;
    int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn;
    int64_t dq_sb, dq_sh, dq_sn;
    int64_t total_work;  // num_m_tiles * heads_q * batch
    int heads_q, group, seqlen_q, seqlen_k, num_m_tiles;
    float scale, scale_log2;
    DropoutArgs dropout;  // read only with Variant::kHasDropout (state null: off)
    BlockLists blk;       // kSparse: kv lists, a row per query tile (args.h)
    VParams vp;
  };

  static __device__ __forceinline__ void load_kv(const Params& p, uint32_t sK, uint32_t sV,
                                                 const Element* k_g, const Element* v_g, int kv0,
                                                 int kv_begin, int kv_end, int tid) {
    if (kv0 >= kv_begin && kv0 + kBlockN <= kv_end) {
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockN, false>(sK, k_g, p.k_sn, kv0,
                                                                          kv_begin, kv_end, tid);
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockN, false>(sV, v_g, p.v_sn, kv0,
                                                                          kv_begin, kv_end, tid);
    } else {
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sK, k_g, p.k_sn, kv0,
                                                                         kv_begin, kv_end, tid);
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sV, v_g, p.v_sn, kv0,
                                                                         kv_begin, kv_end, tid);
    }
  }

  template <bool kMasked>
  static __device__ __forceinline__ void probs_grads(const Params& p, float (&s)[kNBlocks][4],
                                                     float (&dp)[kNBlocks][4],
                                                     const float (&l2)[2], const float (&dd)[2],
                                                     int b, int h, int q_row0, int kv0,
                                                     int kv_begin, int kv_end, int lane) {
    const int g = lane >> 2, t = lane & 3;
    [[maybe_unused]] const float c = p.scale_log2;  // unused with a score mod
    // Dropout: dP = dP~ * Z / (1 - p) with the forward's keep mask (layout as in the forward:
    // rows q {g, g + 8} x kv {c, c + 8} of blocks j, j + 1); see BwdKernel::probs_grads.
    [[maybe_unused]] uint32_t keep[kNBlocks / 2][2] = {};
    [[maybe_unused]] bool drop = false;
    if constexpr (Variant::kHasDropout) {
      drop = p.dropout.state != nullptr;
      if (drop) {
        const DropoutKey key = dropout_key(p.dropout, int64_t(b) * p.heads_q + h);
#pragma unroll
        for (int jp = 0; jp < kNBlocks / 2; ++jp) {
#pragma unroll
          for (int e0 = 0; e0 < 2; ++e0) {
            keep[jp][e0] = dropout_bits(key, q_row0 + g, kv0 + jp * 16 + 2 * t + e0);
          }
        }
      }
    }
    // Rows q_row0 + g and q_row0 + g + 8: their key bounds once (kRowBounds; see row_bounds).
    constexpr bool kBounds = kMasked && bwd_detail::kRowBounds<Variant>;
    [[maybe_unused]] int lo[2] = {0, 0}, hi[2] = {0, 0};
    if constexpr (kBounds) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        bwd_detail::row_bounds<Variant>(p.vp, b, h, q_row0 + g + r * 8, kv_begin, kv_end,
                                        p.seqlen_q, p.seqlen_k, lo[r], hi[r]);
      }
    }
#pragma unroll
    for (int j = 0; j < kNBlocks; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = q_row0 + g + (e >> 1) * 8;
        const int kv = kv0 + j * 8 + 2 * t + (e & 1);
        bool vis = true;
        if constexpr (kBounds) {
          vis = kv >= lo[e >> 1] && kv < hi[e >> 1];
        } else if constexpr (kMasked) {
          vis = bwd_detail::visible<Variant>(p.vp, b, h, q, kv, kv_begin, kv_end, p.seqlen_q,
                                             p.seqlen_k);
        }
        float dpe = dp[j][e];
        if constexpr (Variant::kHasDropout) {
          const bool kept =
              !drop || ((keep[j >> 1][e & 1] >> ((e >> 1) | ((j & 1) << 1))) & 1u);
          dpe = kept ? dpe * p.dropout.scale : 0.f;
        }
        if constexpr (Variant::kHasScoreMod) {
          // As in BwdKernel::probs_grads, without param_grad (the main kernel calls it).
          float pv = 0.f, ds = 0.f;
          if (vis) {
            bwd_detail::score_grads<Variant, false>(p.vp, s[j][e], p.scale, l2[e >> 1],
                                                    dpe - dd[e >> 1], b, h, q, kv,
                                                    p.seqlen_q, p.seqlen_k, false, pv, ds);
          }
          dp[j][e] = ds;
        } else {
          const float pv = ptx::exp2_approx(fmaf(s[j][e], c, -l2[e >> 1]));
          const float ds = pv * (dpe - dd[e >> 1]);
          dp[j][e] = kMasked && !vis ? 0.f : ds;
        }
      }
    }
  }

  static __device__ __forceinline__ void run_item(const Params& p, int iter, Element* smem) {
    const int64_t w = int64_t(ptx::ctaid_x()) + int64_t(iter) * ptx::nctaid_x();
    const int64_t bh = w / p.num_m_tiles;
    const int m_tile = p.num_m_tiles - 1 - int(w - bh * p.num_m_tiles);
    const int h = int(bh % p.heads_q);
    const int b = int(bh / p.heads_q);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int warp_row0 = warp * 16;

    const uint32_t sQ = ptx::smem_addr(smem);
    const uint32_t sdO = sQ + kQElems * kE;
    const uint32_t sK0 = sdO + kQElems * kE;
    const uint32_t sV0 = sK0 + 2 * kKVElems * kE;
    const uint32_t off_a = bwd_detail::lane_off_a(lane, kPitch, kE);
    const uint32_t off_b = bwd_detail::lane_off_b(lane, kPitch, kE);

    const int Nq = p.seqlen_q, Nk = p.seqlen_k;
    const int q_lo = m_tile * kBlockM;
    const int q_hi = imin(q_lo + kBlockM, Nq);
    const int h_kv = h / p.group;
    const Element* q_g = p.q + wide(b) * p.q_sb + wide(h) * p.q_sh;
    const Element* do_g = p.dout + wide(b) * p.do_sb + wide(h) * p.do_sh;
    const Element* k_g = p.k + wide(b) * p.k_sb + wide(h_kv) * p.k_sh;
    const Element* v_g = p.v + wide(b) * p.v_sb + wide(h_kv) * p.v_sh;

    const int kv_begin = imin(imax(Variant::kv_lo(p.vp, b, h, q_lo, q_hi, Nq, Nk), 0), Nk);
    const int kv_end = imin(imax(Variant::kv_hi(p.vp, b, h, q_lo, q_hi, Nq, Nk), 0), Nk);
    int n_hi = 0, n_tiles = 0;
    BlockRow blk{nullptr, 0, 0};  // kSparse: the listed key tiles of this query tile
    if constexpr (kSparse) {
      blk = block_row(p.blk, b, h, m_tile);
      n_tiles = kv_end > kv_begin ? blk.n_all : 0;
    } else if (kv_end > kv_begin) {
      n_hi = (kv_end - 1) / kBlockN;
      n_tiles = n_hi - kv_begin / kBlockN + 1;
    }

    float dq[kDBlocks][4];
#pragma unroll
    for (int i = 0; i < kDBlocks; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[i][e] = 0.f;
    }

    if (n_tiles > 0) {
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sQ, q_g, p.q_sn, q_lo, 0,
                                                                         Nq, tid);
      bwd_detail::load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sdO, do_g, p.do_sn, q_lo,
                                                                         0, Nq, tid);
      load_kv(p, sK0, sV0, k_g, v_g, (kSparse ? __ldg(blk.idx) : n_hi) * kBlockN, kv_begin, kv_end,
              tid);
      ptx::cp_async_commit();

      // Per-row LSE (log2 units, +inf for rows without keys or past seqlen_q) and D.
      float l2[2], dd[2];
      const int64_t row_base =
          kPacked ? wide(h) * p.total_q : (wide(b) * p.heads_q + h) * int64_t(Nq);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int q = q_lo + warp_row0 + g + half * 8;
        l2[half] = q < Nq ? bwd_detail::lse_log2(p.lse[row_base + q]) : INFINITY;
        dd[half] = q < Nq ? p.dsum[row_base + q] : 0.f;
      }

      for (int it = 0; it < n_tiles; ++it) {
        const int kv0 = (kSparse ? __ldg(blk.idx + it) : n_hi - it) * kBlockN;
        const uint32_t sK = sK0 + (it & 1) * kKVElems * kE;
        const uint32_t sV = sV0 + (it & 1) * kKVElems * kE;
        ptx::cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_tiles) {
          const uint32_t st = ((it + 1) & 1) * kKVElems * kE;
          load_kv(p, sK0 + st, sV0 + st, k_g, v_g,
                  kSparse ? __ldg(blk.idx + it + 1) * kBlockN : kv0 - kBlockN, kv_begin, kv_end,
                  tid);
          ptx::cp_async_commit();
        }

        // S = Q K^T, dP = dO V^T for the warp's 16 rows.
        float s[kNBlocks][4], dp[kNBlocks][4];
#pragma unroll
        for (int j = 0; j < kNBlocks; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          uint32_t aq[4], ao[4];
          ptx::ldmatrix_x4(aq, sQ + (warp_row0 * kPitch + kk * 16) * kE + off_a);
          ptx::ldmatrix_x4(ao, sdO + (warp_row0 * kPitch + kk * 16) * kE + off_a);
#pragma unroll
          for (int np = 0; np < kBlockN / 16; ++np) {
            uint32_t bk[4], bv[4];
            ptx::ldmatrix_x4(bk, sK + (np * 16 * kPitch + kk * 16) * kE + off_b);
            ptx::ldmatrix_x4(bv, sV + (np * 16 * kPitch + kk * 16) * kE + off_b);
            ptx::mma_16816<Element>(s[2 * np], aq, bk[0], bk[1]);
            ptx::mma_16816<Element>(s[2 * np + 1], aq, bk[2], bk[3]);
            ptx::mma_16816<Element>(dp[2 * np], ao, bv[0], bv[1]);
            ptx::mma_16816<Element>(dp[2 * np + 1], ao, bv[2], bv[3]);
          }
        }
        const bool need_mask =
            (kSparse && it < blk.n_part) || kv0 < kv_begin || kv0 + kBlockN > kv_end ||
            q_hi - q_lo < kBlockM ||
            (Variant::kHasMask && !(kSparse && p.blk.full_kept) &&
             !Variant::tile_full(p.vp, b, h, q_lo, q_hi, kv0, kv0 + kBlockN, Nq, Nk));
        if (need_mask) {
          probs_grads<true>(p, s, dp, l2, dd, b, h, q_lo + warp_row0, kv0, kv_begin, kv_end, lane);
        } else {
          probs_grads<false>(p, s, dp, l2, dd, b, h, q_lo + warp_row0, kv0, kv_begin, kv_end,
                             lane);
        }
        // dQ += dS K.
#pragma unroll
        for (int u = 0; u < kBlockN / 16; ++u) {
          uint32_t a[4];
          a[0] = ptx::pack2<Element>(dp[2 * u][0], dp[2 * u][1]);
          a[1] = ptx::pack2<Element>(dp[2 * u][2], dp[2 * u][3]);
          a[2] = ptx::pack2<Element>(dp[2 * u + 1][0], dp[2 * u + 1][1]);
          a[3] = ptx::pack2<Element>(dp[2 * u + 1][2], dp[2 * u + 1][3]);
#pragma unroll
          for (int dpp = 0; dpp < kD / 16; ++dpp) {
            uint32_t bk[4];
            ptx::ldmatrix_x4_trans(bk, sK + (u * 16 * kPitch + dpp * 16) * kE + off_a);
            ptx::mma_16816<Element>(dq[2 * dpp], a, bk[0], bk[1]);
            ptx::mma_16816<Element>(dq[2 * dpp + 1], a, bk[2], bk[3]);
          }
        }
      }
    }

    // Epilogue: scale, stage the warp's own rows through its slice of sQ, 16-byte stores.
    __syncwarp();
    const float sc = p.scale;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + g + half * 8;
#pragma unroll
      for (int dn = 0; dn < kDBlocks; ++dn) {
        *reinterpret_cast<uint32_t*>(smem + row * kPitch + dn * 8 + 2 * t) =
            ptx::pack2<Element>(dq[dn][2 * half] * sc, dq[dn][2 * half + 1] * sc);
      }
    }
    __syncwarp();
    Element* dq_g = p.dq + wide(b) * p.dq_sb + wide(h) * p.dq_sh;
    constexpr int kOutChunks = 16 * kChunksPerRow;
#pragma unroll
    for (int i = 0; i < (kOutChunks + 31) / 32; ++i) {
      const int c = lane + i * 32;
      if (kOutChunks % 32 == 0 || c < kOutChunks) {
        const int r = c / kChunksPerRow;
        const int cc = c % kChunksPerRow;
        const int q = q_lo + warp_row0 + r;
        if (q < Nq && (kD == kHeadDim || cc * 8 < kHeadDim)) {
          *reinterpret_cast<uint4*>(dq_g + wide(q) * p.dq_sn + cc * 8) =
              *reinterpret_cast<const uint4*>(smem + (warp_row0 + r) * kPitch + cc * 8);
        }
      }
    }
  }

  static __device__ __forceinline__ void run(const Params& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Element* smem = reinterpret_cast<Element*>(smem_raw);
    for (int iter = 0; int64_t(blockIdx.x) + int64_t(iter) * gridDim.x < p.total_work; ++iter) {
      if (iter > 0) __syncthreads();
      if constexpr (kPacked) {
        // As run_item numbers items; a query tile past its sequence's end has no rows.
        const int64_t w = int64_t(ptx::ctaid_x()) + int64_t(iter) * ptx::nctaid_x();
        const int64_t bh = w / p.num_m_tiles;
        const int m_tile = p.num_m_tiles - 1 - int(w - bh * p.num_m_tiles);
        const SeqSpan sp =
            seq_span(p.cu_q, p.cu_k, int(bh / p.heads_q), p.seqlen_q, p.seqlen_k);
        if (m_tile * kBlockM >= sp.len_q) continue;
        Params lp = p;  // sequence sp as a padded batch of its own lengths
        lp.seqlen_q = sp.len_q;
        lp.seqlen_k = sp.len_k;
        lp.q += wide(sp.q0) * p.q_sn;
        lp.dout += wide(sp.q0) * p.do_sn;
        lp.dq += wide(sp.q0) * p.dq_sn;
        lp.k += wide(sp.k0) * p.k_sn;
        lp.v += wide(sp.k0) * p.v_sn;
        lp.lse += sp.q0;
        lp.dsum += sp.q0;
        run_item(lp, iter, smem);
      } else {
        run_item(p, iter, smem);
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 2)
    bwd_dq_kernel(const __grid_constant__ typename Kernel::Params params) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  Kernel::run(params);
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side.

namespace bwd_detail {

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
    cudaGetLastError();
    return detail::fail(FG_ERR_SMEM_ATTR,
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

inline int grid_for(int64_t work, int64_t cap) {
  if (work < 1) work = 1;
  return int(work < cap ? work : cap);
}

}  // namespace bwd_detail

// The backward with the tiles the generated translation unit names (flashgen/tiles.py chose them).
template <class Variant, class Element, int kHeadDim, class Tile, class DqTileT,
          bool kPacked = false, bool kSparse = false>
int launch_bwd_tiled(const FgBwdArgs& a) {
  using KA = BwdKernel<Variant, Element, kHeadDim, Tile, true, kPacked, kSparse>;  // dQ atomics
  using KD = BwdKernel<Variant, Element, kHeadDim, Tile, false, kPacked, kSparse>;  // determ.
  using KQ = DqKernel<Variant, Element, kHeadDim, DqTileT, kPacked, kSparse>;
  (void)&Variant::keep;
  (void)&Variant::score;
  (void)&Variant::tile_full;
  (void)&Variant::dscore;
  (void)&Variant::param_grad;
  (void)Variant::kHasParamGrad;
  (void)Variant::kRowExact;
  detail::clear_error();
  if (a.head_dim != kHeadDim) {
    return detail::fail(FG_ERR_BAD_HEAD_DIM, "head_dim %lld differs from this kernel's %d",
                        (long long)a.head_dim, kHeadDim);
  }
  const int64_t kIntMax = 2147483647;
  if (a.batch < 0 || a.heads_q < 0 || a.heads_kv < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 ||
      a.batch > kIntMax || a.heads_q > kIntMax || a.heads_kv > kIntMax ||
      a.seqlen_q > FG_MAX_SEQLEN || a.seqlen_k > FG_MAX_SEQLEN) {
    return detail::fail(FG_ERR_BAD_SHAPE,
                        "sizes out of range: batch %lld, heads_q %lld, heads_kv %lld, seqlen_q "
                        "%lld, seqlen_k %lld (each must be >= 0; batch and heads fit in int32, "
                        "seqlens at most 2^30)",
                        (long long)a.batch, (long long)a.heads_q, (long long)a.heads_kv,
                        (long long)a.seqlen_q, (long long)a.seqlen_k);
  }
  if (a.heads_q > 0 && (a.heads_kv <= 0 || a.heads_q % a.heads_kv != 0)) {
    return detail::fail(FG_ERR_BAD_SHAPE, "heads_q %lld is not a multiple of heads_kv %lld",
                        (long long)a.heads_q, (long long)a.heads_kv);
  }
  // Packed (varlen) batches (args.h): per-sequence rows from cu_seqlens, batch strides unused,
  // the fp32 per-row buffers [H, total]; the element-wise kernels treat them as one batch of
  // total rows.
  const bool packed = a.cu_seqlens_q != nullptr;
  if (packed != kPacked) {
    return detail::fail(FG_ERR_BAD_SHAPE, kPacked ? "this instantiation takes packed batches: "
                                                    "cu_seqlens_q must be set"
                                                  : "this instantiation takes padded batches: "
                                                    "cu_seqlens_q must be null");
  }
  if (packed && (!a.cu_seqlens_k || a.total_q < 0 || a.total_k < 0 || a.total_q > kIntMax ||
                 a.total_k > kIntMax)) {
    return detail::fail(FG_ERR_BAD_SHAPE,
                        "packed batch: cu_seqlens_k must be set with cu_seqlens_q, totals "
                        "(%lld, %lld) in [0, 2^31)", (long long)a.total_q, (long long)a.total_k);
  }
  // Block sparsity: q lists for the main kernel's tiles, kv lists for DqKernel's.
  {
    int st = detail::check_block_lists(a.q_blocks, kSparse, "q_blocks",
                                       (a.seqlen_k + KA::kBlockN - 1) / KA::kBlockN,
                                       (a.seqlen_q + KA::kBlockM - 1) / KA::kBlockM, KA::kBlockN,
                                       KA::kBlockM);
    if (st == FG_OK) {
      st = detail::check_block_lists(a.kv_blocks, kSparse, "kv_blocks",
                                     (a.seqlen_q + KQ::kBlockM - 1) / KQ::kBlockM,
                                     (a.seqlen_k + KQ::kBlockN - 1) / KQ::kBlockN, KQ::kBlockM,
                                     KQ::kBlockN);
    }
    if (st != FG_OK) return st;
  }
  if (a.batch == 0 || a.heads_q == 0 || (a.seqlen_q == 0 && a.seqlen_k == 0)) return FG_OK;

  const bool has_q = a.seqlen_q > 0 && (!packed || a.total_q > 0);
  const bool has_k = a.seqlen_k > 0 && (!packed || a.total_k > 0);
  if (!has_q && !has_k) return FG_OK;
  // Extents of the batch and row dims of the data tensors; the element-wise kernels' batch
  // and sequence length (one batch of total rows when packed).
  const int64_t nb = packed ? 1 : a.batch;
  const int64_t rows_q = packed ? a.total_q : a.seqlen_q, rows_k = packed ? a.total_k : a.seqlen_k;
  bool det = a.deterministic != 0;
  if ((has_q && (!a.q || !a.out || !a.dout || !a.lse || !a.dq || !a.softmax_d)) ||
      (has_k && (!a.k || !a.v || !a.dk || !a.dv)) ||
      (has_q && !det && !a.dq_accum)) {
    return detail::fail(FG_ERR_BAD_SHAPE,
                        "null pointer among q/k/v/out/dout/lse/dq/dk/dv/softmax_d/dq_accum");
  }
  constexpr int64_t kE16 = 16 / int64_t(sizeof(Element));
  using detail::bad_stride;
  using detail::misaligned;
  auto bad_q = [&](const void* ptr, int64_t sb, int64_t sh, int64_t sn) {
    return has_q && (misaligned(ptr) || bad_stride(sb, nb, kE16) ||
                     bad_stride(sh, a.heads_q, kE16) || bad_stride(sn, rows_q, kE16));
  };
  auto bad_k = [&](const void* ptr, int64_t sb, int64_t sh, int64_t sn) {
    return has_k && (misaligned(ptr) || bad_stride(sb, nb, kE16) ||
                     bad_stride(sh, a.heads_kv, kE16) || bad_stride(sn, rows_k, kE16));
  };
  const char* bad = nullptr;
  if (bad_q(a.q, a.q_stride_b, a.q_stride_h, a.q_stride_n)) bad = "q";
  else if (bad_k(a.k, a.k_stride_b, a.k_stride_h, a.k_stride_n)) bad = "k";
  else if (bad_k(a.v, a.v_stride_b, a.v_stride_h, a.v_stride_n)) bad = "v";
  else if (bad_q(a.out, a.o_stride_b, a.o_stride_h, a.o_stride_n)) bad = "out";
  else if (bad_q(a.dout, a.do_stride_b, a.do_stride_h, a.do_stride_n)) bad = "dout";
  else if (bad_q(a.dq, a.dq_stride_b, a.dq_stride_h, a.dq_stride_n)) bad = "dq";
  else if (bad_k(a.dk, a.dk_stride_b, a.dk_stride_h, a.dk_stride_n)) bad = "dk";
  else if (bad_k(a.dv, a.dv_stride_b, a.dv_stride_h, a.dv_stride_n)) bad = "dv";
  else if (has_q && ((reinterpret_cast<uintptr_t>(a.lse) & 3u) ||
                     (reinterpret_cast<uintptr_t>(a.softmax_d) & 3u) ||
                     (reinterpret_cast<uintptr_t>(a.dlse) & 3u)))
    bad = "lse/softmax_d/dlse";
  else if (has_q && !det && misaligned(a.dq_accum)) bad = "dq_accum";
  if (bad) {
    return detail::fail(FG_ERR_ALIGNMENT,
                        "%s: base pointers must be 16-byte aligned (lse/softmax_d/dlse 4-byte) and "
                        "batch/head/row strides multiples of %lld elements (last dim contiguous)",
                        bad, (long long)kE16);
  }

  const int Hq = int(a.heads_q), Hkv = int(a.heads_kv), Nq = int(a.seqlen_q),
            Nk = int(a.seqlen_k);
  const int group = Hq / Hkv;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "cudaGetDevice", err);
  int num_sms = a.num_sms;
  if (num_sms <= 0) {
    if (cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      num_sms = 108;
    }
  }
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  // The non-deterministic main kernel needs the most shared memory (its dS^T buffer); on a device
  // that cannot give it take the deterministic path, which is correct in either mode (and needs
  // no dq_accum).
  if (!det && has_q && has_k) {
    const int optin = bwd_detail::max_smem_optin(dev);
    if (optin > 0 && KA::kSmem > optin) det = true;
  }
  const int64_t kMaxGrid = FLASHGEN_BWD_MAX_GRID;
  const int64_t kElemGrid = int64_t(num_sms) * 16 < kMaxGrid ? int64_t(num_sms) * 16 : kMaxGrid;

  // GQA split (non-deterministic only; needs the dk/dv workspaces).
  const int num_n_tiles = has_k ? int((a.seqlen_k + KA::kBlockN - 1) / KA::kBlockN) : 0;
  int splits = 1;
  if (!det && has_q && has_k && group > 1 && a.dk_accum && a.dv_accum &&
      !misaligned(a.dk_accum) && !misaligned(a.dv_accum)) {
    const int64_t items = int64_t(num_n_tiles) * Hkv * a.batch;
    if (2 * items <= num_sms) {
      for (int s = 2; s <= group; ++s) {
        if (group % s == 0 && items * s <= num_sms) splits = s;
      }
    }
  }

  // 1. D = rowsum(dout ∘ out); zero the workspaces this call accumulates into.
  if (has_q) {
    BwdPreParams<Element> pp;
    memset(&pp, 0, sizeof(pp));
    pp.o = static_cast<const Element*>(a.out);
    pp.dout = static_cast<const Element*>(a.dout);
    pp.o_sb = packed ? 0 : a.o_stride_b, pp.o_sh = a.o_stride_h, pp.o_sn = a.o_stride_n;
    pp.do_sb = packed ? 0 : a.do_stride_b, pp.do_sh = a.do_stride_h, pp.do_sn = a.do_stride_n;
    pp.dsum = a.softmax_d;
    pp.dlse = a.dlse;
    pp.dq_accum = det ? nullptr : a.dq_accum;
    pp.rows = nb * a.heads_q * rows_q;
    pp.heads_q = Hq;
    pp.seqlen_q = int(rows_q);
    if (splits > 1) {
      pp.zero_a = a.dk_accum;
      pp.zero_b = a.dv_accum;
      pp.zero_count = nb * a.heads_kv * rows_k * kHeadDim;
    }
    constexpr int kTpr = kHeadDim / 8 <= 1 ? 1 : kHeadDim / 8 <= 2 ? 2 : kHeadDim / 8 <= 4 ? 4
                         : kHeadDim / 8 <= 8 ? 8 : kHeadDim / 8 <= 16 ? 16 : 32;
    const int64_t blocks = (pp.rows + 256 / kTpr - 1) / (256 / kTpr);
    bwd_preprocess_kernel<Element, kHeadDim>
        <<<bwd_detail::grid_for(blocks, kElemGrid), 256, 0, stream>>>(pp);
    err = cudaGetLastError();
    if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "backward preprocess launch", err);
  }

  // 2. Main kernel: dK, dV (and dQ atomics when not deterministic).
  if (has_k) {
    auto launch_main = [&](auto kernel, auto tag) -> int {
      using K = typename decltype(tag)::type;
      static std::atomic<uint64_t> configured{0};
      const int st = bwd_detail::ensure_smem(kernel, K::kSmem, configured, dev, "backward kernel");
      if (st != FG_OK) return st;
      typename K::Params p;
      memset(&p, 0, sizeof(p));
      p.q = static_cast<const Element*>(has_q ? a.q : a.k);  // never read when seqlen_q == 0
      p.k = static_cast<const Element*>(a.k);
      p.v = static_cast<const Element*>(a.v);
      p.dout = static_cast<const Element*>(has_q ? a.dout : a.k);
      p.lse = has_q ? a.lse : nullptr;
      p.dsum = a.softmax_d;
      p.dk = static_cast<Element*>(a.dk);
      p.dv = static_cast<Element*>(a.dv);
      p.dq_accum = a.dq_accum;
      p.dk_accum = a.dk_accum;
      p.dv_accum = a.dv_accum;
      p.cu_q = a.cu_seqlens_q;
      p.cu_k = a.cu_seqlens_k;
      p.total_q = a.total_q;
      p.total_k = a.total_k;
      p.q_sb = packed ? 0 : a.q_stride_b, p.q_sh = a.q_stride_h, p.q_sn = a.q_stride_n;
      p.k_sb = packed ? 0 : a.k_stride_b, p.k_sh = a.k_stride_h, p.k_sn = a.k_stride_n;
      p.v_sb = packed ? 0 : a.v_stride_b, p.v_sh = a.v_stride_h, p.v_sn = a.v_stride_n;
      p.do_sb = packed ? 0 : a.do_stride_b, p.do_sh = a.do_stride_h, p.do_sn = a.do_stride_n;
      p.dk_sb = packed ? 0 : a.dk_stride_b, p.dk_sh = a.dk_stride_h, p.dk_sn = a.dk_stride_n;
      p.dv_sb = packed ? 0 : a.dv_stride_b, p.dv_sh = a.dv_stride_h, p.dv_sn = a.dv_stride_n;
      p.heads_q = Hq;
      p.heads_kv = Hkv;
      p.group = group;
      p.num_splits = splits;
      p.heads_per_split = group / splits;
      p.seqlen_q = Nq;
      p.seqlen_k = Nk;
      p.num_m_tiles = int((a.seqlen_q + K::kBlockM - 1) / K::kBlockM);
      p.num_n_tiles = num_n_tiles;
      p.total_work = int64_t(num_n_tiles) * splits * Hkv * a.batch;
      p.scale = a.scale;
      p.scale_log2 = a.scale * K::kLog2e;
      p.dropout.state = Variant::kHasDropout ? a.dropout_state : nullptr;
      p.dropout.threshold = a.dropout_threshold;
      p.dropout.scale = a.dropout_scale;
      p.blk = detail::block_lists(a.q_blocks);
      if constexpr (!std::is_empty<typename Variant::Params>::value) {
        if (a.params) memcpy(&p.vp, a.params, sizeof(p.vp));
      }
      kernel<<<bwd_detail::grid_for(p.total_work, kMaxGrid), K::kThreads, K::kSmem, stream>>>(p);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "backward kernel launch", e);
      return FG_OK;
    };
    int st;
    if (det) {
      st = launch_main(&bwd_kernel<KD>, std::common_type<KD>{});
    } else {
      st = launch_main(&bwd_kernel<KA>, std::common_type<KA>{});
    }
    if (st != FG_OK) return st;
  }

  // 3. dq.
  if (has_q) {
    if (det) {
      auto kernel = &bwd_dq_kernel<KQ>;
      static std::atomic<uint64_t> configured{0};
      const int st = bwd_detail::ensure_smem(kernel, KQ::kSmem, configured, dev,
                                             "deterministic dq kernel");
      if (st != FG_OK) return st;
      typename KQ::Params p;
      memset(&p, 0, sizeof(p));
      p.q = static_cast<const Element*>(a.q);
      p.k = static_cast<const Element*>(has_k ? a.k : a.q);
      p.v = static_cast<const Element*>(has_k ? a.v : a.q);
      p.dout = static_cast<const Element*>(a.dout);
      p.lse = a.lse;
      p.dsum = a.softmax_d;
      p.dq = static_cast<Element*>(a.dq);
      p.cu_q = a.cu_seqlens_q;
      p.cu_k = a.cu_seqlens_k;
      p.total_q = a.total_q;
      p.q_sb = packed ? 0 : a.q_stride_b, p.q_sh = a.q_stride_h, p.q_sn = a.q_stride_n;
      p.k_sb = packed ? 0 : a.k_stride_b, p.k_sh = a.k_stride_h, p.k_sn = a.k_stride_n;
      p.v_sb = packed ? 0 : a.v_stride_b, p.v_sh = a.v_stride_h, p.v_sn = a.v_stride_n;
      p.do_sb = packed ? 0 : a.do_stride_b, p.do_sh = a.do_stride_h, p.do_sn = a.do_stride_n;
      p.dq_sb = packed ? 0 : a.dq_stride_b, p.dq_sh = a.dq_stride_h, p.dq_sn = a.dq_stride_n;
      p.heads_q = Hq;
      p.group = group;
      p.seqlen_q = Nq;
      p.seqlen_k = Nk;
      p.num_m_tiles = int((a.seqlen_q + KQ::kBlockM - 1) / KQ::kBlockM);
      p.total_work = int64_t(p.num_m_tiles) * Hq * a.batch;
      p.scale = a.scale;
      p.scale_log2 = a.scale * KA::kLog2e;
      p.dropout.state = Variant::kHasDropout ? a.dropout_state : nullptr;
      p.dropout.threshold = a.dropout_threshold;
      p.dropout.scale = a.dropout_scale;
      p.blk = detail::block_lists(a.kv_blocks);
      if constexpr (!std::is_empty<typename Variant::Params>::value) {
        if (a.params) memcpy(&p.vp, a.params, sizeof(p.vp));
      }
      kernel<<<bwd_detail::grid_for(p.total_work, kMaxGrid), KQ::kThreads, KQ::kSmem, stream>>>(p);
      err = cudaGetLastError();
      if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "dq kernel launch", err);
    } else {
      BwdConvertParams<Element> cp;
      cp.src = a.dq_accum;
      cp.dst = static_cast<Element*>(a.dq);
      cp.rows = nb * a.heads_q * rows_q;
      cp.heads = Hq;
      cp.seqlen = int(rows_q);
      cp.sb = packed ? 0 : a.dq_stride_b, cp.sh = a.dq_stride_h, cp.sn = a.dq_stride_n;
      cp.mul = a.scale;
      const int64_t blocks = (cp.rows * (kHeadDim / 8) + 255) / 256;
      bwd_convert_kernel<Element, kHeadDim>
          <<<bwd_detail::grid_for(blocks, kElemGrid), 256, 0, stream>>>(cp);
      err = cudaGetLastError();
      if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "dq convert launch", err);
    }
  }

  // 4. dk, dv from the workspaces when the GQA group was split.
  if (splits > 1) {
    for (int which = 0; which < 2; ++which) {
      BwdConvertParams<Element> cp;
      cp.src = which == 0 ? a.dk_accum : a.dv_accum;
      cp.dst = static_cast<Element*>(which == 0 ? a.dk : a.dv);
      cp.rows = nb * a.heads_kv * rows_k;
      cp.heads = Hkv;
      cp.seqlen = int(rows_k);
      cp.sb = packed ? 0 : which == 0 ? a.dk_stride_b : a.dv_stride_b;
      cp.sh = which == 0 ? a.dk_stride_h : a.dv_stride_h;
      cp.sn = which == 0 ? a.dk_stride_n : a.dv_stride_n;
      cp.mul = 1.f;  // dk_accum already holds scale * dS^T Q
      const int64_t blocks = (cp.rows * (kHeadDim / 8) + 255) / 256;
      bwd_convert_kernel<Element, kHeadDim>
          <<<bwd_detail::grid_for(blocks, kElemGrid), 256, 0, stream>>>(cp);
      err = cudaGetLastError();
      if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "dk/dv convert launch", err);
    }
  }
  return FG_OK;
}

}  // namespace cuda
}  // namespace flashgen
