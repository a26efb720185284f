// flashgen sm90 backward: the Hopper family's attention backward (FlashAttention-3's anatomy,
// Shah et al. 2024, arXiv 2407.08608, Sec. 3 and App. B), specialised by a generated Variant
// (flashgen/variant.h): every spec (mask and score hooks, parameters and their gradients,
// dropout regenerated from the forward's Philox stream), GQA/MQA, head dims
// 64 and 128, fp16/bf16, padded or packed, dense or block lists, deterministic or not
// (flashgen/families/sm90.py declares exactly these calls; block lists with the deterministic
// mode and other head dims run on the sm80 family).
//
//   template <class Variant, class Element /* __half | __nv_bfloat16 */, int kHeadDim /* 64 | 128 */,
//             class Tile /* Sm90BwdTile */>
//   int flashgen::sm90::launch_bwd(const FgBwdArgs& args);   // FgStatus; no host sync
//
// ---------------------------------------------------------------------------------------------
// Launch sequence (all on args.stream):
//  1. the sm80 family's bwd_preprocess_kernel (cuda/bwd.cuh): D = rowsum(dO ∘ O) − dlse in fp32
//     into softmax_d, dq_accum (and with a GQA split dk_accum, dv_accum) zero-filled;
//  2. Sm90Bwd (below), one item per (key tile of 128 keys, GQA split, kv head, batch), each
//     CTA looping over its items (a persistent grid of one CTA per multiprocessor, or one CTA
//     per item: ``work_of``), an item walking the query tiles of every query head of its share
//     of the kv head's group: dK, dV of its
//     keys summed over those heads in registers and written directly (or, with the group split
//     over args.gqa_splits CTAs, added into dk_accum / dv_accum), dQ partials added to dq_accum
//     by the dQ writer warp's TMA tensor reduce-adds (the default) or, under
//     FLASHGEN_SM90_BWD_DQ=atomic, the consumers' fp32 atomics (the defaults: kBwdDefault* and
//     bwd_default_lpt below);
//  3. the sm80 family's bwd_convert_kernel: dq = scale · dq_accum in the input dtype (and dk, dv
//     from their workspaces when the group was split).
//
// CTA: three warpgroups (384 threads), one CTA per multiprocessor.
//   warpgroup 0, the producer: warp 0 loads K and V of the key tile once (TMA, then zero-fills
//     the tile's rows that no query of the walk sees, as the forward does for V), then for each
//     query tile of the walk Q and dO by TMA and LSE and D by plain loads into a kStages-deep
//     ring (mbarriers "full" / "empty"). Warp 1, the dQ writer: for each query tile's dQ block
//     the consumers staged in shared memory (fp32, 128-byte swizzled boxes of 64 rows x 32
//     columns), lane 0 adds it into dq_accum by TMA tensor reduce-adds (cp.reduce.async.bulk
//     .tensor add.f32, each element atomically; FlashAttention-3's dQ writer) and releases the
//     staging once the copies have read it (mbarriers "dq_full" / "dq_empty"; a DqSlot in shared
//     memory says where). The warpgroup gives its registers away (setmaxnreg).
//   warpgroups 1 and 2, the consumers: 64 keys each (wgmma M = 64 rows are keys). Per query tile
//     of kBlockM rows:
//       S^T = K Q^T, dP^T = V dO^T        wgmma, both operands in shared memory
//       P^T, dS^T                         the sm80 family's BwdMainloop::probs_grads (tile classes,
//                                         mask hooks, LSE = -inf rows; one implementation of the
//                                         semantics), per warp on the same C-fragment layout
//       dV += P^T dO, dK += dS^T Q        wgmma with A (P^T, dS^T) from registers
//       dS -> shared memory               stmatrix.trans into [q][kv] rows, 128-byte swizzle
//       dQ_part = dS K                    wgmma from shared memory; each warpgroup one 64 x 64
//                                         block of the query tile's dQ (d 128: a column half,
//                                         over all 128 keys; d 64: the whole tile over its own
//                                         64 keys, in a staging buffer of its own), staged for
//                                         the writer; without the writer
//                                         (FLASHGEN_SM90_BWD_DQ=atomic, read per launch), and for
//                                         a packed sequence's partial last query tile (whose rows
//                                         past the sequence are the next sequence's), added by
//                                         red.global.add.v2.f32 instead.
//     then releases the stage. The dS buffer is double-buffered; one named barrier per step
//     between the consumer warpgroups orders its writes before the dQ GEMM's reads and the
//     GEMM's reads before the next-but-one step's writes.
//   Epilogue: dK · scale and dV in the input dtype, from registers (rows past seqlen_k skipped).
// The walk: for each query head of the share in order, the query tiles m in [m_first, m_last]
// that can see the key tile (Variant::kv_lo / kv_hi per tile, a warp-parallel scan that producer
// and consumers compute alike; the sm80 mainloop's next_step), from the first visible pair on.
// A key tile no query sees writes dK = dV = 0. Score hooks, masks, parameter gradients and
// dropout act in the sm80 mainloop's probs_grads on the S^T / dP^T fragments.
// Rows past seqlen_q arrive as zeros (TMA) with LSE = -inf, so P = dS = 0 there; such tiles take
// the masked path (q_hi - q_lo < kBlockM) and their dQ rows are not added.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "flashgen/args.h"
#include "flashgen/cuda/bwd.cuh"
#include "flashgen/cuda/host.cuh"
#include "flashgen/cuda/status.cuh"
#include "flashgen/sm90/ptx.cuh"
#include "flashgen/sm90/tma.cuh"
#include "flashgen/sm90/wgmma.cuh"
#include "flashgen/variant.h"

namespace flashgen {
namespace sm90 {

namespace ptx {
// Four 8x8 b16 matrices from registers to shared memory, each stored transposed: lane l gives
// the address of row l % 8 of matrix l / 8 (16 bytes: the 8 elements of one column of the
// register fragment, whose thread t holds row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
#if defined(FG_SM90A)
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#endif
}
// The deterministic mode's semaphore: an acquire load and a release store at GPU scope.
__device__ __forceinline__ int ld_acquire_gpu(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int32_t* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
}  // namespace ptx

// kBlockM query rows per step (64 at d 64 and 128; 128 at d 64 builds but ptxas spills there:
// S^T and dP^T take 64 fp32 each beside dK and dV); each consumer holds S^T, dP^T (kBlockM / 2
// fp32 each), dK, dV (d / 2 each) and a 64 x 64 dQ block; kBlockN = 128
// keys per CTA (two consumer warpgroups of 64); kStages Q/dO stages.
template <int kBlockM_, int kStages_ = 2>
struct Sm90BwdTile {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kBlockM == 64 || kBlockM == 128, "kBlockM: 64 or 128 query rows");
  static_assert(kStages >= 2 && kStages <= 3, "2 or 3 Q/dO stages");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "register file");
};

template <class Element, class VParams>
struct Sm90BwdParams {  // 64-byte aligned through CUtensorMap
  CUtensorMap tq, tk, tv, tdo;  // TMA descriptors (sm90/tma.cuh)
  cuda::BwdParams<Element, VParams> base;  // everything the sm80 backward's Params hold
  // The deterministic mode (args.dq_semaphore; null otherwise): int32 per query row, laid out
  // as lse, zeros at launch (the host allocates them per call); the entry of a query tile's first row counts the
  // key tiles that have added their dQ partials to that tile.
  int32_t* sem;
  // dQ partials: 1 = the dQ writer warp's tensor reduce-adds through tdq (shared-memory staging),
  // 0 = the consumers' own fp32 atomics (FLASHGEN_SM90_BWD_DQ=atomic, a diagnostic switch).
  CUtensorMap tdq;
  int dq_writer;
  // The order of the CTAs' items in blockIdx: 0 = key tile fastest (the CTAs running at once
  // share a head's Q and dO in L2); 1 = key tile slowest (every head's first key tiles first:
  // with causal masks the longest walks start first; the default for deterministic calls of
  // specs with a mask). FLASHGEN_SM90_BWD_ORDER=tile | lpt.
  int lpt;
  // The bare path's split waits (P during dP^T's GEMM, dS during dV's): 1, or 0 under
  // FLASHGEN_SM90_BWD_SPLIT=0 (a diagnostic switch for A/B timing).
  int split_waits;
};

