"""Shared test set-up: the `gpu` marker skips where no GPU (or no CuPy) is present.

The tests sit in folders that mirror dptrain's packages (engine, backend, dist, data, run,
cli, models) plus studies (scaling, benchmarks); what several of them share (launchers,
fixtures, reference checks, the scripts MPI tests start) is in helpers/, importable by name.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


def _one_gpu_per_worker():
    """Under pytest-xdist (`-n N`) on a machine of several GPUs, worker k sees GPU k mod G
    only, so the suite spreads over the GPUs (set before CUDA is first touched). Tests of
    several GPUs then skip: run them without -n."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return
    gpus = sum(line.startswith("GPU ") for line in listed.splitlines())
    if gpus > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(worker[2:]) % gpus)


_one_gpu_per_worker()

from dptrain.backend import cuda_available  # noqa: E402

HAVE_GPU = cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cuda():
    """The CUDA backend module (imported only by the GPU tests that ask for it)."""
    import importlib

    return importlib.import_module("dptrain.backend.cuda")


@pytest.fixture
def cu(cuda, monkeypatch):
    """The CUDA backend with every output allocation poisoned (all bits set) before use, so
    an element a kernel forgets to write fails the comparison."""
    from dptrain.backend.cuda import launch

    real = launch.new

    def poisoned(shape, dtype):
        out = real(shape, dtype)
        if out.nbytes:
            out.data.memset_async(0xFF, out.nbytes)
        return out

    monkeypatch.setattr(launch, "new", poisoned)
    return cuda


@pytest.fixture
def rng():
    """Fresh random inputs each run; the seed is printed so a failure can be replayed."""
    import numpy as np

    seed = np.random.SeedSequence().entropy % 2**63
    print(f"input seed: {seed}")
    return np.random.default_rng(seed)
