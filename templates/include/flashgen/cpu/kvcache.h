// flashgen CPU KV-cache layer (args.h, FgKvCache; op.with_kvcache): which sequences of a decode
// call are valid, appending k_new / v_new into the cache, and reading the rows of a paged cache.
// The forward driver (cpu/fwd.h, fwd_kvcache) runs on top of it.
//
// Nothing read from the device-side arrays (seqlens, leftpad, block_table) is trusted: a sequence
// whose values are out of range is marked invalid (no cache writes, out and lse NaN), and page
// indices are clamped into the pool wherever they are used, so no value makes the kernels touch
// memory outside the tensors.
#pragma once

#include <stdint.h>
#include <string.h>

#include <vector>

#include "flashgen/args.h"

namespace flashgen {
namespace cpu {
namespace detail {

// Sequence b of a decode call: valid, its first slot (the left padding) and its length L.
struct KvSeq {
  bool ok;
  int64_t pad, len;
};

static inline int64_t kv_page(const FgKvCache& c, int64_t b, int64_t slot) {
  const int64_t p = c.block_table[b * c.block_table_stride + slot / c.page_size];
  return p < 0 ? 0 : (p >= c.num_pages ? c.num_pages - 1 : p);
}

// The sequences of a decode call (args.h, FgKvCache): n = seqlens[b], pad = leftpad[b] (or 0);
// valid iff 0 <= pad <= n, n + seqlen_new <= capacity and (paged) every page of the slots
// [pad, n + seqlen_new) lies in [0, num_pages).
static inline void kv_seqs(const FgKvCache& c, int64_t batch, std::vector<KvSeq>& out) {
  out.assign(batch, KvSeq{false, 0, 0});
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = c.seqlens[b], pad = c.leftpad ? c.leftpad[b] : 0;
    const int64_t end = n + c.seqlen_new;
    bool ok = pad >= 0 && pad <= n && end <= c.capacity;
    if (ok && c.block_table && end > pad) {
      for (int64_t pg = pad / c.page_size; pg <= (end - 1) / c.page_size; ++pg) {
        const int64_t p = c.block_table[b * c.block_table_stride + pg];
        if (p < 0 || p >= c.num_pages) {
          ok = false;
          break;
        }
      }
    }
    out[b] = KvSeq{ok, ok ? pad : 0, ok ? end - pad : 0};
  }
}

// Writes k_new / v_new of the valid sequences into their slots [n, n + seqlen_new) (before any
// attention reads the cache). One thread: a decode step appends a few rows per sequence, less
// than a parallel region costs.
template <class T>
static inline void kv_append(const FgFwdArgs& a, const std::vector<KvSeq>& seqs) {
  const FgKvCache& c = a.kv_cache;
  if (!c.k_new || c.seqlen_new <= 0) return;
  const int64_t Hkv = a.heads_kv, d = a.head_dim, Sn = c.seqlen_new;
  T* K = static_cast<T*>(const_cast<void*>(a.k));
  T* V = static_cast<T*>(const_cast<void*>(a.v));
  const T* Kn = static_cast<const T*>(c.k_new);
  const T* Vn = static_cast<const T*>(c.v_new);
  for (int64_t i = 0; i < a.batch * Hkv; ++i) {
    const int64_t b = i / Hkv, h = i % Hkv;
    if (!seqs[b].ok) continue;
    const int64_t n = c.seqlens[b];
    for (int64_t j = 0; j < Sn; ++j) {
      const int64_t slot = n + j;
      int64_t ko, vo;
      if (c.block_table) {
        const int64_t p = kv_page(c, b, slot), r = slot % c.page_size;
        ko = p * a.k_stride_b + h * a.k_stride_h + r * a.k_stride_n;
        vo = p * a.v_stride_b + h * a.v_stride_h + r * a.v_stride_n;
      } else {
        ko = b * a.k_stride_b + h * a.k_stride_h + slot * a.k_stride_n;
        vo = b * a.v_stride_b + h * a.v_stride_h + slot * a.v_stride_n;
      }
      memcpy(K + ko, Kn + b * c.kn_stride_b + h * c.kn_stride_h + j * c.kn_stride_n, sizeof(T) * d);
      memcpy(V + vo, Vn + b * c.vn_stride_b + h * c.vn_stride_h + j * c.vn_stride_n, sizeof(T) * d);
    }
  }
}

// The keys of one (sequence, kv head) of a paged cache: key j is slot pad + j. rows() points at
// keys [j0, j0 + n) as rows of stride ld: in place when they lie in one page, else gathered into
// buf (n x d elements).
template <class T>
struct PagedRows {
  const FgKvCache* c;
  int64_t b, pad, d;
  const T* base;  // the cache at page 0 of this kv head
  int64_t page_stride, row_stride;
  void rows(int64_t j0, int64_t n, T* buf, const T*& out, int64_t& ld) const {
    const int64_t s0 = pad + j0, ps = c->page_size;
    if (s0 / ps == (s0 + n - 1) / ps) {
      out = base + kv_page(*c, b, s0) * page_stride + (s0 % ps) * row_stride;
      ld = row_stride;
      return;
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = s0 + j;
      memcpy(buf + j * d, base + kv_page(*c, b, s) * page_stride + (s % ps) * row_stride,
             sizeof(T) * d);
    }
    out = buf;
    ld = d;
  }
};

}  // namespace detail
}  // namespace cpu
}  // namespace flashgen
