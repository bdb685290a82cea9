"""Layer fusion (nn.fusion): fused ops give the values and gradients of the layers they replace."""
import numpy as np
import pytest

import dptrain.engine.functional as F
from dptrain.engine.autograd import Tensor
from dptrain.backend import cpu
from dptrain.nn import Linear, MaxPool2d, ReLU, Sequential, cnn, fusion, resnet18

POOLS = [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1)), ((3, 2), (1, 2), (1, 0))]


def _tricky(rng, shape):
    """Random values with ties, zeros (relu's kink) and negatives-only windows. (No NaN: the
    unfused CPU max pool may then point idx at another element of a NaN window; the fused op
    gives NaN windows no gradient on both backends, see test_cuda_backend.)"""
    x = rng.integers(-3, 3, shape).astype(np.float32) * 0.5
    x[0, 0] = -1.0
    return x


@pytest.mark.parametrize("kernel,stride,padding", POOLS, ids=str)
def test_relu_max_pool_equals_relu_then_max_pool(kernel, stride, padding):
    rng = np.random.default_rng(0)
    x = _tricky(rng, (2, 3, 7, 6))
    y, idx = cpu.relu_max_pool2d_forward(x, kernel, stride, padding)
    r = cpu.relu(x)
    y2, idx2 = cpu.max_pool2d_forward(r, kernel, stride, padding)
    assert np.array_equal(y, y2)
    assert ((idx == idx2) | (idx == -1)).all() and (idx == -1).any()
    gy = rng.standard_normal(y.shape).astype(np.float32)
    fused = cpu.max_pool2d_backward(gy, idx, x.shape)
    unfused = cpu.relu_backward(r, cpu.max_pool2d_backward(gy, idx2, x.shape))
    assert np.array_equal(fused, unfused)


def _forward_backward(model, x):
    xt = Tensor(x, requires_grad=True)
    out = model(xt)
    (out * out).sum().backward()
    return out.numpy(), xt.grad.numpy(), [p.grad.numpy() for p in model.parameters()]


def test_fused_cnn_equals_unfused_bitwise(monkeypatch):
    """The reference CNN's ReLU + MaxPool2d pairs and its Linear + ReLU run fused; outputs
    and gradients are the same bits as with fusion off."""
    model = cnn(image_shape=(1, 16, 16), num_classes=5, widths=(4, 8), hidden=16)
    assert sum(callable(s) and not hasattr(s, "forward") for s in model._steps()) == 3
    x = _tricky(np.random.default_rng(1), (3, 1, 16, 16))
    fused = _forward_backward(model, x)
    for p in model.parameters():
        p.grad = None
    monkeypatch.setenv("DPTRAIN_FUSE", "0")
    assert all(hasattr(s, "forward") for s in model._steps())
    unfused = _forward_backward(model, x)
    for a, b in zip([fused[0], fused[1], *fused[2]], [unfused[0], unfused[1], *unfused[2]]):
        assert np.array_equal(a, b)


def test_a_second_layer_with_hooks_is_not_fused():
    relu, pool = ReLU(), MaxPool2d(2)
    seq = Sequential(relu, pool)
    assert len(seq._steps()) == 1
    pool.register_forward_pre_hook(lambda m: None)
    assert seq._steps() == [relu, pool]
    x = Tensor(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4) - 8)
    assert np.array_equal(seq(x).numpy(), F.max_pool2d(F.relu(x), 2).numpy())


def test_a_first_layer_with_hooks_fuses_and_runs_its_hooks_first():
    """The reducer hooks every layer with parameters (its wait for their all-gather): a
    Linear so hooked still fuses with its ReLU, its hooks called before the fused op."""
    lin, relu = Linear(4, 3), ReLU()
    seq = Sequential(lin, relu)
    calls = []
    lin.register_forward_pre_hook(lambda m: calls.append(m))
    assert len(seq._steps()) == 1
    x = Tensor(np.arange(8, dtype=np.float32).reshape(2, 4) - 4)
    assert np.array_equal(seq(x).numpy(), F.relu(F.linear(x, lin.weight, lin.bias)).numpy())
    assert calls == [lin]


