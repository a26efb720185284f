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
// (args.tile_q must be block_r): qb = block_r, and kv tiles of block_c keys,
// any multiple of 8 up to 512 (K^T panels are zero-padded to 16 columns; the kernels take row
// tails). A task is still (b, h, query tile r) (packed: the sequence's own tiles), but it visits
// only the kv tiles listed in row r of (b, h), in increasing order, each clipped to
// [kv_lo, kv_hi) and seqlen_k like any tile (one entirely outside is skipped); adjacent listed
// tiles of one kind in one aligned chunk of kvb keys are taken as one step (kvb = args.tile_kv, a
// multiple of block_c; flashgen/families/cpu_tiles.py sparse_fwd_tiles). A
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
// Decoding with a KV cache (args.kv_cache.seqlens set; layout in args.h, FgKvCache): fwd_kvcache
// appends k_new / v_new into the cache first (cpu/kvcache.h), then runs one task per (sequence,
// query head, query tile of the Sq rows) through the same fwd_tile, the sequence's length L as
// both seqlen_q and seqlen_k and the rows at positions L - Sq .. L - 1, so every hook sees what
// it sees in the prefill call on the whole sequence. A contiguous cache is read in place from
// its left padding on; a paged one in place where a tile lies within one page, else gathered
// row by row into the work's kg / vg buffers (kvb x d Elements each, allocated only then).
//
// Variant hooks (contract: flashgen/variant.h). The Params reference is *args.params, or a
// value-initialised Params when args.params is null (allowed when Params is empty); it is shared
// read-only by all threads. kv_lo / kv_hi / tile_full are evaluated per work item with its own
// (b, h), so a mask may depend on the batch and the query head (the host's tile-size cost model,
// which has no particular work item, evaluates the same bounds at b = h = 0).
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
// Gemm backends (cpu/gemm.h; both fp32 in, fp32 out): the own register-blocked 6x16 FMA
// micro-kernels by default (QK: K^T is packed per kv tile into 16-column panels, 8x8 in-register
// transposes widening 16-bit K on the fly, Q rows broadcast in place; PV: V rows are read in place
// (fp32) and P is broadcast from the S tile, so nothing of the q x kv tile is ever packed, and
// the O rescale by 2^(m_old - m_new) is folded into the kernel's accumulator load), or BLAS
// sgemm_ (without AVX2/FMA, or FLASHGEN_CPU_GEMM=blas).
//
// Layers: cpu/simd.h (f8 vectors, exp2), cpu/convert.h (Element <-> fp32), cpu/gemm.h (the gemm
// family both passes use), cpu/tiles.h (tile choice), cpu/work.h (scratch, packed layout, block
// lists, task order); this header is the forward driver on top of them.
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
//   * Non-finite scores (DESIGN.md): a NaN or +inf score at a kept entry makes the row's out and
//     lse NaN. Nothing is tested per element: whether or not the row max keeps a NaN, exp2v
//     gives NaN for it (NaN in, NaN out), and +inf becomes the row max and gives
//     P = 2^(inf - inf) = NaN there, so l turns NaN and stays NaN; only m == -inf (every score
//     so far -inf) means "row still empty", and the epilogue writes zeros only for l == 0. A
//     score of -inf is a masked one.
//   * GQA/MQA: query head h reads kv head h / (heads_q / heads_kv).
//   * Any batch/head/seq strides (elements, 64-bit offsets); the last dim must be contiguous.
//     lse is fp32, contiguous [B, Hq, Nq] (packed: [Hq, total_q]); out is written in Element
//     with args' strides.
//   * Shape errors (negative sizes, heads_q % heads_kv != 0, null pointers, seqlens > FG_MAX_SEQLEN = 2^30)
//     return FG_ERR_BAD_SHAPE; an exception inside the kernel (e.g. bad_alloc of the scratch)
//     returns FG_ERR_LAUNCH. Nothing is thrown across the C ABI.
//
// Tiles: args.tile_q x args.tile_kv, chosen by the host (flashgen/families/cpu_tiles.py; packed:
// sized for max_seqlen_q / max_seqlen_k; block lists: from their block sizes) and checked by
// fwd_tiles_of in cpu/tiles.h (FG_ERR_BAD_SHAPE when not set or out of range). Per-thread
// scratch is allocated once per parallel_for chunk
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

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "flashgen/args.h"
#include "flashgen/cpu/convert.h"
#include "flashgen/cpu/dropout.h"
#include "flashgen/cpu/gemm.h"
#include "flashgen/cpu/kvcache.h"
#include "flashgen/cpu/simd.h"
#include "flashgen/cpu/tiles.h"
#include "flashgen/cpu/work.h"
#include "flashgen/variant.h"

