// elementwise.cu: maps over every element (unary, binary with NumPy broadcasting, activation
// backward), fill and dtype conversion. Launchers: dptrain/backend/cuda/elementwise.py (fill_
// and astype: dptrain/backend/cuda/arrays.py).
//
// Conventions
//  * Every kernel writes its output with `=`. The one accumulation, add_ (dst += src), is the
//    binary Add kernel launched with out == a, so no kernel here uses __restrict__.
//  * Activation backward kernels take the forward OUTPUT y (relu, sigmoid, tanh) or the input x
//    (pow) and the output gradient gy, and write the input gradient with `=`.
//  * Flat kernels: contiguous operands of one shape, long long count, grid-stride loop over
//    16-byte groups (common.cuh): one vector access per operand when `vec` (every operand
//    16-byte aligned, found by the launcher) and the group is whole; element by element in
//    the last, partial group and for unaligned operands.
//    bcast2 kernels: contiguous output; a and b read through a Layout (shape, element strides,
//    stride 0 along broadcast axes). Layout indices are int: the launcher asserts < 2^31.
//  * Math runs in compute_t<T>: the element type for float and double, as NumPy does for
//    float32 arrays; float for __half, rounded once per result (NumPy rounds its float16
//    ufuncs' results the same way). Every op functor takes (a, b, s, t): two operands and two
//    host scalars, unused ones ignored.
//  * fill and convert move data only: results are exact.

#include "common.cuh"

// ---------------------------------------------------------------------------- op functors
struct Add { template <typename T> __device__ T operator()(T a, T b, T, T) const { return a + b; } };
struct Sub { template <typename T> __device__ T operator()(T a, T b, T, T) const { return a - b; } };
struct Mul { template <typename T> __device__ T operator()(T a, T b, T, T) const { return a * b; } };
struct Div { template <typename T> __device__ T operator()(T a, T b, T, T) const { return a / b; } };

struct Neg { template <typename T> __device__ T operator()(T a, T, T, T) const { return -a; } };
struct Exp { template <typename T> __device__ T operator()(T a, T, T, T) const { return dp_exp(a); } };
struct Log { template <typename T> __device__ T operator()(T a, T, T, T) const { return dp_log(a); } };
struct Sqrt { template <typename T> __device__ T operator()(T a, T, T, T) const { return dp_sqrt(a); } };
struct Tanh { template <typename T> __device__ T operator()(T a, T, T, T) const { return dp_tanh(a); } };
// s = the scale factor.
struct Scale { template <typename T> __device__ T operator()(T a, T, T s, T) const { return a * s; } };
// s = the exponent p.
struct Pow { template <typename T> __device__ T operator()(T a, T, T s, T) const { return dp_pow(a, s); } };
// NaN stays NaN, as np.maximum(a, 0) does.
struct Relu { template <typename T> __device__ T operator()(T a, T, T, T) const { return a < T(0) ? T(0) : a; } };
// Split by sign so neither branch overflows (same formula as cpu.sigmoid).
struct Sigmoid {
  template <typename T> __device__ T operator()(T a, T, T, T) const {
    const T e = dp_exp(a < T(0) ? a : -a);
    return a >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
  }
};

// Backward: a = y (or x for pow), b = gy.
struct ReluBack { template <typename T> __device__ T operator()(T y, T gy, T, T) const { return y > T(0) ? gy : T(0); } };
struct SigmoidBack { template <typename T> __device__ T operator()(T y, T gy, T, T) const { return gy * y * (T(1) - y); } };
struct TanhBack { template <typename T> __device__ T operator()(T y, T gy, T, T) const { return gy * (T(1) - y * y); } };
// s = p, t = p - 1 (both rounded on the host, as NumPy does).
struct PowBack { template <typename T> __device__ T operator()(T x, T gy, T s, T t) const { return gy * s * dp_pow(x, t); } };

// ---------------------------------------------------------------------------- kernels
template <typename T, typename Op>
__global__ void map1_kernel(T* out, const T* a, long long n, compute_t<T> s, compute_t<T> t,
                            int vec) {
  using C = compute_t<T>;
  const Op op;
  constexpr int V = Group<T>::size;
  GRID_STRIDE(j, (n + V - 1) / V) {
    const FlatGroup at = flat_group<V>(j, n, vec);
    C v[V];
    load_group(v, a + at.o, at.m, at.whole);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = op(v[k], C(0), s, t);
    store_group(out + at.o, v, at.m, at.whole);
  }
}

