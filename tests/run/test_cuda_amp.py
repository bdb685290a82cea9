"""16-bit floats on the GPU (--precision fp16 / bf16): every kernel the 16-bit step runs,
against the CPU backend in fp32 on the same 16-bit inputs with the result rounded once (what
the kernels compute), the captured 16-bit step replaying bit for bit like the eager one, fp16
training following fp32, both reaching the fp32 run's accuracy, and an fp16 overflow on one
of two GPUs skipping the step on both.

Tolerance: a 16-bit result is an fp32 sum rounded once, a relative step of 2^-11 (float16) or
2^-8 (bfloat16); ours and the reference may round a value near a boundary to neighbouring
16-bit values, and summation orders differ. Results are compared norm-wise against about four
such steps: |ours - ref| / |ref| <= 2e-3 (float16), 1.6e-2 (bfloat16)."""
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from dptrain import backend
from dptrain.backend.bfloat16 import BFLOAT16, from_bfloat16, to_bfloat16
from mpilaunch import gpu_count
from replay import train_steps

pytestmark = pytest.mark.gpu
H = np.dtype(np.float16)
DTYPES = [pytest.param(H, id="fp16"), pytest.param(BFLOAT16, id="bf16")]
TOL = {H: 2e-3, BFLOAT16: 1.6e-2}


@pytest.fixture(scope="module")
def cu():
    return backend.get("cuda")


cpu = backend.get("cpu")


def to16(x, dt):
    return to_bfloat16(x) if dt == BFLOAT16 else np.asarray(x, np.float32).astype(H)


def f32(a, dt):
    return from_bfloat16(a) if dt == BFLOAT16 else np.asarray(a).astype(np.float32)


def close(got, ref, dt, factor=1.0):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= TOL[dt] * factor, f"relative error {err:.2e} > {TOL[dt] * factor:.1e}"


def rand(dt, *shape, seed=0, scale=1.0, shift=0.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale + shift
    return to16(x, dt)


def both(cu, dt, name, *args, **kw):
    """(ours, reference) of op `name` as float32: ours on the device on the 16-bit arrays of
    `args`, the reference on the CPU in float32 on the same values, rounded to `dt` once.
    Non-float results (pooling's indices) come back as they are."""
    dev = [cu.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    host = [f32(a, dt) if isinstance(a, np.ndarray) and a.dtype == dt else a for a in args]

    def mine(r):
        r = cu.to_numpy(r)
        return f32(r, dt) if r.dtype == dt else r

    def rounded(r):
        return f32(to16(r, dt), dt) if r.dtype == np.float32 else r

    got = getattr(cu, name)(*dev, **kw)
    ref = getattr(cpu, name)(*host, **kw)
    if isinstance(got, tuple):
        return tuple(map(mine, got)), tuple(map(rounded, ref))
    assert got.dtype == dt, f"{name} returned {got.dtype}"
    return mine(got), rounded(ref)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", [((37, 53), (37, 53)), ((4, 6, 5, 7), (1, 6, 1, 1))])
def test_binary_ops(cu, dt, name, shapes):
    a, b = rand(dt, *shapes[0], seed=1), rand(dt, *shapes[1], seed=2, shift=3.0)
    close(*both(cu, dt, name, a, b), dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("name", ["relu", "neg", "exp", "tanh", "sigmoid"])
def test_unary_ops(cu, dt, name):
    close(*both(cu, dt, name, rand(dt, 3, 1000, seed=3)), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_relu_backward_scale_bias_add_and_astype(cu, dt):
    y, gy = rand(dt, 17, 300, seed=4), rand(dt, 17, 300, seed=5)
    close(*both(cu, dt, "relu_backward", to16(np.maximum(f32(y, dt), 0), dt), gy), dt)
    close(*both(cu, dt, "scale", y, 0.3), dt)
    close(*both(cu, dt, "bias_add", rand(dt, 5, 7, 3, 3, seed=6), rand(dt, 7, seed=7)), dt)
    x = np.random.default_rng(8).standard_normal((33, 65)).astype(np.float32) * 100
    half = cu.to_numpy(cu.astype(cu.asarray(x), dt))
    assert half.dtype == dt and np.array_equal(half, to16(x, dt))  # round to nearest even
    back = cu.to_numpy(cu.astype(cu.asarray(half), np.float32))
    assert np.array_equal(back, f32(half, dt))  # exact


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 2)])
def test_sum_and_max(cu, dt, axis):
    a = rand(dt, 40, 30, 9, seed=9)
    close(*both(cu, dt, "sum", a, axis=axis), dt, factor=2.5)
    got, ref = both(cu, dt, "max", a, axis=axis)
    assert np.array_equal(got, ref)  # max picks an element: exact


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(64, 10), (32, 16, 14, 14), (3, 5, 1, 1), (9472, 64)])
def test_bias_grad(cu, dt, shape):
    close(*both(cu, dt, "bias_grad", rand(dt, *shape, seed=10)), dt, factor=2.5)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("m, n, k", [(64, 256, 6272), (37, 50, 61), (256, 10, 256),
                                     (200, 300, 96),  # 64-row tiles, partial on both sides
                                     (2048, 2300, 64)])  # 288 tiles of 128 rows
