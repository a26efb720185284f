// flashgen CUDA forward kernel skeleton (sm_80+, runs on sm_90a): FlashAttention-2 with
// mma.sync tensor cores, specialised by a generated Variant (flashgen/variant.h).
//
//   template <class Variant, class Element /* __half | __nv_bfloat16 */, int kHeadDim,
//             class Tile /* FwdTile */, bool kPacked = false, bool kSparse = false>
//   int flashgen::cuda::launch_fwd_tiled(const FgFwdArgs& args);   // FgStatus; no host sync
//
// kPacked instantiations take packed (varlen) batches (args.h): work items are (sequence, query
// head, query tile) with tiles counted up to max_seqlen_q, and an item past its sequence's end
// returns at once (an idle CTA costs a few loads of cu_seqlens); every hook sees the sequence's
// own lengths and positions. Padded instantiations compile exactly the code they had before.
//
// kSparse instantiations (launch_fwd_tiled<..., kPacked, true>) take block lists (args.h, "Block
// sparsity"; FgFwdArgs::kv_blocks, made for this kernel's tiles): a work item walks
// only the key tiles its query tile's row lists, partial ones first, each in list order, with the
// same two-stage K/V pipeline (the next listed tile is prefetched). A listed-partial tile always
// takes the per-element mask; a listed-full tile takes the usual tile test, minus tile_full when
// the lists come from the variant's own mask (full_kept). Dense instantiations compile the code
// they had before.
//
// Supported head dims: every multiple of 8 from 8 to 256 (a static_assert rejects the rest).
// Internally the head dim is padded to kD = round_up(d, 16); the padded columns are zero-filled
// in shared memory and never written back.
//
// ---------------------------------------------------------------------------------------------
// Algorithm (FlashAttention-2, Dao 2023, arXiv 2307.08691, Algorithm 1)
//
// One thread block ("CTA") owns one (query tile of kBlockM rows, query head, batch) work item.
// Its warps split the query tile into slabs of 16*kMAtoms rows; a warp never exchanges data
// with another warp, so each query row's softmax state lives in one quad of lanes.
//
//   load Q tile (kept on chip: in registers, or re-read from shared memory per K tile)
//   m = -inf, l = 0, O = 0                               (per query row)
//   for each K/V tile j in [kv_lo, kv_hi), from the high end down:
//     S = Q K_j^T                                          (tensor cores, fp32 accumulation)
//     S = scale*log2(e) * S  (or log2(e) * score(scale*S)), masked entries := -inf by selection
//     m_new = max(m, rowmax(S));  P = exp2(S - m_new);  alpha = exp2(m - m_new)
//     l = alpha*l + rowsum(P);  O = alpha*O + P V_j        (P stays in registers)
//     (O *= alpha is skipped when no row of the warp raised its max; building with
//      FLASHGEN_FWD_RESCALE_LOG2=8 also keeps a stale m until it is exceeded by 8 (log2 units),
//      2-4% faster but with up to ~2x the output rounding error)
//   O /= l;  LSE = ln(2) * (m + log2(l))                   (rows with l == 0: O = 0, LSE = -inf)
//
// Memory pipeline: K and V tiles stream through a 2-stage ring in shared memory with cp.async.
// At the top of iteration j one barrier publishes tile j (issued during iteration j-1) and
// certifies that every warp is done with tile j-1; the copies of tile j+1 are then issued into
// that freed stage and overlap both GEMMs of tile j. One __syncthreads per tile.
//
// Masking by tile class: tiles outside the variant's [kv_lo, kv_hi) are never visited; a
// visited tile takes the per-element path (bounds & Variant::keep, then score on visible elements
// only) only if it crosses kv_lo/kv_hi/seqlen_k, or Variant::tile_full says the mask is partial
// there, or (with a score mod) the query tile runs past seqlen_q. On such a tile, when the mask
// keeps an interval of keys per row (Variant::kRowExact: causal, windows, prefix-LM, key
// padding), the mask is two integer compares per element against that row's bounds
// (row_bounds); otherwise bounds + keep() per element. All other tiles run the bare
// path (one multiply per score, or score() per element with a score mod: every element of such
// a tile is in bounds). Iterating from the high end puts the partial tiles of causal and
// bottom-aligned masks first.
//
// Variant hooks (flashgen/variant.h): kv_lo/kv_hi are evaluated once per work item and
// tile_full once per visited tile, with the item's batch b and query head h and the tile
// [q_lo, q_hi) clipped to seqlen_q; keep() and score() per element, score() on
// s = scale * q.k in natural units (its result is scaled by log2(e) here). score() only ever
// sees in-bounds elements (q < seqlen_q, kv < seqlen_k) that keep() kept. Variant::Params is
// copied from FgFwdArgs::params (which may be null when it is empty) into the kernel's
// by-value argument, so tensor parameters are device pointers read through the hooks.
//
// ---------------------------------------------------------------------------------------------
// Fragment layouts (PTX ISA, "mma.m16n8k16" for .f16/.bf16; g = lane/4, t = lane%4):
//   A 16x16 (row-major, 4 regs of 2 elements):  a0 = (g, 2t..2t+1)    a1 = (g+8, 2t..2t+1)
//                                               a2 = (g, 8+2t..)      a3 = (g+8, 8+2t..)
//   B 16x8  (col-major, 2 regs):                 b0 = (k=2t..2t+1, n=g)  b1 = (k=8+2t.., n=g)
//   C 16x8  (fp32, 4 regs):                      c0,c1 = (g, 2t..2t+1)   c2,c3 = (g+8, 2t..2t+1)
// * Q (A operand, stored [row][d]): one ldmatrix.x4 per 16x16 block; lanes 0-7 address rows 0-7
//   at col 0, lanes 8-15 rows 8-15 at col 0, lanes 16-23 rows 0-7 at col 8, 24-31 rows 8-15 at
//   col 8, which yields a0..a3 directly.
// * K (B operand of S = QK^T, stored [kv][d]): B(k=d, n=kv) = K[kv][d], so an untransposed 8x8
//   ldmatrix of K rows gives b0/b1. One ldmatrix.x4 covers 16 keys x 16 d: matrices (kv 0-7, d
//   0-7), (kv 0-7, d 8-15), (kv 8-15, d 0-7), (kv 8-15, d 8-15) = b0,b1 of n-block 0, b0,b1 of
//   n-block 1.
// * V (B operand of O = PV, stored [kv][d]): B(k=kv, n=d) = V[kv][d] needs the transpose, so
//   ldmatrix.x4.trans with the same lane addressing as Q: matrices (kv 0-7, d 0-7), (kv 8-15,
//   d 0-7), (kv 0-7, d 8-15), (kv 8-15, d 8-15) = b0,b1 of d-block 0, b0,b1 of d-block 1.
// * P (A operand of O = PV) comes straight from the S accumulators: the C layout of two
//   adjacent 8-key n-blocks 2u, 2u+1 is exactly the A layout of the 16-key k-slice u:
//   a0 = pack(c0,c1 of 2u), a1 = pack(c2,c3 of 2u), a2 = pack(c0,c1 of 2u+1), a3 = pack(c2,c3
//   of 2u+1). No shared-memory round trip.
// * Each row's softmax statistics are reduced over the quad (lanes 4g..4g+3) with two shuffles;
//   the row sum is kept per lane and reduced once at the end (alpha is quad-uniform).
//
// Shared memory rows are padded by 16 bytes (pitch kD+8 elements): kD/8+1 is odd, so the 8 row
// addresses of every ldmatrix phase fall on 8 distinct 16-byte bank groups (conflict-free), and
// cp.async writes stay 16-byte aligned.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "flashgen/args.h"
#include "flashgen/cuda/dropout.cuh"
#include "flashgen/cuda/ptx.cuh"
#include "flashgen/cuda/status.cuh"
#include "flashgen/variant.h"

