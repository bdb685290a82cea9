// conv2d_direct.cu: direct (FFMA) convolution forward and backward-weight for layers whose
// filters are small, K = C_in*KH*KW <= 32 (a network's first layer on 1-3 channel images).
// Launchers: dptrain/backend/cuda/conv/direct.py (chosen by conv/passes.py's routes; conv2d.cu's implicit GEMM otherwise).
//
// Why: with K that small the implicit GEMM fills under a third of each 32-wide K slab, gathers
// every pixel through its generic per-element path, and backward-weight's 32 x 32 output tile
// holds 9 useful columns; the layer is bound by its activation traffic, which a direct kernel
// moves once.
//
// Conventions
//  * NCHW, weight (C_out, C_in, KH, KW) contiguous, read in its own order k = (c, kh, kw).
//    The tensor-core backward-weight reads a channels-last gy, (N, Ho, Wo, M), where `cl`
//    (a network's channels-last stem: no copy of gy to NCHW; x of one channel is either).
//    The 16-bit forward writes a channels-last y where CL (M even, at most DIRECT_CL_MAX_M):
//    a round of 256 pixels is staged in shared memory and stored as whole lines, its pixels
//    being contiguous in (N, Ho, Wo, M), and `stats` takes its batch statistics on the way.
//    (Stores straight from registers, 16 bytes of channels a thread, made the stem's forward
//    114.7 us against 95.7 for NCHW plus the launcher's transpose: fp16, 256 x 48 x 48 x 64,
//    H200.)
//  * KMAX (a multiple of 4, >= K) sizes the per-thread tap array; taps k >= K are zero.
//  * Forward: one thread per output pixel; its K input taps sit in registers and every output
//    channel's dot product reads the weights from shared memory (all lanes the same address:
//    a broadcast). Sums over k in order from 0, then + bias, in fp32 (more exact than TF32).
//  * Backward-weight: grid.y picks a group of MG output channels, each thread accumulates
//    MG x KMAX sums over the pixels of its grid-stride loop, the block reduces them in a fixed
//    order into ws[blockIdx.x][m][k], and splitk_reduce_kernel (gemm_tiles.cuh, instantiated in
//    conv2d.cu) sums the
//    blocks in order: bitwise repeatable, no atomics. The partials are float for every T.
//  * __half data: loaded into float, rounded once per stored output.
//  * Backward-weight in the tensor-core precisions (TF32, bf16, fp16) runs on tensor cores
//    instead (conv2d_direct_bwdw_mma_kernel, fp32 accumulation): the FFMA kernel spends ~15
//    instructions per useful FMA on tap loads, bounds checks and conversions (ncu:
//    issue-bound at 25% occupancy, and 35% slower in 16 bits than in fp32); the mma kernel
//    spends ~60 per 16 pixels x 32 channels x 8 taps. Same partials and reduction, so it
//    stays bitwise repeatable. The FFMA kernel remains for --precision fp32.
//
// instantiations-per-module: 1  (a run builds only those it uses: a shorter cold start)
// instantiate: conv2d_direct_fwd_kernel<{float, __half, __nv_bfloat16}, {4, 8, 12, 16, 20, 24, 28, 32}>; conv2d_direct_fwd_kernel<{__half, __nv_bfloat16}, {4, 8, 12, 16, 20, 24, 28, 32}, true>
// instantiate: conv2d_direct_bwdw_kernel<{float, __half, __nv_bfloat16}, 4, 8>; conv2d_direct_bwdw_kernel<{float, __half, __nv_bfloat16}, {8, 12, 16}, 4>; conv2d_direct_bwdw_kernel<{float, __half, __nv_bfloat16}, {20, 24, 28, 32}, 2>
// instantiate: conv2d_direct_bwdw_mma_kernel<{float, __half, __nv_bfloat16}, {1, 2, 3, 4}>

#include "gemm_tiles.cuh"  // mma_b16

#define DIRECT_MAX_M 128  // output channels the forward keeps in shared memory

// Field names match DIRECT_GEOM in dptrain/backend/cuda/launch.py (a NumPy structured dtype).
struct DirectGeom {
  int Nb, C, H, W, M, Ho, Wo, KH, KW, sh, sw, ph, pw;
};

// Filter tap k = (c, kh, kw): its offset c*H*W + kh*W + kw from the window's top-left pixel
// and (kh, kw) for the bounds check; a table in shared memory, so no thread divides per tap.
struct Tap {
  int off, kh, kw;
};

