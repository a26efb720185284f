// flashgen CPU backward kernel skeleton: fused FlashAttention backward for one generated Variant.
//
//   template <class Variant, class Element>   // Element: float, c10::BFloat16, c10::Half
//   int flashgen::cpu::run_bwd(const FgBwdArgs& args);   // returns an FgStatus (args.h)
//
// head_dim: runtime, any multiple of 8 in [8, 256] (else FG_ERR_BAD_HEAD_DIM).
//
// Algorithm: FlashAttention-2 backward (Dao 2023, Alg. 2), recomputing P from the saved lse; no
// N x N buffer. Three at::parallel_for passes:
//
//   1. D pass, over query rows: D_i = rowsum(dout_i ∘ out_i) − dlse_i (dlse nullable) into
//      softmax_d; zero-fills the fp32 dQ accumulators (so dq_accum need not arrive zeroed).
//   2. Main pass, over tasks (batch, kv head, kv segment); a segment is a contiguous run of kv
//      tiles. For each of its kv tiles a task keeps dK and dV of the tile in fp32 scratch and
//      loops, for every query head of the kv head's group (GQA/MQA: the group's sum is formed
//      inside the task, in a fixed order), over the query tiles that can see the tile:
//        P  = exp(scale·Q Kᵀ − lse)              gemm, exp in its epilogue; 0 where masked
//        dV += Pᵀ dO                             gemm
//        dS = P ∘ (dO Vᵀ − D)                    gemm, dS in its epilogue (in place over P)
//        dK += dSᵀ Q                             gemm   (scale applied at write-back)
//        dQ_seg += dS K                          gemm into the segment's fp32 dQ buffer
//      then writes dk = scale·dK, dv = dV (Element, args' strides).
//   3. dQ pass, over query rows: dq = scale · (dQ_0 + dQ_1 + ... ) in segment order (Element,
//      args' strides); rows with lse == -inf (or seqlen_k == 0) are written as exact zeros.
//   Segment 0's dQ buffer is args.dq_accum; more than one segment is used only when
//   batch * heads_kv is too small to keep every thread busy (see bwd_plan); the extra segments'
//   buffers ((nseg − 1) x [B, Hq, Nq, d] fp32, packed [Hq, total_q, d]) are allocated here. The kernel itself uses no
//   atomics: every sum has a fixed order, so dq, dk, dv (and, without a parameter gradient,
//   everything) are bitwise repeatable for a given thread count whatever args.deterministic
//   says (the segment count depends on at::get_num_threads()). Parameter gradients are the
//   exception: param_grad adds into them atomically, in an order that depends on the schedule.
//
// Packed (varlen) batches (args.cu_seqlens_q set; layout in args.h): a task is (sequence, kv
// head, segment of the sequence's own kv tiles), with the sequence's true lengths in every hook
// and bound and its rows from cu_seqlens_*[b]; bwd_plan_packed sizes the segments per sequence
// (no task for padding, none for a sequence without keys; a sequence without queries keeps its
// tasks, which write dk = dv = 0). The D and dQ passes run over the Hq x total_q rows of the
// per-row buffers. The metadata is re-checked here (FG_ERR_BAD_SHAPE when inconsistent).
//
// Block sparsity (args.q_blocks.data set; layout in args.h; args.kv_blocks is not read here):
// kv tiles of block_r keys, q tiles of block_c queries (args.tile_kv / args.tile_q must be
// those). For kv tile kt and each query head h of its group, a task
// visits only the q tiles listed in row kt of (b, h), in increasing order; the [kv_lo, kv_hi)
// test, the lse == -inf trimming and tile_full apply to them as to any tile, except that a
// listed-partial tile always runs the element mask (the spec's mask applies on top of the lists)
// and a listed-full one skips it when full_kept is set (as in fwd.h). A kv tile that no q tile
// lists writes dk = dv = 0; a query row no tile reaches keeps dq = 0 (its forward lse is -inf).
// The segment models (bwd_plan, bwd_plan_packed) count listed tiles: a kv tile's work is
// qb x (its width + 16) x its mean listed count over batch and query heads (each capped at the
// sequence's q tiles). Validation (FG_ERR_BAD_SHAPE before any work; rows x cols must be
// ceil(seqlen_k / block_r) x ceil(seqlen_q / block_c)) and malformed lists: as fwd.h.
//
// Score mods (Variant::kHasScoreMod; the "mod path", also taken for kHasParamGrad alone, where
// score() is the identity): the chain rule through s' = score(s), as the contract's "Backward
// with a score mod" says. Per (q tile, kv tile):
//        s  = scale·Q Kᵀ                         gemm (natural units), into the S tile
//        per in-bounds kept entry: S = score(s)·log2e and G = dscore(s) (or G = s, see below);
//        masked entries: S = −inf. Then P = 2^(S − lse·log2e) (vectorised; exactly 0 where
//        masked). Rows with lse == −inf get P = 0 without any hook call.
//        dV += Pᵀ dO                             as above (P of the modified scores)
//        dS' = P ∘ (dO Vᵀ − D)                   gemm with epilogue, as above
//        dS = dS' ∘ G, selected to 0 where dS' == 0 (a non-finite dscore never makes NaN)
//        dK, dQ from dS                          as above
//   G is one extra fp32 qb x kvb tile per thread, laid out like S. Without a parameter gradient
//   it holds dscore(s), computed next to score(s) with no store in between (so the compiler can
//   share their common subexpressions: one tanh for a softcap, measured ~12% faster than
//   calling dscore in a later pass), and the dS' epilogue multiplies it in. With
//   Variant::kHasParamGrad it holds s, and a pass after the dS' epilogue calls, on every entry
//   with dS' != 0 (in bounds and kept by construction: dS' is 0 wherever P is),
//   dscore(s), then param_grad(dS', s, b, h, q, kv, ..), and sets dS = dS'·dscore(s).
//   Recomputing s instead of keeping it would cost another d-long dot product per entry.
//   Without a score mod or parameter gradient none of this is compiled: the P exp stays in the
//   gemm epilogue and no G tile is allocated.
//
// Dropout (Variant::kHasDropout and args.dropout_state set; FlashAttention, Alg. 4): the
// forward's keep mask is regenerated per (q tile, kv tile) from the same (seed, offset) at the
// absolute (b, h, q, kv) (cpu/dropout.h), so the kv-major traversal, GQA grouping and segments
// see exactly the forward's mask. With Z = keep / (1 − p) and Pd = P ∘ Z (one more qb x kvb
// tile per thread):
//        dV += Pdᵀ dO;   dS = P ∘ ((dO Vᵀ) ∘ Z − D) = Pd ∘ (dO Vᵀ) − P ∘ D  (in the DS epilogue)
// D = rowsum(dO ∘ O) is unchanged (O holds the dropout already); dS then feeds the score-mod
// chain rule, dK and dQ as above. Without kHasDropout nothing of it is compiled.
//
// Variant hooks (contract: flashgen/variant.h). The Params reference is *args.params, or a
// value-initialised Params when args.params is null (allowed when Params is empty).
// score / dscore / param_grad are only called on in-bounds (q < seqlen_q, kv < seqlen_k) entries
// that the mask keeps. kv_lo / kv_hi / tile_full take the real (b, h) of the work: h is the
// query head, and since a task serves all query heads of its kv head (GQA), each task evaluates
// kv_lo / kv_hi for each of its query heads h and each q tile, and visits (q tile, kv tile) for
// head h iff [kv_lo(b, h, ..), kv_hi(b, h, ..)) meets the kv tile; so the mask may depend on h.
// The segment cost model (bwd_plan) has no particular work item and evaluates kv_lo / kv_hi at
// b = h = 0 (as the host's tile-size model does).
//
// Workspaces: dq_accum (fp32 [B, Hq, Nq, d], packed [Hq, total_q, d]; zero-filled here: the
// caller's zeroing is not needed) and softmax_d (written here) are used; dk_accum and dv_accum
// are NOT used (may be null).
//
// Which (q tile, kv tile) pairs run: query tile [q_lo, q_hi) of head h meets kv tile [k0, k1) iff
// [Variant::kv_lo, Variant::kv_hi) for (b, h) (clamped to [0, seqlen_k]) intersects it (and, with
// block lists, row kt of (b, h) lists the q tile); keys outside that range count as masked, as in
// the forward. The per-element mask runs only where tile_full is false; then rows and columns
// that keep nothing are trimmed from both ends of the tile. Rows with lse == -inf are
// trimmed/zeroed too: they contribute nothing.
//
// Gemms: fp32 in, fp32 out, the same two backends and kernel family as the forward (cpu/gemm.h):
// register-blocked 6x16 AVX2/FMA micro-kernels by default (K^T and V^T are packed
// once per kv tile into 16-column panels by pack_kt; the Aᵀ·B products read P / dS
// transposed in place, so nothing of the q x kv tile is ever packed), or BLAS sgemm_ when
// compiled without AVX2/FMA or with FLASHGEN_CPU_GEMM=blas (and the symbol resolves).
// 16-bit Elements are widened to fp32 tile by tile; P and dS stay fp32 (not rounded to Element).
//
// Edge cases: seqlen_q == 0 -> dk = dv = 0; seqlen_k == 0 -> dq = 0 (packed: the same per
// sequence); batch == 0 -> nothing; keys that no query sees -> dk = dv = 0 exactly; rows with
// lse == -inf -> dq = 0 exactly.
// Masked K/V entries never leak: P is masked by selection, dS is selected to 0 where P is 0, and
// for dQ += dS K on a tile with interior fully-masked columns the K rows of those columns are
// replaced by zeros (so NaN/inf there cannot turn 0 * NaN into NaN). Not covered (as in the
// forward): a key that one row of a tile keeps and another masks enters the masking row's dQ as
// 0 * K, so NaN/inf in that K row reaches it (an unfused autograd gives the same). Non-finite
// values (DESIGN.md): only lse == -inf is an empty row; a NaN lse (the forward saw a NaN or +inf
// score at a kept key) gives P = NaN on the row's kept entries, so its dQ and the dK / dV of the
// keys it keeps are NaN; a NaN score at a kept entry of a finite-lse row gives P = NaN there
// (exp2v propagates NaN). A non-finite dscore(s) reaches dS only where dS' != 0.
// Any batch/head/seq strides (64-bit offsets), last dim contiguous; lse, dlse, softmax_d
// contiguous [B, Hq, Nq] (packed: [Hq, total_q]).
// Errors: FG_ERR_BAD_HEAD_DIM; FG_ERR_BAD_SHAPE for negative sizes, seqlens > FG_MAX_SEQLEN,
// heads_q % heads_kv != 0, or a null pointer that is needed; FG_ERR_LAUNCH for an exception
// inside the kernel (e.g. bad_alloc).
//
// Tiles: args.tile_q x args.tile_kv, chosen by the host (flashgen/families/cpu_tiles.py; block
// lists: theirs) and checked by bwd_tiles_of in cpu/tiles.h (FG_ERR_BAD_SHAPE when not set or out
// of range); per-thread scratch
// O((qb + kvb) * d + qb * kvb) floats (one more qb x kvb tile on the mod path).
// Build requirements: as fwd.h (-fopenmp at compile and link, -O3 -march=native).
//
// Layers: as the forward (cpu/simd.h, convert.h, gemm.h, tiles.h, work.h); this header is the
// backward driver: the plan (tiles, kv segments, task order), the main pass and the D / dQ passes.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "flashgen/args.h"
#include "flashgen/cpu/convert.h"
#include "flashgen/cpu/dropout.h"
#include "flashgen/cpu/gemm.h"
#include "flashgen/cpu/simd.h"
#include "flashgen/cpu/tiles.h"
#include "flashgen/cpu/work.h"
#include "flashgen/variant.h"

