// flashgen kernel ABI: the argument blocks the generated forward and backward entry points take.
//
// Shared by the CPU and CUDA kernel families. Plain C layout (no torch headers) so that
// the Python side can fill it through ctypes and kernel translation units compile
// standalone. Bump FG_ABI_VERSION whenever a field changes.
#pragma once
#include <stdint.h>

#define FG_ABI_VERSION 10

#ifdef __cplusplus
extern "C" {
#endif

// Dropout on P (FlashAttention's fused dropout, Alg. 2 and 4), read only by variants with
// kHasDropout (the spec declares `dropout`). dropout_state null: no dropout. Otherwise it points
// to {seed, offset}, two int64 (bit patterns of uint64) on the inputs' device -- a device read,
// so nothing syncs the host and a captured CUDA graph replays with the values of each replay.
// Element (b, h, q, kv) (h the query head, absolute positions) is kept iff
// fg_dropout_keep(seed, offset, b * heads_q + h, q, kv, dropout_threshold) (philox.h), and
// kept probabilities are multiplied by dropout_scale; the softmax statistics (m, l, lse) are
// those of the undropped P. The host computes threshold = round(p * 2^16) (an element is kept
// iff its 16-bit half of a Philox word is >= threshold) and scale = 1 / (1 - p)
// (flashgen/philox.py), so every family uses the same integers.
// The op refuses dropout_p > 0 before any launch on a family that does not apply it yet
// (flashgen.ops.DROPOUT_BACKENDS).

// Packed (varlen) batches, the last fields of both blocks (flash_attn's varlen layout).
// cu_seqlens_q null: the padded layout described below, total_q and total_k unused (0).
// cu_seqlens_q set (and then cu_seqlens_k too): q [total_q, Hq, d], k/v [total_k, Hkv, d], out
// like q; cu_seqlens_q and cu_seqlens_k are int32 [batch + 1] on the inputs' device, starting at
// 0, non-decreasing, ending at total_q and total_k (the host checks this before any launch).
//   * batch is the number of sequences; sequence b has length_q = cu_seqlens_q[b + 1] -
//     cu_seqlens_q[b] queries and length_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys.
//   * seqlen_q / seqlen_k hold max_seqlen_q / max_seqlen_k: an upper bound on every sequence's
//     length_q / length_k. Kernels may size grids and loops by them, but masks, hooks and
//     bounds use each sequence's true lengths (the hooks' seqlen_q / seqlen_k arguments are
//     length_q / length_k; their b is the sequence index; q and kv count from the sequence's
//     start).
//   * *_stride_b are 0 and ignored. Position i of sequence b is row cu_seqlens_*[b] + i: its
//     element of head h is at (cu_seqlens_*[b] + i) * *_stride_n + h * *_stride_h from the base
//     pointer (q, k, v, out, dout, dq, dk, dv alike).
//   * Every fp32 per-row buffer that is [B, H, N(, d)] contiguous in the padded layout is
//     [H, total(, d)] contiguous here, sequence b's rows starting at cu_seqlens_*[b] (the padded
//     formula with B = 1, N = total and a row offset of cu_seqlens_*[b]): lse, dlse and
//     softmax_d [Hq, total_q]; dq_accum [Hq, total_q, d]; dk_accum, dv_accum [Hkv, total_k, d].
//   * A sequence with length_k == 0 writes out rows 0 and lse -inf; keys of a sequence with
//     length_q == 0 (or that no query sees) get dk = dv = 0. Dropout keys the mask by the
//     sequence index b and the per-sequence positions q, kv.
//   * seqlen_q, seqlen_k <= FG_MAX_SEQLEN as in the padded layout; total_q and total_k fit
//     cu_seqlens' int32, so row offsets need 64-bit arithmetic only when multiplied by strides.
// The op refuses cu_seqlens_q before any launch on a family that does not take packed batches
// yet (flashgen.ops.VARLEN_BACKENDS).

// Forward pass: out = softmax(mods(scale * q k^T), masked) v, lse = logsumexp of the same row.
// Layout (PyTorch SDPA's): q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d], out like q; strides are in
// elements, the last dim is contiguous (stride 1). lse is fp32, natural log, contiguous
// [B, Hq, Nq]; -inf for a row that sees no key (whose out row is 0).
// Block sparsity (block_mask=; the paper's block-sparse FlashAttention, Dao et al. 2022, Sec. 3.3),
// the last fields of both blocks. An FgBlockLists with data == null: no block lists (the kernels
// visit every tile of the variant's closed-form [kv_lo, kv_hi) range, as before). Otherwise it
// lists, for each tile row of each (batch b, query head h), the tiles of that row to visit:
//   row r of (b, h) starts at data + b * stride_b + h * stride_h + r * (2 + cols) and holds
//   [n_partial, n_full, idx_0, ..., idx_{cols-1}]: idx_0 .. idx_{n_partial-1} are the partial
//   tiles (apply the element mask), idx_{n_partial} .. idx_{n_partial+n_full-1} the full tiles
//   (the block lists say every element is kept; the variant's own mask, bounds and tile_full
//   still apply, as on any tile); the rest is unused. Indices are distinct, in [0, cols).
//   stride_b / stride_h are 0 when the lists are shared by all batch entries / heads.
//   rows x cols tiles of block_r x block_c elements: kv lists (FgFwdArgs::kv_blocks,
//   FgBwdArgs::kv_blocks) have a row per query tile (block_r queries) listing key tiles
//   (block_c keys); q lists (FgBwdArgs::q_blocks, the transpose) a row per key tile (block_r
//   keys) listing query tiles (block_c queries).
// The block lists are the authority on which tiles are visited: a tile they leave out is never
// loaded, even when the variant's mask would keep some of its elements; a row with no tile writes
// out 0 and lse -inf. CUDA kernels take lists whose tile size equals their own (else
// FG_ERR_BAD_SHAPE); CPU kernels use block_r x block_c as their tiles. Packed layout: b is the
// sequence and tiles count from the sequence's start. The host builds the lists on the inputs'
// device (flashgen.BlockMask), so a call reads no value of them on the host.
typedef struct FgBlockLists {
  const int32_t* data;
  int64_t stride_b, stride_h;  // in int32 elements
  int32_t rows, cols;
  int32_t block_r, block_c;
  int32_t full_kept;  // 1: the lists come from the variant's own mask (flashgen.block_mask), so
                      // a full tile keeps every element under it and kernels may skip keep()
                      // there; 0: full only means the block pattern keeps the whole tile
} FgBlockLists;

// Block classification of a variant's mask (flashgen.block_mask and the kernels' own block lists;
// exported by CUDA "mask" instantiations as fg_<spec>_mask_<dtype>(const FgClassifyArgs*)):
// out[((b * heads + h) * rows + r) * cols + c] = 0 when no element of block (r, c) of (batch b,
// query head h) is kept, 2 when every in-bounds element is, 1 otherwise; blocks are block_r
// queries x block_c keys, rows = ceil(seqlen_q / block_r), cols = ceil(seqlen_k / block_c).
// batch / heads are the extents evaluated (pass 1 for a dim the mask does not depend on: b or h
// is then 0). Packed layout (cu_seqlens_q set): b is the sequence, blocks count from its start,
// and the hooks see its own lengths (blocks past its end are 0). Out-of-bounds elements count
// neither way. Launched on `stream`, no host synchronisation.
typedef struct FgClassifyArgs {
  int8_t* out;
  int64_t batch, heads, seqlen_q, seqlen_k;
  int32_t block_r, block_c, rows, cols;
  const int32_t* cu_seqlens_q;  // null: padded layout
  const int32_t* cu_seqlens_k;
  const void* params;           // the variant's Params (may be null when it is empty)
  void* stream;
} FgClassifyArgs;

// Decoding with a KV cache (op.with_kvcache), the last field of FgFwdArgs. seqlens null: an
// ordinary forward (the layouts above). seqlens set: q [B, Hq, Sq, d] holds the last Sq queries
// of each sequence (seqlen_q = Sq) and k / v are the cache, seqlen_k its capacity (slots per
// sequence):
//   * contiguous (block_table null): k/v [B, Hkv, capacity, d] with the usual strides;
//   * paged (block_table set): k/v [num_pages, page_size, Hkv, d]; *_stride_b is the page stride,
//     *_stride_n the slot stride within a page, *_stride_h the head stride; slot s of sequence b
//     lives in page block_table[b * block_table_stride + s / page_size], row s % page_size;
//     capacity = max_pages * page_size.
// Sequence b holds n = seqlens[b] cached keys in slots [pad, n) (pad = leftpad[b], 0 when leftpad
// is null), then k_new / v_new (nullable, [B, Hkv, seqlen_new, d]) are written into slots
// [n, n + seqlen_new) before attention; its length is L = n + seqlen_new - pad and key j (a
// position in [0, L)) is slot pad + j. Query row i is position L - Sq + i: the kernels compute
// exactly the last Sq rows of the prefill call on the whole sequence (hooks see seqlen_q =
// seqlen_k = L and absolute positions). A row whose position is negative (Sq > L) gets out 0
// and lse -inf. The values of seqlens, leftpad and block_table live on the device and are never
// trusted: a sequence with n < 0, pad < 0, pad > n, n + seqlen_new > capacity or a page index
// of a slot in [pad, n + seqlen_new) outside [0, num_pages) writes nothing into the cache and
// gets out and lse NaN (every index is clamped: nothing is read or written out of bounds).
// Without block lists, dropout or packed batches (FG_ERR_BAD_SHAPE otherwise). Families without
// decode kernels refuse seqlens set with FG_ERR_BAD_SHAPE.
// Split-KV (the CUDA decode kernels, cuda/decode.cuh; the CPU family ignores these fields):
// num_splits >= 1 is the host's per-call split count (1: out and lse written directly); above 1,
// o_accum (fp32 [num_splits, batch, heads_q, seqlen_q, head_dim] contiguous) and lse_accum (fp32
// [num_splits, batch, heads_q, seqlen_q] contiguous) are workspaces the host allocates per call,
// which the kernels fully write before reading (no zeroing needed).
typedef struct FgKvCache {
  const int32_t* seqlens;      // int32 [batch], inputs' device; null: no KV cache
  const int32_t* leftpad;      // nullable int32 [batch]
  const int32_t* block_table;  // null: contiguous cache; paged: int32 [batch, max_pages]
  int64_t block_table_stride;  // elements between rows of block_table
  int64_t num_pages;
  int32_t page_size, max_pages;
  int64_t capacity;
  const void* k_new;           // nullable (then v_new too): nothing is appended
  const void* v_new;
  int64_t seqlen_new;
  int64_t kn_stride_b, kn_stride_h, kn_stride_n;
  int64_t vn_stride_b, vn_stride_h, vn_stride_n;
  int32_t num_splits;          // split-KV count (CUDA); see above
  int32_t reserved;            // 0
  float* o_accum;              // num_splits > 1: the partial outputs' workspace
  float* lse_accum;            // num_splits > 1: the partial LSEs' workspace
} FgKvCache;

// Dynamic tile scheduling (the sm90 forward on packed batches), the last field of FgFwdArgs.
// counter null: the kernel's static schedule (every other family and layout ignores the field).
// Otherwise counter points to one int32 on the inputs' device, zero at launch (the host
// allocates it per call, so concurrent calls and graph replays each start from 0), and order
// lists the work items as the kernel's work index enumerates them (sm90/fwd.cuh, ``coord``),
// ranked by descending cost: entry r is the index of the r-th item to run, or -1 past the last
// real item; the table has as many entries as the kernel's work index has values
// (heads_q * (batch + total_q / block_m) for a packed batch), so every rank the kernel can ask
// for is inside it. A CTA takes rank atomicAdd(counter, 1) until it draws -1 or a rank past
// the table. Each listed index appears once; the host builds the table once per cu_seqlens
// layout (flashgen/families/sm90_schedule.py).
typedef struct FgWorkQueue {
  int32_t* counter;
  const int32_t* order;
} FgWorkQueue;

typedef struct FgFwdArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int64_t q_stride_b, q_stride_h, q_stride_n;
  int64_t k_stride_b, k_stride_h, k_stride_n;
  int64_t v_stride_b, v_stride_h, v_stride_n;
  int64_t o_stride_b, o_stride_h, o_stride_n;
  float scale;         // softmax scale, natural units (the kernel folds log2(e) in itself)
  int32_t num_sms;     // CUDA: multiprocessor count of the device (0 if unknown); CPU: unused
  void* stream;        // CUDA: cudaStream_t to launch on; CPU: unused
  const void* params;  // the variant's generated Params struct (may be null when it is empty)
  const int64_t* dropout_state;  // nullable: int64[2] {seed, offset}; see "Dropout" above
  uint32_t dropout_threshold;     // keep iff the element's 16-bit Philox half >= threshold
  float dropout_scale;            // 1 / (1 - p)
  const int32_t* cu_seqlens_q;    // null: padded layout; packed: int32 [batch + 1], inputs' device
  const int32_t* cu_seqlens_k;    // set iff cu_seqlens_q is set
  int64_t total_q, total_k;       // packed: the token counts (cu_seqlens_*[batch]); padded: 0
  FgBlockLists kv_blocks;         // block sparsity (see above); data null: none
  // Decided per call by the host (the kernel family's module in flashgen/families), read here:
  // CPU: the tiles, tile_q query rows x tile_kv keys (flashgen/families/cpu_tiles.py; block
  // lists: tile_q = kv_blocks.block_r, tile_kv a multiple of kv_blocks.block_c); 0 is refused
  // with FG_ERR_BAD_SHAPE (cpu/tiles.h). CUDA: unused (the tiles are the instantiation's).
  int32_t tile_q, tile_kv;
  FgKvCache kv_cache;             // decoding with a KV cache (see above); seqlens null: none
  FgWorkQueue work;               // dynamic tile scheduling (see above); counter null: static
} FgFwdArgs;

// Backward pass (recomputation, FlashAttention-2 Alg. 2): from q, k, v, out, dout and the saved
// lse, write dq [like q], dk, dv [like k/v]. Nothing else is saved by the forward.
//   D = rowsum(dout ∘ out); P = exp(scale·q kᵀ (masked) − lse); dV = Pᵀ dO; dP = dO Vᵀ;
//   dS = P ∘ (dP − D); dQ = scale · dS K; dK = scale · dSᵀ Q.
// GQA: dk/dv of a kv head are the sums over its query heads (h // (heads_q / heads_kv)).
// Workspaces are allocated by the caller (the Python side) and zero-filled where noted:
//   dq_accum: fp32 [B, Hq, Nq, d] contiguous, zeroed (dQ accumulation across K/V tiles);
//   softmax_d: fp32 [B, Hq, Nq] contiguous (D; the kernel writes it);
//   dk_accum, dv_accum: fp32 [B, Hkv, Nk, d] contiguous, zeroed; used when heads_q != heads_kv
//     (each query head adds its share) -- the entry point then converts them into dk, dv.
// deterministic != 0: bitwise-repeatable results (no order-dependent floating-point atomics).
// Rows that see no key (lse == -inf) get dq = 0 and contribute nothing.
// dlse (nullable, fp32 [B, Hq, Nq] contiguous): the gradient flowing into the returned lse; since
// d lse_i / d s_ij = P_ij, it enters as D_i = rowsum(dout_i ∘ out_i) − dlse_i.
typedef struct FgBwdArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  const float* lse;
  void* dq;
  void* dk;
  void* dv;
  float* dq_accum;
  float* softmax_d;
  float* dk_accum;
  float* dv_accum;
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int64_t q_stride_b, q_stride_h, q_stride_n;
  int64_t k_stride_b, k_stride_h, k_stride_n;
  int64_t v_stride_b, v_stride_h, v_stride_n;
  int64_t o_stride_b, o_stride_h, o_stride_n;
  int64_t do_stride_b, do_stride_h, do_stride_n;
  int64_t dq_stride_b, dq_stride_h, dq_stride_n;
  int64_t dk_stride_b, dk_stride_h, dk_stride_n;
  int64_t dv_stride_b, dv_stride_h, dv_stride_n;
  float scale;
  int32_t num_sms;
  int32_t deterministic;
  void* stream;
  const void* params;
  const float* dlse;  // nullable; see above
  // The forward's dropout values: the backward regenerates the same keep mask from them.
  const int64_t* dropout_state;
  uint32_t dropout_threshold;
  float dropout_scale;
  // Packed (varlen) batches, as in FgFwdArgs (see "Packed (varlen) batches" above).
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int64_t total_q, total_k;
  // Block sparsity, as in FgFwdArgs: q lists for the key-tile-major pass, kv lists for a
  // query-tile-major pass (CUDA's deterministic dQ kernel); data null: none.
  FgBlockLists q_blocks;
  FgBlockLists kv_blocks;
  // Decided per call by the host (the kernel family's module in flashgen/families), read here:
  // CPU: the tiles, tile_q query rows per step x tile_kv keys (flashgen/families/cpu_tiles.py;
  // block lists: tile_q = q_blocks.block_c, tile_kv = q_blocks.block_r); 0 is refused with
  // FG_ERR_BAD_SHAPE (cpu/tiles.h). CUDA: unused.
  int32_t tile_q, tile_kv;
  // CUDA: the GQA split, how many CTAs share the query heads of a kv head's group
  // (flashgen/families/sm80.py gqa_splits); it must be >= 1 and divide heads_q / heads_kv, else
  // FG_ERR_BAD_SHAPE. Taken only on the non-deterministic path with the dk/dv workspaces (cuda/
  // bwd.cuh); otherwise one CTA serves the whole group. CPU: unused.
  int32_t gqa_splits;
  // CUDA, the sm90 backward's deterministic mode: int32 zeros, one per query row in lse's layout
  // ([batch, heads_q, seqlen_q], packed [heads_q, total_q]), allocated per call; the entry of a
  // query tile's first row orders the key tiles' dQ adds (sm90/bwd.cuh). Null when not
  // deterministic; sm80 and the CPU ignore it.
  int32_t* dq_semaphore;
} FgBwdArgs;

// Status codes returned by entry points (0 = launched / done).
enum FgStatus {
  FG_OK = 0,
  FG_ERR_BAD_HEAD_DIM = 1,    // head_dim differs from the instantiation's
  FG_ERR_LAUNCH = 2,          // the launch failed; fg_*_error() names the CUDA error
  FG_ERR_SMEM_ATTR = 3,       // raising the dynamic shared-memory limit failed
  FG_ERR_ALIGNMENT = 4,       // a base pointer is not 16-byte aligned or a used stride is not a
                              // multiple of 16 bytes (CUDA); pass contiguous tensors instead
  FG_ERR_BAD_SHAPE = 5,       // negative/too-large sizes, heads_q % heads_kv != 0, null pointers
};

#ifdef __cplusplus
}
#endif
