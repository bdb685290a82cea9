// common.cuh: what the kernel files share. Included by every .cu file here (the loader hashes
// local headers into its cache key, so editing this one recompiles them all).
//
// Conventions
//  * Grid-stride loops: every kernel loops so that any grid covers any size; the launcher caps
//    the grid. GRID_STRIDE counts in long long, GRID_STRIDE_32 in int (where the launcher has
//    asserted the count fits: strided kernels index through a Layout of int strides).
//  * Warp-level helpers assume all 32 lanes of the warp call them (FULL_MASK).
//  * Math helpers dispatch on the element type (float or double): NVRTC has no <cmath>
//    overload set we can rely on.
//  * 16-bit floats (__half, __nv_bfloat16) are storage types: kernels load them into
//    compute_t<T> (float) and round once when they store.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FULL_MASK 0xffffffffu
#define DP_MAX_DIMS 8

#define GRID_STRIDE(i, n)                                                              \
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n);       \
       i += (long long)gridDim.x * blockDim.x)

#define GRID_STRIDE_32(i, n) \
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)

// The row loop of warp-per-row kernels: warp w of the grid takes rows w, w + nwarps, ...
// (uniform within the warp, so its lanes can shuffle together).
#define FOR_EACH_ROW(row, R)                                                          \
  for (int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < (R);             \
       row += (gridDim.x * blockDim.x) >> 5)

// ----------------------------------------------------------------------------- strided layouts

// A shape plus the element strides of two operands (s0 for the output or first operand, s1
// for the input or second); stride 0 broadcasts, a negative stride reverses. Passed by value
// (the launcher builds it as a NumPy structured array with these fields).
struct Layout {
  int ndim;
  int shape[DP_MAX_DIMS];
  int s0[DP_MAX_DIMS];
  int s1[DP_MAX_DIMS];
};

// Offsets in both operands of row-major flat index i. Unrolled so the Layout stays in
// parameter space (no local-memory copy).
__device__ __forceinline__ void layout_offsets(int i, const Layout& L, int& o0, int& o1) {
  o0 = 0;
  o1 = 0;
#pragma unroll
  for (int d = DP_MAX_DIMS - 1; d >= 1; --d) {
    if (d < L.ndim) {
      const int n = L.shape[d];
      const int q = i / n;
      const int r = i - q * n;
      o0 += r * L.s0[d];
      o1 += r * L.s1[d];
      i = q;
    }
  }
  // Axis 0 needs no division: what is left of i is its index (0 when ndim == 0, where the
  // zeroed strides make it vanish anyway).
  o0 += i * L.s0[0];
  o1 += i * L.s1[0];
}

// Offset (stride s0 only) of row-major flat index i.
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

// ----------------------------------------------------------------------------- math by type

__device__ __forceinline__ float dp_exp(float x) { return expf(x); }
__device__ __forceinline__ double dp_exp(double x) { return exp(x); }
__device__ __forceinline__ float dp_log(float x) { return logf(x); }
__device__ __forceinline__ double dp_log(double x) { return log(x); }
__device__ __forceinline__ float dp_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dp_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float dp_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double dp_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float dp_pow(float x, float p) { return powf(x, p); }
__device__ __forceinline__ double dp_pow(double x, double p) { return pow(x, p); }
__device__ __forceinline__ float dp_erf(float x) { return erff(x); }
__device__ __forceinline__ double dp_erf(double x) { return erf(x); }

// Batch norm's per-channel arithmetic (norm.cu; pool.cu's batch norm + ReLU + max-pool): one
// over the standard deviation, and the normalised, scaled and shifted value (x - mean) *
// scale + bias as one fused multiply-add (so every kernel that computes it rounds alike).
template <typename T> __device__ __forceinline__ T inv_std(T var, T eps) {
  return T(1) / dp_sqrt(var + eps);
}
template <typename P> __device__ __forceinline__ P bn_affine(P x, P mu, P scale, P bias) {
  return fma(x - mu, scale, bias);
}

template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float((int)0xff800000u); }
template <> __device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double((long long)0xfff0000000000000ull);
}
template <typename T> __device__ __forceinline__ T quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double quiet_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000ll);
}

template <> __device__ __forceinline__ __half neg_inf<__half>() { return __ushort_as_half(0xfc00u); }
template <> __device__ __forceinline__ __half quiet_nan<__half>() { return __ushort_as_half(0x7e00u); }
template <> __device__ __forceinline__ __nv_bfloat16 neg_inf<__nv_bfloat16>() {
  return __ushort_as_bfloat16(0xff80u);
}
template <> __device__ __forceinline__ __nv_bfloat16 quiet_nan<__nv_bfloat16>() {
  return __ushort_as_bfloat16(0x7fc0u);
}

