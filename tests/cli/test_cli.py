"""The command line: the documented run writes its files; bad input is one line and exit 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, cwd=None, cache=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if cache:
        env["DPTRAIN_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "dptrain", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


SMALL = ["--device", "cpu", "--train-images", "256", "--val-images", "64", "--epochs", "1",
         "--batch-size", "32", "--no-progress"]


def test_documented_run_writes_metrics_summary_and_weights(tmp_path):
    logs, weights = tmp_path / "L", tmp_path / "W.npz"
    result = run_cli("train", "--model", "cnn", "--dataset", "synthetic", *SMALL, "--log-every", "2",
                     "--log-dir", str(logs), "--save", str(weights), cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_accuracy" in r]
    assert steps and evals
    assert set(steps[0]) == {"step", "epoch", "loss", "accuracy", "lr", "images_per_s", "time"}
    assert 0 <= steps[0]["accuracy"] <= 1 and steps[0]["time"] > 1.5e9
    assert {"val_loss", "val_accuracy"} <= set(evals[-1])
    summary = json.loads((logs / "summary.json").read_text())
    for key in ("train_loss", "val_accuracy", "steps", "images", "world_size", "device",
                "wall_s", "images_per_s"):
        assert key in summary
    assert summary["steps"] == 8 and summary["images"] == 256 and summary["device"] == "cpu"
    with np.load(weights) as w:
        assert w["0.weight"].shape == (32, 1, 3, 3) and w["12.bias"].shape == (7,)
    # The saved weights load back into a fresh run.
    again = run_cli(*SMALL, "--max-steps", "1", "--load", str(weights), cache=tmp_path / "cache")
    assert again.returncode == 0, again.stderr


def _assert_usage_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args,fragments", [
    (["--model", "resnet9000"], ["--model", "resnet9000"]),
    (["--dataset", "imagenet-21k"], ["--dataset", "imagenet-21k"]),
    (["--optimizer", "lbfgs"], ["--optimizer", "lbfgs"]),
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--batch-size", "0"], ["--batch-size", "0"]),
    (["--batch-size", "-3"], ["--batch-size", "-3"]),
    (["--epochs", "two"], ["--epochs", "two"]),
    (["--train-images", "0"], ["--train-images"]),
    (["--lr", "-1"], ["--lr", "-1"]),
    (["--no-such-flag"], ["--no-such-flag"]),
])
def test_bad_flag_values(args, fragments):
    _assert_usage_error(run_cli(*args), *fragments)


def test_batch_larger_than_dataset(tmp_path):
    result = run_cli(*SMALL[:-3], "--batch-size", "1024", cache=tmp_path)
    _assert_usage_error(result, "--batch-size 1024")


def test_load_missing_file(tmp_path):
    _assert_usage_error(run_cli(*SMALL, "--load", str(tmp_path / "nope.npz"), cache=tmp_path),
                        "--load", "nope.npz", "no such file")


def test_load_not_npz(tmp_path):
    bad = tmp_path / "weights.npz"
    bad.write_text("these are not weights")
    _assert_usage_error(run_cli(*SMALL, "--load", str(bad), cache=tmp_path), "--load", "not a .npz")


def test_load_wrong_names_and_shapes(tmp_path):
    wrong_names = tmp_path / "names.npz"
    np.savez(wrong_names, foo=np.zeros(3))
    _assert_usage_error(run_cli(*SMALL, "--load", str(wrong_names), cache=tmp_path),
                        "--load", "missing 0.bias, 0.weight", "unexpected foo")
    from dptrain import nn

    state = nn.cnn((1, 48, 48), 7).state_dict()
    state["3.weight"] = np.zeros((1, 2, 3))
    wrong_shape = tmp_path / "shape.npz"
    np.savez(wrong_shape, **state)
    _assert_usage_error(run_cli(*SMALL, "--load", str(wrong_shape), cache=tmp_path),
                        "3.weight has shape (1, 2, 3)")


def test_help_explains():
    result = run_cli("train", "--help")
    assert result.returncode == 0
    for flag in ("--model", "--train-images", "--batch-size", "--device", "--save", "--load",
                 "--eval-every", "--log-dir"):
        assert flag in result.stdout
    assert run_cli("--help").returncode == 0


def test_device_cuda_without_gpu_is_one_line():
    from dptrain.backend import cuda_available

    if cuda_available():
        pytest.skip("a GPU is present")
    _assert_usage_error(run_cli("--device", "cuda"), "--device cuda", "no usable GPU")
