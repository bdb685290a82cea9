"""The MPI launcher the tests use, whatever its flavour (Open MPI, MPICH, srun): one place
that finds it and builds its command lines (dptrain.distributed.launcher). DPTRAIN_TEST_LAUNCHER picks one
(mpirun, mpiexec, srun or a path); by default the first found, as the scaling scripts do."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain import switches
from dptrain.distributed.launcher import LaunchError, find_launcher

ROOT = Path(__file__).resolve().parents[2]
try:
    LAUNCHER = find_launcher(switches.value("TEST_LAUNCHER", "auto"))
except LaunchError:
    LAUNCHER = None
HAVE_MPI = LAUNCHER is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs an MPI launcher and mpi4py "
                               "(pip install '.[mpi-bundled]')")


def gpu_count() -> int:
    """The GPUs this process sees (0 without CuPy or a GPU): multi-GPU tests skip below theirs."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return 0


def mpi_command(ranks, program, device="cpu", extra=()):
    """`program` started as `ranks` ranks by the launcher, with its flavour's flags."""
    return LAUNCHER.command(ranks, list(program), device, list(extra))


def mpi_env(base=None, device="cpu"):
    """`base` (default: this environment) plus what the launcher needs (run as root under
    Open MPI, oversubscription, one thread per rank on the CPU)."""
    env = dict(os.environ if base is None else base)
    env.update({k: v for k, v in LAUNCHER.env(device).items() if k not in env})
    return env


# -- `python -m dptrain train` on the CPU, as the reliability tests start it

def env(cache, device="cpu", **extra):
    base = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache),
                OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **extra)
    return mpi_env(base, device) if LAUNCHER is not None else base


def command(ranks, args, device="cpu"):
    """`python -m dptrain train ARGS`, under the launcher with `ranks` processes when > 0."""
    cmd = [sys.executable, "-m", "dptrain", "train", *args]
    return mpi_command(ranks, cmd, device) if ranks else cmd


def run(ranks, args, cache, timeout=240, device="cpu", **extra_env):
    return subprocess.run(command(ranks, args, device), capture_output=True, text=True,
                          env=env(cache, device, **extra_env), timeout=timeout)


def start(ranks, args, cache, device="cpu", **extra_env):
    return subprocess.Popen(command(ranks, args, device), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(cache, device, **extra_env),
                            start_new_session=True)
