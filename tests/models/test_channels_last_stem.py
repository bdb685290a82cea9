"""ImageNet's stem channels-last: the 7x7/2 convolution with its input and weight padded with
zero channels where the backend asks (``conv2d_channels_last_pad``), and the channels-last
3x3/2 max-pool; and its input laid out by the loader's op in the layout the model names
(``input_layout``, ``gather_normalize(..., layout=)``, marked by ``F.laid_out``) in place of
the stem's own pass. On the CPU nothing is padded unless a test asks, so these tests ask."""
import numpy as np
import pytest
from replay import train_steps

import dptrain as dp
from dptrain import backend, nn
from dptrain.backend import cpu
from dptrain.engine.autograd import Tensor


def _loss_and_grads(model, x):
    loss = dp.functional.cross_entropy(model(dp.tensor(x)), np.array([0, 2]))
    loss.backward()
    return [loss.numpy()] + [p.grad.numpy() for p in model.parameters()]


@pytest.mark.parametrize("pad", [0, 5])
def test_imagenet_stem_channels_last_equals_nchw(monkeypatch, pad):
    """ResNet-18 above 64 px (the ImageNet stem: 7x7/2 convolution, 3x3/2 max-pool) gives the
    same loss and gradients channels-last, its stem padded with `pad` zero channels or not
    (and then run over pairs of columns), as in NCHW; the weight keeps its (64, 3, 7, 7)
    shape."""
    asked = []

    def stem_pad(c, kh, kw, dtype):
        asked.append((c, kh, kw))
        return -c % 8 if pad and (c, kh, kw) in ((3, 7, 7), (6, 7, 4)) else 0

    monkeypatch.setattr(cpu, "conv2d_channels_last_pad", stem_pad)
    x = np.random.default_rng(1).standard_normal((2, 3, 66, 70))
    models = {cl: nn.resnet18((3, 66, 70), 3, widths=(8, 8, 16, 16), channels_last=cl)
              for cl in (True, False)}
    models[True].load_state_dict(models[False].state_dict())
    results = {cl: _loss_and_grads(_float64(m), x) for cl, m in models.items()}
    assert asked[0] == (3, 7, 7)  # only the channels-last model asks, each convolution
    assert ((6, 7, 4) in asked) == (pad > 0)
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
    """A stride-2 convolution over pairs of columns (nn.layers.column_pairs, its NCHW input
    laid out in pairs by F.to_channels_last) gives the plain channels-last one's output and
    the gradients of x and the weight, in float64."""
    from dptrain.nn.layers import column_pairs

    rng = np.random.default_rng(width * 100 + kernel * 10 + padding)
    xs = rng.standard_normal((2, 3, 9, width))
    ws = rng.standard_normal((4, 3, 5, kernel))
    gy = None
    results = []
    for paired in (False, True):
        x, w = dp.tensor(xs, requires_grad=True), dp.tensor(ws, requires_grad=True)
        columns, weight, stride, padding_ = (0, 0), w, (2, 2), (2, padding)
        if paired:
            columns, weight, stride, padding_ = column_pairs(width, w, stride, padding_)
            assert stride == (2, 1) and weight.shape == (4, 6, 5, (kernel + 1) // 2)
        xl = dp.functional.to_channels_last(x, columns, 2 if paired else 1)
        y = dp.functional.conv2d(xl, weight, None, stride, padding_, channels_last=True)
        gy = rng.standard_normal(y.shape) if gy is None else gy
        (y * dp.tensor(gy)).sum().backward()
        results.append([y.numpy(), x.grad.numpy(), w.grad.numpy()])
    for got, ref in zip(*results[::-1]):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("columns,group,channels", [
    ((0, 0), 1, None), ((0, 0), 1, 8), ((1, 3), 1, 5), ((1, 2), 2, 8), ((0, 1), 2, 6),
    ((1, 0), 3, 11)])
def test_to_channels_last_layout_and_gradient(columns, group, channels):
    """F.to_channels_last's slots hold the columns they name (zero outside the image and past
    group * C channels), and its gradient is the slice of them, back in NCHW."""
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5))
    t = dp.tensor(x, requires_grad=True)
    y = dp.functional.to_channels_last(t, columns, group, channels)
    left, right = columns
    c = channels or group * 3
    assert y.shape == (2, 4, (left + 5 + right) // group, c)
    want = np.zeros((2, 4, left + 5 + right, 3))
    want[:, :, left:left + 5] = x.transpose(0, 2, 3, 1)
    want = want.reshape(2, 4, -1, group * 3)
    assert np.array_equal(y.numpy()[..., :group * 3], want)
    assert not y.numpy()[..., group * 3:].any()
    gy = np.random.default_rng(4).standard_normal(y.shape)
    (y * dp.tensor(gy)).sum().backward()
    g = np.zeros((2, 4, left + 5 + right, 3))
    g.reshape(2, 4, -1, group * 3)[:] = gy[..., :group * 3]
    assert np.array_equal(t.grad.numpy(), g[:, :, left:left + 5].transpose(0, 3, 1, 2))


def test_to_channels_last_refuses_a_layout_that_does_not_exist():
    x = dp.tensor(np.zeros((1, 3, 2, 5)))
    with pytest.raises(ValueError, match="columns \\(0, 0\\) around 5 in groups of 2"):
        dp.functional.to_channels_last(x, (0, 0), 2)
    with pytest.raises(ValueError, match="with 4 channels for 3"):
        dp.functional.to_channels_last(x, (1, 0), 2, 4)


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
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpu_stem_channels_last(precision):
    """On the GPU the stem runs channels-last natively (padded input channels, over pairs of
    columns, the channels-last max-pool), and the loss and every gradient follow the float64
    CPU reference as closely as the NCHW network's do."""
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


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_with_its_max_pool_is_the_two_ops(training):
    """F.batch_norm(..., pool=) (ImageNet's stem: relu(bn(x)) max-pooled in one pass) gives
    the output, the input and parameter gradients and the running estimates of batch_norm
    then max_pool2d, in float64."""
    F = dp.functional
    rng = np.random.default_rng(6)
    xs = rng.standard_normal((2, 9, 7, 5))
    results = []
    for fused in (True, False):
        x = dp.tensor(xs, requires_grad=True)
        w = dp.tensor(np.full(5, 1.5), requires_grad=True)
        b = dp.tensor(np.full(5, 0.2), requires_grad=True)
        running = tuple(dp.tensor(a) for a in (np.zeros(5), np.ones(5), np.zeros((), np.int64)))
        args = dict(running=running, training=training, relu=True, channels_last=True)
        window = ((3, 3), (2, 2), (1, 1))
        if fused:
            y = F.batch_norm(x, w, b, pool=window, **args)
        else:
            y = F.max_pool2d(F.batch_norm(x, w, b, **args), *window, channels_last=True)
        (y * dp.tensor(np.arange(y.size).reshape(y.shape) % 7)).sum().backward()
        results.append([y.numpy(), x.grad.numpy(), w.grad.numpy(), b.grad.numpy(),
                        *(t.numpy() for t in running)])
    for got, ref in zip(*results):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="pool needs channels-last 4-D input, relu"):
        F.batch_norm(dp.tensor(xs), w, b, running=running, pool=window, channels_last=True)


