// conv2d_bwdw_wgmma.cu: 2D convolution backward-weight as an implicit GEMM on Hopper tensor
// cores (wgmma.mma_async, sm_90a), bf16 / fp16 in, fp32 accumulate. Launcher:
// dptrain/backend/cuda/conv/bwdw_wgmma.py, which picks it on compute capability 9.0 for 16-bit
// operands whose channel counts come in whole 16-byte chunks; otherwise conv2d_nhwc.cu's
// mma.sync kernel runs.
//
// Conventions
//  * The GEMM: rows j = (kh*KW + kw)*C + c (the filter taps times input channels, wgmma's M,
//    128 per block: two warpgroups), columns m = output channels (wgmma's N, BN per block),
//    K = the output pixels q = (n, oy, ox), summed. D[j][m] = sum_q x[n, iy, ix, c] gy[q, m]
//    where (iy, ix) = (oy*sh - ph + kh, ox*sw - pw + kw).
//  * Both operands come channels-last (the launcher copies x and gy to NHWC first), so a
//    16-byte chunk of 8 consecutive j is one tap's contiguous channels of one pixel (C % 8 ==
//    0), and a chunk of 8 consecutive m is gy's channels of one pixel (M % 8 == 0): both tiles
//    are MN-major (wgmma.cuh), each slab 64 pixels of K; zero-fill outside the image, past
//    the block's pixel range, past the rows and columns.
//  * TF32 (conv2d_bwdw_wgmma_tf32_kernel): wgmma reads 32-bit operands K-major only, so the
//    float loader stages each slab in registers and stores it transposed: a thread loads a
//    block of 4 channels by 4 pixels (4 chunks of 16 bytes) per operand and stores it as 4
//    K-major chunks (each 4 pixels of one row), conflict-free; the next slab is stored and
//    the one after loaded while the tensor cores run (wgmma_mainloop_staged). Tiles of 128 x
//    128 (more columns would spill the staging registers).
//  * K is split over grid z (the launcher picks the count): split s covers pixels
//    [s*chunk, (s+1)*chunk). One split writes gw directly; several write float partials
//    ws[s][j][m], which conv2d_bwdw_wgmma_reduce_kernel (a thread per output) or
//    conv2d_bwdw_reduce_tiled_kernel (a tile through shared memory) sums in split order
//    (bitwise repeatable, the same bits) into gw, or adds into a float .grad (put_sum). gw is
//    PyTorch's (M, C, KH, KW): column j lands at c*KH*KW + tap.
//  * conv2d_bwdw_tma_kernel: the same GEMM turned around and fed by TMA, warp-specialized as
//    conv2d_wgmma.cu's forward (a ring of stages, one producer thread, two multiplying
//    warpgroups taking whole tiles in turn). Rows are the output channels m (wgmma's M: R
//    atoms of 64 channels of gy), columns the j (wgmma's N: BJ of them, BJ / 64 atoms of 64
//    channels of one tap each), K the pixels in slabs of 64: D[m][j]. With 64 output
//    channels (ResNet's first stage) the wide side is then j: an m64n192 wgmma reads 8 KB
//    of shared memory per 197 K multiply-adds, where the 128 x 64 tile's two m64n64 read 8
//    KB per 131 K. With more, tiles of 128 x 128 (R = 2) load 32 KB a slab per 1 M
//    multiply-adds where 64 x 192 load 32 KB per 786 K: these passes are bound by what the
//    SMs read from L2. A slab is R + BJ / 64 boxes, each landing as an MN-major atom: gy's
//    64 pixels x 64 channels through a tiled map of (pixels, M), and x's through the
//    forward's im2col map (64 output pixels' channels c.. at tap (kh, kw): base o * s - p,
//    offset the tap). Pixels past the last read as zeros through both maps, and the
//    splits' chunks are whole slabs, so no slab needs a mask. The tiles (m fastest, then
//    j, then the split) are walked by one block an SM: the tiles in flight share their
//    split's pixels in L2. Partials and reduce as above (the same ws[s][j][m]).
//
// nvrtc-options: -arch=sm_90a
// instantiations-per-module: 1  (a run builds only those it uses: a shorter cold start)
// instantiate: conv2d_bwdw_wgmma_kernel<{__nv_bfloat16, __half}, {64, 128, 256}>
// instantiate: conv2d_bwdw_wgmma_tf32_kernel<128>
// instantiate: conv2d_bwdw_tma_kernel<{__nv_bfloat16, __half}, 192, 1>; conv2d_bwdw_tma_kernel<{__nv_bfloat16, __half}, 128, 2>
// instantiate: conv2d_bwdw_reduce_tiled_kernel<{__nv_bfloat16, __half, float}>
// instantiate: conv2d_bwdw_wgmma_reduce_kernel<{__nv_bfloat16, __half, float}>