// Upper bound on gridDim.x; CTAs loop over the remaining work items (tests lower it to exercise
// that loop).
#ifndef FLASHGEN_FWD_MAX_GRID
#define FLASHGEN_FWD_MAX_GRID 2147483647
#endif

// Lazy-rescale threshold in log2 units (see softmax_tile). 0 (default): the running max follows
// every increase, so the largest P of a row is exactly 1 and rounds exactly. 8: the max is
// only moved once some row of the warp exceeds it by 8 (a factor 2^8 in P), which skips most
// O *= alpha passes (+2-4% on an H200) but puts a rounding error on every P, so the output
// error roughly matches (instead of undercutting) a low-precision reference; the FlashAttention
// test rule (<= 2x that reference's error) then failed on 2 of 475 small shapes.
#ifndef FLASHGEN_FWD_RESCALE_LOG2
#define FLASHGEN_FWD_RESCALE_LOG2 0
#endif

namespace flashgen {
namespace cuda {

// ---------------------------------------------------------------------------------------------
// Tile configuration.

// kBlockM query rows per CTA, kBlockN keys per K/V tile, kWarps warps; each warp owns
// kBlockM/kWarps rows (16 or 32: one or two m16 "atoms"). kQInRegs keeps the warp's Q fragments
// in registers for the whole work item; otherwise they are re-read from shared memory per tile
// (fewer registers, more shared-memory traffic). kBlockNSm8x replaces kBlockN in device code
// built for sm_8x (whose ptxas needs a few more registers for the same tile).
template <int kBlockM_, int kBlockN_, int kWarps_, bool kQInRegs_, int kBlockNSm8x_ = kBlockN_>
struct FwdTile {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockNSm8x = kBlockNSm8x_;
  static constexpr int kWarps = kWarps_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = kBlockM / kWarps;
  static constexpr int kMAtoms = kWarpRows / 16;
  static_assert(kBlockM % kWarps == 0 && kWarpRows % 16 == 0, "each warp owns 16*k query rows");
  static_assert(kMAtoms == 1 || kMAtoms == 2, "a warp owns 16 or 32 query rows");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 16 && kBlockNSm8x % 16 == 0 && kBlockNSm8x >= 16,
                "kBlockN must be a multiple of 16");
};

// The tile of an instantiation is chosen in Python (flashgen/tiles.py: per-arch tables of
// measured configurations, tiles derived from the device's shared memory, tuned winners) and
// rendered into the generated translation unit, which calls launch_fwd_tiled with it.

// ---------------------------------------------------------------------------------------------
// The kernel.

// Widen a non-negative index to 64 bits by zero extension (the compiler then keeps no register
// for the high half; every index passed here is >= 0).
__device__ __forceinline__ int64_t wide(int x) { return int64_t(uint32_t(x)); }

// One sequence's rows (args.h, "Packed (varlen) batches"): its first query and key row (q0, k0)
// and its lengths. Padded layout (cu_q null): 0, 0 and the batch's seqlen_q, seqlen_k. Packed:
// from cu_seqlens_q / cu_seqlens_k, whose values the host checked before the launch.
struct SeqSpan {
  int q0, k0, len_q, len_k;
};
__device__ __forceinline__ SeqSpan seq_span(const int* cu_q, const int* cu_k, int b, int seqlen_q,
                                            int seqlen_k) {
  if (cu_q == nullptr) return SeqSpan{0, 0, seqlen_q, seqlen_k};
  const int q0 = __ldg(cu_q + b), k0 = __ldg(cu_k + b);
  return SeqSpan{q0, k0, __ldg(cu_q + b + 1) - q0, __ldg(cu_k + b + 1) - k0};
}

// Block sparsity (args.h, FgBlockLists) as the kernels read it: kSparse instantiations visit, per
// tile row, only the listed tiles (partial ones first), in list order.
struct BlockLists {
  const int* data;
  int64_t sb, sh;  // int32 elements between batch entries / query heads (0: shared)
  int cols;
  int full_kept;  // 1: a listed-full tile keeps every element under the variant's mask too
};
struct BlockRow {
  const int* idx;  // tile indices: [0, n_part) partial, [n_part, n_all) full
  int n_part, n_all;
};
__device__ __forceinline__ BlockRow block_row(const BlockLists& l, int b, int h, int r) {
  const int* row = l.data + wide(b) * l.sb + wide(h) * l.sh + wide(r) * (l.cols + 2);
  BlockRow br;
  br.n_part = imin(imax(__ldg(row), 0), l.cols);
  br.n_all = br.n_part + imin(imax(__ldg(row + 1), 0), l.cols - br.n_part);
  br.idx = row + 2;
  return br;
}

template <class Variant, class Element, int kHeadDim, class Tile, bool kPacked = false,
          bool kSparse = false>
struct FwdKernel {
  static_assert(kHeadDim >= 8 && kHeadDim <= 256 && kHeadDim % 8 == 0,
                "flashgen CUDA forward supports head_dim in {8, 16, 24, ..., 256} (multiples of 8 "
                "up to 256)");
  static_assert(std::is_same<Element, __half>::value || std::is_same<Element, __nv_bfloat16>::value,
                "flashgen CUDA forward supports __half and __nv_bfloat16 inputs");

