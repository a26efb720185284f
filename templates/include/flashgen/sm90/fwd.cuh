// flashgen sm90 forward: the Hopper family's attention forward (FlashAttention-3's anatomy, Shah
// et al. 2024, arXiv 2407.08608, Sec. 3.1), specialised by a generated Variant (flashgen/variant.h).
//
//   template <class Variant, class Element /* __half | __nv_bfloat16 */, int kHeadDim,
//             class Tile /* Sm90FwdTile */, bool kSparse = false, bool kPacked = false>
//   int flashgen::sm90::launch_fwd(const FgFwdArgs& args);   // FgStatus; no host sync
//
// Layouts: padded [batch, heads, seqlen, d], or packed (kPacked: [total, heads, d] with
// cu_seqlens, args.h), whose tensor maps see one batch of total rows; an item of a packed batch
// addresses its sequence's rows from cu_seqlens (rows past the sequence's end inside the tensor
// are the next sequence's: masked like keys outside the key range, below). Head dims: every
// multiple of 8 up to 256 whose tiles fit shared memory (the static_assert on kSmem).
//
// ---------------------------------------------------------------------------------------------
// CTA: three or four warpgroups (384 / 512 threads), one CTA per multiprocessor.
//   warpgroup 0, the producer: its first warp issues the TMA copies (sm90/tma.cuh) of the Q tile
//     (kBlockM = 128 or 192 rows) and of the K and V tiles (kBlockN keys each) into a kStages-deep ring,
//     each completing on an mbarrier ("full"); it refills a stage once the consumers have
//     released it ("empty"). It gives its registers away (setmaxnreg) to the consumers.
//   warpgroups 1 .. kBlockM / 64, the consumers: 64 query rows each. Per key tile: S = Q K^T by wgmma with
//     both operands in shared memory (fp32 accumulators in registers, the mma.sync C layout per
//     warp of 16 rows), the variant's tile class, mask and score hooks and the online softmax
//     (the sm80 family's FwdMainloop::softmax_classed, unchanged: one implementation of the
//     semantics), dropout, then O += P V by wgmma with P straight from the S registers (the
//     A-fragment trick of FlashAttention-2) and V from shared memory.
//   The epilogue is the sm80 family's FwdEpilogue (O / l, LSE), staged through each warp's own
//     rows of a separate buffer.
// Work items are (batch, query head, query tile), the sm80 family's QTileScheduler order (query
// tile fastest, heaviest first; a packed batch enumerates only its sequences' own query tiles,
// ``coord``); each CTA loops over items (gridDim.x may be smaller than the
// number of items), the producer running ahead into the next item's Q once the consumers have
// released the previous one. A persistent grid takes the items in rounds of gridDim.x, CTAs in
// reverse order in odd rounds (serpentine, ``work_of``): under a causal mask a CTA that took a
// heavy item in one round takes a light one in the next (a plain round-robin leaves some CTAs
// 1.1-1.3x the mean work at N 1K-4K, the serpentine 1.03x). A packed batch whose host passes a
// work queue (args.h FgWorkQueue) runs the dynamic schedule instead (``dynamic``): a persistent
// grid whose CTAs draw the items longest first from a shared counter, as they free up.
//
// Key range and tile classes are those of the sm80 forward (fwd.cuh): only the key tiles of the
// item's [kv_lo, kv_hi) are visited, from the high end down (or the listed tiles, kSparse). TMA
// loads whole tiles; rows past seqlen_k arrive as zeros, but rows inside the tensor and outside
// the item's key range arrive as data, which a mask turns into P = 0 -- and 0 * NaN is NaN. So on
// a tile that holds such V rows the producer waits for the copy, zero-fills those rows itself
// (the swizzle permutes 16-byte chunks within a 128-byte row, so a row stays a row), fences the
// generic-proxy writes against the tensor cores' reads and only then publishes the stage: what
// lies outside the key range never reaches the output, as in the sm80 family.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "flashgen/args.h"
#include "flashgen/cuda/epilogue.cuh"
#include "flashgen/cuda/fwd.cuh"
#include "flashgen/cuda/fwd_mainloop.cuh"
#include "flashgen/cuda/host.cuh"
#include "flashgen/cuda/scheduler.cuh"
#include "flashgen/cuda/status.cuh"
#include "flashgen/sm90/ptx.cuh"
#include "flashgen/sm90/tma.cuh"
#include "flashgen/sm90/wgmma.cuh"
#include "flashgen/variant.h"

#ifndef FLASHGEN_SM90_FWD_MAX_GRID
#define FLASHGEN_SM90_FWD_MAX_GRID 2147483647
#endif
// The largest persistent grid of the dynamic schedule (one CTA per multiprocessor: a bound on
// the ranks drawn past the work-order table).
#define FLASHGEN_SM90_FWD_MAX_DYN_GRID (1 << 20)

