"""Model weights as a .npz of PyTorch-style name -> array, written atomically."""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from dptrain.errors import UsageError
from dptrain.fileio import atomic_write


def save_weights(model, path) -> None:
    atomic_write(Path(path), lambda f: np.savez(f, **model.state_dict()))


def read_weights(path) -> dict:
    """The name -> array mapping in a .npz, with a clear error for a missing or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--load {path}: no such file")
    try:
        archive = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise UsageError(f"--load {path}: not a .npz weights file ({exc})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise UsageError(f"--load {path}: not a .npz weights file (a single array)")
    with archive:
        return {name: archive[name] for name in archive.files}


def load_weights(model, path) -> None:
    state = read_weights(path)
    try:
        model.load_state_dict(state, source=f"--load {path}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