  using VParams = typename Variant::Params;
  static_assert(std::is_trivially_copyable<VParams>::value,
                "Variant::Params must be trivially copyable (it is passed by value to the kernel)");

  static constexpr int kBlockM = Tile::kBlockM;
  // Keys per K/V tile in this compilation pass (see FwdTile::kBlockNSm8x); the host pass sees
  // kBlockN, and sizes shared memory per device (smem_bytes) so that either choice fits.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  static constexpr int kBlockN = Tile::kBlockNSm8x;
#else
  static constexpr int kBlockN = Tile::kBlockN;
#endif
  static constexpr int kBlockNMax =
      Tile::kBlockN > Tile::kBlockNSm8x ? Tile::kBlockN : Tile::kBlockNSm8x;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kMinBlocks = kThreads <= 128 ? 2 : 1;
  static constexpr int kWarpRows = Tile::kWarpRows;
  static constexpr int kMAtoms = Tile::kMAtoms;
  static constexpr bool kQInRegs = Tile::kQInRegs;
  static constexpr int kD = (kHeadDim + 15) / 16 * 16;  // padded head dim (mma k granularity)
  static constexpr int kPitch = kD + 8;                  // shared row pitch, elements
  static constexpr int kChunksPerRow = kD / 8;           // 16-byte chunks per row
  static constexpr int kStages = 2;
  static constexpr int kQElems = kBlockM * kPitch;
  static constexpr int kKVElems = kBlockN * kPitch;
  // Dynamic shared memory: Q tile, then the K ring, then the V ring (kStages tiles each).
  static constexpr int smem_bytes(int block_n) {
    return (kQElems + 2 * kStages * block_n * kPitch) * int(sizeof(Element));
  }
  static constexpr int kNBlocks = kBlockN / 8;  // 8-key accumulator blocks of S per m-atom
  static constexpr int kDBlocks = kD / 8;       // 8-column accumulator blocks of O per m-atom
  static constexpr float kLog2e = 1.4426950408889634f;
  static constexpr float kLn2 = 0.6931471805599453f;

  struct Params {
    const Element* q;
    const Element* k;
    const Element* v;
    Element* o;
    float* lse;  // may be null: LSE not written
    const int* cu_q;  // kPacked: cu_seqlens_q / cu_seqlens_k (args.h, packed batches)
    const int* cu_k;
    int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn;
    int64_t total_q;  // kPacked: LSE is [heads_q, total_q]
    int64_t total_work;  // num_m_tiles * heads_q * batch
    int heads_q, group, seqlen_q, seqlen_k, num_m_tiles;
    float scale;       // natural units (score mods see scale * q.k)
    float scale_log2;  // scale * log2(e)
    DropoutArgs dropout;  // read only with Variant::kHasDropout (state null: off)
    BlockLists blk;       // kSparse: kv lists, a row per query tile (args.h)
    VParams vp;
  };

  // Copy rows [row0, row0 + kRows) of a [rows][d] matrix into shared memory (pitch kPitch).
  // Rows outside [row_begin, row_end) and padded columns past kHeadDim are zero-filled and never
  // read, so K/V outside the visited key range (and past seqlen) cannot leak even as NaN.
  // kCheckRows = false: the caller guarantees that every row is inside [row_begin, row_end)
  // (interior K/V tiles), which drops the per-chunk predicates.
  template <int kRows, bool kCheckRows = true>
  static __device__ __forceinline__ void load_rows(uint32_t s_addr, const Element* g,
                                                   int64_t stride_n, int row0, int row_begin,
                                                   int row_end, int tid) {
    constexpr int kChunks = kRows * kChunksPerRow;
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
        ptx::cp_async_16(s_addr + ((r0 + i * kRowStep) * kPitch + cc * 8) * int(sizeof(Element)),
                         ok ? src : g, ok);
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
          ptx::cp_async_16(s_addr + (r * kPitch + cc * 8) * int(sizeof(Element)), src, ok);
        }
      }
    }
  }

  // K and V rows [kv0, kv0 + kBlockN) into one pipeline stage; interior tiles skip the row
  // predicates.
  static __device__ __forceinline__ void load_kv(uint32_t sK, uint32_t sV, const Element* k_g,
                                                 const Element* v_g, const Params& p, int kv0,
                                                 int kv_begin, int kv_end, int tid) {
    if (kv0 >= kv_begin && kv0 + kBlockN <= kv_end) {
      load_rows<kBlockN, false>(sK, k_g, p.k_sn, kv0, kv_begin, kv_end, tid);
      load_rows<kBlockN, false>(sV, v_g, p.v_sn, kv0, kv_begin, kv_end, tid);
    } else {
      load_rows<kBlockN, true>(sK, k_g, p.k_sn, kv0, kv_begin, kv_end, tid);
      load_rows<kBlockN, true>(sV, v_g, p.v_sn, kv0, kv_begin, kv_end, tid);
    }
  }

  static constexpr int kNoMask = 0, kRowMask = 1, kElemMask = 2;

  // Per-element visibility on a partial tile: in bounds and kept. keep() runs on every element
  // of the tile, out-of-range ones too (its result is then discarded; variant.h allows it), so
  // its reads carry no branch and nvcc shares those of one row or column across the tile's
  // elements (a document-id mask then costs two loads per row and column, not two per element).
  // score() still only sees visible elements.
  static __device__ __forceinline__ bool visible(const Params& p, int b, int h, int q, int kv,
                                                 int kv_begin, int kv_end, int Nq, int Nk) {
    const bool in = kv >= kv_begin && kv < kv_end && q < Nq;
    if constexpr (Variant::kHasMask) {
      return in & Variant::keep(p.vp, b, h, q, kv, Nq, Nk);
    } else {
      return in;
    }
  }

  // Keys [lo, hi) of query row q within [kv_begin, kv_end): the variant's key range for the
  // single row [q, q+1) (empty for q >= seqlen_q). With Variant::kRowExact (the mask keeps an
  // interval of keys per row: causal, windows, prefix-LM, key padding; proven by the generator),
  // visible(q, kv) <=> lo <= kv < hi.
  static __device__ __forceinline__ void row_bounds(const Params& p, int b, int h, int q,
                                                    int kv_begin, int kv_end, int Nq, int Nk,
                                                    int& lo, int& hi) {
    lo = hi = 0;
    if (q >= Nq) return;
    lo = imax(imin(imax(Variant::kv_lo(p.vp, b, h, q, q + 1, Nq, Nk), 0), Nk), kv_begin);
    hi = imin(imin(imax(Variant::kv_hi(p.vp, b, h, q, q + 1, Nq, Nk), 0), Nk), kv_end);
  }

  // Row-wise max (kMax) or min of the raw accumulators, reduced over the quad.
  template <bool kMax>
  static __device__ __forceinline__ void raw_row_extreme(const float (&s)[kMAtoms][kNBlocks][4],
                                                         float (&out)[kMAtoms][2]) {
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float x = s[ma][0][2 * half];
#pragma unroll
        for (int j = 0; j < kNBlocks; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float y = s[ma][j][2 * half + e];
            x = kMax ? fmaxf(x, y) : fminf(x, y);
          }
        }
