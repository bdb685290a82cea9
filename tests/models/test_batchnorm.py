"""Batch normalisation, global average pooling and residual addition on the CPU backend:
float64 gradient checks, forward values and running estimates against NumPy formulas,
module buffers in state_dict."""
import threading

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import backend, nn
from gradcheck import gradcheck

rng = np.random.default_rng(2024)


def randn(*shape):
    return rng.standard_normal(shape)


def _running(c):
    return (dp.tensor(np.zeros(c)), dp.tensor(np.ones(c)), dp.tensor(np.zeros((), np.int64)))


def reference_bn(x, w, b, eps=1e-5):
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * w.reshape(shape) \
        + b.reshape(shape)
    return y, mean, var


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("shape", [(3, 4, 5, 3), (5, 3), (2, 2, 1, 1), (1, 3, 3, 2)])
@pytest.mark.parametrize("with_running", [False, True])
def test_batch_norm_training_gradients(shape, with_running):
    c = shape[1]
    running = _running(c) if with_running else None
    gradcheck(lambda x, w, b: F.batch_norm(x, w, b, running, training=True),
              randn(*shape) * 2 + 0.5, randn(c), randn(c))


@pytest.mark.parametrize("residual", [False, True])
def test_channels_last_batch_norm_gradients(residual):
    """channels_last=True normalises the last axis of (N, H, W, C) (as rows of C), with the
    fused residual and ReLU; gradients checked, values those of NCHW batch norm."""
    c = 3
    x, w, b, r = randn(2, 4, 3, c), randn(c), randn(c), randn(2, 4, 3, c)
    bn = lambda x, w, b, r: F.batch_norm(x, w, b, _running(c), training=True,
                                         residual=r if residual else None, relu=residual,
                                         channels_last=True)
    if residual:
        gradcheck(bn, x, w, b, r)
    else:
        gradcheck(lambda x, w, b: bn(x, w, b, None), x, w, b)
    x, w, b, r = (dp.tensor(a) for a in (x, w, b, r))
    nchw = F.batch_norm(F.to_channels_first(x), w, b, _running(c), training=True,
                        residual=F.to_channels_first(r) if residual else None, relu=residual)
    np.testing.assert_allclose(bn(x, w, b, r).numpy(), F.to_channels_last(nchw).numpy(),
                               rtol=1e-12, atol=1e-12)


def test_batch_norm_eval_gradients():
    c = 4
    running = (dp.tensor(randn(c)), dp.tensor(rng.random(c) + 0.5),
               dp.tensor(np.zeros((), np.int64)))
    gradcheck(lambda x, w, b: F.batch_norm(x, w, b, running, training=False),
              randn(3, c, 2, 3), randn(c), randn(c))


def test_global_average_pool_gradients():
    gradcheck(lambda x: F.adaptive_avg_pool2d(x, 1), randn(2, 3, 5, 7))


def test_residual_addition_reaches_both_branches():
    """x feeds a convolution branch and the identity; both gradients add up."""
    w = randn(3, 3, 3, 3)
    gradcheck(lambda x, w: F.relu(F.conv2d(x, w, padding=1) + x), randn(2, 3, 4, 5), w)


