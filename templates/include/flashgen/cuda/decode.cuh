// flashgen CUDA decode kernels (the sm80 family; op.with_kvcache, args.h FgKvCache): split-KV
// attention of a few query rows per sequence against a contiguous or paged KV cache
// (flash-decoding), on mma.sync m16n8k16 tensor cores. Runs on sm_80 and newer (sm_90a too).
//
// Semantics (args.h, FgKvCache; the same as the CPU family's cpu/kvcache.h and fwd_kvcache):
// sequence b holds n = seqlens[b] cached keys in slots [pad, n) (pad = leftpad[b] or 0); k_new /
// v_new are written into slots [n, n + seqlen_new) first; its length is L = n + seqlen_new - pad,
// key j is slot pad + j, query row i is position L - Sq + i, and every hook sees seqlen_q =
// seqlen_k = L and those absolute positions: the result is the last Sq rows of the prefill call
// on the whole sequence. Rows at negative positions get out 0 and lse -inf.
//
// Three kernels, launched in this order on the caller's stream (no host synchronisation; a
// fixed-shape decode step is CUDA-graph capturable):
//
//  1. decode_append_kernel (only with k_new): one CTA per sequence checks the sequence (below)
//     and, when it is valid, copies its seqlen_new new rows of every kv head into the cache
//     (16-byte vectors; a paged slot goes through block_table). Because it finishes before the
//     attention kernel starts (stream order), the attention sees the appended keys, as the CPU
//     family's append-then-attend order does.
//
//  2. decode_kernel: one CTA (2 or 4 warps) per (sequence b, kv head hk, row tile mt, split s), a
//     flat 1-D grid with mt fastest (the row tiles of one split read the same keys back to
//     back, from L2), then for a paged cache hk, s, b (the kv heads' rows of one slot are
//     interleaved in a page, so CTAs of neighbouring heads read the same pages at the same
//     time), for a contiguous one s, hk, b (decode_cta, the one place the grid is decoded;
//     FLASHGEN_DECODE_HEADS_FIRST=0 / 1 forces either order, a diagnostic switch). The M side
//     of the tensor-core tiles is the GQA group's query rows: row R = r * Sq + i (r the head
//     within the group, i the query) of the group's group * Sq rows, 16 rows per row tile
//     (padded: rows past group * Sq are zero-filled and never written), so the group size and
//     Sq are runtime values and one kernel serves every GQA ratio. Q of the tile stays in shared
//     memory. The keys the tile may see are the union of the rows' closed-form ranges
//     [Variant::kv_lo, Variant::kv_hi) (one row each, evaluated in the kernel from the
//     device-side L): a sliding window reads only the window. That range is cut
//     into num_splits pieces of whole kBlockN-key tiles, piece s to split s (the split count is
//     the host's, the cut the device's, from the real lengths). The split's key tiles stream
//     through shared memory in a kStages-deep cp.async ring (one __syncthreads per tile); within
//     a tile each warp owns 16 keys: S = Q K^T (16 rows x 16 keys, K via ldmatrix), the mask
//     (row bounds for row-exact masks, else Variant::keep per element) and score hooks, an
//     online softmax per warp (running max and sum, O rescaled), then O += P V (P from the S
//     accumulators, V via ldmatrix.trans). At the end the warps' (m, l, O) are merged
//     through shared memory. With one split the CTA writes out (input dtype) and lse directly;
//     with several it writes its fp32 partial (O normalised by its own sum, and its LSE) into
//     the workspace: o_accum [splits, B, Hq, Sq, d], lse_accum [splits, B, Hq, Sq].
//     Paged caches: each key row's slot is mapped through block_table (page size a runtime
//     value, 1..256: a shift and mask where it is a power of two, else a division) once per key
//     row per tile: two threads per row (K, V) compute the row's element offsets one iteration
//     before the tile's copies are issued and leave them in the padding columns of the row in
//     the tile's K stage, where every copy of the row reads them behind the next barrier
//     (FLASHGEN_DECODE_ROW_LOOKUP=0, a diagnostic switch: the page looked up per 16-byte chunk
//     as the copy is issued). Page indices are clamped into [0, num_pages) wherever they are
//     used, so no value reads out of bounds; the table is read only for keys before kv_end.
//     Opt-in bulk-copy variant (FLASHGEN_CUDA_DECODE_BULK=1 or 2: config decode_bulk,
//     DecodeBulkTile; sm_90 and newer; an A/B switch for the load path: +0.6-3% with 1 and
//     0.6-0.7x with 2 on an H100, docs/perf-notes.md): the K/V tiles come by 1-D TMA bulk copies (cp.async.bulk), one per key row of K and
//     one of V (kD elements into the row's place at the padded pitch: the consumers, the row
//     offsets and the arithmetic are the default's), each completing on its stage's mbarrier,
//     whose phase it / kStages is tile it (expect_tx: the bytes of the tile's rows before
//     kv_end, announced before the copies are issued). 1: thread tid copies row tid / 2 of K or
//     V (lane 0 of each warp announces its warp's bytes); 2: warp 0 copies every row. A copy's
//     operands are uniform registers, so a warp issues its lanes' copies one by one (an ELECT
//     loop: 32 per warp per tile with 1, 4 x 32 in warp 0 with 2 at 64 keys). Rows at or past
//     kv_end are zeroed by ordinary stores in the same step (a bulk copy cannot zero-fill); the
//     loop's __syncthreads between a tile's issue and its use (at least one: kStages >= 2)
//     makes them visible to every warp, and frees a stage only once every warp has read it, as
//     in the default. Only a split's last tile has such rows, so no bulk copy ever follows a
//     zero store into the same bytes. Q still comes by cp.async.
//
//  3. decode_combine_kernel (num_splits > 1): one warp (four from 8 splits on) per query row
//     merges the splits by their LSEs (on sm_90 a programmatic dependent launch: launch_combine): M = max lse_s; w_s = exp(lse_s - M); out = sum w_s O_s / sum w_s; lse = M + log sum
//     w_s. A split with lse -inf weighs 0 and its O is never read (no NaN from it); every split
//     -inf: out 0, lse -inf; any split NaN: out and lse NaN.
//
// Why not the forward's mainloop step (fwd_mainloop.cuh): there each warp owns 16 or 32 query
// rows of a 64-128-row tile and every warp walks every key; a decode tile has 16 rows in all,
// so here the warps share the rows and split each key tile between them (16 keys each), and
// their softmax states are merged once at the end. The building blocks are shared
// (mainloop.cuh: lane offsets, row bounds of row-exact masks; ptx.cuh).
//
// Bad device values: a sequence is invalid when pad < 0, pad > n, n + seqlen_new > capacity,
// or (paged) a page index of one of the slots [pad, n + seqlen_new) lies outside
// [0, num_pages). The append kernel checks everything and writes nothing for an invalid
// sequence. An attention CTA checks the sizes, and its share of the sequence's pages (the page
// range cut into num_splits pieces, piece s checked by split s); a CTA that finds its sequence
// invalid writes NaN (direct: out and lse; split: its partial), so the combine's NaN rule makes
// every row of the sequence NaN, never a plausible wrong number. A CTA reads keys only after the
// size checks pass (every slot it reads is then inside [0, capacity)), and through clamped page
// indices.
//
// Non-finite values (DESIGN.md): a NaN or +inf score at a kept key makes the row's out and lse
// NaN; a -inf score counts as masked; NaN/inf in V at a kept key reaches the row. Keys outside
// the split's range (and past L) are zero-filled in shared memory, so they never reach a row;
// within a loaded tile a key masked for some rows multiplies their P of exactly 0.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <atomic>
#include <type_traits>