# ----------------------------------------------------------------------------- the input laid out

F = dp.functional
IMAGE = (3, 72, 72)  # above 64 px: ImageNet's stem
WIDTHS = (8, 8, 16, 16)


def _stem_pad(pad):
    """conv2d_channels_last_pad as the GPU's in 16 bits where `pad`: the stem's 3 channels, and
    its 6 over pairs of columns, padded to 8; nothing else."""
    def stem_pad(c, kh, kw, dtype):
        return -c % 8 if pad and (c, kh, kw) in ((3, 7, 7), (6, 7, 4)) else 0
    return stem_pad


def _batch(be, layout, dtype=np.float32):
    """4 fixed uint8 images normalised in `dtype` by the loader's op, laid out in `layout` and
    marked so (NCHW where None)."""
    images = np.random.default_rng(7).integers(0, 256, (6, *IMAGE), dtype=np.uint8)
    x = be.gather_normalize(be.asarray(images), be.asarray(np.arange(4)), 0.45, 0.23, dtype,
                            layout=layout)
    return F.laid_out(Tensor(x), layout)


def _results(model, x):
    """Logits, loss and every parameter's gradient of one training forward and backward."""
    for p in model.parameters():
        p.grad = None
    logits = model(x)
    loss = F.cross_entropy(logits, np.array([0, 2, 4, 1]))
    loss.backward()
    return [logits.numpy(), loss.numpy()] + [p.grad.numpy() for p in model.parameters()]


def _assert_bits(got, ref):
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("pad", [0, 5])
def test_laid_out_input_gives_the_nchw_results(monkeypatch, pad):
    """ResNet-18 at 3x72x72 channels-last, fed its batch laid out by the loader's op in the
    layout its input_layout names, gives the NCHW batch's logits, loss and gradients bit for
    bit: plain NHWC, or (`pad`) 8 channels over pairs of columns as on the GPU. The stem's
    own layout pass does not run."""
    monkeypatch.setattr(cpu, "conv2d_channels_last_pad", _stem_pad(pad))
    model = nn.resnet18(IMAGE, 5, widths=WIDTHS, channels_last=True)
    layout = model.input_layout(IMAGE, np.float32, cpu)
    assert layout == ((1, 1, 2, 8) if pad else (0, 0, 1, 3))
    nchw = _results(model, _batch(cpu, None))
    passes, real = [], cpu.to_channels_last
    monkeypatch.setattr(cpu, "to_channels_last", lambda *a, **k: passes.append(a) or real(*a, **k))
    laid = _results(model, _batch(cpu, layout))
    assert not passes
    _assert_bits(laid, nchw)


