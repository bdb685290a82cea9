"""Model weights as a .npz of PyTorch-style name -> array, written atomically.

``read_weights`` trusts nothing in the file: it is opened without pickle, every member's
CRC is checked, and each array must be a finite real floating-point array; any failure is one
line naming the file and the array. An array named ``__meta__`` is reserved for metadata
about the weights and is not a parameter: it is skipped here.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from dptrain.errors import UsageError
from dptrain.fileio import atomic_write

META = "__meta__"  # reserved array name: metadata, not a parameter


def save_weights(model, path) -> None:
    atomic_write(Path(path), lambda f: np.savez(f, **model.state_dict()))


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
    path = Path(path)
    where = f"{flag} {path}"
    if not path.is_file():
        raise UsageError(f"{where}: no such file")
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()  # reads every member, checking its CRC-32
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
    state = {}
    with archive:
        for name in archive.files:
            if name == META:
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


def load_weights(model, path) -> None:
    state = read_weights(path)
    for name, p in model.named_parameters():  # e.g. float64 values beyond float32's range
        if name in state and not np.isfinite(state[name].astype(p.dtype)).all():
            raise UsageError(f"--load {path}: array {name!r} does not fit the model's "
                             f"{np.dtype(p.dtype)} (values overflow to infinity)")
    try:
        model.load_state_dict(state, source=f"--load {path}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
