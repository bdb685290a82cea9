"""Planner of kernels/conv2d_strip.cu: the channels-last 16-bit forward of a convolution whose
input pixels are one 16-byte chunk each (ResNet's ImageNet stem over column pairs: 8
channels, 7 x 4 taps, stride 2 down and 1 along the rows). A tile is an output row; its
input rows come in as one TMA box, and wgmma reads the im2col matrix straight from it (the
.cu file's header), with the block's weights resident in shared memory.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch, tma
from dptrain.backend.cuda.conv.geometry import ConvGeom, nhwc_shape
from dptrain.backend.cuda.conv.layout import weight_reorder
from dptrain.backend.cuda.gemm import output, wgmma_available
from dptrain.backend.cuda.launch import i32

FILE, KERNEL = "conv2d_strip.cu", "conv2d_strip_kernel"
BM, BN, RING, BLOCKS_PER_SM = 128, 64, 2, 3  # the .cu file's; blocks its launch bounds fit
BOX_MAX = 256  # a TMA box's extent in each dimension
FILTERS = ((7, 4),)  # (KH, KW) instantiated (the .cu file's template arguments): the stem's


def refuses(g: ConvGeom):
    """Why conv2d_strip.cu cannot compute this forward, or None."""
    if not wgmma_available():
        return "no wgmma (not a compute capability 9.0 GPU)"
    if np.dtype(g.dtype) not in launch.HALVES or not g.cl or not g.x16:
        return "not a 16-bit channels-last x on 16 bytes"
    if g.c * np.dtype(g.dtype).itemsize != 16:
        return f"{g.c} channels are not one 16-byte chunk a pixel"
    if g.sw != 1:
        return "a stride along the rows"
    if (g.kh, g.kw) not in FILTERS:
        return (f"a {g.kh}x{g.kw} filter (instantiated: "
                f"{', '.join(f'{h}x{w}' for h, w in FILTERS)})")
    if g.wo > BM or BM + g.kw - 1 > BOX_MAX or g.kh > BOX_MAX:
        return f"output rows over {BM} pixels or a strip past a TMA box"
    if -(-g.cout // BN) > launch.GRID_YZ_MAX:
        return "past the grid's limits"
    return None


def smem(kh: int, kw: int, c: int) -> int:
    """The kernel's dynamic shared memory: the weights' 64-K slabs of 64 rows (8 KB each),
    RING strips (strip_bytes), + slack to align."""
    strip = -(-kh * (BM + kw - 1) * 16 // 1024) * 1024
    return -(-kh * kw * c // 64) * 8192 + RING * strip + 1024


def plan(g: ConvGeom):
    """run(w, x, bias, out, workspace=None, stats=None) -> y (N, Ho, Wo, C_out); `stats`
    ((N * Ho, 3, C_out) floats) takes each output row's batch statistics (run.stat_tiles
    tiles of run.stat_rows pixels)."""
    dt, m = g.dtype, g.cout
    out_shape = nhwc_shape(g.y_shape)
    reorder = weight_reorder(0, m, g.c, g.taps, dt)
    shared = smem(g.kh, g.kw, g.c)
    fn = launch.kernel(FILE, KERNEL, launch.ctype(dt), str(g.kh), str(g.kw), smem=shared)
    tiles = g.n * g.ho
    grid = (min(tiles, BLOCKS_PER_SM * launch.sm_count()), -(-m // BN))
    x_shape = nhwc_shape(g.x_shape)

    def run(w, x, bias, out, workspace=None, stats=None):
        y = output("conv2d_forward", out, out_shape, dt)
        strips = tma.strips(x, x_shape, BM + g.kw - 1, g.kh)
        has_bias = bias is not None
        fn(grid, (128,), (strips, reorder(w), bias if has_bias else y, y, i32(has_bias))
           + g.gemm(0) + (launch.NULL if stats is None else stats,), shared_mem=shared)
        return y

    run.kernel = KERNEL
    run.stat_tiles = tiles
    run.stat_rows = g.wo
    return run