#include "flashgen/args.h"
#include "flashgen/cuda/host.cuh"
#include "flashgen/cuda/mainloop.cuh"
#include "flashgen/cuda/ptx.cuh"
#include "flashgen/cuda/status.cuh"
#include "flashgen/variant.h"

namespace flashgen {
namespace cuda {

// The decode kernel's tile, chosen per instantiation by the family (flashgen/families/sm80.py,
// decode_tile): kBlockN keys per shared-memory stage, 16 per warp (64: 4 warps; 32: 2 warps, for
// d = 256 or small shared memories), kStages stages; kSmem is the host's figure for the dynamic
// shared memory, checked against the kernel's own below.
template <int kBlockN_, int kStages_, int kSmem_>
struct DecodeTile {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kSmem = kSmem_;
  static constexpr int kWarps = kBlockN / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBulk = 0;  // K/V tiles by 16-byte cp.async (DecodeBulkTile: by bulk copies)
  static constexpr int kKeys = 0;  // queries on the M side (DecodeKeysTile, cuda/decode_keys.cuh: keys)
  static_assert(kBlockN == 32 || kBlockN == 64 || kBlockN == 128, "16 keys per warp, 2 to 8 warps");
  static_assert(kStages >= 2 && kStages <= 4, "2 to 4 pipeline stages");
};

// The opt-in bulk-copy variant's tile (config decode_bulk, FLASHGEN_CUDA_DECODE_BULK; sm_90 and
// newer): the same tile whose K/V rows are loaded by 1-D TMA bulk copies, issued by every warp
// for its own 16 rows (kBulk 1) or by warp 0 for all of them (kBulk 2). kSmem includes the
// stages' mbarriers (32 bytes after the rest).
template <int kBlockN_, int kStages_, int kSmem_, int kBulk_>
struct DecodeBulkTile : DecodeTile<kBlockN_, kStages_, kSmem_> {
  static constexpr int kBulk = kBulk_;
  static_assert(kBulk == 1 || kBulk == 2, "decode_bulk: 1 (every warp issues its rows) or 2 (one warp)");
};

template <class Element, class VParams>
struct DecodeParams {
  const Element* q;
  const Element* k;
  const Element* v;
  Element* o;
  float* lse;
  float* o_accum;  // splits > 1: fp32 [splits, B, Hq, Sq, d]
  float* lse_accum;  // splits > 1: fp32 [splits, B, Hq, Sq]
  const int* seqlens;
  const int* leftpad;  // nullable
  const int* table;    // nullable: contiguous cache
  const Element* k_new;  // nullable (append kernel)
  const Element* v_new;
  int64_t table_stride, num_pages;
  int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn;
  int64_t kn_sb, kn_sh, kn_sn, vn_sb, vn_sh, vn_sn;
  int64_t rows_all;  // B * Hq * Sq
  int batch, heads_q, heads_kv, group, sq, page_size, capacity, seqlen_new, splits, m_tiles;
  int page_shift;   // log2(page_size) where it is a power of two, else -1
  int row_lookup;   // paged: one page lookup per key row per tile (0: one per 16-byte chunk)
  int heads_first;  // the grid's order: 1 (mt, hk, split, b), 0 (mt, split, hk, b)
  float scale, scale_log2;
  VParams vp;
};

namespace detail {

// Sequence b's sizes: valid (pad, n and the append inside the capacity), its first slot and
// length. Page indices are checked separately (decode_pages_bad).
struct DecodeSeq {
  bool ok;
  int pad, n, len;
};

template <class P>
__device__ __forceinline__ DecodeSeq decode_seq(const P& p, int b) {
  const int64_t n = p.seqlens[b];
  const int64_t pad = p.leftpad ? p.leftpad[b] : 0;
  const int64_t end = n + p.seqlen_new;
  const bool ok = pad >= 0 && pad <= n && end <= p.capacity;
  DecodeSeq s;
  s.ok = ok;
  s.pad = ok ? int(pad) : 0;
  s.n = ok ? int(n) : 0;
  s.len = ok ? int(end - pad) : 0;
  return s;
}

// True (in every thread of the CTA) when a page index among pieces `piece` of `pieces` of the
// pages that hold slots [pad, pad + len) of sequence b lies outside the pool. A CTA-wide call.
template <class P>
__device__ __forceinline__ bool decode_pages_bad(const P& p, int b, const DecodeSeq& s, int piece,
                                                 int pieces, int tid, int nthreads) {
  bool bad = false;
  if (p.table && s.ok && s.len > 0) {
    const int ps = p.page_size;
    const int first = s.pad / ps, last = (s.pad + s.len - 1) / ps;
    const int count = last - first + 1;
    const int share = (count + pieces - 1) / pieces;
    const int lo = first + piece * share;
    const int hi = imin(last + 1, lo + share);
    const int* row = p.table + int64_t(b) * p.table_stride;
    for (int pg = lo + tid; pg < hi; pg += nthreads) {
      const int idx = row[pg];
      bad |= idx < 0 || int64_t(idx) >= p.num_pages;
    }
  }
  return __syncthreads_or(bad) != 0;
}

// Element offset of slot `slot` of sequence b, kv head hk, in a cache with strides (sb, sh, sn):
// contiguous: b's rows; paged: the slot's page (clamped into the pool) and row within it.
template <class P>
__device__ __forceinline__ int64_t decode_slot(const P& p, int b, int hk, int slot, int64_t sb,
                                               int64_t sh, int64_t sn) {
  if (p.table) {
    const int ps = p.page_size;
    int64_t pg = p.table[int64_t(b) * p.table_stride + slot / ps];
    pg = pg < 0 ? 0 : (pg >= p.num_pages ? p.num_pages - 1 : pg);
    return pg * sb + int64_t(hk) * sh + int64_t(slot % ps) * sn;
  }
  return int64_t(b) * sb + int64_t(hk) * sh + int64_t(slot) * sn;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ int warp_min_i(int x) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) x = imin(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ int warp_max_i(int x) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) x = imax(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

}  // namespace detail

// ------------------------------------------------------------------ 1. append

template <class Element, int kHeadDim, class P>
__global__ void __launch_bounds__(128) decode_append_kernel(const P p) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte vectors per row
  const int b = blockIdx.x, tid = threadIdx.x;
  const detail::DecodeSeq s = detail::decode_seq(p, b);
  if (!s.ok) return;  // uniform over the CTA
  if (detail::decode_pages_bad(p, b, s, 0, 1, tid, blockDim.x)) return;
  Element* K = const_cast<Element*>(p.k);
  Element* V = const_cast<Element*>(p.v);
  const int64_t total = int64_t(p.heads_kv) * p.seqlen_new * kChunks;
  for (int64_t c = tid; c < total; c += blockDim.x) {
    const int cc = int(c % kChunks);
    const int j = int(c / kChunks % p.seqlen_new);
    const int hk = int(c / (int64_t(kChunks) * p.seqlen_new));
    const int slot = s.n + j;
    const int64_t ko = detail::decode_slot(p, b, hk, slot, p.k_sb, p.k_sh, p.k_sn) + cc * 8;
    const int64_t vo = detail::decode_slot(p, b, hk, slot, p.v_sb, p.v_sh, p.v_sn) + cc * 8;
    const Element* kn = p.k_new + int64_t(b) * p.kn_sb + int64_t(hk) * p.kn_sh + int64_t(j) * p.kn_sn;
    const Element* vn = p.v_new + int64_t(b) * p.vn_sb + int64_t(hk) * p.vn_sh + int64_t(j) * p.vn_sn;
    *reinterpret_cast<uint4*>(K + ko) = *reinterpret_cast<const uint4*>(kn + cc * 8);
    *reinterpret_cast<uint4*>(V + vo) = *reinterpret_cast<const uint4*>(vn + cc * 8);
  }
}

// ------------------------------------------------------------------ 2. attention

template <class Variant, class Element, int kHeadDim, class Tile>
struct DecodeKernel {
  using Params = DecodeParams<Element, typename Variant::Params>;
  static_assert(kHeadDim % 16 == 0 && kHeadDim >= 16 && kHeadDim <= 256,
                "decode kernels take head dims that are multiples of 16 up to 256");
  static constexpr int kD = kHeadDim;
  static constexpr int kPitch = kD + 8;  // padded rows (mainloop.cuh, HeadDim)
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kWarps = Tile::kWarps;
  static constexpr int kRows = 16;  // query rows per CTA (one m16 atom)
  static constexpr int kE = int(sizeof(Element));
  static constexpr int kDBlocks = kD / 8;
  static constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks
  // Copies: chunk c of pass i is thread tid's c = tid + i * kThreads, row c / kChunksPerRow.
  // Where a pass covers whole rows (d 16, 32, 64, 128, 256), a thread keeps one column chunk and
  // steps kRowStep rows per pass; otherwise (d 48, 80, 96, ...) rows and chunks come from c.
  static constexpr bool kWholeRows = kThreads % kChunksPerRow == 0;
  static constexpr int kRowStep = kWholeRows ? kThreads / kChunksPerRow : 1;
  static __device__ __forceinline__ void chunk_of(int tid, int i, int& r, int& cc) {
    if constexpr (kWholeRows) {
      r = tid / kChunksPerRow + i * kRowStep;
      cc = tid % kChunksPerRow;
    } else {
      const int c = tid + i * kThreads;
      r = c / kChunksPerRow;
      cc = c % kChunksPerRow;
    }
  }
  static constexpr int kQBytes = kRows * kPitch * kE;
  static constexpr int kStageBytes = 2 * kBlockN * kPitch * kE;  // K and V of one tile
  static constexpr int kPipeBytes = kQBytes + kStages * kStageBytes;
  // The warps' merge after the loop reuses the pipeline's memory: O [warps][16][kD + 4] fp32,
  // then m, l [warps][16] and the rows' NaN flags [warps][16].
  static constexpr int kOPitch = kD + 4;
  static constexpr int kMergeBytes = kWarps * kRows * kOPitch * 4 + 3 * kWarps * kRows * 4;
  // The bulk variant's kStages mbarriers (8 bytes each) come after both, never reused.
  static constexpr int kBulk = Tile::kBulk;
  static constexpr int kBarOffset = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static constexpr int kSmem = kBarOffset + (kBulk ? 32 : 0);
  static_assert(kBarOffset % 16 == 0 && 8 * kStages <= 32, "the mbarriers: 8-byte aligned, 32 bytes");
  static_assert(Tile::kKeys || kSmem == Tile::kSmem, "the family's shared-memory figure (sm80.py decode_tile) "
                                                      "is the kernel's (DecodeKeysKernel checks its own)");
  static constexpr float kLog2e = 1.4426950408889634f;
  static constexpr float kLn2 = 0.6931471805599453f;

