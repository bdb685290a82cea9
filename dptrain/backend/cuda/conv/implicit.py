"""Planner of kernels/conv2d.cu: the implicit GEMMs that run everywhere (NCHW gathers;
mma.sync in TF32 and 16 bits, FFMA in fp32), and the backward-weight plan conv2d_nhwc.cu's
kernels share.

Forward and backward-data are one kernel (mode 0 / 1) after the weight is reordered into
the GEMM's (kh, kw, c) K order; the output-channel tile is the smallest of 32/64/128
covering the channels (under fp32 a 32- or 64-channel tile spans 256 pixels, else 128).
Backward-weight splits its long K (batch * output pixels) over grid z when the output tiles
leave SMs idle, and sums the splits in a fixed order: bitwise repeatable.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.conv.geometry import ConvGeom
from dptrain.backend.cuda.conv.layout import (chunk, cols_tile, rows_tile, tensor_cores,
                                              via_nchw, weight_reorder)
from dptrain.backend.cuda.gemm import output, reducer, split_k, tile_floats
from dptrain.backend.cuda.launch import i32
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.cuda.workspace import take

FILE = "conv2d.cu"
FN = ("conv2d_forward", "conv2d_backward_data")


def ffma_phased(mode, stride, taps: int, c: int, dt) -> bool:
    """Whether the FFMA kernel runs a backward-data pass by phases (mode 2): strided, a
    filter wider than 1x1, and c summed channels in whole 16-wide K slabs (a slab one tap).
    The other kernels zero-fill the taps that do not divide."""
    return (mode == 1 and tuple(stride) != (1, 1) and taps > 1 and c % 16 == 0
            and not tensor_cores(dt))


def kernel(m, npix, dt):
    """The implicit GEMM for m output channels: mma.sync (TF32, 16-bit) or FFMA.
    (name, kernel, grid, block, shared memory)"""
    bm = rows_tile(m)
    if dt in launch.HALVES:
        smem = 3 * 2 * (tile_floats(bm, 32, True, 8) + tile_floats(128, 32, False, 8))
        name, ctype, block = "conv2d_b16_kernel", launch.ctype(dt), (128,)
    elif runtime.precision == "tf32":
        smem = 3 * 4 * (tile_floats(bm, 32, True, 4) + tile_floats(128, 32, False, 8))
        name, ctype, block = "conv2d_tf32_kernel", "float", (128,)
    else:
        bn = 256 if bm < 128 else 128  # few channels: 256 pixels (9-20% faster, 6 of 7 shapes)
        smem = 3 * 4 * (tile_floats(bm, 16, False, 4) + tile_floats(bn, 16, False, 4))
        fn = launch.kernel(FILE, "conv2d_fp32_kernel", "float", str(bm),
                           *((str(bn),) if bn != 128 else ()), smem=smem)
        return "conv2d_fp32_kernel", fn, (-(-npix // bn), -(-m // bm)), (256,), smem
    fn = launch.kernel(FILE, name, ctype, str(bm), smem=smem)
    return name, fn, (-(-npix // 128), -(-m // bm)), block, smem


def plan(g: ConvGeom, mode: int):
    """Forward (mode 0) or backward-data (mode 1) of NCHW operands; channels-last ones
    through NCHW copies. run(w, src, bias, out, workspace) -> out."""
    fn_name, dt, nb = FN[mode], g.dtype, g.n
    m, c, (hs, ws), (ho, wo) = g.view(mode)
    npix, k = nb * ho * wo, g.taps * c
    out_shape = (nb, m, ho, wo)
    reorder = weight_reorder(mode, m, c, g.taps, dt)
    phased = ffma_phased(mode, g.stride, g.taps, c, dt)  # grid x fits phase (0, 0)
    phases = g.sh * g.sw if phased else 1
    first = nb * -(-ho // g.sh) * -(-wo // g.sw) if phased else npix
    name, fn, grid, block, smem = kernel(m, first, dt)
    grid = grid + (phases,)
    tail = g.gemm(mode) + (i32(k % chunk(dt) == 0), i32(2 if phased else mode))  # + vec_w

    def run(w, src, bias, out, workspace=None, stats=None):
        y = output(fn_name, out, out_shape, dt)
        wr = reorder(w)
        has_bias = bias is not None
        fn(grid, block, (wr, src, bias if has_bias else y, y, np.int32(has_bias)) + tail,
           shared_mem=smem)
        return y

    run.kernel = name
    run.phases = phases  # grid z: strided backward-data by phases, else 1
    run.stat_tiles = None
    run.tma_store = False
    if g.cl:
        return via_nchw(run, fn_name, {1: (nb, c, hs, ws)}, out_shape, dt)
    return run


def backward_weight_tiles(g: ConvGeom):
    """(tiles, grid, kernel parameters, reduce or None) of backward-weight's implicit GEMM:
    output channels by (c, kh, kw) columns (rows_tile, cols_tile), the pixels split over
    grid z where the tiles leave SMs idle; shared by conv2d.cu's and conv2d_nhwc.cu's
    kernels."""
    f, dt = "conv2d_backward_weight", g.dtype
    m, ncol, k = g.cout, g.rows, g.npix
    bm, bn = rows_tile(m), cols_tile(ncol)
    if -(-m // bm) > launch.GRID_YZ_MAX:
        raise ValueError(f"cuda.{f}: {m} output channels exceed the grid's limit")
    splits, kchunk = split_k(-(-m // bm) * -(-ncol // bn), k, 512, 1024)
    grid = (-(-ncol // bn), -(-m // bm), splits)
    # BWDW_PARAMS after (x, gy, gw, ws): Nb Cout Cin H W Ho Wo KH KW sh sw ph pw splits kchunk.
    tail = tuple(i32(v) for v in (g.n, g.cout, g.c, g.h, g.w, g.ho, g.wo, g.kh, g.kw, g.sh,
                                  g.sw, g.ph, g.pw, splits, kchunk))
    reduce = reducer(FILE, splits, 1, m, ncol, ncol, 0, 0, dt) if splits > 1 else None
    return (bm, bn), grid, tail, reduce


def backward_weight_run(g: ConvGeom, name, fn, grid, tail, reduce, smem, x_copy=None):
    """run(x, gy, out, workspace) of a backward-weight kernel; x_copy(x): the source it
    reads instead of x (its channels-last copy, taken from the workspace where kept)."""
    f, dt, w_shape = "conv2d_backward_weight", g.dtype, g.w_shape
    m, ncol = g.cout, g.rows

    def run(x, gy, out, workspace=None):
        gw = output(f, out, w_shape, dt)
        ws = launch.new((grid[2], m, ncol), np.float32) if reduce else gw
        src = take(workspace, "x", x, x_copy) if x_copy else x
        fn(grid, (256,), (src, gy, gw, ws) + tail, shared_mem=smem)
        if reduce:
            reduce(ws, gw, gw)
        return gw

    run.kernel = name
    return run


def backward_weight(g: ConvGeom):
    """conv2d.cu's backward-weight of NCHW x and gy."""
    dt = g.dtype
    (bm, bn), grid, tail, reduce = backward_weight_tiles(g)
    slab = ()  # the K slab's width where a kernel takes it
    if dt in launch.HALVES:
        smem = 3 * 2 * (tile_floats(bm, 32, True, 8) + tile_floats(bn, 32, True, 8))
        name = "conv2d_bwdw_b16_kernel"
    elif runtime.precision == "tf32":
        smem = 3 * 4 * (tile_floats(bm, 32, True, 4) + tile_floats(bn, 32, True, 4))
        name = "conv2d_bwdw_tf32_kernel"
    else:
        # 16-wide K slabs with 32- or 64-row tiles, 8-wide with 128 (measured: the kernel)
        bk = 16 if bm < 128 else 8
        smem = (3 if bk == 16 else 4) * 4 * (tile_floats(bm, bk, False, 4)
                                            + tile_floats(bn, bk, False, 4))
        name, slab = "conv2d_bwdw_fp32_kernel", (("16",) if bk == 16 else ())
    fn = launch.kernel(FILE, name, launch.ctype(dt), str(bm), str(bn), *slab, smem=smem)
    return backward_weight_run(g, name, fn, grid, tail, reduce, smem)
