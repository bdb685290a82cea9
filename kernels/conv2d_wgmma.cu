// conv2d_wgmma.cu: 2D convolution forward and backward-data as implicit GEMMs on Hopper
// tensor cores (wgmma.mma_async, sm_90a): TF32 on float, bf16 / fp16 on 16-bit types, fp32
// accumulate. Launcher: dptrain/backend/cuda/conv2d.py, which picks this kernel on compute
// capability 9.0 for tensor-core precisions when the summed channels come in whole 16-byte
// chunks; otherwise conv2d.cu's mma.sync kernels run.
//
// Conventions
//  * The GEMM of conv2d.cu's forward / backward-data (ConvGeom, conv_tap in conv_geom.cuh),
//    transposed: rows are output pixels q = (n, oy, ox) (GEMM M, 128 per block), columns
//    the output channels m (GEMM N, BN per block), K = KH*KW*C in (kh, kw, c) order.
//  * A (pixels x K) is gathered from the source in channels-last layout, src[n, y, x, c]
//    (the launcher transposes the NCHW tensor first): with C a multiple of the 16-byte
//    chunk (4 floats, 8 16-bit values) every chunk of a pixel's K row is one filter tap's
//    contiguous channels, so the im2col gather is wgmma's own 16-byte cp.async load with a
//    per-chunk address (zero-fill outside the image, past K and past the last pixel).
//  * B (channels x K) is the weight reordered by conv2d_weight_reorder_kernel (conv2d.cu),
//    wr[m][(kh*KW + kw)*C + c]: dense and K-major, rows past M zero-filled.
//  * Backward-data with a stride and a filter wider than 1x1 (mode 2; the launcher picks it)
//    runs one phase per grid z (z = ry * sw + rx): the output
//    pixels (oy, ox) = (ry + sh*i, rx + sw*j), which only the taps kh = (ry + ph) mod sh +
//    sh*t (likewise kw) reach; K sums those taps alone. The taps a plain implicit GEMM would
//    visit and zero-fill (all but 1 / (sh*sw) of them) are never loaded; a phase no tap
//    reaches writes zeros. A phase's pixels are sw apart in a row, so its stores use a
//    1/sw of each 32-byte sector: 1x1 filters (mode 1), which gain nothing from phases,
//    stay in one grid with the zero-filled taps. Forward and stride 1: one phase.
//  * The output is NCHW, out[n, m, oy, ox] = acc (+ bias[m]), written with `=`: per
//    accumulator, lanes along the pixels (8 consecutive pixels of one channel per quad).
//  * Tiles, swizzle and pipeline: wgmma.cuh. 256 threads = two warpgroups of 64 pixels.
//
// nvrtc-options: -arch=sm_90a
// instantiations-per-module: 1  (a run builds only those it uses: a shorter cold start)
// instantiate: conv2d_wgmma_kernel<float, 32>; conv2d_wgmma_kernel<float, 64>
// instantiate: conv2d_wgmma_kernel<float, 128>
// instantiate: conv2d_wgmma_kernel<__nv_bfloat16, 32>; conv2d_wgmma_kernel<__nv_bfloat16, 64>
// instantiate: conv2d_wgmma_kernel<__nv_bfloat16, 128>
// instantiate: conv2d_wgmma_kernel<__half, 32>; conv2d_wgmma_kernel<__half, 64>
// instantiate: conv2d_wgmma_kernel<__half, 128>

#include "common.cuh"
#include "conv_geom.cuh"
#include "wgmma.cuh"

namespace wgmma_conv {
constexpr int BM = 128, THREADS = 256;
constexpr int A_ROWS = BM / (THREADS / 8);  // pixel rows each thread loads: 4
}  // namespace wgmma_conv

