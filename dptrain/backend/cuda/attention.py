"""Launchers of kernels/attention.cu: layer norm over the last axis, the exact GELU, and the
masked softmax of scaled dot-product attention, each with its backward.

Conventions (the .cu file's header has the kernel side; the NumPy reference with the same
signatures is dptrain/backend/cpu/attention.py):
  * Float32 or float64, or float16 / bfloat16 computed in float32 (layer norm's weight,
    bias, mean and rstd then float32), contiguous inputs; outputs are new arrays written
    with `=`.
  * Row ops run one warp per row with fixed shuffle trees; layer norm's weight and bias
    gradients are column sums by reduce.cu (double accumulation, fixed order): every result
    is deterministic, no atomics.
  * masked_softmax takes the mask as flags: `causal` and `key_lengths` (a (B,) int32/int64
    device array; a host array is uploaded, which synchronises: pass device arrays inside a
    captured step). No mask tensor is built.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cpu.attention import check_masked_softmax_args
from dptrain.backend.cuda import launch
from dptrain.backend.cuda.arrays import asarray
from dptrain.backend.cuda.reduce import sum as _sum
from dptrain.backend.cuda.reduce import sum_float32
from dptrain.backend.registry import op

AT = "attention.cu"


def _compute(x):
    """The dtype the kernels compute x's rows in: float32 for 16-bit x, else x's own."""
    return np.dtype(np.float32) if x.dtype in launch.HALVES else x.dtype


def _check_vector(op, name, v, d, x):
    launch.check_float(op, v)
    launch.check_contiguous(op, v)
    if v.dtype != _compute(x):
        raise TypeError(f"cuda.{op}: {name} is {v.dtype}, expected {_compute(x)} for "
                        f"{x.dtype} x")
    if tuple(v.shape) != (d,):
        raise ValueError(f"cuda.{op}: {name} has shape {tuple(v.shape)}, expected ({d},)")


# ----------------------------------------------------------------------------- layer norm


@op
def layer_norm_forward(x, weight, bias, eps=1e-5):
    """(y, mean, rstd): layer norm of x over its last axis; mean, rstd of shape x.shape[:-1].
    16-bit x: weight, bias, mean and rstd are float32 (the math is)."""
    r, d = launch.rows("layer_norm_forward", x, half=True)
    _check_vector("layer_norm_forward", "weight", weight, d, x)
    _check_vector("layer_norm_forward", "bias", bias, d, x)
    a = _compute(x)
    y = launch.new(x.shape, x.dtype)
    mean = launch.new(x.shape[:-1], a)
    rstd = launch.new(x.shape[:-1], a)
    if x.size:
        fn = launch.kernel(AT, "layer_norm_fwd_kernel", launch.ctype(x.dtype))
        launch.grid_stride(fn, r, (y, mean, rstd, x, weight, bias, np.int32(r), np.int32(d),
                                   a.type(eps)), launch.WARPS)
    return y, mean, rstd


@op
def layer_norm_backward(gy, x, weight, mean, rstd):
    """(gx, gweight, gbias) of layer_norm_forward, from its saved mean and rstd; the
    parameter gradients in the weight's dtype."""
    launch.check_float("layer_norm_backward", x, gy, half=True)
    r, d = launch.rows("layer_norm_backward", x, half=True)
    launch.check_contiguous("layer_norm_backward", gy, mean, rstd)
    launch.check_shape("layer_norm_backward", gy, x.shape, "gy")
    launch.check_shape("layer_norm_backward", mean, x.shape[:-1], "mean")
    launch.check_shape("layer_norm_backward", rstd, x.shape[:-1], "rstd")
    _check_vector("layer_norm_backward", "weight", weight, d, x)
    for name, v in (("mean", mean), ("rstd", rstd)):
        if v.dtype != _compute(x):
            raise TypeError(f"cuda.layer_norm_backward: {name} is {v.dtype}, expected "
                            f"{_compute(x)}")
    gx = launch.new(x.shape, x.dtype)
    gyxhat = launch.new((r, d), _compute(x))
    if x.size:
        fn = launch.kernel(AT, "layer_norm_bwd_kernel", launch.ctype(x.dtype))
        launch.grid_stride(fn, r, (gx, gyxhat, gy, x, weight, mean, rstd, np.int32(r),
                                   np.int32(d)), launch.WARPS)
    rows = gy.reshape(r, d)
    gbias = sum_float32(rows, 0) if x.dtype in launch.HALVES else _sum(rows, axis=0)
    return gx, _sum(gyxhat, axis=0), gbias