@pytest.mark.parametrize("project", [True, False])
def test_residual_block_gradients_in_float64(project):
    """A basic block (conv, BN, ReLU, twice, plus a 1x1 conv + BN projection shortcut or the
    identity), written with the functional ops, in float64."""
    def block(x, w1, g1, b1, w2, g2, b2, *shortcut):
        stride = 2 if project else 1
        out = F.relu(F.batch_norm(F.conv2d(x, w1, stride=stride, padding=1), g1, b1))
        out = F.batch_norm(F.conv2d(out, w2, padding=1), g2, b2)
        if project:
            wd, gd, bd = shortcut
            x = F.batch_norm(F.conv2d(x, wd, stride=2), gd, bd)
        return F.relu(out + x)

    cin, c = (2, 3) if project else (3, 3)
    args = [randn(2, cin, 5, 4) + 0.3, randn(c, cin, 3, 3), randn(c) + 1, randn(c),
            randn(c, c, 3, 3), randn(c) + 1, randn(c)]
    if project:
        args += [randn(c, cin, 1, 1), randn(c) + 1, randn(c)]
    gradcheck(block, *args, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_with_residual_and_relu_gradients(relu):
    """relu(bn(x) + residual) as one op: gradients of x, weight, bias and the residual."""
    c = 3
    gradcheck(lambda x, w, b, r: F.batch_norm(x, w, b, _running(c), training=True, residual=r,
                                              relu=relu),
              randn(2, c, 4, 3) * 2 + 0.5, randn(c), randn(c), randn(2, c, 4, 3))


def test_batch_norm_relu_without_residual_gradients():
    gradcheck(lambda x, w, b: F.batch_norm(x, w, b, training=True, relu=True),
              randn(3, 2, 3, 3), randn(2), randn(2))


def test_batch_norm_residual_must_match_the_input():
    x, w, b = dp.tensor(randn(2, 3, 4, 4)), dp.tensor(randn(3)), dp.tensor(randn(3))
    with pytest.raises(ValueError, match="residual must match"):
        F.batch_norm(x, w, b, residual=dp.tensor(randn(2, 3, 4, 5)))
    with pytest.raises(ValueError, match="residual must match"):
        F.batch_norm(x, w, b, residual=dp.tensor(randn(2, 3, 4, 4).astype(np.float32)))


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("shape", [(4, 3, 5, 7), (6, 5)])
def test_batch_norm_forward_matches_numpy(shape):
    x, w, b = randn(*shape) * 3 + 1, randn(shape[1]), randn(shape[1])
    y = F.batch_norm(dp.tensor(x), dp.tensor(w), dp.tensor(b), training=True).numpy()
    np.testing.assert_allclose(y, reference_bn(x, w, b)[0], rtol=1e-10, atol=1e-12)


def test_running_estimates_follow_pytorch_rule_and_eval_uses_them():
    """Three training steps of BatchNorm2d against the rule written out in NumPy, then an
    eval forward that must use the running estimates, not the batch's."""
    layer = nn.BatchNorm2d(3, momentum=0.2)
    layer.weight.data[:] = [1.5, -0.5, 2.0]
    layer.bias.data[:] = [0.1, 0.2, -0.3]
    mean_ref, var_ref = np.zeros(3), np.ones(3)
    for _ in range(3):
        x = (randn(5, 3, 4, 3) * np.array([1, 2, 3])[:, None, None] + 2).astype(np.float32)
        layer(dp.tensor(x))
        n = x.size // 3
        m, v = x.astype(np.float64).mean(axis=(0, 2, 3)), x.astype(np.float64).var(axis=(0, 2, 3))
        mean_ref = 0.8 * mean_ref + 0.2 * m
        var_ref = 0.8 * var_ref + 0.2 * v * n / (n - 1)
    np.testing.assert_allclose(layer.running_mean.numpy(), mean_ref, rtol=1e-5)
    np.testing.assert_allclose(layer.running_var.numpy(), var_ref, rtol=1e-5)
    assert layer.num_batches_tracked.numpy() == 3
    assert layer.num_batches_tracked.dtype == np.int64

    layer.eval()
    x = randn(2, 3, 2, 2).astype(np.float32)
    y = layer(dp.tensor(x)).numpy()
    shape = (1, 3, 1, 1)
    ref = (x - mean_ref.reshape(shape)) / np.sqrt(var_ref.reshape(shape) + 1e-5) \
        * layer.weight.numpy().reshape(shape) + layer.bias.numpy().reshape(shape)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert layer.num_batches_tracked.numpy() == 3  # eval leaves the estimates alone


def test_global_average_pool_is_the_spatial_mean():
    x = randn(2, 3, 4, 5)
    y = nn.AdaptiveAvgPool2d(1)(dp.tensor(x)).numpy()
    np.testing.assert_allclose(y, x.mean(axis=(2, 3), keepdims=True), rtol=1e-12)
    with pytest.raises(ValueError, match="output_size 1"):
        nn.AdaptiveAvgPool2d(2)


def test_cpu_ops_keep_float32_and_accumulate_precisely():
    cpu = backend.get("cpu")
    x = (rng.standard_normal((64, 3, 16, 16)) + 1000).astype(np.float32)
    mean = cpu.batch_norm_mean(x)
    var = cpu.batch_norm_var(x, mean)
    assert mean.dtype == var.dtype == np.float32
    np.testing.assert_allclose(mean, x.astype(np.float64).mean(axis=(0, 2, 3)), rtol=1e-7)
    np.testing.assert_allclose(var, x.astype(np.float64).var(axis=(0, 2, 3)), rtol=1e-3)
    mean1, var1 = cpu.batch_norm_stats(x)  # one call: the variance about the exact mean
    np.testing.assert_array_equal(mean1, mean)
    np.testing.assert_allclose(var1, x.astype(np.float64).var(axis=(0, 2, 3)), rtol=1e-6)


# ----------------------------------------------------------------------------- buffers


def test_buffers_are_saved_loaded_and_not_trained():
    layer = nn.BatchNorm2d(4)
    names = list(layer.state_dict())
    assert names == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    model = nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4))
    model(dp.tensor(randn(2, 1, 5, 5).astype(np.float32)))
    state = model.state_dict()
    assert state["1.num_batches_tracked"] == 1 and state["1.running_var"].shape == (4,)
    fresh = nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4))
    fresh.load_state_dict(state)
    for name, value in fresh.state_dict().items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    del state["1.running_mean"]
    with pytest.raises(ValueError, match="missing 1.running_mean"):
        fresh.load_state_dict(state)


