"""The streaming input path: batches gathered ahead by host threads and copied to the device
on a copy stream while the step before them runs.

``BatchStream`` walks a plan, the dataset indices of every step to come in order (for
training, ``planned_batches(sampler, first_step, last_step)``: the stride sampler's own
order across epoch boundaries, from any step a checkpoint resumes at, padded batches of
``drop_last=False`` included). It keeps a ring of ``depth`` slots, each a pinned host buffer
and a device buffer of one batch of uint8 rows::

    worker thread (step t, slot t % depth)        main thread, set_batch of step t
    -------------------------------------        ---------------------------------
    wait until step t - depth was taken           wait until step t is ready
    host_wait(slot.copied)   host rows are free   compute stream waits slot.copied
    np.take(images, idx, out=slot.host)           device_copy_(fixed, slot.device)
    copy stream waits slot.consumed               slot.consumed = record()
    upload_async_(slot.device, slot.host)         step t + depth may now claim the slot
    slot.copied = record(copy stream)

The captured step reads one fixed device buffer (the loader's), so the graph sees the same
address every step. Each batch reaches it by a device-to-device copy on the compute stream,
issued before the step and after the previous step (the stream's order; a replayed graph is
ordered after its caller's stream and the caller after it). Why a copy and not two fixed
buffers used in turn: the graph holds its input's address, so alternating would need two
captured graphs (twice the graph memory and capture time, and a step object that knows
which one to launch), while the copy costs a batch's bytes at device bandwidth (38.5 MB for
256 x 3x224x224: about 20 us on an H200, against a step of milliseconds). Copying straight
from the host into the fixed buffer instead would have to wait for the previous step to
finish reading it, which is the overlap this path exists for.

Threads, not processes: ``np.take`` on a memory map releases the GIL (measured: a Python
loop keeps 0.98-1.03 of its solo rate while another thread takes rows of a memory map), the
pinned buffers are this process's, and the copies are issued from the threads themselves
(``runtime.thread_target`` puts them on the process's GPU; CuPy waits for an event with
the GIL released). Capture is unaffected: CuPy
captures in relaxed mode, in which other threads may issue copies and wait for events on
streams that are not capturing.

A worker's error stops the stream; the main thread raises it, as one line naming the file,
when it needs a batch the stream can no longer make. ``close()`` stops and joins the threads
(also when training ends early) and waits for the copies in flight.
"""
from __future__ import annotations

import threading

import numpy as np

from dptrain.errors import RunStopped

DEFAULT_DEPTH = 3  # batches in flight: one being read by the step, one copied, one gathered
DEFAULT_WORKERS = 2


def planned_batches(sampler, first_step: int, last_step: int):
    """This rank's indices for global steps first_step .. last_step - 1, in the order the
    training loop walks them (epoch = step // steps per epoch)."""
    per_epoch, epoch, batches = len(sampler), None, None
    for step in range(first_step, last_step):
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            batches = sampler.epoch_batches(epoch)
        yield batches[step % per_epoch]


def check_depth(depth, workers) -> tuple[int, int]:
    """(depth, workers) as ints, or ValueError naming the one at fault."""
    for flag, value, low in (("--prefetch-depth", depth, 2), ("--data-workers", workers, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{flag} {value!r}: must be an integer >= {low}")
    return int(depth), int(workers)


class _Slot:
    def __init__(self, host, device):
        self.host, self.device = host, device
        self.copied = self.consumed = None  # events: rows on the device; rows read out
        self.indices = None


class BatchStream:
    """Batches of uint8 rows of `images` (n, ...) for the steps of a plan, gathered ahead.

    ``take_into(fixed, indices)`` puts the next planned batch into the device array `fixed`
    (on the current stream) and checks that `indices` are the plan's; `source` names the
    file, and `first_step` (the plan's first training step, 0-based) the step, in errors."""

    def __init__(self, images, be, batch_size: int, plan, depth: int = DEFAULT_DEPTH,
                 workers: int = DEFAULT_WORKERS, source: str | None = None, first_step: int = 0):
        depth, workers = check_depth(depth, workers)
        self._first = int(first_step)
        self.images, self.be, self.rt = images, be, be.runtime
        self.source = source or "the dataset's images"
        shape = (int(batch_size),) + tuple(images.shape[1:])
        self._slots = [_Slot(self.rt.pinned_empty(shape, np.uint8), be.zeros(shape, np.uint8))
                       for _ in range(depth)]
        self._copy_stream = self.rt.copy_stream()
        self._plan = iter(plan)
        self._cond = threading.Condition()
        self._claimed = self._taken = 0  # steps handed to workers; steps taken by set_batch
        self._ready: dict[int, _Slot] = {}
        self._planned = None  # the plan's length, once it ran out
        self._error = None  # (step, message) of the first worker failure
        self._stopping = False
        target = self.rt.thread_target(self._work)
        self._threads = [threading.Thread(target=target, name=f"dptrain-stream-{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    @property
    def depth(self) -> int:
        return len(self._slots)

    @property
    def workers(self) -> int:
        return len(self._threads)

    # -- worker threads
    def _claim(self):
        """(step, slot, indices) of the next step to gather, or None when there is none."""
        with self._cond:
            while not self._stopping and self._error is None and self._planned is None \
                    and self._claimed - self._taken >= self.depth:
                self._cond.wait()
            if self._stopping or self._error is not None or self._planned is not None:
                return None
            step = self._claimed
            try:
                indices = next(self._plan)
            except StopIteration:
                self._planned = step
                self._cond.notify_all()
                return None
            except Exception as exc:  # noqa: BLE001 - the plan's failure, for the main thread
                self._fail(step, f"planning step {self._first + step + 1} failed", exc)
                return None
            self._claimed += 1
            return step, self._slots[step % self.depth], indices

    def _work(self):
        rt = self.rt
        while (claim := self._claim()) is not None:
            step, slot, indices = claim
            try:
                if slot.copied is not None:
                    rt.host_wait(slot.copied)  # the last upload from these host rows is done
                # mode="clip" skips a buffered bounds check: set_batch checks the indices
                np.take(self.images, indices, axis=0, out=slot.host, mode="clip")
                if slot.consumed is not None:
                    rt.wait(slot.consumed, self._copy_stream)  # its last batch was read out
                with rt.on(self._copy_stream):
                    rt.upload_async_(slot.device, slot.host)
                slot.copied = rt.record(self._copy_stream)
                slot.indices = np.asarray(indices)
            except Exception as exc:  # noqa: BLE001 - any failure is the run's, said in one line
                with self._cond:
                    self._fail(step, f"reading {self.source} for step "
                                     f"{self._first + step + 1} failed", exc)
                return
            with self._cond:
                self._ready[step] = slot
                self._cond.notify_all()

    def _fail(self, step, what, exc):
        """Record the first failure as one line (call holding the lock)."""
        if self._error is None:
            text = " ".join(str(exc).split()) or "no message"
            self._error = (step, f"data stream: {what}: {type(exc).__name__}: {text}")
        self._cond.notify_all()

    # -- the main thread
    def take_into(self, fixed, indices) -> None:
        """The next planned batch into device array `fixed`, on the current stream; waits
        for the workers while it is not gathered yet."""
        step = self._taken
        with self._cond:
            while step not in self._ready and self._error is None and not self._stopping \
                    and (self._planned is None or step < self._planned):
                if not self._cond.wait(timeout=1.0) and not any(
                        t.is_alive() for t in self._threads):
                    break  # every worker is gone without a word: never wait forever
            slot = self._ready.pop(step, None)
        if slot is None:
            if self._error is not None:
                raise RunStopped(self._error[1])
            raise RuntimeError(f"data stream: no planned batch for step {self._first + step + 1} "
                               f"(the plan held {self._planned} steps, or the stream was closed)")
        if not np.array_equal(slot.indices, indices):
            raise RuntimeError(f"data stream: step {self._first + step + 1} asked for other "
                               f"indices than the planned ones (the loop and the plan disagree)")
        rt = self.rt
        rt.wait(slot.copied)
        rt.device_copy_(fixed, slot.device)
        slot.consumed = rt.record()
        with self._cond:
            self._taken += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the workers, join them and wait for the copies in flight (idempotent)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        for slot in self._slots:
            if slot.copied is not None:
                self.rt.host_wait(slot.copied)
