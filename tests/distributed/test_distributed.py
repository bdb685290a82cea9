"""Data-parallel training on the CPU over MPI: N ranks equal one process, replicas stay
identical, and failures end the job instead of hanging it. Skipped without an MPI launcher
and mpi4py; runs under Open MPI, MPICH or srun (tests/helpers/mpilaunch.py)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
from mpilaunch import mpi_command, mpi_env, needs_mpi

pytestmark = needs_mpi

COMMON = ["--device", "cpu", "--model", "cnn", "--train-images", "480", "--val-images", "60",
          "--epochs", "1", "--max-steps", "10", "--optimizer", "sgd", "--lr", "0.05", "--no-progress",
          "--log-every", "5", "--seed", "3"]


def _env(cache):
    return mpi_env(dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache)))


def run(ranks, args, cache, timeout=300):
    cmd = [sys.executable, "-m", "dptrain", "train", *args]
    if ranks:
        cmd = mpi_command(ranks, cmd)
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(cache), timeout=timeout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    result = run(0, COMMON + ["--batch-size", "48", "--save", str(tmp / "w.npz")], tmp / "cache")
    assert result.returncode == 0, result.stderr
    with np.load(tmp / "w.npz") as w:
        return {k: w[k] for k in w.files if k != "__meta__"}


@pytest.mark.parametrize("ranks", [2, 3])
def test_n_ranks_match_one_process(ranks, single, tmp_path):
    out = tmp_path / "w.npz"
    result = run(ranks, COMMON + ["--global-batch-size", "48", "--verify-replicas",
                                  "--save", str(out)], tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    with np.load(out) as w:
        for name, ref in single.items():
            rel = np.abs(w[name] - ref).max() / (np.abs(ref).max() + 1e-12)
            assert rel <= 1e-4, f"{name}: relative difference {rel:.2e} with {ranks} ranks"


def test_ragged_dataset_does_not_hang(tmp_path):
    # 101 images over 3 ranks at batch 8: the ragged tail is dropped or padded, never waited on.
    args = ["--device", "cpu", "--train-images", "101", "--val-images", "13", "--epochs", "2",
            "--batch-size", "8", "--no-progress"]
    for extra in ([], ["--no-drop-last"]):
        result = run(3, args + extra, tmp_path / "cache", timeout=240)
        assert result.returncode == 0, result.stderr


def test_failing_rank_aborts_the_job(tmp_path):
    env_args = COMMON + ["--global-batch-size", "48"]
    cmd = mpi_command(2, [sys.executable, "-m", "dptrain", "train", *env_args])
    env = dict(_env(tmp_path / "cache"), DPTRAIN_TEST_FAULT="1:3")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode != 0
    assert "[rank 1]" in result.stderr and "injected fault" in result.stderr


def test_bench_comm_runs_over_mpi(tmp_path):
    cmd = mpi_command(2, [sys.executable, "-m", "dptrain", "bench", "comm", "--device", "cpu",
                          "--sizes-mb", "0.25", "--repeats", "2", "--csv", str(tmp_path / "c.csv")])
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "RS+AG" in result.stdout and (tmp_path / "c.csv").exists()
