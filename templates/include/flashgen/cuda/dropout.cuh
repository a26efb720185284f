// flashgen CUDA dropout: the keep mask of the fused dropout (FlashAttention, Alg. 2 and 4), for
// the mma fragments of the forward and backward kernels.
//
// The stream (flashgen/philox.h, fg_dropout_group; Philox4x32-10, Salmon et al., SC 2011) comes
// in groups of eight elements, q in {qb, qb + 8} x kv in {kb, kb + 1, kb + 8, kb + 9} with bit 3
// of qb and bits 0 and 3 of kb clear, one call per group: element (q, kv) takes word
// w = (q bit 3) | (kv bit 3) << 1 and, of it, the 16-bit half kv bit 0 selects (0: low).
// An mma.m16n8 (or wgmma) accumulator fragment gives each thread rows {g, g + 8} and columns
// {2t, 2t + 1} of each 8-column block. So:
//   * forward layout (rows = q, columns = kv): across two adjacent 8-column blocks a thread holds
//     exactly one group, kv {c, c + 1, c + 8, c + 9} with c = 2t: dropout_bits8, one call per
//     eight elements, every half of every word used;
//   * backward's transposed layout (rows = kv, columns = q): a thread holds kv {g, g + 8} and
//     q {c, c + 1, c + 8, c + 9}, i.e. the groups (q = c, kv & ~1) and (q = c + 1, kv & ~1), of
//     each word the half g & 1 selects: dropout_bits_kv, one call per four elements.
// The mask is a function of the absolute (b, h, q, kv) alone: tiling, GQA grouping and the
// backward's traversal order never change it.
#pragma once
#include <stdint.h>

#include "flashgen/philox.h"

namespace flashgen {
namespace cuda {

// The dropout of one launch: null state = off. seed/offset are read from device memory (the op
// draws them on the device: no host synchronisation, CUDA-graph safe).
struct DropoutArgs {
  const int64_t* state;  // {seed, offset}
  uint32_t threshold;    // keep iff the element's 16-bit half >= threshold (round(p * 2^16))
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

// dropout_bits8 and dropout_bits_kv are host-callable too (tests/test_dropout.py checks their
// bits against fg_dropout_keep on the host).

// __byte_perm(x, 0, sel) (one PRMT on the device): result byte i is byte sel nibble i of x for
// nibbles 0..3, zero for 4..7 (the bytes of the zero operand). The host form is for tests.
__host__ __device__ __forceinline__ uint32_t byte_perm0(uint32_t x, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, 0u, sel);
#else
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t b = (sel >> (4 * i)) & 7u;
    r |= (b < 4 ? (x >> (8 * b)) & 0xFFu : 0u) << (8 * i);
  }
  return r;
#endif
}

// Forward layout. Keep bits of the whole group whose first element is (q_base, kv_base) (bit 3
// of q_base, bits 0 and 3 of kv_base clear): bit 2w + h for half h of word w, i.e.
//   bit 0 (q, kv), 1 (q, kv + 1), 2 (q + 8, kv), 3 (q + 8, kv + 1),
//   bit 4 (q, kv + 8), 5 (q, kv + 9), 6 (q + 8, kv + 8), 7 (q + 8, kv + 9).
// In accumulator terms: bit 4i + e is element e of the 8-column block i (0: columns kv_base,
// kv_base + 1; 1: columns kv_base + 8, kv_base + 9) of rows {q_base, q_base + 8}.
__host__ __device__ __forceinline__ uint32_t dropout_bits8(const DropoutKey& k, int q_base,
                                                          int kv_base) {
  const FgPhilox4 r = fg_dropout_group(k.seed, k.offset, k.bh, uint32_t(q_base), uint32_t(kv_base));
  uint32_t bits = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    bits |= uint32_t((r.x[w] & 0xFFFFu) >= k.threshold) << (2 * w);
    bits |= uint32_t((r.x[w] >> 16) >= k.threshold) << (2 * w + 1);
  }
  return bits;
}

