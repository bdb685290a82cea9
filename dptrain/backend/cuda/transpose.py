"""Launchers of kernels/transpose.cu: data movement through strides.

Conventions (the .cu file's header has the kernel side):
  * Every op returns a new contiguous array, written with `=`, bit for bit (copies move raw
    bits: one kernel per element size serves every dtype of that size).
  * strided_copy(dst, src, src_strides) is the workhorse: dst and src are views whose first
    element the kernel starts from, read and written through one Layout (shape, element
    strides; 0 broadcasts, negative reverses). Axes of size 1 are dropped and neighbours
    contiguous in both operands merged first (launch.collapse). 32-bit indices, asserted.
  * Index arrays: one 1-D integer array picking rows (a batch of labels) runs take_rows;
    host index arrays are bounds-checked and uploaded, device ones wrap modulo the row count
    (no sync to check them). Other index arrays use CuPy's indexing (outside the hot path).
  * getitem_backward sums repeated indices by gathering (index_add_kernel), in a fixed order.
  * spreader puts a channels-last grid on every s-th pixel of a larger one, zeros between
    (a strided 1x1 convolution's backward-data, conv2d._spread).
  * to_channels_last lays an NCHW input out as the stem convolution reads it (zero columns,
    column pairs, zero channels) in one pass.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.elementwise import fill_
from dptrain.backend.registry import op

TR = "transpose.cu"
NARROW_BYTES = 48 * 1024  # a matrix narrow_transpose_kernel moves whole (static smem limit)


def strided_copy(dst, src, src_strides):
    """dst[i] = src[i] for every index of dst.shape, src read with `src_strides` (elements;
    0 broadcasts). Any dst strides. Exact: copies raw bits."""
    n = dst.size
    if n == 0:
        return dst
    if dst.dtype != src.dtype:
        raise TypeError(f"cuda.copy: copy between {src.dtype} and {dst.dtype} needs astype first")
    launch.check_int32("copy", n)
    dims, (so, si) = launch.collapse(dst.shape, launch.estrides(dst), src_strides)
    v = _vector(dims, (so, si), dst.itemsize, (dst.data.ptr, src.data.ptr))
    ctype = "uint4" if v > 1 else launch.bits(dst.itemsize)[0]
    if v > 1:
        dims = dims[:-1] + [dims[-1] // v]
        so, si = ([s // v for s in st[:-1]] + [1] for st in (so, si))
    launch.grid_stride(launch.kernel(TR, "strided_copy_kernel", ctype), n // v,
                       (dst, src, np.int32(n // v), launch.layout(dims, so, si)))
    return dst


def _vector(dims, strides, itemsize, pointers) -> int:
    """Elements a thread of strided_copy moves as one 16-byte vector: where the innermost
    axis runs contiguous in both operands and every stride, that axis's length and both
    starts come in whole vectors (a broadcast of (N, 1, 1, C) to (N, H, W, C) copies C
    channels a pixel: ResNet-50's pooling gradient at batch 256, 88 us as 2-byte moves);
    else 1."""
    v = 16 // itemsize
    if (v == 1 or not dims or any(st[-1] != 1 for st in strides) or dims[-1] % v
            or any(s % v for st in strides for s in st[:-1]) or any(p % 16 for p in pointers)):
        return 1
    return v


def transposer(nb: int, rows: int, cols: int, dtype):
    """run(a) -> a new contiguous (nb, cols, rows) array holding each of the nb (rows, cols)
    matrices of the contiguous array a transposed (tile_transpose_kernel: both sides
    contiguous). The fast GEMM and convolution paths copy their operands with it."""
    if rows == 1 or cols == 1:  # the elements stay in order: a plain copy, no tiles
        return lambda a: copy(a).reshape(nb, cols, rows)
    itemsize = np.dtype(dtype).itemsize
    if min(rows, cols) < 32 and rows * cols * itemsize <= NARROW_BYTES and itemsize in (2, 4):
        fn_narrow = launch.kernel(TR, "narrow_transpose_kernel", launch.bits(itemsize)[0])
        blocks, smem = min(nb, 8 * launch.sm_count()), rows * cols * itemsize

        def narrow_run(a):  # whole matrices through shared memory
            out = launch.new((nb, cols, rows), dtype)
            if out.size:
                vec = np.int32(smem % 16 == 0 and a.data.ptr % 16 == 0)
                fn_narrow((blocks,), (256,), (a, out, np.int32(nb), np.int32(rows),
                                              np.int32(cols), vec), shared_mem=smem)
            return out

        return narrow_run
    if nb > launch.GRID_YZ_MAX or -(-rows // 32) > launch.GRID_YZ_MAX:
        raise ValueError(f"cuda.transpose: {nb} matrices of {rows} rows exceed the grid's limit")
    if itemsize == 2 and rows % 2 == 0 and cols % 2 == 0:
        fn = launch.kernel(TR, "tile_transpose_pairs_kernel")  # 16-bit pairs, 64 x 64 tiles
        tile = 64
    else:
        fn = launch.kernel(TR, "tile_transpose_kernel", launch.bits(np.dtype(dtype).itemsize)[0])
        tile = 32
    grid, tail = (-(-cols // tile), -(-rows // tile), nb), (np.int32(rows), np.int32(cols))

    def run(a):
        out = launch.new((nb, cols, rows), dtype)
        fn(grid, (32, 8), (a, out) + tail)
        return out

    return run


def spreader(shape, dense_hw, stride, padding, dtype):
    """run(dense, out) -> out: the contiguous (N, H, W, C) array `out` of `shape` holding the
    contiguous (N, Hi, Wi, C) array `dense` (dense_hw = (Hi, Wi)) at the pixels
    (s * i - p, t * j - q) of stride (s, t) and padding (p, q) that lie inside, zeros
    elsewhere (stride_spread_kernel: one pass, a block an image row, pixels' rows as 16-byte
    vectors where they and both arrays' starts are 16-byte aligned). Exact: raw bits."""
    nb, h, w, c = shape
    itemsize = np.dtype(dtype).itemsize
    tail = tuple(np.int32(v) for v in (h, w, *dense_hw, *stride, *padding))
    element = launch.kernel(TR, "stride_spread_kernel", launch.bits(itemsize)[0])
    vector = (launch.kernel(TR, "stride_spread_kernel", "uint4")
              if c * itemsize % 16 == 0 else None)

    def run(dense, out):
        if out.size:
            aligned = vector is not None and (dense.data.ptr | out.data.ptr) % 16 == 0
            fn, row = (vector, c * itemsize // 16) if aligned else (element, c)
            fn((nb * h,), (256,), (out, dense, np.int32(row)) + tail)  # a block an image row
        return out

    return run


@op
def copy(a):
    launch.check_arrays("copy", a)
    return strided_copy(launch.new(a.shape, a.dtype), a, launch.estrides(a))


@op
def transpose(a, axes):
    launch.check_arrays("transpose", a)
    axes = tuple(range(a.ndim))[::-1] if axes is None else tuple(int(x) % a.ndim for x in axes)
    if sorted(axes) != list(range(a.ndim)):
        raise ValueError(f"cuda.transpose: axes {axes} are not a permutation of {a.ndim} axes")
    st = launch.estrides(a)
    out = launch.new(tuple(a.shape[i] for i in axes), a.dtype)
    return strided_copy(out, a, [st[i] for i in axes])


@op
def to_channels_last(x, group=1, left=0, right=0, channels=None):
    """NCHW x laid out channels-last with zero columns and channels, `group` columns a pixel
    (see the CPU reference): one pass of channels_last_input_kernel, 16-byte stores where
    a pixel's channels allow."""
    launch.check_arrays("to_channels_last", x)
    launch.check_contiguous("to_channels_last", x)
    if x.ndim != 4 or x.itemsize not in (2, 4, 8):
        raise TypeError(f"cuda.to_channels_last: x must be NCHW of 2-, 4- or 8-byte elements, "
                        f"got {x.shape} {x.dtype}")
    n, c, h, w = x.shape
    channels = group * c if channels is None else channels
    cols = left + w + right
    if cols % group or channels < group * c or min(left, right) < 0:
        raise ValueError(f"cuda.to_channels_last: {left} + {w} + {right} columns in groups of "
                         f"{group}, {channels} channels for {c} a column: no such layout")
    out = launch.new((n, h, cols // group, channels), x.dtype)
    vec = 16 // x.itemsize if channels * x.itemsize % 16 == 0 else 1
    items = out.size // vec
    if items:
        launch.check_int32("to_channels_last", out.size, x.size)
        fn = launch.kernel(TR, "channels_last_input_kernel", launch.bits(x.itemsize)[0],
                           str(vec))
        launch.grid_stride(fn, items, (out, x, *map(np.int32, (items, c, h, w, cols // group,
                                                                 channels, group, left))))
    return out


def _is_basic(index):
    """Ints, slices, None and Ellipsis only: a[index] is a view (no index arrays)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(
        isinstance(i, (int, np.integer, slice, type(None), type(Ellipsis)))
        and not isinstance(i, (bool, np.bool_))
        for i in items
    )


def _device_index(index):
    """The index with every array / list in it moved to the device (CuPy's indexing)."""
    def move(i):
        return cupy.asarray(i) if isinstance(i, (np.ndarray, list)) else i
    return tuple(move(i) for i in index) if isinstance(index, tuple) else move(index)


def _row_index(index, rows):
    """The device index array when `index` picks whole rows of an array of `rows` rows with
    one 1-D integer array (a batch of labels, say), else None. Host arrays are bounds-checked
    and uploaded; device arrays cannot be checked without a sync (take_rows wraps)."""
    i = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    if isinstance(i, np.ndarray) and i.ndim == 1 and i.dtype.kind == "i":
        if i.size and not (-rows <= i.min() and i.max() < rows):
            raise IndexError(f"cuda.getitem: index out of range for {rows} rows")
        i = cupy.asarray(i.astype(np.int64))
    if launch.is_cupy(i) and i.ndim == 1 and i.dtype.kind == "i" and i.itemsize in (4, 8):
        return i if i.flags.c_contiguous else copy(i)
    return None


@op
def getitem(a, index):
    launch.check_arrays("getitem", a)
    if _is_basic(index):
        view = a[index]  # CuPy basic indexing: a view (metadata only); the copy is ours
        return strided_copy(launch.new(view.shape, a.dtype), view, launch.estrides(view))
    rows = _row_index(index, a.shape[0]) if a.ndim >= 1 and a.shape[0] > 0 else None
    if rows is not None:
        src = a if a.flags.c_contiguous else copy(a)
        out = launch.new((rows.size,) + tuple(a.shape[1:]), a.dtype)
        row = src.size // a.shape[0]
        if out.size:
            fn = launch.kernel(TR, "take_rows_kernel", launch.bits(a.itemsize)[0],
                               launch.ctype(rows.dtype))
            launch.grid_stride(fn, out.size, (out, src, rows, np.int32(rows.size),
                                              np.int64(a.shape[0]), np.int64(row)))
        return out
    # Other index arrays: CuPy's indexing gathers (outside the training hot path).
    res = a[_device_index(index)]
    return res if res.flags.c_contiguous else copy(res)


@op
def getitem_backward(gy, shape, index):
    """Gradient of getitem: zeros of `shape` with gy added at `index` (repeats accumulate)."""
    launch.check_arrays("getitem_backward", gy)
    shape = tuple(shape)
    gx = launch.new(shape, gy.dtype)
    if _is_basic(index):
        fill_(gx, 0)
        view = gx[index]
        launch.check_shape("getitem_backward", gy, view.shape, "gy")
        strided_copy(view, gy, launch.bstrides(gy, view.shape))
        return gx
    launch.check_float("getitem_backward", gy)
    # CuPy indexing of an arange gives each gy element's flat target (index normalisation);
    # our gather kernel then sums repeats in a fixed order (np.add.at's).
    flat = cupy.arange(math.prod(shape), dtype=cupy.int64).reshape(shape)[_device_index(index)]
    launch.check_shape("getitem_backward", gy, flat.shape, "gy")
    flat = flat.reshape(-1) if flat.flags.c_contiguous else copy(flat).reshape(-1)
    src = gy if gy.flags.c_contiguous else copy(gy)
    launch.check_int32("getitem_backward", gx.size, src.size)
    if gx.size:
        fn = launch.kernel(TR, "index_add_kernel", launch.ctype(gy.dtype))
        launch.grid_stride(fn, gx.size, (gx, src, flat, np.int32(src.size), np.int32(gx.size)))
    return gx


@op
def concatenate(arrays, axis):
    arrays = list(arrays)
    launch.check_arrays("concatenate", *arrays)
    first = arrays[0]
    axis = int(axis) % first.ndim
    for a in arrays[1:]:
        if a.dtype != first.dtype or a.ndim != first.ndim or any(
            a.shape[i] != first.shape[i] for i in range(first.ndim) if i != axis
        ):
            raise ValueError(f"cuda.concatenate: {a.shape} {a.dtype} does not match "
                             f"{first.shape} {first.dtype} along axis {axis}")
    shape = list(first.shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    out = launch.new(tuple(shape), first.dtype)
    start = 0
    for a in arrays:
        stop = start + a.shape[axis]
        view = out[(slice(None),) * axis + (slice(start, stop),)]
        strided_copy(view, a, launch.estrides(a))
        start = stop
    return out


@op
def broadcast_to(a, shape):
    launch.check_arrays("broadcast_to", a)
    shape = tuple(shape)
    return strided_copy(launch.new(shape, a.dtype), a, launch.bstrides(a, shape))