#include "common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace wgmma_bwdw {
constexpr int BM = 128, BK = 64, THREADS = 256, CHUNK = 8;  // CHUNK: 16-bit values
constexpr int ROWS = BK / (THREADS / 8);                    // pixel rows a thread loads: 2
}  // namespace wgmma_bwdw

// An output pixel q as (n, oy, ox), walked by both kernels' loaders a slab at a time: the
// slab's pixel count decoded once into whole images, rows and columns (PixelStep), each
// step then carried, without the two divisions per pixel and slab of decoding q (the
// loaders are issue-bound). Branch-free: the TF32 loader runs inside the wgmma pipeline.
struct Pixel { int n, oy, ox; };
struct PixelStep { int dn, dy, dx, Ho, Wo; };
__device__ __forceinline__ Pixel pixel_at(int q, int Ho, int Wo) {
  const int hw = Ho * Wo, n = q / hw, p = q - n * hw, oy = p / Wo;
  return {n, oy, p - oy * Wo};
}
__device__ __forceinline__ PixelStep pixel_step(int by, int Ho, int Wo) {
  const int hw = Ho * Wo, dn = by / hw, dy = (by - dn * hw) / Wo;
  return {dn, dy, by - dn * hw - dy * Wo, Ho, Wo};
}
__device__ __forceinline__ void advance(Pixel& px, const PixelStep& s) {
  px.ox += s.dx;
  if (px.ox >= s.Wo) px.ox -= s.Wo, ++px.oy;
  px.oy += s.dy;
  if (px.oy >= s.Ho) px.oy -= s.Ho, ++px.n;
  px.n += s.dn;
}

// gw's column (c, kh, kw) of GEMM row j = t * C + c (tap t of `taps`, channel c): every kernel
// here stores gw (C_out, C_in, KH, KW) through it.
__device__ __forceinline__ int gw_column(int j, int C, int taps) {
  const int t = j / C;
  return (j - t * C) * taps + t;
}

// Epilogue of both kernels: the thread's rows j (row and row + 8) and pairs of columns m, to
// gw (one split) or to split blockIdx.z's float partials.
template <typename T, int BN>
__device__ __forceinline__ void bwdw_store(const float (&acc)[BN / 2], T* gw, float* ws, int M,
                                           int C, int J, int taps, int splits, int j0,
                                           int m0) {
  using namespace wgmma_tiles;
  int jrow[2], gcol[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = j0 + (threadIdx.x >> 7) * 64 + ((threadIdx.x >> 5) & 3) * 16 +
                  ((threadIdx.x & 31) >> 2) + 8 * h;
    jrow[h] = j < J ? j : -1;
    gcol[h] = gw_column(j, C, taps);
  }
  float* part = ws + (long long)blockIdx.z * J * M;
  for_each_pair<BN>(acc, [&](int, int col, float x0, float y0, float x1, float y1) {
    const int m = m0 + col;
    if (m >= M) return;  // M % 8 == 0 (16-bit), % 4 (float): m + 1 < M too
    const float v[2][2] = {{x0, y0}, {x1, y1}};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (jrow[h] < 0) continue;
      if (splits == 1) {
        gw[(long long)m * J + gcol[h]] = as<T>(v[h][0]);
        gw[(long long)(m + 1) * J + gcol[h]] = as<T>(v[h][1]);
      } else {
        *reinterpret_cast<float2*>(part + (long long)jrow[h] * M + m) = make_float2(v[h][0], v[h][1]);
      }
    }
  });
}

