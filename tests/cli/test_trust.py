"""Nothing a user has is replaced without --overwrite, and every command takes every dataset:
--save, --checkpoint-dir of another run, `eval` and `train --torch` on file datasets, `data
pack` over a packed set, and where a run's files went."""
import sys
from unittest import mock

import numpy as np
import pytest

from data_fixtures import write_mnist
from test_cli import SMALL, _assert_usage_error, run_cli

TINY = [*SMALL, "--model", "mlp", "--max-steps", "2"]
FILES = ["--device", "cpu", "--batch-size", "8", "--epochs", "1", "--no-progress", "--model",
         "mlp", "--max-steps", "2"]  # a file dataset, used whole


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mnist")
    write_mnist(str(folder), np.random.default_rng(0), n_train=40, n_test=12)
    return folder


def test_save_never_replaces_weights_without_overwrite(tmp_path, cache):
    logs, weights = tmp_path / "runs" / "a", tmp_path / "runs" / "a" / "w.npz"
    first = run_cli(*TINY, "--log-dir", str(logs), "--save", str(weights), cache=cache)
    assert first.returncode == 0, first.stderr
    kept = weights.read_bytes()
    # the same command again: the logs move to a-1 and the weights follow them
    second = run_cli(*TINY, "--seed", "1", "--log-dir", str(logs), "--save", str(weights),
                     cache=cache)
    assert second.returncode == 0, second.stderr
    assert weights.read_bytes() == kept
    assert (tmp_path / "runs" / "a-1" / "w.npz").is_file()
    assert str(tmp_path / "runs" / "a-1" / "w.npz") in second.stdout.splitlines()[-1]
    # outside a log directory: refused, naming the file
    elsewhere = tmp_path / "w.npz"
    elsewhere.write_bytes(kept)
    _assert_usage_error(run_cli(*TINY, "--save", str(elsewhere), cache=cache), "--save",
                        str(elsewhere), "--overwrite")
    again = run_cli(*TINY, "--save", str(elsewhere), "--overwrite", cache=cache)
    assert again.returncode == 0, again.stderr


def test_checkpoint_dir_of_another_run_is_refused(tmp_path, cache):
    ck = tmp_path / "ck"
    args = [*TINY, "--checkpoint-dir", str(ck), "--checkpoint-every", "1"]
    assert run_cli(*args, "--seed", "3", cache=cache).returncode == 0
    theirs = (ck / "step-00000002" / "model.npz").read_bytes()
    _assert_usage_error(run_cli(*args, "--seed", "99", cache=cache), "--checkpoint-dir",
                        "--seed 3", "--seed 99")
    assert (ck / "step-00000002" / "model.npz").read_bytes() == theirs
    # the same run again continues it (--resume auto) or starts over (--overwrite): started
    # beside its old checkpoints, their retention would delete its new ones
    _assert_usage_error(run_cli(*args, "--seed", "3", cache=cache), "--checkpoint-dir",
                        "--resume auto", "--overwrite")
    replaced = run_cli(*args, "--seed", "99", "--overwrite", cache=cache)
    assert replaced.returncode == 0, replaced.stderr
    assert (ck / "step-00000002" / "model.npz").read_bytes() != theirs


def test_checkpoint_every_needs_a_checkpoint_dir():
    _assert_usage_error(run_cli(*TINY, "--checkpoint-every", "5"), "--checkpoint-every",
                        "--checkpoint-dir")


def test_eval_takes_a_file_dataset_from_the_weights(tmp_path, cache, mnist):
    weights = tmp_path / "w.npz"
    trained = run_cli(*FILES, "--dataset", "mnist", "--data-dir", str(mnist), "--save",
                      str(weights), cache=cache)
    assert trained.returncode == 0, trained.stderr
    out = run_cli("eval", "--load", str(weights), "--device", "cpu", cache=cache)
    assert out.returncode == 0, out.stderr
    assert "on mnist val, 12 images" in out.stdout
    _assert_usage_error(run_cli("eval", "--load", str(weights), "--device", "cpu", "--images",
                                "50", cache=cache), "--images 50", "only 12")


def test_torch_twin_reads_the_runs_files(monkeypatch, tmp_path, mnist):
    """The twin asks for the dataset with our run's --data-dir (torch itself is faked: the
    test stops at the dataset)."""
    from dptrain import data
    from dptrain.run.config import TrainConfig
    from dptrain.run.torch_twin import train_twin

    asked = []

    class Reached(Exception):
        pass

    def get_dataset(name, split, n, seed=0, cache_dir=None, **options):
        asked.append(options)
        raise Reached

    monkeypatch.setattr(data, "get_dataset", get_dataset)
    monkeypatch.setitem(sys.modules, "torch", mock.MagicMock())
    cfg = TrainConfig(dataset="mnist", data_dir=str(mnist), device="cpu", epochs=1)
    with pytest.raises(Reached):
        train_twin(cfg, "cpu", 32)
    assert asked and asked[0].get("data_dir") == str(mnist)


def test_data_pack_keeps_a_packed_set_and_names_a_missing_parent(tmp_path, mnist):
    out = tmp_path / "packed"
    assert run_cli("data", "pack", str(mnist), str(out)).returncode == 0
    header = (out / "header.json").read_bytes()
    _assert_usage_error(run_cli("data", "pack", str(mnist), str(out)), str(out), "--overwrite")
    assert (out / "header.json").read_bytes() == header
    assert run_cli("data", "pack", str(mnist), str(out), "--overwrite").returncode == 0
    orphan = tmp_path / "no" / "such" / "out"
    _assert_usage_error(run_cli("data", "pack", str(mnist), str(orphan)),
                        "parent directory", "missing")


def test_output_is_one_line_per_event_when_redirected(tmp_path, cache):
    """No carriage-return progress frames in a log file; a divergence is its one line, with
    no NumPy warnings before it; errors share the prefix `dptrain COMMAND: error:`."""
    out = run_cli(*[a for a in TINY if a != "--no-progress"], cache=cache)
    assert out.returncode == 0 and "\r" not in out.stderr, out.stderr
    blown = run_cli(*SMALL, "--optimizer", "sgd", "--lr", "1e6", "--warmup-steps", "0",
                    "--log-every", "1", cache=cache)
    assert blown.returncode == 3, blown.stderr
    lines = [line for line in blown.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "non-finite" in lines[0], blown.stderr
    assert run_cli("train", "--epochs", "x").stderr.startswith("dptrain train: error:")
    assert run_cli("data", "info").stderr.startswith("dptrain data info: error:")
    assert "bench startup" in run_cli("--help").stdout
