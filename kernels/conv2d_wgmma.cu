// conv2d_wgmma.cu: 2D convolution forward and backward-data as implicit GEMMs on Hopper
// tensor cores (wgmma.mma_async, sm_90a): TF32 on float, bf16 / fp16 on 16-bit types, fp32
// accumulate. Launcher: dptrain/backend/cuda/conv/wgmma.py, which picks this kernel on compute
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
//  * B (channels x K) is the weight as the launcher reorders it (conv2d.cu's header),
//    wr[m][(kh*KW + kw)*C + c]: dense and K-major, rows past M zero-filled.
//  * Backward-data with a stride and a filter wider than 1x1 (mode 2; the launcher picks it)
//    runs one phase per grid z (z = ry * sw + rx): the output
//    pixels (oy, ox) = (ry + sh*i, rx + sw*j), which only the taps kh = (ry + ph) mod sh +
//    sh*t (likewise kw) reach; K sums those taps alone. The taps a plain implicit GEMM would
//    visit and zero-fill (all but 1 / (sh*sw) of them) are never loaded; a phase no tap
//    reaches writes zeros. A phase's pixels are sw apart in a row, so its stores use a
//    1/sw of each 32-byte sector: 1x1 filters (mode 1), which gain nothing from phases,
//    stay in one grid with the zero-filled taps. Forward and stride 1: one phase.
//  * The output, written with `=`, is acc (+ bias[m]) either NCHW, out[n, m, oy, ox] (lanes
//    along the pixels: 8 consecutive pixels of one channel per quad), or channels-last when
//    `nhwc`, out[n, oy, ox, m] (a quad stores 8 consecutive channels as 4 pairs), which
//    spares the launcher the copy of a channels-last tensor to NCHW and back.
//  * Batch statistics (forward, TMA kernel, `stats` non-null): each tile also writes, per
//    channel m, the rounded output's shift (the tile's first pixel), sum of d = y - shift
//    and sum of d^2 over its valid pixels, as floats at stats[(tx * 3 + r) * M + m] (tx the
//    pixel tile; r = 0, 1, 2): batch norm's statistics without a pass over y (norm.cu's
//    bn_tile_stats_finalize_kernel merges the tiles in double).
//  * Tiles, swizzle and pipeline: wgmma.cuh. conv2d_wgmma_kernel: a tile per block, 256
//    threads = two warpgroups of 64 pixels that both gather and multiply.
//  * conv2d_wgmma_tma_kernel, where C fills whole 128-byte slabs: the same tiles, slabs and
//    wgmma shapes (so the same bits), persistent and warp-specialized: one thread issues
//    each slab as two TMA copies (tma.cuh: an im2col map of src, a tiled map of wr, both
//    zero-filling past their tensors), and stages are handed over through mbarriers. Its
//    two multiplying warpgroups take whole tiles in turn (ping-pong), so one's epilogue
//    runs while the other's wgmmas keep the tensor cores busy; 16-bit channels-last tiles
//    of 64 or 128 channels are stored through shared memory by TMA. The launcher's default
//    where it applies (NOTES-gemm.md rows 36-39).
//  * TURN (16-bit tiles of 64 channels): the tile turned around, D^T = W X^T, one m64n128
//    wgmma a step with the weights as A and the 128 pixel rows as B, where two m64n64 read
//    the weights twice: 6 KB of shared memory per 131 K multiply-adds instead of 8. The
//    accumulator's rows are then channels and its columns pixels; the staging
//    (stage_tile_turned) and the statistics (tile_stats_turned) read it so, and every store
//    after the staging is the same.
//  * RES (16-bit tiles of 64 or 128 channels, one phase, the weights within RES_BYTES): the
//    weights are loaded once a block and stay in shared memory; the ring carries pixel
//    slabs alone. The same slabs in the same order: the same bits.
//
// nvrtc-options: -arch=sm_90a
// instantiations-per-module: 1  (a run builds only those it uses: a shorter cold start)
// instantiate: conv2d_wgmma_kernel<{float, __nv_bfloat16, __half}, {32, 64, 128}>
// instantiate: conv2d_wgmma_tma_kernel<float, {32, 64, 128}>; conv2d_wgmma_tma_kernel<{__nv_bfloat16, __half}, {32, 128}>; conv2d_wgmma_tma_kernel<{__nv_bfloat16, __half}, 64, true>; conv2d_wgmma_tma_kernel<{__nv_bfloat16, __half}, 64, true, true>; conv2d_wgmma_tma_kernel<{__nv_bfloat16, __half}, 128, false, true>

