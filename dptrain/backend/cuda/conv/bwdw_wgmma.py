"""Planner of kernels/conv2d_bwdw_wgmma.cu: backward-weight on Hopper's wgmma, x and gy
channels-last (NCHW ones copied, or taken from the workspace where the forward and
backward-data kept their copies), C_in and C_out in whole 16-byte chunks.

16-bit operands always; TF32 ones where C_in*KH*KW fills 128-row tiles (TF32_BWDW_MIN_ROWS).
The gathering kernel: 128 rows of (tap, c) by 64 / 128 / 256 output channels a block (128
in TF32), the pixels split over grid z by a cost model of waves, slabs and the reduce
(pixel_splits). 16-bit stride-1 passes whose C_in*KH*KW fills 192- or 128-wide tiles and
whose channels fill 128-byte slabs run turned around and fed by TMA instead
(conv2d_bwdw_tma_kernel: rows the output channels, columns the (tap, c); tma_route):
ResNet-18's stride-1 passes 2.0x (64 channels) and 1.4-1.5x (128-512) faster than the
gathering kernel, split-K reduce included; its fp16 step 8.05 -> 7.20 ms with the 64 x 192
tiles alone (H200). The splits' float partials are summed in a fixed order (reducer).
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch, tma
from dptrain.backend.cuda.conv.geometry import ConvGeom, tma_box
from dptrain.backend.cuda.conv.layout import channels_last, to_nhwc
from dptrain.backend.cuda.gemm import output, wgmma_available, wgmma_smem
from dptrain.backend.cuda.launch import i32
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.cuda.transpose import transposer
from dptrain.backend.cuda.workspace import take

FILE = "conv2d_bwdw_wgmma.cu"
# A 64 x 192 tile's time per multiply-add over a 128 x 128 one's (more operand bytes per
# multiply-add), the median of ResNet-18's stride-1 passes of 128, 256 and 512 channels at
# batch 256 on 48 x 48 images: 1.27, 1.15 and 1.12 times slower per multiply-add of their
# split estimate as 64 x 192 (fp16, H200)
BWDW_WIDE_RATE = 1.15
# TF32 backward-weight on wgmma (conv2d_bwdw_wgmma_tf32_kernel) where C_in*KH*KW fills its
# 128-row tiles: ResNet-18's passes on an H100 (2026-11-25) 1.03-2.5x faster than
# conv2d_nhwc.cu from 128 rows on, 0.76x at 64 (a 1x1 filter on 64 channels)
TF32_BWDW_MIN_ROWS = 128
# The tiled reduce (reduce_tiled) where its tiles fill the SMs; below, a thread per output.
# (Two earlier tiled versions, used for every pass, took 330 and 265 against 219 us a
# ResNet-18 fp16 step: the small passes' few tiles left SMs idle.)


def refuses(g: ConvGeom, aligned=True):
    """Why conv2d_bwdw_wgmma.cu cannot compute this backward-weight pass, or None: a Hopper
    GPU, 16-bit operands (or TF32 ones of TF32_BWDW_MIN_ROWS rows), both channel counts in
    whole 16-byte chunks, the NHWC copies within their grids; x and gy 16-byte aligned
    where `aligned` asks."""
    dt = g.dtype
    if not wgmma_available():
        return "no wgmma (not a compute capability 9.0 GPU)"
    if dt not in launch.HALVES:
        if dt != np.float32 or runtime.precision != "tf32":
            return "fp32 operands under FFMA"
        if g.rows < TF32_BWDW_MIN_ROWS:
            return f"TF32 with C_in*KH*KW = {g.rows} < {TF32_BWDW_MIN_ROWS}"
    if not (channels_last(dt, g.c, g.n) and channels_last(dt, g.cout, g.n)):
        return "C_in or C_out not in whole 16-byte chunks (or past the NHWC copies' grids)"
    if -(-g.cout // 256) > launch.GRID_YZ_MAX:
        return "past the grid's limits"
    if aligned and not (g.x16 and g.gy16):
        return "x or gy not 16-byte aligned"
    return None


def takes(g: ConvGeom) -> bool:
    """Whether a kernel of this file may take g's backward-weight, alignment aside (so
    backward-data keeps its NHWC copy of gy for it)."""
    return refuses(g, aligned=False) is None


def refuses_tma(g: ConvGeom, aligned=True):
    """Why conv2d_bwdw_tma_kernel cannot take the pass, or None: not 16-bit, a stride
    (ResNet-18's three stride-2 3x3 passes took 0.086, 0.078 and 0.082 ms this way, 0.063,
    0.064 and 0.079 gathering; fp16, H200), C_in*KH*KW in no whole tiles, or no TMA box for
    the forward."""
    why = refuses(g, aligned)
    if why:
        return why
    if g.dtype not in launch.HALVES:
        return "not 16-bit"
    if g.stride != (1, 1):
        return "strided (the gathering kernel is faster)"
    if tma_route(g) is None:
        return "C_in*KH*KW in no whole 192- or 128-wide tiles, or no TMA box for x"
    return None


def tma_route(g: ConvGeom):
    """(box, tiling) of conv2d_bwdw_tma_kernel: the im2col box of its map of x (the
    forward's: geometry.tma_box) and its tiles and splits (tma_tiling), or None."""
    tiling = tma_tiling(g.cout, g.rows, g.npix)
    box = tiling and tma_box(0, g.stride, g.padding, (g.kh, g.kw), (g.h, g.w), (g.ho, g.wo),
                             g.c, g.dtype)
    return (box, tiling) if box else None


def pixel_splits(tiles: int, npix: int, outputs: int, blocks: int, fill: int,
                 reduce_cost: float, most: int) -> tuple[int, int, float]:
    """(splits, chunk, cost) of a backward-weight pass's npix pixels over `tiles` output
    tiles: the split count, at most `most`, that minimises an estimate in slab times (64
    pixels of one tile): waves of tiles x splits over `blocks` resident blocks, each a
    chunk's slabs plus `fill` (its pipeline fill and epilogue), plus the float partials'
    reduce (`reduce_cost` slab times per output and split), and that estimate. Chunks are
    whole slabs; no split is left empty."""
    slabs, best = -(-npix // 64), None
    for s in range(1, min(slabs, most) + 1):
        per = -(-slabs // s)
        if -(-slabs // per) != s:
            continue
        reduce = s * outputs * reduce_cost if s > 1 else 0.0
        cost = -(-tiles * s // blocks) * (per + fill) + reduce
        if best is None or cost < best[0]:
            best = (cost, s, per * 64)
    return best[1], best[2], best[0]


def tma_tiling(cout: int, ncol: int, npix: int):
    """(rows, cols, splits, chunk) of conv2d_bwdw_tma_kernel for cout output channels by ncol
    (tap, c) over npix pixels, or None where no tile fits ncol: 64 x 192 tiles, or 128 x 128
    where there are more than 64 channels, whichever the split estimate (pixel_splits, one
    block an SM) times the tile's multiply-adds and BWDW_WIDE_RATE says is faster."""
    best = None
    for rows, cols, rate in ((128, 128, 1.0), (64, 192, BWDW_WIDE_RATE)):
        if ncol % cols or (rows == 128 and cout <= 64):
            continue
        tiles = -(-cout // rows) * (ncol // cols)
        # the reduce's cost per slab time an estimate (not measured)
        splits, chunk, cost = pixel_splits(tiles, npix, ncol * cout, launch.sm_count(),
                                           fill=2, reduce_cost=3.3e-6, most=256)
        time = cost * rows * cols * rate
        if best is None or time < best[0]:
            best = (time, rows, cols, splits, chunk)
    return best and best[1:]


def tma_smem(rows: int, cols: int) -> int:
    """conv2d_bwdw_tma_kernel's dynamic shared memory (its stages<BJ, R>): stages of a 64-pixel
    slab of rows + cols rows, as many as fit in 192 KB, at most 8, + slack to align."""
    stage = (rows + cols) * 128
    return min(8, 192 * 1024 // stage) * stage + 1024


def reducer(splits: int, cout: int, c: int, taps: int, dt):
    """reduce(ws, gw, add_to=None): the (splits, taps * c, cout) float partials ws summed in
    split order into gw (cout, c, taps), or, given add_to (float32, gw's shape; gw then
    unused), rounded to gw's dtype and added into add_to, as add_ of gw would.
    conv2d_bwdw_reduce_tiled_kernel where its tiles (32 output channels by up to 64 (tap, c)
    rows) fill the SMs at least once, both sides coalesced; else a thread per output, whose
    stores are strided. The same bits either way."""
    from dptrain.backend.cuda.conv.routes import refused
    ctile = max(1, 64 // taps)  # the kernel's 64 rows
    grid = (-(-cout // 32), -(-c // ctile))
    if (taps <= 64 and grid[1] <= launch.GRID_YZ_MAX and not refused("bwdw_reduce_tiled")
            and grid[0] * grid[1] >= launch.sm_count()):
        fn = launch.kernel(FILE, "conv2d_bwdw_reduce_tiled_kernel", launch.ctype(dt))
        tail = (i32(splits), i32(cout), i32(c), i32(taps), i32(ctile))
    else:
        fn = launch.kernel(FILE, "conv2d_bwdw_wgmma_reduce_kernel", launch.ctype(dt))
        grid = (max(1, min(-(-taps * c * cout // 256), launch.sm_count() * 8)),)
        tail = (i32(splits), i32(cout), i32(c), i32(taps))

    def reduce(ws, gw, add_to=None):
        fn(grid, (256,), (ws, gw if add_to is None else add_to) + tail
           + (launch.NULL if add_to is None else add_to,))
        return gw if add_to is None else add_to

    return reduce


def _copies(g: ConvGeom):
    """x and gy as the kernels read them: as they lie where channels-last, else NHWC copies
    (taken from the workspace where kept)."""
    x_nhwc = (lambda a: a) if g.cl else to_nhwc(g.x_shape, g.dtype)
    gy_nhwc = (lambda a: a) if g.cl else transposer(g.n, g.cout, g.ho * g.wo, g.dtype)
    return lambda x, gy, workspace: (take(workspace, "x", x, x_nhwc),
                                     take(workspace, "gy", gy, gy_nhwc))


def plan_tma(g: ConvGeom):
    """conv2d_bwdw_tma_kernel: tiles of output channels by (tap, c) (tma_tiling), the pixels
    split into chunks of whole slabs, one block an SM walking the tiles; several splits'
    float partials summed by reducer's kernel."""
    f, dt = "conv2d_backward_weight", g.dtype
    launch.check_int32(f, g.x_size, g.y_size)
    box, (rows, cols, splits, chunk) = tma_route(g)
    n, c, h, wd, cout = g.n, g.c, g.h, g.w, g.cout
    ncol, npix = g.rows, g.npix
    tiles_m, tiles_j = -(-cout // rows), ncol // cols
    smem = tma_smem(rows, cols)
    fn = launch.kernel(FILE, "conv2d_bwdw_tma_kernel", launch.ctype(dt), str(cols),
                       str(rows // 64), smem=smem)
    grid = (min(tiles_m * tiles_j * splits, launch.sm_count()),)
    tail = tuple(i32(v) for v in (n, cout, c, g.ho, g.wo, g.kw, g.sh, g.sw, g.ph, g.pw, ncol,
                                  tiles_m, tiles_j, splits, chunk))
    copies = _copies(g)
    reduce = reducer(splits, cout, c, g.taps, dt)
    w_shape = g.w_shape

    def run(x, gy, out, workspace=None, add_to=None):
        # (given add_to, splits > 1: the kernel writes ws alone, gw is a placeholder)
        gw = output(f, out, w_shape, dt) if add_to is None else add_to
        ws = launch.new((splits, ncol, cout), np.float32) if splits > 1 else gw
        xn, gyn = copies(x, gy, workspace)
        maps = (tma.im2col(xn, (n, h, wd, c), *box, channels=64, pixels=64),
                tma.tiled(gyn, npix, cout, 64, 64))
        fn(grid, (384,), maps + (gw, ws) + tail, shared_mem=smem)
        return reduce(ws, gw, add_to) if splits > 1 else gw

    run.kernel, run.splits, run.tile = "conv2d_bwdw_tma_kernel", splits, (rows, cols)
    run.adds = splits > 1  # takes add_to= (the reducer adds)
    return run


def plan(g: ConvGeom):
    """The gathering kernel: 128 rows of (tap, c) by BN output channels per block (64 / 128
    / 256, the smallest covering them; 128 in TF32), the pixels split over grid z."""
    f, dt = "conv2d_backward_weight", g.dtype
    launch.check_int32(f, g.x_size, g.y_size)
    cout, ncol, npix = g.cout, g.rows, g.npix
    bn = 64 if cout <= 64 else 128 if cout <= 128 else 256
    if dt == np.float32:  # TF32 stages its slabs in registers: 128 x 128 tiles only
        bn = 128
    smem = wgmma_smem(128, bn)
    tiles = -(-ncol // 128) * -(-cout // bn)
    # a slab of one block ~1 us; the reduce about 3 us per 2.4 M outputs per split (~3 TB/s)
    splits, chunk, _ = pixel_splits(tiles, npix, ncol * cout,
                                    launch.sm_count() * (2 if bn == 64 else 1), fill=4,
                                    reduce_cost=1.33e-6, most=64)
    if dt == np.float32:  # TF32: slabs stored K-major from registers
        name = "conv2d_bwdw_wgmma_tf32_kernel"
        fn = launch.kernel(FILE, name, str(bn), smem=smem)
    else:
        name = "conv2d_bwdw_wgmma_kernel"
        fn = launch.kernel(FILE, name, launch.ctype(dt), str(bn), smem=smem)
    grid = (-(-ncol // 128), -(-cout // bn), splits)
    tail = tuple(i32(v) for v in (g.n, cout, g.c, g.h, g.w, g.ho, g.wo, g.kh, g.kw, g.sh,
                                  g.sw, g.ph, g.pw, splits, chunk))
    copies = _copies(g)
    if splits > 1:
        reduce = reducer(splits, cout, g.c, g.taps, dt)
    w_shape = g.w_shape

    def run(x, gy, out, workspace=None, add_to=None):
        # (given add_to, splits > 1: the kernel writes ws alone, gw is a placeholder)
        gw = output(f, out, w_shape, dt) if add_to is None else add_to
        ws = launch.new((splits, ncol, cout), np.float32) if splits > 1 else gw
        xn, gyn = copies(x, gy, workspace)
        fn(grid, (256,), (xn, gyn, gw, ws) + tail, shared_mem=smem)
        return reduce(ws, gw, add_to) if splits > 1 else gw

    run.kernel, run.splits = name, splits
    run.adds = splits > 1  # takes add_to= (the reducer adds)
    return run
