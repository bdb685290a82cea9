// wgmma.cuh: the Hopper (sm_90a) tensor-core main loop shared by gemm_wgmma.cu (dense
// operands) and conv2d_wgmma.cu (im2col gathers): D (BM x BN, fp32) += A (BM x K) * B^T
// (B stored BN x K), both operands K-major in shared memory, filled by the caller's loader.
//
// Layout: a stage holds the A tile (BM rows) then the B tile (BN rows); a row is one
// 128-byte slab of K (32 floats, 64 16-bit values), its 16-byte chunk c stored at
// ((c ^ (row % 8)) * 16): the 128-byte swizzle, which the matrix descriptors below name
// (mode 1, 8-row groups 1024 bytes apart). Every tile base is 1024-byte aligned.
// Warpgroup w (128 threads) owns rows 64w .. 64w + 63 of the block tile and all BN columns:
// one m64nBNk8 (TF32) or m64nBNk16 (bf16 / fp16) wgmma per 32 bytes of K, BN / 2 fp32
// accumulators per thread.
// Pipeline (STAGES = 4, two slabs of prefetch):
//   slab kt: wait for its copies (this thread's) -> fence.proxy.async (visible to the
//   tensor cores' async proxy) -> __syncthreads (everyone's; slab kt-2's wgmma retired in
//   every thread) -> load slab kt+2 into slab kt-2's stage -> wgmma.fence, the wgmmas,
//   commit -> wait_group 1 (slab kt-1's wgmma retired, so the next refill is safe).
// MN-major operands (16-bit types only: backward-weight's channels-last gathers): a stage's
// tile is then 64 rows of K, each row 128 bytes of 64 consecutive M (or N) values, one such
// 8 KB atom per 64 rows (columns) of the block tile, with the same 128-byte swizzle; the
// descriptors say it (mn_desc: 8-row groups of K 1024 bytes apart, atoms 8 KB apart) and
// the instruction's transpose flags are set. The byte counts equal the K-major tiles'.
// Accumulator layout of m64nNk8/k16 (warp v of the warpgroup, lane l): for each 8-column
// group j, acc[4j], acc[4j+1] at row 16v + l/4, columns 8j + 2(l%4) + {0, 1}; acc[4j+2],
// acc[4j+3] eight rows further down.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "wgmma_regs.cuh"

namespace wgmma_tiles {

// No <cstdint>: NVRTC does not ship it.
typedef unsigned long long u64;
typedef unsigned int u32;

constexpr int ROW_BYTES = 128, STAGES = 4;

// Bytes of dynamic shared memory a block of BM x BN tiles asks for (+ slack to align).
template <int BM, int BN>
__host__ __device__ constexpr int smem_bytes() { return STAGES * (BM + BN) * ROW_BYTES + 1024; }

// Traps unless the launcher gave the block `bytes` of dynamic shared memory (or more).
__device__ __forceinline__ void require_smem(int bytes) {
  unsigned dyn;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
  if (dyn < (unsigned)bytes) __trap();
}
__device__ __forceinline__ u32 smem_base(const void* raw) {
  return ((u32)__cvta_generic_to_shared(raw) + 1023u) & ~1023u;
}

// Tile offset of row r's 16-byte chunk c (the 128-byte swizzle).
__device__ __forceinline__ u32 swizzled(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// 16-byte async copy into shared address dst; with `bytes`, only that many are read (0:
// nothing, the 16 bytes are zero-filled).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// mbarriers (warp-specialized kernels): a 64-bit shared-memory barrier that completes a
// phase when `count` arrivals have come; waiters name the phase's parity (0, 1, 0, ...).
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
// Spins until the phase of parity `parity` has completed (a fresh barrier's phase "1" counts
// as completed, so a producer's first wait on an empty slot passes).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins the accumulators in place across the async region (the compiler sees a use/def).
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ u64 smem_desc(u32 saddr) {
  return (u64)((saddr & 0x3FFFF) >> 4)      // start address
         | ((u64)(16 >> 4) << 16)           // leading byte offset (unused when swizzled)
         | ((u64)(1024 >> 4) << 32)         // stride byte offset: next 8 rows
         | ((u64)1 << 62);                  // swizzle mode 1: 128 bytes
}

// Shared-memory matrix descriptor: MN-major, 128-byte swizzle: 8-row groups of K 1024 bytes
// apart (stride byte offset), 64-value atoms of M / N `atom` bytes apart (leading byte offset).
__device__ __forceinline__ u64 mn_desc(u32 saddr, u32 atom) {
  return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(atom >> 4) << 16) | ((u64)(1024 >> 4) << 32) |
         ((u64)1 << 62);
}

// D (64 x N fp32, N / 2 registers per thread) += A (64 x 32 bytes) * B (32 bytes x N), both
// from shared memory through descriptors, K-major (16-bit types: transpose flags 0) or, with
// MN, both MN-major (flags 1; 16-bit types only), scale-d 1 (accumulate), operand scales 1.
template <typename T, int N, bool MN = false>
struct Wgmma;

#define DP_WGMMA_ASM(op, n, r, tail)                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" op "\n" WGMMA_D##r ", p, 1, 1" tail \
               ";\n}\n"                                                                    \
               : WGMMA_REGS##r                                                             \
               : "l"(a), "l"(b))
// One 16-bit specialisation: element type E, PTX type name ty, MN-major or not.
#define DP_WGMMA16(E, ty, n, r, mn, flags)                                                 \
  template <> struct Wgmma<E, n, mn> {                                                    \
    __device__ __forceinline__ static void run(float (&d)[r], u64 a, u64 b) {             \
      DP_WGMMA_ASM("wgmma.mma_async.sync.aligned.m64n" #n "k16.f32." ty "." ty, n, r, flags); \
    }                                                                                      \
  };
#define DP_WGMMA(n, r)                                                                     \
  template <> struct Wgmma<float, n> {                                                    \
    __device__ __forceinline__ static void run(float (&d)[r], u64 a, u64 b) {             \
      DP_WGMMA_ASM("wgmma.mma_async.sync.aligned.m64n" #n "k8.f32.tf32.tf32", n, r, "");   \
    }                                                                                      \
  };                                                                                       \
  DP_WGMMA16(__nv_bfloat16, "bf16", n, r, false, ", 0, 0")                                 \
  DP_WGMMA16(__half, "f16", n, r, false, ", 0, 0")                                         \
  DP_WGMMA16(__nv_bfloat16, "bf16", n, r, true, ", 1, 1")                                  \
  DP_WGMMA16(__half, "f16", n, r, true, ", 1, 1")
DP_WGMMA(32, 16)
DP_WGMMA(64, 32)
DP_WGMMA(128, 64)
DP_WGMMA(192, 96)
DP_WGMMA(256, 128)
#undef DP_WGMMA
#undef DP_WGMMA16
#undef DP_WGMMA_ASM

// One slab's wgmmas, committed as one group: this warpgroup's rows of the A tile at sa, the
// B tile at sb (K-major, or with MN both MN-major). The caller waits for the group.
template <typename T, int BN, bool MN = false>
__device__ __forceinline__ void wgmma_slab(float (&acc)[BN / 2], u32 sa, u32 sb) {
  fence_regs(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < ROW_BYTES / 32; ++kk) {
    if constexpr (MN)  // 16 rows of K per step; an atom is 64 rows of 128 bytes
      Wgmma<T, BN, true>::run(acc, mn_desc(sa + kk * 2048, 64 * ROW_BYTES),
                              mn_desc(sb + kk * 2048, 64 * ROW_BYTES));
    else
      Wgmma<T, BN>::run(acc, smem_desc(sa + kk * 32), smem_desc(sb + kk * 32));
  }
  wgmma_commit();
}

// One slab's wgmmas for a warpgroup's 128 rows, committed as one group: rows 0-63 of the A
// tile at sa0 into acc0, rows 64-127 at sa1 into acc1, the B tile at sb (K-major).
template <typename T, int BN>
__device__ __forceinline__ void wgmma_slab_pair(float (&acc0)[BN / 2], float (&acc1)[BN / 2],
                                                u32 sa0, u32 sa1, u32 sb) {
  fence_regs(acc0);
  fence_regs(acc1);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < ROW_BYTES / 32; ++kk) {
    Wgmma<T, BN>::run(acc0, smem_desc(sa0 + kk * 32), smem_desc(sb + kk * 32));
    Wgmma<T, BN>::run(acc1, smem_desc(sa1 + kk * 32), smem_desc(sb + kk * 32));
  }
  wgmma_commit();
}

// Registers per thread of the executing warpgroup raised (inc) or lowered (dec) to N, a
// multiple of 8: warp-specialized kernels move them from the loading warpgroup to the
// multiplying ones.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// The main loop: KT slabs, load(kt, a_tile, b_tile) issuing slab kt's cp.async copies into
// the two shared tiles (this thread's share; zero-fill outside the matrices). Accumulates
// into acc, which the caller zeroes. sbase: smem_base() of the dynamic shared memory. MN:
// both tiles MN-major (see above; 16-bit types, 64 rows of K per slab).
template <typename T, int BM, int BN, bool MN = false, class Load>
__device__ __forceinline__ void wgmma_mainloop(float (&acc)[BN / 2], u32 sbase, int KT,
                                               Load&& load) {
  constexpr int A_BYTES = BM * ROW_BYTES, STAGE_BYTES = (BM + BN) * ROW_BYTES;
  static_assert(BM % 64 == 0 && STAGE_BYTES % 1024 == 0, "tiles of 64-row warpgroups");
  static_assert(!MN || (sizeof(T) == 2 && BN % 64 == 0), "MN-major: 16-bit, whole atoms");
  const int wg = threadIdx.x >> 7;
#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < KT) load(s, sbase + s * STAGE_BYTES, sbase + s * STAGE_BYTES + A_BYTES);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 3>();  // slab kt has landed (this thread's copies)
    fence_proxy_async();          // ... and is visible to the async proxy
    __syncthreads();              // every thread's copies; slab kt-2's wgmma retired everywhere
    const int nk = kt + STAGES - 2;
    if (nk < KT) {
      const u32 st = sbase + (nk % STAGES) * STAGE_BYTES;
      load(nk, st, st + A_BYTES);
    }
    cp_async_commit();  // always, so the group count stays in step with kt

    const u32 st = sbase + (kt % STAGES) * STAGE_BYTES;
    wgmma_slab<T, BN, MN>(acc, st + wg * (64 * ROW_BYTES), st + A_BYTES);
    wgmma_wait<1>();  // slab kt-1's wgmma has retired: its stage may be refilled
    fence_regs(acc);
  }
  wgmma_wait<0>();
  fence_regs(acc);
  cp_async_wait<0>();
}

// The main loop of a loader that cannot copy asynchronously (TF32 from MN-major sources:
// loads to registers, stores transposed): fetch(kt) loads slab kt into the caller's
// registers (zeros past the last slab), stash(a_tile, b_tile) stores them into a stage,
// K-major. While slab kt's wgmma runs, slab kt+1 is stashed (fetched one slab earlier) and
// slab kt+2 fetched; then the wgmma is waited for, so none is in flight across the loop's
// branch (ptxas serialises the wgmmas otherwise). One barrier per slab.
template <typename T, int BM, int BN, class Fetch, class Stash>
__device__ __forceinline__ void wgmma_mainloop_staged(float (&acc)[BN / 2], u32 sbase, int KT,
                                                      Fetch&& fetch, Stash&& stash) {
  constexpr int A_BYTES = BM * ROW_BYTES, STAGE_BYTES = (BM + BN) * ROW_BYTES;
  static_assert(BM % 64 == 0 && STAGE_BYTES % 1024 == 0, "tiles of 64-row warpgroups");
  const int wg = threadIdx.x >> 7;
  if (KT <= 0) return;
  fetch(0);
  stash(sbase, sbase + A_BYTES);
  fetch(1);
  for (int kt = 0; kt < KT; ++kt) {
    fence_proxy_async();  // this thread's stores of slab kt, visible to the async proxy
    __syncthreads();      // ... everyone's; every earlier wgmma retired
    const u32 st = sbase + (kt % STAGES) * STAGE_BYTES;
    wgmma_slab<T, BN>(acc, st + wg * (64 * ROW_BYTES), st + A_BYTES);
    // unconditionally (no branch in the pipeline): past the last slab, fetch loads nothing
    // and stash fills a stage no wgmma reads
    const u32 next = sbase + ((kt + 1) % STAGES) * STAGE_BYTES;
    stash(next, next + A_BYTES);
    fetch(kt + 2);
    wgmma_wait<0>();
    fence_regs(acc);
  }
}
// The accumulator's coordinates in the block tile: f(row, col, x0, y0, x1, y1) for each pair
// of neighbouring columns (col, col + 1) this thread holds, (x0, y0) at row 16v + l/4 and
// (x1, y1) eight rows further down (see the layout above).
template <int BN, class F>
__device__ __forceinline__ void for_each_pair(const float (&acc)[BN / 2], F&& f) {
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row = wg * 64 + warp * 16 + (lane >> 2), col = 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
    f(row, col + 8 * j, acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
}

}  // namespace wgmma_tiles
