// norm.cu: batch normalisation over NCHW, forward, running estimates and backward.
// Launchers: dptrain/backend/cuda/norm.py. Reference: dptrain/backend/cpu/norm.py.
//
// Conventions
//  * x is contiguous (N, C, S), S the product of the spatial dims; channel c's k-th element
//    (k < K = N*S, n-major) sits at (n*C + c)*S + s with n = k / S, s = k % S.
//  * Per-channel arrays (mean, var, weight, bias) are contiguous (C,); sums is (2, C).
//  * invstd = 1 / sqrt(var + eps) in T; xhat = (x - mean) * invstd.
//  * Channel reductions (mean, var, backward_reduce): one block per channel (grid-stride over
//    channels), threads stride over k, then the fixed block tree of common.cuh: accumulated in
//    double, deterministic run to run, no atomics. var is the biased mean of (x - mean)^2
//    about the mean it is given (two passes, so sync-BN can all-reduce the mean in between).
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

// mean[c] = sum_k x / K.
template <typename T>
__global__ void bn_mean_kernel(T* mean, const T* x, int N, int C, int S) {
  __shared__ double shared[32];
  const int K = N * S;
  for (int c = blockIdx.x; c < C; c += gridDim.x) {
    double acc = 0.0;
    for (int k = threadIdx.x; k < K; k += blockDim.x) acc += (double)x[channel_offset(k, c, C, S)];
    acc = block_reduce<double, SumOp>(acc, shared);
    if (threadIdx.x == 0) mean[c] = T(acc / (double)K);
  }
}

// var[c] = sum_k (x - mean[c])^2 / K.
template <typename T>
__global__ void bn_var_kernel(T* var, const T* x, const T* mean, int N, int C, int S) {
  __shared__ double shared[32];
  const int K = N * S;
  for (int c = blockIdx.x; c < C; c += gridDim.x) {
    const double m = (double)mean[c];
    double acc = 0.0;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      const double d = (double)x[channel_offset(k, c, C, S)] - m;
      acc += d * d;
    }
    acc = block_reduce<double, SumOp>(acc, shared);
    if (threadIdx.x == 0) var[c] = T(acc / (double)K);
  }
}

// y = (x - mean) * (invstd * weight) + bias.
template <typename T>
__global__ void bn_forward_kernel(T* y, const T* x, const T* mean, const T* var, const T* weight,
                                  const T* bias, T eps, long long n, int C, int S) {
  GRID_STRIDE(i, n) {
    const int c = (int)((i / S) % C);
    const T scale = inv_std(var[c], eps) * weight[c];
    y[i] = (x[i] - mean[c]) * scale + bias[c];
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

// sums[c] = sum_k gy, sums[C + c] = sum_k gy * xhat.
template <typename T>
__global__ void bn_backward_reduce_kernel(T* sums, const T* gy, const T* x, const T* mean,
                                          const T* var, T eps, int N, int C, int S) {
  __shared__ double shared[32];
  const int K = N * S;
  for (int c = blockIdx.x; c < C; c += gridDim.x) {
    const double m = (double)mean[c];
    const double invstd = 1.0 / sqrt((double)var[c] + (double)eps);
    double sg = 0.0, sgx = 0.0;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      const long long o = channel_offset(k, c, C, S);
      const double g = (double)gy[o];
      sg += g;
      sgx += g * ((double)x[o] - m) * invstd;
    }
    sg = block_reduce<double, SumOp>(sg, shared);
    sgx = block_reduce<double, SumOp>(sgx, shared);
    if (threadIdx.x == 0) {
      sums[c] = T(sg);
      sums[C + c] = T(sgx);
    }
  }
}

// dx = weight * invstd * (gy - sums[c] / count - xhat * sums[C + c] / count).
template <typename T>
__global__ void bn_backward_data_kernel(T* dx, const T* gy, const T* x, const T* mean,
                                        const T* var, const T* weight, const T* sums, T eps,
                                        T inv_count, long long n, int C, int S) {
  GRID_STRIDE(i, n) {
    const int c = (int)((i / S) % C);
    const T invstd = inv_std(var[c], eps);
    const T xhat = (x[i] - mean[c]) * invstd;
    dx[i] = (gy[i] - sums[c] * inv_count - xhat * (sums[C + c] * inv_count)) *
            (weight[c] * invstd);
  }
}

// instantiate: bn_mean_kernel<float>; bn_mean_kernel<double>; bn_var_kernel<float>; bn_var_kernel<double>
// instantiate: bn_forward_kernel<float>; bn_forward_kernel<double>
// instantiate: bn_update_running_kernel<float>; bn_update_running_kernel<double>
// instantiate: bn_backward_reduce_kernel<float>; bn_backward_reduce_kernel<double>
// instantiate: bn_backward_data_kernel<float>; bn_backward_data_kernel<double>
