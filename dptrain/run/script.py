"""``launch(main)``: run a user's training script as `python -m dptrain` runs its commands.

Under ``launch`` a DataParallel is protected as `train` is (``Protection``): the watchdog
(dptrain.distributed.watchdog) watches every point where the library waits for the other
ranks (a step, ``step.metrics()``, the first read of the weights after a step, ``save``,
``load``) and ends the job with one line naming the call, the step and the ranks that did
not arrive (exit code 4) when one has not finished after ``collective_timeout`` seconds:
the fate of a collective that some ranks skip (``if rank == 0: step.metrics()``). SIGINT
and SIGTERM stop the loop after the step every rank agrees on (dptrain.distributed.stopping):
that step's ``step(batch)`` raises RunStopped, which ends the script with one line and exit
code 128 + the signal, or which the script catches to save first.
"""
from __future__ import annotations

import contextlib
import sys

from dptrain.distributed import current
from dptrain.distributed.stopping import StopRequests, signal_name
from dptrain.distributed.watchdog import DEFAULT_TIMEOUT, Watchdog
from dptrain.distributed.world import guarded
from dptrain.errors import RunStopped, UsageError


class Protection:
    """The watchdog and the agreed stop of a launched script (nothing outside ``launch``)."""

    def __init__(self, timeout: float | None = None):
        self.timeout = timeout  # None: not launched, nothing watched
        self.world = self.watchdog = self.stops = None

    def attach(self, world):
        """Start watching `world` (once; the first DataParallel's)."""
        if self.timeout is not None and self.world is None:
            self.world = world
            self.watchdog = Watchdog(world, self.timeout).start()
            self.stops = StopRequests(world).install()
        return self

    def watch(self, what: str, step: int):
        """The watchdog's watch of the block (the outermost one where they nest)."""
        if self.watchdog is None or self.watchdog.region is not None:
            return contextlib.nullcontext()
        return self.watchdog.watch(what, step)

    def poll(self, step: int):
        """After every step, on every rank: RunStopped once the ranks agree on a signal."""
        signum = self.stops.poll() if self.stops is not None else 0
        if signum:
            raise RunStopped(f"stopped by {signal_name(signum)} after step {step} (every rank "
                             f"at the same step)", exit_code=128 + signum, agreed=True)

    def close(self, complete: bool):
        if self.stops is not None:
            self.stops.close(complete)
        if self.watchdog is not None:
            self.watchdog.stop()
        self.world = self.watchdog = self.stops = None


_protection = Protection()


def protection() -> Protection:
    """The running launch's Protection (one that watches nothing outside ``launch``)."""
    return _protection


def launch(main, *args, collective_timeout: float = DEFAULT_TIMEOUT):
    """Call ``main(*args)`` and exit. Bad input (UsageError: a step function that returns no
    loss, a batch of another shape, parameters that differ between ranks, a bad argument
    ...) ends with one line ``NAME: error: ...`` and exit code 2; a stopped run (RunStopped:
    a NaN loss, a signal, ...) with one line and its exit code; a call that waits more than
    `collective_timeout` seconds for the other ranks (0: never) with the watchdog's one line
    and exit code 4 (see the module's docstring). Under mpirun or srun any other exception
    prints its traceback prefixed with the rank, and any failure ends every rank of the job."""
    global _protection
    name = sys.argv[0].rsplit("/", 1)[-1] or "dptrain"

    def body():
        global _protection
        _protection, ok = Protection(collective_timeout), False
        try:
            main(*args)
            ok = True
        except UsageError as exc:
            print(f"{name}: error: {exc}", file=sys.stderr, flush=True)
            return 2
        except RunStopped as exc:
            world = current()
            if not exc.agreed or world is None or world.is_root:  # an agreed stop: one line
                print(f"{name}: {exc}", file=sys.stderr, flush=True)
            if exc.agreed:  # every rank ends alike: guarded exits with the code, no abort
                raise
            return exc.exit_code
        finally:
            _protection.close(complete=ok)
            _protection = Protection()
        return 0

    sys.exit(guarded(body))
