// flashgen sm90 host side: tensor maps for the tensor memory accelerator (TMA).
//
// A tensor map describes a [batch, heads, rows, d] tensor (strides in elements, the last dim
// contiguous) as a 4-d tensor {d, rows, heads, batch} (innermost first) read in boxes of
// 64 x box_rows x 1 x 1 elements with the 128-byte swizzle: one box is one 64-column panel of a
// tile, laid out in shared memory as the wgmma descriptors of sm90/ptx.cuh expect (rows of
// 128 bytes, 8-row atoms of 1024 bytes). Elements outside the tensor (rows >= rows, columns >= d)
// are written as zeros, so tiles cut by seqlen or a head dim below a multiple of 64 need no
// predicates. cuTensorMapEncodeTiled is a driver function: it is looked up once through the
// runtime (cudaGetDriverEntryPointByVersion), so nothing links against libcuda.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "flashgen/cuda/status.cuh"

namespace flashgen {
namespace sm90 {
namespace detail {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled() {
  static std::atomic<EncodeTiledFn> fn{nullptr};
  EncodeTiledFn f = fn.load(std::memory_order_acquire);
  if (f) return f;
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                           cudaEnableDefault, &q);
  if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || !ptr) {
    cudaGetLastError();
    return nullptr;
  }
  f = reinterpret_cast<EncodeTiledFn>(ptr);
  fn.store(f, std::memory_order_release);
  return f;
}

inline int no_encode() {
  return cuda::detail::fail(FG_ERR_LAUNCH, "cuTensorMapEncodeTiled is not available from the "
                                           "CUDA driver (the sm90 kernels need a CUDA 12+ driver)");
}

// A stride of a dimension with one index is never used; the TMA unit still wants a multiple of
// 16 bytes below 2^40, so such a stride is replaced by the dense one.
inline uint64_t used_stride(int64_t stride, int64_t extent, uint64_t dense) {
  return extent > 1 ? uint64_t(stride) : dense;
}

// The map of `ptr` viewed as [batch, heads, rows, d] of 2-byte elements with element strides
// sb, sh, sn; boxes of 64 x box_rows. Returns an FgStatus (FG_ERR_ALIGNMENT with a reason when the
// TMA unit cannot describe the tensor).
inline int make_tmap(CUtensorMap* map, const void* ptr, bool bf16, int64_t batch, int64_t heads,
                     int64_t rows, int64_t d, int64_t sb, int64_t sh, int64_t sn, int box_rows,
                     const char* what) {
  const EncodeTiledFn encode = encode_tiled();
  if (!encode) return no_encode();
  const int64_t b = batch > 0 ? batch : 1, h = heads > 0 ? heads : 1, n = rows > 0 ? rows : 1;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(n), cuuint64_t(h), cuuint64_t(b)};
  const uint64_t s_n = used_stride(sn, n, uint64_t(d)) * 2;
  const uint64_t s_h = used_stride(sh, h, uint64_t(n) * s_n / 2) * 2;
  const uint64_t s_b = used_stride(sb, b, uint64_t(h) * s_h / 2) * 2;
  const cuuint64_t strides[3] = {s_n, s_h, s_b};  // bytes, dims 1..3
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  const bool bad_stride = sn < 0 || sh < 0 || sb < 0;
  const CUresult r =
      bad_stride ? CUDA_ERROR_INVALID_VALUE
                 : encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                          4, const_cast<void*>(ptr), dims, strides, box, estr,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return cuda::detail::fail(
        FG_ERR_ALIGNMENT,
        "%s: the sm90 kernels read it through a TMA tensor map, which cannot describe strides "
        "(batch %lld, head %lld, row %lld elements; error %d): pass a contiguous tensor",
        what, (long long)sb, (long long)sh, (long long)sn, int(r));
  }
  return FG_OK;
}

// The backward's dQ workspace (fp32 [batch, heads, rows, d], dense) as a 4-d map read in boxes
// of 32 columns (128 bytes, the 128-byte swizzle's row) x 64 rows: the target of the dQ writer's
// tensor reduce-adds (sm90/bwd.cuh). Rows >= rows are outside the tensor and not touched.
inline int make_tmap_dq(CUtensorMap* map, const float* ptr, int64_t batch, int64_t heads, int64_t rows, int64_t d) {
  const EncodeTiledFn encode = encode_tiled();
  if (!encode) return no_encode();
  const int64_t b = batch > 0 ? batch : 1, h = heads > 0 ? heads : 1, n = rows > 0 ? rows : 1;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(n), cuuint64_t(h), cuuint64_t(b)};
  const cuuint64_t strides[3] = {cuuint64_t(d) * 4, cuuint64_t(n * d) * 4, cuuint64_t(h * n * d) * 4};
  const cuuint32_t box[4] = {32, 64, 1, 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, const_cast<float*>(ptr), dims, strides, box,
                            estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return cuda::detail::fail(FG_ERR_ALIGNMENT, "dq_accum: the sm90 backward's dQ tensor map failed (error %d)",
                              int(r));
  }
  return FG_OK;
}

}  // namespace detail
}  // namespace sm90
}  // namespace flashgen
