// norm.cu: batch normalisation over NCHW, forward, running estimates and backward.
// Launchers: dptrain/backend/cuda/norm.py. Reference: dptrain/backend/cpu/norm.py.
//
// Conventions
//  * x is contiguous (N, C, S), S the product of the spatial dims; channel c's k-th element
//    (k < K = N*S, n-major) sits at (n*C + c)*S + s with n = k / S, s = k % S.
//  * Per-channel arrays (mean, var, weight, bias) are contiguous (C,); sums is (2, C). They are
//    of P = compute_t<T>: T itself for float and double, float for the 16-bit types, whose
//    statistics, parameters and arithmetic stay fp32 (mixed precision) while x, gy, y and dx
//    are 16-bit.
//  * invstd = 1 / sqrt(var + eps) in T; xhat = (x - mean) * invstd.
//  * Channel reductions (mean, var, backward_reduce) in two launches. The *_partial kernels
//    split each channel's K elements over gridDim.y blocks (block y takes k in
//    [y * chunk, min(K, (y + 1) * chunk)); grid-stride over channels in x), reduce with the
//    fixed block tree of common.cuh in double and write one partial per block to
//    ws[(y * R + r) * C + c] (R sums per channel); bn_finalize_kernel adds the partials in
//    split order. The split depends only on the shape and the GPU: deterministic run to run,
//    no atomics. One block per channel left most SMs idle at ResNet's 64-channel layers.
//    var is the biased mean of (x - mean)^2 about the mean it is given (two passes, so sync-BN
//    can all-reduce the mean in between).
//  * Elementwise kernels (forward, backward_data) write every output element with `=`.
//  * update_running: running = keep * running + momentum * batch (keep = 1 - momentum, rounded
//    on the host; var made unbiased by count / (count - 1)), in place; one thread also adds 1
//    to the int64 batch counter.

#include "common.cuh"

__device__ __forceinline__ long long channel_offset(int k, int c, int C, int S) {
  const int n = k / S;
  return ((long long)n * C + c) * S + (k - n * S);
}

template <typename T> __device__ __forceinline__ T inv_std(T var, T eps) {
  return T(1) / dp_sqrt(var + eps);
}

// ws[y * C + c] = sum over block y's k of x.
template <typename T>
__global__ void bn_mean_partial_kernel(double* ws, const T* x, int N, int C, int S, int chunk) {
  __shared__ double shared[32];
  const int K = N * S, k0 = blockIdx.y * chunk, k1 = min(K, k0 + chunk);
  for (int c = blockIdx.x; c < C; c += gridDim.x) {
    double acc = 0.0;
    for (int k = k0 + threadIdx.x; k < k1; k += blockDim.x)
      acc += as<double>(x[channel_offset(k, c, C, S)]);
    acc = block_reduce<double, SumOp>(acc, shared);
    if (threadIdx.x == 0) ws[(long long)blockIdx.y * C + c] = acc;
  }
}

// ws[y * C + c] = sum over block y's k of (x - mean[c])^2.
template <typename T>
__global__ void bn_var_partial_kernel(double* ws, const T* x, const compute_t<T>* mean, int N,
                                      int C, int S, int chunk) {
  __shared__ double shared[32];
  const int K = N * S, k0 = blockIdx.y * chunk, k1 = min(K, k0 + chunk);
  for (int c = blockIdx.x; c < C; c += gridDim.x) {
    const double m = (double)mean[c];
    double acc = 0.0;
    for (int k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
      const double d = as<double>(x[channel_offset(k, c, C, S)]) - m;
      acc += d * d;
    }
    acc = block_reduce<double, SumOp>(acc, shared);
    if (threadIdx.x == 0) ws[(long long)blockIdx.y * C + c] = acc;
  }
}

// out[j] = T(sum_y ws[y * n + j] / divisor), the partials added in split order.
template <typename T>
__global__ void bn_finalize_kernel(T* out, const double* ws, int splits, int n, double divisor) {
  GRID_STRIDE_32(j, n) {
    double acc = 0.0;
    for (int y = 0; y < splits; ++y) acc += ws[(long long)y * n + j];
    out[j] = T(acc / divisor);
  }
}

