// flashgen CPU forward kernel skeleton: fused FlashAttention forward for one generated Variant.
//
//   template <class Variant, class Element>   // Element: float, c10::BFloat16, c10::Half
//   int flashgen::cpu::run_fwd(const FgFwdArgs& args);   // returns an FgStatus (args.h)
//
// head_dim: runtime, any multiple of 8 in [8, 256] (else FG_ERR_BAD_HEAD_DIM).
//
// Algorithm: FlashAttention forward (Dao et al. 2022, Alg. 1) in the FA2 loop order. Work is
// split over (batch b, query head h, query tile) with at::parallel_for; one task owns a query
// tile and streams the kv tiles in [Variant::kv_lo, Variant::kv_hi) (evaluated for the task's
// b and h, clamped to [0, seqlen_k]):
//
//     S = Q K^T * scale                      fp32 gemm (see "gemm backends")
//     S = score(S)                           only if Variant::kHasScoreMod
//     S = keep ? S : -inf                    only on tiles where Variant::tile_full is false
//     m_new = max(m, rowmax S); P = 2^(S*log2e - m_new); l = l*2^(m - m_new) + rowsum P
//     P = keep ? P : 0                       only with dropout (after l: see below)
//     O = O * 2^(m - m_new) + P V            fp32 gemm into the fp32 accumulator O
//
// then out = O / l and lse = ln(l) + m (natural log). log2(e) is folded into the QK gemm's
// alpha (or applied after the score hook), so the softmax runs on a vectorised exp2.
//
// Packed (varlen) batches (args.cu_seqlens_q set; layout in args.h): b is a sequence, and its
// tasks cover only its own query tiles (from its true length, never max_seqlen_q), so padding
// costs nothing. Every hook and bound of a task sees the sequence's own lengths as seqlen_q /
// seqlen_k and positions counted from its start; its rows start at cu_seqlens_*[b] and its lse
// rows at h * total_q + cu_seqlens_q[b]. As lengths vary, tasks are handed out dynamically
// (an atomic counter; the sequences with the most score entries first) rather than in equal
// contiguous chunks. The padded layout's split and code path are unchanged. The metadata is
// re-checked here (O(batch) reads; FG_ERR_BAD_SHAPE when inconsistent).
//
// Block sparsity (args.kv_blocks.data set; layout in args.h): the lists' tiles are the kernel's
// (choose_tiles and FLASHGEN_CPU_TILES are skipped): qb = block_r, and kv tiles of block_c keys,
// any multiple of 8 up to 512 (K^T panels are zero-padded to 16 columns; the kernels take row
// tails). A task is still (b, h, query tile r) (packed: the sequence's own tiles), but it visits
// only the kv tiles listed in row r of (b, h), in increasing order, each clipped to
// [kv_lo, kv_hi) and seqlen_k like any tile (one entirely outside is skipped); adjacent listed
// tiles of one kind in one aligned chunk of kvb keys are taken as one step (see sparse_tiles). A
// listed-partial tile always takes the element-mask path (Variant::keep, when kHasMask); a
// listed-full one is an ordinary tile (tile_full decides: the spec's mask applies on top of the
// lists) or, with full_kept set (lists made from the variant's own mask), one known to be kept
// throughout: keep() is skipped. A row whose listed tiles keep nothing gets out 0 and lse -inf.
// Tasks are handed out dynamically (an atomic counter), those with the most listed tiles first,
// in both layouts. FG_ERR_BAD_SHAPE before any work for tile sizes other than multiples of 8 in
// [8, 512], negative strides, or rows x cols other than ceil(seqlen_q / block_r) x
// ceil(seqlen_k / block_c). The list values are the host's to check; here counts are clipped to
// cols and indices out of range ignored, so malformed lists cannot make the kernel touch memory
// out of range.
//
// Variant hooks (contract: flashgen/variant.h). The Params reference is *args.params, or a
// value-initialised Params when args.params is null (allowed when Params is empty); it is shared
// read-only by all threads. kv_lo / kv_hi / tile_full are evaluated per work item with its own
// (b, h), so a mask may depend on the batch and the query head; only the tile-size cost model
// (choose_tiles), which has no particular work item, evaluates kv_lo / kv_hi at b = h = 0.
// score(s) gets s = scale * q.k in natural units and is called on every entry of the loaded
// (trimmed) tile, all of them in bounds, kept or not: a masked entry's result is discarded by
// the selection that follows. dscore and param_grad are backward-only (bwd.h); kHasParamGrad
// does not change the forward.
//
// Dropout (Variant::kHasDropout and args.dropout_state set; FlashAttention, Alg. 2): the keep
// mask of cpu/dropout.h at the absolute (b, h, q, kv) zeroes P after its row sum entered l, so
// m, l and lse are those of the undropped P (as flashgen.reference computes them); the factor
// 1 / (1 - p) is applied once, in the epilogue (out = O * dropout_scale / l). Without
// kHasDropout nothing of it is compiled; with it and dropout_p == 0 it costs one branch per row.
//
// Gemm backends (both fp32 in, fp32 out):
//   * own (default when compiled with AVX2+FMA): register-blocked 6x16 FMA micro-kernels below.
//     QK: K^T is packed per kv tile into 16-column panels (8x8 in-register transposes, widening
//     16-bit K on the fly), Q rows are broadcast in place. PV: V rows are read in place
//     (fp32) and P is broadcast from the S tile, so nothing of the q x kv tile is ever packed,
//     and the O rescale by 2^(m_old - m_new) is folded into the kernel's accumulator load.
//   * blas: the BLAS sgemm_ that libtorch_cpu exports (MKL in the x86 wheels; it is what
//     at::native::cpublas::gemm<float> calls internally). Used when compiled without AVX2/FMA,
//     or when FLASHGEN_CPU_GEMM=blas is set in the environment (A/B comparisons), and only if
//     the symbol resolves (it is declared weak) and the row strides fit in an int.
//   The at::native::cpublas::gemm overloads declared in ATen/native/CPUBlas.h are NOT exported
//   from libtorch_cpu.so (no TORCH_API, torch 2.13): a kernel .so calling them fails to load
//   with "undefined symbol". That is why this file neither calls nor includes them.
//
// Numerics (all dtypes): fp32 accumulation everywhere. For 16-bit Elements the Q/K/V tiles are
// widened to fp32; a product of two bf16 (or two fp16) values is exact in fp32, so the gemms are
// exactly "16-bit inputs, fp32 accumulate" (and run at fp32 FMA speed: AVX2 has no 16-bit FMA).
// P is rounded to Element precision (RNE) before the PV product, as the reference keeps P in
// the input dtype; the row sum l uses the unrounded fp32 P (as torch's CPU flash kernel does).
// exp2: Cephes minimax polynomial, relative error ~2e-7.
//
// Edge cases:
//   * batch == 0 / heads_q == 0 / seqlen_q == 0 (packed: total_q == 0): nothing to do, FG_OK.
//     seqlen_k == 0 (packed: a sequence without keys), or a row that sees no key: out row
//     exactly 0 and lse exactly -inf (never NaN).
//   * Masked / out-of-range keys never leak, even when K/V hold NaN or inf there:
//       - only kv rows in [kv_lo, kv_hi) ∩ [0, seqlen_k) (and, with block lists, in listed tiles)
//         are ever read; nothing past seqlen_k (or before 0) is touched;
//       - masking is by selection (S = keep ? S : -inf), so NaN/inf scores at masked entries
//         are discarded and P is exactly 0 there (exp2 returns exactly 0 for -inf);
//       - on a partially masked tile, columns that no row of the tile keeps are trimmed from
//         both ends of the tile (the gemms only see [first kept, last kept]), and interior
//         fully-masked columns get their V row replaced by zeros in the V scratch (P is 0 there
//         too), so the PV gemm never computes 0 * NaN for a key that the whole tile masks;
//       - a row that ends with l == 0 is written as exact zeros, not O / l.
//     Not covered: a key that one row of a tile keeps and another row masks is multiplied by
//     P = 0 in the masking row; if that V row holds NaN/inf, IEEE 0 * NaN puts NaN in the
//     masking row too (the same result as an unfused softmax(S) @ V).
//   * A NaN score at a kept entry is not propagated by the polynomial exp2 (it gives P = 0).
//   * GQA/MQA: query head h reads kv head h / (heads_q / heads_kv).
//   * Any batch/head/seq strides (elements, 64-bit offsets); the last dim must be contiguous.
//     lse is fp32, contiguous [B, Hq, Nq] (packed: [Hq, total_q]); out is written in Element
//     with args' strides.
//   * Shape errors (negative sizes, heads_q % heads_kv != 0, null pointers, seqlens > FG_MAX_SEQLEN = 2^30)
//     return FG_ERR_BAD_SHAPE; an exception inside the kernel (e.g. bad_alloc of the scratch)
//     returns FG_ERR_LAUNCH. Nothing is thrown across the C ABI.
//
// Tiles: see choose_tiles() (packed: sized for max_seqlen_q / max_seqlen_k; block lists:
// sparse_tiles()). Per-thread scratch is allocated once per parallel_for chunk
// (O(qb * kvb + (qb + kvb) * d) floats; no N x N buffer).
//
// Build requirements: -fopenmp at compile AND link (at::parallel_for is header-inline; without
// _OPENMP it silently runs on ONE thread, hence the #warning below; the .so then binds to the
// libgomp.so.1 torch already loaded). -O3 -march=native (or at least -mavx2 -mfma -mf16c) for
// the AVX2 micro-kernels; without them the portable vector-extension code is used and the blas
// backend is preferred. Link: libtorch_cpu and libc10 (torch.utils.cpp_extension does this).
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "flashgen/args.h"
#include "flashgen/cpu/dropout.h"
#include "flashgen/variant.h"