template <typename T, int BN>
__global__ void __launch_bounds__(wgmma_bwdw::THREADS, 1)
    conv2d_bwdw_wgmma_kernel(const T* __restrict__ x, const T* __restrict__ gy,
                             T* __restrict__ gw, float* __restrict__ ws, int Nb, int M, int C,
                             int H, int W, int Ho, int Wo, int KH, int KW, int sh, int sw,
                             int ph, int pw, int splits, int chunk) {
  using namespace wgmma_tiles;
  using namespace wgmma_bwdw;
  constexpr int A_ATOMS = BM / 64, B_ATOMS = BN / 64;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  require_smem(smem_bytes<BM, BN>());  // the launcher must pass it

  const int taps = KH * KW, J = taps * C, npix = Nb * Ho * Wo;
  const int j0 = blockIdx.x * BM, m0 = blockIdx.y * BN;
  const int p_begin = blockIdx.z * chunk, p_end = min(npix, p_begin + chunk);
  const int KT = p_end > p_begin ? (p_end - p_begin + BK - 1) / BK : 0;

  // Loader: chunk lc = tid % 8 of pixel rows lrow + 32 r of every atom. A thread's columns
  // (its taps and channels) stay the same for every slab: decoded once, as offsets into x
  // from a pixel's top-left tap. Its pixels move on by BK each slab (the main loop asks for
  // the slabs in order): walked as Pixels.
  const int lrow = threadIdx.x >> 3, lc = threadIdx.x & 7;
  int tkh[A_ATOMS], tkw[A_ATOMS], toff[A_ATOMS];
#pragma unroll
  for (int a = 0; a < A_ATOMS; ++a) {
    const int j = j0 + a * 64 + lc * CHUNK, t = j / C;
    tkh[a] = t / KW;
    tkw[a] = t - tkh[a] * KW;
    toff[a] = j < J ? (tkh[a] * W + tkw[a]) * C + (j - t * C) : -1;
  }
  Pixel pix[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) pix[r] = pixel_at(p_begin + lrow + 32 * r, Ho, Wo);
  const PixelStep slab = pixel_step(BK, Ho, Wo);

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  if (KT > 0)
    wgmma_mainloop<T, BM, BN, true>(acc, smem_base(smem_raw), KT, [&](int kt, u32 sa, u32 sb) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int row = lrow + 32 * r, q = p_begin + kt * BK + row;
        const bool qok = q < p_end;
        const int iy0 = pix[r].oy * sh - ph, ix0 = pix[r].ox * sw - pw;  // the top-left tap
        const long long at = ((long long)pix[r].n * H + iy0) * W + ix0;
#pragma unroll
        for (int a = 0; a < A_ATOMS; ++a) {
          const int iy = iy0 + tkh[a], ix = ix0 + tkw[a];
          const bool ok =
              qok && toff[a] >= 0 && (unsigned)iy < (unsigned)H && (unsigned)ix < (unsigned)W;
          cp_async16(sa + a * (BK * ROW_BYTES) + swizzled(row, lc),
                     ok ? x + at * C + toff[a] : x, ok ? 16 : 0);
        }
        const T* gq = gy + (long long)q * M;
#pragma unroll
        for (int b = 0; b < B_ATOMS; ++b) {
          const int m = m0 + b * 64 + lc * CHUNK;
          const bool ok = qok && m < M;
          cp_async16(sb + b * (BK * ROW_BYTES) + swizzled(row, lc), ok ? gq + m : gy, ok ? 16 : 0);
        }
        advance(pix[r], slab);  // the next slab's pixel, BK further
      }
    });

  bwdw_store<T, BN>(acc, gw, ws, M, C, J, taps, splits, j0, m0);
}