#pragma unroll
        for (int off = 1; off <= 2; off *= 2) {
          const float y = __shfl_xor_sync(0xffffffffu, x, off);
          x = kMax ? fmaxf(x, y) : fminf(x, y);
        }
        out[ma][half] = x;
      }
    }
  }

  // Scores -> probabilities for one tile, updating the running max / sum and rescaling O.
  // On entry s[][][] holds the raw accumulators q.k; on return P = exp2(s' - m) in fp32, where s'
  // is the score in log2 units (exactly 0 where masked). The running max m is in log2 units.
  //
  // Two forms:
  //  * kMasked or a score mod: s' is materialised per element (scale or score(), then -inf by
  //    selection for masked entries), and the row max is taken over s'.
  //  * otherwise (the hot path): s' = c*x with c = scale*log2(e) is never materialised; the row
  //    max is c * max(x) (c * min(x) when c < 0) and P = exp2(fma(x, c, -m)), one FFMA + one
  //    MUFU per element.
  // kMask: kNoMask (every element of the tile is visible), kRowMask (visible iff
  // row_lo <= kv < row_hi, the per-row bounds of row_bounds) or kElemMask (bounds, then
  // Variant::keep per element).
  template <int kMask>
  static __device__ __forceinline__ void softmax_tile(
      const Params& p, float (&s)[kMAtoms][kNBlocks][4], float (&row_max)[kMAtoms][2],
      float (&row_sum)[kMAtoms][2], float (&o)[kMAtoms][kDBlocks][4], int b, int h, int q_row0,
      int kv0, int kv_begin, int kv_end, int Nq, int Nk, int lane) {
    constexpr bool kMasked = kMask != kNoMask;
    constexpr bool kRaw = !kMasked && !Variant::kHasScoreMod;
    const int g = lane >> 2, t = lane & 3;
    const float c = p.scale_log2;
    float tile_max[kMAtoms][2];
    if constexpr (kRaw) {
      if (c >= 0.f) {
        raw_row_extreme<true>(s, tile_max);
      } else {
        raw_row_extreme<false>(s, tile_max);
      }
#pragma unroll
      for (int ma = 0; ma < kMAtoms; ++ma) {
        tile_max[ma][0] *= c;
        tile_max[ma][1] *= c;
      }
    } else {
      // Row by row: with kRowMask only that row's bounds are live (recomputed per partial tile,
      // cheaper than keeping 4 * kMAtoms registers across the key loop).
#pragma unroll
      for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int q = q_row0 + ma * 16 + g + half * 8;
          int lo = 0, hi = 0;
          if constexpr (kMask == kRowMask) row_bounds(p, b, h, q, kv_begin, kv_end, Nq, Nk, lo, hi);
#pragma unroll
          for (int j = 0; j < kNBlocks; ++j) {
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
              const int e = 2 * half + e1;
              float x = s[ma][j][e];
              const int kv = kv0 + j * 8 + 2 * t + e1;
              const bool vis = kMask == kNoMask ||
                               (kMask == kRowMask ? (kv >= lo && kv < hi)
                                                  : visible(p, b, h, q, kv, kv_begin, kv_end, Nq, Nk));
              if constexpr (Variant::kHasScoreMod) {
                if (vis) {
                  x = Variant::score(p.vp, x * p.scale, b, h, q, kv, Nq, Nk) *
                      kLog2e;
                } else {
                  x = -INFINITY;
                }
              } else {
                x *= c;
                if (!vis) x = -INFINITY;
              }
              s[ma][j][e] = x;
            }
          }
        }
      }
      raw_row_extreme<true>(s, tile_max);
    }

    // The running max m moves when some row of the warp exceeds it by more than
    // FLASHGEN_FWD_RESCALE_LOG2 log2 units (by default 0: any increase) or sees its first key;
    // otherwise the O *= alpha pass is skipped and P is taken against the current m
    // (P <= 2^threshold; O, l and LSE = m + log2(l) stay consistent, exact up to rounding).
    bool need = false;
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // -inf - (-inf) = NaN compares false: a row with no key so far needs nothing yet.
        need |= tile_max[ma][half] - row_max[ma][half] > float(FLASHGEN_FWD_RESCALE_LOG2);
      }
    }
    float m_use[kMAtoms][2];
    if (__any_sync(0xffffffffu, need)) {
      float alpha[kMAtoms][2];
#pragma unroll
      for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float mx = fmaxf(row_max[ma][half], tile_max[ma][half]);
          // A row that has seen no key keeps max -inf; exponentiate against 0 instead so that
          // exp2(-inf - (-inf)) = NaN never happens: P = 0 and alpha = 0 (O and l are 0).
          m_use[ma][half] = (mx == -INFINITY) ? 0.f : mx;
          alpha[ma][half] = ptx::exp2_approx(row_max[ma][half] - m_use[ma][half]);
          row_max[ma][half] = mx;
          row_sum[ma][half] *= alpha[ma][half];
        }
      }