// Backward's transposed layout. Keep bits of the four elements q in {q_base, q_base + 8} x kv in
// {kv, kv + 8} (bit 3 of q_base and of kv clear; kv of either parity): the group (q_base,
// kv & ~1), of each word the half kv & 1 selects. Bit w for word w, i.e.
//   bit 0 (q, kv), 1 (q + 8, kv), 2 (q, kv + 8), 3 (q + 8, kv + 8).
__host__ __device__ __forceinline__ uint32_t dropout_bits_kv(const DropoutKey& k, int q_base,
                                                            int kv) {
  const FgPhilox4 r =
      fg_dropout_group(k.seed, k.offset, k.bh, uint32_t(q_base), uint32_t(kv) & ~1u);
  // The half as one byte permute: bytes 0, 1 (kv even) or 2, 3 (kv odd), then two zero bytes.
  const uint32_t sel = (uint32_t(kv) & 1u) ? 0x4432u : 0x4410u;
  uint32_t bits = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) bits |= uint32_t(byte_perm0(r.x[w], sel) >= k.threshold) << w;
  return bits;
}

// dropout_bits_kv for e0 = 0 and 1 (q_base = q0 + e0) at half the Philox calls, by the lane
// pairs that need the same two groups: lanes 4g + t and 4(g ^ 1) + t of a warp hold keys kv and
// kv ^ 1 (kv_row0 even) and the same query columns, so both need the groups (q0, kv & ~1) and
// (q0 + 1, kv & ~1), each taking the other half of every word. The lane of key parity e computes
// the group q0 + e (dropout_kv_pair_halves: the four bits of its own half and the four of the
// other half) and hands the other half's bits to its partner (one shuffle); dropout_kv_pair_bits
// puts its own and the partner's bits in e0 order. bits[e0] equals dropout_bits_kv(k, q0 + e0,
// kv) bit for bit (tests/test_dropout.py checks it on the host with the shuffle emulated).
// Used when the backward's Params::dropout_pair_share is set (FLASHGEN_DROPOUT_BWD_SHARE, default 1;
// 0 computes every group per lane, dropout_bits_kv).
__host__ __device__ __forceinline__ void dropout_kv_pair_halves(const DropoutKey& k, int q0, int kv, uint32_t& own,
                                                               uint32_t& other) {
  const uint32_t odd = uint32_t(kv) & 1u;
  const FgPhilox4 r = fg_dropout_group(k.seed, k.offset, k.bh, uint32_t(q0) + odd, uint32_t(kv) & ~1u);
  const uint32_t own_sel = odd ? 0x4432u : 0x4410u, other_sel = odd ? 0x4410u : 0x4432u;
  own = other = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    own |= uint32_t(byte_perm0(r.x[w], own_sel) >= k.threshold) << w;
    other |= uint32_t(byte_perm0(r.x[w], other_sel) >= k.threshold) << w;
  }
}

// `got`: the partner's `other` (its group q0 + (kv & 1 ^ 1), this lane's half).
__host__ __device__ __forceinline__ void dropout_kv_pair_bits(int kv, uint32_t own, uint32_t got, uint32_t (&bits)[2]) {
  const bool odd = kv & 1;
  bits[0] = odd ? got : own;
  bits[1] = odd ? own : got;
}

#if defined(__CUDA_ARCH__)
// Every lane of the warp must call it (the shuffle's mask is the whole warp).
__device__ __forceinline__ void dropout_bits_kv_pair(const DropoutKey& k, int q0, int kv, uint32_t (&bits)[2]) {
  uint32_t own, other;
  dropout_kv_pair_halves(k, q0, kv, own, other);
  dropout_kv_pair_bits(kv, own, __shfl_xor_sync(0xffffffffu, other, 4), bits);
}
#endif

}  // namespace cuda
}  // namespace flashgen
