// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel Random Numbers: As Easy as 1, 2, 3",
// SC 2011): a counter-based generator, a pure function of a 128-bit counter and a 64-bit key, so
// any element's random number is computed where it is needed, in any order, on any device.
//
// flashgen keys its dropout stream by (seed, offset, b, h, q, kv) with absolute positions, one
// Philox call per group of four elements: (q, kv), (q + 8, kv), (q, kv + 8), (q + 8, kv + 8) with
// bit 3 of q and of kv clear (a tensor-core accumulator fragment holds exactly such a group):
//   counter = {kv & ~8, q & ~8, b * heads_q + h, offset mod 2^32},
//   key     = {seed mod 2^32, (seed >> 32) ^ (offset >> 32)}   (all counters taken mod 2^32),
// and element (q, kv) takes word w = (q bit 3) | (kv bit 3) << 1 of that call. It is kept iff that
// word, as a 24-bit fraction, is >= dropout_p:
//   keep <=> (out[w] >> 8) >= threshold,  threshold = round(dropout_p * 2^24).
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

// The four words of the group whose first element is (q_base, kv_base) (bit 3 of both clear):
// word 0 (q, kv), 1 (q + 8, kv), 2 (q, kv + 8), 3 (q + 8, kv + 8); bh = b * heads_q + h.
FG_HD FgPhilox4 fg_dropout_group(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t q_base,
                                 uint32_t kv_base) {
  return fg_philox4x32_10(kv_base, q_base, bh, (uint32_t)offset, (uint32_t)seed,
                          (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32));
}

// Whether dropout keeps score (b, h, q, kv); see the header comment for the keying.
FG_HD bool fg_dropout_keep(uint64_t seed, uint64_t offset, int64_t bh, int64_t q, int64_t kv,
                           uint32_t threshold) {
  const uint32_t q32 = (uint32_t)q, kv32 = (uint32_t)kv;
  const FgPhilox4 r = fg_dropout_group(seed, offset, (uint32_t)bh, q32 & ~8u, kv32 & ~8u);
  return (r.x[((q32 >> 3) & 1u) | (((kv32 >> 3) & 1u) << 1)] >> 8) >= threshold;
}

}  // namespace flashgen
