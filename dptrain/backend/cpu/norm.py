"""The NumPy backend's batch-normalisation ops (the reference for kernels/norm.cu).

Conventions, shared with the CUDA launchers (dptrain/backend/cuda/norm.py):
  * x is NCHW (any ndim >= 2: axis 1 is the channel, every other axis is reduced); the
    per-channel arrays (mean, var, weight, bias) are (C,).
  * Statistics are two passes: ``batch_norm_mean`` then ``batch_norm_var`` about a given
    mean (the biased variance, as batch normalisation uses), so the two can be all-reduced
    between passes (sync-BN: the mean of equal-count ranks' means is the global mean).
    Sums accumulate in float64.
  * ``invstd = 1 / sqrt(var + eps)``, ``xhat = (x - mean) * invstd``,
    ``y = xhat * weight + bias``.
  * Backward: ``batch_norm_backward_reduce`` gives the (2, C) sums [sum gy, sum gy * xhat]
    (the bias and weight gradients); ``batch_norm_backward_data`` takes such sums over
    ``count`` elements (all-reduced over ranks for sync-BN) and returns
    ``dx = weight * invstd * (gy - sums[0] / count - xhat * sums[1] / count)``.
  * ``batch_norm_update_`` updates the running estimates in place (PyTorch's rule, the
    unbiased variance over ``count`` elements) and adds one to the int64 batch counter.
  * A 16-bit x (mixed precision) keeps its statistics, parameters and sums in float32
    (``stat_dtype``) and computes in float32; y and dx come back in x's dtype, rounded once.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cpu.ops import add, relu_backward, relu_backward_sum
from dptrain.backend.registry import op
from dptrain.backend.spread import Spread


def _axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _channel(v, x):
    """Per-channel (C,) array shaped to broadcast against x."""
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def stat_dtype(x) -> np.dtype:
    """The dtype of the per-channel arrays for activations x: float32 for 16-bit x."""
    return np.dtype(np.float32) if x.dtype.itemsize == 2 else x.dtype


def _compute(a, x):
    """`a` (x or gy) in the arithmetic type of x: float32 for 16-bit x."""
    return a.astype(np.float32) if x.dtype.itemsize == 2 else a


def _count(x):
    return x.size // x.shape[1] if x.shape[1] else 0


@op
def batch_norm_mean(x):
    """Per-channel mean of x over every axis but 1."""
    return (x.sum(axis=_axes(x), dtype=np.float64) / max(_count(x), 1)).astype(stat_dtype(x))


@op
def batch_norm_var(x, mean):
    """Per-channel mean of (x - mean)^2 over every axis but 1 (the biased variance)."""
    d = x.astype(np.float64) - _channel(mean, x)
    return ((d * d).sum(axis=_axes(x)) / max(_count(x), 1)).astype(stat_dtype(x))


def _invstd(var, eps):
    return (1.0 / np.sqrt(var.astype(np.float64) + eps)).astype(var.dtype)


@op
def batch_norm_stats(x):
    """(mean, var): the per-channel mean and biased variance of x over every axis but 1
    (one read of x on the GPU; here the two passes, in float64)."""
    exact = batch_norm_mean(x.astype(np.float64))
    return exact.astype(stat_dtype(x)), batch_norm_var(x, exact)


@op
def batch_norm_forward(x, mean, var, weight, bias, eps, residual=None, relu=False,
                       update=None):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, per channel; plus `residual` (x's
    shape and dtype) where given, then max(y, 0) when `relu`: one pass, rounded once.
    `update`: (running_mean, running_var, num_batches_tracked, momentum, count), updated as
    batch_norm_update_ with mean and var (the GPU does it in the same launch)."""
    if update is not None:
        batch_norm_update_(*update[:3], mean, var, *update[3:])
    scale = _invstd(var, eps) * weight
    y = (_compute(x, x) - _channel(mean, x)) * _channel(scale, x) + _channel(bias, x)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"cpu.batch_norm_forward: residual must be {x.dtype} {x.shape} "
                             f"like x, got {residual.dtype} {residual.shape}")
        y = y + _compute(residual, x)
    if relu:
        y = np.maximum(y, 0)
    return y.astype(x.dtype, copy=False)


