"""Tensor maps for Hopper's tensor memory accelerator (TMA): the 128-byte descriptors a kernel
takes by value (a ``const __grid_constant__ TmaMap`` parameter, kernels/tma.cuh) to copy a
box of a global tensor into shared memory with one instruction, zero-filling what lies
outside the tensor. Encoded on the host by the driver (cuTensorMapEncodeTiled /
cuTensorMapEncodeIm2col through ctypes: CuPy does not wrap them), with the 128-byte swizzle
that kernels/wgmma.cuh's tiles use; `strips` alone land unswizzled (conv2d_strip.cu reads
them through unswizzled descriptors).

A map holds its tensor's address: a launch encodes the maps of its own arrays on the host
(cached by their arguments), and a captured CUDA graph keeps the values it was captured
with, which stay right because a captured step reuses its buffers.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from dptrain.backend.bfloat16 import BFLOAT16

# CUtensorMap: 128 bytes, passed by value like the structs of launch.py.
TENSOR_MAP = np.dtype([("bits", np.uint64, (16,))])

# CUtensorMapDataType for each storage dtype (float is copied as its bits, TF32 included).
_DATA_TYPE = {np.dtype(np.float16): 6, np.dtype(np.float32): 7, np.dtype(BFLOAT16): 9}
_NO_SWIZZLE, _SWIZZLE_128B, _L2_256B, _NO_INTERLEAVE, _ZERO_FILL = 0, 3, 3, 0, 0

# cuTensorMapEncodeIm2col's corner offsets are signed 8-bit for a 4-D (NHWC) tensor; its
# per-load filter offsets unsigned 8-bit.
CORNER_MIN, CORNER_MAX, OFFSET_MAX = -128, 127, 255


class TensorMapError(RuntimeError):
    """The driver refused a tensor map (the message names its shape and the CUresult)."""


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    u32p, u64p, i32p = (ctypes.POINTER(t) for t in (ctypes.c_uint32, ctypes.c_uint64,
                                                      ctypes.c_int32))
    tiled = lib.cuTensorMapEncodeTiled
    tiled.restype = ctypes.c_int
    tiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                      u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    im2col = lib.cuTensorMapEncodeIm2col
    im2col.restype = ctypes.c_int
    im2col.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                       u64p, i32p, i32p, ctypes.c_uint32, ctypes.c_uint32, u32p, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return tiled, im2col


def _array(ctype, values):
    return (ctype * len(values))(*values)


def _encode(what, call, *args):
    """Runs the driver's encoder into a 64-byte aligned scratch buffer (its requirement) and
    returns the map as a kernel argument (any alignment does there: the driver copies it)."""
    scratch = np.zeros(TENSOR_MAP.itemsize + 64, np.uint8)
    at = -scratch.ctypes.data % 64
    res = call(ctypes.c_void_p(scratch.ctypes.data + at), *args)
    if res != 0:
        raise TensorMapError(f"cuda.tma: the driver refused the tensor map of {what} "
                             f"(CUresult {res})")
    return scratch[at:at + TENSOR_MAP.itemsize].view(TENSOR_MAP).copy()


def tiled(a, rows: int, cols: int, box_rows: int, box_cols: int):
    """The map of the row-major (rows, cols) array `a` (contiguous), loaded as boxes of
    box_rows x box_cols elements (box_cols * itemsize == 128: one swizzled 128-byte row per
    box row); rows and columns past the array read as zeros."""
    return _tiled(a.data.ptr, a.dtype, rows, cols, box_rows, box_cols)


def strips(a, shape, width: int, rows: int):
    """The map of the NHWC array `a` of `shape` (n, h, w, c), c * itemsize a multiple of 16,
    loaded as boxes of `rows` rows x `width` pixels x all c channels of one image, unswizzled
    (a box lands as its rows of pixels of c values, dense); what falls outside the image
    (negative coordinates too) reads as zeros."""
    return _strips(a.data.ptr, a.dtype, tuple(shape), width, rows)


def pixel_rows(a, rows: int, width: int, channels: int):
    """The map of the channels-last 16-bit array `a` as `rows` rows of `width` pixels of
    `channels` channels (channels a multiple of 8), loaded as boxes of 64 pixels x 64
    channels of one row, with the 128-byte swizzle; pixels past a row's width and channels
    past `channels` read as zeros."""
    return _pixel_rows(a.data.ptr, a.dtype, rows, width, channels)


def im2col(a, shape, lower, upper, strides, channels: int, pixels: int):
    """The im2col map of the NHWC array `a` of `shape` (n, h, w, c): a load fetches
    `pixels` output pixels' `channels` channels from one filter tap. The pixels walk the
    box of base positions lower[d] .. size[d] - 1 + upper[d] (d = h, w) with `strides`,
    then the images; a load's filter offset is added to each base, and what falls outside
    the tensor reads as zeros."""
    return _im2col(a.data.ptr, a.dtype, tuple(shape), tuple(lower), tuple(upper),
                   tuple(strides), channels, pixels)


# A map depends on its arguments alone: eager steps that reuse the pool's addresses (most
# of them) skip the driver call.
@functools.lru_cache(maxsize=1024)
def _tiled(ptr, dtype, rows, cols, box_rows, box_cols):
    item = dtype.itemsize
    return _encode(f"a {rows}x{cols} {dtype} array", _driver()[0], _DATA_TYPE[dtype], 2,
                   ctypes.c_void_p(ptr), _array(ctypes.c_uint64, (cols, rows)),
                   _array(ctypes.c_uint64, (cols * item,)),
                   _array(ctypes.c_uint32, (box_cols, box_rows)),
                   _array(ctypes.c_uint32, (1, 1)), _NO_INTERLEAVE, _SWIZZLE_128B, _L2_256B,
                   _ZERO_FILL)


@functools.lru_cache(maxsize=1024)
def _strips(ptr, dtype, shape, width, rows):
    n, h, w, c = shape
    item = dtype.itemsize
    return _encode(f"an NHWC {shape} {dtype} array (strips of {rows} x {width})",
                   _driver()[0], _DATA_TYPE[dtype], 4, ctypes.c_void_p(ptr),
                   _array(ctypes.c_uint64, (c, w, h, n)),
                   _array(ctypes.c_uint64, (c * item, w * c * item, h * w * c * item)),
                   _array(ctypes.c_uint32, (c, width, rows, 1)),
                   _array(ctypes.c_uint32, (1, 1, 1, 1)), _NO_INTERLEAVE, _NO_SWIZZLE, _L2_256B,
                   _ZERO_FILL)


@functools.lru_cache(maxsize=1024)
def _pixel_rows(ptr, dtype, rows, width, channels):
    item = dtype.itemsize
    return _encode(f"{rows} rows of {width} x {channels} {dtype}", _driver()[0],
                   _DATA_TYPE[dtype], 3, ctypes.c_void_p(ptr),
                   _array(ctypes.c_uint64, (channels, width, rows)),
                   _array(ctypes.c_uint64, (channels * item, width * channels * item)),
                   _array(ctypes.c_uint32, (64, 64, 1)), _array(ctypes.c_uint32, (1, 1, 1)),
                   _NO_INTERLEAVE, _SWIZZLE_128B, _L2_256B, _ZERO_FILL)


@functools.lru_cache(maxsize=1024)
def _im2col(ptr, dtype, shape, lower, upper, strides, channels, pixels):
    n, h, w, c = shape
    item = dtype.itemsize
    (lh, lw), (uh, uw), (sh, sw) = lower, upper, strides
    return _encode(f"an NHWC {shape} {dtype} array (box {lower}..{upper}, strides {strides})",
                   _driver()[1], _DATA_TYPE[dtype], 4, ctypes.c_void_p(ptr),
                   _array(ctypes.c_uint64, (c, w, h, n)),
                   _array(ctypes.c_uint64, (c * item, w * c * item, h * w * c * item)),
                   _array(ctypes.c_int32, (lw, lh)), _array(ctypes.c_int32, (uw, uh)),
                   channels, pixels, _array(ctypes.c_uint32, (1, sw, sh, 1)), _NO_INTERLEAVE,
                   _SWIZZLE_128B, _L2_256B, _ZERO_FILL)
