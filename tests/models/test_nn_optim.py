"""Modules, flat buffers, optimizers (against PyTorch's update rules written out) and schedules."""
import math

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import nn
from dptrain.distributed.flat import ALIGN, FlatParameters
from dptrain.optim import SGD, AdamW, LRSchedule


def test_cnn_names_shapes_and_count():
    model = nn.cnn((1, 48, 48), 7)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert shapes == {
        "0.weight": (32, 1, 3, 3), "0.bias": (32,), "3.weight": (64, 32, 3, 3), "3.bias": (64,),
        "6.weight": (128, 64, 3, 3), "6.bias": (128,), "10.weight": (256, 4608),
        "10.bias": (256,), "12.weight": (7, 256), "12.bias": (7,),
    }
    x = dp.tensor(np.random.default_rng(0).standard_normal((2, 1, 48, 48)))
    assert model(x).shape == (2, 7)


def test_default_init_bounds_follow_pytorch():
    dp.manual_seed(0)
    layer = nn.Conv2d(4, 8, 3)
    bound = 1 / math.sqrt(4 * 9)
    w = layer.weight.numpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.8 * bound


def test_manual_seed_makes_init_repeat():
    dp.manual_seed(3)
    a = nn.mlp((1, 4, 4), 3).state_dict()
    dp.manual_seed(3)
    b = nn.mlp((1, 4, 4), 3).state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_state_dict_round_trip_and_errors():
    model, other = nn.cnn((1, 16, 16), 3), nn.cnn((1, 16, 16), 3)
    other.load_state_dict(model.state_dict())
    assert all(np.array_equal(a, b) for a, b in zip(model.state_dict().values(),
                                                    other.state_dict().values()))
    state = model.state_dict()
    state["0.weight"] = np.zeros((1, 1, 1, 1))
    with pytest.raises(ValueError, match=r"0\.weight has shape"):
        other.load_state_dict(state)
    del state["0.weight"]
    with pytest.raises(ValueError, match=r"missing 0\.weight"):
        other.load_state_dict(state)


def test_train_eval_mode_controls_dropout():
    model = nn.Sequential(nn.Dropout(0.5))
    x = dp.tensor(np.ones((100, 10)))
    assert (model(x).numpy() == 0).any()
    model.eval()
    assert (model(x).numpy() == 1).all()


def test_flat_parameters_are_views_and_aligned():
    model = nn.mlp((1, 3, 3), 2, hidden=(5,))
    params = model.parameters()
    flat = FlatParameters(params, world_size=3)
    assert flat.numel % (3 * ALIGN) == 0
    params[0].data[0, 0] = 42.0
    assert 42.0 in flat.data
    flat.grad[:] = 1.0
    assert (params[1].grad.numpy() == 1.0).all()
    flat.zero_grad()
    assert (params[1].grad.numpy() == 0.0).all()
    assert flat.shard_segments(2) == [(2 * flat.numel // 3, flat.numel)]


def test_buckets_are_reverse_ordered_and_divisible():
    model = nn.cnn((1, 16, 16), 3)
    flat = FlatParameters(model.parameters(), world_size=3, bucket_bytes=40_000)
    assert len(flat.buckets) > 2
    assert flat.buckets[0].params[0] is model.parameters()[-1]  # last layer first
    covered = [p for b in flat.buckets for p in b.params]
    assert sorted(map(id, covered)) == sorted(map(id, model.parameters()))
    for b in flat.buckets:
        assert (b.stop - b.start) % (3 * ALIGN) == 0
        for p in b.params:
            assert b.start <= flat.offsets[id(p)] and flat.offsets[id(p)] + p.size <= b.stop


def _quadratic_problem(dtype=np.float64):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((4, 3)).astype(dtype)
    target = rng.standard_normal((4, 3)).astype(dtype)
    return w0, target


def _run(opt_factory, steps=5):
    w0, target = _quadratic_problem()
    p = nn.Parameter(w0.copy())
    opt = opt_factory([p])
    for _ in range(steps):
        opt.zero_grad()
        ((p - dp.tensor(target)) ** 2).sum().backward()
        opt.step()
    return p.numpy(), w0, target


@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.9, False, 0.01),
                                                  (0.9, True, 0.001)])
def test_sgd_matches_pytorch_rule(momentum, nesterov, wd):
    lr = 0.05
    got, w, target = _run(lambda ps: SGD(ps, lr, momentum, wd, nesterov))
    buf = np.zeros_like(w)
    for t in range(5):
        g = 2 * (w - target) + wd * w
        if momentum:
            buf = momentum * buf + g if t else g
            g = g + momentum * buf if nesterov else buf
        w = w - lr * g
    np.testing.assert_allclose(got, w, rtol=1e-12)


def test_adamw_matches_pytorch_rule():
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.1
    got, w, target = _run(lambda ps: AdamW(ps, lr, (b1, b2), eps, wd))
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t in range(1, 6):
        g = 2 * (w - target)
        w = w * (1 - lr * wd)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    np.testing.assert_allclose(got, w, rtol=1e-10)


def test_optimizer_shard_updates_only_its_range():
    p = nn.Parameter(np.ones(300))
    flat = FlatParameters([p], world_size=2)
    half = flat.numel // 2
    opt = SGD(flat, lr=0.5, segments=flat.shard_segments(0))
    flat.grad[:] = 1.0
    opt.step()
    assert (p.numpy()[:half] == 0.5).all() and (p.numpy()[half:] == 1.0).all()


def test_optimizer_state_dict_round_trip():
    p = nn.Parameter(np.ones(10))
    opt = SGD([p], lr=0.1, momentum=0.9)
    p.grad.data[:] = 1.0
    opt.step()
    state = opt.state_dict()
    q = nn.Parameter(np.ones(10))
    opt2 = SGD([q], lr=0.3, momentum=0.9)
    opt2.load_state_dict(state)
    assert opt2.steps == 1 and opt2.lr == 0.1
    np.testing.assert_array_equal(opt2.buf, opt.buf)


def test_lr_schedules():
    cos = LRSchedule(1.0, "cosine", total_steps=110, warmup_steps=10)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.5) and cos(110) == pytest.approx(0.0, abs=1e-12)
    step = LRSchedule(1.0, "step", total_steps=30, step_size=10, gamma=0.5)
    assert [step(0), step(10), step(25)] == [1.0, 0.5, 0.25]
    assert LRSchedule(0.3, "constant", 10)(7) == 0.3
    with pytest.raises(ValueError, match="unknown schedule"):
        LRSchedule(1.0, "linear")


def test_cnn_learns_a_tiny_problem():
    """Loss must fall on a separable toy task (a fast sanity check of the whole stack)."""
    dp.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1, 8, 8)).astype(np.float32)
    y = (x[:, 0, :4].mean(axis=(1, 2)) > x[:, 0, 4:].mean(axis=(1, 2))).astype(np.int64)
    model = nn.cnn((1, 8, 8), 2, widths=(8, 16, 16), hidden=32)
    opt = AdamW(model.parameters(), lr=0.01)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = F.cross_entropy(model(dp.tensor(x)), dp.tensor(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]
