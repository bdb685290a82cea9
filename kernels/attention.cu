// attention.cu: the transformer's own ops: layer norm over the last axis (forward, backward),
// the exact GELU and its gradient, and the masked softmax of scaled dot-product attention
// (forward, backward). Launchers: dptrain/backend/cuda/attention.py; the NumPy reference:
// dptrain/backend/cpu/attention.py (same formulas, step by step).
//
// Conventions
//  * Row kernels take contiguous (R, C) blocks: one warp per row (FOR_EACH_ROW, common.cuh),
//    lanes stride over the row, xor-shuffle trees (warp_all_reduce) give every lane the row's
//    sums. Fixed order, no atomics: deterministic. Math in compute_t<T>: the element type for
//    float and double, float for the 16-bit types (read up, results rounded once).
//  * Layer norm over the last axis (D = C): forward writes y, and mean and rstd per row
//    (rstd = 1 / sqrt(var + eps), biased variance); weight, bias, mean, rstd and gyxhat are
//    compute_t<T> (float32 parameters for 16-bit activations); backward writes gx with `=`
//    and the product gy * xhat (R, D), which the launcher sums over rows with reduce.cu's
//    deterministic column sums for the weight gradient (the bias gradient sums gy the same
//    way, into the weight's dtype).
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
__global__ void layer_norm_fwd_kernel(T* y, compute_t<T>* mean, compute_t<T>* rstd, const T* x,
                                      const compute_t<T>* w, const compute_t<T>* b, int R, int D,
                                      compute_t<T> eps) {
  using A = compute_t<T>;
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const T* xr = x + (long long)row * D;
    T* yr = y + (long long)row * D;
    A s = A(0);
    for (int c = lane; c < D; c += 32) s += as<A>(xr[c]);
    const A mu = warp_all_reduce<A, SumOp>(s) / A(D);
    A v = A(0);
    for (int c = lane; c < D; c += 32) {
      const A d = as<A>(xr[c]) - mu;
      v += d * d;
    }
    const A rs = A(1) / dp_sqrt(warp_all_reduce<A, SumOp>(v) / A(D) + eps);
    for (int c = lane; c < D; c += 32) yr[c] = as<T>((as<A>(xr[c]) - mu) * rs * w[c] + b[c]);
    if (lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// gx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = gy * w, xhat = (x - mean) * rstd;
// gyxhat = gy * xhat (summed over rows by the launcher: the weight gradient).
template <typename T>
__global__ void layer_norm_bwd_kernel(T* gx, compute_t<T>* gyxhat, const T* gy, const T* x,
                                      const compute_t<T>* w, const compute_t<T>* mean,
                                      const compute_t<T>* rstd, int R, int D) {
  using A = compute_t<T>;
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const long long o = (long long)row * D;
    const A mu = mean[row], rs = rstd[row];
    A sg = A(0), sgx = A(0);
    for (int c = lane; c < D; c += 32) {
      const A xh = (as<A>(x[o + c]) - mu) * rs;
      const A g = as<A>(gy[o + c]) * w[c];
      sg += g;
      sgx += g * xh;
      gyxhat[o + c] = as<A>(gy[o + c]) * xh;
    }
    sg = warp_all_reduce<A, SumOp>(sg) / A(D);
    sgx = warp_all_reduce<A, SumOp>(sgx) / A(D);
    for (int c = lane; c < D; c += 32) {
      const A xh = (as<A>(x[o + c]) - mu) * rs;
      gx[o + c] = as<T>(rs * (as<A>(gy[o + c]) * w[c] - sg - xh * sgx));
    }
  }
}

// ----------------------------------------------------------------------------- GELU

#define DP_INV_SQRT2 0.70710678118654752440
#define DP_INV_SQRT_2PI 0.39894228040143267794

template <typename T>
__global__ void gelu_fwd_kernel(T* y, const T* x, long long n) {
  using A = compute_t<T>;
  GRID_STRIDE(i, n) {
    const A v = as<A>(x[i]);
    y[i] = as<T>(A(0.5) * v * (A(1) + dp_erf(v * A(DP_INV_SQRT2))));
  }
}

template <typename T>
__global__ void gelu_bwd_kernel(T* gx, const T* x, const T* gy, long long n) {
  using A = compute_t<T>;
  GRID_STRIDE(i, n) {
    const A v = as<A>(x[i]);
    const A cdf = A(0.5) * (A(1) + dp_erf(v * A(DP_INV_SQRT2)));
    const A pdf = A(DP_INV_SQRT_2PI) * dp_exp(A(-0.5) * v * v);
    gx[i] = as<T>(as<A>(gy[i]) * (cdf + v * pdf));
  }
}

// ----------------------------------------------------------------------------- masked softmax

template <typename T, typename L>
__global__ void masked_softmax_fwd_kernel(T* y, const T* x, const L* lengths, int R, int C,
                                          int Tq, int per_batch, int causal, int use_lengths,
                                          compute_t<T> scale) {
  using A = compute_t<T>;
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
    A mx = neg_inf<A>();
    for (int c = lane; c < limit; c += 32) mx = nan_max(mx, as<A>(xr[c]) * scale);
    mx = warp_all_reduce<A, MaxOp>(mx);
    A s = A(0);
    for (int c = lane; c < limit; c += 32) s += dp_exp(as<A>(xr[c]) * scale - mx);
    s = warp_all_reduce<A, SumOp>(s);
    for (int c = lane; c < C; c += 32)
      yr[c] = as<T>(c < limit ? dp_exp(as<A>(xr[c]) * scale - mx) / s : A(0));
  }
}

