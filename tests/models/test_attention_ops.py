"""The transformer ops on the CPU backend: float64 gradient checks of every new op (layer norm,
GELU, the masked softmax, broadcast_to, matmul with transposes and general batch
broadcasting, scaled dot-product attention) and their forward values against plain formulas."""
import math

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain.backend import cpu
from dptrain.backend.cpu import attention as cpu_attention
from gradcheck import gradcheck

rng = np.random.default_rng(2024)


def randn(*shape):
    return rng.standard_normal(shape)


# ----------------------------------------------------------------------------- erf


def test_erf_matches_math_erf():
    x = np.concatenate([np.linspace(-7, 7, 20001), randn(5000) * 3, [0.0, 1.0, -1.0, 6.0]])
    ref = np.array([math.erf(v) for v in x])
    assert np.max(np.abs(cpu_attention.erf(x) - ref) / np.maximum(np.abs(ref), 1e-300)) < 1e-14
    assert np.max(np.abs(cpu_attention.erf_float32(x) - ref)) < 3e-8
    assert cpu_attention.erf(np.array([0.0]))[0] == 0.0


def test_gelu_values_match_the_erf_formula():
    x = np.linspace(-8, 8, 1001)
    ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(cpu.gelu(x), ref, rtol=1e-12, atol=1e-15)  # 1 + erf cancels
    np.testing.assert_allclose(cpu.gelu(x.astype(np.float32)), ref, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- gradient checks


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 6)])
def test_layer_norm_gradcheck(shape):
    d = shape[-1]
    gradcheck(lambda x, w, b: F.layer_norm(x, w, b), randn(*shape) * 2 + 1, randn(d), randn(d))


def test_layer_norm_forward_values():
    x, w, b = randn(4, 9) * 3 + 2, randn(9), randn(9)
    y, mean, rstd = cpu.layer_norm_forward(x, w, b, 1e-5)
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(y, ref, rtol=1e-12)
    np.testing.assert_allclose(mean, x.mean(-1), rtol=1e-12)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(-1) + 1e-5), rtol=1e-12)


@pytest.mark.parametrize("shape", [(7,), (3, 5)])
def test_gelu_gradcheck(shape):
    gradcheck(F.gelu, randn(*shape) * 2)


MASKS = [(False, None), (True, None), (False, [3, 1]), (True, [2, 4]), (True, [0, 3])]


@pytest.mark.parametrize("causal,lengths", MASKS)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_masked_softmax_gradcheck(causal, lengths, scale):
    key_lengths = None if lengths is None else np.array(lengths)
    gradcheck(lambda x: F.masked_softmax(x, causal, key_lengths, scale), randn(2, 3, 4, 4) * 2)


def _masked_softmax_loops(x, causal, lengths, scale):
    """Row by row with an explicit list of kept keys."""
    b_, tq, tk = x.shape[0], x.shape[-2], x.shape[-1]
    out = np.zeros_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        b, i = idx[0], idx[-1]
        keep = [j for j in range(tk) if (not causal or j <= i)
                and (lengths is None or j < lengths[b])]
        if keep:
            z = x[idx][keep] * scale
            e = np.exp(z - z.max())
            out[idx][keep] = e / e.sum()
    assert b_ == x.shape[0]
    return out


@pytest.mark.parametrize("causal,lengths", MASKS)
def test_masked_softmax_values(causal, lengths):
    x = randn(2, 3, 5, 4) * 3
    key_lengths = None if lengths is None else np.array(lengths)
    y = cpu.masked_softmax(x, causal=causal, key_lengths=key_lengths, scale=0.5)
    np.testing.assert_allclose(y, _masked_softmax_loops(x, causal, lengths, 0.5), rtol=1e-12,
                               atol=1e-300)
    if lengths is not None and 0 in lengths:  # a row with no key left is all zeros
        assert (y[lengths.index(0)] == 0).all()


def test_masked_softmax_rejects_bad_lengths():
    with pytest.raises(ValueError, match="key_lengths has shape"):
        cpu.masked_softmax(randn(2, 3, 4), key_lengths=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="at least 2 dims"):
        cpu.masked_softmax(randn(4), causal=True)


def test_broadcast_to_gradcheck():
    gradcheck(lambda t: F.broadcast_to(t, (3, 2, 4)), randn(1, 1, 4))
    gradcheck(lambda t: F.broadcast_to(t, (2, 5, 3)), randn(5, 1))