def test_fused_resnet_equals_unfused_bitwise(monkeypatch):
    """ResNet's batch norms take their block's ReLU and residual addition into their pass; in
    float32 on the CPU that is the same arithmetic as the three separate ops, bit for bit,
    forward and backward (running estimates too)."""
    def run():
        import dptrain as dp
        dp.manual_seed(4)
        model = resnet18((1, 12, 12), 5, widths=(4, 4, 8, 8))
        out = _forward_backward(model, _tricky(np.random.default_rng(2), (3, 1, 12, 12)))
        return out, [b.numpy() for b in model.buffers()]

    fused = run()
    monkeypatch.setenv("DPTRAIN_FUSE", "0")
    unfused = run()
    (fo, fx, fp), fb = fused
    (uo, ux, up), ub = unfused
    for a, b in zip([fo, fx, *fp, *fb], [uo, ux, *up, *ub]):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv2d_hands_on_its_batch_statistics(channels_last):
    """F.conv2d(batch_stats=True): y as without, and (mean, var) those batch_norm computes
    of y (here the same ops: the same bits); batch_norm then uses them as they are."""
    rng = np.random.default_rng(5)
    x = Tensor(rng.standard_normal((2, 5, 5, 3) if channels_last else (2, 3, 5, 5))
               .astype(np.float32))
    w = Tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    y, (mean, var) = F.conv2d(x, w, None, 1, 1, channels_last=channels_last, batch_stats=True)
    plain = F.conv2d(x, w, None, 1, 1, channels_last=channels_last)
    assert np.array_equal(y.numpy(), plain.numpy())
    rows = plain.numpy().reshape(-1, 4) if channels_last else plain.numpy()
    for got, want in zip((mean, var), cpu.batch_norm_stats(rows)):
        assert np.array_equal(got, want)
    weight, bias = Tensor(np.ones(4, np.float32)), Tensor(np.zeros(4, np.float32))
    given = F.batch_norm(y, weight, bias, channels_last=channels_last, batch_stats=(mean, var))
    computed = F.batch_norm(plain, weight, bias, channels_last=channels_last)
    assert np.array_equal(given.numpy(), computed.numpy())


def test_batch_statistics_are_refused_where_they_cannot_apply():
    x = Tensor(np.zeros((1, 2, 3, 3), np.float32))
    w, b = Tensor(np.zeros((2, 2, 1, 1), np.float32)), Tensor(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="bias-free"):
        F.conv2d(x, w, b, batch_stats=True)
    stats = (np.zeros(2, np.float32), np.ones(2, np.float32))
    running = tuple(Tensor(a) for a in (*stats, np.zeros((), np.int64)))
    with pytest.raises(ValueError, match="not eval"):
        F.batch_norm(x, b, b, running, training=False, batch_stats=stats)


def test_conv_batch_norm_falls_back_to_the_two_layers(monkeypatch):
    """conv_batch_norm asks for statistics only where batch norm would compute its own:
    training, per-rank statistics, a bias-free convolution, fusion on."""
    from dptrain.nn import BatchNorm2d, Conv2d
    asked = []
    real = F.conv2d
    monkeypatch.setattr(F, "conv2d", lambda *a, **k: asked.append(k["batch_stats"]) or
                        real(*a, **k))
    x = Tensor(np.random.default_rng(0).standard_normal((2, 2, 4, 4)).astype(np.float32))
    conv, bn = Conv2d(2, 3, 3, padding=1, bias=False), BatchNorm2d(3)
    want = bn(real(x, conv.weight, None, 1, 1)).numpy()
    bn.running_mean.data[:], bn.running_var.data[:] = 0, 1
    bn.num_batches_tracked.data[...] = 0
    assert np.array_equal(fusion.conv_batch_norm(conv, bn, x).numpy(), want)
    bn.eval()
    fusion.conv_batch_norm(conv, bn, x)
    bn.train()
    monkeypatch.setenv("DPTRAIN_FUSE", "0")
    fusion.conv_batch_norm(conv, bn, x)
    assert asked == [True, False, False]
