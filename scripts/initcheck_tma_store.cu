// Minimal reproducer: compute-sanitizer's initcheck does not count bytes written by a TMA store
// (cp.async.bulk.tensor, global <- shared) or by a plain bulk store (cp.async.bulk) as
// initialised, so a later kernel reading them is reported as an "Uninitialized __global__ memory
// read" although the values are there. The sm90 forward writes O through a TMA store, and the
// backward's preprocessing kernel (D = rowsum(dO o O)) reads O: that is the report initcheck
// makes on every padded sm90 backward (docs/reliability.md).
//
// Three buffers from cudaMalloc, never memset, each filled with the same 64 x 64 fp32 values by
// one kernel: plain st.global stores, a TMA tensor store, a bulk store. Then one reader kernel
// per buffer checks every value on the device and counts mismatches. Expected: every buffer
// holds the values (the program prints "ok" for each and exits 0); under
//   compute-sanitizer --tool initcheck ./initcheck_tma_store
// reports name read_after_tma_store and read_after_bulk_store only, never read_after_st_global.
//
//   nvcc -std=c++17 -arch=sm_90a -o initcheck_tma_store scripts/initcheck_tma_store.cu
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

constexpr int kRows = 64, kCols = 64, kBoxRows = 16;
constexpr int kBytes = kRows * kCols * 4;

__device__ float value(int i) { return float(i % 1000) * 0.5f + 1.f; }

__global__ void fill_st_global(float* out) {
  for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) out[i] = value(i);
}

// The whole 16 KB tile in shared memory, then written out by the TMA in four 64 x 16 boxes.
__global__ void fill_tma_store(const __grid_constant__ CUtensorMap tmap) {
  __shared__ __align__(128) float tile[kRows * kCols];
  for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) tile[i] = value(i);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> async proxy
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int r = 0; r < kRows; r += kBoxRows) {
      const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(tile + r * kCols));
      asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                   ::"l"(&tmap), "r"(0), "r"(r), "r"(src) : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

__global__ void fill_bulk_store(float* out) {
  __shared__ __align__(128) float tile[kRows * kCols];
  for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) tile[i] = value(i);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 ::"l"(out), "r"(src), "r"(kBytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

__device__ void check(const float* in, int* bad) {
  for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x)
    if (in[i] != value(i)) atomicAdd(bad, 1);
}
__global__ void read_after_st_global(const float* in, int* bad) { check(in, bad); }
__global__ void read_after_tma_store(const float* in, int* bad) { check(in, bad); }
__global__ void read_after_bulk_store(const float* in, int* bad) { check(in, bad); }

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e_));                      \
      return 2;                                                                 \
    }                                                                           \
  } while (0)

int main() {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !fn) {
    std::printf("cuTensorMapEncodeTiled not found\n");
    return 2;
  }
  float* buf[3];
  int* bad;
  for (auto& b : buf) CK(cudaMalloc(&b, kBytes));  // never initialised by the host
  CK(cudaMalloc(&bad, 3 * sizeof(int)));
  CK(cudaMemset(bad, 0, 3 * sizeof(int)));

  CUtensorMap tmap;
  const cuuint64_t dims[2] = {kCols, kRows}, strides[1] = {kCols * 4};
  const cuuint32_t box[2] = {kCols, kBoxRows}, estr[2] = {1, 1};
  if (reinterpret_cast<Encode>(fn)(&tmap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, buf[1], dims, strides, box, estr,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                   CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed\n");
    return 2;
  }
  fill_st_global<<<1, 256>>>(buf[0]);
  fill_tma_store<<<1, 256>>>(tmap);
  fill_bulk_store<<<1, 256>>>(buf[2]);
  CK(cudaDeviceSynchronize());
  read_after_st_global<<<1, 256>>>(buf[0], bad + 0);
  read_after_tma_store<<<1, 256>>>(buf[1], bad + 1);
  read_after_bulk_store<<<1, 256>>>(buf[2], bad + 2);
  CK(cudaDeviceSynchronize());
  int h[3];
  CK(cudaMemcpy(h, bad, sizeof(h), cudaMemcpyDeviceToHost));
  const char* names[3] = {"st.global", "TMA tensor store", "bulk store"};
  int rc = 0;
  for (int i = 0; i < 3; ++i) {
    std::printf("%-17s %s (%d of %d values wrong)\n", names[i], h[i] ? "WRONG" : "ok", h[i], kRows * kCols);
    rc |= h[i] != 0;
  }
  return rc;
}
