// norm.cu: batch normalisation over NCHW or channels-last activations, forward, running
// estimates and backward.
// Launchers: dptrain/backend/cuda/norm.py. Reference: dptrain/backend/cpu/norm.py.
//
// Conventions
//  * x is contiguous (N, C, S), S the product of the spatial dims: plane p = n * C + c holds
//    channel c's S elements of sample n. Kernels walk a plane in groups of GROUP<T> elements
//    (16 bytes, common.cuh): group g covers s in [g * V, min(S, g * V + V)), one 16-byte
//    access when `vec` (the launcher found S a multiple of V and every array 16-byte aligned).
//    Index math is 32-bit: the launcher asserts every element count fits.
//  * Per-channel arrays (mean, var, weight, bias) are contiguous (C,); sums is (2, C). They are
//    of P = compute_t<T>: T itself for float and double, float for the 16-bit types, whose
//    statistics, parameters and arithmetic stay fp32 (mixed precision) while x, gy, y and dx
//    are 16-bit.
//  * invstd = 1 / sqrt(var + eps) in T; xhat = (x - mean) * invstd.
//  * Channel reductions in two launches. The *_partial kernels split each channel's N * G
//    groups (G = ceil(S / V), group i being group i % G of sample i / G) over gridDim.y
//    blocks (block y takes [y * chunk, min(N * G, (y + 1) * chunk)); grid-stride over
//    channels in x), sum in double with the fixed block tree of common.cuh and write one
//    partial per block to ws[(y * R + r) * C + c] (R sums per channel); the finalize kernels
//    add the partials in a fixed order (fold_splits). The split depends only on the shape and the GPU:
//    deterministic run to run, no atomics.
//  * Statistics: bn_stats_* gives mean and biased variance in one read of x, from sums of
//    d = x - x[c's first element] and d^2 in double (the shift keeps E[d^2] - E[d]^2 from
//    cancelling when the mean is large against the spread). bn_mean_* then bn_var_* (the
//    variance about a given mean) are two reads, so sync-BN can all-reduce the mean between.
//  * Elementwise kernels (forward, backward_data) write every output element with `=`. The
//    forward adds an optional residual (same shape as x) and applies ReLU when `relu`, in its
//    compute type, rounding once: relu(bn(x) + residual) in one pass.
//  * ReLU without a residual is undone inside the backward: both backward kernels recompute
//    the forward's output from x (relu_passed) and zero gy where it was 0, so the ReLU's
//    gradient costs no pass over the activations of its own.
//  * The channels-last backward sums may join gy as they read it (Join): its two parts added
//    and the ReLU-after-residual mask applied, rounded once and stored, so the gradient that
//    arrives in parts (a block's output feeds two paths) costs no pass of its own either.
//  * update_running: running = keep * running + momentum * batch (keep = 1 - momentum, rounded
//    on the host; var made unbiased by count / (count - 1)), in place; one thread also adds 1
//    to the int64 batch counter. The forward kernels do the same update where given the
//    running arrays (Running<P>, passed by value: rm null for none).

#include "common.cuh"

// The running estimates' update of channel c: running = keep * running + momentum * batch
// (var made unbiased). bn_update_running_kernel, and the forward kernels where the launcher
// hands them the running arrays (rm non-null): one launch fewer a layer, the same bits.
template <typename P>
struct Running {
  P *rm, *rv;
  long long* batches;
  P keep, momentum, unbias;
  __device__ __forceinline__ void update(const P* mean, const P* var, int c) const {
    rm[c] = keep * rm[c] + momentum * mean[c];
    rv[c] = keep * rv[c] + momentum * (var[c] * unbias);
  }
};

// Whether relu(bn(x)) was positive, as the forward rounded it to T: where the ReLU's
// gradient passes. Recomputed from x, so the backward needs neither the output nor a pass
// of its own.
template <typename T, typename P>
__device__ __forceinline__ bool relu_passed(P x, P mu, P scale, P bias) {
  return as<P>(as<T>(bn_affine(x, mu, scale, bias))) > P(0);
}

