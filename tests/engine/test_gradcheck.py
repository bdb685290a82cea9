"""Every op's backward against float64 central differences, on the CPU backend."""
import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from gradcheck import gradcheck

rng = np.random.default_rng(1234)


def randn(*shape):
    return rng.standard_normal(shape)


def positive(*shape):
    return rng.random(shape) + 0.5


BINARY_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 5), (3, 1)), ((4,), (2, 3, 4)), ((), (2, 3))]


@pytest.mark.parametrize("sa,sb", BINARY_SHAPES)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcasting(op, sa, sb):
    fn = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b,
          "mul": lambda a, b: a * b, "div": lambda a, b: a / b}[op]
    gradcheck(fn, randn(*sa), positive(*sb) if op == "div" else randn(*sb))


def test_scalar_operands_on_both_sides():
    gradcheck(lambda a: 2.0 * a - 1.5 / (a + 3.0) + (1 - a) * 0.5, positive(3, 2))


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4)])
@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "relu", "sigmoid", "tanh", "neg"])
def test_unary(name, shape):
    x = positive(*shape) if name in ("log", "sqrt") else randn(*shape)
    if name == "relu":  # keep clear of the kink at 0
        x = np.where(np.abs(x) < 0.05, 0.3, x)
    fn = {"neg": lambda t: -t}.get(name, lambda t: getattr(t, name)())
    gradcheck(fn, x)


@pytest.mark.parametrize("p", [2, 3, 0.5, -1.5])
def test_pow_scalar(p):
    gradcheck(lambda x: x**p, positive(3, 4))


@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("name", ["sum", "mean", "max"])
def test_reductions(name, axis, keepdims):
    gradcheck(lambda x: getattr(x, name)(axis=axis, keepdims=keepdims), randn(2, 3, 4))


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)), ((2, 3, 4), (4, 5)),
                                   ((3, 4), (2, 4, 5)), ((1, 1), (1, 7))])
def test_matmul(sa, sb):
    gradcheck(lambda a, b: a @ b, randn(*sa), randn(*sb))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xshape", [(3, 4), (2, 3, 4), (1, 4)])
def test_linear(xshape, bias):
    args = (randn(*xshape), randn(5, 4)) + ((randn(5),) if bias else ())
    gradcheck(lambda x, w, *b: F.linear(x, w, *b), *args)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xshape", [(3, 4), (2, 3, 4)])
def test_linear_relu(xshape, bias):
    args = (randn(*xshape), randn(5, 4)) + ((randn(5),) if bias else ())
    gradcheck(lambda x, w, *b: F.linear_relu(x, w, *b), *args)


CONV_CASES = [
    # x shape, w shape, stride, padding
    ((2, 3, 5, 5), (4, 3, 3, 3), 1, 0),
    ((2, 3, 7, 5), (4, 3, 3, 3), 1, 1),
    ((1, 2, 8, 6), (3, 2, 3, 2), (2, 1), (1, 2)),
    ((2, 1, 9, 7), (2, 1, 5, 5), 2, 2),
    ((3, 2, 4, 6), (5, 2, 1, 1), 1, 0),
    ((1, 3, 6, 6), (2, 3, 2, 2), 3, 1),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xs,ws,stride,padding", CONV_CASES)
def test_conv2d(xs, ws, stride, padding, bias):
    args = (randn(*xs), randn(*ws)) + ((randn(ws[0]),) if bias else ())
    gradcheck(lambda x, w, *b: F.conv2d(x, w, *b, stride=stride, padding=padding), *args)


@pytest.mark.parametrize("xs,ws,stride,padding", CONV_CASES[:3] + CONV_CASES[4:5])
def test_conv2d_channels_last(xs, ws, stride, padding):
    """channels_last=True: x (N, H, W, C), weight as ever; gradients checked, and the values
    those of the NCHW convolution transposed."""
    x, w, b = randn(xs[0], xs[2], xs[3], xs[1]), randn(*ws), randn(ws[0])
    conv = lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=padding, channels_last=True)
    gradcheck(conv, x, w, b)
    x, w, b = dp.tensor(x), dp.tensor(w), dp.tensor(b)
    nchw = F.conv2d(F.to_channels_first(x), w, b, stride=stride, padding=padding)
    np.testing.assert_allclose(conv(x, w, b).numpy(),
                               F.to_channels_last(nchw).numpy(), rtol=1e-12, atol=1e-12)


