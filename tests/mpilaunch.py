"""How the reliability tests start dptrain under MPI: one place to build the command line,
so switching to another launcher (or MPI flavour) changes this file only."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")
HAVE_MPI = MPIRUN is not None and importlib.util.find_spec("mpi4py") is not None


def env(cache, **extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache),
                OMPI_MCA_rmaps_base_oversubscribe="1",
                PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **extra)


def command(ranks, args):
    """`python -m dptrain train ARGS`, under mpirun with `ranks` processes when ranks > 0."""
    cmd = [sys.executable, "-m", "dptrain", "train", *args]
    if ranks:
        cmd = [MPIRUN, "-n", str(ranks), "--oversubscribe", *cmd]
    return cmd


def run(ranks, args, cache, timeout=240, **extra_env):
    return subprocess.run(command(ranks, args), capture_output=True, text=True,
                          env=env(cache, **extra_env), timeout=timeout)


def start(ranks, args, cache, **extra_env):
    return subprocess.Popen(command(ranks, args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(cache, **extra_env),
                            start_new_session=True)
