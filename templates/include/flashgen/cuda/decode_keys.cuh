// flashgen CUDA decode kernel with the keys on the tensor cores' M side (the sm80 family's
// keys-major variant; config decode_keys, DecodeKeysTile): the same calls, semantics, grid,
// split cut, load pipeline and bad-value rules as DecodeKernel (cuda/decode.cuh, whose comment
// is the specification), with the step's two products transposed:
//
//   S^T = K Q^T   (m16n8k16: A = the warp's 16 keys of the tile by ldmatrix, B = Q^T, the
//                  group's query rows as the N side of 8, held in registers for the whole call)
//   O^T += V^T P^T (A = V^T by ldmatrix.trans, 16 head-dim rows per atom; B = P^T, the S^T
//                  accumulators rounded to the element type and transposed per 8 x 8 quadrant
//                  by movmatrix)
//
// Why: at Sq 1 a GQA group of 4 (Llama's 32 / 8 heads) has 4 query rows, which fill a quarter
// of DecodeKernel's 16-row M side, so its key-tile step issued 4x the tensor-core work it
// needed, 8 ldmatrix of Q per 16 keys, and rescaled 16 rows of O. Here the 16 keys of a warp fill
// M, the rows take an N of 8 (kN8 = 1: group x Sq <= 8 rows per CTA, and every CTA above d 128)
// or two of 8 (kN8 = 2: 16 rows), and per 16 keys at d 128 a warp issues 16 mma and 16 ldmatrix (DecodeKernel: 32 and 24)
// with 32 fp32 accumulators of O instead of 64 (kN8 = 1). The online softmax runs per query
// column: a column's 16 keys of the warp sit in lanes of one t4 (lane % 4), keys g and g + 8, so
// its max takes three shuffles (xor 4, 8, 16) and each lane keeps a partial sum, reduced once at
// the end. The warps' merge and the output are DecodeKernel's, over kRows = 8 kN8 rows.
#pragma once
#include "flashgen/cuda/decode.cuh"

namespace flashgen {
namespace cuda {

// The keys-major variant's tile (flashgen/families/sm80.py, decode_tile with decode_keys): the
// same keys per stage and stages as DecodeTile; kSmem is its own figure (no Q in shared memory).
template <int kBlockN_, int kStages_, int kSmem_>
struct DecodeKeysTile : DecodeTile<kBlockN_, kStages_, kSmem_> {
  static constexpr int kKeys = 1;
};

template <class Variant, class Element, int kHeadDim, class Tile, int kN8>
struct DecodeKeysKernel {
  using Base = DecodeKernel<Variant, Element, kHeadDim, Tile>;
  using Params = typename Base::Params;
  static_assert(Tile::kKeys == 1 && Tile::kBulk == 0, "DecodeKeysTile: keys-major, K/V by cp.async");
  static_assert(kN8 == 1 || kN8 == 2, "8 or 16 query rows per CTA");
  static constexpr int kD = kHeadDim;
  static constexpr int kPitch = Base::kPitch;
  static constexpr int kE = Base::kE;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kWarps = Tile::kWarps;
  static constexpr int kDB = kD / 16;  // 16-wide head-dim blocks
  static constexpr int kRows = 8 * kN8;  // query rows per CTA (the N side)
  static constexpr int kCols = 2 * kN8;  // query columns per thread: 2 t4 + {0, 1} of each n8 tile
  static constexpr int kStageBytes = Base::kStageBytes;
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kOPitch = Base::kOPitch;
  // Sized for 16 rows whatever kN8: one shared-memory figure for both kernels of a unit.
  static constexpr int kMergeBytes = kWarps * 16 * kOPitch * 4 + 3 * kWarps * 16 * 4;
  static constexpr int kSmem = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static_assert(kSmem == Tile::kSmem, "the family's shared-memory figure (sm80.py decode_smem, keys) is "
                                      "the kernel's");
  static constexpr float kLog2e = Base::kLog2e;

