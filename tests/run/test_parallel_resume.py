"""DataParallel.save / load: the whole training state in the checkpoint format of `train
--checkpoint-dir`. A loop saved at step 5 and resumed in a fresh process trains on bitwise
as the uninterrupted loop (1 rank and 2 ranks: weights, optimizer state, step count,
learning rate, fp16's loss scale, dropout's generator); 2 ranks load what 1 rank saved and
go on as the 1-rank run does, to float rounding. tests/helpers/resume_driver.py is the
user's loop."""
import subprocess
import sys

import numpy as np
import pytest

import dptrain as dp
from dptrain import checkpoints, nn
from dptrain.checkpoints.state import MODEL, OPTIM
from dptrain.errors import UsageError
from mpilaunch import ROOT, env, mpi_command, needs_mpi

DRIVER = str(ROOT / "tests" / "helpers" / "resume_driver.py")
SAVE_AT, STEPS = 5, 12


def _run(tmp_path, ranks, name, save_at=0, load="-"):
    out = tmp_path / name
    cmd = [sys.executable, DRIVER, str(out), str(save_at), str(load)]
    result = subprocess.run(mpi_command(ranks, cmd) if ranks > 1 else cmd, capture_output=True,
                            text=True, env=env(tmp_path / "cache"), timeout=180)
    assert result.returncode == 0, result.stderr
    return [dict(np.load(f"{out}.rank{r}.npz")) for r in range(ranks)]


def _after_save(run):
    """What the steps after SAVE_AT leave: their losses, the weights, scale and step count."""
    return {k: v for k, v in run.items() if not k.startswith(("loss:", "loaded:"))
            or k.startswith("loss:") and int(k[5:]) > SAVE_AT}


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=needs_mpi)])
def test_a_resumed_loop_is_bitwise_the_uninterrupted_one(tmp_path, ranks):
    whole = _run(tmp_path, ranks, "whole")
    saving = _run(tmp_path, ranks, "saving", save_at=SAVE_AT)
    resumed = _run(tmp_path, ranks, "resumed", load=tmp_path / "saving.ckpt")
    assert (tmp_path / "saving.ckpt" / f"step-{SAVE_AT:08d}" / "manifest.json").is_file()
    for r in range(ranks):
        assert whole[r]["steps"] == STEPS and whole[r]["scale"][0] > 2.0**8  # it grew
        assert whole[r]["loss:12"] < whole[r]["loss:1"]
        assert sorted(saving[r]) == sorted(whole[r])
        for name in whole[r]:  # saving changes nothing
            assert np.array_equal(saving[r][name], whole[r][name]), f"rank {r}: {name}"
        expected = _after_save(whole[r])
        assert sorted(_after_save(resumed[r])) == sorted(expected)
        for name, value in expected.items():
            assert np.array_equal(resumed[r][name], value), f"rank {r}: {name}"


@needs_mpi
def test_two_ranks_load_what_one_rank_saved(tmp_path):
    (one,) = _run(tmp_path, 1, "one", save_at=SAVE_AT)
    two = _run(tmp_path, 2, "two", load=tmp_path / "one.ckpt")
    _, files = checkpoints.load(tmp_path / "one.ckpt" / f"step-{SAVE_AT:08d}")
    for r, got in enumerate(two):
        for name, value in files[MODEL].items():  # loaded as saved, to the bit
            assert np.array_equal(got[f"loaded:model:{name}"], value), f"rank {r}: {name}"
        assert files[OPTIM]
        for name, value in files[OPTIM].items():
            assert np.array_equal(got[f"loaded:optim:{name}"], value), f"rank {r}: {name}"
        expected = _after_save(one)
        assert sorted(_after_save(got)) == sorted(expected)
        for name, value in expected.items():  # then trains on as one rank does (fp16)
            np.testing.assert_allclose(got[name], value, rtol=1e-3, atol=5e-4,
                                       err_msg=f"rank {r}: {name}")


def test_load_names_what_does_not_fit(tmp_path):
    def wrapped(out_features, optimizer="sgd"):
        dp.manual_seed(0)
        options = {"momentum": 0.9} if optimizer == "sgd" else {}
        return dp.DataParallel(nn.Sequential(nn.Linear(3, out_features)), optimizer, lr=0.1,
                               **options)

    with pytest.raises(UsageError, match="no checkpoint there"):
        wrapped(1).load(tmp_path / "none")
    path = wrapped(1).save(tmp_path / "ckpt")
    assert path == tmp_path / "ckpt" / "step-00000000"
    with pytest.raises(UsageError, match=r"step-00000000: .*0.weight has shape \(1, 3\)"):
        wrapped(2).load(tmp_path / "ckpt")
    with pytest.raises(UsageError, match="saved with optimizer SGD, this DataParallel has AdamW"):
        wrapped(1, "adamw").load(path)
    (path / MODEL).write_bytes(b"damaged")
    with pytest.raises(UsageError, match="no checkpoint there.*does not match the SHA-256"):
        wrapped(1).load(tmp_path / "ckpt")
