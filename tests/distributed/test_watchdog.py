"""Failures end the job instead of hanging it: a SIGKILLed rank ends the job within 10 s with
no process left; a rank that stops answering (SIGSTOP, or sleeping before a collective) trips
the watchdog within the timeout + 10 s, the job prints one verdict naming it and exits with
the watchdog's code, on the CPU and on 2 GPUs (where the other rank's main thread is blocked
behind an NCCL kernel waiting for the stopped one)."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mpilaunch import HAVE_MPI, gpu_count, run, start

pytestmark = pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
ARGS = ["--device", "cpu", "--model", "mlp", "--train-images", "256", "--val-images", "32",
        "--epochs", "1000", "--global-batch-size", "16", "--log-every", "1", "--no-progress",
        "--collective-timeout", "4"]


def _ranks_of(proc):
    """PIDs of the dptrain ranks the launcher started (its descendants running Python)."""
    out = subprocess.run(["ps", "-o", "pid=,ppid=,args=", "-e"], capture_output=True,
                         text=True).stdout
    children, args_of = {}, {}
    for line in out.splitlines():
        pid, ppid, args = (line.strip().split(None, 2) + [""])[:3]
        children.setdefault(int(ppid), []).append(int(pid))
        args_of[int(pid)] = args
    found, todo = [], [proc.pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if "-m dptrain" in args_of[child] and "mpirun" not in args_of[child] \
                    and "prterun" not in args_of[child] and "mpiexec" not in args_of[child]:
                found.append(child)
    return sorted(found)


GPU_ARGS = ["--device", "cuda", "--model", "cnn", "--train-images", "20000", "--val-images",
            "256", "--epochs", "1000", "--batch-size", "256", "--log-every", "50",
            "--no-progress", "--collective-timeout", "4"]


@pytest.fixture
def job(cache):
    """Start a 2-rank job; whatever happens, none of its processes outlives the test."""
    procs = []

    def launch(args=ARGS, device="cpu", ranks=2, **extra_env):
        procs.append(start(ranks, args, cache, device, **extra_env))
        return procs[-1]
    yield launch
    for proc in procs:
        for pid in _ranks_of(proc):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_for_ranks(proc, n=2, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = _ranks_of(proc)
        if len(pids) == n:
            return pids
        time.sleep(0.2)
    raise AssertionError("the ranks did not start")


def _wait_training(proc):
    """Until rank 0 announces the run (set-up is over), then a second of steps."""
    line = proc.stdout.readline()
    assert "steps" in line, line
    time.sleep(1.0)


def _finish(proc, timeout):
    t0 = time.time()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job did not end within {timeout} s") from None
    return time.time() - t0, out, err


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    warm = run(0, ARGS + ["--max-steps", "1"], cache)  # builds the cached dataset
    assert warm.returncode == 0, warm.stderr
    return cache


def test_sigkill_of_one_rank_ends_the_job(job):
    proc = job()
    pids = _wait_for_ranks(proc)
    _wait_training(proc)
    os.kill(pids[1], signal.SIGKILL)
    took, _, err = _finish(proc, timeout=10)
    assert proc.returncode != 0
    assert not _ranks_of(proc), "a rank survived the job"


def _rank_of(pid):
    """The MPI rank of process `pid`, from the variables its launcher gave it."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for line in env:
        name, _, value = line.decode(errors="replace").partition("=")
        if name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
            return int(value)
    raise AssertionError(f"process {pid} carries no rank variable")


def _stop_rank_1_and_judge(proc, ranks=2, timeout=4):
    pids = _wait_for_ranks(proc, ranks)
    _wait_training(proc)
    stopped = next(pid for pid in pids if _rank_of(pid) == 1)
    os.kill(stopped, signal.SIGSTOP)
    took, _, err = _finish(proc, timeout=timeout + 10)
    verdicts = [line for line in err.splitlines() if "dptrain: watchdog:" in line]
    assert len(verdicts) == 1, err[-3000:]
    assert "rank 1 (" in verdicts[0] and "did not arrive" in verdicts[0], verdicts
    assert proc.returncode == 4, (proc.returncode, err[-2000:])
    assert not _ranks_of(proc), "a rank survived the job"
    return took


def test_sigstopped_rank_trips_the_watchdog(job):
    _stop_rank_1_and_judge(job())


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_sigstopped_rank_ends_a_gpu_job(job, ranks):
    if gpu_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    took = _stop_rank_1_and_judge(job(GPU_ARGS, "cuda", ranks), ranks)
    print(f"the {ranks}-GPU job ended {took:.1f} s after the stop")


def test_rank_sleeping_before_a_collective_is_named(cache):
    t0 = time.time()
    result = run(2, ARGS, cache, timeout=120, DPTRAIN_TEST_STALL="1:3:600")
    assert result.returncode != 0
    line = next(l for l in result.stderr.splitlines() if "watchdog" in l)
    assert "at step 3" in line or "at step 4" in line, line
    assert "rank 1 (" in line and "did not arrive" in line and "on rank 0" in line, line
    assert time.time() - t0 < 60


def test_a_rank_waking_after_the_abort_does_not_contradict_the_verdict():
    """The late rank, once it runs again, finds every other rank already past it and silent
    (the job was aborted because of it): it says the job has ended instead of claiming that
    every rank arrived and the collective failed."""
    import time
    from types import SimpleNamespace

    from dptrain.distributed.watchdog import Watchdog

    dog = Watchdog(SimpleNamespace(rank=1, size=3), timeout=5, interval=0.1)
    dog.named_ranks, now = True, time.monotonic()
    dog.heard = {0: (8, 7, True, now - 30), 2: (8, 7, True, now - 29)}
    message = dog._hang_message(("metrics all-reduce", 8, 8, now - 6))
    assert "every other rank reached it and has been silent for 29 s: the job has ended" in message
    dog.heard[2] = (8, 7, True, now)  # one still answering: the collective itself hangs
    assert "the collective itself did not complete" in dog._hang_message(
        ("metrics all-reduce", 8, 8, now - 6))
