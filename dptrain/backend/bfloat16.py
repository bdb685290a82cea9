"""bfloat16 where NumPy and CuPy have no such dtype: arrays of uint16 holding the upper half of
each float32's bits (sign, the 8 exponent bits, 7 mantissa bits).

Only the GPU kernels compute on them (as ``__nv_bfloat16``, in float arithmetic rounded once
per result); here are the host conversions the launchers and the tests use. In this project
uint16 arrays mean bfloat16 and nothing else.
"""
from __future__ import annotations

import numpy as np

BFLOAT16 = np.dtype(np.uint16)
HALVES = (np.dtype(np.float16), BFLOAT16)  # the 16-bit float dtypes, bfloat16 as its bits


def to_bfloat16(x) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even; NaN stays NaN), as bits."""
    x = np.asarray(x, dtype=np.float32)
    bits = np.ascontiguousarray(x).view(np.uint32).reshape(x.shape)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def from_bfloat16(bits) -> np.ndarray:
    """The float32 values of bfloat16 bits (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