class _ThreadComm:
    """Ranks as threads of one process: all_reduce sums the ranks' buffers (a barrier each
    side), so sync-BN can be checked exactly, in float64, without MPI."""

    def __init__(self, size):
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size

    def rank(self, r):
        outer = self

        class View:
            size = outer.size

            def all_reduce(self, buf, op="sum"):
                outer.slots[r] = buf.copy()
                outer.barrier.wait()
                total = sum(outer.slots)
                outer.barrier.wait()
                buf[...] = total / (outer.size if op == "mean" else 1)

        return View()


def _tiny_resnet():
    dp.manual_seed(1)
    model = nn.resnet18((1, 12, 12), 5, widths=(4, 4, 4, 4))
    for t in model.parameters() + model.buffers():
        if t.dtype.kind == "f":
            t.data = t.data.astype(np.float64)
    return model


def _sgd(model, lr=0.1):
    for p in model.parameters():
        p.data -= lr * p.grad.data
        p.grad = None


def test_sync_bn_of_two_ranks_equals_the_global_batch_in_float64():
    """Three SGD steps of a small ResNet: two ranks (threads) with sync-BN, gradients averaged
    as the reducer does, against one process on the union of their batches."""
    x, y = randn(3, 8, 1, 12, 12), rng.integers(0, 5, (3, 8))
    one = _tiny_resnet()
    for s in range(3):
        F.cross_entropy(one(dp.tensor(x[s])), dp.tensor(y[s])).backward()
        _sgd(one)
    comm, ranks = _ThreadComm(2), [_tiny_resnet(), _tiny_resnet()]
    for r, model in enumerate(ranks):
        assert nn.sync_batch_norm(model, comm.rank(r)) == 20
    for s in range(3):
        def work(r):
            out = ranks[r](dp.tensor(x[s][r::2]))  # stride sharding, as the sampler does
            F.cross_entropy(out, dp.tensor(y[s][r::2])).backward()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p0, p1 in zip(ranks[0].parameters(), ranks[1].parameters()):
            mean = (p0.grad.data + p1.grad.data) / 2
            p0.grad.data, p1.grad.data = mean, mean.copy()
        for model in ranks:
            _sgd(model)
    want, got = one.state_dict(), ranks[0].state_dict()
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-10, atol=1e-12, err_msg=name)
    assert int(got["bn1.num_batches_tracked"]) == 3


def test_sync_batch_norm_reaches_every_layer():
    from dptrain.distributed import LocalComm

    model = nn.resnet18((1, 16, 16), 3, widths=(4, 8, 8, 8))
    comm = LocalComm(backend.get("cpu"))
    assert nn.sync_batch_norm(model, comm) == 20
    assert all(m.comm is comm for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_fp16_batch_norm_is_the_fp32_layer_rounded_once():
    """A 16-bit input keeps fp32 statistics, parameters and arithmetic (no float32 island, no
    casts): the output and the input gradient are the fp32 layer's, rounded to float16 once;
    the running estimates and the parameter gradients are the fp32 layer's exactly."""
    rng = np.random.default_rng(5)

    def half_values(shape, scale=1.0, shift=0.0):  # values float16 holds exactly
        v = rng.standard_normal(shape) * scale + shift
        return v.astype(np.float16).astype(np.float32)

    x, gy, w = half_values((6, 4, 5, 3), 2.0, 1.0), half_values((6, 4, 5, 3)), half_values(4)
    out = {}
    for dtype in (np.float16, np.float32):
        layer = nn.BatchNorm2d(4)
        layer.weight.data[...] = w
        leaf = dp.tensor(x, requires_grad=True)
        y = layer(F.cast(leaf, dtype))
        assert y.dtype == dtype and layer.running_mean.dtype == np.float32
        (F.cast(y, np.float32) * dp.tensor(gy)).sum().backward()
        out[dtype] = {"y": y.numpy(), "dx": leaf.grad.numpy(), "gw": layer.weight.grad.numpy(),
                      "gb": layer.bias.grad.numpy(), "running": layer.running_var.numpy()}
    h, f = out[np.float16], out[np.float32]
    assert np.array_equal(h["y"], f["y"].astype(np.float16).astype(np.float32))
    assert np.array_equal(h["dx"], f["dx"].astype(np.float16).astype(np.float32))
    for key in ("gw", "gb", "running"):
        assert np.array_equal(h[key], f[key]), key
