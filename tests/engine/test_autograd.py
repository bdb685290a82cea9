"""The engine: accumulation over shared uses, no_grad, detach, dtypes, errors."""
import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F


def test_value_used_twice_accumulates():
    x = dp.tensor([2.0, 3.0], requires_grad=True)
    y = x * x + x  # dy/dx = 2x + 1
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 7.0])


def test_diamond_graph():
    x = dp.tensor([1.5], requires_grad=True)
    a, b = x * 2.0, x.exp()
    (a * b).sum().backward()  # d/dx 2x e^x = 2e^x + 2x e^x
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.exp(1.5) * (1 + 1.5), rtol=1e-6)


def test_backward_twice_accumulates_into_grad():
    x = dp.tensor([1.0, 2.0], requires_grad=True)
    (x * 3.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 6.0])


def test_backward_with_explicit_gradient():
    x = dp.tensor(np.ones((2, 2)), requires_grad=True)
    (x * 2.0).backward(dp.tensor(np.array([[1.0, 2.0], [3.0, 4.0]])))
    np.testing.assert_allclose(x.grad.numpy(), [[2, 4], [6, 8]])


def test_no_grad_records_nothing():
    x = dp.tensor([1.0], requires_grad=True)
    with dp.no_grad():
        y = x * 2.0
    assert not y.requires_grad and y._ctx is None
    assert dp.is_grad_enabled()


def test_detach_cuts_the_graph():
    x = dp.tensor([3.0], requires_grad=True)
    y = x * x.detach()  # gradient flows only through the first factor
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0])


def test_grad_only_for_inputs_that_require_it():
    x = dp.tensor([1.0, 2.0], requires_grad=True)
    c = dp.tensor([5.0, 6.0])
    (x * c).sum().backward()
    assert c.grad is None
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 6.0])


def test_backward_on_constant_raises():
    with pytest.raises(RuntimeError, match="does not require grad"):
        dp.tensor([1.0]).backward()


def test_dtypes_default_float32_keep_float64_and_ints():
    assert dp.tensor([1.0, 2.0]).dtype == np.float32
    assert dp.tensor(np.zeros(3, dtype=np.float64)).dtype == np.float64
    assert dp.tensor(np.arange(3)).dtype.kind == "i"
    assert (dp.tensor([1.0]) + 1).dtype == np.float32


def test_tensor_api_surface():
    x = dp.tensor(np.arange(24, dtype=np.float64).reshape(2, 3, 4))
    assert x.shape == (2, 3, 4) and x.T.shape == (4, 3, 2)
    assert x.reshape(6, 4).shape == (6, 4) and x.flatten().shape == (2, 12)
    assert x[1, :, 2].numpy().tolist() == [14.0, 18.0, 22.0]
    assert x.max(axis=2).numpy()[0].tolist() == [3.0, 7.0, 11.0]
    assert float(x.mean().item()) == pytest.approx(11.5)
    assert isinstance(x.numpy(), np.ndarray)


def test_deep_chain_does_not_recurse():
    x = dp.tensor([1.0], requires_grad=True)
    y = x
    for _ in range(5000):
        y = y + 0.0
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0])


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match="4 channels"):
        F.conv2d(dp.tensor(np.zeros((1, 4, 5, 5))), dp.tensor(np.zeros((2, 3, 3, 3))))
    with pytest.raises(ValueError, match="features"):
        F.linear(dp.tensor(np.zeros((2, 3))), dp.tensor(np.zeros((4, 5))))
    with pytest.raises(ValueError, match="integer labels"):
        F.cross_entropy(dp.tensor(np.zeros((2, 3))), dp.tensor([0.5, 1.0]))
