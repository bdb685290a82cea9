// gemm_wgmma.cu: C = A @ B^T (+ bias) on Hopper tensor cores through wgmma.mma_async
// (sm_90a): TF32 on float operands, bf16 / fp16 on __nv_bfloat16 / __half. Launcher and
// dispatch: dptrain/backend/cuda/gemm.py, which uses this kernel for precision "tf32" float
// operands or 16-bit operands on compute capability 9.0, when the shapes fit (below) and
// DPTRAIN_WGMMA=0 is not set; everything else runs kernels/gemm.cu.
//
// Conventions
//  * Row-major, T in and out, fp32 accumulate; float operands are read as tf32 by the
//    tensor cores (low mantissa bits ignored, as cuBLAS TF32 does); 16-bit outputs are
//    rounded once.
//  * A is M x K (lda = K), B is N x K (ldb = K): both K-major, the only layout wgmma takes
//    for tf32 from shared memory. That is matmul(a, b, trans_b=True) = x @ W^T.
//  * Fast-path shapes only, checked by the launcher: M % 128 == 0, N % 256 == 0,
//    K % BK == 0 (BK = one 128-byte row: 32 floats, 64 16-bit values), K > 0, A, B, C
//    16-byte aligned (rows then are too). No edge handling.
//  * `=`: C is written, never read. bias_mode 1 adds bias[n] to every row.
//  * Batch in grid z: matrix b starts at A + b*sA (B, C likewise); stride 0 broadcasts.
//
// Design: block tile 128 x 256 x BK (K tile = one 128-byte row: 32 floats or 64 16-bit
// values), 256 threads = two warpgroups, each owning 64 rows x 256 columns (one m64n256k8
// tf32 or m64n256k16 16-bit wgmma per 32 bytes of K, 128 fp32 accumulators per thread). In
// bytes the tiles, swizzle, descriptors and k steps are the same for every type. Shared tiles are K-major with the 128-byte swizzle:
// row r (128 bytes) at r*128, its 16-byte chunk c at ((c ^ (r % 8)) * 16), tile base
// 1024-byte aligned, matching a matrix descriptor with swizzle mode 1 (128B), stride byte
// offset 1024 (8 rows), and a start address stepped by 32 bytes per k step.
// All 256 threads load with 16-byte cp.async.cg; 4 stages, 2 tiles of prefetch:
//   iteration kt: wait for tile kt (own copies) -> fence.proxy.async (make them visible to
//   the tensor cores' async proxy) -> __syncthreads -> issue the load of tile kt+2 into the
//   stage tile kt-2 used (its wgmma retired in every thread before the barrier) ->
//   wgmma.fence, 4 wgmma, commit -> wgmma.wait_group 1 (tile kt-1's wgmma retired).
// Blocks are rastered in groups of 16 block rows for L2 reuse.
//
// nvrtc-options: -arch=sm_90a
// instantiate: gemm_wgmma_kernel<float>; gemm_wgmma_kernel<__nv_bfloat16>
// instantiate: gemm_wgmma_kernel<__half>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// No <cstdint>: NVRTC does not ship it.
typedef unsigned long long u64;
typedef unsigned int u32;