  // Paged caches with p.row_lookup: the element offsets of key row r of a tile (K at byte 0, V at
  // byte 8: page, head and row within the page, no column) sit in the padding columns
  // [kD, kPitch) of row r of the tile's K stage, which no ldmatrix reads and no copy writes.
  static_assert((kPitch - kD) * kE >= 16, "16 bytes of row padding hold a key row's offsets");
  static_assert(kThreads == 2 * kBlockN, "two threads per key row (K, V) compute the offsets");
  static constexpr int kOffsetByte = kD * kE;

  // The offset thread tid computes for tile row tid / 2 (key j = kv0 + tid / 2): K's for even tid,
  // V's for odd. One block_table read and a shift/mask (page sizes that are powers of two) or a
  // division; the page index clamped into [0, num_pages) as in decode_slot; 0 past kv_end (the
  // table is not read there).
  static __device__ __forceinline__ int64_t row_offset(const Params& p, int b, int hk, int pad, int kv0,
                                                       int kv_end, int tid) {
    const int j = kv0 + (tid >> 1);
    if (j >= kv_end) return 0;
    const int slot = pad + j;
    int pi, row;
    if (p.page_shift >= 0) {
      pi = slot >> p.page_shift;
      row = slot & (p.page_size - 1);
    } else {
      pi = slot / p.page_size;
      row = slot - pi * p.page_size;
    }
    int64_t pg = p.table[int64_t(b) * p.table_stride + pi];
    pg = pg < 0 ? 0 : (pg >= p.num_pages ? p.num_pages - 1 : pg);
    return (tid & 1) ? pg * p.v_sb + int64_t(hk) * p.v_sh + int64_t(row) * p.v_sn
                     : pg * p.k_sb + int64_t(hk) * p.k_sh + int64_t(row) * p.k_sn;
  }
  // Where thread tid stores its row_offset in the K stage whose generic address is `stage`.
  static __device__ __forceinline__ int64_t* row_offset_slot(char* stage, int tid) {
    return reinterpret_cast<int64_t*>(stage + ((tid >> 1) * kPitch) * kE + kOffsetByte) + (tid & 1);
  }

