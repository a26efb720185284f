// flashgen CUDA backward mainloops (FlashAttention-2, Alg. 2, inner loops; the launch sequence,
// the tile classes and the layouts are described in bwd.cuh):
//
//   BwdMainloop  the main kernel's work for one key tile: which (query head, query tile) pairs
//                see it (a warp-parallel scan), the walk over them with the Q / dO / LSE / D
//                pipeline (run), and one step of it (step: S^T = K Q^T, dP^T = V dO^T, P^T and
//                dS^T with the mask, score-mod and dropout hooks, dV += P^T dO, dK += dS^T Q, and
//                in the non-deterministic mode dQ += dS K into dq_accum with fp32 atomics).
//                Owns the dK / dV accumulators' layout and the kernel's shared-memory layout.
//   DqMainloop   the deterministic dQ kernel's work for one query tile: the K/V pipeline (run)
//                and one key tile of it (step: S, dP, dS, dQ += dS K in registers).
//
// Neither knows the grid (scheduler.cuh) or writes the item's outputs (epilogue.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <limits.h>
#include <stdint.h>

#include <type_traits>

#include "flashgen/cuda/dropout.cuh"
#include "flashgen/cuda/epilogue.cuh"
#include "flashgen/cuda/mainloop.cuh"
#include "flashgen/cuda/ptx.cuh"
#include "flashgen/cuda/scheduler.cuh"
#include "flashgen/variant.h"

namespace flashgen {
namespace cuda {

namespace bwd_detail {

// 4-byte async copy (zero-filled when pred is false), for the per-row LSE and D vectors whose
// rows are not 16-byte aligned in general.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(pred ? 4 : 0)
               : "memory");
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

}  // namespace bwd_detail

// Tile configurations.

// Main kernel: kWarps warps; warp w owns the 16 keys of slab w / kWarpsD and the head-dim
// 16-column pairs p ≡ w % kWarpsD (mod kWarpsD) of dK/dV (kWarpsD = 2 splits the dK/dV
// accumulators of large head dims over two warps, which then both compute the slab's S^T and
// dP^T). kBlockN = 16 * kWarps / kWarpsD keys per CTA; kBlockM query rows per inner step. In the
// dQ = dS K GEMM the warps form a kWarpsMdq x (kWarps / kWarpsMdq) grid over (q rows, d pairs).
// In the non-deterministic mode the dQ GEMM + atomics of a step run right after it, behind a
// second barrier, from one dS^T buffer; every CTA walks from its first visible query tile.
template <int kBlockM_, int kWarps_, int kWarpsD_, int kWarpsMdq_>
struct BwdTile {
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

// The main kernel's by-value argument (filled by launch_bwd_tiled).
template <class Element, class VParams>
struct BwdParams {
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
  int dropout_pair_share;  // dropout_bits_kv_pair (FLASHGEN_DROPOUT_BWD_SHARE, default 1; host.cuh)
  BlockLists blk;       // kSparse: q lists, a row per key tile (args.h)
  VParams vp;
};

// The deterministic dQ kernel's by-value argument.
template <class Element, class VParams>
struct DqParams {
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

template <class Variant, class Element, int kHeadDim, class Tile, bool kComputeDq, bool kPacked,
          bool kSparse>
struct BwdMainloop {
  using Params = BwdParams<Element, typename Variant::Params>;
  using ElementT = Element;
  static constexpr int kHeadDimV = kHeadDim;
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
  // Shared memory (bytes): K, V tiles; Q and dO rings (2 stages); dS^T (none in the
  // deterministic mode); LSE, D rings.
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kBlockN * kPitch * kE;
  static constexpr int kOffQ = kOffV + kBlockN * kPitch * kE;
  static constexpr int kStageQ = kBlockM * kPitch * kE;
  static constexpr int kOffDO = kOffQ + 2 * kStageQ;
  static constexpr int kOffS = kOffDO + 2 * kStageQ;
  static constexpr int kSBufs = kComputeDq ? 1 : 0;  // dS^T buffers
  static constexpr int kSBuf = kBlockN * kPitchS * kE;
  static constexpr int kOffL = kOffS + kSBufs * kSBuf;
  static constexpr int kOffDs = kOffL + 2 * kBlockM * 4;
  static constexpr int kSmem = kOffDs + 2 * kBlockM * 4;
  static constexpr float kLog2e = 1.4426950408889634f;


