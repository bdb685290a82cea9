"""Model weights as a .npz of PyTorch-style name -> array, written atomically.

``read_weights`` trusts nothing in the file: it is opened without pickle, every member's
CRC is checked, and each array must be a finite real floating-point array; any failure is one
line naming the file and the array.

A weights file may also carry what is needed to use it without its training run: the model's
name, image shape and class count, the class names and the input normalisation (mean/std of
[0,1]-scaled pixels, a number or one per channel). They are JSON in the archive's ZIP comment
(``read_metadata``), so the file's arrays are the model's tensors and nothing else: a strict
``torch.nn.Module.load_state_dict`` takes them as they are. (Metadata too large for a comment,
64 KiB, and files of earlier versions hold it as a uint8 array under the reserved name
``__meta__``, which ``read_weights`` and loading into a model skip.)
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np

from dptrain.errors import UsageError
from dptrain.fileio import atomic_write

META_KEY = "__meta__"  # reserved array name: metadata, not a parameter
MAX_COMMENT = 0xFFFF  # a ZIP comment's largest size


def save_weights(model, path, meta: dict | None = None) -> None:
    arrays = dict(model.state_dict())
    text = json.dumps(meta).encode() if meta is not None else b""
    if len(text) > MAX_COMMENT:
        arrays[META_KEY] = np.frombuffer(text, dtype=np.uint8)
        text = b""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    if text:
        with zipfile.ZipFile(buf, "a") as zf:
            zf.comment = text
    data = buf.getvalue()
    atomic_write(Path(path), lambda f: f.write(data))


def weights_metadata(model_name: str, dataset, dataset_name: str | None = None,
                     data: dict | None = None) -> dict:
    """What a weights file records about its model and data: enough to classify raw images,
    and (`data`: data_dir, seed, val_fraction, ...) to evaluate it on the same split."""
    def plain(value):
        value = np.asarray(value, dtype=np.float64)
        return float(value) if value.ndim == 0 else value.tolist()

    names = class_names(dataset)
    return {"format": "dptrain-weights", "version": 1, "model": model_name,
            "image_shape": [int(d) for d in dataset.image_shape],
            "num_classes": int(dataset.num_classes), "class_names": names,
            "mean": plain(dataset.mean), "std": plain(dataset.std), "dataset": dataset_name,
            "data": data}


def class_names(dataset) -> list[str]:
    """The dataset's class names (``class_names``, else ``classes``), else "0", "1", ..."""
    names = getattr(dataset, "class_names", None)
    if names is None:
        names = getattr(dataset, "classes", None)
    if names is None or len(names) != int(dataset.num_classes):
        return [str(i) for i in range(int(dataset.num_classes))]
    return [str(name) for name in names]


def _check_array(where: str, name: str, value: np.ndarray) -> None:
    if value.dtype == object:
        raise UsageError(f"{where}: array {name!r} holds Python objects (not loaded)")
    if not np.issubdtype(value.dtype, np.floating):
        raise UsageError(f"{where}: array {name!r} has dtype {value.dtype}; weights must be "
                         f"floating point")
    if not np.isfinite(value).all():
        bad = int(value.size - np.isfinite(value).sum())
        raise UsageError(f"{where}: array {name!r} holds {bad} NaN or infinite value(s)")


def read_weights(path, flag: str = "--load") -> dict:
    """The name -> array mapping in a .npz, with a one-line error naming the file (and the
    array) for a missing, foreign, corrupt, pickled, non-float or non-finite one."""
    where = f"{flag} {path}"
    archive = _open(path, flag, check_crc=True)
    state = {}
    with archive:
        for name in archive.files:
            if name == META_KEY:
                continue
            try:
                value = archive[name]
            except ValueError as exc:
                if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
                    raise UsageError(f"{where}: array {name!r} holds Python objects "
                                     f"(not loaded)") from None
                raise UsageError(f"{where}: array {name!r} cannot be read ({exc})") from None
            except (zipfile.BadZipFile, OSError, EOFError) as exc:
                raise UsageError(f"{where}: array {name!r} cannot be read ({exc})") from None
            _check_array(where, name, value)
            state[name] = value
    return state


def load_weights(model, path, flag: str = "--load") -> None:
    state = read_weights(path, flag)
    for name, p in model.named_parameters():  # e.g. float64 values beyond float32's range
        if name in state and not np.isfinite(state[name].astype(p.dtype)).all():
            raise UsageError(f"{flag} {path}: array {name!r} does not fit the model's "
                             f"{np.dtype(p.dtype)} (values overflow to infinity)")
    try:
        model.load_state_dict(state, source=f"{flag} {path}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _open(path, flag, check_crc=False):
    """The .npz at `path`, opened without pickle; `check_crc` first reads every member and
    checks its CRC-32. Any failure is one line naming the flag and the file."""
    path = Path(path)
    where = f"{flag} {path}"
    if not path.is_file():
        raise UsageError(f"{where}: no such file")
    if check_crc:
        try:
            with zipfile.ZipFile(path) as zf:
                bad = zf.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise UsageError(f"{where}: not a .npz weights file ({exc})") from None
        if bad is not None:
            name = bad[:-4] if bad.endswith(".npy") else bad
            raise UsageError(f"{where}: array {name!r} is corrupt (CRC check failed)")
    try:
        archive = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise UsageError(f"{where}: not a .npz weights file ({exc})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise UsageError(f"{where}: not a .npz weights file (a single array)")
    return archive


def read_metadata(path, flag: str = "--load") -> dict | None:
    """The metadata a weights file carries, or None for a file written without it."""
    with _open(path, flag) as archive:
        raw = archive.zip.comment
        if not raw and META_KEY not in archive.files:
            return None
        if not raw:
            raw = np.asarray(archive[META_KEY], dtype=np.uint8).tobytes()
    try:
        meta = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag} {path}: unreadable {META_KEY} ({exc})") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{flag} {path}: {META_KEY} is not a JSON object")
    return meta