template <typename T, int BN>
__global__ void __launch_bounds__(wgmma_conv::THREADS, BN <= 64 ? 2 : 1)
    conv2d_wgmma_kernel(const T* __restrict__ wr, const T* __restrict__ src,
                        const T* __restrict__ bias, T* __restrict__ out, int has_bias, int Nb,
                        int M, int C, int Hs, int Ws, int Ho, int Wo, int KH, int KW, int sh,
                        int sw, int ph, int pw, int mode) {
  using namespace wgmma_tiles;
  using namespace wgmma_conv;
  constexpr int BK = ROW_BYTES / sizeof(T), CHUNK = 16 / sizeof(T);  // elements
  constexpr int B_ROWS = BN / (THREADS / 8);  // weight rows each thread loads
  static_assert(B_ROWS >= 1, "at least one weight row per thread");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  require_smem(smem_bytes<BM, BN>());  // the launcher must pass it

  const ConvGeom g{Nb, M, C, Hs, Ws, Ho, Wo, KH, KW, sh, sw, ph, pw, mode};
  // This block's phase: output pixels (ry + ps_h*i, rx + ps_w*j) and the taps (rkh + ps_h*t,
  // rkw + ps_w*u) that reach them (nkh x nkw of them; every tap for the forward).
  const bool phased = mode == 2;
  const int ps_h = phased ? sh : 1, ps_w = phased ? sw : 1;
  const int ry = blockIdx.z / ps_w, rx = blockIdx.z - ry * ps_w;
  const int rkh = phased ? (ry + ph) % sh : 0, rkw = phased ? (rx + pw) % sw : 0;
  const int nkh = rkh < KH ? (KH - rkh + ps_h - 1) / ps_h : 0;
  const int nkw = rkw < KW ? (KW - rkw + ps_w - 1) / ps_w : 0;
  const int Hq = (Ho - ry + ps_h - 1) / ps_h, Wq = (Wo - rx + ps_w - 1) / ps_w;
  const int K = nkh * nkw * C, Kw = KH * KW * C, hq = Hq * Wq, hw = Ho * Wo, npix = Nb * hq;
  const int q0 = blockIdx.x * BM, m0 = blockIdx.y * BN;
  if (q0 >= npix && q0 > 0) return;  // past this phase's pixels (the grid fits phase 0)

  // Loader: 16-byte chunk lc = tid % 8 of tile rows lrow + 32 j. The pixel rows' coordinates
  // are worked out once; each row's source pointer once per filter tap (the slabs of a tap,
  // C / BK of them, then only add their channel offset: the loader is issue-bound).
  const int lrow = threadIdx.x >> 3, lc = threadIdx.x & 7;
  long long pbase[A_ROWS];  // offset of the pixel's image in src; -1 past the last pixel
  int py[A_ROWS], px[A_ROWS];
#pragma unroll
  for (int j = 0; j < A_ROWS; ++j) {
    const int q = q0 + lrow + 32 * j;
    const int n = q / hq, p = q - n * hq, qy = p / Wq;
    py[j] = ry + ps_h * qy;
    px[j] = rx + ps_w * (p - qy * Wq);
    pbase[j] = q < npix ? (long long)n * Hs * Ws * C : -1;
  }

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  // This thread's chunk of the slab: column k = kt * BK + lc * CHUNK, channels c.. of the
  // phase's tap (th, tw). The main loop asks for the slabs in order, so the chunk moves on
  // by BK each slab, without the divisions of decoding k; `retap` says the tap changed.
  int k = 0, c = 0, th = 0, tw = 0;
  bool retap = true;
  auto advance = [&](int by) {
    k += by;
    c += by;
    while (c >= C) {
      c -= C;
      retap = true;
      if (++tw == nkw) tw = 0, ++th;
    }
  };
  advance(lc * CHUNK);
  const T* row[A_ROWS];  // the rows' source pixel at channel 0 of the tap; nullptr: zeros
  const T* wcol = wr;    // the weight column of the tap's channel 0
  wgmma_mainloop<T, BM, BN>(acc, smem_base(smem_raw), (K + BK - 1) / BK,
                            [&](int, u32 sa, u32 sb) {
    if (retap) {
      retap = false;
      const int kh = rkh + ps_h * th, kw = rkw + ps_w * tw;
      wcol = wr + (kh * KW + kw) * C;
#pragma unroll
      for (int j = 0; j < A_ROWS; ++j) {
        int iy = 0, ix = 0;
        const bool ok = k < K && pbase[j] >= 0 && conv_tap(g, py[j], px[j], kh, kw, iy, ix);
        row[j] = ok ? src + pbase[j] + (long long)(iy * Ws + ix) * C : nullptr;
      }
    }
#pragma unroll
    for (int j = 0; j < A_ROWS; ++j)
      cp_async16(sa + swizzled(lrow + 32 * j, lc), row[j] ? row[j] + c : src, row[j] ? 16 : 0);
    const bool kok = k < K;
#pragma unroll
    for (int j = 0; j < B_ROWS; ++j) {
      const int m = m0 + lrow + 32 * j;
      const bool ok = kok && m < M;
      cp_async16(sb + swizzled(lrow + 32 * j, lc), ok ? wcol + (long long)m * Kw + c : wr,
                 ok ? 16 : 0);
    }
    advance(BK);
  });

  // Epilogue: the thread's two pixel rows (row and row + 8), then each pair of channels.
  long long obase[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int q = q0 + (threadIdx.x >> 7) * 64 + ((threadIdx.x >> 5) & 3) * 16 +
                  ((threadIdx.x & 31) >> 2) + 8 * h;
    const int n = q / hq, p = q - n * hq, qy = p / Wq;
    obase[h] = q < npix ? (long long)n * M * hw + (ry + ps_h * qy) * Wo + rx + ps_w * (p - qy * Wq)
                        : -1;
  }
  for_each_pair<BN>(acc, [&](int, int col, float x0, float y0, float x1, float y1) {
    const float v[2][2] = {{x0, y0}, {x1, y1}};
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // channel m0 + col + e
      const int m = m0 + col + e;
      if (m >= M) break;
      const float b = has_bias ? as<float>(bias[m]) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (obase[h] >= 0) out[obase[h] + (long long)m * hw] = as<T>(has_bias ? v[h][e] + b : v[h][e]);
    }
  });
}
