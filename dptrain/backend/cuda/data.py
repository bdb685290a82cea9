"""Launchers of kernels/data.cu: batch assembly on the device, and dropout masks.

Conventions (the .cu file's header has the kernel side):
  * gather_normalize(images uint8 (M, ...), idx, mean, std) -> float32 rows idx, scaled to
    [0, 1] then (x - mean) / std, bit for bit as the CPU backend computes them. Host indices
    are uploaded (outside a captured step); a device index outside [0, M) gives a NaN row.
  * dropout_mask(shape, p) keeps each element with probability 1 - p and scales it by
    1 / (1 - p) (inverted dropout). Philox4x32-10 keyed by the seed; the seed and the counter
    offset live in runtime.rng_state on the device. After each draw a one-thread kernel adds
    the draw's group count (4 numbers per group) to the offset, so every draw, eager or
    replayed from a CUDA graph, gets fresh numbers; after runtime.manual_seed(s) the masks
    are a function of s and the sequence of draws alone.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.cuda.transpose import copy

DATA = "data.cu"


def gather_normalize(images, idx, mean, std):
    """Rows idx of a uint8 (M, C, H, W) image array as float32, scaled to [0,1] then (x-mean)/std."""
    launch.check_arrays("gather_normalize", images)
    if images.dtype != np.uint8 or images.ndim < 1:
        raise TypeError(f"cuda.gather_normalize: images must be uint8 (M, ...), got {images.dtype}")
    launch.check_contiguous("gather_normalize", images)
    if not launch.is_cupy(idx):
        idx = cupy.asarray(np.asarray(idx))  # host indices: uploaded (outside a captured step)
    if idx.ndim != 1 or idx.dtype.kind != "i" or idx.itemsize not in (4, 8):
        raise TypeError(f"cuda.gather_normalize: idx must be 1-D int32/int64, got {idx.shape} {idx.dtype}")
    idx = idx if idx.flags.c_contiguous else copy(idx)
    m = images.shape[0]
    chw = math.prod(images.shape[1:])
    out = launch.new((idx.size,) + tuple(images.shape[1:]), np.float32)
    launch.check_int32("gather_normalize", idx.size)
    if out.size:
        mean, std = float(mean), float(std)
        launch.grid_stride(launch.kernel(DATA, "gather_normalize_kernel", launch.ctype(idx.dtype)),
                           out.size,
                           (out, images, idx, np.int32(idx.size), np.int64(m), np.int64(chw),
                            np.float32(1.0 / (255.0 * std)), np.float32(mean / std)))
    return out


def dropout_mask(shape, p, dtype=np.float32):
    """Keep each element with probability 1-p, scaled by 1/(1-p) (inverted dropout)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"cuda.dropout_mask: p must be in [0, 1), got {p}")
    dtype = np.dtype(dtype)
    if dtype not in launch.FLOATS:
        raise TypeError(f"cuda.dropout_mask: dtype {dtype} not supported (float32 or float64)")
    out = launch.new(shape, dtype)
    n = out.size
    if n:
        groups = -(-n // 4)  # one Philox call gives 4 numbers
        state = runtime.rng_state
        launch.grid_stride(launch.kernel(DATA, "dropout_mask_kernel", launch.ctype(dtype)), groups,
                           (out, np.int64(n), state, np.float32(p), dtype.type(1.0 / (1.0 - p))))
        launch.kernel(DATA, "rng_advance_kernel")((1,), (1,), (state, np.uint64(groups)))
    return out
