// reduce.cu: sum and max over arbitrary axes (also serving sum_to_shape and bias_grad),
// max_backward and count_correct. Launchers: dptrain/backend/cuda/reduce.py.
//
// Conventions
//  * Strided formulation, no transpose copy: output m (row-major over the kept axes) reduces
//    the K elements at  offset(m, Lk) + offset(k, Lr),  k < K, where Lk / Lr hold the kept /
//    reduced axes' shapes and element strides (s0; s1 unused). The output is contiguous.
//  * Split: entry v = m*S + s of `out` reduces k in [s*chunk, min(K, (s+1)*chunk)). S = 1 is a
//    plain reduction; S > 1 writes partials that a second launch (S as the reduced axis) folds.
//  * A group of G threads (G a power of two <= 32, or G == blockDim.x) computes one entry:
//    member j takes k = k0 + j, k0 + j + G, ... then a fixed shuffle / shared-memory tree.
//    G, S and chunk come from the shapes alone, so the summation order is fixed: results are
//    deterministic run to run (no atomics anywhere).
//  * Sums accumulate in double (A); max in T, propagating NaN as np.max does (__half: float).
//  * All outputs are written with `=`.

#include "common.cuh"

// The combining operations (SumOp, MaxOp) and the group / block trees are in common.cuh.

// See the header: out has M*S entries.
template <typename Tin, typename A, typename Tout, typename Op>
__global__ void reduce_kernel(Tout* out, const Tin* in, int M, int S, int K, int chunk,
                              Layout Lk, Layout Lr, int G) {
  const int total = M * S;
  if (G == (int)blockDim.x) {
    __shared__ A shared[32];
    for (int v = blockIdx.x; v < total; v += gridDim.x) {
      const int m = v / S, s = v - m * S;
      const int k0 = s * chunk, k1 = min(K, k0 + chunk);
      const int base = layout_offset(m, Lk);
      A acc = Op::template identity<A>();
      for (int k = k0 + threadIdx.x; k < k1; k += blockDim.x)
        acc = Op::template combine<A>(acc, as<A>(in[base + layout_offset(k, Lr)]));
      acc = block_reduce<A, Op>(acc, shared);
      if (threadIdx.x == 0) out[v] = as<Tout>(acc);
    }
    return;
  }
  const int groups = blockDim.x / G, g = threadIdx.x / G, j = threadIdx.x - g * G;
  // `first` is uniform across the block, so every warp runs the shuffles together.
  for (int first = blockIdx.x * groups; first < total; first += gridDim.x * groups) {
    const int v = first + g;
    A acc = Op::template identity<A>();
    if (v < total) {
      const int m = v / S, s = v - m * S;
      const int k0 = s * chunk, k1 = min(K, k0 + chunk);
      const int base = layout_offset(m, Lk);
      for (int k = k0 + j; k < k1; k += G)
        acc = Op::template combine<A>(acc, as<A>(in[base + layout_offset(k, Lr)]));
    }
    acc = group_reduce<A, Op>(acc, G);
    if (v < total && j == 0) out[v] = as<Tout>(acc);
  }
}

// bias_grad of a (N, C, P) array, P = the pixels of one plane (> 1): part[s*C + c] = sum of
// in[n, c, :] over images n of split s (n in [s*chunk, (s+1)*chunk)), one block per (c, s).
// Warp w of the block takes planes n = s*chunk + w, + nwarps, ...; its lanes read a plane
// along its contiguous axis, eight loads in flight each (the loop is unrolled, the adds
// trail the loads), then block_reduce; channel_sum_fold_kernel adds the S partials of each
// channel in order. (The generic reduce_kernel, a layout division per element and one load
// in flight, ran at a third of the memory's bandwidth here.)
template <typename T>
__global__ void channel_sum_kernel(double* part, const T* __restrict__ in, int N, int C, int P,
                                   int chunk) {
  __shared__ double shared[32];
  const int c = blockIdx.x, s = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int n1 = min(N, (s + 1) * chunk);
  double acc = 0.0;
  for (int n = s * chunk + warp; n < n1; n += nwarps) {
    const T* plane = in + ((long long)n * C + c) * P;
#pragma unroll 8
    for (int p = lane; p < P; p += 32) acc += as<double>(plane[p]);
  }
  acc = block_reduce<double, SumOp>(acc, shared);
  if (threadIdx.x == 0) part[(long long)s * C + c] = acc;
}

