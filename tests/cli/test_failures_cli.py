"""Bad runs and bad input from the command line: the documented outcome for each (exit code,
one line naming the culprit, nothing good overwritten)."""
import json
import zipfile

import numpy as np
import pytest

from test_cli import SMALL, _assert_usage_error, run_cli


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def good_weights(tmp_path_factory, cache):
    path = tmp_path_factory.mktemp("w") / "good.npz"
    result = run_cli(*SMALL, "--model", "mlp", "--max-steps", "2", "--save", str(path),
                     cache=cache)
    assert result.returncode == 0, result.stderr
    return path


# -- case 1: a run that blows up
def test_blow_up_stops_with_exit_3_and_keeps_the_good_file(tmp_path, cache, good_weights):
    target = tmp_path / "w.npz"
    target.write_bytes(good_weights.read_bytes())
    logs = tmp_path / "L"
    result = run_cli(*SMALL, "--optimizer", "sgd", "--lr", "1e6", "--warmup-steps", "0",
                     "--log-every", "2", "--save", str(target), "--overwrite",
                     "--log-dir", str(logs), "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4",
                     cache=cache)
    assert result.returncode == 3, result.stderr
    line = [l for l in result.stderr.splitlines() if "non-finite" in l]
    assert line and "at step" in line[0], result.stderr
    assert target.read_bytes() == good_weights.read_bytes()  # not overwritten
    assert not (logs / "summary.json").exists()
    for text in (logs / "metrics.jsonl").read_text().splitlines():
        json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics"))
    for ck in (tmp_path / "ck").glob("step-*"):  # any checkpoint written holds finite weights
        with np.load(ck / "model.npz") as w:
            assert all(np.isfinite(w[k]).all() for k in w.files)


def test_skip_nonfinite_budget_is_counted(tmp_path, cache):
    result = run_cli(*SMALL, "--optimizer", "sgd", "--lr", "1e6", "--warmup-steps", "0",
                     "--log-every", "1", "--skip-nonfinite", "2", cache=cache)
    assert result.returncode == 3, result.stderr
    assert "more than --skip-nonfinite 2" in result.stderr


