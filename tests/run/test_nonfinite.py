"""The non-finite check: the op on both backends, the skipped update, and the guard's
decisions (stop at the first bad step naming it, or skip up to a budget)."""
import numpy as np
import pytest

from dptrain import backend, nn
from dptrain import distributed as dist
from dptrain.errors import NonFiniteError
from dptrain.distributed.flat import FlatParameters
from dptrain.run.nonfinite import NonFiniteGuard
from dptrain.optim import SGD, SKIP_SLOT, AdamW

cpu = backend.get("cpu")
gpu = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("start", [0.0, 1.0, 3.0, np.nan])
def test_cpu_nonfinite_flag(dtype, bad, start):
    x = np.linspace(-1, 1, 37).astype(dtype)
    if bad is not None:
        x[11] = bad
    flag = np.array([start], dtype)
    cpu.nonfinite_flag_(flag, x)
    assert flag[0] == (1.0 if bad is not None or start != 0 else 0.0)
    cpu.nonfinite_flag_(flag, x[:0])  # empty: only normalises
    assert flag[0] in (0.0, 1.0)


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 31, 1000, 123457])
@pytest.mark.parametrize("start", [0.0, 2.0, np.nan])
def test_cuda_nonfinite_flag_matches_cpu(n, dtype, start):
    import dptrain.backend.cuda as cu

    rng = np.random.default_rng()
    for bad in (None, np.nan, np.inf, -np.inf):
        x = rng.standard_normal(n).astype(dtype)
        if bad is not None:
            x[rng.integers(n)] = bad
        ref = np.array([start], dtype)
        cpu.nonfinite_flag_(ref, x)
        flag = cu.asarray(np.array([start], dtype))
        cu.nonfinite_flag_(flag, cu.asarray(x))
        assert cu.to_numpy(flag)[0] == ref[0], (n, bad, start)
        cu.nonfinite_flag_(flag, cu.zeros((0,), dtype))
        assert cu.to_numpy(flag)[0] == ref[0]


@gpu
def test_cuda_optimizers_skip_when_flagged():
    import dptrain.backend.cuda as cu

    rng = np.random.default_rng()
    n = 4099
    p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    hyper = cu.asarray(np.array([0.1, 0.1, 0.001, 1.0], np.float32))
    dp, buf, m, v = cu.asarray(p), cu.zeros((n,)), cu.zeros((n,)), cu.zeros((n,))
    cu.sgd_step_(dp, cu.asarray(g), buf, hyper, 0.9, 1e-4, False)
    cu.adamw_step_(dp, cu.asarray(g), m, v, hyper, 0.9, 0.999, 1e-8, 0.01)
    assert np.array_equal(cu.to_numpy(dp), p)
    assert not cu.to_numpy(buf).any() and not cu.to_numpy(m).any() and not cu.to_numpy(v).any()


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_cpu_optimizers_skip_when_flagged(cls):
    model = nn.mlp((1, 4, 4), 3, hidden=(5,))
    opt = cls(model.parameters(), lr=0.1)
    before = opt.flat.data.copy()
    opt.flat.grad[...] = 1.0
    opt.hyper[SKIP_SLOT] = 1.0
    opt.step()
    assert np.array_equal(opt.flat.data, before)
    opt.hyper[SKIP_SLOT] = 0.0
    opt.step()
    assert not np.array_equal(opt.flat.data, before)


def _setup(skip_budget):
    model = nn.mlp((1, 4, 4), 3, hidden=(5,))
    opt = AdamW(model.parameters(), lr=0.1)
    return opt, NonFiniteGuard(opt, dist.LocalComm(cpu), skip_budget)


def _step(opt, guard, loss_value, grad_value=1.0):
    opt.begin_step()
    opt.flat.grad[...] = grad_value
    guard(np.array(loss_value, np.float32))
    opt.update()


def test_default_stops_naming_the_first_bad_step_with_weights_kept():
    opt, guard = _setup(0)
    _step(opt, guard, 1.0)
    good = opt.flat.data.copy()
    _step(opt, guard, np.nan)  # step 2: bad
    _step(opt, guard, 1.0)  # step 3: after a bad step nothing more is applied
    assert np.array_equal(opt.flat.data, good)
    with pytest.raises(NonFiniteError, match="at step 2;"):
        guard.read(3)


def test_skip_mode_skips_bad_steps_and_applies_good_ones():
    opt, guard = _setup(2)
    _step(opt, guard, 1.0, grad_value=np.inf)  # bad gradient: skipped
    assert guard.read(1) == 1
    before = opt.flat.data.copy()
    _step(opt, guard, 1.0)  # good: applied
    assert not np.array_equal(opt.flat.data, before)
    assert guard.read(2) == 0
    _step(opt, guard, np.nan)
    _step(opt, guard, np.nan)
    with pytest.raises(NonFiniteError, match="3 steps .* more than --skip-nonfinite 2"):
        guard.read(4)


def test_optimizer_state_reshards_onto_another_world_size():
    """gather_state (world of one) -> scatter_state into each rank's shard of a 3-rank layout:
    every shard holds exactly its slice of the parameters' state."""
    model = nn.mlp((1, 4, 4), 3, hidden=(5,))
    opt = AdamW(model.parameters(), lr=0.1)
    opt.m[...] = np.arange(opt.m.size, dtype=np.float32)
    named = list(model.named_parameters())
    state = opt.gather_state(dist.LocalComm(cpu), named)
    for name, p in named:
        start = opt.flat.offsets[id(p)]
        assert np.array_equal(state["exp_avg"][name].reshape(-1), opt.m[start:start + p.size])
    model3 = nn.mlp((1, 4, 4), 3, hidden=(5,))
    flat3 = FlatParameters(model3.parameters(), world_size=3, bucket_bytes=256)
    named3 = list(model3.named_parameters())
    full = np.zeros(flat3.numel, np.float32)
    for rank in range(3):
        opt3 = AdamW(flat3, lr=0.1, segments=flat3.shard_segments(rank))
        opt3.scatter_state(state, named3)
        offset = 0
        for start, stop in opt3.segments:
            full[start:stop] = opt3.m[offset:offset + stop - start]
            offset += stop - start
    for name, p in named3:
        start = flat3.offsets[id(p)]
        assert np.array_equal(full[start:start + p.size], state["exp_avg"][name].reshape(-1))
