"""Launchers of kernels/conv2d*.cu: 2-D convolution forward, backward-data and backward-weight
as implicit GEMMs (no im2col buffer), planned like matmul (gemm.py).

Conventions (the .cu file's header has the kernel side):
  * float32, float16 or bfloat16 (every operand: the b16 tensor-core kernels and the direct
    kernels load 16-bit data and accumulate in fp32, rounding each result once), NCHW
    activations, weight (C_out, C_in, kH, kW), PyTorch's cross-correlation; stride and padding
    are (h, w) pairs of ints. Results are new arrays or `out=`, written with `=`.
  * forward and backward-data are one kernel (mode 0 / 1) after the weight is reordered into
    the GEMM's (kh, kw, c) K order; the output-channel tile is the smallest of 32/64/128
    covering the channels (under fp32 a 32- or 64-channel tile spans 256 pixels, else 128).
  * backward-weight splits its long K (batch * output pixels) over grid z when the output
    tiles leave SMs idle, and sums the splits in a fixed order: bitwise repeatable.
  * backward-weight, where C_in and Ho*Wo are multiples of a 16-byte chunk (8 for 16-bit
    types, 4 for float under TF32) and gy is 16-byte aligned, copies x to NHWC first and runs
    conv2d_nhwc.cu's kernel, whose im2col gathers are 16-byte cp.async chunks (1.3-1.8x
    faster at the reference CNN's shapes, the copy included). Under fp32 its FFMA kernel
    does the same for filters wider than 1x1 with C_in in whole chunks (gy gathered element
    by element, so Ho*Wo and gy's alignment do not matter). DPTRAIN_NHWC_CONV=0 keeps
    conv2d.cu's NCHW gathers.
  * Forward and backward-data on Hopper (conv2d_wgmma.cu, wgmma with channels-last 16-byte
    gathers; DPTRAIN_WGMMA_CONV=0 turns it off, measured 6-8% faster in the CNN's step): the
    source is copied to NHWC first, and the kernel needs the summed channels in whole 16-byte
    chunks; otherwise conv2d.cu's mma.sync kernels run. Where they fill whole 128-byte slabs
    (and for backward-data one box serves every phase) the tensor memory accelerator loads
    the slabs instead (conv2d_wgmma_tma_kernel; DPTRAIN_WGMMA_CONV_TMA=0 turns it off).
  * The channels-last backward-data of a strided 1x1 filter (a ResNet shortcut) is the
    stride-1 product at the pixels the filter reaches, spread onto x's grid with zeros
    between (_spread; DPTRAIN_CONV_SPREAD=0 runs the one pass over every pixel instead).
  * Backward-weight of 16-bit operands on Hopper (conv2d_bwdw_wgmma.cu, wgmma with both
    operands channels-last; DPTRAIN_WGMMA_BWDW=0 turns it off), and of TF32 ones where
    C_in*KH*KW >= 128 (DPTRAIN_WGMMA_BWDW_TF32: "0" never, "1" always): x and gy are copied
    to NHWC, and C_in and C_out must come in whole 16-byte chunks; its split of the pixels
    over grid z is chosen by a cost model of waves, slabs and the reduce (_pixel_splits).
    16-bit stride-1 passes whose C_in*KH*KW fills 192- or 128-wide tiles and whose channels
    fill 128-byte slabs run turned around and fed by TMA instead (conv2d_bwdw_tma_kernel:
    rows the output channels, columns the (tap, c); DPTRAIN_BWDW_TMA=0 turns it off). The
    splits' float partials are summed in a fixed order, a tile at a time where the tiles
    fill the SMs, else a thread per output (_bwdw_wgmma_reducer).
  * fp32 channels-last passes on Hopper run as 3xTF32 (tf32x3.py: the operands split into
    TF32 parts, K tripled, then the TF32 wgmma plan), where a TF32 wgmma kernel takes the
    tripled pass, and for backward-weight where C_out and C_in*KH*KW fill 128-wide tiles
    (X3_BWDW_MIN). ResNet-18's fp32 step: 75.43 ms on FFMA, 42.18 this way (one H200).
    DPTRAIN_FP32_TF32X3=0 keeps FFMA.
  * `channels_last=True`: activations (x, y, gy, gx) are (N, H, W, C). The wgmma kernels read
    and write them as they are (no copies: their sources are channels-last anyway and their
    epilogue stores channel pairs), and so does 16-bit / TF32 backward-weight on wgmma; the
    FFMA backward-weight of conv2d_nhwc.cu copies gy only (_x_as_it_lies); every other pass
    copies its activations to NCHW and its output back (_via_nchw).
  * conv2d_forward_stats: a bias-free forward plus its output's batch statistics for the batch
    norm that follows; the TMA-fed kernel (in its epilogue) and the channels-last direct
    forward (from its staged rounds) sum them where _epilogue_stats says (per-tile sums
    merged by norm.batch_norm_tile_stats), else batch_norm_stats reads y.
  * `conv2d_kernels` names the kernel each pass's plan runs (tests, benchmarks).
  * Small filters (C_in*KH*KW <= 32, e.g. a first layer on 1-3 channel images) run the
    direct kernels of conv2d_direct.cu instead, forward (<= 128 output channels) and
    backward-weight: there the implicit GEMM wastes most of each K slab. The forward is FFMA
    in fp32 whatever the precision (more exact than TF32); in 16 bits with an even C_out up to
    64 it writes a channels-last y itself, and conv2d_forward_stats' statistics with it
    (_direct_cl_out). Backward-weight runs on tensor cores in TF32 / bf16 / fp16 (fp32
    accumulation; a channels-last gy read as it lies), FFMA under fp32.
    DPTRAIN_DIRECT_CONV=0 turns them off.
  * The precision (runtime.precision) is part of every plan key. `workspace=` (a layer's
    cuda/workspace.py Workspace) carries the channels-last copies of x (made by the forward)
    and gy (made by backward-data) to backward-weight, which then copies neither again.
"""
from __future__ import annotations

import numpy as np

from dptrain import switches
from dptrain.backend.cuda import launch, tf32x3, tma
from dptrain.backend.cuda.arrays import fill_
from dptrain.backend.cuda.gemm import (operand_dtype, output, plan, reducer, sig, split_k,
                                       tile_floats, wgmma_available, wgmma_smem)
from dptrain.backend.cuda.launch import i32
from dptrain.backend.cuda.norm import TILE_PIXELS, batch_norm_stats, batch_norm_tile_stats
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.cuda.transpose import spreader, strided_copy, transposer
from dptrain.backend.cuda.workspace import Workspace, keep, take
from dptrain.backend.registry import op

