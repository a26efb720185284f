// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel Random Numbers: As Easy as 1, 2, 3",
// SC 2011): a counter-based generator, a pure function of a 128-bit counter and a 64-bit key, so
// any element's random number is computed where it is needed, in any order, on any device.
//
// flashgen's dropout stream (v2) is keyed by (seed, offset, b, h, q, kv) with absolute positions,
// one Philox call per group of eight elements: q in {qb, qb + 8} x kv in {kb, kb + 1, kb + 8,
// kb + 9}, with qb = q & ~8 (bit 3 clear) and kb = kv & ~9 (bits 0 and 3 clear):
//   counter = {kb, qb, b * heads_q + h, offset mod 2^32},
//   key     = {seed mod 2^32, (seed >> 32) ^ (offset >> 32)}   (all counters taken mod 2^32).
// Element (q, kv) takes word w = (q bit 3) | (kv bit 3) << 1 of that call and, within it, the
// 16-bit half kv bit 0 selects (0: bits 0..15, 1: bits 16..31). It is kept iff that half, as a
// 16-bit fraction, is >= dropout_p:
//   keep <=> ((out[w] >> (16 * (kv & 1))) & 0xFFFF) >= threshold,  threshold = round(p * 2^16)
// (threshold 2^16, for p within 2^-17 of 1, keeps nothing). A tensor-core accumulator fragment
// (mma.m16n8 or wgmma) gives a thread rows {g, g + 8} and columns {2t, 2t + 1} of each 8-column
// block: in the forward (rows = q) a whole group across two adjacent blocks, one call per eight
// elements; in the backward's transposed tiles (rows = kv) the calls of q = c and q = c + 1,
// of which it uses the halves its kv parity selects.
// flashgen/philox.py implements the same in PyTorch (the reference regenerates the exact mask).
#pragma once
#include <stdint.h>

#ifndef FG_HD  // as in flashgen/variant.h
#if defined(__CUDACC__)
#define FG_HD __host__ __device__ __forceinline__
#else
#define FG_HD inline
#endif
#endif

namespace flashgen {

struct FgPhilox4 {
  uint32_t x[4];
};

FG_HD void fg_mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  *lo = (uint32_t)p;
}

FG_HD FgPhilox4 fg_philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {  // key schedule: bump before rounds 2..10 (Random123's order)
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, lo0, hi1, lo1;
    fg_mulhilo32(0xD2511F53u, c0, &hi0, &lo0);
    fg_mulhilo32(0xCD9E8D57u, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return FgPhilox4{{c0, c1, c2, c3}};
}

// The four words of the group whose first element is (q_base, kv_base) (q_base bit 3 clear,
// kv_base bits 0 and 3 clear): word 0 holds (q, kv) and (q, kv + 1) in its low and high halves,
// word 1 (q + 8, kv) and (q + 8, kv + 1), word 2 (q, kv + 8) and (q, kv + 9), word 3 (q + 8,
// kv + 8) and (q + 8, kv + 9); bh = b * heads_q + h.
FG_HD FgPhilox4 fg_dropout_group(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t q_base,
                                 uint32_t kv_base) {
  return fg_philox4x32_10(kv_base, q_base, bh, (uint32_t)offset, (uint32_t)seed,
                          (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32));
}

// The 16-bit value of half `half` (0: low, 1: high) of a Philox word.
FG_HD uint32_t fg_dropout_half(uint32_t word, uint32_t half) {
  return (word >> (16u * half)) & 0xFFFFu;
}

// Whether dropout keeps score (b, h, q, kv); see the header comment for the keying.
FG_HD bool fg_dropout_keep(uint64_t seed, uint64_t offset, int64_t bh, int64_t q, int64_t kv,
                           uint32_t threshold) {
  const uint32_t q32 = (uint32_t)q, kv32 = (uint32_t)kv;
  const FgPhilox4 r = fg_dropout_group(seed, offset, (uint32_t)bh, q32 & ~8u, kv32 & ~9u);
  const uint32_t w = ((q32 >> 3) & 1u) | (((kv32 >> 3) & 1u) << 1);
  return fg_dropout_half(r.x[w], kv32 & 1u) >= threshold;
}

}  // namespace flashgen
