// conv2d.cu: 2D convolution forward, backward-data and backward-weight as implicit GEMMs on
// the tiles of gemm_tiles.cuh, fp32 (FFMA) or TF32 (tensor cores, fp32 accumulate) on float,
// f16 tensor cores (fp32 accumulate) on __half.
// Launchers: dptrain/backend/cuda/conv/implicit.py.
//
// Conventions
//  * NCHW activations, weight (C_out, C_in, KH, KW), PyTorch's cross-correlation; any stride
//    and zero padding per axis. All outputs are written with `=`; nothing is read first.
//  * No im2col buffer: the loaders gather each operand element straight from the tensors
//    while filling the shared-memory slab (4-byte cp.async, zero-fill outside the image; a
//    thread's own load and store for __half elements).
//  * Forward and backward-data are one kernel (`mode` 0 / 1):
//      out[n, m, p] = sum_{kh, kw, c} wgt(m, c, kh, kw) * src[n, c, tap(p, kh, kw)] (+ bias[m])
//    forward:   m = c_out, c = c_in,  src = x,  tap: iy = oy*sh - ph + kh
//    bwd-data:  m = c_in,  c = c_out, src = gy, tap: oy = (iy + ph - kh) / sh, when exact
//    GEMM view: M = channels of out, N = batch * out pixels, K = KH*KW*C ordered (kh, kw, c),
//    so when C % BK == 0 a K slab is one filter tap and BK consecutive channels: the gather
//    then costs one bounds check per slab and a pointer step per element.
//    Strided backward-data in fp32 may run by phases (`mode` 2, conv_geom.cuh's Phase): grid
//    z = (ry, rx), the output pixels (ry + sh*i, rx + sw*j) and only the taps that reach
//    them, as conv2d_wgmma.cu does; the other kernels visit every tap and zero-fill those
//    that do not divide.
//    The launcher first copies the weight into that K order, wr[m][(kh*KW + kw)*C + c] (a
//    small M x K matrix, by tiled transposes: transpose.cu), so the GEMM reads it as a dense,
//    K-major operand with 16-byte copies (gathering it in place was the slowest part).
//  * Backward-weight: gw[co, j] with j = (ci, kh, kw), the weight's own layout, =
//      sum over p = (n, oy, ox) of gy[n, co, oy, ox] * x[n, ci, oy*sh - ph + kh, ox*sw - pw + kw]
//    GEMM view: M = C_out, N = C_in*KH*KW, K = N_batch*Ho*Wo. K is long and M*N small, so K
//    is split over grid z; split s writes its partial to ws[s] and splitk_reduce_kernel sums
//    the splits in order: deterministic, no atomics. Partials are float for every type.
//  * Index arithmetic is int within one image and long long across the batch; the launcher
//    asserts every tensor has fewer than 2^31 elements.
//
// instantiations-per-module: 1  (a run builds only those it uses: a shorter cold start)
// instantiate: conv2d_tf32_kernel<float, {32, 64, 128}>
// instantiate: conv2d_fp32_kernel<float, {32, 64, 128}>; conv2d_fp32_kernel<float, {32, 64}, 256>
// instantiate: conv2d_bwdw_fp32_kernel<float, {32, 64}, {32, 128, 96}, 16>; conv2d_bwdw_fp32_kernel<float, {32, 64, 128}, {32, 128, 96}>
// instantiate: conv2d_bwdw_tf32_kernel<float, {32, 64, 128}, {32, 128, 96}>
// instantiate: splitk_reduce_kernel<float>; splitk_reduce_kernel<{__half, __nv_bfloat16}, float>
// instantiate: splitk_reduce_warp_kernel<float>; splitk_reduce_warp_kernel<{__nv_bfloat16, __half}, float>
// instantiate: conv2d_b16_kernel<{__half, __nv_bfloat16}, {32, 64, 128}>
// instantiate: conv2d_bwdw_b16_kernel<{__half, __nv_bfloat16}, {32, 64, 128}, {32, 128, 96}>

#include "conv_geom.cuh"
#include "conv_gather.cuh"

// ----------------------------------------------------------------------------- forward / bwd-data