  // Key rows [kv0, kv0 + kBlockN) of the split (rows at or past kv_end zero-filled) into a stage
  // (sK, sV; gK: sK's generic address, whose padding holds the rows' offsets when `rows`), by
  // 16-byte cp.async (the default; the bulk variant: load_kv_bulk).
  static __device__ __forceinline__ void load_kv(uint32_t sK, uint32_t sV, const char* gK, bool rows,
                                                 const Params& p, int b, int hk, int pad, int kv0,
                                                 int kv_end, int tid) {
#pragma unroll
    for (int i = 0; i < (kBlockN * kChunksPerRow + kThreads - 1) / kThreads; ++i) {
      int r, cc;
      chunk_of(tid, i, r, cc);
      if ((kBlockN * kChunksPerRow) % kThreads != 0 && r >= kBlockN) break;
      const int j = kv0 + r;
      const bool ok = j < kv_end;
      int64_t ko = 0, vo = 0;
      if (ok) {
        if (rows) {
          const longlong2 off = *reinterpret_cast<const longlong2*>(gK + (r * kPitch) * kE + kOffsetByte);
          ko = off.x;
          vo = off.y;
        } else if (p.table) {
          const int slot = pad + j, ps = p.page_size;
          int64_t pg = p.table[int64_t(b) * p.table_stride + slot / ps];
          pg = pg < 0 ? 0 : (pg >= p.num_pages ? p.num_pages - 1 : pg);
          const int64_t row = slot % ps;
          ko = pg * p.k_sb + int64_t(hk) * p.k_sh + row * p.k_sn;
          vo = pg * p.v_sb + int64_t(hk) * p.v_sh + row * p.v_sn;
        } else {
          const int64_t slot = pad + j;
          ko = int64_t(b) * p.k_sb + int64_t(hk) * p.k_sh + slot * p.k_sn;
          vo = int64_t(b) * p.v_sb + int64_t(hk) * p.v_sh + slot * p.v_sn;
        }
      }
      const uint32_t dst = (r * kPitch + cc * 8) * kE;
      ptx::cp_async_16(sK + dst, ok ? p.k + ko + cc * 8 : p.k, ok);
      ptx::cp_async_16(sV + dst, ok ? p.v + vo + cc * 8 : p.v, ok);
    }
  }

  // ---------------------------------------------------------------- the bulk-copy variant
  // (kBulk; sm_90 and newer). One 1-D bulk copy per key row of K and of V (kRowBytes each) into
  // the row's place at pitch kPitch (the padding columns are not written, so the consumers and
  // the row offsets are as above), completing on the stage's mbarrier; rows at or past kv_end
  // are zeroed by ordinary stores (zero_rows). The launcher's alignment check (16-byte aligned
  // bases, strides in multiples of 8 elements) makes every source row 16-byte aligned.
  static constexpr int kRowBytes = kD * kE;
  static_assert(kRowBytes % 16 == 0 && (kPitch * kE) % 16 == 0 && kQBytes % 16 == 0 && kStageBytes % 16 == 0,
                "bulk copies move multiples of 16 bytes between 16-byte aligned addresses");
  // Arrivals that complete a stage's phase: one per warp (kBulk 1), or warp 0's (kBulk 2); each
  // announces the bytes of the copies it issues (expect_tx) before issuing them.
  static constexpr int kBarArrivals = kBulk == 2 ? 1 : kWarps;

  // The element offset of key row j (< kv_end; tile row r) of K (v false) or V: the row's offset
  // in the stage padding (rows, row_offset), else detail::decode_slot's (its page clamped into
  // the pool, or its contiguous slot).
  static __device__ __forceinline__ int64_t row_src(const Params& p, const char* gK, bool rows, int b, int hk,
                                                    int pad, int r, int j, bool v) {
    if (rows) return *reinterpret_cast<const int64_t*>(gK + (r * kPitch) * kE + kOffsetByte + 8 * int(v));
    return detail::decode_slot(p, b, hk, pad + j, v ? p.v_sb : p.k_sb, v ? p.v_sh : p.k_sh, v ? p.v_sn : p.k_sn);
  }

