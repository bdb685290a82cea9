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
//    (rstd = 1 / sqrt(var + eps), biased variance); weight, bias, mean, rstd and sums are
//    compute_t<T> (float32 parameters for 16-bit activations); backward writes gx with `=`
//    and rows [gy * xhat | gy] (R, 2D), which the launcher sums over rows with reduce.cu's
//    deterministic column sums: the weight and the bias gradient in one pass.
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
// sums row r = [gy * xhat | gy] (2D wide; the launcher sums it over rows in one pass: the
// weight and the bias gradient).
template <typename T>
__global__ void layer_norm_bwd_kernel(T* gx, compute_t<T>* sums, const T* gy, const T* x,
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
      sums[2 * o + c] = as<A>(gy[o + c]) * xh;
      sums[2 * o + D + c] = as<A>(gy[o + c]);
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
// conflicts when lanes walk rows), converted to the compute type. (r, c) advance by the
// block's stride without a division per element.
template <typename T, typename A>
__device__ __forceinline__ void attn_load(A* dst, const T* src, const long long* s, int b, int h,
                                          int rows, int cols) {
  const T* base = src + attn_at(s, b, h, 0);
  const int dr = blockDim.x / cols, dc = blockDim.x - dr * cols;
  int r = threadIdx.x / cols, c = threadIdx.x - r * cols;
  for (; r < rows; r += dr, c += dc) {
    if (c >= cols) c -= cols, ++r;
    if (r >= rows) break;
    dst[r * (cols + 1) + c] = as<A>(base[r * s[2] + c]);
  }
}

// out (rows, cols) at (b, h) through strides s: out[r][c] = sum_k x[r][k] * y[k][c] over
// shared x (r at stride xp, k at stride xs: either layout of a table) and y (pitch cols + 1).
template <typename T, typename A>
__device__ __forceinline__ void attn_product(T* out, const long long* s, int b, int h, int rows,
                                             int cols, int inner, const A* x, int xp, int xs,
                                             const A* y) {
  T* base = out + attn_at(s, b, h, 0);
  const int dr = blockDim.x / cols, dc = blockDim.x - dr * cols;
  int r = threadIdx.x / cols, c = threadIdx.x - r * cols;
  for (; r < rows; r += dr, c += dc) {
    if (c >= cols) c -= cols, ++r;
    if (r >= rows) break;
    const A* xr = x + r * xp;
    A acc = A(0);
#pragma unroll 4
    for (int k = 0; k < inner; ++k) acc += xr[k * xs] * y[k * (cols + 1) + c];
    base[r * s[2] + c] = as<T>(acc);
  }
}

// The block's (batch, head) and its q, k and v in shared memory (row pitches E + 1, E + 1,
// Ev + 1, in that order from `smem`), loaded (the caller syncs); `rest` is the first free
// element after them.
template <typename A>
struct AttnBlock {
  int b, h;
  A *q, *k, *v, *rest;
};

template <typename T, typename A>
__device__ __forceinline__ AttnBlock<A> attn_open(void* smem, const T* q, const T* k, const T* v,
                                                  const AttnGeom& g) {
  AttnBlock<A> t;
  t.b = blockIdx.x / g.H;
  t.h = blockIdx.x - t.b * g.H;
  t.q = reinterpret_cast<A*>(smem);
  t.k = t.q + g.Tq * (g.E + 1);
  t.v = t.k + g.Tk * (g.E + 1);
  t.rest = t.v + g.Tk * (g.Ev + 1);
  attn_load(t.q, q, g.q, t.b, t.h, g.Tq, g.E);
  attn_load(t.k, k, g.k, t.b, t.h, g.Tk, g.E);
  attn_load(t.v, v, g.v, t.b, t.h, g.Tk, g.Ev);
  return t;
}

template <typename T, typename L>
__global__ void attention_fwd_kernel(T* out, compute_t<T>* probs, const T* q, const T* k,
                                     const T* v, const L* lengths, AttnGeom g,
                                     compute_t<T> scale, const unsigned long long* rng,
                                     float p, compute_t<T> keep_scale) {
  using A = compute_t<T>;
  extern __shared__ __align__(16) unsigned char attn_smem[];
  const int Tq = g.Tq, Tk = g.Tk, E = g.E, Ev = g.Ev, pitch = Tk + 1;
  const AttnBlock<A> t = attn_open<T, A>(attn_smem, q, k, v, g);
  const int b = t.b, h = t.h;
  const A *qs = t.q, *ks = t.k, *vs = t.v;
  A* ws = t.rest;  // the weights: softmax, then dropout
  __syncthreads();
  int kept = Tk;
  if (g.use_lengths) kept = (int)max(0LL, min((long long)Tk, (long long)lengths[b]));
  A* saved = probs + (long long)blockIdx.x * Tq * Tk;
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x >> 5; i < Tq; i += blockDim.x >> 5) {  // a warp per query row
    const int limit = g.causal ? min(kept, i + 1) : kept;
    const A* qi = qs + i * (E + 1);
    A* row = ws + i * pitch;
    A mx = neg_inf<A>();
    for (int j = lane; j < limit; j += 32) {  // scores of the kept keys, each lane its own
      const A* kj = ks + j * (E + 1);
      A s = A(0);
#pragma unroll 4
      for (int e = 0; e < E; ++e) s += qi[e] * kj[e];
      row[j] = s * scale;
      mx = nan_max(mx, row[j]);
    }
    mx = warp_all_reduce<A, MaxOp>(mx);
    A sum = A(0);
    for (int j = lane; j < limit; j += 32) sum += dp_exp(row[j] - mx);
    sum = warp_all_reduce<A, SumOp>(sum);
    for (int j = lane; j < Tk; j += 32) {
      const A w = j < limit ? dp_exp(row[j] - mx) / sum : A(0);
      row[j] = w;
      if (p == 0.f) saved[i * Tk + j] = w;
    }
  }
  if (p > 0.f) {
    // Dropout over the block's Tq * Tk weights, one generator call per group of four
    // elements of the global draw (philox.cuh): elements first .. first + n - 1.
    __syncthreads();
    const unsigned long long seed = rng[0], offset = rng[1];
    const long long n = (long long)Tq * Tk;
    const long long first = (((long long)b * g.size + g.rank) * g.H + h) * n;
    for (long long grp = first / 4 + threadIdx.x; grp * 4 < first + n; grp += blockDim.x) {
      const Philox4 r = philox_group((unsigned int)seed, (unsigned int)(seed >> 32),
                                     offset + (unsigned long long)grp);
      for (int l = 0; l < 4; ++l) {
        const long long e = grp * 4 + l - first;
        if (e < 0 || e >= n) continue;
        const int at = (int)e, i = at / Tk, j = at - i * Tk;
        const A w = ws[i * pitch + j];
        const bool keep = philox_unit(r.v[l]) >= p;
        saved[at] = keep ? w : -w;  // -0.0 marks a dropped 0
        ws[i * pitch + j] = keep ? w * keep_scale : A(0);
      }
    }
  }
  __syncthreads();
  attn_product(out, g.o, b, h, Tq, Ev, Tk, ws, pitch, 1, vs);
}

