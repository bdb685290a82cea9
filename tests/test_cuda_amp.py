"""float16 on the GPU (--precision fp16): every kernel the 16-bit step runs, against the CPU
backend's float16 reference (fp32 arithmetic on the same 16-bit inputs, rounded once), the
captured fp16 step replaying bit for bit like the eager one, fp16 training following fp32,
and an overflow on one of two GPUs skipping the step on both.

Tolerance: a 16-bit result is an fp32 sum rounded once to float16 (a relative step of 2^-11 =
4.9e-4), so ours and the reference's may round a value that sits near a rounding boundary to
neighbouring float16 values; summation order differs too. Results are compared norm-wise:
|ours - ref| / |ref| <= 2e-3, about four float16 steps."""
import json
import subprocess
import sys

import numpy as np
import pytest

from dptrain import backend
from replay import train_steps

pytestmark = pytest.mark.gpu
H = np.float16
TOL = 2e-3


@pytest.fixture(scope="module")
def cu():
    return backend.get("cuda")


cpu = backend.get("cpu")


def close(got, ref, tol=TOL):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= tol, f"relative error {err:.2e} > {tol}"


def rand(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(H)


def both(cu, name, *args, **kw):
    """(cuda result, cpu result) of op `name` on the same host arrays (float16 ones moved)."""
    dev = [cu.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    got = getattr(cu, name)(*dev, **kw)
    ref = getattr(cpu, name)(*args, **kw)
    if isinstance(got, tuple):
        return tuple(cu.to_numpy(g) for g in got), ref
    return cu.to_numpy(got), ref


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", [((37, 53), (37, 53)), ((4, 6, 5, 7), (1, 6, 1, 1))])
def test_binary_ops(cu, name, shapes):
    a, b = rand(*shapes[0], seed=1), rand(*shapes[1], seed=2) + H(3)
    got, ref = both(cu, name, a, b)
    assert got.dtype == H
    close(got, ref)


@pytest.mark.parametrize("name", ["relu", "neg", "exp", "tanh", "sigmoid"])
def test_unary_ops(cu, name):
    got, ref = both(cu, name, rand(3, 1000, seed=3))
    assert got.dtype == H
    close(got, ref)


def test_relu_backward_scale_bias_add_and_astype(cu):
    y, gy = rand(17, 300, seed=4), rand(17, 300, seed=5)
    close(*both(cu, "relu_backward", cpu.relu(y), gy))
    close(*both(cu, "scale", y, 0.3))
    close(*both(cu, "bias_add", rand(5, 7, 3, 3, seed=6), rand(7, seed=7)))
    x = np.random.default_rng(8).standard_normal((33, 65)).astype(np.float32) * 100
    half, ref = both(cu, "astype", x, H)
    assert np.array_equal(half, ref)  # conversion is exact rounding on both
    back, ref = both(cu, "astype", ref, np.float32)
    assert np.array_equal(back, ref)


@pytest.mark.parametrize("axis", [None, 0, 1, (0, 2)])
def test_sum_and_max(cu, axis):
    a = rand(40, 30, 9, seed=9)
    close(*both(cu, "sum", a, axis=axis), tol=5e-3)
    got, ref = both(cu, "max", a, axis=axis)
    assert np.array_equal(got, ref)  # max picks an element: exact


@pytest.mark.parametrize("shape", [(64, 10), (32, 16, 14, 14), (3, 5, 1, 1)])
def test_bias_grad(cu, shape):
    close(*both(cu, "bias_grad", rand(*shape, seed=10)), tol=5e-3)


@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("m, n, k", [(64, 256, 6272), (37, 50, 61), (256, 10, 256)])
def test_matmul_f16(cu, ta, tb, m, n, k):
    a = rand(*((k, m) if ta else (m, k)), seed=11)
    b = rand(*((n, k) if tb else (k, n)), seed=12)
    got, ref = both(cu, "matmul", a, b, ta, tb)
    assert got.dtype == H
    close(got, ref)


CONVS = [  # x shape, w shape, stride, padding
    ((8, 1, 28, 28), (32, 1, 3, 3), (1, 1), (1, 1)),  # the first layer: direct kernels
    ((8, 32, 14, 14), (64, 32, 3, 3), (1, 1), (1, 1)),  # implicit GEMM, C % 32 == 0
    ((4, 64, 7, 7), (128, 64, 3, 3), (1, 1), (1, 1)),
    ((3, 5, 11, 9), (7, 5, 3, 2), (2, 1), (1, 0)),  # odd everything: the general gathers
    ((2, 40, 9, 9), (33, 40, 1, 1), (1, 1), (0, 0)),
]


@pytest.mark.parametrize("xs, ws, stride, pad", CONVS)
def test_conv2d_f16_all_passes(cu, xs, ws, stride, pad):
    x, w, b = rand(*xs, seed=13), rand(*ws, seed=14, scale=0.2), rand(ws[0], seed=15)
    y, ref = both(cu, "conv2d_forward", x, w, b, stride, pad)
    assert y.dtype == H
    close(y, ref)
    gy = rand(*ref.shape, seed=16)
    close(*both(cu, "conv2d_backward_data", gy, w, xs, stride, pad))
    close(*both(cu, "conv2d_backward_weight", x, gy, ws, stride, pad), tol=4e-3)


def test_pooling_f16(cu):
    x = rand(4, 6, 12, 10, seed=17)
    (y, idx), (ry, ridx) = both(cu, "relu_max_pool2d_forward", x, (2, 2), (2, 2), (0, 0))
    assert np.array_equal(y, ry) and np.array_equal(idx, ridx)
    (y, idx), (ry, ridx) = both(cu, "max_pool2d_forward", x, (3, 3), (2, 2), (1, 1))
    assert np.array_equal(y, ry) and np.array_equal(idx, ridx)
    gy = rand(*y.shape, seed=18)
    got, ref = both(cu, "max_pool2d_backward", gy, ridx, x.shape)
    close(got, ref)
    close(*both(cu, "avg_pool2d_forward", x, (2, 2), (2, 2), (0, 0)))


def test_loss_scale_ops_match_cpu(cu):
    g = rand(1000, seed=19).astype(np.float32) * 1024
    scale = np.array([512.0], np.float32)
    got, ref = both(cu, "unscale_", g.copy(), scale)
    assert np.array_equal(got, ref)
    for flag in (0.0, 1.0):
        state = np.array([64.0, 2.0, 0.0], np.float32)
        got, ref = both(cu, "loss_scale_update_", state.copy(), np.array([flag], np.float32), 3)
        assert np.array_equal(got, ref), flag


def test_fp16_step_replays_bitwise_like_eager():
    from dptrain import nn

    build = lambda: nn.cnn((1, 16, 16), 5, widths=(8, 16), hidden=32)  # noqa: E731
    _, eager = train_steps("cuda", build, (1, 16, 16), 5, False, 20, 3, precision="fp16")
    _, graph = train_steps("cuda", build, (1, 16, 16), 5, True, 20, 3, precision="fp16")
    for step, (a, b) in enumerate(zip(eager, graph)):
        assert np.array_equal(a, b), f"weights differ after step {step + 1}"


def test_fp16_training_follows_fp32_on_the_gpu():
    """30 SGD steps from the same start: fp16 ends as close to the fp32 run as TF32 does (both
    keep 10 mantissa bits; fp16 rounds every activation and gradient, TF32 only the matrix
    operands), measured against the fp32 run's total update."""
    from dptrain import nn
    from dptrain.optim import SGD

    be = backend.get("cuda")
    build = lambda: nn.cnn((1, 16, 16), 5, widths=(8, 16), hidden=32)  # noqa: E731
    sgd = lambda flat: SGD(flat, lr=0.05, momentum=0.9)  # noqa: E731
    runs = {}
    for precision in ("fp32", "tf32", "fp16"):
        with be.runtime.precision_scope("fp32" if precision == "fp32" else "tf32"):
            runs[precision] = train_steps("cuda", build, (1, 16, 16), 5, True, 30, 5,
                                          optimizer=sgd, precision=precision)[1]
    ref = runs["fp32"]
    drift = {p: float(np.linalg.norm(runs[p][-1] - ref[-1]) / np.linalg.norm(ref[-1] - ref[0]))
             for p in ("tf32", "fp16")}
    assert drift["fp16"] <= 2 * drift["tf32"] + 0.02, drift


TRAIN = [sys.executable, "-m", "dptrain", "train", "--device", "cuda", "--model", "cnn",
         "--train-images", "20000", "--val-images", "4000", "--epochs", "3", "--batch-size",
         "128", "--seed", "5", "--no-progress"]


def _train(args, tmp, name, **env):
    import os
    from pathlib import Path

    logs = tmp / name
    full = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent),
                DPTRAIN_CACHE=str(tmp / "cache"), NCCL_NVLS_ENABLE="0", **env)
    out = subprocess.run(args + ["--log-dir", str(logs)], capture_output=True, text=True,
                         env=full, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((logs / "summary.json").read_text())


def test_fp16_reaches_the_tf32_runs_validation_accuracy(tmp_path):
    acc = {p: _train(TRAIN + ["--precision", p], tmp_path, p)["val_accuracy"]
           for p in ("tf32", "fp16")}
    assert acc["fp16"] >= acc["tf32"] - 0.01, acc


def _gpus():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _records(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_overflow_on_one_of_two_gpus_skips_that_step_on_both(tmp_path):
    """DPTRAIN_OVERFLOW=1:3 overflows rank 1's fp16 gradients at step 3 (its loss scale raised
    2^40-fold for that step): both GPUs skip step 3 and halve their scale (the flag is
    all-reduced over NCCL inside the captured step), so the weights after 3 steps are those
    after 2 and the replicas stay identical."""
    from mpilaunch import LAUNCHER, mpi_command, mpi_env

    if LAUNCHER is None:
        pytest.skip("needs an MPI launcher")
    base = [sys.executable, "-m", "dptrain", "train", "--device", "cuda", "--model", "cnn",
            "--train-images", "960", "--val-images", "100", "--epochs", "1",
            "--global-batch-size", "64", "--precision", "fp16", "--log-every", "1", "--optimizer",
            "sgd", "--lr", "0.05", "--lr-schedule", "constant", "--warmup-steps", "0",
            "--verify-replicas", "--seed", "3", "--no-progress"]

    def run(extra, **env):
        import os
        from pathlib import Path

        full = mpi_env(dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent),
                            DPTRAIN_CACHE=str(tmp_path / "cache"), NCCL_NVLS_ENABLE="0", **env),
                       device="cuda")
        out = subprocess.run(mpi_command(2, base + extra, device="cuda"), capture_output=True,
                             text=True, env=full, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]

    run(["--max-steps", "3", "--log-dir", str(tmp_path / "hit"), "--save",
         str(tmp_path / "hit.npz")], DPTRAIN_OVERFLOW="1:3")
    recs = _records(tmp_path / "hit")
    assert [r["overflow_steps"] for r in recs] == [0, 0, 1]
    assert recs[0]["loss_scale"] == 65536.0 and recs[2]["loss_scale"] == 32768.0
    run(["--max-steps", "2", "--save", str(tmp_path / "two.npz")])
    with np.load(tmp_path / "hit.npz") as hit, np.load(tmp_path / "two.npz") as two:
        for name in (n for n in two.files if n != "__meta__"):
            assert np.array_equal(hit[name], two[name]), name
