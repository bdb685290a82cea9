// tf32x3.cu: float32 operands split into TF32 parts, so that TF32 tensor cores compute a
// float32 product ("3xTF32"). Launcher: dptrain/backend/cuda/tf32x3.py.
//
// Conventions
//  * a = hi + lo + r with hi = tf32(a), lo = tf32(a - hi), both rounded to nearest (ties
//    away, cvt.rna.tf32.f32), so |lo| <= 2^-11 |a| and |r| <= 2^-22 |a|. A product then sums
//    hi_a*hi_b + lo_a*hi_b + hi_a*lo_b (lo_a*lo_b, below 2^-22 of it, dropped): three TF32
//    products, laid side by side along a K three times as long, so that one unchanged TF32
//    kernel sums them in its fp32 accumulators.
//  * split3_kernel<V> writes three parts of an (R, C) array a as an (R, 3, C) array: part j
//    of row r (hi, or lo where bit j of `lo_parts` is set) at out + (3r + j) * C. The
//    launcher picks R and C for the axis the parts line up along (channels: R pixels of C
//    channels; the batch: one row of the whole array). V floats move per access (4 where C
//    is a multiple of 4 and a 16-byte aligned).
//  * Deterministic: the same a always gives the same parts.

#include "gemm_tiles.cuh"  // to_tf32

__device__ __forceinline__ float tf32_round(float a) { return __uint_as_float(to_tf32(a)); }

template <int V>
struct Vec {
  float v[V];
};

template <int V>
__global__ void split3_kernel(const float* __restrict__ a, float* __restrict__ out, int rows,
                              int cols, int lo_parts) {
  using F = Vec<V>;
  const int per_row = cols / V;
  GRID_STRIDE(i, (long long)rows * per_row) {
    const long long r = i / per_row, c = (i - r * per_row) * V;
    const F x = *reinterpret_cast<const F*>(a + r * cols + c);
    F hi, lo;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      hi.v[e] = tf32_round(x.v[e]);
      lo.v[e] = tf32_round(x.v[e] - hi.v[e]);
    }
    float* o = out + 3 * r * cols + c;
#pragma unroll
    for (int j = 0; j < 3; ++j)
      *reinterpret_cast<F*>(o + j * (long long)cols) = (lo_parts >> j & 1) ? lo : hi;
  }
}

// instantiate: split3_kernel<{1, 4}>