  static __device__ void run(const Params& p, char* smem) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t4 = lane & 3;
    int mt, split, hk, b;
    Base::decode_cta(p, blockIdx.x, mt, split, hk, b);
    const int rows_total = p.group * p.sq;
    const int row0 = mt * kRows;

    const detail::DecodeSeq s = detail::decode_seq(p, b);
    const bool bad_seq =
        !s.ok || detail::decode_pages_bad(p, b, s, split, p.splits, tid, kThreads);  // uniform
    if (bad_seq) {  // every row of this tile NaN
      Base::template write_nan_rows<kRows>(p, smem, b, hk, split, row0, rows_total, tid);
      return;
    }
    const int L = s.len;

    // This thread's query columns u = 2 n + e: row R = row0 + 8 n + 2 t4 + e (head, position, key
    // bounds). Rows past the group's rows or at negative positions see no key.
    int rh[kCols], rpos[kCols], rlo[kCols], rhi[kCols];
    bool rok[kCols];
    int lo = L, hi = 0;
#pragma unroll
    for (int u = 0; u < kCols; ++u) {
      const int R = row0 + 8 * (u >> 1) + 2 * t4 + (u & 1);
      int h = 0, i = 0;
      if (R < rows_total) Base::row_of(p, hk, R, h, i);
      rh[u] = h;
      rpos[u] = L - p.sq + i;
      rok[u] = R < rows_total && rpos[u] >= 0;
      rlo[u] = L, rhi[u] = 0;
      if (rok[u]) row_bounds<Variant>(p.vp, b, h, rpos[u], 0, L, L, L, rlo[u], rhi[u]);
      if (rlo[u] >= rhi[u]) rlo[u] = L, rhi[u] = 0;
      lo = imin(lo, rlo[u]);
      hi = imax(hi, rhi[u]);
    }
    // The tile's keys: the union of its rows' ranges (the lanes' t4 cover every column), cut into
    // the splits' pieces of whole tiles, as DecodeKernel.
    lo = detail::warp_min_i(lo);
    hi = detail::warp_max_i(hi);
    int kv_begin = 0, kv_end = 0;
    if (lo < hi) {
      const int ntiles = (hi - lo + kBlockN - 1) / kBlockN;
      const int per = (ntiles + p.splits - 1) / p.splits;
      kv_begin = imin(hi, lo + split * per * kBlockN);
      kv_end = imin(hi, kv_begin + per * kBlockN);
    }
    const int n_tiles = (kv_end - kv_begin + kBlockN - 1) / kBlockN;

    const uint32_t sKV = ptx::smem_addr(smem);
    char* const gKV = smem;  // sKV's generic address
    const bool rows = p.table && p.row_lookup;  // uniform
    if (rows) {  // the offsets of tiles 0 .. kStages - 1 (the prologue's and iteration 0's copies)
#pragma unroll
      for (int st = 0; st < kStages; ++st)
        if (st < n_tiles)
          *Base::row_offset_slot(gKV + st * kStageBytes, tid) =
              Base::row_offset(p, b, hk, s.pad, kv_begin + st * kBlockN, kv_end, tid);
      __syncthreads();
    }
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < n_tiles)
        Base::load_kv(sKV + st * kStageBytes, sKV + st * kStageBytes + kStageBytes / 2, gKV + st * kStageBytes,
                      rows, p, b, hk, s.pad, kv_begin + st * kBlockN, kv_end, tid);
      ptx::cp_async_commit();
    }

    // Q^T as the B operand, for the whole call: n8 tile n's column g is row R = row0 + 8 n + g,
    // registers (kk, 0 / 1) its head-dim pairs 16 kk + 2 t4 and 16 kk + 8 + 2 t4 (zero past the
    // group's rows). 32-bit loads: the launcher's 16-byte alignment check covers them.
    uint32_t qb[kN8][kDB][2];
#pragma unroll
    for (int n = 0; n < kN8; ++n) {
      const int R = row0 + 8 * n + g;
      const bool ok = R < rows_total;
      int h = 0, qi = 0;
      if (ok) Base::row_of(p, hk, R, h, qi);
      const uint32_t* src = reinterpret_cast<const uint32_t*>(p.q + int64_t(b) * p.q_sb + int64_t(h) * p.q_sh +
                                                              int64_t(qi) * p.q_sn);
#pragma unroll
      for (int kk = 0; kk < kDB; ++kk) {
        qb[n][kk][0] = ok ? src[kk * 8 + t4] : 0u;
        qb[n][kk][1] = ok ? src[kk * 8 + 4 + t4] : 0u;
      }
    }

