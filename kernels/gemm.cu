// gemm.cu: batched C = alpha * op(A) @ op(B) (+ bias) (+ beta * C), fp32 (FFMA) or TF32
// (tensor cores, fp32 accumulate) on float, f16 tensor cores (fp32 accumulate) on __half.
// Launchers: dptrain/backend/cuda/gemm.py.
//
// Conventions
//  * Row-major. op(A) is M x K: A is stored M x K (lda >= K), or K x M when TA (lda >= M).
//    op(B) is K x N: B is stored K x N (ldb >= N), or N x K when TB (ldb >= K). C is M x N.
//  * `=` by default: C is not read when beta == 0 (NaN in C stays out). beta != 0 gives
//    C = alpha*AB + beta*C, the `+=` used for gradient accumulation.
//  * Batch: grid z = batch * splits. Matrix b starts at A + b*sA (B, C likewise); a batch
//    stride of 0 broadcasts one 2D operand over the batch.
//  * Split-K (splits > 1): split s covers K range [s*kchunk, (s+1)*kchunk) and writes its raw
//    partial product to ws[s][b] (dense M x N); splitk_reduce_kernel then sums the splits in a
//    fixed order and applies alpha, bias and beta. No atomics: results are bitwise repeatable.
//  * bias_mode: 0 none, 1 bias[n] per column (y = x W^T + b), 2 bias[m] per row; + EPI_RELU
//    (4): ReLU after the bias (gemm_tiles.cuh's epilogue_value), with beta 0 only.
//  * vec_a / vec_b: the launcher's promise that the operand's rows (leading dimension, batch
//    stride) are whole 16-byte chunks and its base 16-byte aligned, so tiles move in 16-byte
//    chunks.
//  * Split-K partials (ws) are float for every element type; the reduce rounds once.
//  * Tiles: fp32 128x128x16, 256 threads, 8x8 per thread, 3-stage cp.async pipeline;
//    tf32 and f16 128x128x32, 128 threads = 4 warps of 64x64, 3 stages (both also 64x128
//    tiles, warps of 32x64, where 128-row tiles would leave SMs idle). Dynamic shared memory
//    sizes and block sizes are computed by the launcher (kept in step with gemm_tiles.cuh;
//    the kernels check their shared memory at entry).
//
// instantiations-per-module: 1  (each takes seconds to build: more threads at a cold start)
// instantiate: gemm_fp32_kernel<float, {false, true}, {false, true}>; gemm_fp32_kernel<float, {false, true}, {false, true}, 64, 64>
// instantiate: gemm_tf32_kernel<float, {false, true}, {false, true}>; gemm_tf32_kernel<float, {false, true}, {false, true}, 64>
// instantiate: gemm_b16_kernel<{__half, __nv_bfloat16}, {false, true}, {false, true}>; gemm_b16_kernel<{__half, __nv_bfloat16}, {false, true}, {false, true}, 64>
// instantiate: splitk_reduce_kernel<float>; splitk_reduce_kernel<{__half, __nv_bfloat16}, float>
// instantiate: splitk_reduce_warp_kernel<float>; splitk_reduce_warp_kernel<{__nv_bfloat16, __half}, float>

#include "gemm_tiles.cuh"

// Writes one output element: `=` (or `+= beta*C`) into C, or the raw partial into a split-K
// workspace slice (alpha 1, beta 0, no bias).
template <typename T = float>
struct GemmEpilogue {
  T* c;
  int ldc, M, N;
  float alpha, beta;
  const T* bias;
  int bias_mode;

  __device__ __forceinline__ void store(int m, int n, float v) const {
    if (m >= M || n >= N) return;
    v = epilogue_value(v, alpha, bias, bias_mode, m, n);
    T* p = c + (long long)m * ldc + n;
    if (beta != 0.f) v += beta * as<float>(*p);
    *p = as<T>(v);
  }
};

// Where this block's tile goes: C[b], or split s of the workspace.
__device__ __forceinline__ GemmEpilogue<> gemm_epilogue(float* C, float* ws, const float* bias,
                                                      int M, int N, int ldc, long long sC,
                                                      int batch, int splits, int b, int s,
                                                      float alpha, float beta, int bias_mode) {
  if (splits == 1) return {C + b * sC, ldc, M, N, alpha, beta, bias, bias_mode};
  return {ws + (s * (long long)batch + b) * M * N, N, M, N, 1.f, 0.f, nullptr, 0};
}

