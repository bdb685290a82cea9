"""The losses beyond classification: gradient-checked in float64 on the CPU backend, and
their values against the plain formulas (PyTorch's definitions, reduction="mean")."""
import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from gradcheck import gradcheck

rng = np.random.default_rng(24)


@pytest.mark.parametrize("shape", [(5,), (4, 3), (2, 3, 2)])
def test_mse_loss_gradient(shape):
    gradcheck(F.mse_loss, rng.standard_normal(shape), rng.standard_normal(shape))


@pytest.mark.parametrize("shape", [(6,), (4, 3), (2, 2, 3)])
def test_bce_with_logits_gradient(shape):
    gradcheck(F.binary_cross_entropy_with_logits, 3 * rng.standard_normal(shape),
              rng.random(shape))


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.4])
def test_cross_entropy_label_smoothing_gradient(smoothing):
    labels = np.array([0, 3, 1, 3, 2])
    gradcheck(lambda x, y: F.cross_entropy(x, y, label_smoothing=smoothing),
              rng.standard_normal((5, 4)), labels)


def test_loss_values_match_the_formulas():
    x, t = rng.standard_normal((6, 3)), rng.random((6, 3))
    got = F.mse_loss(dp.tensor(x), dp.tensor(t)).item()
    assert np.isclose(got, ((x - t) ** 2).mean(), rtol=1e-12)
    got = F.binary_cross_entropy_with_logits(dp.tensor(x), dp.tensor(t)).item()
    sig = 1 / (1 + np.exp(-x))
    assert np.isclose(got, -(t * np.log(sig) + (1 - t) * np.log(1 - sig)).mean(), rtol=1e-12)
    labels, s = np.array([2, 0, 1, 1, 0, 2]), 0.2
    logp = x - np.log(np.exp(x).sum(1, keepdims=True))
    target = np.full((6, 3), s / 3) + (1 - s) * np.eye(3)[labels]
    got = F.cross_entropy(dp.tensor(x), dp.tensor(labels), label_smoothing=s).item()
    assert np.isclose(got, -(target * logp).sum(1).mean(), rtol=1e-12)


def test_bce_with_logits_is_finite_for_large_logits():
    x = dp.tensor(np.array([[-300.0, 300.0, 0.0]]), requires_grad=True)
    loss = F.binary_cross_entropy_with_logits(x, dp.tensor(np.array([[0.0, 1.0, 1.0]])))
    loss.backward()
    assert np.isclose(loss.item(), np.log(2) / 3)
    assert np.isfinite(x.grad.numpy()).all()


def test_losses_refuse_mismatched_targets():
    with pytest.raises(ValueError, match=r"mse_loss: target has shape \(3,\), the input \(4,\)"):
        F.mse_loss(dp.tensor(np.zeros(4)), dp.tensor(np.zeros(3)))
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        F.cross_entropy(dp.tensor(np.zeros((2, 3))), np.array([0, 1]), label_smoothing=1.0)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_of_16bit_logits_is_that_of_their_float_cast(smoothing):
    """float16 logits: a float32 loss, bitwise that of the logits cast to float32 first, and
    a float16 gradient, the float32 one rounded once (as a cast's backward rounds it)."""
    x = (3 * rng.standard_normal((9, 5))).astype(np.float16)
    labels = np.array([0, 4, 1, 3, 2, 2, 0, 1, 4])
    results = []
    for cast_first in (False, True):
        logits = dp.tensor(x, requires_grad=True, dtype=np.float16)
        loss = F.cross_entropy(F.cast(logits, np.float32) if cast_first else logits, labels,
                               label_smoothing=smoothing)
        loss.backward()
        assert loss.dtype == np.float32 and logits.grad.dtype == np.float16
        results.append((loss.numpy().tobytes(), logits.grad.numpy().tobytes()))
    assert results[0] == results[1]
