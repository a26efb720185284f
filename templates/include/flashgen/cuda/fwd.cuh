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
//   load Q tile (kept on chip in shared memory, its fragments re-read per K tile)
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
//   (non-finite scores, DESIGN.md: nothing is tested per element; a NaN score or a +inf one
//    (exp2(inf - inf)) makes l NaN, and only l == 0 is an empty row, so out and LSE are NaN)
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
//
// ---------------------------------------------------------------------------------------------
// Roles (as FlashAttention-3 composes Mainloop x Epilogue x Scheduler): FwdKernel only glues
//   QTileScheduler (scheduler.cuh)   the persistent grid loop and the work-item decoding;
//   FwdMainloop (fwd_mainloop.cuh)   the accumulators, the K/V pipeline and one K/V tile step;
//   FwdEpilogue (epilogue.cuh)       O / l and LSE, through the TileEpilogue the dQ kernel uses;
//   launch_fwd_tiled                 the host prelude (host.cuh), Params, the launch.
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
#include "flashgen/cuda/epilogue.cuh"
#include "flashgen/cuda/fwd_mainloop.cuh"
#include "flashgen/cuda/host.cuh"
#include "flashgen/cuda/ptx.cuh"
#include "flashgen/cuda/scheduler.cuh"
#include "flashgen/cuda/status.cuh"
#include "flashgen/variant.h"

// Upper bound on gridDim.x; CTAs loop over the remaining work items (tests lower it to exercise
// that loop).
#ifndef FLASHGEN_FWD_MAX_GRID
#define FLASHGEN_FWD_MAX_GRID 2147483647
#endif

namespace flashgen {
namespace cuda {

// The tile of an instantiation (FwdTile, fwd_mainloop.cuh) is chosen in Python
// (flashgen/tiles.py: per-arch tables of measured configurations, tiles derived from the
// device's shared memory, tuned winners) and rendered into the generated translation unit, which
// calls launch_fwd_tiled with it.

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

  using Scheduler = QTileScheduler;
  using Mainloop = FwdMainloop<Variant, Element, kHeadDim, Tile, kSparse>;
  using Epilogue = FwdEpilogue<Variant, Element, kHeadDim, Tile::kMAtoms, kPacked>;
  using Params = typename Mainloop::Params;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kMinBlocks = kThreads <= 128 ? 2 : 1;
  static constexpr int kSmem = Mainloop::kSmem;

  // One work item: query tile m_tile of (batch b, query head h). The epilogue gets the item
  // decoded again rather than b and h kept live through the main loop (register pressure).
  static __device__ __forceinline__ void run_item(const Params& p, int iter, Element* smem) {
    const Scheduler::Item item = Scheduler::decode(p.num_m_tiles, p.heads_q, iter);
    const int b = item.b, h = item.h, m_tile = item.m_tile;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp_row0 = (tid >> 5) * Tile::kWarpRows;
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

    typename Mainloop::Accum acc;
    Mainloop::init(acc);
    Mainloop::run(p, acc, smem, b, h, m_tile, q_lo, q_hi, Nq, Nk, q_g, k_g, v_g, kv_begin, kv_end,
                  tid, lane, warp_row0);

    const Scheduler::Item item_e = Scheduler::decode(p.num_m_tiles, p.heads_q, iter);
    const SeqSpan sp_e = kPacked ? seq_span(p.cu_q, p.cu_k, item_e.b, p.seqlen_q, p.seqlen_k)
                                 : SeqSpan{0, 0, p.seqlen_q, p.seqlen_k};
    Epilogue::run(p, acc.o, acc.row_max, acc.row_sum, smem, item_e.b, item_e.h, sp_e.q0, q_lo, Nq,
                  lane, warp_row0);
  }

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

// The host prelude of a forward launch, shared by every forward kernel family (this file's and
// sm90/fwd.cuh): the size, packed-metadata, block-list, pointer and alignment checks, then the
// kernel's by-value Params p (a FwdParams, fwd_mainloop.cuh) for query tiles of kBlockM rows and
// key tiles of kBlockN keys. Returns an FgStatus; sets `empty` when there is nothing to compute
// (FG_OK and no launch), `dev` to the current device.
template <class Variant, class Element, int kHeadDim, bool kPacked, bool kSparse, int kBlockM,
          int kBlockN, class P>
int fwd_prelude(const FgFwdArgs& a, P& p, int& dev, bool& empty) {
  detail::reference_hooks<Variant>();
  detail::clear_error();
  empty = false;
  int st = detail::check_sizes(a, kHeadDim, kPacked, false);
  if (st != FG_OK) return st;
  if (a.kv_cache.seqlens != nullptr) {  // args.h, FgKvCache: no CUDA decode kernels yet
    return detail::fail(FG_ERR_BAD_SHAPE, "kv_cache: this forward kernel takes no KV cache "
                                          "(kv_cache.seqlens must be null)");
  }
  const bool packed = a.cu_seqlens_q != nullptr;
  dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "cudaGetDevice", err);
  // Block sparsity: the lists must be made for this kernel's tiles.
  st = detail::check_tile_lists(a.kv_blocks, kSparse, "kv_blocks", a.seqlen_q, a.seqlen_k,
                                kBlockM, kBlockN);
  if (st != FG_OK) return st;
  if (a.batch == 0 || a.heads_q == 0 || a.seqlen_q == 0 || (packed && a.total_q == 0)) {
    empty = true;  // nothing to compute
    return FG_OK;
  }

