"""Losses composed from the primitives of dptrain.engine.ops, so every backend runs them
with the kernels it already has, and their gradients follow from the primitives' own.

All of them average over every element (PyTorch's reduction="mean") and return a scalar.
"""
from __future__ import annotations

import numpy as np

from dptrain.engine import ops
from dptrain.engine.autograd import Tensor


def _target(target, like: Tensor, op: str) -> Tensor:
    if not isinstance(target, Tensor):
        target = Tensor(like.be.asarray(np.asarray(target, dtype=like.dtype)))
    if target.shape != like.shape:
        raise ValueError(f"{op}: target has shape {target.shape}, the input {like.shape}")
    if target.dtype.kind != "f":
        raise ValueError(f"{op}: target must be floating point, got {target.dtype}")
    return target


def mse_loss(input: Tensor, target) -> Tensor:  # noqa: A002 - PyTorch's name
    """Mean of (input - target)^2 over every element; target of input's shape."""
    diff = input - _target(target, input, "mse_loss")
    return ops.Mean.apply(diff * diff, axis=None, keepdims=False)


def binary_cross_entropy_with_logits(logits: Tensor, targets) -> Tensor:
    """Mean over every element of -[t log sigmoid(x) + (1 - t) log sigmoid(-x)]: independent
    yes/no labels (multi-label), targets in [0, 1] of the logits' shape."""
    targets = _target(targets, logits, "binary_cross_entropy_with_logits")
    n = logits.size
    # log sigmoid(x) and log sigmoid(-x) are the log-softmax of [0, x]: stable at any |x|
    zero = Tensor(logits.be.zeros((n, 1), logits.dtype))
    pair = ops.Concatenate.apply(zero, ops.Reshape.apply(logits, shape=(n, 1)), axis=1)
    log_pq = ops.LogSoftmax.apply(pair)
    log_not = ops.GetItem.apply(log_pq, index=(slice(None), 0))
    log_yes = ops.GetItem.apply(log_pq, index=(slice(None), 1))
    t = ops.Reshape.apply(targets, shape=(n,))
    per_element = t * (log_yes - log_not) + log_not
    return -ops.Mean.apply(per_element, axis=None, keepdims=False)


def smoothed_cross_entropy(logits: Tensor, labels: Tensor, smoothing: float) -> Tensor:
    """Cross-entropy against (1 - s) one-hot + s / C (PyTorch's label_smoothing=s):
    (1 - s) * CE(logits, labels) + s * mean over the batch of -mean_c log softmax(logits)."""
    ce = ops.CrossEntropy.apply(logits, labels)
    log_p = ops.LogSoftmax.apply(logits)
    uniform = -ops.Mean.apply(log_p, axis=None, keepdims=False)  # mean over batch and classes
    return ce * (1.0 - smoothing) + uniform * smoothing
