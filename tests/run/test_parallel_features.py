"""What DDP users reach for next, on dptrain.DataParallel: gradient accumulation and clipping
inside the captured step, schedules as objects, parameter groups, BatchNorm1d, the accuracy
helpers; the watchdog and the agreed stop protecting dptrain.launch scripts; bad arguments as
one line. tests/helpers/features_driver.py is the user's loop for the runs under mpirun."""
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dptrain as dp
from dptrain import functional as F
from dptrain import nn
from dptrain.errors import UsageError
from dptrain.optim import no_decay_groups, schedules
from gradcheck import gradcheck
from mpilaunch import LAUNCHER, ROOT, env, mpi_command, needs_mpi

DRIVER = str(ROOT / "tests" / "helpers" / "features_driver.py")


def _run(tmp_path, ranks, *args, name="out"):
    out = tmp_path / f"{name}-{ranks}.npz"
    cmd = [sys.executable, DRIVER, str(out), *map(str, args)]
    result = subprocess.run(mpi_command(ranks, cmd) if ranks > 1 else cmd, capture_output=True,
                            text=True, env=env(tmp_path / "cache"), timeout=180)
    return result, out


def _trained(tmp_path, ranks, accumulate, clip):
    result, out = _run(tmp_path, ranks, "train", accumulate, clip, name=f"a{accumulate}c{clip}")
    assert result.returncode == 0, result.stderr
    return dict(np.load(out))


def _close(a, b, skip=("sent",)):
    for name in a:
        if name not in skip:
            np.testing.assert_allclose(b[name], a[name], rtol=2e-5, atol=2e-6, err_msg=name)


# ----------------------------------------------------------------------------- accumulation


@needs_mpi
def test_accumulation_equals_one_step_on_the_whole_batch_at_one_and_two_ranks(tmp_path):
    """2 micro-batches of 8 (1 rank) or 4 (2 ranks) per step equal one step of 16, with a
    schedule and parameter groups on; the exchange is held until the last micro-batch: as
    many reduce-scatters a step as without accumulation."""
    whole = _trained(tmp_path, 1, 1, 0)
    assert whole["losses"][-2:].mean() < whole["losses"][:2].mean()
    for ranks in (1, 2):
        split = _trained(tmp_path, ranks, 2, 0)
        _close(whole, split)
        if ranks == 2:
            assert split["sent"].tolist() == [2] * 8  # two buckets, sent once a step


def test_accumulation_needs_rows_that_split_evenly():
    ddp = dp.DataParallel(nn.Sequential(nn.Linear(3, 1)), "sgd", lr=0.1)
    step = ddp.compile(lambda b: F.mse_loss(ddp(b), b[:, :1]), accumulate=4)
    with pytest.raises(UsageError, match="has 6 rows, which accumulate=4 cannot split"):
        step(np.ones((6, 3), np.float32))
    with pytest.raises(UsageError, match="accumulate=0"):
        ddp.compile(lambda b: None, accumulate=0)


# ----------------------------------------------------------------------------- clipping


@needs_mpi
def test_clipping_by_global_norm_at_two_ranks_equals_one_process(tmp_path):
    """Each rank's shard norm alone would clip otherwise: the norms and weights agree, and
    the clip (0.3, below every step's norm) changed the run."""
    one, two = _trained(tmp_path, 1, 1, 0.3), _trained(tmp_path, 2, 1, 0.3)
    _close(one, two)
    assert (one["norms"] > 0.3).all()
    free = _trained(tmp_path, 1, 1, 0)
    assert not np.allclose(free["0.weight"], one["0.weight"], atol=1e-4)


