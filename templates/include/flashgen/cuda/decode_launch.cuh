// flashgen CUDA decode launcher (op.with_kvcache on the sm80 family; args.h FgKvCache): checks an
// FgFwdArgs decode call, then launches cuda/decode.cuh's append, attention (DecodeKernel, or
// cuda/decode_keys.cuh's DecodeKeysKernel for a DecodeKeysTile) and combine kernels on the
// caller's stream. Included by the decode unit (templates/cuda_decode.cu.jinja).
#pragma once
#include "flashgen/cuda/decode.cuh"
#include "flashgen/cuda/decode_keys.cuh"

namespace flashgen {
namespace cuda {

// Launches the combine: 4 warps per row from 8 splits on, else 1; on sm_90 and newer as a
// programmatic dependent launch (the kernel waits for the attention kernel's writes itself).
template <class Element, int kHeadDim, class P>
cudaError_t launch_combine(const P& p, cudaStream_t stream, bool dependent) {
  const bool wide = p.splits >= 8;
  auto kernel = wide ? decode_combine_kernel<Element, kHeadDim, 4, P> : decode_combine_kernel<Element, kHeadDim, 1, P>;
  const unsigned grid = unsigned(wide ? p.rows_all : (p.rows_all + 3) / 4);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(128);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// ------------------------------------------------------------------ host launcher

// The decode call of an FgFwdArgs whose kv_cache.seqlens is set (args.h): checks, then the
// append, attention and combine launches. FG_ERR_BAD_SHAPE for sizes out of range, block lists,
// dropout, packed batches, num_splits < 1, or num_splits > 1 without the workspaces;
// FG_ERR_ALIGNMENT for tensors the 16-byte copies cannot take.
template <class Variant, class Element, int kHeadDim, class Tile>
int launch_decode(const FgFwdArgs& a) {
  using K = DecodeKernel<Variant, Element, kHeadDim, Tile>;
  using P = DecodeParams<Element, typename Variant::Params>;
  detail::clear_error();
  detail::reference_hooks<Variant>();
  const FgKvCache& c = a.kv_cache;
  int st = detail::check_sizes(a, kHeadDim, false, true);
  if (st != FG_OK) return st;
  if (!c.seqlens && a.batch > 0) return detail::fail(FG_ERR_BAD_SHAPE, "decode: kv_cache.seqlens must be set");
  if (a.kv_blocks.data || a.cu_seqlens_q || a.cu_seqlens_k || a.dropout_state)
    return detail::fail(FG_ERR_BAD_SHAPE, "decode: no block lists, packed batches or dropout with a KV cache");
  if (c.capacity < 0 || c.capacity > FG_MAX_SEQLEN || c.capacity != a.seqlen_k || c.seqlen_new < 0 ||
      c.seqlen_new > c.capacity || (!c.k_new) != (!c.v_new))
    return detail::fail(FG_ERR_BAD_SHAPE, "decode: capacity %lld (seqlen_k %lld) or seqlen_new %lld out of range, "
                        "or k_new / v_new not given together", (long long)c.capacity, (long long)a.seqlen_k,
                        (long long)c.seqlen_new);
  if (c.block_table && (c.page_size < 1 || c.page_size > 256 || c.max_pages < 0 || c.block_table_stride < 0 ||
                        c.capacity != int64_t(c.page_size) * c.max_pages || (c.capacity > 0 && c.num_pages < 1)))
    return detail::fail(FG_ERR_BAD_SHAPE, "decode: page_size %d (1 to 256), max_pages %d, num_pages %lld do not "
                        "describe the capacity %lld", c.page_size, c.max_pages, (long long)c.num_pages,
                        (long long)c.capacity);
  const int64_t B = a.batch, Hq = a.heads_q, Hkv = a.heads_kv, Sq = a.seqlen_q;
  if (B == 0 || Hkv == 0) return FG_OK;
  const int64_t group = Hq / Hkv;
  // Query rows per attention CTA: DecodeKernel's 16; DecodeKeysKernel's 8 where the group's
  // rows fit (kN8 = 1), else 16 (kN8 = 2), but always 8 above d 128 (kN8 = 2 would keep 2 x 8
  // rows of Q^T and of O^T in registers: it spills at d 256). The host's split count (sm80.py
  // kv_splits) assumes 16-row tiles: the same CTA count up to 8 rows (and up to 16 at d <= 128).
  constexpr bool kEightOnly = Tile::kKeys && kHeadDim > 128;
  const int64_t tile_rows = Tile::kKeys && (kEightOnly || group * Sq <= 8) ? 8 : K::kRows;
  const int64_t m_tiles = (group * Sq + tile_rows - 1) / tile_rows;
  const int64_t splits = c.num_splits;
  if (splits < 1 || splits > 1024 || (splits > 1 && (!c.o_accum || !c.lse_accum)))
    return detail::fail(FG_ERR_BAD_SHAPE, "decode: num_splits %lld (1 to 1024; above 1 with both workspaces)",
                        (long long)splits);
  const int64_t grid = B * Hkv * m_tiles * splits;
  if (group * Sq > detail::kIntMax || grid > detail::kIntMax || B * Hq * Sq > detail::kIntMax)
    return detail::fail(FG_ERR_BAD_SHAPE, "decode: %lld x %lld query rows or %lld CTAs exceed 2^31",
                        (long long)group, (long long)Sq, (long long)grid);
  constexpr int64_t e16 = 16 / sizeof(Element);
  const bool pg = c.block_table != nullptr;
  const int64_t kb = pg ? c.num_pages : B, kn = pg ? c.page_size : c.capacity;
  if ((Sq > 0 && Hq > 0 &&
       (detail::bad_tensor(a.q, a.q_stride_b, a.q_stride_h, a.q_stride_n, B, Hq, Sq, e16) ||
        detail::bad_tensor(a.out, a.o_stride_b, a.o_stride_h, a.o_stride_n, B, Hq, Sq, e16) ||
        detail::misaligned4(a.lse))) ||
      detail::bad_tensor(a.k, a.k_stride_b, a.k_stride_h, a.k_stride_n, kb, Hkv, kn, e16) ||
      detail::bad_tensor(a.v, a.v_stride_b, a.v_stride_h, a.v_stride_n, kb, Hkv, kn, e16) ||
      (c.k_new && c.seqlen_new > 0 &&
       (detail::bad_tensor(c.k_new, c.kn_stride_b, c.kn_stride_h, c.kn_stride_n, B, Hkv, c.seqlen_new, e16) ||
        detail::bad_tensor(c.v_new, c.vn_stride_b, c.vn_stride_h, c.vn_stride_n, B, Hkv, c.seqlen_new, e16))) ||
      (splits > 1 && (detail::misaligned(c.o_accum) || detail::misaligned4(c.lse_accum))))
    return detail::fail_alignment("decode", e16);
  if ((Sq > 0 && Hq > 0 && (!a.q || !a.out || !a.lse)) || (c.capacity > 0 && (!a.k || !a.v)))
    return detail::fail(FG_ERR_BAD_SHAPE, "decode: null tensor pointers");

  P p{};
  p.q = static_cast<const Element*>(a.q);
  p.k = static_cast<const Element*>(a.k);
  p.v = static_cast<const Element*>(a.v);
  p.o = static_cast<Element*>(a.out);
  p.lse = a.lse;
  p.o_accum = c.o_accum;
  p.lse_accum = c.lse_accum;
  p.seqlens = c.seqlens;
  p.leftpad = c.leftpad;
  p.table = c.block_table;
  p.k_new = static_cast<const Element*>(c.k_new);
  p.v_new = static_cast<const Element*>(c.v_new);
  p.table_stride = c.block_table_stride;
  p.num_pages = c.num_pages;
  p.q_sb = a.q_stride_b, p.q_sh = a.q_stride_h, p.q_sn = a.q_stride_n;
  p.k_sb = a.k_stride_b, p.k_sh = a.k_stride_h, p.k_sn = a.k_stride_n;
  p.v_sb = a.v_stride_b, p.v_sh = a.v_stride_h, p.v_sn = a.v_stride_n;
  p.o_sb = a.o_stride_b, p.o_sh = a.o_stride_h, p.o_sn = a.o_stride_n;
  p.kn_sb = c.kn_stride_b, p.kn_sh = c.kn_stride_h, p.kn_sn = c.kn_stride_n;
  p.vn_sb = c.vn_stride_b, p.vn_sh = c.vn_stride_h, p.vn_sn = c.vn_stride_n;
  p.rows_all = B * Hq * Sq;
  p.batch = int(B), p.heads_q = int(Hq), p.heads_kv = int(Hkv), p.group = int(group), p.sq = int(Sq);
  p.page_size = pg ? c.page_size : 1;
  p.page_shift = -1;
  for (int sh = 0; sh <= 8; ++sh)
    if (p.page_size == 1 << sh) p.page_shift = sh;
  // Diagnostic switches, read per launch (A/B timings in one process, scripts/ab_paged_decode.py):
  // FLASHGEN_DECODE_ROW_LOOKUP=0: a paged cache's page looked up per 16-byte chunk, not per key row;
  // FLASHGEN_DECODE_HEADS_FIRST=0 / 1: the grid's split-major / head-major order for every cache
  // (unset: head-major for paged caches, split-major for contiguous ones).
  const char* rows_env = getenv("FLASHGEN_DECODE_ROW_LOOKUP");
  const char* order_env = getenv("FLASHGEN_DECODE_HEADS_FIRST");
  p.row_lookup = !(rows_env && rows_env[0] == '0');
  p.heads_first = order_env && order_env[0] ? order_env[0] != '0' : pg;
  p.capacity = int(c.capacity);
  p.seqlen_new = c.k_new ? int(c.seqlen_new) : 0;
  p.splits = int(splits);
  p.m_tiles = int(m_tiles);
  p.scale = a.scale;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  detail::copy_variant_params(p.vp, a.params);

  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  if (p.seqlen_new > 0) {
    decode_append_kernel<Element, kHeadDim, P><<<unsigned(B), 128, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "decode append launch", err);
  }
  if (Sq == 0 || Hq == 0) return FG_OK;
  int dev = 0;
  cudaGetDevice(&dev);
  if constexpr (Tile::kKeys) {
    static std::atomic<uint64_t> configured8{0}, configured16{0};
    const bool eight = tile_rows == 8;
    auto kernel = eight ? decode_keys_kernel<Variant, Element, kHeadDim, Tile, 1>
                        : decode_keys_kernel<Variant, Element, kHeadDim, Tile, kEightOnly ? 1 : 2>;
    st = detail::ensure_smem(kernel, Tile::kSmem, eight ? configured8 : configured16, dev, "decode kernel");
    if (st != FG_OK) return st;
    kernel<<<unsigned(grid), Tile::kThreads, Tile::kSmem, stream>>>(p);
  } else {
    static std::atomic<uint64_t> configured{0};
    auto kernel = decode_kernel<Variant, Element, kHeadDim, Tile>;
    st = detail::ensure_smem(kernel, K::kSmem, configured, dev, "decode kernel");
    if (st != FG_OK) return st;
    kernel<<<unsigned(grid), K::kThreads, K::kSmem, stream>>>(p);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "decode launch", err);
  if (splits > 1) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    const char* pdl_env = getenv("FLASHGEN_DECODE_PDL");  // =0: a plain launch (diagnostic switch)
    err = launch_combine<Element, kHeadDim>(p, stream, major >= 9 && !(pdl_env && pdl_env[0] == '0'));
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess) return detail::fail_cuda(FG_ERR_LAUNCH, "decode combine launch", err);
  }
  return FG_OK;
}

}  // namespace cuda
}  // namespace flashgen
