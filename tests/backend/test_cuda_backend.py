"""The cuda backend against the NumPy reference (the cpu backend), op by op.

Each GPU test draws fresh random inputs (odd sizes, broadcasting shapes, float32 and float64;
the seed is printed, so a failure can be replayed), runs the op on both backends and compares:
relative error ||cuda - cpu|| / ||cpu|| <= 1e-5 in float32 (1e-11 in float64) for arithmetic,
exact equality for data movement. Every array the cuda backend allocates is poisoned first
(all bits set: NaN for floats, -1 for integers), so an element a kernel skips fails.
"""
from pathlib import Path

import numpy as np
import pytest

from dptrain.backend import cpu
from dptrain.backend.bfloat16 import BFLOAT16

gpu = pytest.mark.gpu
F32, F64 = np.float32, np.float64
FLOATS = [F32, F64]
RTOL = {np.dtype(F32): 1e-5, np.dtype(F64): 1e-11}


# ----------------------------------------------------------------------------- fixtures, helpers


def randn(rng, shape, dtype=F32):
    return np.asarray(rng.standard_normal(shape)).astype(dtype)


def uniform(rng, shape, lo, hi, dtype=F32):
    return np.asarray(rng.uniform(lo, hi, shape)).astype(dtype)


def assert_close(cu, got, ref, rtol=None):
    got, ref = cu.to_numpy(got), np.asarray(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN mismatch (an unwritten element?)"
    rtol = RTOL[ref.dtype] if rtol is None else rtol
    g, r = np.nan_to_num(got.astype(F64)), np.nan_to_num(ref.astype(F64))
    err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:g}"


def sum64(fn, x, *args):
    """A summing cpu op evaluated in float64 and rounded back: the correctly rounded sum, so
    float32 results are not judged by NumPy's own float32 rounding (sequential along outer axes)."""
    return np.asarray(fn(x.astype(F64), *args)).astype(x.dtype)