template <int KMAX>
__device__ __forceinline__ void fill_taps(Tap* taps, const DirectGeom& g) {
  const int khw = g.KH * g.KW, K = g.C * khw;
  for (int k = threadIdx.x; k < KMAX; k += blockDim.x) {
    const int c = k / khw, r = k - c * khw, kh = r / g.KW, kw = r - kh * g.KW;
    // k >= K: a tap that is never inside the image (kh = -2^20).
    taps[k] = k < K ? Tap{(c * g.H + kh) * g.W + kw, kh, kw} : Tap{0, -(1 << 20), 0};
  }
}

// v[k] = x[n, c, oy*sh - ph + kh, ox*sw - pw + kw] for tap k, 0 outside the image (and for
// the padding taps k >= K).
template <int KMAX, typename T>
__device__ __forceinline__ void load_taps(float (&v)[KMAX], const T* __restrict__ x,
                                          const Tap* taps, const DirectGeom& g, int n, int oy,
                                          int ox) {
  const int iy0 = oy * g.sh - g.ph, ix0 = ox * g.sw - g.pw;
  const T* xw = x + (long long)n * g.C * g.H * g.W + (iy0 * g.W + ix0);
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const Tap t = taps[k];
    const bool in = (unsigned)(iy0 + t.kh) < (unsigned)g.H && (unsigned)(ix0 + t.kw) < (unsigned)g.W;
    v[k] = in ? as<float>(xw[t.off]) : 0.f;
  }
}

// Output channel m's dot product with a pixel's taps v, weights from shared memory.
template <int KMAX>
__device__ __forceinline__ float direct_dot(const float4* sw4, const float (&v)[KMAX], int m) {
  const float4* wm = sw4 + m * (KMAX / 4);
  float acc = 0.f;
#pragma unroll
  for (int k4 = 0; k4 < KMAX / 4; ++k4) {
    const float4 f = wm[k4];
    acc = fmaf(f.x, v[4 * k4], acc);
    acc = fmaf(f.y, v[4 * k4 + 1], acc);
    acc = fmaf(f.z, v[4 * k4 + 2], acc);
    acc = fmaf(f.w, v[4 * k4 + 3], acc);
  }
  return acc;
}

// DIRECT_TILE: the statistics' pixel tile (norm.py's TILE_PIXELS)
constexpr int DIRECT_CL_MAX_M = 64, DIRECT_TILE = 128;

// Two neighbouring channels of one pixel, as stored: one 32-bit word (16-bit T).
template <typename T> struct alignas(2 * sizeof(T)) ChannelPair { T a, b; };

