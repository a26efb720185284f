// flashgen CPU SIMD layer: 8-wide fp32 vectors (f8) through GCC/Clang vector extensions, the
// vectorised exp2 of the softmax, the 8x8 in-register transpose, and the float constants both
// passes use. No dependency on the Variant, the Element type or torch.
#pragma once

#include <stdint.h>
#include <string.h>

#include <limits>

// Without -mavx, GCC warns that 32-byte vector arguments change the psABI; every function taking
// them here has internal linkage, so the warning does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace flashgen {
namespace cpu {
namespace detail {

// 8-wide float vectors through GCC/Clang vector extensions (AVX ymm with -march=native, split
// into SSE halves otherwise). Unaligned loads/stores go through memcpy.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));

static inline f8 ld8(const float* p) { f8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float* p, f8 v) { memcpy(p, &v, sizeof v); }
static inline f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }
static inline f8 vmax(f8 a, f8 b) { return a > b ? a : b; }
static inline float hmax(f8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
static inline float hsum(f8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// 2^x, branch free. Range reduction x = n + f, n = round(x), f in [-1/2, 1/2]; 2^f by the
// Cephes exp2f minimax polynomial (degree 6, rel. error ~2e-7); 2^n added to the exponent bits.
// x <= -126 (including -inf) gives exactly 0; inputs here are always <= 0 (x = s - rowmax).
// NaN gives NaN (DESIGN.md's non-finite rule: a NaN or +inf score at a kept key, whose x is
// NaN, must reach the row sum): the clamp and the final select both let it through, and the
// float-to-int conversion of NaN (x86: INT_MIN; AArch64: 0) shifted by 23 adds 0 to its bits.
static inline f8 exp2v(f8 x) {
  const f8 lo = splat(-127.0f);
  x = x < lo ? lo : x;
  const f8 magic = splat(12582912.0f);  // 1.5 * 2^23: round to nearest integer
  const f8 n = (x + magic) - magic;
  const f8 f = x - n;
  f8 p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const i8 ni = __builtin_convertvector(n, i8);
  const f8 r = (f8)((i8)p + (ni << 23));
  return x <= splat(-126.0f) ? splat(0.0f) : r;
}

static inline float exp2s(float x) {  // scalar wrapper (per-row rescale factors)
  return exp2v(splat(x))[0];
}
// In-register 8x8 transpose: r[k][t] <- r[t][k].
static inline void transpose8(f8 r[8]) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  // unpcklps/unpckhps, shufps, vperm2f128: the classic 24-shuffle AVX transpose.
  const f8 t0 = __builtin_shufflevector(r[0], r[1], 0, 8, 1, 9, 4, 12, 5, 13);
  const f8 t1 = __builtin_shufflevector(r[0], r[1], 2, 10, 3, 11, 6, 14, 7, 15);
  const f8 t2 = __builtin_shufflevector(r[2], r[3], 0, 8, 1, 9, 4, 12, 5, 13);
  const f8 t3 = __builtin_shufflevector(r[2], r[3], 2, 10, 3, 11, 6, 14, 7, 15);
  const f8 t4 = __builtin_shufflevector(r[4], r[5], 0, 8, 1, 9, 4, 12, 5, 13);
  const f8 t5 = __builtin_shufflevector(r[4], r[5], 2, 10, 3, 11, 6, 14, 7, 15);
  const f8 t6 = __builtin_shufflevector(r[6], r[7], 0, 8, 1, 9, 4, 12, 5, 13);
  const f8 t7 = __builtin_shufflevector(r[6], r[7], 2, 10, 3, 11, 6, 14, 7, 15);
  const f8 s0 = __builtin_shufflevector(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13);
  const f8 s1 = __builtin_shufflevector(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
  const f8 s2 = __builtin_shufflevector(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13);
  const f8 s3 = __builtin_shufflevector(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
  const f8 s4 = __builtin_shufflevector(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13);
  const f8 s5 = __builtin_shufflevector(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
  const f8 s6 = __builtin_shufflevector(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13);
  const f8 s7 = __builtin_shufflevector(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
  r[0] = __builtin_shufflevector(s0, s4, 0, 1, 2, 3, 8, 9, 10, 11);
  r[1] = __builtin_shufflevector(s1, s5, 0, 1, 2, 3, 8, 9, 10, 11);
  r[2] = __builtin_shufflevector(s2, s6, 0, 1, 2, 3, 8, 9, 10, 11);
  r[3] = __builtin_shufflevector(s3, s7, 0, 1, 2, 3, 8, 9, 10, 11);
  r[4] = __builtin_shufflevector(s0, s4, 4, 5, 6, 7, 12, 13, 14, 15);
  r[5] = __builtin_shufflevector(s1, s5, 4, 5, 6, 7, 12, 13, 14, 15);
  r[6] = __builtin_shufflevector(s2, s6, 4, 5, 6, 7, 12, 13, 14, 15);
  r[7] = __builtin_shufflevector(s3, s7, 4, 5, 6, 7, 12, 13, 14, 15);
#else
  f8 t[8];
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 8; ++k) t[k][i] = r[i][k];
  for (int k = 0; k < 8; ++k) r[k] = t[k];
#endif
}

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
