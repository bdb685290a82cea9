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
//  * Fused attention (short sequences): one block per (batch b, head h) holds q (Tq, E),
//    k (Tk, E), v (Tk, Ev) and the weights (Tq, Tk) in shared memory in compute_t<T> and runs
//    scores, mask (as the masked softmax's), softmax, dropout and the product with v without
//    writing the scores out. Every operand, input or output, is a (B, H, T, E) view given by
//    its element strides over (batch, head, token), the last axis contiguous: the heads of a
//    packed (B, T, 3, H, E) projection are read, and the output and the gradients written,
//    where they lie, with no copy. `probs` (B, H, Tq, Tk, compute_t<T>) keeps the softmax for the backward, with
//    the sign bit set where dropout dropped the weight (-0.0 for a dropped 0). Dropout follows
//    philox.cuh over the (B * size, H, Tq, Tk) draw of the global batch, batch row b being
//    global row b * size + rank: the mask data.cu's dropout_mask draws for that shape.
//    Backward: gv = Pd^T go, dP = keep * keep_scale * (go v^T), dS = P (dP - sum(P dP)) *
//    scale, gq = dS k, gk = dS^T q, with Pd = keep * keep_scale * P. Fixed order, no atomics.

#include "common.cuh"
#include "philox.cuh"

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

// ----------------------------------------------------------------------------- fused attention

// Shapes and element strides over (batch, head, token) (dptrain/backend/cuda/attention.py:
// ATTN_GEOM, ATTN_GRADS): q, k, v, and o, the output (forward) or its gradient (backward).
struct AttnGeom {
  long long q[3], k[3], v[3], o[3];
  int H, Tq, Tk, E, Ev;
  int causal, use_lengths;
  int rank, size;
};

// Where the backward writes the gradients of q, k and v.
struct AttnGrads {
  long long q[3], k[3], v[3];
};

__device__ __forceinline__ long long attn_at(const long long* s, int b, int h, int t) {
  return b * s[0] + h * s[1] + t * s[2];
}

// rows x cols of operand `src` at (b, h) into shared `dst` (row pitch cols + 1: no bank
// conflicts when lanes walk rows), converted to the compute type.
template <typename T, typename A>
__device__ __forceinline__ void attn_load(A* dst, const T* src, const long long* s, int b, int h,
                                          int rows, int cols) {
  const T* base = src + attn_at(s, b, h, 0);
  for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
    const int r = idx / cols, c = idx - r * cols;
    dst[r * (cols + 1) + c] = as<A>(base[r * s[2] + c]);
  }
}

