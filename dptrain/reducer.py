"""Gradient exchange: reduce-scatter each bucket as backward completes it, update the shard,
all-gather the parameters while the next forward begins.

Per step:
  1. ``gather_parameters`` all-gathers every bucket (the shards the ranks updated last
     step), first layers first, on a communication stream; each layer's forward waits
     only for its own bucket, so the large late layers' gathers overlap the early layers'
     forward. (On the first step the gather changes nothing: every rank already holds
     rank 0's broadcast parameters.)
  2. backward runs; when the last gradient of a bucket is accumulated, that bucket's
     reduce-scatter (mean over ranks) is issued on the communication stream, ordered after
     the compute stream by an event, so it overlaps the rest of backward;
  3. ``finish_backward`` issues any bucket not yet sent and makes the compute stream wait;
  4. the optimizer updates only this rank's shard of each bucket (ZeRO-1).
``sync_parameters`` gathers and waits at once, before anything reads whole parameters
outside a step (evaluation, saving, the replica check). Reduce-scatter and all-gather
work in place in the flat buffers: rank r's shard of a bucket is the r-th of its N slices.
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

    def bucket_done(self, i):
        pass

    def wait_bucket(self, i):
        pass

    def mark(self, name):
        if name == "comm_waited":
            self.steps += 1

    def read_exposed(self) -> float:
        """Mean seconds per step spent in communication, since the last read."""
        value = self.exposed / max(1, self.steps)
        self.exposed, self.steps = 0.0, 0
        return value


class _CudaStreams:
    """GPU: a dedicated communication stream, ordered against compute with events. Two
    timing events on the compute stream bracket the wait for the reduce-scatters, so the
    exposed part of the latest step can be read once the host has synchronised."""

    def __init__(self, buckets: int):
        import cupy

        self.cupy = cupy
        self.comm = cupy.cuda.Stream(non_blocking=True)
        self.bucket_events = [cupy.cuda.Event(disable_timing=True) for _ in range(buckets)]
        self.events = {name: cupy.cuda.Event() for name in ("backward_done", "comm_waited")}
        self.marked = set()

    def _order(self, first, then):
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(first)
        then.wait_event(event)

    def before_comm(self):
        self._order(self.cupy.cuda.get_current_stream(), self.comm)
        return self.comm

    def after_comm(self):
        self._order(self.comm, self.cupy.cuda.get_current_stream())

    def timed(self, fn, *args):
        fn(*args)

    def bucket_done(self, i):
        self.bucket_events[i].record(self.comm)

    def wait_bucket(self, i):
        self.cupy.cuda.get_current_stream().wait_event(self.bucket_events[i])

    def mark(self, name):
        stream = self.cupy.cuda.get_current_stream()
        if stream.is_capturing():
            self.marked.clear()  # timing events cannot be read back from a graph replay
            return
        self.events[name].record(stream)
        self.marked.add(name)

    def read_exposed(self):
        """Seconds the latest step's compute stream waited for its reduce-scatters (call after
        a host synchronisation); None when the step ran as a graph replay."""
        if self.marked != set(self.events):
            return None
        e = self.events
        e["comm_waited"].synchronize()
        return self.cupy.cuda.get_elapsed_time(e["backward_done"], e["comm_waited"]) / 1e3


class Reducer:
    def __init__(self, flat, world, model=None):
        self.flat, self.world, self.comm = flat, world, world.comm
        self.rank, self.size = world.rank, world.size
        nb = len(flat.buckets)
        self.streams = _CudaStreams(nb) if flat.be.name == "cuda" else _NoStreams()
        self.bucket_of = {id(p): i for i, b in enumerate(flat.buckets) for p in b.params}
        self.pending, self.sent = [0] * nb, [False] * nb
        self.gathering = False
        for p in flat.params:
            p.register_grad_hook(self._grad_ready)
        if model is not None:
            for module in model.modules():
                mine = sorted({self.bucket_of[id(p)] for p in module._params.values()
                               if id(p) in self.bucket_of})
                if mine:
                    module.register_forward_pre_hook(lambda _, b=mine: self._wait_gathered(b))
        self.model_hooks = model is not None
        self.begin_step()

    def broadcast_parameters(self, root: int = 0):
        """Make every rank start from rank `root`'s parameters, then run one exchange of
        each bucket, so connection set-up is not charged to the first training step."""
        self.comm.broadcast(self.flat.data, root)
        if self.size > 1:
            self.flat.zero_grad()
            for i in range(len(self.flat.buckets)):
                self._reduce_scatter(i)  # of zeros: changes nothing
            self.finish_backward()
            self.sync_parameters()

    def begin_step(self):
        self.pending = [len(b.params) for b in self.flat.buckets]
        self.sent = [False] * len(self.flat.buckets)

    # -- parameters: all-gather the updated shards
    def gather_parameters(self):
        """Issue the all-gather of every bucket, first layers (the last buckets) first."""
        if self.size == 1:
            return
        stream = self.streams.before_comm()
        data = self.flat.data
        for i in reversed(range(len(self.flat.buckets))):
            bucket = self.flat.buckets[i]
            start, stop = bucket.shard(self.rank, self.size)
            args = (data[start:stop], data[bucket.start : bucket.stop])
            if stream is None:
                self.streams.timed(self.comm.all_gather, *args)
            else:
                self.comm.all_gather(*args, stream=stream)
            self.streams.bucket_done(i)
        self.gathering = True
        if not self.model_hooks:
            self.wait_gathered()

    def _wait_gathered(self, buckets):
        if self.gathering:
            for i in buckets:
                self.streams.wait_bucket(i)

    def wait_gathered(self):
        """Make the compute stream wait for every bucket's all-gather."""
        if self.gathering:
            self.streams.after_comm()
            self.gathering = False

    def sync_parameters(self):
        """Gather the latest shards and wait: whole parameters for evaluation or saving."""
        self.gather_parameters()
        self.wait_gathered()

    # -- gradients: reduce-scatter each bucket as backward completes it
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
            self.gathering = False  # the wait above also covered this step's gathers
        self.begin_step()

    def read_exposed_comm(self):
        """Seconds per step the compute stream waited for communication (GPU: the wait for
        the reduce-scatters after backward; CPU: every collective), or None where it cannot
        be measured."""
        return self.streams.read_exposed() if self.size > 1 else 0.0
