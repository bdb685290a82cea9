"""Gradient clipping by global norm, inside the (captured) step, across the shards.

After the exchange each rank holds the averaged gradient of its shard only (ZeRO-1), so the
norm of the whole gradient is assembled on the device:

    sq     = sum over this rank's shard segments of sum(g * g)
    sq     = all-reduce(sq, sum)               one scalar; the shards do not overlap
    norm   = sqrt(sq)
    factor = max_norm / max(norm, max_norm)    = min(1, max_norm / norm)
    g     *= factor                            this rank's segments

No value reaches the host, so a replayed graph clips too; the result is the full gradient
clipped on one process (to float rounding: the sum of squares is summed in another order).
PyTorch's clip_grad_norm_ divides by norm + 1e-6; here no epsilon is needed (a zero norm
gives factor 1). The norm before clipping is the step's ``grad_norm`` metric. It runs after
the non-finite guard, which unscales fp16's gradients: the norm is that of the true ones.
"""
from __future__ import annotations

import math

import numpy as np

from dptrain.errors import BadArgument


class ClipGradNorm:
    def __init__(self, flat, segments, comm, max_norm: float):
        try:
            max_norm = float(max_norm)
        except (TypeError, ValueError):
            max_norm = float("nan")
        if not math.isfinite(max_norm) or max_norm <= 0:
            raise BadArgument(f"clip_grad_norm must be a positive number, got {max_norm!r}")
        be = flat.be
        self.be, self.flat, self.segments, self.comm = be, flat, list(segments), comm
        self.max_norm = max_norm
        self.sq = be.zeros((1,), np.float32)  # fixed buffers: capture-friendly
        self.limit = be.full((1,), max_norm, np.float32)

    def __call__(self):
        """Clip this rank's shard of the gradient in place; returns the norm before (a
        one-element device array)."""
        be, grad = self.be, self.flat.grad
        be.fill_(self.sq, 0.0)
        for start, stop in self.segments:
            g = grad[start:stop]
            be.add_(self.sq, be.sum(be.mul(g, g)).reshape(1))
        self.comm.all_reduce(self.sq, "sum")
        norm = be.sqrt(self.sq)
        factor = be.div(self.limit, be.max(be.concatenate([norm, self.limit], 0)).reshape(1))
        for start, stop in self.segments:
            g = grad[start:stop]
            be.copy_(g, be.mul(g, factor))
        return norm.reshape(())
