"""Flat buffers: every parameter of a model in one contiguous array, every gradient in another.

Each parameter's ``data`` and ``grad`` become views into the two buffers, so the
optimizer updates all of them with one kernel, zeroing gradients is one fill,
and the gradient exchange moves a few large contiguous pieces instead of one
small message per parameter. The buffers are padded so that their length
divides by ``pad_multiple`` (the world size times an alignment), which lets
every rank own an equal, aligned shard.
"""
from __future__ import annotations

from dptrain.autograd import Tensor

ALIGN = 64  # elements: each parameter starts on a 256-byte boundary (float32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FlatParameters:
    def __init__(self, params, pad_multiple: int = 1):
        params = list(params)
        if not params:
            raise ValueError("no parameters to flatten")
        be, dtype = params[0].be, params[0].dtype
        for p in params:
            if p.dtype != dtype or p.device != params[0].device:
                raise ValueError("all parameters must share one dtype and device to be flattened")
        self.be, self.dtype, self.params = be, dtype, params
        self.offsets, offset = [], 0
        for p in params:
            self.offsets.append(offset)
            offset = _round_up(offset + p.size, ALIGN)
        self.numel = _round_up(max(offset, 1), ALIGN * pad_multiple)
        self.data = be.zeros((self.numel,), dtype)
        self.grad = be.zeros((self.numel,), dtype)
        for p, start in zip(params, self.offsets):
            view = self.data[start : start + p.size]
            be.copy_(view, p.data.reshape(-1))
            p.data = view.reshape(p.shape)
            p.grad = Tensor(self.grad[start : start + p.size].reshape(p.shape))

    def zero_grad(self):
        self.be.fill_(self.grad, 0.0)

    def shard(self, rank: int, world_size: int) -> tuple[int, int]:
        """The [start, stop) range of the flat buffers that `rank` owns."""
        size = self.numel // world_size
        return rank * size, (rank + 1) * size