template <class Variant, class Element, int kHeadDim, class Tile, bool kPacked = false, bool kSparse = false>
struct Sm90Bwd {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the sm90 backward (stage a) takes head_dim 64 and 128");
  static constexpr int kD = kHeadDim;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kPanels = kD / 64;         // 64-column panels of a tile (one TMA box each)
  static constexpr int kKPanel = kBlockN * 128;   // bytes
  static constexpr int kKBytes = kPanels * kKPanel;
  static constexpr int kQPanel = kBlockM * 128;
  static constexpr int kQBytes = kPanels * kQPanel;  // one Q or dO stage
  static constexpr int kSPanel = kBlockM * 128;      // dS [q][kv]: 64 keys per panel
  static constexpr int kSBytes = (kBlockN / 64) * kSPanel;
  // Shared memory (from a 1024-byte aligned base): K, V, the Q and dO rings, two dS buffers, the
  // LSE and D rings (fp32), the mbarriers.
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKBytes;
  static constexpr int kOffQ = kOffV + kKBytes;
  static constexpr int kOffDO = kOffQ + kStages * kQBytes;
  static constexpr int kOffS = kOffDO + kStages * kQBytes;
  // dQ staging for the writer warp: the query tile's dQ in fp32 boxes of 64 rows x 32 columns
  // (128-byte swizzle; box (rb, cb) at (rb * kD / 32 + cb) * 8 KB), one buffer, or at d 64 with
  // 64-row tiles (kDqKeySplit) one per consumer warpgroup.
  static constexpr int kDqBufs = (kBlockM == 64 && kD == 64) ? 2 : 1;
  static constexpr int kDqBuf = kBlockM * kD * 4;
  static constexpr int kOffDQ = kOffS + 2 * kSBytes;
  static constexpr int kOffL = kOffDQ + kDqBufs * kDqBuf;
  static constexpr int kOffDs = kOffL + kStages * kBlockM * 4;
  static constexpr int kOffBar = kOffDs + kStages * kBlockM * 4;
  // full_kv, kv_ready, full[S], empty[S], q_tail, dq_full, dq_empty, kv_empty
  static constexpr int kNumBars = 6 + 2 * kStages;
  static constexpr int kOffSlot = kOffBar + 8 * kNumBars;  // the dQ writer's step (DqSlot)
  static constexpr int kSmem = kOffSlot + 32 + 1024;        // + alignment slack
  static constexpr int kConsumerWarps = 4 * Tile::kConsumers;
  // A consumer's dQ block (64 x 64): rows [kDqRows wg, + 64) and columns [kDqCols wg, + 64) of
  // the query tile's dQ, over all 128 keys; or (kDqKeySplit: d 64 with 64-row query tiles) the
  // whole 64 x 64 tile over the warpgroup's own 64 keys, both warpgroups adding their partials.
  static constexpr bool kDqKeySplit = kBlockM == 64 && kD == 64;
  static constexpr int kDqRows = kBlockM == 128 ? 64 : 0;
  static constexpr int kDqCols = kBlockM == 128 || kDqKeySplit ? 0 : 64;
  static_assert(kDqKeySplit || kBlockM * kD == 128 * 64, "dQ blocks: 64 x 64 per consumer warpgroup");

  // The sm80 family's backward mainloop at these tiles (8 warps x 16 keys = 128 keys, kBlockM
  // queries per step): its key ranges and P^T / dS^T (probs_grads) on the C-fragment layout
  // that each consumer warp's wgmma accumulators share.
  using Base = cuda::BwdMainloop<Variant, Element, kHeadDim, cuda::BwdTile<kBlockM, 8, 1, kBlockM / 32>, true,
                                 kPacked, kSparse>;
  static_assert(Base::kBlockN == kBlockN && Base::kBlockM == kBlockM, "tiles");
  using BaseParams = cuda::BwdParams<Element, typename Variant::Params>;
  using Params = Sm90BwdParams<Element, typename Variant::Params>;
  using Range = typename Base::Range;
  using MmaS = Wgmma<Element, kBlockM>;  // S^T, dP^T: 64 keys x kBlockM queries
  using MmaKV = Wgmma<Element, kD>;      // dK, dV: 64 keys x d
  using MmaQ = Wgmma<Element, 64>;       // dQ block: 64 x 64

  struct Bars {
    uint32_t base;
    __device__ uint32_t full_kv() const { return base; }
    __device__ uint32_t kv_ready() const { return base + 8; }
    __device__ uint32_t full(int s) const { return base + 16 + 8 * s; }
    __device__ uint32_t empty(int s) const { return base + 16 + 8 * (kStages + s); }
    // kPacked: the TMA copy of a sequence's last, partial query tile lands here first (the
    // producer then zeroes the rows past the sequence before it releases the stage).
    __device__ uint32_t q_tail() const { return base + 16 + 16 * kStages; }
    // The dQ staging: full when every consumer thread has written its part (256 arrivals),
    // empty when the writer's reduce-adds have read it (1 arrival).
    __device__ uint32_t dq_full() const { return base + 24 + 16 * kStages; }
    __device__ uint32_t dq_empty() const { return base + 32 + 16 * kStages; }
    // K and V of an item are read (every consumer thread arrives after its item's last GEMM): the
    // producer may load the next item's.
    __device__ uint32_t kv_empty() const { return base + 40 + 16 * kStages; }
  };
  // What the roles count across the items of a persistent CTA (each role its own copy): Q/dO
  // stages consumed (cnt), packed tail copies (tails), K/V tiles loaded (kvn), dQ blocks staged
  // for the writer (dcnt). Barrier phases follow from them.
  struct Counters {
    uint32_t cnt = 0, tails = 0, kvn = 0, dcnt = 0;
  };

  // What the dQ writer adds where, written by the first consumer thread with each staged block
  // (and read by the writer after the full barrier): the block's first row in the tensor map's
  // rows, its head and batch coordinates; deterministic: the query tile's semaphore and this key
  // tile's rank; done: the walk is over (nothing staged).
  struct DqSlot {
    int32_t* sem;
    int row, h, b, rank, done;
  };

  // Packed batches: the Params of sequence sp as if it were a padded batch of its own lengths
  // (the per-row buffers and the outputs moved to its first rows; the tensor maps see the whole
  // packed tensor, so TMA rows are offset by sp.q0 / sp.k0 instead).
  static __device__ __forceinline__ BaseParams localize(const BaseParams& p, const cuda::SeqSpan& sp) {
    BaseParams lp = p;
    lp.seqlen_q = sp.len_q;
    lp.seqlen_k = sp.len_k;
    lp.num_m_tiles = (sp.len_q + kBlockM - 1) / kBlockM;
    lp.dk += cuda::wide(sp.k0) * p.dk_sn;
    lp.dv += cuda::wide(sp.k0) * p.dv_sn;
    lp.lse += sp.q0;
    lp.dsum += sp.q0;
    if (p.dq_accum) lp.dq_accum += cuda::wide(sp.q0) * kHeadDim;
    if (p.dk_accum) lp.dk_accum += cuda::wide(sp.k0) * kHeadDim;
    if (p.dv_accum) lp.dv_accum += cuda::wide(sp.k0) * kHeadDim;
    return lp;
  }

  // The work item of this CTA: key tile fastest (P.lpt: slowest), then the GQA split, then kv
  // head, then batch. Its query heads: h0, h0 + 1, ..., h0 + n_heads - 1 (the split's share of
  // the kv head's group). Either order dispatches a key tile's CTA after those of the lower key
  // tiles of its (batch, kv head), which the deterministic mode's semaphores wait on.
  struct Item {
    int b, hkv, h0, n_heads, n_tile, kv0;
  };
  static __device__ __forceinline__ Item item(const Params& P, const BaseParams& p, int w) {
    Item it;
    if (P.lpt) {
      const int rest = int(P.base.total_work / P.base.num_n_tiles);  // splits x kv heads x batch
      it.n_tile = int(w / rest);
      w %= rest;
    } else {
      it.n_tile = int(w % p.num_n_tiles);
      w /= p.num_n_tiles;
    }
    const int split = int(w % p.num_splits);
    w /= p.num_splits;
    it.hkv = int(w % p.heads_kv);
    it.b = int(w / p.heads_kv);
    it.n_heads = p.heads_per_split;
    it.h0 = it.hkv * p.group + split * it.n_heads;
    it.kv0 = it.n_tile * kBlockN;
    return it;
  }