def test_matmul_16bit(cu, dt, ta, tb, m, n, k):
    a = rand(dt, *((k, m) if ta else (m, k)), seed=11)
    b = rand(dt, *((n, k) if tb else (k, n)), seed=12)
    close(*both(cu, dt, "matmul", a, b, ta, tb), dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1408, 3072, 64), (2048, 4352, 320), (2048, 4096, 128)])
def test_matmul_16bit_on_wgmma(cu, dt, m, n, k):
    """a @ b^T with wgmma's shapes (128 x 256 tiles, K in 128-byte rows) on a Hopper GPU: the
    wgmma kernel, bias added in its epilogue; the other three layouts take it too."""
    import cupy

    from dptrain.backend.cuda import gemm

    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("wgmma needs compute capability 9.0")
    a, b, bias = rand(dt, m, k, seed=21), rand(dt, n, k, seed=22), rand(dt, n, seed=23)
    assert gemm.matmul_kernel(cu.asarray(a), cu.asarray(b), False, True) == "gemm_wgmma_kernel"
    close(*both(cu, dt, "matmul", a, b, False, True), dt)
    # the other layouts: MN-major operands transposed to scratch first
    at, bt = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    for x, y, ta, tb in ((a, bt, False, False), (at, bt, True, False), (at, b, True, True)):
        assert gemm.matmul_kernel(cu.asarray(x), cu.asarray(y), ta, tb) == "gemm_wgmma_kernel"
        close(*both(cu, dt, "matmul", x, y, ta, tb), dt)
    got = cu.matmul(cu.asarray(a), cu.asarray(b), False, True, bias=cu.asarray(bias))
    ref = cpu.bias_add(cpu.matmul(f32(a, dt), f32(b, dt), False, True), f32(bias, dt))
    close(f32(cu.to_numpy(got), dt), f32(to16(ref, dt), dt), dt)


CONVS = [  # x shape, w shape, stride, padding
    ((8, 1, 28, 28), (32, 1, 3, 3), (1, 1), (1, 1)),  # the first layer: direct kernels
    ((8, 32, 14, 14), (64, 32, 3, 3), (1, 1), (1, 1)),  # implicit GEMM, C % 32 == 0
    ((4, 64, 7, 7), (128, 64, 3, 3), (1, 1), (1, 1)),
    ((3, 5, 11, 9), (7, 5, 3, 2), (2, 1), (1, 0)),  # odd everything: the general gathers
    ((2, 40, 9, 9), (33, 40, 1, 1), (1, 1), (0, 0)),
    ((2, 8, 10, 10), (130, 8, 3, 3), (1, 1), (1, 1)),  # backward-weight: 2 x 128 rows, 96 cols
]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad", CONVS)
def test_conv2d_16bit_all_passes(cu, dt, xs, ws, stride, pad):
    x, w = rand(dt, *xs, seed=13), rand(dt, *ws, seed=14, scale=0.2)
    b = rand(dt, ws[0], seed=15)
    y, ref = both(cu, dt, "conv2d_forward", x, w, b, stride, pad)
    close(y, ref, dt)
    gy = rand(dt, *ref.shape, seed=16)
    close(*both(cu, dt, "conv2d_backward_data", gy, w, xs, stride, pad), dt)
    close(*both(cu, dt, "conv2d_backward_weight", x, gy, ws, stride, pad), dt, factor=2)


@pytest.mark.parametrize("dt", DTYPES)
def test_add_folds_the_cast_of_a_16_bit_gradient(cu, dt):
    """add_(fp32 dst, 16-bit src): one kernel, the bits of astype then add_ (what a mixed-
    precision parameter's gradient accumulation did before)."""
    src = rand(dt, 1000, 37, seed=41)
    dst = np.random.default_rng(42).standard_normal((1000, 37)).astype(np.float32)
    fused, ref = cu.asarray(dst), cu.asarray(dst)
    cu.add_(fused, cu.asarray(src))
    cu.add_(ref, cu.astype(cu.asarray(src), np.float32))
    assert cu.to_numpy(fused).tobytes() == cu.to_numpy(ref).tobytes()
    with pytest.raises(ValueError, match="shape"):
        cu.add_(fused, cu.asarray(rand(dt, 37, seed=43)))


