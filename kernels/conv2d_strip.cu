// conv2d_strip.cu: the forward of a convolution whose input pixels are one 16-byte chunk each
// (C * sizeof(T) == 16: ResNet's ImageNet stem over column pairs, 8 channels) on Hopper tensor
// cores (wgmma, sm_90a), bf16 / fp16, fp32 accumulate, with no im2col gather. Launcher:
// dptrain/backend/cuda/conv/strip.py. conv2d_wgmma.cu gathers such a stem's slabs 16 bytes
// at a time, and every input pixel reaches 14 output pixels' rows: its loads are bound by
// what the SMs read from L2.
//
// Conventions
//  * A tile is one output row (n, oy) of Wo <= 128 pixels (GEMM rows: 128, the last ones
//    idle) by the block's 64 output channels m0.. (GEMM columns); K = KH * KW * C in (kh,
//    kw, c) order, as conv2d_wgmma.cu's (the weights reordered the same way: wr[m][k]).
//  * The tile's input is a strip: the KH source rows oy * sh - ph + kh, BM + KW - 1 pixels
//    each from column -pw, one TMA box of the NHWC source (zeros outside the image) that
//    lands dense: pixel (kh, x) at (kh * SW + x) * 16 bytes. With sw == 1, output pixel r's
//    tap (kh, kw) is strip pixel (kh, r + kw): the im2col rows are the strip's pixels, 16
//    bytes apart, and the next tap's chunk is the next pixel. wgmma reads that in place
//    through an unswizzled K-major descriptor: core matrices (8 rows x 16 bytes) 128 bytes
//    apart down the rows, 16 bytes apart along K. A k16 step takes two taps, (kh, kw) and
//    (kh, kw + 1): KW even.
//  * The weights of the block's 64 channels stay in shared memory (K-major slabs of 64 K
//    with the 128-byte swizzle, wgmma.cuh's tiles), loaded once: a block walks the tiles
//    blockIdx.x, + gridDim.x, ... through a ring of RING strips that thread 0 refills by
//    TMA once the tile before has read its stage.
//  * 128 threads, one warpgroup: two m64n64 accumulators (rows 0-63 and 64-127). Several
//    blocks an SM overlap one's epilogue with the others' loads and wgmmas (the forward's
//    ring: RING = 2 stages, 3 blocks an SM; backward-weight's: BWDW_RING = 3, 2 blocks).
//  * Epilogue: conv_epilogue.cuh's store_tile (channels-last; the tile's pixels q0 .. q0 +
//    Wo - 1, q0 the row's first) and, with `stats`, tile_stats at tile n * Ho + oy: each
//    tile's sums over its Wo pixels (norm.cu merges them with rows = Wo).
//  * The same k16 products in the same K order as conv2d_wgmma_kernel, whose zero-filled K
//    past the last slab adds nothing: the same bits.
//  * Backward-weight (conv2d_strip_bwdw_kernel): gw[m][j] = sum over the output pixels q of
//    gy[q, m] * im2col(x)[q, j], j = (kh * KW + kw) * C + c: the same strips, now as wgmma's
//    B (N = the KW * C columns of one filter row kh, K = a tile's 128 pixels), MN-major and
//    unswizzled: a tap's 8 channels 16 bytes from the next tap's (stride byte offset), the
//    next 8 pixels 128 bytes on (leading byte offset). A = gy's rows transposed: the tile's
//    gy as two TMA boxes of 64 pixels x 64 channels, MN-major atoms with the 128-byte
//    swizzle as conv2d_bwdw_wgmma.cu's (pixels past Wo and channels past M read as zeros).
//    A block keeps the whole M x K sum in registers (KH accumulators of m64n(KW * C)) over
//    its tiles, each tile's wgmmas in flight while the next tile's boxes land, then writes it
//    as split blockIdx.x's float partials ws[split][j][m], which conv2d_bwdw_wgmma.cu's
//    reducers sum in split order.
//
// nvrtc-options: -arch=sm_90a
// instantiate: conv2d_strip_kernel<{__nv_bfloat16, __half}, 7, 4>
// instantiate: conv2d_strip_bwdw_kernel<{__nv_bfloat16, __half}, 7, 4>

#include "common.cuh"
#include "conv_epilogue.cuh"
#include "conv_geom.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace conv_strip {
using namespace wgmma_tiles;
constexpr int BM = 128, BN = 64, SLAB = 64 * ROW_BYTES;  // SLAB: 64 rows of 64 K
constexpr int RING = 2, BWDW_RING = 3, GY_BYTES = 2 * 64 * ROW_BYTES;  // a tile's gy boxes

// Bytes of a strip of KH rows of BM + KW - 1 16-byte pixels, 1024-aligned.
__host__ __device__ constexpr int strip_bytes(int KH, int KW) {
  return (KH * (BM + KW - 1) * 16 + 1023) / 1024 * 1024;
}

