// flashgen sm90 PTX wrappers: the Hopper instructions the sm90 kernels are built from (PTX ISA 8.x):
// mbarriers (arrive, expect-tx, parity wait), the tensor memory accelerator's tiled bulk copy
// global -> shared (cp.async.bulk.tensor), proxy fences, warpgroup MMA fences / commit / wait,
// shared-memory matrix descriptors, register reallocation (setmaxnreg) and named barriers.
//
// FG_SM90A is defined when compiling device code for sm_90a (the only target with wgmma and
// setmaxnreg); elsewhere the wrappers compile to a trap, so a unit built for another architecture
// fails loudly instead of computing garbage.
#pragma once
#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FG_SM90A 1
#endif

namespace flashgen {
namespace sm90 {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ----------------------------------------------------------------------------------------------
// mbarrier (PTX "Parallel Synchronization and Communication Instructions: mbarrier").

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#if defined(FG_SM90A)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
#endif
}
// Makes the initialised barriers visible to the async proxy (the TMA unit) and the other threads
// (followed by a CTA barrier).
__device__ __forceinline__ void fence_barrier_init() {
#if defined(FG_SM90A)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if defined(FG_SM90A)
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
// One arrival that also announces `bytes` of transactions (TMA copies completing on `bar`).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if defined(FG_SM90A)
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
#endif
}
// Wait until the phase with parity `phase` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
#if defined(FG_SM90A)
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(phase)
      : "memory");
#endif
}

// ----------------------------------------------------------------------------------------------
// Tensor memory accelerator: a 4-d box of a tensor map (coordinates innermost first) into shared
// memory at `dst`, completing `bar`'s transactions. Out-of-bounds elements are written as zeros.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0,
                                            int c1, int c2, int c3) {
#if defined(FG_SM90A)
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}
__device__ __forceinline__ void prefetch_tmap(const void* tmap) {
#if defined(FG_SM90A)
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
#endif
}
// The reverse: a 4-d box of shared memory at `src` (the tensor map's box and swizzle) into the
// tensor at the coordinates (innermost first), as one bulk group of this thread (commit it with
// bulk_commit). Elements outside the tensor are not written.
__device__ __forceinline__ void tma_store_4d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3) {
#if defined(FG_SM90A)
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tmap)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
#endif
}
// The tensor reduction: adds (fp32 add, each element atomically) a 4-d box of shared memory at
// `src` (the tensor map's box and swizzle) into the tensor at the coordinates, as one bulk group
// of this thread. Elements outside the tensor are not touched.
__device__ __forceinline__ void tma_reduce_add_4d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3) {
#if defined(FG_SM90A)
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(tmap)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}
// Orders async-proxy (TMA) global accesses with this thread's generic-proxy ones around a
// synchronisation through global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
#if defined(FG_SM90A)
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if defined(FG_SM90A)
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most N of this thread's bulk groups are still reading their shared memory
// (bulk_wait_read) or still pending at all (bulk_wait).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if defined(FG_SM90A)
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
#if defined(FG_SM90A)
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// Orders this thread's earlier generic-proxy shared-memory writes before later async-proxy
// (wgmma, TMA) accesses that synchronise with it.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(FG_SM90A)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ----------------------------------------------------------------------------------------------
// Warpgroup MMA control. wgmma_fence before the first wgmma that reads registers written since
// (accumulators, A fragments); commit closes a group; wait<N> leaves at most N groups pending.
__device__ __forceinline__ void wgmma_fence() {
#if defined(FG_SM90A)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(FG_SM90A)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(FG_SM90A)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps the compiler from moving accesses of an accumulator register across wgmma issue / wait.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) {
  asm volatile("" : "+r"(r)::"memory");
}

// 16-byte shared-memory store and load (the sm90 forward's work ring, sm90/fwd.cuh): volatile,
// so the load is issued where it stands (after the barrier wait that publishes the slot), never
// hoisted out of a loop and held in registers.
__device__ __forceinline__ void st_shared_v4(uint32_t addr, int x, int y, int z, int w) {
  asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x), "r"(y), "r"(z), "r"(w)
               : "memory");
}
__device__ __forceinline__ int4 ld_shared_v4(uint32_t addr) {
  int4 v;
  asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// A copy of x the compiler cannot prove equal to x: what is computed from it is computed again
// rather than held in registers (through a key loop that needs them for the accumulators).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Shared-memory matrix descriptor (PTX "Matrix Descriptor Format") for the 128-byte swizzle:
// start address, leading and stride byte offsets (all >> 4), layout type 1 = SWIZZLE_128B.
//   K-major operand, rows of 64 elements (128 B) in 8-row atoms of 1024 B: sbo = 1024 (next 8
//   rows), lbo unused (1); the next 16 elements along K start 32 bytes later.
//   N-major operand (B with N contiguous), 64-element columns: lbo = the byte stride between
//   64-element column panels, sbo = 1024 (next 8 rows along K).
// The atoms must be 1024-byte aligned (base offset 0).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= uint64_t((addr >> 4) & 0x3FFF);
  d |= uint64_t((lbo >> 4) & 0x3FFF) << 16;
  d |= uint64_t((sbo >> 4) & 0x3FFF) << 32;
  d |= uint64_t(1) << 62;
  return d;
}
// sw128_desc(addr + bytes, lbo, sbo) from sw128_desc(addr, lbo, sbo), for bytes a multiple of 16
// with addr + bytes a shared-memory address (< 2^18, so the 14-bit start field cannot carry):
// one 32-bit add to the low word. With a warp-uniform base the compiler keeps the descriptors in
// uniform registers, one add per wgmma, instead of re-encoding both descriptors (about 14
// instructions and 4 register-to-uniform moves per wgmma).
__device__ __forceinline__ uint64_t desc_advance(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(d) + (bytes >> 4));
}

// ----------------------------------------------------------------------------------------------
// Register reallocation between warpgroups (the kernel must start with a register cap:
// __launch_bounds__(threads, 1)).
template <int N>
__device__ __forceinline__ void reg_alloc() {
#if defined(FG_SM90A)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void reg_dealloc() {
#if defined(FG_SM90A)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` threads, a multiple of 32.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int kId, int kThreads>  // immediate operands: no registers held for them
__device__ __forceinline__ void bar_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ __forceinline__ void bar_arrive() {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

}  // namespace ptx
}  // namespace sm90
}  // namespace flashgen
