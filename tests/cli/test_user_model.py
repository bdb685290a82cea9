"""`--model FILE.py:FUNCTION` / `package.module:FUNCTION`: a user's model trained, checkpointed,
resumed and evaluated by the commands; bad specs end with one line and exit code 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--device", "cpu", "--train-images", "256", "--val-images", "64", "--batch-size",
         "32", "--no-progress", "--dataset", "synthetic"]
MODEL_FILE = '''
from dptrain import nn


class Small(nn.Module):  # a model of the user's own, not in dptrain.nn
    def __init__(self, channels, classes):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, 4, 3, padding=1), nn.ReLU(),
                                  nn.MaxPool2d(4), nn.Flatten())
        self.head = nn.Linear(4 * 12 * 12, classes)

    def forward(self, x):
        return self.head(self.body(x))


def build(image_shape, num_classes):
    return Small(image_shape[0], num_classes)


def not_a_model():
    return 42
'''


def run_cli(*args, cwd, cache):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{cwd}", DPTRAIN_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "dptrain", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "mymodels.py").write_text(MODEL_FILE)
    return tmp_path


def test_a_user_model_trains_resumes_and_evaluates(user_dir):
    cache, ck = user_dir / "cache", user_dir / "ck"
    first = run_cli("train", *SMALL, "--model", "mymodels:build", "--max-steps", "4",
                    "--epochs", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "4",
                    "--log-dir", str(user_dir / "L"), cwd=user_dir, cache=cache)
    assert first.returncode == 0, first.stderr
    resumed = run_cli("train", *SMALL, "--model", "mymodels:build", "--epochs", "2",
                      "--checkpoint-dir", str(ck), "--resume", "auto", "--save", "W.npz",
                      "--log-dir", str(user_dir / "L"), cwd=user_dir, cache=cache)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((user_dir / "L" / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["val_accuracy"] is not None
    evaluated = run_cli("eval", "--load", "W.npz", "--model", "mymodels.py:build", "--device",
                        "cpu", "--images", "64",
                        cwd=user_dir, cache=cache)
    assert evaluated.returncode == 0, evaluated.stderr


@pytest.mark.parametrize("spec,message", [
    ("missing.py:build", "--model missing.py:build: no file missing.py"),
    ("mymodels.py:nothing", "--model mymodels.py:nothing: mymodels.py has no function nothing"),
    ("mymodels.py:not_a_model", "returned int, not a dptrain.nn.Module"),
    ("no_such_package.mod:build", "cannot import no_such_package.mod"),
    ("resnet9000", "'resnet9000' is not a model"),
])
def test_bad_model_specs_end_with_one_line(user_dir, spec, message):
    result = run_cli("train", *SMALL, "--model", spec, "--max-steps", "1", cwd=user_dir,
                     cache=user_dir / "cache")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
