"""Checkpoints on disk: a directory per step, committed by its manifest.

    DIR/step-00000010/model.npz        name -> array (model.state_dict())
    DIR/step-00000010/optimizer.npz    "STATE:PARAM" -> array (the whole, gathered state)
    DIR/step-00000010/manifest.json    format, version, step, world size, each file's
                                       SHA-256 and size, the training state and the config

Every file is written by ``fileio.atomic_write`` (a temporary in the same directory,
fsynced, renamed, directory fsynced); the manifest is written last, so a checkpoint without
one is torn, and one whose files do not match the manifest's hashes was damaged or tampered
with. Loading reads each file's bytes once, checks their hash, then parses them with
``allow_pickle=False``. ``latest`` takes the newest checkpoint that passes all checks and
names every newer one it skipped, with the reason. ``prune`` keeps the newest K complete
checkpoints; it runs only after a new one is committed.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np

from dptrain.fileio import atomic_write, fsync_dir, remove_temporaries_under

FORMAT, VERSION = "dptrain-checkpoint", 1
MANIFEST = "manifest.json"
OWNER = "run.json"  # which run the directory's checkpoints belong to (state.run_identity)
_NAME = re.compile(r"^step-(\d{8,})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message says which and why."""


def step_dir(directory, step: int) -> Path:
    return Path(directory) / f"step-{int(step):08d}"


def _npz_bytes(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def strict_json(obj, **kwargs) -> str:
    return json.dumps(obj, allow_nan=False, **kwargs)


class CheckpointStore:
    def __init__(self, directory, keep: int = 3):
        self.dir = Path(directory)
        self.keep = max(1, int(keep))

    # -- whose checkpoints
    def owner(self) -> dict | None:
        """The identity of the run the directory belongs to, or None where none is recorded."""
        try:
            owner = json.loads((self.dir / OWNER).read_text())
        except (OSError, ValueError):
            return None
        return owner.get("run") if isinstance(owner, dict) else None

    def set_owner(self, identity: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        text = strict_json({"format": FORMAT, "run": identity}, indent=1) + "\n"
        atomic_write(self.dir / OWNER, lambda f: f.write(text.encode()))

    def drop_all(self) -> None:
        """Remove every checkpoint (the directory passes to another run)."""
        for _, path in self.entries():
            shutil.rmtree(path, ignore_errors=True)
        fsync_dir(self.dir)

    # -- writing
    def clean(self) -> list[Path]:
        """Remove what killed writers left: temporaries of any checkpoint file."""
        return remove_temporaries_under(self.dir)

    def write(self, step: int, files: dict, meta: dict, _stage=None) -> Path:
        """Write checkpoint `step`: files = {file name: {array name: array}}, meta = what
        the manifest carries besides the hashes (JSON-able, finite). Returns its directory.
        `_stage(name)` is called between stages (tests simulate a crash there)."""
        stage = _stage or (lambda name: None)
        path = step_dir(self.dir, step)
        path.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.dir)
        manifest_path = path / MANIFEST
        if manifest_path.exists():  # rewriting this step: uncommit it first
            manifest_path.unlink()
            fsync_dir(path)
        entries = {}
        for name, arrays in files.items():
            data = _npz_bytes(arrays)
            stage(f"{name}:begin")
            atomic_write(path / name, lambda f, d=data: f.write(d),
                         _stage_hook=lambda s, n=name: stage(f"{name}:{s}"))
            entries[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        manifest = {"format": FORMAT, "version": VERSION, "step": int(step), **meta,
                    "files": entries}
        text = strict_json(manifest, indent=1) + "\n"
        stage("manifest:begin")
        atomic_write(manifest_path, lambda f: f.write(text.encode()),
                     _stage_hook=lambda s: stage(f"manifest:{s}"))
        stage("committed")
        return path

    def discard(self, step: int) -> None:
        """Remove checkpoint `step` (what a failed write left of it)."""
        shutil.rmtree(step_dir(self.dir, step), ignore_errors=True)

    @staticmethod
    def complete(path) -> bool:
        """Whether checkpoint directory `path` was committed (has its manifest)."""
        return (Path(path) / MANIFEST).is_file()

    def prune(self) -> list[Path]:
        """Keep the newest `keep` complete checkpoints; drop older ones and torn ones older
        than the newest complete one. Call only after a new checkpoint is committed."""
        entries = self.entries()
        complete = [p for _, p in entries if (p / MANIFEST).is_file()]
        if not complete:
            return []
        keep = set(complete[-self.keep:])
        newest = entries[[p for _, p in entries].index(complete[-1])][0]
        removed = []
        for step, p in entries:
            if p not in keep and step <= newest:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        if removed:
            fsync_dir(self.dir)
        return removed

    # -- reading
    def entries(self) -> list[tuple[int, Path]]:
        """(step, directory) of every checkpoint directory, oldest first."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self, warn=None):
        """(path, manifest, files) of the newest usable checkpoint, or None. Each newer one
        that fails a check is reported through warn(message)."""
        for _, path in reversed(self.entries()):
            try:
                return (path, *load(path))
            except CheckpointError as exc:
                if warn:
                    warn(f"skipping checkpoint {path}: {exc}")
        return None


def read_manifest(path) -> dict:
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError("torn (no manifest: it was never committed)")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError("not a dptrain checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"format version {manifest.get('version')!r}, this dptrain "
                              f"reads version {VERSION}")
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("step"), int):
        raise CheckpointError("manifest lacks its files or step")
    return manifest


def load(path) -> tuple[dict, dict]:
    """(manifest, {file name: {array name: array}}) of a checkpoint directory, every file
    checked against the manifest's size and SHA-256 and parsed without pickle."""
    path = Path(path)
    manifest = read_manifest(path)
    files = {}
    for name, entry in manifest["files"].items():
        fpath = path / name
        try:
            data = fpath.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{name}: cannot be read ({exc.strerror or exc})") from None
        if len(data) != entry.get("bytes") or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise CheckpointError(f"{name} does not match the SHA-256 in its manifest "
                                  f"(damaged or modified)")
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                files[name] = {k: archive[k] for k in archive.files}
        except Exception as exc:  # noqa: BLE001 - any parse failure makes it unusable
            raise CheckpointError(f"{name}: not a readable .npz ({exc})") from None
    return manifest, files
