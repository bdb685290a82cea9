"""The small vision transformer (--model vit): its gradient end to end against finite
differences, its loss falling on the synthetic data, its captured training step (dropout
included) replaying bit for bit like the eager one, and the command line."""
import json

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import backend, nn
from dptrain import distributed as dist
from dptrain.data import DeviceLoader, get_dataset
from dptrain.distributed.flat import FlatParameters
from dptrain.optim import AdamW
from dptrain.distributed.reducer import Reducer
from dptrain.run.config import TrainConfig
from dptrain.run.step import TrainStep
from dptrain.run.train import train
from replay import train_steps

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_sizes_for_48_and_32_pixel_images():
    assert nn.vit((1, 48, 48), 7).num_patches == 36  # patch 8
    assert nn.vit((3, 32, 32), 10).num_patches == 16
    assert nn.vit((1, 30, 30), 7).patch_size == 6
    m = nn.vit((3, 32, 32), 10, dim=32, depth=1, heads=2)
    out = m(dp.tensor(np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)))
    assert out.shape == (2, 10)
    with pytest.raises(ValueError, match="does not divide"):
        nn.vit((1, 48, 48), 7, dim=30, heads=4)


def test_gradient_matches_finite_differences():
    """The whole model in float64 (patch embedding, class token, positions, two blocks,
    the final norm and the head): backward against central differences on sampled entries."""
    dp.manual_seed(1)
    model = nn.VisionTransformer((2, 8, 8), 3, patch_size=4, dim=8, depth=2, heads=2,
                                 mlp_dim=12, dropout=0.0)
    for p in model.parameters():
        p.data = p.data.astype(np.float64) + np.random.default_rng(0).normal(0, 0.1, p.shape)
    rng = np.random.default_rng(2)
    x = dp.tensor(rng.standard_normal((3, 2, 8, 8)))
    labels = dp.tensor(np.array([0, 2, 1]))

    def loss():
        return F.cross_entropy(model(x), labels)

    loss().backward()
    for name, p in model.named_parameters():
        flat = p.data.reshape(-1)
        for j in rng.choice(flat.size, size=min(4, flat.size), replace=False):
            orig = flat[j]
            with dp.no_grad():
                flat[j] = orig + 1e-6
                plus = loss().item()
                flat[j] = orig - 1e-6
                minus = loss().item()
            flat[j] = orig
            numeric = (plus - minus) / 2e-6
            analytic = p.grad.numpy().reshape(-1)[j]
            assert abs(analytic - numeric) <= 1e-6 + 1e-5 * abs(numeric), (name, j)


def test_loss_falls_on_synthetic_data(tmp_path):
    """Six epochs of AdamW over 256 synthetic images (48 steps, seconds): the mean training
    loss of the last epoch is well below the first's. (A ViT learns these shapes slowly from
    scratch: on the full stream at batch 64 it goes from 1.99 to about 1.55 in 400 steps.)"""
    dp.manual_seed(0)
    data = get_dataset("synthetic", "train", 256, 0, str(tmp_path))
    be = backend.get("cpu")
    model = nn.VisionTransformer(data.image_shape, data.num_classes, patch_size=8, dim=32,
                                 depth=2, heads=4, mlp_dim=64, dropout=0.0)
    flat = FlatParameters(model.parameters())
    opt = AdamW(flat, lr=3e-3, weight_decay=0.0)
    reducer = Reducer(flat, dist.World(comm=dist.LocalComm(be)))
    loader = DeviceLoader(data, be, 32)
    step = TrainStep(model, opt, reducer, loader)
    rng = np.random.default_rng(0)
    losses = []
    for epoch in range(6):
        order = rng.permutation(256)
        for i in range(8):
            opt.begin_step()
            loader.set_batch(order[i * 32:(i + 1) * 32])
            step()
        losses.append(step.read_metrics(reducer.comm)[0] / 8)
    assert losses[0] > 1.9, losses  # about chance, ln 7 = 1.95
    assert losses[-1] < losses[0] - 0.15, losses


