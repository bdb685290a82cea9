"""The transformer kernels (kernels/attention.cu) and the CUDA matmul's general batch
broadcasting against the NumPy reference backend.

Fresh random inputs (the seed is printed), odd sizes, float32 and float64; every array the
cuda backend allocates is poisoned first (all bits set: NaN), so an element a kernel skips
fails. Relative error ||cuda - cpu|| / ||cpu|| <= 1e-5 in float32 (1e-11 in float64); the
reference is evaluated in float64 where the CPU's own float32 rounding would dominate.
"""
import numpy as np
import pytest

from dptrain.backend import cpu

pytestmark = pytest.mark.gpu
F32, F64 = np.float32, np.float64
FLOATS = [F32, F64]
RTOL = {np.dtype(F32): 1e-5, np.dtype(F64): 1e-11}


def randn(rng, shape, dtype=F32):
    return np.asarray(rng.standard_normal(shape)).astype(dtype)


def assert_close(cu, got, ref, dtype, rtol=None):
    got = cu.to_numpy(got)
    ref = np.asarray(ref).astype(dtype)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
    assert not np.isnan(got).any(), "NaN: an unwritten element?"
    rtol = RTOL[np.dtype(dtype)] if rtol is None else rtol
    g, r = got.astype(F64), ref.astype(F64)
    err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:g}"


def f64(*arrays):
    return [a.astype(F64) for a in arrays]


# ----------------------------------------------------------------------------- layer norm


