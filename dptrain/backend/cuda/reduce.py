"""Launchers of kernels/reduce.cu: sum and max over any axes, max's gradient, bias_grad,
sum_to_shape and count_correct.

Conventions (the .cu file's header has the kernel side):
  * Strided formulation, no transpose copy: M outputs of K elements, element k of output m at
    offset(m, Lk) + offset(k, Lr) (the kept and the reduced axes, each collapsed to a Layout).
  * Deterministic: the group size G (lanes per output), the split S and the chunk come from
    the shapes alone (and the launch shape), so the summation order is fixed; no atomics.
    Long reductions over few outputs run in two passes: (M, S) partials, then one fold.
  * Sums over middle axes of a contiguous array, (A, K, B) -> (A, B), one thread per output
    (where the generic kernel would take one too) run middle_sum_kernel: the same order.
  * Sums over the leading axes of a contiguous array with few columns (bias and layer-norm
    gradients of (tokens, features)) run column_sum_kernel instead: lanes along the columns,
    (split, column) partials, then each column folded in split order.
  * Sums accumulate in double; max in the element type, NaN propagating as np.max.
  * Outputs are new arrays written with `=`; max_backward splits the gradient evenly among
    ties. count_correct returns a 0-d float32 on the device (no host sync).
"""
from __future__ import annotations

import builtins
import math

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.elementwise import add_, fill_
from dptrain.backend.registry import op

RED = "reduce.cu"
SPLIT_MIN_K = 16384  # a reduction this long over few outputs is split in two passes
SPLIT_CHUNK = 8192
# A sum over the leading axes of a contiguous array with fewer columns than this runs
# column_sum_kernel (lanes along the columns); from here on reduce_kernel's one thread per
# column reads coalesced anyway.
COLUMN_SUM_MAX_M = 4096
COLUMN_SUM_ROWS = 32  # rows per split, at least (else about sqrt(rows))
# Up to this many splits (a block of 32 columns x splits threads) sum and fold in one launch.
COLUMN_SUM_FOLDED_SPLITS = 32


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
    st = launch.estrides(a)
    kept = [i for i in range(a.ndim) if i not in axes]
    M = math.prod(a.shape[i] for i in kept)
    K = math.prod(a.shape[i] for i in axes)
    launch.check_int32(op, M, K)
    kdims, (kst,) = launch.collapse([a.shape[i] for i in kept], [st[i] for i in kept])
    rdims, (rst,) = launch.collapse([a.shape[i] for i in axes], [st[i] for i in axes])
    inner = not rdims or abs(rst[-1]) == 1
    return M, K, launch.layout(kdims, kst), launch.layout(rdims, rst), inner


def _pow2_at_least(n):
    return 1 << builtins.max(0, int(n) - 1).bit_length()  # sum and max are ops here


