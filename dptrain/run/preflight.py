"""Checks made before any training, so a bad output path fails in a second, not after hours.

``check_outputs`` verifies that --save, --log-dir and --checkpoint-dir can be written (one
line naming the flag and the path, exit code 2) and removes what earlier killed runs left
behind: the atomic writer's temporaries of those targets. It also decides where the run
writes, so that nothing an earlier run left is replaced without --overwrite: a --log-dir that
holds a run moves to LOGDIR-1 (a --save inside it moves along), an existing --save file is
refused, and a --checkpoint-dir that belongs to another run, or holds this run's
checkpoints, is refused (unless --resume or --overwrite). ``check_sizes`` refuses a generated
dataset larger than memory, ``check_augment`` an --augment-pad larger than the images.
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
    try:
        _claim(cfg, store)
    except OSError as exc:  # e.g. a full disk: the probe's empty file fitted, run.json not
        raise UsageError(f"--checkpoint-dir {cfg.checkpoint_dir}: cannot write its run.json "
                         f"({exc.strerror or exc})") from None


def _claim(cfg, store) -> None:
    mine, theirs = run_identity(cfg), store.owner()
    if cfg.resume and theirs is not None:
        if theirs != mine and not store.entries():  # nothing to resume: it becomes this run's
            store.set_owner(mine)
        return
    if theirs is None and not store.entries():
        store.set_owner(mine)
        return
    complete = [p for _, p in store.entries() if store.complete(p)]
    if theirs == mine and not complete:
        return
    if theirs == mine and not cfg.overwrite:
        # starting over beside them, retention (newest steps kept) would delete the new run's
        # own checkpoints and --resume auto would pick up the old run's
        raise UsageError(f"--checkpoint-dir {cfg.checkpoint_dir}: holds this run's "
                         f"checkpoints (the newest {complete[-1].name}); --resume auto continues "
                         "it, --overwrite starts over and drops them")
    if not cfg.overwrite:
        what = ("checkpoints of a run it does not name" if theirs is None
                else f"the checkpoints of another run ({identity_difference(theirs, mine)})")
        raise UsageError(f"--checkpoint-dir {cfg.checkpoint_dir}: holds {what}; --resume auto "
                         "continues that run, --overwrite replaces its checkpoints")
    store.drop_all()
    store.set_owner(mine)


def _memory_bytes() -> int | None:
    """This machine's physical memory, or None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_sizes(cfg, memory: int | None = None) -> None:
    """A generated dataset (synthetic) of --train-images + --val-images must fit in this
    machine's memory: refused up front in one line, not a MemoryError or the kernel's OOM
    killer hours into generating it. Datasets read from files are as large as their files."""
    from dptrain.data import fixed_size
    from dptrain.data.synthetic import SIZE

    if fixed_size(cfg.dataset):
        return
    memory = _memory_bytes() if memory is None else memory
    per_image = SIZE * SIZE + 8  # one 48x48 uint8 channel and an int64 label
    train, val = (cfg.train_images or 0) * per_image, (cfg.val_images or 0) * per_image
    if memory is None or train + val <= memory:
        return
    flag = (f"--train-images {cfg.train_images}" if train > memory else
            f"--val-images {cfg.val_images}" if val > memory else
            f"--train-images {cfg.train_images} with --val-images {cfg.val_images}")
    raise UsageError(f"{flag}: the {cfg.dataset} dataset would take "
                     f"{(train + val) / 2**30:.1f} GiB ({per_image} bytes an image), more than "
                     f"this machine's {memory / 2**30:.1f} GiB of memory")


def check_augment(cfg, image_shape) -> None:
    """--augment-pad must leave the crop some of the image: at most its smaller side."""
    side = min(int(d) for d in image_shape[1:])
    if cfg.augment and cfg.augment_pad > side:
        raise UsageError(f"--augment-pad {cfg.augment_pad}: more than the {side}-pixel images "
                         f"it pads (the crop would see mostly padding)")
