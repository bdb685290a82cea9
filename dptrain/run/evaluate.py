"""Evaluation: ``evaluate`` validates during training on the device (each rank takes every N-th
image, sums all-reduced, one host read at the end); ``predict`` gives every image's predicted
class for `python -m dptrain eval`; ``broadcast_buffers`` gives every rank rank 0's batch-norm
estimates before either."""
from __future__ import annotations

import numpy as np

import dptrain.engine.functional as F
from dptrain.distributed import LocalComm
from dptrain.engine.autograd import Tensor, no_grad


EVAL_BATCH = 1000  # images per evaluation forward


def eval_batch_sizes(num_images, world=None, batch_size=EVAL_BATCH) -> list[int]:
    """The batch sizes ``evaluate`` feeds this rank's model: full batches, then the rest."""
    rank, size = (world.rank, world.size) if world else (0, 1)
    mine = len(range(rank, num_images, size))
    return [n for n in dict.fromkeys((min(batch_size, mine), mine % batch_size)) if n]


def evaluate(model, loader, world=None, batch_size=EVAL_BATCH, dtype=np.float32) -> dict:
    """Mean loss and accuracy over a loader's whole set, the model fed `dtype` activations
    (marked laid out where the loader has a layout). Each rank takes every N-th image and the
    sums are all-reduced; one host read at the end."""
    be = loader.be
    rank, size = (world.rank, world.size) if world else (0, 1)
    comm = world.comm if world else LocalComm(be)
    model.eval()
    n = loader.num_images
    mine = np.arange(rank, n, size, dtype=np.int64)
    sums = be.zeros((2,), np.float32)  # loss * count, correct
    loss_sum, correct = sums[0:1].reshape(()), sums[1:2].reshape(())
    with no_grad():
        for start in range(0, len(mine), batch_size):
            idx = mine[start : start + batch_size]
            x, y = loader.gather(idx)
            x = F.laid_out(Tensor(x), loader.layout)  # marked where the loader laid it out
            logits = F.cast(model(F.cast(x, dtype)), np.float32)
            loss = F.cross_entropy(logits, Tensor(y)).data
            be.add_(loss_sum, be.scale(loss, float(len(idx))))
            be.add_(correct, be.count_correct(logits.data, y))
    model.train()
    comm.all_reduce(sums, "sum")
    total_loss, total_correct = be.to_numpy(sums).tolist()
    return {"val_loss": total_loss / n, "val_accuracy": total_correct / n}


def broadcast_buffers(model, comm, root: int = 0):
    """Give every rank rank `root`'s buffers (batch norm's running estimates): at the start,
    like the parameters, and before evaluating or saving, where per-rank statistics may have
    drifted apart (as PyTorch's DDP does with its buffers)."""
    for buf in model.buffers():
        comm.broadcast(buf.data.reshape(-1), root)


def predict(model, loader, labels: np.ndarray, batch_size: int):
    """(predicted class of every image, summed cross-entropy in float64) over the loader's
    images in order, on one process."""
    be = loader.be
    total = len(labels)
    predictions = np.empty(total, dtype=np.int64)
    loss_sum = 0.0
    model.eval()
    with no_grad():
        for start in range(0, total, batch_size):
            idx = np.arange(start, min(total, start + batch_size))
            x, _ = loader.gather(idx)
            logits = be.to_numpy(model(F.laid_out(Tensor(x), loader.layout)).data)
            logits = logits.astype(np.float64)
            peak = logits.max(axis=1, keepdims=True)
            log_norm = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
            loss_sum += float((log_norm - logits[np.arange(len(idx)), labels[idx]]).sum())
            predictions[idx] = logits.argmax(axis=1)
    model.train()
    return predictions, loss_sum