// `=` of the tile's accumulators into the (M, N) matrix D (rows ldd apart; D and ldd 16-byte
// aligned) through shared memory: staged as E (alpha and bias applied), then each thread
// stores whole 16-byte row segments. A fragment holds 2 columns of 8 rows, so storing it
// directly half-fills its sectors and costs an instruction per element. `smem` must hold
// BM x (BN + 16 bytes) of E (staged_fits); the main loop must be done with it.
template <class Cfg, typename E>
__host__ __device__ constexpr bool staged_fits(int smem_bytes) {
  return Cfg::BM * (Cfg::BN + 16 / (int)sizeof(E)) * (int)sizeof(E) <= smem_bytes;
}

template <class Cfg, typename E, typename B>
__device__ __forceinline__ void store_staged(void* smem_raw,
                                             const float (&acc)[Cfg::MT][Cfg::NT][4], E* D,
                                             int ldd, int M, int N, int m0, int n0, float alpha,
                                             const B* bias, int bias_mode) {
  constexpr int V = 16 / sizeof(E), PITCH = Cfg::BN + V;  // +16 bytes: fewer bank conflicts
  E* smem = reinterpret_cast<E*>(smem_raw);
  __syncthreads();  // every warp is done reading the main loop's tiles
  MmaCoords<Cfg>().for_each(acc, [&](int r, int c, int, float v) {
    // (a bias index out of the matrix only reaches elements that are never stored)
    const int mode = m0 + r < M && n0 + c < N ? bias_mode : bias_mode & EPI_RELU;
    smem[r * PITCH + c] = as<E>(epilogue_value(v, alpha, bias, mode, m0 + r, n0 + c));
  });
  __syncthreads();
  constexpr int SEGS = Cfg::BN / V;  // 16-byte segments per tile row
  for (int i = threadIdx.x; i < Cfg::BM * SEGS; i += Cfg::THREADS) {
    const int r = i / SEGS, c = (i - r * SEGS) * V, m = m0 + r, n = n0 + c;
    if (m >= M || n >= N) continue;
    E* dst = D + (long long)m * ldd + n;
    const E* src = smem + r * PITCH + c;
    if (n + V <= N) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int q = 0; q < N - n; ++q) dst[q] = src[q];
    }
  }
}

// The general epilogue: epi.store(m, n, v) for every element of the tile, from the raw
// accumulators staged in shared memory ROWS rows at a time, in a rolled loop. This path (beta
// != 0, unaligned C, split-K partials of odd N) is rarely the hot one: rolled, it compiles
// once instead of once per accumulator (unrolled, it was over a second of NVRTC time per
// GEMM kernel), and its stores run along rows.
template <class Cfg, int SMEM>
__host__ __device__ constexpr int rolled_rows() {
  int rows = Cfg::BM;
  while (rows > 16 && rows * (Cfg::BN + 4) * 4 > SMEM) rows /= 2;
  return rows;
}

template <class Cfg, int SMEM, class Epi>
__device__ __forceinline__ void store_rolled(void* smem_raw,
                                             const float (&acc)[Cfg::MT][Cfg::NT][4],
                                             const Epi& epi, int m0, int n0) {
  constexpr int PITCH = Cfg::BN + 4, ROWS = rolled_rows<Cfg, SMEM>();
  static_assert(ROWS * PITCH * 4 <= SMEM, "the staged rows fit");
  float* smem = reinterpret_cast<float*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cols = min(Cfg::BN, epi.N - n0);
#pragma unroll 1
  for (int r0 = 0; r0 < Cfg::BM && m0 + r0 < epi.M; r0 += ROWS) {
    __syncthreads();  // the main loop's tiles (or the previous rows) are read
    MmaCoords<Cfg>().for_each(acc, [&](int r, int c, int, float v) {
      if (r >= r0 && r < r0 + ROWS) smem[(r - r0) * PITCH + c] = v;
    });
    __syncthreads();
    const int rows = min(ROWS, epi.M - m0 - r0);
#pragma unroll 1
    for (int r = warp; r < rows; r += Cfg::THREADS / 32)
#pragma unroll 1
      for (int c = lane; c < cols; c += 32) epi.store(m0 + r0 + r, n0 + c, smem[r * PITCH + c]);
  }
}

