"""The models --model names: the mlp at any depth on any input, resnet18's structure, and the
loss of each falling on the synthetic data through the training step (captured on the CPU,
where capture calls the step)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dptrain as dp
from dptrain import backend, nn
from dptrain import distributed as dist
from dptrain.data import DeviceLoader, get_dataset
from dptrain.distributed.flat import FlatParameters
from dptrain.optim import AdamW
from dptrain.distributed.reducer import Reducer
from dptrain.run.step import TrainStep

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("image_shape", [(3, 5, 7), (10,), (2, 3)])
@pytest.mark.parametrize("hidden", [(), (8,), (16, 8, 4)])
def test_mlp_flattens_any_input_at_any_depth(image_shape, hidden):
    model = nn.mlp(image_shape, 4, hidden=hidden)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == list(hidden) + [4]
    assert linears[0].in_features == int(np.prod(image_shape))
    y = model(dp.tensor(np.random.default_rng(0).standard_normal((6,) + image_shape)))
    assert y.shape == (6, 4)


def test_build_model_passes_hidden_to_the_mlp_only():
    model = nn.build_model("mlp", (1, 4, 4), 3, hidden=(7, 5))
    assert [m.out_features for m in model if isinstance(m, nn.Linear)] == [7, 5, 3]
    with pytest.raises(ValueError, match="--hidden applies to --model mlp, not cnn"):
        nn.build_model("cnn", (1, 48, 48), 7, hidden=(8,))
    assert "resnet18" in nn.MODELS


def test_resnet18_structure():
    model = nn.resnet18((1, 48, 48), 7)
    params = dict(model.named_parameters())
    assert params["conv1.weight"].shape == (64, 1, 3, 3) and model.maxpool is None
    assert params["layer2.0.downsample.0.weight"].shape == (128, 64, 1, 1)
    assert "layer1.0.downsample.0.weight" not in params
    assert params["layer4.1.conv2.weight"].shape == (512, 512, 3, 3)
    assert params["fc.weight"].shape == (7, 512)
    assert not any(name.endswith("conv1.bias") for name in params)  # convolutions are bias-free
    # torchvision's 11,689,512, with a 1-channel 3x3 conv1 and a 7-class fc instead
    assert model.num_parameters() == 11_689_512 - 64 * 3 * 49 + 64 * 9 - 513_000 + 512 * 7 + 7
    big = nn.resnet18((3, 96, 96), 1000)
    assert big.conv1.weight.shape == (64, 3, 7, 7) and big.maxpool is not None
    assert big.num_parameters() == 11_689_512  # torchvision's resnet18
    y = big.eval()(dp.tensor(np.zeros((1, 3, 65, 65), np.float32)))
    assert y.shape == (1, 1000)


def test_resnet18_layout_auto_true_false():
    """channels_last="auto" (the default) keeps NCHW on the CPU, whose convolutions would copy
    channels-last activations; True and False fix the layout, with the same loss and
    gradients to rounding from the same weights."""
    x = np.random.default_rng(0).standard_normal((2, 1, 12, 12)).astype(np.float32)
    models = {cl: nn.resnet18((1, 12, 12), 3, widths=(8, 8, 16, 16), channels_last=cl)
              for cl in ("auto", True, False)}
    assert not models["auto"].layout(dp.tensor(x))
    for cl in (True, False):
        models[cl].load_state_dict(models["auto"].state_dict())
    results = {}
    for cl, model in models.items():
        loss = dp.functional.cross_entropy(model(dp.tensor(x)), np.array([0, 2]))
        loss.backward()
        results[cl] = (loss.numpy(), model.conv1.weight.grad.numpy())
        spatial = [m.channels_last for m in model.modules() if isinstance(m, nn.Conv2d)]
        assert spatial == [cl is True] * len(spatial)  # what this forward ran
    for cl in (True, False):
        for got, ref in zip(results[cl], results["auto"]):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="channels_last must be True, False or 'auto'"):
        nn.resnet18((1, 12, 12), 3, channels_last="yes")


def _train_losses(model, dataset, steps, batch, opt_cls, lr, seed=0, fixed=False):
    """Losses of `steps` captured training steps (the TrainStep the trainer runs), on random
    batches, or on one batch throughout when `fixed`."""
    be = backend.get("cpu")
    flat = FlatParameters(model.parameters())
    opt = opt_cls(flat, lr=lr) if opt_cls is AdamW else opt_cls(flat, lr=lr, momentum=0.9)
    reducer = Reducer(flat, dist.World(comm=dist.LocalComm(be)), model)
    loader = DeviceLoader(dataset, be, batch)
    step = TrainStep(model, opt, reducer, loader)
    run = be.runtime.capture(step)
    rng = np.random.default_rng(seed)
    losses, chosen = [], rng.choice(len(dataset.labels), batch, replace=False)
    for _ in range(steps):
        opt.begin_step()
        loader.set_batch(chosen if fixed else rng.choice(len(dataset.labels), batch,
                                                         replace=False))
        run()
        losses.append(step.read_metrics(reducer.comm)[0])
    return losses


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return get_dataset("synthetic", "train", 1024, seed=0,
                       cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_small_resnet_loss_falls(shapes):
    """ResNet-18's structure at reduced width (the full width is slow on a CPU), on one batch
    of synthetic images: within a few steps it fits them, far below chance (ln 7 = 1.95).
    (On random batches this net needs hundreds of steps to move, too slow for a unit test.)"""
    dp.manual_seed(0)
    model = nn.resnet18(shapes.image_shape, shapes.num_classes, widths=(8, 8, 8, 8))
    losses = _train_losses(model, shapes, steps=12, batch=8, opt_cls=AdamW, lr=1e-2,
                           fixed=True)
    assert losses[0] > 1.5 and losses[-1] < losses[0] - 0.7, losses
    bn = model.layer1[0].bn1
    assert int(bn.num_batches_tracked.numpy()) == 12
    assert np.abs(bn.running_mean.numpy()).max() > 0  # updated inside the step


def test_mlp_loss_falls(shapes):
    dp.manual_seed(0)
    model = nn.build_model("mlp", shapes.image_shape, shapes.num_classes, hidden=(64, 32, 16))
    losses = _train_losses(model, shapes, steps=150, batch=32, opt_cls=AdamW, lr=2e-3)
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert first > 1.8 and last < first - 0.15, losses


def run_cli(*args, cache):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "dptrain", *args], capture_output=True,
                          text=True, env=env, timeout=600)


SMALL = ["--device", "cpu", "--train-images", "64", "--val-images", "16", "--epochs", "1",
         "--no-progress"]


def test_cli_trains_resnet18_and_saves_torchvision_names(tmp_path):
    weights, logs = tmp_path / "w.npz", tmp_path / "L"
    result = run_cli("train", "--model", "resnet18", *SMALL, "--batch-size", "4",
                     "--max-steps", "2", "--optimizer", "sgd", "--lr", "0.01",
                     "--save", str(weights), "--log-dir", str(logs), cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert np.isfinite(json.loads((logs / "summary.json").read_text())["train_loss"])
    with np.load(weights) as w:
        # torchvision's resnet18 state_dict entries, plus our metadata
        assert len([f for f in w.files if f != "__meta__"]) == 122
        assert w["layer3.0.downsample.1.running_var"].shape == (256,)
        assert int(w["bn1.num_batches_tracked"]) == 2


def test_cli_mlp_hidden_and_its_errors(tmp_path):
    weights = tmp_path / "w.npz"
    result = run_cli("train", "--model", "mlp", "--hidden", "24,16,8", *SMALL, "--batch-size",
                     "16", "--save", str(weights), cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    with np.load(weights) as w:
        assert [w[f"{i}.weight"].shape for i in (1, 3, 5, 7)] == [(24, 2304), (16, 24), (8, 16),
                                                                   (7, 8)]
    for args, fragment in ((["--hidden", "64,x"], "--hidden"), (["--hidden", "0"], "--hidden"),
                           (["--model", "cnn", "--hidden", "8"], "--hidden")):
        bad = run_cli("train", *args, *SMALL, cache=tmp_path / "cache")
        lines = [line for line in bad.stderr.splitlines() if line.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and fragment in lines[0], bad.stderr