# ----------------------------------------------------------------------------- GELU


def _flat(op, kernel, *arrays):
    launch.check_float(op, *arrays, half=True)
    launch.check_contiguous(op, *arrays)
    for a in arrays[1:]:
        launch.check_shape(op, a, arrays[0].shape)
    out = launch.new(arrays[0].shape, arrays[0].dtype)
    n = arrays[0].size
    if n:
        fn = launch.kernel(AT, kernel, launch.ctype(arrays[0].dtype))
        launch.grid_stride(fn, n, (out, *arrays, np.int64(n)))
    return out


@op
def gelu(x):
    """x * Phi(x), the exact (erf) GELU."""
    return _flat("gelu", "gelu_fwd_kernel", x)


@op
def gelu_backward(x, gy):
    """gy * (Phi(x) + x phi(x)), from the forward input x."""
    return _flat("gelu_backward", "gelu_bwd_kernel", x, gy)


# ----------------------------------------------------------------------------- masked softmax


@op
def masked_softmax(x, causal=False, key_lengths=None, scale=1.0):
    """softmax(scale * x) over the last axis, keys masked by `causal` (key j > query i) and
    `key_lengths` (keys j >= key_lengths[b] of batch element b) at probability exactly 0."""
    r, c = launch.rows("masked_softmax", x, half=True)
    if key_lengths is not None:
        if not launch.is_cupy(key_lengths):
            key_lengths = asarray(np.asarray(key_lengths))
        if key_lengths.dtype.kind != "i" or key_lengths.itemsize not in (4, 8):
            raise TypeError(f"cuda.masked_softmax: key_lengths must be int32 or int64, "
                            f"got {key_lengths.dtype}")
        launch.check_contiguous("masked_softmax", key_lengths)
    check_masked_softmax_args("cuda.masked_softmax", x.shape, causal, key_lengths)
    y = launch.new(x.shape, x.dtype)
    if x.size:
        tq = x.shape[-2] if x.ndim >= 2 else 1
        per_batch = r // x.shape[0] if key_lengths is not None else 1
        lengths = key_lengths if key_lengths is not None else y
        ltype = launch.ctype(key_lengths.dtype) if key_lengths is not None else "int"
        fn = launch.kernel(AT, "masked_softmax_fwd_kernel", launch.ctype(x.dtype), ltype)
        launch.grid_stride(fn, r, (y, x, lengths, np.int32(r), np.int32(c), np.int32(tq),
                                   np.int32(per_batch), np.int32(bool(causal)),
                                   np.int32(key_lengths is not None), _compute(x).type(scale)),
                           launch.WARPS)
    return y


@op
def masked_softmax_backward(y, gy, scale=1.0):
    """scale * y * (gy - sum(gy * y)) over the last axis, from the forward output y."""
    launch.check_float("masked_softmax_backward", y, gy, half=True)
    r, c = launch.rows("masked_softmax_backward", y, half=True)
    launch.check_contiguous("masked_softmax_backward", gy)
    launch.check_shape("masked_softmax_backward", gy, y.shape, "gy")
    gx = launch.new(y.shape, y.dtype)
    if y.size:
        fn = launch.kernel(AT, "masked_softmax_bwd_kernel", launch.ctype(y.dtype))
        launch.grid_stride(fn, r, (gx, y, gy, np.int32(r), np.int32(c), _compute(y).type(scale)),
                           launch.WARPS)
    return gx