// Without -mavx, GCC warns that 32-byte vector arguments change the psABI; every function taking
// them here has internal linkage, so the warning does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace flashgen {
namespace cpu {
namespace detail {

// ------------------------------------------------------------------------------------------
// Plan: tiles, the kv range of every query tile, kv segments, task order.
// Packed layout (sq.packed()): nqt and nkvt are the tile counts of max_seqlen_q / max_seqlen_k
// (bounds: each sequence has its own, from its true lengths), and every sequence has its own
// segment boundaries over its own kv tiles.
struct BwdPlan {
  BwdTiles tiles;                       // args.tile_q x args.tile_kv (checked: bwd_tiles_of)
  int64_t qb, kvb, nqt, nkvt, nseg, group;
  bool blas, mod;                       // mod: the score-mod path (bwd_mod_path)
  Dropout dr;                           // the forward's dropout (dr.on: regenerate its mask)
  Seqs sq;                              // the layout (padded, or packed with cu_seqlens)
  const FgBlockLists* qbl = nullptr;    // block lists (args.q_blocks), or null: none
  int64_t nrows = 0;                    // rows of a dQ buffer: B * Hq * Nq, packed Hq * total_q
  std::vector<int64_t> seg_begin;       // nseg + 1 kv-tile boundaries (packed: per sequence)
  std::vector<int64_t> tasks;           // task ids (bkv * nseg + seg), heaviest first
  float* dq_extra = nullptr;            // (nseg - 1) x nrows x d fp32, or null
  // First kv tile of segment s of batch element / sequence b (s == nseg: one past the last).
  int64_t seg_lo(int64_t b, int64_t s) const {
    return sq.packed() ? seg_begin[b * (nseg + 1) + s] : seg_begin[s];
  }
};

// Work model of the block lists: the mean over query heads (just head 0 when the lists are
// shared by all heads) of the listed tile count of row r of batch element / sequence b, each
// count capped at lim (the tiles that exist).
static inline double block_mean(const FgBlockLists& l, int64_t b, int64_t heads, int64_t r,
                                int64_t lim) {
  const int64_t nh = l.stride_h ? heads : 1;
  double sum = 0.0;
  for (int64_t h = 0; h < nh; ++h)
    sum += double(std::min(block_count(block_row(l, b, h, r), l.cols), lim));
  return nh > 0 ? sum / double(nh) : 0.0;
}

template <class Variant>
static void bwd_plan(const FgBwdArgs& a, const typename Variant::Params& prm, BwdPlan& pl) {
  const int64_t B = a.batch, Hkv = a.heads_kv, Nq = a.seqlen_q, Nk = a.seqlen_k;
  const BwdTiles t = pl.tiles;
  pl.qb = t.qb;
  pl.kvb = t.kvb;
  pl.nqt = Nq > 0 ? (Nq + t.qb - 1) / t.qb : 0;
  pl.nkvt = Nk > 0 ? (Nk + t.kvb - 1) / t.kvb : 0;
  pl.group = Hkv > 0 ? a.heads_q / Hkv : 0;
  pl.mod = bwd_mod_path<Variant>();
  // kv range of every q tile for b = h = 0: a work model only (tasks evaluate the hooks for
  // their own batch and query heads).
  std::vector<int64_t> q_kvlo(pl.nqt), q_kvhi(pl.nqt);
  for (int64_t qt = 0; qt < pl.nqt; ++qt) {
    const int64_t q_lo = qt * t.qb, q_hi = std::min(q_lo + t.qb, Nq);
    int64_t lo = Variant::kv_lo(prm, 0, 0, (int)q_lo, (int)q_hi, (int)Nq, (int)Nk);
    int64_t hi = Variant::kv_hi(prm, 0, 0, (int)q_lo, (int)q_hi, (int)Nq, (int)Nk);
    q_kvlo[qt] = lo < 0 ? 0 : (lo > Nk ? Nk : lo);
    q_kvhi[qt] = hi > Nk ? Nk : (hi < 0 ? 0 : hi);
  }
  // Work per kv tile (score entries visited + a per-tile constant), its prefix sums.
  std::vector<double> prefix(pl.nkvt + 1, 0.0);
  for (int64_t kt = 0; kt < pl.nkvt; ++kt) {
    const int64_t k0 = kt * t.kvb, k1 = std::min(k0 + t.kvb, Nk);
    double w = double(k1 - k0) * 8.0;  // write-back
    if (pl.qbl) {  // block lists: the mean listed q tile count of the kv tile's rows
      double listed = 0.0;
      const int64_t nb = pl.qbl->stride_b ? B : 1;
      for (int64_t b = 0; b < nb; ++b) listed += block_mean(*pl.qbl, b, a.heads_q, kt, pl.nqt);
      w += double(t.qb) * double(k1 - k0 + 16) * listed / double(nb);
    } else {
      for (int64_t qt = 0; qt < pl.nqt; ++qt) {
        const int64_t ov = std::min(k1, q_kvhi[qt]) - std::max(k0, q_kvlo[qt]);
        if (ov > 0) w += double(std::min(t.qb, Nq - qt * t.qb)) * double(ov + 16);
      }
    }
    prefix[kt + 1] = prefix[kt] + w;
  }
  // Segments: the fewest such that B * Hkv * nseg tasks keep all threads >= 90% busy
  // (assuming equal tasks), at most 4 per thread, and the extra dQ buffers below 256 MiB.
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  const int64_t nbkv = B * Hkv;
  const double seg_bytes = double(B) * double(a.heads_q) * double(Nq) * double(a.head_dim) * 4.0;
  int64_t nseg = 1;
  if (nbkv > 0 && pl.nkvt > 1 && T > 1) {
    double best_eff = -1.0;
    const int64_t smax = std::min<int64_t>(pl.nkvt, 4 * T);
    for (int64_t s = 1; s <= smax; ++s) {
      if (s > 1 && double(s - 1) * seg_bytes > double(256 << 20)) break;
      const int64_t nt = nbkv * s;
      const double eff = double(nt) / double(T) / double((nt + T - 1) / T);
      if (eff > best_eff + 1e-9) {
        best_eff = eff;
        nseg = s;
      }
      if (eff >= 0.9) break;
    }
  }
  pl.nseg = nseg;
  pl.seg_begin.assign(nseg + 1, 0);
  pl.seg_begin[nseg] = pl.nkvt;
  for (int64_t s = 1; s < nseg; ++s) {  // split the work prefix into equal parts
    const double target = prefix[pl.nkvt] * double(s) / double(nseg);
    int64_t kt = pl.seg_begin[s - 1] + 1;
    while (kt < pl.nkvt - (nseg - s) && prefix[kt] < target) ++kt;
    pl.seg_begin[s] = kt;
  }
  std::vector<double> seg_work(nseg);
  for (int64_t s = 0; s < nseg; ++s)
    seg_work[s] = prefix[pl.seg_begin[s + 1]] - prefix[pl.seg_begin[s]];
  pl.tasks.resize(nbkv * nseg);
  for (int64_t i = 0; i < nbkv * nseg; ++i) pl.tasks[i] = i;
  std::stable_sort(pl.tasks.begin(), pl.tasks.end(), [&](int64_t x, int64_t y) {
    return seg_work[x % nseg] > seg_work[y % nseg];
  });
}

// Packed layout: tiles from max_seqlen_q / max_seqlen_k; per sequence, the work of each of its
// kv tiles from its true lengths (hooks at its b and h = 0, as the padded model at b = h = 0);
// segments split each sequence's work into equal parts (at most one per kv tile); the segment
// count is the smallest (up to 4 per thread, extra dQ buffers below 256 MiB) for which a
// longest-first list schedule of the (sequence, kv head, segment) tasks keeps the threads >= 90%
// busy. Sequences without keys get no task (nothing to write); sequences without queries keep
// theirs (they write dk = dv = 0). Only the work model depends on the Variant; the rest is in
// plain functions (bwd_packed_segments), which keeps the kernels' compile time down.

// Boundaries bounds[0..s] of s segments over nkvt kv tiles with work prefix sums pre[0..nkvt]
// (as bwd_plan splits; segments past the tile count stay empty).
static inline void bwd_split(const double* pre, int64_t nkvt, int64_t s, int64_t* bounds) {
  const int64_t used = std::min(s, nkvt);
  bounds[0] = 0;
  for (int64_t i = 1; i <= s; ++i) bounds[i] = nkvt;
  for (int64_t i = 1; i < used; ++i) {
    const double target = pre[nkvt] * double(i) / double(used);
    int64_t kt = bounds[i - 1] + 1;
    while (kt < nkvt - (used - i) && pre[kt] < target) ++kt;
    bounds[i] = kt;
  }
}

// Segments of every sequence into bounds (B x (s + 1)) and their work into w (B x s; -1: empty).
// first[b] + b: where sequence b's nkvt_b + 1 prefix sums start in prefix.
static inline void bwd_seg_work(const std::vector<int64_t>& first, const std::vector<double>& prefix,
                                int64_t B, int64_t s, std::vector<int64_t>& bounds,
                                std::vector<double>& w) {
  bounds.assign(B * (s + 1), 0);
  w.assign(B * s, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    int64_t* bd = bounds.data() + b * (s + 1);
    const double* pre = prefix.data() + first[b] + b;
    bwd_split(pre, first[b + 1] - first[b], s, bd);
    for (int64_t i = 0; i < s; ++i)
      w[b * s + i] = bd[i + 1] > bd[i] ? pre[bd[i + 1]] - pre[bd[i]] : -1.0;
  }
}

// The segment count, boundaries and task list of the packed layout from the work prefix sums.
static void bwd_packed_segments(const FgBwdArgs& a, const std::vector<int64_t>& first,
                                const std::vector<double>& prefix, BwdPlan& pl) {
  const int64_t B = a.batch, Hkv = a.heads_kv;
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  const double seg_bytes = double(pl.nrows) * double(a.head_dim) * 4.0;
  std::vector<int64_t> order;
  std::vector<double> w, load;
  int64_t nseg = 1;
  if (Hkv > 0 && pl.nkvt > 1 && T > 1) {
    double best_eff = -1.0;
    const int64_t smax = std::min<int64_t>(pl.nkvt, 4 * T);
    for (int64_t s = 1; s <= smax; ++s) {
      if (s > 1 && double(s - 1) * seg_bytes > double(256 << 20)) break;
      bwd_seg_work(first, prefix, B, s, pl.seg_begin, w);
      order_by_work(w.data(), (int64_t)w.size(), order);
      if (order.empty()) break;
      load.assign(T, 0.0);  // longest first, each task to the least loaded thread
      double total = 0.0;
      for (int64_t i : order)
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          int64_t t = 0;
          for (int64_t u = 1; u < T; ++u) t = load[u] < load[t] ? u : t;
          load[t] += w[i];
          total += w[i];
        }
      double makespan = 0.0;
      for (double x : load) makespan = std::max(makespan, x);
      const double eff = makespan > 0.0 ? total / (double(T) * makespan) : 1.0;
      if (eff > best_eff + 1e-9) {
        best_eff = eff;
        nseg = s;
      }
      if (eff >= 0.9) break;
    }
  }
  pl.nseg = nseg;
  bwd_seg_work(first, prefix, B, nseg, pl.seg_begin, w);
  order_by_work(w.data(), (int64_t)w.size(), order);
  pl.tasks.clear();
  for (int64_t i : order)  // i = b * nseg + s
    for (int64_t hk = 0; hk < Hkv; ++hk) pl.tasks.push_back(((i / nseg) * Hkv + hk) * nseg + i % nseg);
}

template <class Variant>
static void bwd_plan_packed(const FgBwdArgs& a, const typename Variant::Params& prm, BwdPlan& pl) {
  const Seqs& sq = pl.sq;
  const int64_t B = a.batch, Hkv = a.heads_kv;
  const BwdTiles t = pl.tiles;
  pl.qb = t.qb;
  pl.kvb = t.kvb;
  pl.nqt = sq.nq > 0 ? (sq.nq + t.qb - 1) / t.qb : 0;
  pl.nkvt = sq.nk > 0 ? (sq.nk + t.kvb - 1) / t.kvb : 0;
  pl.group = Hkv > 0 ? a.heads_q / Hkv : 0;
  pl.mod = bwd_mod_path<Variant>();
  // Work prefix sums over each sequence's kv tiles (as bwd_plan's): sequence b's nkvt_b + 1
  // entries start at first[b] + b.
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + (sq.len_k(b) + t.kvb - 1) / t.kvb;
  std::vector<double> prefix(first[B] + B, 0.0);
  std::vector<int64_t> q_kvlo, q_kvhi;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t Nq = sq.len_q(b), Nk = sq.len_k(b), nkvt = first[b + 1] - first[b];
    const int64_t nqt = (Nq + t.qb - 1) / t.qb;
    q_kvlo.assign(nqt, 0);
    q_kvhi.assign(nqt, 0);
    for (int64_t qt = 0; qt < nqt; ++qt) {
      const int64_t q_lo = qt * t.qb, q_hi = std::min(q_lo + t.qb, Nq);
      const int64_t lo = Variant::kv_lo(prm, (int)b, 0, (int)q_lo, (int)q_hi, (int)Nq, (int)Nk);
      const int64_t hi = Variant::kv_hi(prm, (int)b, 0, (int)q_lo, (int)q_hi, (int)Nq, (int)Nk);
      q_kvlo[qt] = lo < 0 ? 0 : (lo > Nk ? Nk : lo);
      q_kvhi[qt] = hi > Nk ? Nk : (hi < 0 ? 0 : hi);
    }
    double* pre = prefix.data() + first[b] + b;
    for (int64_t kt = 0; kt < nkvt; ++kt) {
      const int64_t k0 = kt * t.kvb, k1 = std::min(k0 + t.kvb, Nk);
      double w = double(k1 - k0) * 8.0;  // write-back
      if (pl.qbl) {  // block lists: the mean listed q tile count (within the sequence's tiles)
        const int64_t bb = pl.qbl->stride_b ? b : 0;
        w += double(t.qb) * double(k1 - k0 + 16) * block_mean(*pl.qbl, bb, a.heads_q, kt, nqt);
      } else {
        for (int64_t qt = 0; qt < nqt; ++qt) {
          const int64_t ov = std::min(k1, q_kvhi[qt]) - std::max(k0, q_kvlo[qt]);
          if (ov > 0) w += double(std::min(t.qb, Nq - qt * t.qb)) * double(ov + 16);
        }
      }
      pre[kt + 1] = pre[kt] + w;
    }
  }
  bwd_packed_segments(a, first, prefix, pl);
}

