"""``CompiledStep``: a user's step function run as the captured step of dptrain.run.step.

The batch goes through fixed device buffers (``StepInputs``): each call uploads the host
arrays into them (asynchronous, ordered on the current stream) and the captured step reads
them, so replaying the graph trains on the new batch. Their shapes and dtypes are those of
the first batch, because a replayed graph cannot change them. With ``accumulate=k`` the
step's function sees k micro-batches in turn: fixed views of k equal slices of the rows.

Labels: the first step records which batch arrays reach ``F.cross_entropy`` as labels and
with how many classes (the model's outputs), checking them there (dptrain.engine.functional
.watching_labels); every later batch's labels held on the host are checked on the host as
they are uploaded, so a label out of range is one line naming it, and the captured step
gains no synchronisation.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from dptrain.engine import functional as F
from dptrain.engine.autograd import Tensor
from dptrain.errors import BadArgument, UsageError
from dptrain.run.step import Step


def _leaves(batch, where="batch"):
    """(name, array) of every array in `batch` (an array, Tensor, or a tuple, list or dict
    of them), in a fixed order."""
    if isinstance(batch, dict):
        for key in batch:
            yield from _leaves(batch[key], f"{where}[{key!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, item in enumerate(batch):
            yield from _leaves(item, f"{where}[{i}]")
    elif isinstance(batch, Tensor):
        yield where, batch.data
    elif hasattr(batch, "shape") and hasattr(batch, "dtype"):
        yield where, batch
    else:
        raise UsageError(f"step: {where} is a {type(batch).__name__}; a batch is an array or "
                         f"a tuple, list or dict of arrays")


def _rebuild(batch, tensors):
    if isinstance(batch, dict):
        return {key: _rebuild(batch[key], tensors) for key in batch}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_rebuild(item, tensors) for item in batch)
    return next(tensors)


def _dtype(array) -> np.dtype:
    dtype = np.dtype(array.dtype)
    return np.dtype(np.float32) if dtype == np.float64 else dtype  # the parameters' dtype


def _describe(shape, dtype) -> str:
    return f"{tuple(shape)} {np.dtype(dtype).name}"


class StepInputs:
    """Device buffers shaped like the first batch; ``set(batch)`` copies a batch in."""

    def __init__(self, be, batch, accumulate=1):
        self.be = be
        leaves = list(_leaves(batch))
        self.names = [name for name, _ in leaves]
        for name, a in leaves:
            if accumulate > 1 and (not a.shape or a.shape[0] % accumulate):
                rows = a.shape[0] if a.shape else "no"
                raise UsageError(f"step: {name} has {rows} rows, which accumulate="
                                 f"{accumulate} cannot split into equal micro-batches")
        self.buffers = [be.empty(tuple(a.shape), _dtype(a)) for _, a in leaves]
        self.batch = _rebuild(batch, iter([Tensor(b) for b in self.buffers]))
        self.micro, self.owner = [], {}  # micro-batches; id(array) -> leaf index
        for i in range(accumulate if accumulate > 1 else 0):
            views = [b[i * (b.shape[0] // accumulate):(i + 1) * (b.shape[0] // accumulate)]
                     for b in self.buffers]
            self.owner.update({id(v): j for j, v in enumerate(views)})
            self.micro.append(_rebuild(batch, iter([Tensor(v) for v in views])))
        self.owner.update({id(b): j for j, b in enumerate(self.buffers)})
        self.labels = {}  # leaf index -> classes, found by the first step
        self.set(batch)

    def note_labels(self, seen):
        """Record the (labels array, classes) that the first step's cross_entropy saw."""
        for array, classes in seen:
            j = self.owner.get(id(array))
            if j is not None:
                self.labels[j] = min(classes, self.labels.get(j, classes))

    def check_labels(self, leaves):
        for j, classes in self.labels.items():
            name, array = leaves[j]
            if isinstance(array, np.ndarray) and array.size:
                F.check_labels(array, classes, name)

    def set(self, batch):
        leaves = list(_leaves(batch))
        if [name for name, _ in leaves] != self.names:
            raise UsageError(f"step: the batch holds {', '.join(n for n, _ in leaves)}; the "
                             f"step was compiled for {', '.join(self.names)}")
        for (name, array), buf in zip(leaves, self.buffers):
            if tuple(array.shape) != buf.shape or _dtype(array) != buf.dtype:
                raise UsageError(
                    f"step: {name} has shape {_describe(array.shape, _dtype(array))}, the "
                    f"compiled step {_describe(buf.shape, buf.dtype)} (a captured step replays "
                    f"fixed shapes: keep every batch the same size, e.g. drop the ragged last "
                    f"batch, or compile another step)")
        self.check_labels(leaves)
        for (_, array), buf in zip(leaves, self.buffers):
            if isinstance(array, np.ndarray):  # host (a memmap too): an upload on the stream
                self.be.runtime.upload_(buf, np.ascontiguousarray(array, buf.dtype))
            else:  # already on the device
                self.be.copy_(buf, array)


class CompiledStep:
    """``step(batch)`` trains on one batch (see DataParallel.compile); ``metrics()`` reads
    the loss and the step's metrics; ``steps`` counts the steps taken."""

    def __init__(self, ddp, fn, capture=True, reduce=None, accumulate=1, clip=None):
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise BadArgument(f"accumulate={accumulate!r}: a positive whole number of "
                              f"micro-batches")
        self.ddp, self.fn, self.accumulate = ddp, fn, accumulate
        self.inputs = None  # made from the first batch
        self.step = Step(ddp.optimizer, ddp.reducer, self._loss, ddp.guard, reduce,
                         accumulate=accumulate, clip=clip)
        self.run = ddp.capture(self.step) if capture else self.step
        self.steps, self.since_read = 0, 0

    def _loss(self, micro=None):
        out = self.fn(self.inputs.batch if micro is None else self.inputs.micro[micro])
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            return out
        if isinstance(out, tuple):
            raise UsageError(f"the step function returned a tuple of {len(out)}; return the "
                             f"loss, or (loss, {{name: metric}})")
        return out, {}

    def __call__(self, batch):
        first = self.inputs is None
        if first:
            self.inputs = StepInputs(self.ddp.be, batch, self.accumulate)
        else:
            self.inputs.set(batch)
        ddp, guard = self.ddp, self.ddp.protection
        ddp.optimizer.begin_step()  # this step's scalars (lr), host side
        with ddp.stepping(), guard.watch("step(batch)", self.steps + 1):
            if first:  # eager: which arrays are labels, and their check (see above)
                with F.watching_labels() as seen:
                    self.run()
                self.inputs.note_labels(seen)
            else:
                self.run()
        self.steps += 1
        self.since_read += 1
        guard.poll(self.steps)  # SIGINT / SIGTERM under dptrain.launch

    def metrics(self) -> dict:
        """{"loss": mean loss per step since the last read, averaged over the ranks, and
        each metric's mean per step (over the ranks by its reduction)}. A collective that
        synchronises: every rank calls it at the same step. Raises NonFiniteError where a
        NaN/inf loss or gradient stopped the run (dptrain.run.nonfinite). Read again before
        another step (or before the first): every value NaN, with a warning saying why
        (every rank agrees, so nothing is exchanged)."""
        ddp = self.ddp
        if self.since_read == 0:
            warnings.warn(f"step.metrics(): no step since the last read (step {self.steps}): "
                          f"NaN", stacklevel=2)
            return {name: math.nan for name in (self.step.sums or {"loss": None})}
        with ddp.protection.watch("step.metrics() (a collective: every rank calls it)",
                                  self.steps):
            sums = self.step.read_sums(ddp.world.comm)
            ddp.guard.read(self.steps)
            if ddp.scaler is not None:
                ddp.scaler.read(self.steps)
        n, self.since_read = self.since_read, 0
        return {name: value / n for name, value in sums.items()}
