"""The packed format (ours): any dataset, decoded once, as raw arrays a run memory-maps.

A packed dataset is a directory:

    header.json          {"format": "dptrain-packed", "version": 1, "image_shape": [C, H, W],
                          "class_names": [...], "mean": [...], "std": [...] (per channel, of
                          [0, 1]-scaled pixels of the training split), "source": "...",
                          "splits": {"train": {"count": N, "images": {"file", "bytes",
                          "sha256"}, "labels": {...}}, "val": {...}}}
    train-images.npy     uint8 (N, C, H, W)       plain .npy: no pickle, memory-mappable
    train-labels.npy     int64 (N,)
    val-images.npy, val-labels.npy

``write`` (and ``Writer``, which big folders fill chunk by chunk) builds the whole dataset in
a temporary folder beside OUT (``.OUT.XXXX.tmp``), the header last, then renames it to OUT:
OUT is either absent, the previous dataset, or the complete new one; a failure or Ctrl-C
removes the temporary folder. A header may also say how the images were stored
(``"stored": {"layout": "center-square", "max_size": S}``: `data pack --max-size S`). ``load`` checks
the header, each file's size and SHA-256 (``verify=True``), dtype, shape and label range,
and memory-maps the images. A file is hashed on its first load only: a stamp in the cache
directory remembers its size, modification time and inode, so later runs open a million
48x48 images (2.3 GB) in well under a second. ``python -m dptrain data pack SRC OUT`` writes one, ``data info OUT`` shows it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from dptrain.data import cache as disk_cache
from dptrain.data.cache import sha256_file
from dptrain.data.formats.common import ImageDataset, check_options, subset_rows, val_split
from dptrain.errors import UsageError
from dptrain.fileio import atomic_write, fsync_dir

NAME = "packed"
FORMAT, VERSION = "dptrain-packed", 1
HEADER = "header.json"


def _dir(path: str) -> str:
    if os.path.basename(path) == HEADER and os.path.isfile(path):
        return os.path.dirname(path) or "."
    return path


def write(out: str, splits: dict, class_names, mean, std, source: str = "") -> dict:
    """Write a packed dataset to directory ``out``: ``splits`` maps "train" (and "val") to
    (images uint8 (n, C, H, W), labels). Returns the header."""
    with Writer(out) as w:
        for split, (images, labels) in splits.items():
            if images.dtype != np.uint8 or images.ndim != 4:
                raise ValueError(f"packed.write: {split} images must be uint8 (n, C, H, W)")
            w.split(split, len(images), images.shape[1:])[:] = images
            w.labels(split, labels)
        return w.commit(class_names, mean, std, source)


class Writer:
    """A packed dataset built in a temporary folder beside ``out`` and renamed into place by
    ``commit``; leaving the ``with`` block without a commit (an error, Ctrl-C) removes it.

    ``split(name, n, shape)`` gives a writable memory map of n images; ``truncate(name, k)``
    keeps its first k (skipped bad images); ``labels(name, labels)`` writes the labels."""

    def __init__(self, out: str):
        self.out = os.path.abspath(out)
        os.makedirs(os.path.dirname(self.out), exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(self.out)}.", suffix=".tmp",
                                    dir=os.path.dirname(self.out))
        self.maps, self.counts = {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.maps.clear()
        if os.path.isdir(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False

    def split(self, name: str, n: int, shape) -> np.ndarray:
        path = os.path.join(self.tmp, f"{name}-images.npy")
        self.maps[name] = np.lib.format.open_memmap(path, "w+", np.uint8,
                                                    (int(n),) + tuple(map(int, shape)))
        self.counts[name] = int(n)
        return self.maps[name]

    def truncate(self, name: str, k: int) -> None:
        """Keep the first k images: the .npy header rewritten in place (the same length,
        padded with spaces as the format allows), the file cut after row k."""
        images = self.maps.pop(name)
        shape, offset = (int(k),) + images.shape[1:], images.offset
        images.flush()
        del images
        path = os.path.join(self.tmp, f"{name}-images.npy")
        with open(path, "r+b") as f:
            f.seek(8)  # magic (6), version (2): 1.0 has a 2-byte header length
            length = int.from_bytes(f.read(2), "little")
            text = repr({"descr": "|u1", "fortran_order": False, "shape": shape})
            f.write((text.ljust(length - 1) + "\n").encode("latin1"))
            f.truncate(offset + int(np.prod(shape)))
        self.counts[name] = int(k)

    def labels(self, name: str, labels) -> None:
        np.save(os.path.join(self.tmp, f"{name}-labels.npy"),
                np.ascontiguousarray(labels, np.int64), allow_pickle=False)

    def commit(self, class_names, mean, std, source: str = "", stored=None) -> dict:
        """Hash the files, write the header, rename the folder to ``out``. The header."""
        for images in self.maps.values():
            images.flush()
        self.maps.clear()
        header = {"format": FORMAT, "version": VERSION,
                  "class_names": list(map(str, class_names)),
                  "mean": [float(v) for v in np.atleast_1d(mean)],
                  "std": [float(v) for v in np.atleast_1d(std)], "source": str(source),
                  "splits": {}}
        if stored:
            header["stored"] = dict(stored)
        for split in self.counts:
            path = os.path.join(self.tmp, f"{split}-images.npy")
            header.setdefault("image_shape", [int(d) for d in np.load(path, mmap_mode="r").shape[1:]])
            entry = {"count": self.counts[split]}
            for kind in ("labels", "images"):
                name = f"{split}-{kind}.npy"
                path = os.path.join(self.tmp, name)
                entry[kind] = {"file": name, "bytes": os.path.getsize(path),
                               "sha256": sha256_file(path)}
            header["splits"][split] = entry
        atomic_write(os.path.join(self.tmp, HEADER),
                     lambda f: f.write((json.dumps(header, indent=1) + "\n").encode("utf-8")))
        self._swap()
        return header

    def _swap(self) -> None:
        old = None
        if os.path.isdir(self.out):  # empty, or a packed dataset to replace (checked before)
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.out)}.old.",
                                   dir=os.path.dirname(self.out))
            os.rename(self.out, os.path.join(old, "data"))
        os.rename(self.tmp, self.out)
        fsync_dir(os.path.dirname(self.out))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def read_header(path: str) -> dict:
    """The checked header of the packed dataset at ``path`` (the directory or its header)."""
    folder = _dir(path)
    header_path = os.path.join(folder, HEADER)
    if not os.path.isfile(header_path):
        raise UsageError(f"{path}: not a packed dataset (no {HEADER}; make one with "
                         f"`python -m dptrain data pack SRC OUT`)")
    try:
        with open(header_path, "rb") as f:
            header = json.loads(f.read().decode("utf-8"))
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}")
        if header.get("version") != VERSION:
            raise ValueError(f"version {header.get('version')!r}, this dptrain reads {VERSION}")
        shape = tuple(int(d) for d in header["image_shape"])
        channels = shape[0]
        if len(shape) != 3 or len(header["mean"]) != channels or len(header["std"]) != channels:
            raise ValueError("image_shape, mean and std disagree")
        if "train" not in header["splits"] or not header["class_names"]:
            raise ValueError("no train split or no class names")
        for split in header["splits"].values():
            int(split["count"]), split["images"]["file"], split["labels"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise UsageError(f"{header_path}: not a valid packed header ({err})") from None
    return header


def _stamp_path(cache_dir: str, path: str) -> str:
    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:20]
    return os.path.join(cache_dir, "verified", f"{digest}.json")


def _already_verified(cache_dir, path: str, sha: str) -> bool:
    """Whether this file, unchanged since (same size, mtime and inode), was hashed to ``sha``."""
    if cache_dir is None:
        return False
    st = os.stat(path)
    try:
        with open(_stamp_path(cache_dir, path)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    return stamp == {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                     "ino": st.st_ino}


def _remember_verified(cache_dir, path: str, sha: str) -> None:
    if cache_dir is None:
        return
    st = os.stat(path)
    stamp = {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    try:
        atomic_write(_stamp_path(cache_dir, path), lambda f: f.write(json.dumps(stamp).encode()))
    except OSError:
        pass  # a read-only cache costs a hash next time, nothing else


def _file(folder: str, meta: dict, verify: bool, cache_dir=None) -> str:
    name = meta["file"]
    if os.path.basename(name) != name:
        raise UsageError(f"{os.path.join(folder, HEADER)}: file name {name!r} leaves the folder")
    path = os.path.join(folder, name)
    try:
        nbytes = os.path.getsize(path)
    except OSError as err:
        raise UsageError(f"{path}: missing ({err.strerror})") from None
    if nbytes != meta["bytes"]:
        raise UsageError(f"{path}: {nbytes} bytes, the header says {meta['bytes']} (truncated or "
                         f"replaced)")
    if verify and not _already_verified(cache_dir, path, meta["sha256"]):
        if sha256_file(path) != meta["sha256"]:
            raise UsageError(f"{path}: SHA-256 does not match the header (the file is damaged)")
        _remember_verified(cache_dir, path, meta["sha256"])
    return path


def load_split(path: str, split: str, verify: bool = True, cache_dir: str | None = None):
    """(images read-only memory map uint8 (n, C, H, W), labels int64, header) of a split.

    ``verify`` hashes each file against the header; with ``cache_dir``, a file hashed once
    is not hashed again while its size, modification time and inode stay the same."""
    folder = _dir(path)
    header = read_header(path)
    entry = header["splits"].get(split)
    if entry is None:
        raise UsageError(f"{path}: no {split!r} split")
    count, shape = int(entry["count"]), tuple(header["image_shape"])
    images_path = _file(folder, entry["images"], verify, cache_dir)
    labels_path = _file(folder, entry["labels"], verify, cache_dir)
    try:
        images = np.load(images_path, mmap_mode="r", allow_pickle=False)
        labels = np.load(labels_path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise UsageError(f"{images_path}: unreadable ({err})") from None
    if images.dtype != np.uint8 or images.shape != (count,) + shape:
        raise UsageError(f"{images_path}: {images.dtype} {images.shape}, the header says uint8 "
                         f"{(count,) + shape}")
    if labels.dtype != np.int64 or labels.shape != (count,):
        raise UsageError(f"{labels_path}: {labels.dtype} {labels.shape}, expected int64 "
                         f"({count},)")
    k = len(header["class_names"])
    if count and (labels.min() < 0 or labels.max() >= k):
        row = int(np.flatnonzero((labels < 0) | (labels >= k))[0])
        raise UsageError(f"{labels_path}: label {int(labels[row])} at record {row} is out of "
                         f"range [0, {k})")
    return images, labels, header


def packed_dataset(split, n_images=None, seed=0, cache_dir=None, data_dir=None, channels=None,
                   image_size=None, val_fraction=0.1, on_bad_image="error", cache=True,
                   verify=True):
    """A split of a packed dataset (``--dataset packed --data-dir OUT``). Its own val split
    when it has one of at least one image, else ``val_fraction`` of the train split."""
    check_options(channels, image_size, on_bad_image, val_fraction)
    cache_dir = cache_dir or disk_cache.default_cache_dir()
    if not data_dir:
        raise UsageError("--dataset packed needs --data-dir PATH (a `data pack` output)")
    header = read_header(data_dir)
    shape = tuple(header["image_shape"])
    if channels not in (None, shape[0]) or image_size not in (None,) and (
            shape[1], shape[2]) != (image_size, image_size):
        raise UsageError(f"--data-dir {data_dir}: packed images are {'x'.join(map(str, shape))}; "
                         f"--channels/--image-size cannot change them (pack again with those "
                         f"flags)")
    own_val = int(header["splits"].get("val", {}).get("count", 0)) > 0
    if split == "val" and own_val:
        images, labels, _ = load_split(data_dir, "val", verify, cache_dir)
    else:
        images, labels, _ = load_split(data_dir, "train", verify, cache_dir)
        if not own_val:
            train_rows, val_rows = val_split(len(labels), val_fraction, seed)
            rows = train_rows if split == "train" else val_rows
            images, labels = images[rows], labels[rows]
    pick = subset_rows(len(labels), n_images, seed, 1 if split == "train" else 2, split)
    if pick is not None:
        images, labels = images[pick], labels[pick]
    if len(labels) == 0:
        raise UsageError(f"{data_dir}: the {split} split is empty")
    return ImageDataset(images, labels, header["class_names"], header["mean"], header["std"],
                        split, data_dir)


packed_dataset.fixed_size = True
