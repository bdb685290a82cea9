// gemm_thin.cu: C = A @ B (+ bias) (ReLU) (+ beta * C) where N or K is at most THIN (16): a
// classifier's products with its few classes (x @ W^T with N = 7, dY @ W with K = 7). The
// tiled tensor-core kernels spend a whole 64 x 128 x 32 tile on them, mostly padding, and
// split K over many blocks with a reduce pass after; these kernels use CUDA cores, read each
// operand once and write C once. (M small, the weight gradient dY^T @ X, stays tiled: a
// block per 32 columns of C left most SMs idle and ran 1.5x slower.) Launcher and choice of
// the products these measured faster on: dptrain/backend/cuda/gemm.py (_thin_kernel).
//
// Conventions
//  * A[m, k] = A[m * sam + k * sak], B[k, n] = B[k * sbk + n * sbn] (element strides: a
//    transposed operand is the same memory with its strides swapped); C row-major, rows ldc
//    apart. One matrix, no batch.
//  * float, __half or __nv_bfloat16 operands (C the same type), float accumulation in a fixed
//    order (bitwise repeatable), rounded once; float operands are not rounded to TF32.
//  * bias_mode and beta as gemm.cu's: bias_mode 1 adds bias[n], 2 bias[m], + EPI_RELU (4)
//    then ReLU; beta != 0 adds beta * C (the gradient accumulation), C is read only then.
//  * Each output is stored by gemm_tiles.cuh's splitk_store, as split-K's reduce stores.
//
// instantiate: gemm_thin_k_kernel<{float, __half, __nv_bfloat16}>
// instantiate: gemm_thin_n_kernel<{float, __half, __nv_bfloat16}, {8, 16}>

#include "common.cuh"
#include "gemm_tiles.cuh"

// Element offsets are int: the launcher takes products of at most 2^21 multiply-adds, so no
// operand holds 2^31 elements (64-bit address arithmetic doubled these kernels' instructions).
#define THIN_PARAMS                                                                      \
  const T *__restrict__ A, const T *__restrict__ B, T *C, const T *__restrict__ bias,   \
      int M, int N, int K, int sam, int sak, int sbk, int sbn, int ldc, float beta,     \
      int bias_mode

// K <= THIN (gemm.py's, 16): a thread per output, consecutive threads along n (B's rows and
// C's rows are read and written along n), the few products in k order.
template <typename T>
__global__ void __launch_bounds__(256) gemm_thin_k_kernel(THIN_PARAMS) {
  GRID_STRIDE_32(i, M * N) {
    const int m = i / N, n = i - m * N;
    float acc = 0.f;
    for (int k = 0; k < K; ++k)
      acc += as<float>(A[m * sam + k * sak]) * as<float>(B[k * sbk + n * sbn]);
    splitk_store<T, float>(C, bias, acc, 0, m, n, ldc, 0, 1.f, beta, bias_mode);
  }
}

// N <= NMAX (8 or 16): a warp per row m, lanes along k (A's row read once, coalesced where
// sak is 1), each lane's partial sums then added across the warp (column_sums). Each lane
// loads THIN_UNROLL values of k before it adds any. Blocks of two warps: a product of 256
// rows spreads over 128 SMs, not 32 (blocks of 8 warps measured 1.2x slower than the tiled
// kernel and its split-K reduce).
constexpr int THIN_UNROLL = 8;

template <typename T, int NMAX>
__device__ __forceinline__ void thin_n_step(float (&acc)[NMAX], float a, const T* b, int N,
                                            int sbn) {
#pragma unroll
  for (int j = 0; j < NMAX; ++j)
    if (j < N) acc[j] += a * as<float>(b[j * sbn]);
}

// Each lane's NMAX partial sums added across the warp: halves swapped with the lane `off`
// away (the upper lane keeps the upper half), so each exchange moves half as many values,
// then the lanes left holding one column finish with a butterfly. 9 shuffles for 8 columns
// where a butterfly per column takes 40. Returns column lane / (32 / NMAX)'s sum; the
// order of additions is fixed.
template <int NMAX>
__device__ __forceinline__ float column_sums(float (&acc)[NMAX], int lane) {
  static_assert(NMAX >= 1 && NMAX <= 32 && (NMAX & (NMAX - 1)) == 0, "a power of two");
  int off = 16;
#pragma unroll
  for (int half = NMAX / 2; half >= 1; half /= 2, off /= 2) {
    const bool upper = lane & off;
#pragma unroll
    for (int q = 0; q < half; ++q) {
      const float keep = upper ? acc[q + half] : acc[q], send = upper ? acc[q] : acc[q + half];
      acc[q] = keep + __shfl_xor_sync(FULL_MASK, send, off);
    }
  }
  float v = acc[0];
  for (; off > 0; off /= 2) v += __shfl_xor_sync(FULL_MASK, v, off);
  return v;
}

template <typename T, int NMAX>
__global__ void __launch_bounds__(64) gemm_thin_n_kernel(THIN_PARAMS) {
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(m, M) {
    float acc[NMAX];
#pragma unroll
    for (int j = 0; j < NMAX; ++j) acc[j] = 0.f;
    const T* a_row = A + m * sam;
    int k = lane;
    for (; k + 32 * (THIN_UNROLL - 1) < K; k += 32 * THIN_UNROLL) {
      float a[THIN_UNROLL];
#pragma unroll
      for (int u = 0; u < THIN_UNROLL; ++u) a[u] = as<float>(a_row[(k + 32 * u) * sak]);
#pragma unroll
      for (int u = 0; u < THIN_UNROLL; ++u) thin_n_step(acc, a[u], B + (k + 32 * u) * sbk, N, sbn);
    }
    for (; k < K; k += 32) thin_n_step(acc, as<float>(a_row[k * sak]), B + k * sbk, N, sbn);
    const float sum = column_sums(acc, lane);
    const int group = 32 / NMAX, n = lane / group;
    if (lane % group == 0 && n < N)
      splitk_store<T, float>(C, bias, sum, 0, m, n, ldc, 0, 1.f, beta, bias_mode);
  }
}