// The partial-sum loop of every channel reduction: for each channel c of this block and each
// of its groups, body(acc, c, offset of the group's first element, its element count m);
// then acc[0..R) reduced over the block and written to ws.
template <int R, typename T, typename Body>
__device__ __forceinline__ void channel_partials(double* ws, int N, int C, int S, int chunk,
                                                 Body body) {
  __shared__ double shared[32];
  constexpr int V = Group<T>::size;
  const int G = (S + V - 1) / V, i0 = blockIdx.y * chunk, i1 = min(N * G, i0 + chunk);
  for (int c = blockIdx.x; c < C; c += gridDim.x) {
    double acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0;
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
      const int n = i / G, s0 = (i - n * G) * V;
      body(acc, c, (n * C + c) * S + s0, min(V, S - s0));
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const double total = block_reduce<double, SumOp>(acc[r], shared);
      if (threadIdx.x == 0) ws[((long long)blockIdx.y * R + r) * C + c] = total;
    }
  }
}

// ws[(y * 2) * C + c] = sum over block y's part of channel c of d = x - x[c * S], and
// ws[(y * 2 + 1) * C + c] of d^2.
template <typename T>
__global__ void bn_stats_partial_kernel(double* ws, const T* x, int N, int C, int S, int chunk,
                                        int vec) {
  constexpr int V = Group<T>::size;
  channel_partials<2, T>(ws, N, C, S, chunk, [&](double (&acc)[2], int c, int o, int m) {
    const double shift = as<double>(x[c * S]);
    double v[V];
    load_group(v, x + o, m, vec);
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (k < m) {
        const double d = v[k] - shift;
        acc[0] += d;
        acc[1] += d * d;
      }
  });
}

constexpr int FOLD_LANES = 32;

// The sum of the FOLD_LANES lanes' acc (lane threadIdx.y) of output threadIdx.x, in lane
// order; valid in lane 0. Every thread of the block must call it.
__device__ __forceinline__ double fold_lanes(double acc) {
  __shared__ double lanes[FOLD_LANES][32];
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.y == 0)
    for (int l = 0; l < FOLD_LANES; ++l) total += lanes[l][threadIdx.x];
  __syncthreads();  // lanes is reused by the caller's next call
  return total;
}

// The finalize kernels' sum of ws[y * n + j] over the splits y, for j = blockIdx.x * 32 +
// threadIdx.x (blocks of 32 x FOLD_LANES threads): lane threadIdx.y adds the splits y = lane,
// lane + FOLD_LANES, ... in order, then lane 0 the lanes' sums in order. A fixed order (the
// bits depend on the split count alone) with enough loads in flight to read hundreds of
// splits in a few microseconds. Every thread of the block must call it; valid in lane 0.
__device__ __forceinline__ double fold_splits(const double* ws, int splits, int n, int j) {
  double acc = 0.0;
  if (j < n)
    for (int y = threadIdx.y; y < splits; y += FOLD_LANES) acc += ws[(long long)y * n + j];
  return fold_lanes(acc);
}

// mean[c], var[c] from the shifted partial sums (fold_splits' order), blocks as fold_splits.
template <typename T, typename P = compute_t<T>>
__global__ void bn_stats_finalize_kernel(P* mean, P* var, const double* ws, const T* x,
                                         int splits, int C, int S, double count) {
  const int c = blockIdx.x * 32 + threadIdx.x;
  const double s1 = fold_splits(ws, splits, 2 * C, c), s2 = fold_splits(ws, splits, 2 * C, C + c);
  if (threadIdx.y == 0 && c < C) {
    const double d = s1 / count;
    mean[c] = P(as<double>(x[c * S]) + d);
    var[c] = P(fmax(s2 / count - d * d, 0.0));
  }
}