CONV = "conv2d.cu"
DIRECT = "conv2d_direct.cu"
NHWC = "conv2d_nhwc.cu"
WGMMA_CONV = "conv2d_wgmma.cu"
WGMMA_BWDW = "conv2d_bwdw_wgmma.cu"
# The routes' switches (dptrain/switches.py), each on by default, and why:
# - WGMMA_CONV, "0": forward / backward-data keep conv2d.cu's mma.sync kernels on Hopper. The
#   reference CNN's captured step ran 6-8% faster with it on an H200 (2026-11-24, bench
#   train, TF32 and bf16, batch 256 and 1024; BENCHMARKS.md).
# - WGMMA_CONV_TMA, "0": forward / backward-data keep conv2d_wgmma_kernel's cp.async gathers.
#   conv2d_wgmma_tma_kernel, the warp-specialized kernel fed by the tensor memory accelerator
#   (an im2col map of the channels-last source, a tiled map of the weight; tma.py), takes the
#   passes whose summed channels come in whole 128-byte slabs and where one box of base
#   pixels serves every phase (_tma_box); bitwise equal to conv2d_wgmma_kernel. ResNet-18's
#   step 12.29 -> 10.90 ms in bf16, 23.8 -> 22.1 in TF32; the reference CNN's 0.63 -> 0.60
#   and 0.95 -> 0.89 (H100, 2026-11-25, BENCHMARKS.md).
# - WGMMA_CONV_TURN: the TMA kernel's 16-bit tiles of 64 channels turned around (weights as
#   wgmma's A, one m64n128 a step where two m64n64 read the weights twice; conv2d_wgmma.cu's
#   TURN); "0": not. ResNet-18's 64-channel forward and backward-data 5% faster (H200; the
#   same bits).
# - CONV_SPREAD, "0": a strided 1x1 filter's channels-last backward-data sums zero-filled taps
#   over every pixel of x instead of the dense product at the pixels it reaches, spread
#   (_spread).
# - NHWC_CONV, "0": backward-weight keeps the NCHW gathers. CONV_STATS: see _epilogue_stats.
# - WGMMA_BWDW, "0": 16-bit backward-weight keeps conv2d_nhwc.cu.
# - BWDW_TMA: 16-bit backward-weight fed by TMA (conv2d_bwdw_tma_kernel) where it applies
#   (_bwdw_tma_route; "0": never): tiles of 64 output channels by 192 (tap, c) columns, or
#   128 by 128 where there are more than 64 output channels and they are faster
#   (_bwdw_tma_tiling). ResNet-18's stride-1 passes 2.0x (64 channels) and 1.4-1.5x
#   (128-512) faster than the gathering kernel, split-K reduce included; its fp16 step
#   8.05 -> 7.20 ms with the 64 x 192 tiles alone (H200).
# - BWDW_REDUCE_TILED: see _bwdw_wgmma_reducer. WGMMA_BWDW_TF32: see TF32_BWDW_MIN_ROWS.
# A 64 x 192 tile's time per multiply-add over a 128 x 128 one's (more operand bytes per
# multiply-add), the median of ResNet-18's stride-1 passes of 128, 256 and 512 channels at
# batch 256 on 48 x 48 images: 1.27, 1.15 and 1.12 times slower per multiply-add of their
# split estimate as 64 x 192 (fp16, H200)
BWDW_WIDE_RATE = 1.15
# TF32 backward-weight on wgmma (conv2d_bwdw_wgmma_tf32_kernel): by default where C_in*KH*KW
# fills its 128-row tiles (ResNet-18's passes on an H100, 2026-11-25: 1.03-2.5x faster than
# conv2d_nhwc.cu from 128 rows on, 0.76x at 64, a 1x1 filter on 64 channels); switch
# WGMMA_BWDW_TF32 "1": every shape it takes, "0": none
TF32_BWDW_MIN_ROWS = 128
# fp32 backward-weight as 3xTF32 (tf32x3.py) where C_out and C_in*KH*KW both fill the TF32
# kernel's 128-wide tiles; with 64 output channels FFMA was faster (ResNet-18's layer1:
# 1.73 against 2.13 ms, H200)
X3_BWDW_MIN = 128
DIRECT_MAX_K, DIRECT_MAX_M = 32, 128  # C_in*KH*KW; output channels (forward)
DIRECT_CL_MAX_M = 64  # conv2d_direct.cu's: the channels of a forward it writes channels-last
_DIRECT_MG = {4: 8, 8: 4, 12: 4, 16: 4, 20: 2, 24: 2, 28: 2, 32: 2}  # KMAX -> channels/thread


