"""What every file-backed dataset shares: the dataset object, splits, normalisation,
channel and size conversion, and the decode-once cache.

A format module (mnist.py, cifar10.py, ...) provides ``NAME``, ``VERSION`` (bump when its
decoding changes: it is part of the cache key), ``sources(data_dir) -> [files]`` (what
the decoded arrays depend on) and ``decode(data_dir, channels, image_size, on_bad_image)
-> Decoded``; ``factory(module)`` turns it into a ``DATASETS`` entry with the common
signature ``(split, n_images, seed, cache_dir, **options)``.

Splits: the source's own test split where it has one, else a deterministic split of the
training files by ``val_fraction`` drawn from the seed. ``n_images`` (``--train-images``,
``--val-images``) keeps a seeded random subset of a split, in the split's order.
Normalisation: the per-channel mean and std of the [0, 1]-scaled pixels of the training
split, the same for both splits.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from dptrain.data import cache as disk_cache
from dptrain.errors import UsageError

SPLITS = ("train", "val")
BAD_IMAGE_POLICIES = ("error", "skip")


class ImageDataset:
    """One split of a dataset held as arrays: ``images`` uint8 (n, C, H, W) (possibly a
    read-only memory map), ``labels`` int64 (n,), ``class_names``, ``num_classes``,
    ``image_shape``, ``mean``/``std`` (per channel, of the training split)."""

    def __init__(self, images, labels, class_names, mean, std, split: str, source: str = ""):
        self.images = images
        self.labels = np.asarray(labels, np.int64)
        self.class_names = tuple(str(c) for c in class_names)
        self.classes = self.class_names
        self.num_classes = len(self.class_names)
        self.image_shape = tuple(int(d) for d in images.shape[1:])
        self.mean = tuple(float(v) for v in np.atleast_1d(mean))
        self.std = tuple(float(v) for v in np.atleast_1d(std))
        self.split, self.source = split, source

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return (f"ImageDataset({self.source!r}, split={self.split!r}, n={len(self)}, "
                f"shape={self.image_shape}, classes={self.num_classes})")


@dataclass
class Decoded:
    """A format's decoded arrays: the training split, its own test split (or None), the
    class names and how many bad files were skipped."""
    train: tuple
    val: tuple | None
    class_names: tuple
    skipped: int = 0
    notes: dict = field(default_factory=dict)
    key: str = ""  # the cache key of the source (files and options)


# ----------------------------------------------------------------------------- checks


def require_dir(data_dir, name: str) -> str:
    if not data_dir:
        raise UsageError(f"--dataset {name} needs --data-dir PATH (where its files are)")
    if not os.path.exists(data_dir):
        raise UsageError(f"--data-dir {data_dir}: no such file or directory")
    return str(data_dir)


def check_labels(labels: np.ndarray, num_classes: int, where: str, first_row: int = 0):
    """One-line UsageError naming ``where`` when a label is outside [0, num_classes)."""
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        row = int(bad[0])
        raise UsageError(f"{where}: label {int(labels[row])} at record {first_row + row} is out "
                         f"of range [0, {num_classes})")


def check_options(channels, image_size, on_bad_image, val_fraction):
    if channels not in (None, 1, 3):
        raise UsageError(f"--channels {channels}: choose 1 (grayscale) or 3 (RGB)")
    if image_size is not None and (isinstance(image_size, bool) or int(image_size) != image_size
                                   or not 1 <= image_size <= 4096):
        raise UsageError(f"--image-size {image_size}: must be an integer in [1, 4096]")
    if on_bad_image not in BAD_IMAGE_POLICIES:
        raise UsageError(f"--on-bad-image {on_bad_image}: choose error or skip")
    if not 0.0 <= float(val_fraction) < 1.0:
        raise UsageError(f"--val-fraction {val_fraction}: must be in [0, 1)")


# ----------------------------------------------------------------------------- conversions


def convert_channels(images: np.ndarray, channels: int | None) -> np.ndarray:
    """uint8 (n, C, H, W) to ``channels`` (None: unchanged). Gray to RGB repeats the plane;
    RGB to gray uses Pillow's "L" conversion (ITU-R 601-2 luma, same integer rounding)."""
    have = images.shape[1]
    if channels is None or channels == have:
        return images
    if have == 1 and channels == 3:
        return np.repeat(images, 3, axis=1)
    if have == 3 and channels == 1:
        r, g, b = (images[:, i].astype(np.uint32) for i in range(3))
        return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)[:, None]
    raise UsageError(f"cannot convert {have}-channel images to {channels} channels")