@pytest.mark.parametrize("flag", ["--lr", "--weight-decay", "--momentum", "--bucket-mb"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_flags_are_refused(flag, value):
    _assert_usage_error(run_cli(f"{flag}={value}"), flag, value)


def test_strict_json_writes_null_for_nan():
    from dptrain.run.metrics import dumps

    assert json.loads(dumps({"loss": float("nan"), "x": [float("inf"), 1.0]})) == \
        {"loss": None, "x": [None, 1.0]}


# -- case 3: outputs that cannot be written fail before training
@pytest.mark.parametrize("what", ["folder", "under-a-file"])
def test_bad_save_path_fails_before_training(tmp_path, what):
    (tmp_path / "file").write_text("x")
    target = tmp_path if what == "folder" else tmp_path / "file" / "w.npz"
    result = run_cli(*SMALL, "--save", str(target), cache=tmp_path / "cache")
    _assert_usage_error(result, "--save", str(target))
    assert not (tmp_path / "cache").exists()  # failed before even building the dataset


@pytest.mark.parametrize("flag", ["--log-dir", "--checkpoint-dir"])
def test_directory_flag_that_is_a_file(tmp_path, flag):
    (tmp_path / "file").write_text("x")
    result = run_cli(*SMALL, flag, str(tmp_path / "file"), cache=tmp_path / "cache")
    _assert_usage_error(result, flag, "not a directory")


# -- case 5: what --load refuses, and flags named in their errors
def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("kind", ["int8", "complex64", "nan", "inf", "object", "flipped"])
def test_load_rejects_bad_arrays_naming_file_and_array(tmp_path, cache, good_weights, kind):
    with np.load(good_weights) as w:
        state = {k: w[k] for k in w.files if k != "__meta__"}
    name = sorted(state)[0]
    path = tmp_path / "bad.npz"
    if kind == "flipped":
        np.savez(path, **state)
        with zipfile.ZipFile(path) as zf:
            info = zf.getinfo(name + ".npy")
        data = bytearray(path.read_bytes())
        data[info.header_offset + 30 + len(info.filename) + 200] ^= 0x10  # inside the data
        path.write_bytes(bytes(data))
    else:
        bad = state[name]
        if kind in ("int8", "complex64"):
            bad = bad.astype(kind)
        elif kind in ("nan", "inf"):
            bad = bad.copy()
            bad.flat[3] = float(kind)
        else:
            bad = np.array([{"evil": 1}], dtype=object)
        np.savez(path, **{**state, name: bad})
    result = run_cli(*SMALL, "--model", "mlp", "--load", str(path), cache=cache)
    _assert_usage_error(result, "--load", str(path), repr(name))


def test_load_ignores_reserved_meta_array(tmp_path, cache, good_weights):
    with np.load(good_weights) as w:
        state = {k: w[k] for k in w.files if k != "__meta__"}
    path = _npz(tmp_path / "meta.npz", **state, __meta__=np.frombuffer(b'{"v": 1}', np.uint8))
    result = run_cli(*SMALL, "--model", "mlp", "--max-steps", "1", "--load", str(path),
                     cache=cache)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("args,fragments", [
    (["--seed", "-5"], ["--seed", "-5"]),
    (["--bucket-mb", "inf"], ["--bucket-mb", "inf"]),
    (["--global-batch-size", "32", "--batch-size", "16"], ["--global-batch-size", "--batch-size"]),
    (["--resume", "auto"], ["--resume auto", "--checkpoint-dir"]),
])
def test_flag_errors_name_the_flag(tmp_path, args, fragments):
    _assert_usage_error(run_cli(*SMALL, *args, cache=tmp_path), *fragments)


def test_resume_of_a_torn_checkpoint_names_it(tmp_path):
    torn = tmp_path / "step-00000010"
    torn.mkdir()
    _assert_usage_error(run_cli(*SMALL, "--resume", str(torn), cache=tmp_path),
                        "--resume", str(torn), "torn")


# -- case 6: leftovers of killed runs
def test_restart_removes_stale_temporaries_and_old_summary(tmp_path, cache):
    target, logs = tmp_path / "w.npz", tmp_path / "L"
    logs.mkdir()
    stale = [tmp_path / ".w.npz.abc123.tmp", tmp_path / ".w.npz.zz9.tmp"]
    for p in stale:
        p.write_bytes(b"partial")
    other = tmp_path / ".unrelated.npz.x.tmp"
    other.write_bytes(b"not ours")
    (logs / "summary.json").write_text('{"old": true}')
    result = run_cli(*SMALL, "--model", "mlp", "--max-steps", "1", "--save", str(target),
                     "--log-dir", str(logs), "--eval-every", "0", "--overwrite", cache=cache)
    assert result.returncode == 0, result.stderr
    assert not any(p.exists() for p in stale) and other.exists()
    assert "old" not in json.loads((logs / "summary.json").read_text())


def test_interrupted_rerun_leaves_no_old_summary(tmp_path, cache):
    """A rerun into a log dir that holds a run goes to a new one (LOGDIR-1) and leaves the old
    run whole; with --overwrite it reuses the dir and the old summary goes at the start."""
    logs = tmp_path / "L"
    logs.mkdir()
    (logs / "summary.json").write_text('{"old": true}')
    blow_up = (*SMALL, "--model", "mlp", "--optimizer", "sgd", "--lr", "1e6",
               "--warmup-steps", "0", "--log-dir", str(logs))
    result = run_cli(*blow_up, cache=cache)
    assert result.returncode == 3  # ended before writing a summary of its own
    assert json.loads((logs / "summary.json").read_text()) == {"old": True}
    assert (tmp_path / "L-1" / "metrics.jsonl").exists()
    assert not (tmp_path / "L-1" / "summary.json").exists()
    result = run_cli(*blow_up, "--overwrite", cache=cache)
    assert result.returncode == 3
    assert not (logs / "summary.json").exists()