// Per-worker scratch.
struct BwdWork {
  float *kt, *vt, *kf, *vf, *khole, *dk, *dv, *qf, *dof, *S, *dP, *L, *D;
  float* G;                // mod path: s or dscore(s), laid out like S (else null)
  float* Pd;               // dropout: P ∘ keep / (1 − p), laid out like S (else null)
  int64_t *rlo, *rhi;      // the task's kv range per (query head of the group, q tile)
  uint8_t *mask, *colkeep;
  uint8_t* tflag;          // block lists: the listed q tiles of the current (kv tile, head)
  int64_t ldS;
};

static inline size_t bwd_work_bytes(const BwdPlan& pl, int64_t d) {
  const int64_t kvb16 = round_up(pl.kvb, 16), qb = pl.qb, kvb = pl.kvb;
  const int64_t ldS = kvb16 + 16;
  size_t off = 0;
  off += 2 * al64(sizeof(float) * kvb16 * d);  // kt, vt
  off += 5 * al64(sizeof(float) * kvb * d);    // kf, vf, khole, dk, dv
  off += 2 * al64(sizeof(float) * qb * d);     // qf, dof
  off += 2 * al64(sizeof(float) * qb * ldS);   // S, dP
  off += pl.mod ? al64(sizeof(float) * qb * ldS) : 0;  // G
  off += pl.dr.on ? al64(sizeof(float) * qb * ldS) : 0;  // Pd
  off += 2 * al64(sizeof(int64_t) * pl.group * pl.nqt);  // rlo, rhi
  off += 2 * al64(sizeof(float) * qb);         // L, D
  off += al64(qb * kvb) + al64(kvb);           // mask, colkeep
  off += pl.qbl ? al64(std::max<int64_t>(pl.nqt, pl.qbl->cols) + 1) : 0;  // tflag
  return off;
}

