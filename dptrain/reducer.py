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


class _NoStreams:
    """CPU: collectives run synchronously where they are issued."""

    def before_comm(self):
        return None

    def after_comm(self):
        pass


class _CudaStreams:
    """GPU: a dedicated communication stream, ordered against compute with events."""

    def __init__(self):
        import cupy

        self.cupy = cupy
        self.comm = cupy.cuda.Stream(non_blocking=True)

    def before_comm(self):
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(self.cupy.cuda.get_current_stream())
        self.comm.wait_event(event)
        return self.comm

    def after_comm(self):
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(self.comm)
        self.cupy.cuda.get_current_stream().wait_event(event)


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
            self.comm.reduce_scatter(*args)
        else:
            self.comm.reduce_scatter(*args, stream=stream)

    def finish_backward(self):
        """Send buckets whose gradients never arrived (unused parameters), then wait for all."""
        for i in range(len(self.flat.buckets)):
            self._reduce_scatter(i)
        if self.size > 1:
            self.streams.after_comm()
        self.begin_step()

    def all_gather(self):
        if self.size == 1:
            return
        data = self.flat.data
        for bucket in self.flat.buckets:
            start, stop = bucket.shard(self.rank, self.size)
            self.comm.all_gather(data[start:stop], data[bucket.start : bucket.stop])
