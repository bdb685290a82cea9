"""Cold start: the work a run does once before its first timed step, and its clock.

* ``first_on_host(world, fn)``: the first rank of each host runs ``fn()`` while the host's
  other ranks wait on a barrier of that host's ranks, then they run it too. With an on-disk
  cache behind ``fn`` (kernels, datasets), one rank per host does the work and the others
  load its result.
* ``process_age_s()``: seconds since this process started (interpreter start, imports
  included), for ``startup_s`` in summary.json.
"""
from __future__ import annotations

import os
import time

_IMPORTED = time.perf_counter()  # fallback origin where the OS does not say


def first_on_host(world, fn):
    """fn() on every rank, the host's first rank (local rank 0) before the others."""
    comm = getattr(world, "host_comm", None)
    if comm is None or comm.Get_size() == 1:
        return fn()
    result = fn() if world.local_rank == 0 else None
    comm.Barrier()
    return result if world.local_rank == 0 else fn()


def process_age_s() -> float:
    """Seconds since this process started: from /proc on Linux, else since dptrain's startup
    module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 (starttime), counted after "pid (comm)"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED
