"""Gradient exchange: reduce-scatter each bucket as backward completes it, update the shard,
all-gather the parameters.

Per step:
  1. backward runs; when the last gradient of a bucket is accumulated, that
     bucket's reduce-scatter (mean over ranks) is issued, on a communication
     stream ordered after the compute stream by an event, so it overlaps the
     rest of backward;
  2. ``finish_backward`` issues any bucket not yet sent and makes the compute
     stream wait for the communication stream;
  3. the optimizer updates only this rank's shard of each bucket (ZeRO-1);
  4. ``all_gather`` sends every rank's updated shard to all the others.
Reduce-scatter and all-gather work in place in the flat buffers: rank r's shard
of a bucket is the r-th of its N equal slices.
"""
from __future__ import annotations

import time


class _NoStreams:
    """CPU: collectives run synchronously where they are issued, so all of their time is
    exposed; it is summed with a host clock."""

    def __init__(self):
        self.exposed, self.steps = 0.0, 0

    def before_comm(self):
        return None

    def after_comm(self):
        pass

    def timed(self, fn, *args):
        start = time.perf_counter()
        fn(*args)
        self.exposed += time.perf_counter() - start

    def mark(self, name):
        if name == "step_end":
            self.steps += 1

    def read_exposed(self) -> float:
        """Mean seconds per step that compute waited for communication, since the last read."""
        value = self.exposed / max(1, self.steps)
        self.exposed, self.steps = 0.0, 0
        return value


class _CudaStreams:
    """GPU: a dedicated communication stream, ordered against compute with events. Timing
    events on the compute stream bracket the waits, so the exposed (non-overlapped)
    communication of the latest step can be read once the host has synchronised."""

    MARKS = ("backward_done", "comm_waited", "gather_start", "step_end")

    def __init__(self):
        import cupy

        self.cupy = cupy
        self.comm = cupy.cuda.Stream(non_blocking=True)
        self.events = {name: cupy.cuda.Event() for name in self.MARKS}
        self.marked = set()

    def before_comm(self):
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(self.cupy.cuda.get_current_stream())
        self.comm.wait_event(event)
        return self.comm

    def after_comm(self):
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(self.comm)
        self.cupy.cuda.get_current_stream().wait_event(event)

    def timed(self, fn, *args):
        fn(*args)

    def mark(self, name):
        stream = self.cupy.cuda.get_current_stream()
        if stream.is_capturing():
            self.marked.clear()  # timing events cannot be read back from a graph replay
            return
        self.events[name].record(stream)
        self.marked.add(name)

    def read_exposed(self):
        """Seconds the latest step's compute stream spent waiting for the reduce-scatters plus
        running the all-gathers (call after a host synchronisation); None when the step ran
        as a graph replay, where no timing event is recorded."""
        if self.marked != set(self.MARKS):
            return None
        e = self.events
        e["step_end"].synchronize()
        ms = self.cupy.cuda.get_elapsed_time(e["backward_done"], e["comm_waited"])
        ms += self.cupy.cuda.get_elapsed_time(e["gather_start"], e["step_end"])
        return ms / 1e3


class Reducer:
    def __init__(self, flat, world):
        self.flat, self.world, self.comm = flat, world, world.comm
        self.rank, self.size = world.rank, world.size
        self.streams = _CudaStreams() if flat.be.name == "cuda" else _NoStreams()
        self.bucket_of = {id(p): i for i, b in enumerate(flat.buckets) for p in b.params}
        self.pending = [0] * len(flat.buckets)
        self.sent = [False] * len(flat.buckets)
        for p in flat.params:
            p.register_grad_hook(self._grad_ready)
        self.begin_step()

    def broadcast_parameters(self, root: int = 0):
        """Make every rank start from rank `root`'s parameters."""
        self.comm.broadcast(self.flat.data, root)

    def begin_step(self):
        self.pending = [len(b.params) for b in self.flat.buckets]
        self.sent = [False] * len(self.flat.buckets)

    def _grad_ready(self, param):
        i = self.bucket_of[id(param)]
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._reduce_scatter(i)

    def _reduce_scatter(self, i):
        if self.sent[i]:
            return
        self.sent[i] = True
        if self.size == 1:
            return
        bucket = self.flat.buckets[i]
        start, stop = bucket.shard(self.rank, self.size)
        grad = self.flat.grad
        stream = self.streams.before_comm()
        args = (grad[bucket.start : bucket.stop], grad[start:stop])
        if stream is None:
            self.streams.timed(self.comm.reduce_scatter, *args)
        else:
            self.comm.reduce_scatter(*args, stream=stream)

    def finish_backward(self):
        """Send buckets whose gradients never arrived (unused parameters), then wait for all."""
        if self.size > 1:
            self.streams.mark("backward_done")
        for i in range(len(self.flat.buckets)):
            self._reduce_scatter(i)
        if self.size > 1:
            self.streams.after_comm()
            self.streams.mark("comm_waited")
        self.begin_step()

    def all_gather(self):
        if self.size == 1:
            return
        self.streams.mark("gather_start")
        data = self.flat.data
        for bucket in self.flat.buckets:
            start, stop = bucket.shard(self.rank, self.size)
            self.streams.timed(self.comm.all_gather, data[start:stop],
                               data[bucket.start : bucket.stop])
        self.streams.mark("step_end")

    def read_exposed_comm(self):
        """Seconds per step of communication that did not overlap compute (see the streams),
        or None where it cannot be measured."""
        return self.streams.read_exposed() if self.size > 1 else 0.0