// B operand: src[n, c, tap(p, kh, kw)] for GEMM column p = (n, oy, ox) of the block's phase
// (every pixel and tap but in mode 2). Lanes run along p, so a warp reads neighbouring
// pixels; each thread keeps its one column's (n, oy, ox).
template <class L, int THREADS>
struct ConvSrcLoader {
  using Layout = L;
  using E = typename L::Elem;
  const E* src;
  ConvGeom g;
  Phase phase;
  bool fast, pok;
  int col, oy, ox;
  long long nbase;

  __device__ __forceinline__ ConvSrcLoader(const E* src_, const ConvGeom& g_, const Phase& f_,
                                           int n0, bool fast_)
      : src(src_), g(g_), phase(f_), fast(fast_) {
    col = threadIdx.x % L::kBMN;
    const int p = n0 + col;
    pok = p < phase.npix;
    int n = 0;
    oy = ox = 0;
    if (pok) phase.pixel(p, n, oy, ox);
    nbase = (long long)n * g.C * g.Hs * g.Ws;
  }

  static constexpr int ROWS = THREADS / L::kBMN, PER = L::kBK / ROWS;  // PER: elements/thread
  static_assert(THREADS % L::kBMN == 0 && L::kBK % ROWS == 0, "bad source tile");

  // f(i, src, ok) for this thread's PER elements of the slab at k0 (tile row r0 + i*ROWS).
  template <class F>
  __device__ __forceinline__ void gather(int k0, int k_end, F&& f) const {
    const int r0 = threadIdx.x / L::kBMN, hws = g.Hs * g.Ws;
    if (fast) {
      const int t = k0 / g.C, c0 = k0 - t * g.C;
      int kh, kw, iy = 0, ix = 0;
      phase.tap(t, kh, kw);
      const bool ok = pok && conv_tap(g, oy, ox, kh, kw, iy, ix);
      const E* base = ok ? src + nbase + (long long)(c0 + r0) * hws + iy * g.Ws + ix : src;
      const int step = ok ? ROWS * hws : 0;
#pragma unroll
      for (int i = 0; i < PER; ++i) f(i, base + (long long)i * step, ok);
      return;
    }
    auto one = [&](int i) {
      const int k = k0 + r0 + i * ROWS;
      bool ok = pok && k < k_end;
      const E* p = src;
      if (ok) {
        const int t = k / g.C, c = k - t * g.C;
        int kh, kw, iy, ix;
        phase.tap(t, kh, kw);
        ok = conv_tap(g, oy, ox, kh, kw, iy, ix);
        if (ok) p = src + nbase + (long long)c * hws + iy * g.Ws + ix;
      }
      f(i, p, ok);
    };
#pragma unroll 1
    for (int i = 0; i < PER; ++i) one(i);
  }

  __device__ __forceinline__ int slot(int i) const {
    return L::off(col, threadIdx.x / L::kBMN + i * ROWS);
  }

  __device__ __forceinline__ void load(E* s, int k0, int k_end) const {
    gather(k0, k_end, [&](int i, const E* p, bool ok) { put_elem(s + slot(i), p, ok); });
  }

  // mma16_mainloop's staged interface. Here the stores follow the loads at once: holding
  // the slab's PER elements in registers across the math made the forward and backward-data
  // kernels 28-38% slower (register pressure), while the backward-weight gathers gain 40%.
  struct Regs {};
  __device__ __forceinline__ void fetch(Regs&, E* s, int k0, int k_end) const { load(s, k0, k_end); }
  __device__ __forceinline__ void put(E*, const Regs&) const {}
};

// out[n, m, p] for GEMM column q, the phase's pixel (n, oy, ox).
template <typename T>
struct ConvOut {
  T* out;
  const T* bias;
  int has_bias, M, hw, Wo;
  Phase f;
  __device__ __forceinline__ long long col_offset(int q) const {  // -1: past the end
    if (q >= f.npix) return -1;
    int n, oy, ox;
    f.pixel(q, n, oy, ox);
    return (long long)n * M * hw + oy * Wo + ox;
  }
  __device__ __forceinline__ void store(int m, long long coff, float v) const {
    if (m >= M || coff < 0) return;
    if (has_bias) v += as<float>(bias[m]);
    out[coff + (long long)m * hw] = as<T>(v);
  }
};

