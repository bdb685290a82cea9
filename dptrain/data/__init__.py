"""Datasets, their on-disk cache, the stride-sharded sampler and the device loader.

The package's shape, from disk to the device:

* **Datasets** (``synthetic.py``, and ``formats/``: one module per file format; a new one
  adds a module and an entry in ``DATASETS``). A dataset object offers what the rest
  reads, whatever its source: ``images`` uint8 (n, C, H, W) (often a read-only memory
  map), ``labels`` int64 (n,), ``num_classes``, ``class_names``, ``image_shape`` (C, H, W),
  ``mean``/``std`` of [0,1]-scaled pixels (scalars, or one per channel), and ``len()``.
  ``DATASETS`` maps a name to a factory ``(split, n_images, seed, cache_dir, **options)``
  returning one (options: ``data_dir``, ``channels``, ``image_size``, ``val_fraction``,
  ``on_bad_image``); for a dataset read from files (``fixed_size``), ``n_images=None``
  means all of its split, a number a seeded random subset.
* **Cache** (``cache.py``): entries of ``.npy`` files named by what determines their
  content, written atomically, loaded as memory maps shared by the ranks of a host.
* **Generation** (``parallel.py``): a dataset whose rows can be made independently renders
  them over forked worker processes into shared memory.
* **Arrays** (``arrays.py``): ``ArrayDataset``, the user's own arrays (any shape and dtype,
  memory maps too) with the same stride sharding; image arrays also feed the loader.
* **Sampler** (``sampler.py``): every rank draws the same per-epoch permutation and takes
  every N-th position, so N ranks at batch B equal one process at batch N*B.
* **Loader** (``loader.py``): ``DeviceLoader`` puts a dataset on the device (resident, or
  streamed through a staging buffer when it does not fit) and serves batches through
  fixed device buffers, so the training step that reads them can be captured and replayed.
  It is the only part that touches the device, and only through the backend.
* **Stream** (``stream.py``): ``--data-on host``'s ``BatchStream``, worker threads that
  gather the sampler's planned batches ahead into pinned host buffers and copy them on a
  copy stream, for the loader to hand to the step.

May import: dptrain.backend, dptrain.distributed (the host's once-only work) and the face; never
the engine, the loop or the command line (``data pack|info|synth`` live in dptrain.cli.data).
"""
from __future__ import annotations

from dptrain.errors import UsageError

from .arrays import ArrayDataset
from .formats import cifar10, fer2013, imagefolder, mnist
from .formats.common import factory as _file_factory
from .formats.packed import packed_dataset
from .loader import DeviceLoader
from .sampler import StrideSampler
from .synthetic import SyntheticDataset, SyntheticSpec


def synthetic_dataset(split, n_images, seed=0, cache_dir=None, data_dir=None, channels=None,
                      image_size=None, val_fraction=None, on_bad_image=None, **options):
    """The built-in shapes (48x48, one channel); generated, so it reads no files."""
    if data_dir is not None:
        raise UsageError(f"--data-dir {data_dir}: the synthetic dataset reads no files "
                         f"(choose --dataset imagefolder, mnist, ... for files)")
    if channels not in (None, 1) or image_size not in (None, 48):
        raise UsageError("--channels/--image-size: the synthetic dataset is 48x48 grayscale "
                         "(pack it with `data synth` and train on other data to change that)")
    return SyntheticDataset(split, n_images, seed=seed, cache_dir=cache_dir, **options)


DATASETS = {
    "synthetic": synthetic_dataset,
    "imagefolder": _file_factory(imagefolder),
    "mnist": _file_factory(mnist),
    "cifar10": _file_factory(cifar10),
    "fer2013": _file_factory(fer2013),
    "packed": packed_dataset,
}


def fixed_size(name: str) -> bool:
    """Whether dataset ``name`` is read from files (its size is theirs: ``n_images=None``
    means all), rather than generated to any size."""
    return bool(getattr(DATASETS.get(name), "fixed_size", False))


def get_dataset(name: str, split: str, n_images: int | None, seed: int = 0,
                cache_dir: str | None = None, **options):
    """The ``split`` ("train" or "val") of dataset ``name``."""
    try:
        factory = DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; choose one of "
                         f"{', '.join(sorted(DATASETS))}") from None
    return factory(split, n_images, seed=seed, cache_dir=cache_dir, **options)


__all__ = ["ArrayDataset", "DATASETS", "get_dataset", "fixed_size", "DeviceLoader", "StrideSampler", "SyntheticDataset",
           "SyntheticSpec"]