@pytest.mark.parametrize("shape", [(3, 7), (5, 37, 33), (2, 1000), (1, 1), (4, 3, 129)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_layer_norm(cu, rng, shape, dtype):
    d = shape[-1]
    x = randn(rng, shape, dtype) * dtype(3) + dtype(1)
    w, b, gy = randn(rng, (d,), dtype), randn(rng, (d,), dtype), randn(rng, shape, dtype)
    y, mean, rstd = cpu.layer_norm_forward(*f64(x, w, b), 1e-5)
    dy, dmean, drstd = cu.layer_norm_forward(cu.asarray(x), cu.asarray(w), cu.asarray(b), 1e-5)
    assert_close(cu, dy, y, dtype)
    assert_close(cu, dmean, mean, dtype)
    assert_close(cu, drstd, rstd, dtype)
    # backward from the device's own saved statistics, against the float64 reference
    ref = cpu.layer_norm_backward(*f64(gy, x, w), mean, rstd)
    got = cu.layer_norm_backward(cu.asarray(gy), cu.asarray(x), cu.asarray(w), dmean, drstd)
    if d == 1:  # one feature: gx is exactly 0, so only an absolute bound means anything
        assert np.abs(cu.to_numpy(got[0])).max() <= (1e-4 if dtype == F32 else 1e-12)
        got, ref = got[1:], ref[1:]
    for g, r in zip(got, ref):
        assert_close(cu, g, r, dtype)


def test_layer_norm_backward_is_deterministic(cu, rng):
    x, gy = cu.asarray(randn(rng, (64, 37, 128))), cu.asarray(randn(rng, (64, 37, 128)))
    w, b = cu.asarray(randn(rng, (128,))), cu.asarray(randn(rng, (128,)))
    _, mean, rstd = cu.layer_norm_forward(x, w, b, 1e-5)
    first = [cu.to_numpy(a) for a in cu.layer_norm_backward(gy, x, w, mean, rstd)]
    again = [cu.to_numpy(a) for a in cu.layer_norm_backward(gy, x, w, mean, rstd)]
    for f, a in zip(first, again):
        assert np.array_equal(f, a)


# ----------------------------------------------------------------------------- GELU


@pytest.mark.parametrize("shape", [(7,), (33, 65), (3, 5, 1001)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_gelu(cu, rng, shape, dtype):
    x, gy = randn(rng, shape, dtype) * dtype(3), randn(rng, shape, dtype)
    assert_close(cu, cu.gelu(cu.asarray(x)), cpu.gelu(x.astype(F64)), dtype)
    assert_close(cu, cu.gelu_backward(cu.asarray(x), cu.asarray(gy)),
                 cpu.gelu_backward(*f64(x, gy)), dtype)


# ----------------------------------------------------------------------------- masked softmax

MASKS = [(False, None), (True, None), (False, "lengths"), (True, "lengths")]


@pytest.mark.parametrize("shape", [(3, 5, 7, 7), (2, 3, 5, 9), (5, 33, 33), (2, 4, 37, 37),
                                   (3, 2, 1, 70)], ids=str)
@pytest.mark.parametrize("causal,lengths", MASKS)
@pytest.mark.parametrize("ltype", [np.int64, np.int32])
@pytest.mark.parametrize("dtype", FLOATS)
def test_masked_softmax(cu, rng, shape, causal, lengths, ltype, dtype):
    if lengths is None and ltype is np.int32:
        pytest.skip("no lengths: the length type does not matter")
    x, gy = randn(rng, shape, dtype) * dtype(3), randn(rng, shape, dtype)
    key_lengths = None
    if lengths:
        key_lengths = rng.integers(0, shape[-1] + 2, shape[0]).astype(ltype)
        key_lengths[0] = 0  # a row with no key left: all zeros
    scale = 0.37
    y = cpu.masked_softmax(x.astype(F64), causal, key_lengths, scale)
    dl = None if key_lengths is None else cu.asarray(key_lengths)
    dy = cu.masked_softmax(cu.asarray(x), causal=causal, key_lengths=dl, scale=scale)
    assert_close(cu, dy, y, dtype)
    got = cu.to_numpy(dy)
    assert (got[y == 0] == 0).all(), "a masked key must get probability exactly 0"
    gx = cu.masked_softmax_backward(dy, cu.asarray(gy), scale=scale)
    assert_close(cu, gx, cpu.masked_softmax_backward(got.astype(F64), gy.astype(F64), scale),
                 dtype)


# ----------------------------------------------------------------------------- 16 bits
# float16 / bfloat16 activations computed in float32 (layer norm's parameters and statistics
# float32): against the float64 reference on the same rounded inputs, within the 16-bit
# type's rounding (relative norm error 2e-3 for float16, 1.6e-2 for bfloat16).
HALVES = ["float16", "bfloat16"]
HALF_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


def _half(cu, x, half):
    """(device array of x in `half`, the rounded values as float64 on the host)."""
    from dptrain.backend.bfloat16 import from_bfloat16, to_bfloat16

    if half == "float16":
        x = x.astype(np.float16)
        return cu.asarray(x), x.astype(F64)
    bits = to_bfloat16(x.astype(F32))
    return cu.asarray(bits), from_bfloat16(bits).astype(F64)


def _widened(cu, a):
    """A 16-bit device result as float64 on the host (checked: no NaN left)."""
    a = cu.astype(a, np.dtype(F32)) if a.dtype != np.float16 else a
    host = cu.to_numpy(a).astype(F64)
    assert not np.isnan(host).any(), "NaN: an unwritten element?"
    return host


def _rel(got, ref):
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


@pytest.mark.parametrize("shape", [(3, 7), (5, 37, 33), (2, 1000), (4, 3, 129)], ids=str)
@pytest.mark.parametrize("half", HALVES)
def test_16_bit_layer_norm_keeps_fp32_parameters_and_statistics(cu, rng, shape, half):
    d, tol = shape[-1], HALF_TOL[half]
    dx, x = _half(cu, randn(rng, shape) * F32(3) + F32(1), half)
    dgy, gy = _half(cu, randn(rng, shape), half)
    w, b = randn(rng, (d,)), randn(rng, (d,))
    y, mean, rstd = cpu.layer_norm_forward(x, *f64(w, b), 1e-5)
    dy, dmean, drstd = cu.layer_norm_forward(dx, cu.asarray(w), cu.asarray(b), 1e-5)
    assert dy.dtype == dx.dtype and dmean.dtype == drstd.dtype == np.float32
    assert _rel(_widened(cu, dy), y) <= tol
    assert_close(cu, dmean, mean, F32)
    assert_close(cu, drstd, rstd, F32)
    gx, gw, gb = cpu.layer_norm_backward(gy, x, w.astype(F64), mean, rstd)
    dgx, dgw, dgb = cu.layer_norm_backward(dgy, dx, cu.asarray(w), dmean, drstd)
    assert dgx.dtype == dx.dtype and dgw.dtype == dgb.dtype == np.float32
    assert _rel(_widened(cu, dgx), gx) <= 2 * tol
    assert_close(cu, dgw, gw, F32, rtol=1e-4)
    assert_close(cu, dgb, gb, F32, rtol=1e-5)


@pytest.mark.parametrize("half", HALVES)
def test_16_bit_gelu(cu, rng, half):
    dx, x = _half(cu, randn(rng, (33, 65)) * F32(3), half)
    dgy, gy = _half(cu, randn(rng, (33, 65)), half)
    assert _rel(_widened(cu, cu.gelu(dx)), cpu.gelu(x)) <= HALF_TOL[half]
    assert _rel(_widened(cu, cu.gelu_backward(dx, dgy)), cpu.gelu_backward(x, gy)) <= \
        HALF_TOL[half]


@pytest.mark.parametrize("causal,lengths", MASKS)
@pytest.mark.parametrize("half", HALVES)
def test_16_bit_masked_softmax(cu, rng, causal, lengths, half):
    shape, scale, tol = (2, 4, 37, 37), 0.37, HALF_TOL[half]
    dx, x = _half(cu, randn(rng, shape) * F32(3), half)
    dgy, gy = _half(cu, randn(rng, shape), half)
    key_lengths = None
    if lengths:
        key_lengths = rng.integers(0, shape[-1] + 2, shape[0]).astype(np.int64)
        key_lengths[0] = 0
    y = cpu.masked_softmax(x, causal, key_lengths, scale)
    dl = None if key_lengths is None else cu.asarray(key_lengths)
    dy = cu.masked_softmax(dx, causal=causal, key_lengths=dl, scale=scale)
    got = _widened(cu, dy)
    assert dy.dtype == dx.dtype and _rel(got, y) <= tol
    assert (got[y == 0] == 0).all(), "a masked key must get probability exactly 0"
    gx = cu.masked_softmax_backward(dy, dgy, scale=scale)
    assert _rel(_widened(cu, gx), cpu.masked_softmax_backward(got, gy, scale)) <= 2 * tol


@pytest.mark.parametrize("half", HALVES)
def test_16_bit_dropout_mask(cu, half):
    """Kept elements hold 1 / (1 - p) rounded to the 16-bit type, the others 0; about p
    dropped."""
    from dptrain.backend.bfloat16 import BFLOAT16

    dtype = np.dtype(np.float16) if half == "float16" else BFLOAT16
    cu.runtime.manual_seed(5)
    mask = _widened(cu, cu.dropout_mask((300, 301), 0.3, dtype))
    kept = mask[mask != 0]
    assert abs(1 - kept.size / mask.size - 0.3) < 0.01
    assert np.allclose(kept, 1 / 0.7, rtol=4e-3) and len(np.unique(kept)) == 1


def test_masked_softmax_rejects_bad_input(cu, rng):
    x = cu.asarray(randn(rng, (2, 3, 4)))
    with pytest.raises(ValueError, match="key_lengths"):
        cu.masked_softmax(x, key_lengths=cu.asarray(np.array([1, 2, 3])))
    with pytest.raises(TypeError, match="int32 or int64"):
        cu.masked_softmax(x, key_lengths=cu.asarray(np.array([1.0, 2.0])))


# ----------------------------------------------------------------------------- matmul

GENERAL = [((2, 1), (5,)), ((1, 3), (2, 1)), ((3,), (1, 1)), ((2, 3), (3,)), ((1,), (2, 3)),
           ((4, 1, 3), (2, 1))]


@pytest.mark.parametrize("batch_a,batch_b", GENERAL, ids=str)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("prec", ["fp32", "tf32"])
def test_matmul_general_broadcasting(cu, rng, batch_a, batch_b, ta, tb, prec):
    import cupy

    m, n, k = 33, 17, 65
    a = randn(rng, batch_a + ((k, m) if ta else (m, k)))
    b = randn(rng, batch_b + ((n, k) if tb else (k, n)))
    ref = cpu.matmul(*f64(a, b), ta, tb)
    with cu.runtime.precision_scope(prec):
        got = cu.matmul(cu.asarray(a), cu.asarray(b), ta, tb)
        assert_close(cu, got, ref, F32, rtol=1e-5 if prec == "fp32" else 5e-3)
        # the same as broadcasting by hand and running the equal-batch kernel, bit for bit
        batch = np.broadcast_shapes(batch_a, batch_b)
        ea = cupy.ascontiguousarray(cupy.broadcast_to(cu.asarray(a), batch + a.shape[-2:]))
        eb = cupy.ascontiguousarray(cupy.broadcast_to(cu.asarray(b), batch + b.shape[-2:]))
        assert np.array_equal(cu.to_numpy(got), cu.to_numpy(cu.matmul(ea, eb, ta, tb)))


def test_matmul_issue_example(cu, rng):
    a, b = randn(rng, (2, 1, 4, 3)), randn(rng, (5, 3, 6))
    got = cu.matmul(cu.asarray(a), cu.asarray(b))
    assert got.shape == (2, 5, 4, 6)
    with cu.runtime.precision_scope("fp32"):
        assert_close(cu, cu.matmul(cu.asarray(a), cu.asarray(b)), np.matmul(*f64(a, b)), F32)


def test_direct_batch_shapes_skip_the_broadcast_copy(cu, rng, monkeypatch):
    """Equal batch shapes and a 2-D operand go straight to the kernels, as before."""
    from dptrain.backend.cuda import gemm

    calls = []
    real = gemm.broadcast_to
    monkeypatch.setattr(gemm, "broadcast_to", lambda *a: calls.append(a) or real(*a))
    for sa, sb in [((3, 5, 4), (3, 4, 6)), ((3, 5, 4), (4, 6)), ((5, 4), (2, 4, 6)),
                   ((1, 5, 4), (3, 4, 6))]:
        cu.matmul(cu.asarray(randn(rng, sa)), cu.asarray(randn(rng, sb)))
    assert not calls
    cu.matmul(cu.asarray(randn(rng, (2, 1, 5, 4))), cu.asarray(randn(rng, (3, 4, 6))))
    assert len(calls) == 2


# ----------------------------------------------------------------------------- capture


def test_attention_ops_replay_in_a_cuda_graph(cu, rng):
    """Layer norm, GELU and the masked softmax (device key lengths) with their backward replay
    from a captured graph: no host synchronisation inside."""
    import cupy

    x = cu.asarray(randn(rng, (3, 2, 9, 9)))
    w, b = cu.asarray(randn(rng, (9,))), cu.asarray(randn(rng, (9,)))
    lengths = cu.asarray(np.array([4, 9, 1], np.int64))

    def step():
        y, mean, rstd = cu.layer_norm_forward(x, w, b, 1e-5)
        g = cu.gelu(y)
        p = cu.masked_softmax(g, causal=True, key_lengths=lengths, scale=0.5)
        gp = cu.masked_softmax_backward(p, g, scale=0.5)
        gg = cu.gelu_backward(y, gp)
        return (p,) + tuple(cu.layer_norm_backward(gg, x, w, mean, rstd))

    eager = [cu.to_numpy(o) for o in step()]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        outs = step()
        graph = stream.end_capture()
        for o in outs:
            o.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
    for e, o in zip(eager, outs):
        np.testing.assert_array_equal(cu.to_numpy(o), e)