// The weight operand of a phase: slab k0 of the phase's K is channels c0.. of its tap t, at
// (kh*KW + kw)*C + c0 of wr's whole K. Every pixel and tap (modes 0 and 1): the same k. In
// mode 2 a slab must not straddle two taps (the launcher asks C % BK == 0).
template <class D>
struct PhaseWeights {
  using Layout = typename D::Layout;
  using E = typename D::E;
  D rows;
  Phase f;
  int C, KW;
  __device__ __forceinline__ void load(E* s, int k0, int k_end) const {
    const int t = k0 / C, c0 = k0 - t * C;
    int kh, kw;
    f.tap(t, kh, kw);
    const int k = (kh * KW + kw) * C + c0;
    rows.load(s, k, k + min(Layout::kBK, k_end - k0));
  }
};

#define CONV_PARAMS                                                                          \
  const T *__restrict__ wr, const T *__restrict__ src, const T *__restrict__ bias,            \
      T *__restrict__ out, int has_bias, int Nb, int M, int C, int Hs, int Ws, int Ho, int Wo, \
      int KH, int KW, int sh, int sw, int ph, int pw, int vec_w, int mode

#define CONV_SETUP                                                                            \
  const ConvGeom g{Nb, M, C, Hs, Ws, Ho, Wo, KH, KW, sh, sw, ph, pw, mode};                   \
  const Phase f(g, blockIdx.z);                                                               \
  const int K = f.K, n0 = blockIdx.x * Cfg::BN, m0 = blockIdx.y * Cfg::BM;                    \
  if (n0 >= f.npix) return; /* past this phase's pixels (the grid fits phase 0) */            \
  const bool fast = C % Cfg::BK == 0;                                                         \
  const DenseLoader<LayA, true, Cfg::THREADS> wrows{wr, KH * KW * C, m0, M, vec_w != 0};    \
  const ConvSrcLoader<LayB, Cfg::THREADS> lb(src, g, f, n0, fast);                            \
  const ConvOut<T> epi{out, bias, has_bias, M, Ho * Wo, Wo, f};                               \
  extern __shared__ float4 smem4[];                                                           \
  T* smem = reinterpret_cast<T*>(smem4);                                                      \
  check_smem(Cfg::STAGES * (LayA::kSize + LayB::kSize) * sizeof(T))

// The epilogue: each column's output offset once per thread, then every accumulator.
#define CONV_STORE(Coords)                                                                    \
  const Coords at;                                                                            \
  long long coff[Coords::COLS];                                                               \
  at.cols([&](int c, int slot) { coff[slot] = epi.col_offset(n0 + c); });                     \
  at.for_each(acc, [&](int r, int, int slot, float v) { epi.store(m0 + r, coff[slot], v); })

template <typename T, int BM>
__global__ void __launch_bounds__(128, 2) conv2d_tf32_kernel(CONV_PARAMS) {
  static_assert(sizeof(T) == 4, "float only for now");
  using Cfg = MmaCfg<BM, 128, 32, 2, 2, 3>;     // 4 warps of (BM/2) x 64
  using LayA = TileLayout<BM, 32, true, 4>;     // wr rows: 16-byte copies, ldmatrix reads
  using LayB = TileLayout<128, 32, false, 8>;   // [k][p]: lanes along p store contiguously
  CONV_SETUP;

  float acc[Cfg::MT][Cfg::NT][4];
  mma_mainloop<Cfg>(acc, wrows, lb, smem, 0, K);

  CONV_STORE(MmaCoords<Cfg>);
}

template <typename T, int BM>
__global__ void __launch_bounds__(128, 2) conv2d_b16_kernel(CONV_PARAMS) {
  static_assert(sizeof(T) == 2, "16-bit operands");
  using Cfg = MmaCfg<BM, 128, 32, 2, 2, 3>;       // the TF32 kernel's tiles on __half
  using LayA = TileLayout<BM, 32, true, 8, T>;     // wr rows: 16-byte copies, ldmatrix reads
  using LayB = TileLayout<128, 32, false, 8, T>;   // [k][p]: ldmatrix.trans reads
  CONV_SETUP;

  float acc[Cfg::MT][Cfg::NT][4];
  mma16_mainloop<Cfg>(acc, wrows, lb, smem, 0, K);

  CONV_STORE(MmaCoords<Cfg>);
}