#include "common.cuh"
#include "conv_epilogue.cuh"
#include "conv_geom.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace wgmma_conv {
using namespace wgmma_tiles;
constexpr int BM = 128;

// The im2col gather of one BM x BN tile's slabs, as one of 256 threads' share: 16-byte
// chunk lc of pixel rows lrow + 32j (j < ROWS) and of weight rows lrow + 32j (j < BROWS).
// Pixel rows' coordinates are worked out once a tile; each row's source pointer once per
// filter tap (C / BK slabs; between taps only the channel offset moves: the loader is
// issue-bound).
template <typename T, int BN>
struct Gather {
  static constexpr int BK = ROW_BYTES / sizeof(T), CHUNK = 16 / sizeof(T);  // elements
  static constexpr int STEP = 32, ROWS = BM / STEP, BROWS = BN / STEP;      // rows apart; rows
  long long pbase[ROWS];  // offset of the pixel's image in src; -1 past the last pixel
  int py[ROWS], px[ROWS];
  const T* row[ROWS];  // the rows' source pixel at channel 0 of the tap; nullptr: zeros
  const T* wcol;       // the weight column of the tap's channel 0
  // This thread's chunk of the slab: column k, channels c.. of the phase's tap (th, tw). The
  // slabs come in order, so the chunk moves on by BK a slab, without the divisions of
  // decoding k; `retap` says the tap changed.
  int k, c, th, tw, lrow, lc;
  bool retap;

  // image: the elements of one source image (Hs * Ws * C); C: the channels summed
  __device__ __forceinline__ void start(const Phase& f, long long image, int C, int q0,
                                        int lrow_, int lc_) {
    lrow = lrow_;
    lc = lc_;
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int q = q0 + lrow + STEP * j;
      int n;
      f.pixel(q, n, py[j], px[j]);
      pbase[j] = q < f.npix ? n * image : -1;
    }
    k = c = th = tw = 0;
    retap = true;
    advance(lc * CHUNK, f, C);
  }
  __device__ __forceinline__ void advance(int by, const Phase& f, int C) {
    k += by;
    c += by;
    while (c >= C) {
      c -= C;
      retap = true;
      if (++tw == f.nkw) tw = 0, ++th;
    }
  }
  // Issues the copies of the next slab into tiles sa (pixels) and sb (weights).
  __device__ __forceinline__ void load(const ConvGeom& g, const Phase& f, const T* src,
                                       const T* wr, int m0, u32 sa, u32 sb) {
    if (retap) {
      retap = false;
      const int kh = f.rkh + f.ps_h * th, kw = f.rkw + f.ps_w * tw;
      wcol = wr + (kh * g.KW + kw) * g.C;
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        int iy = 0, ix = 0;
        const bool ok = k < f.K && pbase[j] >= 0 && conv_tap(g, py[j], px[j], kh, kw, iy, ix);
        row[j] = ok ? src + pbase[j] + (long long)(iy * g.Ws + ix) * g.C : nullptr;
      }
    }
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      cp_async16(sa + swizzled(lrow + STEP * j, lc), row[j] ? row[j] + c : src, row[j] ? 16 : 0);
    const bool kok = k < f.K;
    const long long Kw = (long long)g.KH * g.KW * g.C;
