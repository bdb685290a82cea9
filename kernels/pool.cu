// pool.cu: 2-D max and average pooling over NCHW (max pooling channels-last too), forward
// and backward.
// Launchers: dptrain/backend/cuda/pool.py.
//
// Conventions
//  * All arrays contiguous NCHW; a "plane" is one (n, c) image of H*W (input) or Ho*Wo (output).
//  * Window of output (oh, ow): rows oh*sh - ph + [0, kh), cols ow*sw - pw + [0, kw).
//  * Max pool: padding acts as -inf (never chosen); idx is the flat h*W + w position of the
//    first maximum in window scan order (rows, then columns), NaN counting as the maximum,
//    exactly as the CPU backend's argmax.
//  * ReLU + max pool (one pass; the model's ReLU -> MaxPool2d pair): the max pool of relu(x),
//    with idx = -1 where that maximum is not > 0, as relu's gradient is zero there; the max
//    pool backward skips idx < 0, so it needs no mask and no saved ReLU output.
//  * __half data: compared, summed and divided in float, rounded once per stored value.
//  * Avg pool: padding counts in the divisor (kh*kw), PyTorch's default.
//  * Backward kernels write dx with `=` (they own every element of dx). No atomics:
//    - max, windows that tile the input (the usual MaxPool2d(k)): one thread per window
//      writes its kh*kw pixels (2 x 2: unrolled, max_pool_bwd_2x2_kernel);
//    - max: one warp per plane zeroes the plane's dx, then walks the plane's outputs 32 at a
//      time; lanes that picked the same input pixel are matched (__match_any_sync) and the
//      lowest of them adds their gy, summed in lane order. The order depends only on the
//      shapes and idx, so the result is deterministic, even for overlapping windows, and it
//      needs no kernel/stride/padding (max_pool2d_backward's contract does not pass them).
//    - avg: one thread per input pixel gathers from every window that contains it.

#include "common.cuh"

// Field names match PoolGeom in dptrain/backend/cuda/pool.py (a NumPy structured dtype).
struct PoolGeom {
  int n_c, h, w, ho, wo, kh, kw, sh, sw, ph, pw;  // n_c: planes (batch * channels)
};

// Output element i (flat over n_c * ho * wo): its plane p and the top-left corner (h0, w0) of
// its window, which may lie in the padding.
struct PoolWindow {
  long long p;
  int h0, w0;
};

__device__ __forceinline__ PoolWindow pool_window(const PoolGeom& g, long long i) {
  const int out_plane = g.ho * g.wo;
  const long long p = i / out_plane;
  const int r = (int)(i - p * out_plane);
  const int oh = r / g.wo, ow = r - oh * g.wo;
  return {p, oh * g.sh - g.ph, ow * g.sw - g.pw};
}

// visit(pos) for every input position pos = hh*W + ww of the window inside the image, rows
// then columns (the scan order both forward kernels and the CPU backend use).
template <typename F>
__device__ __forceinline__ void for_each_tap(const PoolGeom& g, const PoolWindow& win, F&& visit) {
  for (int a = 0; a < g.kh; ++a) {
    const int hh = win.h0 + a;
    if (hh < 0 || hh >= g.h) continue;
    for (int b = 0; b < g.kw; ++b) {
      const int ww = win.w0 + b;
      if (ww < 0 || ww >= g.w) continue;
      visit(hh * g.w + ww);
    }
  }
}

// The max scan of one window, fed its taps in scan order. kRelu: pool relu(x) (relu(v) =
// v < 0 ? 0 : v, NaN kept, as elementwise.cu's Relu) and mark the windows whose maximum is
// not > 0 with idx -1.
template <typename C, bool kRelu>
struct MaxScan {
  C best;
  int arg;
  __device__ __forceinline__ MaxScan() : best(neg_inf<C>()), arg(-1) {}
  __device__ __forceinline__ void take(C v, int pos) {
    if (kRelu && v < C(0)) v = C(0);
    if (arg < 0 || v > best || (v != v && best == best)) { best = v; arg = pos; }
  }
  template <typename T>
  __device__ __forceinline__ void store(T* y, int* idx, long long i) const {
    y[i] = as<T>(best);
    idx[i] = (kRelu && !(best > C(0))) ? -1 : arg;
  }
};