// The batch statistics of a channels-last round's two DIRECT_TILE-pixel tiles from the
// staged outputs (as stored): per channel c, the tile's first pixel (the shift), the sum of
// d = y - shift and of d^2, at stats[(tile * 3 + r) * M + c], conv2d_wgmma.cu's layout. Two
// threads a channel of a tile, 64 pixels each, in pixel order, then lane pairs added. (Four
// interleaved sums a thread, for more loads in flight, made the stem's forward 89.2 us
// against 78.9: ResNet-18 fp16, H200, one profile each.)
template <typename T>
__device__ __forceinline__ void direct_round_stats(const ChannelPair<T>* stage, int pitch,
                                                   long long base, int cnt, int M,
                                                   float* stats) {
  const int j = threadIdx.x / DIRECT_TILE, r = threadIdx.x % DIRECT_TILE;
  const int c = r >> 1, h = r & 1, valid = min(max(cnt - j * DIRECT_TILE, 0), DIRECT_TILE);
  const auto at = [&](int i) {  // channel c of the tile's pixel i
    const ChannelPair<T> p = stage[(j * DIRECT_TILE + i) * pitch + (c >> 1)];
    return as<float>(c & 1 ? p.b : p.a);
  };
  float shift = 0.f, sum = 0.f, sq = 0.f;
  if (c < M && valid > 0) {
    shift = at(0);
    for (int i = h * 64, end = min(h * 64 + 64, valid); i < end; ++i) {
      const float d = at(i) - shift;
      sum += d;
      sq += d * d;
    }
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // both halves of the tile, in that order
  sq += __shfl_xor_sync(0xffffffffu, sq, 1);
  if (c < M && valid > 0 && h == 0) {
    const long long tile = base / DIRECT_TILE + j;
    stats[(tile * 3) * M + c] = shift;
    stats[(tile * 3 + 1) * M + c] = sum;
    stats[(tile * 3 + 2) * M + c] = sq;
  }
}

template <typename T, int KMAX, bool CL = false>
__global__ void __launch_bounds__(256) conv2d_direct_fwd_kernel(
    const T* __restrict__ w, const T* __restrict__ x, const T* __restrict__ bias,
    T* __restrict__ y, int has_bias, DirectGeom g, float* __restrict__ stats) {
  static_assert(KMAX % 4 == 0, "KMAX must be a multiple of 4");
  constexpr int MAX_M = CL ? DIRECT_CL_MAX_M : DIRECT_MAX_M;  // (CL: room for the stage)
  __shared__ float4 sw4[MAX_M * KMAX / 4];
  __shared__ float sb[MAX_M];
  __shared__ Tap taps[KMAX];
  float* sw = reinterpret_cast<float*>(sw4);
  const int K = g.C * g.KH * g.KW;
  fill_taps<KMAX>(taps, g);
  for (int i = threadIdx.x; i < g.M * KMAX; i += blockDim.x) {
    const int m = i / KMAX, k = i - m * KMAX;
    sw[i] = k < K ? as<float>(w[m * K + k]) : 0.f;
  }
  for (int m = threadIdx.x; m < g.M; m += blockDim.x) sb[m] = has_bias ? as<float>(bias[m]) : 0.f;
  __syncthreads();
  const int hw = g.Ho * g.Wo;
  const long long npix = (long long)g.Nb * hw;
  if constexpr (!CL) {
    GRID_STRIDE(q, npix) {
      const int n = (int)(q / hw), p = (int)(q - (long long)n * hw);
      const int oy = p / g.Wo, ox = p - oy * g.Wo;
      float v[KMAX];
      load_taps<KMAX>(v, x, taps, g, n, oy, ox);
      T* out = y + (long long)n * g.M * hw + p;
      for (int m = 0; m < g.M; ++m)
        out[(long long)m * hw] = as<T>(direct_dot<KMAX>(sw4, v, m) + sb[m]);
    }
  } else {
    // [pixel of the round][channel pair], pitch M / 2 + 1 words: a warp's 32 pixels writing
    // one pair hit 32 banks
    __shared__ ChannelPair<T> stage[256 * (DIRECT_CL_MAX_M / 2 + 1)];
    const int pairs = g.M / 2, pitch = pairs + 1;
    for (long long base = (long long)blockIdx.x * 256; base < npix;
         base += (long long)gridDim.x * 256) {
      const long long q = base + threadIdx.x;
      if (q < npix) {
        const int n = (int)(q / hw), p = (int)(q - (long long)n * hw);
        const int oy = p / g.Wo, ox = p - oy * g.Wo;
        float v[KMAX];
        load_taps<KMAX>(v, x, taps, g, n, oy, ox);
        for (int m = 0; m < g.M; m += 2)
          stage[threadIdx.x * pitch + m / 2] = ChannelPair<T>{
              as<T>(direct_dot<KMAX>(sw4, v, m) + sb[m]),
              as<T>(direct_dot<KMAX>(sw4, v, m + 1) + sb[m + 1])};
      }
      __syncthreads();
      const int cnt = (int)min(256LL, npix - base);
      ChannelPair<T>* out = reinterpret_cast<ChannelPair<T>*>(y + base * g.M);
      for (int i = threadIdx.x; i < cnt * pairs; i += 256) {  // the round's pixels are contiguous
        const int p = i / pairs;
        out[i] = stage[p * pitch + (i - p * pairs)];
      }
      if (stats) direct_round_stats<T>(stage, pitch, base, cnt, g.M, stats);
      __syncthreads();  // the stage is read before the next round writes it
    }
  }
}

// ws[blockIdx.x][m][k] = sum over this block's pixels of gy[n, m, p] * tap k of p, for the
// MG channels m of group blockIdx.y; the launcher sums ws over blockIdx.x.
template <typename T, int KMAX, int MG>
__global__ void __launch_bounds__(256) conv2d_direct_bwdw_kernel(
    const T* __restrict__ x, const T* __restrict__ gy, float* __restrict__ ws, DirectGeom g) {
  const int K = g.C * g.KH * g.KW, hw = g.Ho * g.Wo, m0 = blockIdx.y * MG;
  __shared__ Tap taps[KMAX];
  fill_taps<KMAX>(taps, g);
  __syncthreads();
  float acc[MG][KMAX];
#pragma unroll
  for (int j = 0; j < MG; ++j)
#pragma unroll
    for (int k = 0; k < KMAX; ++k) acc[j][k] = 0.f;
  GRID_STRIDE(q, (long long)g.Nb * hw) {
    const int n = (int)(q / hw), p = (int)(q - (long long)n * hw);
    const int oy = p / g.Wo, ox = p - oy * g.Wo;
    float v[KMAX];
    load_taps<KMAX>(v, x, taps, g, n, oy, ox);
    const T* gp = gy + ((long long)n * g.M + m0) * hw + p;
#pragma unroll
    for (int j = 0; j < MG; ++j) {
      const float d = m0 + j < g.M ? as<float>(gp[(long long)j * hw]) : 0.f;
#pragma unroll
      for (int k = 0; k < KMAX; ++k) acc[j][k] = fmaf(d, v[k], acc[j][k]);
    }
  }
  // Block reduction in a fixed order: lanes by shuffles, then the warps in order.
  __shared__ float part[256 / 32][MG * KMAX];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < MG; ++j)
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      float s = acc[j][k];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
      if (lane == 0) part[warp][j * KMAX + k] = s;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < MG * KMAX; i += blockDim.x) {
    const int j = i / KMAX, k = i - j * KMAX;
    if (k >= K || m0 + j >= g.M) continue;
    float s = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += part[w][i];
    ws[((long long)blockIdx.x * g.M + m0 + j) * K + k] = s;
  }
}