  const bool reads_kv = a.seqlen_k > 0 && (!packed || a.total_k > 0);
  if (!a.q || !a.out || (reads_kv && (!a.k || !a.v))) {
    return detail::fail(FG_ERR_BAD_SHAPE, "null q/k/v/out pointer");
  }
  constexpr int64_t kE16 = 16 / int64_t(sizeof(Element));  // elements per 16 bytes
  const int64_t nb = packed ? 1 : a.batch;  // extents of the batch and row dims
  const int64_t rows_q = packed ? a.total_q : a.seqlen_q, rows_k = packed ? a.total_k : a.seqlen_k;
  using detail::bad_tensor;
  const bool q_bad = bad_tensor(a.q, a.q_stride_b, a.q_stride_h, a.q_stride_n, nb, a.heads_q, rows_q, kE16);
  const bool o_bad =
      bad_tensor(a.out, a.o_stride_b, a.o_stride_h, a.o_stride_n, nb, a.heads_q, rows_q, kE16);
  const bool k_bad = reads_kv && bad_tensor(a.k, a.k_stride_b, a.k_stride_h, a.k_stride_n, nb,
                                            a.heads_kv, rows_k, kE16);
  const bool v_bad = reads_kv && bad_tensor(a.v, a.v_stride_b, a.v_stride_h, a.v_stride_n, nb,
                                            a.heads_kv, rows_k, kE16);
  const bool lse_bad = a.lse && detail::misaligned4(a.lse);
  if (q_bad || k_bad || v_bad || o_bad || lse_bad) {
    return detail::fail_alignment(q_bad ? "q" : k_bad ? "k" : v_bad ? "v" : o_bad ? "out" : "lse",
                                  kE16);
  }

  memset(&p, 0, sizeof(p));
  p.q = static_cast<const Element*>(a.q);
  p.k = static_cast<const Element*>(reads_kv ? a.k : a.q);  // never read when seqlen_k == 0
  p.v = static_cast<const Element*>(reads_kv ? a.v : a.q);
  p.o = static_cast<Element*>(a.out);
  p.lse = a.lse;
  p.cu_q = packed ? a.cu_seqlens_q : nullptr;
  p.cu_k = packed ? a.cu_seqlens_k : nullptr;
  detail::set_strides(p.q_sb, p.q_sh, p.q_sn, a.q_stride_b, a.q_stride_h, a.q_stride_n, packed);
  detail::set_strides(p.k_sb, p.k_sh, p.k_sn, a.k_stride_b, a.k_stride_h, a.k_stride_n, packed);
  detail::set_strides(p.v_sb, p.v_sh, p.v_sn, a.v_stride_b, a.v_stride_h, a.v_stride_n, packed);
  detail::set_strides(p.o_sb, p.o_sh, p.o_sn, a.o_stride_b, a.o_stride_h, a.o_stride_n, packed);
  p.total_q = a.total_q;
  p.heads_q = int(a.heads_q);
  p.group = int(a.heads_q / a.heads_kv);
  p.seqlen_q = int(a.seqlen_q);
  p.seqlen_k = int(a.seqlen_k);
  p.num_m_tiles = int((a.seqlen_q + kBlockM - 1) / kBlockM);
  p.total_work = int64_t(p.num_m_tiles) * a.heads_q * a.batch;
  detail::fill_common<Variant>(p, a, a.kv_blocks);
  return FG_OK;
}

// The forward with the tile the generated translation unit names (flashgen/tiles.py chose it).
template <class Variant, class Element, int kHeadDim, class Tile, bool kPacked = false,
          bool kSparse = false>
int launch_fwd_tiled(const FgFwdArgs& a) {
  using K = FwdKernel<Variant, Element, kHeadDim, Tile, kPacked, kSparse>;
  using P = typename K::Params;
  P p;
  int dev = 0;
  bool empty = false;
  int st = fwd_prelude<Variant, Element, kHeadDim, kPacked, kSparse, K::kBlockM, K::kBlockN>(
      a, p, dev, empty);
  if (st != FG_OK || empty) return st;

  // Raise the dynamic shared-memory limit once per (instantiation, device).
  auto kernel = &fwd_kernel<K>;
  static std::atomic<uint64_t> configured{0};
  st = detail::ensure_smem(kernel, K::kSmem, configured, dev, "forward kernel");
  if (st != FG_OK) return st;

  kernel<<<detail::grid_for(p.total_work, FLASHGEN_FWD_MAX_GRID), K::kThreads, K::kSmem,
           static_cast<cudaStream_t>(a.stream)>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "forward kernel launch", err);
  return FG_OK;
}

}  // namespace cuda
}  // namespace flashgen