namespace flashgen {
namespace sm90 {

// kBlockN keys per K/V tile, kStages K/V stages; the query tile is kBlockM rows: 128 (two
// consumer warpgroups of 64) or 192 (three, FlashAttention-3's tile at d <= 64: at small head
// dims the exponentials cost as much issue time as the GEMMs, and a third warpgroup gives the
// scheduler more independent work to hide them under; each consumer then has 160 registers).
template <int kBlockN_, int kStages_ = 2, int kOverlap_ = 0, int kPingPong_ = 0, int kPersistentMaxSeqlenK_ = 0,
          int kBlockM_ = 128>
struct Sm90FwdTile {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // 1: intra-warpgroup overlap (FlashAttention-3, Sec. 3.2): the S GEMM of tile j and the PV
  // GEMM of tile j - 1 are in flight together while the softmax of tile j runs.
  static constexpr bool kOverlap = kOverlap_ != 0;
  // 1 (with kOverlap): ping-pong between the consumer warpgroups (FlashAttention-3, Sec. 3.1):
  // each issues its GEMMs of a step only after the other has issued its own (named barriers
  // 1 and 2), so one warpgroup's softmax runs under the other's GEMMs.
  static constexpr bool kPingPong = kPingPong_ != 0;
  // Calls with seqlen_k up to this launch one CTA per multiprocessor, each looping over work
  // items (the producer loads the next item's Q and K/V while the consumers run the epilogue:
  // it pays where items are short); longer ones (and 0: all) launch one CTA per item, which
  // the hardware hands out as multiprocessors free up (it balances items of unequal cost).
  static constexpr int kPersistentMaxSeqlenK = kPersistentMaxSeqlenK_;
  static constexpr int kConsumers = kBlockM / 64;  // warpgroups of 64 query rows
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // setmaxnreg: the producer warpgroup keeps 24 registers, the consumers take the rest of the
  // 64K-register file (the launch gives every thread 65536 / kThreads: 168 or 128).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kBlockM == 128 || kBlockM == 192, "kBlockM: 128 or 192 query rows");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "register file");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 16 && kBlockN <= 256, "kBlockN: 16..256, step 16");
  static_assert(kStages >= 2 && kStages <= 4, "2 to 4 K/V stages");
  static_assert(!kPingPong || kOverlap, "ping-pong needs the overlapped key loop");
  static_assert(!kPingPong || kConsumers == 2, "ping-pong takes two consumer warpgroups");
};

template <class Element, class VParams>
struct Sm90FwdParams {  // 64-byte aligned through CUtensorMap
  CUtensorMap tq, tk, tv;  // TMA descriptors of q, k, v (sm90/tma.cuh)
  cuda::FwdParams<Element, VParams> base;  // everything the sm80 forward's Params hold
  int64_t rows_k;  // rows of the k / v tensor maps: seqlen_k (padded) or total_k (packed)
  int batch;       // sequences (kPacked: the work index enumerates their query tiles, ``coord``)
  int tma_store;   // kTmaStore: `to` describes the output (else the epilogue stores directly)
  CUtensorMap to;  // the output's tensor map, boxes of 64 columns x 16 rows (epilogue_tma)
  // kPacked: the dynamic schedule (args.h FgWorkQueue; ``dynamic``); work_counter null: static.
  int* work_counter;
  const int* work_order;
};

template <class Variant, class Element, int kHeadDim, class Tile, bool kSparse = false,
          bool kPacked = false>
struct Sm90Fwd {
  static_assert(kHeadDim >= 8 && kHeadDim <= 256 && kHeadDim % 8 == 0,
                "the sm90 forward supports head_dim in {8, 16, ..., 256}");
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kD = cuda::HeadDim<kHeadDim>::kD;
  static constexpr int kPitch = cuda::HeadDim<kHeadDim>::kPitch;
  static constexpr int kPanels = (kD + 63) / 64;  // 64-column panels of a tile (one TMA box each)
  static constexpr int kQPanel = kBlockM * 128;   // bytes
  static constexpr int kKVPanel = kBlockN * 128;
  static constexpr int kQBytes = kPanels * kQPanel;
  static constexpr int kKVBytes = kPanels * kKVPanel;  // one K or V stage
  // Shared memory (from a 1024-byte aligned base): Q, the K ring, the V ring, the O staging rows
  // (pitch kPitch, as FwdEpilogue writes them), the mbarriers. Where the O rows do not fit
  // beside the rings (large key tiles), they overlay the K/V rings (kOInRing): both consumer
  // warpgroups finish their GEMMs of the item first (named barrier 3), and they release Q only
  // after the epilogue, so that the producer loads nothing of the next item into the rings before.
  static constexpr int kOBytes = (kBlockM * kPitch * int(sizeof(Element)) + 15) / 16 * 16;
  static constexpr int kRingBytes = 2 * kStages * kKVBytes;
  // full_q, empty_q, full_k[S], empty_k[S], full_v[S], empty_v[S], aux_v
  static constexpr int kNumBars = 3 + 4 * kStages;
  // Packed batches: the dynamic schedule's two-slot work ring (``dynamic``) after the mbarriers.
  // (16-byte aligned: kOffBar is a multiple of 16).
  static constexpr int kWorkBytes = kPacked ? 64 : 0;
  static constexpr int kBarBytes = kPacked ? (8 * kNumBars + 15) / 16 * 16 : 8 * kNumBars;
  static constexpr bool kOInRing = kQBytes + kRingBytes + kOBytes + kBarBytes + kWorkBytes + 1024 > 227 * 1024;
  static_assert(!kOInRing || kRingBytes >= kOBytes, "the O staging rows fit neither beside nor in the rings");
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKVBytes;
  static constexpr int kOffO = kOInRing ? kOffK : kOffV + kStages * kKVBytes;
  static constexpr int kOffBar = kOInRing ? kOffK + kRingBytes : kOffO + kOBytes;
  static constexpr int kOffWork = kOffBar + kBarBytes;
  static constexpr int kSmem = kOffWork + kWorkBytes + 1024;  // + alignment slack
  static_assert(!kPacked || kOffWork % 16 == 0, "the work ring's 16-byte stores");
  static constexpr int kConsumerWarps = 4 * Tile::kConsumers;
  // The epilogue stores O by TMA (epilogue_tma) in the padded layout where the boxes' staging
  // rows (kPanels x 128 bytes) fit in the direct path's (kPitch elements): head dims 64, 128,
  // 192, 256. Packed batches store directly (a box would cross into the next sequence's rows).
  static constexpr bool kTmaStore = !kPacked && kPanels * 64 <= kPitch;

  // The sm80 family's mainloop for one consumer warpgroup (64 rows = 4 warps of 16): its
  // softmax, tile classes, dropout and accumulator types.
  using Base = cuda::FwdMainloop<Variant, Element, kHeadDim, cuda::FwdTile<64, kBlockN, 4>, kSparse>;
  using Accum = typename Base::Accum;
  using Epilogue = cuda::FwdEpilogue<Variant, Element, kHeadDim, 1, kPacked>;
  using BaseParams = cuda::FwdParams<Element, typename Variant::Params>;
  using Params = Sm90FwdParams<Element, typename Variant::Params>;
  using Scheduler = cuda::QTileScheduler;
  using MmaS = Wgmma<Element, kBlockN>;
  using MmaO = Wgmma<Element, kD>;

  struct Bars {
    uint32_t base;
    __device__ uint32_t full_q() const { return base; }
    __device__ uint32_t empty_q() const { return base + 8; }
    __device__ uint32_t aux_v() const { return base + 16; }
    __device__ uint32_t full_k(int s) const { return base + 24 + 8 * s; }
    __device__ uint32_t empty_k(int s) const { return base + 24 + 8 * (kStages + s); }
    __device__ uint32_t full_v(int s) const { return base + 24 + 8 * (2 * kStages + s); }
    __device__ uint32_t empty_v(int s) const { return base + 24 + 8 * (3 * kStages + s); }
  };