namespace wgmma_bwdw_tf32 {
constexpr int BM = 128, BK = 32, THREADS = 256;  // BK: pixels per slab (128 bytes)
// A thread's share of a slab of a 128-row operand tile: one block of 4 rows (one 16-byte
// chunk of the channels-last source) by 4 pixels, loaded as 4 chunks (one per pixel) and
// stored as 4 (one per row): 16 bytes of a K-major row are 4 consecutive pixels. Warp w
// covers rows 16w..16w+15; lane l rows 4(l%4).. of them and pixels 4(l/4)..: a store
// instruction's 32 chunks fall 4 to each of the 8 swizzled 16-byte bank groups (no
// conflict), a load's are 8 pixels' 64 contiguous bytes.
__device__ __forceinline__ int block_row() { return 16 * (threadIdx.x >> 5) + 4 * (threadIdx.x & 3); }
__device__ __forceinline__ int block_pixel() { return 4 * ((threadIdx.x & 31) >> 2); }
// 16 bytes from global memory where `ok`, else zeros: one predicated load, no branch (a
// branch inside the wgmma pipeline makes ptxas serialise the wgmmas).
__device__ __forceinline__ float4 load4_or_zero(const float* p, bool ok) {
  float4 v;
  asm volatile(
      "{\n.reg .pred q;\nsetp.ne.b32 q, %5, 0;\n"
      "mov.f32 %0, 0f00000000;\nmov.f32 %1, 0f00000000;\n"
      "mov.f32 %2, 0f00000000;\nmov.f32 %3, 0f00000000;\n"
      "@q ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(p), "r"((int)ok));
  return v;
}
// Stores the block v[pixel] (4 rows each) transposed: row r + k gets the 4 pixels' k-th
// values, one 16-byte store into the K-major, 128-byte swizzled tile.
__device__ __forceinline__ void stash_block(wgmma_tiles::u32 tile, int r, int p,
                                            const float4 (&v)[4]) {
  const float* e[4] = {&v[0].x, &v[1].x, &v[2].x, &v[3].x};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     tile + wgmma_tiles::swizzled(r + k, p >> 2)),
                 "f"(e[0][k]), "f"(e[1][k]), "f"(e[2][k]), "f"(e[3][k])
                 : "memory");
}
}  // namespace wgmma_bwdw_tf32

// TF32: the GEMM and epilogue of conv2d_bwdw_wgmma_kernel with 128 x 128 tiles, slabs of 32
// pixels stored K-major from registers (see the conventions). A template (of one
// instantiation) so that only the module naming it compiles it.
template <int BN>
__global__ void __launch_bounds__(wgmma_bwdw_tf32::THREADS, 1)
    conv2d_bwdw_wgmma_tf32_kernel(const float* __restrict__ x, const float* __restrict__ gy,
                                  float* __restrict__ gw, float* __restrict__ ws, int Nb, int M,
                                  int C, int H, int W, int Ho, int Wo, int KH, int KW, int sh,
                                  int sw, int ph, int pw, int splits, int chunk) {
  using namespace wgmma_tiles;
  using namespace wgmma_bwdw_tf32;
  static_assert(BN == BM, "one 4 x 4 block of each operand per thread");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  require_smem(smem_bytes<BM, BN>());  // the launcher must pass it

  const int taps = KH * KW, J = taps * C, npix = Nb * Ho * Wo;
  const int j0 = blockIdx.x * BM, m0 = blockIdx.y * BN;
  const int p_begin = blockIdx.z * chunk, p_end = min(npix, p_begin + chunk);
  const int KT = p_end > p_begin ? (p_end - p_begin + BK - 1) / BK : 0;
  const int brow = block_row(), bpix = block_pixel();

  // A: this thread's 4 rows j (one tap's channels) are the same in every slab: decoded once.
  // Its 4 pixels move on by BK a slab: walked as Pixels. B: 4 channels m of gy.
  const int ja = j0 + brow, ta = ja / C, ca = ja - ta * C;
  const int akh = ta / KW, akw = ta - akh * KW;
  const bool jok = ja < J;
  const int mb = m0 + brow;
  Pixel pix[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) pix[e] = pixel_at(p_begin + bpix + e, Ho, Wo);
  const PixelStep slab = pixel_step(BK, Ho, Wo);
  float4 ra[4], rb[4];  // the slab in flight (wgmma_mainloop_staged), by pixel

  auto fetch = [&](int kt) {
    const int q0 = p_begin + kt * BK + bpix;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int iy = pix[e].oy * sh - ph + akh, ix = pix[e].ox * sw - pw + akw;
      const bool qok = q0 + e < p_end;
      const bool ok = qok && jok && (unsigned)iy < (unsigned)H && (unsigned)ix < (unsigned)W;
      ra[e] = load4_or_zero(x + (((long long)pix[e].n * H + iy) * W + ix) * C + ca, ok);
      rb[e] = load4_or_zero(gy + (long long)(q0 + e) * M + mb, qok && mb < M);
      advance(pix[e], slab);  // the next slab's pixel, BK further
    }
  };
  auto stash = [&](u32 sa, u32 sb) {
    stash_block(sa, brow, bpix, ra);
    stash_block(sb, brow, bpix, rb);
  };

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  wgmma_mainloop_staged<float, BM, BN>(acc, smem_base(smem_raw), KT, fetch, stash);
  bwdw_store<float, BN>(acc, gw, ws, M, C, J, taps, splits, j0, m0);
}