@op
def batch_norm_update_(running_mean, running_var, num_batches_tracked, mean, var, momentum,
                       count):
    """running = (1 - momentum) * running + momentum * batch (var unbiased over `count`),
    in place; num_batches_tracked (int64, 0-d) += 1."""
    t = running_mean.dtype.type
    unbiased = var * t(count / max(count - 1, 1))
    running_mean *= t(1 - momentum)
    running_mean += t(momentum) * mean
    running_var *= t(1 - momentum)
    running_var += t(momentum) * unbiased
    num_batches_tracked += 1
    return running_mean


def _relu_masked(gy, x, mean, var, eps, relu):
    """gy zeroed where relu(bn(x)) with `relu`'s (weight, bias) was 0 (the forward's output,
    recomputed bit for bit), or gy itself for no `relu`."""
    if relu is None:
        return gy
    y = batch_norm_forward(x, mean, var, relu[0], relu[1], eps, relu=True)
    return gy * (y > 0)  # as relu_backward


@op
def batch_norm_backward_reduce(gy, x, mean, var, eps, relu=None, add_to=None):
    """(2, C): [sum of gy, sum of gy * xhat] per channel (bias and weight gradients). `relu`:
    the (weight, bias) of a forward that applied ReLU (no residual); gy is then that ReLU's
    output gradient, masked here where the recomputed output was 0. `add_to`: (bias .grad,
    weight .grad), (C,) arrays of the sums' dtype that rows 0 and 1 are also added into, in
    place."""
    gy = _relu_masked(gy, x, mean, var, eps, relu)
    xhat = (x.astype(np.float64) - _channel(mean, x)) * _channel(_invstd(var, eps), x)
    g = gy.astype(np.float64)
    sums = np.stack([g.sum(axis=_axes(x)), (g * xhat).sum(axis=_axes(x))])
    sums = sums.astype(stat_dtype(x))
    if add_to is not None:
        for dst, row in zip(add_to, sums):
            if dst.shape != row.shape or dst.dtype != row.dtype:
                raise ValueError(f"cpu.batch_norm_backward_reduce: add_to arrays must be "
                                 f"{row.dtype} {row.shape}, got {dst.dtype} {dst.shape}")
            np.add(dst, row, out=dst)
    return sums


@op
def batch_norm_backward_reduce_joined(ga, gb, x, mean, var, eps, relu=None, relu_out=None,
                                      add_to=None):
    """(gy, sums) for a gradient that arrives in parts or through the ReLU after a residual
    add: gy = ga + gb (gb None: ga alone), zero where relu_out (that ReLU's output) is not
    positive (add's, relu_backward's or relu_backward_sum's result), and
    batch_norm_backward_reduce(gy, x, mean, var, eps, relu, add_to). gb may be a Spread
    (dptrain.backend.spread), added as its array."""
    if isinstance(gb, Spread):
        gb = gb.total()
    if relu_out is None:
        gy = ga if gb is None else add(ga, gb)
    else:
        gy = relu_backward(relu_out, ga) if gb is None else relu_backward_sum(relu_out, ga, gb)
    return gy, batch_norm_backward_reduce(gy, x, mean, var, eps, relu=relu, add_to=add_to)


@op
def batch_norm_backward_data(gy, x, mean, var, weight, sums, eps, count, relu=None):
    """dx = weight * invstd * (gy - sums[0] / count - xhat * sums[1] / count); `relu` as in
    batch_norm_backward_reduce (gy masked first)."""
    gy = _relu_masked(gy, x, mean, var, eps, relu)
    invstd = _invstd(var, eps)
    t = stat_dtype(x).type
    xhat = (_compute(x, x) - _channel(mean, x)) * _channel(invstd, x)
    mean_gy = _channel(sums[0] * t(1.0 / count), x)
    mean_gy_xhat = _channel(sums[1] * t(1.0 / count), x)
    dx = (_compute(gy, x) - mean_gy - xhat * mean_gy_xhat) * _channel(weight * invstd, x)
    return dx.astype(x.dtype, copy=False)
