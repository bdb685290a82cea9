"""Gradient exchange: reduce-scatter each bucket as backward completes it, update the shard,
all-gather the parameters while the next forward begins.

Per step:
  1. ``gather_parameters`` all-gathers every bucket (the shards the ranks updated last
     step), first layers first, on a communication stream; each layer's forward waits
     only for its own bucket, so the large late layers' gathers overlap the early layers'
     forward. (On the first step the gather changes nothing: every rank already holds
     rank 0's broadcast parameters.) Under mixed precision it gathers the parameters'
     16-bit shadow (dptrain.distributed.flat), which is all the layers read, at half the bytes; the
     fp32 ``data`` then stays current only in this rank's shard.
  2. backward runs; when the last gradient of a bucket is accumulated, that bucket's
     reduce-scatter (mean over ranks) is issued on the communication stream, ordered after
     the compute stream by an event, so it overlaps the rest of backward;
  3. ``finish_backward`` issues any bucket not yet sent and makes the compute stream wait;
  4. the optimizer updates only this rank's shard of each bucket (ZeRO-1).
``sync_parameters`` gathers the fp32 ``data`` and waits at once, then casts the whole
shadow from it, before anything reads whole parameters outside a step (evaluation, saving,
checkpoints, the replica check): they see fp32 master weights exactly as without a shadow.
Reduce-scatter and all-gather work in place in the flat buffers: rank r's shard of a bucket
is the r-th of its N slices.

Gradient exchange dtype (``exchange``): "fp32" reduce-scatters the fp32 gradients in place.
"bf16" casts each bucket to a 16-bit copy (bfloat16, uint16 storage; dptrain.backend.bfloat16)
on the communication stream, reduce-scatters that copy in place (half the bytes) and widens
the mean of this rank's shard back into the fp32 gradient shard, which the optimizer reads
as before. The widened mean overwrites the shard: its own fp32 values were one of the summands.
With one rank nothing is exchanged, so both dtypes train bit for bit alike.

A ``Timeline`` (dptrain.distributed.timeline), when set as ``reducer.timeline``, gets per-bucket
reduce-scatter / all-gather spans on the communication stream and marks on the compute stream
(a bucket's gradients complete, the forward has its gathered bucket, backward waits).

Streams, events and the timing of exposed communication come from the backend's runtime,
so this file reads the same on every device (on the CPU the streams are one, the events
tokens, and every collective completes where it is issued).
"""
from __future__ import annotations

import contextlib

from dptrain.backend.bfloat16 import BFLOAT16

EXCHANGES = ("fp32", "bf16")  # dtype of the gradients' reduce-scatter


class Reducer:
    def __init__(self, flat, world, model=None, exchange="fp32"):
        if exchange not in EXCHANGES:
            raise ValueError(f"gradient exchange {exchange!r}: choose one of {', '.join(EXCHANGES)}")
        self.flat, self.world, self.comm = flat, world, world.comm
        self.exchange, self.timeline = exchange, None
        self.rank, self.size = world.rank, world.size
        self.rt = flat.be.runtime
        nb = len(flat.buckets)
        self.timer = self.rt.comm_timer()
        self.gathered = [None] * nb  # per bucket: the event its all-gather completes
        self.waited = [False] * nb  # per bucket: the compute stream waited for it this step
        self.bucket_of = {id(p): i for i, b in enumerate(flat.buckets) for p in b.params}
        self.pending, self.sent = [0] * nb, [False] * nb
        self.gathering = False
        # True while backward runs a micro-batch before the last (gradient accumulation,
        # dptrain.run.step): gradients only add up, nothing is sent until the last one
        self.holding = False
        # the 16-bit copy of the gradients that bf16 reduce-scatters (fixed: capture-friendly)
        self.grad16 = (flat.be.empty((flat.numel,), BFLOAT16)
                       if exchange == "bf16" and self.size > 1 else None)
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
        self.sync_parameters()  # and the shadow from the broadcast parameters

    def begin_step(self):
        self.pending = [len(b.params) for b in self.flat.buckets]
        self.sent = [False] * len(self.flat.buckets)

    # -- parameters: all-gather the updated shards
    def gather_parameters(self):
        """Issue the all-gather of every bucket, first layers (the last buckets) first: of
        the 16-bit shadow where there is one (what the layers read), else of the fp32 data."""
        shadow = self.flat.shadow
        self._gather(shadow if shadow is not None else self.flat.data)

    def _gather(self, data):
        if self.size == 1:
            return
        rt, comm_stream = self.rt, self.rt.comm_stream()
        rt.order(comm_stream, rt.current_stream())
        with rt.on(comm_stream):
            for i in reversed(range(len(self.flat.buckets))):
                bucket = self.flat.buckets[i]
                start, stop = bucket.shard(self.rank, self.size)
                with self._span("all_gather", i, comm_stream):
                    self.timer.issue(self.comm.all_gather, data[start:stop],
                                     data[bucket.start : bucket.stop])
                self.gathered[i] = rt.record(comm_stream)
                self.waited[i] = False
        self.gathering = True
        if not self.model_hooks:
            self.wait_gathered()

    def _wait_gathered(self, buckets):
        if self.gathering:
            for i in buckets:
                if not self.waited[i]:  # once per step: later layers of the bucket have it
                    self.rt.wait(self.gathered[i])
                    self.waited[i] = True
                    self.mark("have_gather", i)

    def wait_gathered(self):
        """Make the compute stream wait for every bucket's all-gather."""
        if self.gathering:
            self.rt.order(self.rt.current_stream(), self.rt.comm_stream())
            self.gathering = False

    def sync_parameters(self):
        """Gather the latest fp32 shards and wait, then cast the whole shadow from them:
        whole, current parameters in both dtypes for evaluation, saving or checking."""
        self._gather(self.flat.data)
        self.wait_gathered()
        self.flat.cast_shadow()

    # -- gradients: reduce-scatter each bucket as backward completes it
    def _grad_ready(self, param):
        if self.holding:
            return
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
        rt, comm_stream, grad = self.rt, self.rt.comm_stream(), self.flat.grad
        self.mark("grads_ready", i)
        rt.order(comm_stream, rt.current_stream())  # after backward wrote this bucket
        with rt.on(comm_stream), self._span("reduce_scatter", i, comm_stream):
            if self.grad16 is None:
                self.timer.issue(self.comm.reduce_scatter, grad[bucket.start : bucket.stop],
                                 grad[start:stop])
            else:
                self.timer.issue(self._reduce_scatter_16, bucket, start, stop)

    def _reduce_scatter_16(self, bucket, start, stop):
        """The bucket's 16-bit copy, reduce-scattered in place, widened into the fp32 shard."""
        be, grad, low = self.flat.be, self.flat.grad, self.grad16
        be.copy_(low[bucket.start : bucket.stop], grad[bucket.start : bucket.stop])
        self.comm.reduce_scatter(low[bucket.start : bucket.stop], low[start:stop])
        be.copy_(grad[start:stop], low[start:stop])

    def finish_backward(self):
        """Send buckets whose gradients never arrived (unused parameters), then wait for all."""
        if self.size > 1:
            self.timer.wait_begin()
        for i in range(len(self.flat.buckets)):
            self._reduce_scatter(i)
        if self.size > 1:
            self.mark("backward_end")
            self.rt.order(self.rt.current_stream(), self.rt.comm_stream())
            self.mark("exchange_waited")
            self.timer.wait_end()
            self.gathering = False  # the wait above also covered this step's gathers
        self.begin_step()

    # -- timeline marks (nothing without a timeline)
    def mark(self, name, bucket=None):
        """A mark on the compute stream of the step's timeline, if it has one."""
        if self.timeline is not None:
            self.timeline.mark("compute", name, self.rt.current_stream(), bucket)

    def _span(self, name, bucket, stream):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span("comm", name, stream, bucket)

    def read_exposed_comm(self):
        """Seconds per step the compute stream waited for communication (GPU: the wait for
        the reduce-scatters after backward; CPU: every collective), or None where it cannot
        be measured."""
        return self.timer.read() if self.size > 1 else 0.0