def assert_exact(cu, got, ref):
    got, ref = cu.to_numpy(got), np.asarray(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
    assert np.array_equal(got, ref, equal_nan=got.dtype.kind == "f")


# ----------------------------------------------------------------------------- arrays


@gpu
def test_poisoning_marks_unwritten_elements(cu):
    assert np.isnan(cu.to_numpy(cu.empty((3, 7), F32))).all()
    assert (cu.to_numpy(cu.empty((5,), np.int32)) == -1).all()


@gpu
@pytest.mark.parametrize("dtype", [F32, F64, np.int32, np.int64, np.uint8, np.bool_])
def test_asarray_round_trip(cu, rng, dtype):
    a = (randn(rng, (3, 7, 5), F64) * 100).astype(dtype)
    d = cu.asarray(a)
    assert_exact(cu, d, a)
    assert cu.asarray(d) is d
    assert_exact(cu, cu.asarray(d, F64), a.astype(F64))


@gpu
def test_empty_zeros_full(cu):
    e = cu.empty((3, 5), F64)
    assert e.shape == (3, 5) and e.dtype == F64
    assert_exact(cu, cu.zeros((3, 7, 5)), cpu.zeros((3, 7, 5)))
    assert_exact(cu, cu.zeros((), F32), cpu.zeros((), F32))
    assert_exact(cu, cu.full((33,), 2.5, F64), cpu.full((33,), 2.5, F64))
    assert_exact(cu, cu.full((4, 3), 7, np.int32), cpu.full((4, 3), 7, np.int32))
    assert_exact(cu, cu.full((2, 9), 1, np.uint8), cpu.full((2, 9), 1, np.uint8))


@gpu
def test_copy_and_copy_(cu, rng):
    a = randn(rng, (3, 7, 5))
    assert_exact(cu, cu.copy(cu.asarray(a)), cpu.copy(a))
    assert_exact(cu, cu.copy(cu.asarray(a).transpose(2, 0, 1)), cpu.copy(a.transpose(2, 0, 1)))
    src = randn(rng, (4, 1), F64)
    for s in (src, src.astype(F32)):  # broadcast, with and without a dtype cast
        dst = randn(rng, (3, 4, 5))
        d = cu.asarray(dst)
        assert cu.copy_(d, cu.asarray(s)) is d
        assert_exact(cu, d, cpu.copy_(dst, s))
    dst = randn(rng, (6, 5))
    d = cu.asarray(dst)
    s = randn(rng, (3, 5))
    cu.copy_(d[::2], cu.asarray(s))  # into a strided view
    cpu.copy_(dst[::2], s)
    assert_exact(cu, d, dst)
    d = cu.asarray(dst)
    cu.copy_(d, s[0])  # from host memory
    assert_exact(cu, d, np.broadcast_to(s[0], dst.shape))


@gpu
@pytest.mark.parametrize("dtype,value", [(F32, 3.25), (F64, -1.5), (np.int32, 7), (F32, np.nan)])
def test_fill_(cu, rng, dtype, value):
    a = (randn(rng, (3, 7, 5)) * 10).astype(dtype)
    d = cu.asarray(a)
    assert cu.fill_(d, value) is d
    assert_exact(cu, d, cpu.fill_(a, value))


@gpu
def test_set_scalar_(cu):
    buf = cu.zeros((4,), F32)
    cu.set_scalar_(buf, [0.1, 0.2, 1e-8])
    assert_exact(cu, buf, cpu.set_scalar_(cpu.zeros((4,), F32), [0.1, 0.2, 1e-8]))


@gpu
@pytest.mark.parametrize("src,dst", [(F32, F64), (F64, F32), (np.int32, F32), (np.int64, F64),
                                     (np.uint8, F32), (F32, np.int32), (np.bool_, F32),
                                     (np.int32, np.int64), (F64, np.uint8)])
def test_astype(cu, rng, src, dst):
    a = np.minimum(np.abs(randn(rng, (3, 7, 5), F64)) * 60, 250).astype(src)  # fits uint8
    assert_exact(cu, cu.astype(cu.asarray(a), dst), cpu.astype(a, dst))
    t = cu.asarray(a).transpose(1, 0, 2)  # a non-contiguous source
    assert_exact(cu, cu.astype(t, dst), cpu.astype(a.transpose(1, 0, 2), dst))


@gpu
@pytest.mark.parametrize("shape,axes", [((3, 7, 5), (2, 0, 1)), ((3, 33, 7, 5), (0, 2, 3, 1)),
                                        ((2, 3, 4, 5, 6, 7), (5, 3, 1, 0, 2, 4)),
                                        ((33,), None), ((4, 6), None), ((3, 1, 5), (1, 2, 0))])
@pytest.mark.parametrize("dtype", [F32, np.int64, np.uint8])
def test_transpose(cu, rng, shape, axes, dtype):
    a = (randn(rng, shape) * 50).astype(dtype)
    assert_exact(cu, cu.transpose(cu.asarray(a), axes), cpu.transpose(a, axes))


@gpu
@pytest.mark.parametrize("shape,columns,group,channels", [
    ((2, 3, 9, 224), (0, 0), 1, None),  # a plain transpose (the 3x3 stem's input)
    ((2, 3, 9, 224), (0, 0), 1, 8),     # ImageNet's stem, padded to 16 bytes in 16 bits
    ((2, 3, 9, 224), (1, 1), 2, 8),     # ... over pairs of columns
    ((3, 3, 5, 17), (1, 0), 2, 6), ((1, 5, 4, 6), (2, 1), 3, 16), ((2, 1, 3, 7), (0, 1), 2, 4)])
@pytest.mark.parametrize("dtype", [F32, F64, np.dtype(np.float16), BFLOAT16],
                         ids=["fp32", "fp64", "fp16", "bf16"])
def test_to_channels_last(cu, rng, shape, columns, group, channels, dtype):
    """The one-pass layout kernel writes the reference's bits, zeros included, in every
    dtype, with and without 16-byte stores."""
    a = cpu.astype(randn(rng, shape), dtype)
    args = (group, *columns, channels)
    assert_exact(cu, cu.to_channels_last(cu.asarray(a), *args), cpu.to_channels_last(a, *args))


def _indices():
    return [
        (slice(None), slice(1, 6, 2)),
        (1,),
        (Ellipsis, 2),
        (slice(None, None, -1), None, slice(2, None)),
        (-1, slice(None), 4),
        np.array([2, 0, 2]),  # rows, a repeat (host index array)
        ("device", np.array([2, 0, -1, 2], dtype=np.int64)),  # rows from a device array
        ("device", np.array([1, 1, 0], dtype=np.int32)),
        (np.arange(3), np.array([1, 6, 6])),  # two index arrays
        (slice(None), np.array([4, 0, 4])),
    ]


def _on_device(cu, index):
    if isinstance(index, tuple) and index and isinstance(index[0], str):
        import cupy
        return cupy.asarray(index[1])
    return index


def _on_host(index):
    return index[1] if isinstance(index, tuple) and index and isinstance(index[0], str) else index


@gpu
@pytest.mark.parametrize("index", _indices(), ids=range(len(_indices())))
def test_getitem_and_backward(cu, rng, index):
    a = randn(rng, (3, 7, 5), F64)
    ref = cpu.getitem(a, _on_host(index))
    assert_exact(cu, cu.getitem(cu.asarray(a), _on_device(cu, index)), ref)
    gy = randn(rng, ref.shape, F64)
    assert_close(cu, cu.getitem_backward(cu.asarray(gy), a.shape, _on_device(cu, index)),
                 cpu.getitem_backward(gy, a.shape, _on_host(index)))


@gpu
def test_getitem_of_labels(cu, rng):
    labels = rng.integers(0, 10, 50)
    idx = rng.integers(0, 50, 9)
    assert_exact(cu, cu.getitem(cu.asarray(labels), cu.asarray(idx)), cpu.getitem(labels, idx))


@gpu
@pytest.mark.parametrize("shapes,axis", [([(3, 7, 5), (3, 2, 5), (3, 1, 5)], 1),
                                         ([(3, 7, 5), (1, 7, 5)], 0),
                                         ([(3, 7, 5), (3, 7, 4)], -1),
                                         ([(33,), (1,), (6,)], 0)])
def test_concatenate(cu, rng, shapes, axis):
    arrays = [randn(rng, s) for s in shapes]
    assert_exact(cu, cu.concatenate([cu.asarray(a) for a in arrays], axis),
                 cpu.concatenate(arrays, axis))
    # a non-contiguous input
    t = randn(rng, shapes[0][::-1]).T
    assert_exact(cu, cu.concatenate([cu.asarray(t.T).T] + [cu.asarray(a) for a in arrays[1:]], axis),
                 cpu.concatenate([t] + arrays[1:], axis))


@gpu
@pytest.mark.parametrize("shape,target", [((3, 1, 5), (2, 3, 4, 5)), ((5,), (3, 5)), ((), (3, 4)),
                                          ((4, 1), (4, 6)), ((7, 5), (7, 5))])
def test_broadcast_to(cu, rng, shape, target):
    a = randn(rng, shape)
    assert_exact(cu, cu.broadcast_to(cu.asarray(a), target), cpu.broadcast_to(a, target))


@gpu
@pytest.mark.parametrize("dtype", FLOATS + [np.float16, np.int8])
def test_copies_move_whole_16_byte_vectors_where_they_can(cu, rng, dtype, monkeypatch):
    """strided_copy's uint4 path (innermost axis contiguous in whole 16-byte vectors): a
    broadcast of per-channel values over pixels, a slice of a row, and views whose start or
    stride breaks the vectors (the element path)."""
    from dptrain.backend.cuda import launch
    from dptrain.backend.cuda.transpose import _vector

    v = 16 // np.dtype(dtype).itemsize
    a = (randn(rng, (6, 1, 1, 4 * v)) * 50).astype(dtype)
    kernels, kernel = [], launch.kernel
    monkeypatch.setattr(launch, "kernel",
                        lambda *key, **kw: kernels.append(key) or kernel(*key, **kw))
    assert_exact(cu, cu.broadcast_to(cu.asarray(a), (6, 5, 3, 4 * v)),
                 cpu.broadcast_to(a, (6, 5, 3, 4 * v)))
    assert ("transpose.cu", "strided_copy_kernel", "uint4") in kernels
    b = (randn(rng, (5, 6 * v)) * 50).astype(dtype)
    d = cu.asarray(b)
    assert _vector([5, 2 * v], ([2 * v, 1], [6 * v, 1]), b.itemsize, (0, d.data.ptr)) == v
    for view in ((slice(None), slice(v, 3 * v)), (slice(None), slice(1, 2 * v + 1)),
                 (slice(None), slice(0, 2 * v, 2)), (slice(1, None, 2), slice(None))):
        assert_exact(cu, cu.copy(d[view]), cpu.copy(b[view]))


@gpu
@pytest.mark.parametrize("shape,target", [((2, 3, 4, 5), (3, 1, 5)), ((2, 3, 4, 5), (5,)),
                                          ((2, 3, 4, 5), (1, 1)), ((2, 3, 4, 5), (2, 3, 4, 5)),
                                          ((3, 7, 5), (7, 1)), ((3, 33, 7, 5), (33, 1, 1)),
                                          ((3, 7, 5), ())])
@pytest.mark.parametrize("dtype", FLOATS)
def test_sum_to_shape(cu, rng, shape, target, dtype):
    g = uniform(rng, shape, -0.5, 1.5, dtype)
    # reshape: cpu.sum_to_shape returns (1,) for target () (np.ascontiguousarray of a 0-d array)
    ref = sum64(cpu.sum_to_shape, g, target).reshape(target)
    assert_close(cu, cu.sum_to_shape(cu.asarray(g), target), ref)


# ----------------------------------------------------------------------------- elementwise

BINARY_SHAPES = [((3, 1, 5), (4, 1)), ((7, 5), (7, 5)), ((2, 3, 4, 5), (5,)), ((33,), ()),
                 ((1,), (6, 1)), ((3, 33, 7, 5), (1, 33, 1, 1)), ((4, 1, 6), (1, 5, 1))]


@gpu
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", BINARY_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_binary(cu, rng, op, shapes, dtype):
    a = randn(rng, shapes[0], dtype)
    b = uniform(rng, shapes[1], 0.5, 2.0, dtype) * rng.choice([-1, 1], shapes[1]).astype(dtype)
    assert_close(cu, getattr(cu, op)(cu.asarray(a), cu.asarray(b)), getattr(cpu, op)(a, b))


@gpu
def test_binary_non_contiguous(cu, rng):
    a, b = randn(rng, (5, 7)), randn(rng, (7, 5))
    assert_close(cu, cu.mul(cu.asarray(a), cu.asarray(b).T), cpu.mul(a, b.T))


UNARY = [("neg", None), ("exp", None), ("log", "pos"), ("sqrt", "pos"), ("relu", None),
         ("sigmoid", "wide"), ("tanh", None), ("scale", 0.37), ("pow_scalar", 2.0),
         ("pow_scalar", 3.0), ("pow_scalar", 0.5), ("pow_scalar", -1.5)]


@gpu
@pytest.mark.parametrize("op,arg", UNARY, ids=[f"{o}-{a}" for o, a in UNARY])
@pytest.mark.parametrize("shape", [(3, 7, 5), (1000, 33), ()], ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_unary(cu, rng, op, arg, shape, dtype):
    positive = arg == "pos" or (op == "pow_scalar" and arg not in (2.0, 3.0))
    x = uniform(rng, shape, 0.1, 3.0, dtype) if positive else randn(rng, shape, dtype)
    if arg == "wide":
        x = x * dtype(20)
    args = (arg,) if isinstance(arg, float) else ()
    assert_close(cu, getattr(cu, op)(cu.asarray(x), *args), getattr(cpu, op)(x, *args))


@gpu
@pytest.mark.parametrize("op", ["relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_activation_backward(cu, rng, op, dtype):
    x, gy = randn(rng, (3, 33, 7, 5), dtype), randn(rng, (3, 33, 7, 5), dtype)
    y = getattr(cpu, op)(x)
    back = op + "_backward"
    assert_close(cu, getattr(cu, back)(cu.asarray(y), cu.asarray(gy)), getattr(cpu, back)(y, gy))


@gpu
@pytest.mark.parametrize("p", [2.0, 3.0, 0.5, -1.5])
@pytest.mark.parametrize("dtype", FLOATS)
def test_pow_scalar_backward(cu, rng, p, dtype):
    x, gy = uniform(rng, (3, 7, 5), 0.1, 3.0, dtype), randn(rng, (3, 7, 5), dtype)
    assert_close(cu, cu.pow_scalar_backward(cu.asarray(x), cu.asarray(gy), p),
                 cpu.pow_scalar_backward(x, gy, p))


@gpu
@pytest.mark.parametrize("shapes", [((3, 5), (3, 5)), ((3, 5), (5,)), ((), ()), ((4, 3, 5), (3, 1))],
                         ids=str)
def test_add_in_place(cu, rng, shapes):
    dst, src = randn(rng, shapes[0]), randn(rng, shapes[1])
    d = cu.asarray(dst)
    assert cu.add_(d, cu.asarray(src)) is d
    assert_close(cu, d, cpu.add_(dst.copy(), src))


@gpu
@pytest.mark.parametrize("shape", [(3, 33, 7, 5), (4, 10), (64, 32, 24, 24), (5, 3, 7), (2, 300, 1, 1)],
                         ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_bias_add_and_grad(cu, rng, shape, dtype):
    y, b = randn(rng, shape, dtype), randn(rng, (shape[1],), dtype)
    assert_close(cu, cu.bias_add(cu.asarray(y), cu.asarray(b)), cpu.bias_add(y, b))
    gy = uniform(rng, shape, -0.5, 1.5, dtype)
    assert_close(cu, cu.bias_grad(cu.asarray(gy)), sum64(cpu.bias_grad, gy))


# ----------------------------------------------------------------------------- reductions

AXES = [None, 0, -1, (0, 2, 3), (1, 3), 2, (0, 1, 2, 3), ()]


@gpu
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
def test_sum_max_and_max_backward(cu, rng, axis, keepdims, dtype):
    x = uniform(rng, (3, 33, 7, 5), -0.5, 1.5, dtype)
    assert_close(cu, cu.sum(cu.asarray(x), axis, keepdims), sum64(cpu.sum, x, axis, keepdims))
    y = cpu.max(x, axis, keepdims)
    assert_exact(cu, cu.max(cu.asarray(x), axis, keepdims), y)
    gy = randn(rng, y.shape, dtype)
    assert_close(cu, cu.max_backward(cu.asarray(x), cu.asarray(y), cu.asarray(gy), axis, keepdims),
                 cpu.max_backward(x, y, gy, axis, keepdims))


@gpu
@pytest.mark.parametrize("axis", [None, 1, (0, 2)], ids=str)
def test_max_ties_split_the_gradient(cu, rng, axis):
    x = rng.integers(0, 4, (3, 33, 7)).astype(F32)  # many ties
    y = cpu.max(x, axis)
    gy = randn(rng, y.shape)
    assert_exact(cu, cu.max(cu.asarray(x), axis), y)
    assert_close(cu, cu.max_backward(cu.asarray(x), cu.asarray(y), cu.asarray(gy), axis),
                 cpu.max_backward(x, y, gy, axis))


@gpu
@pytest.mark.parametrize("shape,axis", [((1 << 20,), None), ((4096, 3), 0), ((3, 20000), 1),
                                        ((5000, 7), 1), ((7, 5000), 0), ((40000, 2), 0),
                                        ((8, 3000, 9), (0, 2)), ((9472, 64), 0),
                                        ((256, 37, 64), (0, 1)), ((70000, 1), 0)], ids=str)
def test_reductions_of_long_and_wide_shapes(cu, rng, shape, axis):
    x = uniform(rng, shape, -0.5, 1.5)
    assert_close(cu, cu.sum(cu.asarray(x), axis), sum64(cpu.sum, x, axis))
    assert_exact(cu, cu.max(cu.asarray(x), axis), cpu.max(x, axis))


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_sums_down_the_rows_repeat_bitwise(cu, rng, dtype):
    """Sums over the leading axes of few columns (column_sum_kernel: split partials folded in
    a fixed order), a bias gradient of (tokens, features) among them."""
    x = cu.asarray(uniform(rng, (9472, 64), -0.5, 1.5, dtype))
    for run in (lambda: cu.sum(x, 0), lambda: cu.bias_grad(x)):
        assert cu.to_numpy(run()).tobytes() == cu.to_numpy(run()).tobytes()


@gpu
@pytest.mark.parametrize("shape", [(256, 512), (1000, 7), (33, 100), (1, 5)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS + [np.float16, "bfloat16"])
def test_column_sums_in_one_launch_equal_two(cu, rng, monkeypatch, shape, dtype):
    """column_sum_folded_kernel (sums and fold in one launch, up to 1024 rows) gives the bits
    of column_sum_kernel + channel_sum_fold_kernel."""
    from dptrain.backend.bfloat16 import to_bfloat16
    from dptrain.backend.cuda import reduce

    x = uniform(rng, shape, -0.5, 1.5)
    x = cu.asarray(to_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype))
    one = cu.to_numpy(cu.bias_grad(x))
    monkeypatch.setattr(reduce, "COLUMN_SUM_FOLDED_SPLITS", 0)
    assert one.tobytes() == cu.to_numpy(cu.bias_grad(x)).tobytes()
    if dtype in FLOATS:
        assert_close(cu, cu.asarray(one), sum64(cpu.sum, cu.to_numpy(x), 0))


@gpu
@pytest.mark.parametrize("shape,axes", [((64, 7, 7, 96), (1, 2)), ((9, 5, 600), (1,)),
                                        ((3, 4, 5, 2, 700), (1, 2, 3))], ids=str)
@pytest.mark.parametrize("dtype", FLOATS + [np.float16, "bfloat16"])
def test_middle_axes_sum_has_the_generic_kernels_bits(cu, rng, monkeypatch, shape, axes, dtype):
    """middle_sum_kernel (a contiguous (A, K, B) summed over K, one thread per output) gives
    reduce_kernel's bits, kept dims or not, and float32 out of 16-bit."""
    from dptrain.backend.bfloat16 import to_bfloat16
    from dptrain.backend.cuda import reduce

    x = uniform(rng, shape, -0.5, 1.5)
    x = cu.asarray(to_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype))
    assert reduce._middle(x, axes) is not None
    runs = (lambda: cu.sum(x, axes, keepdims=True), lambda: reduce.sum_float32(x, axes))
    fast = [cu.to_numpy(run()) for run in runs]
    monkeypatch.setattr(reduce, "_middle", lambda a, axes: None)
    for got, run in zip(fast, runs):
        assert got.tobytes() == cu.to_numpy(run()).tobytes()
    if dtype in FLOATS:
        assert_close(cu, cu.asarray(fast[0]), sum64(cpu.sum, cu.to_numpy(x), axes, True))


@gpu
def test_sum_of_a_strided_view(cu, rng):
    x = uniform(rng, (7, 5, 33), -0.5, 1.5)
    t = cu.asarray(x).transpose(2, 0, 1)
    assert_close(cu, cu.sum(t, (0, 2)), sum64(cpu.sum, x.transpose(2, 0, 1), (0, 2)))


@gpu
@pytest.mark.parametrize("n,c,ltype", [(37, 10, np.int64), (1000, 7, np.int32), (3, 1000, np.int64)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_count_correct(cu, rng, n, c, ltype, dtype):
    logits = randn(rng, (n, c), dtype)
    labels = rng.integers(0, c, n).astype(ltype)
    hit = rng.random(n) < 0.5
    labels[hit] = logits.argmax(axis=1)[hit]
    assert_exact(cu, cu.count_correct(cu.asarray(logits), cu.asarray(labels)),
                 cpu.count_correct(logits, labels))


# ----------------------------------------------------------------------------- softmax family


@gpu
@pytest.mark.parametrize("shape", [(3, 10), (7, 5, 33), (4, 1000), (2, 1)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_family(cu, rng, shape, dtype):
    x, gy = randn(rng, shape, dtype) * dtype(3), randn(rng, shape, dtype)
    for fwd in ("softmax", "log_softmax"):
        y = getattr(cpu, fwd)(x)
        assert_close(cu, getattr(cu, fwd)(cu.asarray(x)), y)
        back = fwd + "_backward"
        assert_close(cu, getattr(cu, back)(cu.asarray(y), cu.asarray(gy)), getattr(cpu, back)(y, gy))


@gpu
@pytest.mark.parametrize("n,c,ltype", [(3, 10, np.int64), (64, 7, np.int32), (5, 1000, np.int64),
                                       (1000, 33, np.int64)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_cross_entropy(cu, rng, n, c, ltype, dtype):
    logits = randn(rng, (n, c), dtype) * dtype(3)
    labels = rng.integers(0, c, n).astype(ltype)
    loss, probs = cpu.cross_entropy_forward(logits, labels)
    dloss, dprobs = cu.cross_entropy_forward(cu.asarray(logits), cu.asarray(labels))
    assert_close(cu, dloss, loss)
    assert_close(cu, dprobs, probs)
    gloss = np.asarray(0.7, dtype=dtype)
    assert_close(cu, cu.cross_entropy_backward(dprobs, cu.asarray(labels), cu.asarray(gloss)),
                 cpu.cross_entropy_backward(probs, labels, gloss))


@gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BFLOAT16], ids=["fp16", "bf16"])
def test_cross_entropy_and_count_of_16bit_logits(cu, rng, dtype):
    """16-bit logits: float32 loss and softmax, the gradient in their dtype, and the count:
    bitwise the float32 kernels' on the logits' exact float values (the gradient rounded
    once, as a cast rounds it), and close to the CPU's."""
    n, c = 300, 7
    logits = np.empty((n, c), dtype)
    cpu.copy_(logits, randn(rng, (n, c)) * F32(3))
    as_float = cpu.copy_(np.empty((n, c), F32), logits)
    labels = rng.integers(0, c, n).astype(np.int64)
    dlabels, gloss = cu.asarray(labels), cu.asarray(np.asarray(0.7, dtype=F32))
    loss, probs = cpu.cross_entropy_forward(logits, labels)
    assert loss.dtype == probs.dtype == F32
    dloss, dprobs = cu.cross_entropy_forward(cu.asarray(logits), dlabels)
    floss, fprobs = cu.cross_entropy_forward(cu.asarray(as_float), dlabels)
    assert_exact(cu, dloss, cu.to_numpy(floss))
    assert_exact(cu, dprobs, cu.to_numpy(fprobs))
    assert_close(cu, dloss, loss)
    assert_close(cu, dprobs, probs)
    g = cu.cross_entropy_backward(dprobs, dlabels, gloss, dtype)
    cast = np.empty((n, c), dtype)
    cpu.copy_(cast, cu.to_numpy(cu.cross_entropy_backward(fprobs, dlabels, gloss)))
    assert_exact(cu, g, cast)
    assert cpu.cross_entropy_backward(probs, labels, cu.to_numpy(gloss), dtype).dtype == dtype
    assert_exact(cu, cu.count_correct(cu.asarray(logits), dlabels),
                 cpu.count_correct(as_float, labels))
    with pytest.raises(TypeError, match="mixed dtypes float32 and float16"):
        cu.cross_entropy_backward(dprobs, cu.asarray(labels), cu.zeros((), np.float16))


# ----------------------------------------------------------------------------- pooling

POOLS = [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1)), ((3, 3), (1, 1), (1, 1)),
         ((2, 3), (1, 2), (0, 1)), ((1, 1), (1, 1), (0, 0)), ((3, 2), (3, 2), (1, 0))]


@gpu
@pytest.mark.parametrize("kernel,stride,padding", POOLS, ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_max_pool(cu, rng, kernel, stride, padding, dtype):
    x = randn(rng, (3, 33, 7, 5), dtype)
    y, idx = cpu.max_pool2d_forward(x, kernel, stride, padding)
    dy, didx = cu.max_pool2d_forward(cu.asarray(x), kernel, stride, padding)
    assert_exact(cu, dy, y)
    assert_exact(cu, didx, idx)
    gy = randn(rng, y.shape, dtype)
    ref = cpu.max_pool2d_backward(gy, idx, x.shape)
    assert_close(cu, cu.max_pool2d_backward(cu.asarray(gy), didx, x.shape), ref)


@gpu
@pytest.mark.parametrize("kernel,stride,padding", POOLS, ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_relu_max_pool(cu, rng, kernel, stride, padding, dtype):
    x = randn(rng, (3, 33, 7, 5), dtype)
    x[0, 0] = 0.0  # windows of zeros (relu's kink) and of NaN
    x[0, 1, 2, 3] = np.nan
    y, idx = cpu.relu_max_pool2d_forward(x, kernel, stride, padding)
    dy, didx = cu.relu_max_pool2d_forward(cu.asarray(x), kernel, stride, padding)
    assert_exact(cu, dy, y)
    assert_exact(cu, didx, idx)
    assert (idx < 0).any() and (idx >= 0).any()
    gy = randn(rng, y.shape, dtype)
    # Overlapping windows sum in another order on each backend: close, not equal.
    ref = cpu.max_pool2d_backward(gy, idx, x.shape)
    assert_close(cu, cu.max_pool2d_backward(cu.asarray(gy), didx, x.shape), ref)


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, window", [
    ((3, 33, 8, 6), ((2, 2), (2, 2), (0, 0))),    # tiles: the one-thread-per-window kernel
    ((2, 5, 9, 12), ((3, 4), (3, 4), (0, 0))),    # tiles, unequal sides
    ((2, 5, 9, 7), ((2, 2), (2, 2), (0, 0))),     # a row and a column left over: warp kernel
    ((2, 5, 9, 9), ((3, 3), (2, 2), (1, 1))),     # overlapping: warp kernel
])
def test_max_pool_backward_with_the_window(cu, rng, shape, window, dtype):
    """Given the forward's window, max_pool2d_backward equals the CPU's exactly (each pixel
    gets at most one term when windows tile), relu's idx -1 windows included."""
    x = randn(rng, shape, dtype)
    x[0, 0] = -1.0  # a plane whose relu max-pool windows are all marked -1
    y, idx = cpu.relu_max_pool2d_forward(x, *window)
    gy = randn(rng, y.shape, dtype)
    ref = cpu.max_pool2d_backward(gy, idx, x.shape, window=window)
    got = cu.max_pool2d_backward(cu.asarray(gy), cu.asarray(idx), x.shape, window=window)
    if window[0] == window[1]:
        assert_exact(cu, got, ref)
    else:
        assert_close(cu, got, ref)


def first_max_positions(x, k, s, p):
    """Slow, obvious reference: flat h*W+w of the first maximum of each window, scanning
    rows then columns (np.argmax's rule)."""
    n, c, h, w = x.shape
    ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    idx = np.empty((n, c, ho, wo), np.int32)
    for oh in range(ho):
        for ow in range(wo):
            best, arg = np.full((n, c), -np.inf, x.dtype), np.full((n, c), -1, np.int32)
            for r in range(oh * s - p, oh * s - p + k):
                for q in range(ow * s - p, ow * s - p + k):
                    if 0 <= r < h and 0 <= q < w:
                        better = (x[:, :, r, q] > best) | (arg < 0)
                        best[better], arg[better] = x[:, :, r, q][better], r * w + q
            idx[:, :, oh, ow] = arg
    return idx


@gpu
@pytest.mark.parametrize("k, s, p", [(3, 2, 1), (2, 2, 0)])  # (2, 2, 0): the 2 x 2 kernel
def test_max_pool_ties_pick_the_first(cu, rng, k, s, p):
    x = rng.integers(0, 3, (3, 5, 9, 7)).astype(F32)  # many ties in every window
    y, _ = cpu.max_pool2d_forward(x, (k, k), (s, s), (p, p))
    dy, didx = cu.max_pool2d_forward(cu.asarray(x), (k, k), (s, s), (p, p))
    assert_exact(cu, dy, y)
    # Against the argmax rule itself: cpu.py (as of this writing) prefers a later offset when
    # the window's first offset ties for the maximum.
    assert_exact(cu, didx, first_max_positions(x, k, s, p))


@gpu
@pytest.mark.parametrize("kernel,stride,padding", POOLS, ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_avg_pool(cu, rng, kernel, stride, padding, dtype):
    x = randn(rng, (3, 33, 7, 5), dtype)
    y = cpu.avg_pool2d_forward(x, kernel, stride, padding)
    assert_close(cu, cu.avg_pool2d_forward(cu.asarray(x), kernel, stride, padding), y)
    gy = randn(rng, y.shape, dtype)
    assert_close(cu, cu.avg_pool2d_backward(cu.asarray(gy), x.shape, kernel, stride, padding),
                 cpu.avg_pool2d_backward(gy, x.shape, kernel, stride, padding))


# ----------------------------------------------------------------------------- optimizers


@gpu
@pytest.mark.parametrize("momentum,wd,nesterov", [(0.0, 0.0, False), (0.9, 0.0, False),
                                                  (0.9, 1e-4, True), (0.0, 5e-4, False)])
def test_sgd_step_(cu, rng, momentum, wd, nesterov):
    n = 12345
    p, buf = randn(rng, n), np.zeros(n, F32)
    dp, dbuf = cu.asarray(p), cu.asarray(buf)
    hyper, dhyper = np.zeros(4, F32), cu.zeros((4,), F32)
    for step, lr in enumerate([0.1, 0.05, 0.01]):
        g = randn(rng, n)
        cpu.set_scalar_(hyper, [lr])
        cu.set_scalar_(dhyper, [lr])
        view = slice(7, n - 3) if step == 2 else slice(None)  # a segment of the flat buffer
        cpu.sgd_step_(p[view], g[view], buf[view] if momentum else None, hyper, momentum, wd, nesterov)
        cu.sgd_step_(dp[view], cu.asarray(g[view]), dbuf[view] if momentum else None, dhyper,
                     momentum, wd, nesterov)
    assert_close(cu, dp, p)
    assert_close(cu, dbuf, buf)


@gpu
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_adamw_step_(cu, rng, wd):
    n, (b1, b2), eps = 12345, (0.9, 0.999), 1e-8
    p, m, v = randn(rng, n), np.zeros(n, F32), np.zeros(n, F32)
    dp, dm, dv = cu.asarray(p), cu.asarray(m), cu.asarray(v)
    hyper, dhyper = np.zeros(4, F32), cu.zeros((4,), F32)
    for t, lr in enumerate([1e-2, 5e-3, 1e-3], start=1):
        g = randn(rng, n)
        values = [lr, 1 - b1**t, 1 - b2**t]
        cpu.set_scalar_(hyper, values)
        cu.set_scalar_(dhyper, values)
        cpu.adamw_step_(p, g, m, v, hyper, b1, b2, eps, wd)
        cu.adamw_step_(dp, cu.asarray(g), dm, dv, dhyper, b1, b2, eps, wd)
    for got, ref in ((dp, p), (dm, m), (dv, v)):
        assert_close(cu, got, ref)


@gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BFLOAT16], ids=["fp16", "bf16"])
def test_optimizer_steps_write_the_shadow(cu, rng, dtype):
    """shadow= rewrites a 16-bit copy of the updated params in the update's pass, with the
    cast's bits (and close to the CPU's: the params themselves agree to float rounding, so a
    value at a 16-bit rounding boundary may round the other way there); a skipped step
    leaves it."""
    n = 12345
    p = randn(rng, n)
    for name in ("sgd", "adamw"):
        dp, state = cu.asarray(p), [cu.zeros((n,), F32) for _ in range(2)]
        shadow, ref_shadow = cu.zeros((n,), dtype), np.zeros(n, dtype)
        hyper, dhyper = np.zeros(4, F32), cu.zeros((4,), F32)
        ref, ref_state = p.copy(), [np.zeros(n, F32) for _ in range(2)]
        for skip in (0.0, 1.0):
            values = [1e-2, 0.1, 0.001, skip]
            cpu.set_scalar_(hyper, values)
            cu.set_scalar_(dhyper, values)
            g = randn(rng, n)
            if name == "sgd":
                cpu.sgd_step_(ref, g, ref_state[0], hyper, 0.9, 1e-4, False, shadow=ref_shadow)
                cu.sgd_step_(dp, cu.asarray(g), state[0], dhyper, 0.9, 1e-4, False,
                             shadow=shadow)
            else:
                cpu.adamw_step_(ref, g, *ref_state, hyper, 0.9, 0.999, 1e-8, 0.01,
                                shadow=ref_shadow)
                cu.adamw_step_(dp, cu.asarray(g), *state, dhyper, 0.9, 0.999, 1e-8, 0.01,
                               shadow=shadow)
            got = cu.to_numpy(shadow)
            as_float = [cpu.copy_(np.empty(n, F32), a) for a in (got, ref_shadow)]
            np.testing.assert_allclose(*as_float, rtol=1e-2, atol=1e-6)
            cast = np.zeros(n, dtype)
            cpu.copy_(cast, cu.to_numpy(dp))
            assert got.tobytes() == cast.tobytes()
        assert_close(cu, dp, ref)
    with pytest.raises(TypeError, match="shadow must be float16 or bfloat16"):
        cu.sgd_step_(dp, dp, None, dhyper, 0.0, 0.0, False, shadow=cu.zeros((n,), F32))
    with pytest.raises(ValueError, match="shadow of 3 elements"):
        cu.sgd_step_(dp, dp, None, dhyper, 0.0, 0.0, False, shadow=cu.zeros((3,), dtype))


# ----------------------------------------------------------------------------- data, randomness


@gpu
@pytest.mark.parametrize("shape", [(50, 3, 7, 5), (50, 3, 4, 5), (50, 3, 8, 6), (50, 1, 48, 48)],
                         ids=str)
@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("dtype", [F32, np.dtype(np.float16), BFLOAT16],
                         ids=["fp32", "fp16", "bf16"])
def test_gather_normalize(cu, rng, itype, shape, dtype):
    """A value per thread (odd planes), four or eight (planes of whole 4- or 8-byte words),
    per-channel affine; in float32 or rounded once to 16 bits."""
    images = rng.integers(0, 256, shape).astype(np.uint8)
    idx = rng.integers(0, 50, 9).astype(itype)
    idx[3] = idx[5]  # a repeated row
    mean, std = ((0.4914, 0.48, 0.45), (0.247, 0.24, 0.26)) if shape[1] == 3 else (0.5, 0.25)
    ref = cpu.gather_normalize(images, idx, mean, std, dtype)
    # exact: the kernel rounds the multiply and the subtract separately, as NumPy does
    got = cu.gather_normalize(cu.asarray(images), cu.asarray(idx), mean, std, dtype)
    assert_exact(cu, got, ref)
    bad = cu.asarray(np.array([0, 50, -1], dtype=itype))  # rows outside [0, M): NaN rows
    assert np.isnan(cu.to_numpy(cu.gather_normalize(cu.asarray(images), bad, mean, std))[1:]).all()


def assert_bits(cu, got, ref):
    """The same shape, dtype and bits (NaN payloads and the sign of zeros included)."""
    got, ref = cu.to_numpy(got), np.asarray(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
    assert got.tobytes() == ref.tobytes()


@gpu
@pytest.mark.parametrize("shape,layout", [
    ((20, 3, 9, 72), (1, 1, 2, 8)),  # ImageNet's stem over column pairs: one 16-byte store
    ((20, 3, 9, 72), (0, 0, 1, 3)),  # plain NHWC: a slot a thread
    ((20, 3, 7, 13), (1, 0, 2, 8)),  # an odd width, its last pair half zeros
    ((20, 3, 5, 11), (2, 1, 1, 4)),  # 16 bytes a pixel in fp32, a slot a thread in 16 bits
    ((20, 1, 6, 10), (3, 1, 2, 8)),
    ((20, 1, 6, 10), (0, 0, 1, 1)),  # one channel as it lies: the NCHW kernel's bytes
    ((20, 5, 4, 6), (2, 1, 3, 16))])  # two 16-byte vectors a pixel in 16 bits, four in fp32
@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("dtype", [F32, np.dtype(np.float16), BFLOAT16],
                         ids=["fp32", "fp16", "bf16"])
def test_gather_normalize_laid_out(cu, rng, shape, layout, itype, dtype):
    """With a layout, one pass writes the stem's layout of the rows: the CPU reference's bits
    (the two ops composed), and the two CUDA ops' bits, NaN rows included, whether a thread
    stores a 16-byte vector (channels * itemsize % 16 == 0) or a slot."""
    images = rng.integers(0, 256, shape).astype(np.uint8)
    idx = rng.integers(0, shape[0], 9).astype(itype)
    mean, std = ((0.4914, 0.48, 0.45), (0.247, 0.24, 0.26)) if shape[1] == 3 else (0.5, 0.25)
    left, right, group, channels = layout
    ref = cpu.gather_normalize(images, idx, mean, std, dtype, layout=layout)
    dev = cu.asarray(images)
    assert_bits(cu, cu.gather_normalize(dev, cu.asarray(idx), mean, std, dtype, layout=layout),
                ref)
    bad = cu.asarray(np.array([0, shape[0], -1, 7], dtype=itype))  # rows outside [0, M)
    one = cu.gather_normalize(dev, bad, mean, std, dtype, layout=layout)
    two = cu.to_channels_last(cu.gather_normalize(dev, bad, mean, std, dtype), group, left,
                              right, channels)
    assert_bits(cu, one, cu.to_numpy(two))
    values = cpu.astype(cu.to_numpy(one), F32)
    assert np.isnan(values[1:3]).any() and not np.isnan(values[[0, 3]]).any()
    with pytest.raises(ValueError, match="cuda.gather_normalize: layout .* does not lay out"):
        cu.gather_normalize(dev, bad, mean, std, dtype, layout=(0, 0, 1, shape[1] - 1))


@gpu
@pytest.mark.parametrize("p,dtype", [(0.1, F32), (0.5, F32), (0.3, F64), (0.0, F32)])
def test_dropout_mask_statistics(cu, p, dtype):
    shape = (1001, 1003)
    cu.runtime.manual_seed(1234)
    a = cu.to_numpy(cu.dropout_mask(shape, p, dtype))
    b = cu.to_numpy(cu.dropout_mask(shape, p, dtype))
    scale = np.dtype(dtype).type(1.0 / (1.0 - p))
    assert a.dtype == dtype and a.shape == shape
    assert np.isin(a, [0, scale]).all()
    n = a.size
    kept = np.count_nonzero(a) / n
    assert abs(kept - (1 - p)) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12
    assert abs(a.mean(dtype=F64) - 1.0) < 0.01  # inverted dropout keeps the mean
    if p > 0:
        assert not np.array_equal(a, b)  # successive calls draw fresh numbers
        rows = (a != 0).mean(axis=1)  # no row (counter block) is degenerate
        assert rows.min() > (1 - p) - 0.1 and rows.max() < (1 - p) + 0.1
        # neighbours are independent: P(both kept) ~ (1-p)^2
        both = np.mean((a.ravel()[1:] != 0) & (a.ravel()[:-1] != 0))
        assert abs(both - (1 - p) ** 2) < 0.01
    cu.runtime.manual_seed(1234)
    assert np.array_equal(cu.to_numpy(cu.dropout_mask(shape, p, dtype)), a)  # reproducible


# ----------------------------------------------------------------------------- integration


def _tiny_step(be, x, b, labels):
    """A forward/backward of our ops only (no matmul), returning every result."""
    h = be.relu(be.bias_add(x, b))
    p, idx = be.max_pool2d_forward(h, (3, 3), (2, 2), (1, 1))
    flat = p.reshape(p.shape[0], -1)
    logits = be.getitem(flat, (slice(None), slice(0, 10)))
    loss, probs = be.cross_entropy_forward(logits, labels)
    glogits = be.cross_entropy_backward(probs, labels, be.full((), 1.0, x.dtype))
    gflat = be.getitem_backward(glogits, flat.shape, (slice(None), slice(0, 10)))
    gh = be.max_pool2d_backward(gflat.reshape(p.shape), idx, h.shape)
    gx = be.relu_backward(h, gh)
    gb = be.bias_grad(gx)
    total = be.sum(be.mul(gx, gx))
    return loss, gx, gb, total, be.count_correct(logits, labels)


@gpu
def test_memory_pool_stays_flat(cuda, rng):
    import cupy

    x = cuda.asarray(randn(rng, (8, 3, 12, 12)))
    b = cuda.asarray(randn(rng, (3,)))
    labels = cuda.asarray(rng.integers(0, 10, 8))
    hyper = cuda.full((4,), 0.01, F32)
    pool = cupy.get_default_memory_pool()
    for i in range(50):
        loss, gx, gb, total, correct = _tiny_step(cuda, x, b, labels)
        cuda.sgd_step_(b, gb, None, hyper, 0.0, 0.0, False)
        del loss, gx, gb, total, correct
        if i == 4:
            base = pool.used_bytes()
    cupy.cuda.get_current_stream().synchronize()
    assert pool.used_bytes() == base


@gpu
def test_step_is_capturable_and_deterministic(cuda, rng):
    """A step captured as a CUDA graph (no host sync inside) replays bit for bit."""
    import cupy

    x = cuda.asarray(randn(rng, (7, 3, 12, 12)))
    b = cuda.asarray(randn(rng, (3,)))
    labels = cuda.asarray(rng.integers(0, 10, 7))
    eager = [cuda.to_numpy(o) for o in _tiny_step(cuda, x, b, labels)]
    again = [cuda.to_numpy(o) for o in _tiny_step(cuda, x, b, labels)]
    for e, a in zip(eager, again):
        np.testing.assert_array_equal(a, e)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        outs = _tiny_step(cuda, x, b, labels)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    for e, o in zip(eager, outs):
        np.testing.assert_array_equal(cuda.to_numpy(o), e)


@gpu
def test_large_reductions_are_deterministic(cuda, rng):
    g = cuda.asarray(randn(rng, (64, 32, 24, 24)))
    x = cuda.asarray(randn(rng, (16, 8, 23, 23)))
    y, idx = cuda.max_pool2d_forward(x, (3, 3), (1, 1), (1, 1))
    first = [cuda.to_numpy(a) for a in (cuda.bias_grad(g), cuda.sum(g),
                                         cuda.max_pool2d_backward(y, idx, x.shape))]
    for _ in range(3):
        again = [cuda.to_numpy(a) for a in (cuda.bias_grad(g), cuda.sum(g),
                                             cuda.max_pool2d_backward(y, idx, x.shape))]
        for f, a in zip(first, again):
            np.testing.assert_array_equal(a, f)


# ----------------------------------------------------------------------------- the runtime


@gpu
def test_runtime_orders_streams(cuda):
    import cupy

    rt = cuda.runtime
    a = cuda.full((1 << 20,), 1.0, F32)
    side = rt.comm_stream()
    assert rt.comm_stream() is side  # one per process
    main = rt.current_stream()
    rt.order(side, main)  # side sees a filled
    with rt.on(side):
        assert rt.current_stream().ptr == side.ptr
        b = cuda.scale(a, 3.0)
        done = rt.record()
    assert rt.current_stream().ptr == main.ptr
    rt.wait(done)  # main sees b
    total = cuda.sum(b)
    rt.synchronize()
    assert float(cuda.to_numpy(total)) == 3.0 * (1 << 20)
    event = rt.record(side)
    rt.wait(event, main)
    event.synchronize()
    assert isinstance(event, cupy.cuda.Event)


@gpu
@pytest.mark.parametrize("dtype", [np.int64, np.uint8])
def test_runtime_upload_(cuda, rng, dtype):
    rt = cuda.runtime
    dst = cuda.zeros((4, 6), dtype)
    host = rng.integers(1, 200, 24).astype(dtype)
    expect = host.reshape(4, 6).copy()
    assert rt.upload_(dst, host) is dst
    host[:] = 0  # staged: the host array may be reused at once
    got = cuda.to_numpy(dst)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expect)
    flat = cuda.zeros((24,), dtype)
    rt.upload_(flat, got)  # another shape of the same size
    np.testing.assert_array_equal(cuda.to_numpy(flat), got.reshape(-1))
    with pytest.raises(ValueError, match="do not fit"):
        rt.upload_(flat, np.zeros(23, dtype))


@gpu
def test_runtime_precision_scope(cuda):
    rt = cuda.runtime
    old = rt.precision
    assert old in rt.PRECISIONS
    with rt.precision_scope("fp32"):
        assert rt.precision == "fp32"
        with pytest.raises(ValueError):
            with rt.precision_scope("fp16"):
                pass
        assert rt.precision == "fp32"
    assert rt.precision == old
    rt.set_precision("auto")
    assert rt.precision == ("tf32" if int(cuda.runtime._capability()) >= 80 else "fp32")
    rt.set_precision(old)


@gpu
def test_runtime_rng_state_round_trip(cuda):
    rt = cuda.runtime
    rt.manual_seed(2**40 + 7)
    np.testing.assert_array_equal(rt.get_rng_state(), np.array([2**40 + 7, 0], np.uint64))
    first = cuda.to_numpy(cuda.dropout_mask((1001,), 0.5))
    state = rt.get_rng_state()
    assert state.dtype == np.uint64 and state.tolist() == [2**40 + 7, 251]  # ceil(1001 / 4)
    second = cuda.to_numpy(cuda.dropout_mask((1001,), 0.5))
    rt.set_rng_state(state)
    np.testing.assert_array_equal(cuda.to_numpy(cuda.dropout_mask((1001,), 0.5)), second)
    assert not np.array_equal(first, second)
    assert rt.rng_state.dtype == np.uint64 and rt.rng_state.shape == (2,)


@gpu
def test_dropout_under_capture_draws_fresh_masks(cuda):
    """A captured step that draws a mask into a fixed buffer: each replay draws the next mask,
    exactly those eager calls draw after the same seed."""
    rt = cuda.runtime
    shape, p = (37, 29), 0.4
    buf = cuda.empty(shape, F32)

    def step():
        cuda.copy_(buf, cuda.dropout_mask(shape, p))

    run = rt.capture(step, warmup=1)
    rt.manual_seed(11)
    replayed = []
    for _ in range(5):  # one eager call, the capture (and its launch), three replays
        run()
        replayed.append(cuda.to_numpy(buf))
    rt.manual_seed(11)
    eager = [cuda.to_numpy(cuda.dropout_mask(shape, p)) for _ in range(5)]
    for a, b in zip(replayed, eager):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(replayed, replayed[1:]):
        assert not np.array_equal(a, b)
    assert rt.get_rng_state()[1] == 5 * -(-37 * 29 // 4)


@gpu
def test_capture_replays_a_step_that_reads_uploaded_inputs(cuda, rng):
    rt = cuda.runtime
    x = cuda.zeros((5, 7), F32)
    y = cuda.zeros((5, 7), F32)

    def step():
        cuda.copy_(y, cuda.relu(x))

    run = rt.capture(step)
    for _ in range(4):  # two eager calls, the capture, a replay
        host = randn(rng, (5, 7))
        rt.upload_(x, host)
        run()
        np.testing.assert_array_equal(cuda.to_numpy(y), cpu.relu(host))


@gpu
def test_capture_gives_the_warm_ups_free_blocks_back(cuda, rng):
    """The eager warm-up's freed blocks go back to the device before the capture, whose own
    pool allocates the step's memory again."""
    import cupy

    pool = cupy.get_default_memory_pool()
    x, y = cuda.asarray(randn(rng, (256, 1024))), cuda.zeros((256, 1024), F32)
    run = cuda.runtime.capture(lambda: cuda.copy_(y, cuda.relu(cuda.relu(x))))
    run()
    run()  # two eager calls: relu's temporaries freed into the pool's cache
    assert pool.free_bytes() >= x.nbytes
    run()  # the capture
    # (an earlier test's array collected meanwhile may leave a small block: not the 1 MB ones)
    assert pool.free_bytes() < x.nbytes
    run()
    np.testing.assert_array_equal(cuda.to_numpy(y), np.maximum(cuda.to_numpy(x), 0))


@gpu
def test_comm_timer_reads_the_exposed_wait(cuda):
    rt = cuda.runtime
    timer = rt.comm_timer()
    assert timer.read() is None
    seen = []
    timer.issue(seen.append, 1)
    assert seen == [1]
    timer.wait_begin()
    cuda.sum(cuda.full((1 << 20,), 1.0, F32))
    timer.wait_end()
    assert timer.read() >= 0.0


@gpu
def test_launch_shape_restores_even_on_an_exception(cuda):
    from dptrain.backend.cuda import launch

    with cuda.launch_shape(threads_per_block=64):
        with pytest.raises(RuntimeError, match="inside"):
            with cuda.launch_shape(threads_per_block=33, max_blocks=2):
                assert launch.current_launch_shape() == (33, 2)
                x = cuda.full((1000,), 2.0, F32)
                assert float(cuda.to_numpy(cuda.sum(x))) == 2000.0
                raise RuntimeError("inside")
        assert launch.current_launch_shape() == (64, None)
    assert launch.current_launch_shape() == (None, None)
    with pytest.raises(ValueError, match="launch_shape"):
        cuda.launch_shape(threads_per_block=1025)


# ----------------------------------------------------------------------------- launch shapes
# No GPU needed: launch.py (and reduce.py) loaded against a stand-in for CuPy.


def _launch_modules(monkeypatch, sms=4):
    """Private copies of launch.py and reduce.py over a fake CuPy with `sms` SMs."""
    import importlib.util
    import sys
    import types

    fake = types.ModuleType("cupy")
    fake.ndarray = type("ndarray", (), {})
    device = types.SimpleNamespace(attributes={"MultiProcessorCount": sms})
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                      Device=lambda i=0: device)
    package = types.ModuleType("dptrain.backend.cuda")
    package.__path__ = []
    package.loader = types.ModuleType("dptrain.backend.cuda.loader")
    elementwise = types.ModuleType("dptrain.backend.cuda.elementwise")
    elementwise.fill_ = elementwise.add_ = None
    for name, module in (("cupy", fake), ("dptrain.backend.cuda", package),
                         ("dptrain.backend.cuda.loader", package.loader),
                         ("dptrain.backend.cuda.elementwise", elementwise)):
        monkeypatch.setitem(sys.modules, name, module)
    here = Path(__file__).parents[2] / "dptrain" / "backend" / "cuda"
    loaded = []
    for name in ("launch", "reduce"):
        spec = importlib.util.spec_from_file_location(f"_{name}_under_test", here / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        if name == "reduce":
            package.launch = loaded[0]
        spec.loader.exec_module(mod)
        loaded.append(mod)
    return loaded


def _shape_of(launch, per_block, items, **kw):
    seen = []
    launch.grid_stride(lambda grid, block, args, shared_mem=0: seen.append((grid[0], block[0])),
                       items, (), per_block, **kw)
    return seen[0]


def test_launch_defaults(monkeypatch):
    launch, reduce = _launch_modules(monkeypatch, sms=4)
    assert launch.current_launch_shape() == (None, None)
    for per_block in (256, 128, 64, 32, 16, 8, 1):
        for items in (1, 37, 1000, 10**7):
            expected = (max(1, min(4 * 16, -(-items // per_block))), 256)
            assert _shape_of(launch, per_block, items) == expected
            assert _shape_of(launch, per_block, items, warps=True) == expected
    assert reduce.group_size(10, 4096, True) == 256


def test_launch_shape_override(monkeypatch):
    launch, reduce = _launch_modules(monkeypatch, sms=4)
    with launch.launch_shape(threads_per_block=1, max_blocks=1):
        assert _shape_of(launch, 256, 10**6) == (1, 1)  # a thread per item: one thread in all
        assert _shape_of(launch, 8, 10**6) == (1, 32)  # a warp per item: one warp
        assert _shape_of(launch, 256, 10**6, warps=True) == (1, 32)
        seen = []
        reduce.run_reduce(lambda g, b, a, **_: seen.append((g[0], b[0], int(a[-1]))), None, None,
                          5000, 1, 8, 8, None, None, 1)
        assert seen == [(1, 32, 1)]  # G = 1 still gets a warp
    with launch.launch_shape(threads_per_block=100):
        assert _shape_of(launch, 256, 10**6) == (64, 100)  # default cap: 16 blocks per SM
        assert _shape_of(launch, 8, 1000) == (64, 96)  # warps: 96 threads, 3 rows per block
        assert _shape_of(launch, 8, 30) == (10, 96)
    with launch.launch_shape(threads_per_block=1024, max_blocks=32):
        assert _shape_of(launch, 256, 10**7) == (32, 1024)
        assert _shape_of(launch, 256, 3000) == (3, 1024)
        # Reductions: a whole block per output has G == the block's size, any size.
        assert reduce.group_size(10, 4096, True) == 1024
        seen = []
        reduce.run_reduce(lambda g, b, a, **_: seen.append((g[0], b[0], int(a[-1]))), None, None,
                          10, 1, 4096, 4096, None, None, reduce.group_size(10, 4096, True))
        assert seen == [(10, 1024, 1024)]
    assert launch.current_launch_shape() == (None, None)
    assert _shape_of(launch, 256, 10**7) == (64, 256)
    for bad in ({"threads_per_block": 0}, {"threads_per_block": 1025}, {"max_blocks": 0},
                {"threads_per_block": 2.5}):
        with pytest.raises(ValueError, match="launch_shape"):
            launch.launch_shape(**bad)
    with pytest.raises(KeyError):
        with launch.launch_shape(threads_per_block=7):
            raise KeyError("restored on the way out")
    assert launch.current_launch_shape() == (None, None)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("nb,rows,cols", [(3, 1, 7), (3, 7, 1), (5, 64, 9), (2, 9, 70),
                                          (4, 3, 2304), (2, 64, 64), (2, 33, 35),
                                          (1, 512, 4608), (2, 31, 1000)])
def test_transposer_turns_every_matrix(cu, nb, rows, cols, dtype):
    """transposer(nb, rows, cols): each (rows, cols) matrix turned, bit for bit, on every path
    (a plain copy where a side is 1, whole narrow matrices through shared memory, 32 x 32
    tiles, 16-bit pairs in 64 x 64 tiles, narrow but too big for shared memory)."""
    from dptrain.backend.cuda.transpose import transposer

    a = (np.arange(nb * rows * cols) % 2039).reshape(nb, rows, cols).astype(dtype)
    got = cu.to_numpy(transposer(nb, rows, cols, np.dtype(dtype))(cu.asarray(a)))
    assert got.tobytes() == np.ascontiguousarray(a.transpose(0, 2, 1)).tobytes()