static inline BwdWork bwd_work_carve(const BwdPlan& pl, int64_t d, char* base) {
  const int64_t kvb16 = round_up(pl.kvb, 16), qb = pl.qb, kvb = pl.kvb;
  BwdWork w;
  w.ldS = kvb16 + 16;  // +16 floats: avoid 4 KiB set aliasing of rows
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* p = base + off;
    off += al64(bytes);
    return p;
  };
  w.kt = reinterpret_cast<float*>(take(sizeof(float) * kvb16 * d));
  w.vt = reinterpret_cast<float*>(take(sizeof(float) * kvb16 * d));
  w.kf = reinterpret_cast<float*>(take(sizeof(float) * kvb * d));
  w.vf = reinterpret_cast<float*>(take(sizeof(float) * kvb * d));
  w.khole = reinterpret_cast<float*>(take(sizeof(float) * kvb * d));
  w.dk = reinterpret_cast<float*>(take(sizeof(float) * kvb * d));
  w.dv = reinterpret_cast<float*>(take(sizeof(float) * kvb * d));
  w.qf = reinterpret_cast<float*>(take(sizeof(float) * qb * d));
  w.dof = reinterpret_cast<float*>(take(sizeof(float) * qb * d));
  w.S = reinterpret_cast<float*>(take(sizeof(float) * qb * w.ldS));
  w.dP = reinterpret_cast<float*>(take(sizeof(float) * qb * w.ldS));
  w.G = nullptr;
  if (pl.mod) {  // zeroed once: the DS epilogue reads whole panels of it
    w.G = reinterpret_cast<float*>(take(sizeof(float) * qb * w.ldS));
    memset(w.G, 0, sizeof(float) * qb * w.ldS);
  }
  w.Pd = pl.dr.on ? reinterpret_cast<float*>(take(sizeof(float) * qb * w.ldS)) : nullptr;
  w.rlo = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * pl.group * pl.nqt));
  w.rhi = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * pl.group * pl.nqt));
  w.L = reinterpret_cast<float*>(take(sizeof(float) * qb));
  w.D = reinterpret_cast<float*>(take(sizeof(float) * qb));
  w.mask = reinterpret_cast<uint8_t*>(take(qb * kvb));
  w.colkeep = reinterpret_cast<uint8_t*>(take(kvb));
  w.tflag = nullptr;
  if (pl.qbl) {  // zeroed once: every flag that is set is cleared as its tile is visited
    const int64_t nf = std::max<int64_t>(pl.nqt, pl.qbl->cols) + 1;
    w.tflag = reinterpret_cast<uint8_t*>(take(nf));
    memset(w.tflag, 0, nf);
  }
  return w;
}