  // The tile scheduler: a CTA runs the work indices of its column of rounds of gridDim.x items,
  // CTAs in reverse order in odd rounds (the forward's serpentine, sm90/fwd.cuh ``work_of``). A
  // grid of total_work CTAs (one item each, the hardware's dispatch order) or a persistent one of
  // one CTA per multiprocessor (the launch's choice: FLASHGEN_SM90_BWD_PERSIST), where the
  // producer loads the next item's K and V while the consumers write the previous item's dK, dV.
  // (32-bit: the host launches only total_work <= 2^30, so every index of a CTA's rounds up to
  // the first past total_work, at most total_work + gridDim.x - 1 < 2^31, fits.)
  static __device__ __forceinline__ int work_of(int iter) {
    const int g = int(cuda::ptx::nctaid_x()), c = int(cuda::ptx::ctaid_x());
    return iter * g + ((iter & 1) ? g - 1 - c : c);
  }
  // f(p, sp, w) for each of the CTA's items, in order, with the item's Params (packed: localized
  // to its sequence; a key tile past its sequence's keys is skipped by every role alike).
  template <class F>
  static __device__ __forceinline__ void for_each_item(const Params& P, F&& f) {
    for (int iter = 0;; ++iter) {
      const int w = work_of(iter);
      if (w >= P.base.total_work || w < 0) break;
      if constexpr (kPacked) {
        const Item it = item(P, P.base, w);
        const cuda::SeqSpan sp = cuda::seq_span(P.base.cu_q, P.base.cu_k, it.b, P.base.seqlen_q, P.base.seqlen_k);
        if (it.kv0 >= sp.len_k) continue;
        f(localize(P.base, sp), sp, w);
      } else {
        f(P.base, cuda::SeqSpan{0, 0, P.base.seqlen_q, P.base.seqlen_k}, w);
      }
    }
  }