@pytest.mark.parametrize("capture", [True, False])
def test_clipping_equals_clipping_the_full_gradient(capture):
    """SGD without momentum: w - lr * g * min(1, c / |g|), g the whole model's gradient."""
    def model():
        dp.manual_seed(4)
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))

    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((8, 5)).astype(np.float32),
                rng.standard_normal((8, 2)).astype(np.float32)) for _ in range(3)]
    ref = model()
    for x, y in batches:
        for p in ref.parameters():
            p.grad = None
        F.mse_loss(ref(dp.tensor(x)), dp.tensor(y)).backward()
        grads = [p.grad.numpy().astype(np.float64) for p in ref.parameters()]
        norm = math.sqrt(sum((g * g).sum() for g in grads))
        for p, g in zip(ref.parameters(), grads):
            p.data -= np.float32(0.1) * (g * min(1.0, 0.05 / norm)).astype(np.float32)
    ddp = dp.DataParallel(model(), "sgd", lr=0.1, precision="fp32")
    step = ddp.compile(lambda b: F.mse_loss(ddp(b[0]), b[1]), clip_grad_norm=0.05,
                       capture=capture)
    for batch in batches:
        step(batch)
    assert step.metrics()["grad_norm"] > 0.05
    for name, value in ddp.state_dict().items():
        np.testing.assert_allclose(value, ref.state_dict()[name], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- schedules, groups


def test_a_schedule_sets_each_steps_rate_in_the_captured_step():
    """The rate reaches the replayed step (same weights as eager) and follows the schedule."""
    lr = schedules.WarmupCosine(0.1, total_steps=6, warmup_steps=2, min_lr=0.01)
    runs = []
    for capture in (True, False):
        dp.manual_seed(3)
        ddp = dp.DataParallel(nn.Sequential(nn.Linear(4, 1)), "sgd", lr=lr, precision="fp32")
        step = ddp.compile(lambda b: F.mse_loss(ddp(b), b[:, :1] * 2), capture=capture)
        rates = []
        for i in range(6):
            step(np.full((4, 4), 0.5 + i, np.float32))
            rates.append(ddp.lr)
        runs.append(ddp.state_dict())
    assert rates == pytest.approx([lr(i) for i in range(6)])
    assert rates[1] == pytest.approx(0.1) and rates[-1] < rates[2]
    for name in runs[0]:
        assert np.array_equal(runs[0][name], runs[1][name]), name
    assert [schedules.StepDecay(1.0, 2, 0.5)(i) for i in range(5)] == [1, 1, .5, .5, .25]
    assert schedules.Constant(0.3)(100) == 0.3


def test_parameter_groups_leave_biases_and_norms_without_weight_decay():
    """One step: 2-D weights as SGD with weight decay, biases and norm weights as without."""
    def run(wd, groups):
        dp.manual_seed(6)
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
        ddp = dp.DataParallel(model, "sgd", lr=0.5, weight_decay=wd, precision="fp32",
                              param_groups=no_decay_groups(model) if groups else None)
        step = ddp.compile(lambda b: F.mse_loss(ddp(b), b[:, :2]))
        step(np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4))
        return ddp.state_dict(), len(ddp.optimizer.runs)

    (decayed, _), (plain, _), (grouped, runs) = run(0.2, False), run(0.0, False), run(0.2, True)
    assert runs > 1
    for name, value in grouped.items():
        if name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            continue
        expect = decayed if value.ndim > 1 else plain
        np.testing.assert_allclose(value, expect[name], rtol=1e-6, atol=1e-7, err_msg=name)
    # the norm's weight (ones) is where weight decay would have shown in one step
    assert not np.allclose(grouped["1.weight"], decayed["1.weight"], atol=1e-3)
    with pytest.raises(UsageError, match="cannot be set per group"):
        dp.DataParallel(nn.Linear(2, 2), "sgd", lr=0.1,
                        param_groups=[{"params": ["bias"], "momentum": 0.5}])


# ----------------------------------------------------------------------------- layers, metrics


@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 2)])
def test_batch_norm_1d_gradients_in_float64(shape):
    bn = nn.BatchNorm1d(3)
    rng = np.random.default_rng(0)

    def fn(x, w, b):
        bn.weight, bn.bias = w, b
        return bn(x)

    gradcheck(fn, rng.standard_normal(shape), rng.standard_normal(3) + 1,
              rng.standard_normal(3))


def test_batch_norm_1d_is_batch_norm_2d_of_the_view():
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    one, two = nn.BatchNorm1d(4), nn.BatchNorm2d(4)
    y1, y2 = one(dp.tensor(x)).numpy(), two(dp.tensor(x.reshape(6, 4, 1, 1))).numpy()
    assert np.array_equal(y1, y2.reshape(6, 4))
    assert np.array_equal(one.running_var.numpy(), two.running_var.numpy())
    assert set(one.state_dict()) == set(two.state_dict())
    with pytest.raises(ValueError, match="got 5 features"):
        one(dp.tensor(np.ones((2, 5), np.float32)))