// One task: kv tiles [seg_begin[seg], seg_begin[seg+1]) of kv head hk in batch b.
template <class Variant, class Element>
static void bwd_task(const FgBwdArgs& a, const typename Variant::Params& prm, const BwdPlan& pl,
                     int64_t b, int64_t hk, int64_t seg, const BwdWork& w) {
  using C = Conv<Element>;
  using T = typename C::T;
  constexpr bool kLowp = C::kLowp;
  const Seqs& sq = pl.sq;
  // The sequence's own lengths and first rows (padded: seqlen_q, seqlen_k and 0).
  const int64_t Hq = a.heads_q, Nq = sq.len_q(b), Nk = sq.len_k(b), d = a.head_dim;
  const int64_t q_row0 = sq.q0(b), k_row0 = sq.k0(b);
  const int64_t qb = pl.qb, kvb = pl.kvb, ldS = w.ldS, group = pl.group;
  const int64_t nqt = Nq > 0 ? (Nq + qb - 1) / qb : 0;  // <= pl.nqt (the rlo / rhi row length)
  const int nq_i = (int)Nq, nk_i = (int)Nk;
  const bool blas = pl.blas;
  const float alpha = a.scale * kLog2e;
  const bool sparse = pl.qbl != nullptr;
  // Score-mod path: G holds dscore(s) (no parameter gradient: the DS epilogue multiplies it in)
  // or s itself (parameter gradient: dscore and param_grad run together after the DS epilogue).
  constexpr bool kMod = bwd_mod_path<Variant>();
  constexpr bool kStoreS = Variant::kHasParamGrad;
  const int bi = (int)b;

  // kv range [rlo, rhi) of every (query head of the group, q tile), clamped to [0, seqlen_k].
  for (int64_t g = 0; g < group; ++g) {
    const int hq = (int)(hk * group + g);
    for (int64_t qt = 0; qt < nqt; ++qt) {
      const int64_t q_lo = qt * qb, q_hi = std::min(q_lo + qb, Nq);
      const int64_t lo = Variant::kv_lo(prm, bi, hq, (int)q_lo, (int)q_hi, nq_i, nk_i);
      const int64_t hi = Variant::kv_hi(prm, bi, hq, (int)q_lo, (int)q_hi, nq_i, nk_i);
      w.rlo[g * pl.nqt + qt] = lo < 0 ? 0 : (lo > Nk ? Nk : lo);
      w.rhi[g * pl.nqt + qt] = hi > Nk ? Nk : (hi < 0 ? 0 : hi);
    }
  }

  const T* Kh =
      static_cast<const T*>(a.k) + b * a.k_stride_b + hk * a.k_stride_h + k_row0 * a.k_stride_n;
  const T* Vh =
      static_cast<const T*>(a.v) + b * a.v_stride_b + hk * a.v_stride_h + k_row0 * a.v_stride_n;
  T* dKh = static_cast<T*>(a.dk) + b * a.dk_stride_b + hk * a.dk_stride_h + k_row0 * a.dk_stride_n;
  T* dVh = static_cast<T*>(a.dv) + b * a.dv_stride_b + hk * a.dv_stride_h + k_row0 * a.dv_stride_n;
  float* dq_seg = seg == 0 ? a.dq_accum : pl.dq_extra + (seg - 1) * pl.nrows * d;

  for (int64_t kt = pl.seg_lo(b, seg); kt < pl.seg_lo(b, seg + 1); ++kt) {
    const int64_t k0 = kt * kvb, k1 = std::min(k0 + kvb, Nk), n = k1 - k0;
    memset(w.dk, 0, sizeof(float) * n * d);
    memset(w.dv, 0, sizeof(float) * n * d);
    bool loaded = false;
    const float* Kf = nullptr;  // K tile rows, fp32 row-major
    const float* Vf = nullptr;  // V tile rows, fp32 row-major (BLAS only)
    int64_t ldk = d, ldv = d;

    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = hk * group + g;
      const int hi_ = (int)h;
      const int64_t* rlo = w.rlo + g * pl.nqt;
      const int64_t* rhi = w.rhi + g * pl.nqt;
      const int64_t row0 = sq.row_q(b, h, Hq, 0);  // the rows of (b, h) in lse, softmax_d, dQ
      const float* lse_bh = a.lse + row0;
      const float* D_bh = a.softmax_d + row0;
      float* dq_bh = dq_seg + row0 * d;
      const T* Qh =
          static_cast<const T*>(a.q) + b * a.q_stride_b + h * a.q_stride_h + q_row0 * a.q_stride_n;
      const T* dOh = static_cast<const T*>(a.dout) + b * a.do_stride_b + h * a.do_stride_h +
                     q_row0 * a.do_stride_n;
      // Block lists: only the q tiles listed in row kt of (b, h), flagged in w.tflag (each flag
      // cleared as the loop below passes it).
      if (sparse &&
          block_mark(block_row(*pl.qbl, b, h, kt), pl.qbl->cols, 0,
                     std::min<int64_t>(nqt, pl.qbl->cols), w.tflag) == 0)
        continue;

      for (int64_t qt = 0; qt < nqt; ++qt) {
        int listed = 0;  // as in fwd.h: 1 partial (mask), 2 full (no keep() with full_kept)
        if (sparse) {
          const uint8_t f = w.tflag[qt];
          if (!f) continue;
          w.tflag[qt] = 0;
          listed = (f & 1) ? 1 : 2;
        }
        (void)listed;
        const int64_t cs = std::max(k0, rlo[qt]), ce = std::min(k1, rhi[qt]);
        if (cs >= ce) continue;
        const int64_t q_lo = qt * qb, mq = std::min(qb, Nq - q_lo);
        const float* lse = lse_bh + q_lo;
        // Rows with lse == -inf see no key: trimmed at both ends, P = 0 inside. A NaN lse (a NaN
        // or +inf score at a kept key) is not empty: its P = 2^(s - NaN) is NaN and reaches dQ of
        // the row and dK / dV of the keys it keeps (as an unfused autograd's gradients).
        int64_t r0 = 0, r1 = mq;
        while (r0 < r1 && lse[r0] == kNegInf) ++r0;
        while (r1 > r0 && lse[r1 - 1] == kNegInf) --r1;
        if (r0 == r1) continue;
        int64_t c0 = cs - k0, c1 = ce - k0;  // tile columns
        bool full = true, holes = false;
        if constexpr (Variant::kHasMask) {
          full = listed == 1   ? false
                 : listed == 2 && pl.qbl->full_kept
                     ? true
                     : Variant::tile_full(prm, bi, hi_, (int)(q_lo + r0), (int)(q_lo + r1),
                                          (int)cs, (int)ce, nq_i, nk_i);
          if (!full) {
            memset(w.colkeep + c0, 0, c1 - c0);
            int64_t nr0 = r1, nr1 = r0;
            for (int64_t i = r0; i < r1; ++i) {
              uint8_t* mr = w.mask + i * kvb;
              uint8_t any = 0;
              if (lse[i] != kNegInf) {
                const int qi = (int)(q_lo + i);
                for (int64_t j = c0; j < c1; ++j) {
                  const uint8_t kp = Variant::keep(prm, bi, hi_, qi, (int)(k0 + j), nq_i, nk_i);
                  mr[j] = kp;
                  any |= kp;
                  w.colkeep[j] |= kp;
                }
              } else {
                memset(mr + c0, 0, c1 - c0);
              }
              if (any) {
                nr0 = nr0 < i ? nr0 : i;
                nr1 = i + 1;
              }
            }
            if (nr0 >= nr1) continue;  // the whole tile is masked
            r0 = nr0;
            r1 = nr1;
            while (!w.colkeep[c0]) ++c0;
            while (!w.colkeep[c1 - 1]) --c1;
            for (int64_t j = c0; j < c1; ++j) holes |= !w.colkeep[j];
          }
        }
        const int64_t m = r1 - r0, nn = c1 - c0;
        const int64_t nn8 = round_up(nn, 8);
        const int64_t c0a = blas ? c0 : (c0 & ~int64_t(15));  // own: panel-aligned start

        if (!loaded) {  // K/V of the kv tile, once per tile (only when some q tile needs it)
          loaded = true;
          if (!blas) {
            pack_kt<Element>(Kh + k0 * a.k_stride_n, a.k_stride_n, n, d, w.kt);
            pack_kt<Element>(Vh + k0 * a.v_stride_n, a.v_stride_n, n, d, w.vt);
          }
          if constexpr (kLowp) {
            for (int64_t j = 0; j < n; ++j)
              C::to_f32(Kh + (k0 + j) * a.k_stride_n, w.kf + j * d, d);
            Kf = w.kf;
            ldk = d;
            if (blas) {
              for (int64_t j = 0; j < n; ++j)
                C::to_f32(Vh + (k0 + j) * a.v_stride_n, w.vf + j * d, d);
              Vf = w.vf;
              ldv = d;
            }
          } else {
            Kf = reinterpret_cast<const float*>(Kh) + k0 * a.k_stride_n;
            ldk = a.k_stride_n;
            Vf = reinterpret_cast<const float*>(Vh) + k0 * a.v_stride_n;
            ldv = a.v_stride_n;
          }
        }

        // Q and dO rows [q_lo + r0, q_lo + r1), fp32.
        const float *Qf, *dOf;
        int64_t ldq, lddo;
        const T* Qt = Qh + (q_lo + r0) * a.q_stride_n;
        const T* dOt = dOh + (q_lo + r0) * a.do_stride_n;
        if constexpr (kLowp) {
          for (int64_t i = 0; i < m; ++i) {
            C::to_f32(Qt + i * a.q_stride_n, w.qf + i * d, d);
            C::to_f32(dOt + i * a.do_stride_n, w.dof + i * d, d);
          }
          Qf = w.qf;
          dOf = w.dof;
          ldq = lddo = d;
        } else {
          Qf = reinterpret_cast<const float*>(Qt);
          dOf = reinterpret_cast<const float*>(dOt);
          ldq = a.q_stride_n;
          lddo = a.do_stride_n;
        }
        for (int64_t i = 0; i < m; ++i) {
          const float l = lse[r0 + i];
          w.L[i] = l == kNegInf ? kPosInf : l * kLog2e;  // +inf: exp2(x - inf) = 0; NaN stays
          w.D[i] = D_bh[q_lo + r0 + i];
        }

        // S tile: row i = query q_lo + r0 + i, column j = key k0 + c0a + j. P = its [.., c0 - c0a..).
        // G (mod path) has the same layout; Gp = its P part.
        float* S = w.S;
        float* P = S + (c0 - c0a);
        float* Gp = kMod ? w.G + (c0 - c0a) : nullptr;
        const int64_t npan = (c1 - c0a + 15) / 16;  // own kernels: panels from c0a
        if constexpr (!kMod) {
          if (blas) {
            blas_sgemm(true, false, nn, m, d, alpha, Kf + c0 * ldk, ldk, Qf, ldq, 0.f, S, ldS);
            for (int64_t i = 0; i < m; ++i) {
              float* s = S + i * ldS;
              const f8 vl = splat(w.L[i]);
              for (int64_t j = 0; j < nn8; j += 8) st8(s + j, exp2v(ld8(s + j) - vl));
            }
          } else {
            gemm_abt<kEpiExp>(Qf, ldq, w.kt + (c0a / 16) * d * 16, npan, m, d, alpha, w.L, S,
                                  ldS);
          }
          if (!full || c0a < c0) {  // masked entries (by selection) and the panel-alignment head
            for (int64_t i = 0; i < m; ++i) {
              float* s = S + i * ldS;
              for (int64_t j = 0; j < c0 - c0a; ++j) s[j] = 0.f;
              if (!full) {
                const uint8_t* mr = w.mask + (r0 + i) * kvb + c0;
                float* p = s + (c0 - c0a);
                for (int64_t j = 0; j < nn; ++j) p[j] = mr[j] ? p[j] : 0.f;
              }
            }
          }
        } else {
          // s = scale·q·k (natural units); per in-bounds kept entry s' = score(s), G = dscore(s)
          // (or s); masked entries get s' = -inf, so P = 2^(s'·log2e − lse·log2e) is exactly 0.
          if (blas)
            blas_sgemm(true, false, nn, m, d, a.scale, Kf + c0 * ldk, ldk, Qf, ldq, 0.f, S, ldS);
          else
            gemm_abt<kEpiScale>(Qf, ldq, w.kt + (c0a / 16) * d * 16, npan, m, d, a.scale, nullptr, S, ldS);
          for (int64_t i = 0; i < m; ++i) {
            float* s = S + i * ldS;
            for (int64_t j = 0; j < c0 - c0a; ++j) s[j] = 0.f;
            float* p = P + i * ldS;
            float* gp = Gp + i * ldS;
            if (w.L[i] == kPosInf) {  // a row that sees no key (lse == -inf): P = 0, no hooks
              memset(p, 0, sizeof(float) * nn8);
              continue;
            }
            const int qi = (int)(q_lo + r0 + i);
            const int kv0 = (int)(k0 + c0);
            // Both hooks run before either store: a store through p / gp may alias Params in the
            // compiler's view and would keep it from sharing their common subexpressions.
            const uint8_t* mr = full ? nullptr : w.mask + (r0 + i) * kvb + c0;
            for (int64_t j = 0; j < nn; ++j) {
              const float x = p[j];
              const int kv = kv0 + (int)j;
              if (full || mr[j]) {
                const float sp = Variant::score(prm, x, bi, hi_, qi, kv, nq_i, nk_i);
                const float g = kStoreS ? x : Variant::dscore(prm, x, bi, hi_, qi, kv, nq_i, nk_i);
                p[j] = sp * kLog2e;
                gp[j] = g;
              } else {
                p[j] = kNegInf;
              }
            }
            for (int64_t j = nn; j < nn8; ++j) p[j] = kNegInf;
            const f8 vl = splat(w.L[i]);
            for (int64_t j = 0; j < nn8; j += 8) st8(p + j, exp2v(ld8(p + j) - vl));
          }
        }

        // Dropout: Pd = P ∘ Z, Z = keep / (1 − p), the forward's mask regenerated at the absolute
        // (b, h, q, kv) over the whole S tile (columns from key k0 + c0a).
        bool drop = false;
        const float* Pv = P;  // the probabilities the forward multiplied V by
        if constexpr (Variant::kHasDropout) {
          if (pl.dr.on) {
            drop = true;
            const int64_t width = blas ? nn8 : npan * 16;
            for (int64_t i = 0; i < m; ++i)
              dropout_row(pl.dr, b * Hq + h, q_lo + r0 + i, k0 + c0a, width, S + i * ldS,
                          w.Pd + i * ldS, pl.dr.scale);
            Pv = w.Pd + (c0 - c0a);
          }
        }

        // dV[c0, c1) += P^T dO (Pd^T dO with dropout).
        if (blas)
          blas_sgemm(false, true, d, nn, m, 1.f, dOf, lddo, Pv, ldS, 1.f, w.dv + c0 * d, d);
        else
          gemm_acc<true>(Pv, ldS, dOf, lddo, nn, m, d, w.dv + c0 * d, d);

        // dS = P ∘ (dO V^T − D), in place over P (0 wherever P is 0); with dropout
        // dS = P ∘ ((dO V^T) ∘ Z − D) = Pd ∘ (dO V^T) − P ∘ D. Mod path: that is dS', and
        // dS = dS' · dscore(s), selected to 0 wherever dS' == 0.
        constexpr bool kMulG = kMod && !kStoreS;  // G holds dscore(s): multiply it in here
        auto ds_gemm = [&](auto drop_tag) {
          constexpr bool kDrop = decltype(drop_tag)::value;
          gemm_abt<kMulG ? kEpiDSG : kEpiDS, kDrop>(dOf, lddo, w.vt + (c0a / 16) * d * 16, npan,
                                                      m, d, 1.f, w.D, S, ldS, w.G, w.Pd);
        };
        if (blas) {
          blas_sgemm(true, false, nn, m, d, 1.f, Vf + c0 * ldv, ldv, dOf, lddo, 0.f, w.dP, ldS);
          const f8 z = splat(0.f);
          for (int64_t i = 0; i < m; ++i) {
            float* p = P + i * ldS;
            const float* dp = w.dP + i * ldS;
            const float* pd = drop ? w.Pd + i * ldS : nullptr;
            const f8 vd = splat(w.D[i]);
            for (int64_t j = 0; j < nn8; j += 8) {
              const f8 pv = ld8(p + j);
              const f8 ds = pv == z ? z : (drop ? ld8(pd + j) * ld8(dp + j) - pv * vd
                                                : pv * (ld8(dp + j) - vd));
              if constexpr (kMulG)
                st8(p + j, ds != z ? ds * ld8(Gp + i * ldS + j) : z);
              else
                st8(p + j, ds);
            }
          }
        } else if (drop) {
          if constexpr (Variant::kHasDropout) ds_gemm(std::true_type{});
        } else {
          ds_gemm(std::false_type{});
        }
        if constexpr (kMod && kStoreS) {
          // G holds s: param_grad(dS', s) and dS = dS' · dscore(s) on every entry with dS' != 0
          // (in bounds, kept, nonzero P by construction).
          for (int64_t i = 0; i < m; ++i) {
            if (w.L[i] == kPosInf) continue;  // P = 0: dS' = 0 throughout
            float* p = P + i * ldS;
            const float* gp = Gp + i * ldS;
            const int qi = (int)(q_lo + r0 + i);
            const int kv0 = (int)(k0 + c0);
            for (int64_t j = 0; j < nn; ++j) {
              const float ds = p[j];
              if (ds != 0.f) {
                const float x = gp[j];
                const int kv = kv0 + (int)j;
                // dscore before param_grad: its atomic add may alias Params for the compiler.
                const float g = Variant::dscore(prm, x, bi, hi_, qi, kv, nq_i, nk_i);
                Variant::param_grad(prm, ds, x, bi, hi_, qi, kv, nq_i, nk_i);
                p[j] = ds * g;
              }
            }
          }
        }

        // dK[c0, c1) += dS^T Q (scale at write-back).
        if (blas)
          blas_sgemm(false, true, d, nn, m, 1.f, Qf, ldq, P, ldS, 1.f, w.dk + c0 * d, d);
        else
          gemm_acc<true>(P, ldS, Qf, ldq, nn, m, d, w.dk + c0 * d, d);

        // dQ rows += dS K[c0, c1) (scale in the dQ pass). Interior fully-masked columns: zero K
        // rows, so that NaN/inf there cannot leak through 0 * NaN.
        const float* Kd = Kf + c0 * ldk;
        int64_t ldkd = ldk;
        if (holes) {
          for (int64_t j = c0; j < c1; ++j) {
            float* dst = w.khole + (j - c0) * d;
            if (w.colkeep[j])
              memcpy(dst, Kf + j * ldk, sizeof(float) * d);
            else
              memset(dst, 0, sizeof(float) * d);
          }
          Kd = w.khole;
          ldkd = d;
        }
        float* dq_rows = dq_bh + (q_lo + r0) * d;
        if (blas)
          blas_sgemm(false, false, d, m, nn, 1.f, Kd, ldkd, P, ldS, 1.f, dq_rows, d);
        else
          gemm_acc<false>(P, ldS, Kd, ldkd, m, nn, d, dq_rows, d);
      }
    }

    // Write-back: dk = scale * dK, dv = dV (zeros for keys no query sees).
    for (int64_t j = 0; j < n; ++j) {
      C::scale_from_f32(w.dk + j * d, a.scale, dKh + (k0 + j) * a.dk_stride_n, d);
      C::scale_from_f32(w.dv + j * d, 1.f, dVh + (k0 + j) * a.dv_stride_n, d);
    }
  }
}

}  // namespace detail

