"""The CUDA backend: launchers of our kernels (kernels/*.cu), one function per name in ``OPS``.

Same signatures and results as ``cpu.py``. CuPy supplies memory (``cupy.empty``, i.e. its
pool), streams and NVRTC; every op's arithmetic runs in our kernels. Each launcher asserts its
preconditions, casts scalar arguments to the kernel parameter's type (CuPy would pass a Python
int as 64 bits) and launches on the current stream. Nothing here waits for the device except
``to_numpy`` and host-to-device ``asarray``/``copy_``, so a training step can be captured as a
CUDA graph. Kernel conventions are in each .cu file's header and in kernels/NOTES-backend.md.
"""
from __future__ import annotations

import builtins
import functools
import math

import cupy
import numpy as np

from dptrain.backend import kernels

name = "cuda"

_BLOCK = 256  # threads per block for every launch
_WARPS = _BLOCK // 32
_MAX_DIMS = 8  # DP_MAX_DIMS in the .cu files
_INT32_MAX = 2**31 - 1
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

EW, TR, RED, SM, POOL, OPT, DATA = (
    "elementwise.cu", "transpose.cu", "reduce.cu", "softmax.cu", "pool.cu", "optim.cu", "data.cu")

# struct Layout in the .cu files: a shape and two operands' element strides, passed by value.
_LAYOUT = np.dtype([("ndim", np.int32), ("shape", np.int32, (_MAX_DIMS,)),
                    ("s0", np.int32, (_MAX_DIMS,)), ("s1", np.int32, (_MAX_DIMS,))])
# struct PoolGeom in pool.cu.
_POOL_GEOM = np.dtype([("v", np.int32, (11,))])

# C type of each supported dtype, keyed by (kind, itemsize) so int64 spelled 'l' or 'q' agree.
_CTYPES = {("f", 4): "float", ("f", 8): "double", ("i", 4): "int", ("i", 8): "long long",
           ("u", 1): "unsigned char", ("b", 1): "bool"}
# Data movement works on raw bits: one kernel per element size serves every dtype of that size.
_BITS = {1: ("unsigned char", np.uint8), 2: ("unsigned short", np.uint16),
         4: ("unsigned int", np.uint32), 8: ("unsigned long long", np.uint64)}


# ----------------------------------------------------------------------------- launch helpers


def _new(shape, dtype):
    """Every output array comes from here (CuPy's pool); the tests wrap it to poison outputs."""
    return cupy.empty(shape, dtype=dtype)


def _ctype(dtype) -> str:
    dt = np.dtype(dtype)
    try:
        return _CTYPES[(dt.kind, dt.itemsize)]
    except KeyError:
        raise TypeError(f"cuda backend: dtype {dt} is not supported") from None


def _bits(itemsize):
    try:
        return _BITS[itemsize]
    except KeyError:
        raise TypeError(f"cuda backend: no copy kernel for {itemsize}-byte elements") from None


def _kernel(filename, kernel, *targs):
    """The instantiation kernel<targs...> of kernels/filename (compiled once per process)."""
    return kernels.function(filename, f"{kernel}<{', '.join(targs)}>")


@functools.lru_cache(maxsize=None)
def _sm_count(device_id):
    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


