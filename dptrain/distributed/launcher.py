"""Starting N ranks under whichever MPI launcher this machine has: Open MPI's `mpirun`,
MPICH's (or Intel MPI's) Hydra `mpiexec`, or Slurm's `srun`.

The flavours differ in the flags that matter here: Open MPI refuses more ranks than cores
without `--oversubscribe` and refuses to run as root without two variables; Hydra
oversubscribes by default and rejects `--oversubscribe`; Open MPI forwards a variable with
`-x NAME`, Hydra and srun forward the whole environment. ``Launcher`` hides that:

    launcher = find_launcher()                     # or find_launcher("mpiexec"), ("srun")
    cmd = launcher.command(2, [sys.executable, "-m", "dptrain", "train"], device="cpu")
    env = {**os.environ, **launcher.env("cpu")}

Used by the scaling scripts and the tests that launch MPI.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

FLAVOURS = ("openmpi", "mpich", "srun")
LAUNCHERS = ("auto", "mpirun", "mpiexec", "srun")
# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM on every rank: a program using it
# can put a shared host's GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def flavour_of(version_text: str, program: str = "") -> str | None:
    """The flavour a launcher's `--version` output names, or None."""
    if Path(program).name.startswith("srun") or version_text.lstrip().startswith("slurm"):
        return "srun"
    text = version_text.lower()
    if "open mpi" in text or "open-mpi" in text or "open rte" in text or "prrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "mpich"
    return None


def detect_flavour(program: str) -> str | None:
    """Run `program --version` and read its flavour (None when it says nothing we know)."""
    if Path(program).name.startswith("srun"):
        return "srun"
    try:
        out = subprocess.run([program, "--version"], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return flavour_of(out.stdout + out.stderr, program)


@dataclass
class Launcher:
    program: str  # the launcher's path (or name, in a dry run)
    flavour: str  # one of FLAVOURS

    def command(self, ranks: int, program: list[str], device: str = "cpu",
                extra: list[str] = (), forward: tuple[str, ...] = tuple(NO_MULTICAST)) -> list[str]:
        """The command that starts `ranks` copies of `program`. On the CPU ranks may outnumber
        the cores; on GPUs each rank is left unbound (its host thread launches kernels, NCCL
        adds threads) and the `forward` variables reach every rank."""
        cmd = [self.program, "-n", str(ranks)]
        cpu = device == "cpu"
        if self.flavour == "openmpi":
            cmd += ["--oversubscribe"] if cpu else ["--bind-to", "none"]
            if not cpu:
                for name in forward:
                    cmd += ["-x", name]
        elif self.flavour == "mpich":
            cmd += [] if cpu else ["-bind-to", "none"]  # Hydra forwards the environment
        else:  # srun: the allocation decides the placement; one failed rank ends the step
            cmd += ["--kill-on-bad-exit=1"] + ([] if cpu else ["--cpu-bind=none"])
        return cmd + list(extra) + list(program)

    def env(self, device: str = "cpu") -> dict:
        """Variables the launch needs beyond the caller's environment (the caller's own
        settings win): Open MPI's run-as-root pair when root, its oversubscription policy
        on the CPU, one thread per rank on the CPU, NVLink multicast off on GPUs."""
        env = {}
        if self.flavour == "openmpi":
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                # Open MPI refuses to start as root unless told twice; only then.
                env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            if device == "cpu":
                # Open MPI 4 reads the first variable, Open MPI 5 (PRRTE) the second.
                env.update(OMPI_MCA_rmaps_base_oversubscribe="1",
                           PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
        if device == "cpu":
            # One core per rank, as one GPU per rank: no BLAS thread pools fighting.
            env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        else:
            env.update(NO_MULTICAST)
        return {k: v for k, v in env.items() if k not in os.environ}


class LaunchError(Exception):
    """No usable launcher: the message says what was looked for."""


def find_launcher(choice: str = "auto", dry_run: bool = False) -> Launcher:
    """The launcher `choice` names (auto, mpirun, mpiexec, srun, or a path), its flavour read
    from `--version`. auto: srun inside a Slurm allocation when it is on PATH, else mpirun,
    else mpiexec. A dry run settles for the name when nothing is installed."""
    if choice == "auto":
        names = (["srun"] if "SLURM_JOB_ID" in os.environ else []) + ["mpirun", "mpiexec"]
    elif choice in LAUNCHERS:
        names = [choice]
    else:
        names = [choice]  # a path
    for name in names:
        path = shutil.which(name)
        if path:
            flavour = detect_flavour(path)
            if flavour is None:
                raise LaunchError(f"--launcher {name}: {path} is neither Open MPI, MPICH (Hydra) "
                                  "nor srun, by its --version")
            return Launcher(path, flavour)
    if dry_run:
        return Launcher(names[0] if choice != "auto" else "mpirun",
                        "srun" if names[0] == "srun" else "openmpi")
    raise LaunchError(f"no MPI launcher found ({' or '.join(names)} on PATH): install Open MPI "
                      "or MPICH, or pip install 'dptrain[mpi-bundled]'")