// Shared-memory matrix descriptor, unswizzled: core matrices of 8 rows x 16 bytes (rows 16
// bytes apart), `lead` (leading byte offset) and `stride` (stride byte offset) multiples of
// 16. K-major: lead steps along K (8 values), stride down the rows (8 rows). MN-major:
// lead steps along K (8 rows), stride along M / N (8 values).
__device__ __forceinline__ u64 plain_desc(u32 saddr, u32 lead, u32 stride) {
  return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32);
}

// A block's ring of S stages at shared address `base`, `stage` bytes apart: a tile's strip,
// then (backward-weight, `gy` non-null) its gy boxes. full[s] completes once stage s's boxes
// have landed. Thread 0 initialises the barriers (the caller syncs the block) and loads.
template <int S>
struct StripRing {
  unsigned long long* full;  // S barriers in static shared memory
  u32 base;
  int stage, strip, Ho, sh, ph, pw;
  __device__ __forceinline__ void init() const {
    if (threadIdx.x == 0)
      for (int s = 0; s < S; ++s) mbar_init(bar(s), 1);
  }
  __device__ __forceinline__ u32 bar(int s) const {
    return (u32)__cvta_generic_to_shared(full) + 8 * s;
  }
  __device__ __forceinline__ u32 at(int i) const { return base + (i % S) * stage; }
  // Tile `tile`'s boxes into the stage of the block's i-th tile: its strip (the source rows
  // oy * sh - ph + kh from column -pw), and gy's two boxes of its 128 pixels.
  __device__ __forceinline__ void load(const TmaMap& strips, const TmaMap* gy, int i, int tile,
                                       int bytes) const {
    const int n = tile / Ho, oy = tile - n * Ho;
    const u32 b = bar(i % S), st = at(i);
    mbar_expect_tx(b, bytes);
    tma_load_4d(st, strips, 0, -pw, oy * sh - ph, n, b);
    if (gy)
      for (int h = 0; h < 2; ++h)
        tma_load_3d(st + strip + h * (GY_BYTES / 2), *gy, 0, 64 * h, tile, b);
  }
  __device__ __forceinline__ void wait(int i) const { mbar_wait(bar(i % S), (i / S) & 1); }
};
}  // namespace conv_strip

#define DP_STRIP_PARAMS                                                                    \
  const __grid_constant__ wgmma_tiles::TmaMap strips, int Nb, int M, int C, int Hs, int Ws, \
      int Ho, int Wo, int kh_, int kw_, int sh, int sw, int ph, int pw

// Traps unless the launcher's geometry is what the kernel reads right (strip.py's refuses).
#define DP_STRIP_CHECK()                                                                   \
  static_assert(KW % 2 == 0, "a forward k16 step takes two taps");                         \
  if (C * (int)sizeof(T) != 16 || sw != 1 || Wo > conv_strip::BM || kh_ != KH || kw_ != KW) \
  __trap()

// The forward. Grid (blocks walking the N * Ho tiles, channel tiles of 64); 128 threads;
// dynamic shared memory: the weights' ceil(K / 64) slabs, then RING strips (launcher:
// strip.py's smem). The filter size is a template parameter, so the k16 steps unroll: with
// a loop over them ptxas fences the wgmmas (C7519). Instantiated for the stem's 7 x 4 taps
// (the launcher's FILTERS).
template <typename T, int KH, int KW>
__global__ void __launch_bounds__(128, 3)
    conv2d_strip_kernel(DP_STRIP_PARAMS, const T* __restrict__ wr, const T* __restrict__ bias,
                        T* __restrict__ out, int has_bias, float* stats) {
  using namespace wgmma_tiles;
  using namespace conv_strip;
  DP_STRIP_CHECK();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long full[RING];
  __shared__ wgmma_conv::StatsSmem<BN> stats_smem;
  const int K = KH * KW * C, KT = (K + 63) / 64, SW = BM + KW - 1, SB = strip_bytes(KH, KW);
  require_smem(KT * SLAB + RING * SB);
  const u32 wbase = smem_base(smem_raw);
  const StripRing<RING> ring{full, wbase + KT * SLAB, SB, SB, Ho, sh, ph, pw};
  const int tiles = Nb * Ho, m0 = blockIdx.y * BN, tid = threadIdx.x;
  ring.init();
  __syncthreads();
  if (tid == 0)
    for (int i = 0; i < RING && blockIdx.x + i * gridDim.x < tiles; ++i)
      ring.load(strips, nullptr, i, blockIdx.x + i * gridDim.x, KH * SW * 16);
  // the weights of channels m0.. (zeros past M and K), once
  for (int e = tid; e < KT * 64 * 8; e += 128) {
    const int slab = e >> 9, r = (e >> 3) & 63, chunk = e & 7, k = slab * 64 + chunk * 8;
    const bool ok = m0 + r < M && k < K;
    cp_async16(wbase + slab * SLAB + swizzled(r, chunk), ok ? wr + (long long)(m0 + r) * K + k : wr,
               ok ? 16 : 0);
  }
  wgmma_tiles::cp_async_commit();
  wgmma_tiles::cp_async_wait<0>();
  fence_proxy_async();  // the weights, visible to the tensor cores' async proxy
  __syncthreads();
  const ConvGeom g{Nb, M, C, Hs, Ws, Ho, Wo, KH, KW, sh, sw, ph, pw, 0};
  const Phase f(g, 0);
  int i = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++i) {
    const u32 st = ring.at(i);
    ring.wait(i);
    float acc[2][BN / 2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int v = 0; v < BN / 2; ++v) acc[h][v] = 0.f;
    fence_regs(acc[0]);
    fence_regs(acc[1]);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < KH * KW / 2; ++j) {  // taps (kh, kw), (kh, kw + 1): K 16j ..
      const int kh = j / (KW / 2), kw = j % (KW / 2) * 2;
      const u64 b = smem_desc(wbase + (j >> 2) * SLAB + (j & 3) * 32);
      const u32 a = st + (kh * SW + kw) * 16;
      Wgmma<T, BN>::run(acc[0], plain_desc(a, 16, 128), b);
      Wgmma<T, BN>::run(acc[1], plain_desc(a + 64 * 16, 16, 128), b);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc[0]);
    fence_regs(acc[1]);
    wgmma_conv::warpgroup_sync(0);  // every thread's wgmmas have read the stage
    if (tid == 0 && tile + RING * gridDim.x < tiles)
      ring.load(strips, nullptr, i + RING, tile + RING * gridDim.x, KH * SW * 16);
    const int q0 = tile * Wo;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wgmma_conv::store_tile<T, BN>(acc[h], g, f, q0 + 64 * h, q0 + Wo, m0, bias, has_bias, 1,
                                    out);
    if (stats) wgmma_conv::tile_stats<T, BN>(acc, 0, M, Wo, tile, m0, stats, stats_smem);
  }
}

