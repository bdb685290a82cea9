"""Files written so that a killed writer never leaves a truncated one behind.

``atomic_write`` writes to a temporary name in the target's directory (``.NAME.XXXX.tmp``),
flushes and fsyncs it, renames it over the target, then fsyncs the directory so the rename
itself survives a power loss. A writer killed before the rename leaves only such a
temporary, never a partial target; ``remove_stale_temporaries`` clears them on the next
start.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

TMP_SUFFIX = ".tmp"


def fsync_dir(directory) -> None:
    """Flush a directory's entries (renames, creations, deletions) to disk, where the OS can."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    finally:
        os.close(fd)


def atomic_write(path, write, _stage_hook=None) -> None:
    """Call write(file) on a temporary file beside `path`, flush it to disk, then rename it
    into place and flush the directory: at worst a stray temporary file is left, never a
    partial `path`. (`_stage_hook(stage)` lets tests stop the writer after "written",
    "synced" or "renamed".)"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if _stage_hook:
                _stage_hook("written")
            f.flush()
            os.fsync(f.fileno())
        if _stage_hook:
            _stage_hook("synced")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; other users' runs read caches
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if _stage_hook:
        _stage_hook("renamed")
    fsync_dir(path.parent)


def stale_temporaries(path) -> list[Path]:
    """The temporaries that atomic_write(`path`) leaves when killed before its rename."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f".{path.name}.*{TMP_SUFFIX}"))


def remove_stale_temporaries(path) -> list[Path]:
    """Delete what killed writers of `path` left behind; returns what was removed."""
    removed = []
    for tmp in stale_temporaries(path):
        try:
            tmp.unlink()
            removed.append(tmp)
        except FileNotFoundError:
            pass
    return removed


def remove_temporaries_under(directory) -> list[Path]:
    """Delete every atomic_write temporary (``.*.tmp``) in a directory tree."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for tmp in sorted(directory.rglob(f".*{TMP_SUFFIX}")):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed
