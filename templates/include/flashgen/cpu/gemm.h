// flashgen CPU GEMM layer: every fp32 product of the forward (S = Q Kᵀ, O = diag(alpha) O + P V)
// and the backward (P and dS with fused epilogues, dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K), in two
// backends (both fp32 in, fp32 out):
//   * own (default when compiled with AVX2+FMA): one family of register-blocked 6x16 FMA
//     micro-kernels, gemm_abt<EPI> (A · Bᵀ with B packed as 16-column Kᵀ panels by pack_kt,
//     which widens 16-bit rows on the fly, and an epilogue per row) and gemm_acc<AT, kRowScale>
//     (C = [diag(rs)] C + op(A) · B with B's rows and A, or Aᵀ, read in place);
//   * blas: the BLAS sgemm_ that libtorch_cpu exports (MKL in the x86 wheels; it is what
//     at::native::cpublas::gemm<float> calls internally). Used when compiled without AVX2/FMA,
//     or when FLASHGEN_CPU_GEMM=blas is set in the environment (A/B comparisons), and only if
//     the symbol resolves (it is declared weak) and the row strides fit in an int (use_blas).
//   The at::native::cpublas::gemm overloads declared in ATen/native/CPUBlas.h are NOT exported
//   from libtorch_cpu.so (no TORCH_API, torch 2.13): a kernel .so calling them fails to load
//   with "undefined symbol". That is why this file neither calls nor includes them.
#pragma once

#include <stdint.h>
#include <stdlib.h>

#include "flashgen/args.h"
#include "flashgen/cpu/convert.h"
#include "flashgen/cpu/simd.h"

// BLAS sgemm_ (Fortran LP64, column-major), weak, under a private C++ name so that it cannot
// clash with another declaration of sgemm_. Null when no loaded library provides it.
extern "C" void flashgen_blas_sgemm(const char* transa, const char* transb, const int* m,
                                    const int* n, const int* k, const float* alpha, const float* a,
                                    const int* lda, const float* b, const int* ldb,
                                    const float* beta, float* c, const int* ldc)
    __asm__("sgemm_") __attribute__((weak));