#pragma unroll
    for (int j = 0; j < BROWS; ++j) {
      const int m = m0 + lrow + STEP * j;
      const bool ok = kok && m < g.M;
      cp_async16(sb + swizzled(lrow + STEP * j, lc), ok ? wcol + m * Kw + c : wr, ok ? 16 : 0);
    }
    advance(BK, f, g.C);
  }
};

// Tile `tile` of the warp-specialized kernel's walk (pixel tiles fastest, then channel
// tiles, then phases): its phase and origin; `none` past the phase's pixels (the grid of
// pixel tiles fits phase 0, the largest).
struct Tile {
  Phase f;
  int q0, m0;
  bool none;
  __device__ __forceinline__ Tile(const ConvGeom& g, int tile, int tiles_x, int tiles_y, int bn)
      : f(g, tile / (tiles_x * tiles_y)),
        q0(tile % tiles_x * BM),
        m0(tile / tiles_x % tiles_y * bn),
        none(q0 >= f.npix && q0 > 0) {}
};

// The TMA kernel's shared memory: its ring of stages, then, for 16-bit tiles of 64 or 128
// channels (`staged`), each multiplying warpgroup's output tile as BN / 64 boxes of 128
// rows x 128 bytes, swizzled as the loads (stage_tile), which TMA stores, then, where the
// weights stay resident (RES), every weight slab of the pass (at most RES_BYTES), loaded
// once a block, so a stage holds only a tile's pixel slab. The ring takes as many stages as
// fit in 192 KB beside them, at most 8 (launcher: conv/wgmma.py's tma_smem).
constexpr int RES_BYTES = 72 * 1024;  // 9 slabs of 64 channels: a 3x3 filter over 64
template <typename T, int BN>
__host__ __device__ constexpr bool staged() { return sizeof(T) == 2 && BN >= 64; }
template <typename T, int BN>
__host__ __device__ constexpr int staging_bytes() { return staged<T, BN>() ? BM * BN * 2 : 0; }
template <int BN, bool RES>
__host__ __device__ constexpr int stage_bytes() { return (RES ? BM : BM + BN) * ROW_BYTES; }
template <typename T, int BN, bool RES>
__host__ __device__ constexpr int tma_stages() {
  constexpr int fit = (192 * 1024 - 2 * staging_bytes<T, BN>() - (RES ? RES_BYTES : 0)) /
                      stage_bytes<BN, RES>();
  return fit < 8 ? fit : 8;
}
template <typename T, int BN, bool RES>
__host__ __device__ constexpr int tma_smem_bytes() {
  return tma_stages<T, BN, RES>() * stage_bytes<BN, RES>() + 2 * staging_bytes<T, BN>() +
         (RES ? RES_BYTES : 0) + 1024;
}

// A warpgroup's 128 x BN tile acc (+ bias[m]) rounded to T into its staging at `sout`
// (generic address; 1024-aligned): rows r and r + 8 of each channel pair, 4 bytes a store,
// the 8 rows a store instruction spans in 8 different 16-byte chunks (no bank conflicts).
template <typename T, int BN>
__device__ __forceinline__ void stage_tile(const float (&acc)[2][BN / 2], unsigned char* sout,
                                           int m0, int M, const T* bias, int has_bias) {
  const int row = ((threadIdx.x >> 5) & 3) * 16 + ((threadIdx.x & 31) >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h)
    for_each_pair<BN>(acc[h], [&](int, int col, float x0, float y0, float x1, float y1) {
      float v[2][2] = {{x0, y0}, {x1, y1}};
      const int m = m0 + col;
      add_bias(v, m, M, bias, has_bias);
      const int box = col / 64, c = col % 64;
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // rows r and r + 8
        const int r = 64 * h + row + 8 * e;
        *reinterpret_cast<Pair<T>*>(sout + box * (BM * ROW_BYTES) + r * ROW_BYTES +
                                    (((c >> 3) ^ (r & 7)) << 4) + (c & 7) * 2) =
            Pair<T>{{as<T>(v[e][0]), as<T>(v[e][1])}};
      }
    });
}

