"""Run under mpirun by tests/distributed/test_multihost.py: do one piece of once-per-host work
(first_on_host) that records who did it, and write this rank's place in the world as JSON
(a file per rank: launchers may interleave the ranks' output lines)."""
import json
import sys
from pathlib import Path

from dptrain import backend
from dptrain import distributed as dist
from dptrain.distributed.startup import first_on_host

world = dist.init(backend.get("cpu"))
marks = Path(sys.argv[1])


def work():
    # the host's first rank finds nothing and does the work; the others find its result
    done = marks / f"host-of-rank-{world.rank - world.local_rank}"
    if not done.exists():
        done.write_text(str(world.rank))
        return "did"
    return "loaded"


outcome = first_on_host(world, work)
(marks.parent / f"rank-{world.rank}.json").write_text(json.dumps(
    {"rank": world.rank, "local_rank": world.local_rank, "local_size": world.local_size,
     "outcome": outcome}))