namespace wgmma_tiles {

constexpr int BM = 128, BN = 256, ROW_BYTES = 128, STAGES = 4, THREADS = 256, GROUP_M = 16;
constexpr int A_BYTES = BM * ROW_BYTES;              // 16 KB
constexpr int B_BYTES = BN * ROW_BYTES;              // 32 KB
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;       // 48 KB, a multiple of 1024
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;  // + slack to align the base

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
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
__device__ __forceinline__ void fence_regs(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ u64 smem_desc(u32 saddr) {
  return (u64)((saddr & 0x3FFFF) >> 4)      // start address
         | ((u64)(16 >> 4) << 16)           // leading byte offset (unused when swizzled)
         | ((u64)(1024 >> 4) << 32)         // stride byte offset: next 8 rows
         | ((u64)1 << 62);                  // swizzle mode 1: 128 bytes
}

// The 128 accumulator operands of an m64n256 wgmma, and their constraints.
#define WGMMA_D \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},\n"
#define WGMMA_D_REGS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D (64 x 256 fp32, 128 registers per thread) += A (64 x k) * B (k x 256), k = 32 bytes of
// T (8 tf32, 16 bf16 / fp16 values), both from shared memory through descriptors, both
// K-major (16-bit types: transpose flags 0).
template <typename T> __device__ __forceinline__ void wgmma_m64n256(float (&d)[128], u64 a, u64 b);

// The instruction `op` with scale-d = 1 (accumulate), operand scales 1 and the `tail`
// flags (the 16-bit types' transpose flags: 0, both operands K-major).
#define WGMMA_M64N256(op, tail)                                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" op "\n" WGMMA_D                \
               " %128, %129, p, 1, 1" tail ";\n}\n"                                       \
               : WGMMA_D_REGS                                                            \
               : "l"(a), "l"(b))

template <>
__device__ __forceinline__ void wgmma_m64n256<float>(float (&d)[128], u64 a, u64 b) {
  WGMMA_M64N256("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32", "");
}
template <>
__device__ __forceinline__ void wgmma_m64n256<__nv_bfloat16>(float (&d)[128], u64 a, u64 b) {
  WGMMA_M64N256("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ", 0, 0");
}
template <>
__device__ __forceinline__ void wgmma_m64n256<__half>(float (&d)[128], u64 a, u64 b) {
  WGMMA_M64N256("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", ", 0, 0");
}

// Two accumulators (+ bias) as one 2-element store of T.
__device__ __forceinline__ void store2(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void store2(__half* p, float x, float y) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

}  // namespace wgmma_tiles

template <typename T>
__global__ void __launch_bounds__(wgmma_tiles::THREADS, 1)
    gemm_wgmma_kernel(const T* __restrict__ A, const T* __restrict__ B, T* C,
                      const T* __restrict__ bias, int M, int N, int K, long long sA,
                      long long sB, long long sC, int bias_mode) {
  using namespace wgmma_tiles;
  constexpr int BK = ROW_BYTES / sizeof(T), CHUNK = 16 / sizeof(T);  // elements
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned dyn;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
  if (dyn < (unsigned)SMEM_BYTES) __trap();  // the launcher must pass SMEM_BYTES

  const u32 raw = (u32)__cvta_generic_to_shared(smem_raw);
  const u32 sbase = (raw + 1023u) & ~1023u;

  // Grouped raster: GROUP_M block rows sweep the block columns together (L2 reuse).
  const int tiles_m = M / BM, tiles_n = N / BN;
  const int pid = blockIdx.x;
  const int per_group = GROUP_M * tiles_n;
  const int first_m = (pid / per_group) * GROUP_M;
  const int gsize = min(tiles_m - first_m, GROUP_M);
  const int tm = first_m + (pid % per_group) % gsize;
  const int tn = (pid % per_group) / gsize;
  const int m0 = tm * BM, n0 = tn * BN;
  const int b = blockIdx.z;
  A += b * sA;
  B += b * sB;
  C += b * sC;

  const int tid = threadIdx.x;
  // Loader: 16-byte chunk c = tid % 8 of rows tid / 8 + 32 j (A: j < 4, B: j < 8).
  const int lrow = tid >> 3, lc = tid & 7;
  const T* a_src = A + (long long)(m0 + lrow) * K + lc * CHUNK;
  const T* b_src = B + (long long)(n0 + lrow) * K + lc * CHUNK;
  const u32 l_off = lrow * 128 + ((lc ^ (lrow & 7)) << 4);
  const long long a_step = 32LL * K;  // 32 rows

  auto load_tile = [&](int kt, int stage) {
    const u32 sa = sbase + stage * STAGE_BYTES + l_off;
    const u32 sb = sa + A_BYTES;
    const T* pa = a_src + kt * BK;
    const T* pb = b_src + kt * BK;
#pragma unroll
    for (int j = 0; j < BM / 32; ++j) cp_async16(sa + j * 4096, pa + j * a_step);
#pragma unroll
    for (int j = 0; j < BN / 32; ++j) cp_async16(sb + j * 4096, pb + j * a_step);
  };

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

  const int KT = K / BK;
  const int wg = tid >> 7;  // warpgroup: rows wg*64 .. wg*64+63 of the block tile
#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < KT) load_tile(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 3>();  // tile kt has landed (this thread's copies)
    fence_proxy_async();          // ... and is visible to the async proxy
    __syncthreads();              // every thread's copies; tile kt-2's wgmma retired everywhere
    if (kt + STAGES - 2 < KT) load_tile(kt + STAGES - 2, (kt + STAGES - 2) % STAGES);
    cp_async_commit();            // always, so the group count stays in step with kt

    const u32 sa = sbase + (kt % STAGES) * STAGE_BYTES + wg * (64 * 128);
    const u32 sb = sbase + (kt % STAGES) * STAGE_BYTES + A_BYTES;
    fence_regs(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < ROW_BYTES / 32; ++kk)
      wgmma_m64n256<T>(acc, smem_desc(sa + kk * 32), smem_desc(sb + kk * 32));
    wgmma_commit();
    wgmma_wait<1>();  // tile kt-1's wgmma has retired: its stage may be refilled
    fence_regs(acc);
  }
  wgmma_wait<0>();
  fence_regs(acc);
  cp_async_wait<0>();

  // Accumulator layout of m64nNk8 (per warp w of the warpgroup, lane l): for each 8-column
  // group j, acc[4j..4j+1] at row 16w + l/4, columns 8j + 2(l%4) + {0,1}; acc[4j+2..4j+3]
  // eight rows further down.
  const int warp = (tid >> 5) & 3, lane = tid & 31;
  const int row = m0 + wg * 64 + warp * 16 + (lane >> 2);
  const int col0 = n0 + 2 * (lane & 3);
  T* c0 = C + (long long)row * N;
  T* c1 = c0 + 8LL * N;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = col0 + 8 * j;
    float bx = 0.f, by = 0.f;
    if (bias_mode == 1) bx = to_f32(bias[col]), by = to_f32(bias[col + 1]);
    store2(c0 + col, acc[4 * j] + bx, acc[4 * j + 1] + by);
    store2(c1 + col, acc[4 * j + 2] + bx, acc[4 * j + 3] + by);
  }
}
