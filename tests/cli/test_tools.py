"""Day-to-day tools around training: eval, plot, --config, log directories, weights metadata,
--help, and the launchers dptrain refuses (torchrun, Slurm without MPI)."""
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dptrain.checkpoints.weights import load_weights, read_metadata, read_weights, save_weights
from dptrain.cli.commands import main as cli_main
from dptrain.errors import UsageError
from dptrain.nn import build_model
from dptrain.optim import LRSchedule

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--model", "mlp", "--train-images", "128", "--val-images", "40",
        "--epochs", "1", "--max-steps", "3", "--batch-size", "32", "--log-every", "1",
        "--no-progress", "--seed", "4"]
# No MPI launcher variables: these tests start plain processes.
_LAUNCHED = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCALNRANKS", "SLURM_", "RANK", "WORLD_SIZE",
             "LOCAL_RANK")


def cli(*args, env=None, cache=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHED)}
    base.update(PYTHONPATH=str(ROOT), **(env or {}))
    if cache:
        base["DPTRAIN_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "dptrain", *args], capture_output=True,
                          text=True, env=base, timeout=300)


def one_line_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny training run: its log directory and weights."""
    tmp = tmp_path_factory.mktemp("run")
    code = cli_main(["train", *TINY, "--cache-dir", str(tmp / "cache"), "--log-dir",
                     str(tmp / "L"), "--save", str(tmp / "W.npz")])
    assert code == 0
    return tmp


def test_eval_prints_a_confusion_matrix_summing_to_the_validation_size(run, capsys):
    out = run / "eval.json"
    code = cli_main(["eval", "--load", str(run / "W.npz"), "--device", "cpu", "--images", "40",
                     "--seed", "4", "--cache-dir", str(run / "cache"), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "confusion matrix" in printed and "per-class accuracy" in printed
    result = json.loads(out.read_text())
    counts = np.array(result["confusion_matrix"])
    assert counts.shape == (7, 7) and counts.sum() == 40 == result["images"]
    assert result["support"] == counts.sum(axis=1).tolist()
    assert result["class_names"][0] == "circle"  # the synthetic set's names, from the file
    assert result["accuracy"] == pytest.approx(np.trace(counts) / 40)
    rows = printed.splitlines()
    matrix = [line for line in rows[rows.index(next(r for r in rows if "confusion" in r)) + 2:]]
    assert sum(int(v) for line in matrix for v in line.split()[2:]) == 40
    # The same validation set and weights as the run's last evaluation.
    summary = json.loads((run / "L" / "summary.json").read_text())
    assert result["accuracy"] == pytest.approx(summary["val_accuracy"])
    assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-4)


def test_weights_carry_metadata_and_old_files_still_load(run, tmp_path):
    meta = read_metadata(run / "W.npz")
    assert meta["model"] == "mlp" and meta["image_shape"] == [1, 48, 48]
    assert len(meta["class_names"]) == meta["num_classes"] == 7
    assert isinstance(meta["mean"], float) and meta["std"] > 0 and meta["dataset"] == "synthetic"
    state = read_weights(run / "W.npz")
    assert "__meta__" not in state
    old = tmp_path / "old.npz"
    np.savez(old, **state)  # as files were written before metadata
    assert read_metadata(old) is None
    model = build_model("mlp", (1, 48, 48), 7)
    load_weights(model, old)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, state[name])
    save_weights(model, tmp_path / "again.npz", meta={"model": "mlp"})
    load_weights(model, tmp_path / "again.npz")
    code = cli_main(["eval", "--load", str(old), "--model", "mlp", "--device", "cpu", "--images",
                     "40", "--seed", "4", "--cache-dir", str(run / "cache")])
    assert code == 0


def test_plot_writes_a_png(run, tmp_path):
    out = tmp_path / "curves.png"
    assert cli_main(["plot", str(run / "L"), str(run / "L"), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 400 and height >= 200 and len(data) > 10_000


def test_plot_without_matplotlib_is_one_line(run, tmp_path, monkeypatch):
    from dptrain.cli import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError, match="plot needs matplotlib"):
        plot.plot(plot.runs_of([run / "L"]), tmp_path / "c.png")
    with pytest.raises(UsageError, match="no metrics.jsonl"):
        plot.runs_of([tmp_path])


def test_metrics_rows_carry_time_and_accuracy_and_config_is_saved(run):
    rows = [json.loads(line) for line in (run / "L" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert all(0 <= r["accuracy"] <= 1 and r["time"] > 1.5e9 for r in train_rows)
    config = json.loads((run / "L" / "config.json").read_text())
    assert config["model"] == "mlp" and config["warmup_steps"] == 0  # 20% of 3 steps
    assert not [p for p in (run / "L").iterdir() if p.name.endswith(".tmp")]


def test_toml_config_equals_the_same_flags_and_log_dirs_are_kept(tmp_path):
    cache = str(tmp_path / "cache")
    toml = tmp_path / "run.toml"
    toml.write_text('device = "cpu"\nmodel = "mlp"\ntrain-images = 128\nval_images = 40\n'
                    'epochs = 1\nmax-steps = 3\nbatch-size = 32\noptimizer = "sgd"\nlr = 0.05\n'
                    'nesterov = true\nno-progress = true\nseed = 4\nlog-every = 1\n'
                    'batch-size-is-not-here = 0\n')
    bad = cli("train", "--config", str(toml))
    one_line_error(bad, str(toml), "batch-size-is-not-here")
    toml.write_text(toml.read_text().replace("batch-size-is-not-here = 0\n", ""))
    flags = ["--device", "cpu", "--model", "mlp", "--train-images", "128", "--val-images", "40",
             "--epochs", "1", "--max-steps", "3", "--batch-size", "32", "--optimizer", "sgd",
             "--lr", "0.05", "--nesterov", "--no-progress", "--seed", "4", "--log-every", "1"]
    logs = tmp_path / "L"
    assert cli_main(["train", *flags, "--cache-dir", cache, "--log-dir", str(logs),
                     "--save", str(tmp_path / "flags.npz")]) == 0
    assert cli_main(["train", "--config", str(toml), "--cache-dir", cache, "--log-dir",
                     str(logs), "--save", str(tmp_path / "toml.npz")]) == 0
    a, b = read_weights(tmp_path / "flags.npz"), read_weights(tmp_path / "toml.npz")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    # The second run did not overwrite the first: it went to L-1, with the same config.
    first = json.loads((logs / "config.json").read_text())
    second = json.loads((tmp_path / "L-1" / "config.json").read_text())
    assert first.pop("save") != second.pop("save")
    assert first.pop("log_dir") == str(logs) and second.pop("log_dir") == str(tmp_path / "L-1")
    assert first == second and first["nesterov"] and not first["progress"]
    # A flag on the command line wins over the file.
    assert cli_main(["train", "--config", str(toml), "--cache-dir", cache, "--log-dir",
                     str(logs), "--overwrite", "--max-steps", "2"]) == 0
    assert json.loads((logs / "config.json").read_text())["max_steps"] == 2
    assert json.loads((logs / "summary.json").read_text())["steps"] == 2
    assert not (tmp_path / "L-2").exists()


@pytest.mark.parametrize("text,fragments", [
    ("batch-size = 0\n", ["batch-size = 0", "positive"]),
    ('optimizer = "lbfgs"\n', ["optimizer = 'lbfgs'", "adamw"]),
    ('no-progress = "yes"\n', ["no-progress", "true or false"]),
    ("lr = [1, 2]\n", ["lr = [1, 2]"]),
    ("this is not toml\n", ["not valid TOML"]),
])
def test_bad_config_files_are_one_line(tmp_path, text, fragments):
    path = tmp_path / "c.toml"
    path.write_text(text)
    one_line_error(cli("train", "--config", str(path)), str(path), *fragments)
    one_line_error(cli("train", "--config", str(tmp_path / "none.toml")), "no such file")


def test_torchrun_without_mpi_is_refused(tmp_path):
    # (Slurm's tasks without MPI meet through the rendezvous: tests/distributed/test_slurm.py)
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    one_line_error(cli("train", *TINY, env=env, cache=tmp_path), "WORLD_SIZE=2", "torchrun",
                   "mpirun -n 2")


def test_a_world_of_one_from_torchrun_or_slurm_trains(tmp_path):
    from dptrain import distributed as dist

    dist.check_foreign_launcher(1)  # nothing set here
    env = {"RANK": "0", "WORLD_SIZE": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    result = cli("train", *TINY, "--max-steps", "1", env=env, cache=tmp_path)
    assert result.returncode == 0, result.stderr


def test_help_texts():
    train = cli("train", "--help").stdout
    assert "(default: True)" not in train and "(default: False)" not in train
    blocks = [" ".join(b.split()) for b in re.split(r"\n  (?=-)", train)]
    assert len(blocks) > 20
    for block in blocks:
        assert "(default: None)" not in block and block.count("default") <= 1, block
    for flag, default in (("--optimizer", "adamw"), ("--lr-schedule", "cosine"),
                          ("--weight-decay", "0.0005")):
        block = train[train.index("\n  " + flag + " ") + 3:].split("\n  -", 1)[0]
        assert f"(default: {default})" in " ".join(block.split()), block
    assert "usage: python -m dptrain bench ops" in cli("bench", "ops", "--help").stdout
    assert "usage: python -m dptrain eval" in cli("eval", "--help").stdout
    from dptrain import __version__

    assert cli("--version").stdout.strip() == f"dptrain {__version__}"


def test_warmup_is_a_fraction_of_the_run_and_a_misfit_is_named():
    assert LRSchedule(1.0, total_steps=31, warmup_steps=None).warmup_steps == 6
    assert LRSchedule(1.0, total_steps=10_000, warmup_steps=None).warmup_steps == 60
    assert LRSchedule(1.0, total_steps=31, warmup_steps=None).fit_warning() is None
    text = LRSchedule(1.0, total_steps=31, warmup_steps=60).fit_warning()
    assert "60-step warmup" in text and "31-step run" in text


def test_torch_twin_writes_comparable_metrics(tmp_path):
    torch = pytest.importorskip("torch")
    logs = tmp_path / "L"
    code = cli_main(["train", *TINY, "--model", "cnn", "--max-steps", "2", "--cache-dir",
                     str(tmp_path / "cache"), "--log-dir", str(logs), "--torch"])
    assert code == 0
    ours = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    twin = [json.loads(x) for x in (logs / "torch" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ours] == [r["step"] for r in twin]
    # Same initial weights and first batch: the first step's loss agrees to float rounding.
    assert twin[0]["loss"] == pytest.approx(ours[0]["loss"], rel=1e-4), torch.__version__
    assert twin[0]["accuracy"] == ours[0]["accuracy"]
    png = tmp_path / "c.png"
    assert cli_main(["plot", str(logs), "-o", str(png)]) == 0 and png.stat().st_size > 0


def test_torch_flag_without_torch_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    from dptrain.run import torch_twin

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(UsageError, match="--torch: PyTorch is not installed"):
        torch_twin.require_torch()
