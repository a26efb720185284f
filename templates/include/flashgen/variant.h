// flashgen variant hooks: the contract between a generated variant and the hand-written kernels.
//
// The kernel skeletons (cpu/fwd.h, cuda/fwd.cuh) are written once; each spec is lowered to one
// struct that provides the members below, rendered from templates/variant.h.jinja. Sequence
// bounds (q < seqlen_q, kv < seqlen_k) are the skeleton's job; a variant describes only its mask
// and its score modification.
//
//   struct Variant {
//     struct Params { ... };                 // runtime scalars / tensor pointers (may be empty)
//     static constexpr bool kHasMask;        // false: every in-bounds (q, kv) is kept
//     static constexpr bool kHasScoreMod;    // false: score() is the identity
//     // Keys a query tile [q_lo, q_hi) may see lie in [kv_lo(..), kv_hi(..)); tiles outside that
//     // range are never loaded. Results may lie outside [0, seqlen_k]; the skeleton clamps.
//     static int kv_lo(const Params&, int q_lo, int q_hi, int seqlen_q, int seqlen_k);
//     static int kv_hi(const Params&, int q_lo, int q_hi, int seqlen_q, int seqlen_k);
//     // True when the mask keeps every (q, kv) of the tile [q_lo,q_hi) x [kv_lo,kv_hi): the
//     // skeleton then skips the per-element mask (bounds are still its own concern).
//     static bool tile_full(const Params&, int q_lo, int q_hi, int kv_lo, int kv_hi,
//                           int seqlen_q, int seqlen_k);
//     // Element mask: true keeps score (q, kv).
//     static bool keep(const Params&, int b, int h, int q, int kv, int seqlen_q, int seqlen_k);
//     // Score modification; s is the scaled score in natural units.
//     static float score(const Params&, float s, int b, int h, int q, int kv, int seqlen_q,
//                        int seqlen_k);
//   };
//
// h is the query head. All members are static and FG_HD so both families can call them.
#pragma once

#if defined(__CUDACC__)
#define FG_HD __host__ __device__ __forceinline__
#else
#define FG_HD inline
#endif

namespace flashgen {

FG_HD int imin(int a, int b) { return a < b ? a : b; }
FG_HD int imax(int a, int b) { return a > b ? a : b; }

}  // namespace flashgen
