// flashgen CUDA work schedulers: how a CTA finds its work items. Owns the persistent grid loop
// (a 1-D grid; CTA x handles items x, x + gridDim.x, ... while they last), the decoding of a
// work index into its coordinates, and what an item covers besides them: its sequence's rows
// (packed batches, args.h) and its row of block lists (block sparsity, args.h). The mainloops
// (mainloop.cuh) and epilogues (epilogue.cuh) take decoded items and never see the grid.
//
//   QTileScheduler  items (query tile, query head, batch): the forward and the dQ kernel
//   KTileScheduler  items (key tile, GQA split, kv head, batch): the backward's main kernel
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "flashgen/cuda/ptx.cuh"
#include "flashgen/variant.h"

namespace flashgen {
namespace cuda {

// Widen a non-negative index to 64 bits by zero extension (the compiler then keeps no register
// for the high half; every index passed here is >= 0).
__device__ __forceinline__ int64_t wide(int x) { return int64_t(uint32_t(x)); }

// One sequence's rows (args.h, "Packed (varlen) batches"): its first query and key row (q0, k0)
// and its lengths. Padded layout (cu_q null): 0, 0 and the batch's seqlen_q, seqlen_k. Packed:
// from cu_seqlens_q / cu_seqlens_k, whose values the host checked before the launch.
struct SeqSpan {
  int q0, k0, len_q, len_k;
};
__device__ __forceinline__ SeqSpan seq_span(const int* cu_q, const int* cu_k, int b, int seqlen_q,
                                            int seqlen_k) {
  if (cu_q == nullptr) return SeqSpan{0, 0, seqlen_q, seqlen_k};
  const int q0 = __ldg(cu_q + b), k0 = __ldg(cu_k + b);
  return SeqSpan{q0, k0, __ldg(cu_q + b + 1) - q0, __ldg(cu_k + b + 1) - k0};
}

// Block sparsity (args.h, FgBlockLists) as the kernels read it: kSparse instantiations visit, per
// tile row, only the listed tiles (partial ones first), in list order.
struct BlockLists {
  const int* data;
  int64_t sb, sh;  // int32 elements between batch entries / query heads (0: shared)
  int cols;
  int full_kept;  // 1: a listed-full tile keeps every element under the variant's mask too
};
struct BlockRow {
  const int* idx;  // tile indices: [0, n_part) partial, [n_part, n_all) full
  int n_part, n_all;
};
__device__ __forceinline__ BlockRow block_row(const BlockLists& l, int b, int h, int r) {
  const int* row = l.data + wide(b) * l.sb + wide(h) * l.sh + wide(r) * (l.cols + 2);
  BlockRow br;
  br.n_part = imin(imax(__ldg(row), 0), l.cols);
  br.n_all = br.n_part + imin(imax(__ldg(row + 1), 0), l.cols - br.n_part);
  br.idx = row + 2;
  return br;
}

// The persistent loop of every kernel: a 1-D grid never hits the 65535 limit of gridDim.y/z; if
// there are more work items than gridDim.x allows, CTAs loop, `iter` counting their items:
//   for (int iter = 0; int64_t(blockIdx.x) + int64_t(iter) * gridDim.x < total_work; ++iter)
// with a barrier between two items (shared memory is then free). The condition is spelled out in
// each kernel's run(), not called through a helper: that way nvcc widens iter to one 64-bit
// induction variable shared with decode(), as it did before the roles were split.

// Work items numbered query-tile fastest (CTAs of one head run together and share its K/V in
// L2), heaviest query tile first within a head (better tail balance under causal masks).
struct QTileScheduler {
  struct Item {
    int b, h, m_tile;
  };
  static __device__ __forceinline__ Item decode(int num_m_tiles, int heads_q, int iter) {
    return decode_index(num_m_tiles, heads_q, int64_t(ptx::ctaid_x()) + int64_t(iter) * ptx::nctaid_x());
  }
  // The coordinates of work index w (>= 0).
  static __device__ __forceinline__ Item decode_index(int num_m_tiles, int heads_q, int64_t w) {
    const int64_t bh = w / num_m_tiles;
    Item it;
    it.m_tile = num_m_tiles - 1 - int(w - bh * num_m_tiles);
    it.h = int(bh % heads_q);
    it.b = int(bh / heads_q);
    return it;
  }
};

// Work items numbered key tile fastest (CTAs of one head run together and share its Q/dO in L2),
// lowest key tile first (the heaviest under causal / bottom-aligned masks), then the share of the
// GQA group (split), the kv head and the batch.
struct KTileScheduler {
  struct Item {
    int n_tile, split, hkv, b;
  };
  static __device__ __forceinline__ Item decode(int num_n_tiles, int num_splits, int heads_kv,
                                                int iter) {
    int64_t w = int64_t(ptx::ctaid_x()) + int64_t(iter) * ptx::nctaid_x();
    Item it;
    int64_t r = w / num_n_tiles;
    it.n_tile = int(w - r * num_n_tiles);
    w = r;
    r = w / num_splits;
    it.split = int(w - r * num_splits);
    w = r;
    r = w / heads_kv;
    it.hkv = int(w - r * heads_kv);
    it.b = int(r);
    return it;
  }
  // First query head of the item's share of its GQA group (heads_per_split heads).
  static __device__ __forceinline__ int first_head(const Item& it, int group, int heads_per_split) {
    return it.hkv * group + it.split * heads_per_split;
  }
};

}  // namespace cuda
}  // namespace flashgen
