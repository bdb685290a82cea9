"""``TrainStep``: everything one step runs on the device.

All-gather the parameters, take the batch from the device loader, forward, backward with the
gradient exchange, optimizer update (in mixed precision ending with the cast of the updated
shard to 16 bits), metric sums. It reads no device value on the host, so the backend's
runtime can capture it once and replay it.
"""
from __future__ import annotations

import numpy as np

import dptrain.engine.functional as F
from dptrain.engine.autograd import Tensor

# capture() runs this many eager steps before it records the graph; the throughput meter
# leaves out those and the capturing step (CAPTURE_WARMUP + 1 steps): see warmup_steps_excluded.
CAPTURE_WARMUP = 2


class TrainStep:
    """One optimisation step on the loader's current batch, metrics summed on the device."""

    def __init__(self, model, optimizer, reducer, loader, guard=None, dtype=np.float32):
        self.model, self.opt, self.reducer, self.loader = model, optimizer, reducer, loader
        self.guard = guard  # the non-finite check: decides on the device if the update applies
        self.dtype = np.dtype(dtype)  # of the activations (float16: mixed precision, dptrain.run.amp)
        self.scaler = guard.scaler if guard is not None else None
        self.be = optimizer.be
        self.loss_sum = self.be.zeros((), optimizer.flat.dtype)
        self.correct_sum = self.be.zeros((), np.float32)

    def __call__(self):
        be = self.be
        self.reducer.gather_parameters()  # last step's updated shards; overlaps the forward
        x, y = self.loader.batch()
        self.opt.zero_grad()
        logits = F.cast(self.model(F.cast(Tensor(x), self.dtype)), np.float32)
        loss = F.cross_entropy(logits, Tensor(y))
        # buckets start their reduce-scatter as their gradients complete
        loss.backward(self.scaler.seed() if self.scaler is not None else None)
        self.reducer.finish_backward()
        if self.guard is not None:
            self.guard(loss.data)
        self.opt.update()  # this rank's shard only; gathered at the start of the next step
        be.add_(self.loss_sum, loss.data)
        be.add_(self.correct_sum, be.count_correct(logits.data, y))

    # -- the logging window, for checkpoints: a resumed run logs the uninterrupted run's values
    def window_state(self) -> list[float]:
        """This rank's metric sums since the last read (host floats; synchronises)."""
        return [float(self.be.to_numpy(self.loss_sum)), float(self.be.to_numpy(self.correct_sum))]

    def set_window_state(self, values) -> None:
        loss, correct = (float(v) for v in values)
        self.be.runtime.upload_(self.loss_sum, np.array(loss, self.loss_sum.dtype))
        self.be.runtime.upload_(self.correct_sum, np.array(correct, np.float32))

    def read_metrics(self, comm) -> tuple[float, float]:
        """(sum of losses averaged over ranks, correct predictions summed over ranks) since
        the last read. Every rank calls this at the same step (collectives); it synchronises."""
        comm.all_reduce(self.loss_sum.reshape(1), "mean")
        comm.all_reduce(self.correct_sum.reshape(1), "sum")
        loss, correct = float(self.be.to_numpy(self.loss_sum)), float(
            self.be.to_numpy(self.correct_sum))
        self.be.fill_(self.loss_sum, 0.0)
        self.be.fill_(self.correct_sum, 0.0)
        return loss, correct
