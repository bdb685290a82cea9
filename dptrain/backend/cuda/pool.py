"""Launchers of kernels/pool.cu: 2-D max and average pooling over NCHW, max pooling
channels-last (N, H, W, C) too (``channels_last=True``).

Conventions (the .cu file's header has the kernel side):
  * Contiguous NCHW in and out; the geometry travels as one PoolGeom struct (launch.POOL_GEOM:
    n_c planes of h x w in, ho x wo out, window kh x kw, stride sh, sw, padding ph, pw).
  * max_pool2d_forward returns (y, idx): idx (int32) is the flat h*W + w position in x of each
    window's first maximum (NaN counting as the maximum), padding never chosen.
    relu_max_pool2d_forward is max_pool2d_forward(relu(x)) in one pass, with idx = -1 where
    the window's maximum is not > 0 (relu's gradient is zero there); max_pool2d_backward
    gives windows with idx < 0 no gradient. batch_norm_relu_max_pool2d (channels-last) is
    max_pool2d_forward of relu(batch norm(x)), the batch norm's output never stored.
  * avg pooling counts the padding in the divisor (PyTorch's default).
  * Backward ops return dx written with `=`, deterministic (no atomics): max backward needs
    only idx (one warp per plane), or, given the forward's `window` and windows that tile the
    input, one thread per window; channels-last, ImageNet's stem window walks a column of
    windows down the rows (max_pool_bwd_walk_kernel), any other gathers per pixel; avg
    backward gathers every window containing a pixel. Max backward's `gb`: a second part of
    the gradient, added first (the walk reads it with gy).
  * `workspace=` is accepted and ignored (the CPU backend reuses memory through it).
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import elementwise, launch, norm
from dptrain.backend.registry import op

POOL = "pool.cu"


def _pair(v):
    return (int(v), int(v)) if isinstance(v, (int, np.integer)) else tuple(int(x) for x in v)


def _pool_geom(op, x_shape, kernel, stride, padding):
    """struct PoolGeom and the output's shape for NCHW input `x_shape`."""
    if len(x_shape) != 4:
        raise ValueError(f"cuda.{op}: input must be NCHW, got shape {tuple(x_shape)}")
    n, c, h, w = (int(v) for v in x_shape)
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride), _pair(padding)
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    if min(kh, kw, sh, sw) < 1 or min(ph, pw) < 0 or ho < 1 or wo < 1:
        raise ValueError(f"cuda.{op}: kernel {kernel}, stride {stride}, padding {padding} "
                         f"do not fit input {tuple(x_shape)}")
    launch.check_int32(op, n * c * h * w, n * c * ho * wo)
    geom = launch.struct(launch.POOL_GEOM, n_c=n * c, h=h, w=w, ho=ho, wo=wo, kh=kh, kw=kw,
                         sh=sh, sw=sw, ph=ph, pw=pw)
    return geom, (n, c, ho, wo)


def _max_pool(op, relu, x, kernel, stride, padding, channels_last=False):
    launch.check_float(op, x, half=True)
    launch.check_contiguous(op, x)
    if channels_last:
        return _max_pool_nhwc(op, x, (kernel, stride, padding),
                              flags=("true" if relu else "false",))
    geom, y_shape = _pool_geom(op, x.shape, kernel, stride, padding)
    y, idx = launch.new(y_shape, x.dtype), launch.new(y_shape, np.int32)
    two = (_pair(kernel), _pair(stride), _pair(padding)) == ((2, 2), (2, 2), (0, 0))
    name = "max_pool_fwd_2x2_kernel" if two else "max_pool_fwd_kernel"  # MaxPool2d(2): unrolled
    if y.size:
        fn = launch.kernel(POOL, name, launch.ctype(x.dtype), "true" if relu else "false")
        launch.grid_stride(fn, y.size, (y, idx, x, geom))
    return y, idx


