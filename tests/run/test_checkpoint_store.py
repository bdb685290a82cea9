"""Crash-safe checkpoints: a save killed at any stage never leaves one that --resume auto
would load; a flipped byte is detected and skipped; no temporary survives a restart."""
import subprocess
import sys

import numpy as np
import pytest

from dptrain.checkpoints.store import CheckpointStore, load, step_dir
from mpilaunch import ROOT

FILES = {"model.npz": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
         "optimizer.npz": {"exp_avg:w": np.ones((2, 3), np.float32)}}
# Every point before the manifest's rename, which is the commit.
STAGES = [f"{f}:{s}" for f in ("model.npz", "optimizer.npz", "manifest")
          for s in ("begin", "written", "synced", "renamed")][:-1]

CRASH = """
import os, sys
import numpy as np
from dptrain.checkpoints.store import CheckpointStore
store = CheckpointStore(sys.argv[1])
files = {"model.npz": {"w": np.full((2, 3), 7, np.float32)},
         "optimizer.npz": {"exp_avg:w": np.zeros((2, 3), np.float32)}}
def stage(name):
    if name == sys.argv[2]:
        os._exit(137)  # as abrupt as SIGKILL: no cleanup runs
store.write(20, files, {"world_size": 1}, _stage=stage)
"""


def _good(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.write(10, FILES, {"world_size": 1})
    return store


@pytest.mark.parametrize("stage", STAGES)
def test_a_save_killed_at_any_stage_is_never_loaded(tmp_path, stage):
    store = _good(tmp_path)
    result = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), stage], cwd=ROOT,
                            env={"PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert result.returncode == 137, result.stderr
    warnings = []
    path, manifest, files = store.latest(warn=warnings.append)
    assert manifest["step"] == 10 and path == step_dir(tmp_path, 10)
    assert np.array_equal(files["model.npz"]["w"], FILES["model.npz"]["w"])
    assert any("step-00000020" in w and "torn" in w for w in warnings), warnings
    # A restart removes what the killed writer left; nothing else.
    store.clean()
    assert not list(tmp_path.rglob("*.tmp"))
    assert store.latest()[1]["step"] == 10


@pytest.mark.parametrize("stage", ["manifest:renamed", "never"])
def test_a_committed_save_is_the_newest(tmp_path, stage):
    store = _good(tmp_path)
    subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), stage], cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT)})
    assert store.latest()[1]["step"] == 20


@pytest.mark.parametrize("victim", ["model.npz", "optimizer.npz", "manifest.json"])
def test_a_flipped_byte_is_detected_and_skipped(tmp_path, victim):
    store = _good(tmp_path)
    store.write(20, FILES, {"world_size": 1})
    target = step_dir(tmp_path, 20) / victim
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    warnings = []
    path, manifest, _ = store.latest(warn=warnings.append)
    assert manifest["step"] == 10
    assert len(warnings) == 1 and "step-00000020" in warnings[0], warnings


def test_keep_the_newest_k_only_after_commit(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        store.write(step, FILES, {"world_size": 1})
        store.prune()
    assert [s for s, _ in store.entries()] == [3, 4]
    step_dir(tmp_path, 5).mkdir()  # torn and newer: kept until a newer commit
    store.prune()
    assert [s for s, _ in store.entries()] == [3, 4, 5]


def test_load_refuses_pickles(tmp_path):
    store = _good(tmp_path)
    import hashlib
    import io
    import json
    path = step_dir(tmp_path, 10)
    buf = io.BytesIO()
    np.savez(buf, w=np.array([{"evil": 1}], dtype=object))
    (path / "model.npz").write_bytes(buf.getvalue())
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.npz"] = {"sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
                                      "bytes": len(buf.getvalue())}
    (path / "manifest.json").write_text(json.dumps(manifest))
    from dptrain.checkpoints.store import CheckpointError
    with pytest.raises(CheckpointError, match="model.npz"):
        load(path)
    assert store.latest() is None