namespace wgmma_bwdw_tma {
using namespace wgmma_tiles;
constexpr int BK = 64, ATOM = BK * ROW_BYTES;  // pixels a slab; bytes of a 64-wide atom
// A stage: R atoms of gy (64 R output channels), then BJ / 64 of x.
template <int BJ, int R> __host__ __device__ constexpr int stage_bytes() {
  return (R + BJ / 64) * ATOM;
}
// As many stages as fit in 192 KB, at most 8 (the launcher: conv/bwdw_wgmma.py's tma_smem).
template <int BJ, int R> __host__ __device__ constexpr int stages() {
  return 192 * 1024 / stage_bytes<BJ, R>() < 8 ? 192 * 1024 / stage_bytes<BJ, R>() : 8;
}

// Tile `tile` of the walk: its output channels m0.., columns j0.., pixels [q0, q1) and slabs.
struct Tile {
  int m0, j0, split, q0, q1, KT;
  __device__ __forceinline__ Tile(int tile, int tiles_m, int tiles_j, int BM, int BJ,
                                  int chunk, int npix)
      : m0(tile % tiles_m * BM),
        j0(tile / tiles_m % tiles_j * BJ),
        split(tile / (tiles_m * tiles_j)),
        q0(split * chunk),
        q1(min(npix, q0 + chunk)),
        KT(q1 > q0 ? (q1 - q0 + BK - 1) / BK : 0) {}
};

// One slab's wgmmas for a warpgroup's R x 64 rows, committed as one group: rows 64r.. from
// gy's atom r at sa + r * ATOM into acc[r], all against the BJ columns of x at sb (both
// MN-major).
template <typename T, int BJ, int R>
__device__ __forceinline__ void slab_rows(float (&acc)[R][BJ / 2], u32 sa, u32 sb) {
#pragma unroll
  for (int r = 0; r < R; ++r) fence_regs(acc[r]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk)  // 16 pixels of K a step: 2 KB of an atom
#pragma unroll
    for (int r = 0; r < R; ++r)
      Wgmma<T, BJ, true>::run(acc[r], mn_desc(sa + r * ATOM + kk * 2048, ATOM),
                              mn_desc(sb + kk * 2048, ATOM));
  wgmma_commit();
}

// The epilogue of 64 rows of a warpgroup's tile (output channels m0..; acc: their m64nBJ
// accumulators): the thread's rows m (row, row + 8) and pairs of columns j, to gw (one
// split) or split `split`'s float partials ws[split][j][m] (a warp's store: 8 consecutive m
// at each of 4 columns, whole 32-byte sectors).
template <typename T, int BJ>
__device__ __forceinline__ void store(const float (&acc)[BJ / 2], T* gw, float* ws, int M,
                                      int C, int J, int splits, const Tile& at, int m0) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, taps = J / C;
  float* part = ws + (long long)at.split * J * M;
#pragma unroll
  for (int g = 0; g < BJ / 8; ++g)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + warp * 16 + (lane >> 2) + 8 * h;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = at.j0 + 8 * g + 2 * (lane & 3) + e;
        if (m >= M || j >= J) continue;
        const float v = acc[4 * g + 2 * h + e];
        if (splits == 1) {
          gw[(long long)m * J + gw_column(j, C, taps)] = as<T>(v);
        } else {
          part[(long long)j * M + m] = v;
        }
      }
    }
}
}  // namespace wgmma_bwdw_tma