// The 16-bit Element types are only used as tags here (data is handled as raw uint16_t bits),
// so they are declared, not included: c10/util/Half.h alone costs ~1.7 s of parsing per TU.
// Compatible with including the real c10 headers before or after this file.
namespace c10 {
struct BFloat16;
struct Half;
}  // namespace c10

#if !defined(_OPENMP)
#warning "flashgen/cpu/fwd.h: compiled without -fopenmp; at::parallel_for will run on one thread"
#endif

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

// true: use BLAS sgemm_ for this call (see "gemm backends" above).
static inline bool use_blas(const FgFwdArgs& a) {
  if (&flashgen_blas_sgemm == nullptr) return false;
  const int64_t imax = INT32_MAX;
  if (a.q_stride_n > imax || a.k_stride_n > imax || a.v_stride_n > imax) return false;
  bool blas = !kOwnGemmDefault;
  if (const char* e = getenv("FLASHGEN_CPU_GEMM")) {
    if (e[0] == 'b') blas = true;
    if (e[0] == 'o') blas = false;
  }
  return blas;
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

// ------------------------------------------------------------------------------------------
// Tile sizes.
//
// Per (q tile, kv tile) the skeleton pays fixed costs that do not scale with qb * kvb * d:
// packing K^T (or, with BLAS, packing both operands of both gemms), the kernels' accumulator
// loads/stores, per-row softmax bookkeeping. Relative to the gemm work they shrink like
// a/qb + a/kvb; a ~ 5 was measured on Zen 3 (a 64 x 256 tile runs ~7-10% slower than
// 256 x 512). The S/P tile (qb x kvb fp32) is written by the QK gemm, swept by the softmax and
// read back by the PV gemm, so it should stay in the per-core L2, and so should the K and V
// tiles (kvb x d each):
//   kvb = 512 (torch's CPU flash kernel uses 512 too), halved while 2 * kvb * d * 4 B > L2
//         (d = 256 -> 256), capped by seqlen_k;
//   qb  <= L2 / (4 * kvb) clamped to [32, 256]: 256 for a 512 KiB L2 (S = 512 KiB) at d <= 128.
// Among qb in {qb_max, qb_max/2, ..., 32} the skeleton picks the one minimising the model
//   makespan(qb) * (1 + a/qb + a/kvb),
// where makespan is the largest per-thread sum, over the contiguous task chunks at::parallel_for
// hands out, of the score entries each task computes (mq x clamped kv range, from the variant's
// kv_lo/kv_hi hooks). This trades the efficiency of big q tiles against the work a diagonal mask
// wastes (causal: ~qb/2 masked columns per row on the diagonal tile) and against load imbalance
// when batch * heads is small. The kv ranges of this model are taken at b = h = 0.
// L2 = sysconf(_SC_LEVEL2_CACHE_SIZE), 512 KiB if unknown.
// Examples (2 threads, B*H = 16, d = 64): dense 1K/4K -> 256 x 512; causal 1K -> 64 x 512,
// causal 4K -> 128 x 512.
// FLASHGEN_CPU_TILES="qb,kvb" in the environment overrides the choice (tuning only).
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

template <class Variant>
static Tiles choose_tiles(const typename Variant::Params& prm, int64_t bh, int64_t nq, int64_t nk,
                          int64_t d) {
  const int64_t l2 = l2_bytes();
  const int64_t nk8 = round_up(nk > 0 ? nk : 1, 8);
  int64_t kvb = 512;
  while (kvb > 128 && 2 * kvb * d * 4 > l2) kvb /= 2;
  kvb = kvb < nk8 ? kvb : nk8;
  int64_t qb_max = l2 / (4 * kvb);
  qb_max = qb_max < 32 ? 32 : (qb_max > 256 ? 256 : qb_max);

  int64_t qb = qb_max < nq ? qb_max : nq;
  if (nq > 32) {
    constexpr double kAlpha = 5.0;
    const int64_t threads = at::get_num_threads() > 0 ? at::get_num_threads() : 1;
    double best = -1.0;
    std::vector<double> prefix;
    for (int64_t cand = qb_max; cand >= 32; cand /= 2) {
      const int64_t qc = cand < nq ? cand : nq;
      const int64_t nqt = (nq + qc - 1) / qc;
      prefix.assign(nqt + 1, 0.0);
      for (int64_t t = 0; t < nqt; ++t) {
        const int64_t lo_q = t * qc, hi_q = lo_q + qc < nq ? lo_q + qc : nq;
        int64_t lo = Variant::kv_lo(prm, 0, 0, (int)lo_q, (int)hi_q, (int)nq, (int)nk);
        int64_t hi = Variant::kv_hi(prm, 0, 0, (int)lo_q, (int)hi_q, (int)nq, (int)nk);
        lo = lo < 0 ? 0 : lo;
        hi = hi > nk ? nk : hi;
        const double span = hi > lo ? double(hi - lo) : 0.0;
        prefix[t + 1] = prefix[t] + double(hi_q - lo_q) * (span + 8.0);  // +8: per-row epilogue
      }
      const int64_t ntasks = bh * nqt;
      const int64_t nthr = threads < ntasks ? threads : ntasks;
      const int64_t chunk = (ntasks + nthr - 1) / nthr;
      auto upto = [&](int64_t x) { return double(x / nqt) * prefix[nqt] + prefix[x % nqt]; };
      double makespan = 0.0;
      for (int64_t i = 0; i < nthr; ++i) {
        const int64_t b0 = i * chunk, b1 = b0 + chunk < ntasks ? b0 + chunk : ntasks;
        if (b0 >= b1) break;
        const double c = upto(b1) - upto(b0);
        makespan = c > makespan ? c : makespan;
      }
      const double cost = makespan * (1.0 + kAlpha / double(qc) + kAlpha / double(kvb));
      if (best < 0.0 || cost < best * 0.999) {  // ties: keep the larger tile
        best = cost;
        qb = qc;
      }
    }
  }
  if (const char* e = getenv("FLASHGEN_CPU_TILES")) {
    long a = 0, b = 0;
    char* end = nullptr;
    a = strtol(e, &end, 10);
    if (end && *end == ',') b = strtol(end + 1, nullptr, 10);
    if (a >= 1 && a <= 1024) qb = a;
    if (b >= 8 && b <= 8192) kvb = round_up(b, 8);
    qb = qb < nq ? qb : nq;
    kvb = kvb < nk8 ? kvb : nk8;
  }
  return {qb, kvb};
}

// Block lists (fwd_sparse): qb = block_r; kvb, the widest step (adjacent listed tiles of one kind
// in one aligned kvb-key chunk are visited together), is choose_tiles' kvb made a multiple of
// block_c: rounded up when it covers all of seqlen_k, else down. So a list of every tile (as
// full) of a mask-free variant steps through the keys exactly as the dense path does.
static inline Tiles sparse_tiles(const FgBlockLists& l, int64_t nk, int64_t d) {
  const int64_t bc = l.block_c, nk8 = round_up(nk > 0 ? nk : 1, 8);
  int64_t kvb = 512;
  while (kvb > 128 && 2 * kvb * d * 4 > l2_bytes()) kvb /= 2;
  kvb = kvb >= nk8 ? round_up(nk8, bc) : std::max(bc, kvb / bc * bc);
  return {l.block_r, kvb};
}

// ------------------------------------------------------------------------------------------
// Register-blocked fp32 micro-kernels (the default gemm backend). Row blocks of up to 6 query
// rows against 16 columns: 12 ymm accumulators + 2 B vectors + 1 broadcast = 15 of 16 ymm.
// a * b + c; GCC and Clang contract it into one vfmadd when FMA is enabled (checked in the
// generated code; -ffp-contract=off would cost ~2x in the kernels).
static inline f8 fma8(f8 a, f8 b, f8 c) { return a * b + c; }

// S[r][0..16) = alpha * sum_c Q[r][c] * KT[c][0..16) for r < MR. KT: one packed panel, d x 16.
template <int MR>
static inline void s_kernel(const float* __restrict Q, int64_t ldq, const float* __restrict KT,
                            int64_t d, float alpha, float* __restrict S, int64_t ldS) {
  f8 c0[MR], c1[MR];
  {  // c = 0 initialises the accumulators (d >= 8), so there is no zero-fill
    const f8 b0 = ld8(KT), b1 = ld8(KT + 8);
    for (int r = 0; r < MR; ++r) {
      const f8 av = splat(Q[r * ldq]);
      c0[r] = av * b0;
      c1[r] = av * b1;
    }
  }
  for (int64_t c = 1; c < d; ++c) {
    const f8 b0 = ld8(KT + c * 16), b1 = ld8(KT + c * 16 + 8);
    for (int r = 0; r < MR; ++r) {
      const f8 av = splat(Q[r * ldq + c]);
      c0[r] = fma8(av, b0, c0[r]);
      c1[r] = fma8(av, b1, c1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    st8(S + r * ldS, c0[r] * alpha);
    st8(S + r * ldS + 8, c1[r] * alpha);
  }
}

// O[r][0..8*NV) = O[r][..] * A[r] + sum_k P[r][k] * V[k][0..8*NV) for r < MR.
template <int MR, int NV>
static inline void pv_kernel(const float* __restrict P, int64_t ldp, const float* __restrict V,
                             int64_t ldv, int64_t nn, const float* __restrict A,
                             float* __restrict O, int64_t ldo) {
  f8 c[MR][NV];
  for (int r = 0; r < MR; ++r) {
    const f8 ar = splat(A[r]);
    for (int v = 0; v < NV; ++v) c[r][v] = ld8(O + r * ldo + 8 * v) * ar;
  }
  for (int64_t k = 0; k < nn; ++k) {
    f8 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = ld8(V + k * ldv + 8 * v);
    for (int r = 0; r < MR; ++r) {
      const f8 av = splat(P[r * ldp + k]);
      for (int v = 0; v < NV; ++v) c[r][v] = fma8(av, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) st8(O + r * ldo + 8 * v, c[r][v]);
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

constexpr int kMR = 6;

// S (mq x 16*npanels, ld ldS) = alpha * Q (mq x d, ld ldq) * KT (npanels packed d x 16 panels).
static inline void gemm_qk(const float* Q, int64_t ldq, const float* KT, int64_t npanels,
                           int64_t mq, int64_t d, float alpha, float* S, int64_t ldS) {
  for (int64_t p = 0; p < npanels; ++p) {
    const float* kt = KT + p * d * 16;
    float* sp = S + p * 16;
    int64_t i = 0;
    for (; i + kMR <= mq; i += kMR) s_kernel<kMR>(Q + i * ldq, ldq, kt, d, alpha, sp + i * ldS, ldS);
    const float* qi = Q + i * ldq;
    float* si = sp + i * ldS;
    switch (mq - i) {
      case 5: s_kernel<5>(qi, ldq, kt, d, alpha, si, ldS); break;
      case 4: s_kernel<4>(qi, ldq, kt, d, alpha, si, ldS); break;
      case 3: s_kernel<3>(qi, ldq, kt, d, alpha, si, ldS); break;
      case 2: s_kernel<2>(qi, ldq, kt, d, alpha, si, ldS); break;
      case 1: s_kernel<1>(qi, ldq, kt, d, alpha, si, ldS); break;
      default: break;
    }
  }
}

template <int MR>
static inline void pv_rows(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t nn,
                           int64_t d, const float* A, float* O, int64_t ldo) {
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) pv_kernel<MR, 2>(P, ldp, V + c, ldv, nn, A, O + c, ldo);
  if (c < d) pv_kernel<MR, 1>(P, ldp, V + c, ldv, nn, A, O + c, ldo);
}

// O (mq x d, ld d) = diag(A) O + P (mq x nn, ld ldp) * V (nn x d, ld ldv).
static inline void gemm_pv(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t mq,
                           int64_t nn, int64_t d, const float* A, float* O) {
  int64_t i = 0;
  for (; i + kMR <= mq; i += kMR) pv_rows<kMR>(P + i * ldp, ldp, V, ldv, nn, d, A + i, O + i * d, d);
  const float* pi = P + i * ldp;
  float* oi = O + i * d;
  switch (mq - i) {
    case 5: pv_rows<5>(pi, ldp, V, ldv, nn, d, A + i, oi, d); break;
    case 4: pv_rows<4>(pi, ldp, V, ldv, nn, d, A + i, oi, d); break;
    case 3: pv_rows<3>(pi, ldp, V, ldv, nn, d, A + i, oi, d); break;
    case 2: pv_rows<2>(pi, ldp, V, ldv, nn, d, A + i, oi, d); break;
    case 1: pv_rows<1>(pi, ldp, V, ldv, nn, d, A + i, oi, d); break;
    default: break;
  }
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

// Packed (varlen) batches (args.h): sequence b's rows start at cu_seqlens_*[b] and it has its
// own lengths; the padded layout is the same with row offset 0 and the lengths seqlen_q /
// seqlen_k. Per-row fp32 buffers (lse, dlse, softmax_d, dq_accum rows) are [B, H, N] padded and
// [H, total] packed; row_q / row_k give the index of row i of (b, h) in them.
struct Seqs {
  const int32_t* cu_q = nullptr;  // null: padded layout
  const int32_t* cu_k = nullptr;
  int64_t batch = 0, nq = 0, nk = 0;  // nq, nk: seqlen_q / seqlen_k (packed: the max_seqlen bounds)
  int64_t total_q = 0, total_k = 0;
  bool packed() const { return cu_q != nullptr; }
  int64_t q0(int64_t b) const { return cu_q ? cu_q[b] : 0; }
  int64_t k0(int64_t b) const { return cu_k ? cu_k[b] : 0; }
  int64_t len_q(int64_t b) const { return cu_q ? cu_q[b + 1] - cu_q[b] : nq; }
  int64_t len_k(int64_t b) const { return cu_k ? cu_k[b + 1] - cu_k[b] : nk; }
  int64_t row_q(int64_t b, int64_t h, int64_t heads, int64_t i) const {
    return cu_q ? h * total_q + cu_q[b] + i : (b * heads + h) * nq + i;
  }
  int64_t row_k(int64_t b, int64_t h, int64_t heads, int64_t i) const {
    return cu_k ? h * total_k + cu_k[b] + i : (b * heads + h) * nk + i;
  }
  // Rows of the per-row fp32 buffers on the query side: B * Hq * Nq padded, Hq * total_q packed.
  int64_t rows_q(int64_t heads) const { return cu_q ? heads * total_q : batch * heads * nq; }
};

// The layout of an FgFwdArgs / FgBwdArgs, or false when its packed metadata is inconsistent
// (both or neither cu_seqlens; each starting at 0, non-decreasing, ending at total, every length
// within seqlen). The host checks all of this before a launch; the kernel checks it again
// because it indexes memory by these values (O(batch) reads of host memory).
template <class Args>
static inline bool seqs_of(const Args& a, Seqs& s) {
  s.batch = a.batch;
  s.nq = a.seqlen_q;
  s.nk = a.seqlen_k;
  if (!a.cu_seqlens_q && !a.cu_seqlens_k) return true;
  if (!a.cu_seqlens_q || !a.cu_seqlens_k || a.total_q < 0 || a.total_k < 0) return false;
  s.cu_q = a.cu_seqlens_q;
  s.cu_k = a.cu_seqlens_k;
  s.total_q = a.total_q;
  s.total_k = a.total_k;
  if (s.cu_q[0] != 0 || s.cu_k[0] != 0) return false;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t lq = s.len_q(b), lk = s.len_k(b);
    if (lq < 0 || lk < 0 || lq > s.nq || lk > s.nk) return false;
  }
  return s.cu_q[a.batch] == s.total_q && s.cu_k[a.batch] == s.total_k;
}

// The indices i in [0, n) with w[i] >= 0, longest first: ordered by decreasing power of two of
// w[i] (a counting sort, ties in index order). Close enough to a sort for a longest-first list
// schedule, O(n), and far cheaper to compile than std::sort in every kernel translation unit.
static inline void order_by_work(const double* w, int64_t n, std::vector<int64_t>& out) {
  int64_t start[130] = {0};  // bucket 0: w == 0; 1 + (binary exponent of w + 1), clamped
  auto bucket = [](double x) {
    int e = 0;
    if (!(x > 0.0)) return 0;
    std::frexp(x, &e);
    return e < -63 ? 1 : (e > 64 ? 129 : e + 65);
  };
  for (int64_t i = 0; i < n; ++i)
    if (w[i] >= 0.0) ++start[129 - bucket(w[i])];
  int64_t pos = 0;
  for (int k = 0; k < 130; ++k) {
    const int64_t c = start[k];
    start[k] = pos;
    pos += c;
  }
  out.assign(pos, 0);
  for (int64_t i = 0; i < n; ++i)
    if (w[i] >= 0.0) out[start[129 - bucket(w[i])]++] = i;
}

// Block lists (args.h, "Block sparsity"), shared with bwd.h. blocks_ok: data null, or tile sizes
// that are multiples of 8 in [8, 512], non-negative strides and rows x cols =
// ceil(n_r / block_r) x ceil(n_c / block_c). The values in the lists are the host's to check;
// here they are only kept from reaching memory out of range (block_count clips the counts to
// cols, block_mark ignores an index outside [lo, hi), hi <= cols).
static inline bool blocks_ok(const FgBlockLists& l, int64_t n_r, int64_t n_c) {
  if (!l.data) return true;
  auto ok = [](int32_t x) { return x >= 8 && x <= 512 && x % 8 == 0; };
  if (!ok(l.block_r) || !ok(l.block_c) || l.stride_b < 0 || l.stride_h < 0) return false;
  return l.rows == (n_r + l.block_r - 1) / l.block_r && l.cols == (n_c + l.block_c - 1) / l.block_c;
}

// Row r of (batch / sequence b, query head h).
static inline const int32_t* block_row(const FgBlockLists& l, int64_t b, int64_t h, int64_t r) {
  return l.data + b * l.stride_b + h * l.stride_h + r * (2 + (int64_t)l.cols);
}

// The row's listed tile count (partial + full), clipped to [0, cols].
static inline int64_t block_count(const int32_t* row, int64_t cols) {
  const int64_t np = std::min<int64_t>(std::max<int32_t>(row[0], 0), cols);
  return np + std::min<int64_t>(std::max<int32_t>(row[1], 0), cols - np);
}

// Marks the row's listed tiles j in [lo, hi) in flag (hi <= cols; flag all zero on entry):
// flag[j] |= 1 for a partial tile, 2 for a full one. Returns how many were marked. The caller
// visits them in increasing j and zeroes each flag as it does.
static inline int64_t block_mark(const int32_t* row, int64_t cols, int64_t lo, int64_t hi,
                                 uint8_t* flag) {
  const int64_t np = std::min<int64_t>(std::max<int32_t>(row[0], 0), cols);
  const int64_t n = block_count(row, cols);
  int64_t marked = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = row[2 + i];
    if (j < lo || j >= hi) continue;
    marked += flag[j] == 0;
    flag[j] |= i < np ? 1 : 2;
  }
  return marked;
}

// Per-thread scratch of the forward (once per parallel_for chunk / worker).
struct FwdWork {
  float *qbuf, *kbuf, *vbuf, *S, *O, *M, *L, *A;
  uint8_t *mask, *colkeep;
  int64_t ldS;
};

template <class Variant, class Element>
static inline size_t fwd_work_bytes(const Tiles t, int64_t d) {
  constexpr bool kLowp = Conv<Element>::kLowp;
  const int64_t qb = t.qb, kvb = t.kvb;
  const int64_t ldS = round_up(kvb, 16) + 16;
  const int64_t kvb16 = round_up(kvb, 16);
  size_t off = 0;
  off += kLowp ? al64(sizeof(float) * qb * d) : 0;
  off += al64(sizeof(float) * kvb16 * d);
  off += al64(sizeof(float) * kvb * d);
  off += al64(sizeof(float) * qb * ldS);
  off += al64(sizeof(float) * qb * d);
  off += 3 * al64(sizeof(float) * qb);
  off += Variant::kHasMask ? al64(qb * kvb) + al64(kvb) : 0;
  return off;
}

template <class Variant, class Element>
static inline FwdWork fwd_work_carve(const Tiles t, int64_t d, char* base) {
  constexpr bool kLowp = Conv<Element>::kLowp;
  const int64_t qb = t.qb, kvb = t.kvb;
  FwdWork w;
  w.ldS = round_up(kvb, 16) + 16;  // +16 floats: avoid 4 KiB set aliasing of rows
  const int64_t kvb16 = round_up(kvb, 16);  // own path: K^T packed in d x 16 panels
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* p = base + off;
    off += al64(bytes);
    return p;
  };
  w.qbuf = kLowp ? reinterpret_cast<float*>(take(sizeof(float) * qb * d)) : nullptr;
  w.kbuf = reinterpret_cast<float*>(take(sizeof(float) * kvb16 * d));
  w.vbuf = reinterpret_cast<float*>(take(sizeof(float) * kvb * d));
  w.S = reinterpret_cast<float*>(take(sizeof(float) * qb * w.ldS));
  w.O = reinterpret_cast<float*>(take(sizeof(float) * qb * d));
  w.M = reinterpret_cast<float*>(take(sizeof(float) * qb));
  w.L = reinterpret_cast<float*>(take(sizeof(float) * qb));
  w.A = reinterpret_cast<float*>(take(sizeof(float) * qb));
  w.mask = Variant::kHasMask ? reinterpret_cast<uint8_t*>(take(qb * kvb)) : nullptr;
  w.colkeep = Variant::kHasMask ? reinterpret_cast<uint8_t*>(take(kvb)) : nullptr;
  return w;
}

// One work item: query rows [q_lo, q_hi) (positions within the sequence) of query head h of
// sequence / batch element b, whose lengths are Nq, Nk; its q rows start at row q_row0 and its
// k/v rows at k_row0 (0 padded; cu_seqlens_*[b] packed), its lse rows at lse_row.
template <class Variant, class Element>
static inline void fwd_tile(const FgFwdArgs& a, const typename Variant::Params& prm, const Tiles t,
                            const bool blas, const Dropout& dr, const FwdWork& w, const int64_t b,
                            const int64_t h, const int64_t q_lo, const int64_t q_hi,
                            const int64_t Nq, const int64_t Nk, const int64_t q_row0,
                            const int64_t k_row0, const int64_t lse_row,
                            const int32_t* brow = nullptr, uint8_t* tflag = nullptr) {
  using C = Conv<Element>;
  using T = typename C::T;  // storage: float or uint16_t bits
  constexpr bool kLowp = C::kLowp;
  const int64_t Hq = a.heads_q, d = a.head_dim;
  const int64_t group = a.heads_q / a.heads_kv;
  const int64_t kvb = t.kvb;
  const int64_t ldS = w.ldS;
  const int nq_i = (int)Nq, nk_i = (int)Nk;
  float* const qbuf = w.qbuf;
  float* const kbuf = w.kbuf;
  float* const vbuf = w.vbuf;
  float* const S = w.S;
  float* const O = w.O;
  float* const M = w.M;
  float* const L = w.L;
  float* const A = w.A;
  uint8_t* const mask = w.mask;
  uint8_t* const colkeep = w.colkeep;

  const T* Qg = static_cast<const T*>(a.q);
  const T* Kg = static_cast<const T*>(a.k);
  const T* Vg = static_cast<const T*>(a.v);
  T* Og = static_cast<T*>(a.out);

  const float gemm_alpha = Variant::kHasScoreMod ? a.scale : a.scale * kLog2e;

  {
    const int64_t hk = h / group;
    const int64_t mq = q_hi - q_lo;
    const int bi = (int)b, hi_ = (int)h;

    const T* Qt = Qg + b * a.q_stride_b + h * a.q_stride_h + (q_row0 + q_lo) * a.q_stride_n;
    const T* Kh = Kg + b * a.k_stride_b + hk * a.k_stride_h + k_row0 * a.k_stride_n;
    const T* Vh = Vg + b * a.v_stride_b + hk * a.v_stride_h + k_row0 * a.v_stride_n;
    int64_t kv_begin = Variant::kv_lo(prm, bi, hi_, (int)q_lo, (int)q_hi, nq_i, nk_i);
    int64_t kv_end = Variant::kv_hi(prm, bi, hi_, (int)q_lo, (int)q_hi, nq_i, nk_i);
    kv_begin = kv_begin < 0 ? 0 : kv_begin;
    kv_end = kv_end > Nk ? Nk : kv_end;
    // Block lists: the listed kv tiles j (keys [j * bc, (j + 1) * bc)) that meet
    // [kv_begin, kv_end), flagged in tflag and visited in increasing j (clipped to the range);
    // runs of adjacent listed tiles of one kind within one aligned kvb-key chunk are visited as
    // one step (kvb: a multiple of bc, see fwd_sparse).
    const bool sparse = brow != nullptr;
    const int64_t bc = sparse ? a.kv_blocks.block_c : kvb;
    int64_t jt = 0, jt_end = 0;
    if (sparse && kv_begin < kv_end) {
      jt = kv_begin / bc;
      jt_end = std::min<int64_t>((kv_end + bc - 1) / bc, a.kv_blocks.cols);
      if (block_mark(brow, a.kv_blocks.cols, jt, jt_end, tflag) == 0) kv_end = kv_begin;
    }

    for (int64_t i = 0; i < mq; ++i) {
      M[i] = kNegInf;
      L[i] = 0.f;
    }
    memset(O, 0, sizeof(float) * mq * d);

    // Q tile, fp32: used in place when Element is float, else widened into qbuf.
    const float* Qf;
    int64_t ldq;
    if constexpr (kLowp) {
      if (kv_begin < kv_end)
        for (int64_t i = 0; i < mq; ++i) C::to_f32(Qt + i * a.q_stride_n, qbuf + i * d, d);
      Qf = qbuf;
      ldq = d;
    } else {
      Qf = reinterpret_cast<const float*>(Qt);
      ldq = a.q_stride_n;
    }

    for (int64_t kv_next = kv_begin;;) {
      int64_t kv0, kv1;
      // Listed tiles: 1 partial (the element mask runs, whatever tile_full says), 2 full (an
      // ordinary tile; with full_kept, known to be kept throughout: keep() is skipped); 0: none.
      int listed = 0;
      if (!sparse) {
        if (kv_next >= kv_end) break;
        kv0 = kv_next;
        kv1 = kv0 + kvb < kv_end ? kv0 + kvb : kv_end;
        kv_next = kv1;
      } else {
        while (jt < jt_end && !tflag[jt]) ++jt;
        if (jt >= jt_end) break;
        const uint8_t kind = tflag[jt] & 1;
        listed = kind ? 1 : 2;
        kv0 = std::max(jt * bc, kv_begin);
        const int64_t chunk_end = (jt * bc / kvb + 1) * kvb;
        do {
          tflag[jt] = 0;
          ++jt;
        } while (jt < jt_end && tflag[jt] && (tflag[jt] & 1) == kind && jt * bc < chunk_end);
        kv1 = std::min(jt * bc, kv_end);
      }
      (void)listed;
      const int64_t n = kv1 - kv0;
      bool full = true;
      int64_t c0 = 0, c1 = n;
      bool holes = false;
      if constexpr (Variant::kHasMask) {
        full = listed == 1   ? false
               : listed == 2 && a.kv_blocks.full_kept
                   ? true
                   : Variant::tile_full(prm, bi, hi_, (int)q_lo, (int)q_hi, (int)kv0, (int)kv1,
                                        nq_i, nk_i);
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
        // Own kernels: K^T packed into 16-column panels (zero-padded to a multiple of 16).
        const int64_t npan = (nn + 15) / 16;
        pack_kt<Element>(Kh + kvs * a.k_stride_n, a.k_stride_n, nn, d, kbuf);
        gemm_qk(Qf, ldq, kbuf, npan, mq, d, gemm_alpha, S, ldS);
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
        // Row max: four independent accumulators (vmaxps latency would bound a single chain).
        f8 vm0 = splat(kNegInf), vm1 = vm0, vm2 = vm0, vm3 = vm0;
        int64_t j = 0;
        for (; j + 32 <= nn8; j += 32) {
          vm0 = vmax(vm0, ld8(s + j));
          vm1 = vmax(vm1, ld8(s + j + 8));
          vm2 = vmax(vm2, ld8(s + j + 16));
          vm3 = vmax(vm3, ld8(s + j + 24));
        }
        for (; j < nn8; j += 8) vm0 = vmax(vm0, ld8(s + j));
        const float rmax = hmax(vmax(vmax(vm0, vm1), vmax(vm2, vm3)));
        const float m_old = M[i];
        const float m_new = rmax > m_old ? rmax : m_old;
        const float sub = m_new == kNegInf ? 0.f : m_new;  // row still empty: P = 0 below
        const f8 vsub = splat(sub);
        f8 vs0 = splat(0.f), vs1 = vs0;
        for (j = 0; j + 16 <= nn8; j += 16) {
          const f8 p0 = exp2v(ld8(s + j) - vsub);
          const f8 p1 = exp2v(ld8(s + j + 8) - vsub);
          vs0 += p0;
          vs1 += p1;
          st8(s + j, p0);
          st8(s + j + 8, p1);
        }
        for (; j < nn8; j += 8) {
          const f8 p0 = exp2v(ld8(s + j) - vsub);
          vs0 += p0;
          st8(s + j, p0);
        }
        const f8 vs = vs0 + vs1;
        const float alpha = exp2s(m_old - sub);  // 0 when m_old == -inf
        A[i] = alpha;
        any_rescale |= (alpha != 1.f) & (L[i] != 0.f);
        L[i] = L[i] * alpha + hsum(vs);
        M[i] = m_new;
        if constexpr (Variant::kHasDropout) {  // after l: the statistics are the undropped P's
          if (dr.on) dropout_row(dr, b * Hq + h, q_lo + i, kvs, nn, s, s, 1.f);
        }
        if constexpr (kLowp) C::round_inplace(s, nn8);
      }
      if (blas && any_rescale) {  // own kernels fold the rescale into the PV kernel
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
        gemm_pv(S, ldS, Vf, ldv, mq, nn, d, A, O);
      }
    }

    // Epilogue: out = O / l (times 1 / (1 - p) with dropout), lse = ln l + m (natural units).
    // l == 0: exact zeros and -inf.
    float* lse = a.lse + lse_row;
    T* Ot = Og + b * a.o_stride_b + h * a.o_stride_h + (q_row0 + q_lo) * a.o_stride_n;
    for (int64_t i = 0; i < mq; ++i) {
      T* orow = Ot + i * a.o_stride_n;
      if (L[i] > 0.f) {
        C::scale_from_f32(O + i * d, (dr.on ? dr.scale : 1.f) / L[i], orow, d);
        lse[i] = (M[i] + std::log2(L[i])) * kLn2;
      } else {
        memset(orow, 0, sizeof(T) * d);
        lse[i] = kNegInf;
      }
    }
  }
}

// Padded layout: tasks [task_begin, task_end) of the (batch, query head, query tile) space, in
// that order (the contiguous chunk at::parallel_for hands one thread).
template <class Variant, class Element>
void fwd_chunk(const FgFwdArgs& a, const typename Variant::Params& prm, const Tiles t,
               const bool blas, const Dropout& dr, int64_t task_begin, int64_t task_end) {
  const int64_t Hq = a.heads_q, Nq = a.seqlen_q, Nk = a.seqlen_k, d = a.head_dim;
  const int64_t qb = t.qb;
  const int64_t nqt = (Nq + qb - 1) / qb;
  Scratch scratch(fwd_work_bytes<Variant, Element>(t, d));
  const FwdWork w = fwd_work_carve<Variant, Element>(t, d, static_cast<char*>(scratch.p));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t qt = task % nqt;
    const int64_t bh = task / nqt;
    const int64_t h = bh % Hq, b = bh / Hq;
    const int64_t q_lo = qt * qb;
    const int64_t q_hi = q_lo + qb < Nq ? q_lo + qb : Nq;
    fwd_tile<Variant, Element>(a, prm, t, blas, dr, w, b, h, q_lo, q_hi, Nq, Nk, 0, 0,
                               (b * Hq + h) * Nq + q_lo);
  }
}

// Runs body(w, flags, i) for i = 0 .. ntasks - 1, handed out one at a time (an atomic counter) to
// at most at::get_num_threads() threads, each with its own forward scratch w and a zeroed byte
// buffer `flags` of flag_bytes (fwd_tile's per-tile marks with block lists).
template <class Variant, class Element, class Body>
void for_each_task(const Tiles t, int64_t d, int64_t ntasks, int64_t flag_bytes, const Body& body) {
  const int64_t nthr = std::min<int64_t>(std::max(1, at::get_num_threads()), ntasks);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthr, 1, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    Scratch scratch(fwd_work_bytes<Variant, Element>(t, d));
    const FwdWork w = fwd_work_carve<Variant, Element>(t, d, static_cast<char*>(scratch.p));
    std::vector<uint8_t> flags(flag_bytes, 0);
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= ntasks) break;
      body(w, flags.data(), i);
    }
  });
}