// stage_tile of a turned tile (TURN): acc holds rows m (channel m0 + 16 * warp + lane / 4, and
// 8 further) by columns q (the 128 pixel rows, for_each_pair's columns), so each value is
// its own 2-byte store: a store instruction's 32 lanes write 8 channels of 4 rows, one
// 16-byte chunk each, in 4 different chunk columns (no bank conflicts).
template <typename T>
__device__ __forceinline__ void stage_tile_turned(const float (&acc)[BM / 2],
                                                  unsigned char* sout, int m0, int M,
                                                  const T* bias, int has_bias) {
  const int c0 = ((threadIdx.x >> 5) & 3) * 16 + ((threadIdx.x & 31) >> 2);
  float b[2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    b[h] = has_bias && m0 + c0 + 8 * h < M ? as<float>(bias[m0 + c0 + 8 * h]) : 0.f;
  for_each_pair<BM>(acc, [&](int, int q, float x0, float y0, float x1, float y1) {
    const float v[2][2] = {{x0, y0}, {x1, y1}};  // [channel c0, c0 + 8][pixel q, q + 1]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = c0 + 8 * h;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = q + e;
        *reinterpret_cast<T*>(sout + r * ROW_BYTES + (((c >> 3) ^ (r & 7)) << 4) +
                              (c & 7) * 2) = as<T>(has_bias ? v[h][e] + b[h] : v[h][e]);
      }
    }
  });
}

// tile_stats of a turned tile (TURN): a channel is a row, so each thread sums its 32 pixels
// of channels c0 and c0 + 8, then the 4 lanes of the row add theirs (xor 1, then 2: a fixed
// order); the shift, pixel q0's rounded value, comes from the row's first lane. No shared
// memory, no warpgroup barrier.
template <typename T>
__device__ __forceinline__ void tile_stats_turned(const float (&acc)[BM / 2], int M, int npix,
                                                  int q0, int m0, float* stats) {
  const int lane = threadIdx.x & 31;
  const int c0 = ((threadIdx.x >> 5) & 3) * 16 + (lane >> 2), tx = q0 / BM;
  const auto rounded = [](float v) { return as<float>(as<T>(v)); };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float shift = __shfl_sync(0xffffffffu, rounded(acc[2 * h]), lane & ~3);
    float sum = 0.f, sq = 0.f;
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = q0 + 8 * j + 2 * (lane & 3) + e;
        const float d = q < npix ? rounded(acc[4 * j + 2 * h + e]) - shift : 0.f;
        sum += d;
        sq += d * d;
      }
#pragma unroll
    for (int mask = 1; mask <= 2; mask <<= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, mask);
      sq += __shfl_xor_sync(0xffffffffu, sq, mask);
    }
    const int m = m0 + c0 + 8 * h;
    if ((lane & 3) == 0 && m < M) {
      stats[(long long)tx * 3 * M + m] = shift;
      stats[((long long)tx * 3 + 1) * M + m] = sum;
      stats[((long long)tx * 3 + 2) * M + m] = sq;
    }
  }
}