// The TMA-fed backward-weight (see the conventions): 384 threads, warpgroups 0 and 1 multiply
// (ping-pong, as conv2d_wgmma.cu's multiply_tiles: turns handed over through order[w]),
// thread 256 issues the copies. `pixels`: the im2col map of x (NHWC; boxes of 64 pixels x
// 64 channels), `grads`: the tiled map of gy as (npix, M) (boxes of 64 x 64). One block an
// SM walks tiles blockIdx.x, + gridDim.x, ...
template <typename T, int BJ, int R>
__global__ void __launch_bounds__(384, 1)
    conv2d_bwdw_tma_kernel(const __grid_constant__ wgmma_tiles::TmaMap pixels,
                           const __grid_constant__ wgmma_tiles::TmaMap grads,
                           T* __restrict__ gw, float* __restrict__ ws, int Nb, int M, int C,
                           int Ho, int Wo, int KW, int sh, int sw, int ph, int pw, int J,
                           int tiles_m, int tiles_j, int splits, int chunk) {
  using namespace wgmma_tiles;
  using namespace wgmma_bwdw_tma;
  constexpr int S = stages<BJ, R>(), STAGE = stage_bytes<BJ, R>(), BM = 64 * R;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * S + 2];  // the Ring's
  require_smem(S * STAGE + 1024);  // the launcher must pass it
  const u32 sbase = smem_base(smem_raw);
  const Ring<S> ring(bars);
  const u32 full = ring.full, empty = ring.empty;
  __syncthreads();
  const int npix = Nb * Ho * Wo, tiles = tiles_m * tiles_j * splits;
  if (threadIdx.x < 256) {  // multiplying warpgroups
    setmaxnreg_inc<232>();
    Turns turns;
    int pos = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const Tile at(tile, tiles_m, tiles_j, BM, BJ, chunk, npix);
      if (!turns.mine()) {  // the other warpgroup's tile
        pos += at.KT;
        continue;
      }
      turns.begin(ring.order, at.KT);
      float acc[R][BJ / 2];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < BJ / 2; ++i) acc[r][i] = 0.f;
      int last = -1;  // the slot of the slab before, released once its wgmmas retire
      for (int kt = 0; kt < at.KT; ++kt, ++pos) {
        const int slot = pos % S;
        mbar_wait(full + 8 * slot, (pos / S) & 1);
        turns.landed(ring.order, kt, at.KT);
        const u32 st = sbase + slot * STAGE;
        slab_rows<T, BJ, R>(acc, st, st + R * ATOM);
        wgmma_wait<1>();  // the slab before has retired: its slot may be refilled
#pragma unroll
        for (int r = 0; r < R; ++r) fence_regs(acc[r]);
        if (last >= 0) mbar_arrive(empty + 8 * last);
        last = slot;
      }
      wgmma_wait<0>();
#pragma unroll
      for (int r = 0; r < R; ++r) fence_regs(acc[r]);
      if (last >= 0) mbar_arrive(empty + 8 * last);
#pragma unroll
      for (int r = 0; r < R; ++r)
        store<T, BJ>(acc[r], gw, ws, M, C, J, splits, at, at.m0 + 64 * r);
    }
    return;
  }
  setmaxnreg_dec<40>();
  if (threadIdx.x != 256) return;
  int slot = 0;
  u32 parity = 0;
  const PixelStep slab = pixel_step(BK, Ho, Wo);
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const Tile at(tile, tiles_m, tiles_j, BM, BJ, chunk, npix);
    int tc[BJ / 64], tw[BJ / 64], th[BJ / 64];  // each atom's channel and tap
#pragma unroll
    for (int a = 0; a < BJ / 64; ++a) {
      const int j = at.j0 + 64 * a, t = j / C;
      tc[a] = j - t * C;
      th[a] = t / KW;
      tw[a] = t - th[a] * KW;
    }
    Pixel px = pixel_at(at.q0, Ho, Wo);
    for (int kt = 0; kt < at.KT; ++kt) {
      mbar_wait(empty + 8 * slot, parity ^ 1);  // the slot's previous slab retired
      const u32 st = sbase + slot * STAGE, bar = full + 8 * slot;
      mbar_expect_tx(bar, STAGE);
#pragma unroll
      for (int r = 0; r < R; ++r)
        tma_load_2d(st + r * ATOM, grads, at.m0 + 64 * r, at.q0 + kt * BK, bar);
#pragma unroll
      for (int a = 0; a < BJ / 64; ++a)
        tma_load_im2col_4d(st + (R + a) * ATOM, pixels, tc[a], px.ox * sw - pw, px.oy * sh - ph,
                           px.n, tw[a], th[a], bar);
      advance(px, slab);
      if (++slot == S) slot = 0, parity ^= 1;
    }
  }
}

