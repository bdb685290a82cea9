"""One seed for everything random: parameter initialisation and every backend's dropout."""
from __future__ import annotations

import numpy as np

from dptrain import backend

_init_rng = np.random.default_rng(0)


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
