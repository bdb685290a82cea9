"""Checks made before any training, so a bad output path fails in a second, not after hours.

``check_outputs`` verifies that --save, --log-dir and --checkpoint-dir can be written (one
line naming the flag and the path, exit code 2) and removes what earlier killed runs left
behind: the atomic writer's temporaries of those targets.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dptrain.errors import UsageError
from dptrain.fileio import remove_stale_temporaries


def _first_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_dir(flag: str, directory: Path, shown: Path | None = None) -> None:
    """`directory` exists or can be made, is a directory, and accepts a new file. Errors
    name `shown` (the flag's value), default `directory`."""
    shown = directory if shown is None else shown
    if directory.exists() and not directory.is_dir():
        what = "not a directory" if shown == directory else f"{directory} is not a directory"
        raise UsageError(f"{flag} {shown}: {what}")
    base = _first_existing(directory)
    if not base.is_dir():
        raise UsageError(f"{flag} {shown}: {base} is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".dptrain-probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {shown}: cannot write in {directory} "
                         f"({exc.strerror or exc})") from None


def check_file_target(flag: str, path) -> None:
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: the file is not writable")
    _probe_dir(flag, path.parent, shown=path)
    remove_stale_temporaries(path)


def check_outputs(cfg) -> None:
    """Raise UsageError unless every output the run will write can be written."""
    if cfg.save:
        check_file_target("--save", cfg.save)
    if cfg.log_dir:
        _probe_dir("--log-dir", Path(cfg.log_dir))
    if getattr(cfg, "checkpoint_dir", None):
        _probe_dir("--checkpoint-dir", Path(cfg.checkpoint_dir))