// y = (x - mean) * (invstd * weight) + bias.
template <typename T, typename P = compute_t<T>>
__global__ void bn_forward_kernel(T* y, const T* x, const P* mean, const P* var, const P* weight,
                                  const P* bias, P eps, long long n, int C, int S) {
  GRID_STRIDE(i, n) {
    const int c = (int)((i / S) % C);
    const P scale = inv_std(var[c], eps) * weight[c];
    y[i] = as<T>((as<P>(x[i]) - mean[c]) * scale + bias[c]);
  }
}

template <typename T>
__global__ void bn_update_running_kernel(T* running_mean, T* running_var, long long* batches,
                                         const T* mean, const T* var, T keep, T momentum, T unbias,
                                         int C) {
  GRID_STRIDE_32(c, C) {
    running_mean[c] = keep * running_mean[c] + momentum * mean[c];
    running_var[c] = keep * running_var[c] + momentum * (var[c] * unbias);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) batches[0] += 1;
}

// ws[(y * 2) * C + c] = sum over block y's k of gy, ws[(y * 2 + 1) * C + c] of gy * xhat.
template <typename T, typename P = compute_t<T>>
__global__ void bn_backward_partial_kernel(double* ws, const T* gy, const T* x, const P* mean,
                                           const P* var, P eps, int N, int C, int S, int chunk) {
  __shared__ double shared[32];
  const int K = N * S, k0 = blockIdx.y * chunk, k1 = min(K, k0 + chunk);
  for (int c = blockIdx.x; c < C; c += gridDim.x) {
    const double m = (double)mean[c];
    const double invstd = 1.0 / sqrt((double)var[c] + (double)eps);
    double sg = 0.0, sgx = 0.0;
    for (int k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
      const long long o = channel_offset(k, c, C, S);
      const double g = as<double>(gy[o]);
      sg += g;
      sgx += g * (as<double>(x[o]) - m) * invstd;
    }
    sg = block_reduce<double, SumOp>(sg, shared);
    sgx = block_reduce<double, SumOp>(sgx, shared);
    if (threadIdx.x == 0) {
      ws[((long long)blockIdx.y * 2) * C + c] = sg;
      ws[((long long)blockIdx.y * 2 + 1) * C + c] = sgx;
    }
  }
}

// dx = weight * invstd * (gy - sums[c] / count - xhat * sums[C + c] / count).
template <typename T, typename P = compute_t<T>>
__global__ void bn_backward_data_kernel(T* dx, const T* gy, const T* x, const P* mean,
                                        const P* var, const P* weight, const P* sums, P eps,
                                        P inv_count, long long n, int C, int S) {
  GRID_STRIDE(i, n) {
    const int c = (int)((i / S) % C);
    const P invstd = inv_std(var[c], eps);
    const P xhat = (as<P>(x[i]) - mean[c]) * invstd;
    dx[i] = as<T>((as<P>(gy[i]) - sums[c] * inv_count - xhat * (sums[C + c] * inv_count)) *
                  (weight[c] * invstd));
  }
}

// instantiate: bn_mean_partial_kernel<float>; bn_mean_partial_kernel<double>; bn_var_partial_kernel<float>; bn_var_partial_kernel<double>
// instantiate: bn_finalize_kernel<float>; bn_finalize_kernel<double>
// instantiate: bn_forward_kernel<float>; bn_forward_kernel<double>
// instantiate: bn_mean_partial_kernel<__half>; bn_var_partial_kernel<__half>; bn_forward_kernel<__half>; bn_backward_partial_kernel<__half>; bn_backward_data_kernel<__half>
// instantiate: bn_mean_partial_kernel<__nv_bfloat16>; bn_var_partial_kernel<__nv_bfloat16>; bn_forward_kernel<__nv_bfloat16>; bn_backward_partial_kernel<__nv_bfloat16>; bn_backward_data_kernel<__nv_bfloat16>
// instantiate: bn_update_running_kernel<float>; bn_update_running_kernel<double>
// instantiate: bn_backward_partial_kernel<float>; bn_backward_partial_kernel<double>
// instantiate: bn_backward_data_kernel<float>; bn_backward_data_kernel<double>
