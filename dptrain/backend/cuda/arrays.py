"""Array creation, host transfers, copies with casts and dtype conversion.

Conventions:
  * Outputs come from launch.new (CuPy's pool) and are contiguous; the `_` ops write in place.
  * Host-to-device copies happen only in asarray / copy_ from host data (synchronous, outside
    a training step) and set_scalar_ (asynchronous on the current stream, from pageable memory,
    so the host values may be reused at once). to_numpy is the one device-to-host read.
  * astype launches convert_kernel (kernels/elementwise.cu): C casts, float to int truncating
    toward zero as NumPy does; copy_ converts straight into a contiguous dst of src's shape,
    else casts first, then copies through strides (transpose.cu).
"""
from __future__ import annotations

import cupy
import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.elementwise import EW, fill_
from dptrain.backend.cuda.transpose import copy, strided_copy
from dptrain.backend.cuda.workspace import Workspace
from dptrain.backend.registry import op


@op
def asarray(a, dtype=None):
    if launch.is_cupy(a):
        if dtype is not None and a.dtype != np.dtype(dtype):
            return astype(a, dtype)
        return a if a.flags.c_contiguous else copy(a)
    # Host data: a (synchronous) host-to-device copy, outside the training step. order="C"
    # rather than np.ascontiguousarray, which would turn a 0-d array into shape (1,).
    return cupy.asarray(np.asarray(a, dtype=dtype, order="C"))


@op
def to_numpy(a):
    return cupy.asnumpy(a) if launch.is_cupy(a) else np.asarray(a)


@op
def empty(shape, dtype=np.float32):
    return launch.new(shape, dtype)


@op
def zeros(shape, dtype=np.float32):
    return fill_(launch.new(shape, dtype), 0)


@op
def full(shape, value, dtype=np.float32):
    return fill_(launch.new(shape, dtype), value)


@op
def copy_(dst, src):
    """dst[...] = src: src broadcasts to dst and is cast to dst's dtype; host data is uploaded."""
    launch.check_arrays("copy_", dst)
    if not launch.is_cupy(src):
        src = cupy.asarray(np.asarray(src, dtype=dst.dtype, order="C"))
    if src.dtype != dst.dtype:
        if src.shape == dst.shape and src.flags.c_contiguous and dst.flags.c_contiguous:
            return _convert(dst, src)  # one kernel, no temporary (the 16-bit shadow's cast)
        src = astype(src, dst.dtype)
    if launch.broadcast_shape("copy_", dst.shape, src.shape) != tuple(dst.shape):
        raise ValueError(f"cuda.copy_: cannot copy shape {src.shape} into {dst.shape}")
    return strided_copy(dst, src, launch.bstrides(src, dst.shape))


@op
def set_scalar_(buf, values):
    """Write host floats into the first len(values) slots of `buf` (asynchronous copy)."""
    launch.check_arrays("set_scalar_", buf)
    host = np.ascontiguousarray(np.asarray(values, dtype=buf.dtype).reshape(-1))
    if buf.ndim != 1 or not buf.flags.c_contiguous or host.size > buf.size:
        raise ValueError(f"cuda.set_scalar_: {host.size} values do not fit buffer {buf.shape}")
    if host.size:
        # From pageable memory the copy is staged before this returns, so `host` may go.
        buf[: host.size].set(host, stream=cupy.cuda.get_current_stream())
    return buf


@op
def astype(a, dtype):
    launch.check_arrays("astype", a)
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a if a.flags.c_contiguous else copy(a)  # as np.ascontiguousarray
    return _convert(launch.new(a.shape, dtype), a if a.flags.c_contiguous else copy(a))


def _convert(out, src):
    """out[...] = src cast to out's dtype (both contiguous, one shape): convert_kernel."""
    for half in launch.HALVES:  # 16-bit floats convert to and from float32 / float64 only
        if half in (src.dtype, out.dtype) and not {src.dtype, out.dtype} <= {half, *launch.FLOATS}:
            name = "bfloat16 (uint16)" if half == launch.BFLOAT16 else str(half)
            raise TypeError(f"cuda.astype: {name} converts to and from float32 and float64 "
                            f"only, not {src.dtype} to {out.dtype}")
    if src.size:
        fn = launch.kernel(EW, "convert_kernel", launch.ctype(out.dtype), launch.ctype(src.dtype))
        launch.grid_stride(fn, src.size, (out, src, np.int64(src.size)))
    return out


@op
def new_workspace():
    """Where a layer's convolution passes leave channels-last copies for its later passes
    (cuda/workspace.py)."""
    return Workspace()
