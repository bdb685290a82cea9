"""Checks made before any training, so a bad output path fails in a second, not after hours.

``check_outputs`` verifies that --save, --log-dir and --checkpoint-dir can be written (one
line naming the flag and the path, exit code 2) and removes what earlier killed runs left
behind: the atomic writer's temporaries of those targets. It also decides where the run
writes, so that nothing an earlier run left is replaced without --overwrite: a --log-dir that
holds a run moves to LOGDIR-1 (a --save inside it moves along), an existing --save file is
refused, and a --checkpoint-dir that belongs to another run is refused (unless --resume).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dptrain.checkpoints.store import CheckpointStore
from dptrain.checkpoints.state import identity_difference, run_identity
from dptrain.errors import UsageError
from dptrain.fileio import remove_stale_temporaries
from dptrain.run.metrics import fresh_log_dir


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


def _inside(path: Path, directory: Path) -> Path | None:
    """`path` relative to `directory` when it lies inside it, else None."""
    try:
        return path.resolve().relative_to(directory.resolve())
    except ValueError:
        return None


def place_outputs(cfg) -> list[str]:
    """Settle where the run writes (cfg.log_dir, cfg.save); returns notes for the user. A
    resumed run continues in its own log directory; else one that holds a run is left alone
    and LOGDIR-1 (-2, ...) used, a --save inside it following the move."""
    notes = []
    if cfg.log_dir:
        old = Path(cfg.log_dir)
        cfg.log_dir, moved = fresh_log_dir(cfg.log_dir, cfg.overwrite or bool(cfg.resume))
        if moved:
            notes.append(moved)
            inner = _inside(Path(cfg.save), old) if cfg.save else None
            if inner is not None:
                cfg.save = str(Path(cfg.log_dir) / inner)
                notes.append(f"--save follows it: the weights go to {cfg.save}")
    return notes


def check_outputs(cfg) -> list[str]:
    """Raise UsageError unless every output the run will write can be written without
    replacing another run's results; returns notes on where outputs moved."""
    notes = place_outputs(cfg)
    if cfg.save:
        check_file_target("--save", cfg.save)
        if Path(cfg.save).exists() and not cfg.overwrite:
            raise UsageError(f"--save {cfg.save}: the file exists (an earlier run's weights); "
                             "--overwrite replaces it")
    if cfg.log_dir:
        _probe_dir("--log-dir", Path(cfg.log_dir))
    if getattr(cfg, "checkpoint_dir", None):
        _probe_dir("--checkpoint-dir", Path(cfg.checkpoint_dir))
        claim_checkpoint_dir(cfg)
    return notes


def claim_checkpoint_dir(cfg) -> None:
    """Record in --checkpoint-dir which run it belongs to; refuse one of another run unless
    --resume (which checks the checkpoint itself) or --overwrite (which drops its
    checkpoints)."""
    store = CheckpointStore(cfg.checkpoint_dir)
    mine, theirs = run_identity(cfg), store.owner()
    if cfg.resume and theirs is not None:
        return
    if theirs is None and not store.entries():
        store.set_owner(mine)
        return
    if theirs == mine:
        return
    if not cfg.overwrite:
        what = ("checkpoints of a run it does not name" if theirs is None
                else f"the checkpoints of another run ({identity_difference(theirs, mine)})")
        raise UsageError(f"--checkpoint-dir {cfg.checkpoint_dir}: holds {what}; --resume auto "
                         "continues that run, --overwrite replaces its checkpoints")
    store.drop_all()
    store.set_owner(mine)
