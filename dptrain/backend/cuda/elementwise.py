"""Launchers of kernels/elementwise.cu: maps over every element, with NumPy broadcasting.

Conventions (the .cu file's header has the kernel side):
  * Outputs are new contiguous arrays written with `=`; add_ (dst += src, gradient
    accumulation) is the binary Add kernel launched with out == dst.
  * Activation backward ops take the forward OUTPUT y (relu, sigmoid, tanh) or the input x
    (pow_scalar) and the output gradient gy, and return the input gradient.
  * Float32 or float64, math in the element type; float16 computes in float32 and rounds
    each result once. Scalars are cast to the element type on the
    host, rounded the way the CPU backend rounds them (e.g. p - 1 for pow's backward).
  * Same-shape contiguous operands take the flat kernels (map1, map2), a thread per 16-byte
    group of elements, vector accesses where every operand is aligned; anything else goes
    through bcast2 with a Layout of broadcast strides (32-bit indices, asserted).
  * fill_ writes raw bits (one kernel per element size); astype (convert_kernel) is in
    arrays.py, next to the copies it needs for non-contiguous sources.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.registry import op

EW = "elementwise.cu"


def _groups(a) -> int:
    """The work items of a flat kernel over a: its 16-byte groups of elements."""
    return -(-a.size // launch.group_size(a.dtype))


def _map1(op, functor, a, s=0.0, t=0.0):
    """out = functor(a) elementwise; s, t: the functor's scalars, cast to the dtype."""
    launch.check_float(op, a, half=True)
    launch.check_contiguous(op, a)
    out = launch.new(a.shape, a.dtype)
    if a.size:
        fn = launch.kernel(EW, "map1_kernel", launch.ctype(a.dtype), functor)
        launch.grid_stride(fn, _groups(a), (out, a, np.int64(a.size), launch.scalar(a.dtype, s),
                                            launch.scalar(a.dtype, t), launch.aligned(out, a)))
    return out


def _map2(op, functor, a, b, s=0.0, t=0.0):
    """out = functor(a, b) elementwise over two contiguous arrays of one shape."""
    launch.check_float(op, a, b, half=True)
    launch.check_contiguous(op, a, b)
    launch.check_shape(op, b, a.shape)
    out = launch.new(a.shape, a.dtype)
    if a.size:
        fn = launch.kernel(EW, "map2_kernel", launch.ctype(a.dtype), functor)
        launch.grid_stride(fn, _groups(a),
                           (out, a, b, np.int64(a.size), launch.scalar(a.dtype, s),
                            launch.scalar(a.dtype, t), launch.aligned(out, a, b)))
    return out


def _binary(op, functor, a, b, out=None):
    """out = a functor b with NumPy broadcasting (out: a new array, or a itself for add_)."""
    launch.check_float(op, a, b, half=True)
    shape = launch.broadcast_shape(op, a.shape, b.shape)
    if out is None:
        out = launch.new(shape, a.dtype)
    elif tuple(out.shape) != shape:
        raise ValueError(f"cuda.{op}: shape {b.shape} does not broadcast to {out.shape}")
    n = out.size
    if n == 0:
        return out
    ctype = launch.ctype(a.dtype)
    zero = launch.scalar(a.dtype, 0)
    if a.shape == b.shape and a.flags.c_contiguous and b.flags.c_contiguous:
        launch.grid_stride(launch.kernel(EW, "map2_kernel", ctype, functor), _groups(out),
                           (out, a, b, np.int64(n), zero, zero, launch.aligned(out, a, b)))
    else:
        launch.check_int32(op, n)
        dims, (sa, sb) = launch.collapse(shape, launch.bstrides(a, shape),
                                         launch.bstrides(b, shape))
        launch.grid_stride(launch.kernel(EW, "bcast2_kernel", ctype, functor), n,
                           (out, a, b, np.int32(n), launch.layout(dims, sa, sb)))
    return out