DIRECT_BWDW = [  # x shape, w shape, stride, padding: C_in*KH*KW <= 32, the tensor-core kernel
    ((16, 1, 48, 48), (32, 1, 3, 3), (1, 1), (1, 1)),  # the reference CNN's first layer
    ((3, 3, 9, 7), (20, 3, 3, 3), (1, 1), (1, 1)),  # K = 27 (4 n-tiles), odd rows, 20 channels
    ((2, 2, 11, 10), (40, 2, 2, 2), (2, 1), (0, 1)),  # K = 8, two 32-channel groups, stride
    ((2, 1, 9, 9), (6, 1, 4, 4), (3, 2), (2, 1)),  # K = 16, uneven stride and padding
]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad", DIRECT_BWDW)
def test_direct_backward_weight_16bit(cu, dt, xs, ws, stride, pad):
    from dptrain.backend.cuda import conv

    assert ws[1] * ws[2] * ws[3] <= conv.direct.DIRECT_MAX_K
    x = rand(dt, *xs, seed=31)
    ho = (xs[2] + 2 * pad[0] - ws[2]) // stride[0] + 1
    wo = (xs[3] + 2 * pad[1] - ws[3]) // stride[1] + 1
    gy = rand(dt, xs[0], ws[0], ho, wo, seed=32)
    close(*both(cu, dt, "conv2d_backward_weight", x, gy, ws, stride, pad), dt, factor=2)
    # gy starting 2 bytes past an aligned address: pixel pairs loaded one by one, same sums
    import cupy

    flat = cupy.empty(gy.size + 1, dtype=gy.dtype)
    shifted = flat[1:].reshape(gy.shape)
    shifted[...] = cu.asarray(gy)
    got = cu.to_numpy(cu.conv2d_backward_weight(cu.asarray(x), shifted, ws, stride, pad))
    again = cu.to_numpy(cu.conv2d_backward_weight(cu.asarray(x), cu.asarray(gy), ws, stride, pad))
    assert got.tobytes() == again.tobytes()  # same partial sums in the same order


