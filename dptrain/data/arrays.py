"""``ArrayDataset``: arrays the user already has, as a dataset sharded like the built-in ones.

    data = ArrayDataset(x, y)                       # NumPy arrays or np.memmap, any shape/dtype
    for xb, yb in data.batches(32, world, epoch):    # this rank's rows of each global batch
        step((xb, yb))

Row i of every array is sample i. ``batches`` draws the epoch's order with a StrideSampler
(the same permutation on every rank, rank r taking positions r, r+N, ...), so N ranks at a
batch of B see exactly the rows one process sees at N*B. Rows are read with ``np.take``,
so a memory map only reads the rows a batch uses.

Images and labels (uint8 (n, C, H, W) and integers) also serve dptrain.data.DeviceLoader,
which normalises on the device: ``images``, ``labels``, ``num_classes``, ``mean``, ``std``
and ``image_shape`` are the protocol it reads, which the built-in datasets offer too
(``ArrayDataset.from_dataset`` wraps one).
"""
from __future__ import annotations

import numpy as np

from dptrain.data.sampler import StrideSampler
from dptrain.errors import BadArgument


class ArrayDataset:
    """Samples as rows of `arrays` (equal first dimensions).

    ``transform(rows)`` (optional) maps the tuple of a batch's rows to what ``batches``
    yields (e.g. uint8 images to normalised float32); ``num_classes``, ``mean`` and ``std``
    describe images and labels for DeviceLoader (``mean``/``std`` of [0, 1]-scaled
    pixels; default 0.5 and 0.25)."""

    def __init__(self, *arrays, transform=None, num_classes=None, mean=0.5, std=0.25):
        if not arrays:
            raise BadArgument("ArrayDataset: give at least one array")
        self.arrays = tuple(a if isinstance(a, np.ndarray) else np.asarray(a) for a in arrays)
        lengths = [a.shape[0] if a.ndim else None for a in self.arrays]
        if None in lengths or len(set(lengths)) != 1:
            shapes = ", ".join(str(a.shape) for a in self.arrays)
            raise BadArgument(f"ArrayDataset: every array needs the same first dimension (one "
                             f"row per sample), got shapes {shapes}")
        self.transform = transform
        self.mean, self.std = mean, std
        self._num_classes = num_classes

    @classmethod
    def from_dataset(cls, dataset, normalize=True):
        """A built-in dataset (images, labels): rows as float32 images normalised by the
        dataset's mean and std (per channel where it has them) and int64 labels."""
        mean = np.asarray(dataset.mean, np.float32).reshape(-1, 1, 1)
        std = np.asarray(dataset.std, np.float32).reshape(-1, 1, 1)

        def normalise(rows):
            images, labels = rows
            return (images.astype(np.float32) / 255 - mean) / std, labels.astype(np.int64)

        return cls(dataset.images, dataset.labels, transform=normalise if normalize else None,
                   num_classes=dataset.num_classes, mean=dataset.mean, std=dataset.std)

    def __len__(self) -> int:
        return int(self.arrays[0].shape[0])

    def take(self, indices) -> tuple:
        """The rows `indices` of every array (through ``transform``)."""
        idx = np.asarray(indices, np.int64)
        rows = tuple(np.take(a, idx, axis=0) for a in self.arrays)
        return self.transform(rows) if self.transform is not None else rows

    def sampler(self, batch_size, world=None, seed=0, drop_last=True) -> StrideSampler:
        """The StrideSampler of this rank (`world`: a dptrain World, or None for one
        process) at `batch_size` rows per rank."""
        rank, size = (world.rank, world.size) if world is not None else (0, 1)
        return StrideSampler(len(self), batch_size, size, rank, seed=seed, drop_last=drop_last)

    def batches(self, batch_size, world=None, epoch=0, seed=0, drop_last=True):
        """This rank's batches of `epoch`, each the tuple ``take`` gives; every rank gets
        the same number of full batches."""
        for indices in self.sampler(batch_size, world, seed, drop_last).epoch_batches(epoch):
            yield self.take(indices)

    # -- what DeviceLoader reads, for image arrays with labels
    @property
    def images(self):
        return self.arrays[0]

    @property
    def labels(self):
        if len(self.arrays) < 2:
            raise AttributeError("ArrayDataset: no labels (a second array)")
        return self.arrays[1]

    @property
    def image_shape(self) -> tuple:
        return tuple(self.arrays[0].shape[1:])

    @property
    def num_classes(self) -> int:
        if self._num_classes is None:
            return int(np.max(self.labels)) + 1
        return int(self._num_classes)