def _nhwc_geom(op, x_shape, window):
    """(struct PoolGeom with n_c = N * C, C, the output's (N, Ho, Wo, C) shape) for
    channels-last input `x_shape` and the window (kernel, stride, padding)."""
    if len(x_shape) != 4:
        raise ValueError(f"cuda.{op}: input must be (N, H, W, C), got shape {tuple(x_shape)}")
    n, h, w, c = (int(v) for v in x_shape)
    geom, (_, _, ho, wo) = _pool_geom(op, (n, c, h, w), *window)
    return geom, c, (n, ho, wo, c)


# Bytes of channels a thread of the channels-last max-pool kernels moves at most. The stem's
# 3x3/2 pool at batch 128 (fp16, H200): backward 382 -> 226 us with 16 bytes against 8,
# forward 205 -> 252 us (so it keeps 8); the fused batch norm's forward no faster with 16
# (ResNet-18's step 5.883 -> 5.860 ms, ResNet-34's 9.703 -> 9.708)
FORWARD_LANE_BYTES, BACKWARD_LANE_BYTES = 8, 16
AFFINE_MAX = 48 * 1024  # batch_norm_relu_max_pool2d's per-channel affine, a block's share


def _lanes(dtype, c: int, most: int) -> str:
    """Channels per thread of the channels-last kernels: the most, up to `most` bytes, that
    divide c (the loads stay aligned)."""
    size = np.dtype(dtype).itemsize
    return str(next(v for v in (8, 4, 2, 1) if v * size <= most and c % v == 0))


def _max_pool_nhwc(op, x, window, name="max_pool_fwd_nhwc_kernel", flags=(), extra=(),
                   smem=0):
    """(y, idx) of channels-last x pooled over window (kernel, stride, padding) by kernel
    `name`<T, *flags, lanes> (args y, idx, x, geom, C, *extra; `smem` bytes of dynamic
    shared memory a block)."""
    geom, c, y_shape = _nhwc_geom(op, x.shape, window)
    y, idx = launch.new(y_shape, x.dtype), launch.new(y_shape, np.int32)
    if y.size:
        lanes = _lanes(x.dtype, c, FORWARD_LANE_BYTES)
        square = "3" if _pair(window[0]) == (3, 3) else "0"  # the 3x3 window unrolled
        fn = launch.kernel(POOL, name, launch.ctype(x.dtype), *flags, lanes, square, smem=smem)
        launch.grid_stride(fn, y.size // int(lanes), (y, idx, x, geom, np.int32(c)) + extra,
                           smem=smem)
    return y, idx


# The stem's window (3 x 3, stride 2, padding 1), which pool.cu's walking backward takes, and
# the output rows a thread of it walks down (its kRun). ResNet-50's stem, fp16, batch 256,
# H200: 291 us at 1, 243 at 2, against the per-pixel gather's 375 (and 71 of the add of a
# gradient in two parts, now read in the walk; NOTES-gemm.md row 66).
WALK_WINDOW, WALK_RUN = ((3, 3), (2, 2), (1, 1)), 2


def _walk(dtype, c: int, window):
    """(channels a thread, channel groups) of the walking backward for c channels pooled
    over `window`, or None where it does not take them: another window, 8-byte elements, or
    channel groups (16 bytes where c allows) that do not divide a warp."""
    if tuple(_pair(v) for v in window) != WALK_WINDOW or np.dtype(dtype).itemsize > 4:
        return None
    lanes = int(_lanes(dtype, c, 16))
    groups = c // lanes
    if lanes < 2 or 32 % groups:
        return None
    return lanes, groups