#pragma unroll
      for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
        for (int dn = 0; dn < kDBlocks; ++dn) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[ma][dn][e] *= alpha[ma][e >> 1];
        }
      }
    } else {
#pragma unroll
      for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          m_use[ma][half] = (row_max[ma][half] == -INFINITY) ? 0.f : row_max[ma][half];
        }
      }
    }
    // P = exp2(s' - m) and the row sums.
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float mu = m_use[ma][half];
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kNBlocks; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[ma][j][2 * half + e];
            x = kRaw ? ptx::exp2_approx(fmaf(x, c, -mu)) : ptx::exp2_approx(x - mu);
            sum += x;
          }
        }
        row_sum[ma][half] += sum;
      }
    }
  }

  // Dropout on this tile's P (after softmax_tile: the row sums, so l and LSE, are those of the
  // undropped P, as in FlashAttention): dropped entries become 0 before O += P V; the factor
  // 1 / (1 - p) is applied once, in the epilogue. One Philox call per four elements: rows
  // {g, g + 8} x columns {c, c + 8} of two adjacent 8-column blocks (see dropout.cuh).
  static __device__ __forceinline__ void apply_dropout(const Params& p,
                                                       float (&s)[kMAtoms][kNBlocks][4], int b,
                                                       int h, int q_row0, int kv0, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const DropoutKey key = dropout_key(p.dropout, int64_t(b) * p.heads_q + h);
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int jp = 0; jp < kNBlocks / 2; ++jp) {
#pragma unroll
        for (int e0 = 0; e0 < 2; ++e0) {
          const uint32_t bits =
              dropout_bits(key, q_row0 + ma * 16 + g, kv0 + jp * 16 + 2 * t + e0);
          float(&lo)[4] = s[ma][2 * jp];
          float(&hi)[4] = s[ma][2 * jp + 1];
          lo[e0] = (bits & 1u) ? lo[e0] : 0.f;      // (q, kv)
          lo[2 + e0] = (bits & 2u) ? lo[2 + e0] : 0.f;  // (q + 8, kv)
          hi[e0] = (bits & 4u) ? hi[e0] : 0.f;      // (q, kv + 8)
          hi[2 + e0] = (bits & 8u) ? hi[2 + e0] : 0.f;  // (q + 8, kv + 8)
        }
      }
    }
  }

  // Work items are numbered query-tile fastest (CTAs of one head run together and share its
  // K/V in L2), heaviest query tile first within a head (better tail balance under causal
  // masks). CTA x handles items x, x + gridDim.x, ...; `iter` counts those.
  struct Item {
    int b, h, m_tile;
  };
  static __device__ __forceinline__ Item decode_item(const Params& p, int iter) {
    const int64_t w = int64_t(ptx::ctaid_x()) + int64_t(iter) * ptx::nctaid_x();
    const int64_t bh = w / p.num_m_tiles;
    Item it;
    it.m_tile = p.num_m_tiles - 1 - int(w - bh * p.num_m_tiles);
    it.h = int(bh % p.heads_q);
    it.b = int(bh / p.heads_q);
    return it;
  }

  // One work item: query tile m_tile of (batch b, query head h). The epilogue decodes the item
  // again rather than keeping b and h live through the main loop (register pressure).
  static __device__ __forceinline__ void run_item(const Params& p, int iter, Element* smem) {
    const Item item = decode_item(p, iter);
    const int b = item.b, h = item.h, m_tile = item.m_tile;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int warp_row0 = warp * kWarpRows;
    constexpr int kE = int(sizeof(Element));

    Element* sQ = smem;
    const uint32_t sQ_addr = ptx::smem_addr(sQ);
    const uint32_t sK_addr = sQ_addr + kQElems * kE;
    const uint32_t sV_addr = sK_addr + kStages * kKVElems * kE;
    // Per-lane ldmatrix byte offsets inside a 16x16 block (see the layout notes above).
    const uint32_t a_off = (((lane & 7) + ((lane >> 3) & 1) * 8) * kPitch + (lane >> 4) * 8) * kE;
    const uint32_t k_off = (((lane & 7) + (lane >> 4) * 8) * kPitch + ((lane >> 3) & 1) * 8) * kE;

    const SeqSpan sp = kPacked ? seq_span(p.cu_q, p.cu_k, b, p.seqlen_q, p.seqlen_k)
                               : SeqSpan{0, 0, p.seqlen_q, p.seqlen_k};
    const int Nq = sp.len_q, Nk = sp.len_k;
    const int q_lo = m_tile * kBlockM;
    if constexpr (kPacked) {
      if (q_lo >= Nq) return;  // a query tile past this sequence's end: no rows to write
    }
    const int q_hi = imin(q_lo + kBlockM, Nq);
    const int h_kv = h / p.group;
    const Element* q_g = p.q + wide(b) * p.q_sb + wide(h) * p.q_sh + wide(sp.q0) * p.q_sn;
    const Element* k_g = p.k + wide(b) * p.k_sb + wide(h_kv) * p.k_sh + wide(sp.k0) * p.k_sn;
    const Element* v_g = p.v + wide(b) * p.v_sb + wide(h_kv) * p.v_sh + wide(sp.k0) * p.v_sn;

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
    // With a score mod, rows past seqlen_q must not reach score(): treat that tile as partial.
    const bool q_partial = Variant::kHasScoreMod && (q_hi - q_lo < kBlockM);


    float o[kMAtoms][kDBlocks][4];
    float row_max[kMAtoms][2], row_sum[kMAtoms][2];
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int dn = 0; dn < kDBlocks; ++dn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[ma][dn][e] = 0.f;
      }
      row_max[ma][0] = row_max[ma][1] = -INFINITY;
      row_sum[ma][0] = row_sum[ma][1] = 0.f;
    }
    uint32_t qf[kQInRegs ? kMAtoms : 1][kQInRegs ? kD / 16 : 1][4];

    if (n_tiles > 0) {
      // Prologue: Q and the first K/V tile, one commit group.
      load_rows<kBlockM>(sQ_addr, q_g, p.q_sn, q_lo, 0, Nq, tid);
      load_kv(sK_addr, sV_addr, k_g, v_g, p, (kSparse ? __ldg(blk.idx) : n_hi) * kBlockN, kv_begin,
              kv_end, tid);
      ptx::cp_async_commit();

      for (int it = 0; it < n_tiles; ++it) {
        const int n = kSparse ? __ldg(blk.idx + it) : n_hi - it;
        const int kv0 = n * kBlockN;
        const uint32_t sK_cur = sK_addr + (it & 1) * kKVElems * kE;
        const uint32_t sV_cur = sV_addr + (it & 1) * kKVElems * kE;

        // K_it and V_it (issued one iteration ago) landed for this thread; the barrier
        // publishes everyone's copies and guarantees that every warp is done with tile it-1,
        // whose stage is refilled right below. This is the only barrier per tile.
        ptx::cp_async_wait<0>();
        __syncthreads();
        if constexpr (kQInRegs) {
          if (it == 0) {
#pragma unroll
            for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
              for (int kk = 0; kk < kD / 16; ++kk) {
                ptx::ldmatrix_x4(qf[ma][kk],
                                 sQ_addr + ((warp_row0 + ma * 16) * kPitch + kk * 16) * kE + a_off);
              }
            }
          }
        }
        // Prefetch tile it+1 into the other stage; it overlaps both GEMMs of this tile.
        if (it + 1 < n_tiles) {
          const uint32_t stage = ((it + 1) & 1) * kKVElems * kE;
          load_kv(sK_addr + stage, sV_addr + stage, k_g, v_g, p,
                  kSparse ? __ldg(blk.idx + it + 1) * kBlockN : kv0 - kBlockN, kv_begin, kv_end,
                  tid);
          ptx::cp_async_commit();
        }

        // S = Q K^T.
        float s[kMAtoms][kNBlocks][4];
#pragma unroll
        for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
          for (int j = 0; j < kNBlocks; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[ma][j][e] = 0.f;
          }
        }
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          uint32_t a[kMAtoms][4];
#pragma unroll
          for (int ma = 0; ma < kMAtoms; ++ma) {
            if constexpr (kQInRegs) {
#pragma unroll
              for (int r = 0; r < 4; ++r) a[ma][r] = qf[ma][kk][r];
            } else {
              ptx::ldmatrix_x4(a[ma],
                               sQ_addr + ((warp_row0 + ma * 16) * kPitch + kk * 16) * kE + a_off);
            }
          }
