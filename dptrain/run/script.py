"""``launch(main)``: run a user's training script as `python -m dptrain` runs its commands."""
from __future__ import annotations

import sys

from dptrain.distributed.world import guarded
from dptrain.errors import RunStopped, UsageError


def launch(main, *args):
    """Call ``main(*args)`` and exit. Bad input (UsageError: a step function that returns no
    loss, a batch of another shape, parameters that differ between ranks, ...) ends with one
    line ``NAME: error: ...`` and exit code 2; a stopped run (RunStopped: a NaN loss, ...)
    with one line and its exit code. Under mpirun or srun any other exception prints its
    traceback prefixed with the rank, and any failure ends every rank of the job."""
    name = sys.argv[0].rsplit("/", 1)[-1] or "dptrain"

    def body():
        try:
            main(*args)
        except UsageError as exc:
            print(f"{name}: error: {exc}", file=sys.stderr, flush=True)
            return 2
        except RunStopped as exc:
            print(f"{name}: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        return 0

    sys.exit(guarded(body))
