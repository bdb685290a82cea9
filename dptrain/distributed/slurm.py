"""Ranks from Slurm's environment, for processes that `srun` starts without an MPI launcher
(no PMI/PMIx, or an MPI that does not speak it).

    tasks = from_env()          # None unless Slurm started this process as one of > 1 tasks
    tasks.rank, tasks.size, tasks.local_rank, tasks.host, tasks.local_size
    rendezvous_place(tasks)     # ("file", path) or ("tcp", host, port): where rank 0 is found

Slurm sets, in every task of a step: SLURM_PROCID (rank), SLURM_STEP_NUM_TASKS and
SLURM_NTASKS (world size), SLURM_LOCALID (position on its node), SLURM_NODEID (the node's
index in the step) and SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1": two
tasks on each of three nodes, then one). The ranks then meet through dptrain.distributed.rendezvous.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from dptrain import switches

DEFAULT_RENDEZVOUS_TIMEOUT = 300.0  # srun starts tasks at once; imports on a busy NFS are slow


class SlurmError(RuntimeError):
    """Slurm's variables do not describe a usable world (the message names the variable)."""


@dataclass(frozen=True)
class SlurmTasks:
    rank: int
    size: int
    local_rank: int
    host: str  # equal on the tasks of one node: SLURM_NODEID, else the host name
    node_index: int | None  # SLURM_NODEID
    tasks_per_node: tuple[int, ...] | None  # per node, in node order
    job: str  # "JOBID.STEPID": names the rendezvous file, checked when ranks meet

    @property
    def local_size(self) -> int | None:
        """Tasks on this node, where Slurm says (the rendezvous counts them anyway)."""
        if self.tasks_per_node is None or self.node_index is None \
                or self.node_index >= len(self.tasks_per_node):
            return None
        return self.tasks_per_node[self.node_index]


def parse_tasks_per_node(text: str) -> tuple[int, ...]:
    """Slurm's compressed per-node counts: "2(x3),1" -> (2, 2, 2, 1)."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise SlurmError(f"tasks per node {text!r}: expected counts like '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return tuple(counts)


def _int(env, name):
    try:
        return int(env[name])
    except ValueError:
        raise SlurmError(f"{name}={env[name]!r} is not an integer") from None


def from_env(env=None) -> SlurmTasks | None:
    """This task's place in the step, or None unless Slurm started > 1 tasks."""
    env = os.environ if env is None else env
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if "SLURM_PROCID" not in env or size_var not in env:
        return None
    size = _int(env, size_var)
    if size <= 1:
        return None
    rank = _int(env, "SLURM_PROCID")
    if not 0 <= rank < size:
        raise SlurmError(f"SLURM_PROCID={rank} is outside the {size} tasks of {size_var}")
    local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None
    if local_rank is None:
        raise SlurmError(f"{size_var}={size} but SLURM_LOCALID is not set")
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else None
    per_node = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            per_node = parse_tasks_per_node(env[name])
            break
    else:
        # --ntasks-per-node alone says every node runs that many
        if env.get("SLURM_NTASKS_PER_NODE") and node is not None:
            each = _int(env, "SLURM_NTASKS_PER_NODE")
            per_node = (each,) * max(node + 1, -(-size // max(each, 1)))
    host = f"node{node}" if node is not None else socket.gethostname()
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    job = f"{env.get('SLURM_JOB_ID', env.get('SLURM_JOBID', 'nojob'))}.{step}"
    return SlurmTasks(rank, size, local_rank, host, node, per_node, job)


def rendezvous_timeout(env=None) -> float:
    text = switches.value("RENDEZVOUS_TIMEOUT", env=env)
    if not text:
        return DEFAULT_RENDEZVOUS_TIMEOUT
    try:
        return float(text)
    except ValueError:
        name = switches.var("RENDEZVOUS_TIMEOUT")
        raise SlurmError(f"{name}={text!r}: expected seconds") from None


def rendezvous_place(tasks: SlurmTasks, env=None):
    """Where the ranks meet: ("tcp", host, port) when DPTRAIN_RENDEZVOUS is host:port (rank 0
    listens on that port), else ("file", path): rank 0 listens on a free port and writes its
    address into a file in a directory every node sees. The default directory is the job's
    submit directory (usually shared), else the working directory."""
    env = os.environ if env is None else env
    value = switches.value("RENDEZVOUS", "", env=env)
    host, _, port = value.rpartition(":")
    if host and port.isdigit() and not Path(value).is_dir():
        return ("tcp", host, int(port))
    directory = Path(value or env.get("SLURM_SUBMIT_DIR") or os.getcwd())
    return ("file", directory / f".dptrain-rendezvous-{tasks.job}")