// Without -mavx, GCC warns that 32-byte vector arguments change the psABI; every function taking
// them here has internal linkage, so the warning does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace flashgen {
namespace cpu {
namespace detail {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kOwnGemmDefault = true;
#else
constexpr bool kOwnGemmDefault = false;
#endif

// true: use BLAS sgemm_ for a call (see the backends above): the symbol resolved, the row
// strides fit in an int, and the build's default or FLASHGEN_CPU_GEMM (b: blas, o: own) says so.
static inline bool use_blas_for(bool strides_fit) {
  if (&flashgen_blas_sgemm == nullptr || !strides_fit) return false;
  bool blas = !kOwnGemmDefault;
  if (const char* e = getenv("FLASHGEN_CPU_GEMM")) {
    if (e[0] == 'b') blas = true;
    if (e[0] == 'o') blas = false;
  }
  return blas;
}
static inline bool use_blas(const FgFwdArgs& a) {
  const int64_t imax = INT32_MAX;
  return use_blas_for(a.q_stride_n <= imax && a.k_stride_n <= imax && a.v_stride_n <= imax);
}
static inline bool use_blas(const FgBwdArgs& a) {
  const int64_t imax = INT32_MAX;
  return use_blas_for(a.q_stride_n <= imax && a.k_stride_n <= imax && a.v_stride_n <= imax &&
                      a.do_stride_n <= imax);
}

// Column-major C(m x n) = alpha * op(A) op(B) + beta * C.
static inline void blas_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                              const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                              float* C, int64_t ldc) {
  const int im = (int)m, in = (int)n, ik = (int)k, ila = (int)lda, ilb = (int)ldb, ilc = (int)ldc;
  flashgen_blas_sgemm(ta ? "T" : "N", tb ? "T" : "N", &im, &in, &ik, &alpha, A, &ila, B, &ilb,
                      &beta, C, &ilc);
}

// Packs rows [0, nn) of K (ld ldk, d columns) as K^T in 16-column panels: panel p holds
// KT[c][0..16) = K[16p + 0..16)[c] at kt + p*d*16 + c*16. Rows past nn are zero.
template <class E>
static inline void pack_kt(const typename Conv<E>::T* K, int64_t ldk, int64_t nn, int64_t d,
                           float* kt) {
  const int64_t rows = (nn + 15) / 16 * 16;
  for (int64_t j0 = 0; j0 < rows; j0 += 8) {
    float* dst = kt + (j0 >> 4) * d * 16 + (j0 & 15);
    for (int64_t c0 = 0; c0 < d; c0 += 8) {
      f8 r[8];
      for (int t = 0; t < 8; ++t)
        r[t] = j0 + t < nn ? Conv<E>::load(K + (j0 + t) * ldk + c0) : splat(0.f);
      transpose8(r);
      for (int k = 0; k < 8; ++k) st8(dst + (c0 + k) * 16, r[k]);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Register-blocked fp32 micro-kernels (the own backend), one family for both passes. Row blocks
// of up to kMR = 6 rows against 16 columns: 12 ymm accumulators + 2 B vectors + 1 broadcast =
// 15 of 16 ymm. fma8 is a * b + c; GCC and Clang contract it into one vfmadd when FMA is enabled
// (checked in the generated code; -ffp-contract=off would cost ~2x in the kernels).
static inline f8 fma8(f8 a, f8 b, f8 c) { return a * b + c; }

constexpr int kMR = 6;

// What gemm_abt does with each 16-column accumulator row acc = A[r] · BT (before the store):
//   kEpiScale: C[r] = alpha * acc                       (the forward's S; the backward's raw s)
//   kEpiExp:   C[r] = exp2(alpha * acc - rv[r])         (P; rv = lse*log2e, +inf gives P = 0)
//   kEpiDS:    C[r] = C[r] != 0 ? C[r] * (acc - rv[r]) : 0 (dS over P in place; rv = D)
//              DROP: C[r] = C[r] != 0 ? Pd[r] * acc - C[r] * rv[r] : 0, i.e. P ∘ (acc ∘ Z − D)
//              with Pd = P ∘ Z the dropped P (laid out like C)
//   kEpiDSG:   as kEpiDS, then C[r] = C[r] != 0 ? C[r] * G[r] : 0 (G: dscore(s), laid out like C)
enum GemmEpilogue { kEpiScale = 0, kEpiExp = 1, kEpiDS = 2, kEpiDSG = 3 };

// acc[r][0..16) = sum_c A[r][c] * BT[c][0..16) for r < MR (BT: one packed d x 16 panel, pack_kt),
// then the epilogue EPI into C[r][0..16).
template <int MR, int EPI, bool DROP>
static inline void abt_kernel(const float* __restrict A, int64_t lda, const float* __restrict BT,
                              int64_t d, float alpha, const float* __restrict rv,
                              float* __restrict C, int64_t ldc, const float* __restrict G,
                              const float* __restrict Pd) {
  f8 c0[MR], c1[MR];
  {  // c = 0 initialises the accumulators (d >= 8), so there is no zero-fill
    const f8 b0 = ld8(BT), b1 = ld8(BT + 8);
    for (int r = 0; r < MR; ++r) {
      const f8 av = splat(A[r * lda]);
      c0[r] = av * b0;
      c1[r] = av * b1;
    }
  }
  for (int64_t c = 1; c < d; ++c) {
    const f8 b0 = ld8(BT + c * 16), b1 = ld8(BT + c * 16 + 8);
    for (int r = 0; r < MR; ++r) {
      const f8 av = splat(A[r * lda + c]);
      c0[r] = fma8(av, b0, c0[r]);
      c1[r] = fma8(av, b1, c1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* cr = C + r * ldc;
    if constexpr (EPI == kEpiScale) {
      st8(cr, c0[r] * alpha);
      st8(cr + 8, c1[r] * alpha);
    } else if constexpr (EPI == kEpiExp) {
      const f8 s = splat(rv[r]);
      st8(cr, exp2v(c0[r] * alpha - s));
      st8(cr + 8, exp2v(c1[r] * alpha - s));
    } else {
      const f8 s = splat(rv[r]);
      const f8 z = splat(0.f);
      const f8 p0 = ld8(cr), p1 = ld8(cr + 8);
      f8 d0, d1;
      if constexpr (DROP) {
        const float* pd = Pd + r * ldc;
        d0 = p0 != z ? ld8(pd) * c0[r] - p0 * s : z;
        d1 = p1 != z ? ld8(pd + 8) * c1[r] - p1 * s : z;
      } else {
        d0 = p0 != z ? p0 * (c0[r] - s) : z;
        d1 = p1 != z ? p1 * (c1[r] - s) : z;
      }
      if constexpr (EPI == kEpiDSG) {  // select, not multiply: dscore may be inf/NaN where dS' == 0
        const float* gr = G + r * ldc;
        d0 = d0 != z ? d0 * ld8(gr) : z;
        d1 = d1 != z ? d1 * ld8(gr + 8) : z;
      }
      st8(cr, d0);
      st8(cr + 8, d1);
    }
  }
}

// C (m x 16*npan, ld ldc) = epilogue(alpha * A (m x d, ld lda) * BT (npan packed d x 16 panels)).
// rv: per-row values of kEpiExp / kEpiDS / kEpiDSG (null for kEpiScale). G (kEpiDSG only, else
// null) and Pd (DROP only, else null): same shape and ld as C.
template <int EPI, bool DROP = false>
static inline void gemm_abt(const float* A, int64_t lda, const float* BT, int64_t npan, int64_t m,
                            int64_t d, float alpha, const float* rv, float* C, int64_t ldc,
                            const float* G = nullptr, const float* Pd = nullptr) {
  for (int64_t p = 0; p < npan; ++p) {
    const float* bt = BT + p * d * 16;
    float* cp = C + p * 16;
    const float* gp = EPI == kEpiDSG ? G + p * 16 : nullptr;
    const float* pdp = DROP ? Pd + p * 16 : nullptr;
    int64_t i = 0;
    for (; i + kMR <= m; i += kMR)
      abt_kernel<kMR, EPI, DROP>(A + i * lda, lda, bt, d, alpha, EPI == kEpiScale ? nullptr : rv + i,
                                 cp + i * ldc, ldc, EPI == kEpiDSG ? gp + i * ldc : nullptr,
                                 DROP ? pdp + i * ldc : nullptr);
    const float* ai = A + i * lda;
    const float* ri = EPI == kEpiScale ? nullptr : rv + i;
    float* ci = cp + i * ldc;
    const float* gi = EPI == kEpiDSG ? gp + i * ldc : nullptr;
    const float* pdi = DROP ? pdp + i * ldc : nullptr;
    switch (m - i) {
      case 5: abt_kernel<5, EPI, DROP>(ai, lda, bt, d, alpha, ri, ci, ldc, gi, pdi); break;
      case 4: abt_kernel<4, EPI, DROP>(ai, lda, bt, d, alpha, ri, ci, ldc, gi, pdi); break;
      case 3: abt_kernel<3, EPI, DROP>(ai, lda, bt, d, alpha, ri, ci, ldc, gi, pdi); break;
      case 2: abt_kernel<2, EPI, DROP>(ai, lda, bt, d, alpha, ri, ci, ldc, gi, pdi); break;
      case 1: abt_kernel<1, EPI, DROP>(ai, lda, bt, d, alpha, ri, ci, ldc, gi, pdi); break;
      default: break;
    }
  }
}

// C[r][0..8*NV) = C[r][..] (* rs[r] with kRowScale) + sum_k a(r, k) * B[k][0..8*NV) for r < MR,
// k < kk, where a(r, k) = A[r*lda + k] (!AT) or A[k*lda + r] (AT: A is read transposed, in
// place). kRowScale folds the forward's O rescale by 2^(m_old - m_new) into the accumulator load.
template <int MR, int NV, bool AT, bool kRowScale>
static inline void acc_kernel(const float* __restrict A, int64_t lda, const float* __restrict B,
                              int64_t ldb, int64_t kk, float* __restrict C, int64_t ldc,
                              const float* __restrict rs) {
  f8 c[MR][NV];
  for (int r = 0; r < MR; ++r) {
    if constexpr (kRowScale) {
      const f8 ar = splat(rs[r]);
      for (int v = 0; v < NV; ++v) c[r][v] = ld8(C + r * ldc + 8 * v) * ar;
    } else {
      for (int v = 0; v < NV; ++v) c[r][v] = ld8(C + r * ldc + 8 * v);
    }
  }
  for (int64_t k = 0; k < kk; ++k) {
    f8 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = ld8(B + k * ldb + 8 * v);
    for (int r = 0; r < MR; ++r) {
      const f8 av = splat(AT ? A[k * lda + r] : A[r * lda + k]);
      for (int v = 0; v < NV; ++v) c[r][v] = fma8(av, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) st8(C + r * ldc + 8 * v, c[r][v]);
}

template <bool AT, bool kRowScale, int MR>
static inline void acc_rows(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t kk,
                            int64_t d, float* C, int64_t ldc, const float* rs) {
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) acc_kernel<MR, 2, AT, kRowScale>(A, lda, B + c, ldb, kk, C + c, ldc, rs);
  if (c < d) acc_kernel<MR, 1, AT, kRowScale>(A, lda, B + c, ldb, kk, C + c, ldc, rs);
}

// C (m x d, ld ldc) = diag(rs) C (kRowScale; else C) + op(A) * B (kk x d, ld ldb); op(A) is
// m x kk: A itself (ld lda) when !AT, or the transpose of A (kk x m, ld lda) when AT.
template <bool AT, bool kRowScale = false>
static inline void gemm_acc(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t m,
                            int64_t kk, int64_t d, float* C, int64_t ldc,
                            const float* rs = nullptr) {
  int64_t i = 0;
  for (; i + kMR <= m; i += kMR)
    acc_rows<AT, kRowScale, kMR>(AT ? A + i : A + i * lda, lda, B, ldb, kk, d, C + i * ldc, ldc,
                                 kRowScale ? rs + i : nullptr);
  const float* ai = AT ? A + i : A + i * lda;
  float* ci = C + i * ldc;
  const float* ri = kRowScale ? rs + i : nullptr;
  switch (m - i) {
    case 5: acc_rows<AT, kRowScale, 5>(ai, lda, B, ldb, kk, d, ci, ldc, ri); break;
    case 4: acc_rows<AT, kRowScale, 4>(ai, lda, B, ldb, kk, d, ci, ldc, ri); break;
    case 3: acc_rows<AT, kRowScale, 3>(ai, lda, B, ldb, kk, d, ci, ldc, ri); break;
    case 2: acc_rows<AT, kRowScale, 2>(ai, lda, B, ldb, kk, d, ci, ldc, ri); break;
    case 1: acc_rows<AT, kRowScale, 1>(ai, lda, B, ldb, kk, d, ci, ldc, ri); break;
    default: break;
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
