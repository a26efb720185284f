// flashgen CPU work layer, shared by the forward and backward drivers: 64-byte aligned scratch,
// the packed (varlen) batch layout (Seqs), the longest-first task order, and reading block
// lists (args.h, "Block sparsity").
#pragma once

#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <new>
#include <vector>

#include "flashgen/args.h"

namespace flashgen {
namespace cpu {
namespace detail {

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

// Block lists (args.h, "Block sparsity"). blocks_ok: data null, or tile sizes
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

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen
