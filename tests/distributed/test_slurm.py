"""Slurm without MPI: tasks that `srun` starts with no PMI meet through the rendezvous
(dptrain/distributed/slurm.py, dptrain/distributed/rendezvous.py). The tests play srun: they start the processes
themselves with the SLURM_* variables srun would set, two simulated nodes of two tasks."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain.distributed import slurm
from weights import assert_same_weights

ROOT = Path(__file__).resolve().parents[2]


# -- (a) what the variables say

def test_tasks_per_node_forms():
    assert slurm.parse_tasks_per_node("4") == (4,)
    assert slurm.parse_tasks_per_node("2(x3),1") == (2, 2, 2, 1)
    assert slurm.parse_tasks_per_node("3,2(x2)") == (3, 2, 2)
    with pytest.raises(slurm.SlurmError, match="2x3"):
        slurm.parse_tasks_per_node("2x3")


def test_rank_size_local_rank_and_host_from_slurm():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"}
    t = slurm.from_env(env)
    assert (t.rank, t.size, t.local_rank, t.node_index, t.local_size) == (5, 7, 1, 2, 2)
    assert t.host == "node2" and t.job == "42.3"
    # the step's own count wins over the allocation's; the per-node count as well
    t = slurm.from_env({**env, "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
                        "SLURM_NODEID": "1"})
    assert (t.size, t.local_size) == (6, 3)
    # --ntasks-per-node alone
    t = slurm.from_env({k: v for k, v in env.items() if k != "SLURM_TASKS_PER_NODE"}
                       | {"SLURM_NTASKS_PER_NODE": "2", "SLURM_NTASKS": "6", "SLURM_NODEID": "1"})
    assert t.local_size == 2
    # tasks of one node share a host; without SLURM_NODEID the host name decides
    assert slurm.from_env({**env, "SLURM_PROCID": "4", "SLURM_LOCALID": "0"}).host == "node2"
    assert slurm.from_env({k: v for k, v in env.items() if k != "SLURM_NODEID"}).local_size is None
    # one task, or no Slurm: no world to build
    assert slurm.from_env({**env, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert slurm.from_env({}) is None
    with pytest.raises(slurm.SlurmError, match="SLURM_PROCID=9"):
        slurm.from_env({**env, "SLURM_PROCID": "9"})
    with pytest.raises(slurm.SlurmError, match="SLURM_LOCALID"):
        slurm.from_env({k: v for k, v in env.items() if k != "SLURM_LOCALID"})


def test_rendezvous_place(tmp_path):
    t = slurm.from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                        "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "1"})
    assert slurm.rendezvous_place(t, {"DPTRAIN_RENDEZVOUS": "node17:29500"}) == \
        ("tcp", "node17", 29500)
    assert slurm.rendezvous_place(t, {"DPTRAIN_RENDEZVOUS": str(tmp_path)}) == \
        ("file", tmp_path / ".dptrain-rendezvous-9.1")
    assert slurm.rendezvous_place(t, {"SLURM_SUBMIT_DIR": str(tmp_path)}) == \
        ("file", tmp_path / ".dptrain-rendezvous-9.1")


# -- several processes, started as srun would start them

NODES = [0, 0, 1, 1]  # rank -> SLURM_NODEID: two nodes of two tasks


def slurm_env(tmp, rank, nodes=NODES, job="1234", **extra):
    """This environment without any launcher's variables, plus what srun sets for `rank`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX_", "MPI_LOCAL"))}
    env.update(PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(tmp / "cache"), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", DPTRAIN_RENDEZVOUS=str(tmp), DPTRAIN_RENDEZVOUS_TIMEOUT="60",
               SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(rank),
               SLURM_NTASKS=str(len(nodes)), SLURM_NODEID=str(nodes[rank]),
               SLURM_LOCALID=str(nodes[:rank].count(nodes[rank])),
               SLURM_TASKS_PER_NODE=",".join(str(nodes.count(n)) for n in sorted(set(nodes))))
    env.update(extra)
    return env


def start(tmp, cmd, nodes=NODES, **extra):
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=slurm_env(tmp, r, nodes, **extra), cwd=tmp)
            for r in range(len(nodes))]


def finish(procs, timeout=120):
    """(return code, stdout, stderr) of each process, all of them ended by `timeout`."""
    deadline, out = time.monotonic() + timeout, []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank was still running after {timeout} s")
        out.append((p.returncode, stdout, stderr))
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["file", "tcp"])
def test_every_collective_over_the_rendezvous(tmp_path, where):
    nodes = NODES if where == "file" else [0, 0, 1]
    extra = {"DPTRAIN_RENDEZVOUS": f"localhost:{free_port()}"} if where == "tcp" else {}
    results = finish(start(tmp_path, [sys.executable, str(ROOT / "tests" / "helpers" / "rendezvous_driver.py"),
                                      str(tmp_path)], nodes, **extra), timeout=60)
    for r, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {r}: {err[-2000:]}"
        assert (tmp_path / f"rank-{r}").read_text() == "ok", (tmp_path / f"rank-{r}").read_text()
    assert not list(tmp_path.glob(".dptrain-rendezvous-*")), "rank 0 removes its file"