template <typename T, typename L>
__global__ void attention_fwd_kernel(T* out, compute_t<T>* probs, const T* q, const T* k,
                                     const T* v, const L* lengths, AttnGeom g,
                                     compute_t<T> scale, const unsigned long long* rng,
                                     float p, compute_t<T> keep_scale) {
  using A = compute_t<T>;
  extern __shared__ __align__(16) unsigned char attn_smem[];
  const int Tq = g.Tq, Tk = g.Tk, E = g.E, Ev = g.Ev, pitch = Tk + 1;
  A* qs = reinterpret_cast<A*>(attn_smem);
  A* ks = qs + Tq * (E + 1);
  A* vs = ks + Tk * (E + 1);
  A* ws = vs + Tk * (Ev + 1);  // scores, then the weights after softmax and dropout
  const int b = blockIdx.x / g.H, h = blockIdx.x - b * g.H;
  attn_load(qs, q, g.q, b, h, Tq, E);
  attn_load(ks, k, g.k, b, h, Tk, E);
  attn_load(vs, v, g.v, b, h, Tk, Ev);
  __syncthreads();
  for (int idx = threadIdx.x; idx < Tq * Tk; idx += blockDim.x) {
    const int i = idx / Tk, j = idx - i * Tk;
    A s = A(0);
    for (int e = 0; e < E; ++e) s += qs[i * (E + 1) + e] * ks[j * (E + 1) + e];
    ws[i * pitch + j] = s * scale;
  }
  __syncthreads();
  int kept = Tk;
  if (g.use_lengths) kept = (int)max(0LL, min((long long)Tk, (long long)lengths[b]));
  const unsigned long long seed = p > 0.f ? rng[0] : 0ull, offset = p > 0.f ? rng[1] : 0ull;
  const long long global_row = (long long)b * g.size + g.rank;
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x >> 5; i < Tq; i += blockDim.x >> 5) {
    const int limit = g.causal ? min(kept, i + 1) : kept;
    A* row = ws + i * pitch;
    A mx = neg_inf<A>();
    for (int j = lane; j < limit; j += 32) mx = nan_max(mx, row[j]);
    mx = warp_all_reduce<A, MaxOp>(mx);
    A sum = A(0);
    for (int j = lane; j < limit; j += 32) sum += dp_exp(row[j] - mx);
    sum = warp_all_reduce<A, SumOp>(sum);
    A* saved = probs + ((long long)blockIdx.x * Tq + i) * Tk;
    for (int j = lane; j < Tk; j += 32) {
      const A w = j < limit ? dp_exp(row[j] - mx) / sum : A(0);
      bool keep = true;
      if (p > 0.f) {
        const unsigned long long e = (unsigned long long)(((global_row * g.H + h) * Tq + i) * Tk + j);
        keep = philox_uniform(seed, offset, e) >= p;
      }
      saved[j] = keep ? w : -w;
      row[j] = keep ? w * keep_scale : A(0);
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < Tq * Ev; idx += blockDim.x) {
    const int i = idx / Ev, c = idx - i * Ev;
    A acc = A(0);
    for (int j = 0; j < Tk; ++j) acc += ws[i * pitch + j] * vs[j * (Ev + 1) + c];
    out[attn_at(g.o, b, h, i) + c] = as<T>(acc);
  }
}

template <typename T>
__global__ void attention_bwd_kernel(T* gq, T* gk, T* gv, const T* q, const T* k, const T* v,
                                     const T* go, const compute_t<T>* probs, AttnGeom g,
                                     AttnGrads d, compute_t<T> scale, compute_t<T> keep_scale) {
  using A = compute_t<T>;
  extern __shared__ __align__(16) unsigned char attn_smem[];
  const int Tq = g.Tq, Tk = g.Tk, E = g.E, Ev = g.Ev, pitch = Tk + 1;
  A* qs = reinterpret_cast<A*>(attn_smem);
  A* ks = qs + Tq * (E + 1);
  A* vs = ks + Tk * (E + 1);
  A* gos = vs + Tk * (Ev + 1);
  A* ps = gos + Tq * (Ev + 1);  // the saved weights, sign bit = dropped
  A* ds = ps + Tq * pitch;      // dP, then dS
  const int b = blockIdx.x / g.H, h = blockIdx.x - b * g.H;
  attn_load(qs, q, g.q, b, h, Tq, E);
  attn_load(ks, k, g.k, b, h, Tk, E);
  attn_load(vs, v, g.v, b, h, Tk, Ev);
  attn_load(gos, go, g.o, b, h, Tq, Ev);
  const A* saved = probs + (long long)blockIdx.x * Tq * Tk;
  for (int idx = threadIdx.x; idx < Tq * Tk; idx += blockDim.x) {
    const int i = idx / Tk, j = idx - i * Tk;
    ps[i * pitch + j] = saved[idx];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < Tk * Ev; idx += blockDim.x) {  // gv = Pd^T go
    const int j = idx / Ev, c = idx - j * Ev;
    A acc = A(0);
    for (int i = 0; i < Tq; ++i) {
      const A w = ps[i * pitch + j];
      if (!signbit(w)) acc += w * gos[i * (Ev + 1) + c];
    }
    gv[attn_at(d.v, b, h, j) + c] = as<T>(acc * keep_scale);
  }
  for (int idx = threadIdx.x; idx < Tq * Tk; idx += blockDim.x) {  // dP
    const int i = idx / Tk, j = idx - i * Tk;
    A d = A(0);
    if (!signbit(ps[i * pitch + j])) {
      for (int c = 0; c < Ev; ++c) d += gos[i * (Ev + 1) + c] * vs[j * (Ev + 1) + c];
      d *= keep_scale;
    }
    ds[i * pitch + j] = d;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x >> 5; i < Tq; i += blockDim.x >> 5) {  // dS, a warp per row
    A dot = A(0);
    for (int j = lane; j < Tk; j += 32) dot += fabs(ps[i * pitch + j]) * ds[i * pitch + j];
    dot = warp_all_reduce<A, SumOp>(dot);
    for (int j = lane; j < Tk; j += 32)
      ds[i * pitch + j] = fabs(ps[i * pitch + j]) * (ds[i * pitch + j] - dot) * scale;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < Tq * E; idx += blockDim.x) {  // gq = dS k
    const int i = idx / E, e = idx - i * E;
    A acc = A(0);
    for (int j = 0; j < Tk; ++j) acc += ds[i * pitch + j] * ks[j * (E + 1) + e];
    gq[attn_at(d.q, b, h, i) + e] = as<T>(acc);
  }
  for (int idx = threadIdx.x; idx < Tk * E; idx += blockDim.x) {  // gk = dS^T q
    const int j = idx / E, e = idx - j * E;
    A acc = A(0);
    for (int i = 0; i < Tq; ++i) acc += ds[i * pitch + j] * qs[i * (E + 1) + e];
    gk[attn_at(d.k, b, h, j) + e] = as<T>(acc);
  }
}