// BK 16, 3 stages: 4-19% faster than BK 8, 4 stages. BN 256 for few channels (BM 32 or 64):
// threads as 8 x 32 keep 4 x 8 or 8 x 8 outputs each, as many as a 128 x 128 tile's.
template <typename T, int BM, int BN = 128>
__global__ void __launch_bounds__(256, 2) conv2d_fp32_kernel(CONV_PARAMS) {
  static_assert(sizeof(T) == 4, "float only for now");
  using Cfg = SimtCfg<BM, BN, 16, 3, BN == 256 ? 32 : 16>;
  using LayA = TileLayout<BM, 16, false, 4>;  // wr transposed to [k][m] by 4-byte copies
  using LayB = TileLayout<BN, 16, false, 4>;
  CONV_SETUP;

  const PhaseWeights<decltype(wrows)> la{wrows, f, C, KW};  // by phases in mode 2

  float acc[Cfg::TM][Cfg::TN];
  simt_mainloop<Cfg>(acc, la, lb, smem, 0, K);

  CONV_STORE(SimtCoords<Cfg>);
}

// ----------------------------------------------------------------------------- backward-weight

// Filter column j = (ci, kh, kw) of the im2col matrix: offset of its pixel within one image
// relative to (iy0, ix0), and (kh, kw) for the bounds check. Built once per block.
struct ColInfo {
  int off, kh, kw, valid;
};

// B operand: x[n, ci, oy*sh - ph + kh, ox*sw - pw + kw] as (k = q, n = j). KL lanes along q.
template <class L, int THREADS, int KL>
struct XColLoader : KLaneLoader<XColLoader<L, THREADS, KL>, L, THREADS, KL> {
  using Base = KLaneLoader<XColLoader, L, THREADS, KL>;
  using E = typename Base::E;
  const E* x;
  const ColInfo* cols;  // shared memory, one entry per tile column
  int C, H, W, Ho, Wo, sh, sw, ph, pw;

  __device__ __forceinline__ XColLoader(const E* x_, const ColInfo* cols_, int C_, int H_,
                                        int W_, int Ho_, int Wo_, int sh_, int sw_, int ph_,
                                        int pw_)
      : x(x_), cols(cols_), C(C_), H(H_), W(W_), Ho(Ho_), Wo(Wo_), sh(sh_), sw(sw_), ph(ph_),
        pw(pw_) {}

  template <bool UNROLL, class F>
  __device__ __forceinline__ void gather(int k0, int k_end, F&& f) const {
    const int kk = threadIdx.x % KL, r0 = threadIdx.x / KL;
    const int q = k0 + kk, hw = Ho * Wo;
    const bool qok = q < k_end;
    const int n = qok ? q / hw : 0, p = qok ? q - n * hw : 0;
    const int oy = p / Wo, ox = p - oy * Wo;
    const int iy0 = oy * sh - ph, ix0 = ox * sw - pw;
    const long long base = (long long)n * C * H * W + iy0 * W + ix0;
    Base::template each<UNROLL>([&](int i) {
      const ColInfo t = cols[r0 + i * Base::RSTEP];
      const bool ok = qok && t.valid && (unsigned)(iy0 + t.kh) < (unsigned)H &&
                      (unsigned)(ix0 + t.kw) < (unsigned)W;
      f(i, ok ? x + (base + t.off) : x, ok);
    });
  }
};

#define BWDW_PARAMS                                                                            \
  const T *__restrict__ x, const T *__restrict__ gy, T *__restrict__ gw, float *__restrict__ ws, \
      int Nb, int Cout, int Cin, int H, int W, int Ho, int Wo, int KH, int KW, int sh, int sw, \
      int ph, int pw, int splits, int kchunk