def test_accuracy_helpers_need_no_backend():
    logits = dp.tensor(np.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]], np.float32))
    labels = dp.tensor(np.array([0, 1, 1, 1]))
    assert float(F.count_correct(logits, labels).numpy()) == 3.0
    assert float(F.accuracy(logits, labels).numpy()) == 0.75


# ----------------------------------------------------------------------------- bad arguments


def _classifier_step(capture=True):
    dp.manual_seed(0)
    ddp = dp.DataParallel(nn.Sequential(nn.Linear(4, 3)), "sgd", lr=0.1)
    return ddp.compile(lambda b: F.cross_entropy(ddp(b[0]), b[1]), capture=capture)


@pytest.mark.parametrize("build,message", [
    (lambda: dp.DataParallel(nn.Linear(2, 2), "sgd", lr=-1), "got -1"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), "sgd", lr=float("nan")), "got nan"),
    (lambda: dp.DataParallel(nn.Linear(2, 2), "sgd", lr=0.1, betas=(0.9, 0.99)),
     "optimizer 'sgd' takes no betas"),
    (lambda: dp.ArrayDataset(np.ones((4, 2)), np.ones(3)), "same first dimension"),
    (lambda: list(dp.ArrayDataset(np.ones((4, 2))).batches(8)), "larger than the dataset"),
    (lambda: _classifier_step()((np.ones((4, 4)), np.ones(4))), "expects integer labels"),
    (lambda: _classifier_step()((np.ones((4, 4)), np.array([0, 1, -1, 2]))), "label -1 is"),
    (lambda: _classifier_step()((np.ones((4, 4)), np.array([0, 7, 1, 2]))),
     "label 7 is out of range for 3 classes"),
])
def test_bad_arguments_are_usage_errors(build, message):
    with pytest.raises(UsageError, match=message):
        build()


@pytest.mark.parametrize("capture", [True, False])
def test_labels_of_a_later_batch_are_checked_on_the_host(capture):
    step = _classifier_step(capture=capture)
    x = np.ones((4, 4), np.float32)
    step((x, np.array([0, 1, 2, 0])))
    step((x, np.array([2, 1, 0, 0])))
    with pytest.raises(UsageError, match=r"batch\[1\]: label 3 is out of range"):
        step((x, np.array([0, 3, 0, 0])))


def test_metrics_read_twice_are_nan_with_a_reason():
    step = _classifier_step()
    with pytest.warns(UserWarning, match="no step since the last read"):
        assert math.isnan(step.metrics()["loss"])
    step((np.ones((4, 4), np.float32), np.array([0, 1, 2, 0])))
    assert np.isfinite(step.metrics()["loss"])
    with pytest.warns(UserWarning, match="no step since the last read"):
        assert math.isnan(step.metrics()["loss"])


SCRIPT = """import numpy as np, dptrain as dp
from dptrain import nn
def main():
    dp.dist.init(device="cpu")
    dp.DataParallel(nn.Linear(2, 2), "sgd", lr=-1)
dp.launch(main)
"""


def test_a_bad_argument_under_launch_is_one_line_and_exit_2(tmp_path):
    script = tmp_path / "bad_lr.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env(tmp_path / "cache"), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "bad_lr.py: error: optimizer 'sgd': learning rate must be positive and finite, got -1"]


# ----------------------------------------------------------------------------- launch's guards


@needs_mpi
@pytest.mark.parametrize("mode,call", [("metrics0", "step.metrics()"),
                                       ("state0", "state_dict(), the first read")])
def test_a_collective_on_rank_0_alone_ends_the_job_naming_it(tmp_path, mode, call):
    result, _ = _run(tmp_path, 2, mode)
    assert result.returncode == 4, result.stderr
    verdict = [ln for ln in result.stderr.splitlines() if "dptrain: watchdog:" in ln]
    assert verdict and call in verdict[0] and "rank 1" in verdict[0], result.stderr