#pragma unroll
          for (int np = 0; np < kBlockN / 16; ++np) {
            uint32_t bk[4];
            ptx::ldmatrix_x4(bk, sK_cur + (np * 16 * kPitch + kk * 16) * kE + k_off);
#pragma unroll
            for (int ma = 0; ma < kMAtoms; ++ma) {
              ptx::mma_16816<Element>(s[ma][2 * np], a[ma], bk[0], bk[1]);
              ptx::mma_16816<Element>(s[ma][2 * np + 1], a[ma], bk[2], bk[3]);
            }
          }
        }

        // Softmax, with the per-element mask only where this tile needs it.
        // kSparse: a listed-partial tile always takes the mask; a listed-full one skips keep()
        // when the lists came from the variant's own mask (BlockLists::full_kept).
        const bool listed_partial = kSparse && it < blk.n_part;
        const bool need_mask =
            listed_partial || kv0 < kv_begin || kv0 + kBlockN > kv_end || q_partial ||
            (Variant::kHasMask && !(kSparse && p.blk.full_kept) &&
             !Variant::tile_full(p.vp, b, h, q_lo, q_hi, kv0, kv0 + kBlockN, Nq, Nk));
        if (!need_mask) {
          softmax_tile<kNoMask>(p, s, row_max, row_sum, o, b, h, q_lo + warp_row0, kv0, kv_begin,
                                kv_end, Nq, Nk, lane);
        } else if constexpr (!Variant::kHasMask || Variant::kRowExact) {
          softmax_tile<kRowMask>(p, s, row_max, row_sum, o, b, h, q_lo + warp_row0, kv0,
                                 kv_begin, kv_end, Nq, Nk, lane);
        } else {
          softmax_tile<kElemMask>(p, s, row_max, row_sum, o, b, h, q_lo + warp_row0, kv0,
                                  kv_begin, kv_end, Nq, Nk, lane);
        }

        if constexpr (Variant::kHasDropout) {
          if (p.dropout.state) apply_dropout(p, s, b, h, q_lo + warp_row0, kv0, lane);
        }

        // O += P V, with P taken from the S accumulators (see the layout notes). The lane
        // offset (same pattern as a_off) is recomputed here, not kept live across the loop.
        const uint32_t lv = ptx::lane_id();
        const uint32_t v_off = (((lv & 7) + ((lv >> 3) & 1) * 8) * kPitch + (lv >> 4) * 8) * kE;
#pragma unroll
        for (int u = 0; u < kBlockN / 16; ++u) {
          uint32_t a[kMAtoms][4];
#pragma unroll
          for (int ma = 0; ma < kMAtoms; ++ma) {
            a[ma][0] = ptx::pack2<Element>(s[ma][2 * u][0], s[ma][2 * u][1]);
            a[ma][1] = ptx::pack2<Element>(s[ma][2 * u][2], s[ma][2 * u][3]);
            a[ma][2] = ptx::pack2<Element>(s[ma][2 * u + 1][0], s[ma][2 * u + 1][1]);
            a[ma][3] = ptx::pack2<Element>(s[ma][2 * u + 1][2], s[ma][2 * u + 1][3]);
          }
#pragma unroll
          for (int dp = 0; dp < kD / 16; ++dp) {
            uint32_t bv[4];
            ptx::ldmatrix_x4_trans(bv, sV_cur + (u * 16 * kPitch + dp * 16) * kE + v_off);
#pragma unroll
            for (int ma = 0; ma < kMAtoms; ++ma) {
              ptx::mma_16816<Element>(o[ma][2 * dp], a[ma], bv[0], bv[1]);
              ptx::mma_16816<Element>(o[ma][2 * dp + 1], a[ma], bv[2], bv[3]);
            }
          }
        }
      }
    }

    // Epilogue: normalise, stage the warp's own rows through its slice of sQ (no other warp
    // reads those rows), then write 16-byte chunks. Rows that saw no key (l == 0) get exactly 0
    // by selection, whatever O holds, and LSE = -inf.
    const Item item_e = decode_item(p, iter);
    const SeqSpan sp_e = kPacked ? seq_span(p.cu_q, p.cu_k, item_e.b, p.seqlen_q, p.seqlen_k)
                                 : SeqSpan{0, 0, p.seqlen_q, p.seqlen_k};
    float* lse_g = !p.lse ? nullptr
                   : kPacked ? p.lse + wide(item_e.h) * p.total_q + sp_e.q0
                             : p.lse + (wide(item_e.b) * p.heads_q + item_e.h) * Nq;
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float l = row_sum[ma][half];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const bool has = l > 0.f;
        float inv = has ? 1.f / l : 0.f;
        if constexpr (Variant::kHasDropout) {
          if (p.dropout.state) inv *= p.dropout.scale;
        }
        const int row = warp_row0 + ma * 16 + g + half * 8;
