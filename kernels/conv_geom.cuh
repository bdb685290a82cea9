// conv_geom.cuh: the geometry of a convolution's forward / backward-data pass as an
// implicit GEMM, shared by conv2d.cu (mma.sync / FFMA main loops, NCHW gathers) and
// conv2d_wgmma.cu (wgmma, channels-last gathers). See conv2d.cu's header for the GEMM view.

#pragma once

struct ConvGeom {
  int Nb, M, C;        // batch; channels of out (GEMM rows); channels summed over
  int Hs, Ws, Ho, Wo;  // spatial size of src; of out
  int KH, KW, sh, sw, ph, pw;
  int mode;  // 0 forward, 1 backward-data, 2 backward-data by phases (one per grid z)
};

// Source pixel read by output pixel (oy, ox) through filter tap (kh, kw); false if none.
__device__ __forceinline__ bool conv_tap(const ConvGeom& g, int oy, int ox, int kh, int kw,
                                         int& iy, int& ix) {
  if (g.mode == 0) {
    iy = oy * g.sh - g.ph + kh;
    ix = ox * g.sw - g.pw + kw;
    return (unsigned)iy < (unsigned)g.Hs && (unsigned)ix < (unsigned)g.Ws;
  }
  const int ty = oy + g.ph - kh, tx = ox + g.pw - kw;
  if (ty < 0 || tx < 0) return false;
  if (g.sh == 1 && g.sw == 1) {  // no divisions: the loaders issue this per row and slab
    iy = ty;
    ix = tx;
    return iy < g.Hs && ix < g.Ws;
  }
  iy = ty / g.sh;
  ix = tx / g.sw;
  return iy * g.sh == ty && ix * g.sw == tx && iy < g.Hs && ix < g.Ws;
}

// A tile's phase: output pixels (ry + ps_h*i, rx + ps_w*j) and the taps (rkh + ps_h*t,
// rkw + ps_w*u) that reach them (nkh x nkw of them); every pixel and tap unless mode 2.
struct Phase {
  int ry, rx, rkh, rkw, ps_h, ps_w, nkh, nkw, Wq, hq, npix, K;
  __device__ __forceinline__ Phase(const ConvGeom& g, int z) {
    const bool phased = g.mode == 2;
    ps_h = phased ? g.sh : 1;
    ps_w = phased ? g.sw : 1;
    ry = z / ps_w;
    rx = z - ry * ps_w;
    rkh = phased ? (ry + g.ph) % g.sh : 0;
    rkw = phased ? (rx + g.pw) % g.sw : 0;
    nkh = rkh < g.KH ? (g.KH - rkh + ps_h - 1) / ps_h : 0;
    nkw = rkw < g.KW ? (g.KW - rkw + ps_w - 1) / ps_w : 0;
    Wq = (g.Wo - rx + ps_w - 1) / ps_w;
    hq = ((g.Ho - ry + ps_h - 1) / ps_h) * Wq;
    npix = g.Nb * hq;
    K = nkh * nkw * g.C;
  }
  // Filter tap (kh, kw) of the phase's tap t < nkh * nkw (taps in (kh, kw) order).
  __device__ __forceinline__ void tap(int t, int& kh, int& kw) const {
    const int th = t / nkw;
    kh = rkh + ps_h * th;
    kw = rkw + ps_w * (t - th * nkw);
  }
  // Image n and output pixel (oy, ox) of the phase's pixel q.
  __device__ __forceinline__ void pixel(int q, int& n, int& oy, int& ox) const {
    n = q / hq;
    const int p = q - n * hq, qy = p / Wq;
    oy = ry + ps_h * qy;
    ox = rx + ps_w * (p - qy * Wq);
  }
};
