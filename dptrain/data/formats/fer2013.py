"""FER-2013: the Kaggle CSV (``fer2013.csv``, columns ``emotion``, ``pixels``, ``Usage``):
``--data-dir`` is the CSV file or a folder holding it. ``pixels`` is 48*48 (any square
count) space-separated grey levels; ``emotion`` is 0..6. Rows whose ``Usage`` is
``Training`` are the training split and ``PublicTest`` the validation split;
``PrivateTest`` rows (the held-out test set) are not used. A CSV without ``Usage`` is split
by ``--val-fraction``."""
from __future__ import annotations

import csv
import math
import os

import numpy as np

from dptrain.data.formats.common import Decoded, convert_channels, resize
from dptrain.errors import UsageError

NAME = "fer2013"
VERSION = 1
CLASSES = ("angry", "disgust", "fear", "happy", "sad", "surprise", "neutral")
NUM_CLASSES = len(CLASSES)
TRAIN, VAL, TEST = "Training", "PublicTest", "PrivateTest"


def _csv_path(data_dir: str) -> str:
    if os.path.isfile(data_dir):
        return data_dir
    for candidate in ("fer2013.csv", os.path.join("fer2013", "fer2013.csv")):
        path = os.path.join(data_dir, candidate)
        if os.path.isfile(path):
            return path
    raise UsageError(f"--data-dir {data_dir}: no fer2013.csv found")


def sources(data_dir: str) -> list[str]:
    return [_csv_path(data_dir)]


def read_csv(path: str):
    """(images uint8 (n, 1, S, S), labels int64, usage list) of the CSV, checked row by row;
    errors name the file and line."""
    rows, labels, usage, side = [], [], [], None
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise UsageError(f"{path}: empty file, expected a header 'emotion,pixels,Usage'")
            names = [h.strip() for h in header]
            if "emotion" not in names or "pixels" not in names:
                raise UsageError(f"{path}: line 1: header {','.join(names)!r} lacks 'emotion' "
                                 f"and 'pixels' columns")
            e_col, p_col = names.index("emotion"), names.index("pixels")
            u_col = names.index("Usage") if "Usage" in names else None
            for row in reader:
                line = reader.line_num
                if not row:
                    continue
                if len(row) < len(names):
                    raise UsageError(f"{path}: line {line}: {len(row)} fields, expected "
                                     f"{len(names)}")
                try:
                    label = int(row[e_col])
                    pixels = np.array(row[p_col].split(), dtype=np.int64)
                except ValueError:
                    raise UsageError(f"{path}: line {line}: emotion and pixels must be "
                                     f"integers") from None
                if not 0 <= label < NUM_CLASSES:
                    raise UsageError(f"{path}: line {line}: label {label} is out of range "
                                     f"[0, {NUM_CLASSES})")
                s = math.isqrt(pixels.size)
                if pixels.size == 0 or s * s != pixels.size or (side is not None and s != side):
                    want = f"{side * side}" if side else "a square number of"
                    raise UsageError(f"{path}: line {line}: {pixels.size} pixels, expected "
                                     f"{want} pixels")
                if pixels.min() < 0 or pixels.max() > 255:
                    raise UsageError(f"{path}: line {line}: pixel values must be in [0, 255]")
                side = s
                rows.append(pixels.astype(np.uint8))
                labels.append(label)
                usage.append(row[u_col].strip() if u_col is not None else "")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text CSV file") from None
    except csv.Error as err:
        raise UsageError(f"{path}: malformed CSV ({err})") from None
    except OSError as err:
        raise UsageError(f"{path}: cannot read ({err.strerror})") from None
    if not rows:
        raise UsageError(f"{path}: no data rows (the dataset is empty)")
    images = np.stack(rows).reshape(-1, 1, side, side)
    return images, np.asarray(labels, np.int64), usage


def decode(data_dir: str, channels=None, image_size=None, on_bad_image="error") -> Decoded:
    path = _csv_path(data_dir)
    images, labels, usage = read_csv(path)
    images = np.ascontiguousarray(resize(convert_channels(images, channels), image_size))
    usage = np.asarray(usage)
    if not usage.any():  # no Usage column: one pool, split by --val-fraction
        return Decoded((images, labels), None, CLASSES)
    unknown = sorted(set(usage.tolist()) - {TRAIN, VAL, TEST})
    if unknown:
        raise UsageError(f"{path}: unknown Usage {unknown[0]!r} (expected {TRAIN}, {VAL} or "
                         f"{TEST})")
    train, val = usage == TRAIN, usage == VAL
    if not train.any():
        raise UsageError(f"{path}: no {TRAIN} rows")
    return Decoded((images[train], labels[train]),
                   (images[val], labels[val]) if val.any() else None, CLASSES)