// out[c] = the sum rounded to T, or with `accumulate` out[c] + that (a bias gradient added
// into its .grad as add_ adds it: the rounded sum, then one rounding of the addition).
template <typename T>
__device__ __forceinline__ void write_sum(T* out, int c, double acc, int accumulate) {
  if (!accumulate) {
    out[c] = as<T>(acc);
  } else if constexpr (sizeof(T) == 8) {
    out[c] += acc;
  } else {
    out[c] = as<T>(as<float>(out[c]) + as<float>(as<T>(acc)));
  }
}

template <typename T>
__global__ void channel_sum_fold_kernel(T* out, const double* part, int S, int C,
                                        int accumulate) {
  GRID_STRIDE_32(c, C) {
    double acc = 0.0;
    for (int s = 0; s < S; ++s) acc += part[(long long)s * C + c];
    write_sum(out, c, acc, accumulate);
  }
}

// Rows [s*chunk, (s+1)*chunk) of column c of a row-major (R, C) array, summed in double.
template <typename T>
__device__ __forceinline__ double column_partial(const T* __restrict__ in, int R, int C, int c,
                                                 int s, int chunk) {
  const int r1 = min(R, (s + 1) * chunk);
  double acc = 0.0;
#pragma unroll 8
  for (int r = s * chunk; r < r1; ++r) acc += as<double>(in[(long long)r * C + c]);
  return acc;
}

// Sum over the leading rows of a contiguous (R, C) array with few columns (a bias gradient of
// (tokens, features), the parameter gradients of a layer norm): part[s*C + c] = sum of
// in[r, c] over rows r of split s (r in [s*chunk, (s+1)*chunk)). Threads run along c
// (blockDim.x of them: one warp reads consecutive columns, coalesced), blockDim.y splits per
// block; channel_sum_fold_kernel then adds each column's partials in split order. (The
// generic reduce_kernel gave each column one group of lanes reading down the rows: a sector
// per element.)
template <typename T>
__global__ void column_sum_kernel(double* part, const T* __restrict__ in, int R, int C, int S,
                                  int chunk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y * blockDim.y + threadIdx.y;
  if (c >= C || s >= S) return;
  part[(long long)s * C + c] = column_partial(in, R, C, c, s, chunk);
}

