// layout.cuh: the strided-index helper shared by elementwise.cu and transpose.cu.
//
// A Layout is a shape plus the element strides of two operands (s0 for the output or first
// operand, s1 for the input or second); stride 0 broadcasts, a negative stride reverses.
#pragma once

#define DP_MAX_DIMS 8

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

