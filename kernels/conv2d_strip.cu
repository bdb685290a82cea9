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
//    blocks an SM overlap one's epilogue with the others' loads and wgmmas.
//  * Epilogue: conv_epilogue.cuh's store_tile (channels-last; the tile's pixels q0 .. q0 +
//    Wo - 1, q0 the row's first) and, with `stats`, tile_stats at tile n * Ho + oy: each
//    tile's sums over its Wo pixels (norm.cu merges them with rows = Wo).
//  * The same k16 products in the same K order as conv2d_wgmma_kernel, whose zero-filled K
//    past the last slab adds nothing: the same bits.
//
// nvrtc-options: -arch=sm_90a
// instantiate: conv2d_strip_kernel<{__nv_bfloat16, __half}, 7, 4>

#include "common.cuh"
#include "conv_epilogue.cuh"
#include "conv_geom.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace conv_strip {
using namespace wgmma_tiles;
constexpr int BM = 128, BN = 64, RING = 2, SLAB = 64 * ROW_BYTES;  // SLAB: 64 rows of 64 K

// Bytes of a stage: a strip of KH rows of BM + KW - 1 16-byte pixels, 1024-aligned.
__host__ __device__ constexpr int strip_bytes(int KH, int KW) {
  return (KH * (BM + KW - 1) * 16 + 1023) / 1024 * 1024;
}

// Shared-memory matrix descriptor: K-major, unswizzled: core matrices of 8 rows x 16 bytes
// (rows 16 bytes apart), the next 8 rows 128 bytes on (stride byte offset), the next 8 K
// `lead` bytes on (leading byte offset).
__device__ __forceinline__ u64 plain_desc(u32 saddr, u32 lead) {
  return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(128 >> 4) << 32);
}
}  // namespace conv_strip

// Grid (blocks walking the N * Ho tiles, channel tiles of 64); 128 threads; dynamic shared
// memory: the weights' ceil(K / 64) slabs, then RING strips (launcher: strip.py's smem).
// The filter size is a template parameter, so the k16 steps unroll: with a loop over them
// ptxas fences the wgmmas (C7519). Instantiated for the stem's 7 x 4 taps (the launcher's
// FILTERS).
template <typename T, int KH, int KW>
__global__ void __launch_bounds__(128, 3)
    conv2d_strip_kernel(const __grid_constant__ wgmma_tiles::TmaMap strips,
                        const T* __restrict__ wr, const T* __restrict__ bias,
                        T* __restrict__ out, int has_bias, int Nb, int M, int C, int Hs, int Ws,
                        int Ho, int Wo, int kh_, int kw_, int sh, int sw, int ph, int pw,
                        float* stats) {
  using namespace wgmma_tiles;
  using namespace conv_strip;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long full[RING];  // a stage's strip has landed
  __shared__ wgmma_conv::StatsSmem<BN> stats_smem;
  const int K = KH * KW * C, KT = (K + 63) / 64, SW = BM + KW - 1, SB = strip_bytes(KH, KW);
  require_smem(KT * SLAB + RING * SB);
  static_assert(KW % 2 == 0, "a k16 step takes two taps");
  if (C * (int)sizeof(T) != 16 || sw != 1 || Wo > BM || kh_ != KH || kw_ != KW) __trap();
  const u32 wbase = smem_base(smem_raw), sbase = wbase + KT * SLAB;
  const u32 bars = (u32)__cvta_generic_to_shared(full);
  const int tiles = Nb * Ho, m0 = blockIdx.y * BN, tid = threadIdx.x;
  if (tid == 0)
    for (int s = 0; s < RING; ++s) mbar_init(bars + 8 * s, 1);
  __syncthreads();
  // the strip of tile `tile` into the stage of the block's i-th tile
  const auto load = [&](int i, int tile) {
    const int n = tile / Ho, oy = tile - n * Ho, s = i % RING;
    mbar_expect_tx(bars + 8 * s, KH * SW * 16);
    tma_load_4d(sbase + s * SB, strips, 0, -pw, oy * sh - ph, n, bars + 8 * s);
  };
  if (tid == 0)
    for (int i = 0; i < RING && blockIdx.x + i * gridDim.x < tiles; ++i)
      load(i, blockIdx.x + i * gridDim.x);
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
    const u32 st = sbase + (i % RING) * SB;
    mbar_wait(bars + 8 * (i % RING), (i / RING) & 1);
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
      Wgmma<T, BN>::run(acc[0], plain_desc(a, 16), b);
      Wgmma<T, BN>::run(acc[1], plain_desc(a + 64 * 16, 16), b);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc[0]);
    fence_regs(acc[1]);
    wgmma_conv::warpgroup_sync(0);  // every thread's wgmmas have read the stage
    if (tid == 0 && tile + RING * gridDim.x < tiles) load(i + RING, tile + RING * gridDim.x);
    const int q0 = tile * Wo;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wgmma_conv::store_tile<T, BN>(acc[h], g, f, q0 + 64 * h, q0 + Wo, m0, bias, has_bias, 1,
                                    out);
    if (stats) wgmma_conv::tile_stats<T, BN>(acc, 0, M, Wo, tile, m0, stats, stats_smem);
  }
}
