"""The command line's rough edges, each seen by a user: a flag that was accepted silently, an
error that was a traceback (or N copies of one line under mpirun), a file that went missing."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpilaunch import LAUNCHER, needs_mpi, run as mpi_run

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--device", "cpu", "--model", "mlp", "--train-images", "128", "--val-images", "32",
         "--epochs", "1", "--batch-size", "16", "--no-progress"]
FILES = ["--device", "cpu", "--model", "mlp", "--epochs", "1", "--batch-size", "4",
         "--no-progress"]  # a dataset read from files: all its images


def cli(*args, cwd=None, cache=None, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if cache:
        env["DPTRAIN_CACHE"] = str(cache)
    if "stdout" not in kwargs:
        kwargs["capture_output"] = True
    return subprocess.run([sys.executable, "-m", "dptrain", *args], text=True, cwd=cwd,
                          env=env, timeout=300, **kwargs)


def one_line(result, code=2):
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def image_folder(root: Path, classes=("a", "b"), per_class=8, size=12):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (size, size), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{i}.png")
    return root


# -- item 9: one class

def test_image_folder_with_one_class_is_refused(tmp_path, cache):
    data = image_folder(tmp_path / "data", classes=("only",))
    line = one_line(cli("train", "--dataset", "imagefolder", "--data-dir", str(data), *FILES,
                        cache=cache))
    assert "one class folder" in line and "'only'" in line, line


# -- item 10: sizes against memory, up front

@pytest.mark.parametrize("n", ["99999999999", "2000000000"])
def test_train_images_beyond_memory_is_one_line(n, cache):
    line = one_line(cli("train", *SMALL, "--train-images", n, cache=cache))
    assert f"--train-images {n}" in line and "memory" in line, line


def test_check_sizes_against_a_given_memory():
    from dptrain.errors import UsageError
    from dptrain.run.config import TrainConfig
    from dptrain.run.preflight import check_sizes

    cfg = TrainConfig(train_images=1000, val_images=100)
    check_sizes(cfg, memory=1000 * 2312 + 100 * 2312)
    with pytest.raises(UsageError, match="--train-images 1000 with --val-images 100"):
        check_sizes(cfg, memory=1000 * 2312)


# -- item 12, one by one

def test_weights_hold_only_the_models_tensors(tmp_path, cache):
    # a strict torch load_state_dict takes every array of the file: no __meta__ among them
    from dptrain.checkpoints.weights import read_metadata
    from dptrain.nn import build_model

    out = cli("train", *SMALL, "--max-steps", "2", "--save", str(tmp_path / "w.npz"),
              cache=cache)
    assert out.returncode == 0, out.stderr
    model = build_model("mlp", (1, 48, 48), 7)
    with np.load(tmp_path / "w.npz") as w:
        assert set(w.files) == set(model.state_dict())
    meta = read_metadata(tmp_path / "w.npz")
    assert meta["model"] == "mlp" and meta["num_classes"] == 7


def test_old_weights_with_a_meta_array_still_load(tmp_path):
    from dptrain.checkpoints.weights import read_metadata, read_weights

    np.savez(tmp_path / "old.npz", w=np.ones(3, np.float32),
             __meta__=np.frombuffer(b'{"model": "mlp"}', np.uint8))
    assert read_metadata(tmp_path / "old.npz") == {"model": "mlp"}
    assert set(read_weights(tmp_path / "old.npz")) == {"w"}


@needs_mpi
@pytest.mark.parametrize("args", [["--val-fraction", "1.5"], ["--save", "EXISTING"],
                                  ["--global-batch-size", "15"], ["--batch-size", "100"]])
def test_usage_error_under_mpi_is_one_line(args, tmp_path, cache):
    existing = tmp_path / "w.npz"
    existing.write_bytes(b"x")
    args = [str(existing) if a == "EXISTING" else a for a in args]
    out = mpi_run(2, SMALL + args, cache)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr
    assert "Traceback" not in out.stderr and "Abort" not in out.stderr
    if LAUNCHER.flavour == "mpich":  # Open MPI's launcher adds its own note on exit codes
        assert len([line for line in out.stderr.splitlines() if line.strip()]) == 1, out.stderr


def test_eval_from_another_directory_finds_the_recorded_data(tmp_path, cache):
    image_folder(tmp_path / "a" / "data")
    out = cli("train", "--dataset", "imagefolder", "--data-dir", "data", *FILES,
              "--max-steps", "2", "--save", "w.npz", cwd=tmp_path / "a",
              cache=cache)
    assert out.returncode == 0, out.stderr
    (tmp_path / "b").mkdir()
    out = cli("eval", "--load", "../a/w.npz", "--device", "cpu", cwd=tmp_path / "b", cache=cache)
    assert out.returncode == 0, out.stderr
    assert "accuracy" in out.stdout


def test_resume_to_a_missing_path_says_so(tmp_path, cache):
    line = one_line(cli("train", *SMALL, "--resume", str(tmp_path / "nope"), cache=cache))
    assert "no such checkpoint directory" in line and "torn" not in line, line


def test_an_error_inside_the_users_model_builder_keeps_its_traceback(tmp_path, cache):
    (tmp_path / "mine.py").write_text(
        "def build(image_shape, num_classes):\n"
        "    raise ValueError('my builder broke')\n")
    out = cli("train", *SMALL, "--model", f"{tmp_path / 'mine.py'}:build", cache=cache)
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "mine.py" in out.stderr, out.stderr
    assert "my builder broke" in out.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--optimizer", "adamw", "--nesterov"], "--nesterov"),
    (["--optimizer", "sgd", "--momentum", "2"], "--momentum 2"),
    (["--val-fraction", "1.5"], "--val-fraction 1.5"),
    (["--augment", "--augment-pad", "1000"], "--augment-pad 1000"),
])
def test_settings_that_cannot_work_are_refused(args, fragment, cache):
    line = one_line(cli("train", *SMALL, *args, cache=cache))
    assert fragment in line, line


def test_help_texts():
    from dptrain.nn import MODELS, build_model
    from dptrain.run.amp import _without_16bit_path

    text = " ".join(cli("train", "--help").stdout.split())
    # --precision auto picks bf16 for every model with a 16-bit kernel in each layer: all
    for name in MODELS:
        assert _without_16bit_path(build_model(name, (1, 48, 48), 7)) is None, name
    auto = text.split("auto: bf16")[1].split("else fp32")[0]
    assert all(name in auto for name in MODELS), auto
    assert "step (x0.1" in text
    info = " ".join(cli("data", "info", "--help").stdout.split())
    assert "Describe a packed dataset" in info
    synth = " ".join(cli("data", "synth", "--help").stdout.split())
    assert "--seed SEED seeds the images" in synth


def test_eval_takes_hidden(tmp_path, cache):
    out = cli("train", *SMALL, "--max-steps", "2", "--hidden", "24,12", "--save",
              str(tmp_path / "w.npz"), cache=cache)
    assert out.returncode == 0, out.stderr
    for extra in ([], ["--hidden", "24,12"]):  # recorded in the file, or given
        out = cli("eval", "--load", str(tmp_path / "w.npz"), "--device", "cpu", "--images",
                  "32", *extra, cache=cache)
        assert out.returncode == 0, out.stderr
    line = one_line(cli("eval", "--load", str(tmp_path / "w.npz"), "--device", "cpu",
                        "--images", "32", "--hidden", "8", cache=cache))
    assert "--load" in line


def test_plot_to_a_format_matplotlib_cannot_write_is_one_line(tmp_path, cache):
    pytest.importorskip("matplotlib")
    out = cli("train", *SMALL, "--max-steps", "2", "--log-dir", str(tmp_path / "L"),
              cache=cache)
    assert out.returncode == 0, out.stderr
    line = one_line(cli("plot", str(tmp_path / "L"), "-o", str(tmp_path / "x.txt")))
    assert "x.txt" in line, line


def test_redirected_progress_prints_the_last_step_once(cache):
    args = [a for a in SMALL if a != "--no-progress"]
    out = cli("train", *args, "--log-every", "4", cache=cache)
    assert out.returncode == 0, out.stderr
    last = [line for line in out.stderr.splitlines() if line.startswith("step 8/8")]
    assert len(last) == 1, out.stderr
    assert "loss" in last[0]


def test_unknown_command_is_a_usage_error_naming_it():
    line = one_line(cli("nosuch"))
    assert "'nosuch'" in line and "command" in line, line


def test_sigint_stopped_run_says_where_its_files_are(tmp_path, cache):
    args = [a if a != "1" else "10000" for a in SMALL]  # --epochs 10000: until stopped
    env = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "train", *args, "--log-dir",
                             str(tmp_path / "L"), "--checkpoint-dir", str(tmp_path / "ck")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "L" / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    last = err.strip().splitlines()[-1]
    assert "stopped by SIGINT" in last and str(tmp_path / "L") in last, last
    assert str(tmp_path / "ck") in last and "--resume auto" in last, last


def test_eval_into_a_closed_pipe_exits_quietly(tmp_path, cache):
    out = cli("train", *SMALL, "--max-steps", "2", "--save", str(tmp_path / "w.npz"),
              cache=cache)
    assert out.returncode == 0, out.stderr
    read, write = os.pipe()
    os.close(read)  # `| head` that has gone before eval writes
    try:
        out = cli("eval", "--load", str(tmp_path / "w.npz"), "--device", "cpu", "--images",
                  "32", cache=cache, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.stderr.strip() == ""
