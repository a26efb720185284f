// flashgen CPU forward kernel skeleton: fused FlashAttention forward for one generated Variant.
//
//   template <class Variant, class Element>   // Element: float, c10::BFloat16, c10::Half
//   int flashgen::cpu::run_fwd(const FgFwdArgs& args);   // returns an FgStatus (args.h)
//
// Algorithm: FlashAttention forward (Dao et al. 2022, Alg. 1) in the FA2 loop order. The work
// is split over (batch, query head, query tile) with at::parallel_for; one task owns a query
// tile and streams the kv tiles in [Variant::kv_lo, Variant::kv_hi) (clamped to [0, seqlen_k]):
//
//     S = Q K^T * scale                      BLAS sgemm_ (MKL) or cpublas::brgemm, fp32
//     S = score(S)                           only if Variant::kHasScoreMod
//     S = keep ? S : -inf                    only on tiles where Variant::tile_full is false
//     m_new = max(m, rowmax S); P = 2^(S*log2e - m_new); l = l*2^(m - m_new) + rowsum P
//     O = O * 2^(m - m_new) + P V            same gemm, fp32 accumulator O
//
// then out = O / l and lse = ln(l) + m (natural log). Working in base 2: log2(e) is folded into
// the gemm's alpha (or applied after the score hook), so the softmax uses exp2.
//
// Numerics (all dtypes): fp32 accumulation everywhere. For 16-bit Elements the Q/K/V tiles are
// widened to fp32 scratch and the gemms run in fp32; a product of two bf16 (or two fp16) values
// is exact in fp32, so this is bit-for-bit "16-bit inputs, fp32 accumulate", and it runs on
// MKL's sgemm instead of the much slower 16-bit fallback gemm that an AVX2 machine gets. P is
// rounded to Element precision (RNE) before the PV product, as the reference keeps P in the
// input dtype; the row sum l uses the unrounded fp32 P (as torch's CPU flash kernel does).
//
// Edge cases:
//   * seqlen_q == 0 / batch == 0 / heads_q == 0: nothing to do. seqlen_k == 0, or a row that
//     sees no key: out row exactly 0 and lse exactly -inf (never NaN).
//   * Masked / out-of-range keys never leak, even when K/V hold NaN or inf there:
//       - only kv rows in [kv_lo, kv_hi) ∩ [0, seqlen_k) are ever read (gemm sizes are trimmed,
//         nothing beyond seqlen_k is touched);
//       - masking is by selection (S = keep ? S : -inf), so NaN scores at masked entries are
//         discarded and P is exactly 0 there (exp2 returns exactly 0 for -inf);
//       - on a partially masked tile, the columns that no row of the tile keeps are trimmed
//         from both ends of the tile (the gemms only see [first kept, last kept]); interior
//         fully-masked columns get their V row replaced by zeros in the V scratch (and P is 0
//         there), so BLAS never computes 0 * NaN for a key that the whole tile masks;
//       - a row that ends with l == 0 is written as exact zeros, not O / l.
//     Not covered: a key that one row of a tile keeps and another masks is multiplied by P = 0
//     for the masking row; if that V row holds NaN/inf, IEEE 0 * NaN puts NaN in the masking
//     row too (the same result as an unfused P @ V). Real masks never rely on this.
//   * NaN from a kept score is not propagated through the polynomial exp (it yields P = 0).
//   * GQA/MQA: query head h reads kv head h / (heads_q / heads_kv).
//   * Any batch/head/seq strides (in elements, 64-bit offsets); the last dim must be contiguous.
//
// Tiles: see choose_tiles() below. Per-thread scratch is allocated once per parallel_for chunk.
//
// Build requirements: -fopenmp (at::parallel_for is header-inline; without _OPENMP it silently
// runs on ONE thread, hence the #warning below), -O3 and preferably -march=native (the softmax
// pass is written with GCC vector extensions; AVX2+FMA+F16C are used when enabled, with portable
// fallbacks otherwise). Link against libtorch_cpu / libc10 (cpublas, parallel runtime).
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <new>
#include <type_traits>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "flashgen/args.h"
#include "flashgen/variant.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if !defined(_OPENMP)
#warning "flashgen/cpu/fwd.h: compiled without -fopenmp; at::parallel_for will run on one thread"
#endif