// A convolution's per-tile statistics (conv2d_wgmma.cu's `stats`: per pixel tile t of
// `rows` pixels, the last one count - rows * (tiles - 1), the float shift, sum of d and sum
// of d^2 at ts[(t * 3 + r) * C + c]) as bn_stats_partial_kernel's partials: each tile's sums
// moved to tile 0's shift (the first pixel, as there) in double; block y of grid (C / 32,
// splits) takes tiles [y * chunk, (y + 1) * chunk), its lanes (FOLD_LANES) every
// FOLD_LANES-th, then fold_lanes. bn_stats_finalize_kernel<float> with x = ts, S = 1 (tile
// 0's shifts) finishes: the same formula. (T: float, the tiles' sums.)
template <typename T>
__global__ void bn_tile_stats_partial_kernel(double* ws, const T* ts, int tiles, int C, int rows,
                                             double count, int chunk) {
  const int c = blockIdx.x * 32 + threadIdx.x;
  const long long n3 = 3LL * C;
  double s1 = 0.0, s2 = 0.0;
  if (c < C) {
    const double shift0 = ts[c];
    for (int t = blockIdx.y * chunk + threadIdx.y, end = min(tiles, (blockIdx.y + 1) * chunk);
         t < end; t += FOLD_LANES) {
      const double n = t < tiles - 1 ? rows : count - (double)rows * (tiles - 1);
      const double delta = (double)ts[t * n3 + c] - shift0, a = ts[t * n3 + C + c];
      s1 += a + n * delta;
      s2 += (double)ts[t * n3 + 2 * C + c] + delta * (2.0 * a + n * delta);
    }
  }
  s1 = fold_lanes(s1);
  s2 = fold_lanes(s2);
  if (threadIdx.y == 0 && c < C) {
    ws[(long long)blockIdx.y * 2 * C + c] = s1;
    ws[((long long)blockIdx.y * 2 + 1) * C + c] = s2;
  }
}

// ws[y * C + c] = sum over block y's part of channel c of x.
template <typename T>
__global__ void bn_mean_partial_kernel(double* ws, const T* x, int N, int C, int S, int chunk,
                                       int vec) {
  constexpr int V = Group<T>::size;
  channel_partials<1, T>(ws, N, C, S, chunk, [&](double (&acc)[1], int, int o, int m) {
    double v[V];
    load_group(v, x + o, m, vec);
#pragma unroll
    for (int k = 0; k < V; ++k) acc[0] += v[k];  // lanes past m are zero
  });
}

// ws[y * C + c] = sum over block y's part of channel c of (x - mean[c])^2.
template <typename T>
__global__ void bn_var_partial_kernel(double* ws, const T* x, const compute_t<T>* mean, int N,
                                      int C, int S, int chunk, int vec) {
  constexpr int V = Group<T>::size;
  channel_partials<1, T>(ws, N, C, S, chunk, [&](double (&acc)[1], int c, int o, int m) {
    const double mu = (double)mean[c];
    double v[V];
    load_group(v, x + o, m, vec);
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (k < m) acc[0] += (v[k] - mu) * (v[k] - mu);
  });
}

// out[j] = T(sum_y ws[y * n + j] / divisor), the partials added in fold_splits' order
// (blocks as there). With add0 (n = 2c: batch norm's sums), row 0 is also added into add0
// and row 1 into add1 (the bias and weight .grad): the bits of adding the rows afterwards,
// without those launches.
template <typename T>
__global__ void bn_finalize_kernel(T* out, const double* ws, int splits, int n, double divisor,
                                   T* add0, T* add1, int c) {
  const int j = blockIdx.x * 32 + threadIdx.x;
  const double acc = fold_splits(ws, splits, n, j);
  if (threadIdx.y == 0 && j < n) {
    const T v = T(acc / divisor);
    out[j] = v;
    if (add0) {
      T* dst = j < c ? add0 + j : add1 + (j - c);
      *dst = *dst + v;
    }
  }
}

// Group j of an elementwise kernel's planes * G groups: its channel, the offset of its first
// element and its element count.
struct GroupAt { int c, o, m; };
template <typename T> __device__ __forceinline__ GroupAt group_at(int j, int G, int C, int S) {
  constexpr int V = Group<T>::size;
  const int p = j / G, s0 = (j - p * G) * V;
  return {p % C, p * S + s0, min(V, S - s0)};
}

// f(at) for each 16-byte group of the (planes, S) array of C channels, a group per thread
// (grid-stride, 32-bit indices): the loop of the flat per-element kernels.
template <typename T, class F>
__device__ __forceinline__ void for_each_group(int planes, int C, int S, F&& f) {
  const int G = (S + Group<T>::size - 1) / Group<T>::size;
  GRID_STRIDE_32(j, planes * G) f(group_at<T>(j, G, C, S));
}

