"""Training on the GPU: the step allocates nothing new per step, single-GPU training matches
the CPU run, and N GPUs over NCCL match one GPU. Marked `gpu`; the NCCL test needs 2 GPUs."""
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import dptrain as dp
from dptrain import backend, nn
from dptrain import distributed as dist
from dptrain.data import DeviceLoader
from dptrain.distributed.flat import FlatParameters
from dptrain.optim import SGD
from dptrain.distributed.reducer import Reducer
from dptrain.run.step import TrainStep
from mpilaunch import LAUNCHER, gpu_count, mpi_command, mpi_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def test_training_step_memory_is_flat():
    import cupy

    be = backend.get("cuda")
    dp.manual_seed(0)
    model = nn.cnn((1, 48, 48), 7).to("cuda")
    flat = FlatParameters(model.parameters())
    opt = SGD(flat, lr=0.01, momentum=0.9)
    reducer = Reducer(flat, dist.World(comm=dist.LocalComm(be)))
    rng = np.random.default_rng(0)
    data = SimpleNamespace(images=rng.integers(0, 256, (512, 1, 48, 48), dtype=np.uint8),
                           labels=rng.integers(0, 7, 512), mean=0.5, std=0.25, num_classes=7,
                           image_shape=(1, 48, 48))
    loader = DeviceLoader(data, be, 64)
    step = TrainStep(model, opt, reducer, loader)
    pool = cupy.get_default_memory_pool()
    used = []
    for i in range(50):
        opt.begin_step()
        loader.set_batch(rng.integers(0, 512, 64))
        step()
        be.runtime.synchronize()
        gc.collect()  # garbage of earlier tests is not this step's
        used.append(pool.used_bytes())
    assert max(used[10:]) == min(used[10:]), f"pool grew: {used[10]} -> {max(used[10:])}"
    assert np.isfinite(step.read_metrics(reducer.comm)[0])


def _run(cmd, tmp, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(tmp / "cache"),
               NCCL_NVLS_ENABLE="0")
    if LAUNCHER is not None:
        env = mpi_env(env, device="cuda")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


TRAIN = [sys.executable, "-m", "dptrain", "train", "--model", "cnn", "--train-images", "6000",
         "--val-images", "2000", "--epochs", "2", "--batch-size", "64", "--seed", "5",
         "--warmup-steps", "60",
         "--no-progress"]


@pytest.mark.slow
def test_gpu_training_reaches_cpu_accuracy(tmp_path):
    acc = {}
    for device in ("cpu", "cuda"):
        logs = tmp_path / device
        _run(TRAIN + ["--device", device, "--log-dir", str(logs)], tmp_path)
        acc[device] = json.loads((logs / "summary.json").read_text())["val_accuracy"]
    assert acc["cuda"] >= acc["cpu"] - 0.01, acc


@pytest.mark.skipif(gpu_count() < 2 or LAUNCHER is None,
                    reason="needs 2 GPUs and an MPI launcher")
def test_two_gpus_over_nccl_match_one_gpu(tmp_path):
    common = ["--device", "cuda", "--precision", "fp32", "--train-images", "960",
              "--val-images", "100", "--epochs", "1", "--max-steps", "10", "--seed", "3",
              "--no-progress", "--optimizer", "sgd", "--lr", "0.05"]
    base = [sys.executable, "-m", "dptrain", "train", *common]
    _run(base + ["--batch-size", "48", "--save", str(tmp_path / "one.npz")], tmp_path)
    _run(mpi_command(2, [*base, "--global-batch-size", "48", "--verify-replicas", "--save",
                         str(tmp_path / "two.npz")], device="cuda"), tmp_path)
    with np.load(tmp_path / "one.npz") as one, np.load(tmp_path / "two.npz") as two:
        for name in (n for n in one.files if n != "__meta__"):
            rel = np.abs(one[name] - two[name]).max() / (np.abs(one[name]).max() + 1e-12)
            assert rel <= 1e-4, f"{name}: relative difference {rel:.2e}"