    float o[kN8][kDB][4];
#pragma unroll
    for (int n = 0; n < kN8; ++n)
#pragma unroll
      for (int db = 0; db < kDB; ++db)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][db][e] = 0.f;
    float m[kCols], l[kCols];
    bool nonfinite[kCols];
#pragma unroll
    for (int u = 0; u < kCols; ++u) m[u] = -INFINITY, l[u] = 0.f, nonfinite[u] = false;
    const uint32_t k_off = lane_off_a(lane, kPitch, kE);  // K as A: rows keys, columns d
    const uint32_t v_off = lane_off_b(lane, kPitch, kE);  // V^T as A through .trans

    for (int it = 0; it < n_tiles; ++it) {
      // As DecodeKernel: tile it landed, the barrier publishes it (and the row offsets) and frees
      // stage (it - 1) % kStages; then tile it + kStages - 1's copies and tile it + kStages's
      // offsets.
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      {
        const bool next_rows = rows && it + kStages < n_tiles;  // uniform
        int64_t next_off = 0;
        if (next_rows)
          next_off = Base::row_offset(p, b, hk, s.pad, kv_begin + (it + kStages) * kBlockN, kv_end, tid);
        const int nt = it + kStages - 1;
        if (nt < n_tiles) {
          const int stg = nt % kStages;
          const uint32_t st = sKV + stg * kStageBytes;
          Base::load_kv(st, st + kStageBytes / 2, gKV + stg * kStageBytes, rows, p, b, hk, s.pad,
                        kv_begin + nt * kBlockN, kv_end, tid);
        }
        ptx::cp_async_commit();
        if (next_rows) *Base::row_offset_slot(gKV + (it % kStages) * kStageBytes, tid) = next_off;
      }
      const uint32_t sK = sKV + (it % kStages) * kStageBytes + warp * 16 * kPitch * kE;
      const uint32_t sV = sK + kStageBytes / 2;
      const int kv0 = kv_begin + it * kBlockN + warp * 16;  // this warp's first key

      // S^T = K Q^T over the warp's 16 keys: sc[n][e] is (key g, column 2 t4 + e & 1) for e < 2,
      // (key g + 8, the same columns) for e >= 2.
      float sc[kN8][4];
#pragma unroll
      for (int n = 0; n < kN8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[n][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kDB; ++kk) {
        uint32_t a[4];
        ptx::ldmatrix_x4(a, sK + kk * 16 * kE + k_off);
#pragma unroll
        for (int n = 0; n < kN8; ++n) ptx::mma_16816<Element>(sc[n], a, qb[n][kk][0], qb[n][kk][1]);
      }

      // Mask and score hooks (log2 units; masked: -inf), then the online softmax per column.
#pragma unroll
      for (int u = 0; u < kCols; ++u) {
        const int n = u >> 1, e = u & 1;
        float tmax = -INFINITY;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int kv = kv0 + g + 8 * hh;
          bool vis = kv < kv_end;
          if constexpr (kRowBounds<Variant>) {
            vis = vis && kv >= rlo[u] && kv < rhi[u];
          } else {
            vis = vis && rok[u] && kv >= rlo[u] && kv < rhi[u] && Variant::keep(p.vp, b, rh[u], rpos[u], kv, L, L);
          }
          float x;
          if constexpr (Variant::kHasScoreMod) {
            x = vis ? Variant::score(p.vp, sc[n][e + 2 * hh] * p.scale, b, rh[u], rpos[u], kv, L, L) * kLog2e
                    : -INFINITY;
          } else {
            x = vis ? sc[n][e + 2 * hh] * p.scale_log2 : -INFINITY;
          }
          if (x != x || x == INFINITY) {  // NaN or +inf at a kept key: the row is NaN
            nonfinite[u] = true;
            x = -INFINITY;
          }
          sc[n][e + 2 * hh] = x;
          tmax = fmaxf(tmax, x);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 8));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
        const float m_new = fmaxf(m[u], tmax);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = ptx::exp2_approx(m[u] - m_use);  // m = -inf: 0 (O and l are 0 then)
        m[u] = m_new;
        const float p0 = ptx::exp2_approx(sc[n][e] - m_use);
        const float p1 = ptx::exp2_approx(sc[n][e + 2] - m_use);
        sc[n][e] = p0;
        sc[n][e + 2] = p1;
        l[u] = l[u] * alpha + (p0 + p1);  // this lane's keys; the column's lanes are summed at the end
#pragma unroll
        for (int db = 0; db < kDB; ++db) {
          o[n][db][e] *= alpha;
          o[n][db][e + 2] *= alpha;
        }
      }

      // O^T += V^T P^T: P^T's B fragment (keys 2 t4 + {0, 1} and + 8, column g) is the transpose
      // of the accumulators' quadrants (keys g and g + 8, columns 2 t4 + {0, 1}).
      uint32_t pb[kN8][2];