// A warpgroup's staged tile (stage_tile) into out by a rolled loop, where no TMA store
// applies (NCHW, the phases' strided pixels, rows not in 16-byte multiples): each thread
// works out its row's offset in out once (rowbase, 128 entries; -1 past the pixels), then
// the elements go out in the order that keeps a warp's stores together: down the pixels of
// a channel (NCHW) or along the channels of a pixel (channels-last: 16-byte chunks of 8
// channels where M and out allow).
template <typename T, int BN>
__device__ __forceinline__ void store_staged(const unsigned char* sout, long long* rowbase,
                                             const ConvGeom& g, const Phase& f, int q0,
                                             int m0, int nhwc, T* out, int wg) {
  const int tid = threadIdx.x & 127, hw = g.Ho * g.Wo;
  {
    int n, oy, ox;
    const int q = q0 + tid;
    f.pixel(q, n, oy, ox);
    const long long pix = oy * g.Wo + ox;
    rowbase[tid] = q >= f.npix ? -1 : nhwc ? ((long long)n * hw + pix) * g.M
                                           : (long long)n * g.M * hw + pix;
  }
  warpgroup_sync(wg);
  if (nhwc && g.M % 8 == 0 && ((unsigned long long)out & 15) == 0) {
    constexpr int CH = BN / 8;  // chunks a row
#pragma unroll 1
    for (int e = tid; e < BM * CH; e += 128) {
      const int row = e / CH, ch = e % CH, m = m0 + 8 * ch;
      const long long base = rowbase[row];
      if (base < 0 || m >= g.M) continue;
      *reinterpret_cast<uint4*>(out + base + m) = *reinterpret_cast<const uint4*>(
          sout + ch / 8 * (BM * ROW_BYTES) + row * ROW_BYTES + (((ch & 7) ^ (row & 7)) << 4));
    }
    return;
  }
  const long long mstep = nhwc ? 1 : hw;  // between channels
#pragma unroll 1
  for (int e = tid; e < BM * BN; e += 128) {
    const int row = nhwc ? e / BN : e % BM, col = nhwc ? e % BN : e / BM;
    const long long base = rowbase[row];
    if (base < 0 || m0 + col >= g.M) continue;
    const int c = col % 64;
    out[base + (m0 + col) * mstep] = *reinterpret_cast<const T*>(
        sout + col / 64 * (BM * ROW_BYTES) + row * ROW_BYTES + (((c >> 3) ^ (row & 7)) << 4) +
        (c & 7) * 2);
  }
}

