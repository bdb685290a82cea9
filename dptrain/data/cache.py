"""The on-disk dataset cache: arrays written once, then memory-mapped by every run.

An entry is a pair of ``.npy`` files in the cache directory, named by the dataset's
*entry name* (everything that determines its content, e.g.
``synthetic-<spec key>-seed0-train``) and its size:

    <name>-n<size>-labels.npy    int64 (size,)
    <name>-n<size>-images.npy    uint8 (size, C, H, W)

Each file is written atomically (a temporary file renamed into place), labels first and
images last, so an entry whose images file exists is complete; a killed writer leaves at
worst a stray temporary file, which no lookup matches. Images are loaded as a read-only
memory map: ranks on one host then share one copy in the page cache.

A dataset whose first ``n`` rows do not depend on how many rows were made (a generator
that is a pure function of the index, a converted set in a fixed order) lets a larger
entry serve a smaller request (``prefix=True``); otherwise only the exact size is used.
"""
from __future__ import annotations

import glob
import os
import warnings

import numpy as np

from dptrain.fileio import atomic_write

_LABELS, _IMAGES = "-labels.npy", "-images.npy"


def default_cache_dir() -> str:
    """``$DPTRAIN_CACHE``, else ``~/.cache/dptrain``."""
    return os.environ.get("DPTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "dptrain")


def entry_stem(cache_dir: str, name: str, size) -> str:
    """The path of an entry without its ``-labels.npy`` / ``-images.npy`` suffix."""
    return os.path.join(cache_dir, f"{name}-n{size}")


def cached_sizes(cache_dir: str, name: str) -> list[int]:
    """Sizes of the entries of ``name`` whose labels file exists, ascending."""
    pattern = glob.escape(entry_stem(cache_dir, name, "")) + "*" + _LABELS
    sizes = []
    for path in glob.glob(pattern):
        try:
            sizes.append(int(path[: -len(_LABELS)].rsplit("-n", 1)[1]))
        except ValueError:
            continue
    return sorted(sizes)


def load(cache_dir: str, name: str, n: int, image_shape, prefix: bool = True):
    """``(images, labels)`` of ``n`` rows from the cache, or None when no usable entry exists.

    With ``prefix`` the smallest entry of at least ``n`` rows serves (its first ``n`` rows);
    without it only an entry of exactly ``n``. ``images`` is a read-only memory map of
    shape (n, *image_shape), uint8; entries of another shape or dtype, or unreadable
    (truncated, foreign) files, are skipped."""
    image_shape = tuple(image_shape)
    sizes = [s for s in cached_sizes(cache_dir, name) if (s >= n if prefix else s == n)]
    for size in sizes:
        stem = entry_stem(cache_dir, name, size)
        try:
            images = np.load(stem + _IMAGES, mmap_mode="r")
            labels = np.load(stem + _LABELS)
        except (OSError, ValueError):
            continue
        if images.shape == (size,) + image_shape and images.dtype == np.uint8 \
                and labels.shape == (size,):
            return images[:n], labels[:n]
    return None


def store(cache_dir: str, name: str, images: np.ndarray, labels: np.ndarray) -> bool:
    """Write an entry of ``len(labels)`` rows; True when written.

    A read-only or full disk costs speed, not the run: it warns and returns False."""
    stem = entry_stem(cache_dir, name, len(labels))
    try:
        atomic_write(stem + _LABELS, lambda f: np.save(f, labels))
        # Images last: their file marks a complete entry.
        atomic_write(stem + _IMAGES, lambda f: np.save(f, images))
    except OSError as err:
        warnings.warn(f"could not cache the dataset {name} in {cache_dir}: {err}")
        return False
    return True