def _walk_items(geom, c, groups):
    """The walking backward's work items (pool.cu's walk_items): the columns padded to whole
    warps, times the runs of rows, the images and the channel groups."""
    per_warp = 32 // groups
    cols = -(-int(geom["wo"][0]) // per_warp) * per_warp
    return int(geom["n_c"][0]) // c * -(-int(geom["ho"][0]) // WALK_RUN) * cols * groups


@op
def max_pool2d_forward(x, kernel, stride, padding, *, workspace=None, channels_last=False):
    """Returns (y, idx): idx is the flat h*W+w position in x of each window's maximum (int32);
    x, y and idx (N, H, W, C) where `channels_last`."""
    return _max_pool("max_pool2d_forward", False, x, kernel, stride, padding, channels_last)


@op
def relu_max_pool2d_forward(x, kernel, stride, padding, *, workspace=None, channels_last=False):
    """max_pool2d_forward(relu(x)) in one pass; idx = -1 where the maximum is not > 0."""
    return _max_pool("relu_max_pool2d_forward", True, x, kernel, stride, padding,
                     channels_last)


@op
def batch_norm_relu_max_pool2d(x, mean, var, weight, bias, eps, kernel, stride, padding):
    """max_pool2d_forward(relu(batch_norm_forward(x, ...)), ...) of channels-last x (N, H, W,
    C) in one pass: (y, idx) with the bits of the two ops, the batch norm's output computed
    and rounded tap by tap, never stored (ImageNet's stem: a 205 MB write and read fewer)."""
    op, window = "batch_norm_relu_max_pool2d", (kernel, stride, padding)
    launch.check_arrays(op, x)
    launch.check_contiguous(op, x)
    c = _nhwc_geom(op, x.shape, window)[1]
    norm.per_channel(op, c, x, mean=mean, var=var, weight=weight, bias=bias)
    affine = 3 * c * mean.dtype.itemsize  # a block's per-channel mean, scale and shift
    if affine > AFFINE_MAX:
        raise ValueError(f"cuda.{op}: {c} channels' batch norm ({affine} bytes) does not fit "
                         f"a block's shared memory ({AFFINE_MAX}); use the two ops")
    return _max_pool_nhwc(op, x, window, "bn_relu_max_pool_fwd_nhwc_kernel",
                          extra=(mean, var, weight, bias, mean.dtype.type(eps)), smem=affine)


def _tiles(window, x_shape, y_shape) -> tuple[int, int] | None:
    """(kh, kw) when `window` ((kernel, stride, padding) pairs) tiles the input exactly:
    window = stride, no padding, every pixel in one window; else None."""
    if window is None:
        return None
    (kh, kw), (sh, sw), (ph, pw) = (_pair(v) for v in window)
    tiles = ((kh, kw) == (sh, sw) and (ph, pw) == (0, 0)
             and tuple(x_shape[2:]) == (y_shape[2] * kh, y_shape[3] * kw))
    return (kh, kw) if tiles else None


@op
def max_pool2d_backward(gy, idx, x_shape, *, window=None, workspace=None, channels_last=False,
                        gb=None):
    """dx: gy at each window's idx. `window` = (kernel, stride, padding) of the forward, if
    given, lets windows that tile the input take the one-thread-per-window kernel; a
    channels-last backward (gy, idx, x_shape (N, H, W, C)) needs it. `gb`: a second part of
    the gradient, gy + gb (add's bits) pooled back; the stem's walking kernel reads it where
    it reads gy (no pass of its own)."""
    op = "max_pool2d_backward"
    launch.check_float(op, gy, half=True)
    launch.check_arrays(op, idx)
    launch.check_contiguous(op, gy, idx)
    if idx.dtype != np.int32 or idx.shape != gy.shape or gy.ndim != 4:
        raise ValueError(f"cuda.{op}: idx {idx.shape} {idx.dtype} must be int32 of gy's shape "
                         f"{gy.shape}")
    if gb is not None:
        launch.check_contiguous(op, gb)
        launch.check_shape(op, gb, gy.shape, "gb")
        if gb.dtype != gy.dtype:
            raise TypeError(f"cuda.{op}: gb's dtype {gb.dtype} is not gy's {gy.dtype}")
    if channels_last:
        geom, c, dx = _nhwc_dx(op, gy, x_shape, window)
        walk = _walk(gy.dtype, c, window)
        if dx.size and walk:  # reads gb beside gy
            fn = launch.kernel(POOL, "max_pool_bwd_walk_kernel", launch.ctype(gy.dtype),
                               str(walk[0]), str(WALK_RUN))
            launch.grid_stride(fn, _walk_items(geom, c, walk[1]),
                               (dx, gy, launch.NULL if gb is None else gb, idx, geom,
                                np.int32(c)), warps=True)
            return dx
    gy = gy if gb is None else elementwise.add(gy, gb)
    if channels_last:  # a thread per input element gathers from the windows that chose it
        if dx.size:
            lanes = _lanes(gy.dtype, c, BACKWARD_LANE_BYTES)
            fn = launch.kernel(POOL, "max_pool_bwd_nhwc_kernel", launch.ctype(gy.dtype), lanes)
            launch.grid_stride(fn, dx.size // int(lanes), (dx, gy, idx, geom, np.int32(c)))
        return dx
    n, c, h, w = (int(v) for v in x_shape)
    if gy.shape[:2] != (n, c):
        raise ValueError(f"cuda.max_pool2d_backward: gy {gy.shape} does not match x {tuple(x_shape)}")
    ho, wo = gy.shape[2:]
    launch.check_int32("max_pool2d_backward", n * c * h * w, gy.size)
    dx = launch.new((n, c, h, w), gy.dtype)
    tiles = _tiles(window, x_shape, gy.shape)
    if tiles is not None and dx.size:
        kh, kw = tiles
        geom = launch.struct(launch.POOL_GEOM, n_c=n * c, h=h, w=w, ho=ho, wo=wo, kh=kh, kw=kw,
                             sh=kh, sw=kw)
        name = "max_pool_bwd_2x2_kernel" if tiles == (2, 2) else "max_pool_bwd_tiled_kernel"
        launch.grid_stride(launch.kernel(POOL, name, launch.ctype(gy.dtype)), gy.size,
                           (dx, gy, idx, geom))
        return dx
    # The window's shape is not needed (idx says where each maximum is): kh = kw = 0.
    geom = launch.struct(launch.POOL_GEOM, n_c=n * c, h=h, w=w, ho=ho, wo=wo, sh=1, sw=1)
    if dx.size:
        launch.grid_stride(launch.kernel(POOL, "max_pool_bwd_kernel", launch.ctype(gy.dtype)),
                           n * c, (dx, gy, idx, geom), launch.WARPS)
    return dx


def _nhwc_dx(op, gy, x_shape, window):
    """(geom, C, dx) of a channels-last max-pool backward, gy checked against x pooled."""
    if window is None:
        raise ValueError(f"cuda.{op}: a channels-last backward needs window=(kernel, stride, "
                         f"padding)")
    geom, c, y_shape = _nhwc_geom(op, x_shape, window)
    if tuple(gy.shape) != y_shape:
        raise ValueError(f"cuda.{op}: gy {gy.shape} does not match x {tuple(x_shape)} pooled "
                         f"to {y_shape}")
    return geom, c, launch.new(tuple(int(v) for v in x_shape), gy.dtype)


@op
def avg_pool2d_forward(x, kernel, stride, padding):
    """Average over each window, padding counted in the divisor (PyTorch's default)."""
    launch.check_float("avg_pool2d_forward", x, half=True)
    launch.check_contiguous("avg_pool2d_forward", x)
    geom, y_shape = _pool_geom("avg_pool2d_forward", x.shape, kernel, stride, padding)
    y = launch.new(y_shape, x.dtype)
    if y.size:
        launch.grid_stride(launch.kernel(POOL, "avg_pool_fwd_kernel", launch.ctype(x.dtype)),
                           y.size, (y, x, geom))
    return y


@op
def avg_pool2d_backward(gy, x_shape, kernel, stride, padding):
    launch.check_float("avg_pool2d_backward", gy, half=True)
    launch.check_contiguous("avg_pool2d_backward", gy)
    geom, y_shape = _pool_geom("avg_pool2d_backward", x_shape, kernel, stride, padding)
    launch.check_shape("avg_pool2d_backward", gy, y_shape, "gy")
    dx = launch.new(tuple(int(v) for v in x_shape), gy.dtype)
    if dx.size:
        launch.grid_stride(launch.kernel(POOL, "avg_pool_bwd_kernel", launch.ctype(gy.dtype)),
                           dx.size, (dx, gy, geom))
    return dx
