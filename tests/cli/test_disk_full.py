"""A full disk while the run writes --save, a checkpoint or its log: one line naming the file
and the cause, and what can be kept is kept (the weights in the log directory, the checkpoints
written before). The disk fills by injection: the writers raise ENOSPC for chosen files."""
import errno
import json

import pytest

import dptrain.checkpoints.store as store
import dptrain.checkpoints.weights as weights
import dptrain.run.metrics as metrics
from dptrain.cli import main

ARGS = ["train", "--device", "cpu", "--model", "mlp", "--train-images", "128", "--val-images",
        "32", "--epochs", "1", "--batch-size", "16", "--no-progress", "--log-every", "2"]


def full_for(module, monkeypatch, fails):
    """module.atomic_write raises ENOSPC for the paths `fails(path)` picks."""
    real = module.atomic_write

    def writer(path, write, *args, **kwargs):
        if fails(str(path)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, write, *args, **kwargs)

    monkeypatch.setattr(module, "atomic_write", writer)


def errors(capsys):
    out, err = capsys.readouterr()
    return out, [line for line in err.splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPTRAIN_CACHE", str(tmp_path / "cache"))


def test_full_disk_on_save_keeps_the_weights_in_the_log_dir(tmp_path, monkeypatch, capsys):
    target = tmp_path / "disk" / "w.npz"
    full_for(weights, monkeypatch, lambda p: p.startswith(str(tmp_path / "disk")))
    code = main(ARGS + ["--save", str(target), "--log-dir", str(tmp_path / "L")])
    out, lines = errors(capsys)
    assert code == 1
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert f"--save {target}" in lines[0] and "No space left on device" in lines[0]
    assert str(tmp_path / "L" / "weights.npz") in lines[0]
    assert (tmp_path / "L" / "weights.npz").is_file() and not target.exists()
    summary = json.loads((tmp_path / "L" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["config"]["save"] == str(tmp_path / "L" / "weights.npz")


def test_full_disk_everywhere_on_save_says_the_weights_are_lost(tmp_path, monkeypatch, capsys):
    full_for(weights, monkeypatch, lambda p: True)
    code = main(ARGS + ["--save", str(tmp_path / "w.npz"), "--log-dir", str(tmp_path / "L")])
    _, lines = errors(capsys)
    assert code == 1 and len(lines) == 1, lines
    assert "the weights are lost" in lines[0]


def test_full_disk_on_a_checkpoint_keeps_the_last_one(tmp_path, monkeypatch, capsys):
    ck = tmp_path / "ck"
    full_for(store, monkeypatch, lambda p: "step-00000006" in p)
    code = main(ARGS + ["--checkpoint-dir", str(ck), "--checkpoint-every", "3"])
    _, lines = errors(capsys)
    assert code == 0
    assert len(lines) == 1 and "step-00000006" in lines[0], lines
    assert "No space left on device" in lines[0] and "step-00000003" in lines[0]
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000003"]


class _FullFile:
    def __init__(self, path, mode="r", *args, **kwargs):
        self.name = path

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


def test_full_disk_on_the_log_is_one_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics, "open", _FullFile, raising=False)
    code = main(ARGS + ["--log-dir", str(tmp_path / "L")])
    out, lines = errors(capsys)
    assert code == 0
    assert len(lines) == 1 and "metrics.jsonl" in lines[0], lines
    assert "No space left on device" in lines[0]
    assert "dptrain: done: 8 steps" in out


def test_full_disk_on_the_checkpoint_dirs_run_json_is_one_line(tmp_path, monkeypatch, capsys):
    full_for(store, monkeypatch, lambda p: p.endswith("run.json"))
    code = main(ARGS + ["--checkpoint-dir", str(tmp_path / "ck")])
    _, lines = errors(capsys)
    assert code == 2 and len(lines) == 1, lines
    assert "--checkpoint-dir" in lines[0] and "run.json" in lines[0]
    assert "No space left on device" in lines[0]