// The multiplying warpgroups of the warp-specialized kernel (threads 0-255), ping-pong:
// warpgroup w takes every other tile of the block's walk (w = the tile's turn % 2), all 128
// of its pixel rows (two m64 wgmmas a step, acc[0] and acc[1]), so one warpgroup's epilogue
// runs while the other's wgmmas keep the tensor cores busy. The producer fills the ring in
// walk order; the ring position `pos` (slabs of the walk so far) moves on past the other
// warpgroup's slabs. A slab is taken once full[slot] completes and released through
// empty[slot] once its wgmmas have retired.
// Turns are handed over through order[w]: a warpgroup starts waiting for its tile's slabs
// only once the other has seen every slab of the tile before land. Without that, it could
// wait on a slot two uses ahead of the barrier, whose parity the use before it shares: a
// parity wait cannot tell them apart.
// RES: the weight slabs come from `resident` (slab kt of channel tile y at (y * KT + kt) *
// BN rows), landed once `loaded` completes; a stage holds only the pixel slab.
template <typename T, int BN, bool TURN, bool RES>
__device__ __forceinline__ void multiply_tiles(const ConvGeom& g, int tiles_x, int tiles_y,
                                               int tiles, u32 sbase, u32 full, u32 empty,
                                               u32 order, const T* bias, int has_bias,
                                               int nhwc, T* out, float* stats,
                                               StatsSmem<BN>& sm, const TmaMap& outputs,
                                               int tma_store, unsigned char* sout,
                                               long long* rowbase, u32 resident, u32 loaded) {
  constexpr int S = tma_stages<T, BN, RES>(), A_BYTES = BM * ROW_BYTES;
  constexpr int STAGE_BYTES = stage_bytes<BN, RES>(), BK = ROW_BYTES / sizeof(T);
  if constexpr (RES) mbar_wait(loaded, 0);
  Turns turns;
  const int wg = turns.wg;
  const bool leader = turns.leader;
  int pos = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const Tile at(g, tile, tiles_x, tiles_y, BN);
    if (at.none) continue;
    const int KT = (at.f.K + BK - 1) / BK;
    if (!turns.mine()) {  // the other warpgroup's tile
      pos += KT;
      continue;
    }
    turns.begin(order, KT);
    float acc[2][BN / 2];  // TURN: acc[0] and acc[1] as one m64n128 accumulator, flat
    float (&flat)[BN] = *reinterpret_cast<float(*)[BN]>(&acc[0][0]);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[h][i] = 0.f;
    int last = -1;  // the slot of the slab before, released once its wgmmas retire
    for (int kt = 0; kt < KT; ++kt, ++pos) {
      const int slot = pos % S;
      mbar_wait(full + 8 * slot, (pos / S) & 1);
      turns.landed(order, kt, KT);
      const u32 st = sbase + slot * STAGE_BYTES;
      const u32 sw = RES ? resident + (at.m0 / BN * KT + kt) * (BN * ROW_BYTES) : st + A_BYTES;
      if constexpr (TURN)
        wgmma_slab<T, BM>(flat, sw, st);  // A: the weights; B: the pixel rows
      else
        wgmma_slab_pair<T, BN>(acc[0], acc[1], st, st + 64 * ROW_BYTES, sw);
      wgmma_wait<1>();  // the slab before has retired: its slot may be refilled
      fence_regs(acc[0]);
      fence_regs(acc[1]);
      if (last >= 0) mbar_arrive(empty + 8 * last);
      last = slot;
    }
    wgmma_wait<0>();
    fence_regs(acc[0]);
    fence_regs(acc[1]);
    if (last >= 0) mbar_arrive(empty + 8 * last);
    if constexpr (staged<T, BN>()) {  // through shared memory: BN / 64 box stores, or rolled
      if (leader) bulk_wait_read<0>();  // the previous tile's boxes have been read
      warpgroup_sync(wg);               // ... and its rolled stores done
      if constexpr (TURN)
        stage_tile_turned<T>(flat, sout, at.m0, g.M, bias, has_bias);
      else
        stage_tile<T, BN>(acc, sout, at.m0, g.M, bias, has_bias);
      fence_proxy_async();  // the staged tile, visible to the TMA unit
      warpgroup_sync(wg);
      if (!tma_store) {
        store_staged<T, BN>(sout, rowbase, g, at.f, at.q0, at.m0, nhwc, out, wg);
      } else if (leader) {
        const u32 at_smem = (u32)__cvta_generic_to_shared(sout);
#pragma unroll
        for (int b = 0; b < BN / 64; ++b)
          tma_store_2d(outputs, at_smem + b * BM * ROW_BYTES, at.m0 + 64 * b, at.q0);
        bulk_commit();
      }
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        store_tile<T, BN>(acc[h], g, at.f, at.q0 + 64 * h, at.f.npix, at.m0, bias, has_bias,
                          nhwc, out);
    }
    if constexpr (TURN) {
      if (stats) tile_stats_turned<T>(flat, g.M, at.f.npix, at.q0, at.m0, stats);
    } else if (stats) {
      tile_stats<T, BN>(acc, wg, g.M, at.f.npix - at.q0, at.q0 / BM, at.m0, stats, sm);
    }
  }
  if (staged<T, BN>() && tma_store && leader) bulk_wait<0>();  // written before the block ends
}
}  // namespace wgmma_conv

#define DP_CONV_PARAMS                                                                      \
  const T *__restrict__ wr, const T *__restrict__ src, const T *__restrict__ bias,          \
      T *__restrict__ out, int has_bias, int Nb, int M, int C, int Hs, int Ws, int Ho, int Wo, \
      int KH, int KW, int sh, int sw, int ph, int pw, int mode, int nhwc