GENERAL_BATCHES = [((2, 1), (5,)), ((1, 3), (2, 1)), ((4,), (1, 1)), ((2, 3), (3,)), ((), (2, 3))]


@pytest.mark.parametrize("ba,bb", GENERAL_BATCHES)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_general_broadcasting_gradcheck(ba, bb, ta, tb):
    m, k, n = 4, 3, 2
    a = randn(*ba, *((k, m) if ta else (m, k)))
    b = randn(*bb, *((n, k) if tb else (k, n)))
    gradcheck(lambda x, y: F.matmul(x, y, trans_a=ta, trans_b=tb), a, b)
    ref = np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)
    got = F.matmul(dp.tensor(a), dp.tensor(b), trans_a=ta, trans_b=tb).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def test_matmul_issue_example():
    """(2,1,4,3) @ (5,3,6) -> (2,5,4,6), gradients summed back to each operand's shape."""
    gradcheck(lambda x, y: x @ y, randn(2, 1, 4, 3), randn(5, 3, 6))


@pytest.mark.parametrize("causal,lengths", [(False, None), (True, None), (False, [2, 4]),
                                            (True, [3, 1])])
def test_scaled_dot_product_attention_gradcheck(causal, lengths):
    key_lengths = None if lengths is None else np.array(lengths)
    q, k, v = randn(2, 3, 4, 5), randn(2, 3, 4, 5), randn(2, 3, 4, 2)
    gradcheck(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, causal, key_lengths),
              q, k, v)


@pytest.mark.parametrize("causal,lengths", [(False, None), (True, [3, 1])])
def test_unfused_scaled_dot_product_attention_gradcheck(causal, lengths):
    """The composition (matmul, masked softmax, dropout, matmul) the fused op replaces."""
    key_lengths = None if lengths is None else np.array(lengths)
    q, k, v = randn(2, 3, 4, 5), randn(2, 3, 4, 5), randn(2, 3, 4, 2)
    gradcheck(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, causal, key_lengths,
                                                             fused=False), q, k, v)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal,lengths", [(False, None), (True, [4, 2])])
def test_self_attention_gradcheck(fused, causal, lengths):
    """Packed (B, T, 3 * D) projection in, (B, T, D) out; 2 heads of 3 features."""
    key_lengths = None if lengths is None else np.array(lengths)
    gradcheck(lambda x: F.self_attention(x, 2, causal, key_lengths, fused=fused),
              randn(2, 4, 18))


@pytest.mark.parametrize("dropout_p", [0.0, 0.4])
def test_fused_attention_equals_the_composition(dropout_p):
    """Same values and gradients fused or not, dropout included: both draw one mask of the
    weights' shape from the runtime's generator at the same point."""
    x = randn(3, 6, 24).astype(np.float32)
    results = []
    for fused in (True, False):
        cpu.runtime.manual_seed(7)
        t = dp.tensor(x, requires_grad=True)
        y = F.self_attention(t, 4, True, np.array([6, 2, 0]), dropout_p=dropout_p, fused=fused)
        (y * y).sum().backward()
        results.append((y.numpy(), t.grad.numpy()))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_fused_attention_probs_mark_dropped_weights():
    q = randn(2, 2, 5, 3).astype(np.float32)
    cpu.runtime.manual_seed(3)
    out, probs = cpu.attention_forward(q, q, q, 0.5, dropout_p=0.5)
    cpu.runtime.manual_seed(3)
    mask = cpu.dropout_mask(probs.shape, 0.5, np.float32)
    np.testing.assert_array_equal(np.signbit(probs), mask == 0)
    weights = cpu.masked_softmax(q @ np.swapaxes(q, -1, -2), scale=0.5)
    np.testing.assert_array_equal(np.abs(probs), weights)
    np.testing.assert_allclose(out, (weights * mask) @ q, rtol=1e-6)


def test_class_token_and_positions_gradcheck():
    """The ViT's token assembly: a (1,1,D) class token repeated over the batch, concatenated in
    front of the patch tokens, plus a (1,T,D) positional parameter added by broadcasting."""
    def tokens(patches, cls, pos):
        b, _, d = patches.shape
        return dp.concatenate([F.broadcast_to(cls, (b, 1, d)), patches], axis=1) + pos
    gradcheck(tokens, randn(2, 3, 4), randn(1, 1, 4), randn(1, 4, 4))