// Packed layout: one task per (sequence, query head, query tile of the sequence's true length);
// sequences without queries take none. Tasks are handed out dynamically, the sequences with
// the most score entries first (a longest-first list schedule: lengths vary, so equal task
// counts per thread would not be equal work).
template <class Variant, class Element>
void fwd_packed(const FgFwdArgs& a, const Seqs& sq, const typename Variant::Params& prm,
                const Tiles t, const bool blas, const Dropout& dr) {
  const int64_t B = a.batch, Hq = a.heads_q, d = a.head_dim, qb = t.qb;
  std::vector<double> work(B);  // score entries (+ the epilogue), -1: no queries, no task
  for (int64_t b = 0; b < B; ++b)
    work[b] = sq.len_q(b) > 0 ? double(sq.len_q(b)) * double(sq.len_k(b) + 8) : -1.0;
  std::vector<int64_t> order;
  order_by_work(work.data(), B, order);
  std::vector<int64_t> start(order.size() + 1, 0);  // first task of each sequence in `order`
  for (size_t j = 0; j < order.size(); ++j)
    start[j + 1] = start[j] + Hq * ((sq.len_q(order[j]) + qb - 1) / qb);
  const int64_t ntasks = start.back();
  if (ntasks == 0) return;
  for_each_task<Variant, Element>(t, d, ntasks, 0, [&](const FwdWork& w, uint8_t*, int64_t task) {
    const size_t j = std::upper_bound(start.begin(), start.end(), task) - start.begin() - 1;
    const int64_t b = order[j], Nq = sq.len_q(b), Nk = sq.len_k(b);
    const int64_t nqt = (Nq + qb - 1) / qb, r = task - start[j];
    const int64_t h = r / nqt, q_lo = (r % nqt) * qb;
    const int64_t q_hi = q_lo + qb < Nq ? q_lo + qb : Nq;
    fwd_tile<Variant, Element>(a, prm, t, blas, dr, w, b, h, q_lo, q_hi, Nq, Nk, sq.q0(b), sq.k0(b),
                               sq.row_q(b, h, Hq, q_lo));
  });
}