// One tile per block, grid (pixel tiles, channel tiles, phases); every thread loads and
// every warpgroup multiplies (wgmma_mainloop).
template <typename T, int BN>
__global__ void __launch_bounds__(256, BN <= 64 ? 2 : 1) conv2d_wgmma_kernel(DP_CONV_PARAMS) {
  using namespace wgmma_conv;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  require_smem(smem_bytes<BM, BN>());  // the launcher must pass it
  const ConvGeom g{Nb, M, C, Hs, Ws, Ho, Wo, KH, KW, sh, sw, ph, pw, mode};
  const Phase f(g, blockIdx.z);
  const int q0 = blockIdx.x * BM, m0 = blockIdx.y * BN;
  if (q0 >= f.npix && q0 > 0) return;  // past this phase's pixels (the grid fits phase 0)
  Gather<T, BN> ld;
  ld.start(f, (long long)Hs * Ws * C, C, q0, threadIdx.x >> 3, threadIdx.x & 7);
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  wgmma_mainloop<T, BM, BN>(acc, smem_base(smem_raw), (f.K + ld.BK - 1) / ld.BK,
                            [&](int, u32 sa, u32 sb) { ld.load(g, f, src, wr, m0, sa, sb); });
  store_tile<T, BN>(acc, g, f, q0 + (threadIdx.x >> 7) * 64, f.npix, m0, bias, has_bias, nhwc,
                    out);
}

