"""The watchdog: a host-synchronising point (a collective, a metric read, a step on the CPU)
that does not finish within ``--collective-timeout`` seconds ends the whole job, naming what
hung, the step, and the ranks that never arrived.

The loop wraps each such point in ``with watchdog.watch(what, step):``, which only stores
(what, step, a sequence number, the time) for a thread to read: nothing is added to the
device step. The thread, every ``interval`` seconds:

  * sends this rank's progress (sequence number, step) to every other rank with nonblocking
    point-to-point messages on a duplicate of the world communicator, and receives theirs
    (plain MPI-1 calls: the same under Open MPI and MPICH; it needs MPI_THREAD_MULTIPLE,
    mpi4py's default, else ranks cannot be named; nor can they under Slurm without MPI,
    whose rendezvous carries collectives only);
  * polls the communicator's asynchronous error check (``comm.check()``: NCCL's
    ncclCommGetAsyncError; a no-op over MPI);
  * when the watched point has run past the timeout: one rank prints one line naming it, the
    step and the ranks whose last progress is behind this one (they never entered it), and
    every rank ends the job (exit code ``EXIT_CODE``).

One verdict a job: the lowest-numbered rank that arrived prints it at once; the others wait
``VERDICT_GRACE_S``, by which time that rank's end has normally ended them, and print theirs
only if it has not. Ending never waits on the device: a GPU rank's main thread may be blocked
behind an NCCL kernel that waits for the silent rank, and ``ncclCommAbort`` (like any CUDA
call that synchronises) can block behind it too. So the communicator is not aborted; the
thread asks the launcher to end the job (``MPI_Abort``) with a timer armed that exits the
process after ``EXIT_DEADLINE_S`` whatever that call does; a rank that exits non-zero makes
Open MPI, MPICH and srun end the others, the stopped one included.

A rank that is stopped (SIGSTOP) or sleeping before a collective stops advancing its
sequence number, so the ranks waiting for it name it. A stopped rank that is woken (Open MPI
sends SIGCONT before ending a job) sees that its thread slept far past its interval and says
nothing: it was the late one, and what it heard before the stop is stale.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import numpy as np

EXIT_CODE = 4
VERDICT_GRACE_S = 3.0  # ranks other than the verdict's wait this long before their own
EXIT_DEADLINE_S = 2.0  # after asking the launcher to end the job, the process exits anyway
FROZEN_S = 2.0  # the thread woke this much later than asked: the process was stopped
DEFAULT_TIMEOUT = 300.0  # seconds: a few minutes (PyTorch's NCCL default is 10)
_TAG = 7301


class Watchdog:
    def __init__(self, world, timeout: float = DEFAULT_TIMEOUT, interval: float | None = None,
                 stream=None):
        self.world, self.timeout = world, float(timeout or 0)
        self.interval = interval or max(0.05, min(1.0, self.timeout / 5))
        self.stream = stream or sys.stderr
        self.rank, self.size = world.rank, world.size
        self.seq, self.region = 0, None  # region: (what, step, seq, start time)
        self.last_step = -1  # the step of the latest watched point
        self.thawed = 0.0  # when this process last woke from being stopped (monotonic)
        self.heard = {}  # rank -> (seq, step, inside a watched point, time heard)
        self.comm, self.named_ranks = None, False
        self.unnamed_why = "MPI lacks MPI_THREAD_MULTIPLE"  # when ranks cannot be named
        self._stop = threading.Event()
        self._thread = None
        self._sends = []

    @property
    def active(self) -> bool:
        return self.timeout > 0

    def start(self):
        if not self.active:
            return self
        mpi_comm = self.world.mpi_comm
        if getattr(mpi_comm, "rendezvous", False):
            # Slurm without MPI: the star through rank 0 carries collectives only
            self.unnamed_why = "the Slurm rendezvous carries no point-to-point messages"
        elif mpi_comm is not None and self.size > 1:
            from mpi4py import MPI

            if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
                self.comm = mpi_comm.Dup()
                self.named_ranks = True
        now = time.monotonic()
        self.heard = {r: (0, -1, False, now) for r in range(self.size) if r != self.rank}
        self._thread = threading.Thread(target=self._run, name="dptrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.comm is not None:
            self._drain()
            for req in self._sends:  # small eager messages: complete locally
                req.Wait()
            self._sends = []

    @contextlib.contextmanager
    def watch(self, what: str, step: int):
        """Watch the block: it must finish within the timeout on this rank."""
        if not self.active:
            yield
            return
        self.seq += 1
        self.last_step = step
        self.region = (what, step, self.seq, time.monotonic())
        try:
            yield
        finally:
            self.region = None

    # -- the thread
    def _run(self):
        tick = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            frozen, tick = now - tick > self.interval + FROZEN_S, now
            if frozen:
                # This process was itself stopped (SIGSTOP, a suspended machine): it is the
                # late one, what it last heard is stale, and the ranks that waited for it are
                # ending the job. No verdict of its own; the timeout counts from the thaw.
                self._stop.wait(VERDICT_GRACE_S)
                self.thawed = tick = time.monotonic()
                continue
            try:
                if self.comm is not None:
                    self._exchange()
                self.world.comm.check()
            except Exception as exc:  # noqa: BLE001 - an asynchronous communicator error
                region = self.region
                where = f" during {region[0]} at step {region[1]}" if region else ""
                self._fire(f"communicator error on rank {self.rank}{where}: {exc}")
            region = self.region
            if region is not None and time.monotonic() - max(region[3], self.thawed) > \
                    self.timeout:
                message = self._hang_message(region)
                if not self._gives_verdict(region):
                    time.sleep(VERDICT_GRACE_S)  # the verdict's rank ends this one meanwhile
                self._fire(message)

    def _exchange(self):
        from mpi4py import MPI

        region = self.region
        seq = region[2] if region else self.seq
        msg = np.array([seq, self.last_step, region is not None], dtype=np.int64)
        self._sends = [r for r in self._sends if not r.Test()]
        for peer in range(self.size):
            if peer != self.rank:
                self._sends.append(self.comm.Isend(msg.copy(), dest=peer, tag=_TAG))
        self._drain(MPI)

    def _drain(self, MPI=None):
        if MPI is None:
            from mpi4py import MPI
        status, buf = MPI.Status(), np.empty(3, dtype=np.int64)
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
            source = status.Get_source()
            self.comm.Recv(buf, source=source, tag=_TAG)
            self.heard[source] = (int(buf[0]), int(buf[1]), bool(buf[2]), time.monotonic())

    def _gives_verdict(self, region) -> bool:
        """Whether this rank prints the job's verdict on `region`: the lowest-numbered of the
        ranks that arrived (all of them where ranks cannot be named: rank 0)."""
        if not self.named_ranks:
            return self.rank == 0
        arrived = [r for r, (s, *_) in self.heard.items() if s >= region[2]]
        return all(self.rank < r for r in arrived)

    def _hang_message(self, region) -> str:
        what, step, seq, start = region
        head = (f"{what} at step {step} has not finished after {self.timeout:g} s on rank "
                f"{self.rank}")
        if not self.named_ranks:
            if self.size > 1:
                return head + " (the ranks that did not arrive cannot be named: " \
                              f"{self.unnamed_why})"
            return head
        now = time.monotonic()
        late = sorted(r for r, (s, *_) in self.heard.items() if s < seq)
        silent = 2 * self.interval + 1
        if not late and all(now - t > silent for *_, t in self.heard.values()):
            # Every other rank got here and then fell silent: they have ended (another rank's
            # watchdog, typically this one's own lateness, aborted the job); no new verdict.
            quiet = min(now - t for *_, t in self.heard.values())
            return (head + f"; every other rank reached it and has been silent for "
                    f"{quiet:.0f} s: the job has ended (see the first rank's verdict)")
        if not late:
            return head + "; every rank reached it, so the collective itself did not complete"
        parts = []
        for r in late:
            _, st, inside, t = self.heard[r]
            quiet = now - t
            seen = (f"silent for {quiet:.0f} s" if quiet > 2 * self.interval + 1
                    else "alive, " + ("inside an earlier collective" if inside
                                      else "busy outside any collective"))
            parts.append(f"{r} ({seen}" + (f", last at step {st})" if st >= 0 else ")"))
        noun = "rank" if len(late) == 1 else "ranks"
        return head + f"; {noun} {', '.join(parts)} did not arrive"

    def _fire(self, message: str):
        try:
            self.stream.write(f"dptrain: watchdog: {message}; aborting the job\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001
            pass
        # Nothing below may wait on the device (see the module's docstring): the timer ends
        # this process even if the launcher's abort blocks.
        deadline = threading.Timer(EXIT_DEADLINE_S, os._exit, (EXIT_CODE,))
        deadline.daemon = True
        deadline.start()
        try:
            mpi_comm = self.world.mpi_comm
            if mpi_comm is not None:
                mpi_comm.Abort(EXIT_CODE)
        finally:
            os._exit(EXIT_CODE)