// y = (x - mean) * (invstd * weight) + bias [+ residual], then max(., 0) when relu.
template <typename T, typename P = compute_t<T>>
__global__ void bn_forward_kernel(T* y, const T* x, const T* residual, const P* mean,
                                  const P* var, const P* weight, const P* bias, P eps,
                                  int planes, int C, int S, int relu, int vec, Running<P> run) {
  constexpr int V = Group<T>::size;
  if (run.rm && blockIdx.x == 0) {  // block 0 also updates the running estimates
    for (int c = threadIdx.x; c < C; c += blockDim.x) run.update(mean, var, c);
    if (threadIdx.x == 0) run.batches[0] += 1;
  }
  for_each_group<T>(planes, C, S, [&](const GroupAt& at) {
    const P scale = inv_std(var[at.c], eps) * weight[at.c], mu = mean[at.c], b = bias[at.c];
    P v[V], r[V];
    load_group(v, x + at.o, at.m, vec);
    if (residual) load_group(r, residual + at.o, at.m, vec);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      v[k] = bn_affine(v[k], mu, scale, b);
      if (residual) v[k] = v[k] + r[k];
      if (relu) v[k] = v[k] < P(0) ? P(0) : v[k];
    }
    store_group(y + at.o, v, at.m, vec);
  });
}

template <typename T>
__global__ void bn_update_running_kernel(Running<T> run, const T* mean, const T* var, int C) {
  GRID_STRIDE_32(c, C) { run.update(mean, var, c); }
  if (blockIdx.x == 0 && threadIdx.x == 0) run.batches[0] += 1;
}

// ws[(y * 2) * C + c] = sum over block y's part of channel c of gy, ws[(y * 2 + 1) * C + c]
// of gy * xhat. With relu_weight and relu_bias (a forward that applied ReLU without a
// residual, with these parameters), gy is first zeroed where the forward's output was.
template <typename T, typename P = compute_t<T>>
__global__ void bn_backward_partial_kernel(double* ws, const T* gy, const T* x, const P* mean,
                                           const P* var, const P* relu_weight,
                                           const P* relu_bias, P eps, int N, int C, int S,
                                           int chunk, int vec) {
  constexpr int V = Group<T>::size;
  channel_partials<2, T>(ws, N, C, S, chunk, [&](double (&acc)[2], int c, int o, int m) {
    const double mu = (double)mean[c];
    const double invstd = 1.0 / sqrt((double)var[c] + (double)eps);
    double g[V], v[V];
    load_group(g, gy + o, m, vec);  // lanes past m are zero: they add nothing
    load_group(v, x + o, m, vec);
    if (relu_weight) {
      const P scale = inv_std(var[c], eps) * relu_weight[c], b = relu_bias[c];
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (!relu_passed<T>(P(v[k]), mean[c], scale, b)) g[k] = 0.0;
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
      acc[0] += g[k];
      acc[1] += g[k] * (v[k] - mu) * invstd;
    }
  });
}

// dx = weight * invstd * (gy - sums[c] / count - xhat * sums[C + c] / count); with relu_bias
// (a forward that applied ReLU without a residual), gy zeroed first where its output was.
template <typename T, typename P = compute_t<T>>
__global__ void bn_backward_data_kernel(T* dx, const T* gy, const T* x, const P* mean,
                                        const P* var, const P* weight, const P* sums,
                                        const P* relu_bias, P eps, P inv_count, int planes,
                                        int C, int S, int vec) {
  constexpr int V = Group<T>::size;
  for_each_group<T>(planes, C, S, [&](const GroupAt& at) {
    const P invstd = inv_std(var[at.c], eps), mu = mean[at.c];
    const P mean_g = sums[at.c] * inv_count, mean_gx = sums[C + at.c] * inv_count;
    const P scale = invstd * weight[at.c];  // the forward's scale, bit for bit
    P g[V], v[V];
    load_group(g, gy + at.o, at.m, vec);
    load_group(v, x + at.o, at.m, vec);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (relu_bias && !relu_passed<T>(v[k], mu, scale, relu_bias[at.c])) g[k] = P(0);
      const P xhat = (v[k] - mu) * invstd;
      g[k] = (g[k] - mean_g - xhat * mean_gx) * scale;
    }
    store_group(dx + at.o, g, at.m, vec);
  });
}

