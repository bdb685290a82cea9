"""Exact resume: a run continued from a checkpoint is the uninterrupted run, bitwise at the
same world size (1 and 2 ranks, under real mpirun), to rounding at another world size; the
same after a SIGKILL at a random step followed by --resume auto."""
import json
import random

import numpy as np
import pytest

from mpilaunch import HAVE_MPI, run

ARGS = ["--device", "cpu", "--model", "mlp", "--train-images", "256", "--val-images", "32",
        "--epochs", "2", "--global-batch-size", "16", "--max-steps", "20", "--log-every", "1",
        "--eval-every", "100", "--no-progress", "--seed", "5"]
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")


def losses(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def weights(path):
    with np.load(path) as w:
        return {k: w[k] for k in w.files}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _full_run(ranks, tmp, cache, extra=()):
    out = run(ranks, ARGS + [*extra, "--log-dir", str(tmp / "full"), "--save",
                             str(tmp / "full.npz"), "--checkpoint-dir", str(tmp / "ck"),
                             "--checkpoint-every", "10"], cache)
    assert out.returncode == 0, out.stderr
    return losses(tmp / "full"), weights(tmp / "full.npz")


@pytest.mark.parametrize("ranks, extra", [
    (0, ()), pytest.param(2, (), marks=needs_mpi),
    (0, ("--augment",)),  # the augmentation's draws resume where they stopped
    (0, ("--augment", "random-resized-crop", "--image-size", "40")),  # its device counter too
    # fp16: the loss scale and its good-step count resume too (this scale overflows at first,
    # and the interval doubles it again within the run)
    (0, ("--model", "cnn", "--precision", "fp16", "--loss-scale", str(2.0**20),
         "--loss-scale-interval", "3")),
    # fp16 over 2 ranks: the resumed parameters' 16-bit shadow is what the ranks all-gather
    pytest.param(2, ("--model", "cnn", "--precision", "fp16"), marks=needs_mpi),
])
def test_resume_from_step_10_is_bitwise_the_full_run(ranks, extra, tmp_path, cache):
    full_losses, full_w = _full_run(ranks, tmp_path, cache, extra)
    assert sorted(full_losses) == list(range(1, 21))
    out = run(ranks, ARGS + [*extra, "--log-dir", str(tmp_path / "again"), "--save",
                             str(tmp_path / "again.npz"), "--resume",
                             str(tmp_path / "ck" / "step-00000010")], cache)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout and "at step 10" in out.stdout
    again = losses(tmp_path / "again")
    assert sorted(again) == list(range(11, 21))
    assert all(again[s] == full_losses[s] for s in again), (again, full_losses)
    resumed_w = weights(tmp_path / "again.npz")
    for name, ref in full_w.items():
        assert np.array_equal(resumed_w[name], ref), name


@pytest.mark.parametrize("ranks", [0, pytest.param(2, marks=needs_mpi)])
def test_sigkill_then_resume_auto_is_bitwise_the_full_run(ranks, tmp_path, cache):
    full_losses, full_w = _full_run(ranks, tmp_path / "ref", cache)
    kill_at = random.Random().randint(4, 17)
    ck = tmp_path / "ck"
    args = ARGS + ["--checkpoint-dir", str(ck), "--checkpoint-every", "3"]
    killed = run(ranks, args, cache, DPTRAIN_TEST_KILL=f"{ranks - 1 if ranks else 0}:{kill_at}")
    assert killed.returncode != 0, killed.stdout
    last = (kill_at - 1) // 3 * 3  # the kill comes before that step's checkpoint
    assert (ck / f"step-{last:08d}" / "manifest.json").is_file()
    out = run(ranks, args + ["--resume", "auto", "--log-dir", str(tmp_path / "L"),
                             "--save", str(tmp_path / "w.npz")], cache)
    assert out.returncode == 0, out.stderr
    assert f"at step {last}" in out.stdout, (kill_at, out.stdout)
    again = losses(tmp_path / "L")
    assert all(again[s] == full_losses[s] for s in again) and min(again) == last + 1
    for name, ref in full_w.items():
        assert np.array_equal(weights(tmp_path / "w.npz")[name], ref), (name, kill_at)
    assert not list(ck.rglob("*.tmp"))
    assert len([p for p in ck.iterdir() if p.name.startswith("step-")]) <= 3  # keep 3


@needs_mpi
def test_resume_two_ranks_onto_one_matches_to_rounding(tmp_path, cache):
    full_losses, full_w = _full_run(2, tmp_path, cache)
    out = run(0, ARGS + ["--log-dir", str(tmp_path / "one"), "--save", str(tmp_path / "one.npz"),
                         "--resume", str(tmp_path / "ck" / "step-00000010")], cache)
    assert out.returncode == 0, out.stderr
    assert "written by 2 rank(s)" in out.stdout
    one = losses(tmp_path / "one")
    for s in range(11, 21):
        assert abs(one[s] - full_losses[s]) <= 1e-5 * max(1.0, abs(full_losses[s])), s
    w = weights(tmp_path / "one.npz")
    for name, ref in full_w.items():
        rel = np.abs(w[name] - ref).max() / (np.abs(ref).max() + 1e-12)
        assert rel <= 1e-5, (name, rel)


def test_resume_refuses_another_model_or_global_batch(tmp_path, cache):
    _full_run(0, tmp_path, cache)
    ck = str(tmp_path / "ck" / "step-00000010")
    other = [a if a != "mlp" else "cnn" for a in ARGS]
    out = run(0, other + ["--resume", ck], cache)
    assert out.returncode == 2 and "--model mlp" in out.stderr, out.stderr
    bigger = [a if a != "16" else "32" for a in ARGS]
    out = run(0, bigger + ["--resume", ck], cache)
    assert out.returncode == 2 and "global batch 16" in out.stderr, out.stderr


def test_sigterm_stops_after_a_step_with_a_checkpoint(tmp_path, cache):
    import signal
    import time

    from mpilaunch import start

    ck = tmp_path / "ck"
    args = [a if a != "20" else "100000" for a in ARGS]
    args = [a if a != "2" else "10000" for a in args]
    proc = start(0, args + ["--checkpoint-dir", str(ck), "--log-dir", str(tmp_path / "L")], cache)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "L" / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after step" in err
    step = int(err.split("after step ")[1].split(";")[0])
    assert (ck / f"step-{step:08d}" / "manifest.json").is_file()


def records(log_dir):
    """metrics.jsonl without its clock readings (time, images/s)."""
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in r.items() if k not in ("time", "images_per_s")}
            for r in map(json.loads, lines)]