// Backward-weight on tensor cores: gw[m][j] = sum over pixels of gy[n, m, p] * tap j of p, a
// GEMM with the pixels as its K (fp32 accumulation). A warp walks whole output rows (n, oy)
// in segments of pixels; A = 16 channels x the segment of gy, B = the segment x 8 taps
// gathered from x, the thread's tap fixed (column lane / 4 of each of the NT 8-wide n-tiles,
// decoded once). Warp w of the grid takes rows w, w + warps, ...; grid.y picks 32 output
// channels. The block sums its warps in order into ws[blockIdx.x][m][j]; the launcher sums
// the blocks in order (splitk_reduce_kernel). Fragment registers follow the PTX layouts:
// a[mt][h + 2*kk] is channel gid + 8h at k-column half kk, b[nt][kk] is k-row half kk.
template <int NT>
struct MmaTaps {
  int off[NT], kh[NT], kw[NT];  // c*H*W, kh (-2^20 past the last tap), kw
  __device__ __forceinline__ MmaTaps(const DirectGeom& g, int gid) {
    const int K = g.C * g.KH * g.KW, khw = g.KH * g.KW;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int j = nt * 8 + gid, c = j / khw, r = j - c * khw, h = r / g.KW;
      off[nt] = c * g.H * g.W;
      kh[nt] = j < K ? h : -(1 << 20);
      kw[nt] = r - h * g.KW;
    }
  }
  // Tap nt of output pixel (oy, ox) of image xn (a zero outside the image or past K).
  template <typename U>
  __device__ __forceinline__ U at(const U* xn, const DirectGeom& g, int nt, int oy, int ox) const {
    const int iy = oy * g.sh - g.ph + kh[nt], ix = ox * g.sw - g.pw + kw[nt];
    const bool ok = ox < g.Wo && (unsigned)iy < (unsigned)g.H && (unsigned)ix < (unsigned)g.W;
    return ok ? xn[off[nt] + iy * g.W + ix] : U(0);
  }
};

// One row, TF32 (float data, m16n8k8): 8 pixels per step, each value rounded to tf32.
template <int NT>
__device__ __forceinline__ void bwdw_mma_row(float (&acc)[2][NT][4], const float* xn,
                                             const float* gr, const MmaTaps<NT>& taps,
                                             const DirectGeom& g, int m0, int oy, int, int gid,
                                             int tig, long long ms, int ps) {
  for (int ox0 = 0; ox0 < g.Wo; ox0 += 8) {
    unsigned a[2][4], b[NT][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const int m = mt * 16 + gid + h * 8, ox = ox0 + tig + kk * 4;
          const bool ok = m0 + m < g.M && ox < g.Wo;
          a[mt][h + 2 * kk] = to_tf32(ok ? gr[m * ms + (long long)ox * ps] : 0.f);
        }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) b[nt][kk] = to_tf32(taps.at(xn, g, nt, oy, ox0 + tig + kk * 4));
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_tf32(acc[mt][nt], a[mt], b[nt]);
  }
}