@needs_mpi
def test_state_dict_on_rank_0_alone_works_once_the_weights_are_current(tmp_path):
    result, _ = _run(tmp_path, 2, "current0")
    assert result.returncode == 0, result.stderr


def _driver_ranks(pid):
    """The pids of the driver's processes below `pid` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1]
                                           .split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        here = frontier.pop()
        children = [c for c, parent in parents.items() if parent == here]
        frontier += children
        found += [c for c in children if _runs_driver(c)]
    return found


def _runs_driver(pid):
    try:
        return DRIVER.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=needs_mpi)])
def test_sigterm_stops_a_launched_loop_after_a_step(tmp_path, ranks):
    """Every rank stops after the same step: exit 143 and one line (signalled as
    tests/distributed/test_signals.py does: MPICH's mpiexec forwards it, Open MPI's ranks
    get it themselves)."""
    if ranks > 1 and LAUNCHER.flavour == "srun":
        pytest.skip("srun's signal handling is Slurm's")
    out = tmp_path / "stepping.txt"
    cmd = [sys.executable, DRIVER, str(out), "sigterm"]
    proc = subprocess.Popen(mpi_command(ranks, cmd) if ranks > 1 else cmd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env(tmp_path / "cache"))
    deadline = time.monotonic() + 60
    while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)
    if ranks == 1 or LAUNCHER.flavour == "mpich":
        proc.send_signal(signal.SIGTERM)
    else:
        pids = _driver_ranks(proc.pid)
        assert len(pids) == ranks, pids
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.count("stopped by SIGTERM after step") == 1, err  # (Open MPI adds a banner)
    assert "MPI_ABORT" not in err and "Traceback" not in err, err
    if ranks == 1:
        assert len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- on a GPU


def _gpu_run(be, capture, accumulate, clip, precision="fp32", groups=False):
    from dptrain import distributed as dist

    dp.manual_seed(5)
    model = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    model[1].train(False)  # micro-batch statistics would differ from the whole batch's
    lr = schedules.WarmupCosine(1e-2, total_steps=6, warmup_steps=2)
    ddp = dp.DataParallel(model, "adamw", world=dist.init(be), precision=precision, lr=lr,
                          param_groups=no_decay_groups(model) if groups else None)

    def loss_fn(batch):
        logits = ddp(batch[0])
        return F.cross_entropy(logits, batch[1]), {"accuracy": F.accuracy(logits, batch[1])}

    step = ddp.compile(loss_fn, capture=capture, accumulate=accumulate, clip_grad_norm=clip)
    rng = np.random.default_rng(0)
    for _ in range(6):
        step((rng.standard_normal((16, 12)).astype(np.float32), rng.integers(0, 3, 16)))
    return ddp.state_dict(), step.metrics()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_accumulation_and_clipping_replay_bitwise_on_a_gpu(precision):
    """Captured (k micro-batches, the clip, the schedule, groups in one graph) equals eager."""
    from dptrain import backend

    be = backend.get("cuda")
    (wa, ma), (wb, mb) = (_gpu_run(be, c, 2, 0.5, precision, True) for c in (True, False))
    assert ma == mb
    for name in wa:
        assert np.array_equal(wa[name], wb[name]), name


@pytest.mark.gpu
def test_accumulation_and_clipping_on_a_gpu_match_the_cpu():
    """The GPU's micro-batches and clip against the NumPy reference (fp32), and accumulation
    against one step of the whole batch on the GPU."""
    from dptrain import backend

    gpu, gpu_metrics = _gpu_run(backend.get("cuda"), True, 2, 0.5, groups=True)
    whole, _ = _gpu_run(backend.get("cuda"), True, 1, 0.5, groups=True)
    cpu, cpu_metrics = _gpu_run(backend.get("cpu"), False, 2, 0.5, groups=True)
    assert gpu_metrics["grad_norm"] == pytest.approx(cpu_metrics["grad_norm"], rel=1e-4)
    for name in gpu:
        np.testing.assert_allclose(gpu[name], whole[name], rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(gpu[name], cpu[name], rtol=2e-4, atol=2e-5, err_msg=name)
