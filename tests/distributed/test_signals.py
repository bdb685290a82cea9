"""Exit codes and messages of a job stopped by a signal or a non-finite step, the same under
Open MPI and MPICH: 128 + the signal (with a checkpoint) or 3, one message, no MPI abort.

Where the signal goes depends on the launcher's flavour (read from its --version): MPICH's
mpiexec forwards SIGINT/SIGTERM to the ranks and waits for them, so the test signals it;
Open MPI's mpirun forwards them and kills the ranks a fraction of a second later (too soon
to write a checkpoint), so the test signals the ranks, as a batch scheduler does."""
import os
import signal
import time
from pathlib import Path

import pytest

from mpilaunch import LAUNCHER, needs_mpi, run, start

ARGS = ["--device", "cpu", "--model", "mlp", "--train-images", "256", "--val-images", "32",
        "--epochs", "10000", "--global-batch-size", "16", "--log-every", "1", "--no-progress"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def descendants(pid):
    """The pids of the processes below `pid` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        children = [c for c, parent in parents.items() if parent == p]
        found += children
        frontier += children
    return found


def dptrain_ranks(pid):
    ranks = []
    for child in descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dptrain" in cmdline and b"-m" in cmdline:
            ranks.append(child)
    return ranks


@needs_mpi
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_rank_with_128_plus_signal(sig, tmp_path, cache):
    if LAUNCHER.flavour == "srun":
        pytest.skip("srun's signal handling is Slurm's")
    ck, logs = tmp_path / "ck", tmp_path / "L"
    proc = start(2, ARGS + ["--checkpoint-dir", str(ck), "--log-dir", str(logs)], cache)
    deadline = time.time() + 120
    while time.time() < deadline and not (logs / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    if LAUNCHER.flavour == "mpich":
        proc.send_signal(sig)
    else:
        ranks = dptrain_ranks(proc.pid)
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, sig)
    out, err = proc.communicate(timeout=120)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err
    assert err.count(f"stopped by {name} after step") == 1, err
    assert "MPI_ABORT" not in err and "Traceback" not in err, err
    step = int(err.split("after step ")[1].split(";")[0])
    assert (ck / f"step-{step:08d}" / "manifest.json").is_file()


@needs_mpi
def test_nonfinite_stop_is_one_message_at_two_ranks(cache):
    out = run(2, ["--device", "cpu", "--train-images", "256", "--val-images", "64", "--epochs",
                  "1", "--global-batch-size", "64", "--no-progress", "--optimizer", "sgd",
                  "--lr", "1e6", "--warmup-steps", "0", "--log-every", "1"], cache)
    assert out.returncode == 3, out.stderr
    assert len([line for line in out.stderr.splitlines() if "non-finite" in line]) == 1, out.stderr
    assert "MPI_ABORT" not in out.stderr