#pragma unroll
        for (int dn = 0; dn < kDBlocks; ++dn) {
          const float v0 = has ? o[ma][dn][2 * half] * inv : 0.f;
          const float v1 = has ? o[ma][dn][2 * half + 1] * inv : 0.f;
          *reinterpret_cast<uint32_t*>(sQ + row * kPitch + dn * 8 + 2 * t) =
              ptx::pack2<Element>(v0, v1);
        }
        const int q = q_lo + row;
        if (lse_g && t == 0 && q < Nq) {
          lse_g[q] = has ? (row_max[ma][half] + ptx::log2_approx(l)) * kLn2 : -INFINITY;
        }
      }
    }
    __syncwarp();
    Element* o_g =
        p.o + wide(item_e.b) * p.o_sb + wide(item_e.h) * p.o_sh + wide(sp_e.q0) * p.o_sn;
    constexpr int kOutChunks = kWarpRows * kChunksPerRow;
#pragma unroll
    for (int i = 0; i < (kOutChunks + 31) / 32; ++i) {
      const int c = lane + i * 32;
      if (kOutChunks % 32 == 0 || c < kOutChunks) {
        const int r = c / kChunksPerRow;
        const int cc = c % kChunksPerRow;
        const int q = q_lo + warp_row0 + r;
        if (q < Nq && (kD == kHeadDim || cc * 8 < kHeadDim)) {
          *reinterpret_cast<uint4*>(o_g + wide(q) * p.o_sn + cc * 8) =
              *reinterpret_cast<const uint4*>(sQ + (warp_row0 + r) * kPitch + cc * 8);
        }
      }
    }
  }

  // A 1-D grid never hits the 65535 limit of gridDim.y/z; if there are more work items than
  // gridDim.x allows, CTAs loop.
  static __device__ __forceinline__ void run(const Params& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Element* smem = reinterpret_cast<Element*>(smem_raw);
    for (int iter = 0; int64_t(blockIdx.x) + int64_t(iter) * gridDim.x < p.total_work; ++iter) {
      if (iter > 0) __syncthreads();  // shared memory of the previous item is free
      run_item(p, iter, smem);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, Kernel::kMinBlocks)
    fwd_kernel(const __grid_constant__ typename Kernel::Params params) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  Kernel::run(params);
#else
  __trap();  // built for an architecture without cp.async / bf16 mma: fail loudly
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side.

namespace detail {
inline bool misaligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; }
// Compute-capability major of a device, cached (cudaDeviceGetAttribute is cheap but not free).
inline int device_major(int dev) {
  static std::atomic<int> cache[64];  // 0 = unknown
  if (dev >= 0 && dev < 64) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v) return v;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;  // unknown: the launch itself will report the problem
  }
  if (dev >= 0 && dev < 64) cache[dev].store(major, std::memory_order_relaxed);
  return major;
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
inline BlockLists block_lists(const FgBlockLists& l) {
  return BlockLists{reinterpret_cast<const int*>(l.data), l.stride_b, l.stride_h, l.cols,
                    l.full_kept};
}
// A stride only matters where its dimension has more than one index.
inline bool bad_stride(int64_t stride, int64_t extent, int64_t elems16) {
  return extent > 1 && (stride % elems16) != 0;
}
}  // namespace detail

// Keys per K/V tile of the device code that runs on a device of compute capability `major`
// (0: unknown, taken as sm_90).
template <class Tile>
constexpr int fwd_block_n(int major) {
  return (major == 0 || major >= 9) ? Tile::kBlockN : Tile::kBlockNSm8x;
}

// The forward with the tile the generated translation unit names (flashgen/tiles.py chose it).
template <class Variant, class Element, int kHeadDim, class Tile, bool kPacked = false,
          bool kSparse = false>
