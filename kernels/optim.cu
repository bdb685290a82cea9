// optim.cu: optimizer updates over flat parameter buffers, in place.
// Launchers: dptrain/backend/cuda/optim.py.
//
// Conventions
//  * param, grad and state buffers are contiguous, of one length n, updated in place (`_` ops).
//  * Values that change from step to step live in the device array `hyper` and are read here,
//    so a captured CUDA graph sees the current ones: sgd hyper = [lr], adamw hyper =
//    [lr, 1 - beta1**t, 1 - beta2**t]. hyper[3] is the skip flag written on the device by the
//    non-finite check (guard.cu): non-zero leaves param and state untouched. Constant
//    coefficients arrive as kernel arguments, rounded to T on the host exactly as the CPU
//    backend rounds them (e.g. 1 - beta1 in double, then T).
//  * Formulas follow the CPU backend (PyTorch's SGD and AdamW) operation by operation.
//  * `shadow` (S = __half or __nv_bfloat16; may be null): the parameters' 16-bit copy of
//    mixed precision, written as<S>(new param) in the same pass, the bits of convert_kernel
//    (a skipped step leaves both as they were, and the copy was current).

#include "common.cuh"

// d = g + wd*p; buf = m*buf + d; d = d + m*buf (nesterov) or buf; p -= lr*d.
// buf may be null when momentum == 0.
template <typename T, typename S = T>
__global__ void sgd_kernel(T* param, const T* grad, T* buf, const T* hyper, long long n,
                           T momentum, T weight_decay, int nesterov, S* shadow) {
  if (hyper[3] != T(0)) return;  // a skipped step: uniform over the grid
  const T lr = hyper[0];
  GRID_STRIDE(i, n) {
    const T p = param[i];
    T d = weight_decay != T(0) ? grad[i] + weight_decay * p : grad[i];
    if (momentum != T(0)) {
      const T b = buf[i] * momentum + d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    const T updated = p - lr * d;
    param[i] = updated;
    if (shadow) shadow[i] = as<S>(updated);
  }
}

// p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
// p -= lr * (m / bc1) / (sqrt(v / bc2) + eps).
template <typename T, typename S = T>
__global__ void adamw_kernel(T* param, const T* grad, T* m, T* v, const T* hyper, long long n,
                             T beta1, T one_minus_beta1, T beta2, T one_minus_beta2, T eps,
                             T weight_decay, S* shadow) {
  if (hyper[3] != T(0)) return;  // a skipped step: uniform over the grid
  const T lr = hyper[0], bc1 = hyper[1], bc2 = hyper[2];
  const T decay = T(1) - lr * weight_decay;
  GRID_STRIDE(i, n) {
    const T g = grad[i];
    const T mi = m[i] * beta1 + one_minus_beta1 * g;
    const T vi = v[i] * beta2 + one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const T p = param[i] * decay;
    const T updated = p - lr * (mi / bc1) / (dp_sqrt(vi / bc2) + eps);
    param[i] = updated;
    if (shadow) shadow[i] = as<S>(updated);
  }
}

// instantiate: sgd_kernel<{float, double}>; sgd_kernel<float, {__half, __nv_bfloat16}>
// instantiate: adamw_kernel<{float, double}>; adamw_kernel<float, {__half, __nv_bfloat16}>
