"""The MPI launcher the tests use, whatever its flavour (Open MPI, MPICH, srun): one place
that finds it and builds its command lines (dptrain.launch). DPTRAIN_TEST_LAUNCHER picks one
(mpirun, mpiexec, srun or a path); by default the first found, as the scaling scripts do."""
import importlib.util
import os

import pytest

from dptrain.launch import LaunchError, find_launcher

try:
    LAUNCHER = find_launcher(os.environ.get("DPTRAIN_TEST_LAUNCHER", "auto"))
except LaunchError:
    LAUNCHER = None
HAVE_MPI = LAUNCHER is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs an MPI launcher and mpi4py "
                               "(pip install '.[mpi-bundled]')")


def mpi_command(ranks, program, device="cpu", extra=()):
    """`program` started as `ranks` ranks by the launcher, with its flavour's flags."""
    return LAUNCHER.command(ranks, list(program), device, list(extra))


def mpi_env(base=None, device="cpu"):
    """`base` (default: this environment) plus what the launcher needs (run as root under
    Open MPI, oversubscription, one thread per rank on the CPU)."""
    env = dict(os.environ if base is None else base)
    env.update({k: v for k, v in LAUNCHER.env(device).items() if k not in env})
    return env
