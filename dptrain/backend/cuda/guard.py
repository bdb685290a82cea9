"""Launchers of kernels/guard.cu: the non-finite check of the training step.

``nonfinite_flag_(flag, x)``: flag (one element, x's dtype, on the device) becomes 1 if it
was non-zero or if x holds a NaN or an infinity, else stays 0. An empty x only normalises
the flag. In place, no host sync, deterministic (no atomics): safe inside a captured step.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.registry import op

GUARD = "guard.cu"


@op
def nonfinite_flag_(flag, x):
    launch.check_float("nonfinite_flag_", flag, x)
    launch.check_contiguous("nonfinite_flag_", flag, x)
    if flag.size != 1:
        raise ValueError(f"cuda.nonfinite_flag_: flag must have one element, has {flag.size}")
    launch.grid_stride(launch.kernel(GUARD, "nonfinite_flag_kernel", launch.ctype(x.dtype)),
                       x.size, (flag, x, np.int64(x.size)))
    return flag


@op
def unscale_(x, scale):
    """x /= scale[0] in place (scale: a one-element float32 device array)."""
    launch.check_float("unscale_", x)
    launch.check_contiguous("unscale_", x, scale)
    if scale.size != 1 or scale.dtype != np.float32:
        raise ValueError(f"cuda.unscale_: scale must be one float32 element, got {scale.size} "
                         f"of {scale.dtype}")
    if x.size:
        launch.grid_stride(launch.kernel(GUARD, "unscale_kernel", launch.ctype(x.dtype)),
                           x.size, (x, scale, np.int64(x.size)))
    return x


@op
def loss_scale_update_(state, overflow, interval):
    """state = [scale, good steps, overflow steps] (float32): halve on overflow[0] != 0, double
    after `interval` good steps in a row. One thread; in place."""
    launch.check_contiguous("loss_scale_update_", state, overflow)
    if state.size != 3 or state.dtype != np.float32 or overflow.dtype != np.float32:
        raise ValueError("cuda.loss_scale_update_: state must be 3 float32 values and the "
                         "overflow flag float32")
    fn = launch.kernel(GUARD, "loss_scale_update_kernel")
    fn((1,), (32,), (state, overflow, np.float32(interval)))
    return state
