"""MNIST (and any dataset in its IDX layout, such as Fashion-MNIST): ``--data-dir`` holds
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
``t10k-labels-idx1-ubyte``, each gzipped (``.gz``) or not (a ``.`` before ``idx`` is also
accepted, as is torchvision's ``MNIST/raw`` folder). The t10k files are the validation
split; 10 classes named "0".."9"."""
from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np

from dptrain.data.formats.common import Decoded, check_labels, convert_channels, resize
from dptrain.errors import UsageError

NAME = "mnist"
VERSION = 1
NUM_CLASSES = 10
FILES = (("train", "images", 3), ("train", "labels", 1), ("t10k", "images", 3),
         ("t10k", "labels", 1))


def _find(data_dir: str, prefix: str, kind: str, dims: int) -> str:
    folders = [data_dir, os.path.join(data_dir, "raw"), os.path.join(data_dir, "MNIST", "raw")]
    names = [f"{prefix}-{kind}-idx{dims}-ubyte", f"{prefix}-{kind}.idx{dims}-ubyte"]
    for folder in folders:
        for name in names:
            for candidate in (name, name + ".gz"):
                path = os.path.join(folder, candidate)
                if os.path.isfile(path):
                    return path
    raise UsageError(f"--data-dir {data_dir}: no {names[0]}[.gz] (MNIST's IDX files) found")


def sources(data_dir: str) -> list[str]:
    if not os.path.isdir(data_dir):
        raise UsageError(f"--data-dir {data_dir}: not a directory (MNIST needs its IDX files)")
    return [_find(data_dir, prefix, kind, dims) for prefix, kind, dims in FILES]


def read_idx(path: str, dims: int) -> np.ndarray:
    """An IDX file of unsigned bytes with ``dims`` dimensions (gzipped or not), checked:
    magic number, dimensions and exact length. Errors are one line naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise UsageError(f"{path}: cannot read ({err.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise UsageError(f"{path}: corrupt gzip data ({err})") from None
    if len(raw) < 4 + 4 * dims:
        raise UsageError(f"{path}: {len(raw)} bytes, too short for an IDX file")
    magic = struct.unpack(">I", raw[:4])[0]
    if magic != 0x800 + dims:
        raise UsageError(f"{path}: wrong magic number 0x{magic:08x}, expected 0x{0x800 + dims:08x} "
                         f"(IDX, unsigned bytes, {dims} dimension{'s' if dims > 1 else ''})")
    shape = struct.unpack(f">{dims}I", raw[4:4 + 4 * dims])
    expected = 4 + 4 * dims + int(np.prod(shape, dtype=np.int64))
    if len(raw) != expected:
        raise UsageError(f"{path}: {len(raw)} bytes, expected {expected} for shape "
                         f"{'x'.join(map(str, shape))} (truncated or corrupt)")
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def _split(images_path: str, labels_path: str):
    images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise UsageError(f"{labels_path}: {len(labels)} labels for the {len(images)} images of "
                         f"{images_path}")
    check_labels(labels, NUM_CLASSES, labels_path)
    return images[:, None], labels.astype(np.int64)


def decode(data_dir: str, channels=None, image_size=None, on_bad_image="error") -> Decoded:
    paths = sources(data_dir)
    parts = []
    for images_path, labels_path in (paths[0:2], paths[2:4]):
        images, labels = _split(images_path, labels_path)
        images = resize(convert_channels(images, channels), image_size)
        parts.append((np.ascontiguousarray(images), labels))
    return Decoded(parts[0], parts[1], tuple(str(i) for i in range(NUM_CLASSES)))
