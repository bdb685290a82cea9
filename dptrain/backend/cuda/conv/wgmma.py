"""Planner of kernels/conv2d_wgmma.cu: forward and backward-data on Hopper's wgmma, the
source gathered channels-last in 16-byte chunks (an NCHW source is copied to NHWC first, and
the copy kept for backward-weight), 32 / 64 / 128 output channels by 128 pixels a block.

Where the summed channels fill whole 128-byte slabs and one box of base pixels serves every
phase (tma_box), the warp-specialized conv2d_wgmma_tma_kernel loads the slabs with the
tensor memory accelerator instead (bitwise equal to conv2d_wgmma_kernel): ResNet-18's step
12.29 -> 10.90 ms in bf16, 23.8 -> 22.1 in TF32; the reference CNN's 0.63 -> 0.60 and
0.95 -> 0.89 (H100, 2026-11-25). Its 16-bit tiles of 64 channels run turned around (weights
as wgmma's A, one m64n128 a step where two m64n64 read the weights twice; the .cu file's
TURN): ResNet-18's 64-channel forward and backward-data 5% faster (H200, the same bits), so
the kernel is no longer instantiated unturned there. Its epilogue sums a 16-bit forward's
batch statistics (epilogue_stats).

The gathering kernel against conv2d.cu's mma.sync kernels: the reference CNN's captured
step 6-8% faster (H200, 2026-11-24, TF32 and bf16, batch 256 and 1024).
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch, tma
from dptrain.backend.cuda.conv import bwdw_wgmma, routes
from dptrain.backend.cuda.conv.geometry import ConvGeom, nhwc_shape, tma_box, tma_slower
from dptrain.backend.cuda.conv.layout import (channels_last, rows_tile, to_nhwc,
                                              weight_reorder)
from dptrain.backend.cuda.gemm import output, wgmma_available, wgmma_smem
from dptrain.backend.cuda.launch import i32
from dptrain.backend.cuda.norm import TILE_PIXELS
from dptrain.backend.cuda.workspace import keep

FILE = "conv2d_wgmma.cu"
FN = ("conv2d_forward", "conv2d_backward_data")


def refuses(g: ConvGeom, mode: int):
    """Why conv2d_wgmma.cu cannot compute this forward (mode 0) / backward-data pass, or
    None: it needs a Hopper GPU, a channels-last gather (each 16-byte chunk is then one tap)
    and a grid within its limits."""
    m, c, _, (ho, wo) = g.view(mode)
    if not wgmma_available():
        return "no wgmma (not a compute capability 9.0 GPU)"
    if not channels_last(g.dtype, c, g.n):
        return (f"{c} summed channels of {g.dtype} not in whole 16-byte chunks on tensor "
                f"cores (or past the NHWC copy's grid)")
    if -(-g.n * ho * wo // 128) > launch.INT32_MAX or -(-m // 128) > launch.GRID_YZ_MAX:
        return "past the grid's limits"
    return None


def refuses_tma(g: ConvGeom, mode: int):
    """Why conv2d_wgmma_tma_kernel cannot take the pass, or None."""
    why = refuses(g, mode)
    if why:
        return why
    _, c, src, out = g.view(mode)
    if c % (128 // np.dtype(g.dtype).itemsize):
        return f"{c} summed channels not in whole 128-byte slabs"
    if tma_slower(mode, g.stride, (g.kh, g.kw)):
        return "a strided 1x1 backward-data (the gathering kernel is faster)"
    if tma_box(mode, g.stride, g.padding, (g.kh, g.kw), src, out, c, g.dtype) is None:
        return "no one im2col box serves every phase within the map's corner range"
    return None


def epilogue_stats(dt) -> bool:
    """Whether the TMA-fed forward of `dt` sums batch statistics in its epilogue
    (conv2d_forward_stats): 16-bit outputs (a tile's 128 pixels summed in float). Its
    warpgroups take turns (ping-pong), so one's epilogue runs while the other multiplies: on
    ResNet-18's 3x3 layers the sums cost 0.8-10 us a convolution against the 12-37 us
    statistics pass they spare (H100, batch 256, 48x48)."""
    return dt in launch.HALVES


# Bytes of weight slabs the TMA kernel keeps resident a block (its RES_BYTES): a 3x3 filter
# over 64 channels in 16 bits.
RESIDENT_BYTES = 72 * 1024


def resident(m, k, dt, phases) -> bool:
    """Whether the TMA kernel keeps every weight slab of an m x k pass in shared memory (its
    RES): 16-bit tiles of 64 or 128 channels, one phase, within RESIDENT_BYTES."""
    bn, slab = rows_tile(m), 128 // np.dtype(dt).itemsize
    return (not routes.refused("wgmma_resident") and dt in launch.HALVES and bn >= 64
            and phases == 1 and -(-m // bn) * -(-k // slab) * bn * 128 <= RESIDENT_BYTES)


def kernel(m, npix, dt, tma_fed=False, res=False):
    """conv2d_wgmma_kernel for m output channels: 32 / 64 / 128 of them per block (the
    smallest covering m), 128 pixels per block; the warp-specialized TMA-fed kernel instead
    where `tma_fed`, its weights resident where `res`. (name, kernel, grid, block, shared
    memory)"""
    bn, turn = rows_tile(m), ()
    if tma_fed:
        name, threads = "conv2d_wgmma_tma_kernel", 384
        smem = tma_smem(dt, bn, res)
        if bn == 64 and dt in launch.HALVES:
            turn = ("true",)  # the tile turned around (conv2d_wgmma.cu's TURN)
        if res:
            turn = (turn[0] if turn else "false", "true")
    else:
        name, threads = "conv2d_wgmma_kernel", 256
        smem = wgmma_smem(128, bn)
    fn = launch.kernel(FILE, name, launch.ctype(dt), str(bn), *turn, smem=smem)
    return name, fn, (-(-npix // 128), -(-m // bn)), (threads,), smem


def tma_staging(dt, bn: int) -> int:
    """Bytes of a multiplying warpgroup's output staging in conv2d_wgmma_tma_kernel (its
    staging_bytes<T, BN>): 16-bit tiles of 64 or 128 channels, stored by TMA."""
    return 128 * bn * 2 if dt in launch.HALVES and bn >= 64 else 0


def tma_smem(dt, bn: int, res: bool = False) -> int:
    """conv2d_wgmma_tma_kernel's dynamic shared memory (its tma_smem_bytes<T, BN, RES>): as
    many stages as fit in 192 KB beside the two staging tiles and the resident weights, at
    most 8, + slack to align. A stage holds a pixel slab, and the weights' slab unless `res`."""
    stage, staging = (128 if res else 128 + bn) * 128, 2 * tma_staging(dt, bn)
    weights = RESIDENT_BYTES if res else 0
    return min(8, (192 * 1024 - staging - weights) // stage) * stage + staging + weights + 1024


def plan(g: ConvGeom, mode: int, tma_fed: bool):
    """Forward (mode 0) or backward-data (mode 1): out[n, m, p] = sum wgt * src.

    The plan runs two kernels: the weight, reordered to the GEMM's (kh, kw, c) K order, then
    the implicit GEMM. run(w, src, bias, out, workspace) -> out; an NCHW source's NHWC copy
    is kept in the workspace, as "x" (forward) or "gy" (backward-data, where backward-weight
    reads it). Channels-last src and out (g.cl) are read and written as they lie."""
    fn_name, dt, cl, nb = FN[mode], g.dtype, g.cl, g.n
    m, c, (hs, ws), (ho, wo) = g.view(mode)
    npix, k, stride = nb * ho * wo, g.taps * c, g.stride
    out_shape = (nb, m, ho, wo)
    if cl:
        out_shape = nhwc_shape(out_shape)
    reorder = weight_reorder(mode, m, c, g.taps, dt)
    box = tma_box(mode, stride, g.padding, (g.kh, g.kw), (hs, ws), (ho, wo), c, dt) \
        if tma_fed else None
    stat_tiles = None
    # strided backward-data of a filter wider than 1x1: a phase of the output pixels per
    # grid z (mode 2, conv2d_wgmma.cu), the grid's x sized for the largest, phase (0, 0)
    phased = mode == 1 and stride != (1, 1) and g.taps > 1
    phases = g.sh * g.sw if phased else 1
    first = nb * -(-ho // g.sh) * -(-wo // g.sw) if phased else npix
    res = box is not None and resident(m, k, dt, phases)
    name, fn, grid, block, smem = kernel(m, first, dt, box is not None, res)
    tail = g.gemm(mode) + (i32(2 if phased else mode), i32(cl))
    # its tiles stored by TMA: boxes of consecutive pixels, rows of 16-byte multiples
    tma_store = (box is not None and cl and not phased and m % 8 == 0
                 and tma_staging(dt, rows_tile(m)) > 0)
    if name != "conv2d_wgmma_kernel":  # persistent: a block per SM walks the tiles
        tiles = grid[0] * grid[1] * phases
        tail += (i32(grid[0]), i32(grid[1]), i32(tiles))
        if mode == 0 and epilogue_stats(dt):
            stat_tiles = grid[0]
        grid = (min(tiles, launch.sm_count()),)  # one block an SM
    else:
        grid = grid + (phases,)
    # channels-last src needs no copy; else the copy backward-weight reads again: x
    # always (both its channels-last kernels); gy only where the wgmma one runs (the
    # mma.sync one reads gy as it is)
    copy = None if cl else to_nhwc((nb, c, hs, ws), dt)
    if cl:
        kept = None
    elif mode:
        kept = "gy" if bwdw_wgmma.takes(g) else None
    else:
        kept = "x"
    slab = 128 // np.dtype(dt).itemsize  # a 128-byte row of K

    def maps(wr, src, y, store):
        """The TMA kernel's maps: (pixels of src, weights wr, outputs y: the weights' again
        where `store` is off), or none for the gathering kernel."""
        if box is None:
            return ()
        weights = tma.tiled(wr, m, k, rows_tile(m), slab)
        return (tma.im2col(src, (nb, hs, ws, c), *box, channels=slab, pixels=128), weights,
                tma.tiled(y, npix, m, 128, slab) if store else weights)

    def run(w, src, bias, out, workspace=None, stats=None):
        y = output(fn_name, out, out_shape, dt)
        wr = reorder(w)
        if copy:
            src = keep(workspace, kept, src, copy(src)) if kept else copy(src)
        has_bias = bias is not None
        store = tma_store and y.data.ptr % 16 == 0  # a map's base is 16-byte aligned
        extra = () if box is None else (i32(store), launch.NULL if stats is None else stats)
        fn(grid, block, maps(wr, src, y, store) + (wr, src, bias if has_bias else y, y,
                                          np.int32(has_bias)) + tail + extra, shared_mem=smem)
        return y

    run.kernel = name
    run.phases = phases  # grid z: strided backward-data by phases, else 1
    run.stat_tiles = stat_tiles  # the pixel tiles whose statistics `stats=` takes, or None
    run.stat_rows = TILE_PIXELS  # each tile's pixels (the last may have fewer)
    run.tma_store = tma_store  # its tiles leave by TMA stores (where y is 16-byte aligned)
    return run