  // The (query head, query tile) pairs that see key tile kv0 (every warp computes it alike; a
  // mask may depend on the head, so with one every head of the share is scanned): the span
  // [m_first, m_last] of tiles some head needs (m_first > m_last: none) and the union [vis_lo,
  // vis_hi) of their key ranges.
  struct Walk {
    int m_first, m_last, vis_lo, vis_hi;
  };
  static __device__ __forceinline__ Walk scan(const BaseParams& p, const Item& it, int lane) {
    const int scan_heads = Variant::kHasMask ? it.n_heads : 1;
    int m_first = INT_MAX, m_last = -1, vis_lo = INT_MAX, vis_hi = 0;
    for (int m = lane; m < p.num_m_tiles; m += 32) {
      for (int gi = 0; gi < scan_heads; ++gi) {
        const Range r = Base::kv_range(p, it.b, it.h0 + gi, m);
        if (Base::sees(r, it.kv0)) {
          m_first = imin(m_first, m);
          m_last = imax(m_last, m);
          vis_lo = imin(vis_lo, r.begin);
          vis_hi = imax(vis_hi, r.end);
        }
      }
    }
    Walk w;
    w.m_first = __reduce_min_sync(0xffffffffu, m_first);
    w.m_last = __reduce_max_sync(0xffffffffu, m_last);
    w.vis_lo = __reduce_min_sync(0xffffffffu, vis_lo);
    w.vis_hi = __reduce_max_sync(0xffffffffu, vis_hi);
    return w;
  }
  // The walk's steps (producer and consumers step alike): (gi, m) from the first visible pair
  // of (0, m_first) on, then the sm80 mainloop's next_step (heads of the share in order, for
  // each the tiles of [m_first, m_last] that see the key tile); kSparse: the listed pairs of the
  // key tile's q lists in list order (next_listed; partial: the list calls the tile partial);
  // gi == n_heads: over.
  struct Step {
    int gi, m, idx;
    bool partial;
  };
  static __device__ __forceinline__ Step first_step(const BaseParams& p, const Item& it, const Walk& w) {
    Step st{0, w.m_first, -1, false};
    if constexpr (kSparse) {
      if (w.m_first <= w.m_last) {
        Base::next_listed(p, it.b, it.h0, it.n_heads, it.n_tile, it.kv0, st.gi, st.idx, st.m, st.partial);
      } else {
        st.gi = it.n_heads;
      }
    } else if constexpr (Variant::kHasMask) {
      if (!Base::sees(Base::kv_range(p, it.b, it.h0, st.m), it.kv0)) {
        Base::next_step(p, it.b, it.h0, it.n_heads, w.m_first, w.m_last, it.kv0, st.gi, st.m);
      }
    }
    return st;
  }
  static __device__ __forceinline__ void next_step(const BaseParams& p, const Item& it, const Walk& w, Step& st) {
    if constexpr (kSparse) {
      Base::next_listed(p, it.b, it.h0, it.n_heads, it.n_tile, it.kv0, st.gi, st.idx, st.m, st.partial);
    } else {
      Base::next_step(p, it.b, it.h0, it.n_heads, w.m_first, w.m_last, it.kv0, st.gi, st.m);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Producer: warp 0 of warpgroup 0 (lane 0 issues the copies; the whole warp loads LSE / D and
  // zero-fills).
  static __device__ __forceinline__ void produce(const Params& P, const BaseParams& p, const cuda::SeqSpan& sp,
                                                 int wi, unsigned char* smem, uint32_t s0, const Bars& bar,
                                                 int lane, Counters& c) {
    const Item it = item(P, p, wi);
    const int tb = kPacked ? 0 : it.b;  // the tensor maps' batch coordinate
    const Walk w = scan(p, it, lane);
    if (w.m_first > w.m_last) return;
    // The previous item's K and V are read (persistent CTAs) before this item's replace them.
    if (c.kvn > 0) ptx::mbar_wait(bar.kv_empty(), (c.kvn - 1) & 1);
    if (lane == 0) {
      if (c.kvn == 0) {
        ptx::prefetch_tmap(&P.tq);
        ptx::prefetch_tmap(&P.tdo);
      }
      ptx::mbar_arrive_expect_tx(bar.full_kv(), 2 * kKBytes);
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn) {
        ptx::tma_load_4d(s0 + kOffK + pn * kKPanel, &P.tk, bar.full_kv(), pn * 64, sp.k0 + it.kv0, it.hkv, tb);
        ptx::tma_load_4d(s0 + kOffV + pn * kKPanel, &P.tv, bar.full_kv(), pn * 64, sp.k0 + it.kv0, it.hkv, tb);
      }
    }
    // Rows of the tile inside the tensor but outside every visible key range: zeros (masked
    // there, but dQ = dS K would take 0 x NaN from them). Packed: the rows past the sequence's
    // keys are the next sequence's, zeroed too.
    ptx::mbar_wait(bar.full_kv(), c.kvn & 1);
    ++c.kvn;
    const int in_hi = kPacked ? it.kv0 + kBlockN : imin(it.kv0 + kBlockN, p.seqlen_k);
    if (w.vis_lo > it.kv0 || w.vis_hi < in_hi) {
      const uint4 zero = make_uint4(0, 0, 0, 0);
      for (int r = lane / 8; r < kBlockN; r += 4) {
        const int kv = it.kv0 + r;
        if (kv < in_hi && (kv < w.vis_lo || kv >= w.vis_hi)) {
#pragma unroll
          for (int pn = 0; pn < 2 * kPanels; ++pn) {
            const uint32_t a = s0 + kOffK + pn * kKPanel + r * 128 + (lane % 8) * 16;  // K panels, then V's
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(zero.x), "r"(zero.y),
                         "r"(zero.z), "r"(zero.w)
                         : "memory");
          }
        }
      }
      ptx::fence_proxy_async();
    }
    ptx::mbar_arrive(bar.kv_ready());  // every lane, after its own zero stores

    uint32_t& cnt = c.cnt;
    [[maybe_unused]] uint32_t& tails = c.tails;
    for (Step st = first_step(p, it, w); st.gi < it.n_heads; next_step(p, it, w, st), ++cnt) {
      const int h = it.h0 + st.gi, m = st.m;
      const int64_t row0 = Base::q_rows(p, it.b, h);
      const int stage = int(cnt % kStages);
      const uint32_t phase = (cnt / kStages) & 1;
      if (cnt >= kStages) ptx::mbar_wait(bar.empty(stage), phase ^ 1);
      const int q_lo = m * kBlockM;
      // Packed: a partial last tile's rows past the sequence are the next sequence's queries;
      // its copy completes on q_tail, the warp zeroes those rows of Q and dO (P = dS = 0 there
      // by selection, but dV += P^T dO and dK += dS^T Q would take 0 x NaN from them), then
      // arrives on the stage's full barrier in the copy's place.
      const bool tail = kPacked && q_lo + kBlockM > p.seqlen_q;
      const uint32_t copy_bar = tail ? bar.q_tail() : bar.full(stage);
      if (lane == 0) {
        ptx::mbar_arrive_expect_tx(copy_bar, 2 * kQBytes);
#pragma unroll
        for (int pn = 0; pn < kPanels; ++pn) {
          ptx::tma_load_4d(s0 + kOffQ + stage * kQBytes + pn * kQPanel, &P.tq, copy_bar, pn * 64, sp.q0 + q_lo,
                           h, tb);
          ptx::tma_load_4d(s0 + kOffDO + stage * kQBytes + pn * kQPanel, &P.tdo, copy_bar, pn * 64, sp.q0 + q_lo,
                           h, tb);
        }
      }
      if constexpr (kPacked) {
        if (tail) {
          __syncwarp();  // every lane waits on this tail's phase (lane 0 cannot be a tail step ahead)
          ptx::mbar_wait(bar.q_tail(), tails & 1);
          ++tails;
          const uint4 zero = make_uint4(0, 0, 0, 0);
          // Rows [seqlen_q - q_lo, kBlockM) of every 64-column panel of Q and dO: 8 16-byte
          // chunks per 128-byte row (the swizzle permutes chunks within a row only).
          for (int ch = lane; ch < (kBlockM - (p.seqlen_q - q_lo)) * 8; ch += 32) {
            const int r = p.seqlen_q - q_lo + ch / 8;
#pragma unroll
            for (int pn = 0; pn < 2 * kPanels; ++pn) {
              const uint32_t a = s0 + (pn < kPanels ? kOffQ : kOffDO) + stage * kQBytes + (pn % kPanels) * kQPanel +
                                 r * 128 + (ch % 8) * 16;
              asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(zero.x), "r"(zero.y),
                           "r"(zero.z), "r"(zero.w)
                           : "memory");
            }
          }
          ptx::fence_proxy_async();
          // the copy's arrival; each lane's own arrival below releases its zero stores
          if (lane == 0) ptx::mbar_arrive(bar.full(stage));
        }
      }
      for (int r = lane; r < kBlockM; r += 32) {  // (32-bit shared addresses: 24 registers here)
        const int q = q_lo + r;
        const bool ok = q < p.seqlen_q;
        const uint32_t a = s0 + kOffL + (stage * kBlockM + r) * 4;
        const float l = ok ? __ldg(p.lse + row0 + q) : -INFINITY, dsum = ok ? __ldg(p.dsum + row0 + q) : 0.f;
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(a), "f"(l) : "memory");
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(a + (kOffDs - kOffL)), "f"(dsum) : "memory");
      }
      ptx::mbar_arrive(bar.full(stage));
    }
  }

  // ---------------------------------------------------------------------------------------------
  template <int N>
  static __device__ __forceinline__ void fence_acc(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_operand(x[i][e]);
    }
  }
  template <int N>
  static __device__ __forceinline__ void fence_frag(uint32_t (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_operand(x[i][e]);
    }
  }
  // The A fragments (m16n8k16 layout, 16 queries each) of a 64 x kBlockM accumulator.
  static __device__ __forceinline__ void pack(const float (&s)[kBlockM / 8][4], uint32_t (&a)[kBlockM / 16][4]) {
#pragma unroll
    for (int u = 0; u < kBlockM / 16; ++u) {
      a[u][0] = cuda::ptx::pack2<Element>(s[2 * u][0], s[2 * u][1]);
      a[u][1] = cuda::ptx::pack2<Element>(s[2 * u][2], s[2 * u][3]);
      a[u][2] = cuda::ptx::pack2<Element>(s[2 * u + 1][0], s[2 * u + 1][1]);
      a[u][3] = cuda::ptx::pack2<Element>(s[2 * u + 1][2], s[2 * u + 1][3]);
    }
  }

  // The deterministic mode's semaphore of query tile m of head h (its first row's entry; q0: the
  // sequence's first packed row) and this key tile's rank among the key tiles that add to it:
  // its index minus the first tile of the query tile's closed-form key range.
  static __device__ __forceinline__ int32_t* dq_semaphore(const Params& P, const BaseParams& p, const Item& it, int h,
                                                          int m, int q0, int& rank) {
    rank = it.n_tile - Base::kv_range(p, it.b, h, m).begin / kBlockN;
    return P.sem + q0 + Base::q_rows(p, it.b, h) + m * kBlockM;
  }

  // A consumer warp's part of its 64 x 64 dQ block into the staging buffer (sm90/tma.cuh's
  // make_tmap_dq boxes: 64 rows of 128 bytes, 16-byte chunk c of row r at c ^ (r % 8)); each
  // warp's 8-byte stores fill every bank twice, the minimum.
  static __device__ __forceinline__ void stage_dq(const float (&dq)[8][4], uint32_t s0, int wg, int warp_in_wg, int g,
                                                  int t) {
    const uint32_t base = s0 + kOffDQ + (kDqKeySplit ? wg * kDqBuf : 0);
    const int row_blk = kDqRows * wg / 64, col_box0 = kDqCols * wg / 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 16 * warp_in_wg + g + 8 * half;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int box = row_blk * (kD / 32) + col_box0 + j / 4;
        const int chunk = 2 * (j % 4) + (t >> 1);
        const uint32_t a = base + box * 8192 + r * 128 + ((chunk ^ (r & 7)) << 4) + 8 * (t & 1);
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(dq[j][2 * half]), "f"(dq[j][2 * half + 1])
                     : "memory");
      }
    }
  }

  // ---------------------------------------------------------------------------------------------
  // The dQ writer: lane 0 of warp 1 of warpgroup 0. For each block the consumers staged (their
  // DqSlot says where), it adds the staging buffer(s) into dq_accum by tensor reduce-adds (fp32,
  // each element atomically; FlashAttention-3's dQ writer) and releases the buffer once the
  // copies have read it, until a slot says done. Deterministic: it first waits for the query
  // tile's semaphore to reach this key tile's rank, and releases rank + 1 once the adds are
  // complete (the consumers go on meanwhile).
  static __device__ __forceinline__ void write_dq(const Params& P, unsigned char* smem, uint32_t s0, const Bars& bar) {
    const volatile DqSlot* slot = reinterpret_cast<const volatile DqSlot*>(smem + kOffSlot);
    ptx::prefetch_tmap(&P.tdq);
    constexpr int kBoxes = (kBlockM / 64) * (kD / 32);  // per buffer
    for (uint32_t n = 0;; ++n) {
      ptx::mbar_wait(bar.dq_full(), n & 1);
      if (slot->done) break;
      int32_t* sem = slot->sem;
      const int row = slot->row, h = slot->h, b = slot->b, rank = slot->rank;
      if (sem != nullptr) {
        while (ptx::ld_acquire_gpu(sem) != rank) __nanosleep(32);
        ptx::fence_proxy_async_global();
      }
#pragma unroll 1
      for (int buf = 0; buf < kDqBufs; ++buf) {
#pragma unroll 1
        for (int x = 0; x < kBoxes; ++x) {
          ptx::tma_reduce_add_4d(&P.tdq, s0 + kOffDQ + buf * kDqBuf + x * 8192, 32 * (x % (kD / 32)),
                                 row + 64 * (x / (kD / 32)), h, b);
        }
        ptx::bulk_commit();
        // deterministic: the two warpgroups' partials (d 64) in a fixed order
        if (sem != nullptr && buf + 1 < kDqBufs) ptx::bulk_wait<0>();
      }
      ptx::bulk_wait_read<0>();
      ptx::mbar_arrive(bar.dq_empty());
      if (sem != nullptr) {
        ptx::bulk_wait<0>();
        ptx::fence_proxy_async_global();
        __threadfence();
        ptx::st_release_gpu(sem, rank + 1);
      }
    }
    ptx::bulk_wait<0>();
  }
  // Consumers: warpgroup wg (0, 1) owns keys [kv0 + 64 wg, kv0 + 64 wg + 64).
  static __device__ __forceinline__ void consume(const Params& P, const BaseParams& p, int q0, int wi,
                                                 unsigned char* smem, uint32_t s0, const Bars& bar, int wg,
                                                 int warp_in_wg, int lane, Counters& c) {
    const Item it = item(P, p, wi);
    const Walk w = scan(p, it, lane);
    const int Nq = p.seqlen_q, Nk = p.seqlen_k;
    const int g = lane >> 2, t = lane & 3;
    float dk[kD / 8][4], dv[kD / 8][4];
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
    }
    uint32_t& dcnt = c.dcnt;  // blocks handed to the dQ writer
    if (w.m_first <= w.m_last) {
      ptx::mbar_wait(bar.kv_ready(), c.kvn & 1);
      ++c.kvn;
      const uint32_t sK = s0 + kOffK + wg * (64 * 128);  // this warpgroup's 64 key rows
      const uint32_t sV = s0 + kOffV + wg * (64 * 128);
      const int kv_row0 = it.kv0 + 64 * wg + 16 * warp_in_wg;  // this warp's first key
      const float* sLall = reinterpret_cast<const float*>(smem + kOffL);
      const float* sDall = reinterpret_cast<const float*>(smem + kOffDs);
      uint32_t& cnt = c.cnt;
      for (Step sw = first_step(p, it, w); __shfl_sync(0xffffffffu, int(sw.gi < it.n_heads), 0);
           next_step(p, it, w, sw), ++cnt) {
        const int h = it.h0 + sw.gi, m = sw.m;
        float* dqa = p.dq_accum + Base::q_rows(p, it.b, h) * kHeadDim;
        // The step count through a shuffle: warp-uniform to the compiler (the walk's exit test is not),
        // so the stage's addresses and descriptors below stay in uniform registers.
        const uint32_t cu = __shfl_sync(0xffffffffu, cnt, 0);
        const int stage = int(cu % kStages);
        const uint32_t phase = (cu / kStages) & 1;
        const int q_lo = m * kBlockM;
        const uint32_t sQ = s0 + kOffQ + stage * kQBytes;
        const uint32_t sdO = s0 + kOffDO + stage * kQBytes;
        bool need_mask;
        {
          const int q_hi = imin(q_lo + kBlockM, Nq);
          const Range r = Base::kv_range(p, it.b, h, m);
          // kSparse: the lists' partial tiles take the mask; their full ones skip keep() when
          // full_kept.
          need_mask = (kSparse && sw.partial) || it.kv0 < r.begin || it.kv0 + kBlockN > r.end ||
                      q_hi - q_lo < kBlockM ||
                      (Variant::kHasMask && !(kSparse && p.blk.full_kept) &&
                       !Variant::tile_full(p.vp, it.b, h, q_lo, q_hi, it.kv0, it.kv0 + kBlockN, Nq, Nk));
        }
        ptx::mbar_wait(bar.full(stage), phase);

        // S^T = K Q^T and dP^T = V dO^T (A: K / V rows, K-major; B: Q / dO rows, K-major).
        float st[kBlockM / 8][4], dpt[kBlockM / 8][4];
        fence_acc(st);
        fence_acc(dpt);
        ptx::wgmma_fence();
        const uint64_t dK0 = ptx::sw128_desc(sK, 16, 1024), dV0 = ptx::sw128_desc(sV, 16, 1024);
        const uint64_t dQ0 = ptx::sw128_desc(sQ, 16, 1024), dO0 = ptx::sw128_desc(sdO, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
          const uint32_t off = (ks % 4) * 32;
          const uint64_t da = ptx::desc_advance(dK0, (ks / 4) * kKPanel + off);
          const uint64_t db = ptx::desc_advance(dQ0, (ks / 4) * kQPanel + off);
          MmaS::template ss<0>(da, db, st, ks > 0 ? 1 : 0);
        }
        ptx::wgmma_commit();  // S^T alone, so that P can start while dP^T's GEMM runs
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
          const uint32_t off = (ks % 4) * 32;
          const uint64_t da = ptx::desc_advance(dV0, (ks / 4) * kKPanel + off);
          const uint64_t db = ptx::desc_advance(dO0, (ks / 4) * kQPanel + off);
          MmaS::template ss<0>(da, db, dpt, ks > 0 ? 1 : 0);
        }
        ptx::wgmma_commit();
        const float* sL = sLall + stage * kBlockM;
        const float* sD = sDall + stage * kBlockM;
        // P^T and dS^T, then dV += P^T dO and dK += dS^T Q (wgmma, A from registers; B: dO / Q
        // rows, N-major). The bare path with split waits (FLASHGEN_SM90_BWD_SPLIT=1; no score
        // expression, no dropout, a tile without masked elements): P = exp2(S^T log2e scale -
        // LSE log2e) while dP^T's GEMM runs, dV's GEMM issued at once, then dS = P (dP - D) while
        // it runs (FlashAttention-3's order); the same arithmetic as the sm80 mainloop's bare
        // path. Otherwise that mainloop's probs_grads once both GEMMs are done (tile classes,
        // mask hooks, score derivative, parameter gradients with warp-aggregated fp32 atomics,
        // dropout, on the same fragment layout). The dV and dK GEMMs are issued at one place
        // after the branches: issued inside them, ptxas serialises every wgmma of the kernel
        // (C7512, "insufficient register resources") to merge the in-flight accumulators.
        uint32_t ap[kBlockM / 16][4], ads[kBlockM / 16][4];
        bool bare = false;
        // (not at 128-row tiles of d 64: its fp32 P, dP^T and both accumulators would overlap the
        // register file, and ptxas would serialise every wgmma of the kernel)
        if constexpr (!Variant::kHasScoreMod && !Variant::kHasDropout && !(kBlockM == 128 && kD == 64)) {
          bare = !need_mask && P.split_waits;
        }
        ptx::wgmma_wait<1>();
        fence_acc(st);
        if (bare) {
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
            const float2 lse = *reinterpret_cast<const float2*>(sL + j * 8 + 2 * t);
            const float l[2] = {cuda::bwd_detail::lse_log2(lse.x), cuda::bwd_detail::lse_log2(lse.y)};
#pragma unroll
            for (int e = 0; e < 4; ++e) st[j][e] = cuda::ptx::exp2_approx(fmaf(st[j][e], p.scale_log2, -l[e & 1]));
          }
        } else {
          ptx::wgmma_wait<0>();
          fence_acc(dpt);
          if (Variant::kHasParamGrad && Variant::param_grad_enabled(p.vp)) {
            if constexpr (Variant::kHasParamGrad) {
              if (need_mask) {
                Base::template probs_grads<true, true>(p, st, dpt, sL, sD, it.b, h, q_lo, kv_row0,
                                                       Base::kv_range(p, it.b, h, m), 0, lane);
              } else {
                Base::template probs_grads<false, true>(p, st, dpt, sL, sD, it.b, h, q_lo, kv_row0, Range{0, 0}, 0,
                                                        lane);
              }
            }
          } else if (need_mask) {
            Base::template probs_grads<true, false>(p, st, dpt, sL, sD, it.b, h, q_lo, kv_row0,
                                                    Base::kv_range(p, it.b, h, m), 0, lane);
          } else {
            Base::template probs_grads<false, false>(p, st, dpt, sL, sD, it.b, h, q_lo, kv_row0, Range{0, 0}, 0,
                                                     lane);
          }
        }
        pack(st, ap);
        fence_acc(dv);
        fence_frag(ap);
        ptx::wgmma_fence();
        const uint64_t dOt = ptx::sw128_desc(sdO, kQPanel, 1024), dQt = ptx::sw128_desc(sQ, kQPanel, 1024);