// The warp-specialized kernel fed by the tensor memory accelerator (tma.cuh): one thread of
// warpgroup 2 issues each slab as two copies, the pixels through the im2col map `pixels`
// of the channels-last source (128 output pixels' BK channels at one filter tap, the
// padding zero-filled) and the weights through the tiled map `weights` of wr (BN rows of
// BK; rows past M zero-filled), and full[s] completes when their bytes have landed. The
// launcher encodes both maps and checks the one box of base positions fits every phase
// with taps; a base (bh, bw) plus the tap's offset is the source pixel (conv_tap):
//   forward: base = o * s - p, offset kh;
//   backward-data (phases; stride 1 is one): base = i + (r + p - rk) / s - (nk - 1), offset
//   nk - 1 - t for tap kh = rk + s * t of phase r's nk, i the phase's pixel index.
// One block an SM; the loading warpgroup gives registers to the multiplying ones (each
// thread of those holds two 64 x BN accumulators). Where `tma_store` (the launcher:
// channels-last, consecutive pixels, M a multiple of 8), the 16-bit tiles go out through
// the tiled map `outputs` of out as (pixels, M), boxes of 128 pixels x 64 channels.
// RES (the launcher: one phase, every weight slab within RES_BYTES): the producer loads the
// weights once, before the first tile's pixels; the stages then carry pixel slabs alone
// (a 3x3 filter over 64 channels re-read 8 KB of weights for every 16 KB of pixels).
template <typename T, int BN, bool TURN = false, bool RES = false>
__global__ void __launch_bounds__(384, 1)
    conv2d_wgmma_tma_kernel(const __grid_constant__ wgmma_tiles::TmaMap pixels,
                            const __grid_constant__ wgmma_tiles::TmaMap weights,
                            const __grid_constant__ wgmma_tiles::TmaMap outputs,
                            DP_CONV_PARAMS, int tiles_x, int tiles_y, int tiles,
                            int tma_store, float* stats) {
  using namespace wgmma_conv;
  constexpr int S = tma_stages<T, BN, RES>();
  constexpr int A_BYTES = BM * ROW_BYTES, STAGE_BYTES = stage_bytes<BN, RES>();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * S + 3];  // the Ring's, then `loaded`
  __shared__ StatsSmem<BN> stats_smem[2];                       // a multiplying warpgroup's each
  __shared__ long long rowbase[2][BM];                          // store_staged's, likewise
  require_smem(tma_smem_bytes<T, BN, RES>());  // the launcher must pass it
  const u32 sbase = smem_base(smem_raw);
  const Ring<S> ring(bars);
  const u32 full = ring.full, empty = ring.empty, order = ring.order, loaded = order + 16;
  const u32 resident = sbase + S * STAGE_BYTES + 2 * staging_bytes<T, BN>();
  if (RES && threadIdx.x == 0) mbar_init(loaded, 1);
  __syncthreads();
  const ConvGeom g{Nb, M, C, Hs, Ws, Ho, Wo, KH, KW, sh, sw, ph, pw, mode};
  // registers moved to the multiplying warpgroups (2 x 64 x BN accumulators a thread)
  if (threadIdx.x < 256) {
    setmaxnreg_inc<232>();
    unsigned char* sout = smem_raw + (sbase - (u32)__cvta_generic_to_shared(smem_raw)) +
                          S * STAGE_BYTES + (threadIdx.x >> 7) * staging_bytes<T, BN>();
    static_assert(!TURN || (BN == 64 && staged<T, BN>()), "turned: 16-bit tiles of 64");
    multiply_tiles<T, BN, TURN, RES>(g, tiles_x, tiles_y, tiles, sbase, full, empty, order,
                                     bias, has_bias, nhwc, out, stats,
                                     stats_smem[threadIdx.x >> 7], outputs, tma_store, sout,
                                     rowbase[threadIdx.x >> 7], resident, loaded);
    return;
  }
  setmaxnreg_dec<40>();
  if (threadIdx.x != 256) return;
  if (mode == 1 && (sh != 1 || sw != 1)) __trap();  // strided backward-data comes by phases
  if (stats && (mode != 0 || has_bias)) __trap();     // statistics of a bias-free forward
  if (tma_store && (!nhwc || mode == 2)) __trap();    // boxes of consecutive pixels' channels
  constexpr int BK = ROW_BYTES / sizeof(T);
  // the tap and channels of slab kt's weights, in the walk's order
  const auto weight_k = [&](const Phase& f, int th, int tw, int c) {
    return ((f.rkh + f.ps_h * th) * KW + f.rkw + f.ps_w * tw) * C + c;
  };
  const auto next_slab = [&](const Phase& f, int& th, int& tw, int& c) {
    if ((c += BK) == C) {
      c = 0;
      if (++tw == f.nkw) tw = 0, ++th;
    }
  };
  if constexpr (RES) {  // one phase: every tile's slabs are phase 0's
    const Phase f(g, 0);
    const int KT = (f.K + BK - 1) / BK;
    if (tiles_y * KT * BN * ROW_BYTES > RES_BYTES || f.K != KH * KW * C) __trap();
    mbar_expect_tx(loaded, tiles_y * KT * BN * ROW_BYTES);
    for (int y = 0; y < tiles_y; ++y) {
      int th = 0, tw = 0, c = 0;
      for (int kt = 0; kt < KT; ++kt, next_slab(f, th, tw, c))
        tma_load_2d(resident + (y * KT + kt) * (BN * ROW_BYTES), weights, weight_k(f, th, tw, c),
                    y * BN, loaded);
    }
  }
  int slot = 0;
  u32 parity = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const Tile at(g, tile, tiles_x, tiles_y, BN);
    if (at.none) continue;
    const Phase& f = at.f;
    int n, oy, ox;
    f.pixel(at.q0, n, oy, ox);
    const bool fwd = mode == 0;
    const int bh = fwd ? oy * sh - ph
                       : (oy - f.ry) / f.ps_h + (f.ry + ph - f.rkh) / f.ps_h - (f.nkh - 1);
    const int bw = fwd ? ox * sw - pw
                       : (ox - f.rx) / f.ps_w + (f.rx + pw - f.rkw) / f.ps_w - (f.nkw - 1);
    int th = 0, tw = 0, c = 0;
    for (int kt = 0, KT = (f.K + BK - 1) / BK; kt < KT; ++kt) {
      mbar_wait(empty + 8 * slot, parity ^ 1);  // the slot's previous slab retired
      const u32 st = sbase + slot * STAGE_BYTES, bar = full + 8 * slot;
      mbar_expect_tx(bar, STAGE_BYTES);
      tma_load_im2col_4d(st, pixels, c, bw, bh, n, fwd ? tw : f.nkw - 1 - tw,
                         fwd ? th : f.nkh - 1 - th, bar);
      if constexpr (!RES) tma_load_2d(st + A_BYTES, weights, weight_k(f, th, tw, c), at.m0, bar);
      next_slab(f, th, tw, c);
      if (++slot == S) slot = 0, parity ^= 1;
    }
  }
}
