"""Planner of kernels/conv2d_strip.cu: the channels-last 16-bit forward and backward-weight
of a convolution whose input pixels are one 16-byte chunk each (ResNet's ImageNet stem over
column pairs: 8 channels, 7 x 4 taps, stride 2 down and 1 along the rows). A tile is an
output row; its input rows come in as one TMA box, and wgmma reads the im2col matrix
straight from it (the .cu file's header). The forward keeps the block's weights in shared
memory; backward-weight keeps the whole weight gradient in registers over a block's tiles,
the blocks' float partials summed in order by conv2d_bwdw_wgmma.cu's reducer.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch, tma
from dptrain.backend.cuda.conv.bwdw_wgmma import reducer
from dptrain.backend.cuda.conv.geometry import ConvGeom, nhwc_shape
from dptrain.backend.cuda.conv.layout import weight_reorder
from dptrain.backend.cuda.gemm import output, wgmma_available
from dptrain.backend.cuda.launch import i32

FILE, KERNEL = "conv2d_strip.cu", "conv2d_strip_kernel"
BM, BN, RING, BLOCKS_PER_SM = 128, 64, 2, 3  # the .cu file's; blocks its launch bounds fit
BWDW_RING, BWDW_BLOCKS_PER_SM, GY_BYTES = 3, 2, 16384  # backward-weight's
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
    if -(-g.cout // BN) > launch.GRID_YZ_MAX or g.npix > launch.INT32_MAX:
        return "past the grid's limits or 32-bit pixel indices"
    return None


def refuses_backward_weight(g: ConvGeom):
    """Why conv2d_strip_bwdw_kernel cannot take this backward-weight, or None: the forward's
    conditions, gy on 16 bytes, and at most 64 output channels in whole 16-byte chunks (one
    m64 row of accumulators; gy's rows as TMA boxes)."""
    why = refuses(g)
    if why:
        return why
    if not g.gy16 or g.cout > BN or g.cout % 8:
        return f"gy not on 16 bytes, or {g.cout} output channels not 8, 16, .. {BN}"
    return None


def strip_bytes(kh: int, kw: int) -> int:
    """Bytes of a strip (the .cu file's strip_bytes): kh rows of BM + kw - 1 16-byte pixels,
    1024-aligned."""
    return -(-kh * (BM + kw - 1) * 16 // 1024) * 1024


def smem(kh: int, kw: int, c: int) -> int:
    """The forward's dynamic shared memory: the weights' 64-K slabs of 64 rows (8 KB each),
    RING strips, + slack to align."""
    return -(-kh * kw * c // 64) * 8192 + RING * strip_bytes(kh, kw) + 1024


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
        args = (reorder(w), bias if has_bias else y, y, i32(has_bias),
                launch.NULL if stats is None else stats)
        fn(grid, (128,), (strips,) + g.gemm(0) + args, shared_mem=shared)
        return y

    run.kernel = KERNEL
    run.stat_tiles = tiles
    run.stat_rows = g.wo
    return run


def plan_backward_weight(g: ConvGeom):
    """run(x, gy, out, workspace=None) -> gw (C_out, C_in, KH, KW): each of up to
    BWDW_BLOCKS_PER_SM blocks an SM sums its output rows' share (a split), and the reducer
    adds the splits' float partials in order."""
    f, dt, m = "conv2d_backward_weight", g.dtype, g.cout
    launch.check_int32(f, g.x_size, g.y_size)
    shared = BWDW_RING * (strip_bytes(g.kh, g.kw) + GY_BYTES) + 1024
    fn = launch.kernel(FILE, "conv2d_strip_bwdw_kernel", launch.ctype(dt), str(g.kh), str(g.kw),
                       smem=shared)
    tiles = g.n * g.ho
    splits = max(1, min(tiles, BWDW_BLOCKS_PER_SM * launch.sm_count()))
    reduce = reducer(splits, m, g.c, g.taps, dt)
    x_shape, w_shape = nhwc_shape(g.x_shape), g.w_shape

    def run(x, gy, out, workspace=None, add_to=None):
        ws = launch.new((splits, g.rows, m), np.float32)
        strips = tma.strips(x, x_shape, BM + g.kw - 1, g.kh)
        grads = tma.pixel_rows(gy, tiles, g.wo, m)
        fn((splits,), (128,), (strips,) + g.gemm(0) + (grads, ws), shared_mem=shared)
        if add_to is not None:
            return reduce(ws, None, add_to)
        return reduce(ws, output(f, out, w_shape, dt))

    run.kernel, run.splits = "conv2d_strip_bwdw_kernel", splits
    run.adds = True  # takes add_to= (the reducer adds)
    return run
