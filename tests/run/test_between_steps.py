"""Weights read between DataParallel steps are the current ones, with no call of the user's:
after a step each rank has updated only its shard of the parameters (ZeRO-1), and the first
read outside a step (the wrapper's call, eval() or state_dict(), the wrapped model's forward
or state_dict(), a sub-module's) gathers the rest, once, at no cost to the steps.
tests/helpers/between_steps_driver.py is the user's loop."""
import subprocess
import sys

import numpy as np
import pytest

import dptrain as dp
from dptrain import nn
from mpilaunch import ROOT, env, mpi_command, needs_mpi

DRIVER = str(ROOT / "tests" / "helpers" / "between_steps_driver.py")
READ_AT = (3, 5, 6, 9, 11)  # the driver's read points (steps), one kind of first read each


def _run(tmp_path, ranks, precision):
    out = tmp_path / f"{precision}-{ranks}"
    cmd = [sys.executable, DRIVER, str(out), precision]
    result = subprocess.run(mpi_command(ranks, cmd) if ranks > 1 else cmd, capture_output=True,
                            text=True, env=env(tmp_path / "cache"), timeout=180)
    assert result.returncode == 0, result.stderr
    return [dict(np.load(f"{out}.rank{r}.npz")) for r in range(ranks)]


@needs_mpi
@pytest.mark.parametrize("precision,rtol,atol", [("fp32", 2e-5, 2e-6), ("fp16", 1e-2, 5e-3)])
def test_reads_between_steps_at_two_ranks_equal_one_process(tmp_path, precision, rtol, atol):
    """fp16: 16-bit activations over half the batch round otherwise than over all of it, and
    AdamW's normalised steps carry it (2.7e-3 at most in the weights by step 11); a stale
    shard is a whole step behind (of the order of lr, 2e-2), and the ranks' reads must agree
    to the bit."""
    (one,) = _run(tmp_path, 1, precision)
    ranks = _run(tmp_path, 2, precision)
    names = [k for k in one if k.startswith(("first:", "eval:", "model:", "ddp:"))]
    assert {k.split(":")[1] for k in names} == {str(s) for s in READ_AT}
    assert len(one["losses"]) == 12 and one["losses"][-3:].mean() < one["losses"][:3].mean()
    for rank, got in enumerate(ranks):
        np.testing.assert_allclose(got["losses"], one["losses"], rtol=rtol, atol=atol)
        for name in names:  # first read, evaluation, model's and ddp's state_dict
            np.testing.assert_allclose(got[name], one[name], rtol=rtol, atol=atol,
                                       err_msg=f"rank {rank}: {name}")
            assert np.array_equal(got[name], ranks[0][name]), f"ranks differ: {name}"
        for s in READ_AT:  # the 16-bit copy the layers read is current too
            assert got[f"shadow_current:{s}"], f"rank {rank}: stale shadow after step {s}"
        # gathered once per read point, by its first read, never inside a step
        assert got["syncs"].tolist() == list(READ_AT), f"rank {rank}"
    assert one["syncs"].tolist() == []  # one process: nothing is ever stale


def test_the_read_hooks_leave_layer_fusion_alone(monkeypatch):
    """Only the root and modules owning parameters get the forward hook: a ReLU with one
    would stop nn.fusion running Linear + ReLU as one op."""
    monkeypatch.setenv("DPTRAIN_FUSE", "1")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fused = len(model._steps())
    dp.DataParallel(model, "sgd", lr=0.1)
    assert fused == 2 and len(model._steps()) == 2
    assert not model[1]._pre_hooks and model[1]._state_hooks
