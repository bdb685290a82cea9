// conv2d_nhwc.cu: backward-weight as an implicit GEMM with channels-last gathers. x is first
// copied to NHWC (transpose.cu's tile_transpose_kernel), where one filter tap of one pixel is
// C_in contiguous channels, so the im2col operand fills with 16-byte cp.async chunks instead
// of one load per element (what conv2d.cu's NCHW backward-weight kernels spend most of their
// time on). TF32 on float, m16n8k16 tensor cores on the 16-bit types, fp32 accumulation, the
// main loops of gemm_tiles.cuh; under fp32, an FFMA kernel with the same x chunks.
// Launchers: dptrain/backend/cuda/conv/nhwc.py (chosen by conv/passes.py's routes; conv2d.cu's kernels otherwise).
//
// Conventions
//  * gw[co, (ci, kh, kw)] as in conv2d.cu (its header), NCHW at the interface: the NHWC copy
//    is the launcher's scratch. V = 16 / sizeof(T) elements make a chunk; C_in and Ho*Wo are
//    multiples of V, so no chunk straddles two filter taps or two images.
//  * The GEMM's columns are j = (kh*KW + kw)*C_in + ci (the epilogue writes gw's own column
//    (ci, kh, kw)); A = gy in chunks along the pixels, K-major; B = x in NHWC, MN-major
//    ([k][j]); thread t keeps pixel row t % BK of every slab (one decode per slab) and chunk
//    columns t / BK + i * THREADS / BK, whose taps it decodes once. K is split over grid z
//    as in conv2d.cu, with the same fixed-order reduce: bitwise repeatable.
//  * The forward and backward-data passes were tried the same way (x or gy copied to NHWC,
//    16-byte chunks along the channels) and measured slower than conv2d.cu's gathers at the
//    reference CNN's shapes (NOTES-gemm.md), so they stay there.
//
// instantiations-per-module: 1  (a run builds only those it uses: a shorter cold start)
// instantiate: conv2d_bwdw_nhwc_kernel<{float, __half, __nv_bfloat16}, {32, 64, 128}, {32, 96, 128}>
// instantiate: conv2d_bwdw_nhwc_fp32_kernel<float, {32, 64, 128}, {32, 96, 128}>

#include "conv_gather.cuh"

// What the chunk loaders share: mma16_mainloop's staged interface, where cp.async needs no
// registers (fetch is load, put does nothing).
template <class Derived, typename E>
struct ChunkLoader {
  static constexpr int V = 16 / sizeof(E);  // elements per 16-byte chunk
  struct Regs {};
  __device__ __forceinline__ void fetch(Regs&, E* s, int k0, int k_end) const {
    static_cast<const Derived*>(this)->load(s, k0, k_end);
  }
  __device__ __forceinline__ void put(E*, const Regs&) const {}
};

// ----------------------------------------------------------------------------- backward-weight

// A operand: gy[n, co, p] as (m = co, k = q), q = n*Ho*Wo + p, in chunks along q.
template <class L, int THREADS>
struct GyChunkLoader : ChunkLoader<GyChunkLoader<L, THREADS>, typename L::Elem> {
  using Layout = L;
  using E = typename L::Elem;
  static constexpr int V = 16 / sizeof(E), CPR = L::kBK / V, RSTEP = THREADS / CPR;
  static constexpr int PER = (L::kBMN + RSTEP - 1) / RSTEP;
  static_assert(L::kKMajor && THREADS % CPR == 0, "K-major rows of whole chunks");
  const E* gy;
  int M, m0, hw;

  __device__ __forceinline__ void load(E* s, int k0, int k_end) const {
    const int kc = (threadIdx.x % CPR) * V, q = k0 + kc, n = q / hw;
    const bool qok = q < k_end;  // k_end is a multiple of V: whole chunks only
    const E* base = gy + ((long long)n * M + m0) * hw + (q - n * hw);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int m = threadIdx.x / CPR + i * RSTEP;
      if (L::kBMN % RSTEP != 0 && m >= L::kBMN) break;
      const bool ok = qok && m0 + m < M;
      cp_async16(s + L::off(m, kc), ok ? base + (long long)m * hw : gy, ok ? 16 : 0);
    }
  }
};

// B operand: xt[n, oy*sh - ph + kh, ox*sw - pw + kw, ci] (x in NHWC) as (k = q, n = j).
template <class L, int THREADS>
struct XtChunkLoader : ChunkLoader<XtChunkLoader<L, THREADS>, typename L::Elem> {
  using Layout = L;
  using E = typename L::Elem;
  static constexpr int V = 16 / sizeof(E), CPR = L::kBMN / V, RSTEP = THREADS / L::kBK;
  static constexpr int PER = (CPR + RSTEP - 1) / RSTEP;
  static_assert(!L::kKMajor && THREADS % L::kBK == 0, "MN-major slab, whole pixel rows");
  const E* xt;
  int C, H, W, hw, Wo, sh, sw;
  int dy[PER], dx[PER], ci[PER];  // each chunk's kh - ph, kw - pw, first channel