// Backward-weight (the header's). Grid: the splits, each a block walking tiles blockIdx.x,
// + gridDim.x, ...; 128 threads; dynamic shared memory: BWDW_RING stages of a strip and a
// tile's gy boxes (strip.py's bwdw_smem). `grads`: the tiled map of gy as (N * Ho, Wo, M),
// boxes of 64 pixels x 64 channels. ws: (gridDim.x, KH * KW * C, M) floats.
template <typename T, int KH, int KW>
__global__ void __launch_bounds__(128, 2)
    conv2d_strip_bwdw_kernel(DP_STRIP_PARAMS, const __grid_constant__ wgmma_tiles::TmaMap grads,
                             float* __restrict__ ws) {
  using namespace wgmma_tiles;
  using namespace conv_strip;
  DP_STRIP_CHECK();
  constexpr int N = KW * 16 / (int)sizeof(T);  // a filter row's (kw, c) columns
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long full[BWDW_RING];
  const int SW = BM + KW - 1, SB = strip_bytes(KH, KW), stage = SB + GY_BYTES;
  require_smem(BWDW_RING * stage);
  const StripRing<BWDW_RING> ring{full, smem_base(smem_raw), stage, SB, Ho, sh, ph, pw};
  const int tiles = Nb * Ho, bytes = KH * SW * 16 + GY_BYTES;
  ring.init();
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < BWDW_RING && blockIdx.x + i * gridDim.x < tiles; ++i)
      ring.load(strips, &grads, i, blockIdx.x + i * gridDim.x, bytes);
  float acc[KH][N / 2];
#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
#pragma unroll
    for (int v = 0; v < N / 2; ++v) acc[kh][v] = 0.f;
  int i = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++i) {
    const u32 st = ring.at(i), gy = st + SB;
    ring.wait(i);
#pragma unroll
    for (int kh = 0; kh < KH; ++kh) fence_regs(acc[kh]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)  // 16 pixels of K a step: 2 KB of a gy atom
#pragma unroll
      for (int kh = 0; kh < KH; ++kh)
        Wgmma<T, N, true>::run(acc[kh], mn_desc(gy + kk * 2048, 64 * ROW_BYTES),
                               plain_desc(st + (kh * SW + 16 * kk) * 16, 128, 16));
    wgmma_commit();
    wgmma_wait<1>();  // the tile before has retired: its stage may be refilled
#pragma unroll
    for (int kh = 0; kh < KH; ++kh) fence_regs(acc[kh]);
    wgmma_conv::warpgroup_sync(0);
    const int next = tile + (BWDW_RING - 1) * gridDim.x;  // the tile before's stage, refilled
    if (threadIdx.x == 0 && i > 0 && next < tiles)
      ring.load(strips, &grads, i + BWDW_RING - 1, next, bytes);
  }
  wgmma_wait<0>();
#pragma unroll
  for (int kh = 0; kh < KH; ++kh) fence_regs(acc[kh]);
  const int J = KH * N;
  float* part = ws + (long long)blockIdx.x * J * M;
#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
    for_each_pair<N>(acc[kh], [&](int row, int col, float x0, float y0, float x1, float y1) {
      const float v[2][2] = {{x0, y0}, {x1, y1}};  // [rows m, m + 8][columns j, j + 1]
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = row + 8 * h, j = kh * N + col + e;
          if (m < M) part[(long long)j * M + m] = v[h][e];
        }
    });
}