def _train_steps(device, graph, steps=6, seed=4, precision="fp32"):
    def build():
        return nn.VisionTransformer((1, 12, 12), 5, patch_size=4, dim=16, depth=2, heads=4,
                                    mlp_dim=24, dropout=0.3)

    return train_steps(device, build, (1, 12, 12), 5, graph, steps, seed,
                       precision=precision)[1]


@pytest.mark.parametrize("device, precision", [
    ("cpu", "fp32"), ("cpu", "fp16"),
    *(pytest.param("cuda", p, marks=pytest.mark.gpu) for p in ("fp32", "bf16", "fp16"))])
def test_captured_step_replays_bitwise_like_eager(device, precision):
    """Dropout in the blocks draws from the device RNG state, so the replayed graph matches
    the eager steps bit for bit, and the weights change every step; in 16 bits too."""
    eager = _train_steps(device, graph=False, precision=precision)
    graph = _train_steps(device, graph=True, precision=precision)
    for step, (a, b) in enumerate(zip(eager, graph)):
        assert np.array_equal(a, b), f"{device} {precision}: weights differ after step {step + 1}"
    assert not np.array_equal(eager[-2], eager[-1])


def test_cli_trains_a_vit(tmp_path):
    cfg = TrainConfig(device="cpu", model="vit", train_images=64, val_images=32, epochs=1,
                      max_steps=2, batch_size=16, log_every=1, cache_dir=str(tmp_path / "c"),
                      log_dir=str(tmp_path / "L"), save=str(tmp_path / "w.npz"), progress=False)
    summary = train(cfg, echo=lambda _: None)
    assert summary["steps"] == 2 and np.isfinite(summary["train_loss"])
    assert json.loads((tmp_path / "L" / "summary.json").read_text())["config"]["model"] == "vit"
    with np.load(tmp_path / "w.npz") as w:
        assert w["pos_embed"].shape == (1, 37, 64)
        assert "blocks.3.self_attn.in_proj_weight" in w.files


_NO_DROPOUT = ("import functools, sys; from dptrain.nn import models, vit; "
               "models.MODELS['vit'] = functools.partial(vit, dropout=0.0); "
               "from dptrain.cli.commands import main; sys.exit(main(sys.argv[1:]))")


def test_two_ranks_match_one_process(tmp_path):
    """Data-parallel over MPI on the CPU: 2 ranks at global batch 32 end with the weights of
    one process at batch 32, dropout on (each rank keeps its rows of the global batch's
    masks) and off."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mpilaunch import HAVE_MPI, mpi_command, mpi_env

    if not HAVE_MPI:
        pytest.skip("needs an MPI launcher and mpi4py")
    env = mpi_env(dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]),
                       DPTRAIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
                       OPENBLAS_NUM_THREADS="1"))
    args = ["train", "--device", "cpu", "--model", "vit", "--train-images", "192",
            "--val-images", "32", "--epochs", "1", "--optimizer", "sgd", "--lr", "0.05",
            "--no-progress", "--seed", "3"]
    for tag, cmd in (("dropout", [sys.executable, "-m", "dptrain", *args]),
                     ("no-dropout", [sys.executable, "-c", _NO_DROPOUT, *args])):
        for ranks, extra, out in ((0, ["--batch-size", "32"], "one.npz"),
                                  (2, ["--global-batch-size", "32", "--verify-replicas"],
                                   "two.npz")):
            full = cmd + extra + ["--save", str(tmp_path / f"{tag}-{out}")]
            result = subprocess.run(mpi_command(ranks, full) if ranks else full,
                                    capture_output=True, text=True, env=env, timeout=300)
            assert result.returncode == 0, result.stderr[-3000:]
        with np.load(tmp_path / f"{tag}-one.npz") as one, \
                np.load(tmp_path / f"{tag}-two.npz") as two:
            for name in (f for f in one.files if f != "__meta__"):
                rel = np.abs(one[name] - two[name]).max() / (np.abs(one[name]).max() + 1e-12)
                assert rel <= 1e-4, f"{tag}: {name}: relative difference {rel:.2e}"
