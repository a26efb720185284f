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
// kSparse instantiations take block lists (args.h, "Block sparsity"; made for the tiles the
// instantiation's config names): the main
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
//  4. GQA split (non-deterministic only): args.gqa_splits CTAs share the query heads of a group
//     (the host's choice, flashgen/families/sm80.py gqa_splits: more than 1 when key tiles × kv
//     heads × batch is at most half the multiprocessor count; it must be >= 1 and divide the
//     group, else FG_ERR_BAD_SHAPE) and add dK, dV into dk_accum/dv_accum (fp32 atomics);
//     bwd_convert_kernel then writes dk, dv. With 1 (and always in deterministic mode, or without
//     the dk/dv workspaces) one CTA loops over the whole group and writes dk/dv directly:
//     dk_accum/dv_accum are then unused.
//
// Query tiles that see a key tile are found generically with Variant::kv_lo/kv_hi, per query
// head (a mask may depend on b and h, and one K/V-major CTA serves all query heads of its GQA
// share): every lane of a warp tests q tiles lane, lane+32, ... of each head of the share and the
// warp reduces min/max, so the CTA walks [m_first, m_last] once per head and skips (with a
// uniform test on that head's range) any (head, tile) pair that cannot see the key tile. K/V rows
// are loaded for the union of the ranges. Without a mask the ranges are the whole key range for
// every head, and one scan serves all heads.
// Tile classification as in the forward: the per-element path (bounds + Variant::keep) runs
// only on tiles that cross that (head, query tile)'s [kv_lo, kv_hi), seqlen_k or seqlen_q, or
// where Variant::tile_full says the mask is partial; there, with kRowBounds (mainloop.cuh; no mask
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
//
// ---------------------------------------------------------------------------------------------
// Roles (as in fwd.cuh): BwdKernel = KTileScheduler x BwdMainloop x KVEpilogue, DqKernel =
// QTileScheduler x DqMainloop x DqEpilogue (scheduler.cuh, bwd_mainloop.cuh, epilogue.cuh; the
// dQ kernel's store is the forward's TileEpilogue); launch_bwd_tiled runs the host prelude
// (host.cuh), fills the three kernels' Params and launches the sequence above.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "flashgen/args.h"
#include "flashgen/cuda/bwd_mainloop.cuh"
#include "flashgen/cuda/dropout.cuh"
#include "flashgen/cuda/epilogue.cuh"
#include "flashgen/cuda/host.cuh"
#include "flashgen/cuda/ptx.cuh"
#include "flashgen/cuda/scheduler.cuh"
#include "flashgen/cuda/status.cuh"
#include "flashgen/variant.h"

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