@pytest.mark.parametrize("dt", DTYPES)
def test_pooling_16bit(cu, dt):
    x = rand(dt, 4, 6, 12, 10, seed=17)
    (y, idx), (ry, ridx) = both(cu, dt, "relu_max_pool2d_forward", x, (2, 2), (2, 2), (0, 0))
    assert np.array_equal(y, ry) and np.array_equal(idx, ridx)
    (y, idx), (ry, ridx) = both(cu, dt, "max_pool2d_forward", x, (3, 3), (2, 2), (1, 1))
    assert np.array_equal(y, ry) and np.array_equal(idx, ridx)
    gy = rand(dt, *y.shape, seed=18)
    close(*both(cu, dt, "max_pool2d_backward", gy, ridx, x.shape), dt)
    (y, idx), _ = both(cu, dt, "relu_max_pool2d_forward", x, (2, 2), (2, 2), (0, 0))
    gy, window = rand(dt, *y.shape, seed=19), ((2, 2), (2, 2), (0, 0))  # tiles: one thread each
    got, ref = both(cu, dt, "max_pool2d_backward", gy, idx, x.shape, window=window)
    assert np.array_equal(got, ref)
    close(*both(cu, dt, "avg_pool2d_forward", x, (2, 2), (2, 2), (0, 0)), dt)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_guard_ops_match_cpu(cu, dtype):
    """unscale_check_ and nonfinite_decide_ bit for bit as the CPU backend's: every flag state
    (0, 1, a sum over ranks, NaN), sticky or not, with and without a loss scale."""
    g = np.random.default_rng(19).standard_normal(1000).astype(dtype) * 1024
    scale = np.array([512.0], np.float32)
    for bad, start in ((None, 0.0), (np.inf, 0.0), (None, 2.0), (np.nan, np.nan)):
        x = g.copy()
        if bad is not None:
            x[123] = bad
        ref_flag, flag = np.array([start], dtype), cu.asarray(np.array([start], dtype))
        got = cu.to_numpy(cu.unscale_check_(cu.asarray(x), cu.asarray(scale), flag))
        ref = cpu.unscale_check_(x.copy(), scale, ref_flag)
        assert np.array_equal(got, ref, equal_nan=True)
        assert cu.to_numpy(flag)[0] == ref_flag[0], (bad, start)
    for f0, f1, prior, sticky, scaled in itertools.product(
            (0.0, 1.0, 2.0, np.nan), (0.0, 1.0, 2.0), (0.0, 1.0), (True, False), (True, False)):
        host = dict(flags=np.array([f0, f1], dtype), decision=np.array([prior], dtype),
                    count=np.array([3.0], dtype), skip=np.array([5.0], dtype),
                    state=np.array([64.0, 2.0, 1.0], np.float32))
        dev = {k: cu.asarray(v) for k, v in host.items()}
        extra = lambda a: (a["state"], a["skip"], 3) if scaled else ()  # noqa: E731
        cpu.nonfinite_decide_(host["flags"], host["decision"], host["count"], sticky,
                              *extra(host))
        cu.nonfinite_decide_(dev["flags"], dev["decision"], dev["count"], sticky, *extra(dev))
        for k in host:  # flags keep their NaN
            assert np.array_equal(cu.to_numpy(dev[k]), host[k], equal_nan=True), (
                k, f0, f1, prior, sticky, scaled)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16bit_step_replays_bitwise_like_eager(precision):
    from dptrain import nn

    build = lambda: nn.cnn((1, 16, 16), 5, widths=(8, 16), hidden=32)  # noqa: E731
    _, eager = train_steps("cuda", build, (1, 16, 16), 5, False, 20, 3, precision=precision)
    _, graph = train_steps("cuda", build, (1, 16, 16), 5, True, 20, 3, precision=precision)
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
    full = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]),
                DPTRAIN_CACHE=str(tmp / "cache"), NCCL_NVLS_ENABLE="0", **env)
    out = subprocess.run(args + ["--log-dir", str(logs)], capture_output=True, text=True,
                         env=full, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((logs / "summary.json").read_text())


def test_16bit_training_reaches_the_fp32_runs_validation_accuracy(tmp_path):
    acc = {p: _train(TRAIN + ["--precision", p], tmp_path, p)["val_accuracy"]
           for p in ("fp32", "bf16", "fp16")}
    assert acc["bf16"] >= acc["fp32"] - 0.01 and acc["fp16"] >= acc["fp32"] - 0.01, acc


def _records(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_overflow_on_one_of_two_gpus_skips_that_step_on_both(tmp_path):
    """DPTRAIN_TEST_OVERFLOW=1:3 overflows rank 1's fp16 gradients at step 3 (its loss scale
    raised 2^40-fold for that step): both GPUs skip step 3 and halve their scale (the flag is
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

        full = mpi_env(dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]),
                            DPTRAIN_CACHE=str(tmp_path / "cache"), NCCL_NVLS_ENABLE="0", **env),
                       device="cuda")
        out = subprocess.run(mpi_command(2, base + extra, device="cuda"), capture_output=True,
                             text=True, env=full, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]

    run(["--max-steps", "3", "--log-dir", str(tmp_path / "hit"), "--save",
         str(tmp_path / "hit.npz")], DPTRAIN_TEST_OVERFLOW="1:3")
    recs = _records(tmp_path / "hit")
    assert [r["overflow_steps"] for r in recs] == [0, 0, 1]
    assert recs[0]["loss_scale"] == 65536.0 and recs[2]["loss_scale"] == 32768.0
    run(["--max-steps", "2", "--save", str(tmp_path / "two.npz")])
    with np.load(tmp_path / "hit.npz") as hit, np.load(tmp_path / "two.npz") as two:
        for name in (n for n in two.files if n != "__meta__"):
            assert np.array_equal(hit[name], two[name]), name


@pytest.mark.parametrize("dt", [H, BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)],
                         ids=["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("n", [1001, 4096])
def test_relu_backward_sum_is_add_then_relu_backward(cu, dt, n):
    """relu_backward_sum(y, a, b): bitwise relu_backward(y, add(a, b)), in every dtype, with
    a partial last group (n = 1001) and an unaligned view (offset by one element)."""
    rng = np.random.default_rng(9)
    host = [rng.standard_normal(n + 1) for _ in range(3)]
    host[0][::3] = 0.0  # y == 0 masks too
    arrays = [cu.asarray(to16(h, dt) if dt in (H, BFLOAT16) else h.astype(dt)) for h in host]
    for view in (slice(0, n), slice(1, n + 1)):
        y, a, b = (arr[view] for arr in arrays)
        joined = cu.to_numpy(cu.relu_backward_sum(y, a, b))
        apart = cu.to_numpy(cu.relu_backward(y, cu.add(a, b)))
        assert joined.dtype == apart.dtype and joined.tobytes() == apart.tobytes()