// The same sums and fold in one launch where a block holds every split of its columns
// (blockDim = (32, S), S <= 32: a batch of up to 1024 rows): the partials meet in shared
// memory and thread y = 0 adds them in split order, as channel_sum_fold_kernel would.
template <typename T>
__global__ void column_sum_folded_kernel(T* out, const T* __restrict__ in, int R, int C,
                                         int chunk, int accumulate) {
  __shared__ double part[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x, s = threadIdx.y;
  part[s][threadIdx.x] = c < C ? column_partial(in, R, C, c, s, chunk) : 0.0;
  __syncthreads();
  if (s != 0 || c >= C) return;
  double acc = 0.0;
  for (int i = 0; i < blockDim.y; ++i) acc += part[i][threadIdx.x];
  write_sum(out, c, acc, accumulate);
}

// Gradient of max: gx = (x == y[m]) ? gy[m] / count[m] : 0, count = number of ties in output
// m's K elements. x and gx are contiguous with the same layout; a group of G <= 32 lanes per
// output counts the ties, then every lane writes its own elements.
template <typename T>
__global__ void max_backward_kernel(T* gx, const T* x, const T* y, const T* gy, int M, int K,
                                    Layout Lk, Layout Lr, int G) {
  const int groups = blockDim.x / G, g = threadIdx.x / G, j = threadIdx.x - g * G;
  for (int first = blockIdx.x * groups; first < M; first += gridDim.x * groups) {
    const int m = first + g;
    const bool active = m < M;
    const int base = active ? layout_offset(m, Lk) : 0;
    const T ym = active ? y[m] : T(0);
    int count = 0;
    if (active)
      for (int k = j; k < K; k += G) count += x[base + layout_offset(k, Lr)] == ym;
    count = group_reduce<int, SumOp>(count, G);
    count = __shfl_sync(FULL_MASK, count, 0, G);  // lane 0 of the group holds the total
    if (active) {
      const T share = gy[m] / T(count);
      for (int k = j; k < K; k += G) {
        const int o = base + layout_offset(k, Lr);
        gx[o] = x[o] == ym ? share : T(0);
      }
    }
  }
}

// Rows whose arg-max (first maximum, NaN counting as the maximum, as np.argmax) equals the
// label, written as one float. One block; integer counts, so the order does not matter.
template <typename T, typename L>
__global__ void count_correct_kernel(float* out, const T* logits, const L* labels, int N, int C) {
  __shared__ int shared[32];
  int hits = 0;
  for (int r = threadIdx.x; r < N; r += blockDim.x) {
    const T* row = logits + (long long)r * C;
    compute_t<T> best = as<compute_t<T>>(row[0]);  // 16-bit logits compared as float: exact
    int arg = 0;
    for (int c = 1; c < C; ++c) {
      const compute_t<T> v = as<compute_t<T>>(row[c]);
      if (v > best || (v != v && best == best)) { best = v; arg = c; }
    }
    hits += (long long)arg == (long long)labels[r];
  }
  hits = block_reduce<int, SumOp>(hits, shared);
  if (threadIdx.x == 0) out[0] = float(hits);
}

// out[a * B + b] = the sum over k < K of in[(a * K + k) * B + b], in double, k in order: a
// sum over the middle axes of a contiguous array (channels-last global pooling's (N, H * W,
// C)). reduce_kernel's one-thread-per-output order, so the same bits, without its layout
// division per element; neighbouring threads read neighbouring b. (reduce_kernel: ResNet-50's
// pooling at batch 256, fp16, 51 MB in 52 us, H200.)
template <typename T, typename Tout>
__global__ void middle_sum_kernel(Tout* out, const T* __restrict__ in, int A, int K, int B) {
  GRID_STRIDE_32(i, A * B) {
    const int a = i / B;
    const T* p = in + ((long long)a * K - a) * B + i;  // element (a, 0, i - a * B)
    double acc = 0.0;
#pragma unroll 8
    for (int k = 0; k < K; ++k) acc += as<double>(p[(long long)k * B]);
    out[i] = as<Tout>(acc);
  }
}

// instantiations-per-module: 3  (built whole every run: a shorter longest module)
// instantiate: reduce_kernel<{float, double, __half, __nv_bfloat16}, double, {float, double}, SumOp>; reduce_kernel<{__half, double}, double, __half, SumOp>; reduce_kernel<{__nv_bfloat16, double}, double, __nv_bfloat16, SumOp>; reduce_kernel<double, double, double, MaxOp>; reduce_kernel<float, float, {float, __half, __nv_bfloat16}, MaxOp>; reduce_kernel<__half, float, {__half, float}, MaxOp>; reduce_kernel<__nv_bfloat16, float, {__nv_bfloat16, float}, MaxOp>
// instantiate: max_backward_kernel<{float, double}>
// instantiate: channel_sum_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: channel_sum_fold_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: count_correct_kernel<{float, double, __half, __nv_bfloat16}, {int, long long}>
// instantiate: column_sum_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: column_sum_folded_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: middle_sum_kernel<{float, double, __half, __nv_bfloat16}, {float, double}>; middle_sum_kernel<__half, __half>; middle_sum_kernel<__nv_bfloat16, __nv_bfloat16>
