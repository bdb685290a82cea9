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


# ----------------------------------------------------------------------------- fused attention
# attention_forward / attention_backward (one block per (batch, head)) against the NumPy
# reference in float64 on the same inputs: float32 / float64 within RTOL, 16-bit within
# HALF_TOL. Dropout: the fused kernel's dropped weights are exactly those dropout_mask draws
# for the (B * size, H, Tq, Tk) global batch from the same RNG state.
ATTN_SHAPES = [((2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4)),  # (q, k, v)
               ((3, 4, 37, 16), (3, 4, 37, 16), (3, 4, 37, 16)),  # the ViT's heads
               ((2, 2, 7, 8), (2, 2, 40, 8), (2, 2, 40, 3)),  # Tq != Tk, Ev != E
               ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))]
ATTN_MASKS = [(False, False), (True, False), (False, True), (True, True)]


def _lengths(rng, b, tk):
    lengths = rng.integers(0, tk + 2, b).astype(np.int64)
    lengths[0] = 0  # a batch element with no key left: zero weights, zero output
    return lengths


@pytest.mark.parametrize("shapes", ATTN_SHAPES, ids=lambda s: "x".join(map(str, s[0])))
@pytest.mark.parametrize("causal,lengths", ATTN_MASKS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_fused_attention(cu, rng, shapes, causal, lengths, dtype):
    q, k, v = (randn(rng, s, dtype) for s in shapes)
    gout = randn(rng, shapes[0][:3] + shapes[2][3:], dtype)
    key_lengths = _lengths(rng, q.shape[0], k.shape[2]) if lengths else None
    scale = 0.41
    out, probs = cpu.attention_forward(*f64(q, k, v), scale, causal, key_lengths)
    dout, dprobs = cu.attention_forward(cu.asarray(q), cu.asarray(k), cu.asarray(v), scale,
                                        causal, None if key_lengths is None else
                                        cu.asarray(key_lengths))
    assert_close(cu, dout, out, dtype)
    assert_close(cu, dprobs, probs, dtype)
    assert (cu.to_numpy(dprobs)[probs == 0] == 0).all(), "masked keys get exactly 0"
    ref = cpu.attention_backward(*f64(gout, q, k, v), probs, scale)
    got = cu.attention_backward(cu.asarray(gout), cu.asarray(q), cu.asarray(k), cu.asarray(v),
                                dprobs, scale)
    for g, r in zip(got, ref):
        assert_close(cu, g, r, dtype)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("causal,lengths", [(False, False), (True, True)])
def test_16_bit_fused_attention(cu, rng, half, causal, lengths):
    shape, tol, scale = (3, 4, 37, 16), HALF_TOL[half], 0.25
    (dq, q), (dk, k), (dv, v), (dg, g) = (_half(cu, randn(rng, shape), half) for _ in range(4))
    key_lengths = _lengths(rng, 3, 37) if lengths else None
    out, probs = cpu.attention_forward(q, k, v, scale, causal, key_lengths)
    dout, dprobs = cu.attention_forward(dq, dk, dv, scale, causal, None if key_lengths is None
                                        else cu.asarray(key_lengths))
    assert dprobs.dtype == F32  # the weights are kept in float32
    for got, ref in [(_widened(cu, dout), out), (cu.to_numpy(dprobs), probs)]:
        assert np.linalg.norm(got - ref) <= tol * np.linalg.norm(ref)
    ref = cpu.attention_backward(g, q, k, v, probs, scale)
    for got, r in zip(cu.attention_backward(dg, dq, dk, dv, dprobs, scale), ref):
        assert np.linalg.norm(_widened(cu, got) - r) <= tol * np.linalg.norm(r)


def test_fused_attention_reads_and_writes_views(cu, rng):
    """Heads of a packed (B, T, 3, H, E) projection in, outputs and gradients into views:
    bitwise the contiguous calls' results."""
    b, t, h, e, scale = 2, 9, 3, 4, 0.5
    qkv = cu.asarray(randn(rng, (b, t, 3, h, e)))
    heads = [qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]
    flat = [cu.copy(x) for x in heads]
    gout = cu.asarray(randn(rng, (b, h, t, e)))
    out, probs = cu.attention_forward(*flat, scale, True)
    packed_out = cu.empty((b, t, h, e), np.float32)
    _, probs2 = cu.attention_forward(*heads, scale, True, out=packed_out.transpose(0, 2, 1, 3))
    assert np.array_equal(cu.to_numpy(packed_out).transpose(0, 2, 1, 3), cu.to_numpy(out))
    assert np.array_equal(cu.to_numpy(probs2), cu.to_numpy(probs))
    grads = cu.attention_backward(gout, *flat, probs, scale)
    packed = cu.empty((b, t, 3, h, e), np.float32)
    views = tuple(packed[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    cu.attention_backward(cu.copy(gout.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3),
                          *heads, probs, scale, grads=views)
    for i, g in enumerate(grads):
        assert np.array_equal(cu.to_numpy(packed)[:, :, i].transpose(0, 2, 1, 3),
                              cu.to_numpy(g))


@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2)])
def test_fused_attention_dropout_is_dropout_mask(cu, rng, rank, size):
    """The dropped weights are those dropout_mask draws for the global batch from the same RNG
    state; the state advances by the same count; values and gradients follow from the mask."""
    shape, p, scale = (3, 2, 37, 16), 0.3, 0.25
    q, k, v, g = (randn(rng, shape) for _ in range(4))
    cu.runtime.manual_seed(99)
    mask = cu.to_numpy(cu.dropout_mask((3 * size, 2, 37, 37), p))[rank::size]
    after = cu.runtime.get_rng_state()
    cu.runtime.manual_seed(99)
    dout, dprobs = cu.attention_forward(cu.asarray(q), cu.asarray(k), cu.asarray(v), scale,
                                        dropout_p=p, shard=(rank, size))
    np.testing.assert_array_equal(cu.runtime.get_rng_state(), after)
    probs = cu.to_numpy(dprobs).astype(F64)
    np.testing.assert_array_equal(np.signbit(probs), mask == 0)
    plain, _ = cpu.attention_forward(*f64(q, k, v), scale)
    weights = np.abs(probs)
    np.testing.assert_allclose(weights, cpu.masked_softmax(q.astype(F64) @ np.swapaxes(
        k.astype(F64), -1, -2), scale=scale), rtol=1e-5, atol=1e-7)
    kept = np.where(mask != 0, weights / (1 - p), 0)
    assert_close(cu, dout, kept @ v.astype(F64), F32)
    assert not np.allclose(cu.to_numpy(dout), plain, atol=1e-3)  # dropout did something
    ref = cpu.attention_backward(*f64(g, q, k, v), probs, scale, p)
    got = cu.attention_backward(cu.asarray(g), cu.asarray(q), cu.asarray(k), cu.asarray(v),
                                dprobs, scale, p)
    for a, r in zip(got, ref):
        assert_close(cu, a, r, F32)


def test_fused_attention_says_what_does_not_fit(cu):
    big = (1, 1, 512, 64)
    assert not cu.attention_supported(big, big, big, np.float32)
    assert cu.attention_supported((256, 4, 37, 16), (256, 4, 37, 16), (256, 4, 37, 16),
                                  np.float32)
    x = cu.zeros(big, np.float32)
    with pytest.raises(ValueError, match="shared memory"):
        cu.attention_forward(x, x, x, 1.0)