// The arithmetic type of an element type: 16-bit floats compute in float, the others in
// themselves.
template <typename T> struct ComputeType { using type = T; };
template <> struct ComputeType<__half> { using type = float; };
template <> struct ComputeType<__nv_bfloat16> { using type = float; };
template <typename T> using compute_t = typename ComputeType<T>::type;

// same_type<A, B>::value: std::is_same without <type_traits> (NVRTC).
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

// as<To>(v): v converted to To, rounding to nearest (even). Spelled out for the 16-bit types,
// whose many conversion operators make plain casts ambiguous.
template <typename To, typename From> __device__ __forceinline__ To as(From v) { return static_cast<To>(v); }
template <> __device__ __forceinline__ float as<float, __half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ double as<double, __half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ __half as<__half, float>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __half as<__half, double>(double v) { return __double2half(v); }
template <> __device__ __forceinline__ __half as<__half, __half>(__half v) { return v; }
template <> __device__ __forceinline__ float as<float, __nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ double as<double, __nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 as<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 as<__nv_bfloat16, double>(double v) {
  return __double2bfloat16(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 as<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16 v) {
  return v;
}

// ----------------------------------------------------------------------------- async copies

// A shared-memory address as the 32 bits PTX's shared state space takes.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte async copy (cp.async: committed by cp_async_commit, awaited by cp_async_wait);
// bytes < 16 reads only `bytes` and zero-fills the rest (0 = all zeros, nothing read).
// Source and destination must be 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N of this thread's committed cp.async groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ----------------------------------------------------------------------------- 16-byte groups

// Memory-bound kernels move GROUP<T> = 16 / sizeof(T) consecutive elements per thread: one
// 16-byte access where the launcher has found the group aligned and whole (`vec`), element by
// element otherwise (m < GROUP elements at the end of a row; lanes past m read as zero and are
// never stored).
template <typename T> struct Group { static constexpr int size = 16 / sizeof(T); };
template <typename T, int V> struct alignas(16) Pack { T v[V]; };

// kV neighbouring elements as one aligned access of kV * sizeof(T) bytes (a thread's lanes of
// channels or values, where fewer than a 16-byte group divide the row).
template <typename T, int kV> struct alignas(sizeof(T) * kV) Lanes { T v[kV]; };
template <typename T, int kV>
__device__ __forceinline__ Lanes<T, kV> load_lanes(const T* p) {
  return *reinterpret_cast<const Lanes<T, kV>*>(p);
}

// Group j of a flat kernel over n elements (a grid-stride loop over (n + V - 1) / V groups):
// its first element o, its element count m, and whether one vector access serves it (`vec`:
// the launcher found every operand aligned; the last group may be partial).
struct FlatGroup { long long o; int m; bool whole; };
template <int V>
__device__ __forceinline__ FlatGroup flat_group(long long j, long long n, int vec) {
  const long long o = j * V;
  const int m = (int)min((long long)V, n - o);
  return {o, m, vec && m == V};
}

template <typename P, typename T, int V>
__device__ __forceinline__ void load_group(P (&out)[V], const T* p, int m, bool vec) {
  if (vec) {
    const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = as<P>(pk.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = k < m ? as<P>(p[k]) : P(0);
  }
}

template <typename T, typename P, int V>
__device__ __forceinline__ void store_group(T* p, const P (&in)[V], int m, bool vec) {
  if (vec) {
    Pack<T, V> pk;
#pragma unroll
    for (int k = 0; k < V; ++k) pk.v[k] = as<T>(in[k]);
    *reinterpret_cast<Pack<T, V>*>(p) = pk;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (k < m) p[k] = as<T>(in[k]);
  }
}

// NaN-propagating max (np.max semantics): once a is NaN it stays NaN, and a NaN b replaces a.
template <typename T> __device__ __forceinline__ T nan_max(T a, T b) { return (b > a || b != b) ? b : a; }

// ----------------------------------------------------------------------------- reductions

// Combining operations: identity() and combine(acc, value).
struct SumOp {
  template <typename A> __device__ static A identity() { return A(0); }
  template <typename A> __device__ static A combine(A a, A b) { return a + b; }
};
struct MaxOp {
  template <typename A> __device__ static A identity() { return neg_inf<A>(); }
  template <typename A> __device__ static A combine(A a, A b) { return nan_max(a, b); }
};

// Tree over the G (power of two <= 32) lanes of a group; the result is valid in its lane 0.
template <typename A, typename Op>
__device__ __forceinline__ A group_reduce(A v, int G) {
  for (int off = G / 2; off > 0; off >>= 1)
    v = Op::template combine<A>(v, __shfl_down_sync(FULL_MASK, v, off, G));
  return v;
}

// Butterfly over the whole warp: every lane gets the result.
template <typename A, typename Op>
__device__ __forceinline__ A warp_all_reduce(A v) {
  for (int off = 16; off > 0; off >>= 1)
    v = Op::template combine<A>(v, __shfl_xor_sync(FULL_MASK, v, off));
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
