// conv2d_bwdw_wgmma.cu: 2D convolution backward-weight as an implicit GEMM on Hopper tensor
// cores (wgmma.mma_async, sm_90a), bf16 / fp16 in, fp32 accumulate. Launcher:
// dptrain/backend/cuda/conv2d.py, which picks it on compute capability 9.0 for 16-bit
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
//    ws[s][j][m], which conv2d_bwdw_wgmma_reduce_kernel sums in split order (bitwise
//    repeatable) into gw. gw is PyTorch's (M, C, KH, KW): column j lands at c*KH*KW + tap.
//
// nvrtc-options: -arch=sm_90a
// instantiations-per-module: 1  (a run builds only those it uses: a shorter cold start)
// instantiate: conv2d_bwdw_wgmma_kernel<__nv_bfloat16, 64>
// instantiate: conv2d_bwdw_wgmma_kernel<__nv_bfloat16, 128>
// instantiate: conv2d_bwdw_wgmma_kernel<__nv_bfloat16, 256>
// instantiate: conv2d_bwdw_wgmma_kernel<__half, 64>; conv2d_bwdw_wgmma_kernel<__half, 128>
// instantiate: conv2d_bwdw_wgmma_kernel<__half, 256>
// instantiate: conv2d_bwdw_wgmma_tf32_kernel<128>
// instantiate: conv2d_bwdw_wgmma_reduce_kernel<__nv_bfloat16>
// instantiate: conv2d_bwdw_wgmma_reduce_kernel<__half>
// instantiate: conv2d_bwdw_wgmma_reduce_kernel<float>

#include "common.cuh"
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
    const int t = j / C;
    jrow[h] = j < J ? j : -1;
    gcol[h] = (j - t * C) * taps + t;  // gw's column (c, kh, kw)
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

// gw[m][c*taps + t] = sum over s in order of ws[s][t*C + c][m]: a thread per output, reading
// along m (coalesced).
template <typename T>
__global__ void conv2d_bwdw_wgmma_reduce_kernel(const float* __restrict__ ws, T* __restrict__ gw,
                                                int splits, int M, int C, int taps) {
  const long long total = (long long)taps * C * M, J = (long long)taps * C;
  for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < total;
       o += (long long)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < splits; ++k) s += ws[k * total + o];
    const long long j = o / M, m = o - j * M, t = j / C, c = j - t * C;
    gw[m * J + c * taps + t] = as<T>(s);
  }
}
