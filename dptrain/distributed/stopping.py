"""SIGINT and SIGTERM stop the run between steps, on every rank at the same step.

The first signal only sets a flag; a second one interrupts at once (KeyboardInterrupt).
Ranks agree on when to stop without a blocking collective per step: each step, every rank
starts a nonblocking all-reduce (max) of its flag on a duplicate of the world communicator
and completes the previous step's one, so all ranks see a signal that reached any of them at
the same step (one step after it arrived) and stop together. The loop then writes a
checkpoint, when it has a checkpoint directory, and ends with exit code 128 + the signal.
"""
from __future__ import annotations

import signal
import threading

import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    def __init__(self, world):
        self.world = world
        self.signum = 0
        self._previous = {}
        self._comm = None
        self._req = None
        self._send = np.zeros(1, dtype=np.int32)
        self._recv = np.zeros(1, dtype=np.int32)
        if world.mpi_comm is not None and world.size > 1:
            self._comm = world.mpi_comm.Dup()

    def install(self):
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.signum:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum

    def poll(self) -> int:
        """Called by every rank after every step: the signal all ranks stop for, or 0."""
        if self._comm is None:
            return self.signum
        from dptrain.distributed.world import constants

        agreed = 0
        if self._req is not None:
            self._req.Wait()
            self._req = None
            agreed = int(self._recv[0])
        if agreed:
            return agreed
        self._send[0] = self.signum
        self._req = self._comm.Iallreduce(self._send, self._recv, op=constants(self._comm).MAX)
        return 0

    def close(self, complete: bool = True):
        """Restore the previous handlers; with `complete`, finish the pending all-reduce
        (every rank has issued it, so it completes)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if complete and self._req is not None:
            self._req.Wait()
            self._req = None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