def _direct_kmax(k: int):
    """The direct kernels' tap count for K = C_in*KH*KW, or None where they do not apply."""
    if not switches.on("DIRECT_CONV") or not 0 < k <= DIRECT_MAX_K:
        return None
    return -(-k // 4) * 4


def _chunk(dt) -> int:
    """Elements in one 16-byte chunk of dtype dt."""
    return 16 // np.dtype(dt).itemsize


def _tensor_cores(dt) -> bool:
    """Whether dtype dt computes on tensor cores now: 16-bit, or float32 under TF32."""
    return np.dtype(dt) in launch.HALVES or runtime.precision == "tf32"


def _chunks_fit(dt, c: int, nb: int) -> bool:
    """Whether c channels of a batch of nb gather as 16-byte chunks: c in whole chunks and
    the NHWC copy (_to_nhwc) within its grid."""
    return c % _chunk(dt) == 0 and nb <= launch.GRID_YZ_MAX and c <= 32 * launch.GRID_YZ_MAX


def _channels_last(dt, c: int, nb: int) -> bool:
    """Whether a channels-last tensor-core kernel may gather c channels of a batch of nb."""
    return _tensor_cores(dt) and _chunks_fit(dt, c, nb)


def _nhwc(dt, c: int, nb: int) -> bool:
    """Whether a channels-last backward-weight kernel (conv2d_nhwc.cu: one for tensor cores,
    one for FFMA) may gather c input channels of a batch of nb (DPTRAIN_NHWC_CONV not "0")."""
    return switches.on("NHWC_CONV") and _chunks_fit(dt, c, nb)


def _to_nhwc(shape, dt):
    """run(a) -> a new (N, H, W, C) copy of the contiguous NCHW array a of `shape`."""
    nb, c, h, w = shape
    transpose = transposer(nb, c, h * w, dt)
    return lambda a: transpose(a).reshape(nb, h, w, c)


def _nhwc_shape(shape):
    """The channels-last (N, H, W, C) shape of NCHW `shape`."""
    n, c, h, w = shape
    return (n, h, w, c)


def _nchw_shape(shape):
    """The NCHW shape of channels-last (N, H, W, C) `shape`."""
    n, h, w, c = shape
    return (n, c, h, w)


def _to_nchw(shape, dt):
    """run(a) -> the contiguous (N, H, W, C) array a of NCHW `shape` as NCHW: a new copy, or
    a view of a where one layout is the other (one channel or one pixel)."""
    nb, c, h, w = shape
    if c == 1 or h * w == 1:
        return lambda a: a.reshape(nb, c, h, w)
    transpose = transposer(nb, h * w, c, dt)
    return lambda a: transpose(a).reshape(nb, c, h, w)


def _via_nchw(run, fn_name, acts, out_shape, dt):
    """A channels-last plan from the NCHW plan `run`: the arguments at `acts` (position ->
    their NCHW shape) copied to NCHW first, and an NCHW output of `out_shape` (None: one that
    is not an activation) copied to channels-last. For the passes no channels-last kernel
    takes (direct and mma.sync kernels, non-Hopper GPUs): right, not fast."""
    to_nchw = {i: _to_nchw(shape, dt) for i, shape in acts.items()}
    to_nhwc = _to_nhwc(out_shape, dt) if out_shape else None

    def run_cl(*args, **kw):  # the plan's inputs, then out and workspace
        *ins, out, workspace = args
        ins = [to_nchw[i](a) if i in to_nchw else a for i, a in enumerate(ins)]
        if to_nhwc is None:
            return run(*ins, out, workspace, **kw)
        y = to_nhwc(run(*ins, None, workspace))
        if out is None:
            return y
        return strided_copy(output(fn_name, out, y.shape, dt), y, launch.estrides(y))

    run_cl.kernel = run.kernel
    run_cl.stat_tiles = getattr(run, "stat_tiles", None) if to_nhwc is None else None
    return run_cl


def _direct_geom(x_shape, w_shape, ho, wo, stride, padding):
    (n, c, h, wd), (cout, _, kh, kw) = x_shape, w_shape
    (sh, sw), (ph, pw) = stride, padding
    launch.check_int32("conv2d", n * c * h * wd, n * cout * ho * wo)
    return launch.struct(launch.DIRECT_GEOM, Nb=n, C=c, H=h, W=wd, M=cout, Ho=ho, Wo=wo, KH=kh,
                         KW=kw, sh=sh, sw=sw, ph=ph, pw=pw)


def _direct_cl_out(dt, cout: int) -> bool:
    """Whether the direct forward writes a channels-last output of cout channels of dtype dt
    itself (16-bit, cout even and at most DIRECT_CL_MAX_M), with the batch statistics of its
    128-pixel tiles where asked (conv2d_forward_stats)."""
    return np.dtype(dt) in launch.HALVES and cout % 2 == 0 and cout <= DIRECT_CL_MAX_M


def _plan_direct_forward(x_shape, w_shape, ho, wo, stride, padding, kmax, dt, cl_out=False):
    """The direct forward of NCHW x: y NCHW, or (N, Ho, Wo, C_out) where `cl_out`
    (_direct_cl_out); run.stat_tiles is then the pixel tiles whose statistics `stats=`
    takes."""
    f = "conv2d_forward"
    n, cout = x_shape[0], w_shape[0]
    out_shape = (n, ho, wo, cout) if cl_out else (n, cout, ho, wo)
    geom = _direct_geom(x_shape, w_shape, ho, wo, stride, padding)
    targs = (launch.ctype(dt), str(kmax)) + (("true",) if cl_out else ())
    fn = launch.kernel(DIRECT, "conv2d_direct_fwd_kernel", *targs)
    npix = n * ho * wo

    # 256-thread blocks whatever launch_shape says (__launch_bounds__(256) in the kernel).
    grid = (max(1, min(-(-npix // 256), launch.sm_count() * launch.BLOCKS_PER_SM // 2)),)

    def run(w, x, bias, out, workspace=None, stats=None):
        y = output(f, out, out_shape, dt)
        if npix and y.size:
            has_bias = bias is not None
            fn(grid, (256,), (w, x, bias if has_bias else y, y, np.int32(has_bias), geom,
                              launch.NULL if stats is None else stats))
        return y

    run.kernel = "conv2d_direct_fwd_kernel"
    run.stat_tiles = (-(-npix // TILE_PIXELS) if cl_out and npix and _epilogue_stats(dt)
                      else None)
    return run


def _plan_direct_backward_weight(x_shape, w_shape, ho, wo, stride, padding, kmax, dt,
                                 cl=False):
    """x NCHW; gy channels-last where `cl` (the tensor-core kernel only)."""
    f = "conv2d_backward_weight"
    geom = _direct_geom(x_shape, w_shape, ho, wo, stride, padding)
    m, k, npix = w_shape[0], w_shape[1] * w_shape[2] * w_shape[3], x_shape[0] * ho * wo
    tensor_cores = _tensor_cores(dt)
    if cl and not tensor_cores:
        raise ValueError(f"cuda.{f}: the FFMA direct kernel reads gy as NCHW only")
    if tensor_cores:  # 32 channels x all taps per block row
        groups, rows = -(-m // 32), x_shape[0] * ho
        blocks = max(1, min(-(-rows // 8), 4 * launch.sm_count() // groups))
        name = "conv2d_direct_bwdw_mma_kernel"
        fn = launch.kernel(DIRECT, name, launch.ctype(dt), str(-(-k // 8)))
    else:
        mg = _DIRECT_MG[kmax]
        groups = -(-m // mg)
        # About three resident blocks per SM over all groups (the accumulators limit occupancy).
        blocks = max(1, min(-(-npix // 256), 3 * launch.sm_count() // groups))
        name = "conv2d_direct_bwdw_kernel"
        fn = launch.kernel(DIRECT, name, launch.ctype(dt), str(kmax), str(mg))
    if groups > launch.GRID_YZ_MAX:
        raise ValueError(f"cuda.{f}: {m} output channels exceed the grid's limit")
    reduce = reducer(CONV, blocks, 1, m, k, k, 0, 0, dt)
    even_rows = wo % 2 == 0

    def run(x, gy, out, workspace=None):
        gw = output(f, out, tuple(w_shape), dt)
        if npix == 0:
            return fill_(gw, 0.0)
        ws = launch.new((blocks, m, k), np.float32)
        if tensor_cores:  # 16-bit NCHW pixel pairs as one 32-bit load where aligned
            pairs = np.int32(not cl and even_rows and gy.data.ptr % 4 == 0)
            fn((blocks, groups), (256,), (x, gy, ws, geom, pairs, i32(cl)))
        else:
            fn((blocks, groups), (256,), (x, gy, ws, geom))
        reduce(ws, gw, gw)
        return gw

    run.kernel = name
    return run


def _empty(run):
    """A plan with nothing to compute (an empty batch or channel axis)."""
    run.kernel = "none"
    return run


def _pair(fn: str, name: str, v) -> tuple[int, int]:
    if (not isinstance(v, (tuple, list)) or len(v) != 2
            or not all(isinstance(i, (int, np.integer)) for i in v)):
        raise ValueError(f"cuda.{fn}: {name} must be an (h, w) pair of ints, got {v!r}")
    return int(v[0]), int(v[1])


def _key(v):
    """A hashable stand-in for a stride / padding / shape argument (validated later)."""
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _out_size(fn, n, k, s, p, axis):
    o = (n + 2 * p - k) // s + 1 if s >= 1 else 0
    if s < 1 or p < 0 or o < 1:
        raise ValueError(f"cuda.{fn}: size {n}, kernel {k}, stride {s}, padding {p} along "
                         f"{axis} give no output")
    return o


def _rows_tile(m: int) -> int:
    """Block tile along the output channels: the smallest of 32/64/128 that covers m."""
    return 32 if m <= 32 else 64 if m <= 64 else 128


def _cols_tile(n: int) -> int:
    """Backward-weight's tile along C_in*KH*KW: 32, 96 or 128, whichever pads n least (ties
    to the larger); 3x3 filters give multiples of 9, which 96 fits where 128 leaves a quarter
    of the last tile idle (288 = 3 x 96)."""
    return min((-(-n // t) * t - n, -t, t) for t in (32, 96, 128))[2]


def _plan_implicit(fn_name, mode, out_shape, m, c, hs, ws, ho, wo, kh, kw, stride, padding,
                   dt, cl=False):
    """Forward (mode 0) or backward-data (mode 1): out[n, m, p] = sum wgt * src (conv2d.cu).

    The plan runs two kernels: the weight, reordered to the GEMM's (kh, kw, c) K order, then
    the implicit GEMM. run(w, src, bias, out, workspace) -> out; the wgmma kernel's NHWC
    copy of src is kept in the workspace, as "x" (forward) or "gy" (backward-data).
    `cl`: src and out are channels-last (out_shape NCHW all the same), which only the wgmma
    kernels read and write as they are; None where they do not apply.
    """
    nb = out_shape[0]
    npix, k = nb * ho * wo, kh * kw * c
    if cl:
        out_shape = _nhwc_shape(out_shape)
    if npix == 0 or m == 0:
        return _empty(lambda w, src, bias, out, workspace=None: output(fn_name, out, out_shape,
                                                                      dt))
    if cl and not _wgmma_conv(dt, c, nb, npix, m):
        return None
    reorder = _weight_reorder(mode, m, c, kh * kw, dt)
    (sh, sw), (ph, pw) = stride, padding
    # The kernels' parameters after (wr, src, bias, out, has_bias).
    geom = (i32(nb), i32(m), i32(c), i32(hs), i32(ws), i32(ho), i32(wo), i32(kh), i32(kw),
            i32(sh), i32(sw), i32(ph), i32(pw))
    box = stat_tiles = None
    tma_store = False
    if _wgmma_conv(dt, c, nb, npix, m):
        box = _tma_box(mode, stride, padding, (kh, kw), (hs, ws), (ho, wo), c, dt)
        # strided backward-data of a filter wider than 1x1: a phase of the output pixels per
        # grid z (mode 2, conv2d_wgmma.cu), the grid's x sized for the largest, phase (0, 0)
        phased = mode == 1 and stride != (1, 1) and kh * kw > 1
        phases = stride[0] * stride[1] if phased else 1
        first = nb * -(-ho // stride[0]) * -(-wo // stride[1]) if phased else npix
        name, fn, grid, block, smem = _wgmma_kernel(m, first, dt, box is not None)
        tail = geom + (i32(2 if phased else mode), i32(cl))
        # its tiles stored by TMA: boxes of consecutive pixels, rows of 16-byte multiples
        tma_store = (box is not None and cl and not phased and m % 8 == 0
                     and _tma_staging(dt, _rows_tile(m)) > 0)
        if name != "conv2d_wgmma_kernel":  # persistent: a block per SM walks the tiles
            tiles = grid[0] * grid[1] * phases
            tail += (i32(grid[0]), i32(grid[1]), i32(tiles))
            if mode == 0 and _epilogue_stats(dt):
                stat_tiles = grid[0]
            grid = (min(tiles, launch.sm_count()),)  # one block an SM
        else:
            grid = grid + (phases,)
        # channels-last src needs no copy; else the copy backward-weight reads again: x
        # always (both its channels-last kernels); gy only where the wgmma one runs (the
        # mma.sync one reads gy as it is)
        to_nhwc = None if cl else _to_nhwc((nb, c, hs, ws), dt)
        if cl:
            kept = None
        elif mode:
            kept = "gy" if _wgmma_bwdw(dt, m, c, nb, m * kh * kw) else None
        else:
            kept = "x"
    else:
        phased = _ffma_phased(mode, stride, kh * kw, c, dt)  # grid x fits phase (0, 0)
        phases = stride[0] * stride[1] if phased else 1
        first = nb * -(-ho // stride[0]) * -(-wo // stride[1]) if phased else npix
        name, fn, grid, block, smem = _mma_kernel(m, first, dt)
        grid = grid + (phases,)
        tail = geom + (i32(k % _chunk(dt) == 0), i32(2 if phased else mode))  # + vec_w
        to_nhwc = kept = None
    slab = 128 // np.dtype(dt).itemsize  # a 128-byte row of K

    def maps(wr, src, y, store):
        """The TMA kernel's maps: (pixels of src, weights wr, outputs y: the weights' again
        where `store` is off), or none for the others."""
        if box is None:
            return ()
        weights = tma.tiled(wr, m, k, _rows_tile(m), slab)
        return (tma.im2col(src, (nb, hs, ws, c), *box, channels=slab, pixels=128), weights,
                tma.tiled(y, npix, m, 128, slab) if store else weights)

    def run(w, src, bias, out, workspace=None, stats=None):
        y = output(fn_name, out, out_shape, dt)
        wr = reorder(w)
        if to_nhwc:
            src = keep(workspace, kept, src, to_nhwc(src)) if kept else to_nhwc(src)
        has_bias = bias is not None
        store = tma_store and y.data.ptr % 16 == 0  # a map's base is 16-byte aligned
        extra = () if box is None else (i32(store), launch.NULL if stats is None else stats)
        fn(grid, block, maps(wr, src, y, store) + (wr, src, bias if has_bias else y, y,
                                          np.int32(has_bias)) + tail + extra, shared_mem=smem)
        return y

    run.kernel = name
    run.phases = phases  # grid z: strided backward-data by phases, else 1
    run.stat_tiles = stat_tiles  # the pixel tiles whose statistics `stats=` takes, or None
    run.tma_store = tma_store  # its tiles leave by TMA stores (where y is 16-byte aligned)
    return run


def _ffma_phased(mode, stride, taps: int, c: int, dt) -> bool:
    """Whether conv2d.cu's FFMA kernel runs a backward-data pass by phases (mode 2): strided,
    a filter wider than 1x1, and c summed channels in whole 16-wide K slabs (a slab one tap).
    The other conv2d.cu kernels zero-fill the taps that do not divide."""
    return (mode == 1 and tuple(stride) != (1, 1) and taps > 1 and c % 16 == 0
            and not _tensor_cores(dt))


def _epilogue_stats(dt) -> bool:
    """Whether the TMA-fed forward of `dt` sums batch statistics in its epilogue
    (conv2d_forward_stats): 16-bit outputs (a tile's 128 pixels summed in float), unless
    DPTRAIN_CONV_STATS is "0". Its warpgroups take turns (ping-pong), so one's epilogue runs
    while the other multiplies: on ResNet-18's 3x3 layers the sums cost 0.8-10 us a
    convolution against the 12-37 us statistics pass they spare (H100, batch 256, 48x48;
    BENCHMARKS.md)."""
    return switches.on("CONV_STATS") and dt in launch.HALVES


def _weight_reorder(mode, m, c, khw, dt):
    """run(w) -> a new (m, khw * c) array wr[m][t * c + ci] of the weight w (C_out, C_in, KH,
    KW): the implicit GEMM's dense, K-major operand (K in (kh, kw, c) order), as one tiled
    transpose. Forward (m = C_out, c = C_in): each output channel's (C_in, KH*KW) matrix
    turned; backward-data (m = C_in, c = C_out): w as one (C_out, C_in*KH*KW) matrix turned.
    Both read and write whole tile rows, where a per-element gather read the weight strided."""
    if m * c * khw == 0:
        return lambda w: launch.new((m, khw * c), dt)
    turn = transposer(m, c, khw, dt) if mode == 0 else transposer(1, c, m * khw, dt)
    return lambda w: turn(w).reshape(m, khw * c)


@op
def conv2d_channels_last_native(dtype) -> bool:
    """Whether the convolutions read and write channels-last activations of `dtype` as they
    lie under the current precision: the wgmma kernels' (Hopper, 16-bit, TF32, or fp32 as
    3xTF32; switched on). Elsewhere a channels-last pass copies its activations to NCHW and
    back (_via_nchw), and NCHW activations run faster (ResNet-18 with FFMA fp32
    convolutions: 75.5 against 81.4 ms a step)."""
    dt = np.dtype(dtype)
    return (switches.on("WGMMA_CONV") and wgmma_available()
            and (dt in launch.HALVES or dt == np.float32)
            and (_tensor_cores(dt) or tf32x3.enabled(dt)))


@op
def conv2d_channels_last_pad(channels, kh, kw, dtype) -> int:
    """Zero input channels a channels-last convolution of `channels` inputs and a kh x kw
    filter should gain (on its input and weight) to run on the native kernels, which gather
    whole 16-byte chunks of channels: 3 -> 8 in 16 bits. ImageNet's stem (7x7/2, batch 128 at
    224 px, bf16, H200): forward with statistics 2.80 -> 0.70 ms, backward-weight 2.28 ->
    0.44 ms (through NCHW copies before). Filters the direct kernels take stay as they are."""
    dt = np.dtype(dtype)
    if not conv2d_channels_last_native(dt) or _direct_kmax(channels * kh * kw):
        return 0
    return -channels % _chunk(dt)


def _wgmma_conv(dt, c: int, nb: int, npix: int, m: int) -> bool:
    """Whether conv2d_wgmma.cu computes a forward / backward-data pass summing c channels
    (DPTRAIN_WGMMA_CONV not "0"): a Hopper GPU, a channels-last gather (each 16-byte chunk is then
    one tap) and a grid within its limits."""
    return (switches.on("WGMMA_CONV") and wgmma_available()
            and _channels_last(dt, c, nb) and -(-npix // 128) <= launch.INT32_MAX
            and -(-m // 128) <= launch.GRID_YZ_MAX)


def _wgmma_kernel(m, npix, dt, tma_fed=False):
    """conv2d_wgmma_kernel for m output channels: 32 / 64 / 128 of them per block (the
    smallest covering m), 128 pixels per block; the warp-specialized TMA-fed kernel instead
    where `tma_fed`. (name, kernel, grid, block, shared memory)"""
    bn, turn = _rows_tile(m), ()
    if tma_fed:
        name, threads = "conv2d_wgmma_tma_kernel", 384
        smem = _tma_smem(dt, bn)
        if bn == 64 and dt in launch.HALVES and switches.on("WGMMA_CONV_TURN"):
            turn = ("true",)  # the tile turned around (conv2d_wgmma.cu's TURN)
    else:
        name, threads = "conv2d_wgmma_kernel", 256
        smem = wgmma_smem(128, bn)
    fn = launch.kernel(WGMMA_CONV, name, launch.ctype(dt), str(bn), *turn, smem=smem)
    return name, fn, (-(-npix // 128), -(-m // bn)), (threads,), smem


def _tma_staging(dt, bn: int) -> int:
    """Bytes of a multiplying warpgroup's output staging in conv2d_wgmma_tma_kernel (its
    staging_bytes<T, BN>): 16-bit tiles of 64 or 128 channels, stored by TMA."""
    return 128 * bn * 2 if dt in launch.HALVES and bn >= 64 else 0


def _tma_smem(dt, bn: int) -> int:
    """conv2d_wgmma_tma_kernel's dynamic shared memory (its tma_smem_bytes<T, BN>): as many
    stages as fit in 192 KB beside the two staging tiles, at most 8, + slack to align."""
    stage, staging = (128 + bn) * 128, 2 * _tma_staging(dt, bn)
    return min(8, (192 * 1024 - staging) // stage) * stage + staging + 1024


def _tma_slower(mode, stride, ksize) -> bool:
    """Where conv2d_wgmma_kernel takes a pass the TMA kernel could: a strided backward-data
    of a 1x1 filter, whose phases are mostly tiles of zeros (2.4x slower on TMA than the
    gathering kernel's one grid with zero-filled taps, H100, before the TMA kernel's
    ping-pong). Needed as well as faster: such a pass gets no phases (_plan_implicit's
    `phased`), and the TMA kernel traps on a strided backward-data without them."""
    return mode == 1 and stride != (1, 1) and ksize == (1, 1)


def _tma_box(mode, stride, padding, ksize, src_hw, out_hw, c, dt):
    """The im2col box of conv2d_wgmma_tma_kernel's pixel map as (lower, upper, strides) per
    (h, w), or None where that kernel does not apply: DPTRAIN_WGMMA_CONV_TMA "0", c not
    in whole 128-byte slabs, phases whose base pixels differ, corners past the map's range,
    or where the gathering kernel is faster (_tma_slower).
    Forward: the bases o * s - p for o < out. Backward-data: per phase, its pixels i plus
    (r + p - rk) / s - (nk - 1) (conv2d_wgmma.cu), one box for every phase that has taps.
    (ResNet-18's strided backward-data into 64 channels: 169 us gathering, 95 us here.)"""
    if (not switches.on("WGMMA_CONV_TMA") or c % (128 // np.dtype(dt).itemsize)
            or _tma_slower(mode, stride, ksize)):
        return None
    lower, upper, steps = [], [], []
    for s, p, k, size, out in zip(stride, padding, ksize, src_hw, out_hw):
        if k - 1 > tma.OFFSET_MAX:
            return None
        if mode == 0:
            bases = {(-p, out)}
        else:
            bases = set()
            for r in range(s):
                rk = (r + p) % s
                nk = -(-(k - rk) // s) if rk < k else 0
                if nk:
                    bases.add(((r + p - rk) // s - (nk - 1), -(-(out - r) // s)))
        if len(bases) != 1:
            return None
        (low, count), step = bases.pop(), s if mode == 0 else 1
        high = low + step * (count - 1) - (size - 1)
        if not tma.CORNER_MIN <= min(low, high) <= max(low, high) <= tma.CORNER_MAX:
            return None
        lower.append(low), upper.append(high), steps.append(step)
    return tuple(lower), tuple(upper), tuple(steps)


def _mma_kernel(m, npix, dt):
    """conv2d.cu's implicit GEMM for m output channels: mma.sync (TF32, 16-bit) or FFMA.
    (name, kernel, grid, block, shared memory)"""
    bm = _rows_tile(m)
    if dt in launch.HALVES:
        smem = 3 * 2 * (tile_floats(bm, 32, True, 8) + tile_floats(128, 32, False, 8))
        name, ctype, block = "conv2d_b16_kernel", launch.ctype(dt), (128,)
    elif runtime.precision == "tf32":
        smem = 3 * 4 * (tile_floats(bm, 32, True, 4) + tile_floats(128, 32, False, 8))
        name, ctype, block = "conv2d_tf32_kernel", "float", (128,)
    else:
        bn = 256 if bm < 128 else 128  # few channels: 256 pixels (9-20% faster, 6 of 7 shapes)
        smem = 3 * 4 * (tile_floats(bm, 16, False, 4) + tile_floats(bn, 16, False, 4))
        fn = launch.kernel(CONV, "conv2d_fp32_kernel", "float", str(bm),
                           *((str(bn),) if bn != 128 else ()), smem=smem)
        return "conv2d_fp32_kernel", fn, (-(-npix // bn), -(-m // bm)), (256,), smem
    fn = launch.kernel(CONV, name, ctype, str(bm), smem=smem)
    return name, fn, (-(-npix // 128), -(-m // bm)), block, smem


@op
def conv2d_forward(x, w, b, stride, padding, *, channels_last=False, out=None, workspace=None):
    """y[n, co] = sum over (ci, kh, kw) of w[co, ci, kh, kw] * x[n, ci, shifted] (+ b[co]);
    x and y are (N, H, W, C) where `channels_last`."""
    return _forward(x, w, b, stride, padding, channels_last)(w, x, b, out, workspace)


def _forward(x, w, b, stride, padding, cl=False):
    f = "conv2d_forward"
    key = (f, sig(f, "x", x), sig(f, "w", w), sig(f, "b", b), _key(stride), _key(padding),
           bool(cl), runtime.precision)
    return plan(key, lambda: _plan_forward(x, w, b, stride, padding, bool(cl)))


def _plan_forward(x, w, b, stride, padding, cl=False):
    f = "conv2d_forward"
    dt = operand_dtype(f, x)
    launch.check_f32(f, "x", x, 4, dt)
    launch.check_f32(f, "w", w, 4, dt)
    (sh, sw), (ph, pw) = _pair(f, "stride", stride), _pair(f, "padding", padding)
    n, c, h, wd = _nchw_shape(x.shape) if cl else x.shape
    cout, cin, kh, kw = w.shape
    if cin != c:
        raise ValueError(f"cuda.{f}: x has {c} channels but w {w.shape} expects {cin}")
    if b is not None:
        launch.check_f32(f, "b", b, 1, dt)
        if b.shape[0] != cout:
            raise ValueError(f"cuda.{f}: b has shape {b.shape}, expected ({cout},)")
    ho, wo = _out_size(f, h, kh, sh, ph, "H"), _out_size(f, wd, kw, sw, pw, "W")
    kmax = _direct_kmax(cin * kh * kw)
    direct = kmax and cout <= DIRECT_MAX_M
    if cl and not direct and tf32x3.enabled(dt) and tf32x3.fits(x.size, w.size):
        # x's channels and w's C_in tripled
        run = _x3(lambda: _plan_implicit(f, 0, (n, cout, ho, wo), cout, 3 * c, h, wd, ho, wo,
                                         kh, kw, (sh, sw), (ph, pw), dt, cl=True),
                  lambda: {0: tf32x3.splitter(w.shape, 1, tf32x3.SECOND),
                           1: tf32x3.splitter(x.shape, 3, tf32x3.FIRST)})
        if run:
            return run
    if direct:
        cl_out = cl and _direct_cl_out(dt, cout)
        run = _plan_direct_forward((n, c, h, wd), w.shape, ho, wo, (sh, sw), (ph, pw), kmax, dt,
                                   cl_out)
        out_nchw = None if cl_out else (n, cout, ho, wo)
        return _via_nchw(run, f, {1: (n, c, h, wd)}, out_nchw, dt) if cl else run
    return _implicit_in_layout(
        lambda cl: _plan_implicit(f, 0, (n, cout, ho, wo), cout, c, h, wd, ho, wo, kh, kw,
                                  (sh, sw), (ph, pw), dt, cl),
        cl, f, (n, c, h, wd), (n, cout, ho, wo), dt)


def _implicit_in_layout(implicit, cl, f, src_shape, out_shape, dt):
    """The implicit-GEMM plan `implicit(cl)` of a pass whose source (argument 1) and output
    have the NCHW shapes `src_shape` and `out_shape`: channels-last where a kernel reads that
    layout (`cl` and implicit(True) plans one), else the NCHW plan, through copies if `cl`."""
    run = cl and implicit(True)
    if run:
        return run
    run = implicit(False)
    return _via_nchw(run, f, {1: src_shape}, out_shape, dt) if cl else run


def _x3(inner, splitters):
    """A 3xTF32 plan (tf32x3.py) of an fp32 pass, or None where no TF32 wgmma kernel takes
    it: the arguments at the positions of splitters() (position -> splitter) split into TF32
    parts, then the plan inner() makes under TF32 (None where it does not apply) run on them.
    The parts are new arrays: the workspace's copies are not the inner plan's operands."""
    with runtime.precision_scope("tf32"):  # the launchers read it while planning only
        run = inner()
    if not run:
        return None
    splits = splitters()

    def run_x3(*args):  # the plan's inputs, then out and workspace
        *ins, out, _ = args
        return run(*(splits[i](a) if i in splits else a for i, a in enumerate(ins)), out, None)

    run_x3.kernel = "3xtf32 " + run.kernel
    return run_x3


@op
def conv2d_forward_stats(x, w, stride, padding, *, channels_last=False, out=None,
                         workspace=None):
    """(y, mean, var): the bias-free conv2d_forward y and batch_norm_stats of it per output
    channel (over the batch and the pixels), for a batch norm that follows in training. Where
    the TMA-fed kernel runs a 16-bit forward, or the direct one writes channels-last, the
    kernel sums each tile's statistics and one small kernel merges them
    (batch_norm_tile_stats): no pass over y. Else the two ops."""
    run = _forward(x, w, None, stride, padding, channels_last)
    tiles = getattr(run, "stat_tiles", None)
    if tiles is None:
        y = run(w, x, None, out, workspace)
        return (y, *batch_norm_stats(y.reshape(-1, y.shape[-1]) if channels_last else y))
    ws = launch.new((tiles, 3, w.shape[0]), np.dtype(np.float32))
    y = run(w, x, None, out, workspace, stats=ws)
    return (y, *batch_norm_tile_stats(ws, y.size // w.shape[0]))


@op
def conv2d_backward_data(gy, w, x_shape, stride, padding, *, channels_last=False, out=None,
                         workspace=None):
    """Gradient of conv2d_forward with respect to x, of shape x_shape (both gy and x
    (N, H, W, C) where `channels_last`)."""
    return _backward_data(gy, w, x_shape, stride, padding, channels_last)(w, gy, None, out,
                                                                          workspace)


def _backward_data(gy, w, x_shape, stride, padding, cl=False):
    f = "conv2d_backward_data"
    key = (f, sig(f, "gy", gy), sig(f, "w", w), _key(x_shape), _key(stride), _key(padding),
           bool(cl), runtime.precision)
    return plan(key, lambda: _plan_backward_data(gy, w, x_shape, stride, padding, bool(cl)))


def _plan_backward_data(gy, w, x_shape, stride, padding, cl=False):
    f = "conv2d_backward_data"
    dt = operand_dtype(f, gy)
    launch.check_f32(f, "gy", gy, 4, dt)
    launch.check_f32(f, "w", w, 4, dt)
    (sh, sw), (ph, pw) = _pair(f, "stride", stride), _pair(f, "padding", padding)
    x_shape = tuple(int(s) for s in x_shape)
    n, c, h, wd = _nchw_shape(x_shape) if cl else x_shape
    cout, cin, kh, kw = w.shape
    if cin != c:
        raise ValueError(f"cuda.{f}: x_shape {x_shape} has {c} channels, w {w.shape} {cin}")
    ho, wo = _out_size(f, h, kh, sh, ph, "H"), _out_size(f, wd, kw, sw, pw, "W")
    gy_shape = (n, ho, wo, cout) if cl else (n, cout, ho, wo)
    if gy.shape != gy_shape:
        raise ValueError(f"cuda.{f}: gy has shape {gy.shape}, expected {gy_shape}")
    if cl and (kh, kw) == (1, 1) and (sh, sw) != (1, 1):
        run = _spread(lambda: _plan_backward_data(gy, w, (n, ho, wo, c), (1, 1), (0, 0), True),
                      f, (n, h, wd, c), (ho, wo), (sh, sw), (ph, pw), dt)
        if run:
            return run
    if cl and tf32x3.enabled(dt) and tf32x3.fits(gy.size, w.size):
        # gy's channels and w's C_out tripled
        run = _x3(lambda: _plan_implicit(f, 1, (n, c, h, wd), c, 3 * cout, ho, wo, h, wd, kh,
                                         kw, (sh, sw), (ph, pw), dt, cl=True),
                  lambda: {0: tf32x3.splitter(w.shape, 0, tf32x3.SECOND),
                           1: tf32x3.splitter(gy.shape, 3, tf32x3.FIRST)})
        if run:
            return run
    return _implicit_in_layout(
        lambda cl: _plan_implicit(f, 1, (n, c, h, wd), c, cout, ho, wo, h, wd, kh, kw,
                                  (sh, sw), (ph, pw), dt, cl),
        cl, f, (n, cout, ho, wo), (n, c, h, wd), dt)


def _spread(dense, f, x_shape, dense_hw, stride, padding, dt):
    """The channels-last backward-data of a strided 1x1 filter as the dense product at the
    pixels its taps reach (dense(): the plan of that stride-1 pass) spread onto x's grid with
    zeros between (transpose.spreader); None where DPTRAIN_CONV_SPREAD is "0" or no wgmma
    kernel takes the dense pass. The one plan over every pixel of x sums taps that are zeros
    at (s^2 - 1) / s^2 of them: ResNet-18's three shortcuts, batch 256 on 48 x 48 images,
    took 0.227 ms that way and 0.099 this way in fp16, 0.265 / 0.179 in TF32, 0.661 / 0.412
    in fp32 (3xTF32; H200). The same bits."""
    if not switches.on("CONV_SPREAD"):
        return None
    inner = dense()
    if "wgmma" not in inner.kernel:
        return None
    spread = spreader(x_shape, dense_hw, stride, padding, dt)

    def run(w, gy, bias, out, workspace=None):
        dx = output(f, out, x_shape, dt)
        return spread(inner(w, gy, None, None, workspace), dx)

    run.kernel = inner.kernel
    return run


@op
def conv2d_backward_weight(x, gy, w_shape, stride, padding, *, channels_last=False, out=None,
                           workspace=None):
    """Gradient of conv2d_forward with respect to w, of shape w_shape; bitwise repeatable.
    x and gy are (N, H, W, C) where `channels_last`."""
    return _backward_weight(x, gy, w_shape, stride, padding, channels_last)(x, gy, out,
                                                                            workspace)


def _backward_weight(x, gy, w_shape, stride, padding, cl=False):
    f = "conv2d_backward_weight"
    key = (f, sig(f, "x", x), sig(f, "gy", gy), _key(w_shape), _key(stride), _key(padding),
           bool(cl), runtime.precision)
    return plan(key, lambda: _plan_backward_weight(x, gy, w_shape, stride, padding, bool(cl)))


def conv2d_kernels(x, w, gy, stride, padding, channels_last=False) -> dict[str, str]:
    """The kernel each pass of this convolution runs, as the plans choose it now (for tests
    and benchmarks): {"forward": ..., "backward_data": ..., "backward_weight": ...}."""
    cl = channels_last
    return {"forward": _forward(x, w, None, stride, padding, cl).kernel,
            "backward_data": _backward_data(gy, w, x.shape, stride, padding, cl).kernel,
            "backward_weight": _backward_weight(x, gy, w.shape, stride, padding, cl).kernel}


def _plan_backward_weight(x, gy, w_shape, stride, padding, cl=False):
    f = "conv2d_backward_weight"
    dt = operand_dtype(f, x)
    launch.check_f32(f, "x", x, 4, dt)
    launch.check_f32(f, "gy", gy, 4, dt)
    (sh, sw), (ph, pw) = _pair(f, "stride", stride), _pair(f, "padding", padding)
    n, c, h, wd = _nchw_shape(x.shape) if cl else x.shape
    cout, cin, kh, kw = (int(s) for s in w_shape)
    if cin != c:
        raise ValueError(f"cuda.{f}: x has {c} channels but w_shape {tuple(w_shape)} expects {cin}")
    ho, wo = _out_size(f, h, kh, sh, ph, "H"), _out_size(f, wd, kw, sw, pw, "W")
    gy_shape = (n, ho, wo, cout) if cl else (n, cout, ho, wo)
    if gy.shape != gy_shape:
        raise ValueError(f"cuda.{f}: gy has shape {gy.shape}, expected {gy_shape}")
    if (cl and tf32x3.enabled(dt) and not _direct_kmax(cin * kh * kw)
            and min(cout, cin * kh * kw) >= X3_BWDW_MIN and tf32x3.fits(x.size, gy.size)):
        # the batch tripled
        run = _x3(lambda: _wgmma_bwdw(dt, cin, cout, 3 * n, cin * kh * kw)
                  and _plan_wgmma_backward_weight((3 * n, c, h, wd), (cout, cin, kh, kw), ho, wo,
                                                  (sh, sw), (ph, pw), dt, cl=True),
                  lambda: {0: tf32x3.splitter(x.shape, 0, tf32x3.FIRST),
                           1: tf32x3.splitter(gy.shape, 0, tf32x3.SECOND)})
        if run:
            return run
    if cl:
        if (_wgmma_bwdw(dt, cin, cout, n, cin * kh * kw) and not _direct_kmax(cin * kh * kw)
                and x.data.ptr % 16 == 0 and gy.data.ptr % 16 == 0):
            return _plan_wgmma_backward_weight((n, c, h, wd), (cout, cin, kh, kw), ho, wo,
                                               (sh, sw), (ph, pw), dt, cl=True)
        kmax = _direct_kmax(cin * kh * kw)
        if kmax and cout and _tensor_cores(dt):  # the direct kernel reads gy as it lies
            run = _plan_direct_backward_weight((n, c, h, wd), (cout, cin, kh, kw), ho, wo,
                                               (sh, sw), (ph, pw), kmax, dt, cl=True)
            return _via_nchw(run, f, {0: (n, c, h, wd)}, None, dt)
        # the NCHW plan, for operands as their copies will be (new, so 16-byte aligned)
        xn, gyn = launch.new((n, c, h, wd), dt), launch.new((n, cout, ho, wo), dt)
        run = _plan_backward_weight(xn, gyn, w_shape, stride, padding)
        if run.kernel == "conv2d_bwdw_nhwc_fp32_kernel":  # reads x channels-last: as it lies
            return _x_as_it_lies(run, _to_nchw((n, cout, ho, wo), dt))
        return _via_nchw(run, f, {0: (n, c, h, wd), 1: (n, cout, ho, wo)}, None, dt)
    out_shape = (cout, cin, kh, kw)
    m, ncol, k = cout, cin * kh * kw, n * ho * wo
    if m == 0 or ncol == 0:
        return _empty(lambda x, gy, out, workspace=None: output(f, out, out_shape, dt))
    kmax = _direct_kmax(ncol)
    if kmax:
        return _plan_direct_backward_weight(x.shape, out_shape, ho, wo, (sh, sw), (ph, pw), kmax,
                                            dt)
    if (_wgmma_bwdw(dt, cin, cout, n, ncol) and x.data.ptr % 16 == 0
            and gy.data.ptr % 16 == 0):
        return _plan_wgmma_backward_weight(x.shape, out_shape, ho, wo, (sh, sw), (ph, pw), dt)
    bm, bn = _rows_tile(m), _cols_tile(ncol)
    if -(-m // bm) > launch.GRID_YZ_MAX:
        raise ValueError(f"cuda.{f}: {m} output channels exceed the grid's limit")
    splits, chunk = split_k(-(-m // bm) * -(-ncol // bn), k, 512, 1024)
    # The tensor-core kernel reads gy in 16-byte chunks too (their alignment is part of the
    # plan's key); the FFMA one gathers it element by element, and only wider filters than
    # 1x1 gain from the x copy (3x3: 4-20% faster at 8 of 9 ResNet-18 and CNN shapes; 1x1
    # stride 2: 5-40% slower).
    nhwc = _nhwc(dt, cin, n) and (
        (ho * wo) % _chunk(dt) == 0 and gy.data.ptr % 16 == 0 if _tensor_cores(dt)
        else kh * kw > 1)
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
    fn = launch.kernel(CONV, name, launch.ctype(dt), str(bm), str(bn), *slab, smem=smem)
    if nhwc and _tensor_cores(dt):
        pad = 8 if dt in launch.HALVES else 4
        smem_cl = 3 * dt.itemsize * (tile_floats(bm, 32, True, pad) + tile_floats(bn, 32, False, 8))
        name_cl, slab_cl = "conv2d_bwdw_nhwc_kernel", ()
    elif nhwc:  # 16-wide K slabs, 3 stages (8-wide, 4: within 2% at 128 rows, 20% slower at 64)
        smem_cl = 3 * 4 * (tile_floats(bm, 16, False, 4) + tile_floats(bn, 16, False, 4))
        name_cl, slab_cl = "conv2d_bwdw_nhwc_fp32_kernel", ()
    if nhwc:
        fn_cl = launch.kernel(NHWC, name_cl, launch.ctype(dt), str(bm), str(bn), *slab_cl,
                              smem=smem_cl)
        to_nhwc = _to_nhwc(x.shape, dt)
    grid = (-(-ncol // bn), -(-m // bm), splits)
    # BWDW_PARAMS after (x, gy, gw, ws): Nb Cout Cin H W Ho Wo KH KW sh sw ph pw splits kchunk.
    tail = (i32(n), i32(cout), i32(cin), i32(h), i32(wd), i32(ho), i32(wo), i32(kh),
            i32(kw), i32(sh), i32(sw), i32(ph), i32(pw), i32(splits), i32(chunk))
    reduce = reducer(CONV, splits, 1, m, ncol, ncol, 0, 0, dt) if splits > 1 else None

    def run(x, gy, out, workspace=None):
        gw = output(f, out, out_shape, dt)
        ws = launch.new((splits, m, ncol), np.float32) if reduce else gw
        if nhwc:
            x_nhwc = take(workspace, "x", x, to_nhwc)
            fn_cl(grid, (256,), (x_nhwc, gy, gw, ws) + tail, shared_mem=smem_cl)
        else:
            fn(grid, (256,), (x, gy, gw, ws) + tail, shared_mem=smem)
        if reduce:
            reduce(ws, gw, gw)
        return gw

    run.kernel = name_cl if nhwc else name
    return run


def _x_as_it_lies(run, gy_to_nchw):
    """A channels-last backward-weight plan from the NCHW plan `run` of an FFMA kernel that
    reads x's channels-last copy (conv2d_bwdw_nhwc_fp32_kernel): handed a workspace that
    holds x itself as that copy, and gy copied to NCHW. (x -> NCHW -> NHWC, as _via_nchw
    copies it, made ResNet-18's layer1 pass 1.93 ms where this takes 1.73, H200.)"""
    def run_cl(x, gy, out, workspace=None):
        kept = Workspace()
        kept.keep("x", x, x)
        return run(x, gy_to_nchw(gy), out, kept)

    run_cl.kernel = run.kernel
    return run_cl


def _wgmma_bwdw(dt, cin: int, cout: int, nb: int, rows: int) -> bool:
    """Whether conv2d_bwdw_wgmma.cu computes a backward-weight pass (DPTRAIN_WGMMA_BWDW not
    "0") of `rows` = C_in*KH*KW: a Hopper GPU, 16-bit operands (or TF32 ones, see
    TF32_BWDW_MIN_ROWS), both channel counts in whole 16-byte chunks and the NHWC copies
    within their grids."""
    tf32_env = switches.value("WGMMA_BWDW_TF32", "")
    tf32 = (dt == np.float32 and runtime.precision == "tf32" and tf32_env != "0"
            and (tf32_env == "1" or rows >= TF32_BWDW_MIN_ROWS))
    return (switches.on("WGMMA_BWDW") and (dt in launch.HALVES or tf32)
            and wgmma_available() and _channels_last(dt, cin, nb)
            and _channels_last(dt, cout, nb) and -(-cout // 256) <= launch.GRID_YZ_MAX)


def _pixel_splits(tiles: int, npix: int, outputs: int, blocks: int, fill: int,
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


def _bwdw_tma_route(dt, x_shape, w_shape, ho, wo, stride, padding):
    """(box, tiling) of conv2d_bwdw_tma_kernel: the im2col box of its map of x (the
    forward's: _tma_box) and its tiles and splits (_bwdw_tma_tiling); or None where that
    kernel does not take the pass: DPTRAIN_BWDW_TMA "0", not 16-bit, a stride (ResNet-18's
    three stride-2 3x3 passes took 0.086, 0.078 and 0.082 ms this way, 0.063, 0.064 and 0.079
    gathering; fp16, H200), C_in*KH*KW not in whole tiles, or no TMA box for the forward."""
    (n, c, h, wd), (cout, _, kh, kw) = x_shape, w_shape
    if (not switches.on("BWDW_TMA") or dt not in launch.HALVES
            or tuple(stride) != (1, 1)):
        return None
    tiling = _bwdw_tma_tiling(cout, c * kh * kw, n * ho * wo)
    box = tiling and _tma_box(0, stride, padding, (kh, kw), (h, wd), (ho, wo), c, dt)
    return (box, tiling) if box else None


def _bwdw_tma_tiling(cout: int, ncol: int, npix: int):
    """(rows, cols, splits, chunk) of conv2d_bwdw_tma_kernel for cout output channels by ncol
    (tap, c) over npix pixels, or None where no tile fits ncol: 64 x 192 tiles, or 128 x 128
    where there are more than 64 channels, whichever the split estimate (_pixel_splits, one
    block an SM) times the tile's multiply-adds and BWDW_WIDE_RATE says is faster."""
    best = None
    for rows, cols, rate in ((128, 128, 1.0), (64, 192, BWDW_WIDE_RATE)):
        if ncol % cols or (rows == 128 and cout <= 64):
            continue
        tiles = -(-cout // rows) * (ncol // cols)
        # the reduce's cost per slab time an estimate (not measured)
        splits, chunk, cost = _pixel_splits(tiles, npix, ncol * cout, launch.sm_count(),
                                            fill=2, reduce_cost=3.3e-6, most=256)
        time = cost * rows * cols * rate
        if best is None or time < best[0]:
            best = (time, rows, cols, splits, chunk)
    return best and best[1:]


def _bwdw_tma_smem(rows: int, cols: int) -> int:
    """conv2d_bwdw_tma_kernel's dynamic shared memory (its stages<BJ, R>): stages of a 64-pixel
    slab of rows + cols rows, as many as fit in 192 KB, at most 8, + slack to align."""
    stage = (rows + cols) * 128
    return min(8, 192 * 1024 // stage) * stage + 1024


def _bwdw_wgmma_reducer(splits: int, cout: int, c: int, taps: int, dt):
    """reduce(ws, gw): the (splits, taps * c, cout) float partials ws summed in split order
    into gw (cout, c, taps). conv2d_bwdw_reduce_tiled_kernel where its tiles (32 output
    channels by up to 64 (tap, c) rows) fill the SMs at least once, both sides coalesced;
    else a thread per output, whose stores are strided (DPTRAIN_BWDW_REDUCE_TILED: "1"
    always tiled, "0" never). The same bits either way. (Two earlier tiled versions, used
    for every pass, took 330 and 265 against 219 us a ResNet-18 fp16 step: the small passes'
    few tiles left SMs idle.)"""
    ctile = max(1, 64 // taps)  # the kernel's 64 rows
    grid = (-(-cout // 32), -(-c // ctile))
    env = switches.value("BWDW_REDUCE_TILED", "")
    if taps <= 64 and grid[1] <= launch.GRID_YZ_MAX and (
            env == "1" or env != "0" and grid[0] * grid[1] >= launch.sm_count()):
        fn = launch.kernel(WGMMA_BWDW, "conv2d_bwdw_reduce_tiled_kernel", launch.ctype(dt))
        tail = (i32(splits), i32(cout), i32(c), i32(taps), i32(ctile))
        return lambda ws, gw: fn(grid, (256,), (ws, gw) + tail)
    fn = launch.kernel(WGMMA_BWDW, "conv2d_bwdw_wgmma_reduce_kernel", launch.ctype(dt))
    grid = (max(1, min(-(-taps * c * cout // 256), launch.sm_count() * 8)),)
    tail = (i32(splits), i32(cout), i32(c), i32(taps))
    return lambda ws, gw: fn(grid, (256,), (ws, gw) + tail)


def _plan_tma_backward_weight(x_shape, w_shape, ho, wo, stride, padding, dt, box, tiling,
                              cl):
    """conv2d_bwdw_tma_kernel: tiles of output channels by (tap, c) (_bwdw_tma_tiling), the
    pixels split into chunks of whole slabs, one block an SM walking the tiles; several
    splits' float partials summed by _bwdw_wgmma_reducer's kernel. Operands as
    _plan_wgmma_backward_weight's."""
    f = "conv2d_backward_weight"
    (n, c, h, wd), (cout, _, kh, kw) = x_shape, w_shape
    ncol, npix = c * kh * kw, n * ho * wo
    rows, cols, splits, chunk = tiling
    tiles_m, tiles_j = -(-cout // rows), ncol // cols
    smem = _bwdw_tma_smem(rows, cols)
    fn = launch.kernel(WGMMA_BWDW, "conv2d_bwdw_tma_kernel", launch.ctype(dt), str(cols),
                       str(rows // 64), smem=smem)
    grid = (min(tiles_m * tiles_j * splits, launch.sm_count()),)
    tail = (i32(n), i32(cout), i32(c), i32(ho), i32(wo), i32(kw), i32(stride[0]),
            i32(stride[1]), i32(padding[0]), i32(padding[1]), i32(ncol), i32(tiles_m),
            i32(tiles_j), i32(splits), i32(chunk))
    x_nhwc = (lambda a: a) if cl else _to_nhwc(x_shape, dt)
    gy_nhwc = (lambda a: a) if cl else transposer(n, cout, ho * wo, dt)
    reduce = _bwdw_wgmma_reducer(splits, cout, c, kh * kw, dt)

    def run(x, gy, out, workspace=None):
        gw = output(f, out, tuple(w_shape), dt)
        ws = launch.new((splits, ncol, cout), np.float32) if splits > 1 else gw
        xn, gyn = take(workspace, "x", x, x_nhwc), take(workspace, "gy", gy, gy_nhwc)
        maps = (tma.im2col(xn, (n, h, wd, c), *box, channels=64, pixels=64),
                tma.tiled(gyn, npix, cout, 64, 64))
        fn(grid, (384,), maps + (gw, ws) + tail, shared_mem=smem)
        if splits > 1:
            reduce(ws, gw)
        return gw

    run.kernel, run.splits, run.tile = "conv2d_bwdw_tma_kernel", splits, (rows, cols)
    return run


def _plan_wgmma_backward_weight(x_shape, w_shape, ho, wo, stride, padding, dt, cl=False):
    """conv2d_bwdw_wgmma.cu: 128 rows of (tap, c) by BN output channels per block (64 / 128 /
    256, the smallest covering them; 128 in TF32), the pixels split over grid z; or the
    TMA-fed kernel where _bwdw_tma_route gives a route. x_shape is NCHW; `cl`: x and gy come
    channels-last already (no copies)."""
    f = "conv2d_backward_weight"
    (n, c, h, wd), (cout, _, kh, kw) = x_shape, w_shape
    launch.check_int32(f, n * c * h * wd, n * cout * ho * wo)
    route = _bwdw_tma_route(dt, x_shape, w_shape, ho, wo, stride, padding)
    if route:
        return _plan_tma_backward_weight(x_shape, w_shape, ho, wo, stride, padding, dt, *route,
                                         cl)
    ncol, npix = c * kh * kw, n * ho * wo
    bn = 64 if cout <= 64 else 128 if cout <= 128 else 256
    if dt == np.float32:  # TF32 stages its slabs in registers: 128 x 128 tiles only
        bn = 128
    smem = wgmma_smem(128, bn)
    tiles = -(-ncol // 128) * -(-cout // bn)
    # a slab of one block ~1 us; the reduce about 3 us per 2.4 M outputs per split (~3 TB/s)
    splits, chunk, _ = _pixel_splits(tiles, npix, ncol * cout,
                                     launch.sm_count() * (2 if bn == 64 else 1), fill=4,
                                     reduce_cost=1.33e-6, most=64)
    if dt == np.float32:  # TF32: slabs stored K-major from registers
        name = "conv2d_bwdw_wgmma_tf32_kernel"
        fn = launch.kernel(WGMMA_BWDW, name, str(bn), smem=smem)
    else:
        name = "conv2d_bwdw_wgmma_kernel"
        fn = launch.kernel(WGMMA_BWDW, name, launch.ctype(dt), str(bn), smem=smem)
    grid = (-(-ncol // 128), -(-cout // bn), splits)
    tail = (i32(n), i32(cout), i32(c), i32(h), i32(wd), i32(ho), i32(wo), i32(kh), i32(kw),
            i32(stride[0]), i32(stride[1]), i32(padding[0]), i32(padding[1]), i32(splits),
            i32(chunk))
    x_nhwc = (lambda a: a) if cl else _to_nhwc(x_shape, dt)
    gy_nhwc = (lambda a: a) if cl else transposer(n, cout, ho * wo, dt)
    if splits > 1:
        reduce = _bwdw_wgmma_reducer(splits, cout, c, kh * kw, dt)

    def run(x, gy, out, workspace=None):
        gw = output(f, out, tuple(w_shape), dt)
        ws = launch.new((splits, ncol, cout), np.float32) if splits > 1 else gw
        xn, gyn = take(workspace, "x", x, x_nhwc), take(workspace, "gy", gy, gy_nhwc)
        fn(grid, (256,), (xn, gyn, gw, ws) + tail, shared_mem=smem)
        if splits > 1:
            reduce(ws, gw)
        return gw

    run.kernel, run.splits = name, splits
    return run