template <typename T>
__global__ void attention_bwd_kernel(T* gq, T* gk, T* gv, const T* q, const T* k, const T* v,
                                     const T* go, const compute_t<T>* probs, AttnGeom g,
                                     AttnGrads d, compute_t<T> scale, compute_t<T> keep_scale) {
  using A = compute_t<T>;
  extern __shared__ __align__(16) unsigned char attn_smem[];
  const int Tq = g.Tq, Tk = g.Tk, E = g.E, Ev = g.Ev, pitch = Tk + 1;
  const AttnBlock<A> t = attn_open<T, A>(attn_smem, q, k, v, g);
  const int b = t.b, h = t.h;
  const A *qs = t.q, *ks = t.k, *vs = t.v;
  A* gos = t.rest;
  A* pd = gos + Tq * (Ev + 1);  // the kept weights times keep_scale (0 where dropped)
  A* ds = pd + Tq * pitch;      // dS
  attn_load(gos, go, g.o, b, h, Tq, Ev);
  __syncthreads();
  const A* saved = probs + (long long)blockIdx.x * Tq * Tk;
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x >> 5; i < Tq; i += blockDim.x >> 5) {  // a warp per query row
    const A* goi = gos + i * (Ev + 1);
    A dot = A(0);
    for (int j = lane; j < Tk; j += 32) {
      const A w = saved[i * Tk + j];
      A dp = A(0);  // the gradient of the undropped weight
      if (!signbit(w)) {
        const A* vj = vs + j * (Ev + 1);
#pragma unroll 4
        for (int c = 0; c < Ev; ++c) dp += goi[c] * vj[c];
        dp *= keep_scale;
      }
      pd[i * pitch + j] = signbit(w) ? A(0) : w * keep_scale;
      ds[i * pitch + j] = dp;
      dot += fabs(w) * dp;
    }
    dot = warp_all_reduce<A, SumOp>(dot);
    for (int j = lane; j < Tk; j += 32)
      ds[i * pitch + j] = fabs(saved[i * Tk + j]) * (ds[i * pitch + j] - dot) * scale;
  }
  __syncthreads();
  attn_product(gv, d.v, b, h, Tk, Ev, Tq, pd, 1, pitch, gos);  // Pd^T go
  attn_product(gq, d.q, b, h, Tq, E, Tk, ds, pitch, 1, ks);    // dS k
  attn_product(gk, d.k, b, h, Tk, E, Tq, ds, 1, pitch, qs);    // dS^T q
}

// instantiate: attention_fwd_kernel<{float, double, __half, __nv_bfloat16}, {int, long long}>
// instantiate: attention_bwd_kernel<{float, double, __half, __nv_bfloat16}>

// instantiate: layer_norm_fwd_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: layer_norm_bwd_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: gelu_fwd_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: gelu_bwd_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: masked_softmax_fwd_kernel<{float, double, __half, __nv_bfloat16}, {int, long long}>
// instantiate: masked_softmax_bwd_kernel<{float, double, __half, __nv_bfloat16}>