// Column table, loaders and this split's K range and destination.
#define BWDW_SETUP(KL)                                                                        \
  const int M = Cout, N = Cin * KH * KW, K = Nb * Ho * Wo;                                    \
  const int m0 = blockIdx.y * Cfg::BM, n0 = blockIdx.x * Cfg::BN, s = blockIdx.z;             \
  const int k_begin = s * kchunk, k_end = min(K, k_begin + kchunk);                           \
  __shared__ ColInfo cols[Cfg::BN];                                                           \
  for (int j = threadIdx.x; j < Cfg::BN; j += Cfg::THREADS) {                                 \
    const int gj = n0 + j, khw = KH * KW;                                                     \
    const int ci = gj / khw, r = gj - ci * khw, kh = r / KW, kw = r - kh * KW;                \
    cols[j] = ColInfo{ci * H * W + kh * W + kw, kh, kw, gj < N};                              \
  }                                                                                           \
  __syncthreads();                                                                            \
  const GyLoader<LayA, Cfg::THREADS, KL> la{gy, M, m0, Ho * Wo};                              \
  const XColLoader<LayB, Cfg::THREADS, KL> lb{x, cols, Cin, H, W, Ho, Wo, sh, sw, ph, pw};    \
  float* part = ws + (long long)s * M * N;                                                    \
  extern __shared__ float4 smem4[];                                                           \
  T* smem = reinterpret_cast<T*>(smem4);                                                      \
  check_smem(Cfg::STAGES * (LayA::kSize + LayB::kSize) * sizeof(T))

// The epilogue: `=` into gw, or into this split's (float) slice of the workspace.
#define BWDW_STORE(Coords)                                                \
  Coords().for_each(acc, [&](int r, int c, int, float v) {                \
    const int m = m0 + r, n = n0 + c;                                     \
    if (m >= M || n >= N) return;                                         \
    if (splits == 1) gw[(long long)m * N + n] = as<T>(v);                 \
    else part[(long long)m * N + n] = v;                                  \
  })

template <typename T, int BM, int BN>
__global__ void __launch_bounds__(256, 2) conv2d_bwdw_tf32_kernel(BWDW_PARAMS) {
  static_assert(sizeof(T) == 4, "float only for now");
  using Cfg = MmaCfg<BM, BN, 32, 2, 4, 3>;
  using LayA = TileLayout<BM, 32, true, 4>;  // [m][k] and [j][k]: lanes along k store contiguously
  using LayB = TileLayout<BN, 32, true, 4>;
  BWDW_SETUP(32);

  float acc[Cfg::MT][Cfg::NT][4];
  mma_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);

  BWDW_STORE(MmaCoords<Cfg>);
}

template <typename T, int BM, int BN>
__global__ void __launch_bounds__(256, 2) conv2d_bwdw_b16_kernel(BWDW_PARAMS) {
  static_assert(sizeof(T) == 2, "16-bit operands");
  using Cfg = MmaCfg<BM, BN, 32, 2, 4, 3>;
  using LayA = TileLayout<BM, 32, true, 8, T>;  // [m][k] and [j][k]: ldmatrix reads
  using LayB = TileLayout<BN, 32, true, 8, T>;
  BWDW_SETUP(32);

  float acc[Cfg::MT][Cfg::NT][4];
  mma16_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);

  BWDW_STORE(MmaCoords<Cfg>);
}

// BK 16 (3 stages) or 8 (4 stages): 16 measured 12% faster with 64-row tiles (both shapes
// tried) and up to 6% slower with 128 (7 of 10 shapes; likely its 16 lanes along k storing
// with 2-way bank conflicts, not profiled).
template <typename T, int BM, int BN, int BK = 8>
__global__ void __launch_bounds__(256, 2) conv2d_bwdw_fp32_kernel(BWDW_PARAMS) {
  static_assert(sizeof(T) == 4, "float only for now");
  using Cfg = SimtCfg<BM, BN, BK, BK == 8 ? 4 : 3>;
  using LayA = TileLayout<BM, BK, false, 4>;  // [k][m]: 8 lanes along k x 4 rows, no conflicts
  using LayB = TileLayout<BN, BK, false, 4>;
  BWDW_SETUP(BK);

  float acc[Cfg::TM][Cfg::TN];
  simt_mainloop<Cfg>(acc, la, lb, smem, k_begin, k_end);

  BWDW_STORE(SimtCoords<Cfg>);
}
