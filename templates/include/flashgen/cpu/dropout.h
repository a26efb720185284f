// flashgen CPU dropout: the keep mask of a row of the P tile, sixteen keys per Philox vector.
//
//   Dropout dr = dropout_of<Variant>(args);   // off unless Variant::kHasDropout and
//                                             // args.dropout_state != null (args.h)
//   dropout_row(dr, bh, q, kv0, n, src, dst, mul);
//       dst[j] = keep(bh, q, kv0 + j) ? src[j] * mul : 0   for j in [0, n)   (dst may be src)
//
// keep is fg_dropout_keep (flashgen/philox.h) bit for bit: one Philox4x32-10 call per group
// (q, kv), (q + 8, kv), (q, kv + 8), (q + 8, kv + 8) with bit 3 of q and kv clear, counter
// {kv & ~8, q & ~8, bh, offset mod 2^32}, key {seed mod 2^32, (seed >> 32) ^ (offset >> 32)}, word
// (q bit 3) | (kv bit 3) << 1, kept iff (word >> 8) >= threshold; bh = b * heads_q + h with h the
// query head, q and kv absolute positions, so tiling, trimming, GQA grouping and the backward's
// traversal order never change the mask. A row takes two words of each call: eight calls (one
// vector, counters kv_base = 16m .. 16m + 7) give keys 16m .. 16m + 15 of the row. The 32 x 32 ->
// 64-bit products of a round are two 64-bit lane multiplies (even and odd lanes; vpmuludq with
// AVX2), and two vectors run interleaved (one Philox chain is latency-bound).
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

// Philox words 0..3 of the groups with q_base = qb and kv_base = kb + 16v + lane (lane < 8) for
// v < NV: w[v][i] holds word i. NV independent vectors per call: one Philox chain is latency-bound
// (its ten rounds are serial), two interleaved fill the multiplier.
template <int NV>
static inline void group8(const Dropout& dr, uint32_t bh, uint32_t qb, uint32_t kb, u32x8 (*w)[4]) {
  u32x8 c0[NV], c1[NV], c2[NV], c3[NV];
  for (int v = 0; v < NV; ++v) {
    c0[v] = u32x8{0, 1, 2, 3, 4, 5, 6, 7} + (kb + 16u * v);
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
  for (int v = 0; v < NV; ++v)
    for (int l = 0; l < 8; ++l) {
      const FgPhilox4 r = fg_dropout_group(dr.seed, dr.offset, bh, qb, kb + 16u * v + l);
      for (int i = 0; i < 4; ++i) w[v][i][l] = r.x[i];
    }
}
#endif

}  // namespace dropout_detail

// dst[j] = keep(bh, q, kv0 + j) ? src[j] * mul : 0 for j in [0, n); dst may equal src.
static inline void dropout_row(const Dropout& dr, int64_t bh, int64_t q, int64_t kv0, int64_t n,
                               const float* src, float* dst, float mul) {
  using namespace dropout_detail;
  if (n <= 0) return;
  const f32x8 vmul = f32x8{} + mul;
  const uint32_t q32 = (uint32_t)q, qbit = (q32 >> 3) & 1u;
  // Keys [k, k + 8) of the row (k - kv0 may fall outside [0, n) at the ends): word qbit of a
  // group holds kv = kv_base, word qbit | 2 holds kv = kv_base + 8.
  auto apply = [&](int64_t k, u32x8 word) {
    const u32x8 keep = (u32x8)((word >> 8) >= dr.threshold);
    const int64_t j = k - kv0;
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
  const int64_t end = kv0 + n;
  int64_t m = kv0 & ~int64_t(15);  // keys [m, m + 16): the groups kv_base = m .. m + 7
  for (; m + 16 < end; m += 32) {
    u32x8 w[2][4];
    group8<2>(dr, (uint32_t)bh, q32 & ~8u, (uint32_t)m, w);
    for (int v = 0; v < 2; ++v) {
      apply(m + 16 * v, w[v][qbit]);
      apply(m + 16 * v + 8, w[v][qbit | 2]);
    }
  }
  if (m < end) {
    u32x8 w[1][4];
    group8<1>(dr, (uint32_t)bh, q32 & ~8u, (uint32_t)m, w);
    apply(m, w[0][qbit]);
    apply(m + 8, w[0][qbit | 2]);
  }
}

}  // namespace cpu
}  // namespace flashgen

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
