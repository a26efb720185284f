// flashgen CUDA epilogues: what a work item writes once its mainloop is done.
//
//   TileEpilogue  a warp's rows of fp32 mma accumulators -> Element through the warp's own rows of
//                 a shared staging buffer, then 16-byte stores to a [rows x d] output, rows past
//                 its end and padded columns skipped. Shared by the forward (O) and the
//                 deterministic dQ kernel (dQ), and by any kernel that ends on such a tile.
//   FwdEpilogue   O / l (times 1 / (1 - p) with dropout) and LSE = ln(2) * (m + log2(l)); rows
//                 that saw no key (l == 0) get exactly 0 by selection and LSE = -inf
//                 (FlashAttention-2, Alg. 1, lines 12-13); a NaN l (a NaN or +inf score at a
//                 kept key) gives out and LSE NaN (row_has_keys below).
//   DqEpilogue    dQ * scale of the deterministic dQ kernel (through TileEpilogue).
//   KVEpilogue    the backward main kernel's dK * scale and dV (FlashAttention-2, Alg. 2, line
//                 24): staged through the K/V tiles and stored, or, for a split GQA group, added
//                 into the fp32 workspaces.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "flashgen/cuda/mainloop.cuh"
#include "flashgen/cuda/ptx.cuh"
#include "flashgen/cuda/scheduler.cuh"

namespace flashgen {
namespace cuda {

// DESIGN.md's non-finite rule at the end of a row: the row is empty (out 0, LSE -inf) only when
// its sum l is exactly 0, i.e. every score it saw was -inf (masked). The softmax itself tests
// nothing per element: a NaN score passes exp2 as NaN, a +inf one becomes the row max and gives
// exp2(inf - inf) = NaN there, so l turns NaN, and a NaN l must be written as out = O / l and
// LSE = m + log2(l), both NaN (a training run that diverges sees NaN, not zeros). The test costs
// what the old one (l > 0, which wrote those rows as empty ones) did: one compare per row.
// FG_NONFINITE_LEGACY restores the old test; it exists for scripts/ab_nonfinite.py's A/B only.
__device__ __forceinline__ bool row_has_keys(float l) {
#ifdef FG_NONFINITE_LEGACY
  return l > 0.f;
#else
  return l != 0.f;
#endif
}

namespace bwd_detail {
// dst[0] += a, dst[1] += b in fp32 (dst 8-byte aligned); one vector reduction on sm_90.
__device__ __forceinline__ void atomic_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// threadIdx.x through volatile asm: the compiler re-reads it where it is used instead of keeping
// values derived from it live (or spilled) across the main loop.
__device__ __forceinline__ int tid_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(r));
  return int(r);
}
}  // namespace bwd_detail

template <class Element, int kHeadDim>
struct TileEpilogue {
  static constexpr int kD = HeadDim<kHeadDim>::kD;
  static constexpr int kPitch = HeadDim<kHeadDim>::kPitch;
  static constexpr int kChunksPerRow = HeadDim<kHeadDim>::kChunksPerRow;
  static constexpr int kDBlocks = kD / 8;

  // Row `row` of the staging buffer s (pitch kPitch) := Element(keep ? acc * mul : 0) for this
  // lane's columns dn * 8 + 2t, +1 of the C fragments acc[dn][2 * half], acc[dn][2 * half + 1].
  static __device__ __forceinline__ void stage_row(Element* s, int row,
                                                   const float (&acc)[kDBlocks][4], int half,
                                                   float mul, bool keep, int t) {
#pragma unroll
    for (int dn = 0; dn < kDBlocks; ++dn) {
      const float v0 = keep ? acc[dn][2 * half] * mul : 0.f;
      const float v1 = keep ? acc[dn][2 * half + 1] * mul : 0.f;
      *reinterpret_cast<uint32_t*>(s + row * kPitch + dn * 8 + 2 * t) = ptx::pack2<Element>(v0, v1);
    }
  }

  // Staged rows s_row0 + r (r < kRows) -> rows q0 + r of g (row stride stride_n) for
  // q0 + r < n_rows, one warp, 16-byte chunks; the padded columns past kHeadDim are not written.
  // stride_n is taken by reference to the Params field and read where it is used, so nvcc does
  // not fold the caller's row offset of g into every store's address (as before the split).
  template <int kRows>
  static __device__ __forceinline__ void store_rows(Element* g, const int64_t& stride_n, int q0,
                                                    int n_rows, const Element* s, int s_row0,
                                                    int lane) {
    constexpr int kOutChunks = kRows * kChunksPerRow;
#pragma unroll
    for (int i = 0; i < (kOutChunks + 31) / 32; ++i) {
      const int c = lane + i * 32;
      if (kOutChunks % 32 == 0 || c < kOutChunks) {
        const int r = c / kChunksPerRow;
        const int cc = c % kChunksPerRow;
        const int q = q0 + r;
        if (q < n_rows && (kD == kHeadDim || cc * 8 < kHeadDim)) {
          *reinterpret_cast<uint4*>(g + wide(q) * stride_n + cc * 8) =
              *reinterpret_cast<const uint4*>(s + (s_row0 + r) * kPitch + cc * 8);
        }
      }
    }
  }
};

// The forward's epilogue for one warp's kMAtoms m-atoms of the query tile at q_lo: normalise,
// stage the warp's own rows through its slice of sQ (no other warp reads those rows), write LSE,
// then O in 16-byte chunks. (b, h, q0) name the item again (the caller re-decodes it rather than
// keeping it live through the mainloop); Nq: the item's sequence length; lane, warp_row0: the
// thread's lane and its warp's first row in the tile.
template <class Variant, class Element, int kHeadDim, int kMAtoms, bool kPacked>
struct FwdEpilogue {
  using Store = TileEpilogue<Element, kHeadDim>;
  static constexpr int kDBlocks = Store::kDBlocks;
  static constexpr int kWarpRows = 16 * kMAtoms;
  static constexpr float kLn2 = 0.6931471805599453f;