// ---------------------------------------------------------------------------- channels-last
// x as (rows, C) with the channel last (an NHWC activation, or any (N, C) batch), C a whole
// number of 16-byte groups and at most CL_THREADS groups, every array 16-byte aligned (the launcher
// checks; else the kernels above run with S = 1). A thread moves one group of V consecutive
// channels of a row; the block's 256 threads cover RPI = 256 / (C / V) rows at a time.
// A thread keeps to one channel group, its per-channel constants in registers. The
// elementwise kernels do the NCHW kernels' arithmetic, per element, so a forward and a
// backward round alike; the reductions sum a thread's rows in the compute type (below).
constexpr int CL_THREADS = 256;  // (256 / (C / V) rows at a time)

// Thread t's channel group in every channels-last kernel: channels c0.. of rows t / (C / V)
// + RPI * i (cl_rows).
__device__ __forceinline__ int cl_channel(int C, int V) { return threadIdx.x % (C / V) * V; }

// The 16-byte groups a thread of a channels-last kernel has in flight: a ring of
// CL_RING / A rows of its A arrays in dynamic shared memory (CL_RING * CL_THREADS * 16 bytes
// a block, the launcher's RING_BYTES). ResNet-50's shapes, H200, bf16: the backward sums
// 169 -> 103 us and the backward-data 219 -> 165 us at 205 MB an array, against 4 rows
// loaded into registers before use (about 2.4 and 2.9 TB/s; by our reading, not profiled,
// because their registers allowed two blocks an SM and a thread had no loads in flight while
// it computed).
constexpr int CL_RING = 8;

// Which row of each array a row of x reads: the same one (SameRows: plain loads, no call),
// or, where kZeros, the row its operator() gives, -1 for a zero-filled group (Join's
// SpreadRows).
struct SameRows {
  static constexpr bool kZeros = false;
};

// The row loop of every channels-last kernel: block y takes rows [y * chunk, min(rows,
// (y + 1) * chunk)) and thread t the channel group c0 = (t % (C / V)) * V of rows t / (C / V)
// + RPI * i (so c0, and every per-channel constant, is the thread's own for the whole loop),
// in that order; f(o, packs) runs on each (o its group's element offset, packs the groups of
// the A arrays src[a], null: not read). Each thread copies its own groups with cp.async
// into its slots of the ring, CL_RING / A - 1 rows ahead of the row f works on, and reads
// back only what it copied: no barrier. `rows_of` maps a row to the row each array reads.
template <int A, typename T, typename F, typename Rows = SameRows>
__device__ __forceinline__ void cl_rows(const T* const (&src)[A], int rows, int C, int chunk,
                                        F f, Rows rows_of = Rows{}) {
  constexpr int V = Group<T>::size, STAGES = CL_RING / A;
  static_assert(STAGES >= 2, "a ring of two rows at least");
  extern __shared__ uint4 ring[];  // [stage][array][thread]
  const int groups = C / V, rpi = CL_THREADS / groups;
  const int lr = threadIdx.x / groups, c0 = cl_channel(C, V);
  const int r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
  if (lr >= rpi) return;
  const int n = r1 - r0 > lr ? (r1 - r0 - lr + rpi - 1) / rpi : 0;  // this thread's rows
  const auto at = [&](int i) { return (long long)(r0 + lr + i * rpi) * C + c0; };
  const auto slot = [&](int i, int a) {
    return ring + ((i % STAGES) * A + a) * CL_THREADS + threadIdx.x;
  };
  const auto issue = [&](int i) {  // row i's groups into its slots (an empty group past n)
    if (i < n)
#pragma unroll
      for (int a = 0; a < A; ++a)
        if (!src[a]) {
        } else if constexpr (Rows::kZeros) {
          const long long r = rows_of(a, r0 + lr + (long long)i * rpi);
          cp_async16(slot(i, a), r < 0 ? src[a] : src[a] + r * C + c0, r < 0 ? 0 : 16);
        } else {
          cp_async16(slot(i, a), src[a] + at(i), 16);
        }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
  for (int i = 0; i < n; ++i) {
    issue(i + STAGES - 1);  // into the slots row i - 1 was read from
    cp_async_wait<STAGES - 1>();
    Pack<T, V> raw[A];
#pragma unroll
    for (int a = 0; a < A; ++a)
      if (src[a]) raw[a] = *reinterpret_cast<const Pack<T, V>*>(slot(i, a));
    f(at(i), raw);
  }
}

// The partial sums of the channels-last reductions over cl_rows: add(acc, v, o) adds one
// row's groups v[a][k] (channel c0 + k of array a; o the groups' element offset) into
// acc[r][k]. A thread's sums are in the compute type P for 16-bit x (a few hundred rows at
// most: 3 * SMs splits of rows / RPI; float keeps the registers of a 16-bit group); the RPI
// threads of each channel group are then added in double, in row order, through shared
// memory, and ws[(y * R + r) * C + c] written.
template <int R, int A, typename Acc, typename T, typename Add, typename Rows = SameRows>
__device__ __forceinline__ void cl_partials(double* ws, const T* const (&src)[A], int rows,
                                            int C, int chunk, Add add, Rows rows_of = Rows{}) {
  constexpr int V = Group<T>::size;
  __shared__ double sums[R * CL_THREADS * V];  // [r][row of the block][channel]
  const int groups = C / V, rpi = CL_THREADS / groups;
  const int lr = threadIdx.x / groups, c0 = cl_channel(C, V);
  Acc acc[R][V];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int k = 0; k < V; ++k) acc[r][k] = Acc(0);
  cl_rows<A, T>(src, rows, C, chunk, [&](long long o, const Pack<T, V> (&raw)[A]) {
    Acc v[A][V];
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
      for (int k = 0; k < V; ++k) v[a][k] = as<Acc>(raw[a].v[k]);
    add(acc, v, o);
  }, rows_of);
  if (lr < rpi)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int k = 0; k < V; ++k) sums[(r * rpi + lr) * C + c0 + k] = (double)acc[r][k];
  __syncthreads();
  for (int j = threadIdx.x; j < R * C; j += CL_THREADS) {
    const int r = j / C, c = j - r * C;
    double total = 0.0;
    for (int i = 0; i < rpi; ++i) total += sums[(r * rpi + i) * C + c];
    ws[((long long)blockIdx.y * R + r) * C + c] = total;
  }
}

