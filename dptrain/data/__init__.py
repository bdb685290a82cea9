"""Datasets, their on-disk cache, the stride-sharded sampler and the device loader.

The package's shape, from disk to the device:

* **Datasets** (``synthetic.py``; a new one adds a module and an entry in ``DATASETS``).
  A dataset object offers what the rest reads, whatever its source:
  ``images`` uint8 (n, C, H, W) (often a read-only memory map), ``labels`` int64 (n,),
  ``num_classes``, ``image_shape`` (C, H, W), ``mean``/``std`` of [0,1]-scaled pixels,
  and ``len()``. ``DATASETS`` maps a name to a factory
  ``(split, n_images, seed, cache_dir, **options)`` returning one; for a dataset of fixed
  size, ``n_images=None`` means all of it.
* **Cache** (``cache.py``): entries of ``.npy`` files named by what determines their
  content, written atomically, loaded as memory maps shared by the ranks of a host.
* **Generation** (``parallel.py``): a dataset whose rows can be made independently renders
  them over forked worker processes into shared memory.
* **Sampler** (``sampler.py``): every rank draws the same per-epoch permutation and takes
  every N-th position, so N ranks at batch B equal one process at batch N*B.
* **Loader** (``loader.py``): ``DeviceLoader`` puts a dataset on the device (resident, or
  streamed through a staging buffer when it does not fit) and serves batches through
  fixed device buffers, so the training step that reads them can be captured and replayed.
  It is the only part that touches the device, and only through the backend.
"""
from __future__ import annotations

from .loader import DeviceLoader
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


__all__ = ["DATASETS", "get_dataset", "DeviceLoader", "StrideSampler", "SyntheticDataset",
           "SyntheticSpec"]