def _launch(kernel, items, args, per_block=_BLOCK, warps=False):
    """Launch on the current stream with enough blocks for `items` work items of which one
    block takes `per_block`; capped, since every kernel loops grid-stride. `per_block` counts
    items per block of _BLOCK threads, so _BLOCK // per_block threads share an item (1, a
    group of lanes, a warp, or the whole block); set_launch_config may change the block.
    `warps`: the kernel needs whole warps even with a thread per item."""
    per_item = _BLOCK // per_block
    threads = _block_threads(warps=warps or per_item > 1)
    per_block = 1 if per_item == _BLOCK else builtins.max(1, threads // per_item)
    cap = _launch_max_blocks or _sm_count(cupy.cuda.runtime.getDevice()) * 16
    grid = builtins.max(1, builtins.min(cap, -(-items // per_block)))
    kernel((grid,), (threads,), args)


# ----------------------------------------------------------------------------- launch override
# For scaling/threads.py, which sweeps the launch shape from one thread up. It applies to every
# launch made in this module (elementwise, copies, reductions, softmax, pooling, optimizers,
# data); GEMM and convolution (cuda_matmul.py) keep their fixed tiles. Default: unchanged.

_launch_threads = None  # threads per block; None: _BLOCK
_launch_max_blocks = None  # blocks per launch at most; None: 16 per SM


def set_launch_config(threads_per_block=None, max_blocks=None):
    """Override threads per block (1..1024) and the blocks-per-launch cap; None restores the
    default. Kernels whose lanes cooperate (shuffles, block trees: reductions, softmax rows,
    max-pool backward) need whole warps, so they get the value rounded down to a multiple of
    32, and at least 32."""
    global _launch_threads, _launch_max_blocks
    for flag, value, top in (("threads_per_block", threads_per_block, 1024),
                             ("max_blocks", max_blocks, 2**31 - 1)):
        if value is not None and not (isinstance(value, (int, np.integer)) and 1 <= value <= top):
            raise ValueError(f"cuda.set_launch_config: {flag} must be an integer in "
                             f"[1, {top}] or None, got {value!r}")
    _launch_threads = None if threads_per_block is None else int(threads_per_block)
    _launch_max_blocks = None if max_blocks is None else int(max_blocks)


def get_launch_config():
    """(threads_per_block, max_blocks) as set; None where the default applies."""
    return _launch_threads, _launch_max_blocks


def _block_threads(warps=False):
    """Threads per block for the next launch; `warps`: the kernel needs whole warps."""
    threads = _launch_threads or _BLOCK
    return builtins.max(32, threads - threads % 32) if warps else threads


def _is_cupy(a):
    return isinstance(a, cupy.ndarray)


def _check_arrays(op, *arrays):
    for a in arrays:
        if not _is_cupy(a):
            raise TypeError(f"cuda.{op}: expected a CuPy array, got {type(a).__name__}")


def _check_float(op, *arrays):
    """CuPy arrays of one floating dtype (float32 or float64)."""
    _check_arrays(op, *arrays)
    dt = arrays[0].dtype
    if dt not in _FLOATS:
        raise TypeError(f"cuda.{op}: dtype {dt} not supported (float32 or float64)")
    for a in arrays[1:]:
        if a.dtype != dt:
            raise TypeError(f"cuda.{op}: mixed dtypes {dt} and {a.dtype}")


def _check_contiguous(op, *arrays):
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError(f"cuda.{op}: arrays must be C-contiguous (shape {a.shape}, "
                             f"strides {a.strides})")


def _check_shape(op, a, shape, what="array"):
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"cuda.{op}: {what} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def _check_int_labels(op, labels, n):
    _check_arrays(op, labels)
    if labels.dtype.kind != "i" or labels.dtype.itemsize not in (4, 8):
        raise TypeError(f"cuda.{op}: labels must be int32 or int64, got {labels.dtype}")
    _check_contiguous(op, labels)
    _check_shape(op, labels, (n,), "labels")


def _check_int32(op, *counts):
    if builtins.max(counts, default=0) > _INT32_MAX:
        raise ValueError(f"cuda.{op}: size {builtins.max(counts)} exceeds 32-bit indexing")


def _estrides(a):
    """Strides in elements rather than bytes."""
    return [s // a.itemsize for s in a.strides]


def _broadcast_shape(op, *shapes):
    nd = builtins.max(len(s) for s in shapes)
    out = []
    for i in range(nd):
        dims = {s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise ValueError(f"cuda.{op}: shapes {', '.join(map(str, shapes))} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _bstrides(a, shape):
    """Element strides of `a` broadcast to `shape` (0 along broadcast axes)."""
    lead = len(shape) - a.ndim
    if lead < 0:
        raise ValueError(f"cannot broadcast shape {a.shape} to {tuple(shape)}")
    out = [0] * len(shape)
    for i, (n, s) in enumerate(zip(a.shape, _estrides(a))):
        if n == shape[lead + i]:
            out[lead + i] = s if n != 1 else 0
        elif n != 1:
            raise ValueError(f"cannot broadcast shape {a.shape} to {tuple(shape)}")
    return out


def _collapse(shape, *strides):
    """Drop size-1 axes and merge neighbours that are contiguous in every operand, so the
    kernel does fewer index divisions (a contiguous copy becomes one axis)."""
    dims, merged = [], [[] for _ in strides]
    for i, n in enumerate(shape):
        if n == 1:
            continue
        if dims and all(m[-1] == s[i] * n for m, s in zip(merged, strides)):
            dims[-1] *= n
            for m, s in zip(merged, strides):
                m[-1] = s[i]
        else:
            dims.append(n)
            for m, s in zip(merged, strides):
                m.append(s[i])
    return dims, merged


def _layout(shape, s0, s1=None):
    """A struct Layout kernel argument (a size-1 structured array, passed by value)."""
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"cuda backend: {len(shape)} non-mergeable axes (at most {_MAX_DIMS})")
    for st in (s0, s1 or ()):
        if builtins.sum((n - 1) * abs(s) for n, s in zip(shape, st)) > _INT32_MAX:
            raise ValueError("cuda backend: array too large for 32-bit strided indexing")
    lay = np.zeros(1, dtype=_LAYOUT)
    nd = len(shape)
    lay["ndim"] = nd
    lay["shape"][0, :nd] = shape
    lay["s0"][0, :nd] = s0
    if s1 is not None:
        lay["s1"][0, :nd] = s1
    return lay


def _strided_copy(dst, src, src_strides):
    """dst[i] = src[i] for every index of dst.shape, src read with `src_strides` (elements;
    0 broadcasts). Any dst strides. Exact: copies raw bits."""
    n = dst.size
    if n == 0:
        return dst
    if dst.dtype != src.dtype:
        raise TypeError(f"cuda: copy between {src.dtype} and {dst.dtype} needs astype first")
    _check_int32("copy", n)
    dims, (so, si) = _collapse(dst.shape, _estrides(dst), src_strides)
    ctype = _bits(dst.itemsize)[0]
    _launch(_kernel(TR, "strided_copy_kernel", ctype), n, (dst, src, np.int32(n), _layout(dims, so, si)))
    return dst


# ----------------------------------------------------------------------------- arrays


def asarray(a, dtype=None):
    if _is_cupy(a):
        if dtype is not None and a.dtype != np.dtype(dtype):
            return astype(a, dtype)
        return a if a.flags.c_contiguous else copy(a)
    # Host data: a (synchronous) host-to-device copy, outside the training step. order="C"
    # rather than np.ascontiguousarray, which would turn a 0-d array into shape (1,).
    return cupy.asarray(np.asarray(a, dtype=dtype, order="C"))


def to_numpy(a):
    return cupy.asnumpy(a) if _is_cupy(a) else np.asarray(a)


def empty(shape, dtype=np.float32):
    return _new(shape, dtype)


def zeros(shape, dtype=np.float32):
    return fill_(_new(shape, dtype), 0)


def full(shape, value, dtype=np.float32):
    return fill_(_new(shape, dtype), value)


def copy(a):
    _check_arrays("copy", a)
    return _strided_copy(_new(a.shape, a.dtype), a, _estrides(a))


def copy_(dst, src):
    """dst[...] = src: src broadcasts to dst and is cast to dst's dtype; host data is uploaded."""
    _check_arrays("copy_", dst)
    if not _is_cupy(src):
        src = cupy.asarray(np.asarray(src, dtype=dst.dtype, order="C"))
    if src.dtype != dst.dtype:
        src = astype(src, dst.dtype)
    if _broadcast_shape("copy_", dst.shape, src.shape) != tuple(dst.shape):
        raise ValueError(f"cuda.copy_: cannot copy shape {src.shape} into {dst.shape}")
    return _strided_copy(dst, src, _bstrides(src, dst.shape))


def fill_(a, value):
    _check_arrays("fill_", a)
    _check_contiguous("fill_", a)
    if a.size:
        ctype, utype = _bits(a.itemsize)
        pattern = np.array(value, dtype=a.dtype).view(utype)[()]  # value's bits in a's dtype
        _launch(_kernel(EW, "fill_kernel", ctype), a.size, (a, np.int64(a.size), pattern))
    return a


def set_scalar_(buf, values):
    """Write host floats into the first len(values) slots of `buf` (asynchronous copy)."""
    _check_arrays("set_scalar_", buf)
    host = np.ascontiguousarray(np.asarray(values, dtype=buf.dtype).reshape(-1))
    if buf.ndim != 1 or not buf.flags.c_contiguous or host.size > buf.size:
        raise ValueError(f"cuda.set_scalar_: {host.size} values do not fit buffer {buf.shape}")
    if host.size:
        # From pageable memory the copy is staged before this returns, so `host` may go.
        buf[: host.size].set(host, stream=cupy.cuda.get_current_stream())
    return buf


def astype(a, dtype):
    _check_arrays("astype", a)
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a if a.flags.c_contiguous else copy(a)  # as np.ascontiguousarray
    src = a if a.flags.c_contiguous else copy(a)
    out = _new(a.shape, dtype)
    if a.size:
        kernel = _kernel(EW, "convert_kernel", _ctype(dtype), _ctype(a.dtype))
        _launch(kernel, a.size, (out, src, np.int64(a.size)))
    return out


def transpose(a, axes):
    _check_arrays("transpose", a)
    axes = tuple(range(a.ndim))[::-1] if axes is None else tuple(int(x) % a.ndim for x in axes)
    if sorted(axes) != list(range(a.ndim)):
        raise ValueError(f"cuda.transpose: axes {axes} are not a permutation of {a.ndim} axes")
    st = _estrides(a)
    out = _new(tuple(a.shape[i] for i in axes), a.dtype)
    return _strided_copy(out, a, [st[i] for i in axes])


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
    if _is_cupy(i) and i.ndim == 1 and i.dtype.kind == "i" and i.itemsize in (4, 8):
        return i if i.flags.c_contiguous else copy(i)
    return None


def getitem(a, index):
    _check_arrays("getitem", a)
    if _is_basic(index):
        view = a[index]  # CuPy basic indexing: a view (metadata only); the copy is ours
        return _strided_copy(_new(view.shape, a.dtype), view, _estrides(view))
    rows = _row_index(index, a.shape[0]) if a.ndim >= 1 and a.shape[0] > 0 else None
    if rows is not None:
        src = a if a.flags.c_contiguous else copy(a)
        out = _new((rows.size,) + tuple(a.shape[1:]), a.dtype)
        row = src.size // a.shape[0]
        if out.size:
            kernel = _kernel(TR, "take_rows_kernel", _bits(a.itemsize)[0], _ctype(rows.dtype))
            _launch(kernel, out.size, (out, src, rows, np.int32(rows.size), np.int64(a.shape[0]),
                                       np.int64(row)))
        return out
    # Other index arrays: CuPy's indexing gathers (outside the training hot path).
    res = a[_device_index(index)]
    return res if res.flags.c_contiguous else copy(res)


def getitem_backward(gy, shape, index):
    """Gradient of getitem: zeros of `shape` with gy added at `index` (repeats accumulate)."""
    _check_arrays("getitem_backward", gy)
    shape = tuple(shape)
    gx = _new(shape, gy.dtype)
    if _is_basic(index):
        fill_(gx, 0)
        view = gx[index]
        _check_shape("getitem_backward", gy, view.shape, "gy")
        _strided_copy(view, gy, _bstrides(gy, view.shape))
        return gx
    _check_float("getitem_backward", gy)
    # CuPy indexing of an arange gives each gy element's flat target (index normalisation);
    # our gather kernel then sums repeats in a fixed order (np.add.at's).
    flat = cupy.arange(math.prod(shape), dtype=cupy.int64).reshape(shape)[_device_index(index)]
    _check_shape("getitem_backward", gy, flat.shape, "gy")
    flat = flat.reshape(-1) if flat.flags.c_contiguous else copy(flat).reshape(-1)
    src = gy if gy.flags.c_contiguous else copy(gy)
    _check_int32("getitem_backward", gx.size, src.size)
    if gx.size:
        kernel = _kernel(TR, "index_add_kernel", _ctype(gy.dtype))
        _launch(kernel, gx.size, (gx, src, flat, np.int32(src.size), np.int32(gx.size)))
    return gx


def concatenate(arrays, axis):
    arrays = list(arrays)
    _check_arrays("concatenate", *arrays)
    first = arrays[0]
    axis = int(axis) % first.ndim
    for a in arrays[1:]:
        if a.dtype != first.dtype or a.ndim != first.ndim or any(
            a.shape[i] != first.shape[i] for i in range(first.ndim) if i != axis
        ):
            raise ValueError(f"cuda.concatenate: {a.shape} {a.dtype} does not match "
                             f"{first.shape} {first.dtype} along axis {axis}")
    shape = list(first.shape)
    shape[axis] = builtins.sum(a.shape[axis] for a in arrays)
    out = _new(tuple(shape), first.dtype)
    start = 0
    for a in arrays:
        stop = start + a.shape[axis]
        view = out[(slice(None),) * axis + (slice(start, stop),)]
        _strided_copy(view, a, _estrides(a))
        start = stop
    return out


def broadcast_to(a, shape):
    _check_arrays("broadcast_to", a)
    shape = tuple(shape)
    return _strided_copy(_new(shape, a.dtype), a, _bstrides(a, shape))


def sum_to_shape(g, shape):
    """Sum a broadcast gradient back down to `shape` (the inverse of broadcasting)."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    _check_float("sum_to_shape", g)
    lead = g.ndim - len(shape)
    if lead < 0:
        raise ValueError(f"cuda.sum_to_shape: cannot reduce {g.shape} to {shape}")
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    out = _reduce("SumOp", g, axes, _reduced_shape(g.shape, axes, False))
    if out.size != math.prod(shape):
        raise ValueError(f"cuda.sum_to_shape: cannot reduce {g.shape} to {shape}")
    return out.reshape(shape)


# ----------------------------------------------------------------------------- elementwise


def _map1(op, functor, a, s=0.0, t=0.0):
    """out = functor(a) elementwise; s, t: the functor's scalars, cast to the dtype."""
    _check_float(op, a)
    _check_contiguous(op, a)
    out = _new(a.shape, a.dtype)
    if a.size:
        kernel = _kernel(EW, "map1_kernel", _ctype(a.dtype), functor)
        _launch(kernel, a.size, (out, a, np.int64(a.size), a.dtype.type(s), a.dtype.type(t)))
    return out


def _map2(op, functor, a, b, s=0.0, t=0.0):
    """out = functor(a, b) elementwise over two contiguous arrays of one shape."""
    _check_float(op, a, b)
    _check_contiguous(op, a, b)
    _check_shape(op, b, a.shape)
    out = _new(a.shape, a.dtype)
    if a.size:
        kernel = _kernel(EW, "map2_kernel", _ctype(a.dtype), functor)
        _launch(kernel, a.size, (out, a, b, np.int64(a.size), a.dtype.type(s), a.dtype.type(t)))
    return out


def _binary(op, functor, a, b, out=None):
    """out = a functor b with NumPy broadcasting (out: a new array, or a itself for add_)."""
    _check_float(op, a, b)
    shape = _broadcast_shape(op, a.shape, b.shape)
    if out is None:
        out = _new(shape, a.dtype)
    elif tuple(out.shape) != shape:
        raise ValueError(f"cuda.{op}: shape {b.shape} does not broadcast to {out.shape}")
    n = out.size
    if n == 0:
        return out
    ctype = _ctype(a.dtype)
    zero = a.dtype.type(0)
    if a.shape == b.shape and a.flags.c_contiguous and b.flags.c_contiguous:
        _launch(_kernel(EW, "map2_kernel", ctype, functor), n, (out, a, b, np.int64(n), zero, zero))
    else:
        _check_int32(op, n)
        dims, (sa, sb) = _collapse(shape, _bstrides(a, shape), _bstrides(b, shape))
        _launch(_kernel(EW, "bcast2_kernel", ctype, functor), n,
                (out, a, b, np.int32(n), _layout(dims, sa, sb)))
    return out


def add(a, b):
    return _binary("add", "Add", a, b)


def sub(a, b):
    return _binary("sub", "Sub", a, b)


def mul(a, b):
    return _binary("mul", "Mul", a, b)


def div(a, b):
    return _binary("div", "Div", a, b)


def add_(dst, src):
    """dst += src, in place (gradient accumulation); src broadcasts to dst."""
    _check_float("add_", dst, src)
    _check_contiguous("add_", dst)
    return _binary("add_", "Add", dst, src, out=dst)


def neg(a):
    return _map1("neg", "Neg", a)


def scale(a, s):
    return _map1("scale", "Scale", a, s)


def pow_scalar(a, p):
    return _map1("pow_scalar", "Pow", a, p)


def pow_scalar_backward(x, gy, p):
    return _map2("pow_scalar_backward", "PowBack", x, gy, p, p - 1)


def exp(a):
    return _map1("exp", "Exp", a)


def log(a):
    return _map1("log", "Log", a)


def sqrt(a):
    return _map1("sqrt", "Sqrt", a)


def relu(a):
    return _map1("relu", "Relu", a)


def relu_backward(y, gy):
    return _map2("relu_backward", "ReluBack", y, gy)


def sigmoid(a):
    return _map1("sigmoid", "Sigmoid", a)


def sigmoid_backward(y, gy):
    return _map2("sigmoid_backward", "SigmoidBack", y, gy)


def tanh(a):
    return _map1("tanh", "Tanh", a)


def tanh_backward(y, gy):
    return _map2("tanh_backward", "TanhBack", y, gy)


def bias_add(y, b):
    """y + b with b broadcast along axis 1 (channels of NCHW, features of (N, F))."""
    _check_float("bias_add", y, b)
    if y.ndim < 2 or b.shape != (y.shape[1],):
        raise ValueError(f"cuda.bias_add: bias {b.shape} does not match axis 1 of {y.shape}")
    return _binary("bias_add", "Add", y, b.reshape((1, -1) + (1,) * (y.ndim - 2)))


# ----------------------------------------------------------------------------- reductions

_SPLIT_MIN_K = 16384  # a reduction this long over few outputs is split in two passes
_SPLIT_CHUNK = 8192


def _axes(op, ndim, axis):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    norm = []
    for ax in axes:
        if not -ndim <= int(ax) < ndim:
            raise ValueError(f"cuda.{op}: axis {ax} out of range for {ndim} dimensions")
        norm.append(int(ax) % ndim)
    if len(set(norm)) != len(norm):
        raise ValueError(f"cuda.{op}: repeated axis in {axis}")
    return tuple(sorted(norm))


def _reduced_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def _reduction_layouts(op, a, axes):
    """M outputs of K elements: element k of output m sits at offset(m, Lk) + offset(k, Lr).
    Also whether the reduced axes hold a's unit stride (then lanes read along k, coalesced)."""
    st = _estrides(a)
    kept = [i for i in range(a.ndim) if i not in axes]
    M = math.prod(a.shape[i] for i in kept)
    K = math.prod(a.shape[i] for i in axes)
    _check_int32(op, M, K)
    kdims, (kst,) = _collapse([a.shape[i] for i in kept], [st[i] for i in kept])
    rdims, (rst,) = _collapse([a.shape[i] for i in axes], [st[i] for i in axes])
    inner = not rdims or abs(rst[-1]) == 1
    return M, K, _layout(kdims, kst), _layout(rdims, rst), inner


def _pow2_at_least(n):
    return 1 << builtins.max(0, int(n) - 1).bit_length()


def _group_size(entries, per_entry, inner):
    """Threads per output (see reduce.cu): a block for long coalesced rows; for shorter rows
    enough lanes that each reads about 4 elements (fewer shuffle steps per element); one
    thread per output when there are many outputs read across k."""
    if inner and per_entry >= 2048:
        return _block_threads(warps=True)  # the whole block (reduce.cu: G == blockDim.x)
    if inner or entries < 4096:
        return builtins.min(32, _pow2_at_least(-(-per_entry // 4)))
    return 1


def _run_reduce(func, out, src, M, S, K, chunk, lk, lr, G):
    per_block = 1 if G > 32 else _BLOCK // G  # G > 32: a whole block per entry
    # warps=True: reduce.cu takes G == blockDim.x as "whole block", so never a block of 1.
    _launch(func, M * S, (out, src, np.int32(M), np.int32(S), np.int32(K), np.int32(chunk),
                          lk, lr, np.int32(G)), per_block, warps=True)


def _reduce(op, a, axes, out_shape):
    """Sum (op "SumOp") or max ("MaxOp") of `a` over `axes`, deterministic (reduce.cu)."""
    opname = "sum" if op == "SumOp" else "max"
    out = _new(out_shape, a.dtype)
    M, K, lk, lr, inner = _reduction_layouts(opname, a, axes)
    if M == 0:
        return out
    if K == 0:
        if op == "MaxOp":
            raise ValueError("cuda.max: zero-size reduction has no identity")
        return fill_(out, 0)
    t = _ctype(a.dtype)
    acc = "double" if op == "SumOp" else t
    if K < _SPLIT_MIN_K or M >= 1024:
        func = _kernel(RED, "reduce_kernel", t, acc, t, op)
        _run_reduce(func, out, a, M, 1, K, K, lk, lr, _group_size(M, K, inner))
        return out
    # Two passes: S partials per output (in the accumulator type), then one fold over them.
    S = -(-K // _SPLIT_CHUNK)
    chunk = -(-K // S)
    partial = _new((M, S), np.dtype(np.float64) if acc == "double" else a.dtype)
    func = _kernel(RED, "reduce_kernel", t, acc, acc, op)
    _run_reduce(func, partial, a, M, S, K, chunk, lk, lr, _group_size(M * S, chunk, inner))
    func = _kernel(RED, "reduce_kernel", acc, acc, t, op)
    _run_reduce(func, out, partial, M, 1, S, S, _layout([M], [S]), _layout([S], [1]),
                _group_size(M, S, True))
    return out


def sum(a, axis=None, keepdims=False):  # noqa: A001 - the op's name
    _check_float("sum", a)
    axes = _axes("sum", a.ndim, axis)
    return _reduce("SumOp", a, axes, _reduced_shape(a.shape, axes, keepdims))


def max(a, axis=None, keepdims=False):  # noqa: A001
    _check_float("max", a)
    axes = _axes("max", a.ndim, axis)
    return _reduce("MaxOp", a, axes, _reduced_shape(a.shape, axes, keepdims))


def max_backward(x, y, gy, axis=None, keepdims=False):
    """Gradient of max: split evenly among the elements that tie for the maximum."""
    _check_float("max_backward", x, y, gy)
    _check_contiguous("max_backward", x, y, gy)
    axes = _axes("max_backward", x.ndim, axis)
    M, K, lk, lr, inner = _reduction_layouts("max_backward", x, axes)
    if y.size != M or gy.size != M:
        raise ValueError(f"cuda.max_backward: y {y.shape} / gy {gy.shape} do not match "
                         f"the max of {x.shape} over axes {axes}")
    gx = _new(x.shape, x.dtype)
    if x.size:
        G = builtins.min(32, _group_size(M, K, inner))
        _launch(_kernel(RED, "max_backward_kernel", _ctype(x.dtype)), M,
                (gx, x, y, gy, np.int32(M), np.int32(K), lk, lr, np.int32(G)), _BLOCK // G)
    return gx


def bias_grad(gy):
    """Sum of gy over every axis but 1: the bias gradient of bias_add."""
    _check_float("bias_grad", gy)
    if gy.ndim < 2:
        raise ValueError(f"cuda.bias_grad: gy {gy.shape} has no axis 1")
    axes = (0,) + tuple(range(2, gy.ndim))
    return _reduce("SumOp", gy, axes, (gy.shape[1],))


def count_correct(logits, labels):
    """Number of rows whose arg-max equals the label, as a 0-d float32 array (no host sync)."""
    _check_float("count_correct", logits)
    _check_contiguous("count_correct", logits)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"cuda.count_correct: logits must be (N, C>0), got {logits.shape}")
    n, c = logits.shape
    _check_int_labels("count_correct", labels, n)
    out = _new((), np.float32)
    kernel = _kernel(RED, "count_correct_kernel", _ctype(logits.dtype), _ctype(labels.dtype))
    kernel((1,), (_block_threads(warps=True),), (out, logits, labels, np.int32(n), np.int32(c)))
    return out


# ----------------------------------------------------------------------------- softmax family
# Along the last axis; one warp per row (softmax.cu).


def _rows(op, *arrays):
    _check_float(op, *arrays)
    _check_contiguous(op, *arrays)
    for a in arrays[1:]:
        _check_shape(op, a, arrays[0].shape)
    x = arrays[0]
    if x.ndim == 0:
        raise ValueError(f"cuda.{op}: needs at least one axis")
    c = x.shape[-1]
    r = x.size // c if c else 0
    _check_int32(op, r, c)
    return r, c


def _row_op(op, kernel, log, first, *rest):
    r, c = _rows(op, first, *rest)
    out = _new(first.shape, first.dtype)
    if first.size:
        func = _kernel(SM, kernel, _ctype(first.dtype), "true" if log else "false")
        _launch(func, r, (out, first, *rest, np.int32(r), np.int32(c)), _WARPS)
    return out


def softmax(x):
    return _row_op("softmax", "softmax_fwd_kernel", False, x)


def softmax_backward(y, gy):
    return _row_op("softmax_backward", "softmax_bwd_kernel", False, y, gy)


def log_softmax(x):
    return _row_op("log_softmax", "softmax_fwd_kernel", True, x)


def log_softmax_backward(y, gy):
    return _row_op("log_softmax_backward", "softmax_bwd_kernel", True, y, gy)


def cross_entropy_forward(logits, labels):
    """Mean cross-entropy of (N, C) logits against int labels: (loss as a 0-d array, softmax)."""
    r, c = _rows("cross_entropy_forward", logits)
    if logits.ndim != 2 or c == 0:
        raise ValueError(f"cuda.cross_entropy_forward: logits must be (N, C>0), got {logits.shape}")
    _check_int_labels("cross_entropy_forward", labels, r)
    t, lt = _ctype(logits.dtype), _ctype(labels.dtype)
    probs = _new(logits.shape, logits.dtype)
    picked = _new((r,), logits.dtype)
    loss = _new((), logits.dtype)
    if r:
        _launch(_kernel(SM, "ce_rows_kernel", t, lt), r,
                (probs, picked, logits, labels, np.int32(r), np.int32(c)), _WARPS)
    _kernel(SM, "ce_mean_kernel", t)((1,), (_block_threads(warps=True),),
                                     (loss, picked, np.int32(r)))
    return loss, probs


def cross_entropy_backward(probs, labels, gloss):
    """(probs - onehot(labels)) * gloss / N; gloss is the 0-d loss gradient on the device."""
    r, c = _rows("cross_entropy_backward", probs)
    _check_float("cross_entropy_backward", probs, gloss)
    if gloss.size != 1:
        raise ValueError(f"cuda.cross_entropy_backward: gloss must hold one value, got {gloss.shape}")
    _check_int_labels("cross_entropy_backward", labels, r)
    g = _new(probs.shape, probs.dtype)
    if probs.size:
        func = _kernel(SM, "ce_bwd_kernel", _ctype(probs.dtype), _ctype(labels.dtype))
        _launch(func, probs.size, (g, probs, labels, gloss, np.int32(r), np.int32(c)))
    return g


# ----------------------------------------------------------------------------- pooling


def _pair(v):
    return (int(v), int(v)) if isinstance(v, (int, np.integer)) else tuple(int(x) for x in v)


def _pool_geom(op, x_shape, kernel, stride, padding):
    """struct PoolGeom and the output's (Ho, Wo) for NCHW input `x_shape`."""
    if len(x_shape) != 4:
        raise ValueError(f"cuda.{op}: input must be NCHW, got shape {tuple(x_shape)}")
    n, c, h, w = (int(v) for v in x_shape)
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride), _pair(padding)
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    if min(kh, kw, sh, sw) < 1 or min(ph, pw) < 0 or ho < 1 or wo < 1:
        raise ValueError(f"cuda.{op}: kernel {kernel}, stride {stride}, padding {padding} "
                         f"do not fit input {tuple(x_shape)}")
    _check_int32(op, n * c * h * w, n * c * ho * wo)
    geom = np.zeros(1, dtype=_POOL_GEOM)
    geom["v"][0] = [n * c, h, w, ho, wo, kh, kw, sh, sw, ph, pw]
    return geom, (n, c, ho, wo)


def max_pool2d_forward(x, kernel, stride, padding):
    """Returns (y, idx): idx is the flat h*W+w position in x of each window's maximum (int32)."""
    _check_float("max_pool2d_forward", x)
    _check_contiguous("max_pool2d_forward", x)
    geom, y_shape = _pool_geom("max_pool2d_forward", x.shape, kernel, stride, padding)
    y, idx = _new(y_shape, x.dtype), _new(y_shape, np.int32)
    if y.size:
        _launch(_kernel(POOL, "max_pool_fwd_kernel", _ctype(x.dtype)), y.size, (y, idx, x, geom))
    return y, idx


def max_pool2d_backward(gy, idx, x_shape):
    _check_float("max_pool2d_backward", gy)
    _check_arrays("max_pool2d_backward", idx)
    _check_contiguous("max_pool2d_backward", gy, idx)
    if idx.dtype != np.int32 or idx.shape != gy.shape or gy.ndim != 4:
        raise ValueError(f"cuda.max_pool2d_backward: idx {idx.shape} {idx.dtype} must be int32 "
                         f"of gy's NCHW shape {gy.shape}")
    n, c, h, w = (int(v) for v in x_shape)
    if gy.shape[:2] != (n, c):
        raise ValueError(f"cuda.max_pool2d_backward: gy {gy.shape} does not match x {tuple(x_shape)}")
    ho, wo = gy.shape[2:]
    _check_int32("max_pool2d_backward", n * c * h * w, gy.size)
    geom = np.zeros(1, dtype=_POOL_GEOM)
    geom["v"][0] = [n * c, h, w, ho, wo, 0, 0, 1, 1, 0, 0]  # window shape unused: idx says
    dx = _new((n, c, h, w), gy.dtype)
    if dx.size:
        _launch(_kernel(POOL, "max_pool_bwd_kernel", _ctype(gy.dtype)), n * c,
                (dx, gy, idx, geom), _WARPS)
    return dx


def avg_pool2d_forward(x, kernel, stride, padding):
    """Average over each window, padding counted in the divisor (PyTorch's default)."""
    _check_float("avg_pool2d_forward", x)
    _check_contiguous("avg_pool2d_forward", x)
    geom, y_shape = _pool_geom("avg_pool2d_forward", x.shape, kernel, stride, padding)
    y = _new(y_shape, x.dtype)
    if y.size:
        _launch(_kernel(POOL, "avg_pool_fwd_kernel", _ctype(x.dtype)), y.size, (y, x, geom))
    return y


def avg_pool2d_backward(gy, x_shape, kernel, stride, padding):
    _check_float("avg_pool2d_backward", gy)
    _check_contiguous("avg_pool2d_backward", gy)
    geom, y_shape = _pool_geom("avg_pool2d_backward", x_shape, kernel, stride, padding)
    _check_shape("avg_pool2d_backward", gy, y_shape, "gy")
    dx = _new(tuple(int(v) for v in x_shape), gy.dtype)
    if dx.size:
        _launch(_kernel(POOL, "avg_pool_bwd_kernel", _ctype(gy.dtype)), dx.size, (dx, gy, geom))
    return dx


# ----------------------------------------------------------------------------- randomness
# Philox4x32-10 (data.cu): the key is the seed; the counter offset advances on the host after
# each call, so every call draws fresh numbers. A captured graph replays the offset it was
# captured with (see kernels/NOTES-backend.md).

_seed = 0
_offset = 0


def manual_seed(seed):
    global _seed, _offset
    _seed, _offset = int(seed) % 2**64, 0


def dropout_mask(shape, p, dtype=np.float32):
    """Keep each element with probability 1-p, scaled by 1/(1-p) (inverted dropout)."""
    global _offset
    if not 0.0 <= p < 1.0:
        raise ValueError(f"cuda.dropout_mask: p must be in [0, 1), got {p}")
    dtype = np.dtype(dtype)
    if dtype not in _FLOATS:
        raise TypeError(f"cuda.dropout_mask: dtype {dtype} not supported (float32 or float64)")
    out = _new(shape, dtype)
    n = out.size
    if n:
        groups = -(-n // 4)  # one Philox call gives 4 numbers
        func = _kernel(DATA, "dropout_mask_kernel", _ctype(dtype))
        _launch(func, groups, (out, np.int64(n), np.uint32(_seed & 0xFFFFFFFF), np.uint32(_seed >> 32),
                               np.uint64(_offset), np.float32(p), dtype.type(1.0 / (1.0 - p))))
        _offset = (_offset + groups) % 2**64
    return out


# ----------------------------------------------------------------------------- optimizers
# Flat buffers, updated in place; `hyper` holds the values that change per step (optim.cu).


def _check_flat(op, param, *others):
    _check_float(op, param, *others)
    _check_contiguous(op, param, *others)
    for a in others:
        if a.size != param.size:
            raise ValueError(f"cuda.{op}: buffer of {a.size} elements, param has {param.size}")


def sgd_step_(param, grad, buf, hyper, momentum, weight_decay, nesterov):
    """PyTorch SGD: d = g + wd*p; buf = m*buf + d; d = d + m*buf (nesterov) or buf; p -= lr*d."""
    _check_flat("sgd_step_", param, grad, *([buf] if momentum else []))
    _check_float("sgd_step_", param, hyper)
    if param.size:
        t = param.dtype.type
        _launch(_kernel(OPT, "sgd_kernel", _ctype(param.dtype)), param.size,
                (param, grad, buf if momentum else None, hyper, np.int64(param.size),
                 t(momentum), t(weight_decay), np.int32(bool(nesterov))))
    return param


def adamw_step_(param, grad, m, v, hyper, beta1, beta2, eps, weight_decay):
    """AdamW with decoupled weight decay; hyper = [lr, 1 - beta1**t, 1 - beta2**t]."""
    _check_flat("adamw_step_", param, grad, m, v)
    _check_float("adamw_step_", param, hyper)
    if hyper.size < 3:
        raise ValueError(f"cuda.adamw_step_: hyper needs 3 slots, has {hyper.size}")
    if param.size:
        t = param.dtype.type
        _launch(_kernel(OPT, "adamw_kernel", _ctype(param.dtype)), param.size,
                (param, grad, m, v, hyper, np.int64(param.size), t(beta1), t(1 - beta1),
                 t(beta2), t(1 - beta2), t(eps), t(weight_decay)))
    return param


# ----------------------------------------------------------------------------- data


def gather_normalize(images, idx, mean, std):
    """Rows idx of a uint8 (M, C, H, W) image array as float32, scaled to [0,1] then (x-mean)/std."""
    _check_arrays("gather_normalize", images)
    if images.dtype != np.uint8 or images.ndim < 1:
        raise TypeError(f"cuda.gather_normalize: images must be uint8 (M, ...), got {images.dtype}")
    _check_contiguous("gather_normalize", images)
    if not _is_cupy(idx):
        idx = cupy.asarray(np.asarray(idx))  # host indices: uploaded (outside a captured step)
    if idx.ndim != 1 or idx.dtype.kind != "i" or idx.itemsize not in (4, 8):
        raise TypeError(f"cuda.gather_normalize: idx must be 1-D int32/int64, got {idx.shape} {idx.dtype}")
    idx = idx if idx.flags.c_contiguous else copy(idx)
    m = images.shape[0]
    chw = math.prod(images.shape[1:])
    out = _new((idx.size,) + tuple(images.shape[1:]), np.float32)
    _check_int32("gather_normalize", idx.size)
    if out.size:
        mean, std = float(mean), float(std)
        _launch(_kernel(DATA, "gather_normalize_kernel", _ctype(idx.dtype)), out.size,
                (out, images, idx, np.int32(idx.size), np.int64(m), np.int64(chw),
                 np.float32(1.0 / (255.0 * std)), np.float32(mean / std)))
    return out


# ----------------------------------------------------------------------------- matrix products
# Written separately (kernels/gemm.cu, kernels/conv2d.cu, cuda_matmul.py); imported last so that
# module may import helpers from this one. If it is missing, the names still exist and raise a
# clear error when called.

try:
    from dptrain.backend.cuda_matmul import (  # noqa: E402
        conv2d_backward_data,
        conv2d_backward_weight,
        conv2d_forward,
        get_precision,
        matmul,
        set_precision,
    )
except Exception as _matmul_error:  # noqa: BLE001 - a missing or broken module: say so on use
    _MATMUL_ERROR = repr(_matmul_error)

    def _unavailable(fname):
        def missing(*args, **kwargs):
            raise NotImplementedError(
                f"cuda.{fname}: dptrain.backend.cuda_matmul could not be imported "
                f"({_MATMUL_ERROR})")
        missing.__name__ = fname
        return missing

    matmul = _unavailable("matmul")
    conv2d_forward = _unavailable("conv2d_forward")
    conv2d_backward_data = _unavailable("conv2d_backward_data")
    conv2d_backward_weight = _unavailable("conv2d_backward_weight")
    set_precision = _unavailable("set_precision")
    get_precision = _unavailable("get_precision")
