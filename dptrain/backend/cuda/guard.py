"""Launchers of kernels/guard.cu: the non-finite check of the training step.

``nonfinite_flag_(flag, x)``: flag (one element, x's dtype, on the device) becomes 1 if it
was non-zero or if x holds a NaN or an infinity, else stays 0. An empty x only normalises
the flag. In place, no host sync, deterministic (no atomics): safe inside a captured step.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch

GUARD = "guard.cu"


def nonfinite_flag_(flag, x):
    launch.check_float("nonfinite_flag_", flag, x)
    launch.check_contiguous("nonfinite_flag_", flag, x)
    if flag.size != 1:
        raise ValueError(f"cuda.nonfinite_flag_: flag must have one element, has {flag.size}")
    launch.grid_stride(launch.kernel(GUARD, "nonfinite_flag_kernel", launch.ctype(x.dtype)),
                       x.size, (flag, x, np.int64(x.size)))
    return flag
