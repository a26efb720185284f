// flashgen variant hooks: the contract between a generated variant and the hand-written kernels.
//
// The kernel skeletons (cpu/fwd.h, cuda/fwd.cuh) are written once; each spec is lowered to one
// struct that provides the members below, rendered from templates/variant.h.jinja. Sequence
// bounds (q < seqlen_q, kv < seqlen_k) are the skeleton's job; a variant describes only its mask
// and its score modification.
//
//   struct Variant {
//     struct Params { ... };                 // runtime scalars and tensor parameters (trivially
//                                            // copyable; the CUDA kernels take it by value)
//     static constexpr bool kHasMask;        // false: every in-bounds (q, kv) is kept
//     static constexpr bool kHasScoreMod;    // false: score() is the identity, dscore() is 1
//     static constexpr bool kHasParamGrad;   // true: param_grad() may write parameter gradients
//     static constexpr bool kRowExact;       // true: keep(q, kv) <=> kv_lo(q, q+1) <= kv <
//                                            // kv_hi(q, q+1), for every row (kernels may
//                                            // test the bounds instead of calling keep)
//     static constexpr bool kHasDropout;     // the spec declares `dropout`: the kernels apply
//                                            // the keep mask when args.dropout_state is set
//                                            // (args.h); false compiles no dropout code
//     // Keys a query tile [q_lo, q_hi) of (batch b, query head h) may see lie in
//     // [kv_lo(..), kv_hi(..)); tiles outside that range are never loaded. Results may lie
//     // outside [0, seqlen_k]; the skeleton clamps. q_hi may exceed seqlen_q (still sound).
//     static int kv_lo(const Params&, int b, int h, int q_lo, int q_hi, int seqlen_q, int seqlen_k);
//     static int kv_hi(const Params&, int b, int h, int q_lo, int q_hi, int seqlen_q, int seqlen_k);
//     // True when the mask keeps every (q, kv) of the tile [q_lo,q_hi) x [kv_lo,kv_hi): the
//     // skeleton then skips the per-element mask (bounds are still its own concern).
//     static bool tile_full(const Params&, int b, int h, int q_lo, int q_hi, int kv_lo, int kv_hi,
//                           int seqlen_q, int seqlen_k);
//     // Element mask: true keeps score (q, kv). The CUDA kernels may also call it for (q, kv)
//     // past seqlen_q / seqlen_k or outside [kv_lo, kv_hi) inside a visited tile (and discard the
//     // result), so that a tile's reads of one row or column are shared: it must be free of side
//     // effects and memory-safe there (generated code clamps every parameter index into range).
//     static bool keep(const Params&, int b, int h, int q, int kv, int seqlen_q, int seqlen_k);
//     // Score modification; s is the scaled score in natural units (scale * q.k).
//     static float score(const Params&, float s, int b, int h, int q, int kv, int seqlen_q,
//                        int seqlen_k);
//     // d score(s) / d s, derived symbolically from the spec (backward only).
//     static float dscore(const Params&, float s, int b, int h, int q, int kv, int seqlen_q,
//                         int seqlen_k);
//     // True when some gradient pointer in Params is non-null (param_grad would write): lets a
//     // kernel take a path without param_grad's atomics, whose possible aliasing with the
//     // parameters' reads would otherwise force those reads to repeat per element.
//     static bool param_grad_enabled(const Params&);
//     // Adds ds * d score(s) / d param to every float tensor parameter whose gradient pointer
//     // in Params is non-null (atomically: fg_atomic_add). ds is dL/d score(s) (backward only).
//     static void param_grad(const Params&, float ds, float s, int b, int h, int q, int kv,
//                            int seqlen_q, int seqlen_k);
//   };
//
// Backward with a score mod (FlashAttention-2 Alg. 2 with the chain rule through score()):
//   s = scale * q.k;  s' = score(s);  P = exp(s' - lse) (0 where masked or out of bounds);
//   dS' = P * (dP - D);  dS = dS' * dscore(s), taken as 0 wherever dS' == 0 (so a non-finite
//   dscore at a masked or zero-probability entry never makes NaN);  dQ = scale * dS K, ...
//   With kHasParamGrad, param_grad(dS', s, ...) runs on every in-bounds kept entry whose
//   dS' != 0. Skeletons only ever call score/dscore/param_grad on in-bounds (q < seqlen_q,
//   kv < seqlen_k) entries; tensor parameter indices are clamped into range by the generated
//   code anyway, so no hook reads or writes out of bounds.
//
// Dropout (kHasDropout and a non-null args.dropout_state; FlashAttention, Alg. 2 and 4): with
// Z = keep / (1 - p), keep from fg_dropout_keep (philox.h) at the absolute (b, h, q, kv),
//   forward:  m, l and lse from the undropped P;  O = (P ∘ Z) V;
//   backward: dV = (P ∘ Z)ᵀ dO;  dP = (dO Vᵀ) ∘ Z;  D = rowsum(dO ∘ O) as usual (O already
//             holds the dropout);  dS' = P ∘ (dP − D), then the score-mod chain rule above.
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

