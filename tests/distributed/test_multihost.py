"""Several hosts simulated on one machine: DPTRAIN_TEST_SIMULATED_HOSTS names each rank's
host, and everything that depends on the host (local rank, once-per-host work, training)
follows.
Runs under Open MPI, MPICH or srun (tests/helpers/mpilaunch.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path


from mpilaunch import mpi_command, mpi_env, needs_mpi
from weights import assert_same_weights

pytestmark = needs_mpi
ROOT = Path(__file__).resolve().parents[2]
HOSTS = "hostA,hostA,hostB,hostB"


def _run(ranks, cmd, tmp, hosts=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(tmp / "cache"))
    if hosts:
        env["DPTRAIN_TEST_SIMULATED_HOSTS"] = hosts
    env = mpi_env(env) if ranks else env
    cmd = mpi_command(ranks, cmd) if ranks else cmd
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_two_simulated_hosts_of_two_ranks(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    _run(4, [sys.executable, str(ROOT / "tests" / "helpers" / "multihost_driver.py"), str(marks)],
         tmp_path, HOSTS)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    assert [(r["local_rank"], r["local_size"]) for r in ranks] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    # the first rank of each host did the work once; its host's other rank loaded it
    assert [r["outcome"] for r in ranks] == ["did", "loaded", "did", "loaded"]
    assert sorted(p.name for p in marks.iterdir()) == ["host-of-rank-0", "host-of-rank-2"]


def test_a_bad_host_list_is_one_clear_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_TEST_SIMULATED_HOSTS="a,b")
    result = subprocess.run(mpi_command(4, [sys.executable, "-m", "dptrain", "train",
                                            "--device", "cpu"]),
                            capture_output=True, text=True, env=mpi_env(env), timeout=300)
    assert result.returncode != 0
    assert "DPTRAIN_TEST_SIMULATED_HOSTS" in result.stderr


def test_training_on_two_simulated_hosts_equals_one_process(tmp_path):
    common = [sys.executable, "-m", "dptrain", "train", "--device", "cpu", "--model", "mlp",
              "--train-images", "512", "--val-images", "64", "--epochs", "1", "--max-steps",
              "8", "--optimizer", "sgd", "--lr", "0.05", "--seed", "3", "--no-progress",
              "--warmup-steps", "0"]
    _run(0, common + ["--batch-size", "32", "--save", str(tmp_path / "one.npz")], tmp_path)
    _run(4, common + ["--global-batch-size", "32", "--verify-replicas",
                      "--save", str(tmp_path / "four.npz")], tmp_path, HOSTS)
    assert_same_weights(tmp_path / "one.npz", tmp_path / "four.npz")