// The BLAS sgemm_ (Fortran LP64, column-major) that libtorch_cpu links and exports (MKL in the
// x86 wheels; it is what at::native::cpublas::gemm<float> calls internally). Declared weak under
// a private C++ name: if no loaded library provides it, the kernel falls back to
// at::native::cpublas::brgemm (TORCH_API, oneDNN ukernel on AVX2+). NB: the cpublas::gemm
// overloads declared in CPUBlas.h are NOT exported from libtorch_cpu.so (no TORCH_API), so a
// kernel .so that calls them fails to load with an undefined symbol.
extern "C" void flashgen_blas_sgemm(const char* transa, const char* transb, const int* m,
                                    const int* n, const int* k, const float* alpha, const float* a,
                                    const int* lda, const float* b, const int* ldb,
                                    const float* beta, float* c, const int* ldc)
    __asm__("sgemm_") __attribute__((weak));

namespace flashgen {
namespace cpu {
namespace detail {

// Which gemm backend run_fwd uses: BLAS sgemm_ when present (and not disabled with
// -DFLASHGEN_CPU_FORCE_BRGEMM), else cpublas::brgemm.
static inline bool have_blas_sgemm() {
#if defined(FLASHGEN_CPU_FORCE_BRGEMM)
  return false;
#else
  return &flashgen_blas_sgemm != nullptr;
#endif
}

// Column-major C(m x n) = alpha * op(A) op(B) + beta * C.
static inline void blas_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                              const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                              float* C, int64_t ldc) {
  const int im = (int)m, in = (int)n, ik = (int)k, ila = (int)lda, ilb = (int)ldb, ilc = (int)ldc;
  flashgen_blas_sgemm(ta ? "T" : "N", tb ? "T" : "N", &im, &in, &ik, &alpha, A, &ila, B, &ilb,
                      &beta, C, &ilc);
}

// ------------------------------------------------------------------------------------------
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

// 2^x, branch free. Range reduction x = n + f, n = round(x), f in [-1/2, 1/2]; 2^f by the
// Cephes exp2f minimax polynomial (degree 6, rel. error ~2e-7); 2^n added to the exponent bits.
// x <= -126 (including -inf) gives exactly 0; inputs here are always <= 0 (x = s - rowmax).
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
  return x > splat(-126.0f) ? r : splat(0.0f);
}

static inline float exp2s(float x) {  // scalar wrapper (per-row rescale factors)
  return exp2v(splat(x))[0];
}

// ------------------------------------------------------------------------------------------
// Element <-> fp32 conversions, n a multiple of 8.
template <class E>
struct Conv;

template <>
struct Conv<float> {
  static constexpr bool kLowp = false;
  static inline void to_f32(const float* src, float* dst, int64_t n) {
    memcpy(dst, src, n * sizeof(float));
  }
  static inline void from_f32(const float* src, float* dst, int64_t n) {
    memcpy(dst, src, n * sizeof(float));
  }
  static inline void scale_from_f32(const float* src, float s, float* dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) st8(dst + j, ld8(src + j) * s);
  }
  static inline void round_inplace(float*, int64_t) {}
};

template <>
struct Conv<c10::BFloat16> {
  static constexpr bool kLowp = true;
  static inline void to_f32(const c10::BFloat16* src, float* dst, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) {
      h8 h;
      memcpy(&h, src + j, sizeof h);
      const u8 w = __builtin_convertvector(h, u8) << 16;
      memcpy(dst + j, &w, sizeof w);
    }
  }
  static inline u8 rne_bits(f8 x) {  // fp32 -> bf16 bits (in the low half), RNE, NaN kept
    const u8 b = (u8)x;
    const u8 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return x != x ? (u8)(r | 0x40u) : r;
  }
  static inline void scale_from_f32(const float* src, float s, c10::BFloat16* dst, int64_t n) {
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
  static constexpr bool kLowp = true;
  static inline void to_f32(const c10::Half* src, float* dst, int64_t n) {
#if defined(__F16C__)
    for (int64_t j = 0; j < n; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + j))));
#else
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
#endif
  }
  static inline void scale_from_f32(const float* src, float s, c10::Half* dst, int64_t n) {
#if defined(__F16C__)
    for (int64_t j = 0; j < n; j += 8) {
      f8 v = ld8(src + j) * s;
      __m256 m;
      memcpy(&m, &v, sizeof m);
      _mm_storeu_si128((__m128i*)(dst + j), _mm256_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT));
    }
#else
    for (int64_t j = 0; j < n; ++j) dst[j] = c10::Half(src[j] * s);
#endif
  }
  static inline void round_inplace(float* x, int64_t n) {
#if defined(__F16C__)
    for (int64_t j = 0; j < n; j += 8)
      _mm256_storeu_ps(
          x + j, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT)));
#else
    for (int64_t j = 0; j < n; ++j) x[j] = static_cast<float>(c10::Half(x[j]));
#endif
  }
};

// ------------------------------------------------------------------------------------------
// Tile sizes.
//
// Per task the hot working set (fp32) is Q (qb x d) + K and V tiles (2 x kvb x d) + S/P
// (qb x kvb) + O (qb x d). q tile: 64 rows (32 when there are too few tasks to keep every
// thread busy, or for d > 128; shorter when seqlen_q is shorter). kv tile: the largest
// multiple of 64 in [64, 512] whose working set fits in half of the per-core L2
// (sysconf(_SC_LEVEL2_CACHE_SIZE), 512 KiB assumed when unknown) -- the other half is left to
// the gemm's packed panels and the next tiles' prefetch. For d = 64 on a 512 KiB L2 that gives
// kvb = 256 with qb = 64 (4*(64*64*2 + 256*(2*64+64)) = 224 KiB). Override with the environment
// variable FLASHGEN_CPU_TILES="qb,kvb" (tuning only).
struct Tiles {
  int64_t qb, kvb;
};