  // Zeroes rows [first, kBlockN) of a stage's K and V (their kD columns), 16 bytes a store.
  static __device__ __forceinline__ void zero_rows(char* gK, char* gV, int first, int tid) {
#pragma unroll
    for (int i = 0; i < (kBlockN * kChunksPerRow + kThreads - 1) / kThreads; ++i) {
      int r, cc;
      chunk_of(tid, i, r, cc);
      if ((kBlockN * kChunksPerRow) % kThreads != 0 && r >= kBlockN) break;
      if (r >= first) {
        const int at = (r * kPitch + cc * 8) * kE;
        *reinterpret_cast<uint4*>(gK + at) = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(gV + at) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }

  // load_kv by bulk copies completing on `bar` (the stage's mbarrier, whose phase the consumers
  // wait for; gK: sK's generic address). kBulk 1: thread tid copies row tid / 2 of K (even tid)
  // or V (odd), lane 0 of each warp first announcing its warp's bytes; kBulk 2: warp 0 copies
  // every row, lane 0 announcing them all. Called CTA-wide (zero_rows) with the tile's kv0.
  static __device__ __forceinline__ void load_kv_bulk(uint32_t sK, uint32_t sV, char* gK, uint32_t bar, bool rows,
                                                      const Params& p, int b, int hk, int pad, int kv0,
                                                      int kv_end, int tid) {
    const int valid = imin(kBlockN, kv_end - kv0);  // rows before kv_end: at least 1
    const int warp = tid / 32, lane = tid % 32;
    if constexpr (kBulk == 1) {
      const int mine = imax(0, imin(16, valid - 16 * warp));  // the warp's rows 16 warp ..
      if (lane == 0) ptx::mbar_arrive_expect_tx(bar, uint32_t(mine * 2 * kRowBytes));
      __syncwarp();  // the bytes announced before any of the warp's copies can complete
      const int r = tid >> 1;
      const bool v = (tid & 1) != 0;
      if (r < valid) {
        const int64_t off = row_src(p, gK, rows, b, hk, pad, r, kv0 + r, v);
        ptx::bulk_g2s((v ? sV : sK) + uint32_t(r * kPitch * kE), (v ? p.v : p.k) + off, kRowBytes, bar);
      }
    } else {
      if (warp == 0) {
        if (lane == 0) ptx::mbar_arrive_expect_tx(bar, uint32_t(valid * 2 * kRowBytes));
        __syncwarp();
#pragma unroll
        for (int i = 0; i < kBlockN / 32; ++i) {
          const int r = lane + 32 * i;
          if (r < valid) {
            const int64_t ko = row_src(p, gK, rows, b, hk, pad, r, kv0 + r, false);
            const int64_t vo = row_src(p, gK, rows, b, hk, pad, r, kv0 + r, true);
            ptx::bulk_g2s(sK + uint32_t(r * kPitch * kE), p.k + ko, kRowBytes, bar);
            ptx::bulk_g2s(sV + uint32_t(r * kPitch * kE), p.v + vo, kRowBytes, bar);
          }
        }
      }
    }
    if (valid < kBlockN) zero_rows(gK, gK + kStageBytes / 2, valid, tid);  // uniform: the split's last tile
  }

  // CTA `w` of the flat grid: row tile mt fastest, then (heads_first) kv head, split, sequence,
  // else split, kv head, sequence. The only place the grid is decoded.
  static __device__ __forceinline__ void decode_cta(const Params& p, int64_t w, int& mt, int& split, int& hk,
                                                    int& b) {
    mt = int(w % p.m_tiles);
    w /= p.m_tiles;
    if (p.heads_first) {
      hk = int(w % p.heads_kv);
      w /= p.heads_kv;
      split = int(w % p.splits);
      b = int(w / p.splits);
    } else {
      split = int(w % p.splits);
      w /= p.splits;
      hk = int(w % p.heads_kv);
      b = int(w / p.heads_kv);
    }
  }

  // The query row R of the group (R = r * Sq + i): its head and query index.
  static __device__ __forceinline__ void row_of(const Params& p, int hk, int R, int& h, int& i) {
    h = hk * p.group + R / p.sq;
    i = R % p.sq;
  }

  // Writes row `row` of the tile (its final out and lse, or the split's partial). o: the row's
  // kD values (normalised), lse natural log. Threads of one row write disjoint 4-column chunks.
  static __device__ __forceinline__ void write_row(const Params& p, int b, int hk, int split,
                                                   int R, const float* o, float lse, int chunk0,
                                                   int chunk_step) {
    int h, i;
    row_of(p, hk, R, h, i);
    const int64_t row = (int64_t(b) * p.heads_q + h) * p.sq + i;
    if (p.splits > 1) {
      float* dst = p.o_accum + (int64_t(split) * p.rows_all + row) * kD;
      for (int c = chunk0; c < kD / 4; c += chunk_step)
        *reinterpret_cast<float4*>(dst + 4 * c) = make_float4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
      if (chunk0 == 0) p.lse_accum[int64_t(split) * p.rows_all + row] = lse;
    } else {
      Element* dst = p.o + int64_t(b) * p.o_sb + int64_t(h) * p.o_sh + int64_t(i) * p.o_sn;
      for (int c = chunk0; c < kD / 4; c += chunk_step) {
        uint2 v;
        v.x = ptx::pack2<Element>(o[4 * c], o[4 * c + 1]);
        v.y = ptx::pack2<Element>(o[4 * c + 2], o[4 * c + 3]);
        *reinterpret_cast<uint2*>(dst + 4 * c) = v;
      }
      if (chunk0 == 0) p.lse[row] = lse;
    }
  }

  // The warps' merge buffers in the pipeline's (free) shared memory, for tiles of kR rows: O
  // [kWarps][kR][kOPitch] fp32, then m, l and the rows' NaN flags [kWarps][kR] each.
  template <int kR>
  static __device__ __forceinline__ void merge_buffers(char* smem, float*& mO, float*& mM, float*& mL, int*& mBad) {
    mO = reinterpret_cast<float*>(smem);
    mM = mO + kWarps * kR * kOPitch;
    mL = mM + kWarps * kR;
    mBad = reinterpret_cast<int*>(mL + kWarps * kR);
  }

  // Every row of a tile of kR rows from row0 written NaN (out and lse, or the split's partial): a
  // sequence with bad device values. A CTA-wide call (one barrier).
  template <int kR>
  static __device__ __forceinline__ void write_nan_rows(const Params& p, char* smem, int b, int hk, int split, int row0,
                                                        int rows_total, int tid) {
    float* sO = reinterpret_cast<float*>(smem);
    for (int e = tid; e < kR * kD; e += kThreads) sO[e] = __int_as_float(0x7fffffff);
    __syncthreads();
    for (int e = tid; e < kR * (kD / 4); e += kThreads) {
      const int r = e / (kD / 4);
      if (row0 + r < rows_total)
        write_row(p, b, hk, split, row0 + r, sO + r * kD, __int_as_float(0x7fffffff), e % (kD / 4), kD / 4);
    }
  }

  // The end of a CTA: the warps' (m, l, O) of each of the kR rows from row0, stored in the merge
  // buffers (merge_buffers) behind a barrier, merged by their maxima (a row NaN where any warp
  // flagged it, empty where no warp saw a key: out 0, lse -inf) and written (write_row);
  // kThreads / kR threads per row, each the 4-column chunks c = t8, t8 + kThreads / kR, ...
  template <int kR>
  static __device__ __forceinline__ void merge_rows(const Params& p, char* smem, int b, int hk, int split, int row0,
                                                    int rows_total, int tid) {
    float *mO, *mM, *mL;
    int* mBad;
    merge_buffers<kR>(smem, mO, mM, mL, mBad);
    constexpr int kPerRow = kThreads / kR;
    const int r = tid / kPerRow, t8 = tid % kPerRow;
    if (row0 + r >= rows_total) return;
    float mx = -INFINITY;
    bool nan_row = false;
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) {
      mx = fmaxf(mx, mM[ww * kR + r]);
      nan_row |= mBad[ww * kR + r] != 0;
    }
    float fac[kWarps], lsum = 0.f;
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) {
      fac[ww] = mx == -INFINITY ? 0.f : ptx::exp2_approx(mM[ww * kR + r] - mx);
      lsum += fac[ww] * mL[ww * kR + r];
    }
    const bool empty = mx == -INFINITY || !(lsum > 0.f);
    const float inv = empty ? 0.f : 1.f / lsum;
    const float nanf_ = __int_as_float(0x7fffffff);
    float* out = mO + r * kOPitch;  // warp 0's row, overwritten in place with the result
    for (int c = t8; c < kD / 4; c += kPerRow) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float acc = 0.f;
#pragma unroll
        for (int ww = 0; ww < kWarps; ++ww)
          if (fac[ww] != 0.f) acc += fac[ww] * mO[(ww * kR + r) * kOPitch + 4 * c + e];
        out[4 * c + e] = nan_row ? nanf_ : acc * inv;
      }
    }
    const float lse = nan_row ? nanf_ : (empty ? -INFINITY : (mx + ptx::log2_approx(lsum)) * kLn2);
    write_row(p, b, hk, split, row0 + r, out, lse, t8, kPerRow);
  }

  static __device__ void run(const Params& p, char* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!kBulk, "FLASHGEN_CUDA_DECODE_BULK: the bulk-copy decode kernel needs sm_90 or newer");
#endif
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t4 = lane & 3;
    int mt, split, hk, b;
    decode_cta(p, blockIdx.x, mt, split, hk, b);
    const int rows_total = p.group * p.sq;
    const int row0 = mt * kRows;

    const detail::DecodeSeq s = detail::decode_seq(p, b);
    const bool bad_seq =
        !s.ok || detail::decode_pages_bad(p, b, s, split, p.splits, tid, kThreads);  // uniform
    if (bad_seq) {  // every row of this tile NaN
      write_nan_rows<kRows>(p, smem, b, hk, split, row0, rows_total, tid);
      return;
    }
    const int L = s.len;

    // This thread's two rows (g, g + 8 of the tile): head, position, key bounds. Rows past the
    // group's rows or at negative positions see no key.
    int rh[2], rpos[2], rlo[2], rhi[2];
    bool rok[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int R = row0 + g + 8 * u;
      int h = 0, i = 0;
      if (R < rows_total) row_of(p, hk, R, h, i);
      rh[u] = h;
      rpos[u] = L - p.sq + i;
      rok[u] = R < rows_total && rpos[u] >= 0;
      rlo[u] = L, rhi[u] = 0;
      if (rok[u]) row_bounds<Variant>(p.vp, b, h, rpos[u], 0, L, L, L, rlo[u], rhi[u]);
      if (rlo[u] >= rhi[u]) rlo[u] = L, rhi[u] = 0;
    }
    // The tile's keys: the union of its rows' ranges (every warp computes the same, lanes g
    // hold rows g and g + 8), cut into the splits' pieces of whole tiles.
    const int lo = detail::warp_min_i(imin(rlo[0], rlo[1]));
    const int hi = detail::warp_max_i(imax(rhi[0], rhi[1]));
    int kv_begin = 0, kv_end = 0;
    if (lo < hi) {
      const int ntiles = (hi - lo + kBlockN - 1) / kBlockN;
      const int per = (ntiles + p.splits - 1) / p.splits;
      kv_begin = imin(hi, lo + split * per * kBlockN);
      kv_end = imin(hi, kv_begin + per * kBlockN);
    }
    const int n_tiles = (kv_end - kv_begin + kBlockN - 1) / kBlockN;

    // Q of the tile into shared memory (rows past the group's zero-filled).
    const uint32_t sQ = ptx::smem_addr(smem);
    const uint32_t sKV = sQ + kQBytes;
    char* const gKV = smem + kQBytes;  // sKV's generic address
    const bool rows = p.table && p.row_lookup;  // uniform
    {
#pragma unroll
      for (int i = 0; i < (kRows * kChunksPerRow + kThreads - 1) / kThreads; ++i) {
        int r, cc;
        chunk_of(tid, i, r, cc);
        if (r < kRows) {
          const int R = row0 + r;
          const bool ok = R < rows_total;
          int h = 0, qi = 0;
          if (ok) row_of(p, hk, R, h, qi);
          const Element* src =
              p.q + int64_t(b) * p.q_sb + int64_t(h) * p.q_sh + int64_t(qi) * p.q_sn + cc * 8;
          ptx::cp_async_16(sQ + (r * kPitch + cc * 8) * kE, ok ? src : p.q, ok);
        }
      }
    }
    const uint32_t sBar = sQ + kBarOffset;  // bulk: stage st's mbarrier at sBar + 8 st
    if constexpr (kBulk) {
      if (tid == 0) {
#pragma unroll
        for (int st = 0; st < kStages; ++st) ptx::mbar_init(sBar + 8 * st, kBarArrivals);
        ptx::fence_mbar_init();
      }
    }
    if (rows) {  // the offsets of tiles 0 .. kStages - 1 (the prologue's and iteration 0's copies)
#pragma unroll
      for (int st = 0; st < kStages; ++st)
        if (st < n_tiles)
          *row_offset_slot(gKV + st * kStageBytes, tid) =
              row_offset(p, b, hk, s.pad, kv_begin + st * kBlockN, kv_end, tid);
      if constexpr (!kBulk) __syncthreads();
    }
    if constexpr (kBulk) __syncthreads();  // the mbarriers initialised (and the offsets stored)
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < n_tiles) {
        if constexpr (kBulk)
          load_kv_bulk(sKV + st * kStageBytes, sKV + st * kStageBytes + kStageBytes / 2, gKV + st * kStageBytes,
                       sBar + 8 * st, rows, p, b, hk, s.pad, kv_begin + st * kBlockN, kv_end, tid);
        else
          load_kv(sKV + st * kStageBytes, sKV + st * kStageBytes + kStageBytes / 2, gKV + st * kStageBytes, rows,
                  p, b, hk, s.pad, kv_begin + st * kBlockN, kv_end, tid);
      }
      ptx::cp_async_commit();
    }
    if constexpr (kBulk) ptx::cp_async_wait<0>();  // Q (the only cp.async group), published by the loop's barrier

    float o[kDBlocks][4];
