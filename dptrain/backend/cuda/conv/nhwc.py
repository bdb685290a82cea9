"""Planner of kernels/conv2d_nhwc.cu: backward-weight whose im2col gathers of x are 16-byte
cp.async chunks of its channels-last copy (1.3-1.8x faster than conv2d.cu's NCHW gathers at
the reference CNN's shapes, the copy included), on the tiles and splits of conv2d.cu's plan
(implicit.backward_weight_tiles).

On tensor cores it needs C_in and Ho*Wo in whole 16-byte chunks (8 for 16-bit types, 4 for
float under TF32) and gy 16-byte aligned. Its FFMA kernel takes filters wider than 1x1 with
C_in in whole chunks (gy gathered element by element, so Ho*Wo and gy's alignment do not
matter); only they gain from the x copy (3x3: 4-20% faster at 8 of 9 ResNet-18 and CNN
shapes; 1x1 stride 2: 5-40% slower).
"""
from __future__ import annotations

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.conv import implicit
from dptrain.backend.cuda.conv.geometry import ConvGeom
from dptrain.backend.cuda.conv.layout import chunk, chunks_fit, tensor_cores, to_nhwc
from dptrain.backend.cuda.gemm import tile_floats

FILE = "conv2d_nhwc.cu"


def refuses(g: ConvGeom):
    """Why conv2d_nhwc.cu's kernels cannot take this backward-weight pass, or None."""
    dt = g.dtype
    if g.cl:
        return "channels-last operands: planned through NCHW copies"
    if not chunks_fit(dt, g.c, g.n):
        return f"{g.c} input channels not in whole 16-byte chunks (or past the copy's grid)"
    if tensor_cores(dt):
        if (g.ho * g.wo) % chunk(dt):
            return f"Ho*Wo = {g.ho * g.wo} not in whole 16-byte chunks"
        if not g.gy16:
            return "gy not 16-byte aligned"
    elif g.taps == 1:
        return "a 1x1 filter under FFMA (the x copy does not pay)"
    return None


def backward_weight(g: ConvGeom):
    dt = g.dtype
    (bm, bn), grid, tail, reduce = implicit.backward_weight_tiles(g)
    if tensor_cores(dt):
        pad = 8 if dt in launch.HALVES else 4
        smem = 3 * dt.itemsize * (tile_floats(bm, 32, True, pad) + tile_floats(bn, 32, False, 8))
        name = "conv2d_bwdw_nhwc_kernel"
    else:  # 16-wide K slabs, 3 stages (8-wide, 4: within 2% at 128 rows, 20% slower at 64)
        smem = 3 * 4 * (tile_floats(bm, 16, False, 4) + tile_floats(bn, 16, False, 4))
        name = "conv2d_bwdw_nhwc_fp32_kernel"
    fn = launch.kernel(FILE, name, launch.ctype(dt), str(bm), str(bn), smem=smem)
    return implicit.backward_weight_run(g, name, fn, grid, tail, reduce, smem,
                                        to_nhwc(g.x_shape, dt))