// kRelu: max pool of relu(x), see MaxScan.
template <typename T, bool kRelu>
__global__ void max_pool_fwd_kernel(T* y, int* idx, const T* x, PoolGeom g) {
  GRID_STRIDE(i, (long long)g.n_c * g.ho * g.wo) {
    const PoolWindow win = pool_window(g, i);
    const T* xp = x + win.p * g.h * g.w;
    MaxScan<compute_t<T>, kRelu> scan;
    for_each_tap(g, win, [&](int pos) { scan.take(as<compute_t<T>>(xp[pos]), pos); });
    scan.store(y, idx, i);
  }
}

// MaxPool2d(2) (2 x 2 windows, stride 2, no padding: every window inside the image; the
// launcher checks, and that the sizes fit int): max_pool_fwd_kernel with the window fixed at
// compile time and 32-bit indices (the generic loop's bounds checks and 64-bit divisions: a
// third of the step's pooling time, 110 -> 71 us at batch 256 under ncu).
template <typename T, bool kRelu>
__global__ void max_pool_fwd_2x2_kernel(T* y, int* idx, const T* x, PoolGeom g) {
  const int out_plane = g.ho * g.wo;
  GRID_STRIDE_32(i, g.n_c * out_plane) {
    const int p = i / out_plane, r = i - p * out_plane, oh = r / g.wo, ow = r - oh * g.wo;
    const T* xp = x + p * g.h * g.w;
    const int pos0 = 2 * oh * g.w + 2 * ow;
    MaxScan<compute_t<T>, kRelu> scan;
#pragma unroll
    for (int t = 0; t < 4; ++t) {  // rows, then columns: the generic scan order
      const int pos = pos0 + (t >> 1) * g.w + (t & 1);
      scan.take(as<compute_t<T>>(xp[pos]), pos);
    }
    scan.store(y, idx, i);
  }
}

// One warp per plane; see the header.
template <typename T>
__global__ void max_pool_bwd_kernel(T* dx, const T* gy, const int* idx, PoolGeom g) {
  const int lane = threadIdx.x & 31;
  const int in_plane = g.h * g.w, out_plane = g.ho * g.wo;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long p = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; p < g.n_c; p += warps) {
    T* d = dx + p * in_plane;
    const T* gp = gy + p * out_plane;
    const int* ip = idx + p * out_plane;
    using C = compute_t<T>;
    for (int e = lane; e < in_plane; e += 32) d[e] = as<T>(C(0));
    __syncwarp();
    for (int first = 0; first < out_plane; first += 32) {
      const int o = first + lane;
      const bool active = o < out_plane;
      // Inactive lanes (and corrupt indices) get a key no other lane has.
      int key = active ? ip[o] : -1 - lane;
      if (active && (key < 0 || key >= in_plane)) key = -1 - lane;
      const C gv = active ? as<C>(gp[o]) : C(0);
      const unsigned peers = __match_any_sync(FULL_MASK, key);
      C acc = C(0);
      for (int src = 0; src < 32; ++src) {  // uniform loop: every lane shuffles
        const C v = __shfl_sync(FULL_MASK, gv, src);
        if ((peers >> src) & 1u) acc += v;
      }
      if (key >= 0 && lane == __ffs(peers) - 1) d[key] = as<T>(as<C>(d[key]) + acc);
      __syncwarp();  // the next batch may add to the same pixel from another lane
    }
  }
}