// instantiate: attention_fwd_kernel<float, int>; attention_fwd_kernel<float, long long>; attention_bwd_kernel<float>
// instantiate: attention_fwd_kernel<double, int>; attention_fwd_kernel<double, long long>; attention_bwd_kernel<double>
// instantiate: attention_fwd_kernel<__half, int>; attention_fwd_kernel<__half, long long>; attention_bwd_kernel<__half>
// instantiate: attention_fwd_kernel<__nv_bfloat16, int>; attention_fwd_kernel<__nv_bfloat16, long long>; attention_bwd_kernel<__nv_bfloat16>

// instantiate: layer_norm_fwd_kernel<float>; layer_norm_fwd_kernel<double>; layer_norm_bwd_kernel<float>; layer_norm_bwd_kernel<double>
// instantiate: gelu_fwd_kernel<float>; gelu_fwd_kernel<double>; gelu_bwd_kernel<float>; gelu_bwd_kernel<double>
// instantiate: masked_softmax_fwd_kernel<float, int>; masked_softmax_fwd_kernel<float, long long>; masked_softmax_fwd_kernel<double, int>; masked_softmax_fwd_kernel<double, long long>
// instantiate: masked_softmax_bwd_kernel<float>; masked_softmax_bwd_kernel<double>
// instantiate: layer_norm_fwd_kernel<__half>; layer_norm_bwd_kernel<__half>; gelu_fwd_kernel<__half>; gelu_bwd_kernel<__half>
// instantiate: masked_softmax_fwd_kernel<__half, int>; masked_softmax_fwd_kernel<__half, long long>; masked_softmax_bwd_kernel<__half>
// instantiate: layer_norm_fwd_kernel<__nv_bfloat16>; layer_norm_bwd_kernel<__nv_bfloat16>; gelu_fwd_kernel<__nv_bfloat16>; gelu_bwd_kernel<__nv_bfloat16>
// instantiate: masked_softmax_fwd_kernel<__nv_bfloat16, int>; masked_softmax_fwd_kernel<__nv_bfloat16, long long>; masked_softmax_bwd_kernel<__nv_bfloat16>
