// flashgen CUDA dropout: the keep mask of the fused dropout (FlashAttention, Alg. 2 and 4), for
// the mma fragments of the forward and backward kernels.
//
// The stream (flashgen/philox.h, fg_dropout_group) comes in groups of four elements, (q, kv),
// (q + 8, kv), (q, kv + 8), (q + 8, kv + 8) with bit 3 of q and kv clear, one Philox4x32-10 call
// per group, word w = (q bit 3) | (kv bit 3) << 1. An mma.m16n8 accumulator fragment gives each
// thread rows {g, g + 8} and, across two adjacent 8-column blocks, columns {c, c + 8}: exactly
// one group, in the forward (rows = q) as in the backward's transposed S^T (rows = kv). So each
// thread makes one Philox call per four of its elements and uses every word, and the mask is a
// function of the absolute (b, h, q, kv) alone: tiling, GQA grouping and the backward's
// traversal order never change it.
#pragma once
#include <stdint.h>

#include "flashgen/philox.h"

namespace flashgen {
namespace cuda {

// The dropout of one launch: null state = off. seed/offset are read from device memory (the op
// draws them on the device: no host synchronisation, CUDA-graph safe).
struct DropoutArgs {
  const int64_t* state;  // {seed, offset}
  uint32_t threshold;    // keep iff (word >> 8) >= threshold
  float scale;           // 1 / (1 - p)
};

struct DropoutKey {
  uint64_t seed, offset;
  uint32_t bh, threshold;
};

__device__ __forceinline__ DropoutKey dropout_key(const DropoutArgs& d, int64_t bh) {
  DropoutKey k;
  k.seed = uint64_t(__ldg(reinterpret_cast<const long long*>(d.state)));
  k.offset = uint64_t(__ldg(reinterpret_cast<const long long*>(d.state) + 1));
  k.bh = uint32_t(bh);
  k.threshold = d.threshold;
  return k;
}

// Keep bits of the group whose first element is (q_base, kv_base) (bit 3 of both clear):
// bit w for word w, i.e. bit 0 (q, kv), 1 (q + 8, kv), 2 (q, kv + 8), 3 (q + 8, kv + 8).
__device__ __forceinline__ uint32_t dropout_bits(const DropoutKey& k, int q_base, int kv_base) {
  const FgPhilox4 r = fg_dropout_group(k.seed, k.offset, k.bh, uint32_t(q_base), uint32_t(kv_base));
  return uint32_t((r.x[0] >> 8) >= k.threshold) | (uint32_t((r.x[1] >> 8) >= k.threshold) << 1) |
         (uint32_t((r.x[2] >> 8) >= k.threshold) << 2) |
         (uint32_t((r.x[3] >> 8) >= k.threshold) << 3);
}

}  // namespace cuda
}  // namespace flashgen