#pragma unroll
        for (int u = 0; u < kBlockM / 16; ++u) {
          MmaKV::template rs<1>(ap[u], ptx::desc_advance(dOt, u * 16 * 128), dv, 1);
        }
        ptx::wgmma_commit();
        ptx::wgmma_wait<1>();
        fence_acc(dpt);
        if (bare) {
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
            const float2 dd = *reinterpret_cast<const float2*>(sD + j * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[j][e] = st[j][e] * (dpt[j][e] - ((e & 1) ? dd.y : dd.x));
          }
        }
        pack(dpt, ads);
        fence_acc(dk);
        fence_frag(ads);
        ptx::wgmma_fence();
#pragma unroll
        for (int u = 0; u < kBlockM / 16; ++u) {
          MmaKV::template rs<1>(ads[u], ptx::desc_advance(dQt, u * 16 * 128), dk, 1);
        }
        ptx::wgmma_commit();

        // dS (rows q, keys contiguous) into this step's buffer: the warp's 16 keys are 16-byte
        // chunks 2 warp_in_wg and 2 warp_in_wg + 1 of panel wg.
        const uint32_t sS = s0 + kOffS + (cu & 1) * kSBytes;
        {
          const int mat = lane >> 3, i = lane & 7;
          const int chunk = 2 * warp_in_wg + (mat & 1);
#pragma unroll
          for (int u = 0; u < kBlockM / 16; ++u) {
            const int q = 16 * u + 8 * (mat >> 1) + i;
            const uint32_t addr = sS + wg * kSPanel + q * 128 + ((chunk ^ (q & 7)) << 4);
            ptx::stmatrix_x4_trans(addr, ads[u][0], ads[u][1], ads[u][2], ads[u][3]);
          }
        }
        ptx::fence_proxy_async();  // the generic-proxy writes before the wgmma reads
        ptx::bar_sync<1, 256>();   // both warpgroups' dS rows are in the buffer

        // dQ block = dS K: rows [kDqRows wg, + 64) of the query tile, columns [kDqCols wg, + 64).
        float dq[8][4];
        fence_acc(dq);
        ptx::wgmma_fence();
        if constexpr (kDqKeySplit) {
          const uint32_t sA = sS + wg * kSPanel;  // dS columns of this warpgroup's keys
          const uint64_t dA0 = ptx::sw128_desc(sA, 16, 1024), dB0 = ptx::sw128_desc(sK, kKPanel, 1024);
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            const uint64_t da = ptx::desc_advance(dA0, ks * 32);
            const uint64_t db = ptx::desc_advance(dB0, ks * 16 * 128);
            MmaQ::template ss<1>(da, db, dq, ks > 0 ? 1 : 0);
          }
        } else {
          const uint32_t sA = sS + kDqRows * wg * 128;
          const uint32_t sB = s0 + kOffK + (kDqCols * wg / 64) * kKPanel;
          const uint64_t dA0 = ptx::sw128_desc(sA, 16, 1024), dB0 = ptx::sw128_desc(sB, kKPanel, 1024);
#pragma unroll
          for (int ks = 0; ks < kBlockN / 16; ++ks) {
            const uint64_t da = ptx::desc_advance(dA0, (ks / 4) * kSPanel + (ks % 4) * 32);
            const uint64_t db = ptx::desc_advance(dB0, ks * 16 * 128);
            MmaQ::template ss<1>(da, db, dq, ks > 0 ? 1 : 0);
          }
        }
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
        fence_acc(dq);
        fence_acc(dv);
        fence_acc(dk);
        fence_frag(ap);
        fence_frag(ads);
        ptx::mbar_arrive(bar.empty(stage));  // every thread: its reads of the stage's Q, dO, LSE, D are done

        // dQ partials into dq_accum (the convert kernel scales them).
        auto add_dq = [&]() {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int q = q_lo + kDqRows * wg + 16 * warp_in_wg + g + 8 * half;
            if (q < Nq) {
              float* row_p = dqa + cuda::wide(q) * kHeadDim + kDqCols * wg + 2 * t;
#pragma unroll
              for (int j = 0; j < 8; ++j) {
                cuda::bwd_detail::atomic_add2(row_p + 8 * j, dq[j][2 * half], dq[j][2 * half + 1]);
              }
            }
          }
        };
        // The writer warp's path: the block into the staging buffer (once the writer has read the
        // previous one), then the full barrier. Packed: a sequence's last, partial query tile
        // keeps the atomics (its rows past the sequence are the next sequence's dQ rows).
        const bool via_writer = P.dq_writer != 0 && !(kPacked && q_lo + kBlockM > Nq);
        if (via_writer) {
          if (dcnt > 0) ptx::mbar_wait(bar.dq_empty(), (dcnt - 1) & 1);
          ++dcnt;
          if (wg == 0 && warp_in_wg == 0 && lane == 0) {
            volatile DqSlot* slot = reinterpret_cast<volatile DqSlot*>(smem + kOffSlot);
            slot->row = q0 + q_lo;
            slot->h = h;
            slot->b = kPacked ? 0 : it.b;
            slot->done = 0;
            int rank = 0;
            slot->sem = P.sem != nullptr ? dq_semaphore(P, p, it, h, m, q0, rank) : nullptr;
            slot->rank = rank;
          }
          stage_dq(dq, s0, wg, warp_in_wg, g, t);
          ptx::fence_proxy_async();  // the generic-proxy writes before the writer's TMA reads
          ptx::mbar_arrive(bar.dq_full());
        } else if (P.sem == nullptr) {
          add_dq();
        } else {
          // Deterministic: the key tiles that see query tile (h, m) add in ascending order, each
          // once the tile's semaphore counts the ones before it (its rank among the tiles that
          // intersect the tile's key range; FlashAttention-3's ordered dQ). Inside the CTA the
          // warpgroups' adds are disjoint (d 128) or ordered by a named barrier (d 64, where
          // both add to the whole tile); the count is released after all of them.
          int rank;
          int32_t* sem = dq_semaphore(P, p, it, h, m, q0, rank);
          if (wg == 0 && warp_in_wg == 0 && lane == 0) {
            while (ptx::ld_acquire_gpu(sem) != rank) __nanosleep(32);
          }
          ptx::bar_sync<2, 256>();
          if constexpr (kDqKeySplit) {
            if (wg == 0) add_dq();
            ptx::bar_sync<2, 256>();
            if (wg == 1) add_dq();
          } else {
            add_dq();
          }
          ptx::bar_sync<2, 256>();
          if (wg == 0 && warp_in_wg == 0 && lane == 0) {
            __threadfence();
            ptx::st_release_gpu(sem, rank + 1);
          }
        }
      }
      // Every GEMM of the walk has completed (wgmma_wait<0> each step): K and V may be replaced.
      ptx::mbar_arrive(bar.kv_empty());
    }

    // Epilogue: dK (scaled) and dV of the warp's 16 keys, straight from the accumulators. The
    // item decoded again (and the lane's fragment coordinates from an opaque copy of the lane):
    // the addresses are computed here, not held in registers across the walk.
    const int ln = ptx::opaque(lane);
    const Item ie = item(P, p, wi);
    const int gg = ln >> 2, tt = ln & 3;
    if (p.num_splits > 1) {
      // A GQA split: this CTA's heads' dK (scaled), dV added into the fp32 workspaces (the
      // convert kernel writes dk, dv).
      float* dka = p.dk_accum + Base::k_rows(p, ie.b, ie.hkv) * kHeadDim;
      float* dva = p.dv_accum + Base::k_rows(p, ie.b, ie.hkv) * kHeadDim;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int kv = ie.kv0 + 64 * wg + 16 * warp_in_wg + gg + 8 * half;
        if (kv < Nk) {
          float* rk = dka + cuda::wide(kv) * kHeadDim + 2 * tt;
          float* rv = dva + cuda::wide(kv) * kHeadDim + 2 * tt;
#pragma unroll
          for (int j = 0; j < kD / 8; ++j) {
            cuda::bwd_detail::atomic_add2(rk + 8 * j, dk[j][2 * half] * p.scale, dk[j][2 * half + 1] * p.scale);
            cuda::bwd_detail::atomic_add2(rv + 8 * j, dv[j][2 * half], dv[j][2 * half + 1]);
          }
        }
      }
      return;
    }
    Element* dk_g = p.dk + cuda::wide(ie.b) * p.dk_sb + cuda::wide(ie.hkv) * p.dk_sh;
    Element* dv_g = p.dv + cuda::wide(ie.b) * p.dv_sb + cuda::wide(ie.hkv) * p.dv_sh;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int kv = ie.kv0 + 64 * wg + 16 * warp_in_wg + gg + 8 * half;
      if (kv < Nk) {
        Element* rk = dk_g + cuda::wide(kv) * p.dk_sn + 2 * tt;
        Element* rv = dv_g + cuda::wide(kv) * p.dv_sn + 2 * tt;
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
          *reinterpret_cast<uint32_t*>(rk + 8 * j) =
              cuda::ptx::pack2<Element>(dk[j][2 * half] * p.scale, dk[j][2 * half + 1] * p.scale);
          *reinterpret_cast<uint32_t*>(rv + 8 * j) = cuda::ptx::pack2<Element>(dv[j][2 * half], dv[j][2 * half + 1]);
        }
      }
    }
  }

  static __device__ __forceinline__ void run(const Params& P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // The 1024-byte aligned base as an offset into smem_raw (not an integer round trip), so that
    // the compiler still knows the pointer is shared memory: LDS/STS instead of generic LD/ST.
    unsigned char* smem = smem_raw + ((1024u - (ptx::smem_addr(smem_raw) & 1023u)) & 1023u);
    const uint32_t s0 = ptx::smem_addr(smem);
    const Bars bar{s0 + kOffBar};
    // wg through a shuffle: the compiler then knows it is warp-uniform, and the shared-memory
    // addresses and wgmma descriptors derived from it live in uniform registers.
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    if (tid == 0) {
      ptx::mbar_init(bar.full_kv(), 1);
      ptx::mbar_init(bar.kv_ready(), 32);  // one per producer lane after its zero stores
      for (int s = 0; s < kStages; ++s) {
        // the TMA's expect-tx arrival (or, for a packed tail, the arrival after its zeroing) and
        // one per producer lane after its own LSE / D stores (each writer releases its stores)
        ptx::mbar_init(bar.full(s), 1 + 32);
        ptx::mbar_init(bar.empty(s), 32 * kConsumerWarps);  // one per consumer thread
      }
      ptx::mbar_init(bar.q_tail(), 1);
      ptx::mbar_init(bar.dq_full(), 32 * kConsumerWarps);  // one per consumer thread
      ptx::mbar_init(bar.dq_empty(), 1);                   // the writer's lane 0
      ptx::mbar_init(bar.kv_empty(), 32 * kConsumerWarps);  // one per consumer thread
      ptx::fence_barrier_init();
    }
    __syncthreads();
    if (wg == 0) {
      ptx::reg_dealloc<Tile::kProducerRegs>();
      if (warp == 0) {
        Counters c;
        for_each_item(P, [&](const BaseParams& p, const cuda::SeqSpan& sp, int wi) {
          produce(P, p, sp, wi, smem, s0, bar, lane, c);
        });
      } else if (warp == 1 && lane == 0 && P.dq_writer) {  // one thread issues and waits
        write_dq(P, smem, s0, bar);
      }
    } else {
      ptx::reg_alloc<Tile::kConsumerRegs>();
      const int cwg = wg - 1, warp_in_wg = warp % 4;
      Counters c;
      for_each_item(P, [&](const BaseParams& p, const cuda::SeqSpan& sp, int wi) {
        consume(P, p, sp.q0, wi, smem, s0, bar, cwg, warp_in_wg, lane, c);
      });
      if (P.dq_writer) {  // the last item's end, for the dQ writer
        if (c.dcnt > 0) ptx::mbar_wait(bar.dq_empty(), (c.dcnt - 1) & 1);
        if (cwg == 0 && warp_in_wg == 0 && lane == 0) reinterpret_cast<volatile DqSlot*>(smem + kOffSlot)->done = 1;
        ptx::mbar_arrive(bar.dq_full());
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    bwd_kernel(const __grid_constant__ typename Kernel::Params params) {
#if defined(FG_SM90A)
  Kernel::run(params);
#else
  __trap();  // the sm90 family needs sm_90a (wgmma, setmaxnreg)
#endif
}

// The defaults of the backward's diagnostic switches (each overridden per launch by its variable):
// FLASHGEN_SM90_BWD_DQ=writer | atomic, FLASHGEN_SM90_BWD_SPLIT=1 | 0, FLASHGEN_SM90_BWD_ORDER=tile | lpt.
// Measured on the H100 (docs/perf-notes.md, scripts/ab_bwd_dq.py): the writer 1.30-1.70x the
// consumers' atomics on dense and causal d 64/128, N 1K-16K, deterministic or not; the split waits
// within noise of none (off); the key tiles slowest in the grid 1.08-1.40x for deterministic causal
// (the longest semaphore chains start first) but 0.69-1.01x elsewhere (Q/dO lose their L2 reuse
// across the key tiles of one head), so by default only deterministic calls of masked specs take it.
constexpr bool kBwdDefaultDqWriter = true;
constexpr bool kBwdDefaultSplitWaits = false;
// FLASHGEN_SM90_BWD_PERSIST=1 | 0: a persistent grid (one CTA per multiprocessor looping over the
// items, Sm90Bwd::work_of) or one CTA per item (the default). Measured on the H100
// (docs/perf-notes.md), causal d 128 forward+backward: persistent 1.03x at N 1K, 1.00x at 4K, but
// 0.77x at 16K, where the items' walks range from 1 to 256 query tiles and the static rounds leave
// CTAs idle that the hardware's dispatch of one CTA per item keeps busy; dense within 1%. It stays
// off by default until a one-time failure of its many-items GPU test (1 of 43 runs, not
// reproduced since) is understood. Deterministic calls always take one CTA per item: their dQ
// semaphores wait on lower key tiles, which a persistent CTA could hold unstarted behind the item
// it spins in if the grid were not all resident.
constexpr bool kBwdDefaultPersist = false;
template <class Variant>
constexpr bool bwd_default_lpt(bool deterministic) {
  return deterministic && Variant::kHasMask;
}

template <class Variant, class Element, int kHeadDim, class Tile, bool kPacked = false, bool kSparse = false>
int launch_bwd(const FgBwdArgs& a) {
  using K = Sm90Bwd<Variant, Element, kHeadDim, Tile, kPacked, kSparse>;
  using P = typename K::Params;
  static_assert(K::kSmem <= 227 * 1024, "the sm90 backward's tiles exceed shared memory");
  cuda::detail::reference_hooks<Variant>();
  cuda::detail::clear_error();
  // Packed (varlen) batches (args.h): per-sequence rows from cu_seqlens (seqlen_q / seqlen_k
  // are the longest sequence's), batch strides unused, the fp32 per-row buffers [H, total]; the
  // tensor maps and the element-wise kernels see one batch of total rows.
  int st = cuda::detail::check_sizes(a, kHeadDim, kPacked, true);
  if (st != FG_OK) return st;
  // The diagnostic switches (A/B timing), read per launch, before anything is launched.
  int lpt = 0, split = 0, writer = 0;
  st = cuda::detail::switch_env("FLASHGEN_SM90_BWD_ORDER", "tile", "lpt", bwd_default_lpt<Variant>(a.deterministic != 0),
                          lpt);
  if (st == FG_OK) st = cuda::detail::switch_env("FLASHGEN_SM90_BWD_SPLIT", "0", "1", kBwdDefaultSplitWaits, split);
  if (st == FG_OK) st = cuda::detail::switch_env("FLASHGEN_SM90_BWD_DQ", "atomic", "writer", kBwdDefaultDqWriter, writer);
  int persist = 0;
  if (st == FG_OK) st = cuda::detail::switch_env("FLASHGEN_SM90_BWD_PERSIST", "0", "1", kBwdDefaultPersist, persist);
  int pair_share = 0;
  if (st == FG_OK) st = cuda::detail::dropout_share_env<Variant>(pair_share);
  if (st != FG_OK) return st;
  // Block sparsity: each key tile's q list at the kernel's tiles (the dq lists of the sm80
  // family's separate dq pass, args.kv_blocks, are not used here). The deterministic mode's
  // order assumes the closed-form walk: the family routes sparse deterministic calls to sm80.
  st = cuda::detail::check_tile_lists(a.q_blocks, kSparse, "q_blocks", a.seqlen_k, a.seqlen_q, K::kBlockN,
                                      K::kBlockM);
  if (st != FG_OK) return st;
  const bool det = a.deterministic != 0;
  if (kSparse && det) {
    return cuda::detail::fail(FG_ERR_BAD_SHAPE,
                              "the sm90 backward's deterministic mode takes no block lists (the family routes "
                              "them to sm80)");
  }
  if (a.batch == 0 || a.heads_q == 0 || (a.seqlen_q == 0 && a.seqlen_k == 0)) return FG_OK;
  const bool has_q = a.seqlen_q > 0 && (!kPacked || a.total_q > 0);
  const bool has_k = a.seqlen_k > 0 && (!kPacked || a.total_k > 0);
  if (!has_q && !has_k) return FG_OK;
  const int64_t nb = kPacked ? 1 : a.batch;
  const int64_t rows_q = kPacked ? a.total_q : a.seqlen_q, rows_k = kPacked ? a.total_k : a.seqlen_k;
  if ((has_q && (!a.q || !a.out || !a.dout || !a.lse || !a.dq || !a.softmax_d || !a.dq_accum)) ||
      (has_k && (!a.k || !a.v || !a.dk || !a.dv))) {
    return cuda::detail::fail(FG_ERR_BAD_SHAPE, "null pointer among q/k/v/out/dout/lse/dq/dk/dv/softmax_d/dq_accum");
  }
  constexpr int64_t kE16 = 16 / int64_t(sizeof(Element));
  auto bad_q = [&](const void* ptr, int64_t sb, int64_t sh, int64_t sn) {
    return has_q && cuda::detail::bad_tensor(ptr, sb, sh, sn, nb, a.heads_q, rows_q, kE16);
  };
  auto bad_k = [&](const void* ptr, int64_t sb, int64_t sh, int64_t sn) {
    return has_k && cuda::detail::bad_tensor(ptr, sb, sh, sn, nb, a.heads_kv, rows_k, kE16);
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
  else if (has_q && (cuda::detail::misaligned4(a.lse) || cuda::detail::misaligned4(a.softmax_d) ||
                     cuda::detail::misaligned4(a.dlse)))
    bad = "lse/softmax_d/dlse";
  else if (has_q && cuda::detail::misaligned(a.dq_accum)) bad = "dq_accum";
  if (bad) return cuda::detail::fail_alignment(bad, kE16);

  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return cuda::detail::fail_cuda(FG_ERR_LAUNCH, "cudaGetDevice", err);
  int num_sms = a.num_sms;
  if (num_sms <= 0 && cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();
    num_sms = 132;
  }
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const int64_t kElemGrid = int64_t(num_sms) * 16;
  constexpr bool kBf16 = std::is_same<Element, __nv_bfloat16>::value;
  // GQA: one CTA walks the query heads of its kv head's group, or (args.gqa_splits > 1, the
  // family's per-call decision when the key tiles alone leave multiprocessors idle) a share of
  // them, adding dK, dV into the fp32 workspaces dk_accum / dv_accum.
  const int group = int(a.heads_q / a.heads_kv);
  if (a.gqa_splits < 1 || group % a.gqa_splits != 0) {
    return cuda::detail::fail(FG_ERR_BAD_SHAPE,
                              "gqa_splits %d: must be >= 1 and divide the GQA group (heads_q / heads_kv = %d)",
                              (int)a.gqa_splits, group);
  }
  int splits = 1;
  if (det && has_q && has_k && (!a.dq_semaphore || cuda::detail::misaligned4(a.dq_semaphore))) {
    return cuda::detail::fail(FG_ERR_BAD_SHAPE, "deterministic: dq_semaphore must be a 4-byte aligned int32 buffer "
                              "of one entry per query row");
  }
  if (!det && has_q && has_k && group > 1 && a.gqa_splits > 1) {
    if (!a.dk_accum || !a.dv_accum || cuda::detail::misaligned(a.dk_accum) || cuda::detail::misaligned(a.dv_accum)) {
      return cuda::detail::fail(FG_ERR_BAD_SHAPE, "gqa_splits > 1 needs 16-byte aligned dk_accum and dv_accum");
    }
    splits = int(a.gqa_splits);
  }

  // 1. D = rowsum(dout ∘ out) - dlse; dq_accum zeroed.
  if (has_q) {
    cuda::BwdPreParams<Element> pp;
    memset(&pp, 0, sizeof(pp));
    pp.o = static_cast<const Element*>(a.out);
    pp.dout = static_cast<const Element*>(a.dout);
    cuda::detail::set_strides(pp.o_sb, pp.o_sh, pp.o_sn, a.o_stride_b, a.o_stride_h, a.o_stride_n, kPacked);
    cuda::detail::set_strides(pp.do_sb, pp.do_sh, pp.do_sn, a.do_stride_b, a.do_stride_h, a.do_stride_n, kPacked);
    pp.dsum = a.softmax_d;
    pp.dlse = a.dlse;
    pp.dq_accum = a.dq_accum;
    pp.rows = nb * a.heads_q * rows_q;
    pp.heads_q = int(a.heads_q);
    pp.seqlen_q = int(rows_q);
    if (splits > 1) {
      pp.zero_a = a.dk_accum;
      pp.zero_b = a.dv_accum;
      pp.zero_count = nb * a.heads_kv * rows_k * kHeadDim;
    }
    constexpr int kTpr = kHeadDim / 8;  // 8 or 16 threads per row
    const int64_t blocks = (pp.rows + 256 / kTpr - 1) / (256 / kTpr);
    cuda::bwd_preprocess_kernel<Element, kHeadDim>
        <<<cuda::detail::grid_for(blocks, kElemGrid), 256, 0, stream>>>(pp);
    err = cudaGetLastError();
    if (err != cudaSuccess) return cuda::detail::fail_cuda(FG_ERR_LAUNCH, "backward preprocess launch", err);
  }

  // 2. The main kernel: dK, dV; dQ partials.
  if (has_k) {
    P p;
    memset(&p, 0, sizeof(p));
    auto& b = p.base;
    b.lse = has_q ? a.lse : nullptr;
    b.dsum = a.softmax_d;
    b.dk = static_cast<Element*>(a.dk);
    b.dv = static_cast<Element*>(a.dv);
    b.dq_accum = a.dq_accum;
    b.dk_accum = a.dk_accum;
    b.dv_accum = a.dv_accum;
    p.sem = det && has_q ? a.dq_semaphore : nullptr;
    cuda::detail::set_strides(b.dk_sb, b.dk_sh, b.dk_sn, a.dk_stride_b, a.dk_stride_h, a.dk_stride_n, kPacked);
    cuda::detail::set_strides(b.dv_sb, b.dv_sh, b.dv_sn, a.dv_stride_b, a.dv_stride_h, a.dv_stride_n, kPacked);
    b.cu_q = a.cu_seqlens_q;
    b.cu_k = a.cu_seqlens_k;
    b.total_q = a.total_q;
    b.total_k = a.total_k;
    b.heads_q = int(a.heads_q);
    b.heads_kv = int(a.heads_kv);
    b.group = group;
    b.num_splits = splits;
    b.heads_per_split = group / splits;
    b.seqlen_q = int(a.seqlen_q);
    b.seqlen_k = int(a.seqlen_k);
    b.num_m_tiles = int((a.seqlen_q + K::kBlockM - 1) / K::kBlockM);
    b.num_n_tiles = int((a.seqlen_k + K::kBlockN - 1) / K::kBlockN);
    b.total_work = int64_t(b.num_n_tiles) * splits * a.heads_kv * a.batch;
    cuda::detail::fill_common<Variant>(b, a, a.q_blocks);
    b.dropout_pair_share = pair_share;
    const int64_t bs = kPacked ? 0 : 1;  // packed: one batch of total rows, batch strides unused
    p.lpt = lpt;  // the switches read above
    p.split_waits = split;
    st = detail::make_tmap(&p.tk, a.k, kBf16, nb, a.heads_kv, rows_k, kHeadDim, bs * a.k_stride_b,
                           a.k_stride_h, a.k_stride_n, K::kBlockN, "k");
    if (st == FG_OK) {
      st = detail::make_tmap(&p.tv, a.v, kBf16, nb, a.heads_kv, rows_k, kHeadDim, bs * a.v_stride_b,
                             a.v_stride_h, a.v_stride_n, K::kBlockN, "v");
    }
    if (st == FG_OK && has_q) {
      st = detail::make_tmap(&p.tq, a.q, kBf16, nb, a.heads_q, rows_q, kHeadDim, bs * a.q_stride_b,
                             a.q_stride_h, a.q_stride_n, K::kBlockM, "q");
      if (st == FG_OK) {
        st = detail::make_tmap(&p.tdo, a.dout, kBf16, nb, a.heads_q, rows_q, kHeadDim, bs * a.do_stride_b,
                               a.do_stride_h, a.do_stride_n, K::kBlockM, "dout");
      }
      p.dq_writer = writer;  // dQ partials by the writer warp's tensor reduce-adds, or the consumers' atomics
      if (st == FG_OK && p.dq_writer) {
        st = detail::make_tmap_dq(&p.tdq, a.dq_accum, nb, a.heads_q, rows_q, kHeadDim);
      }
    }
    if (st != FG_OK) return st;
    auto kernel = &bwd_kernel<K>;
    static std::atomic<uint64_t> configured{0};
    st = cuda::detail::ensure_smem(kernel, K::kSmem, configured, dev, "sm90 backward kernel");
    if (st != FG_OK) return st;
    if (b.total_work > (int64_t(1) << 30)) {  // the work indices are int32 (Sm90Bwd::work_of)
      return cuda::detail::fail(FG_ERR_BAD_SHAPE, "the sm90 backward's grid (%lld key tiles x splits x kv heads x "
                                "batch) exceeds 2^30", (long long)b.total_work);
    }
    const int64_t grid = persist && !det ? cuda::detail::grid_for(b.total_work, num_sms) : b.total_work;
    kernel<<<unsigned(grid), K::kThreads, K::kSmem, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return cuda::detail::fail_cuda(FG_ERR_LAUNCH, "sm90 backward kernel launch", err);
  }

  // 3. dq = scale * dq_accum.
  if (has_q) {
    cuda::BwdConvertParams<Element> cp;
    cp.src = a.dq_accum;
    cp.dst = static_cast<Element*>(a.dq);
    cp.rows = nb * a.heads_q * rows_q;
    cp.heads = int(a.heads_q);
    cp.seqlen = int(rows_q);
    cuda::detail::set_strides(cp.sb, cp.sh, cp.sn, a.dq_stride_b, a.dq_stride_h, a.dq_stride_n, kPacked);
    cp.mul = a.scale;
    const int64_t blocks = (cp.rows * (kHeadDim / 8) + 255) / 256;
    cuda::bwd_convert_kernel<Element, kHeadDim>
        <<<cuda::detail::grid_for(blocks, kElemGrid), 256, 0, stream>>>(cp);
    err = cudaGetLastError();
    if (err != cudaSuccess) return cuda::detail::fail_cuda(FG_ERR_LAUNCH, "dq convert launch", err);
  }

  // 4. dk, dv from the workspaces when the GQA group was split (the sm80 family's convert).
  if (splits > 1) return cuda::convert_kv_workspaces<Element, kHeadDim>(a, nb, rows_k, kPacked, kElemGrid, stream);
  return FG_OK;
}

}  // namespace sm90
}  // namespace flashgen