template <typename T>
__global__ void masked_softmax_bwd_kernel(T* gx, const T* y, const T* gy, int R, int C,
                                          compute_t<T> scale) {
  using A = compute_t<T>;
  const int lane = threadIdx.x & 31;
  FOR_EACH_ROW(row, R) {
    const long long o = (long long)row * C;
    A dot = A(0);
    for (int c = lane; c < C; c += 32) dot += as<A>(gy[o + c]) * as<A>(y[o + c]);
    dot = warp_all_reduce<A, SumOp>(dot);
    for (int c = lane; c < C; c += 32)
      gx[o + c] = as<T>(scale * (as<A>(y[o + c]) * (as<A>(gy[o + c]) - dot)));
  }
}

// instantiate: layer_norm_fwd_kernel<float>; layer_norm_fwd_kernel<double>; layer_norm_bwd_kernel<float>; layer_norm_bwd_kernel<double>
// instantiate: gelu_fwd_kernel<float>; gelu_fwd_kernel<double>; gelu_bwd_kernel<float>; gelu_bwd_kernel<double>
// instantiate: masked_softmax_fwd_kernel<float, int>; masked_softmax_fwd_kernel<float, long long>; masked_softmax_fwd_kernel<double, int>; masked_softmax_fwd_kernel<double, long long>
// instantiate: masked_softmax_bwd_kernel<float>; masked_softmax_bwd_kernel<double>
// instantiate: layer_norm_fwd_kernel<__half>; layer_norm_bwd_kernel<__half>; gelu_fwd_kernel<__half>; gelu_bwd_kernel<__half>
// instantiate: masked_softmax_fwd_kernel<__half, int>; masked_softmax_fwd_kernel<__half, long long>; masked_softmax_bwd_kernel<__half>
// instantiate: layer_norm_fwd_kernel<__nv_bfloat16>; layer_norm_bwd_kernel<__nv_bfloat16>; gelu_fwd_kernel<__nv_bfloat16>; gelu_bwd_kernel<__nv_bfloat16>
// instantiate: masked_softmax_fwd_kernel<__nv_bfloat16, int>; masked_softmax_fwd_kernel<__nv_bfloat16, long long>; masked_softmax_bwd_kernel<__nv_bfloat16>
