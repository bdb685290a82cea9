"""What the convolution planners share: 16-byte chunks, tile sizes, layout copies around a
plan (NCHW <-> channels-last), 3xTF32 around a plan, and the empty plan.

A plan is run(*inputs, out, workspace, **kw) -> result, with `.kernel` naming what it runs.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.conv import ahead
from dptrain.backend.cuda.gemm import output
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.cuda.transpose import copy, strided_copy, transposer
from dptrain.backend.cuda.workspace import Workspace


def chunk(dt) -> int:
    """Elements in one 16-byte chunk of dtype dt."""
    return 16 // np.dtype(dt).itemsize


def tensor_cores(dt) -> bool:
    """Whether dtype dt computes on tensor cores now: 16-bit, or float32 under TF32."""
    return np.dtype(dt) in launch.HALVES or runtime.precision == "tf32"


def chunks_fit(dt, c: int, nb: int) -> bool:
    """Whether c channels of a batch of nb gather as 16-byte chunks: c in whole chunks and
    the NHWC copy (to_nhwc) within its grid."""
    return c % chunk(dt) == 0 and nb <= launch.GRID_YZ_MAX and c <= 32 * launch.GRID_YZ_MAX


def channels_last(dt, c: int, nb: int) -> bool:
    """Whether a channels-last tensor-core kernel may gather c channels of a batch of nb."""
    return tensor_cores(dt) and chunks_fit(dt, c, nb)


def rows_tile(m: int) -> int:
    """Block tile along the output channels: the smallest of 32/64/128 that covers m."""
    return 32 if m <= 32 else 64 if m <= 64 else 128


def cols_tile(n: int) -> int:
    """Backward-weight's tile along C_in*KH*KW: 32, 96 or 128, whichever pads n least (ties
    to the larger); 3x3 filters give multiples of 9, which 96 fits where 128 leaves a quarter
    of the last tile idle (288 = 3 x 96)."""
    return min((-(-n // t) * t - n, -t, t) for t in (32, 96, 128))[2]


def weight_reorder(mode, m, c, khw, dt):
    """run(w) -> the (m, khw * c) array wr[m][t * c + ci] of the weight w (C_out, C_in, KH,
    KW): the implicit GEMM's dense, K-major operand (K in (kh, kw, c) order), as one tiled
    transpose. Forward (m = C_out, c = C_in): each output channel's (C_in, KH*KW) matrix
    turned; backward-data (m = C_in, c = C_out): w as one (C_out, C_in*KH*KW) matrix turned.
    Both read and write whole tile rows, where a per-element gather read the weight strided.
    A 1x1 filter's forward operand is the weight as it lies: w itself, where contiguous and
    16-byte aligned (ResNet-50 fp16 at 224 px copied 36 a step: 0.10 ms of kernels, H200)."""
    if m * c * khw == 0:
        return lambda w: launch.new((m, khw * c), dt)
    if mode == 0 and khw == 1:
        return lambda w: (w if w.flags.c_contiguous and w.data.ptr % 16 == 0
                          else copy(w)).reshape(m, c)
    turn = transposer(m, c, khw, dt) if mode == 0 else transposer(1, c, m * khw, dt)

    def run(w):  # reordered ahead with the step's other weights (conv/ahead.py), or now
        ready = ahead.ready_operand(w, mode)
        return ready if ready is not None else turn(w).reshape(m, khw * c)

    return run


def to_nhwc(shape, dt):
    """run(a) -> a new (N, H, W, C) copy of the contiguous NCHW array a of `shape`."""
    nb, c, h, w = shape
    transpose = transposer(nb, c, h * w, dt)
    return lambda a: transpose(a).reshape(nb, h, w, c)


def to_nchw(shape, dt):
    """run(a) -> the contiguous (N, H, W, C) array a of NCHW `shape` as NCHW: a new copy, or
    a view of a where one layout is the other (one channel or one pixel)."""
    nb, c, h, w = shape
    if c == 1 or h * w == 1:
        return lambda a: a.reshape(nb, c, h, w)
    transpose = transposer(nb, h * w, c, dt)
    return lambda a: transpose(a).reshape(nb, c, h, w)


def via_nchw(run, fn_name, acts, out_shape, dt):
    """A channels-last plan from the NCHW plan `run`: the arguments at `acts` (position ->
    their NCHW shape) copied to NCHW first, and an NCHW output of `out_shape` (None: one that
    is not an activation) copied to channels-last. For the passes no channels-last kernel
    takes (direct and mma.sync kernels, non-Hopper GPUs): right, not fast."""
    to_nchw_ = {i: to_nchw(shape, dt) for i, shape in acts.items()}
    to_nhwc_ = to_nhwc(out_shape, dt) if out_shape else None

    def run_cl(*args, **kw):  # the plan's inputs, then out and workspace
        *ins, out, workspace = args
        ins = [to_nchw_[i](a) if i in to_nchw_ else a for i, a in enumerate(ins)]
        if to_nhwc_ is None:
            return run(*ins, out, workspace, **kw)
        y = to_nhwc_(run(*ins, None, workspace))
        if out is None:
            return y
        return strided_copy(output(fn_name, out, y.shape, dt), y, launch.estrides(y))

    run_cl.kernel = run.kernel
    run_cl.stat_tiles = getattr(run, "stat_tiles", None) if to_nhwc_ is None else None
    run_cl.stat_rows = getattr(run, "stat_rows", None)
    return run_cl


def x_as_it_lies(run, gy_to_nchw):
    """A channels-last backward-weight plan from the NCHW plan `run` of an FFMA kernel that
    reads x's channels-last copy (conv2d_bwdw_nhwc_fp32_kernel): handed a workspace that
    holds x itself as that copy, and gy copied to NCHW. (x -> NCHW -> NHWC, as via_nchw
    copies it, made ResNet-18's layer1 pass 1.93 ms where this takes 1.73, H200.)"""
    def run_cl(x, gy, out, workspace=None):
        kept = Workspace()
        kept.keep("x", x, x)
        return run(x, gy_to_nchw(gy), out, kept)

    run_cl.kernel = run.kernel
    return run_cl


def x3(inner, splitters):
    """A 3xTF32 plan (tf32x3.py) of an fp32 pass: the arguments at the positions of
    splitters() (position -> splitter) split into TF32 parts, then the plan inner() makes
    under TF32 runs on them. The parts are new arrays: the workspace's copies are not the
    inner plan's operands."""
    with runtime.precision_scope("tf32"):  # the launchers read it while planning only
        run = inner()
    splits = splitters()

    def run_x3(*args):  # the plan's inputs, then out and workspace
        *ins, out, _ = args
        return run(*(splits[i](a) if i in splits else a for i, a in enumerate(ins)), out, None)

    run_x3.kernel = "3xtf32 " + run.kernel
    return run_x3


def empty(fn_name, inputs: int, out_shape, dt):
    """A plan with nothing to compute (an empty batch or channel axis): its output only, of
    a pass with `inputs` inputs before out."""
    def run(*args, **kw):  # the plan's inputs, then out and workspace
        return output(fn_name, args[inputs] if len(args) > inputs else None, out_shape, dt)

    run.kernel = "none"
    return run