@pytest.mark.parametrize("ranks", [0, pytest.param(2, marks=needs_mpi)])
def test_resumed_run_continues_its_own_metrics_exactly(ranks, tmp_path, cache):
    # logged every 4 steps, checkpoints every 5, killed after step 14: the log holds step 12,
    # past the newest checkpoint (10), which lands inside the window of steps 9-12
    args = [a if a != "1" else "4" for a in ARGS] + ["--eval-every", "8"]
    full = run(ranks, args + ["--log-dir", str(tmp_path / "full")], cache)
    assert full.returncode == 0, full.stderr
    logged = args + ["--log-dir", str(tmp_path / "L"), "--checkpoint-dir", str(tmp_path / "ck"),
                     "--checkpoint-every", "5"]
    killed = run(ranks, logged, cache, DPTRAIN_TEST_KILL=f"{max(ranks - 1, 0)}:14")
    assert killed.returncode != 0
    assert any(r.get("step") == 12 for r in records(tmp_path / "L"))
    out = run(ranks, logged + ["--resume", "auto"], cache)
    assert out.returncode == 0, out.stderr
    assert "at step 10" in out.stdout, out.stdout
    assert records(tmp_path / "L") == records(tmp_path / "full")


# -- resuming with other settings, extending a run, resuming a finished one

CONSTANT = [a for a in ARGS if a not in ("--max-steps", "20")] + [
    "--lr-schedule", "constant", "--warmup-steps", "0"]  # the rate is the same however long


def _set(args, flag, value):
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def test_resume_with_another_lr_is_refused_naming_it(tmp_path, cache):
    ck = tmp_path / "ck"
    out = run(0, ARGS + ["--checkpoint-dir", str(ck), "--checkpoint-every", "10"], cache)
    assert out.returncode == 0, out.stderr
    out = run(0, ARGS + ["--lr", "0.01", "--resume", str(ck / "step-00000010")], cache)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--lr 0.002" in lines[0] and "--lr 0.01" in lines[0], out.stderr