def test_a_laid_out_input_the_model_does_not_read_is_refused(monkeypatch):
    """A mark naming another layout, a model that reads NCHW, a model that reshapes its input
    and a cast to another dtype all refuse a laid-out batch, naming it; F.laid_out refuses
    what cannot be one."""
    monkeypatch.setattr(cpu, "conv2d_channels_last_pad", _stem_pad(True))
    model = nn.resnet18(IMAGE, 5, widths=WIDTHS, channels_last=True)
    assert model.input_layout(IMAGE, np.float32, cpu) == (1, 1, 2, 8)
    with pytest.raises(ValueError, match=r"laid out \(0, 0, 1, 3\) .* reads float32 images 72 "
                                         r"columns wide laid out \(1, 1, 2, 8\)"):
        model(_batch(cpu, (0, 0, 1, 3)))
    x = _batch(cpu, (1, 1, 2, 8))
    nchw = nn.resnet18(IMAGE, 5, widths=WIDTHS)  # "auto": NCHW on the CPU
    assert nchw.input_layout(IMAGE, np.float32, cpu) is None
    with pytest.raises(ValueError, match=r"Conv2d: its input is laid out \(1, 1, 2, 8\)"):
        nchw(x)
    flat = nn.Sequential(nn.Flatten(), nn.Linear(72 * 37 * 8, 5))
    assert flat.input_layout(IMAGE, np.float32, cpu) is None
    with pytest.raises(ValueError, match=r"Reshape: an input laid out \(1, 1, 2, 8\)"):
        flat(x)
    with pytest.raises(TypeError, match="cast: x is laid out for a stem in float32"):
        F.cast(x, np.float16)
    plain = Tensor(x.data)
    assert F.cast(x, np.float32) is x and F.laid_out(plain, None) is plain
    with pytest.raises(ValueError, match=r"laid_out: x \(4, 72, 37, 8\) is not"):
        F.laid_out(Tensor(x.data), (1, 1, 2, 6))
    with pytest.raises(ValueError, match="laid_out: marks a network's input batch"):
        F.laid_out(dp.tensor(x.numpy(), requires_grad=True), (1, 1, 2, 8))


def _laid_out_steps(device, build, laid_out, precision="fp32"):
    return train_steps(device, build, IMAGE, 5, graph=True, steps=5, seed=3, images=24,
                       batch=8, precision=precision, laid_out=laid_out)


def test_steps_on_laid_out_batches_train_as_on_nchw_ones(monkeypatch):
    """Training steps (TrainStep, DeviceLoader) of a channels-last ResNet-18 at 3x72x72 on
    batches the loader lays out for its stem (8 channels over pairs of columns) give the
    weights after every step and the batch-norm estimates of the steps on NCHW batches, bit
    for bit."""
    monkeypatch.setattr(cpu, "conv2d_channels_last_pad", _stem_pad(True))

    def build():
        return nn.resnet18(IMAGE, 5, widths=WIDTHS, channels_last=True)

    (model, laid), (ref, nchw) = (_laid_out_steps("cpu", build, flag) for flag in (True, False))
    _assert_bits(laid, nchw)
    _assert_bits(model.state_dict().values(), ref.state_dict().values())


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_laid_out_input_gives_the_nchw_results(precision):
    """On the GPU (the stem padded to 8 channels over pairs of columns) a batch laid out by
    the one-pass kernel gives the NCHW batch's logits, loss and gradients bit for bit."""
    from dptrain.run import amp

    be, dtype = backend.get("cuda"), amp.compute_dtype(precision)
    with backend_precision(precision):
        dp.manual_seed(4)
        model = nn.resnet18(IMAGE, 5, widths=WIDTHS).to("cuda")
        layout = model.input_layout(IMAGE, dtype, be)
        assert layout is not None and layout.group == 2 and layout.channels == 8
        nchw = _results(model, _batch(be, None, dtype))
        laid = _results(model, _batch(be, layout, dtype))
    _assert_bits(laid, nchw)


@pytest.mark.gpu
def test_gpu_captured_fp16_steps_on_laid_out_batches_train_as_on_nchw_ones():
    """Captured fp16 steps (loss scaler and guard as a run has them) of ResNet-18 at 3x72x72
    on batches laid out by the loader's one-pass kernel give the weights after every step and
    the batch-norm estimates of the steps on NCHW batches (the stem's own pass), bit for
    bit."""
    from dptrain.run import amp

    def build():
        return nn.resnet18(IMAGE, 5, widths=WIDTHS)

    layout = build().to("cuda").input_layout(IMAGE, amp.compute_dtype("fp16"),
                                             backend.get("cuda"))
    assert layout is not None and layout.group == 2
    (model, laid), (ref, nchw) = (_laid_out_steps("cuda", build, flag, "fp16")
                                  for flag in (True, False))
    _assert_bits(laid, nchw)
    _assert_bits(model.state_dict().values(), ref.state_dict().values())