// Windows that tile the input (window = stride, no padding, h = ho*kh, w = wo*kw; the
// launcher checks): every input pixel lies in exactly one window, so one thread per window
// writes all of its pixels, gy at the window's idx and 0 elsewhere: no zeroing pass, no
// sums, 32-bit index arithmetic (the launcher checks the sizes).
template <typename T>
__global__ void max_pool_bwd_tiled_kernel(T* dx, const T* gy, const int* idx, PoolGeom g) {
  const T zero = as<T>(0.f);
  const int out_plane = g.ho * g.wo, in_plane = g.h * g.w;
  GRID_STRIDE_32(i, g.n_c * out_plane) {
    const int p = i / out_plane, r = i - p * out_plane;
    const int oh = r / g.wo, ow = r - oh * g.wo;
    const int j = idx[i];
    const T v = gy[i];
    T* d = dx + p * in_plane;
    for (int a = 0; a < g.kh; ++a) {
      const int row = (oh * g.kh + a) * g.w + ow * g.kw;
      for (int b = 0; b < g.kw; ++b) d[row + b] = row + b == j ? v : zero;
    }
  }
}

// The same for 2 x 2 windows, unrolled.
template <typename T>
__global__ void max_pool_bwd_2x2_kernel(T* dx, const T* gy, const int* idx, PoolGeom g) {
  const T zero = as<T>(0.f);
  const int out_plane = g.ho * g.wo;
  GRID_STRIDE_32(i, g.n_c * out_plane) {
    const int p = i / out_plane, r = i - p * out_plane;
    const int oh = r / g.wo, ow = r - oh * g.wo;
    const int j = idx[i], row = 2 * oh * g.w + 2 * ow;
    const T v = gy[i];
    T* d = dx + p * g.h * g.w;
    d[row] = row == j ? v : zero;
    d[row + 1] = row + 1 == j ? v : zero;
    d[row + g.w] = row + g.w == j ? v : zero;
    d[row + g.w + 1] = row + g.w + 1 == j ? v : zero;
  }
}

template <typename T>
__global__ void avg_pool_fwd_kernel(T* y, const T* x, PoolGeom g) {
  using C = compute_t<T>;
  const C count = C(g.kh * g.kw);
  GRID_STRIDE(i, (long long)g.n_c * g.ho * g.wo) {
    const PoolWindow win = pool_window(g, i);
    const T* xp = x + win.p * g.h * g.w;
    C acc = C(0);
    for_each_tap(g, win, [&](int pos) { acc += as<C>(xp[pos]); });
    y[i] = as<T>(acc / count);
  }
}

// First output index whose window [o*s - p, o*s - p + k) reaches position v.
__device__ __forceinline__ int first_window(int v, int k, int s, int p) {
  const int num = v + p - k + 1;
  return num <= 0 ? 0 : (num + s - 1) / s;
}

template <typename T>
__global__ void avg_pool_bwd_kernel(T* dx, const T* gy, PoolGeom g) {
  using C = compute_t<T>;
  const int in_plane = g.h * g.w;
  const C count = C(g.kh * g.kw);
  GRID_STRIDE(i, (long long)g.n_c * in_plane) {
    const long long p = i / in_plane;
    const int r = (int)(i - p * in_plane);
    const int hh = r / g.w, ww = r - hh * g.w;
    const int oh0 = first_window(hh, g.kh, g.sh, g.ph), oh1 = min(g.ho - 1, (hh + g.ph) / g.sh);
    const int ow0 = first_window(ww, g.kw, g.sw, g.pw), ow1 = min(g.wo - 1, (ww + g.pw) / g.sw);
    const T* gp = gy + p * g.ho * g.wo;
    C acc = C(0);
    for (int oh = oh0; oh <= oh1; ++oh)
      for (int ow = ow0; ow <= ow1; ++ow) acc += as<C>(gp[oh * g.wo + ow]);
    dx[i] = as<T>(acc / count);  // one division (the CPU backend divides each term: same up to rounding)
  }
}

// Channels-last max pool: x (N, H, W, C), y and idx (N, Ho, Wo, C); PoolGeom's n_c is N * C
// and `c` is C. idx keeps the NCHW kernels' meaning (the flat h*W + w position of the window's
// first maximum, -1 for ReLU's zero windows), so the CPU reference holds it through NCHW
// copies. A thread takes kV neighbouring channels of one pixel (one load of up to 8 bytes
// a tap forward, 16 backward; the launcher picks kV dividing C) and neighbouring threads the
// next channels, with 32-bit index arithmetic (the launcher checks the sizes fit).
//
// The forward's loop: thread i takes kV channels ch.. of output pixel pix, scans its window's
// taps with lane v's value as value(t, v) (t the stored element; value = lanes(ch), made once
// a pixel, so it may hold its channels' constants; the value in compute_t<T>), and stores the
// maxima and their positions. kK > 0: the window is kK x kK (the launcher's), its taps'
// loads issued at once, those outside the image reading a pixel inside and skipped by the
// scan (the stem's fused 3x3/2 pool, fp16, b128: 254 -> 193 us, H200); kK = 0 walks the
// window tap by tap.
template <typename T, bool kRelu, int kV, int kK, class MakeValue>
__device__ __forceinline__ void max_pool_nhwc(T* y, int* idx, const T* x, const PoolGeom& g,
                                              int c, MakeValue lanes) {
  using C = compute_t<T>;
  const int groups = c / kV, out_pixels = g.ho * g.wo;
  GRID_STRIDE_32(i, g.n_c / kV * out_pixels) {
    const int pix = i / groups, ch = (i - pix * groups) * kV;
    const int n = pix / out_pixels, r = pix - n * out_pixels;
    const int oh = r / g.wo, ow = r - oh * g.wo;
    const PoolWindow win{n, oh * g.sh - g.ph, ow * g.sw - g.pw};
    const T* xp = x + n * g.h * g.w * c + ch;
    const auto value = lanes(ch);
    MaxScan<C, kRelu> scan[kV];
    const auto take = [&](const Lanes<T, kV>& t, int pos) {
#pragma unroll
      for (int v = 0; v < kV; ++v) scan[v].take(value(t.v[v], v), pos);
    };
    if constexpr (kK > 0) {
      Lanes<T, kV> t[kK][kK];
#pragma unroll
      for (int a = 0; a < kK; ++a)
#pragma unroll
        for (int b = 0; b < kK; ++b) {
          const int hh = min(max(win.h0 + a, 0), g.h - 1), ww = min(max(win.w0 + b, 0), g.w - 1);
          t[a][b] = load_lanes<T, kV>(xp + (hh * g.w + ww) * c);
        }
#pragma unroll
      for (int a = 0; a < kK; ++a)
#pragma unroll
        for (int b = 0; b < kK; ++b) {
          const int hh = win.h0 + a, ww = win.w0 + b;
          if (hh >= 0 && hh < g.h && ww >= 0 && ww < g.w) take(t[a][b], hh * g.w + ww);
        }
    } else {
      for_each_tap(g, win, [&](int pos) { take(load_lanes<T, kV>(xp + pos * c), pos); });
    }
#pragma unroll
    for (int v = 0; v < kV; ++v) scan[v].store(y, idx, pix * c + ch + v);
  }
}

template <typename T, bool kRelu, int kV, int kK>
__global__ void max_pool_fwd_nhwc_kernel(T* y, int* idx, const T* x, PoolGeom g, int c) {
  max_pool_nhwc<T, kRelu, kV, kK>(y, idx, x, g, c, [](int) {
    return [](T t, int) { return as<compute_t<T>>(t); };
  });
}

// max_pool_fwd_nhwc_kernel of relu(batch norm(x)), the batch norm's output never stored: each
// tap computed and rounded to T as bn_forward_cl_kernel computes and stores it (scale =
// inv_std(var, eps) * weight, bn_affine, ReLU), so y and idx are the bits of the two passes.
// The batch norm's statistics are per channel (C = compute_t<T>, as norm.cu's P). Each block
// first works out every channel's mean, scale and shift into its dynamic shared memory (3 *
// c values: the launcher's), so a thread's taps pay no square root or division.
template <typename T, int kV, int kK>
__global__ void bn_relu_max_pool_fwd_nhwc_kernel(T* y, int* idx, const T* x, PoolGeom g, int c,
                                                 const compute_t<T>* mean,
                                                 const compute_t<T>* var,
                                                 const compute_t<T>* weight,
                                                 const compute_t<T>* bias, compute_t<T> eps) {
  using C = compute_t<T>;
  extern __shared__ __align__(16) unsigned char affine_raw[];
  C* const mu = reinterpret_cast<C*>(affine_raw);
  C* const scale = mu + c;
  C* const shift = scale + c;
  for (int k = threadIdx.x; k < c; k += blockDim.x) {
    mu[k] = mean[k];
    scale[k] = inv_std(var[k], eps) * weight[k];
    shift[k] = bias[k];
  }
  __syncthreads();
  max_pool_nhwc<T, false, kV, kK>(y, idx, x, g, c, [&](int ch) {
    Lanes<C, kV> m, a, b;  // the pixel's channels' mean, scale and shift
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      m.v[v] = mu[ch + v];
      a.v[v] = scale[ch + v];
      b.v[v] = shift[ch + v];
    }
    return [=](T t, int v) {
      const C z = bn_affine(as<C>(t), m.v[v], a.v[v], b.v[v]);
      return as<C>(as<T>(z < C(0) ? C(0) : z));
    };
  });
}

// ---------------------------------------------------------------- the stem's 3 x 3 / 2 window
// ImageNet's stem pools 3 x 3 windows at stride 2 with padding 1: window (oh, ow) covers input
// rows 2oh - 1 .. 2oh + 1 and columns 2ow - 1 .. 2ow + 1, so the input pixels (2oh + a,
// 2ow + b), a, b in {0, 1}, lie in windows (oh, ow), (oh, ow + 1), (oh + 1, ow) and
// (oh + 1, ow + 1) alone (those that exist). The walking backward gives a thread kV channels
// ch.. of output column ow and a run of kRun output rows: it loads the run's kRun + 1 rows of
// windows at once, each once, takes column ow + 1's from that column's thread in the warp (a
// shuffle), and writes those four pixels a row. The warp's lanes take C / kV channel groups
// of 32 / (C / kV) neighbouring columns (the launcher checks C / kV divides 32); the columns
// are padded to whole warps, so every lane of a warp runs each iteration (the shuffles need
// them all) and the padding's columns store nothing. (A forward that walked the same way,
// each input row valued once and column 2ow - 1 shuffled from the left: 468 us at kRun 1,
// 613 at 2, against the window scans' 380; ResNet-50's stem, fp16, batch 256, H200:
// NOTES-gemm.md row 67.)
struct Walk {
  int ch, ow, oh0, oh1, n;
  bool last;  // the warp's last column: no right neighbour in the warp
};

__device__ __forceinline__ int walk_items(const PoolGeom& g, int c, int kV, int run) {
  const int groups = c / kV, per_warp = 32 / groups;
  return g.n_c / c * ((g.ho + run - 1) / run) * ((g.wo + per_warp - 1) / per_warp * per_warp) *
         groups;
}

__device__ __forceinline__ Walk walk_at(int i, const PoolGeom& g, int c, int kV, int run) {
  const int groups = c / kV, per_warp = 32 / groups;
  const int cols = (g.wo + per_warp - 1) / per_warp * per_warp, runs = (g.ho + run - 1) / run;
  const int lane = threadIdx.x & 31, ch = i % groups * kV, t = i / groups;
  const int ow = t % cols, r = t / cols % runs, n = t / cols / runs;
  return {ch, ow, r * run, min(g.ho, r * run + run), n, lane >= 32 - groups};
}

// The backward's walk: thread i writes the input pixels (2oh + a, 2ow + b), a, b in {0, 1},
// of its run's rows, each the sum of gy over the windows that chose it, in window order
// (rows, then columns: the gather's order, so its bits). The run's kRun + 1 rows of windows
// (oh, ow) are loaded at once; (oh, ow + 1) comes from the right neighbour's lane. `gb` (may
// be null): a second part of gy, added first as add(gy, gb) rounds it (a gradient that
// arrives in two parts costs no pass of its own).
template <typename T, int kV, int kRun>
__global__ void max_pool_bwd_walk_kernel(T* dx, const T* gy, const T* gb, const int* idx,
                                         PoolGeom g, int c) {
  using C = compute_t<T>;
  constexpr int WORDS = kV * sizeof(T) / 4;  // gy's lanes as 32-bit words (shuffled)
  struct Part {
    Lanes<T, kV> g;
    Lanes<int, kV> at;
  };
  const int groups = c / kV;
  GRID_STRIDE_32(i, walk_items(g, c, kV, kRun)) {
    const Walk at = walk_at(i, g, c, kV, kRun);
    // window (oh, ow + dw)'s part, or none (idx -1 chooses no pixel) past the windows
    const auto load = [&](int oh, int dw) {
      Part p;
      const int o = ((at.n * g.ho + min(oh, g.ho - 1)) * g.wo + min(at.ow + dw, g.wo - 1)) * c +
                    at.ch;
      p.g = load_lanes<T, kV>(gy + o);
      p.at = load_lanes<int, kV>(idx + o);
      if (gb) {
        const Lanes<T, kV> b = load_lanes<T, kV>(gb + o);
#pragma unroll
        for (int k = 0; k < kV; ++k) p.g.v[k] = as<T>(as<C>(p.g.v[k]) + as<C>(b.v[k]));
      }
      if (oh >= g.ho || at.ow + dw >= g.wo)
#pragma unroll
        for (int k = 0; k < kV; ++k) p.at.v[k] = -1;
      return p;
    };
    Part own[kRun + 1], right[kRun + 1];
#pragma unroll
    for (int j = 0; j <= kRun; ++j) own[j] = load(at.oh0 + j, 0);
#pragma unroll
    for (int j = 0; j <= kRun; ++j) {
      const unsigned* w = reinterpret_cast<const unsigned*>(&own[j].g);
      unsigned* r = reinterpret_cast<unsigned*>(&right[j].g);
#pragma unroll
      for (int k = 0; k < WORDS; ++k) r[k] = __shfl_down_sync(0xffffffffu, w[k], groups);
#pragma unroll
      for (int k = 0; k < kV; ++k)
        right[j].at.v[k] = __shfl_down_sync(0xffffffffu, own[j].at.v[k], groups);
      if (at.last) right[j] = load(at.oh0 + j, 1);
      if (at.ow + 1 >= g.wo)
#pragma unroll
        for (int k = 0; k < kV; ++k) right[j].at.v[k] = -1;
    }
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      const int oh = at.oh0 + j;
      if (oh >= at.oh1) break;
      const Part* parts[4] = {&own[j], &right[j], &own[j + 1], &right[j + 1]};
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int hh = 2 * oh + a, ww = 2 * at.ow + b, r = hh * g.w + ww;
          Lanes<T, kV> out;
#pragma unroll
          for (int k = 0; k < kV; ++k) {
            C acc = C(0);
#pragma unroll
            for (int p = 0; p < 4; ++p)  // (oh, ow), (oh, ow + 1), (oh + 1, ow), (oh + 1, ow + 1)
              if ((p & 1) <= b && (p >> 1) <= a && parts[p]->at.v[k] == r)
                acc += as<C>(parts[p]->g.v[k]);
            out.v[k] = as<T>(acc);
          }
          if (hh < g.h && ww < g.w)
            *reinterpret_cast<Lanes<T, kV>*>(dx + ((at.n * g.h + hh) * g.w + ww) * c + at.ch) =
                out;
        }
    }
  }
}

