// flashgen CUDA forward mainloop (FlashAttention-2, Alg. 1, inner loop): owns the accumulators
// of one query tile (O, running max m and sum l; FwdMainloop::Accum), the shared-memory layout
// and the K/V pipeline of a work item (FwdMainloop::run), and one K/V tile of the online softmax
// (FwdMainloop::step: S = Q K^T, tile class and mask/score hooks, softmax with the O rescale,
// dropout on P, O += P V). It knows nothing of the grid (scheduler.cuh) or of how O and LSE are
// written (epilogue.cuh), so another kernel (a split-KV decode pass, say) can drive step() over
// its own key range. Algorithm, layouts and tile classes: see fwd.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "flashgen/cuda/dropout.cuh"
#include "flashgen/cuda/mainloop.cuh"
#include "flashgen/cuda/ptx.cuh"
#include "flashgen/cuda/scheduler.cuh"
#include "flashgen/variant.h"

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

// kBlockM query rows per CTA, kBlockN keys per K/V tile, kWarps warps; each warp owns
// kBlockM/kWarps rows (16 or 32: one or two m16 "atoms"). The warp's Q fragments are re-read
// from shared memory per K tile.
template <int kBlockM_, int kBlockN_, int kWarps_>
struct FwdTile {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = kBlockM / kWarps;
  static constexpr int kMAtoms = kWarpRows / 16;
  static_assert(kBlockM % kWarps == 0 && kWarpRows % 16 == 0, "each warp owns 16*k query rows");
  static_assert(kMAtoms == 1 || kMAtoms == 2, "a warp owns 16 or 32 query rows");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 16, "kBlockN must be a multiple of 16");
};

// The forward kernel's by-value argument (filled by launch_fwd_tiled, host.cuh's prelude).
template <class Element, class VParams>
struct FwdParams {
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

template <class Variant, class Element, int kHeadDim, class Tile, bool kSparse>
struct FwdMainloop {
  using Params = FwdParams<Element, typename Variant::Params>;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kWarpRows = Tile::kWarpRows;
  static constexpr int kMAtoms = Tile::kMAtoms;
  static constexpr int kD = HeadDim<kHeadDim>::kD;
  static constexpr int kPitch = HeadDim<kHeadDim>::kPitch;
  static constexpr int kStages = 2;
  static constexpr int kQElems = kBlockM * kPitch;
  static constexpr int kKVElems = kBlockN * kPitch;
  // Dynamic shared memory: Q tile, then the K ring, then the V ring (kStages tiles each).
  static constexpr int kSmem = (kQElems + 2 * kStages * kKVElems) * int(sizeof(Element));
  static constexpr int kNBlocks = kBlockN / 8;  // 8-key accumulator blocks of S per m-atom
  static constexpr int kDBlocks = kD / 8;       // 8-column accumulator blocks of O per m-atom
  static constexpr float kLog2e = 1.4426950408889634f;
  static constexpr int kNoMask = 0, kRowMask = 1, kElemMask = 2;

  // A warp's share of the query tile: O and each row's running max (log2 units) and sum.
  struct Accum {
    float o[kMAtoms][kDBlocks][4];
    float row_max[kMAtoms][2], row_sum[kMAtoms][2];
  };
  static __device__ __forceinline__ void init(Accum& acc) {
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int dn = 0; dn < kDBlocks; ++dn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc.o[ma][dn][e] = 0.f;
      }
      acc.row_max[ma][0] = acc.row_max[ma][1] = -INFINITY;
      acc.row_sum[ma][0] = acc.row_sum[ma][1] = 0.f;
    }
  }

  // The O rescale a deferred softmax_tile leaves for later (alpha per row; any: some row of the
  // warp moved its max, so O must be multiplied).
  struct Rescale {
    float alpha[kMAtoms][2];
    bool any;
  };
  static __device__ __forceinline__ void apply_rescale(const Rescale& r, float (&o)[kMAtoms][kDBlocks][4]) {
    if (r.any) {
#pragma unroll
      for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
        for (int dn = 0; dn < kDBlocks; ++dn) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[ma][dn][e] *= r.alpha[ma][e >> 1];
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
      load_rows<Element, kHeadDim, kThreads, kBlockN, false>(sK, k_g, p.k_sn, kv0, kv_begin,
                                                             kv_end, tid);
      load_rows<Element, kHeadDim, kThreads, kBlockN, false>(sV, v_g, p.v_sn, kv0, kv_begin,
                                                             kv_end, tid);
    } else {
      load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sK, k_g, p.k_sn, kv0, kv_begin,
                                                            kv_end, tid);
      load_rows<Element, kHeadDim, kThreads, kBlockN, true>(sV, v_g, p.v_sn, kv0, kv_begin,
                                                            kv_end, tid);
    }
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
  //
  // kDefer (the sm90 family, whose O is still being accumulated by an asynchronous PV GEMM of the
  // previous tile): O is not touched; the factors are left in *defer (any: some row moved its
  // max) for the caller to apply once that GEMM is done (apply_rescale).
  template <int kMask, bool kDefer = false>
  static __device__ __forceinline__ void softmax_tile(
      const Params& p, float (&s)[kMAtoms][kNBlocks][4], float (&row_max)[kMAtoms][2],
      float (&row_sum)[kMAtoms][2], float (&o)[kMAtoms][kDBlocks][4], int b, int h, int q_row0,
      int kv0, int kv_begin, int kv_end, int Nq, int Nk, int lane, Rescale* defer = nullptr) {
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
          if constexpr (kMask == kRowMask) {
            row_bounds<Variant>(p.vp, b, h, q, kv_begin, kv_end, Nq, Nk, lo, hi);
          }
#pragma unroll
          for (int j = 0; j < kNBlocks; ++j) {
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
              const int e = 2 * half + e1;
              float x = s[ma][j][e];
              const int kv = kv0 + j * 8 + 2 * t + e1;
              const bool vis =
                  kMask == kNoMask ||
                  (kMask == kRowMask
                       ? (kv >= lo && kv < hi)
                       : visible<Variant>(p.vp, b, h, q, kv, kv_begin, kv_end, Nq, Nk));
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
      if constexpr (kDefer) {
        defer->any = true;
#pragma unroll
        for (int ma = 0; ma < kMAtoms; ++ma) {
          defer->alpha[ma][0] = alpha[ma][0];
          defer->alpha[ma][1] = alpha[ma][1];
        }
      } else {
#pragma unroll
        for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
          for (int dn = 0; dn < kDBlocks; ++dn) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[ma][dn][e] *= alpha[ma][e >> 1];
          }
        }
      }
    } else {
      if constexpr (kDefer) defer->any = false;
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
  // 1 / (1 - p) is applied once, in the epilogue. One Philox call per eight elements: rows
  // {g, g + 8} x columns {2t, 2t + 1} of two adjacent 8-column blocks (dropout.cuh,
  // dropout_bits8). q_row0 and kv0 are multiples of 16.
  static __device__ __forceinline__ void apply_dropout(const Params& p,
                                                       float (&s)[kMAtoms][kNBlocks][4], int b,
                                                       int h, int q_row0, int kv0, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const DropoutKey key = dropout_key(p.dropout, int64_t(b) * p.heads_q + h);
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int jp = 0; jp < kNBlocks / 2; ++jp) {
        // Bit 4i + e: element e of block 2jp + i.
        const uint32_t bits = dropout_bits8(key, q_row0 + ma * 16 + g, kv0 + jp * 16 + 2 * t);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& x = s[ma][2 * jp + i][e];
            x = ((bits >> (4 * i + e)) & 1u) ? x : 0.f;
          }
        }
      }
    }
  }

  // The tile class of key tile [kv0, kv0 + kBlockN) for the query rows [q_lo, q_hi) (see fwd.cuh,
  // "Masking by tile class"), then softmax_tile with the mask that class needs. With a score mod,
  // rows past seqlen_q must not reach score(): a query tile cut by seqlen_q is partial.
  // listed_partial: a block list names this tile partial. q_row0: the warp's first query row.
  // Shared with the sm90 family's consumer warpgroups (sm90/fwd.cuh), which pass their own
  // 64-row share of the tile as [q_lo, q_hi).
  template <bool kDefer = false>
  static __device__ __forceinline__ void softmax_classed(const Params& p,
                                                         float (&s)[kMAtoms][kNBlocks][4],
                                                         Accum& acc, int b, int h, int q_lo,
                                                         int q_hi, int Nq, int Nk, int kv0,
                                                         int kv_begin, int kv_end,
                                                         bool listed_partial, int q_row0,
                                                         int lane, Rescale* defer = nullptr) {
    const bool q_partial = Variant::kHasScoreMod && (q_hi - q_lo < kBlockM);
    const bool need_mask =
        listed_partial || kv0 < kv_begin || kv0 + kBlockN > kv_end || q_partial ||
        (Variant::kHasMask && !(kSparse && p.blk.full_kept) &&
         !Variant::tile_full(p.vp, b, h, q_lo, q_hi, kv0, kv0 + kBlockN, Nq, Nk));
    if (!need_mask) {
      softmax_tile<kNoMask, kDefer>(p, s, acc.row_max, acc.row_sum, acc.o, b, h, q_row0, kv0,
                            kv_begin, kv_end, Nq, Nk, lane, defer);
    } else if constexpr (!Variant::kHasMask || Variant::kRowExact) {
      softmax_tile<kRowMask, kDefer>(p, s, acc.row_max, acc.row_sum, acc.o, b, h, q_row0, kv0,
                             kv_begin, kv_end, Nq, Nk, lane, defer);
    } else {
      softmax_tile<kElemMask, kDefer>(p, s, acc.row_max, acc.row_sum, acc.o, b, h, q_row0, kv0,
                              kv_begin, kv_end, Nq, Nk, lane, defer);
    }
  }

  // One K/V tile [kv0, kv0 + kBlockN) against the warp's query rows (K and V landed in sK_cur /
  // sV_cur): S = Q K^T, the tile class, softmax with the O rescale, dropout, O += P V. kSparse:
  // the tile is entry `it` of a list row whose first n_part entries are partial; a listed-partial
  // tile always takes the mask, a listed-full one skips keep() when the lists came from the
  // variant's own mask (BlockLists::full_kept). The tile class is derived here from the tile's
  // coordinates (not passed in), so that it folds to constants wherever the variant allows.
  static __device__ __forceinline__ void step(const Params& p, Accum& acc, uint32_t sQ_addr,
                                              uint32_t sK_cur, uint32_t sV_cur, uint32_t a_off,
                                              uint32_t k_off, int b, int h, int q_lo, int q_hi,
                                              int Nq, int Nk, int kv0, int kv_begin, int kv_end,
                                              int it, int n_part, int warp_row0,
                                              int lane) {
    constexpr int kE = int(sizeof(Element));
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
        ptx::ldmatrix_x4(a[ma], sQ_addr + ((warp_row0 + ma * 16) * kPitch + kk * 16) * kE + a_off);
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

    const bool listed_partial = kSparse && it < n_part;
    softmax_classed(p, s, acc, b, h, q_lo, q_hi, Nq, Nk, kv0, kv_begin, kv_end, listed_partial,
                    q_lo + warp_row0, lane);

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
          ptx::mma_16816<Element>(acc.o[ma][2 * dp], a[ma], bv[0], bv[1]);
          ptx::mma_16816<Element>(acc.o[ma][2 * dp + 1], a[ma], bv[2], bv[3]);
        }
      }
    }
  }

  // The key loop of one work item (query rows [q_lo, q_hi) of query head h, batch / sequence b;
  // q_g, k_g, v_g point at its sequence's first rows): the key tiles of [kv_begin, kv_end) from
  // the high end down, or (kSparse) the listed tiles of the item's row `blk` in list order,
  // through a 2-stage cp.async ring. At the top of iteration j one barrier publishes tile j
  // (issued during iteration j-1) and certifies that every warp is done with tile j-1; the
  // copies of tile j+1 are then issued into that freed stage and overlap both GEMMs of tile j.
  // tid, lane: the thread's; warp_row0: the warp's first row in the query tile.
  static __device__ __forceinline__ void run(const Params& p, Accum& acc, Element* smem, int b,
                                             int h, int m_tile, int q_lo, int q_hi, int Nq, int Nk,
                                             const Element* q_g, const Element* k_g,
                                             const Element* v_g, int kv_begin, int kv_end, int tid,
                                             int lane, int warp_row0) {
    constexpr int kE = int(sizeof(Element));

    const uint32_t sQ_addr = ptx::smem_addr(smem);
    const uint32_t sK_addr = sQ_addr + kQElems * kE;
    const uint32_t sV_addr = sK_addr + kStages * kKVElems * kE;
    // Per-lane ldmatrix byte offsets inside a 16x16 block (see the layout notes in fwd.cuh).
    const uint32_t a_off = (((lane & 7) + ((lane >> 3) & 1) * 8) * kPitch + (lane >> 4) * 8) * kE;
    const uint32_t k_off = (((lane & 7) + (lane >> 4) * 8) * kPitch + ((lane >> 3) & 1) * 8) * kE;

    int n_hi = 0, n_tiles = 0;
    BlockRow blk{nullptr, 0, 0};  // kSparse: the listed key tiles of this query tile
    if constexpr (kSparse) {
      blk = block_row(p.blk, b, h, m_tile);
      n_tiles = kv_end > kv_begin ? blk.n_all : 0;
    } else if (kv_end > kv_begin) {
      n_hi = (kv_end - 1) / kBlockN;
      n_tiles = n_hi - kv_begin / kBlockN + 1;
    }

    if (n_tiles > 0) {
      // Prologue: Q and the first K/V tile, one commit group.
      load_rows<Element, kHeadDim, kThreads, kBlockM, true>(sQ_addr, q_g, p.q_sn, q_lo, 0, Nq, tid);
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
        // Prefetch tile it+1 into the other stage; it overlaps both GEMMs of this tile.
        if (it + 1 < n_tiles) {
          const uint32_t stage = ((it + 1) & 1) * kKVElems * kE;
          load_kv(sK_addr + stage, sV_addr + stage, k_g, v_g, p,
                  kSparse ? __ldg(blk.idx + it + 1) * kBlockN : kv0 - kBlockN, kv_begin, kv_end,
                  tid);
          ptx::cp_async_commit();
        }
        step(p, acc, sQ_addr, sK_cur, sV_cur, a_off, k_off, b, h, q_lo, q_hi, Nq, Nk, kv0,
             kv_begin, kv_end, it, blk.n_part, warp_row0, lane);
      }
    }
  }
};

}  // namespace cuda
}  // namespace flashgen