  // The item's sizes and visit list, computed identically by producer and consumers: its
  // sequence's first rows (q0, k0: 0 in the padded layout) and lengths, the query tile's rows
  // and the key tiles to visit. skip: a packed batch's query tile past its sequence's end
  // (nothing to load or write; producer and consumers pass over it alike).
  struct Item {
    int b, h, m_tile, q0, k0, len_q, len_k, q_lo, q_hi, kv_begin, kv_end, n_hi, n_tiles;
    bool skip;
    cuda::BlockRow blk;
  };
  // The work index of this CTA's iter-th item: rounds of gridDim.x items, CTAs in reverse order
  // in odd rounds (see the header). Past total_work only in the last round (the loops stop).
  static __device__ __forceinline__ int64_t work_of(int iter) {
    const int64_t g = cuda::ptx::nctaid_x(), c = cuda::ptx::ctaid_x();
    return int64_t(iter) * g + ((iter & 1) ? g - 1 - c : c);
  }
  // The coordinates (sequence, query head, query tile) of work index w. Padded: the
  // QTileScheduler order. Packed: a sequence b of len_q rows owns the slots [slot(b), slot(b + 1))
  // with slot(b) = b + cu_seqlens_q[b] / kBlockM -- at least ceil(len_q / kBlockM) of them and at
  // most one more, read off cu_seqlens alone (no pre-pass, no host synchronisation) -- and the
  // work index runs over heads_q * slot(batch) items, (sequence, head, slot) with the slot
  // fastest, heaviest query tile first. So a launch enumerates the real query tiles plus at most
  // one empty slot per (sequence, head), not max_seqlen_q / kBlockM tiles of every sequence: a
  // batch of short and long sequences then balances over the persistent rounds like a uniform
  // one. skip: an empty slot (or indices past the last sequence's slots, or metadata that is
  // not monotone: nothing is read or written for them).
  struct Coord {
    int b, h, m_tile;
    bool skip;
  };
  static __device__ __forceinline__ Coord coord(const Params& P, int64_t w) {
    const BaseParams& p = P.base;
    if constexpr (!kPacked) {
      const cuda::QTileScheduler::Item c = Scheduler::decode_index(p.num_m_tiles, p.heads_q, w);
      return Coord{c.b, c.h, c.m_tile, false};
    } else {
      const int64_t hq = p.heads_q;
      auto slot = [&](int b) { return int64_t(b) + int64_t(__ldg(p.cu_q + b)) / kBlockM; };
      int lo = 0, hi = P.batch - 1;  // the last b with heads_q * slot(b) <= w (slot(0) = 0)
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (hq * slot(mid) <= w) lo = mid; else hi = mid - 1;
      }
      const int64_t s0 = slot(lo), n = slot(lo + 1) - s0;  // the sequence's slots
      Coord c;
      c.b = lo;
      const int64_t r = w - hq * s0;
      c.skip = n <= 0 || r >= hq * n;
      if (c.skip) {
        c.h = 0, c.m_tile = 0;
        return c;
      }
      c.h = int(r / n);
      c.m_tile = int(n - 1 - (r - int64_t(c.h) * n));
      c.skip = c.m_tile >= p.num_m_tiles;
      return c;
    }
  }
  static __device__ __forceinline__ Item item(const Params& P, int64_t work) {
    const BaseParams& p = P.base;
    const Coord w = coord(P, work);
    if (w.skip) return skipped(w);
    const cuda::SeqSpan sp = kPacked ? cuda::seq_span(p.cu_q, p.cu_k, w.b, p.seqlen_q, p.seqlen_k)
                                     : cuda::SeqSpan{0, 0, p.seqlen_q, p.seqlen_k};
    return item_at(P, w, sp);
  }
  static __device__ __forceinline__ Item skipped(const Coord& w) {
    Item it;
    it.b = w.b, it.h = w.h, it.m_tile = w.m_tile;
    it.q0 = it.k0 = it.len_q = it.len_k = it.q_lo = it.q_hi = 0;
    it.n_hi = it.n_tiles = it.kv_begin = it.kv_end = 0;
    it.blk = cuda::BlockRow{nullptr, 0, 0};
    it.skip = true;
    return it;
  }
  // The item at coordinates w (not an empty slot) of the sequence whose rows and lengths are sp.
  static __device__ __forceinline__ Item item_at(const Params& P, const Coord& w, const cuda::SeqSpan& sp) {
    const BaseParams& p = P.base;
    Item it;
    it.b = w.b, it.h = w.h, it.m_tile = w.m_tile;
    const int Nq = sp.len_q, Nk = sp.len_k;
    it.q0 = sp.q0, it.k0 = sp.k0, it.len_q = Nq, it.len_k = Nk;
    it.q_lo = w.m_tile * kBlockM;
    it.q_hi = imin(it.q_lo + kBlockM, Nq);
    it.n_hi = 0;
    it.n_tiles = 0;
    it.blk = cuda::BlockRow{nullptr, 0, 0};
    it.skip = kPacked && it.q_lo >= Nq;
    if (it.skip) {
      it.kv_begin = it.kv_end = 0;
      return it;
    }
    it.kv_begin = imin(imax(Variant::kv_lo(p.vp, it.b, it.h, it.q_lo, it.q_hi, Nq, Nk), 0), Nk);
    it.kv_end = imin(imax(Variant::kv_hi(p.vp, it.b, it.h, it.q_lo, it.q_hi, Nq, Nk), 0), Nk);
    if constexpr (kSparse) {
      it.blk = cuda::block_row(p.blk, it.b, it.h, it.m_tile);
      it.n_tiles = it.kv_end > it.kv_begin ? it.blk.n_all : 0;
    } else if (it.kv_end > it.kv_begin) {
      it.n_hi = (it.kv_end - 1) / kBlockN;
      it.n_tiles = it.n_hi - it.kv_begin / kBlockN + 1;
    }
    return it;
  }
  static __device__ __forceinline__ int tile_of(const Item& it, int j) {
    if constexpr (kSparse) {
      return __ldg(it.blk.idx + j);
    } else {
      return it.n_hi - j;
    }
  }

