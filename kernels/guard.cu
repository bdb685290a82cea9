// guard.cu: checks that training values are finite. Launchers: dptrain/backend/cuda/guard.py.
//
// Conventions
//  * nonfinite_flag_kernel ORs "x holds a NaN or an infinity" into a one-element flag of x's
//    type and normalises the flag to 0 or 1: flag = (flag != 0 || any x[i] not finite).
//  * Deterministic without atomics: each block ORs its threads' findings with
//    __syncthreads_or, and every store writes the same value 1; only block 0 reads the old
//    flag (to turn any non-zero value, NaN included, into 1). Nothing ever writes 0, so the
//    stores cannot race to different results.
//  * The test is on the exponent bits (all ones: NaN or infinity), so it holds under any
//    floating-point compiler options.

#include "common.cuh"

__device__ __forceinline__ bool dp_nonfinite(float v) {
  return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool dp_nonfinite(double v) {
  return (static_cast<unsigned long long>(__double_as_longlong(v)) & 0x7ff0000000000000ull) ==
         0x7ff0000000000000ull;
}

// flag[0] = 1 if flag[0] != 0 or any of x[0..n) is NaN or infinite; else flag is left at 0.
// n may be 0 (then only the flag is normalised); the launcher starts at least one block.
template <typename T>
__global__ void nonfinite_flag_kernel(T* flag, const T* x, long long n) {
  int found = 0;
  GRID_STRIDE(i, n) {
    if (dp_nonfinite(x[i])) found = 1;
  }
  found = __syncthreads_or(found);
  if (threadIdx.x == 0) {
    if (found) {
      flag[0] = T(1);
    } else if (blockIdx.x == 0) {
      const T old = flag[0];
      if (!(old == T(0))) flag[0] = T(1);  // NaN compares unequal to 0: it becomes 1 too
    }
  }
}

// instantiate: nonfinite_flag_kernel<float>; nonfinite_flag_kernel<double>

// ----------------------------------------------------------------------------- loss scaling
// fp16 mixed precision (dptrain/amp.py): the backward starts from the loss scale, so small
// gradients stay representable in 16 bits; these two kernels undo the scale on the gradient
// and adapt it, reading only device values (the step stays capturable).

// x[i] /= scale[0] (a power of two in practice, so the division is exact).
template <typename T>
__global__ void unscale_kernel(T* x, const float* scale, long long n) {
  const T s = T(scale[0]);
  GRID_STRIDE(i, n) x[i] = x[i] / s;
}

// state = [scale, good steps, overflow steps]. One thread: an overflow (flag non-zero) halves
// the scale, restarts the good-step count and counts the overflow; `interval` good steps in a
// row double the scale.
__global__ void loss_scale_update_kernel(float* state, const float* overflow, float interval) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  if (overflow[0] != 0.f) {
    state[0] *= 0.5f;
    state[1] = 0.f;
    state[2] += 1.f;
  } else if (state[1] + 1.f >= interval) {
    state[0] *= 2.f;
    state[1] = 0.f;
  } else {
    state[1] += 1.f;
  }
}

// instantiate: unscale_kernel<float>; unscale_kernel<double>; loss_scale_update_kernel
