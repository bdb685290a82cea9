// gemm_wgmma.cu: C = A @ B^T (+ bias) on Hopper tensor cores through wgmma.mma_async
// (sm_90a): TF32 on float operands, bf16 / fp16 on __nv_bfloat16 / __half. Launcher and
// dispatch: dptrain/backend/cuda/gemm.py, which uses this kernel for precision "tf32" float
// operands or 16-bit operands on compute capability 9.0, when the shapes fit (below);
// everything else runs kernels/gemm.cu.
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
//  * `=`: C is written, never read. bias_mode 1 adds bias[n] to every row; + 4 then applies
//    ReLU (v < 0 -> 0, NaN kept), as gemm_tiles.cuh's EPI_RELU.
//  * Batch in grid z: matrix b starts at A + b*sA (B, C likewise); stride 0 broadcasts.
//  * Split-K (splits > 1): grid z = batch * splits; split s walks the slabs [s*kt_split,
//    (s+1)*kt_split) of K and writes its raw float partial product to ws[s][b] (dense M x N,
//    no bias, no ReLU); gemm.cu's splitk_reduce_kernel then sums the splits in order and
//    applies bias and ReLU. For products of few tiles and long K, which one block per tile
//    would walk alone.
//
// Design: block tile 128 x 256 x one 128-byte slab of K, 256 threads = two warpgroups,
// each owning 64 rows x 256 columns: wgmma.cuh's main loop (swizzled K-major tiles, 4
// stages, two slabs of prefetch). All 256 threads load with 16-byte cp.async.cg. Blocks are
// rastered in groups of 16 block rows for L2 reuse.
//
// nvrtc-options: -arch=sm_90a
// instantiate: gemm_wgmma_kernel<{float, __nv_bfloat16, __half}>

#include "wgmma.cuh"

namespace wgmma_gemm {
using namespace wgmma_tiles;

constexpr int BM = 128, BN = 256, THREADS = 256, GROUP_M = 16;
constexpr int SMEM_BYTES = smem_bytes<BM, BN>();

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

}  // namespace wgmma_gemm

template <typename T>
__global__ void __launch_bounds__(wgmma_gemm::THREADS, 1)
    gemm_wgmma_kernel(const T* __restrict__ A, const T* __restrict__ B, T* C,
                      const T* __restrict__ bias, int M, int N, int K, long long sA,
                      long long sB, long long sC, int bias_mode, float* ws, int splits,
                      int kt_split) {
  using namespace wgmma_gemm;
  constexpr int BK = ROW_BYTES / sizeof(T), CHUNK = 16 / sizeof(T);  // elements
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  require_smem(SMEM_BYTES);  // the launcher must pass it

  // Grouped raster: GROUP_M block rows sweep the block columns together (L2 reuse).
  const int tiles_m = M / BM, tiles_n = N / BN;
  const int pid = blockIdx.x;
  const int per_group = GROUP_M * tiles_n;
  const int first_m = (pid / per_group) * GROUP_M;
  const int gsize = min(tiles_m - first_m, GROUP_M);
  const int tm = first_m + (pid % per_group) % gsize;
  const int tn = (pid % per_group) / gsize;
  const int m0 = tm * BM, n0 = tn * BN;
  const int b = blockIdx.z / splits, s = blockIdx.z - b * splits;
  const int kt0 = s * kt_split, KT = min(K / BK - kt0, kt_split);  // this split's slabs
  A += b * sA + kt0 * BK;
  B += b * sB + kt0 * BK;
  C += b * sC;

  // Loader: 16-byte chunk c = tid % 8 of rows tid / 8 + 32 j (A: j < 4, B: j < 8).
  const int tid = threadIdx.x, lrow = tid >> 3, lc = tid & 7;
  const T* a_src = A + (long long)(m0 + lrow) * K + lc * CHUNK;
  const T* b_src = B + (long long)(n0 + lrow) * K + lc * CHUNK;
  const u32 l_off = swizzled(lrow, lc);
  const long long a_step = 32LL * K;  // 32 rows

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  wgmma_mainloop<T, BM, BN>(acc, smem_base(smem_raw), KT, [&](int kt, u32 sa, u32 sb) {
    const T* pa = a_src + kt * BK;
    const T* pb = b_src + kt * BK;
#pragma unroll
    for (int j = 0; j < BM / 32; ++j) cp_async16(sa + l_off + j * 4096, pa + j * a_step);
#pragma unroll
    for (int j = 0; j < BN / 32; ++j) cp_async16(sb + l_off + j * 4096, pb + j * a_step);
  });

  if (splits > 1) {  // the raw partial, rounded by the reduce only
    float* w = ws + ((long long)s * (gridDim.z / splits) + b) * M * N;
    for_each_pair<BN>(acc, [&](int r, int c, float x0, float y0, float x1, float y1) {
      float* p = w + (long long)(m0 + r) * N + n0 + c;
      store2(p, x0, y0);
      store2(p + 8LL * N, x1, y1);
    });
    return;
  }
  for_each_pair<BN>(acc, [&](int r, int c, float x0, float y0, float x1, float y1) {
    const int col = n0 + c;
    float bx = 0.f, by = 0.f;
    if (bias_mode & 1) bx = to_f32(bias[col]), by = to_f32(bias[col + 1]);
    const auto out = [&](float v) { return (bias_mode & 4) && v < 0.f ? 0.f : v; };
    T* c0 = C + (long long)(m0 + r) * N + col;
    store2(c0, out(x0 + bx), out(y0 + by));
    store2(c0 + 8LL * N, out(x1 + bx), out(y1 + by));
  });
}
