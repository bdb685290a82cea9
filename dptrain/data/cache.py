"""The on-disk dataset cache: arrays written once, checked, then memory-mapped by every run.

An entry is three files in the cache directory, named by the dataset's *entry name*
(everything that determines its content, e.g. ``synthetic-<spec key>-seed0-train``, or a
decoded dataset's source key) and its size:

    <name>-n<size>-labels.npy    int64 (size,)
    <name>-n<size>-images.npy    uint8 (size, C, H, W)
    <name>-n<size>-entry.json    the manifest: each file's byte count and SHA-256, and the
                                 dataset's metadata (class names, normalisation, ...)

Each file is written atomically (a temporary file renamed into place), the manifest last,
so an entry whose manifest exists is complete; a killed writer leaves at worst a stray
temporary file, which no lookup matches. Every load checks the files against the manifest:
an entry that is truncated, emptied or overwritten is reported by path (a warning), removed
and treated as missing, so the caller regenerates it -- it is never trained on, and never a
permanent failure. Images are loaded as a read-only memory map: ranks on one host then share
one copy in the page cache.

A dataset whose first ``n`` rows do not depend on how many rows were made (a generator
that is a pure function of the index, a converted set in a fixed order) lets a larger
entry serve a smaller request (``prefix=True``); otherwise only the exact size is used.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import warnings

import numpy as np

from dptrain import switches
from dptrain.fileio import atomic_write

_LABELS, _IMAGES, _ENTRY = "-labels.npy", "-images.npy", "-entry.json"
VERSION = 1


def default_cache_dir() -> str:
    """``$DPTRAIN_CACHE``, else ``~/.cache/dptrain``."""
    return switches.value("CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dptrain")


def entry_stem(cache_dir: str, name: str, size) -> str:
    """The path of an entry without its ``-labels.npy`` / ``-images.npy`` suffix."""
    return os.path.join(cache_dir, f"{name}-n{size}")


def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cached_sizes(cache_dir: str, name: str) -> list[int]:
    """Sizes of the entries of ``name`` whose manifest exists, ascending."""
    pattern = glob.escape(entry_stem(cache_dir, name, "")) + "*" + _ENTRY
    sizes = []
    for path in glob.glob(pattern):
        try:
            sizes.append(int(path[: -len(_ENTRY)].rsplit("-n", 1)[1]))
        except ValueError:
            continue
    return sorted(sizes)


class CorruptEntry(Exception):
    """A cache file that does not match its manifest; the message names the file."""


def _check(stem: str, size: int, image_shape) -> dict:
    """The manifest of a complete, intact entry; CorruptEntry naming the bad file otherwise."""
    manifest_path = stem + _ENTRY
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        files = manifest["files"]
        if manifest.get("version") != VERSION or manifest.get("rows") != size:
            raise ValueError("unexpected version or row count")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CorruptEntry(f"{manifest_path}: unreadable manifest ({err})") from None
    for suffix in (_LABELS, _IMAGES):
        path, want = stem + suffix, files.get(suffix.lstrip("-"), {})
        try:
            nbytes = os.path.getsize(path)
        except OSError as err:
            raise CorruptEntry(f"{path}: missing ({err.strerror})") from None
        if nbytes != want.get("bytes"):
            raise CorruptEntry(f"{path}: {nbytes} bytes, the manifest says {want.get('bytes')}")
        if sha256_file(path) != want.get("sha256"):
            raise CorruptEntry(f"{path}: checksum mismatch (the file was changed or damaged)")
    if image_shape is not None and tuple(manifest.get("image_shape", ())) != tuple(image_shape):
        raise CorruptEntry(f"{manifest_path}: image shape {manifest.get('image_shape')}, "
                           f"expected {list(image_shape)}")
    return manifest


def _discard(stem: str, reason: str) -> None:
    warnings.warn(f"dataset cache entry {reason}; discarding it and regenerating",
                  stacklevel=3)
    for suffix in (_ENTRY, _IMAGES, _LABELS):
        try:
            os.remove(stem + suffix)
        except OSError:
            pass


def load_entry(cache_dir: str, name: str, n: int, image_shape, prefix: bool = True):
    """``(images, labels, meta)`` of ``n`` rows from the cache, or None when no intact
    entry exists. Corrupt entries are reported, removed and skipped (see the module's notes).

    With ``prefix`` the smallest entry of at least ``n`` rows serves (its first ``n`` rows);
    without it only an entry of exactly ``n``. ``images`` is a read-only memory map of
    shape (n, *image_shape), uint8; ``image_shape=None`` takes the entry's own."""
    if image_shape is not None:
        image_shape = tuple(int(d) for d in image_shape)
    sizes = [s for s in cached_sizes(cache_dir, name) if (s >= n if prefix else s == n)]
    for size in sizes:
        stem = entry_stem(cache_dir, name, size)
        try:
            manifest = _check(stem, size, image_shape)
            images = np.load(stem + _IMAGES, mmap_mode="r", allow_pickle=False)
            labels = np.load(stem + _LABELS, allow_pickle=False)
            want = tuple(manifest.get("image_shape", ())) if image_shape is None else image_shape
            if images.shape != (size,) + want or images.dtype != np.uint8:
                raise CorruptEntry(f"{stem + _IMAGES}: {images.dtype} {images.shape}, expected "
                                   f"uint8 {(size,) + want}")
            if labels.shape != (size,) or labels.dtype != np.int64:
                raise CorruptEntry(f"{stem + _LABELS}: {labels.dtype} {labels.shape}, expected "
                                   f"int64 ({size},)")
        except CorruptEntry as err:
            _discard(stem, str(err))
            continue
        except (OSError, ValueError) as err:
            _discard(stem, f"{stem}: unreadable ({err})")
            continue
        return images[:n], labels[:n], manifest.get("meta", {})
    return None


def load(cache_dir: str, name: str, n: int, image_shape, prefix: bool = True):
    """``(images, labels)`` of ``n`` rows from the cache, or None (see ``load_entry``)."""
    found = load_entry(cache_dir, name, n, image_shape, prefix)
    return None if found is None else found[:2]


def store(cache_dir: str, name: str, images: np.ndarray, labels: np.ndarray,
          meta: dict | None = None) -> bool:
    """Write an entry of ``len(labels)`` rows with its manifest (``meta``: JSON-able
    metadata returned by ``load_entry``); True when written.

    A read-only or full disk costs speed, not the run: it warns and returns False."""
    stem = entry_stem(cache_dir, name, len(labels))
    labels = np.ascontiguousarray(labels, np.int64)
    try:
        files = {}
        for suffix, array in ((_LABELS, labels), (_IMAGES, images)):
            atomic_write(stem + suffix, lambda f, a=array: np.save(f, a, allow_pickle=False))
            files[suffix.lstrip("-")] = {"bytes": os.path.getsize(stem + suffix),
                                         "sha256": sha256_file(stem + suffix)}
        manifest = {"version": VERSION, "rows": len(labels),
                    "image_shape": [int(d) for d in images.shape[1:]], "files": files,
                    "meta": meta or {}}
        # The manifest last: it marks a complete entry.
        atomic_write(stem + _ENTRY,
                     lambda f: f.write(json.dumps(manifest, indent=1).encode("utf-8")))
    except OSError as err:
        warnings.warn(f"could not cache the dataset {name} in {cache_dir}: {err}")
        return False
    return True