#if !defined(_OPENMP)
#warning "flashgen/cpu/fwd.h: compiled without -fopenmp; at::parallel_for will run on one thread"
#endif

// Without -mavx, GCC warns that 32-byte vector arguments change the psABI; every function taking
// them here has internal linkage, so the warning does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace flashgen {
namespace cpu {
namespace detail {

// Per-thread scratch of the forward (once per parallel_for chunk / worker).
struct FwdWork {
  float *qbuf, *kbuf, *vbuf, *S, *O, *M, *L, *A;
  uint8_t *mask, *colkeep;
  void *kg, *vg;  // paged KV cache: kvb x d Elements each, the gathered rows of a tile; else null
  int64_t ldS;
};

// The K and V rows of one (sequence, kv head) of a paged KV cache (cpu/kvcache.h).
template <class T>
struct KvPages {
  PagedRows<T> k, v;
};

template <class Variant, class Element>
static inline size_t fwd_work_bytes(const Tiles t, int64_t d, bool paged = false) {
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
  off += paged ? 2 * al64(sizeof(typename Conv<Element>::T) * kvb * d) : 0;
  return off;
}

template <class Variant, class Element>
static inline FwdWork fwd_work_carve(const Tiles t, int64_t d, char* base, bool paged = false) {
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
  w.kg = paged ? take(sizeof(typename Conv<Element>::T) * kvb * d) : nullptr;
  w.vg = paged ? take(sizeof(typename Conv<Element>::T) * kvb * d) : nullptr;
  return w;
}

// One work item: query rows [q_lo, q_hi) (positions within the sequence) of query head h of
// sequence / batch element b, whose lengths are Nq, Nk; its q (and out) rows start at row
// q_row0 (0 padded; cu_seqlens_q[b] packed; Sq - L for a decode call, whose positions are
// L - Sq .. L - 1) and its k/v rows at k_row0 (0 padded; cu_seqlens_k[b] packed; the left
// padding of a contiguous KV cache), its lse rows at lse_row. pg: the rows of a paged KV cache
// (then k_row0 is unused and key j is read through pg).
template <class Variant, class Element>
static inline void fwd_tile(const FgFwdArgs& a, const typename Variant::Params& prm, const Tiles t,
                            const bool blas, const Dropout& dr, const FwdWork& w, const int64_t b,
                            const int64_t h, const int64_t q_lo, const int64_t q_hi,
                            const int64_t Nq, const int64_t Nk, const int64_t q_row0,
                            const int64_t k_row0, const int64_t lse_row,
                            const int32_t* brow = nullptr, uint8_t* tflag = nullptr,
                            const KvPages<typename Conv<Element>::T>* pg = nullptr) {
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
    const T* Kh = pg ? nullptr : Kg + b * a.k_stride_b + hk * a.k_stride_h + k_row0 * a.k_stride_n;
    const T* Vh = pg ? nullptr : Vg + b * a.v_stride_b + hk * a.v_stride_h + k_row0 * a.v_stride_n;
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
      // The tile's K and V rows kvs .. kvs + nn - 1, rows ldkt / ldvt apart (paged: in place
      // within one page, else gathered into the work's kg / vg).
      const T *Kt, *Vt;
      int64_t ldkt, ldvt;
      if (pg) {
        pg->k.rows(kvs, nn, static_cast<T*>(w.kg), Kt, ldkt);
        pg->v.rows(kvs, nn, static_cast<T*>(w.vg), Vt, ldvt);
      } else {
        Kt = Kh + kvs * a.k_stride_n;
        ldkt = a.k_stride_n;
        Vt = Vh + kvs * a.v_stride_n;
        ldvt = a.v_stride_n;
      }

      // S (row-major mq x nn, ld ldS) = alpha * Q K^T.
      if (blas) {
        // column-major nn x mq = K^T (K: col-major d x nn) * Q (col-major d x mq)
        const float* Kf;
        int64_t ldk;
        if constexpr (kLowp) {
          for (int64_t j = 0; j < nn; ++j)
            C::to_f32(Kt + j * ldkt, kbuf + j * d, d);
          Kf = kbuf;
          ldk = d;
        } else {
          Kf = reinterpret_cast<const float*>(Kt);
          ldk = ldkt;
        }
        blas_sgemm(true, false, nn, mq, d, gemm_alpha, Kf, ldk, Qf, ldq, 0.f, S, ldS);
      } else {
        // Own kernels: K^T packed into 16-column panels (zero-padded to a multiple of 16).
        const int64_t npan = (nn + 15) / 16;
        pack_kt<Element>(Kt, ldkt, nn, d, kbuf);
        gemm_abt<kEpiScale>(Qf, ldq, kbuf, npan, mq, d, gemm_alpha, nullptr, S, ldS);
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
        // Row still empty (only m == -inf; a NaN m propagates): P = 0 below.
        const float sub = m_new == kNegInf ? 0.f : m_new;
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
            C::to_f32(Vt + j * ldvt, dst, d);
          } else {
            memcpy(dst, Vt + j * ldvt, sizeof(float) * d);
          }
        }
        Vf = vbuf;
        ldv = d;
      } else {
        Vf = reinterpret_cast<const float*>(Vt);
        ldv = ldvt;
      }
      if (blas) {
        // column-major d x mq = V (col-major d x nn) * P (col-major nn x mq)
        blas_sgemm(false, false, d, mq, nn, 1.f, Vf, ldv, S, ldS, 1.f, O, d);
      } else {
        gemm_acc<false, true>(S, ldS, Vf, ldv, mq, nn, d, O, d, A);
      }
    }

    // Epilogue: out = O / l (times 1 / (1 - p) with dropout), lse = ln l + m (natural units).
    // l == 0 (no kept key): exact zeros and -inf. A NaN l (a NaN or +inf score at a kept key)
    // falls through to O / l: out and lse NaN.
    float* lse = a.lse + lse_row;
    T* Ot = Og + b * a.o_stride_b + h * a.o_stride_h + (q_row0 + q_lo) * a.o_stride_n;
    for (int64_t i = 0; i < mq; ++i) {
      T* orow = Ot + i * a.o_stride_n;
      if (L[i] != 0.f) {
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
// at most at::get_num_threads() threads, each with its own forward scratch w (with the gather
// buffers of a paged KV cache when `paged`) and a zeroed byte buffer `flags` of flag_bytes
// (fwd_tile's per-tile marks with block lists).
template <class Variant, class Element, class Body>
void for_each_task(const Tiles t, int64_t d, int64_t ntasks, int64_t flag_bytes, const Body& body,
                   bool paged = false) {
  const int64_t nthr = std::min<int64_t>(std::max(1, at::get_num_threads()), ntasks);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthr, 1, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    Scratch scratch(fwd_work_bytes<Variant, Element>(t, d, paged));
    const FwdWork w = fwd_work_carve<Variant, Element>(t, d, static_cast<char*>(scratch.p), paged);
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


// Decoding with a KV cache (args.kv_cache.seqlens set; layout in args.h, FgKvCache): k_new / v_new
// of the valid sequences are appended first (cpu/kvcache.h), then one task per (sequence, query
// head, query tile of the Sq rows) attends over the sequence's L keys as the rows L - Sq .. L - 1
// of the prefill call on the whole sequence (fwd_tile with Nq = Nk = L; a paged cache's rows are
// read in place within a page or gathered per tile). Tasks are handed out dynamically, the
// longest sequences first. Every row of an invalid sequence gets out and lse NaN; rows at
// negative positions (Sq > L) get out 0 and lse -inf.
template <class Variant, class Element>
void fwd_kvcache(const FgFwdArgs& a, const typename Variant::Params& prm, const Tiles t,
                 const bool blas, const Dropout& dr) {
  using C = Conv<Element>;
  using T = typename C::T;
  const FgKvCache& c = a.kv_cache;
  const int64_t B = a.batch, Hq = a.heads_q, Sq = a.seqlen_q, d = a.head_dim, qb = t.qb;
  const int64_t group = a.heads_q / a.heads_kv;
  std::vector<KvSeq> seqs;
  kv_seqs(c, B, seqs);
  kv_append<T>(a, seqs);
  const int64_t nqt = (Sq + qb - 1) / qb, ntasks = B * Hq * nqt;
  if (ntasks == 0) return;
  std::vector<double> work(ntasks);  // keys per task (+ the epilogue)
  for (int64_t i = 0; i < ntasks; ++i) work[i] = double(seqs[i / (Hq * nqt)].len) + 8.0;
  std::vector<int64_t> order;
  order_by_work(work.data(), ntasks, order);
  const bool paged = c.block_table != nullptr;
  const T* Kg = static_cast<const T*>(a.k);
  const T* Vg = static_cast<const T*>(a.v);
  T* Og = static_cast<T*>(a.out);
  const auto body = [&](const FwdWork& w, uint8_t*, int64_t i) {
    const int64_t task = order[i];
    const int64_t b = task / (Hq * nqt), h = task / nqt % Hq, r0 = task % nqt * qb;
    const int64_t r1 = std::min(r0 + qb, Sq);
    const KvSeq& s = seqs[b];
    const int64_t L = s.len;
    // Rows r0 .. first - 1 have no row of the prefill call (or the sequence is invalid).
    const int64_t first = s.ok ? std::min(std::max(r0, Sq - L), r1) : r1;
    float* lse = a.lse + (b * Hq + h) * Sq;
    if (!s.ok)
      for (int64_t j = 0; j < d; ++j) w.O[j] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t r = r0; r < first; ++r) {
      T* orow = Og + b * a.o_stride_b + h * a.o_stride_h + r * a.o_stride_n;
      if (s.ok) {
        memset(orow, 0, sizeof(T) * d);
        lse[r] = kNegInf;
      } else {
        C::scale_from_f32(w.O, 1.f, orow, d);
        lse[r] = std::numeric_limits<float>::quiet_NaN();
      }
    }
    if (first == r1) return;
    KvPages<T> pg;
    if (paged) {
      const int64_t hk = h / group;
      pg.k = PagedRows<T>{&c, b, s.pad, d, Kg + hk * a.k_stride_h, a.k_stride_b, a.k_stride_n};
      pg.v = PagedRows<T>{&c, b, s.pad, d, Vg + hk * a.v_stride_h, a.v_stride_b, a.v_stride_n};
    }
    fwd_tile<Variant, Element>(a, prm, t, blas, dr, w, b, h, first - Sq + L, r1 - Sq + L, L, L,
                               Sq - L, s.pad, (b * Hq + h) * Sq + first, nullptr, nullptr,
                               paged ? &pg : nullptr);
  };
  for_each_task<Variant, Element>(t, d, ntasks, 0, body, paged);
}

// The sizes of a decode call (args.h, FgKvCache) that index memory: a capacity within
// FG_MAX_SEQLEN (paged: max_pages * page_size, page_size >= 1, a pool with pages when there are
// slots), seqlen_new within it, the cache and seqlens pointers set, k_new and v_new together;
// no block lists, dropout or packed batch with it.
static inline bool kvcache_ok(const FgFwdArgs& a) {
  const FgKvCache& c = a.kv_cache;
  if (a.kv_blocks.data || a.cu_seqlens_q || a.cu_seqlens_k || a.dropout_state) return false;
  if (c.capacity < 0 || c.capacity > FG_MAX_SEQLEN || c.capacity != a.seqlen_k) return false;
  if (c.seqlen_new < 0 || c.seqlen_new > c.capacity || (!c.k_new) != (!c.v_new)) return false;
  if (c.k_new && c.seqlen_new > 0 && a.heads_kv > 0 && (!a.k || !a.v)) return false;
  if (c.block_table) {
    if (c.page_size < 1 || c.max_pages < 0 || c.block_table_stride < 0 ||
        c.capacity != int64_t(c.page_size) * c.max_pages || (c.capacity > 0 && c.num_pages < 1))
      return false;
  }
  return a.batch == 0 || c.seqlens != nullptr;
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
  const bool decode = args.kv_cache.seqlens != nullptr;
  if (decode && !detail::kvcache_ok(args)) return FG_ERR_BAD_SHAPE;
  if (B == 0 || Hq == 0 || (Nq == 0 && !(decode && args.kv_cache.k_new))) return FG_OK;
  if (Hkv <= 0 || Hq % Hkv != 0) return FG_ERR_BAD_SHAPE;
  detail::Seqs sq;
  if (!detail::seqs_of(args, sq)) return FG_ERR_BAD_SHAPE;
  if (sq.packed() && sq.total_q == 0) return FG_OK;
  const bool any_k = sq.packed() ? sq.total_k > 0 : Nk > 0;
  if ((Nq > 0 && (!args.q || !args.out || !args.lse)) || (any_k && (!args.k || !args.v)))
    return FG_ERR_BAD_SHAPE;

  const typename Variant::Params empty_params{};
  const typename Variant::Params& prm =
      args.params ? *static_cast<const typename Variant::Params*>(args.params) : empty_params;

  const bool sparse = args.kv_blocks.data != nullptr;
  detail::Tiles t;
  if (!detail::fwd_tiles_of(args, t)) return FG_ERR_BAD_SHAPE;
  const bool blas = detail::use_blas(args);
  const Dropout dr = dropout_of<Variant>(args);
  try {
    if (decode) {
      detail::fwd_kvcache<Variant, Element>(args, prm, t, blas, dr);
      return FG_OK;
    }
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