static inline int64_t l2_bytes() {
  static const int64_t v = [] {
    long s = -1;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    s = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    if (s < (256 << 10) || s > (8 << 20)) s = 512 << 10;
    return (int64_t)s;
  }();
  return v;
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static inline Tiles choose_tiles(int64_t bh, int64_t nq, int64_t nk, int64_t d) {
  int64_t qb = d > 128 ? 32 : 64;
  const int64_t threads = at::get_num_threads();
  if (qb > 32 && bh * ((nq + qb - 1) / qb) < 4 * threads) qb = 32;
  const int64_t budget = l2_bytes() / 2;
  int64_t kvb = 512;
  while (kvb > 64 && 4 * (2 * qb * d + kvb * (2 * d + qb)) > budget) kvb -= 64;
  if (const char* e = getenv("FLASHGEN_CPU_TILES")) {
    long a = 0, b = 0;
    char* end = nullptr;
    a = strtol(e, &end, 10);
    if (end && *end == ',') b = strtol(end + 1, nullptr, 10);
    if (a >= 1 && a <= 1024) qb = a;
    if (b >= 8 && b <= 8192) kvb = round_up(b, 8);
  }
  qb = qb < nq ? qb : nq;
  const int64_t nk8 = round_up(nk > 0 ? nk : 1, 8);
  kvb = kvb < nk8 ? kvb : nk8;
  return {qb, kvb};
}

// 64-byte aligned scratch, freed at scope exit.
struct Scratch {
  void* p = nullptr;
  explicit Scratch(size_t bytes) {
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) throw std::bad_alloc();
  }
  ~Scratch() { free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

static inline size_t al64(size_t bytes) { return (bytes + 63) & ~size_t(63); }

template <class Variant, class Element>
void fwd_chunk(const FgFwdArgs& a, const typename Variant::Params& prm, const Tiles t,
               const bool blas, int64_t task_begin, int64_t task_end) {
  using C = Conv<Element>;
  constexpr bool kLowp = C::kLowp;
  const int64_t Hq = a.heads_q, Nq = a.seqlen_q, Nk = a.seqlen_k, d = a.head_dim;
  const int64_t group = a.heads_q / a.heads_kv;
  const int64_t qb = t.qb, kvb = t.kvb;
  const int64_t nqt = (Nq + qb - 1) / qb;
  const int64_t ldS = round_up(kvb, 8) + 16;  // +16 floats: avoid 4 KiB set aliasing of rows
  const int64_t ldKT = round_up(kvb, 8);      // brgemm path: K^T tile is d x kvb
  const int nq_i = (int)Nq, nk_i = (int)Nk;

  // Scratch, once per chunk.
  size_t off = 0;
  const size_t o_q = off; off += (kLowp || !blas) ? al64(sizeof(float) * qb * d) : 0;
  const size_t o_k = off; off += (kLowp || !blas) ? al64(sizeof(float) * ldKT * d) : 0;
  const size_t o_v = off; off += al64(sizeof(float) * kvb * d);
  const size_t o_s = off; off += al64(sizeof(float) * qb * ldS);
  const size_t o_o = off; off += al64(sizeof(float) * qb * d);
  const size_t o_m = off; off += al64(sizeof(float) * qb);
  const size_t o_l = off; off += al64(sizeof(float) * qb);
  const size_t o_a = off; off += al64(sizeof(float) * qb);
  const size_t o_mask = off; off += Variant::kHasMask ? al64(qb * kvb) : 0;
  const size_t o_col = off; off += Variant::kHasMask ? al64(kvb) : 0;
  Scratch scratch(off);
  char* base = static_cast<char*>(scratch.p);
  float* qbuf = reinterpret_cast<float*>(base + o_q);
  float* kbuf = reinterpret_cast<float*>(base + o_k);
  float* vbuf = reinterpret_cast<float*>(base + o_v);
  float* S = reinterpret_cast<float*>(base + o_s);
  float* O = reinterpret_cast<float*>(base + o_o);
  float* M = reinterpret_cast<float*>(base + o_m);
  float* L = reinterpret_cast<float*>(base + o_l);
  float* A = reinterpret_cast<float*>(base + o_a);
  uint8_t* mask = reinterpret_cast<uint8_t*>(base + o_mask);
  uint8_t* colkeep = reinterpret_cast<uint8_t*>(base + o_col);

  const Element* Qg = static_cast<const Element*>(a.q);
  const Element* Kg = static_cast<const Element*>(a.k);
  const Element* Vg = static_cast<const Element*>(a.v);
  Element* Og = static_cast<Element*>(a.out);

  const float gemm_alpha = Variant::kHasScoreMod ? a.scale : a.scale * kLog2e;

  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t qt = task % nqt;
    const int64_t bh = task / nqt;
    const int64_t h = bh % Hq, b = bh / Hq;
    const int64_t hk = h / group;
    const int64_t q_lo = qt * qb;
    const int64_t q_hi = q_lo + qb < Nq ? q_lo + qb : Nq;
    const int64_t mq = q_hi - q_lo;
    const int bi = (int)b, hi_ = (int)h;

    const Element* Qt = Qg + b * a.q_stride_b + h * a.q_stride_h + q_lo * a.q_stride_n;
    const Element* Kh = Kg + b * a.k_stride_b + hk * a.k_stride_h;
    const Element* Vh = Vg + b * a.v_stride_b + hk * a.v_stride_h;

    int64_t kv_begin = Variant::kv_lo(prm, (int)q_lo, (int)q_hi, nq_i, nk_i);
    int64_t kv_end = Variant::kv_hi(prm, (int)q_lo, (int)q_hi, nq_i, nk_i);
    kv_begin = kv_begin < 0 ? 0 : kv_begin;
    kv_end = kv_end > Nk ? Nk : kv_end;

    for (int64_t i = 0; i < mq; ++i) {
      M[i] = kNegInf;
      L[i] = 0.f;
    }
    memset(O, 0, sizeof(float) * mq * d);

    // Q tile, fp32. BLAS path: used in place when Element is float (alpha goes to the gemm).
    // brgemm path (no alpha argument): an fp32 copy pre-multiplied by alpha.
    const float* Qf;
    int64_t ldq;
    if (kLowp || !blas) {
      if (kv_begin < kv_end) {
        for (int64_t i = 0; i < mq; ++i) {
          float* dst = qbuf + i * d;
          if constexpr (kLowp) {
            C::to_f32(Qt + i * a.q_stride_n, dst, d);
          } else {
            memcpy(dst, Qt + i * a.q_stride_n, sizeof(float) * d);
          }
          if (!blas)
            for (int64_t c = 0; c < d; c += 8) st8(dst + c, ld8(dst + c) * gemm_alpha);
        }
      }
      Qf = qbuf;
      ldq = d;
    } else {
      Qf = reinterpret_cast<const float*>(Qt);
      ldq = a.q_stride_n;
    }

    for (int64_t kv0 = kv_begin; kv0 < kv_end; kv0 += kvb) {
      const int64_t kv1 = kv0 + kvb < kv_end ? kv0 + kvb : kv_end;
      const int64_t n = kv1 - kv0;
      bool full = true;
      int64_t c0 = 0, c1 = n;
      bool holes = false;
      if constexpr (Variant::kHasMask) {
        full = Variant::tile_full(prm, (int)q_lo, (int)q_hi, (int)kv0, (int)kv1, nq_i, nk_i);
        if (!full) {
          memset(colkeep, 0, n);
          for (int64_t i = 0; i < mq; ++i) {
            uint8_t* mr = mask + i * kvb;
            const int qi = (int)(q_lo + i);
            for (int64_t j = 0; j < n; ++j) {
              const uint8_t k = Variant::keep(prm, bi, hi_, qi, (int)(kv0 + j), nq_i, nk_i) ? 1 : 0;
              mr[j] = k;
              colkeep[j] |= k;
            }
          }
          while (c0 < c1 && !colkeep[c0]) ++c0;
          if (c0 == c1) continue;  // the whole tile is masked
          while (!colkeep[c1 - 1]) --c1;
          for (int64_t j = c0; j < c1; ++j) holes |= !colkeep[j];
        }
      }
      const int64_t nn = c1 - c0;
      const int64_t kvs = kv0 + c0;
      const int64_t nn8 = round_up(nn, 8);

      // S (row-major mq x nn, ld ldS) = alpha * Q K^T.
      if (blas) {
        // column-major nn x mq = K^T (K: col-major d x nn) * Q (col-major d x mq)
        const float* Kf;
        int64_t ldk;
        if constexpr (kLowp) {
          for (int64_t j = 0; j < nn; ++j)
            C::to_f32(Kh + (kvs + j) * a.k_stride_n, kbuf + j * d, d);
          Kf = kbuf;
          ldk = d;
        } else {
          Kf = reinterpret_cast<const float*>(Kh) + kvs * a.k_stride_n;
          ldk = a.k_stride_n;
        }
        blas_sgemm(true, false, nn, mq, d, gemm_alpha, Kf, ldk, Qf, ldq, 0.f, S, ldS);
      } else {
        // row-major: S = (alpha Q) (mq x d) * K^T (d x nn, transposed into kbuf, ld ldKT)
        float row[256];
        for (int64_t j = 0; j < nn; ++j) {
          const Element* src = Kh + (kvs + j) * a.k_stride_n;
          const float* r;
          if constexpr (kLowp) {
            C::to_f32(src, row, d);
            r = row;
          } else {
            r = reinterpret_cast<const float*>(src);
          }
          for (int64_t c = 0; c < d; ++c) kbuf[c * ldKT + j] = r[c];
        }
        at::native::cpublas::brgemm(mq, nn, d, ldq, ldKT, ldS, false, Qf, kbuf, S);
      }

      // Softmax pass, one row at a time (row stays in L1).
      bool any_rescale = false;
      for (int64_t i = 0; i < mq; ++i) {
        float* s = S + i * ldS;
        const int qi = (int)(q_lo + i);
        if constexpr (Variant::kHasScoreMod) {
          for (int64_t j = 0; j < nn; ++j)
            s[j] = Variant::score(prm, s[j], bi, hi_, qi, (int)(kvs + j), nq_i, nk_i) * kLog2e;
        }
        if constexpr (Variant::kHasMask) {
          if (!full) {
            const uint8_t* mr = mask + i * kvb + c0;
            for (int64_t j = 0; j < nn; ++j) s[j] = mr[j] ? s[j] : kNegInf;
          }
        }
        for (int64_t j = nn; j < nn8; ++j) s[j] = kNegInf;
        f8 vm = splat(kNegInf);
        for (int64_t j = 0; j < nn8; j += 8) vm = vmax(vm, ld8(s + j));
        const float rmax = hmax(vm);
        const float m_old = M[i];
        const float m_new = rmax > m_old ? rmax : m_old;
        const float sub = m_new == kNegInf ? 0.f : m_new;  // row still empty: P = 0 below
        const f8 vsub = splat(sub);
        f8 vs = splat(0.f);
        for (int64_t j = 0; j < nn8; j += 8) {
          const f8 p = exp2v(ld8(s + j) - vsub);
          vs += p;
          st8(s + j, p);
        }
        const float alpha = exp2s(m_old - sub);  // 0 when m_old == -inf
        A[i] = alpha;
        any_rescale |= (alpha != 1.f) & (L[i] != 0.f);
        L[i] = L[i] * alpha + hsum(vs);
        M[i] = m_new;
        if constexpr (kLowp) C::round_inplace(s, nn8);
      }
      if (any_rescale) {
        for (int64_t i = 0; i < mq; ++i) {
          if (A[i] == 1.f) continue;
          float* o = O + i * d;
          const f8 va = splat(A[i]);
          for (int64_t c = 0; c < d; c += 8) st8(o + c, ld8(o + c) * va);
        }
      }

      // O (row-major mq x d) += P V, as col-major d x mq = V(col, d x nn) * P(col, nn x mq).
      const float* Vf;
      int64_t ldv;
      if (kLowp || holes) {
        for (int64_t j = 0; j < nn; ++j) {
          float* dst = vbuf + j * d;
          if (holes && !colkeep[c0 + j]) {
            memset(dst, 0, sizeof(float) * d);
          } else if constexpr (kLowp) {
            C::to_f32(Vh + (kvs + j) * a.v_stride_n, dst, d);
          } else {
            memcpy(dst, Vh + (kvs + j) * a.v_stride_n, sizeof(float) * d);
          }
        }
        Vf = vbuf;
        ldv = d;
      } else {
        Vf = reinterpret_cast<const float*>(Vh) + kvs * a.v_stride_n;
        ldv = a.v_stride_n;
      }
      if (blas) {
        // column-major d x mq = V (col-major d x nn) * P (col-major nn x mq)
        blas_sgemm(false, false, d, mq, nn, 1.f, Vf, ldv, S, ldS, 1.f, O, d);
      } else {
        at::native::cpublas::brgemm(mq, d, nn, ldS, ldv, d, true, S, Vf, O);
      }
    }

    // Epilogue: out = O / l, lse = ln l + m (natural units). l == 0: exact zeros and -inf.
    float* lse = a.lse + (b * Hq + h) * Nq + q_lo;
    Element* Ot = Og + b * a.o_stride_b + h * a.o_stride_h + q_lo * a.o_stride_n;
    for (int64_t i = 0; i < mq; ++i) {
      Element* orow = Ot + i * a.o_stride_n;
      if (L[i] > 0.f) {
        C::scale_from_f32(O + i * d, 1.f / L[i], orow, d);
        lse[i] = (M[i] + std::log2(L[i])) * kLn2;
      } else {
        memset(static_cast<void*>(orow), 0, sizeof(Element) * d);
        lse[i] = kNegInf;
      }
    }
  }
}

}  // namespace detail