// Helpers for generated expressions: integer arithmetic is exact (64-bit, or 32-bit where it
// provably fits) with Python's floor division and modulo (so a spec means the same in the
// reference); tensor indices are clamped into range.
//
// Every kernel rejects seqlen_q or seqlen_k above FG_MAX_SEQLEN before launch: the generator's
// range analysis assumes 0 <= q, kv < FG_MAX_SEQLEN (flashgen/lang/expr.py, MAX_SEQLEN).
#define FG_MAX_SEQLEN (1LL << 30)
typedef long long fg_int;
FG_HD fg_int fg_floordiv(fg_int a, fg_int b) {
  if (b == 0) return 0;
  fg_int q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
FG_HD fg_int fg_mod(fg_int a, fg_int b) {
  if (b == 0) return 0;
  fg_int r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
FG_HD fg_int fg_mini(fg_int a, fg_int b) { return a < b ? a : b; }
FG_HD fg_int fg_maxi(fg_int a, fg_int b) { return a > b ? a : b; }
FG_HD fg_int fg_absi(fg_int a) { return a < 0 ? -a : a; }
// 32-bit overloads: the generator computes an int subexpression in 32 bits only where interval
// analysis proves that its value and operands fit (flashgen/lang/expr.py, Cxx), so these never overflow.
FG_HD int fg_floordiv(int a, int b) {
  if (b == 0) return 0;
  int q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
FG_HD int fg_mod(int a, int b) {
  if (b == 0) return 0;
  int r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
FG_HD int fg_mini(int a, int b) { return a < b ? a : b; }
FG_HD int fg_maxi(int a, int b) { return a > b ? a : b; }
FG_HD int fg_absi(int a) { return a < 0 ? -a : a; }
FG_HD int fg_signi(int x) { return (x > 0) - (x < 0); }
FG_HD fg_int fg_index(fg_int i, long long size) { return i < 0 ? 0 : (i >= size ? size - 1 : i); }
FG_HD int fg_clamp_kv(fg_int x, int seqlen_k) {
  return (int)(x < 0 ? 0 : (x > seqlen_k ? seqlen_k : x));
}
FG_HD float fg_sign(float x) { return (float)((x > 0.f) - (x < 0.f)); }
FG_HD fg_int fg_signi(fg_int x) { return (fg_int)((x > 0) - (x < 0)); }
// tanh accurate to a few fp32 ulps of its absolute value even under --use_fast_math (where tanhf
// becomes tanh.approx.f32, ~5e-4 relative error: softcap · tanh(s / softcap) would carry
// softcap × that into every score).
FG_HD float fg_tanh(float x) {
#if defined(__CUDA_ARCH__)
  return 1.f - 2.f / (__expf(2.f * x) + 1.f);
#else
  return tanhf(x);
#endif
}

// fg_atomic_add(p, v): *p += v atomically. On the GPU the lanes of a warp that add into the same
// address in the same call are combined first (one atomic per distinct address per warp): a
// per-head parameter such as ALiBi's slopes otherwise takes one atomic per score on one address.
FG_HD void fg_atomic_add(float* p, float v) {
#if defined(__CUDA_ARCH__)
  const unsigned active = __activemask();
  const unsigned peers = __match_any_sync(active, reinterpret_cast<unsigned long long>(p));
  const unsigned lane = threadIdx.x & 31u;
  const unsigned leader = __ffs(peers) - 1;
  if (peers == 0xffffffffu) {
    for (int off = 16; off >= 1; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  } else {
    float total = v;
    for (unsigned m = peers & (peers - 1); m; m &= m - 1) {
      const float x = __shfl_sync(peers, v, __ffs(m) - 1);
      if (lane == leader) total += x;
    }
    v = total;
  }
  if (lane == leader) atomicAdd(p, v);
#else  // compare-and-swap loop on the float's bits
  float cur, next;
  __atomic_load(p, &cur, __ATOMIC_RELAXED);
  do {
    next = cur + v;
  } while (!__atomic_compare_exchange(p, &cur, &next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
#endif
}

}  // namespace flashgen
