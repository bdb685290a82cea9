"""The captured step: everything one optimisation step runs on the device.

``Step`` is the machinery every training step shares, whoever wrote its loss: all-gather
the parameters, zero the gradients, call the loss function (forward), backward with the
gradient exchange, the non-finite guard, the optimizer update of this rank's shard (in
mixed precision ending with the cast of that shard to 16 bits), and the metric sums. It
reads no device value on the host, so the backend's runtime can capture it once and replay
it. Two options, off by default (the step then runs exactly the launches it always ran):

  * ``accumulate=k``: k forward/backward passes (micro-batches) into the same gradients,
    the reducer holding every bucket's exchange until the last one's backward, then one
    exchange and one update; each micro-batch's loss seeds backward with 1/k of its
    gradient, so the step equals one step on the k micro-batches together (to float
    rounding). The step's loss is the micro-batches' mean; a metric reduced by "mean" is
    averaged over them, by "sum" summed (micro-batches combine as ranks do).
  * ``clip``: a ClipGradNorm (dptrain.run.clip) applied after the guard, before the update;
    its norm becomes the ``grad_norm`` metric.

``TrainStep`` is `train`'s classification step on top of it; ``dptrain.run.parallel``
(the public ``DataParallel``) puts a user's step function on top of it.
"""
from __future__ import annotations

import contextlib

import numpy as np

import dptrain.engine.functional as F
from dptrain.engine.autograd import Tensor
from dptrain.errors import UsageError

# capture() runs this many eager steps before it records the graph; the throughput meter
# leaves out those and the capturing step (CAPTURE_WARMUP + 1 steps): see warmup_steps_excluded.
CAPTURE_WARMUP = 2
REDUCTIONS = ("mean", "sum")  # how a metric combines over the ranks


class Step:
    """One optimisation step around ``loss_fn() -> (loss, {name: value})``.

    ``loss`` is a scalar Tensor that requires grad; the values (Tensors or device arrays of
    a fixed shape) are summed on the device, step after step, until ``read_sums``.
    ``reduce`` maps a metric name to how ``read_sums`` combines it over the ranks, "mean"
    (default) or "sum"; the loss is averaged.
    """

    def __init__(self, optimizer, reducer, loss_fn, guard=None, reduce=None, accumulate=1,
                 clip=None):
        self.opt, self.reducer, self.loss_fn, self.guard = optimizer, reducer, loss_fn, guard
        self.accumulate, self.clip = int(accumulate), clip
        self.scaler = guard.scaler if guard is not None else None
        self.be = optimizer.be
        self.reduce = dict(reduce or {})
        for name, how in self.reduce.items():
            if how not in REDUCTIONS:
                raise ValueError(f"metric {name!r}: reduce over ranks by one of "
                                 f"{REDUCTIONS}, got {how!r}")
        self.sums = None  # name -> device array, made by the first (eager) call
        self._operands = False  # the weights' operands reordered ahead: made by the first call
        self._window = None  # sums to start from (a resumed run's, TrainStep)

    def __call__(self):
        self.reducer.mark("step_begin")  # timeline marks: nothing without a timeline
        self.reducer.gather_parameters()  # last step's updated shards; overlaps the forward
        self.opt.zero_grad()
        operands = self._weight_operands()
        with operands.ready() if operands is not None else contextlib.nullcontext():
            if self.accumulate == 1:
                loss, metrics = self.loss_fn()
                _check_loss(loss)
                # buckets start their reduce-scatter as their gradients complete
                loss.backward(self.scaler.seed() if self.scaler is not None else None)
                loss = loss.data
            else:
                loss, metrics = self._micro_batches()
        self.reducer.finish_backward()
        if self.guard is not None:
            self.guard(loss)
        if self.clip is not None:
            metrics = {**metrics, "grad_norm": self.clip()}
        self.opt.update()  # this rank's shard only; gathered at the start of the next step
        self._accumulate({"loss": loss, **metrics})
        self.reducer.mark("step_end")

    def _weight_operands(self):
        """The 16-bit convolution weights' operands reordered now, in one launch, for the
        forward and backward to take (be.conv2d_weight_operands), or None: on one process
        only, where no gather of the weights overlaps the forward (N ranks reorder each
        weight as its layer runs, after its bucket's gather)."""
        if self._operands is False:
            shadows = [getattr(p, "shadow", None) for p in self.reducer.flat.params]
            self._operands = (self.be.conv2d_weight_operands([w for w in shadows
                                                               if w is not None])
                              if self.reducer.size == 1 else None)
        if self._operands is not None:
            self._operands.refresh()
        return self._operands

    def _micro_batches(self):
        """``loss_fn(i)`` and its backward for each micro-batch i, the exchange held until
        the last: (the mean loss, the metrics combined), device arrays."""
        be, k = self.be, self.accumulate
        loss_sum, sums = None, {}
        try:
            for i in range(k):
                self.reducer.holding = i < k - 1
                loss, metrics = self.loss_fn(i)
                _check_loss(loss)
                seed = (self.scaler.seed().data if self.scaler is not None
                        else be.full(tuple(loss.shape), 1.0, loss.dtype))
                loss.backward(Tensor(be.scale(seed, 1.0 / k)))
                parts = {k_: v.data if isinstance(v, Tensor) else v for k_, v in metrics.items()}
                parts["loss"] = loss.data
                for name, value in parts.items():
                    if self.reduce.get(name, "mean") == "mean":
                        value = be.scale(value, 1.0 / k)
                    sums[name] = value if i == 0 else be.add(sums[name], value)
        finally:
            self.reducer.holding = False
        return sums.pop("loss"), sums

    def _accumulate(self, values):
        be = self.be
        arrays = {k: v.data if isinstance(v, Tensor) else v for k, v in values.items()}
        if self.sums is None:  # eager, before any capture: fixed buffers from here on
            self.sums = {k: be.zeros(tuple(a.shape), np.float32) for k, a in arrays.items()}
            if self._window:
                self._restore_window()
        if set(arrays) != set(self.sums):
            raise UsageError(f"the step returned metrics {sorted(arrays)}, earlier steps "
                             f"{sorted(self.sums)}: return the same names every step")
        for name, value in arrays.items():
            if tuple(value.shape) != self.sums[name].shape:
                raise UsageError(f"metric {name!r} has shape {tuple(value.shape)}, earlier "
                                 f"steps {self.sums[name].shape}")
            be.add_(self.sums[name], value)

    def read_sums(self, comm) -> dict:
        """{name: sum since the last read, combined over the ranks} as host floats (arrays
        for metrics that are not scalars), then zeroed. Every rank calls this at the same
        step (collectives); it synchronises."""
        out = {}
        for name, buf in (self.sums or {}).items():
            comm.all_reduce(buf.reshape(-1), self.reduce.get(name, "mean"))
            host = self.be.to_numpy(buf)
            out[name] = float(host) if host.ndim == 0 else host.copy()
            self.be.fill_(buf, 0.0)
        return out


def _check_loss(loss):
    if not isinstance(loss, Tensor):
        raise UsageError(f"the step function must return the loss as a Tensor (or (loss, "
                         f"metrics)), got {type(loss).__name__}")
    if loss.size != 1 or not loss.requires_grad:
        why = "does not require grad" if loss.size == 1 else f"has shape {loss.shape}"
        raise UsageError(f"the step function's loss must be a scalar Tensor computed from the "
                         f"model's parameters; it {why}")


class TrainStep(Step):
    """`train`'s step: cross-entropy on the loader's current batch, correct predictions summed
    as a metric. A loader with a layout gives the model its batch marked laid out."""

    def __init__(self, model, optimizer, reducer, loader, guard=None, dtype=np.float32):
        super().__init__(optimizer, reducer, self._classify, guard, reduce={"correct": "sum"})
        self.model, self.loader = model, loader
        self.dtype = np.dtype(dtype)  # of the activations (16-bit: mixed precision, run.amp)

    def _classify(self):
        x, y = self.loader.batch()
        x = F.laid_out(Tensor(x), self.loader.layout)  # marked where the loader laid it out
        logits = self.model(F.cast(x, self.dtype))  # 16-bit ones: the loss reads
        loss = F.cross_entropy(logits, Tensor(y))   # them as float32 (no cast pass)
        return loss, {"correct": self.be.count_correct(logits.data, y)}

    # -- the logging window, for checkpoints: a resumed run logs the uninterrupted run's values
    def window_state(self) -> list[float]:
        """This rank's [loss, correct] sums since the last read (host floats; synchronises)."""
        if self.sums is None:
            return [0.0, 0.0]
        return [float(self.be.to_numpy(self.sums[k])) for k in ("loss", "correct")]

    def set_window_state(self, values) -> None:
        """Start the sums from a checkpoint's window (before or after the first step)."""
        self._window = dict(zip(("loss", "correct"), (float(v) for v in values)))
        if self.sums is not None:
            self._restore_window()

    def _restore_window(self):
        for name, value in self._window.items():
            self.be.runtime.upload_(self.sums[name], np.array(value, np.float32))
        self._window = None

    def read_metrics(self, comm) -> tuple[float, float]:
        """(sum of losses averaged over ranks, correct predictions summed over ranks) since
        the last read. Every rank calls this at the same step (collectives); it synchronises."""
        sums = self.read_sums(comm)
        return sums.get("loss", 0.0), sums.get("correct", 0.0)