@op
def fill_(a, value):
    """a[...] = value, in place: `value` converted to a's dtype, written as raw bits."""
    launch.check_arrays("fill_", a)
    launch.check_contiguous("fill_", a)
    if a.size:
        ctype, utype = launch.bits(a.itemsize)
        pattern = np.array(value, dtype=a.dtype).view(utype)[()]  # value's bits in a's dtype
        launch.grid_stride(launch.kernel(EW, "fill_kernel", ctype), a.size,
                           (a, np.int64(a.size), pattern))
    return a


@op
def add(a, b):
    return _binary("add", "Add", a, b)


@op
def sub(a, b):
    return _binary("sub", "Sub", a, b)


@op
def mul(a, b):
    return _binary("mul", "Mul", a, b)


@op
def div(a, b):
    return _binary("div", "Div", a, b)


@op
def add_(dst, src):
    """dst += src, in place (gradient accumulation); src broadcasts to dst. A float32 dst
    also takes a 16-bit src of its shape (a mixed-precision weight's gradient), cast and added
    in one pass."""
    if dst.dtype == np.float32 and getattr(src, "dtype", None) in launch.HALVES:
        launch.check_arrays("add_", dst, src)
        launch.check_contiguous("add_", dst, src)
        if src.shape != dst.shape:
            raise ValueError(f"cuda.add_: a {src.dtype} src must have dst's shape {dst.shape}, "
                             f"got {src.shape}")
        if dst.size:
            fn = launch.kernel(EW, "accumulate_kernel", "float", launch.ctype(src.dtype))
            launch.grid_stride(fn, _groups(dst), (dst, src, np.int64(dst.size),
                                                  launch.aligned(dst)))
        return dst
    launch.check_float("add_", dst, src, half=True)
    launch.check_contiguous("add_", dst)
    return _binary("add_", "Add", dst, src, out=dst)


@op
def neg(a):
    return _map1("neg", "Neg", a)


@op
def scale(a, s):
    return _map1("scale", "Scale", a, s)


@op
def pow_scalar(a, p):
    return _map1("pow_scalar", "Pow", a, p)


@op
def pow_scalar_backward(x, gy, p):
    return _map2("pow_scalar_backward", "PowBack", x, gy, p, p - 1)


@op
def exp(a):
    return _map1("exp", "Exp", a)


@op
def log(a):
    return _map1("log", "Log", a)


@op
def sqrt(a):
    return _map1("sqrt", "Sqrt", a)


@op
def relu(a):
    return _map1("relu", "Relu", a)


@op
def relu_backward(y, gy, *, workspace=None):
    return _map2("relu_backward", "ReluBack", y, gy)


@op
def relu_backward_sum(y, ga, gb):
    """relu_backward(y, add(ga, gb)) in one pass, the same bits: ReLU's backward of a gradient
    that arrived in two parts."""
    op_name = "relu_backward_sum"
    launch.check_float(op_name, y, ga, gb, half=True)
    launch.check_contiguous(op_name, y, ga, gb)
    launch.check_shape(op_name, ga, y.shape)
    launch.check_shape(op_name, gb, y.shape)
    out = launch.new(y.shape, y.dtype)
    if y.size:
        fn = launch.kernel(EW, "relu_back_sum_kernel", launch.ctype(y.dtype))
        launch.grid_stride(fn, _groups(y), (out, y, ga, gb, np.int64(y.size),
                                            launch.aligned(out, y, ga, gb)))
    return out


@op
def sigmoid(a):
    return _map1("sigmoid", "Sigmoid", a)


@op
def sigmoid_backward(y, gy):
    return _map2("sigmoid_backward", "SigmoidBack", y, gy)


@op
def tanh(a):
    return _map1("tanh", "Tanh", a)


@op
def tanh_backward(y, gy):
    return _map2("tanh_backward", "TanhBack", y, gy)


@op
def bias_add(y, b):
    """y + b with b broadcast along axis 1 (channels of NCHW, features of (N, F))."""
    launch.check_float("bias_add", y, b, half=True)
    if y.ndim < 2 or b.shape != (y.shape[1],):
        raise ValueError(f"cuda.bias_add: bias {b.shape} does not match axis 1 of {y.shape}")
    return _binary("bias_add", "Add", y, b.reshape((1, -1) + (1,) * (y.ndim - 2)))