// Whether C takes staged 16-byte stores: `=` (beta 0) into 16-byte aligned rows.
__device__ __forceinline__ bool c_staged(const void* C, int ldc, long long sC, int elem_bytes,
                                         float beta) {
  const int v = 16 / elem_bytes;
  return beta == 0.f && ldc % v == 0 && sC % v == 0 &&
         (reinterpret_cast<unsigned long long>(C) & 15) == 0;
}

// The split-K partials of this tile: ws slice (s, b), rows N apart, staged where the tile fits
// the kernel's shared memory and N keeps rows 16-byte aligned.
template <class Cfg, int SMEM>
__device__ __forceinline__ void store_partials(void* smem, const float (&acc)[Cfg::MT][Cfg::NT][4],
                                               float* ws, int M, int N, int m0, int n0, int b,
                                               int s, int batch) {
  float* w = ws + (s * (long long)batch + b) * M * N;
  if constexpr (staged_fits<Cfg, float>(SMEM)) {
    if (N % 4 == 0) {
      store_staged<Cfg, float, float>(smem, acc, w, N, M, N, m0, n0, 1.f, nullptr, 0);
      return;
    }
  }
  store_rolled<Cfg, SMEM>(smem, acc, GemmEpilogue<float>{w, N, M, N, 1.f, 0.f, nullptr, 0}, m0,
                          n0);
}

#define GEMM_PARAMS                                                                          \
  const T *__restrict__ A, const T *__restrict__ B, T *C, const T *__restrict__ bias, float *ws, \
      int M, int N, int K, int lda, int ldb, int ldc, long long sA, long long sB,           \
      long long sC, int batch, int splits, int kchunk, float alpha, float beta,             \
      int bias_mode, int vec_a, int vec_b

// This block's batch b, split s, tile origin (m0, n0), K range and operand loaders.
#define GEMM_TILE                                                                           \
  const int b = blockIdx.z / splits, s = blockIdx.z - b * splits;                          \
  const int m0 = blockIdx.y * Cfg::BM, n0 = blockIdx.x * Cfg::BN;                          \
  const int k_begin = s * kchunk, k_end = min(K, k_begin + kchunk);                        \
  const DenseLoader<LayA, !TA, Cfg::THREADS> la{A + b * sA, lda, m0, M, vec_a != 0};      \
  const DenseLoader<LayB, TB, Cfg::THREADS> lb{B + b * sB, ldb, n0, N, vec_b != 0}

template <typename T, bool TA, bool TB, int BM = 128>
__global__ void __launch_bounds__(128, 2) gemm_tf32_kernel(GEMM_PARAMS) {
  static_assert(sizeof(T) == 4, "float only for now");
  // 4 warps of 64x64: 32 mma per 8-wide k step per warp against 16 fragment loads (64x32
  // warp tiles measured 11% slower; see NOTES-gemm.md). BM 64 (warps of 32x64): twice the
  // blocks, half the work each, for products whose 128-row tiles leave SMs idle.
  using Cfg = MmaCfg<BM, 128, 32, 2, 2, 3>;
  // Each operand's smem tile keeps its source's contiguous direction (16-byte copies);
  // padding 4 (K-major) / 8 (MN-major) makes the fragment reads conflict-free.
  using LayA = TileLayout<Cfg::BM, Cfg::BK, !TA, TA ? 8 : 4>;
  using LayB = TileLayout<Cfg::BN, Cfg::BK, TB, TB ? 4 : 8>;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  check_smem(Cfg::STAGES * (LayA::kSize + LayB::kSize) * 4);

  GEMM_TILE;

  float acc[Cfg::MT][Cfg::NT][4];
  mma_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);

  constexpr int SMEM = Cfg::STAGES * (LayA::kSize + LayB::kSize) * 4;
  if (splits > 1) {
    store_partials<Cfg, SMEM>(smem, acc, ws, M, N, m0, n0, b, s, batch);
  } else if (c_staged(C, ldc, sC, 4, beta)) {
    static_assert(staged_fits<Cfg, float>(SMEM), "the staged tile fits");
    store_staged<Cfg, float, float>(smem, acc, C + b * sC, ldc, M, N, m0, n0, alpha, bias,
                                    bias_mode);
  } else {
    const GemmEpilogue<float> epi{C + b * sC, ldc, M, N, alpha, beta, bias, bias_mode};
    store_rolled<Cfg, SMEM>(smem, acc, epi, m0, n0);
  }
}