// Where a reducer's sum of output o goes: gw[o] = T(sum), or, given `add` (a mixed-precision
// weight's float .grad, gw then unused), add[o] = prior + T(sum), prior being add[o] as the
// caller loaded it before summing the splits (its latency hidden behind theirs: loaded after
// them it cost the tiled kernel 5 us a launch, H200): the bits of storing gw and then add_
// (elementwise.cu's accumulate_kernel), without that pass.
template <typename T>
__device__ __forceinline__ void put_sum(T* gw, float* add, long long o, float prior, float sum) {
  if (add)
    add[o] = prior + as<float>(as<T>(sum));
  else
    gw[o] = as<T>(sum);
}

// gw[m][c*taps + t] = sum over s in order of ws[s][t*C + c][m]: a thread per output, reading
// along m (coalesced), its stores strided (J apart). For outputs too few to tile.
template <typename T>
__global__ void conv2d_bwdw_wgmma_reduce_kernel(const float* __restrict__ ws, T* __restrict__ gw,
                                                int splits, int M, int C, int taps,
                                                float* __restrict__ add) {
  const long long total = (long long)taps * C * M, J = (long long)taps * C;
  for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < total;
       o += (long long)gridDim.x * blockDim.x) {
    const long long j = o / M, m = o - j * M;  // j < J: an int
    const long long at = m * J + gw_column((int)j, C, taps);
    const float prior = add ? add[at] : 0.f;
    float s = 0.f;
    for (int k = 0; k < splits; ++k) s += ws[k * total + o];
    put_sum(gw, add, at, prior, s);
  }
}

// The same sums a tile at a time, both sides coalesced: a block sums the rows j = (t, c) of
// 32 output channels m0.. for channels c0 .. c0 + CT of every tap (CT * taps <= 64 rows;
// a warp loads its 8 rows together, 128 bytes each a split) into shared memory, then writes
// each m's CT * taps outputs, which lie together in gw. The same additions in the same
// order as the thread-per-output kernel: the same bits. Grid (M / 32, C / CT); 256 threads.
template <typename T>
__global__ void __launch_bounds__(256) conv2d_bwdw_reduce_tiled_kernel(
    const float* __restrict__ ws, T* __restrict__ gw, int splits, int M, int C, int taps, int CT,
    float* __restrict__ add) {
  constexpr int RPW = 8;                  // rows a warp: row r = warp + 8i
  constexpr int OUTS = 8;                 // outputs a thread stores: 32 x 64 / 256
  __shared__ float sums[8 * RPW][33];     // [t * CT + i]: channel c0 + i of tap t, by m
  const long long total = (long long)taps * C * M, J = (long long)taps * C;
  const int m0 = blockIdx.x * 32, c0 = blockIdx.y * CT, lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5, rows = CT * taps, m = m0 + lane;
  // the block's output e = mm * rows + i * taps + t (channel m0 + mm, c0 + i, tap t): its
  // place in gw, or -1 past the outputs
  const auto out_at = [&](int e) -> long long {
    const int mm = e / rows, q = e - mm * rows, i = q / taps, t = q - i * taps;
    return e < 32 * rows && m0 + mm < M && c0 + i < C
               ? (long long)(m0 + mm) * J + (long long)(c0 + i) * taps + t : -1;
  };
  float prior[OUTS];
#pragma unroll
  for (int u = 0; u < OUTS; ++u) {
    const long long o = out_at(threadIdx.x + 256 * u);
    prior[u] = add && o >= 0 ? add[o] : 0.f;
  }
  const float* p[RPW];
  bool ok[RPW];
  float s[RPW];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int r = warp + 8 * i, t = r / CT, c = c0 + r - t * CT;
    ok[i] = r < rows && c < C && m < M;
    p[i] = ws + (long long)(t * C + c) * M + m;  // read only where ok
    s[i] = 0.f;
  }
  for (int k = 0; k < splits; ++k)
#pragma unroll
    for (int i = 0; i < RPW; ++i)
      if (ok[i]) s[i] += p[i][k * total];
#pragma unroll
  for (int i = 0; i < RPW; ++i)
    if (warp + 8 * i < rows) sums[warp + 8 * i][lane] = s[i];
  __syncthreads();
#pragma unroll
  for (int u = 0; u < OUTS; ++u) {
    const int e = threadIdx.x + 256 * u;
    const long long o = out_at(e);
    const int mm = e / rows, q = e - mm * rows, i = q / taps, t = q - i * taps;
    if (o >= 0) put_sum(gw, add, o, prior[u], sums[t * CT + i][mm]);
  }
}
