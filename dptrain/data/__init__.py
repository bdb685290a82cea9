"""Datasets and the stride-sharded sampler.

A dataset object offers what the training loop reads, whatever its source:
  ``images``  uint8 (n, C, H, W)      ``labels``  int64 (n,)
  ``num_classes``, ``image_shape`` (C, H, W), ``mean``/``std`` of [0,1]-scaled pixels,
  and ``len()``.
``DATASETS`` maps a name to a factory ``(split, n_images, seed, cache_dir, **options)``
returning one; a new dataset (mnist, cifar10, an image folder, ...) adds one entry.
For a dataset of fixed size, ``n_images=None`` means all of it.
"""
from __future__ import annotations

from .sampler import StrideSampler
from .synthetic import SyntheticDataset, SyntheticSpec

DATASETS = {
    "synthetic": SyntheticDataset,
}


def get_dataset(name: str, split: str, n_images: int | None, seed: int = 0,
                cache_dir: str | None = None, **options):
    """The ``split`` ("train" or "val") of dataset ``name``."""
    try:
        factory = DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; choose one of "
                         f"{', '.join(sorted(DATASETS))}") from None
    return factory(split, n_images, seed=seed, cache_dir=cache_dir, **options)


__all__ = ["DATASETS", "get_dataset", "StrideSampler", "SyntheticDataset", "SyntheticSpec"]