template <class Variant, class Element>
int run_bwd(const FgBwdArgs& args) {
  static_assert(std::is_same<Element, float>::value ||
                    std::is_same<Element, c10::BFloat16>::value ||
                    std::is_same<Element, c10::Half>::value,
                "flashgen::cpu::run_bwd: Element must be float, c10::BFloat16 or c10::Half");
  using namespace detail;
  using C = Conv<Element>;
  using T = typename C::T;
  FgBwdArgs a = args;
  const int64_t B = a.batch, Hq = a.heads_q, Hkv = a.heads_kv;
  const int64_t Nq = a.seqlen_q, Nk = a.seqlen_k, d = a.head_dim;
  if (d <= 0 || d > 256 || d % 8 != 0) return FG_ERR_BAD_HEAD_DIM;
  if (B < 0 || Hq < 0 || Hkv < 0 || Nq < 0 || Nk < 0 || Nq > FG_MAX_SEQLEN || Nk > FG_MAX_SEQLEN)
    return FG_ERR_BAD_SHAPE;
  if (!blocks_ok(a.q_blocks, Nk, Nq)) return FG_ERR_BAD_SHAPE;  // a.kv_blocks: unused here
  if (B == 0 || (Hq == 0 && Hkv == 0)) return FG_OK;
  if (Hkv == 0 || Hq % Hkv != 0) return FG_ERR_BAD_SHAPE;
  Seqs sq;
  if (!seqs_of(a, sq)) return FG_ERR_BAD_SHAPE;
  if (sq.packed())  // the batch strides are ignored in the packed layout (args.h)
    a.q_stride_b = a.k_stride_b = a.v_stride_b = a.o_stride_b = a.do_stride_b = a.dq_stride_b =
        a.dk_stride_b = a.dv_stride_b = 0;
  // Rows of the per-row buffers: padded B * Hq rows of Nq; packed Hq rows of total_q (decoded
  // below as "batch 0" with rows of total_q tokens, the batch strides being 0).
  const int64_t Nrow = sq.packed() ? sq.total_q : Nq;
  const bool no_keys = sq.packed() ? sq.total_k == 0 : Nk == 0;
  const bool q_side = Hq > 0 && Nrow > 0, k_side = !no_keys;
  if (q_side && (!a.q || !a.out || !a.dout || !a.lse || !a.dq || !a.dq_accum || !a.softmax_d))
    return FG_ERR_BAD_SHAPE;
  if (k_side && (!a.k || !a.v || !a.dk || !a.dv)) return FG_ERR_BAD_SHAPE;

  const typename Variant::Params empty_params{};
  const typename Variant::Params& prm =
      a.params ? *static_cast<const typename Variant::Params*>(a.params) : empty_params;

  BwdTiles tiles;
  if (!bwd_tiles_of(a, tiles)) return FG_ERR_BAD_SHAPE;

  try {
    BwdPlan pl;
    pl.tiles = tiles;
    pl.dr = dropout_of<Variant>(a);
    pl.sq = sq;
    pl.qbl = a.q_blocks.data ? &a.q_blocks : nullptr;
    pl.nrows = sq.rows_q(Hq);
    if (sq.packed())
      bwd_plan_packed<Variant>(a, prm, pl);
    else
      bwd_plan<Variant>(a, prm, pl);
    pl.blas = use_blas(a);
    const int64_t nrows = pl.nrows;
    std::unique_ptr<Scratch> extra;
    if (pl.nseg > 1) {
      extra.reset(new Scratch(sizeof(float) * (pl.nseg - 1) * nrows * d));
      pl.dq_extra = static_cast<float*>(extra->p);
    }

    // 1. D = rowsum(dO ∘ O) − dlse; zero the dQ accumulators.
    if (nrows > 0) {
      at::parallel_for(0, nrows, 256, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = r % Nrow, bh = r / Nrow, h = bh % Hq, b = bh / Hq;
          for (int64_t s = 0; s < pl.nseg; ++s)
            memset((s == 0 ? a.dq_accum : pl.dq_extra + (s - 1) * nrows * d) + r * d, 0,
                   sizeof(float) * d);
          const T* o = static_cast<const T*>(a.out) + b * a.o_stride_b + h * a.o_stride_h +
                       i * a.o_stride_n;
          const T* g = static_cast<const T*>(a.dout) + b * a.do_stride_b + h * a.do_stride_h +
                       i * a.do_stride_n;
          f8 acc = splat(0.f);
          for (int64_t c = 0; c < d; c += 8) acc = fma8(C::load(o + c), C::load(g + c), acc);
          a.softmax_d[r] = hsum(acc) - (a.dlse ? a.dlse[r] : 0.f);
        }
      });
    }

    // 2. Main pass: dynamic task queue (each task's output is independent of the thread that
    //    runs it, so the schedule does not affect the results).
    const int64_t ntasks = (int64_t)pl.tasks.size();
    if (ntasks > 0 && pl.nkvt > 0) {
      const int64_t nthr = std::min<int64_t>(std::max(1, at::get_num_threads()), ntasks);
      std::atomic<int64_t> next{0};
      const size_t wbytes = bwd_work_bytes(pl, d);
      // One worker per invocation (a nested call gets the whole range: one worker, all tasks).
      at::parallel_for(0, nthr, 1, [&](int64_t begin, int64_t end) {
        if (begin >= end) return;
        Scratch scratch(wbytes);
        const BwdWork w = bwd_work_carve(pl, d, static_cast<char*>(scratch.p));
        for (;;) {
          const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
          if (t >= ntasks) break;
          const int64_t id = pl.tasks[t];
          const int64_t seg = id % pl.nseg, bkv = id / pl.nseg;
          bwd_task<Variant, Element>(a, prm, pl, bkv / Hkv, bkv % Hkv, seg, w);
        }
      });
    }

    // 3. dq = scale * sum of the segments' dQ (fixed order); exact zeros for empty rows.
    if (nrows > 0) {
      at::parallel_for(0, nrows, 128, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = r % Nrow, bh = r / Nrow, h = bh % Hq, b = bh / Hq;
          T* dq = static_cast<T*>(a.dq) + b * a.dq_stride_b + h * a.dq_stride_h +
                  i * a.dq_stride_n;
          if (no_keys || a.lse[r] == kNegInf) {
            memset(dq, 0, sizeof(T) * d);
            continue;
          }
          float* acc = a.dq_accum + r * d;
          for (int64_t s = 1; s < pl.nseg; ++s) {
            const float* part = pl.dq_extra + (s - 1) * nrows * d + r * d;
            for (int64_t c = 0; c < d; c += 8) st8(acc + c, ld8(acc + c) + ld8(part + c));
          }
          C::scale_from_f32(acc, a.scale, dq, d);
        }
      });
    }
  } catch (...) {
    return FG_ERR_LAUNCH;
  }
  return FG_OK;
}

}  // namespace cpu
}  // namespace flashgen

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