// Its backward: a thread per kV channels of an input pixel gathers gy from every window that
// contains the pixel and chose it (idx), in window order (rows, then columns), summed in
// float and rounded once; writes dx with `=`, no atomics. Needs the forward's window. (The
// stem's window walks instead: max_pool_bwd_walk_kernel.)
template <typename T, int kV>
__global__ void max_pool_bwd_nhwc_kernel(T* dx, const T* gy, const int* idx, PoolGeom g, int c) {
  using C = compute_t<T>;
  const int groups = c / kV, in_pixels = g.h * g.w;
  GRID_STRIDE_32(i, g.n_c / kV * in_pixels) {
    const int pix = i / groups, ch = (i - pix * groups) * kV;
    const int n = pix / in_pixels, r = pix - n * in_pixels;
    const int hh = r / g.w, ww = r - hh * g.w;
    const int oh0 = first_window(hh, g.kh, g.sh, g.ph), oh1 = min(g.ho - 1, (hh + g.ph) / g.sh);
    const int ow0 = first_window(ww, g.kw, g.sw, g.pw), ow1 = min(g.wo - 1, (ww + g.pw) / g.sw);
    C acc[kV];
#pragma unroll
    for (int v = 0; v < kV; ++v) acc[v] = C(0);
    const auto load = [&](int oh, int ow, Lanes<T, kV>& t, Lanes<int, kV>& k) {
      const int o = ((n * g.ho + oh) * g.wo + ow) * c + ch;
      t = load_lanes<T, kV>(gy + o);
      k = load_lanes<int, kV>(idx + o);
    };
    const auto take = [&](const Lanes<T, kV>& t, const Lanes<int, kV>& k) {
#pragma unroll
      for (int v = 0; v < kV; ++v)
        if (k.v[v] == r) acc[v] += as<C>(t.v[v]);
    };
    for (int oh = oh0; oh <= oh1; ++oh)
      for (int ow = ow0; ow <= ow1; ++ow) {
        Lanes<T, kV> t;
        Lanes<int, kV> k;
        load(oh, ow, t, k);
        take(t, k);
      }
    Lanes<T, kV> out;
#pragma unroll
    for (int v = 0; v < kV; ++v) out.v[v] = as<T>(acc[v]);
    *reinterpret_cast<Lanes<T, kV>*>(dx + pix * c + ch) = out;
  }
}

// instantiate: max_pool_fwd_kernel<{float, double, __half, __nv_bfloat16}, {false, true}>
// instantiate: max_pool_bwd_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: avg_pool_fwd_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: avg_pool_bwd_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: max_pool_bwd_tiled_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: max_pool_fwd_2x2_kernel<{float, double, __half, __nv_bfloat16}, {false, true}>
// instantiate: max_pool_bwd_2x2_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: max_pool_fwd_nhwc_kernel<{float, double, __half, __nv_bfloat16}, {false, true}, 1, {0, 3}>
// instantiate: max_pool_fwd_nhwc_kernel<{float, __half, __nv_bfloat16}, {false, true}, 2, {0, 3}>
// instantiate: max_pool_fwd_nhwc_kernel<{__half, __nv_bfloat16}, {false, true}, 4, {0, 3}>
// instantiate: bn_relu_max_pool_fwd_nhwc_kernel<{float, double, __half, __nv_bfloat16}, 1, {0, 3}>
// instantiate: bn_relu_max_pool_fwd_nhwc_kernel<{float, __half, __nv_bfloat16}, 2, {0, 3}>
// instantiate: bn_relu_max_pool_fwd_nhwc_kernel<{__half, __nv_bfloat16}, 4, {0, 3}>
// instantiate: max_pool_bwd_nhwc_kernel<{float, double, __half, __nv_bfloat16}, 1>
// instantiate: max_pool_bwd_nhwc_kernel<{float, double, __half, __nv_bfloat16}, 2>
// instantiate: max_pool_bwd_nhwc_kernel<{__half, __nv_bfloat16}, {4, 8}>
// instantiate: max_pool_bwd_nhwc_kernel<float, 4>
// instantiate: max_pool_bwd_walk_kernel<{__half, __nv_bfloat16}, {2, 4, 8}, 2>; max_pool_bwd_walk_kernel<float, {2, 4}, 2>