POOL_CASES = [((2, 3, 6, 6), 2, None, 0), ((1, 2, 7, 5), 3, 2, 1), ((2, 1, 5, 8), (2, 3), (1, 2), (1, 1)),
              ((1, 2, 9, 9), 3, 3, 0), ((1, 1, 4, 7), 2, 1, 0)]


@pytest.mark.parametrize("xs,k,s,p", POOL_CASES)
def test_max_pool2d(xs, k, s, p):
    # Distinct values, so no two elements of a window tie for the maximum.
    x = rng.permutation(np.prod(xs)).reshape(xs) / 10.0
    gradcheck(lambda t: F.max_pool2d(t, k, s, p), x)


@pytest.mark.parametrize("xs,k,s,p", POOL_CASES)
def test_relu_max_pool2d(xs, k, s, p):
    # Distinct values away from relu's kink, about half of them negative.
    x = (rng.permutation(np.prod(xs)).reshape(xs) - np.prod(xs) / 2 + 0.5) / 10.0
    gradcheck(lambda t: F.relu_max_pool2d(t, k, s, p), x)


@pytest.mark.parametrize("xs,k,s,p", POOL_CASES)
def test_avg_pool2d(xs, k, s, p):
    gradcheck(lambda t: F.avg_pool2d(t, k, s, p), randn(*xs))


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_family(axis):
    gradcheck(lambda x: F.softmax(x, axis=axis), randn(3, 4, 2))
    gradcheck(lambda x: F.log_softmax(x, axis=axis), randn(3, 4, 2))


@pytest.mark.parametrize("n,c", [(1, 2), (5, 7), (8, 3)])
def test_cross_entropy(n, c):
    labels = dp.tensor(rng.integers(0, c, size=n))
    gradcheck(lambda x: F.cross_entropy(x, labels), randn(n, c) * 3)


def test_shape_ops():
    gradcheck(lambda x: x.reshape(4, 6).T, randn(2, 3, 4))
    gradcheck(lambda x: x.transpose(2, 0, 1), randn(2, 3, 4))
    gradcheck(lambda x: x.flatten(), randn(2, 3, 4))
    gradcheck(lambda x: x.flatten(0), randn(2, 3, 4))


@pytest.mark.parametrize("index", [1, (slice(None), 2), (slice(0, 2), slice(1, 3)), (Ellipsis, 0),
                                   (np.array([0, 2, 0]),)])
def test_getitem(index):
    gradcheck(lambda x: x[index], randn(3, 4, 2))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate(axis):
    gradcheck(lambda a, b: dp.concatenate([a, b, a], axis=axis), randn(2, 3, 2), randn(2, 3, 2))


def test_dropout_backward_uses_forward_mask():
    x = dp.tensor(randn(50, 20), requires_grad=True)
    y = F.dropout(x, 0.3, training=True)
    y.sum().backward()
    mask = y.numpy() / x.numpy()
    np.testing.assert_allclose(x.grad.numpy(), mask, rtol=1e-6)
    assert set(np.round(np.unique(mask), 5)) <= {0.0, round(1 / 0.7, 5)}


def test_composite_network_float64():
    """A small conv net end to end: every input and parameter gradient at once."""
    def net(x, w1, b1, w2, b2):
        h = F.max_pool2d(F.conv2d(x, w1, b1, padding=1).relu(), 2)
        return F.log_softmax(F.linear(h.flatten(), w2, b2))
    gradcheck(net, randn(2, 2, 6, 4), randn(3, 2, 3, 3), randn(3), randn(4, 18), randn(4))