  // The dynamic schedule (kPacked, the host set args.work: a zeroed counter and the ranked work
  // order, args.h FgWorkQueue): the producer's lane 0 takes rank atomicAdd(counter, 1) and its
  // work index order[rank] (-1 past the table or its real items: the end), decodes the item and
  // publishes its coordinates and sequence span in slot (local & 1) of a two-slot ring in shared
  // memory before the full_q arrive of its Q load (release); the consumers read the slot after
  // their full_q wait (acquire), so they decode nothing from cu_seqlens. The end is published the
  // same way (b = -1) with a plain arrive once the consumers have released the last item's Q. The
  // producer writes slot (local & 1) only after empty_q of item local - 1, which every consumer
  // warp arrives on after its epilogue of item local - 2 (the last reader of that slot): two slots
  // suffice. Items run longest first and the CTAs (one per multiprocessor) take the next one as
  // they free up, so uneven sequences no longer leave multiprocessors idle at the end of a launch.
  static __device__ __forceinline__ bool dynamic(const Params& P) {
    if constexpr (kPacked) {
      return P.work_counter != nullptr;
    } else {
      return false;
    }
  }
  static __device__ __forceinline__ int64_t next_work(const Params& P, int lane) {
    int w = -1;
    if (lane == 0) {
      const int r = atomicAdd(P.work_counter, 1);
      if (int64_t(r) < P.base.total_work) w = __ldg(P.work_order + r);
    }
    return __shfl_sync(0xffffffffu, w, 0);
  }
  static constexpr uint32_t kRingSlot = kWorkBytes / 2;  // {b, h, m_tile, q0}, {k0, len_q, len_k, -}
  static __device__ __forceinline__ void publish(uint32_t slot, int b, int h, int m_tile, int q0, int k0,
                                                 int len_q, int len_k) {
    ptx::st_shared_v4(slot, b, h, m_tile, q0);
    ptx::st_shared_v4(slot + 16, k0, len_q, len_k, 0);
  }
  // Reads a published slot; false for the end.
  static __device__ __forceinline__ bool ring_read(uint32_t slot, Coord& c, cuda::SeqSpan& sp) {
    const int4 x = ptx::ld_shared_v4(slot), y = ptx::ld_shared_v4(slot + 16);
    c = Coord{x.x, x.y, x.z, false};
    sp = cuda::SeqSpan{x.w, y.x, y.y, y.z};
    return x.x >= 0;
  }

  // ---------------------------------------------------------------------------------------------
  // Producer: warp 0 of warpgroup 0 (lane 0 issues the copies; the whole warp zero-fills).
  static __device__ __forceinline__ void produce(const Params& P, uint32_t s0, const Bars& bar,
                                                 int lane) {
    const uint32_t ring = s0 + kOffWork;  // the dynamic schedule's work ring
    const BaseParams& p = P.base;
    if (lane == 0) {
      ptx::prefetch_tmap(&P.tq);
      ptx::prefetch_tmap(&P.tk);
      ptx::prefetch_tmap(&P.tv);
    }
    uint32_t cnt = 0, edges = 0;
    int local = 0;
    const bool dyn = dynamic(P);
    for (int iter = 0; dyn || int64_t(iter) * gridDim.x < p.total_work; ++iter) {
      int64_t work;
      if (dyn) {
        work = next_work(P, lane);
        if (work < 0) {  // the end, published once the consumers are done with the last Q
          if (local > 0) ptx::mbar_wait(bar.empty_q(), (local - 1) & 1);
          if (lane == 0) {
            publish(ring + kRingSlot * (local & 1), -1, 0, 0, 0, 0, 0, 0);
            ptx::mbar_arrive(bar.full_q());
          }
          break;
        }
      } else {
        work = work_of(iter);
        if (work >= p.total_work) break;  // the last round's CTAs without an item
      }
      const Item it = item(P, work);
      if (it.skip) continue;
      const int h_kv = it.h / p.group;
      const int tb = kPacked ? 0 : it.b;  // the tensor maps' batch coordinate
      // Q: the consumers released the previous item's Q after their last S GEMM.
      if (local > 0) ptx::mbar_wait(bar.empty_q(), (local - 1) & 1);
      if (lane == 0) {
        if (dyn) publish(ring + kRingSlot * (local & 1), it.b, it.h, it.m_tile, it.q0, it.k0, it.len_q, it.len_k);
        ptx::mbar_arrive_expect_tx(bar.full_q(), kQBytes);
#pragma unroll
        for (int pn = 0; pn < kPanels; ++pn) {
          ptx::tma_load_4d(s0 + pn * kQPanel, &P.tq, bar.full_q(), pn * 64, it.q0 + it.q_lo, it.h, tb);
        }
      }
      for (int j = 0; j < it.n_tiles; ++j, ++cnt) {
        const int stage = int(cnt % kStages);
        const uint32_t phase = (cnt / kStages) & 1;
        const int kv0 = tile_of(it, j) * kBlockN;
        const uint32_t sK = s0 + kOffK + stage * kKVBytes;
        const uint32_t sV = s0 + kOffV + stage * kKVBytes;
        if (cnt >= kStages) ptx::mbar_wait(bar.empty_k(stage), phase ^ 1);
        if (lane == 0) {
          ptx::mbar_arrive_expect_tx(bar.full_k(stage), kKVBytes);
#pragma unroll
          for (int pn = 0; pn < kPanels; ++pn) {
            ptx::tma_load_4d(sK + pn * kKVPanel, &P.tk, bar.full_k(stage), pn * 64, it.k0 + kv0, h_kv, tb);
          }
        }
        if (cnt >= kStages) ptx::mbar_wait(bar.empty_v(stage), phase ^ 1);
        // V rows of this tile inside the tensor but outside the key range (see the header).
        const int in_hi = int(imin(int64_t(kv0 + kBlockN), P.rows_k - it.k0));
        const int zlo_end = imin(it.kv_begin, in_hi);      // rows [kv0, zlo_end)
        const int zhi_begin = imax(it.kv_end, kv0);        // rows [zhi_begin, in_hi)
        const bool edge = zlo_end > kv0 || zhi_begin < in_hi;
        const uint32_t done = edge ? bar.aux_v() : bar.full_v(stage);
        if (lane == 0) {
          ptx::mbar_arrive_expect_tx(done, kKVBytes);
#pragma unroll
          for (int pn = 0; pn < kPanels; ++pn) {
            ptx::tma_load_4d(sV + pn * kKVPanel, &P.tv, done, pn * 64, it.k0 + kv0, h_kv, tb);
          }
        }
        if (edge) {
          ptx::mbar_wait(bar.aux_v(), edges & 1);
          ++edges;
          const uint4 zero = make_uint4(0, 0, 0, 0);
          // 16-byte chunks of the rows to clear, over all panels.
          for (int r = lane / 8; r < kBlockN; r += 4) {
            const int kv = kv0 + r;
            if ((kv < zlo_end) || (kv >= zhi_begin && kv < in_hi)) {
#pragma unroll
              for (int pn = 0; pn < kPanels; ++pn) {
                const uint32_t a = sV + pn * kKVPanel + r * 128 + (lane % 8) * 16;
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(zero.x),
                             "r"(zero.y), "r"(zero.z), "r"(zero.w)
                             : "memory");
              }
            }
          }
          ptx::fence_proxy_async();
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(bar.full_v(stage));
        }
      }
      ++local;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // wgmma issue helpers (fenced, committed as one group each; the caller waits).
  static __device__ __forceinline__ void issue_s(uint32_t sQ, uint32_t sK, float (&s)[1][kBlockN / 8][4]) {
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_operand(s[0][i][e]);
    }
    ptx::wgmma_fence();
    const uint64_t dQ0 = ptx::sw128_desc(sQ, 16, 1024), dK0 = ptx::sw128_desc(sK, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks % 4) * 32;
      const uint64_t da = ptx::desc_advance(dQ0, (ks / 4) * kQPanel + off);
      const uint64_t db = ptx::desc_advance(dK0, (ks / 4) * kKVPanel + off);
      MmaS::template ss<0>(da, db, s[0], ks > 0 ? 1 : 0);
    }
    ptx::wgmma_commit();
  }
  static __device__ __forceinline__ void issue_pv(uint32_t (&a)[kBlockN / 16][4], uint32_t sV,
                                                  float (&o)[1][kD / 8][4]) {
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_operand(o[0][i][e]);
    }
#pragma unroll
    for (int u = 0; u < kBlockN / 16; ++u) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_operand(a[u][e]);
    }
    ptx::wgmma_fence();
    const uint64_t dV0 = ptx::sw128_desc(sV, kKVPanel, 1024);
