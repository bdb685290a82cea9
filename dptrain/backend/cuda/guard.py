"""Launchers of kernels/guard.cu: the non-finite check of the training step.

``nonfinite_flag_(flag, x)``: flag (one element, x's dtype, on the device) becomes 1 if it
was non-zero or if x holds a NaN or an infinity, else stays 0. An empty x only normalises
the flag. ``unscale_check_`` does the same on a scaled gradient and divides it by the loss
scale in the same pass; ``nonfinite_decide_`` turns the all-reduced flags into the step's
decision (and the loss scale's update) in one thread. In place, no host sync, deterministic
(no atomics): safe inside a captured step.
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
def unscale_check_(x, scale, flag):
    """flag as nonfinite_flag_(flag, x) on x as it is, then x /= scale[0], in one pass (scale:
    a one-element float32 device array)."""
    launch.check_float("unscale_check_", x, flag)
    launch.check_contiguous("unscale_check_", x, scale, flag)
    if scale.size != 1 or scale.dtype != np.float32 or flag.size != 1:
        raise ValueError(f"cuda.unscale_check_: scale must be one float32 element and flag "
                         f"one element, got {scale.size} of {scale.dtype} and {flag.size}")
    launch.grid_stride(launch.kernel(GUARD, "unscale_check_kernel", launch.ctype(x.dtype)),
                       x.size, (x, scale, flag, np.int64(x.size)))
    return x


@op
def nonfinite_decide_(flags, decision, count, sticky, state=None, skip=None, interval=1):
    """The guard's decision after the flags' all-reduce, one thread (the CPU backend's
    docstring has the rules). flags: two elements; decision, count, skip: one each, flags'
    dtype; state: 3 float32 values or None."""
    launch.check_float("nonfinite_decide_", flags, decision, count)
    if flags.size != 2 or decision.size != 1 or count.size != 1:
        raise ValueError("cuda.nonfinite_decide_: flags must have two elements, decision "
                         "and count one")
    if state is not None and (state.size != 3 or state.dtype != np.float32 or skip is None
                              or skip.size != 1 or skip.dtype != flags.dtype):
        raise ValueError("cuda.nonfinite_decide_: a loss scale state is 3 float32 values, "
                         "with a one-element skip of the flags' dtype")
    fn = launch.kernel(GUARD, "nonfinite_decide_kernel", launch.ctype(flags.dtype))
    scaled = state is not None  # else count stands in for the pointers the kernel skips
    fn((1,), (32,), (flags, decision, count, np.int32(bool(sticky)), np.int32(scaled),
                     state if scaled else count, skip if scaled else count,
                     np.float32(interval)))
    return decision