template <typename T, typename Op>
__global__ void map2_kernel(T* out, const T* a, const T* b, long long n, compute_t<T> s,
                            compute_t<T> t, int vec) {
  using C = compute_t<T>;
  const Op op;
  constexpr int V = Group<T>::size;
  GRID_STRIDE(j, (n + V - 1) / V) {
    const FlatGroup at = flat_group<V>(j, n, vec);
    C u[V], v[V];
    load_group(u, a + at.o, at.m, at.whole);
    load_group(v, b + at.o, at.m, at.whole);
#pragma unroll
    for (int k = 0; k < V; ++k) u[k] = op(u[k], v[k], s, t);
    store_group(out + at.o, u, at.m, at.whole);
  }
}

// out = ReluBack(y, a + b): ReLU's backward of a gradient that arrived in two parts (a
// residual block's input feeds two paths), the add and the mask in one pass. Bits of
// map2<Add> then map2<ReluBack>: the sum rounded once to T, the mask exact.
template <typename T>
__global__ void relu_back_sum_kernel(T* out, const T* y, const T* a, const T* b, long long n,
                                     int vec) {
  using C = compute_t<T>;
  constexpr int V = Group<T>::size;
  GRID_STRIDE(j, (n + V - 1) / V) {
    const FlatGroup at = flat_group<V>(j, n, vec);
    C w[V], u[V], v[V];
    load_group(w, y + at.o, at.m, at.whole);
    load_group(u, a + at.o, at.m, at.whole);
    load_group(v, b + at.o, at.m, at.whole);
#pragma unroll
    for (int k = 0; k < V; ++k) u[k] = ReluBack()(w[k], Add()(u[k], v[k], C(0), C(0)), C(0), C(0));
    store_group(out + at.o, u, at.m, at.whole);
  }
}

// out (contiguous, n elements) = a op b, a and b read through L (broadcast strides).
template <typename T, typename Op>
__global__ void bcast2_kernel(T* out, const T* a, const T* b, int n, Layout L) {
  using C = compute_t<T>;
  const Op op;
  GRID_STRIDE_32(i, n) {
    int oa, ob;
    layout_offsets(i, L, oa, ob);
    out[i] = as<T>(op(as<C>(a[oa]), as<C>(b[ob]), C(0), C(0)));
  }
}

// U is an unsigned type of the element's size: one kernel fills every dtype of that size.
template <typename U>
__global__ void fill_kernel(U* out, long long n, U bits) {
  GRID_STRIDE(i, n)
    out[i] = bits;
}

// astype on contiguous arrays: C casts (float -> int truncates toward zero, as NumPy).
template <typename To, typename Ti>
__global__ void convert_kernel(To* out, const Ti* in, long long n) {
  GRID_STRIDE(i, n)
    out[i] = as<To>(in[i]);
}

// dst += src with src in a 16-bit type and dst float (a mixed-precision weight's gradient into
// its fp32 .grad): the cast and the add of convert_kernel + map2_kernel<Add> in one pass,
// the same arithmetic (the cast is exact, the sum in float).
template <typename To, typename Ti>
__global__ void accumulate_kernel(To* dst, const Ti* src, long long n, int vec) {
  constexpr int V = Group<To>::size;  // groups of dst: src read element by element
  GRID_STRIDE(j, (n + V - 1) / V) {
    const FlatGroup at = flat_group<V>(j, n, vec);
    To d[V];
    load_group(d, dst + at.o, at.m, at.whole);
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (k < at.m) d[k] = d[k] + as<To>(src[at.o + k]);
    store_group(dst + at.o, d, at.m, at.whole);
  }
}

// instantiate: map1_kernel<{float, double, __half, __nv_bfloat16}, {Neg, Exp, Log, Sqrt, Tanh, Scale, Pow, Relu, Sigmoid}>
// instantiate: map2_kernel<{float, double, __half, __nv_bfloat16}, {Add, Sub, Mul, Div, ReluBack, SigmoidBack, TanhBack, PowBack}>
// instantiate: relu_back_sum_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bcast2_kernel<{float, double, __half, __nv_bfloat16}, {Add, Sub, Mul, Div}>
// instantiate: fill_kernel<{unsigned char, unsigned short, unsigned int, unsigned long long}>
// instantiate: convert_kernel<float, {double, int, long long, unsigned char, bool, __half, __nv_bfloat16}>; convert_kernel<double, {float, int, long long, unsigned char, bool, __half, __nv_bfloat16}>; convert_kernel<int, {float, double, long long, unsigned char, bool}>; convert_kernel<long long, {float, double, int, unsigned char, bool}>; convert_kernel<{unsigned char, bool}, {float, double, int, long long}>; convert_kernel<{__half, __nv_bfloat16}, {float, double}>
// instantiate: accumulate_kernel<float, {__half, __nv_bfloat16}>
