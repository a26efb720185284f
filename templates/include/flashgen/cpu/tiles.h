// flashgen CPU tile layer: the (query tile, kv tile) sizes of both passes from the per-core L2
// and the variant's key ranges (choose_tiles / sparse_tiles for the forward, bwd_choose_tiles
// for the backward), and the FLASHGEN_CPU_TILES / FLASHGEN_CPU_BWD_TILES overrides.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include <ATen/Parallel.h>

#include "flashgen/args.h"

namespace flashgen {
namespace cpu {
namespace detail {

// ------------------------------------------------------------------------------------------
// Tile sizes of the forward.
//
// Per (q tile, kv tile) the skeleton pays fixed costs that do not scale with qb * kvb * d:
// packing K^T (or, with BLAS, packing both operands of both gemms), the kernels' accumulator
// loads/stores, per-row softmax bookkeeping. Relative to the gemm work they shrink like
// a/qb + a/kvb; a ~ 5 was measured on Zen 3 (a 64 x 256 tile runs ~7-10% slower than
// 256 x 512). The S/P tile (qb x kvb fp32) is written by the QK gemm, swept by the softmax and
// read back by the PV gemm, so it should stay in the per-core L2, and so should the K and V
// tiles (kvb x d each):
//   kvb = 512 (torch's CPU flash kernel uses 512 too), halved while 2 * kvb * d * 4 B > L2
//         (d = 256 -> 256), capped by seqlen_k;
//   qb  <= L2 / (4 * kvb) clamped to [32, 256]: 256 for a 512 KiB L2 (S = 512 KiB) at d <= 128.
// Among qb in {qb_max, qb_max/2, ..., 32} the skeleton picks the one minimising the model
//   makespan(qb) * (1 + a/qb + a/kvb),
// where makespan is the largest per-thread sum, over the contiguous task chunks at::parallel_for
// hands out, of the score entries each task computes (mq x clamped kv range, from the variant's
// kv_lo/kv_hi hooks). This trades the efficiency of big q tiles against the work a diagonal mask
// wastes (causal: ~qb/2 masked columns per row on the diagonal tile) and against load imbalance
// when batch * heads is small. The kv ranges of this model are taken at b = h = 0.
// L2 = sysconf(_SC_LEVEL2_CACHE_SIZE), 512 KiB if unknown.
// Examples (2 threads, B*H = 16, d = 64): dense 1K/4K -> 256 x 512; causal 1K -> 64 x 512,
// causal 4K -> 128 x 512.
// FLASHGEN_CPU_TILES="qb,kvb" in the environment overrides the choice (tuning only).
struct Tiles {
  int64_t qb, kvb;
};

static inline int64_t l2_bytes() {
  static const int64_t v = [] {
    long s = -1;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    s = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    if (s < (256 << 10) || s > (8 << 20)) s = 512 << 10;
    return (int64_t)s;
  }();
  return v;
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <class Variant>
static Tiles choose_tiles(const typename Variant::Params& prm, int64_t bh, int64_t nq, int64_t nk,
                          int64_t d) {
  const int64_t l2 = l2_bytes();
  const int64_t nk8 = round_up(nk > 0 ? nk : 1, 8);
  int64_t kvb = 512;
  while (kvb > 128 && 2 * kvb * d * 4 > l2) kvb /= 2;
  kvb = kvb < nk8 ? kvb : nk8;
  int64_t qb_max = l2 / (4 * kvb);
  qb_max = qb_max < 32 ? 32 : (qb_max > 256 ? 256 : qb_max);

  int64_t qb = qb_max < nq ? qb_max : nq;
  if (nq > 32) {
    constexpr double kAlpha = 5.0;
    const int64_t threads = at::get_num_threads() > 0 ? at::get_num_threads() : 1;
    double best = -1.0;
    std::vector<double> prefix;
    for (int64_t cand = qb_max; cand >= 32; cand /= 2) {
      const int64_t qc = cand < nq ? cand : nq;
      const int64_t nqt = (nq + qc - 1) / qc;
      prefix.assign(nqt + 1, 0.0);
      for (int64_t t = 0; t < nqt; ++t) {
        const int64_t lo_q = t * qc, hi_q = lo_q + qc < nq ? lo_q + qc : nq;
        int64_t lo = Variant::kv_lo(prm, 0, 0, (int)lo_q, (int)hi_q, (int)nq, (int)nk);
        int64_t hi = Variant::kv_hi(prm, 0, 0, (int)lo_q, (int)hi_q, (int)nq, (int)nk);
        lo = lo < 0 ? 0 : lo;
        hi = hi > nk ? nk : hi;
        const double span = hi > lo ? double(hi - lo) : 0.0;
        prefix[t + 1] = prefix[t] + double(hi_q - lo_q) * (span + 8.0);  // +8: per-row epilogue
      }
      const int64_t ntasks = bh * nqt;
      const int64_t nthr = threads < ntasks ? threads : ntasks;
      const int64_t chunk = (ntasks + nthr - 1) / nthr;
      auto upto = [&](int64_t x) { return double(x / nqt) * prefix[nqt] + prefix[x % nqt]; };
      double makespan = 0.0;
      for (int64_t i = 0; i < nthr; ++i) {
        const int64_t b0 = i * chunk, b1 = b0 + chunk < ntasks ? b0 + chunk : ntasks;
        if (b0 >= b1) break;
        const double c = upto(b1) - upto(b0);
        makespan = c > makespan ? c : makespan;
      }
      const double cost = makespan * (1.0 + kAlpha / double(qc) + kAlpha / double(kvb));
      if (best < 0.0 || cost < best * 0.999) {  // ties: keep the larger tile
        best = cost;
        qb = qc;
      }
    }
  }
  if (const char* e = getenv("FLASHGEN_CPU_TILES")) {
    long a = 0, b = 0;
    char* end = nullptr;
    a = strtol(e, &end, 10);
    if (end && *end == ',') b = strtol(end + 1, nullptr, 10);
    if (a >= 1 && a <= 1024) qb = a;
    if (b >= 8 && b <= 8192) kvb = round_up(b, 8);
    qb = qb < nq ? qb : nq;
    kvb = kvb < nk8 ? kvb : nk8;
  }
  return {qb, kvb};
}

// Block lists (fwd_sparse): qb = block_r; kvb, the widest step (adjacent listed tiles of one kind
// in one aligned kvb-key chunk are visited together), is choose_tiles' kvb made a multiple of
// block_c: rounded up when it covers all of seqlen_k, else down. So a list of every tile (as
// full) of a mask-free variant steps through the keys exactly as the dense path does.
static inline Tiles sparse_tiles(const FgBlockLists& l, int64_t nk, int64_t d) {
  const int64_t bc = l.block_c, nk8 = round_up(nk > 0 ? nk : 1, 8);
  int64_t kvb = 512;
  while (kvb > 128 && 2 * kvb * d * 4 > l2_bytes()) kvb /= 2;
  kvb = kvb >= nk8 ? round_up(nk8, bc) : std::max(bc, kvb / bc * bc);
  return {l.block_r, kvb};
}

// ------------------------------------------------------------------------------------------
// Tile sizes of the backward. A task step (q tile x kv tile) touches, besides the qb x kvb P/dS tile (and, with a
// score mod, the qb x kvb G tile), per kv tile K^T and V^T panels, fp32 K, and the dK/dV
// accumulators (~5 * kvb * d floats) and per q tile Q, dO and the dQ rows (~3 * qb * d floats);
// all of it should stay in the per-core L2:
//   kvb = 128, halved (down to 32) while 5 * kvb * d * 4 B > L2 / 2; capped by seqlen_k;
//   qb_max = 128, halved (down to 32) while (t * qb * kvb + 3 * qb * d) * 4 B > L2 / 2, t = 1
//   (2 with a score mod; one more with dropout).
// Among qb in {qb_max, qb_max / 2, ..., 32} the one minimising
//   area(qb) * (1 + a / qb + a / kvb),   a = 5 (fixed per-tile costs, as in fwd.h)
// is used, where area(qb) = sum over q tiles of rows x |[kv_lo, kv_hi)| (from the variant's
// hooks, evaluated for b = h = 0: a model, not a visit list): the score entries the backward
// computes. Dense: qb = qb_max; a diagonal mask trades the masked half of the diagonal tiles
// against the per-tile overheads (causal 1K: 64, 4K: 128).
// On the 2-core Zen 3 test machine (512 KiB L2) at d = 64: kvb = 128, qb_max = 128.
// FLASHGEN_CPU_BWD_TILES="qb,kvb" overrides the choice (tuning only).
struct BwdTiles {
  int64_t qb, kvb;
};

// The score-mod path of the backward (raw scores kept in a G tile, hooks per element): taken with
// a score mod, and also for a parameter gradient without one (score() is then the identity).
template <class Variant>
constexpr bool bwd_mod_path() {
  return Variant::kHasScoreMod || Variant::kHasParamGrad;
}

template <class Variant>
static inline BwdTiles bwd_choose_tiles(const typename Variant::Params& prm, int64_t nq,
                                        int64_t nk, int64_t d, bool drop) {
  const int64_t l2 = l2_bytes();
  const int64_t tiles_qk = (bwd_mod_path<Variant>() ? 2 : 1) + (drop ? 1 : 0);  // P/dS (+ G, Pd)
  int64_t kvb = 128;
  while (kvb > 32 && 5 * kvb * d * 4 > l2 / 2) kvb /= 2;
  int64_t qb_max = 128;
  while (qb_max > 32 && (tiles_qk * qb_max * kvb + 3 * qb_max * d) * 4 > l2 / 2) qb_max /= 2;
  const int64_t nk8 = round_up(nk > 0 ? nk : 1, 8);
  kvb = kvb < nk8 ? kvb : nk8;
  int64_t qb = qb_max < nq ? qb_max : (nq > 0 ? nq : 1);
  if (nq > 32) {
    constexpr double kAlpha = 5.0;
    double best = -1.0;
    for (int64_t cand = qb_max; cand >= 32; cand /= 2) {
      const int64_t qc = cand < nq ? cand : nq;
      double area = 0.0;
      for (int64_t q_lo = 0; q_lo < nq; q_lo += qc) {
        const int64_t q_hi = q_lo + qc < nq ? q_lo + qc : nq;
        int64_t lo = Variant::kv_lo(prm, 0, 0, (int)q_lo, (int)q_hi, (int)nq, (int)nk);
        int64_t hi = Variant::kv_hi(prm, 0, 0, (int)q_lo, (int)q_hi, (int)nq, (int)nk);
        lo = lo < 0 ? 0 : lo;
        hi = hi > nk ? nk : hi;
        if (hi > lo) area += double(q_hi - q_lo) * double(hi - lo);
      }
      const double cost = area * (1.0 + kAlpha / double(qc) + kAlpha / double(kvb));
      if (best < 0.0 || cost < best * 0.999) {  // ties: keep the larger tile
        best = cost;
        qb = qc;
      }
    }
  }
  if (const char* e = getenv("FLASHGEN_CPU_BWD_TILES")) {
    char* end = nullptr;
    const long a = strtol(e, &end, 10);
    long b = 0;
    if (end && *end == ',') b = strtol(end + 1, nullptr, 10);
    if (a >= 1 && a <= 1024) qb = a;
    if (b >= 8 && b <= 1024) kvb = round_up(b, 8);
    kvb = kvb < nk8 ? kvb : nk8;
    qb = qb < nq ? qb : (nq > 0 ? nq : 1);
  }
  return {qb, kvb};
}

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen
