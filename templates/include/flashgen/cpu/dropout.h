// flashgen CPU dropout: the keep mask of a row of the P tile, 32 keys per Philox vector.
//
//   Dropout dr = dropout_of<Variant>(args);   // off unless Variant::kHasDropout and
//                                             // args.dropout_state != null (args.h)
//   dropout_row(dr, bh, q, kv0, n, src, dst, mul);
//       dst[j] = keep(bh, q, kv0 + j) ? src[j] * mul : 0   for j in [0, n)   (dst may be src)
//
// keep is fg_dropout_keep (flashgen/philox.h) bit for bit: the v2 stream of Philox4x32-10
// (Salmon et al., SC 2011), one call per group of eight elements q in {qb, qb + 8} x kv in
// {kb, kb + 1, kb + 8, kb + 9} (qb = q & ~8, kb = kv & ~9), counter {kb, qb, bh, offset mod 2^32},
// key {seed mod 2^32, (seed >> 32) ^ (offset >> 32)}, word (q bit 3) | (kv bit 3) << 1 and of it
// the 16-bit half kv bit 0 selects, kept iff that half >= threshold (round(p * 2^16)); bh =
// b * heads_q + h with h the query head, q and kv absolute positions, so tiling, trimming, GQA
// grouping and the backward's traversal order never change the mask. A row takes two words of
// each call, four keys: eight calls (one vector, counters kb = 32m + {0, 2, 4, 6, 16, 18, 20,
// 22}) give keys 32m .. 32m + 31 of the row. The 32 x 32 -> 64-bit products of a round are two
// 64-bit lane multiplies (even and odd lanes; vpmuludq with AVX2), and two vectors run
// interleaved (one Philox chain is latency-bound).
//
// Self-contained (no torch headers), so it can be compiled and checked on its own.
#pragma once

#include <stdint.h>
#include <string.h>

#include "flashgen/philox.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace flashgen {
namespace cpu {

// The dropout of one kernel call.
struct Dropout {
  bool on = false;
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;
  float scale = 1.f;  // 1 / (1 - p)
};

// From an FgFwdArgs / FgBwdArgs: off for variants without `dropout` (nothing of it is compiled
// into their kernels) and when dropout_state is null (dropout_p == 0).
template <class Variant, class Args>
inline Dropout dropout_of(const Args& a) {
  Dropout dr;
  if constexpr (Variant::kHasDropout) {
    if (a.dropout_state) {
      dr.on = true;
      dr.seed = (uint64_t)a.dropout_state[0];
      dr.offset = (uint64_t)a.dropout_state[1];
      dr.threshold = a.dropout_threshold;
      dr.scale = a.dropout_scale;
    }
  }
  return dr;
}

namespace dropout_detail {

typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint64_t u64x4 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

// The kv_base offsets of the eight lanes of a vector, from its first key: lanes {0, 1, 4, 5} hold
// the groups of keys +0 .. +15 (kv_base +0, +2, +4, +6), lanes {2, 3, 6, 7} those of keys
// +16 .. +31, ordered so that interleaving the low and high halves of lanes 0, 1, 4, 5 (or 2, 3,
// 6, 7) lists eight consecutive keys (vpunpckldq / vpunpckhdq with AVX2, which interleave within
// 128-bit halves: no lane-crossing shuffle).
#define FG_DROPOUT_LANE_KB {0u, 2u, 16u, 18u, 4u, 6u, 20u, 22u}

#if defined(__AVX2__) && defined(__has_builtin)
#if __has_builtin(__builtin_ia32_pmuludq256)
#define FG_DROPOUT_PMULUDQ 1
#endif
#endif

#ifdef FG_DROPOUT_PMULUDQ
// The 64-bit products m * c[2i] (unsigned 32 x 32 bits) of the even lanes of c.
static inline u64x4 mul_even(u32x8 c, uint32_t m) {
  typedef int i32x8 __attribute__((vector_size(32)));
  return (u64x4)__builtin_ia32_pmuludq256((i32x8)c, (i32x8)(u32x8{} + m));
}

// (hi, lo) words of m * c in each of the eight 32-bit lanes.
static inline void mulhilo8(uint32_t m, u32x8 c, u32x8& hi, u32x8& lo) {
  const u32x8 pe = (u32x8)mul_even(c, m);                        // lanes 0, 2, 4, 6
  const u32x8 po = (u32x8)mul_even((u32x8)((u64x4)c >> 32), m);  // lanes 1, 3, 5, 7
  lo = __builtin_shufflevector(pe, po, 0, 8, 2, 10, 4, 12, 6, 14);
  hi = __builtin_shufflevector(pe, po, 1, 9, 3, 11, 5, 13, 7, 15);
}

// Philox words 0..3 of the groups with q_base = qb and kv_base = kb + 32v + (lane offset, above)
// for v < NV: w[v][i] holds word i. NV independent vectors per call: one Philox chain is
// latency-bound (its ten rounds are serial), two interleaved fill the multiplier.
template <int NV>
static inline void group8(const Dropout& dr, uint32_t bh, uint32_t qb, uint32_t kb, u32x8 (*w)[4]) {
  u32x8 c0[NV], c1[NV], c2[NV], c3[NV];
  for (int v = 0; v < NV; ++v) {
    c0[v] = u32x8 FG_DROPOUT_LANE_KB + (kb + 32u * v);
    c1[v] = u32x8{} + qb;
    c2[v] = u32x8{} + bh;
    c3[v] = u32x8{} + (uint32_t)dr.offset;
  }
  uint32_t k0 = (uint32_t)dr.seed, k1 = (uint32_t)(dr.seed >> 32) ^ (uint32_t)(dr.offset >> 32);
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {  // the key schedule of fg_philox4x32_10
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    for (int v = 0; v < NV; ++v) {
      u32x8 hi0, lo0, hi1, lo1;
      mulhilo8(0xD2511F53u, c0[v], hi0, lo0);
      mulhilo8(0xCD9E8D57u, c2[v], hi1, lo1);
      c0[v] = hi1 ^ c1[v] ^ k0;
      c1[v] = lo1;
      c2[v] = hi0 ^ c3[v] ^ k1;
      c3[v] = lo0;
    }
  }
  for (int v = 0; v < NV; ++v) {
    w[v][0] = c0[v];
    w[v][1] = c1[v];
    w[v][2] = c2[v];
    w[v][3] = c3[v];
  }
}
#else
// Without AVX2 a 64-bit lane multiply would be emulated (slower than scalar code): one
// fg_dropout_group call per group, as above.
template <int NV>
static inline void group8(const Dropout& dr, uint32_t bh, uint32_t qb, uint32_t kb, u32x8 (*w)[4]) {
  const u32x8 lane_kb = FG_DROPOUT_LANE_KB;
  for (int v = 0; v < NV; ++v)
    for (int l = 0; l < 8; ++l) {
      const FgPhilox4 r = fg_dropout_group(dr.seed, dr.offset, bh, qb, kb + 32u * v + lane_kb[l]);
      for (int i = 0; i < 4; ++i) w[v][i][l] = r.x[i];
    }
}
#endif

// The 16-bit values of eight consecutive keys of a word vector (see FG_DROPOUT_LANE_KB): part 0
// the halves (low, high) of lanes 0, 1, 4, 5, part 1 those of lanes 2, 3, 6, 7.
static inline u32x8 halves8(u32x8 word, int part) {
  const u32x8 lo = word & 0xFFFFu, hi = word >> 16;
#ifdef FG_DROPOUT_PMULUDQ
  return part ? __builtin_shufflevector(lo, hi, 2, 10, 3, 11, 6, 14, 7, 15)
              : __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 4, 12, 5, 13);
#else
  const int a = part ? 2 : 0;
  return u32x8{lo[a], hi[a], lo[a + 1], hi[a + 1], lo[a + 4], hi[a + 4], lo[a + 5], hi[a + 5]};
#endif
}

}  // namespace dropout_detail