  template <class Params>
  static __device__ __forceinline__ void run(const Params& p, const float (&o)[kMAtoms][kDBlocks][4],
                                             const float (&row_max)[kMAtoms][2],
                                             const float (&row_sum)[kMAtoms][2], Element* sQ,
                                             int b, int h, int q0, int q_lo, int Nq, int lane,
                                             int warp_row0) {
    const int g = lane >> 2, t = lane & 3;
    // The warp's last ldmatrix reads of its sQ rows come before any lane restages them (the
    // data dependence through mma.sync orders them in practice; this orders them for the
    // memory model and for racecheck, which reported the restaging as intra-warp WAR hazards).
    __syncwarp();
    float* lse_g = !p.lse ? nullptr
                   : kPacked ? p.lse + wide(h) * p.total_q + q0
                             : p.lse + (wide(b) * p.heads_q + h) * Nq;
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float l = row_sum[ma][half];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const bool has = row_has_keys(l);
        float inv = has ? 1.f / l : 0.f;
        if constexpr (Variant::kHasDropout) {
          if (p.dropout.state) inv *= p.dropout.scale;
        }
        const int row = warp_row0 + ma * 16 + g + half * 8;
        Store::stage_row(sQ, row, o[ma], half, inv, has, t);
        const int q = q_lo + row;
        if (lse_g && t == 0 && q < Nq) {
          lse_g[q] = has ? (row_max[ma][half] + ptx::log2_approx(l)) * kLn2 : -INFINITY;
        }
      }
    }
    __syncwarp();
    Element* o_g = p.o + wide(b) * p.o_sb + wide(h) * p.o_sh + wide(q0) * p.o_sn;
    Store::template store_rows<kWarpRows>(o_g, p.o_sn, q_lo + warp_row0, Nq, sQ, warp_row0, lane);
  }
};

// The deterministic dQ kernel's epilogue for one warp's 16 query rows of the tile at q_lo:
// dQ * scale, staged through the warp's own rows of sQ, then stored (the same tile store as the
// forward's O). (b, h): the item; Nq: its sequence length; lane, warp_row0 as in FwdEpilogue.
template <class Element, int kHeadDim>
struct DqEpilogue {
  using Store = TileEpilogue<Element, kHeadDim>;
  static constexpr int kDBlocks = Store::kDBlocks;

  template <class Params>
  static __device__ __forceinline__ void run(const Params& p, const float (&dq)[kDBlocks][4],
                                             Element* sQ, int b, int h, int q_lo, int Nq,
                                             int lane, int warp_row0) {
    const int g = lane >> 2, t = lane & 3;
    __syncwarp();
    const float sc = p.scale;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      Store::stage_row(sQ, warp_row0 + g + half * 8, dq, half, sc, true, t);
    }
    __syncwarp();
    Element* dq_g = p.dq + wide(b) * p.dq_sb + wide(h) * p.dq_sh;
    Store::template store_rows<16>(dq_g, p.dq_sn, q_lo + warp_row0, Nq, sQ, warp_row0, lane);
  }
};

// The backward main kernel's epilogue for its key tile [kv0, kv0 + kBlockN): Mainloop supplies
// the tile shape and shared-memory layout (bwd_mainloop.cuh), dk / dv the warp's accumulators
// (key rows warp_kv0 + {g, g + 8}, 16-column pairs wd, wd + kWarpsD, ...). Part of a split GQA
// group (num_splits > 1): fp32 atomics into dk_accum / dv_accum. Otherwise dK * scale and dV are
// staged through sK / sV and stored; the item is decoded again (iter) for the output pointers.
template <class Mainloop>
struct KVEpilogue {
  using Element = typename Mainloop::ElementT;
  static constexpr int kHeadDim = Mainloop::kHeadDimV;
  static constexpr int kD = Mainloop::kD, kPitch = Mainloop::kPitch;
  static constexpr int kChunksPerRow = Mainloop::kChunksPerRow;
  static constexpr int kPairsKV = Mainloop::kPairsKV, kWarpsD = Mainloop::kWarpsD;
  static constexpr int kDPairs = Mainloop::kDPairs;
  static constexpr int kBlockN = Mainloop::kBlockN, kThreads = Mainloop::kThreads;

  template <class Params>
  static __device__ __forceinline__ void run(const Params& p, float (&dk)[kPairsKV * 2][4],
                                             float (&dv)[kPairsKV * 2][4], unsigned char* smem,
                                             int b, int hkv, int kv0, int warp_kv0, int wd,
                                             int lane, int iter) {
    const int Nk = p.seqlen_k;
    const int g = lane >> 2, t = lane & 3;
    __syncthreads();  // every warp is done with sK / sV
    const float sc = p.scale;
    if (p.num_splits > 1) {
      // Part of a GQA group: add into the fp32 workspaces.
      const int64_t base = Mainloop::k_rows(p, b, hkv);
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
    Element* sKe = reinterpret_cast<Element*>(smem + Mainloop::kOffK);
    Element* sVe = reinterpret_cast<Element*>(smem + Mainloop::kOffV);
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
    const KTileScheduler::Item item_e =
        KTileScheduler::decode(p.num_n_tiles, p.num_splits, p.heads_kv, iter);
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
};

}  // namespace cuda
}  // namespace flashgen