#pragma unroll
    for (int u = 0; u < kBlockN / 16; ++u) {
      MmaO::template rs<1>(a[u], ptx::desc_advance(dV0, u * 16 * 128), o[0], 1);
    }
    ptx::wgmma_commit();
  }
  // After the wait that completes them: S / O / the A fragments may be touched again (the
  // fences keep the compiler from using their registers, or moving their accesses, earlier).
  template <int N>
  static __device__ __forceinline__ void fence_all(float (&x)[1][N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_operand(x[0][i][e]);
    }
  }
  static __device__ __forceinline__ void fence_a(uint32_t (&a)[kBlockN / 16][4]) {
#pragma unroll
    for (int u = 0; u < kBlockN / 16; ++u) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_operand(a[u][e]);
    }
  }
  static __device__ __forceinline__ void pack_p(const float (&s)[1][kBlockN / 8][4], uint32_t (&a)[kBlockN / 16][4]) {
#pragma unroll
    for (int u = 0; u < kBlockN / 16; ++u) {
      a[u][0] = cuda::ptx::pack2<Element>(s[0][2 * u][0], s[0][2 * u][1]);
      a[u][1] = cuda::ptx::pack2<Element>(s[0][2 * u][2], s[0][2 * u][3]);
      a[u][2] = cuda::ptx::pack2<Element>(s[0][2 * u + 1][0], s[0][2 * u + 1][1]);
      a[u][3] = cuda::ptx::pack2<Element>(s[0][2 * u + 1][2], s[0][2 * u + 1][3]);
    }
  }

  // The key loop of one item with intra-warpgroup overlap (Tile::kOverlap): per tile j >= 1,
  // S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued back to back; the softmax of S_j runs
  // while the PV GEMM is still in flight (its O rescale is deferred until that GEMM is done).
  // cnt: the pipeline count of the item's first tile.
  // Ping-pong (Tile::kPingPong): a step's GEMMs are issued between turn() (this warpgroup's
  // barrier, completed by the other's pass()) and pass(); both warpgroups take the same number
  // of steps per item (n + 1), and consumer warpgroup 1 passes once first, so 0 starts.
  static __device__ __forceinline__ void turn(int wg) {
    if constexpr (Tile::kPingPong) {
      if (wg == 0) {
        ptx::bar_sync<1, 256>();
      } else {
        ptx::bar_sync<2, 256>();
      }
    }
  }
  static __device__ __forceinline__ void pass(int wg) {
    if constexpr (Tile::kPingPong) {
      if (wg == 0) {
        ptx::bar_arrive<2, 256>();
      } else {
        ptx::bar_arrive<1, 256>();
      }
    }
  }
  static __device__ __forceinline__ void overlapped(const BaseParams& p, Accum& acc, const Item& it,
                                                    uint32_t sQ, uint32_t s0, const Bars& bar,
                                                    uint32_t cnt, int wq_lo, int wq_hi, int warp_row0,
                                                    int lane, int wg) {
    const int Nq = it.len_q, Nk = it.len_k, n = it.n_tiles;
    float s[1][kBlockN / 8][4];
    uint32_t a[kBlockN / 16][4];
    // Tile 0: S, softmax, P (O is still 0: its rescale is harmless).
    {
      const int stage = int(cnt % kStages);
      ptx::mbar_wait(bar.full_k(stage), (cnt / kStages) & 1);
      turn(wg);
      issue_s(sQ, s0 + kOffK + stage * kKVBytes, s);
      pass(wg);
      ptx::wgmma_wait<0>();
      fence_all(s);
      __syncwarp();
      if (lane == 0) {
        ptx::mbar_arrive(bar.empty_k(stage));
        if (!kOInRing && n == 1) ptx::mbar_arrive(bar.empty_q());
      }
      const int kv0 = tile_of(it, 0) * kBlockN;
      Base::softmax_classed(p, s, acc, it.b, it.h, wq_lo, wq_hi, Nq, Nk, kv0, it.kv_begin, it.kv_end,
                            kSparse && 0 < it.blk.n_part, it.q_lo + warp_row0, lane);
      if constexpr (Variant::kHasDropout) {
        if (p.dropout.state) Base::apply_dropout(p, s, it.b, it.h, it.q_lo + warp_row0, kv0, lane);
      }
      pack_p(s, a);
    }
    for (int j = 1; j < n; ++j) {
      const uint32_t c = cnt + j, cp = c - 1;
      const int stage = int(c % kStages), pstage = int(cp % kStages);
      ptx::mbar_wait(bar.full_k(stage), (c / kStages) & 1);
      ptx::mbar_wait(bar.full_v(pstage), (cp / kStages) & 1);
      turn(wg);
      issue_s(sQ, s0 + kOffK + stage * kKVBytes, s);
      issue_pv(a, s0 + kOffV + pstage * kKVBytes, acc.o);
      pass(wg);
      ptx::wgmma_wait<1>();  // S_j is done; the PV GEMM may still run
      fence_all(s);
      __syncwarp();
      if (lane == 0) {
        ptx::mbar_arrive(bar.empty_k(stage));
        if (!kOInRing && j + 1 == n) ptx::mbar_arrive(bar.empty_q());
      }
      const int kv0 = tile_of(it, j) * kBlockN;
      typename Base::Rescale r;
      Base::template softmax_classed<true>(p, s, acc, it.b, it.h, wq_lo, wq_hi, Nq, Nk, kv0, it.kv_begin,
                                           it.kv_end, kSparse && j < it.blk.n_part, it.q_lo + warp_row0,
                                           lane, &r);
      if constexpr (Variant::kHasDropout) {
        if (p.dropout.state) Base::apply_dropout(p, s, it.b, it.h, it.q_lo + warp_row0, kv0, lane);
      }
      ptx::wgmma_wait<0>();  // O += P_{j-1} V_{j-1} is done
      fence_all(acc.o);
      fence_a(a);
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(bar.empty_v(pstage));
      Base::apply_rescale(r, acc.o);
      pack_p(s, a);
    }
    const uint32_t cl = cnt + n - 1;
    const int lstage = int(cl % kStages);
    ptx::mbar_wait(bar.full_v(lstage), (cl / kStages) & 1);
    turn(wg);
    issue_pv(a, s0 + kOffV + lstage * kKVBytes, acc.o);
    pass(wg);
    ptx::wgmma_wait<0>();
    fence_all(acc.o);
    fence_a(a);
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(bar.empty_v(lstage));
  }

  // ---------------------------------------------------------------------------------------------
  // Consumers: warpgroup wg (0 .. kConsumers - 1) owns query rows [64 wg, 64 wg + 64) of each
  // item's tile.
  static __device__ __forceinline__ void consume(const Params& P, unsigned char* smem, uint32_t s0,
                                                 const Bars& bar, int wg, int warp_in_wg,
                                                 int lane) {
    const BaseParams& p = P.base;
    Element* sO = reinterpret_cast<Element*>(smem + kOffO);
    const int warp_row0 = 64 * wg + 16 * warp_in_wg;  // this warp's first row in the tile
    uint32_t cnt = 0;
    int local = 0;
    if (Tile::kPingPong && wg == 1) pass(wg);  // consumer warpgroup 0 takes the first turn
    const bool dyn = dynamic(P);
    for (int iter = 0; dyn || int64_t(iter) * gridDim.x < p.total_work; ++iter) {
      Item it;
      if (dyn) {  // the producer's published item (``dynamic``): Q has landed with it
        ptx::mbar_wait(bar.full_q(), local & 1);
        Coord c;
        cuda::SeqSpan sp;
        if (!ring_read(s0 + kOffWork + kRingSlot * (local & 1), c, sp)) break;
        it = item_at(P, c, sp);
      } else {
        const int64_t work = work_of(iter);
        if (work >= p.total_work) break;  // the last round's CTAs without an item
        it = item(P, work);
        if (it.skip) continue;
      }
      const int Nq = it.len_q, Nk = it.len_k;
      const int wq_lo = it.q_lo + 64 * wg;                 // this warpgroup's rows
      const int wq_hi = imin(wq_lo + 64, Nq);
      Accum acc;
      Base::init(acc);
      if (!dyn) ptx::mbar_wait(bar.full_q(), local & 1);
      const uint32_t sQ = s0 + wg * (64 * 128);
      if (!kOInRing && it.n_tiles == 0) {
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(bar.empty_q());
      }
      if constexpr (Tile::kOverlap) {
        if (it.n_tiles > 0) overlapped(p, acc, it, sQ, s0, bar, cnt, wq_lo, wq_hi, warp_row0, lane, wg);
        cnt += it.n_tiles;
      } else {
        for (int j = 0; j < it.n_tiles; ++j, ++cnt) {
          const int stage = int(cnt % kStages);
          const uint32_t phase = (cnt / kStages) & 1;
          const int kv0 = tile_of(it, j) * kBlockN;
          const uint32_t sK = s0 + kOffK + stage * kKVBytes;
          const uint32_t sV = s0 + kOffV + stage * kKVBytes;

          // S = Q K^T (both K-major in shared memory).
          float s[1][kBlockN / 8][4];
          ptx::mbar_wait(bar.full_k(stage), phase);
  #pragma unroll
          for (int i = 0; i < kBlockN / 8; ++i) {
  #pragma unroll
            for (int e = 0; e < 4; ++e) ptx::fence_operand(s[0][i][e]);
          }
          ptx::wgmma_fence();
          const uint64_t dQ0 = ptx::sw128_desc(sQ, 16, 1024), dK0 = ptx::sw128_desc(sK, 16, 1024);
  #pragma unroll
          for (int ks = 0; ks < kD / 16; ++ks) {
            const uint32_t off = (ks % 4) * 32;
            const uint64_t da = ptx::desc_advance(dQ0, (ks / 4) * kQPanel + off);
            const uint64_t db = ptx::desc_advance(dK0, (ks / 4) * kKVPanel + off);
            MmaS::template ss<0>(da, db, s[0], ks > 0 ? 1 : 0);
          }
          ptx::wgmma_commit();
          ptx::wgmma_wait<0>();
  #pragma unroll
          for (int i = 0; i < kBlockN / 8; ++i) {
  #pragma unroll
            for (int e = 0; e < 4; ++e) ptx::fence_operand(s[0][i][e]);
          }
          __syncwarp();
          if (lane == 0) {
            ptx::mbar_arrive(bar.empty_k(stage));
            if (!kOInRing && j + 1 == it.n_tiles) ptx::mbar_arrive(bar.empty_q());
          }

          // Tile class, mask / score hooks, online softmax (the sm80 family's, per warp).
          const bool listed_partial = kSparse && j < it.blk.n_part;
          Base::softmax_classed(p, s, acc, it.b, it.h, wq_lo, wq_hi, Nq, Nk, kv0, it.kv_begin,
                                it.kv_end, listed_partial, it.q_lo + warp_row0, lane);
          if constexpr (Variant::kHasDropout) {
            if (p.dropout.state) Base::apply_dropout(p, s, it.b, it.h, it.q_lo + warp_row0, kv0, lane);
          }

          // O += P V: P from the S registers (A fragments), V N-major in shared memory.
          uint32_t a[kBlockN / 16][4];
  #pragma unroll
          for (int u = 0; u < kBlockN / 16; ++u) {
            a[u][0] = cuda::ptx::pack2<Element>(s[0][2 * u][0], s[0][2 * u][1]);
            a[u][1] = cuda::ptx::pack2<Element>(s[0][2 * u][2], s[0][2 * u][3]);
            a[u][2] = cuda::ptx::pack2<Element>(s[0][2 * u + 1][0], s[0][2 * u + 1][1]);
            a[u][3] = cuda::ptx::pack2<Element>(s[0][2 * u + 1][2], s[0][2 * u + 1][3]);
          }
          ptx::mbar_wait(bar.full_v(stage), phase);
  #pragma unroll
          for (int i = 0; i < kD / 8; ++i) {
  #pragma unroll
            for (int e = 0; e < 4; ++e) ptx::fence_operand(acc.o[0][i][e]);
          }
  #pragma unroll
          for (int u = 0; u < kBlockN / 16; ++u) {
  #pragma unroll
            for (int e = 0; e < 4; ++e) ptx::fence_operand(a[u][e]);
          }
          ptx::wgmma_fence();
          const uint64_t dV0 = ptx::sw128_desc(sV, kKVPanel, 1024);
  #pragma unroll
          for (int u = 0; u < kBlockN / 16; ++u) {
            MmaO::template rs<1>(a[u], ptx::desc_advance(dV0, u * 16 * 128), acc.o[0], 1);
          }
          ptx::wgmma_commit();
          ptx::wgmma_wait<0>();
  #pragma unroll
          for (int i = 0; i < kD / 8; ++i) {
  #pragma unroll
            for (int e = 0; e < 4; ++e) ptx::fence_operand(acc.o[0][i][e]);
          }
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(bar.empty_v(stage));
        }
      }
      if constexpr (kOInRing) {
        ptx::bar_sync<3, 128 * Tile::kConsumers>();  // every consumer warpgroup is done reading the rings
      } else {
        __syncwarp();  // the warp's previous item left its staging rows
      }
      // The item decoded again, and the lane and rows, from opaque copies: the epilogue's
      // addresses are computed here, not hoisted out of the item loop and held in registers
      // through the key loop (where the accumulators need them; ptxas would spill them).
      // Dynamic: the slot again (its producer rewrites it only after this warp's next item began).
      Coord w;
      cuda::SeqSpan se;
      if (dyn) {
        ring_read(s0 + kOffWork + kRingSlot * (ptx::opaque(local) & 1), w, se);
      } else {
        w = coord(P, work_of(ptx::opaque(iter)));
        se = kPacked ? cuda::seq_span(p.cu_q, p.cu_k, w.b, p.seqlen_q, p.seqlen_k)
                     : cuda::SeqSpan{0, 0, p.seqlen_q, p.seqlen_k};
      }
      bool stored = false;
      if constexpr (kTmaStore) {
        if (P.tma_store) {
          epilogue_tma(P, acc, smem, s0, w.b, w.h, w.m_tile * kBlockM, se.len_q, ptx::opaque(lane),
                       ptx::opaque(warp_row0));
          stored = true;
        }
      }
      if (!stored) {
        Epilogue::run(p, acc.o, acc.row_max, acc.row_sum, sO, w.b, w.h, se.q0, w.m_tile * kBlockM, se.len_q,
                      ptx::opaque(lane), ptx::opaque(warp_row0));
      }
      if constexpr (kOInRing) {  // the rings (and Q) may take the next item's tiles now
        __syncwarp();
        if (lane == 0) {
          if constexpr (kTmaStore) ptx::bulk_wait_read<0>();  // the store has read the rows
          ptx::mbar_arrive(bar.empty_q());
        }
      }
      ++local;
    }
    if constexpr (kTmaStore) {
      if (lane == 0) ptx::bulk_wait<0>();  // the CTA's shared memory outlives its stores
    }
  }

  // The epilogue through a TMA store (padded layout, kTmaStore, when the host could make the
  // output's tensor map): O / l and LSE as FwdEpilogue computes them, the warp's 16 rows staged
  // in the layout of the O map's boxes (64-column panels of 16 rows x 128 bytes, 128-byte swizzle:
  // chunk c of row r at c ^ (r mod 8), which also spreads a warp's 4-byte writes over all 32
  // banks), then one bulk tensor store per panel issued by lane 0, which the warp does not wait
  // for: its next item's epilogue first waits until the previous stores have read the rows.
  // The map clips rows past seqlen_q and columns past head_dim.
  static __device__ __forceinline__ void epilogue_tma(const Params& P, const Accum& acc, unsigned char* smem,
                                                      uint32_t s0, int b, int h, int q_lo, int Nq, int lane,
                                                      int warp_row0) {
    const BaseParams& p = P.base;
    constexpr float kLn2 = 0.6931471805599453f;
    const int g = lane >> 2, t = lane & 3;
    const int off = kOffO + (warp_row0 / 16) * (kPanels * 2048);
    unsigned char* w = smem + off;
    if (lane == 0) ptx::bulk_wait_read<0>();  // this warp's previous store is done with the rows
    __syncwarp();
    float* lse_g = p.lse ? p.lse + (cuda::wide(b) * p.heads_q + h) * Nq : nullptr;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = acc.row_sum[0][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const bool has = cuda::row_has_keys(l);  // l == 0: empty; NaN: out and LSE NaN
      float inv = has ? 1.f / l : 0.f;
      if constexpr (Variant::kHasDropout) {
        if (p.dropout.state) inv *= p.dropout.scale;
      }
      const int r = g + half * 8;
#pragma unroll
      for (int dn = 0; dn < kD / 8; ++dn) {
        const float v0 = has ? acc.o[0][dn][2 * half] * inv : 0.f;
        const float v1 = has ? acc.o[0][dn][2 * half + 1] * inv : 0.f;
        *reinterpret_cast<uint32_t*>(w + (dn / 8) * 2048 + r * 128 + (((dn % 8) ^ (r & 7)) << 4) + 4 * t) =
            cuda::ptx::pack2<Element>(v0, v1);
      }
      const int q = q_lo + warp_row0 + r;
      if (lse_g && t == 0 && q < Nq) {
        lse_g[q] = has ? (acc.row_max[0][half] + cuda::ptx::log2_approx(l)) * kLn2 : -INFINITY;
      }
    }
    ptx::fence_proxy_async();  // the generic writes above, before the TMA unit reads them
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn) {
        ptx::tma_store_4d(&P.to, s0 + off + pn * 2048, pn * 64, q_lo + warp_row0, h, b);
      }
      ptx::bulk_commit();
    }
  }

  static __device__ __forceinline__ void run(const Params& P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // The 1024-byte aligned base as an offset into smem_raw (not an integer round trip), so that
    // the compiler still knows the pointer is shared memory: LDS/STS instead of generic LD/ST.
    unsigned char* smem = smem_raw + ((1024u - (ptx::smem_addr(smem_raw) & 1023u)) & 1023u);
    const uint32_t s0 = ptx::smem_addr(smem);
    const Bars bar{s0 + kOffBar};
    // wg through a shuffle: warp-uniform to the compiler (shared-memory addresses and wgmma
    // descriptors derived from it then live in uniform registers).
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    if (tid == 0) {
      ptx::mbar_init(bar.full_q(), 1);
      ptx::mbar_init(bar.empty_q(), kConsumerWarps);
      ptx::mbar_init(bar.aux_v(), 1);
      for (int s = 0; s < kStages; ++s) {
        ptx::mbar_init(bar.full_k(s), 1);
        ptx::mbar_init(bar.empty_k(s), kConsumerWarps);
        ptx::mbar_init(bar.full_v(s), 1);
        ptx::mbar_init(bar.empty_v(s), kConsumerWarps);
      }
      ptx::fence_barrier_init();
    }
    __syncthreads();
    if (wg == 0) {
      ptx::reg_dealloc<Tile::kProducerRegs>();
      if (warp == 0) produce(P, s0, bar, lane);
    } else {
      ptx::reg_alloc<Tile::kConsumerRegs>();
      consume(P, smem, s0, bar, wg - 1, warp % 4, lane);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    fwd_kernel(const __grid_constant__ typename Kernel::Params params) {
#if defined(FG_SM90A)
  Kernel::run(params);
#else
  __trap();  // the sm90 family needs sm_90a (wgmma, setmaxnreg)
#endif
}

template <class Variant, class Element, int kHeadDim, class Tile, bool kSparse = false, bool kPacked = false>
int launch_fwd(const FgFwdArgs& a) {
  using K = Sm90Fwd<Variant, Element, kHeadDim, Tile, kSparse, kPacked>;
  using P = typename K::Params;
  static_assert(K::kSmem <= 227 * 1024, "the sm90 forward's tiles exceed shared memory");
  P p;
  memset(&p, 0, sizeof(p));
  int dev = 0;
  bool empty = false;
  int st = cuda::fwd_prelude<Variant, Element, kHeadDim, kPacked, kSparse, K::kBlockM, K::kBlockN>(
      a, p.base, dev, empty);
  if (st != FG_OK || empty) return st;
  constexpr bool kBf16 = std::is_same<Element, __nv_bfloat16>::value;
  // Packed batches: one batch of total rows (cu_seqlens locate each sequence's).
  const int64_t nb = kPacked ? 1 : a.batch;
  const int64_t rows_q = kPacked ? a.total_q : a.seqlen_q, rows_k = kPacked ? a.total_k : a.seqlen_k;
  p.rows_k = rows_k;
  p.batch = int(a.batch);
  // Packed: heads_q * slot(batch) items, slot(batch) <= batch + total_q / kBlockM (``coord``).
  if (kPacked) p.base.total_work = a.heads_q * (a.batch + a.total_q / K::kBlockM);
  // The dynamic schedule where the host passed its queue (packed only; ranks are int32: every
  // CTA draws at most one rank past the table, so the table plus a grid must fit).
  const bool dyn = kPacked && a.work.counter != nullptr && a.work.order != nullptr &&
                   p.base.total_work < int64_t(INT32_MAX) - FLASHGEN_SM90_FWD_MAX_DYN_GRID;
  p.work_counter = dyn ? a.work.counter : nullptr;
  p.work_order = dyn ? a.work.order : nullptr;
  st = detail::make_tmap(&p.tq, a.q, kBf16, nb, a.heads_q, rows_q, a.head_dim, kPacked ? 0 : a.q_stride_b,
                         a.q_stride_h, a.q_stride_n, K::kBlockM, "q");
  if (st != FG_OK) return st;
  if (a.seqlen_k > 0 && rows_k > 0) {
    st = detail::make_tmap(&p.tk, a.k, kBf16, nb, a.heads_kv, rows_k, a.head_dim,
                           kPacked ? 0 : a.k_stride_b, a.k_stride_h, a.k_stride_n, K::kBlockN, "k");
    if (st != FG_OK) return st;
    st = detail::make_tmap(&p.tv, a.v, kBf16, nb, a.heads_kv, rows_k, a.head_dim,
                           kPacked ? 0 : a.v_stride_b, a.v_stride_h, a.v_stride_n, K::kBlockN, "v");
    if (st != FG_OK) return st;
  }
  // The TMA store unless the output's strides rule it out or FLASHGEN_SM90_TMA_STORE=0 (a
  // diagnostic switch, read per launch: A/B timings in one process).
  const char* tma_env = getenv("FLASHGEN_SM90_TMA_STORE");
  if (K::kTmaStore && a.seqlen_q > 0 && !(tma_env && tma_env[0] == '0')) {
    p.tma_store = detail::make_tmap(&p.to, a.out, kBf16, a.batch, a.heads_q, a.seqlen_q, a.head_dim, a.o_stride_b,
                                    a.o_stride_h, a.o_stride_n, 16, "out") == FG_OK;
  }
  auto kernel = &fwd_kernel<K>;
  static std::atomic<uint64_t> configured{0};
  st = cuda::detail::ensure_smem(kernel, K::kSmem, configured, dev, "sm90 forward kernel");
  if (st != FG_OK) return st;
  int64_t cap = FLASHGEN_SM90_FWD_MAX_GRID;
  if (dyn || a.seqlen_k <= Tile::kPersistentMaxSeqlenK) {  // persistent (the dynamic schedule always)
    int sms = a.num_sms;
    if (sms <= 0 && cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) sms = 132;
    cap = sms < cap ? sms : cap;
  }
  kernel<<<cuda::detail::grid_for(p.base.total_work, cap), K::kThreads, K::kSmem,
           static_cast<cudaStream_t>(a.stream)>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda::detail::fail_cuda(FG_ERR_LAUNCH, "sm90 forward kernel launch", err);
  return FG_OK;
}

}  // namespace sm90
}  // namespace flashgen