def _per_step_losses(tmp_path, cache, epochs):
    args = _set(_set(CONSTANT, "--epochs", str(epochs)), "--log-every", "1")
    out = run(0, args + ["--log-dir", str(tmp_path / "ref")], cache)
    assert out.returncode == 0, out.stderr
    return losses(tmp_path / "ref")


def _assert_true_window_means(logged: dict, per_step: dict, since: int):
    """Each logged loss is the mean of the per-step losses since the previous logged step."""
    previous = since
    for step in sorted(s for s in logged if s > since):
        window = [per_step[k] for k in range(previous + 1, step + 1)]
        assert logged[step] == pytest.approx(sum(window) / len(window), rel=1e-5), step
        previous = step


def test_extended_run_logs_true_window_means(tmp_path, cache):
    # 2 epochs of 16 steps logged every 5: the last window (31-32) closes at step 32, where the
    # checkpoint is; 3 epochs then log steps 35 (33-35 only), 40, 45 and 48
    per_step = _per_step_losses(tmp_path, cache, epochs=3)
    args = _set(CONSTANT, "--log-every", "5") + [
        "--log-dir", str(tmp_path / "L"), "--checkpoint-dir", str(tmp_path / "ck"),
        "--checkpoint-every", "16"]
    assert run(0, args, cache).returncode == 0
    out = run(0, _set(args, "--epochs", "3") + ["--resume", "auto"], cache)
    assert out.returncode == 0, out.stderr
    logged = losses(tmp_path / "L")
    assert sorted(s for s in logged if s > 32) == [35, 40, 45, 48]
    _assert_true_window_means(logged, per_step, since=0)
    summary = json.loads((tmp_path / "L" / "summary.json").read_text())
    assert summary["train_loss"] == logged[48]


def test_resume_with_another_log_every_logs_true_window_means(tmp_path, cache):
    # logged every 4, checkpoint at 10 inside the window 9-12; resumed logging every 3: its
    # first window is 9-12 (the restored sums of 9-10, then 11-12)
    per_step = _per_step_losses(tmp_path, cache, epochs=2)
    args = _set(CONSTANT, "--log-every", "4") + [
        "--log-dir", str(tmp_path / "L"), "--checkpoint-dir", str(tmp_path / "ck"),
        "--checkpoint-every", "10", "--max-steps", "20"]
    assert run(0, args, cache).returncode == 0
    out = run(0, _set(args, "--log-every", "3") + ["--resume", str(tmp_path / "ck" / "step-00000010")],
              cache)
    assert out.returncode == 0, out.stderr
    logged = losses(tmp_path / "L")
    assert sorted(logged) == [4, 8, 12, 15, 18, 20]
    _assert_true_window_means(logged, per_step, since=0)


def test_resume_auto_of_a_finished_run_says_so_and_keeps_its_summary(tmp_path, cache):
    args = ARGS + ["--log-dir", str(tmp_path / "L"), "--checkpoint-dir", str(tmp_path / "ck"),
                   "--checkpoint-every", "10"]
    assert run(0, args, cache).returncode == 0
    before = (tmp_path / "L" / "summary.json").read_text()
    log = (tmp_path / "L" / "metrics.jsonl").read_text()
    out = run(0, args + ["--resume", "auto"], cache)
    assert out.returncode == 0, out.stderr
    assert "the run is complete" in out.stdout and "step 20 of 20" in out.stdout, out.stdout
    assert "nan" not in out.stdout
    assert (tmp_path / "L" / "summary.json").read_text() == before
    assert (tmp_path / "L" / "metrics.jsonl").read_text() == log


def test_fresh_run_beside_its_own_checkpoints_is_refused(tmp_path, cache):
    # started over silently, its retention (newest steps kept) deleted its own new checkpoints
    ck = tmp_path / "ck"
    args = ARGS + ["--checkpoint-dir", str(ck), "--checkpoint-every", "5",
                   "--keep-checkpoints", "2"]
    assert run(0, args, cache).returncode == 0
    out = run(0, _set(args, "--max-steps", "10"), cache)
    assert out.returncode == 2, out.stderr
    assert "--resume auto" in out.stderr and "--overwrite" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = run(0, _set(args, "--max-steps", "10") + ["--overwrite"], cache)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000005", "step-00000010"]