template <class Variant, class Element>
int run_fwd(const FgFwdArgs& args) {
  static_assert(std::is_same<Element, float>::value ||
                    std::is_same<Element, c10::BFloat16>::value ||
                    std::is_same<Element, c10::Half>::value,
                "flashgen::cpu::run_fwd: Element must be float, c10::BFloat16 or c10::Half");
  const int64_t B = args.batch, Hq = args.heads_q, Hkv = args.heads_kv;
  const int64_t Nq = args.seqlen_q, Nk = args.seqlen_k, d = args.head_dim;
  if (d <= 0 || d > 256 || d % 8 != 0) return FG_ERR_BAD_HEAD_DIM;
  // Shape errors have no dedicated status code yet; they are reported as FG_ERR_LAUNCH.
  if (B < 0 || Hq < 0 || Nq < 0 || Nk < 0 || Nq > INT32_MAX || Nk > INT32_MAX) return FG_ERR_LAUNCH;
  if (B == 0 || Hq == 0 || Nq == 0) return FG_OK;
  if (Hkv <= 0 || Hq % Hkv != 0) return FG_ERR_LAUNCH;
  if (!args.q || !args.out || !args.lse || (Nk > 0 && (!args.k || !args.v))) return FG_ERR_LAUNCH;

  const typename Variant::Params empty_params{};
  const typename Variant::Params& prm =
      args.params ? *static_cast<const typename Variant::Params*>(args.params) : empty_params;

  const detail::Tiles t = detail::choose_tiles(B * Hq, Nq, Nk, d);
  const int64_t imax = INT32_MAX;
  const bool blas = detail::have_blas_sgemm() && args.q_stride_n <= imax &&
                    args.k_stride_n <= imax && args.v_stride_n <= imax;
  const int64_t ntasks = B * Hq * ((Nq + t.qb - 1) / t.qb);
  try {
    at::parallel_for(0, ntasks, 1, [&](int64_t begin, int64_t end) {
      detail::fwd_chunk<Variant, Element>(args, prm, t, blas, begin, end);
    });
  } catch (...) {
    return FG_ERR_LAUNCH;
  }
  return FG_OK;
}

}  // namespace cpu
}  // namespace flashgen
