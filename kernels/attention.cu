// attention.cu: the transformer's own ops: layer norm over the last axis (forward, backward),
// the exact GELU and its gradient, and the masked softmax of scaled dot-product attention
// (forward, backward). Launchers: dptrain/backend/cuda/attention.py; the NumPy reference:
// dptrain/backend/cpu/attention.py (same formulas, step by step).
//
// Conventions
//  * Row kernels take contiguous (R, C) blocks: one warp per row (FOR_EACH_ROW, common.cuh),
//    lanes stride over the row, xor-shuffle trees (warp_all_reduce) give every lane the row's
//    sums. Fixed order, no atomics: deterministic. Math in the element type T.
//  * Layer norm over the last axis (D = C): forward writes y, and mean and rstd per row
//    (rstd = 1 / sqrt(var + eps), biased variance); backward writes gx with `=` and the
//    product gy * xhat (R, D), which the launcher sums over rows with reduce.cu's
//    deterministic column sums for the weight gradient (the bias gradient sums gy the same way).
//  * GELU is the erf form: y = 0.5 x (1 + erf(x / sqrt 2)); its backward takes the forward
//    INPUT x: gx = gy (Phi(x) + x phi(x)). Flat, grid-stride.
//  * Masked softmax: rows of Tk keys; row r is query i = r % Tq of batch element
//    b = r / per_batch. Keys c < limit are kept, limit = Tk, min(limit, i + 1) when `causal`,
//    min(limit, lengths[b]) when `use_lengths` (lengths: int or long long, L). Kept keys get
//    softmax(scale * x), the others exactly 0; a row with no kept key is all 0. No mask tensor.
//    Backward takes the forward OUTPUT y: gx = scale * (y * (gy - sum(gy * y))), 0 where y is.

#include "common.cuh"

// ----------------------------------------------------------------------------- layer norm

template <typename T>
__global__ void layer_norm_fwd_kernel(T* y, T* mean, T* rstd, const T* x, const T* w,
                                      const T* b, int R, int D, T eps) {
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const T* xr = x + (long long)row * D;
    T* yr = y + (long long)row * D;
    T s = T(0);
    for (int c = lane; c < D; c += 32) s += xr[c];
    const T mu = warp_all_reduce<T, SumOp>(s) / T(D);
    T v = T(0);
    for (int c = lane; c < D; c += 32) {
      const T d = xr[c] - mu;
      v += d * d;
    }
    const T rs = T(1) / dp_sqrt(warp_all_reduce<T, SumOp>(v) / T(D) + eps);
    for (int c = lane; c < D; c += 32) yr[c] = (xr[c] - mu) * rs * w[c] + b[c];
    if (lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// gx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = gy * w, xhat = (x - mean) * rstd;
// gyxhat = gy * xhat (summed over rows by the launcher: the weight gradient).
template <typename T>
__global__ void layer_norm_bwd_kernel(T* gx, T* gyxhat, const T* gy, const T* x, const T* w,
                                      const T* mean, const T* rstd, int R, int D) {
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const long long o = (long long)row * D;
    const T mu = mean[row], rs = rstd[row];
    T sg = T(0), sgx = T(0);
    for (int c = lane; c < D; c += 32) {
      const T xh = (x[o + c] - mu) * rs;
      const T g = gy[o + c] * w[c];
      sg += g;
      sgx += g * xh;
      gyxhat[o + c] = gy[o + c] * xh;
    }
    sg = warp_all_reduce<T, SumOp>(sg) / T(D);
    sgx = warp_all_reduce<T, SumOp>(sgx) / T(D);
    for (int c = lane; c < D; c += 32) {
      const T xh = (x[o + c] - mu) * rs;
      gx[o + c] = rs * (gy[o + c] * w[c] - sg - xh * sgx);
    }
  }
}

// ----------------------------------------------------------------------------- GELU

#define DP_INV_SQRT2 0.70710678118654752440
#define DP_INV_SQRT_2PI 0.39894228040143267794

template <typename T>
__global__ void gelu_fwd_kernel(T* y, const T* x, long long n) {
  GRID_STRIDE(i, n) {
    const T v = x[i];
    y[i] = T(0.5) * v * (T(1) + dp_erf(v * T(DP_INV_SQRT2)));
  }
}

template <typename T>
__global__ void gelu_bwd_kernel(T* gx, const T* x, const T* gy, long long n) {
  GRID_STRIDE(i, n) {
    const T v = x[i];
    const T cdf = T(0.5) * (T(1) + dp_erf(v * T(DP_INV_SQRT2)));
    const T pdf = T(DP_INV_SQRT_2PI) * dp_exp(T(-0.5) * v * v);
    gx[i] = gy[i] * (cdf + v * pdf);
  }
}

// ----------------------------------------------------------------------------- masked softmax

template <typename T, typename L>
__global__ void masked_softmax_fwd_kernel(T* y, const T* x, const L* lengths, int R, int C,
                                          int Tq, int per_batch, int causal, int use_lengths,
                                          T scale) {
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    int limit = C;
    if (causal) limit = min(limit, row % Tq + 1);
    if (use_lengths) {
      const long long len = (long long)lengths[row / per_batch];
      limit = (int)max(0LL, min((long long)limit, len));
    }
    const T* xr = x + (long long)row * C;
    T* yr = y + (long long)row * C;
    T mx = neg_inf<T>();
    for (int c = lane; c < limit; c += 32) mx = nan_max(mx, xr[c] * scale);
    mx = warp_all_reduce<T, MaxOp>(mx);
    T s = T(0);
    for (int c = lane; c < limit; c += 32) s += dp_exp(xr[c] * scale - mx);
    s = warp_all_reduce<T, SumOp>(s);
    for (int c = lane; c < C; c += 32) yr[c] = c < limit ? dp_exp(xr[c] * scale - mx) / s : T(0);
  }
}

template <typename T>
__global__ void masked_softmax_bwd_kernel(T* gx, const T* y, const T* gy, int R, int C,
                                          T scale) {
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const long long o = (long long)row * C;
    T dot = T(0);
    for (int c = lane; c < C; c += 32) dot += gy[o + c] * y[o + c];
    dot = warp_all_reduce<T, SumOp>(dot);
    for (int c = lane; c < C; c += 32) gx[o + c] = scale * (y[o + c] * (gy[o + c] - dot));
  }
}

// instantiate: layer_norm_fwd_kernel<float>; layer_norm_fwd_kernel<double>; layer_norm_bwd_kernel<float>; layer_norm_bwd_kernel<double>
// instantiate: gelu_fwd_kernel<float>; gelu_fwd_kernel<double>; gelu_bwd_kernel<float>; gelu_bwd_kernel<double>
// instantiate: masked_softmax_fwd_kernel<float, int>; masked_softmax_fwd_kernel<float, long long>; masked_softmax_fwd_kernel<double, int>; masked_softmax_fwd_kernel<double, long long>
// instantiate: masked_softmax_bwd_kernel<float>; masked_softmax_bwd_kernel<double>