def resize(images: np.ndarray, size: int | None) -> np.ndarray:
    """uint8 (n, C, H, W) to (n, C, size, size) with Pillow's bilinear filter (None or the
    same size: unchanged)."""
    if size is None or images.shape[2:] == (size, size):
        return images
    from PIL import Image

    out = np.empty(images.shape[:2] + (size, size), np.uint8)
    for i in range(images.shape[0]):
        for c in range(images.shape[1]):
            plane = Image.fromarray(np.ascontiguousarray(images[i, c]), mode="L")
            out[i, c] = np.asarray(plane.resize((size, size), Image.BILINEAR))
    return out


def channel_stats(images: np.ndarray, chunk: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (mean, std) of [0, 1]-scaled pixels, float64, exact: from a histogram of
    the 256 grey levels per channel, read in chunks of rows (a memory map is never read
    whole into memory)."""
    n, c = images.shape[:2]
    if n == 0:
        return np.zeros(c), np.ones(c)
    counts = np.zeros((c, 256), np.int64)
    for start in range(0, n, chunk):
        block = np.asarray(images[start:start + chunk])
        for ch in range(c):
            counts[ch] += np.bincount(block[:, ch].reshape(-1), minlength=256)
    levels = np.arange(256, dtype=np.float64) / 255.0
    total = counts.sum(axis=1)
    mean = counts @ levels / total
    var = counts @ (levels * levels) / total - mean * mean
    std = np.sqrt(np.maximum(var, 0.0))
    std[std == 0] = 1.0  # a constant channel: keep it finite
    return mean, std


def subset_rows(n: int, want: int | None, seed: int, salt: int, what: str) -> np.ndarray | None:
    """Sorted rows of a seeded random subset of ``want`` out of ``n`` (None: all of them)."""
    if want is None or want == n:
        return None
    if want > n:
        raise UsageError(f"--{what}-images {want}: the {what} split has only {n} images")
    rng = np.random.default_rng([int(seed), salt])
    return np.sort(rng.choice(n, want, replace=False))


def val_split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, val rows), sorted, of a deterministic split drawn from the seed."""
    n_val = int(round(float(val_fraction) * n))
    if n_val == 0 or n_val == n:
        raise UsageError(f"--val-fraction {val_fraction} of {n} images leaves no "
                         f"{'validation' if n_val == 0 else 'training'} images; this dataset "
                         f"has no test split of its own")
    perm = np.random.default_rng([int(seed), 0x5A11]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def report(text: str) -> None:
    print(f"dptrain: {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- decode-once cache


def source_key(name: str, version: int, files, **options) -> str:
    """A short hash of what the decoded arrays depend on: the format and its version, the
    options, and each source file's absolute path, size and modification time."""
    stats = []
    for path in sorted(files):
        st = os.stat(path)
        stats.append((os.path.abspath(path), st.st_size, st.st_mtime_ns))
    text = json.dumps([name, version, sorted(options.items()), stats])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_decoded(module, data_dir, cache_dir, cache: bool, **options) -> Decoded:
    """The format's decoded arrays, from the cache when an intact entry exists, else decoded
    and stored (train entry last, holding the metadata)."""
    files = module.sources(data_dir)
    key = source_key(module.NAME, module.VERSION, files, **options)
    stem = f"{module.NAME}-{key}"
    cache_dir = cache_dir or disk_cache.default_cache_dir()
    if cache:
        found = _load_cached(cache_dir, stem)
        if found is not None:
            found.key = key
            return found
    decoded = module.decode(data_dir, **options)
    decoded.key = key
    if cache:
        meta = {"class_names": list(decoded.class_names), "has_val": decoded.val is not None,
                "skipped": decoded.skipped, "notes": decoded.notes}
        if decoded.val is not None:
            disk_cache.store(cache_dir, f"{stem}-val", *decoded.val, meta={"of": stem})
        disk_cache.store(cache_dir, f"{stem}-train", *decoded.train, meta=meta)
    return decoded


def _only_entry(cache_dir, name):
    sizes = disk_cache.cached_sizes(cache_dir, name)
    for size in reversed(sizes):
        found = disk_cache.load_entry(cache_dir, name, size, None, prefix=False)
        if found is not None:
            return found
    return None


def _load_cached(cache_dir, stem) -> Decoded | None:
    train = _only_entry(cache_dir, f"{stem}-train")
    if train is None:
        return None
    meta = train[2]
    val = None
    if meta.get("has_val"):
        val = _only_entry(cache_dir, f"{stem}-val")
        if val is None:
            return None
        val = val[:2]
    return Decoded(train[:2], val, tuple(meta.get("class_names", ())),
                   int(meta.get("skipped", 0)), meta.get("notes", {}))


# ----------------------------------------------------------------------------- splits


_STATS: dict = {}  # (source, seed, val_fraction) -> (mean, std): train and val calls share it


def build_split(decoded: Decoded, split: str, n_images, seed: int, val_fraction: float,
                source: str) -> ImageDataset:
    """The ``split`` of decoded arrays as an ImageDataset (see the module's notes)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose train or val")
    images, labels = decoded.train
    if len(labels) == 0:
        raise UsageError(f"{source}: the dataset is empty")
    if decoded.val is not None:
        rows = {"train": None, "val": None}
        parts = {"train": decoded.train, "val": decoded.val}
        if len(decoded.val[1]) == 0:
            raise UsageError(f"{source}: the test split is empty")
    else:
        train_rows, val_rows = val_split(len(labels), val_fraction, seed)
        rows = {"train": train_rows, "val": val_rows}
        parts = {"train": decoded.train, "val": decoded.train}
    key = (decoded.key or id(decoded), int(seed), float(val_fraction))
    if key not in _STATS:
        train_images = decoded.train[0] if rows["train"] is None else \
            decoded.train[0][rows["train"]]
        _STATS[key] = channel_stats(train_images)
    mean, std = _STATS[key]
    images, labels = parts[split]
    if rows[split] is not None:
        images, labels = images[rows[split]], labels[rows[split]]
    pick = subset_rows(len(labels), n_images, seed, 1 if split == "train" else 2, split)
    if pick is not None:
        images, labels = images[pick], labels[pick]
    return ImageDataset(images, np.asarray(labels, np.int64), decoded.class_names, mean, std,
                        split, source)


def factory(module):
    """A ``DATASETS`` entry for a format module (see the module's notes)."""

    def make(split, n_images=None, seed=0, cache_dir=None, data_dir=None, channels=None,
             image_size=None, val_fraction=0.1, on_bad_image="error", cache=True):
        check_options(channels, image_size, on_bad_image, val_fraction)
        data_dir = require_dir(data_dir, module.NAME)
        decoded = load_decoded(module, data_dir, cache_dir, cache, channels=channels,
                               image_size=image_size, on_bad_image=on_bad_image)
        if decoded.skipped and split == "train":
            report(f"{data_dir}: skipped {decoded.skipped} unreadable image(s) "
                   f"(--on-bad-image skip)")
        return build_split(decoded, split, n_images, seed, val_fraction, data_dir)

    make.__name__ = f"{module.NAME}_dataset"
    make.__doc__ = module.__doc__
    make.fixed_size = True
    return make