// What a thread sums its rows' statistics in: float for 16-bit x (a few hundred shifted
// values of 8 or 11 bits each; with a double conversion and three double operations per
// element the kernel read 1.6 TB/s, and ResNet-18's 20 launches fell from 499 to 320 us in
// float), double for float and double x (float sums failed ResNet-18's strict fp32
// gradient check, at 0.7%).
template <typename T> struct StatSum { using type = double; };
template <> struct StatSum<__half> { using type = float; };
template <> struct StatSum<__nv_bfloat16> { using type = float; };

// bn_stats_partial_kernel's sums (about x's first row) over rows of channels-last x.
template <typename T>
__global__ void __launch_bounds__(CL_THREADS) bn_stats_partial_cl_kernel(double* ws, const T* x,
                                                                         int rows, int C,
                                                                         int chunk) {
  constexpr int V = Group<T>::size;
  using S = typename StatSum<T>::type;
  S shift[V];  // the thread's channels of row 0
  load_group(shift, x + cl_channel(C, V), V, true);
  const T* const src[1] = {x};
  cl_partials<2, 1, S, T>(ws, src, rows, C, chunk, [&](S (&acc)[2][V], S (&v)[1][V],
                                                        long long) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const S d = v[0][k] - shift[k];
      acc[0][k] += d;
      acc[1][k] += d * d;
    }
  });
}

// bn_mean_partial_kernel, channels-last.
template <typename T>
__global__ void __launch_bounds__(CL_THREADS) bn_mean_partial_cl_kernel(double* ws, const T* x,
                                                                        int rows, int C,
                                                                        int chunk) {
  constexpr int V = Group<T>::size;
  const T* const src[1] = {x};
  cl_partials<1, 1, double, T>(ws, src, rows, C, chunk, [&](double (&acc)[1][V],
                                                            double (&v)[1][V], long long) {
#pragma unroll
    for (int k = 0; k < V; ++k) acc[0][k] += v[0][k];
  });
}

// bn_var_partial_kernel, channels-last.
template <typename T>
__global__ void __launch_bounds__(CL_THREADS) bn_var_partial_cl_kernel(
    double* ws, const T* x, const compute_t<T>* mean, int rows, int C, int chunk) {
  constexpr int V = Group<T>::size;
  double mu[V];
  load_group(mu, mean + cl_channel(C, V), V, false);
  const T* const src[1] = {x};
  cl_partials<1, 1, double, T>(ws, src, rows, C, chunk, [&](double (&acc)[1][V],
                                                            double (&v)[1][V], long long) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const double d = v[0][k] - mu[k];
      acc[0][k] += d * d;
    }
  });
}

