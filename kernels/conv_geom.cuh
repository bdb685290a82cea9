// conv_geom.cuh: the geometry of a convolution's forward / backward-data pass as an
// implicit GEMM, shared by conv2d.cu (mma.sync / FFMA main loops, NCHW gathers) and
// conv2d_wgmma.cu (wgmma, channels-last gathers). See conv2d.cu's header for the GEMM view.

#pragma once

struct ConvGeom {
  int Nb, M, C;        // batch; channels of out (GEMM rows); channels summed over
  int Hs, Ws, Ho, Wo;  // spatial size of src; of out
  int KH, KW, sh, sw, ph, pw;
  int mode;  // 0 forward, 1 backward-data, 2 backward-data by phases (conv2d_wgmma.cu)
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