  // First row of (batch b, query head h) in the per-row fp32 buffers (lse, dsum, dq_accum
  // rows) and of (b, kv head hkv) in dk_accum / dv_accum: padded [B, H, N] rows; packed
  // [H, total] rows, offset by the sequence's start (already added to the pointers, localize).
  static __device__ __forceinline__ int64_t q_rows(const Params& p, int b, int h) {
    return kPacked ? wide(h) * p.total_q : (wide(b) * p.heads_q + h) * int64_t(p.seqlen_q);
  }
  static __device__ __forceinline__ int64_t k_rows(const Params& p, int b, int hkv) {
    return kPacked ? wide(hkv) * p.total_k : (wide(b) * p.heads_kv + hkv) * int64_t(p.seqlen_k);
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
  // for each the query tiles m_first, ..., m_last, minus the (head, tile) pairs that cannot see
  // key tile kv0 (the walk wraps around from m_last to m_first; a wrap back to m_first moves on
  // to the next head). gi == n_heads: the walk is over. Without a mask every head sees the same
  // tiles (all keys), and m_first is one of them.
  static __device__ __forceinline__ void next_step(const Params& p, int b, int h0, int n_heads,
                                                   int m_first, int m_last, int kv0, int& gi,
                                                   int& m) {
    if constexpr (Variant::kHasMask) {
      do {
        m = m == m_last ? m_first : m + 1;
        if (m == m_first) ++gi;
      } while (gi < n_heads && !sees(kv_range(p, b, h0 + gi, m), kv0));
    } else {
      do {
        m = m == m_last ? m_first : m + 1;
      } while (m != m_first && !sees(kv_range(p, b, h0, m), kv0));
      if (m == m_first) ++gi;
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
      load_rows<Element, kHeadDim, kThreads, kBlockM, false>(sQ, q_g, p.q_sn, q_lo, 0,
                                                                          Nq, tid);
      load_rows<Element, kHeadDim, kThreads, kBlockM, false>(sdO, do_g, p.do_sn, q_lo,
                                                                          0, Nq, tid);
    } else {
      load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sQ, q_g, p.q_sn, q_lo, 0,
                                                                         Nq, tid);
      load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sdO, do_g, p.do_sn, q_lo,
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
    // here rows are keys: keep[jp][e0] holds kv {g, g + 8} x q {c, c + 8} of m-blocks 2jp,
    // 2jp + 1, c = 2t + e0, from the group (c, kv & ~1) and the half g & 1 selects:
    // dropout_bits_kv, one Philox call per four elements as before the 8-element groups).
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
        if (p.dropout_pair_share) {  // warp-uniform
#pragma unroll
          for (int jp = 0; jp < kMBlocks / 2; ++jp) dropout_bits_kv_pair(key, q_lo + jp * 16 + 2 * t, kv_row0 + g, keep[jp]);
        } else {
#pragma unroll
          for (int jp = 0; jp < kMBlocks / 2; ++jp) {
#pragma unroll
            for (int e0 = 0; e0 < 2; ++e0) {
              keep[jp][e0] = dropout_bits_kv(key, q_lo + jp * 16 + 2 * t + e0, kv_row0 + g);
            }
          }
        }
      }
    }
    constexpr bool kBounds = kMasked && kRowBounds<Variant>;
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
          row_bounds<Variant>(p.vp, b, h, q_lo + j * 8 + 2 * t + e1, r.begin, r.end,
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
              vis = visible<Variant>(p.vp, b, h, q, kv, r.begin, r.end, p.seqlen_q,
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
                vis = visible<Variant>(p.vp, b, h, q, kv, r.begin, r.end,
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

  // The walk of one work item, key tile n_tile (keys [kv0, kv0 + kBlockN)) of kv head hkv, batch
  // / sequence b, over the query heads h0, h0 + 1, ... of its share of the GQA group. Which
  // (query head, query tile) pairs see this key tile (warp-parallel scan, every warp does it):
  // lane l tests the query tiles l, l + 32, ... of every head of the CTA's share (a mask may
  // depend on the query head; without one all heads see every key), and the warp reduces the
  // span [m_first, m_last] of tiles that some head needs and the union [vis_lo, vis_hi) of their
  // key ranges. K and V of the tile stay in shared memory; the Q / dO / LSE / D tiles of the
  // steps stream through a 2-stage ring. dk / dv: the warp's accumulators (zeroed here).
  static __device__ __forceinline__ void run(const Params& p, float (&dk)[kPairsKV * 2][4],
                                             float (&dv)[kPairsKV * 2][4], uint32_t smem_base,
                                             unsigned char* smem, int b, int hkv, int h0,
                                             int n_tile, int kv0, int warp_kv0, int wd, int warp,
                                             int lane) {
    const int tid = threadIdx.x;
    const int scan_heads = Variant::kHasMask ? p.heads_per_split : 1;
    int m_first = INT_MAX, m_last = -1, vis_lo = INT_MAX, vis_hi = 0;
    for (int m = lane; m < p.num_m_tiles; m += 32) {
      for (int gi = 0; gi < scan_heads; ++gi) {
        const Range r = kv_range(p, b, h0 + gi, m);
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

#pragma unroll
    for (int i = 0; i < kPairsKV * 2; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
    }

    const int n_heads = p.heads_per_split;
    const uint32_t sK = smem_base + kOffK;
    const uint32_t sV = smem_base + kOffV;
    // kSparse: the first listed (head, query tile) pair that sees this key tile, if any.
    int gi = 0, m = m_first, idx = -1;
    bool partial = false;
    if constexpr (kSparse) {
      if (m_first <= m_last) next_listed(p, b, h0, n_heads, n_tile, kv0, gi, idx, m, partial);
    }

    if (kSparse ? gi < n_heads && m_first <= m_last : m_first <= m_last) {
      const Element* k_g = p.k + wide(b) * p.k_sb + wide(hkv) * p.k_sh;
      const Element* v_g = p.v + wide(b) * p.v_sb + wide(hkv) * p.v_sh;
      load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sK, k_g, p.k_sn, kv0, vis_lo, vis_hi,
                                                            tid);
      load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sV, v_g, p.v_sn, kv0, vis_lo, vis_hi,
                                                            tid);
      // The walk (next_step) wraps around [m_first, m_last]; its first step is the first visible
      // (head, tile) pair from (h0, m_first) on, which exists because some head of the share
      // sees this key tile. (Without a mask m_first itself is visible.)
      if constexpr (!kSparse) {
        if constexpr (Variant::kHasMask) {
          if (!sees(kv_range(p, b, h0, m), kv0)) {
            next_step(p, b, h0, n_heads, m_first, m_last, kv0, gi, m);
          }
        }
      }
      load_q_tile(p, smem_base, 0, b, h0 + gi, m, tid);
      ptx::cp_async_commit();

      for (int it = 0;; ++it) {
        const int stage = it & 1;
        ptx::cp_async_wait<0>();
        __syncthreads();
        // Next (head, query tile) of this CTA; its copies overlap all GEMMs of this step.
        int gi_n = gi, m_n = m, idx_n = idx;
        bool partial_n = false;
        if constexpr (kSparse) {
          next_listed(p, b, h0, n_heads, n_tile, kv0, gi_n, idx_n, m_n, partial_n);
        } else {
          next_step(p, b, h0, n_heads, m_first, m_last, kv0, gi_n, m_n);
        }
        if (gi_n < n_heads) {
          load_q_tile(p, smem_base, stage ^ 1, b, h0 + gi_n, m_n, tid);
          ptx::cp_async_commit();
        }
        step(p, smem_base, smem, stage, b, h0 + gi, m, kv0, warp_kv0, wd, warp, lane, dk, dv,
             partial);
        if (gi_n >= n_heads) break;
        gi = gi_n;
        m = m_n;
        idx = idx_n;
        partial = partial_n;
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
    const uint32_t off_a = lane_off_a(lane, kPitch, kE);
    const uint32_t off_b = lane_off_b(lane, kPitch, kE);

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
          Element* row_g = sdS + (warp_kv0 + g) * kPitchS + u * 16 + 2 * t;
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

    if constexpr (kComputeDq) {
      __syncthreads();  // dS^T of every warp is in sdS
      dq_step(p, smem_base, b, h, m, warp, lane);
    }
  }

  // dQ_partial = dS K for query tile m of head h (dS^T in sdS) added to dq_accum.
  static __device__ __forceinline__ void dq_step(const Params& p, uint32_t smem_base, int b,
                                                 int h, int m, int warp, int lane) {
    {
      const int Nq = p.seqlen_q;
      const int q_lo = m * kBlockM;
      const int g = lane >> 2, t = lane & 3;
      const uint32_t sK = smem_base + kOffK;
      const uint32_t off_a = lane_off_a(lane, kPitch, kE);
      const int wm = warp / kWarpsDdq, wq = warp % kWarpsDdq;
      const int row0 = wm * kQAtomsDq * 16;
      const uint32_t sS = smem_base + kOffS;
      const uint32_t off_s = lane_off_b(lane, kPitchS, kE);
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
};

template <class Variant, class Element, int kHeadDim, class Tile, bool kPacked, bool kSparse>
struct DqMainloop {
  using Params = DqParams<Element, typename Variant::Params>;
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

  static __device__ __forceinline__ void load_kv(const Params& p, uint32_t sK, uint32_t sV,
                                                 const Element* k_g, const Element* v_g, int kv0,
                                                 int kv_begin, int kv_end, int tid) {
    if (kv0 >= kv_begin && kv0 + kBlockN <= kv_end) {
      load_rows<Element, kHeadDim, kThreads, kBlockN, false>(sK, k_g, p.k_sn, kv0,
                                                                          kv_begin, kv_end, tid);
      load_rows<Element, kHeadDim, kThreads, kBlockN, false>(sV, v_g, p.v_sn, kv0,
                                                                          kv_begin, kv_end, tid);
    } else {
      load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sK, k_g, p.k_sn, kv0,
                                                                         kv_begin, kv_end, tid);
      load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sV, v_g, p.v_sn, kv0,
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
    // keep[jp] bit 4i + e is element e of block 2jp + i, one Philox call per eight elements,
    // dropout_bits8); see BwdKernel::probs_grads.
    [[maybe_unused]] uint32_t keep[kNBlocks / 2] = {};
    [[maybe_unused]] bool drop = false;
    if constexpr (Variant::kHasDropout) {
      drop = p.dropout.state != nullptr;
      if (drop) {
        const DropoutKey key = dropout_key(p.dropout, int64_t(b) * p.heads_q + h);
#pragma unroll
        for (int jp = 0; jp < kNBlocks / 2; ++jp) {
          keep[jp] = dropout_bits8(key, q_row0 + g, kv0 + jp * 16 + 2 * t);
        }
      }
    }
    // Rows q_row0 + g and q_row0 + g + 8: their key bounds once (kRowBounds; see row_bounds).
    constexpr bool kBounds = kMasked && kRowBounds<Variant>;
    [[maybe_unused]] int lo[2] = {0, 0}, hi[2] = {0, 0};
    if constexpr (kBounds) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_bounds<Variant>(p.vp, b, h, q_row0 + g + r * 8, kv_begin, kv_end,
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
          vis = visible<Variant>(p.vp, b, h, q, kv, kv_begin, kv_end, p.seqlen_q,
                                             p.seqlen_k);
        }
        float dpe = dp[j][e];
        if constexpr (Variant::kHasDropout) {
          const bool kept = !drop || ((keep[j >> 1] >> (4 * (j & 1) + e)) & 1u);
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

  // One key tile [kv0, kv0 + kBlockN) (K and V landed in sK / sV) against the warp's 16 query
  // rows: S = Q K^T, dP = dO V^T, the tile class (kSparse: entry `it` of a list row whose first
  // n_part entries are partial; those take the mask), dS with the hooks, dQ += dS K. l2 / dd: the
  // rows' LSE (log2 units) and D.
  static __device__ __forceinline__ void step(const Params& p, float (&dq)[kDBlocks][4],
                                              uint32_t sQ, uint32_t sdO, uint32_t sK, uint32_t sV,
                                              uint32_t off_a, uint32_t off_b, const float (&l2)[2],
                                              const float (&dd)[2], int b, int h, int q_lo,
                                              int q_hi, int Nq, int Nk, int kv0, int kv_begin,
                                              int kv_end, int it, int n_part, int warp_row0,
                                              int lane) {
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
        (kSparse && it < n_part) || kv0 < kv_begin || kv0 + kBlockN > kv_end ||
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

  // The key loop of one work item (query rows [q_lo, q_hi) of query head h, batch / sequence b;
  // q_g, do_g, k_g, v_g point at its first rows): Q and dO stay in shared memory, the key tiles
  // of [kv_begin, kv_end) (from the high end down; kSparse: the listed ones) stream through a
  // 2-stage K/V ring as in the forward. dq: the warp's accumulator (zeroed here).
  static __device__ __forceinline__ void run(const Params& p, float (&dq)[kDBlocks][4],
                                             Element* smem, int b, int h, int m_tile, int q_lo,
                                             int q_hi, int Nq, int Nk, const Element* q_g,
                                             const Element* do_g, const Element* k_g,
                                             const Element* v_g, int kv_begin, int kv_end) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int warp_row0 = warp * 16;

    const uint32_t sQ = ptx::smem_addr(smem);
    const uint32_t sdO = sQ + kQElems * kE;
    const uint32_t sK0 = sdO + kQElems * kE;
    const uint32_t sV0 = sK0 + 2 * kKVElems * kE;
    const uint32_t off_a = lane_off_a(lane, kPitch, kE);
    const uint32_t off_b = lane_off_b(lane, kPitch, kE);

    int n_hi = 0, n_tiles = 0;
    BlockRow blk{nullptr, 0, 0};  // kSparse: the listed key tiles of this query tile
    if constexpr (kSparse) {
      blk = block_row(p.blk, b, h, m_tile);
      n_tiles = kv_end > kv_begin ? blk.n_all : 0;
    } else if (kv_end > kv_begin) {
      n_hi = (kv_end - 1) / kBlockN;
      n_tiles = n_hi - kv_begin / kBlockN + 1;
    }

#pragma unroll
    for (int i = 0; i < kDBlocks; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[i][e] = 0.f;
    }
    if (n_tiles > 0) {
      load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sQ, q_g, p.q_sn, q_lo, 0, Nq, tid);
      load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sdO, do_g, p.do_sn, q_lo, 0, Nq, tid);
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

        step(p, dq, sQ, sdO, sK, sV, off_a, off_b, l2, dd, b, h, q_lo, q_hi, Nq, Nk, kv0, kv_begin,
             kv_end, it, blk.n_part, warp_row0, lane);
      }
    }
  }
};

}  // namespace cuda
}  // namespace flashgen
