"""Launchers of kernels/norm.cu: batch normalisation, forward, running estimates, backward.

Conventions (the .cu file's header has the kernel side; dptrain/backend/cpu/norm.py is the
reference with the same signatures):
  * x is contiguous (N, C, ...): axis 1 the channel, the rest reduced; per-channel arrays
    (mean, var, weight, bias) contiguous (C,), sums (2, C), all of x's float dtype, or
    float32 for a 16-bit x (mixed precision: fp32 statistics and parameters, ``stat_dtype``).
  * Channel reductions (batch_norm_stats, batch_norm_mean, batch_norm_var,
    batch_norm_backward_reduce): each channel split over enough blocks to fill the GPU,
    double partials added in a fixed order by a finalize kernel: deterministic, no atomics.
    batch_norm_backward_reduce_joined is the backward sums of a gradient that comes in two
    parts or through the ReLU after a residual add: the channels-last kernel joins and
    stores it as it sums (JOIN), where add / relu_backward / relu_backward_sum would first
    write it and the sums read it again.
  * Every kernel moves 16-byte groups of x (launch.whole_groups decides, per call, whether
    they are whole and aligned) and indexes in 32 bits.
  * Outputs are new arrays written with `=`; batch_norm_update_ works in place and adds one
    to the int64 0-d num_batches_tracked on the device (no host sync).
  * A 2-D x (rows, C), which is how a channels-last activation (N, H, W, C) comes (the
    engine reshapes it), runs the *_cl kernels where C is a whole number of 16-byte groups,
    at most CL_THREADS of them, and every array is 16-byte aligned: each thread moves a group of
    channels of a row, coalesced (the NCHW kernels would read it one strided element at a
    time, S = 1).
  * Host scalars (eps, momentum, count) are cast to the element type; they are constants of a
    layer, so a captured graph that bakes them in stays right.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from dptrain.backend.cuda import elementwise, launch
from dptrain.backend.registry import op
from dptrain.backend.spread import Spread

NORM = "norm.cu"
# norm.cu's: a block's threads cover at least one row, so C is at most CL_THREADS groups
# (2048 channels in 16 bits: ResNet-50's widest, whose NCHW kernels took 2.5 ms of a
# 27 ms step at 1024 channels alone, batch 128 at 224 px)
CL_THREADS = 256
FOLD_BLOCK = (32, 32)  # the finalize kernels' blocks: 32 outputs x FOLD_LANES
TILE_PIXELS = 128  # the pixels of a convolution tile (batch_norm_tile_stats)
# Blocks an SM of the channels-last reductions: 3, but 2 for the backward's (with its ring,
# 3 ran 25% slower on ResNet-50's shapes, H200: 2.36 against 1.84 ms a step of them)
SUMS_PER_SM, BACKWARD_PER_SM = 3, 2
# norm.cu's CL_RING: every channels-last kernel keeps its loads in flight in a ring of this
# many bytes of dynamic shared memory a block
RING_BYTES = 8 * CL_THREADS * 16
# Blocks an SM of the channels-last elementwise kernels: 4, or 2 where a thread would then
# move fewer than MAP_THREAD_ROWS rows (each block loads its channels' constants first).
# ResNet-18 fp16 at batch 256, H200: 2 an SM on its layer2-4 shapes made the step 55 us
# faster than 4 everywhere (BENCHMARKS.md)
MAP_PER_SM, MAP_FEW_PER_SM, MAP_THREAD_ROWS = 4, 2, 32


def stat_dtype(x) -> np.dtype:
    """The dtype of the per-channel arrays for activations x: float32 for 16-bit x."""
    return np.dtype(np.float32) if x.dtype in launch.HALVES else x.dtype


def _geometry(op, x):
    """(N, C, S) of x, checked: float (16-bit too), contiguous, at least 2-D, 32-bit
    per-channel counts."""
    launch.check_float(op, x, half=True)
    launch.check_contiguous(op, x)
    if x.ndim < 2:
        raise ValueError(f"cuda.{op}: x must have a channel axis (N, C, ...), got {x.shape}")
    n, c = int(x.shape[0]), int(x.shape[1])
    s = math.prod(int(d) for d in x.shape[2:])
    launch.check_int32(op, n * s, x.size)
    return n, c, s


def per_channel(op, c, x, **arrays):
    stat = stat_dtype(x)
    for name, a in arrays.items():
        launch.check_arrays(op, a)
        if a.dtype != stat:
            raise TypeError(f"cuda.{op}: {name} must be {stat} for {x.dtype} x, got {a.dtype}")
        launch.check_contiguous(op, a)
        launch.check_shape(op, a, (c,), name)


def _channel_sums(name, x, geometry, rows, grouped, args):
    """The per-channel double sums of kernel `name` (rows of them per channel) as a (splits,
    rows, C) array of partials, each channel's N * G groups (G = ceil(S / group size)) split
    over enough blocks to fill the GPU; a finalize kernel adds them. `geometry`: x's
    (N, C, S); `grouped`: the arrays the kernel reads in groups (x, gy). (partials, splits)"""
    n, c, s = geometry
    threads = launch.block_threads(warps=True)
    _, cap = launch.current_launch_shape()
    blocks = cap or launch.sm_count() * launch.BLOCKS_PER_SM
    grid_x = max(1, min(c, blocks))
    items = n * -(-s // launch.group_size(x.dtype))
    # at least a group per thread, and no more than the grid-stride cap
    splits = max(1, min(blocks // grid_x, items // threads, launch.GRID_YZ_MAX))
    chunk = -(-items // splits)
    ws = launch.new((splits, rows, c), np.dtype(np.float64))
    fn = launch.kernel(NORM, name, launch.ctype(x.dtype))
    fn((grid_x, splits), (threads,), (ws, *args, np.int32(n), np.int32(c), np.int32(s),
                                      np.int32(chunk), launch.whole_groups(s, *grouped)))
    return ws, splits


def _cl(x, *arrays) -> bool:
    """Whether the channels-last kernels take x (and the other activations of its shape)."""
    c = int(x.shape[-1])
    group = launch.group_size(x.dtype)
    return (x.ndim == 2 and 0 < c <= CL_THREADS * group and c % group == 0
            and x.shape[0] > 0 and all(a.data.ptr % 16 == 0 for a in (x, *arrays)))


def _cl_grid(x, per_sm):
    """(rows, C, blocks, chunk) of a channels-last launch over x: about `per_sm` blocks per
    SM (fewer where the rows run out), each taking a chunk of rows."""
    rows, c = (int(d) for d in x.shape)
    per_pass = CL_THREADS // (c // launch.group_size(x.dtype))  # rows a block moves at once
    blocks = max(1, min(per_sm * launch.sm_count(), -(-rows // per_pass), launch.GRID_YZ_MAX))
    chunk = -(-rows // blocks)
    return rows, c, -(-rows // chunk), chunk


def _cl_sums(name, x, rows_per_channel, args, per_sm=SUMS_PER_SM, targs=None):
    """The channels-last twin of _channel_sums: (partials (splits, R, C), splits), block y of
    grid (1, splits) summing its chunk of x's rows, about per_sm blocks an SM. `targs`: the
    kernel's template arguments (x's element type by default)."""
    rows, c, splits, chunk = _cl_grid(x, per_sm)
    ws = launch.new((splits, rows_per_channel, c), np.dtype(np.float64))
    fn = launch.kernel(NORM, name, *(targs or (launch.ctype(x.dtype),)), smem=RING_BYTES)
    fn((1, splits), (CL_THREADS,), (ws, *args, np.int32(rows), np.int32(c), np.int32(chunk)),
       shared_mem=RING_BYTES)
    return ws, splits


def _cl_map(name, x, args):
    """Launch the channels-last elementwise kernel `name` over x's rows, as _cl_sums, with
    MAP_PER_SM blocks an SM, or MAP_FEW_PER_SM where the rows are few."""
    rows, c = (int(d) for d in x.shape)
    per_pass = CL_THREADS // (c // launch.group_size(x.dtype))
    many = rows >= MAP_PER_SM * launch.sm_count() * per_pass * MAP_THREAD_ROWS
    rows, c, blocks, chunk = _cl_grid(x, MAP_PER_SM if many else MAP_FEW_PER_SM)
    fn = launch.kernel(NORM, name, launch.ctype(x.dtype), smem=RING_BYTES)
    fn((1, blocks), (CL_THREADS,), args + (np.int32(rows), np.int32(c), np.int32(chunk)),
       shared_mem=RING_BYTES)


def _groups(op, x):
    """(N, C, S, G) of the elementwise kernels' grid over x (checked by _geometry): N * C
    planes of S elements, G groups each."""
    n, c, s = _geometry(op, x)
    g = -(-s // launch.group_size(x.dtype))
    launch.check_int32(op, n * c * g)
    return n, c, s, g


def _finalize(out, ws, splits, divisor, add_to=None):
    """out (any shape, R * C values) = the partials' sums (a fixed order) / divisor; with
    add_to (two (C,) arrays, R = 2), row r is also added into add_to[r]."""
    fn = launch.kernel(NORM, "bn_finalize_kernel", launch.ctype(out.dtype))
    add0, add1 = add_to if add_to is not None else (launch.NULL, launch.NULL)
    fn((-(-out.size // 32),), FOLD_BLOCK, (out, ws, np.int32(splits), np.int32(out.size),
                                           np.float64(divisor), add0, add1,
                                           np.int32(out.shape[-1])))
    return out


@op
def batch_norm_mean(x):
    """Per-channel mean of x over every axis but 1."""
    n, c, s = _geometry("batch_norm_mean", x)
    mean = launch.new((c,), stat_dtype(x))
    if c:
        if n * s == 0:
            raise ValueError(f"cuda.batch_norm_mean: no elements per channel in {x.shape}")
        if _cl(x):
            ws, splits = _cl_sums("bn_mean_partial_cl_kernel", x, 1, (x,))
        else:
            ws, splits = _channel_sums("bn_mean_partial_kernel", x, (n, c, s), 1, (x,), (x,))
        _finalize(mean, ws, splits, n * s)
    return mean


@op
def batch_norm_var(x, mean):
    """Per-channel mean of (x - mean)^2 over every axis but 1 (the biased variance)."""
    n, c, s = _geometry("batch_norm_var", x)
    per_channel("batch_norm_var", c, x, mean=mean)
    var = launch.new((c,), stat_dtype(x))
    if c:
        if n * s == 0:
            raise ValueError(f"cuda.batch_norm_var: no elements per channel in {x.shape}")
        if _cl(x):
            ws, splits = _cl_sums("bn_var_partial_cl_kernel", x, 1, (x, mean))
        else:
            ws, splits = _channel_sums("bn_var_partial_kernel", x, (n, c, s), 1, (x,),
                                       (x, mean))
        _finalize(var, ws, splits, n * s)
    return var


@op
def batch_norm_stats(x):
    """(mean, var): the per-channel mean and biased variance of x over every axis but 1, in
    one read of x."""
    n, c, s = _geometry("batch_norm_stats", x)
    mean, var = launch.new((c,), stat_dtype(x)), launch.new((c,), stat_dtype(x))
    if c:
        if n * s == 0:
            raise ValueError(f"cuda.batch_norm_stats: no elements per channel in {x.shape}")
        if _cl(x):
            ws, splits = _cl_sums("bn_stats_partial_cl_kernel", x, 2, (x,))
        else:
            ws, splits = _channel_sums("bn_stats_partial_kernel", x, (n, c, s), 2, (x,), (x,))
        fn = launch.kernel(NORM, "bn_stats_finalize_kernel", launch.ctype(x.dtype))
        fn((-(-c // 32),), FOLD_BLOCK, (mean, var, ws, x, np.int32(splits), np.int32(c),
                                        np.int32(s), np.float64(n * s)))
    return mean, var


def batch_norm_tile_stats(ts, count, rows=TILE_PIXELS):
    """(mean, var) (float32) from a convolution's per-tile statistics ts (tiles, 3, C) of
    `count` pixels (conv2d_wgmma.cu's `stats`; tiles of `rows` pixels but the last): what
    batch_norm_stats of its output gives, to rounding. The tiles are split over enough
    blocks to fill the GPU, then finalized as batch_norm_stats' partials are."""
    tiles, _, c = ts.shape
    mean, var = launch.new((c,), np.dtype(np.float32)), launch.new((c,), np.dtype(np.float32))
    groups = -(-c // 32)
    splits = max(1, min(-(-tiles // (4 * FOLD_BLOCK[1])),
                        launch.sm_count() * launch.BLOCKS_PER_SM // groups, launch.GRID_YZ_MAX))
    chunk = -(-tiles // splits)
    splits = -(-tiles // chunk)
    ws = launch.new((splits, 2, c), np.dtype(np.float64))
    fn = launch.kernel(NORM, "bn_tile_stats_partial_kernel", "float")
    fn((groups, splits), FOLD_BLOCK, (ws, ts, np.int32(tiles), np.int32(c),
                                      np.int32(rows), np.float64(count), np.int32(chunk)))
    fn = launch.kernel(NORM, "bn_stats_finalize_kernel", "float")
    fn((groups,), FOLD_BLOCK, (mean, var, ws, ts, np.int32(splits), np.int32(c), np.int32(1),
                               np.float64(count)))
    return mean, var


@op
def batch_norm_forward(x, mean, var, weight, bias, eps, residual=None, relu=False,
                       update=None):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, per channel; plus `residual` (x's
    shape and dtype) where given, then max(y, 0) when `relu`: one pass, rounded once.
    `update`: (running_mean, running_var, num_batches_tracked, momentum, count), updated as
    batch_norm_update_ with mean and var would, by the same launch."""
    op = "batch_norm_forward"
    n, c, s, g = _groups(op, x)
    per_channel(op, c, x, mean=mean, var=var, weight=weight, bias=bias)
    run = _running(op, c, x, mean, var, *update) if update is not None else _no_running(x)
    grouped = (x,)
    if residual is not None:
        launch.check_arrays(op, residual)
        launch.check_contiguous(op, residual)
        launch.check_shape(op, residual, x.shape, "residual")
        if residual.dtype != x.dtype:
            raise TypeError(f"cuda.{op}: residual must be {x.dtype} like x, got {residual.dtype}")
        grouped = (x, residual)
    y = launch.new(x.shape, x.dtype)
    t = stat_dtype(x).type
    r = launch.NULL if residual is None else residual
    if y.size and _cl(x, y, *grouped):
        _cl_map("bn_forward_cl_kernel", x, (y, x, r, mean, var, weight, bias, t(eps),
                                            np.int32(bool(relu)), run))
    elif y.size:
        fn = launch.kernel(NORM, "bn_forward_kernel", launch.ctype(x.dtype))
        launch.grid_stride(fn, n * c * g,
                           (y, x, r, mean, var, weight, bias, t(eps), np.int32(n * c),
                            np.int32(c), np.int32(s), np.int32(bool(relu)),
                            launch.whole_groups(s, y, *grouped), run))
    elif update is not None:  # no elements, still the update
        batch_norm_update_(*update[:3], mean, var, *update[3:])
    return y


@functools.lru_cache(maxsize=None)
def _running_dtype(p) -> np.dtype:
    """struct Running<P> (norm.cu): three pointers, then keep, momentum and unbias in P."""
    return np.dtype([("rm", np.uint64), ("rv", np.uint64), ("batches", np.uint64),
                     ("keep", p), ("momentum", p), ("unbias", p)], align=True)


def _no_running(x):
    """A Running<P> argument that updates nothing."""
    return launch.struct(_running_dtype(stat_dtype(x)))


def _running(op, c, x, mean, var, running_mean, running_var, num_batches_tracked, momentum,
             count):
    """The Running<P> argument of an update of these running estimates with mean and var,
    checked (batch_norm_update_'s contract)."""
    if running_mean.ndim != 1 or running_mean.shape[0] != c:
        raise ValueError(f"cuda.{op}: running_mean must be ({c},), got {running_mean.shape}")
    per_channel(op, c, x, running_mean=running_mean, running_var=running_var, mean=mean,
                 var=var)
    launch.check_arrays(op, num_batches_tracked)
    if num_batches_tracked.dtype != np.int64 or num_batches_tracked.size != 1:
        raise ValueError(f"cuda.{op}: num_batches_tracked must be one int64, got "
                         f"{num_batches_tracked.dtype} {num_batches_tracked.shape}")
    t = running_mean.dtype.type
    return launch.struct(_running_dtype(running_mean.dtype), rm=running_mean.data.ptr,
                         rv=running_var.data.ptr, batches=num_batches_tracked.data.ptr,
                         keep=t(1 - momentum), momentum=t(momentum),
                         unbias=t(count / max(count - 1, 1)))


@op
def batch_norm_update_(running_mean, running_var, num_batches_tracked, mean, var, momentum,
                       count):
    """running = (1 - momentum) * running + momentum * batch (var unbiased over `count`),
    in place; num_batches_tracked (int64, 0-d) += 1."""
    op = "batch_norm_update_"
    if running_mean.ndim != 1:
        raise ValueError(f"cuda.{op}: running_mean must be (C,), got {running_mean.shape}")
    c = int(running_mean.shape[0])
    run = _running(op, c, running_mean, mean, var, running_mean, running_var,
                   num_batches_tracked, momentum, count)
    fn = launch.kernel(NORM, "bn_update_running_kernel", launch.ctype(running_mean.dtype))
    launch.grid_stride(fn, max(c, 1), (run, mean, var, np.int32(c)))
    return running_mean


def _relu_affine(op, c, x, relu):
    """The (weight, bias) of a forward that applied ReLU without a residual, checked, or
    (NULL, NULL) for none."""
    if relu is None:
        return launch.NULL, launch.NULL
    weight, bias = relu
    per_channel(op, c, x, relu_weight=weight, relu_bias=bias)
    return weight, bias


@op
def batch_norm_backward_reduce(gy, x, mean, var, eps, relu=None, add_to=None):
    """(2, C): [sum of gy, sum of gy * xhat] per channel (bias and weight gradients). `relu`:
    the (weight, bias) of a forward that applied ReLU (no residual); gy is then that ReLU's
    output gradient, masked here where the recomputed output was 0. `add_to`: (bias .grad,
    weight .grad), (C,) arrays of the sums' dtype that the sums' last kernel also adds rows 0
    and 1 into, in place (the bits of add_ afterwards, two launches fewer per row)."""
    op = "batch_norm_backward_reduce"
    launch.check_float(op, x, gy, half=True)
    launch.check_contiguous(op, gy)
    launch.check_shape(op, gy, x.shape, "gy")
    return _backward_sums(op, gy, x, mean, var, eps, relu, add_to)


# struct Join<T> (norm.cu): the second part, the ReLU output that masks, where gy goes; a
# Spread second part's grid (h, w), its product's (bh, bw), stride and padding (sh 0: dense)
_JOIN = np.dtype([("b", np.uint64), ("y", np.uint64), ("out", np.uint64),
                  *((name, np.int32) for name in ("h", "w", "bh", "bw", "sh", "sw", "ph", "pw"))])


@op
def batch_norm_backward_reduce_joined(ga, gb, x, mean, var, eps, relu=None, relu_out=None,
                                      add_to=None):
    """(gy, sums) for a gradient that arrives in parts or through the ReLU after a residual
    add: gy = ga + gb (gb None: ga alone), zero where relu_out (that ReLU's output) is not
    positive, with add's, relu_backward's or relu_backward_sum's bits, and sums =
    batch_norm_backward_reduce(gy, x, mean, var, eps, relu, add_to). gb may be a Spread
    (dptrain.backend.spread). Where the channels-last kernel takes x, gy is joined and stored
    by the sums' pass itself (no pass of its own), a Spread's product read where it lies;
    elsewhere by those ops first."""
    op = "batch_norm_backward_reduce_joined"
    spread = gb if isinstance(gb, Spread) else None
    b = spread.dense if spread is not None else gb
    given = [a for a in (ga, b, relu_out) if a is not None]
    launch.check_float(op, x, *given, half=True)
    launch.check_contiguous(op, *given)
    for name, a in (("ga", ga), ("gb", gb), ("relu_out", relu_out)):
        if a is not None:
            launch.check_shape(op, a, x.shape, name)
    if spread is not None and spread.dtype != x.dtype:
        raise TypeError(f"cuda.{op}: gb's dtype {spread.dtype} is not x's {x.dtype}")
    if gb is None and relu_out is None:
        return ga, _backward_sums(op, ga, x, mean, var, eps, relu, add_to)
    gy = launch.new(x.shape, x.dtype)
    if x.size and _cl(x, gy, *given) and (spread is None or x.shape[0] < 2**31):
        ptr = (lambda a: 0 if a is None else a.data.ptr)
        grid = {}
        if spread is not None:
            (_, h, w, _), (_, bh, bw, _) = spread.grid, spread.dense.shape
            grid = dict(h=h, w=w, bh=bh, bw=bw, sh=spread.stride[0], sw=spread.stride[1],
                        ph=spread.padding[0], pw=spread.padding[1])
        join = launch.struct(_JOIN, b=ptr(b), y=ptr(relu_out), out=gy.data.ptr, **grid)
        return gy, _backward_sums(op, ga, x, mean, var, eps, relu, add_to, join)
    gb = spread.total() if spread is not None else gb
    if relu_out is None:
        gy = elementwise.add(ga, gb)
    elif gb is None:
        gy = elementwise.relu_backward(relu_out, ga)
    else:
        gy = elementwise.relu_backward_sum(relu_out, ga, gb)
    return gy, _backward_sums(op, gy, x, mean, var, eps, relu, add_to)


def _backward_sums(op, gy, x, mean, var, eps, relu, add_to, join=None):
    """batch_norm_backward_reduce's sums (gy checked by the caller); `join`: a Join<T>
    struct for the channels-last kernel to join gy from (gy then its first part)."""
    n, c, s = _geometry(op, x)
    per_channel(op, c, x, mean=mean, var=var)
    if add_to is not None:
        per_channel(op, c, x, bias_grad=add_to[0], weight_grad=add_to[1])
    masks = _relu_affine(op, c, x, relu)
    sums = launch.new((2, c), stat_dtype(x))
    if c:
        args = (gy, x, mean, var, *masks, stat_dtype(x).type(eps))
        if join is not None or _cl(x, gy):
            targs = None if join is None else (launch.ctype(x.dtype),
                                               launch.ctype(stat_dtype(x)), "true",
                                               "true" if join["sh"][0] else "false")
            join = launch.struct(_JOIN) if join is None else join
            ws, splits = _cl_sums("bn_backward_partial_cl_kernel", x, 2, (join, *args),
                                  BACKWARD_PER_SM, targs)
        else:
            ws, splits = _channel_sums("bn_backward_partial_kernel", x, (n, c, s), 2, (gy, x),
                                       args)
        _finalize(sums, ws, splits, 1.0, add_to)
    return sums


@op
def batch_norm_backward_data(gy, x, mean, var, weight, sums, eps, count, relu=None):
    """dx = weight * invstd * (gy - sums[0] / count - xhat * sums[1] / count); `relu` as in
    batch_norm_backward_reduce (gy masked first; its weight must be `weight`)."""
    op = "batch_norm_backward_data"
    n, c, s, g = _groups(op, x)
    launch.check_float(op, x, gy, half=True)
    launch.check_contiguous(op, gy, sums)
    launch.check_shape(op, gy, x.shape, "gy")
    launch.check_shape(op, sums, (2, c), "sums")
    per_channel(op, c, x, mean=mean, var=var, weight=weight)
    if sums.dtype != stat_dtype(x):
        raise TypeError(f"cuda.{op}: sums must be {stat_dtype(x)} for {x.dtype} x, got "
                        f"{sums.dtype}")
    if relu is not None and relu[0] is not weight:
        raise ValueError(f"cuda.{op}: relu's weight must be the weight given")
    relu_bias = _relu_affine(op, c, x, relu)[1]
    dx = launch.new(x.shape, x.dtype)
    t = stat_dtype(x).type
    if dx.size and _cl(x, dx, gy):
        _cl_map("bn_backward_data_cl_kernel", x, (dx, gy, x, mean, var, weight, sums, relu_bias,
                                                  t(eps), t(1.0 / count)))
    elif dx.size:
        fn = launch.kernel(NORM, "bn_backward_data_kernel", launch.ctype(x.dtype))
        launch.grid_stride(fn, n * c * g, (dx, gy, x, mean, var, weight, sums, relu_bias,
                                           t(eps), t(1.0 / count), np.int32(n * c),
                                           np.int32(c), np.int32(s),
                                           launch.whole_groups(s, dx, gy, x)))
    return dx
