// flashgen CUDA: thin wrappers over the sm_80 PTX the forward kernel is built from.
//
// cp.async (16-byte global->shared copies that zero-fill when predicated off), ldmatrix (8x8
// b16 tiles from shared memory into mma fragments), mma.sync m16n8k16 with fp32 accumulation,
// ex2.approx, and the fp32 -> {fp16, bf16} pair packing used to feed P back into an mma.
// All of these exist on sm_80 and later (they run unchanged on sm_90a). At the end, the sm_90
// instructions of the decode kernel's opt-in bulk-copy variant (mbarriers, 1-D cp.async.bulk).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace flashgen {
namespace cuda {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared. When `pred` is false the source size is 0: nothing is read
// from global memory (`src` only has to be some valid address) and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool pred) {
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i of
// every lane receives matrix i in the mma fragment layout (lane l holds row l/4, cols 2(l%4)+{0,1}).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Same, each 8x8 matrix transposed on the way (lane l holds rows 2(l%4)+{0,1} of column l/4).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Transposes an 8x8 b16 matrix held in the mma fragment layout (lane l holds row l/4, columns
// 2(l%4)+{0,1}): afterwards lane l holds row l/4 of the transpose, i.e. column l/4's rows
// 2(l%4)+{0,1} of the input. sm_75 and newer.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// D = A * B + D on a 16x8x16 tile, fp32 accumulators (row-major A, column-major B).
template <class Element>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Round two floats to the element type and pack them into one 32-bit register, `lo` in the low
// half (the lower column index of an mma fragment pair).
template <class Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 2^x through the special-function unit (ex2.approx.ftz: -inf -> +0, relative error ~2^-22),
// independent of whether the translation unit is built with --use_fast_math.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Special registers read through volatile asm: the compiler re-reads them where they are used
// instead of keeping values derived from them live (and spilled) across long loops.
__device__ __forceinline__ uint32_t ctaid_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t nctaid_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t lane_id() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(r));
  return r;
}

// ----------------------------------------------------------------------------------------------
// sm_90 and newer only (the decode kernel's bulk-copy variant, FLASHGEN_CUDA_DECODE_BULK; its
// kernel static_asserts the architecture, and these trap if reached on an older one anyway):
// mbarriers with transaction counts and 1-D bulk copies global -> shared (no tensor map).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FG_CUDA_BULK_OK 1
#endif

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#if defined(FG_CUDA_BULK_OK)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#else
  __trap();
#endif
}
// Makes initialised mbarriers visible to the async proxy (the copy engine); a CTA barrier after it
// makes them visible to the other threads.
__device__ __forceinline__ void fence_mbar_init() {
#if defined(FG_CUDA_BULK_OK)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  __trap();
#endif
}
// One arrival on `bar` that also announces `bytes` of transactions (bulk copies completing on it).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if defined(FG_CUDA_BULK_OK)
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}
// Waits until the phase of `bar` with parity `parity` has completed (acquire: the bytes of the
// copies that completed it are visible to this thread).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if defined(FG_CUDA_BULK_OK)
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}
// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned) by the copy
// engine, completing that many transaction bytes of `bar`.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if defined(FG_CUDA_BULK_OK)
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#else
  __trap();
#endif
}

#undef FG_CUDA_BULK_OK

}  // namespace ptx
}  // namespace cuda
}  // namespace flashgen