// The gradient a channels-last backward reduction joins as it reads (bn_backward_partial_cl
// with JOIN): gy = a + b (b null: a alone) in the compute type, zero where the forward's
// output y (null: no such mask) was not positive, rounded once to T and stored at out:
// add's, relu_backward's or relu_backward_sum's bits, without their pass. With SPREAD, b is
// a Spread's product (dptrain/backend/spread.py): (N, bh, bw, C) at the pixels (sh * i - ph,
// sw * j - pw) of x's (N, h, w) grid, 0 at every other pixel (a zero-filled load: a + 0 as
// the stored spread gave), so the zeros are never written nor read.
template <typename T> struct Join {
  const T *b, *y;
  T* out;
  int h, w, bh, bw, sh, sw, ph, pw;
};

// The rows a join with a Spread's b reads: b's row of grid pixel `row` (-1: a zero), the
// row itself for the other arrays. 32-bit divisions: the launcher checks the rows fit.
template <typename T> struct SpreadRows {
  static constexpr bool kZeros = true;
  const Join<T>& j;
  __device__ __forceinline__ long long operator()(int a, long long row) const {
    if (a != 2) return row;
    const unsigned r = (unsigned)row, hw = (unsigned)(j.h * j.w), img = r / hw;
    const unsigned p = r - img * hw, py = p / (unsigned)j.w, y = py + j.ph;
    const unsigned x = p - py * j.w + j.pw, i = y / j.sh, k = x / j.sw;
    if (y - i * j.sh || x - k * j.sw || i >= (unsigned)j.bh || k >= (unsigned)j.bw) return -1;
    return ((long long)img * j.bh + i) * j.bw + k;
  }
};

// bn_backward_partial_kernel, channels-last: the constants of each channel staged once. Two
// blocks an SM (the launcher's BACKWARD_PER_SM; three ran 25% slower on ResNet-50's shapes).
// JOIN: gy is the Join's a (read as gy), joined with b and masked by y first and stored;
// SPREAD: b is a Spread's product (SpreadRows; other launches keep cl_rows' plain loads).
template <typename T, typename P = compute_t<T>, bool JOIN = false, bool SPREAD = false>
__global__ void __launch_bounds__(CL_THREADS) bn_backward_partial_cl_kernel(
    double* ws, Join<T> join, const T* gy, const T* x, const P* mean, const P* var,
    const P* relu_weight, const P* relu_bias, P eps, int rows, int C, int chunk) {
  constexpr int V = Group<T>::size;
  const int c0 = cl_channel(C, V);
  P mu[V], invstd[V], scale[V], shift[V];  // the thread's channels'
#pragma unroll
  for (int k = 0; k < V; ++k) {
    mu[k] = mean[c0 + k];
    invstd[k] = inv_std(var[c0 + k], eps);
    scale[k] = relu_weight ? invstd[k] * relu_weight[c0 + k] : P(0);
    shift[k] = relu_weight ? relu_bias[c0 + k] : P(0);
  }
  constexpr int A = JOIN ? 4 : 2;
  auto add = [&](P (&acc)[2][V], P (&v)[A][V], long long o) {  // v: gy, x[, b, y]
    P g[V];
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = v[0][k];
    if constexpr (JOIN) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (join.b) g[k] = g[k] + v[2][k];
        if (join.y && !(v[3][k] > P(0))) g[k] = P(0);
        g[k] = as<P>(as<T>(g[k]));  // the sums see gy as stored
      }
      store_group(join.out + o, g, V, true);
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (relu_weight && !relu_passed<T>(v[1][k], mu[k], scale[k], shift[k])) g[k] = P(0);
      acc[0][k] += g[k];
      acc[1][k] += g[k] * (v[1][k] - mu[k]) * invstd[k];
    }
  };
  if constexpr (JOIN) {
    const T* const src[4] = {gy, x, join.b, join.y};
    if constexpr (SPREAD)
      cl_partials<2, 4, P, T>(ws, src, rows, C, chunk, add, SpreadRows<T>{join});
    else
      cl_partials<2, 4, P, T>(ws, src, rows, C, chunk, add);
  } else {
    const T* const src[2] = {gy, x};
    cl_partials<2, 2, P, T>(ws, src, rows, C, chunk, add);
  }
}