template <typename T, bool TA, bool TB, int BM = 128>
__global__ void __launch_bounds__(128, 2) gemm_b16_kernel(GEMM_PARAMS) {
  static_assert(sizeof(T) == 2, "16-bit operands");
  using Cfg = MmaCfg<BM, 128, 32, 2, 2, 3>;  // BM 64: twice the blocks for small products
  // Rows padded by 8 elements (16 bytes): ldmatrix's eight row reads hit distinct banks.
  using LayA = TileLayout<Cfg::BM, Cfg::BK, !TA, 8, T>;
  using LayB = TileLayout<Cfg::BN, Cfg::BK, TB, 8, T>;
  extern __shared__ float4 smem4[];
  T* smem = reinterpret_cast<T*>(smem4);
  check_smem(Cfg::STAGES * (LayA::kSize + LayB::kSize) * sizeof(T));

  GEMM_TILE;

  float acc[Cfg::MT][Cfg::NT][4];
  mma16_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);

  constexpr int SMEM = Cfg::STAGES * (LayA::kSize + LayB::kSize) * sizeof(T);
  if (splits > 1) {
    store_partials<Cfg, SMEM>(smem, acc, ws, M, N, m0, n0, b, s, batch);
  } else if (c_staged(C, ldc, sC, sizeof(T), beta)) {
    static_assert(staged_fits<Cfg, T>(SMEM), "the staged tile fits");
    store_staged<Cfg, T, T>(smem, acc, C + b * sC, ldc, M, N, m0, n0, alpha, bias, bias_mode);
  } else {
    const GemmEpilogue<T> epi{C + b * sC, ldc, M, N, alpha, beta, bias, bias_mode};
    store_rolled<Cfg, SMEM>(smem, acc, epi, m0, n0);
  }
}

template <typename T, bool TA, bool TB, int BM = 128, int BN = 128>
__global__ void __launch_bounds__(256, 2) gemm_fp32_kernel(GEMM_PARAMS) {
  static_assert(sizeof(T) == 4, "float only for now");
  // BK 16, 3 stages: 5% faster than BK 8, 4 stages. 64 x 64 (4 x 4 per thread): four times
  // the blocks for products whose 128 x 128 tiles leave SMs idle (a ViT's 64-wide layers).
  using Cfg = SimtCfg<BM, BN, 16, 3>;
  // Both tiles [k][mn] for vector reads along m and n; a K-major source is transposed by
  // 4-byte copies (8 lanes along k, 4 rows: conflict-free with the +4 padding).
  using LayA = TileLayout<Cfg::BM, Cfg::BK, false, 4>;
  using LayB = TileLayout<Cfg::BN, Cfg::BK, false, 4>;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  check_smem(Cfg::STAGES * (LayA::kSize + LayB::kSize) * 4);

  GEMM_TILE;

  float acc[Cfg::TM][Cfg::TN];
  simt_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);

  const GemmEpilogue<> epi =
      gemm_epilogue(C, ws, bias, M, N, ldc, sC, batch, splits, b, s, alpha, beta, bias_mode);
  const SimtCoords<Cfg> at;
  // V consecutive columns (a thread's half-row) per store where the whole segment is in
  // bounds and aligned.
  constexpr int V = Cfg::TN / 2 < 4 ? Cfg::TN / 2 : 4;
  const bool vec_c = splits > 1 ? (N % V == 0) : (ldc % V == 0 && sC % V == 0 &&
                                                  (reinterpret_cast<unsigned long long>(C) & (4 * V - 1)) == 0);
#pragma unroll
  for (int i = 0; i < Cfg::TM; ++i) {
    const int m = m0 + at.row(i);
#pragma unroll
    for (int j = 0; j < Cfg::TN; j += V) {
      const int n = n0 + at.col(j);
      if (vec_c && m < M && n + V - 1 < N && epi.beta == 0.f && epi.bias_mode == 0) {
        const float a = epi.alpha;
        float* c = epi.c + (long long)m * epi.ldc + n;
        if constexpr (V == 4)
          *reinterpret_cast<float4*>(c) =
              make_float4(a * acc[i][j], a * acc[i][j + 1], a * acc[i][j + 2], a * acc[i][j + 3]);
        else
          *reinterpret_cast<float2*>(c) = make_float2(a * acc[i][j], a * acc[i][j + 1]);
      } else {
#pragma unroll
        for (int q = 0; q < V; ++q) epi.store(m, n + q, acc[i][j + q]);
      }
    }
  }
}
