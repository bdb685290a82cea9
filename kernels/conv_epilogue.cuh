// conv_epilogue.cuh: the epilogue of Hopper's convolution tiles (conv2d_wgmma.cu's kernels,
// conv2d_strip.cu's): a warpgroup's 64-row halves of a 128-pixel tile stored from the
// accumulators, and the tile's batch statistics summed in a fixed order.

#pragma once

#include "common.cuh"
#include "conv_geom.cuh"
#include "wgmma.cuh"

namespace wgmma_conv {
using namespace wgmma_tiles;

// Two adjacent output channels of one pixel as one store (channels-last output).
template <typename T> struct alignas(2 * sizeof(T)) Pair { T v[2]; };

// v[row][e] += bias[m + e] for the channels m, m + 1 below M; without a bias nothing is
// added (not + 0.f: a -0 stays -0).
template <typename T>
__device__ __forceinline__ void add_bias(float (&v)[2][2], int m, int M, const T* bias,
                                         int has_bias) {
  if (!has_bias) return;
#pragma unroll
  for (int e = 0; e < 2; ++e)
    if (m + e < M) {
      const float b = as<float>(bias[m + e]);
      v[0][e] += b;
      v[1][e] += b;
    }
}

// The epilogue of a warpgroup's 64 pixel rows q0.. of the tile (those below qend): acc (+
// bias[m]) written with `=`, the thread's two pixel rows (row and row + 8), then each pair
// of channels. NCHW:
// out[n, m, oy, ox]; channels-last (`nhwc`): out[n, oy, ox, m], a channel pair per store
// where M is even.
template <typename T, int BN>
__device__ __forceinline__ void store_tile(const float (&acc)[BN / 2], const ConvGeom& g,
                                           const Phase& f, int q0, int qend, int m0,
                                           const T* bias, int has_bias, int nhwc, T* out) {
  const int hw = g.Ho * g.Wo;
  const long long mstep = nhwc ? 1 : hw;  // between channels
  const bool pairs = nhwc && g.M % 2 == 0;
  long long obase[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int q = q0 + ((threadIdx.x >> 5) & 3) * 16 + ((threadIdx.x & 31) >> 2) + 8 * h;
    int n, oy, ox;
    f.pixel(q, n, oy, ox);
    const long long pix = oy * g.Wo + ox;
    obase[h] = q >= qend ? -1 : nhwc ? ((long long)n * hw + pix) * g.M
                                       : (long long)n * g.M * hw + pix;
  }
  for_each_pair<BN>(acc, [&](int, int col, float x0, float y0, float x1, float y1) {
    float v[2][2] = {{x0, y0}, {x1, y1}};
    const int m = m0 + col;
    if (m >= g.M) return;
    add_bias(v, m, g.M, bias, has_bias);
    if (pairs) {  // m even, M even: m + 1 < M, and the pair is aligned
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (obase[h] >= 0)
          *reinterpret_cast<Pair<T>*>(out + obase[h] + m) =
              Pair<T>{{as<T>(v[h][0]), as<T>(v[h][1])}};
      return;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // channel m + e
      if (m + e >= g.M) break;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (obase[h] >= 0) out[obase[h] + (m + e) * mstep] = as<T>(v[h][e]);
    }
  });
}

// Shared memory of a warpgroup's tile_stats: the tile's first row, then each warp's column
// sums.
template <int BN> struct StatsSmem {
  float shift[BN];
  float part[4][2][BN];  // [warp][sum of d, of d^2][column]
};

// Warpgroup wg's barrier (named barrier 1 + wg, its 128 threads; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int wg) {
  asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
}

// Half of a thread's n values kept (the upper half where `upper`), the other half sent to
// the partner lane (lane ^ mask) and its half of the same values added: a step of a
// reduce-scatter over lanes.
template <int H>
__device__ __forceinline__ void halve(float* v, int mask) {
  const bool upper = threadIdx.x & mask;
#pragma unroll
  for (int i = 0; i < H; ++i) {
    const float keep = upper ? v[i + H] : v[i], send = upper ? v[i] : v[i + H];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
  }
}

// The batch statistics (conv2d_wgmma.cu's `stats`, at pixel tile tx) of warpgroup wg's
// tile, its 128 rows in acc[0] (rows 0-63) and acc[1] (64-127), the first `rows` of them
// pixels, of the output as stored (rounded to T, bias-free): per
// column, d = y - y[first pixel] and d^2 summed over the thread's four rows, over the warp's
// rows by a reduce-scatter over the 8 lanes that share columns (lane bits 4, 3, 2: 7/8
// shuffle per value), then over the 4 warps in order through shared memory. Fixed order:
// the same bits every run. Every thread of the warpgroup calls it.
template <typename T, int BN>
__device__ __forceinline__ void tile_stats(const float (&acc)[2][BN / 2], int wg, int M,
                                           int rows, int tx, int m0, float* stats,
                                           StatsSmem<BN>& sm) {
  constexpr int Q = BN / 2, C4 = BN / 4;  // values a thread sums: C4 columns' (d, d^2)
  const int tid = threadIdx.x & 127, warp = tid >> 5, lane = threadIdx.x & 31;
  const auto rounded = [](float v) { return as<float>(as<T>(v)); };
  warpgroup_sync(wg);  // the previous tile's sums have been read
  if (tid < 4)  // the tile's first pixel row: warp 0, lanes 0-3
    for_each_pair<BN>(acc[0], [&](int, int col, float x0, float y0, float, float) {
      sm.shift[col] = rounded(x0);
      sm.shift[col + 1] = rounded(y0);
    });
  warpgroup_sync(wg);
  const int row = warp * 16 + (lane >> 2);
  bool ok[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) ok[h][e] = 64 * h + row + 8 * e < rows;
  // v[i], i < C4: the sum of d of local column i (column 8 * (i / 2) + 2 * (lane & 3) +
  // i % 2, for_each_pair's layout); v[C4 + i]: of d^2. Indexed by constants only, so v
  // stays in registers.
  float v[Q];
#pragma unroll
  for (int i = 0; i < C4; ++i) {
    const int col = 8 * (i / 2) + 2 * (lane & 3) + i % 2, a = 4 * (i / 2) + i % 2;
    const float s = sm.shift[col];
    float sum = 0.f, sq = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float d = ok[h][e] ? rounded(acc[h][a + 2 * e]) - s : 0.f;
        sum += d;
        sq += d * d;
      }
    v[i] = sum;
    v[C4 + i] = sq;
  }
  halve<Q / 2>(v, 16);
  halve<Q / 4>(v, 8);
  halve<Q / 8>(v, 4);
  // kept: values (lane >> 2) * Q / 8 + t, the warp's sums over its 32 rows
#pragma unroll
  for (int t = 0; t < Q / 8; ++t) {
    const int i = (lane >> 2) * (Q / 8) + t, r = i / C4, lc = i - r * C4;
    sm.part[warp][r][8 * (lc / 2) + 2 * (lane & 3) + lc % 2] = v[t];
  }
  warpgroup_sync(wg);
  for (int o = tid; o < 2 * BN; o += 128) {
    const int r = o / BN, col = o % BN, m = m0 + col;
    if (m >= M) continue;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) total += sm.part[w][r][col];
    stats[((long long)tx * 3 + 1 + r) * M + m] = total;
    if (r == 0) stats[(long long)tx * 3 * M + m] = sm.shift[col];
  }
}
}  // namespace wgmma_conv
