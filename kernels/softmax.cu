// softmax.cu: softmax and log_softmax along the last axis, their backward, and cross-entropy
// (forward: mean loss as a 0-d array plus probs; backward from the 0-d loss gradient).
// Launchers: dptrain/backend/cuda/softmax.py.
//
// Conventions
//  * Inputs are contiguous (R, C) row blocks: R = size / C rows of C elements.
//  * One warp per row: lanes stride over the row, then an xor-shuffle tree gives every lane the
//    row's max / sum (warp_all_reduce, common.cuh). Fixed order, no atomics: deterministic.
//  * Backward kernels take the forward OUTPUT y and gy, and write the input gradient with `=`.
//  * Formulas follow the CPU backend step by step (shift by the row max, then exp / log), in type T.
//  * Cross-entropy: ce_rows writes probs = exp(logp) and each row's logp[label] (NaN for a
//    label outside [0, C), so a bad label shows in the loss instead of reading out of bounds);
//    ce_mean folds those in one block, in double, in a fixed order: loss = -sum / R.
//  * Labels are int or long long (L).
//  * Cross-entropy of 16-bit logits (mixed precision) computes in float from their exact float
//    values and writes the gradient in their type: the bits of a cast to float, the float
//    kernels and a cast of the gradient back, without the two casts' passes.

#include "common.cuh"

// Max and sum of exp(x - max) of one row, known to every lane (x read as T: exact).
template <typename T, typename TI>
__device__ __forceinline__ void row_stats(const TI* x, int C, int lane, T& mx, T& sum) {
  mx = neg_inf<T>();
  for (int c = lane; c < C; c += 32) mx = nan_max(mx, as<T>(x[c]));
  mx = warp_all_reduce<T, MaxOp>(mx);
  sum = T(0);
  for (int c = lane; c < C; c += 32) sum += dp_exp(as<T>(x[c]) - mx);
  sum = warp_all_reduce<T, SumOp>(sum);
}

// Max and log-sum-exp of one row, known to every lane: log_softmax(x)[c] = (x[c] - mx) - lse.
template <typename T, typename TI>
__device__ __forceinline__ void row_lse(const TI* x, int C, int lane, T& mx, T& lse) {
  T sum;
  row_stats(x, C, lane, mx, sum);
  lse = dp_log(sum);
}

// y = softmax(x) (LOG = false) or log_softmax(x) (LOG = true).
template <typename T, bool LOG>
__global__ void softmax_fwd_kernel(T* y, const T* x, int R, int C) {
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const T* xr = x + (long long)row * C;
    T* yr = y + (long long)row * C;
    T mx, s;
    if (LOG) {
      row_lse(xr, C, lane, mx, s);
      for (int c = lane; c < C; c += 32) yr[c] = (xr[c] - mx) - s;
    } else {
      row_stats(xr, C, lane, mx, s);
      for (int c = lane; c < C; c += 32) yr[c] = dp_exp(xr[c] - mx) / s;
    }
  }
}

// softmax: gx = y * (gy - sum(gy * y));  log_softmax: gx = gy - exp(y) * sum(gy).
template <typename T, bool LOG>
__global__ void softmax_bwd_kernel(T* gx, const T* y, const T* gy, int R, int C) {
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const long long o = (long long)row * C;
    T dot = T(0);
    for (int c = lane; c < C; c += 32) dot += LOG ? gy[o + c] : gy[o + c] * y[o + c];
    dot = warp_all_reduce<T, SumOp>(dot);
    for (int c = lane; c < C; c += 32)
      gx[o + c] = LOG ? gy[o + c] - dp_exp(y[o + c]) * dot : y[o + c] * (gy[o + c] - dot);
  }
}

// probs = exp(log_softmax(logits)); picked[row] = log_softmax(logits)[row, label[row]].
// Logits of TI (16-bit ones read as float: the loss of their exact float cast).
template <typename T, typename L, typename TI = T>
__global__ void ce_rows_kernel(T* probs, T* picked, const TI* logits, const L* labels, int R,
                               int C) {
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const TI* xr = logits + (long long)row * C;
    T* pr = probs + (long long)row * C;
    T mx, lse;
    row_lse(xr, C, lane, mx, lse);
    for (int c = lane; c < C; c += 32) pr[c] = dp_exp((as<T>(xr[c]) - mx) - lse);
    if (lane == 0) {
      const long long label = (long long)labels[row];
      picked[row] =
          (label >= 0 && label < C) ? (as<T>(xr[label]) - mx) - lse : quiet_nan<T>();
    }
  }
}

// loss[0] = -sum(picked) / R. One block of blockDim.x (a multiple of 32) threads; the block
// tree of common.cuh, so the order is fixed.
template <typename T>
__global__ void ce_mean_kernel(T* loss, const T* picked, int R) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int r = threadIdx.x; r < R; r += blockDim.x) acc += double(picked[r]);
  acc = block_reduce<double, SumOp>(acc, shared);
  if (threadIdx.x == 0) loss[0] = -T(acc) / T(R);
}

// g = (probs - onehot(label)) * (gloss[0] / R), flat over R*C elements, stored as TG (the
// 16-bit logits' type: rounded once, as a cast of the float gradient would).
template <typename T, typename L, typename TG = T>
__global__ void ce_bwd_kernel(TG* g, const T* probs, const L* labels, const T* gloss, int R,
                              int C) {
  const T factor = gloss[0] / T(R);
  const long long n = (long long)R * C;
  GRID_STRIDE(i, n) {
    const long long row = i / C;
    const long long c = i - row * C;
    const T p = probs[i];
    g[i] = as<TG>(((long long)labels[row] == c ? p - T(1) : p) * factor);
  }
}

// instantiate: softmax_fwd_kernel<{float, double}, {false, true}>
// instantiate: softmax_bwd_kernel<{float, double}, {false, true}>
// instantiate: ce_rows_kernel<{float, double}, {int, long long}>; ce_rows_kernel<float, {int, long long}, {__half, __nv_bfloat16}>
// instantiate: ce_mean_kernel<{float, double}>
// instantiate: ce_bwd_kernel<{float, double}, {int, long long}>; ce_bwd_kernel<float, {int, long long}, {__half, __nv_bfloat16}>