#pragma unroll
    for (int dn = 0; dn < kDBlocks; ++dn)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[dn][e] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    bool nonfinite[2] = {false, false};
    const uint32_t a_off = lane_off_a(lane, kPitch, kE);
    const uint32_t b_off = lane_off_b(lane, kPitch, kE);

    for (int it = 0; it < n_tiles; ++it) {
      // Tile it landed (cp.async: this thread's copies; bulk: every copy of the tile, the stage's
      // mbarrier phase it / kStages); the barrier makes every thread's copies, zero rows and
      // offsets visible, and frees stage (it - 1) % kStages, read by every warp in iteration it - 1.
      if constexpr (kBulk)
        ptx::mbar_wait(sBar + 8 * (it % kStages), uint32_t(it / kStages) & 1u);
      else
        ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      {
        // Tile it + kStages's row offsets (rows): block_table read before this iteration's copies
        // are issued, stored after them into the tile's stage padding (stage it % kStages: its
        // last reader, tile it's copies, is behind the barrier above), read by the next
        // iteration's copies.
        const bool next_rows = rows && it + kStages < n_tiles;  // uniform
        int64_t next_off = 0;
        if (next_rows) next_off = row_offset(p, b, hk, s.pad, kv_begin + (it + kStages) * kBlockN, kv_end, tid);
        const int nt = it + kStages - 1;
        if (nt < n_tiles) {
          const int stg = nt % kStages;
          const uint32_t st = sKV + stg * kStageBytes;
          if constexpr (kBulk)
            load_kv_bulk(st, st + kStageBytes / 2, gKV + stg * kStageBytes, sBar + 8 * stg, rows, p, b, hk, s.pad,
                         kv_begin + nt * kBlockN, kv_end, tid);
          else
            load_kv(st, st + kStageBytes / 2, gKV + stg * kStageBytes, rows, p, b, hk, s.pad,
                    kv_begin + nt * kBlockN, kv_end, tid);
        }
        if constexpr (!kBulk) ptx::cp_async_commit();
        if (next_rows) *row_offset_slot(gKV + (it % kStages) * kStageBytes, tid) = next_off;
      }
      const uint32_t sK = sKV + (it % kStages) * kStageBytes + warp * 16 * kPitch * kE;
      const uint32_t sV = sK + kStageBytes / 2;
      const int kv0 = kv_begin + it * kBlockN + warp * 16;  // this warp's first key

      // S = Q K^T over the warp's 16 keys.
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[4], bk[4];
        ptx::ldmatrix_x4(a, sQ + kk * 16 * kE + a_off);
        ptx::ldmatrix_x4(bk, sK + kk * 16 * kE + b_off);
        ptx::mma_16816<Element>(sc[0], a, bk[0], bk[1]);
        ptx::mma_16816<Element>(sc[1], a, bk[2], bk[3]);
      }

      // Mask and score hooks (log2 units; masked: -inf), then the online softmax per row.
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float tmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kv = kv0 + j * 8 + 2 * t4 + e;
            bool vis = kv < kv_end;
            if constexpr (kRowBounds<Variant>) {
              vis = vis && kv >= rlo[u] && kv < rhi[u];
            } else {
              vis = vis && rok[u] && kv >= rlo[u] && kv < rhi[u] &&
                    Variant::keep(p.vp, b, rh[u], rpos[u], kv, L, L);
            }
            float x;
            if constexpr (Variant::kHasScoreMod) {
              x = vis ? Variant::score(p.vp, sc[j][2 * u + e] * p.scale, b, rh[u], rpos[u], kv, L, L) * kLog2e
                      : -INFINITY;
            } else {
              x = vis ? sc[j][2 * u + e] * p.scale_log2 : -INFINITY;
            }
            if (x != x || x == INFINITY) {  // NaN or +inf at a kept key: the row is NaN
              nonfinite[u] = true;
              x = -INFINITY;
            }
            sc[j][2 * u + e] = x;
            tmax = fmaxf(tmax, x);
          }
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const float m_new = fmaxf(m[u], tmax);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = ptx::exp2_approx(m[u] - m_use);  // m = -inf: 0 (O and l are 0 then)
        m[u] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pr = ptx::exp2_approx(sc[j][2 * u + e] - m_use);
            sc[j][2 * u + e] = pr;
            sum += pr;
          }
        }
        l[u] = l[u] * alpha + sum;
#pragma unroll
        for (int dn = 0; dn < kDBlocks; ++dn) {
          o[dn][2 * u] *= alpha;
          o[dn][2 * u + 1] *= alpha;
        }
      }

      // O += P V.
      uint32_t a[4];
      a[0] = ptx::pack2<Element>(sc[0][0], sc[0][1]);
      a[1] = ptx::pack2<Element>(sc[0][2], sc[0][3]);
      a[2] = ptx::pack2<Element>(sc[1][0], sc[1][1]);
      a[3] = ptx::pack2<Element>(sc[1][2], sc[1][3]);
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        uint32_t bv[4];
        ptx::ldmatrix_x4_trans(bv, sV + dp * 16 * kE + a_off);
        ptx::mma_16816<Element>(o[2 * dp], a, bv[0], bv[1]);
        ptx::mma_16816<Element>(o[2 * dp + 1], a, bv[2], bv[3]);
      }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // the ring is free: the warps' merge reuses it

    // Merge the warps' (m, l, O) of each row.
    float *mO, *mM, *mL;
    int* mBad;
    merge_buffers<kRows>(smem, mO, mM, mL, mBad);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      l[u] += __shfl_xor_sync(0xffffffffu, l[u], 1);
      l[u] += __shfl_xor_sync(0xffffffffu, l[u], 2);
      int nf = int(nonfinite[u]);  // the quad's lanes hold the row's other keys
      nf |= __shfl_xor_sync(0xffffffffu, nf, 1);
      nf |= __shfl_xor_sync(0xffffffffu, nf, 2);
      const int r = g + 8 * u;
      float* row = mO + (warp * kRows + r) * kOPitch;