// One row, 16-bit data (m16n8k16): 16 pixels per step, each register a pair of neighbouring
// pixels (for gy one 32-bit load when `pairs`: NCHW, Wo even and gy 4-byte aligned), gy's
// channel m and pixel ox at gr[m * ms + ox * ps]. E: T's bits.
template <typename T, int NT>
__device__ __forceinline__ void bwdw_mma_row(float (&acc)[2][NT][4], const unsigned short* xn,
                                             const unsigned short* gr, const MmaTaps<NT>& taps,
                                             const DirectGeom& g, int m0, int oy, int pairs,
                                             int gid, int tig, long long ms, int ps) {
  using U = unsigned short;
  for (int ox0 = 0; ox0 < g.Wo; ox0 += 16) {
    unsigned a[2][4], b[NT][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const int m = mt * 16 + gid + h * 8, ox = ox0 + 2 * tig + kk * 8;
          const U* p = gr + m * ms + (long long)ox * ps;
          const bool mok = m0 + m < g.M;
          unsigned v = 0;
          if (pairs) {
            if (mok && ox < g.Wo) v = *reinterpret_cast<const unsigned*>(p);
          } else {
            v = (mok && ox < g.Wo ? p[0] : 0u) | (mok && ox + 1 < g.Wo ? p[ps] : 0u) << 16;
          }
          a[mt][h + 2 * kk] = v;
        }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const int ox = ox0 + 2 * tig + kk * 8;
        b[nt][kk] = (unsigned)taps.at(xn, g, nt, oy, ox) |
                    (unsigned)taps.at(xn, g, nt, oy, ox + 1) << 16;
      }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_b16<T>(acc[mt][nt], a[mt], b[nt]);
  }
}

// What the rows read x and gy as: float, or the raw bits of a 16-bit type.
template <typename T> struct MmaElem { using type = unsigned short; };
template <> struct MmaElem<float> { using type = float; };

template <typename T, int NT>
__global__ void __launch_bounds__(256) conv2d_direct_bwdw_mma_kernel(
    const T* __restrict__ x, const T* __restrict__ gy, float* __restrict__ ws, DirectGeom g,
    int pairs, int cl) {
  static_assert(NT >= 1 && NT <= 4, "K <= 32");
  constexpr int WARPS = 8;  // 256 threads; 32 channels per block
  using E = typename MmaElem<T>::type;
  const E* xs = reinterpret_cast<const E*>(x);
  const E* gs = reinterpret_cast<const E*>(gy);
  const int K = g.C * g.KH * g.KW, hw = g.Ho * g.Wo, m0 = blockIdx.y * 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
  const MmaTaps<NT> taps(g, gid);
  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  const int rows = g.Nb * g.Ho, warps = gridDim.x * WARPS;
  for (int row = blockIdx.x * WARPS + warp; row < rows; row += warps) {
    const int n = row / g.Ho, oy = row - n * g.Ho;
    const E* xn = xs + (long long)n * g.C * g.H * g.W;
    // channel m0 of row oy; channels ms apart, pixels ps (NCHW or channels-last gy)
    const E* gr = cl ? gs + (long long)row * g.Wo * g.M + m0
                     : gs + ((long long)n * g.M + m0) * hw + oy * g.Wo;
    const long long ms = cl ? 1 : hw;
    const int ps = cl ? g.M : 1;
    if constexpr (sizeof(T) == 4)
      bwdw_mma_row<NT>(acc, xn, gr, taps, g, m0, oy, pairs, gid, tig, ms, ps);
    else
      bwdw_mma_row<T, NT>(acc, xn, gr, taps, g, m0, oy, pairs, gid, tig, ms, ps);
  }

  // The warps' sums, added in warp order (fixed): acc element e of (mt, nt) is channel
  // mt*16 + gid + 8*(e/2), tap nt*8 + 2*tig + e%2.
  __shared__ float part[WARPS][32][NT * 8];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        part[warp][mt * 16 + gid + (e >> 1) * 8][nt * 8 + 2 * tig + (e & 1)] = acc[mt][nt][e];
  __syncthreads();
  for (int i = threadIdx.x; i < 32 * K; i += blockDim.x) {
    const int m = i / K, j = i - m * K;
    if (m0 + m >= g.M) continue;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += part[w][m][j];
    ws[((long long)blockIdx.x * g.M + m0 + m) * K + j] = s;
  }
}