// The tiles of an instantiation (BwdTile for the main kernel, DqTile for DqKernel;
// bwd_mainloop.cuh) are chosen in Python (flashgen/tiles.py, with the measurements behind its
// tables) and rendered into the generated translation unit, which calls launch_bwd_tiled with them.

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

  using Scheduler = KTileScheduler;
  using Mainloop = BwdMainloop<Variant, Element, kHeadDim, Tile, kComputeDq, kPacked, kSparse>;
  using Epilogue = KVEpilogue<Mainloop>;
  using Params = typename Mainloop::Params;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kWarpsD = Tile::kWarpsD;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSmem = Mainloop::kSmem;
  static constexpr int kPairsKV = Mainloop::kPairsKV;

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

  // One work item: key tile n_tile of (kv head hkv [, share split of its GQA group], batch b).
  static __device__ __forceinline__ void run_item(const Params& p, int iter, uint32_t smem_base,
                                                  unsigned char* smem) {
    const Scheduler::Item item = Scheduler::decode(p.num_n_tiles, p.num_splits, p.heads_kv, iter);
    const int b = item.b;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wd = warp % kWarpsD;
    const int warp_kv0 = (warp / kWarpsD) * 16;
    const int kv0 = item.n_tile * kBlockN;
    float dk[kPairsKV * 2][4], dv[kPairsKV * 2][4];
    Mainloop::run(p, dk, dv, smem_base, smem, b, item.hkv,
                  Scheduler::first_head(item, p.group, p.heads_per_split), item.n_tile, kv0,
                  warp_kv0, wd, warp, lane);
    Epilogue::run(p, dk, dv, smem, b, item.hkv, kv0, warp_kv0, wd, lane, iter);
  }

  static __device__ __forceinline__ void run(const Params& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t base = ptx::smem_addr(smem_raw);
    for (int iter = 0; int64_t(blockIdx.x) + int64_t(iter) * gridDim.x < p.total_work; ++iter) {
      if (iter > 0) __syncthreads();  // shared memory of the previous item is free
      if constexpr (kPacked) {
        // Key tiles are counted up to max_seqlen_k: one past its sequence's keys has nothing
        // to write (keys no query sees still get their zeros from the items that hold them).
        const Scheduler::Item item = Scheduler::decode(p.num_n_tiles, p.num_splits, p.heads_kv, iter);
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
  using Scheduler = QTileScheduler;
  using Mainloop = DqMainloop<Variant, Element, kHeadDim, Tile, kPacked, kSparse>;
  using Epilogue = DqEpilogue<Element, kHeadDim>;
  using Params = typename Mainloop::Params;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSmem = Mainloop::kSmem;
  static constexpr int kDBlocks = Mainloop::kDBlocks;

  // One work item: query tile m_tile of (batch b, query head h).
  static __device__ __forceinline__ void run_item(const Params& p, int iter, Element* smem) {
    const Scheduler::Item item = Scheduler::decode(p.num_m_tiles, p.heads_q, iter);
    const int m_tile = item.m_tile, h = item.h, b = item.b;
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
    float dq[kDBlocks][4];
    Mainloop::run(p, dq, smem, b, h, m_tile, q_lo, q_hi, Nq, Nk, q_g, do_g, k_g, v_g, kv_begin,
                  kv_end);
    const int lane = threadIdx.x & 31;
    Epilogue::run(p, dq, smem, b, h, q_lo, Nq, lane, (threadIdx.x >> 5) * 16);
  }

  static __device__ __forceinline__ void run(const Params& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Element* smem = reinterpret_cast<Element*>(smem_raw);
    for (int iter = 0; int64_t(blockIdx.x) + int64_t(iter) * gridDim.x < p.total_work; ++iter) {
      if (iter > 0) __syncthreads();
      if constexpr (kPacked) {
        // As run_item numbers items; a query tile past its sequence's end has no rows.
        const Scheduler::Item item = Scheduler::decode(p.num_m_tiles, p.heads_q, iter);
        const SeqSpan sp = seq_span(p.cu_q, p.cu_k, item.b, p.seqlen_q, p.seqlen_k);
        if (item.m_tile * kBlockM >= sp.len_q) continue;
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

// dk, dv in the input dtype from the fp32 workspaces dk_accum, dv_accum of a split GQA group
// (they already hold scale * dS^T Q and P^T dO): one bwd_convert_kernel launch each, on [nb,
// heads_kv, rows_k] rows. Shared by this family's launcher and the sm90 backward's.
template <class Element, int kHeadDim>
int convert_kv_workspaces(const FgBwdArgs& a, int64_t nb, int64_t rows_k, bool packed, int64_t grid_cap,
                          cudaStream_t stream) {
  for (int which = 0; which < 2; ++which) {
    BwdConvertParams<Element> cp;
    cp.src = which == 0 ? a.dk_accum : a.dv_accum;
    cp.dst = static_cast<Element*>(which == 0 ? a.dk : a.dv);
    cp.rows = nb * a.heads_kv * rows_k;
    cp.heads = int(a.heads_kv);
    cp.seqlen = int(rows_k);
    detail::set_strides(cp.sb, cp.sh, cp.sn, which == 0 ? a.dk_stride_b : a.dv_stride_b,
                        which == 0 ? a.dk_stride_h : a.dv_stride_h, which == 0 ? a.dk_stride_n : a.dv_stride_n,
                        packed);
    cp.mul = 1.f;
    const int64_t blocks = (cp.rows * (kHeadDim / 8) + 255) / 256;
    bwd_convert_kernel<Element, kHeadDim><<<detail::grid_for(blocks, grid_cap), 256, 0, stream>>>(cp);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "dk/dv convert launch", err);
  }
  return FG_OK;
}

// The backward with the tiles the generated translation unit names (flashgen/tiles.py chose them).
template <class Variant, class Element, int kHeadDim, class Tile, class DqTileT,
          bool kPacked = false, bool kSparse = false>
int launch_bwd_tiled(const FgBwdArgs& a) {
  using KA = BwdKernel<Variant, Element, kHeadDim, Tile, true, kPacked, kSparse>;  // dQ atomics
  using KD = BwdKernel<Variant, Element, kHeadDim, Tile, false, kPacked, kSparse>;  // determ.
  using KQ = DqKernel<Variant, Element, kHeadDim, DqTileT, kPacked, kSparse>;
  detail::reference_hooks<Variant>();
  detail::clear_error();
  // Packed (varlen) batches (args.h): per-sequence rows from cu_seqlens, batch strides unused,
  // the fp32 per-row buffers [H, total]; the element-wise kernels treat them as one batch of
  // total rows.
  int st = detail::check_sizes(a, kHeadDim, kPacked, true);
  if (st != FG_OK) return st;
  const bool packed = a.cu_seqlens_q != nullptr;
  // Block sparsity: q lists for the main kernel's tiles, kv lists for DqKernel's.
  st = detail::check_tile_lists(a.q_blocks, kSparse, "q_blocks", a.seqlen_k, a.seqlen_q,
                                KA::kBlockN, KA::kBlockM);
  if (st == FG_OK) {
    st = detail::check_tile_lists(a.kv_blocks, kSparse, "kv_blocks", a.seqlen_q, a.seqlen_k,
                                  KQ::kBlockM, KQ::kBlockN);
  }
  int pair_share = 0;
  if (st == FG_OK) st = detail::dropout_share_env<Variant>(pair_share);
  if (st != FG_OK) return st;
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
  using detail::misaligned;
  using detail::misaligned4;
  auto bad_q = [&](const void* ptr, int64_t sb, int64_t sh, int64_t sn) {
    return has_q && detail::bad_tensor(ptr, sb, sh, sn, nb, a.heads_q, rows_q, kE16);
  };
  auto bad_k = [&](const void* ptr, int64_t sb, int64_t sh, int64_t sn) {
    return has_k && detail::bad_tensor(ptr, sb, sh, sn, nb, a.heads_kv, rows_k, kE16);
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
  else if (has_q && (misaligned4(a.lse) || misaligned4(a.softmax_d) || misaligned4(a.dlse)))
    bad = "lse/softmax_d/dlse";
  else if (has_q && !det && misaligned(a.dq_accum)) bad = "dq_accum";
  if (bad) return detail::fail_alignment(bad, kE16);

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
    const int optin = detail::max_smem_optin(dev);
    if (optin > 0 && KA::kSmem > optin) det = true;
  }
  const int64_t kMaxGrid = FLASHGEN_BWD_MAX_GRID;
  const int64_t kElemGrid = int64_t(num_sms) * 16 < kMaxGrid ? int64_t(num_sms) * 16 : kMaxGrid;

  // GQA split: the host's (args.gqa_splits), taken on the non-deterministic path with the dk/dv
  // workspaces only.
  const int num_n_tiles = has_k ? int((a.seqlen_k + KA::kBlockN - 1) / KA::kBlockN) : 0;
  if (a.gqa_splits < 1 || group % a.gqa_splits != 0) {
    return detail::fail(FG_ERR_BAD_SHAPE,
                        "gqa_splits %d: must be >= 1 and divide the GQA group (heads_q / heads_kv "
                        "= %d)", (int)a.gqa_splits, group);
  }
  int splits = 1;
  if (!det && has_q && has_k && group > 1 && a.dk_accum && a.dv_accum &&
      !misaligned(a.dk_accum) && !misaligned(a.dv_accum)) {
    splits = a.gqa_splits;
  }

  // 1. D = rowsum(dout ∘ out); zero the workspaces this call accumulates into.
  if (has_q) {
    BwdPreParams<Element> pp;
    memset(&pp, 0, sizeof(pp));
    pp.o = static_cast<const Element*>(a.out);
    pp.dout = static_cast<const Element*>(a.dout);
    detail::set_strides(pp.o_sb, pp.o_sh, pp.o_sn, a.o_stride_b, a.o_stride_h, a.o_stride_n, packed);
    detail::set_strides(pp.do_sb, pp.do_sh, pp.do_sn, a.do_stride_b, a.do_stride_h, a.do_stride_n,
                        packed);
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
        <<<detail::grid_for(blocks, kElemGrid), 256, 0, stream>>>(pp);
    err = cudaGetLastError();
    if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "backward preprocess launch", err);
  }

  // 2. Main kernel: dK, dV (and dQ atomics when not deterministic).
  if (has_k) {
    auto launch_main = [&](auto kernel, auto tag) -> int {
      using K = typename decltype(tag)::type;
      static std::atomic<uint64_t> configured{0};
      const int st = detail::ensure_smem(kernel, K::kSmem, configured, dev, "backward kernel");
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
      detail::set_strides(p.q_sb, p.q_sh, p.q_sn, a.q_stride_b, a.q_stride_h, a.q_stride_n, packed);
      detail::set_strides(p.k_sb, p.k_sh, p.k_sn, a.k_stride_b, a.k_stride_h, a.k_stride_n, packed);
      detail::set_strides(p.v_sb, p.v_sh, p.v_sn, a.v_stride_b, a.v_stride_h, a.v_stride_n, packed);
      detail::set_strides(p.do_sb, p.do_sh, p.do_sn, a.do_stride_b, a.do_stride_h, a.do_stride_n,
                          packed);
      detail::set_strides(p.dk_sb, p.dk_sh, p.dk_sn, a.dk_stride_b, a.dk_stride_h, a.dk_stride_n,
                          packed);
      detail::set_strides(p.dv_sb, p.dv_sh, p.dv_sn, a.dv_stride_b, a.dv_stride_h, a.dv_stride_n,
                          packed);
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
      detail::fill_common<Variant>(p, a, a.q_blocks);
      p.dropout_pair_share = pair_share;
      kernel<<<detail::grid_for(p.total_work, kMaxGrid), K::kThreads, K::kSmem, stream>>>(p);
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
      const int st = detail::ensure_smem(kernel, KQ::kSmem, configured, dev,
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
      detail::set_strides(p.q_sb, p.q_sh, p.q_sn, a.q_stride_b, a.q_stride_h, a.q_stride_n, packed);
      detail::set_strides(p.k_sb, p.k_sh, p.k_sn, a.k_stride_b, a.k_stride_h, a.k_stride_n, packed);
      detail::set_strides(p.v_sb, p.v_sh, p.v_sn, a.v_stride_b, a.v_stride_h, a.v_stride_n, packed);
      detail::set_strides(p.do_sb, p.do_sh, p.do_sn, a.do_stride_b, a.do_stride_h, a.do_stride_n,
                          packed);
      detail::set_strides(p.dq_sb, p.dq_sh, p.dq_sn, a.dq_stride_b, a.dq_stride_h, a.dq_stride_n,
                          packed);
      p.heads_q = Hq;
      p.group = group;
      p.seqlen_q = Nq;
      p.seqlen_k = Nk;
      p.num_m_tiles = int((a.seqlen_q + KQ::kBlockM - 1) / KQ::kBlockM);
      p.total_work = int64_t(p.num_m_tiles) * Hq * a.batch;
      detail::fill_common<Variant>(p, a, a.kv_blocks);
      kernel<<<detail::grid_for(p.total_work, kMaxGrid), KQ::kThreads, KQ::kSmem, stream>>>(p);
      err = cudaGetLastError();
      if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "dq kernel launch", err);
    } else {
      BwdConvertParams<Element> cp;
      cp.src = a.dq_accum;
      cp.dst = static_cast<Element*>(a.dq);
      cp.rows = nb * a.heads_q * rows_q;
      cp.heads = Hq;
      cp.seqlen = int(rows_q);
      detail::set_strides(cp.sb, cp.sh, cp.sn, a.dq_stride_b, a.dq_stride_h, a.dq_stride_n, packed);
      cp.mul = a.scale;
      const int64_t blocks = (cp.rows * (kHeadDim / 8) + 255) / 256;
      bwd_convert_kernel<Element, kHeadDim>
          <<<detail::grid_for(blocks, kElemGrid), 256, 0, stream>>>(cp);
      err = cudaGetLastError();
      if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "dq convert launch", err);
    }
  }

  // 4. dk, dv from the workspaces when the GQA group was split.
  if (splits > 1) return convert_kv_workspaces<Element, kHeadDim>(a, nb, rows_k, packed, kElemGrid, stream);
  return FG_OK;
}

}  // namespace cuda
}  // namespace flashgen
