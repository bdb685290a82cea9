"""Flat buffers: every parameter of a model in one contiguous array, every gradient in another.

Each parameter's ``data`` and ``grad`` become views into the two buffers, so the
optimizer updates all of them with a few kernels, zeroing gradients is one fill,
and the gradient exchange moves a few large contiguous pieces instead of one
small message per parameter.

Parameters are laid out in reverse order (the last layer first), grouped into
buckets of about ``bucket_bytes`` (backward's first, ``first_bucket_bytes`` where given):
backward produces gradients last layer first, so each bucket is complete, and its exchange
can start, while backward still works on earlier layers. Every bucket's length divides by the world size
times an alignment, so each rank owns an equal, aligned slice of each bucket.

Mixed precision (``shadow_dtype``, float16 or bfloat16) adds a third buffer, ``shadow``: the
fp32 ``data`` cast to the 16-bit dtype, laid out alike, with each parameter's slice as
``p.shadow``. The layers read it instead of casting their weights every forward, and the
all-gather moves it instead of ``data`` (half the bytes). Whoever writes ``data`` keeps it
current: the optimizer its updated shard (SGD and AdamW in their update's own pass, others by
``cast_shadow`` after it), the reducer the whole buffer after a broadcast or a gather of
``data`` (dptrain.distributed.reducer), a resume after loading.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dptrain.engine.autograd import Tensor, grads_zeroed

ALIGN = 64  # elements: each parameter and shard starts on a 256-byte boundary (float32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Bucket:
    start: int
    stop: int
    params: list = field(default_factory=list)

    def shard(self, rank: int, world_size: int) -> tuple[int, int]:
        size = (self.stop - self.start) // world_size
        return self.start + rank * size, self.start + (rank + 1) * size


class FlatParameters:
    def __init__(self, params, world_size: int = 1, bucket_bytes: int | None = None,
                 shadow_dtype=None, first_bucket_bytes: int | None = None):
        params = list(params)
        if not params:
            raise ValueError("no parameters to flatten")
        be, dtype = params[0].be, params[0].dtype
        for p in params:
            if p.dtype != dtype or p.device != params[0].device:
                raise ValueError("all parameters must share one dtype and device to be flattened")
        self.be, self.dtype, self.params, self.world_size = be, dtype, params, world_size
        limit = bucket_bytes // dtype.itemsize if bucket_bytes else None
        # backward's first bucket may be smaller, so its reduce-scatter starts early
        first = first_bucket_bytes // dtype.itemsize if first_bucket_bytes else limit
        self.buckets, self.offsets, offset = [], {}, 0
        bucket = Bucket(0, 0)
        for p in reversed(params):
            cap = first if not self.buckets else limit
            if bucket.params and cap is not None and offset - bucket.start + p.size > cap:
                bucket = self._close(bucket, offset)
                offset = bucket.start
            self.offsets[id(p)] = offset
            bucket.params.append(p)
            offset = _round_up(offset + p.size, ALIGN)
        self._close(bucket, offset)
        self.numel = self.buckets[-1].stop
        self.data = be.zeros((self.numel,), dtype)
        self.grad = be.zeros((self.numel,), dtype)
        for p in params:
            start = self.offsets[id(p)]
            view = self.data[start : start + p.size]
            be.copy_(view, p.data.reshape(-1))
            p.data = view.reshape(p.shape)
            p.grad = Tensor(self.grad[start : start + p.size].reshape(p.shape))
        self.shadow = None
        if shadow_dtype is not None:
            self.shadow = be.empty((self.numel,), shadow_dtype)
            for p in params:
                start = self.offsets[id(p)]
                p.shadow = self.shadow[start : start + p.size].reshape(p.shape)
            self.cast_shadow()

    def _close(self, bucket: Bucket, offset: int) -> Bucket:
        bucket.stop = _round_up(max(offset, bucket.start + 1), ALIGN * self.world_size)
        self.buckets.append(bucket)
        return Bucket(bucket.stop, bucket.stop)

    def zero_grad(self):
        self.be.fill_(self.grad, 0.0)
        grads_zeroed(self.params)  # so a gradient may be written into its .grad, not added

    def cast_shadow(self, segments=None):
        """shadow[start:stop] = data[start:stop] in 16 bits, one cast per [start, stop) of
        `segments` (default: the whole buffer); nothing without a shadow. Casting here what
        each rank updated gives the bits every layer's own cast of the weights gave."""
        if self.shadow is None:
            return
        for start, stop in segments if segments is not None else [(0, self.numel)]:
            self.be.copy_(self.shadow[start:stop], self.data[start:stop])

    def shard_segments(self, rank: int) -> list[tuple[int, int]]:
        """The [start, stop) ranges of the flat buffers that `rank` owns, one per bucket."""
        return [b.shard(rank, self.world_size) for b in self.buckets]
