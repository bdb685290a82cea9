"""dptrain.DataParallel with a model and a loop of the test's own (tests/helpers/
parallel_driver.py): 2 ranks equal 1 rank at the same global batch after 20 steps, with and
without capture; bad input ends with one line naming it."""
import subprocess
import sys

import numpy as np
import pytest

import dptrain as dp
from dptrain import functional as F
from dptrain import nn
from dptrain.errors import UsageError
from mpilaunch import ROOT, env, mpi_command, needs_mpi

DRIVER = str(ROOT / "tests" / "helpers" / "parallel_driver.py")


def _run(tmp_path, ranks, capture, mode="train", name="out.npz"):
    out = tmp_path / name
    cmd = [sys.executable, DRIVER, str(out), "16", "1" if capture else "0", mode]
    result = subprocess.run(mpi_command(ranks, cmd) if ranks > 1 else cmd, capture_output=True,
                            text=True, env=env(tmp_path / "cache"), timeout=180)
    return result, out


@needs_mpi
@pytest.mark.parametrize("capture", [True, False])
def test_two_ranks_equal_one_rank_at_the_same_global_batch(tmp_path, capture):
    one, one_out = _run(tmp_path, 1, capture, name="one.npz")
    two, two_out = _run(tmp_path, 2, capture, name="two.npz")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a, b = np.load(one_out), np.load(two_out)
    assert len(a["losses"]) == 20
    assert a["losses"][-4:].mean() < a["losses"][:4].mean()  # it learns
    for name in a.files:
        np.testing.assert_allclose(b[name], a[name], rtol=2e-5, atol=2e-6, err_msg=name)


@needs_mpi
def test_parameters_that_differ_between_ranks_are_named(tmp_path):
    result, _ = _run(tmp_path, 2, True, mode="differ")
    assert result.returncode != 0
    lines = [ln for ln in result.stderr.splitlines() if "parallel_driver.py: error:" in ln]
    assert lines and "parameters differ between ranks at the start: conv.weight" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("mode,message", [
    ("noloss", "the step function must return the loss as a Tensor (or (loss, metrics)), "
               "got NoneType"),
    ("badshape", "step: batch[0] has shape (15, 1, 6, 6) float32, the compiled step "
                 "(16, 1, 6, 6) float32"),
])
def test_bad_input_ends_with_one_line_naming_it(tmp_path, mode, message):
    result, _ = _run(tmp_path, 1, True, mode=mode)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_captured_and_eager_steps_agree_bitwise_on_one_process():
    def train(capture):
        dp.manual_seed(3)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
        ddp = dp.DataParallel(model, "sgd", lr=0.05, momentum=0.9, precision="fp32")
        step = ddp.compile(lambda b: F.mse_loss(ddp(b[0]), b[1]), capture=capture)
        rng = np.random.default_rng(0)
        for _ in range(6):
            x = rng.standard_normal((8, 5)).astype(np.float32)
            step((x, x[:, :1] * 2.0))
        return ddp.state_dict(), step.metrics()["loss"]

    (wa, la), (wb, lb) = train(True), train(False)
    assert la == lb
    for name in wa:
        assert np.array_equal(wa[name], wb[name]), name


def test_frozen_parameters_stay_put_and_are_not_exchanged():
    dp.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    for p in model[0].parameters():
        p.requires_grad = False
    before = model.state_dict()
    ddp = dp.DataParallel(model, "adamw", lr=1e-2)
    assert ddp.flat.params == model[2].parameters()
    step = ddp.compile(lambda b: F.mse_loss(ddp(b[0]), b[1]))
    x = np.ones((4, 4), np.float32)
    for _ in range(3):
        step((x, np.zeros((4, 2), np.float32)))
    after = ddp.state_dict()
    assert np.array_equal(after["0.weight"], before["0.weight"])
    assert not np.array_equal(after["2.weight"], before["2.weight"])


def test_metrics_and_their_errors():
    dp.manual_seed(2)
    ddp = dp.DataParallel(nn.Sequential(nn.Linear(3, 1)), "sgd", lr=0.1)
    step = ddp.compile(lambda b: (F.mse_loss(ddp(b), b[:, :1]), {"twice": dp.tensor(2.0)}))
    for _ in range(3):
        step(np.ones((2, 3), np.float32))
    read = step.metrics()
    assert read["twice"] == 2.0 and np.isfinite(read["loss"])
    with pytest.raises(UsageError, match="optimizer 'lamb'"):
        dp.DataParallel(nn.Linear(2, 2), "lamb", lr=0.1)
    bad = dp.DataParallel(nn.Sequential(nn.Linear(3, 1)), "sgd", lr=0.1).compile(
        lambda b: dp.tensor(1.0))
    with pytest.raises(UsageError, match="does not require grad"):
        bad(np.ones((2, 3), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_captured_and_eager_steps_agree_bitwise_on_a_gpu(precision):
    """The user's step replayed from a CUDA graph trains to the same bits as run op by op."""
    from dptrain import backend
    from dptrain import distributed as dist

    be = backend.get("cuda")

    def train(capture):
        dp.manual_seed(5)
        model = nn.cnn((1, 16, 16), num_classes=3, widths=(16, 32, 32), hidden=32)
        ddp = dp.DataParallel(model, "adamw", world=dist.init(be), precision=precision,
                              lr=1e-3)
        step = ddp.compile(lambda b: F.cross_entropy(ddp(b[0]), b[1]), capture=capture)
        rng = np.random.default_rng(0)
        for _ in range(6):
            step((rng.standard_normal((8, 1, 16, 16)).astype(np.float32),
                  rng.integers(0, 3, 8)))
        return ddp.state_dict(), step.metrics()["loss"]

    (wa, la), (wb, lb) = train(True), train(False)
    assert la == lb
    for name in wa:
        assert np.array_equal(wa[name], wb[name]), name