  __device__ __forceinline__ XtChunkLoader(const E* xt_, int C_, int H_, int W_, int Ho, int Wo_,
                                           int sh_, int sw_, int ph, int pw, int KW, int N,
                                           int n0)
      : xt(xt_), C(C_), H(H_), W(W_), hw(Ho * Wo_), Wo(Wo_), sh(sh_), sw(sw_) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = threadIdx.x / L::kBK + i * RSTEP, j = n0 + c * V;
      const int tap = j / C, kh = tap / KW;
      const bool ok = c < CPR && j < N;
      dy[i] = ok ? kh - ph : -(1 << 20);  // never inside the image: a zero chunk
      dx[i] = tap - kh * KW - pw;
      ci[i] = j - tap * C;
    }
  }

  __device__ __forceinline__ void load(E* s, int k0, int k_end) const {
    const int r = threadIdx.x % L::kBK, q = k0 + r;
    const bool qok = q < k_end;
    const int n = q / hw, p = q - n * hw, oy = p / Wo, ox = p - oy * Wo;
    const int iy0 = oy * sh, ix0 = ox * sw;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = threadIdx.x / L::kBK + i * RSTEP;
      if (CPR % RSTEP != 0 && c >= CPR) break;
      const int iy = iy0 + dy[i], ix = ix0 + dx[i];
      const bool ok = qok && (unsigned)iy < (unsigned)H && (unsigned)ix < (unsigned)W;
      const E* src = ok ? xt + (((long long)n * H + iy) * W + ix) * C + ci[i] : xt;
      cp_async16(s + L::off(c * V, r), src, ok ? 16 : 0);
    }
  }
};

#define BWDW_NHWC_PARAMS                                                                      \
  const T *__restrict__ xt, const T *__restrict__ gy, T *__restrict__ gw,                      \
      float *__restrict__ ws, int Nb, int Cout, int Cin, int H, int W, int Ho, int Wo, int KH, \
      int KW, int sh, int sw, int ph, int pw, int splits, int kchunk

// This split's K range, the x loader, and its slice of the workspace.
#define BWDW_NHWC_SETUP                                                                       \
  const int M = Cout, N = Cin * KH * KW, K = Nb * Ho * Wo, KHW = KH * KW;                     \
  const int m0 = blockIdx.y * Cfg::BM, n0 = blockIdx.x * Cfg::BN, s = blockIdx.z;             \
  const int k_begin = s * kchunk, k_end = min(K, k_begin + kchunk);                           \
  const XtChunkLoader<LayB, Cfg::THREADS> lb(xt, Cin, H, W, Ho, Wo, sh, sw, ph, pw, KW, N, n0); \
  float* part = ws + (long long)s * M * N;                                                    \
  extern __shared__ float4 smem4[];                                                           \
  T* smem = reinterpret_cast<T*>(smem4);                                                      \
  check_smem(Cfg::STAGES * (LayA::kSize + LayB::kSize) * sizeof(T))

// Column j = (kh, kw, ci) goes to gw's own column (ci, kh, kw).
#define BWDW_NHWC_STORE(Coords)                                                   \
  Coords().for_each(acc, [&](int r, int c, int, float v) {                        \
    const int m = m0 + r, j = n0 + c;                                             \
    if (m >= M || j >= N) return;                                                 \
    const int tap = j / Cin;                                                      \
    const long long at = (long long)m * N + (j - tap * Cin) * KHW + tap;          \
    if (splits == 1) gw[at] = as<T>(v);                                           \
    else part[at] = v;                                                            \
  })

template <typename T, int BM, int BN>
__global__ void __launch_bounds__(256, 2) conv2d_bwdw_nhwc_kernel(BWDW_NHWC_PARAMS) {
  constexpr bool B16 = sizeof(T) == 2;
  using Cfg = MmaCfg<BM, BN, 32, 2, 4, 3>;  // conv2d.cu's backward-weight tiles
  using LayA = TileLayout<BM, 32, true, B16 ? 8 : 4, T>;
  using LayB = TileLayout<BN, 32, false, 8, T>;
  BWDW_NHWC_SETUP;
  const GyChunkLoader<LayA, Cfg::THREADS> la{{}, gy, M, m0, Ho * Wo};

  float acc[Cfg::MT][Cfg::NT][4];
  if constexpr (B16) mma16_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);
  else mma_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);

  BWDW_NHWC_STORE(MmaCoords<Cfg>);
}

// fp32 (FFMA): both tiles [k][mn], gy gathered by KL lanes along the pixels (conv2d.cu's
// loader: NCHW gy is not contiguous along the channels), x in chunks as above.
template <typename T, int BM, int BN>
__global__ void __launch_bounds__(256, 2) conv2d_bwdw_nhwc_fp32_kernel(BWDW_NHWC_PARAMS) {
  static_assert(sizeof(T) == 4, "float");
  constexpr int BK = 16;  // 3 stages: within 2% of BK 8 with 4 at 128 rows, 20% faster at 64
  using Cfg = SimtCfg<BM, BN, BK, 3>;
  using LayA = TileLayout<BM, BK, false, 4>;
  using LayB = TileLayout<BN, BK, false, 4>;
  BWDW_NHWC_SETUP;
  const GyLoader<LayA, Cfg::THREADS, BK> la{gy, M, m0, Ho * Wo};

  float acc[Cfg::TM][Cfg::TN];
  simt_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);

  BWDW_NHWC_STORE(SimtCoords<Cfg>);
}