// bn_forward_kernel over channels-last x (cl_rows; grid (1, blocks), `chunk` rows each).
template <typename T, typename P = compute_t<T>>
__global__ void __launch_bounds__(CL_THREADS) bn_forward_cl_kernel(
    T* y, const T* x, const T* residual, const P* mean, const P* var, const P* weight,
    const P* bias, P eps, int relu, Running<P> run, int rows, int C, int chunk) {
  constexpr int V = Group<T>::size;
  const int c0 = cl_channel(C, V);
  if (run.rm && blockIdx.y == 0 && threadIdx.x < C / V) {  // also the running estimates
#pragma unroll
    for (int k = 0; k < V; ++k) run.update(mean, var, c0 + k);
    if (threadIdx.x == 0) run.batches[0] += 1;
  }
  P mu[V], scale[V], shift[V];  // the thread's channels'
#pragma unroll
  for (int k = 0; k < V; ++k) {
    mu[k] = mean[c0 + k];
    scale[k] = inv_std(var[c0 + k], eps) * weight[c0 + k];
    shift[k] = bias[c0 + k];
  }
  const T* const src[2] = {x, residual};
  cl_rows<2, T>(src, rows, C, chunk, [&](long long o, const Pack<T, V> (&raw)[2]) {
    P v[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      v[k] = bn_affine(as<P>(raw[0].v[k]), mu[k], scale[k], shift[k]);
      if (residual) v[k] = v[k] + as<P>(raw[1].v[k]);
      if (relu) v[k] = v[k] < P(0) ? P(0) : v[k];
    }
    store_group(y + o, v, V, true);
  });
}

// bn_backward_data_kernel over channels-last x (cl_rows, as the forward).
template <typename T, typename P = compute_t<T>>
__global__ void __launch_bounds__(CL_THREADS) bn_backward_data_cl_kernel(
    T* dx, const T* gy, const T* x, const P* mean, const P* var, const P* weight,
    const P* sums, const P* relu_bias, P eps, P inv_count, int rows, int C, int chunk) {
  constexpr int V = Group<T>::size;
  const int c0 = cl_channel(C, V);
  P mu[V], invstd[V], mean_g[V], mean_gx[V], scale[V], shift[V];  // the thread's channels'
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int c = c0 + k;
    mu[k] = mean[c];
    invstd[k] = inv_std(var[c], eps);
    mean_g[k] = sums[c] * inv_count;
    mean_gx[k] = sums[C + c] * inv_count;
    scale[k] = invstd[k] * weight[c];  // the forward's scale, bit for bit
    shift[k] = relu_bias ? relu_bias[c] : P(0);
  }
  const T* const src[2] = {gy, x};
  cl_rows<2, T>(src, rows, C, chunk, [&](long long o, const Pack<T, V> (&raw)[2]) {
    P g[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const P v = as<P>(raw[1].v[k]);
      g[k] = as<P>(raw[0].v[k]);
      if (relu_bias && !relu_passed<T>(v, mu[k], scale[k], shift[k])) g[k] = P(0);
      const P xhat = (v - mu[k]) * invstd[k];
      g[k] = (g[k] - mean_g[k] - xhat * mean_gx[k]) * scale[k];
    }
    store_group(dx + o, g, V, true);
  });
}

// instantiate: bn_stats_partial_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_stats_finalize_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_mean_partial_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_var_partial_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_finalize_kernel<{float, double}>
// instantiate: bn_forward_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_backward_partial_kernel<{__half, __nv_bfloat16, float, double}>
// instantiate: bn_backward_data_kernel<{__half, __nv_bfloat16, float, double}>
// instantiate: bn_update_running_kernel<{float, double}>
// instantiate: bn_tile_stats_partial_kernel<float>
// instantiate: bn_stats_partial_cl_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_mean_partial_cl_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_var_partial_cl_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_backward_partial_cl_kernel<{float, double, __half, __nv_bfloat16}>; bn_backward_partial_cl_kernel<{float, __half, __nv_bfloat16}, float, true, {false, true}>; bn_backward_partial_cl_kernel<double, double, true, {false, true}>
// instantiate: bn_forward_cl_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: bn_backward_data_cl_kernel<{float, double, __half, __nv_bfloat16}>