def group_size(entries, per_entry, inner):
    """Threads per output (see reduce.cu): a block for long coalesced rows; for shorter rows
    enough lanes that each reads about 4 elements (fewer shuffle steps per element); one
    thread per output when there are many outputs read across k."""
    if inner and per_entry >= 2048:
        return launch.block_threads(warps=True)  # the whole block (reduce.cu: G == blockDim.x)
    if inner or entries < 4096:
        return min(32, _pow2_at_least(-(-per_entry // 4)))
    return 1


def run_reduce(fn, out, src, M, S, K, chunk, lk, lr, G):
    """One pass of reduce_kernel: M*S entries, G lanes each (G > 32: a whole block)."""
    per_block = 1 if G > 32 else launch.BLOCK // G
    # warps=True: reduce.cu takes G == blockDim.x as "whole block", so never a block of 1.
    launch.grid_stride(fn, M * S, (out, src, np.int32(M), np.int32(S), np.int32(K),
                                   np.int32(chunk), lk, lr, np.int32(G)), per_block, warps=True)


def _reduce(op, a, axes, out_shape, out_dtype=None):
    """Sum (op "SumOp") or max ("MaxOp") of `a` over `axes`, deterministic (reduce.cu), in
    `out_dtype` (default a's; float32 for a 16-bit `a`'s sum is the other choice)."""
    opname = "sum" if op == "SumOp" else "max"
    out = launch.new(out_shape, a.dtype if out_dtype is None else out_dtype)
    o = launch.ctype(out.dtype)
    M, K, lk, lr, inner = _reduction_layouts(opname, a, axes)
    if M == 0:
        return out
    if K == 0:
        if op == "MaxOp":
            raise ValueError("cuda.max: zero-size reduction has no identity")
        return fill_(out, 0)
    t = launch.ctype(a.dtype)
    if op == "SumOp" and _leading_rows(a, axes) and M < COLUMN_SUM_MAX_M:
        return _column_sum(out, a, K, M)
    acc = "double" if op == "SumOp" else "float" if a.dtype in launch.HALVES else t
    if K < SPLIT_MIN_K or M >= 1024:
        G = group_size(M, K, inner)
        middle = _middle(a, axes) if op == "SumOp" and G == 1 else None
        if middle:  # the same order as G = 1's, a division fewer an element
            fn = launch.kernel(RED, "middle_sum_kernel", t, o)
            launch.grid_stride(fn, M, (out, a) + tuple(np.int32(v) for v in middle))
            return out
        fn = launch.kernel(RED, "reduce_kernel", t, acc, o, op)
        run_reduce(fn, out, a, M, 1, K, K, lk, lr, G)
        return out
    # Two passes: S partials per output (in the accumulator type), then one fold over them.
    S = -(-K // SPLIT_CHUNK)
    chunk = -(-K // S)
    partial = launch.new((M, S), np.dtype(np.float64) if acc == "double" else np.float32)
    fn = launch.kernel(RED, "reduce_kernel", t, acc, acc, op)
    run_reduce(fn, partial, a, M, S, K, chunk, lk, lr, group_size(M * S, chunk, inner))
    fn = launch.kernel(RED, "reduce_kernel", acc, acc, o, op)
    run_reduce(fn, out, partial, M, 1, S, S, launch.layout([M], [S]), launch.layout([S], [1]),
               group_size(M, S, True))
    return out


def _middle(a, axes):
    """(A, K, B) where the contiguous array a is (A, K, B) reduced over K: `axes` a run of
    neighbouring axes, neither the first nor the last (middle_sum_kernel); else None."""
    first, last = axes[0], axes[-1]
    if (not a.flags.c_contiguous or first == 0 or last == a.ndim - 1
            or last - first + 1 != len(axes)):
        return None
    return (math.prod(a.shape[:first]), math.prod(a.shape[first:last + 1]),
            math.prod(a.shape[last + 1:]))


def _leading_rows(a, axes) -> bool:
    """Whether `axes` are a's leading axes and a is contiguous: a sum down the rows of an
    (R, C) matrix."""
    return a.flags.c_contiguous and axes == tuple(range(len(axes))) and len(axes) < a.ndim


def _column_sum(out, a, rows, cols, accumulate=False):
    """out = (or with `accumulate`, +=) the sum of the contiguous (rows, cols) view of `a`
    down its rows: (split, column) partials in double, then each column's folded in split
    order (deterministic). Up to 32 splits (1024 rows) both happen in one launch,
    column_sum_folded_kernel, with the same bits as the two."""
    # about sqrt(rows) rows per split: the first pass's loop and the fold's are of a length
    # (the fold, a thread per column, is what few columns wait on)
    per_split = builtins.max(COLUMN_SUM_ROWS, math.isqrt(rows))
    splits = builtins.max(1, builtins.min(-(-rows // per_split), launch.GRID_YZ_MAX,
                                          -(-16 * launch.sm_count() * launch.BLOCK // cols)))
    chunk = -(-rows // splits)
    splits = -(-rows // chunk)
    if splits <= COLUMN_SUM_FOLDED_SPLITS:
        launch.kernel(RED, "column_sum_folded_kernel", launch.ctype(a.dtype))(
            (-(-cols // 32),), (32, splits),
            (out, a, np.int32(rows), np.int32(cols), np.int32(chunk), np.int32(accumulate)))
        return out
    part = launch.new((splits, cols), np.float64)
    bx = builtins.min(launch.BLOCK, 32 * -(-cols // 32))
    by = launch.BLOCK // bx
    launch.kernel(RED, "column_sum_kernel", launch.ctype(a.dtype))(
        (-(-cols // bx), -(-splits // by)), (bx, by),
        (part, a, np.int32(rows), np.int32(cols), np.int32(splits), np.int32(chunk)))
    return _fold(out, part, splits, cols, accumulate)


@op
def sum(a, axis=None, keepdims=False):  # noqa: A001 - the op's name
    launch.check_float("sum", a, half=True)
    axes = _axes("sum", a.ndim, axis)
    return _reduce("SumOp", a, axes, _reduced_shape(a.shape, axes, keepdims))


def sum_float32(a, axis):
    """sum(a, axis) as float32 whatever a's float dtype (16-bit activations' parameter
    gradients: fp32 parameters)."""
    launch.check_float("sum", a, half=True)
    axes = _axes("sum", a.ndim, axis)
    return _reduce("SumOp", a, axes, _reduced_shape(a.shape, axes, False), np.float32)


@op
def max(a, axis=None, keepdims=False):  # noqa: A001
    launch.check_float("max", a, half=True)
    axes = _axes("max", a.ndim, axis)
    return _reduce("MaxOp", a, axes, _reduced_shape(a.shape, axes, keepdims))


@op
def max_backward(x, y, gy, axis=None, keepdims=False):
    """Gradient of max: split evenly among the elements that tie for the maximum."""
    launch.check_float("max_backward", x, y, gy)
    launch.check_contiguous("max_backward", x, y, gy)
    axes = _axes("max_backward", x.ndim, axis)
    M, K, lk, lr, inner = _reduction_layouts("max_backward", x, axes)
    if y.size != M or gy.size != M:
        raise ValueError(f"cuda.max_backward: y {y.shape} / gy {gy.shape} do not match "
                         f"the max of {x.shape} over axes {axes}")
    gx = launch.new(x.shape, x.dtype)
    if x.size:
        G = min(32, group_size(M, K, inner))
        launch.grid_stride(launch.kernel(RED, "max_backward_kernel", launch.ctype(x.dtype)), M,
                           (gx, x, y, gy, np.int32(M), np.int32(K), lk, lr, np.int32(G)),
                           launch.BLOCK // G)
    return gx


@op
def sum_to_shape(g, shape):
    """Sum a broadcast gradient back down to `shape` (the inverse of broadcasting)."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    launch.check_float("sum_to_shape", g, half=True)
    lead = g.ndim - len(shape)
    if lead < 0:
        raise ValueError(f"cuda.sum_to_shape: cannot reduce {g.shape} to {shape}")
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    out = _reduce("SumOp", g, axes, _reduced_shape(g.shape, axes, False))
    if out.size != math.prod(shape):
        raise ValueError(f"cuda.sum_to_shape: cannot reduce {g.shape} to {shape}")
    return out.reshape(shape)


@op
def bias_grad(gy):
    """Sum of gy over every axis but 1: the bias gradient of bias_add."""
    launch.check_float("bias_grad", gy, half=True)
    if gy.ndim < 2:
        raise ValueError(f"cuda.bias_grad: gy {gy.shape} has no axis 1")
    axes = (0,) + tuple(range(2, gy.ndim))
    n, c, planes = gy.shape[0], gy.shape[1], math.prod(gy.shape[2:])
    if planes > 1 and gy.flags.c_contiguous and n * c:
        return _channel_sum(gy, n, c, planes)
    return _reduce("SumOp", gy, axes, (gy.shape[1],))


@op
def bias_grad_add_(dst, gy):
    """dst += bias_grad(gy), in place: a bias gradient added into its .grad by the sum's last
    kernel (the same bits as bias_grad then add_, one launch fewer). Returns dst."""
    launch.check_float("bias_grad_add_", dst, gy, half=True)
    if gy.ndim < 2 or dst.shape != (gy.shape[1],) or dst.dtype != gy.dtype:
        raise ValueError(f"cuda.bias_grad_add_: dst {dst.dtype} {dst.shape} does not take the "
                         f"bias gradient of gy {gy.dtype} {gy.shape}")
    launch.check_contiguous("bias_grad_add_", dst)
    n, c, planes = gy.shape[0], gy.shape[1], math.prod(gy.shape[2:])
    if n * c * planes == 0:
        return dst
    if gy.flags.c_contiguous and planes > 1:
        return _channel_sum(gy, n, c, planes, dst)
    if gy.flags.c_contiguous and gy.ndim == 2 and c < COLUMN_SUM_MAX_M:
        return _column_sum(dst, gy, n, c, accumulate=True)
    return add_(dst, bias_grad(gy))


def _channel_sum(gy, n, c, planes, add_to=None):
    """bias_grad of a contiguous (N, C, pixels...) array: per (channel, split of the batch)
    sums of whole planes, then the splits folded in order (kernels/reduce.cu); added into
    `add_to` instead of a new array when one is given."""
    launch.check_int32("bias_grad", planes, c, n)
    splits = builtins.max(1, builtins.min(n, -(-4 * launch.sm_count() // c)))
    chunk = -(-n // splits)
    splits = -(-n // chunk)
    part = launch.new((splits, c), np.float64)
    launch.kernel(RED, "channel_sum_kernel", launch.ctype(gy.dtype))(
        (c, splits), (launch.BLOCK,), (part, gy, np.int32(n), np.int32(c), np.int32(planes),
                                       np.int32(chunk)))
    out = launch.new((c,), gy.dtype) if add_to is None else add_to
    return _fold(out, part, splits, c, accumulate=add_to is not None)


def _fold(out, part, splits, cols, accumulate=False):
    """out[c] = (with `accumulate`, +=) the sum of the (splits, cols) double partials' column
    c, in split order."""
    launch.grid_stride(launch.kernel(RED, "channel_sum_fold_kernel", launch.ctype(out.dtype)),
                       cols, (out, part, np.int32(splits), np.int32(cols), np.int32(accumulate)))
    return out


@op
def count_correct(logits, labels):
    """Number of rows whose arg-max equals the label, as a 0-d float32 array (no host sync)."""
    launch.check_float("count_correct", logits, half=True)
    launch.check_contiguous("count_correct", logits)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"cuda.count_correct: logits must be (N, C>0), got {logits.shape}")
    n, c = logits.shape
    launch.check_int_labels("count_correct", labels, n)
    out = launch.new((), np.float32)
    fn = launch.kernel(RED, "count_correct_kernel", launch.ctype(logits.dtype),
                       launch.ctype(labels.dtype))
    fn((1,), (launch.block_threads(warps=True),), (out, logits, labels, np.int32(n), np.int32(c)))
    return out