int launch_fwd_tiled(const FgFwdArgs& a) {
  using K = FwdKernel<Variant, Element, kHeadDim, Tile, kPacked, kSparse>;
  using P = typename K::Params;
  // Reference every hook: the kernel skips keep() without a mask and score() without a score
  // mod, never calls the backward's dscore()/param_grad(), and a generated variant in an
  // anonymous namespace would otherwise draw "declared but never referenced" warnings for them.
  (void)&Variant::keep;
  (void)&Variant::score;
  (void)&Variant::tile_full;
  (void)&Variant::dscore;
  (void)&Variant::param_grad;
  (void)&Variant::param_grad_enabled;
  (void)Variant::kHasParamGrad;
  (void)Variant::kRowExact;
  detail::clear_error();
  if (a.head_dim != kHeadDim) {
    return detail::fail(FG_ERR_BAD_HEAD_DIM, "head_dim %lld differs from this kernel's %d",
                        (long long)a.head_dim, kHeadDim);
  }
  const int64_t kIntMax = 2147483647;
  if (a.batch < 0 || a.heads_q < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.batch > kIntMax ||
      a.heads_q > kIntMax || a.seqlen_q > FG_MAX_SEQLEN || a.seqlen_k > FG_MAX_SEQLEN) {
    return detail::fail(FG_ERR_BAD_SHAPE,
                        "sizes out of range: batch %lld, heads_q %lld, seqlen_q %lld, seqlen_k "
                        "%lld (each must be >= 0; batch and heads fit in int32, seqlens at most 2^30)",
                        (long long)a.batch, (long long)a.heads_q, (long long)a.seqlen_q,
                        (long long)a.seqlen_k);
  }
  if (a.heads_q > 0 && (a.heads_kv <= 0 || a.heads_q % a.heads_kv != 0)) {
    return detail::fail(FG_ERR_BAD_SHAPE, "heads_q %lld is not a multiple of heads_kv %lld",
                        (long long)a.heads_q, (long long)a.heads_kv);
  }
  // Packed (varlen) batches (args.h): per-sequence rows from cu_seqlens, batch strides unused.
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
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "cudaGetDevice", err);
  const int major = detail::device_major(dev);  // 0 if unknown
  // Block sparsity: the lists must be made for this kernel's tiles on this device.
  {
    const int st = detail::check_block_lists(
        a.kv_blocks, kSparse, "kv_blocks", (a.seqlen_q + K::kBlockM - 1) / K::kBlockM,
        (a.seqlen_k + fwd_block_n<Tile>(major) - 1) / fwd_block_n<Tile>(major), K::kBlockM,
        fwd_block_n<Tile>(major));
    if (st != FG_OK) return st;
  }
  if (a.batch == 0 || a.heads_q == 0 || a.seqlen_q == 0 || (packed && a.total_q == 0)) {
    return FG_OK;  // nothing to compute
  }

  const bool reads_kv = a.seqlen_k > 0 && (!packed || a.total_k > 0);
  if (!a.q || !a.out || (reads_kv && (!a.k || !a.v))) {
    return detail::fail(FG_ERR_BAD_SHAPE, "null q/k/v/out pointer");
  }
  constexpr int64_t kE16 = 16 / int64_t(sizeof(Element));  // elements per 16 bytes
  using detail::bad_stride;
  using detail::misaligned;
  const int64_t nb = packed ? 1 : a.batch;  // extents of the batch and row dims
  const int64_t rows_q = packed ? a.total_q : a.seqlen_q, rows_k = packed ? a.total_k : a.seqlen_k;
  const bool q_bad = misaligned(a.q) || bad_stride(a.q_stride_b, nb, kE16) ||
                     bad_stride(a.q_stride_h, a.heads_q, kE16) ||
                     bad_stride(a.q_stride_n, rows_q, kE16);
  const bool o_bad = misaligned(a.out) || bad_stride(a.o_stride_b, nb, kE16) ||
                     bad_stride(a.o_stride_h, a.heads_q, kE16) ||
                     bad_stride(a.o_stride_n, rows_q, kE16);
  const bool k_bad = reads_kv && (misaligned(a.k) || bad_stride(a.k_stride_b, nb, kE16) ||
                                  bad_stride(a.k_stride_h, a.heads_kv, kE16) ||
                                  bad_stride(a.k_stride_n, rows_k, kE16));
  const bool v_bad = reads_kv && (misaligned(a.v) || bad_stride(a.v_stride_b, nb, kE16) ||
                                  bad_stride(a.v_stride_h, a.heads_kv, kE16) ||
                                  bad_stride(a.v_stride_n, rows_k, kE16));
  const bool lse_bad = a.lse && (reinterpret_cast<uintptr_t>(a.lse) & 3u) != 0;
  if (q_bad || k_bad || v_bad || o_bad || lse_bad) {
    return detail::fail(FG_ERR_ALIGNMENT,
                        "%s: base pointers must be 16-byte aligned and batch/head/row strides "
                        "multiples of %lld elements (last dim contiguous)",
                        q_bad ? "q" : k_bad ? "k" : v_bad ? "v" : o_bad ? "out" : "lse",
                        (long long)kE16);
  }

  P p;
  memset(&p, 0, sizeof(p));
  p.q = static_cast<const Element*>(a.q);
  p.k = static_cast<const Element*>(reads_kv ? a.k : a.q);  // never read when seqlen_k == 0
  p.v = static_cast<const Element*>(reads_kv ? a.v : a.q);
  p.o = static_cast<Element*>(a.out);
  p.lse = a.lse;
  p.cu_q = packed ? a.cu_seqlens_q : nullptr;
  p.cu_k = packed ? a.cu_seqlens_k : nullptr;
  p.q_sb = packed ? 0 : a.q_stride_b, p.q_sh = a.q_stride_h, p.q_sn = a.q_stride_n;
  p.k_sb = packed ? 0 : a.k_stride_b, p.k_sh = a.k_stride_h, p.k_sn = a.k_stride_n;
  p.v_sb = packed ? 0 : a.v_stride_b, p.v_sh = a.v_stride_h, p.v_sn = a.v_stride_n;
  p.o_sb = packed ? 0 : a.o_stride_b, p.o_sh = a.o_stride_h, p.o_sn = a.o_stride_n;
  p.total_q = a.total_q;
  p.heads_q = int(a.heads_q);
  p.group = int(a.heads_q / a.heads_kv);
  p.seqlen_q = int(a.seqlen_q);
  p.seqlen_k = int(a.seqlen_k);
  p.num_m_tiles = int((a.seqlen_q + K::kBlockM - 1) / K::kBlockM);
  p.total_work = int64_t(p.num_m_tiles) * a.heads_q * a.batch;
  p.scale = a.scale;
  p.scale_log2 = a.scale * K::kLog2e;
  p.dropout.state = Variant::kHasDropout ? a.dropout_state : nullptr;
  p.dropout.threshold = a.dropout_threshold;
  p.dropout.scale = a.dropout_scale;
  p.blk = detail::block_lists(a.kv_blocks);
  if constexpr (!std::is_empty<typename K::VParams>::value) {
    if (a.params) memcpy(&p.vp, a.params, sizeof(p.vp));
  }

  // Raise the dynamic shared-memory limit once per (instantiation, device). Device code built
  // for sm_8x uses Tile::kBlockNSm8x, code for sm_90+ Tile::kBlockN; a device of compute
  // capability >= 9 may also run sm_8x code (PTX JIT), so it gets room for both.
  auto kernel = &fwd_kernel<K>;
  static std::atomic<uint64_t> configured{0};
  const int smem = (major == 0 || major >= 9) ? K::smem_bytes(K::kBlockNMax)
                                              : K::smem_bytes(Tile::kBlockNSm8x);
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit == 0 || !(configured.load(std::memory_order_acquire) & bit)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err == cudaSuccess) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 int(cudaSharedmemCarveoutMaxShared));
    }
    if (err != cudaSuccess) {
      cudaGetLastError();  // the failed attribute call must not poison the next launch check
      return detail::fail(FG_ERR_SMEM_ATTR,
                          "cannot raise dynamic shared memory to %d bytes on device %d: %s",
                          smem, dev, cudaGetErrorString(err));
    }
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }

  const int64_t kMaxGrid = FLASHGEN_FWD_MAX_GRID;
  const dim3 grid(unsigned(p.total_work < kMaxGrid ? p.total_work : kMaxGrid));
  kernel<<<grid, K::kThreads, smem, static_cast<cudaStream_t>(a.stream)>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "forward kernel launch", err);
  return FG_OK;
}

}  // namespace cuda
}  // namespace flashgen
