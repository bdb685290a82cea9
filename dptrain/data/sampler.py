"""Stride sharding of one shared permutation.

Every rank draws the same permutation of the dataset for an epoch, from (seed, epoch),
and rank r takes positions r, r+N, r+2N, ... of it. Cut into global batches of N*B, the
union of all ranks' batch k is exactly the single-process batch k of size N*B:

    single process:  perm[k*N*B : (k+1)*N*B]
    rank r:          perm[k*N*B + r : (k+1)*N*B : N]

so N-rank training follows 1-rank training at the same global batch, up to float
rounding (the averaged gradient is the same sum). Every rank runs the same number of
steps, so no rank waits in a collective that the others never enter.
"""
from __future__ import annotations

import numpy as np

from dptrain.errors import BadArgument


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise BadArgument(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class StrideSampler:
    """Per-rank batches of dataset indices for each epoch.

    ``batch_size`` is per rank; the global batch is ``batch_size * world_size``. With
    ``drop_last`` the ragged tail of the permutation is dropped; without it the last
    global batch is filled up with samples from the start of the permutation (wrapping
    around), so every rank still gets full batches.
    """

    def __init__(self, num_samples: int, batch_size: int, world_size: int = 1, rank: int = 0,
                 seed: int = 0, drop_last: bool = True, shuffle: bool = True):
        self.num_samples = _positive_int("num_samples", num_samples)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.world_size = _positive_int("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
                or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise BadArgument(f"seed must be a non-negative integer, got {seed!r}")
        self.rank, self.seed = int(rank), int(seed)
        self.drop_last, self.shuffle = bool(drop_last), bool(shuffle)
        if self.global_batch_size > self.num_samples:
            raise BadArgument(
                f"global batch batch_size*world_size = {self.batch_size}*{self.world_size} = "
                f"{self.global_batch_size} is larger than the dataset ({self.num_samples})")

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        """Steps per epoch, the same on every rank."""
        full, ragged = divmod(self.num_samples, self.global_batch_size)
        return full + (1 if ragged and not self.drop_last else 0)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of the whole dataset, identical on every rank."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        rng = np.random.default_rng([self.seed, int(epoch)])
        return rng.permutation(self.num_samples).astype(np.int64)

    def global_batches(self, epoch: int) -> np.ndarray:
        """(steps, batch_size*world_size): the single-process batches this run stands for."""
        order = self.permutation(epoch)
        used = len(self) * self.global_batch_size
        # np.resize repeats the array to fill: the tail wraps to the permutation's start.
        return np.resize(order, used).reshape(len(self), self.global_batch_size)

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """(steps, batch_size) int64 dataset indices: this rank's batch for each step."""
        return np.ascontiguousarray(self.global_batches(epoch)[:, self.rank::self.world_size])

    def __repr__(self) -> str:
        return (f"StrideSampler(num_samples={self.num_samples}, batch_size={self.batch_size}, "
                f"world_size={self.world_size}, rank={self.rank}, seed={self.seed}, "
                f"drop_last={self.drop_last}, shuffle={self.shuffle})")