// dst[j] = keep(bh, q, kv0 + j) ? src[j] * mul : 0 for j in [0, n); dst may equal src.
static inline void dropout_row(const Dropout& dr, int64_t bh, int64_t q, int64_t kv0, int64_t n,
                               const float* src, float* dst, float mul) {
  using namespace dropout_detail;
  if (n <= 0) return;
  const f32x8 vmul = f32x8{} + mul;
  const uint32_t q32 = (uint32_t)q, qbit = (q32 >> 3) & 1u;
  // Keys [k, k + 8) of the row (k - kv0 may fall outside [0, n) at the ends) from their 16-bit
  // values.
  auto apply = [&](int64_t k, u32x8 vals) {
    const int64_t j = k - kv0;
    if (j >= n || j + 8 <= 0) return;
    const u32x8 keep = (u32x8)(vals >= dr.threshold);
    if (j >= 0 && j + 8 <= n) {
      f32x8 x;
      memcpy(&x, src + j, sizeof x);
      x = (f32x8)((u32x8)(x * vmul) & keep);
      memcpy(dst + j, &x, sizeof x);
    } else {
      for (int l = 0; l < 8; ++l)
        if (j + l >= 0 && j + l < n) dst[j + l] = keep[l] ? src[j + l] * mul : 0.f;
    }
  };
  // Keys [m, m + 32) from one vector: word qbit holds kv = kv_base, kv_base + 1, word qbit | 2
  // kv = kv_base + 8, kv_base + 9.
  auto apply32 = [&](int64_t m, const u32x8* w) {
    apply(m, halves8(w[qbit], 0));
    apply(m + 8, halves8(w[qbit | 2], 0));
    apply(m + 16, halves8(w[qbit], 1));
    apply(m + 24, halves8(w[qbit | 2], 1));
  };
  const int64_t end = kv0 + n;
  int64_t m = kv0 & ~int64_t(31);  // keys [m, m + 32): one vector
  for (; m + 32 < end; m += 64) {
    u32x8 w[2][4];
    group8<2>(dr, (uint32_t)bh, q32 & ~8u, (uint32_t)m, w);
    apply32(m, w[0]);
    apply32(m + 32, w[1]);
  }
  if (m < end) {
    u32x8 w[1][4];
    group8<1>(dr, (uint32_t)bh, q32 & ~8u, (uint32_t)m, w);
    apply32(m, w[0]);
  }
}

#undef FG_DROPOUT_LANE_KB

}  // namespace cpu
}  // namespace flashgen

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
