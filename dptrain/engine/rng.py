"""One seed for everything random: parameter initialisation and every backend's dropout."""
from __future__ import annotations

import numpy as np

from dptrain import backend

_init_rng = np.random.default_rng(0)
_data_shard = (0, 1)  # (rank, world size): whose rows of the global batch this process holds


def manual_seed(seed: int) -> None:
    """Seed parameter initialisation and the dropout generators of loaded backends."""
    global _init_rng
    _init_rng = np.random.default_rng(seed)
    for device in backend.DEVICES:
        if device in backend._loaded:
            backend.get(device).runtime.manual_seed(seed)
    backend.default_seed = seed


def init_rng() -> np.random.Generator:
    """The generator parameter initialisers draw from (host side, so every device agrees)."""
    return _init_rng


def set_data_shard(rank: int, size: int) -> None:
    """Declare that this process holds rows rank, rank + size, ... of every global batch (the
    stride sharding of dptrain.data.StrideSampler). Dropout then draws the mask of the whole
    global batch and keeps this rank's rows, so N ranks drop exactly what one process would
    at the same global batch (N-rank training equals 1-rank training, dropout included)."""
    global _data_shard
    if not 0 <= rank < size:
        raise ValueError(f"data shard: rank {rank} out of range for {size} ranks")
    _data_shard = (int(rank), int(size))


def data_shard() -> tuple[int, int]:
    return _data_shard
