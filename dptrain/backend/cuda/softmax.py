"""Launchers of kernels/softmax.cu: softmax and log_softmax along the last axis, their
backward, and cross-entropy.

Conventions (the .cu file's header has the kernel side):
  * Contiguous (R, C) row blocks, one warp per row (WARPS rows per block of BLOCK threads);
    fixed shuffle trees, so results are deterministic.
  * Backward ops take the forward OUTPUT y and gy and return the input gradient (`=`).
  * cross_entropy_forward(logits (N, C), int labels) -> (mean loss as a 0-d device array,
    probs); cross_entropy_backward takes the 0-d loss gradient on the device, so neither
    reads a value back to the host. A label outside [0, C) gives a NaN loss.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.registry import op

SM = "softmax.cu"


def _row_op(op, kernel, log, first, *rest):
    r, c = launch.rows(op, first, *rest)
    out = launch.new(first.shape, first.dtype)
    if first.size:
        fn = launch.kernel(SM, kernel, launch.ctype(first.dtype), "true" if log else "false")
        launch.grid_stride(fn, r, (out, first, *rest, np.int32(r), np.int32(c)), launch.WARPS)
    return out


@op
def softmax(x):
    return _row_op("softmax", "softmax_fwd_kernel", False, x)


@op
def softmax_backward(y, gy):
    return _row_op("softmax_backward", "softmax_bwd_kernel", False, y, gy)


@op
def log_softmax(x):
    return _row_op("log_softmax", "softmax_fwd_kernel", True, x)


@op
def log_softmax_backward(y, gy):
    return _row_op("log_softmax_backward", "softmax_bwd_kernel", True, y, gy)


@op
def cross_entropy_forward(logits, labels):
    """Mean cross-entropy of (N, C) logits against int labels: (loss as a 0-d array, softmax).
    16-bit logits are read as their exact float values: loss and softmax in float32."""
    r, c = launch.rows("cross_entropy_forward", logits, half=True)
    if logits.ndim != 2 or c == 0:
        raise ValueError(f"cuda.cross_entropy_forward: logits must be (N, C>0), got {logits.shape}")
    launch.check_int_labels("cross_entropy_forward", labels, r)
    dt = np.dtype(np.float32) if logits.dtype in launch.HALVES else logits.dtype
    t, lt = launch.ctype(dt), launch.ctype(labels.dtype)
    mixed = (launch.ctype(logits.dtype),) if dt != logits.dtype else ()
    probs = launch.new(logits.shape, dt)
    picked = launch.new((r,), dt)
    loss = launch.new((), dt)
    if r:
        launch.grid_stride(launch.kernel(SM, "ce_rows_kernel", t, lt, *mixed), r,
                           (probs, picked, logits, labels, np.int32(r), np.int32(c)), launch.WARPS)
    launch.kernel(SM, "ce_mean_kernel", t)((1,), (launch.block_threads(warps=True),),
                                           (loss, picked, np.int32(r)))
    return loss, probs


@op
def cross_entropy_backward(probs, labels, gloss, dtype=None):
    """(probs - onehot(labels)) * gloss / N; gloss is the 0-d loss gradient on the device.
    `dtype`: the logits' 16-bit type for float32 probs (the gradient rounded once into it),
    else probs' own."""
    r, c = launch.rows("cross_entropy_backward", probs)
    launch.check_float("cross_entropy_backward", probs, gloss)
    if gloss.size != 1:
        raise ValueError(f"cuda.cross_entropy_backward: gloss must hold one value, got {gloss.shape}")
    launch.check_int_labels("cross_entropy_backward", labels, r)
    dtype = probs.dtype if dtype is None else np.dtype(dtype)
    if dtype != probs.dtype and not (dtype in launch.HALVES and probs.dtype == np.float32):
        raise TypeError(f"cuda.cross_entropy_backward: a {dtype} gradient of {probs.dtype} "
                        f"probs; only float32 probs of 16-bit logits differ")
    mixed = (launch.ctype(dtype),) if dtype != probs.dtype else ()
    g = launch.new(probs.shape, dtype)
    if probs.size:
        fn = launch.kernel(SM, "ce_bwd_kernel", launch.ctype(probs.dtype),
                           launch.ctype(labels.dtype), *mixed)
        launch.grid_stride(fn, probs.size, (g, probs, labels, gloss, np.int32(r), np.int32(c)))
    return g
