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

// Block-wide: flag[0] = 1 where any thread `found` a non-finite value; block 0 also turns
// any non-zero old flag (NaN included: it compares unequal to 0) into 1.
template <typename T>
__device__ __forceinline__ void or_into_flag(T* flag, int found) {
  found = __syncthreads_or(found);
  if (threadIdx.x == 0) {
    if (found) {
      flag[0] = T(1);
    } else if (blockIdx.x == 0) {
      const T old = flag[0];
      if (!(old == T(0))) flag[0] = T(1);
    }
  }
}

// flag[0] = 1 if flag[0] != 0 or any of x[0..n) is NaN or infinite; else flag is left at 0.
// n may be 0 (then only the flag is normalised); the launcher starts at least one block.
template <typename T>
__global__ void nonfinite_flag_kernel(T* flag, const T* x, long long n) {
  int found = 0;
  GRID_STRIDE(i, n) {
    if (dp_nonfinite(x[i])) found = 1;
  }
  or_into_flag(flag, found);
}

// instantiate: nonfinite_flag_kernel<{float, double}>

// ----------------------------------------------------------------------------- the guard's step
// dptrain/run/nonfinite.py's checks and decision in two kernels around the flags' all-reduce
// (it took up to eleven launches with one gradient segment). fp16 mixed precision
// (dptrain/run/amp.py) scales the loss, so small gradients stay representable in 16 bits;
// these kernels undo the scale on the gradient and adapt it, reading only device values (the
// step stays capturable).

// Before the all-reduce: flag as nonfinite_flag_kernel's over x as it is (the scaled
// gradient: dividing by a scale under 1 could overflow a finite value), then x /= scale[0]
// (a power of two, so the division is exact).
template <typename T>
__global__ void unscale_check_kernel(T* x, const float* scale, T* flag, long long n) {
  const T s = T(scale[0]);
  int found = 0;
  GRID_STRIDE(i, n) {
    const T v = x[i];
    if (dp_nonfinite(v)) found = 1;
    x[i] = v / s;
  }
  or_into_flag(flag, found);
}

// After it, one thread: d = flags[0] (+ decision[0] when sticky) as 0 or 1 (NaN: 1) into
// decision, count += d. With a loss scale (`scaled`, state = [scale, good steps, overflow
// steps]): o = flags[1] as 0 or 1; an overflow halves the scale, restarts the good-step count
// and counts itself, `interval` good steps in a row double the scale; skip = d + o. Without
// one, decision is the optimizer's skip slot itself and state and skip are not read.
template <typename T>
__global__ void nonfinite_decide_kernel(const T* flags, T* decision, T* count, int sticky,
                                        int scaled, float* state, T* skip, float interval) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const T sum = sticky ? decision[0] + flags[0] : flags[0];
  const T d = sum == T(0) ? T(0) : T(1);
  decision[0] = d;
  count[0] += d;
  if (!scaled) return;
  const T o = flags[1] == T(0) ? T(0) : T(1);
  if (o != T(0)) {
    state[0] *= 0.5f;
    state[1] = 0.f;
    state[2] += 1.f;
  } else if (state[1] + 1.f >= interval) {
    state[0] *= 2.f;
    state[1] = 0.f;
  } else {
    state[1] += 1.f;
  }
  skip[0] = d + o;
}

// instantiate: unscale_check_kernel<{float, double}>
// instantiate: nonfinite_decide_kernel<{float, double}>
