"""ImageNet's stem channels-last: the 7x7/2 convolution with its input and weight padded with
zero channels where the backend asks (``conv2d_channels_last_pad``), and the channels-last
3x3/2 max-pool. On the CPU nothing is padded unless a test asks, so these tests ask."""
import numpy as np
import pytest

import dptrain as dp
from dptrain import nn
from dptrain.backend import cpu


def _loss_and_grads(model, x):
    loss = dp.functional.cross_entropy(model(dp.tensor(x)), np.array([0, 2]))
    loss.backward()
    return [loss.numpy()] + [p.grad.numpy() for p in model.parameters()]


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("pad", [0, 5])
def test_imagenet_stem_channels_last_equals_nchw(monkeypatch, pad, pairs):
    """ResNet-18 above 64 px (the ImageNet stem: 7x7/2 convolution, 3x3/2 max-pool) gives the
    same loss and gradients channels-last, its stem padded with `pad` zero channels or not
    (and, with DPTRAIN_STEM_COLUMN_PAIRS, run over pairs of columns where it is padded), as
    in NCHW; the weight keeps its (64, 3, 7, 7) shape."""
    asked = []

    def stem_pad(c, kh, kw, dtype):
        asked.append((c, kh, kw))
        return -c % 8 if pad and (c, kh, kw) in ((3, 7, 7), (6, 7, 4)) else 0

    monkeypatch.setattr(cpu, "conv2d_channels_last_pad", stem_pad)
    monkeypatch.setenv("DPTRAIN_STEM_COLUMN_PAIRS", "1" if pairs else "0")
    x = np.random.default_rng(1).standard_normal((2, 3, 66, 70))
    models = {cl: nn.resnet18((3, 66, 70), 3, widths=(8, 8, 16, 16), channels_last=cl)
              for cl in (True, False)}
    models[True].load_state_dict(models[False].state_dict())
    results = {cl: _loss_and_grads(_float64(m), x) for cl, m in models.items()}
    assert asked[0] == (3, 7, 7)  # only the channels-last model asks, each convolution
    assert ((6, 7, 4) in asked) == (pairs and pad > 0)
    assert models[True].conv1.weight.shape == (8, 3, 7, 7)
    for got, ref in zip(results[True], results[False]):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


def _float64(model):
    """The model's parameters in float64 (its batch norms' running estimates do not enter a
    training forward)."""
    for p in model.parameters():
        p.data = p.data.astype(np.float64)
    return model


@pytest.mark.parametrize("width,kernel,padding", [
    (70, 7, 3),  # the stem's: one zero column before, one after, 4 paired taps
    (9, 7, 3), (8, 3, 1), (11, 5, 2), (10, 5, 2), (12, 4, 1), (7, 1, 0), (10, 3, 0)])
def test_column_pairs_is_the_same_convolution(width, kernel, padding):
    """A stride-2 convolution over pairs of columns (nn.layers.column_pairs) gives the plain
    one's output and the gradients of x and the weight, in float64."""
    from dptrain.nn.layers import column_pairs

    rng = np.random.default_rng(width * 100 + kernel * 10 + padding)
    xs = rng.standard_normal((2, 9, width, 3))
    ws = rng.standard_normal((4, 3, 5, kernel))
    gy = None
    results = []
    for paired in (False, True):
        x, w = dp.tensor(xs, requires_grad=True), dp.tensor(ws, requires_grad=True)
        args = (x, w, (2, 2), (2, padding))
        if paired:
            args = column_pairs(*args)
            assert args[2] == (2, 1) and args[1].shape == (4, 6, 5, (kernel + 1) // 2)
        y = dp.functional.conv2d(args[0], args[1], None, args[2], args[3], channels_last=True)
        gy = rng.standard_normal(y.shape) if gy is None else gy
        (y * dp.tensor(gy)).sum().backward()
        results.append([y.numpy(), x.grad.numpy(), w.grad.numpy()])
    for got, ref in zip(*results[::-1]):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_pad_zeros_gradient_is_the_slice():
    x = dp.tensor(np.arange(6.0).reshape(1, 2, 3), requires_grad=True)
    y = dp.functional.pad_zeros(x, -1, 2)
    assert y.shape == (1, 2, 5) and not y.numpy()[..., 3:].any()
    (y * dp.tensor(np.arange(10.0).reshape(1, 2, 5))).sum().backward()
    assert np.array_equal(x.grad.numpy(), np.arange(10.0).reshape(1, 2, 5)[..., :3])


def _stem_grads(device, precision, channels_last, dtype=np.float32):
    """Loss and gradients of one forward and backward of a small ResNet-18 at 3x66x70 (the
    ImageNet stem), its activations in `precision` (16-bit: the input cast, the layers cast
    their weights, as mixed precision runs), from fixed weights and images."""
    from dptrain.run import amp

    dp.manual_seed(4)
    model = nn.resnet18((3, 66, 70), 5, widths=(8, 8, 16, 16), channels_last=channels_last)
    model = _float64(model) if dtype == np.float64 else model
    model.to(device)
    x = dp.tensor(np.random.default_rng(4).standard_normal((4, 3, 66, 70)), device=device,
                  dtype=dtype)
    if precision != "fp32":
        x = dp.functional.cast(x, amp.compute_dtype(precision))
    loss = dp.functional.cross_entropy(model(x), np.array([0, 2, 4, 1]))
    loss.backward()
    return [loss.numpy().astype(np.float64)] + [p.grad.numpy().astype(np.float64)
                                                for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("pairs", ["0", "1"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpu_stem_channels_last(monkeypatch, precision, pairs):
    """On the GPU the stem runs channels-last natively (padded input channels, over pairs of
    columns with DPTRAIN_STEM_COLUMN_PAIRS, the channels-last max-pool), and the loss and
    every gradient follow the float64 CPU reference as closely as the NCHW network's do."""
    monkeypatch.setenv("DPTRAIN_STEM_COLUMN_PAIRS", pairs)
    ref = _stem_grads("cpu", "fp32", False, np.float64)
    with backend_precision(precision):
        cl = _stem_grads("cuda", precision, True)
        nchw = _stem_grads("cuda", precision, False)

    def error(got):
        return max(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
                   for g, r in zip(got, ref))

    limit = 1e-4 if precision == "fp32" else 3e-2
    assert error(cl) <= max(limit, 2 * error(nchw)), (error(cl), error(nchw))


def backend_precision(precision):
    from dptrain import backend

    matrix = "fp32" if precision == "fp32" else "auto"
    return backend.get("cuda").runtime.precision_scope(matrix)
