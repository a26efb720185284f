// flashgen CPU conversion layer: Element (float, c10::BFloat16, c10::Half) <-> fp32, as Conv<E>
// (load 8, widen a row, scale and narrow a row with round-to-nearest-even, round P in place), and
// the software binary16 conversions used without F16C.
#pragma once

#include <stdint.h>
#include <string.h>

#include "flashgen/cpu/simd.h"

// The 16-bit Element types are only used as tags here (data is handled as raw uint16_t bits),
// so they are declared, not included: c10/util/Half.h alone costs ~1.7 s of parsing per TU.
// Compatible with including the real c10 headers before or after this file.
namespace c10 {
struct BFloat16;
struct Half;
}  // namespace c10

// Without -mavx, GCC warns that 32-byte vector arguments change the psABI; every function taking
// them here has internal linkage, so the warning does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace flashgen {
namespace cpu {
namespace detail {

// Element <-> fp32 conversions (n a multiple of 8). T is the storage type the kernel indexes.
typedef int16_t s8v __attribute__((vector_size(16)));

// IEEE binary16 <-> binary32 in software (used when F16C is not enabled).
static inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else {  // zero / subnormal: man * 2^-24, exact in fp32
    float f = float(man) * 5.9604644775390625e-8f;
    memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
static inline uint16_t float_to_half_bits(float f) {  // round to nearest even
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
  if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (x < 0x38800000u) {  // |f| < 2^-14: subnormal half, RNE through an fp32 add
    float a;
    memcpy(&a, &x, 4);
    a += 0.5f;  // ulp(0.5) = 2^-24 = the half subnormal step; the add rounds to nearest even
    uint32_t r;
    memcpy(&r, &a, 4);
    return uint16_t(sign | (r - 0x3f000000u));
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round to nearest even
  return uint16_t(sign | (x >> 13));
}

template <class E>
struct Conv;

template <>
struct Conv<float> {
  using T = float;
  static constexpr bool kLowp = false;
  static inline f8 load(const float* p) { return ld8(p); }
  static inline void to_f32(const float* src, float* dst, int64_t n) {
    memcpy(dst, src, n * sizeof(float));
  }
  static inline void scale_from_f32(const float* src, float s, float* dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) st8(dst + j, ld8(src + j) * s);
  }
  static inline void round_inplace(float*, int64_t) {}
};

template <>
struct Conv<c10::BFloat16> {
  using T = uint16_t;
  static constexpr bool kLowp = true;
  static inline f8 load(const uint16_t* p) {
    h8 h;
    memcpy(&h, p, sizeof h);
    return (f8)(__builtin_convertvector(h, u8) << 16);
  }
  static inline void to_f32(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) st8(dst + j, load(src + j));
  }
  static inline u8 rne_bits(f8 x) {  // fp32 -> bf16 bits (in the low half), RNE, NaN kept
    const u8 b = (u8)x;
    const u8 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return x != x ? (u8)(r | 0x40u) : r;
  }
  static inline void scale_from_f32(const float* src, float s, uint16_t* dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) {
      const h8 h = __builtin_convertvector(rne_bits(ld8(src + j) * s), h8);
      memcpy(dst + j, &h, sizeof h);
    }
  }
  static inline void round_inplace(float* x, int64_t n) {  // P in [0, 1]: finite
    for (int64_t j = 0; j < n; j += 8) {
      const u8 b = (u8)ld8(x + j);
      const u8 r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
      st8(x + j, (f8)r);
    }
  }
};

template <>
struct Conv<c10::Half> {
  using T = uint16_t;
  static constexpr bool kLowp = true;
  static inline f8 load(const uint16_t* p) {
#if defined(__F16C__) && defined(__AVX__)
    s8v h;
    memcpy(&h, p, sizeof h);
    return __builtin_ia32_vcvtph2ps256(h);
#else
    f8 v;
    for (int i = 0; i < 8; ++i) v[i] = half_bits_to_float(p[i]);
    return v;
#endif
  }
  static inline void store(uint16_t* p, f8 v) {  // RNE
#if defined(__F16C__) && defined(__AVX__)
    const s8v h = __builtin_ia32_vcvtps2ph256(v, 0);
    memcpy(p, &h, sizeof h);
#else
    for (int i = 0; i < 8; ++i) p[i] = float_to_half_bits(v[i]);
#endif
  }
  static inline void to_f32(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) st8(dst + j, load(src + j));
  }
  static inline void scale_from_f32(const float* src, float s, uint16_t* dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) store(dst + j, ld8(src + j) * s);
  }
  static inline void round_inplace(float* x, int64_t n) {
    uint16_t h[8];
    for (int64_t j = 0; j < n; j += 8) {
      store(h, ld8(x + j));
      st8(x + j, load(h));
    }
  }
};

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