#pragma unroll
      for (int n = 0; n < kN8; ++n) {
        pb[n][0] = ptx::movmatrix_trans(ptx::pack2<Element>(sc[n][0], sc[n][1]));
        pb[n][1] = ptx::movmatrix_trans(ptx::pack2<Element>(sc[n][2], sc[n][3]));
      }
#pragma unroll
      for (int db = 0; db < kDB; ++db) {
        uint32_t va[4];
        ptx::ldmatrix_x4_trans(va, sV + db * 16 * kE + v_off);
#pragma unroll
        for (int n = 0; n < kN8; ++n) ptx::mma_16816<Element>(o[n][db], va, pb[n][0], pb[n][1]);
      }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // the ring is free: the warps' merge reuses it

    // Each column's sum and non-finite flag over its lanes (g), then the warps' (m, l, O) of
    // each row through shared memory: O [warps][kRows][kOPitch], m, l, flags [warps][kRows].
    float *mO, *mM, *mL;
    int* mBad;
    Base::template merge_buffers<kRows>(smem, mO, mM, mL, mBad);
#pragma unroll
    for (int u = 0; u < kCols; ++u) {
      const int n = u >> 1, e = u & 1;
      int nf = int(nonfinite[u]);
#pragma unroll
      for (int off = 4; off <= 16; off *= 2) {
        l[u] += __shfl_xor_sync(0xffffffffu, l[u], off);
        nf |= __shfl_xor_sync(0xffffffffu, nf, off);
      }
      const int col = 8 * n + 2 * t4 + e;
      float* row = mO + (warp * kRows + col) * kOPitch;
#pragma unroll
      for (int db = 0; db < kDB; ++db) {
        row[db * 16 + g] = o[n][db][e];
        row[db * 16 + 8 + g] = o[n][db][e + 2];
      }
      if (g == 0) {
        mM[warp * kRows + col] = m[u];
        mL[warp * kRows + col] = l[u];
        mBad[warp * kRows + col] = nf;
      }
    }
    __syncthreads();

    Base::template merge_rows<kRows>(p, smem, b, hk, split, row0, rows_total, tid);
  }
};

template <class Variant, class Element, int kHeadDim, class Tile, int kN8>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kSmem <= 80 * 1024 ? 2 : 1)
    decode_keys_kernel(const DecodeParams<Element, typename Variant::Params> p) {
  extern __shared__ __align__(16) char smem[];
  DecodeKeysKernel<Variant, Element, kHeadDim, Tile, kN8>::run(p, smem);
}

}  // namespace cuda
}  // namespace flashgen
