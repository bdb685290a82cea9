// reduce.cu: sum and max over arbitrary axes (also serving sum_to_shape and bias_grad),
// max_backward and count_correct. Launchers: dptrain/backend/cuda.py.
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
//  * Sums accumulate in double (A); max in T, propagating NaN as np.max does.
//  * All outputs are written with `=`.

#define DP_MAX_DIMS 8
#define FULL_MASK 0xffffffffu

struct Layout {
  int ndim;
  int shape[DP_MAX_DIMS];
  int s0[DP_MAX_DIMS];
  int s1[DP_MAX_DIMS];
};

// Offset (stride s0) of row-major flat index i.
__device__ __forceinline__ int layout_offset(int i, const Layout& L) {
  int o = 0;
#pragma unroll
  for (int d = DP_MAX_DIMS - 1; d >= 1; --d) {
    if (d < L.ndim) {
      const int n = L.shape[d];
      const int q = i / n;
      o += (i - q * n) * L.s0[d];
      i = q;
    }
  }
  return o + i * L.s0[0];  // axis 0: no division needed (s0[0] is 0 when ndim == 0)
}

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float((int)0xff800000u); }
template <> __device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double((long long)0xfff0000000000000ull);
}

struct SumOp {
  template <typename A> __device__ static A identity() { return A(0); }
  template <typename A> __device__ static A combine(A a, A b) { return a + b; }
};
struct MaxOp {
  template <typename A> __device__ static A identity() { return neg_inf<A>(); }
  // NaN wins: once acc is NaN it stays NaN, and a NaN element replaces acc.
  template <typename A> __device__ static A combine(A a, A b) { return (b > a || b != b) ? b : a; }
};

// Tree over the G (power of two <= 32) lanes of a group; the result is valid in its lane 0.
// All 32 lanes of the warp must call it.
template <typename A, typename Op>
__device__ __forceinline__ A group_reduce(A v, int G) {
  for (int off = G / 2; off > 0; off >>= 1)
    v = Op::template combine<A>(v, __shfl_down_sync(FULL_MASK, v, off, G));
  return v;
}

// Tree over the whole block (blockDim.x a multiple of 32, <= 1024); result valid in thread 0.
template <typename A, typename Op>
__device__ __forceinline__ A block_reduce(A v, A* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = group_reduce<A, Op>(v, 32);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? shared[lane] : Op::template identity<A>();
    v = group_reduce<A, Op>(v, 32);
  }
  __syncthreads();  // shared is reused by the caller's next iteration
  return v;
}

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
        acc = Op::template combine<A>(acc, A(in[base + layout_offset(k, Lr)]));
      acc = block_reduce<A, Op>(acc, shared);
      if (threadIdx.x == 0) out[v] = Tout(acc);
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
        acc = Op::template combine<A>(acc, A(in[base + layout_offset(k, Lr)]));
    }
    acc = group_reduce<A, Op>(acc, G);
    if (v < total && j == 0) out[v] = Tout(acc);
  }
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
    T best = row[0];
    int arg = 0;
    for (int c = 1; c < C; ++c) {
      const T v = row[c];
      if (v > best || (v != v && best == best)) { best = v; arg = c; }
    }
    hits += (long long)arg == (long long)labels[r];
  }
  hits = block_reduce<int, SumOp>(hits, shared);
  if (threadIdx.x == 0) out[0] = float(hits);
}

// instantiate: reduce_kernel<float, double, float, SumOp>; reduce_kernel<float, double, double, SumOp>; reduce_kernel<double, double, float, SumOp>; reduce_kernel<double, double, double, SumOp>
// instantiate: reduce_kernel<float, float, float, MaxOp>; reduce_kernel<double, double, double, MaxOp>
// instantiate: max_backward_kernel<float>; max_backward_kernel<double>
// instantiate: count_correct_kernel<float, int>; count_correct_kernel<float, long long>; count_correct_kernel<double, int>; count_correct_kernel<double, long long>