@pytest.mark.parametrize("nodes,simulated", [(NODES, None),
                                             ([0, 0, 0, 0], "hostA,hostA,hostB,hostB")])
def test_local_ranks_and_once_per_host_work(tmp_path, nodes, simulated):
    marks = tmp_path / "marks"
    marks.mkdir()
    extra = {"DPTRAIN_TEST_SIMULATED_HOSTS": simulated} if simulated else {}
    results = finish(start(tmp_path, [sys.executable, str(ROOT / "tests" / "helpers" / "multihost_driver.py"),
                                      str(marks)], nodes, **extra), timeout=60)
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    assert [(r["local_rank"], r["local_size"]) for r in ranks] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["outcome"] for r in ranks] == ["did", "loaded", "did", "loaded"]
    assert sorted(p.name for p in marks.iterdir()) == ["host-of-rank-0", "host-of-rank-2"]


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")
def test_mpi_singletons_fall_back_to_slurm(tmp_path):
    # srun --mpi=pmix with an MPI that cannot use it: a launcher's variable is set, yet
    # every task is an MPI world of one; the tasks meet through the rendezvous instead
    marks = tmp_path / "marks"
    marks.mkdir()
    extra = {"MPI_LOCALNRANKS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
             "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    results = finish(start(tmp_path, [sys.executable, str(ROOT / "tests" / "helpers" / "multihost_driver.py"),
                                      str(marks)], [0, 0], **extra), timeout=60)
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["local_rank"], r["local_size"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]


TRAIN = [sys.executable, "-m", "dptrain", "train", "--device", "cpu", "--model", "mlp",
         "--train-images", "512", "--val-images", "64", "--epochs", "1", "--max-steps", "8",
         "--optimizer", "sgd", "--lr", "0.05", "--seed", "3", "--no-progress",
         "--warmup-steps", "0"]


def test_training_under_slurm_equals_one_process(tmp_path):
    env = {k: v for k, v in slurm_env(tmp_path, 0).items() if not k.startswith("SLURM_")}
    one = subprocess.run(TRAIN + ["--batch-size", "32", "--save", str(tmp_path / "one.npz")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    results = finish(start(tmp_path, TRAIN + ["--global-batch-size", "32", "--verify-replicas",
                                              "--save", str(tmp_path / "four.npz")]))
    for r, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {r}: {err[-3000:]}"
    assert "x 4" in results[0][1]  # rank 0 reports a world of four
    assert_same_weights(tmp_path / "one.npz", tmp_path / "four.npz")


# -- failures end every rank, naming the one that went

@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_dies_ends_the_job(tmp_path, victim):
    nodes = [0, 0, 1]
    began = time.monotonic()
    results = finish(start(tmp_path, TRAIN + ["--batch-size", "16", "--max-steps", "200"],
                           nodes, DPTRAIN_TEST_KILL=f"{victim}:2"), timeout=60)
    assert time.monotonic() - began < 60
    assert all(code != 0 for code, _, _ in results), [code for code, _, _ in results]
    others = "".join(err for r, (_, _, err) in enumerate(results) if r != victim)
    assert f"rank {victim}" in others, others[-3000:]


def test_a_rank_alone_gives_up_naming_the_rendezvous(tmp_path):
    result = subprocess.run(TRAIN, capture_output=True, text=True, timeout=60,
                            env=slurm_env(tmp_path, 1, DPTRAIN_RENDEZVOUS_TIMEOUT="2"))
    assert result.returncode != 0
    assert "could not reach rank 0" in result.stderr and ".dptrain-rendezvous-1234" in \
        result.stderr, result.stderr[-2000:]


def test_an_exception_on_one_rank_aborts_all_with_its_traceback(tmp_path):
    results = finish(start(tmp_path, TRAIN + ["--batch-size", "16", "--max-steps", "200"],
                           [0, 1], DPTRAIN_TEST_FAULT="1:2"), timeout=60)
    assert all(code != 0 for code, _, _ in results)
    assert "[rank 1]" in results[1][2] and "injected fault on rank 1" in results[1][2]


def test_a_rank_that_stops_answering_trips_the_watchdog(tmp_path):
    # the watchdog cannot name the late rank here (no point-to-point messages): it says so
    results = finish(start(tmp_path, TRAIN + ["--batch-size", "16", "--max-steps", "200",
                                              "--collective-timeout", "2"],
                           [0, 0, 1], DPTRAIN_TEST_STALL="2:2:60"), timeout=40)
    assert all(code != 0 for code, _, _ in results), [code for code, _, _ in results]
    text = "".join(err for _, _, err in results)
    assert "has not finished after 2 s" in text and "cannot be named" in text, text[-3000:]