#pragma unroll
      for (int dn = 0; dn < kDBlocks; ++dn)
        *reinterpret_cast<float2*>(row + dn * 8 + 2 * t4) = make_float2(o[dn][2 * u], o[dn][2 * u + 1]);
      if (t4 == 0) {
        mM[warp * kRows + r] = m[u];
        mL[warp * kRows + r] = l[u];
      }
      if (t4 == 0) mBad[warp * kRows + r] = nf;
    }
    __syncthreads();

    merge_rows<kRows>(p, smem, b, hk, split, row0, rows_total, tid);
  }
};

template <class Variant, class Element, int kHeadDim, class Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kSmem <= 80 * 1024 ? 2 : 1)
    decode_kernel(const DecodeParams<Element, typename Variant::Params> p) {
  extern __shared__ __align__(16) char smem[];
  DecodeKernel<Variant, Element, kHeadDim, Tile>::run(p, smem);
}

// ------------------------------------------------------------------ 3. combine

// kW warps per query row (4 when there are many splits, else 1: then a CTA serves 4 rows); the
// row's warps take the splits s = part, part + kW, ... and add their sums through shared memory.
// Each lane owns the row's 4-column chunks c = lane, lane + 32, ... The split loop is unrolled so
// that several splits' loads are in flight at once (a row's splits are independent reads: the
// kernel's time is their latency, not their bytes). On sm_90 the kernel is launched as a
// programmatic dependent of the attention kernel (launch_combine): it may start while that
// kernel's last CTAs run, and waits for its writes with griddepcontrol.wait before any read.
template <class Element, int kHeadDim, int kW, class P>
__global__ void __launch_bounds__(128) decode_combine_kernel(const P p) {
  constexpr int kD = kHeadDim, kRowsPerCta = 4 / kW, kChunks = (kD / 4 + 31) / 32;
  __shared__ float4 part_sum[kW > 1 ? kW : 1][kW > 1 ? kD / 4 : 1];
  __shared__ float part_stat[4][2];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, part = warp % kW;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerCta + warp / kW;
  if (row >= p.rows_all) return;  // kW > 1: the CTA's one row, so the whole CTA leaves together
  const int S = p.splits;
  const float* lse_row = p.lse_accum + row;
  float mx = -INFINITY;
  bool nan_row = false;
  for (int sp = part * 32 + lane; sp < S; sp += 32 * kW) {
    const float x = lse_row[int64_t(sp) * p.rows_all];
    nan_row |= x != x;
    mx = fmaxf(mx, x);
  }
  mx = detail::warp_max(mx);
  nan_row = __any_sync(0xffffffffu, nan_row);
  if constexpr (kW > 1) {
    if (lane == 0) part_stat[warp][0] = mx, part_stat[warp][1] = nan_row ? 1.f : 0.f;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kW; ++w) mx = fmaxf(mx, part_stat[w][0]), nan_row |= part_stat[w][1] != 0.f;
  }
  float wsum = 0.f;
  float4 acc[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mx != -INFINITY && !nan_row) {
    const float* o_row = p.o_accum + row * kD;
#pragma unroll 4
    for (int sp = part; sp < S; sp += kW) {
      const float x = lse_row[int64_t(sp) * p.rows_all];
      float4 v[kChunks];
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int c = lane + 32 * j;
        v[j] = c < kD / 4 ? *reinterpret_cast<const float4*>(o_row + int64_t(sp) * p.rows_all * kD + 4 * c)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      // A split of lse -inf weighs 0 and its O (zeros: an empty split writes 0) does not reach the row.
      const bool keep = x != -INFINITY;
      const float wgt = keep ? __expf(x - mx) : 0.f;
      wsum += wgt;
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
        if (keep)
          acc[j].x += wgt * v[j].x, acc[j].y += wgt * v[j].y, acc[j].z += wgt * v[j].z, acc[j].w += wgt * v[j].w;
    }
  }
  if constexpr (kW > 1) {
    __syncthreads();  // part_stat read by every warp before it is reused
    if (lane == 0) part_stat[warp][0] = wsum;
#pragma unroll
    for (int j = 0; j < kChunks; ++j)
      if (lane + 32 * j < kD / 4) part_sum[part][lane + 32 * j] = acc[j];
    __syncthreads();
    if (part != 0) return;
    wsum = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) wsum += part_stat[w][0];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = lane + 32 * j;
      if (c >= kD / 4) continue;
      float4 t = part_sum[0][c];
#pragma unroll
      for (int w = 1; w < kW; ++w) {
        const float4 u = part_sum[w][c];
        t.x += u.x, t.y += u.y, t.z += u.z, t.w += u.w;
      }
      acc[j] = t;
    }
  }
  const bool empty = mx == -INFINITY || !(wsum > 0.f);
  const float inv = empty ? 0.f : 1.f / wsum;
  const float nanf_ = __int_as_float(0x7fffffff);
  const float f = nan_row ? nanf_ : inv;  // NaN * anything: the row's NaN
  const int64_t i = row % p.sq, h = row / p.sq % p.heads_q, b = row / (int64_t(p.sq) * p.heads_q);
  Element* dst = p.o + b * p.o_sb + h * p.o_sh + i * p.o_sn;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = lane + 32 * j;
    if (c >= kD / 4) continue;
    uint2 v;
    v.x = ptx::pack2<Element>(acc[j].x * f, acc[j].y * f);
    v.y = ptx::pack2<Element>(acc[j].z * f, acc[j].w * f);
    *reinterpret_cast<uint2*>(dst + 4 * c) = v;
  }
  if (lane == 0) p.lse[row] = nan_row ? nanf_ : (empty ? -INFINITY : mx + __logf(wsum));
}

}  // namespace cuda
}  // namespace flashgen