// Block lists (a.kv_blocks.data set), padded or packed layout: one task per (batch element /
// sequence, query head, query tile of block_r rows of its true length), handed out dynamically,
// the tasks with the most listed key entries first (the cost of a task is its listed tiles, which
// vary from row to row, so equal contiguous chunks would not be equal work).
template <class Variant, class Element>
void fwd_sparse(const FgFwdArgs& a, const Seqs& sq, const typename Variant::Params& prm,
                const Tiles t, const bool blas, const Dropout& dr) {
  const FgBlockLists& bl = a.kv_blocks;
  const int64_t B = a.batch, Hq = a.heads_q, d = a.head_dim, qb = t.qb, bc = bl.block_c;
  const int64_t cols = bl.cols;
  std::vector<int64_t> start(B + 1, 0);  // first task of each batch element / sequence
  for (int64_t b = 0; b < B; ++b) start[b + 1] = start[b] + Hq * ((sq.len_q(b) + qb - 1) / qb);
  const int64_t ntasks = start[B];
  if (ntasks == 0) return;
  std::vector<double> work(ntasks);  // score entries of the listed tiles (+ the epilogue)
  for (int64_t b = 0, task = 0; b < B; ++b) {
    const int64_t Nq = sq.len_q(b), nqt = (Nq + qb - 1) / qb;
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t qt = 0; qt < nqt; ++qt, ++task)
        work[task] = double(std::min(qb, Nq - qt * qb)) *
                     (double(block_count(block_row(bl, b, h, qt), cols)) * double(bc) + 8.0);
  }
  std::vector<int64_t> order;
  order_by_work(work.data(), ntasks, order);
  const auto body = [&](const FwdWork& w, uint8_t* tflag, int64_t i) {
    const int64_t task = order[i];
    const int64_t b = std::upper_bound(start.begin(), start.end(), task) - start.begin() - 1;
    const int64_t Nq = sq.len_q(b), Nk = sq.len_k(b);
    const int64_t nqt = (Nq + qb - 1) / qb, r = task - start[b];
    const int64_t h = r / nqt, qt = r % nqt, q_lo = qt * qb;
    const int64_t q_hi = q_lo + qb < Nq ? q_lo + qb : Nq;
    fwd_tile<Variant, Element>(a, prm, t, blas, dr, w, b, h, q_lo, q_hi, Nq, Nk, sq.q0(b), sq.k0(b),
                               sq.row_q(b, h, Hq, q_lo), block_row(bl, b, h, qt), tflag);
  };
  for_each_task<Variant, Element>(t, d, ntasks, cols + 1, body);
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
  if (B < 0 || Hq < 0 || Nq < 0 || Nk < 0 || Nq > FG_MAX_SEQLEN || Nk > FG_MAX_SEQLEN)
    return FG_ERR_BAD_SHAPE;
  if (!detail::blocks_ok(args.kv_blocks, Nq, Nk)) return FG_ERR_BAD_SHAPE;
  if (B == 0 || Hq == 0 || Nq == 0) return FG_OK;
  if (Hkv <= 0 || Hq % Hkv != 0) return FG_ERR_BAD_SHAPE;
  detail::Seqs sq;
  if (!detail::seqs_of(args, sq)) return FG_ERR_BAD_SHAPE;
  if (sq.packed() && sq.total_q == 0) return FG_OK;
  const bool any_k = sq.packed() ? sq.total_k > 0 : Nk > 0;
  if (!args.q || !args.out || !args.lse || (any_k && (!args.k || !args.v))) return FG_ERR_BAD_SHAPE;

  const typename Variant::Params empty_params{};
  const typename Variant::Params& prm =
      args.params ? *static_cast<const typename Variant::Params*>(args.params) : empty_params;

  const bool sparse = args.kv_blocks.data != nullptr;
  const detail::Tiles t =
      sparse ? detail::sparse_tiles(args.kv_blocks, Nk, d)
             : detail::choose_tiles<Variant>(prm, B * Hq, Nq, Nk, d);
  const bool blas = detail::use_blas(args);
  const Dropout dr = dropout_of<Variant>(args);
  try {
    if (sq.packed()) {
      FgFwdArgs a = args;  // the batch strides are ignored in the packed layout (args.h)
      a.q_stride_b = a.k_stride_b = a.v_stride_b = a.o_stride_b = 0;
      if (sparse)
        detail::fwd_sparse<Variant, Element>(a, sq, prm, t, blas, dr);
      else
        detail::fwd_packed<Variant, Element>(a, sq, prm, t, blas, dr);
      return FG_OK;
    }
    if (sparse) {
      detail::fwd_sparse<Variant, Element>(args, sq, prm, t, blas, dr);
      return FG_OK;
    }
    const int64_t ntasks = B * Hq * ((Nq + t.qb - 1) / t.qb);
    at::parallel_for(0, ntasks, 1, [&](int64_t begin, int64_t end) {
      detail::fwd_chunk<Variant, Element>(args, prm, t, blas, dr, begin, end);
    });
  } catch (...) {
    return FG_ERR_LAUNCH;
  }
  return FG_OK;
}

}  // namespace cpu
}  // namespace flashgen

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
