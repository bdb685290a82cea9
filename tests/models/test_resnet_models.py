"""ResNet-34 and ResNet-50: their structure and parameter counts against torchvision's (counted
without torch), forward and backward through both stems, their weights loaded into
torchvision's models with the outputs agreeing in float64 (skipped without torchvision), and
resnet50 trained a few steps at 3x64x64 on the CPU through `python -m dptrain train`, then
resumed bitwise from a checkpoint."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import nn

ROOT = Path(__file__).resolve().parents[2]
HAVE_TORCHVISION = (importlib.util.find_spec("torch") is not None
                    and importlib.util.find_spec("torchvision") is not None)
# torchvision's models at 1000 classes (their documented sizes) and state_dict entries
TORCHVISION = {"resnet34": (21_797_672, 218), "resnet50": (25_557_032, 320)}


@pytest.mark.parametrize("name", ["resnet34", "resnet50"])
def test_parameter_counts_are_torchvisions(name):
    params, entries = TORCHVISION[name]
    model = nn.build_model(name, (3, 96, 96), 1000)
    assert model.num_parameters() == params
    assert len(model.state_dict()) == entries
    # the small-image stem swaps the 7x7 3->64 convolution for a 3x3 one
    small = nn.build_model(name, (3, 32, 32), 1000)
    assert small.num_parameters() == params - 64 * 3 * (49 - 9)


def test_resnet50_is_torchvisions_v1_5_layout():
    """Bottlenecks 1x1 -> 3x3 (the stride here, v1.5) -> 1x1 x4; a projection shortcut on
    every stage's first block (stage 1's widens 64 -> 256 at stride 1)."""
    model = nn.resnet50((3, 96, 96), 10)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert shapes["layer1.0.conv1.weight"] == (64, 64, 1, 1)
    assert shapes["layer1.0.conv2.weight"] == (64, 64, 3, 3)
    assert shapes["layer1.0.conv3.weight"] == (256, 64, 1, 1)
    assert shapes["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)
    assert shapes["layer1.1.conv1.weight"] == (64, 256, 1, 1)
    assert shapes["layer2.0.conv1.weight"] == (128, 256, 1, 1)
    assert shapes["layer4.2.bn3.running_mean"] == (2048,)
    assert shapes["fc.weight"] == (10, 2048)
    assert "layer1.1.downsample.0.weight" not in shapes
    first = model.layer2[0]
    assert (first.conv1.stride, first.conv2.stride, first.conv3.stride) == (1, 2, 1)
    assert first.downsample[0].stride == 2 and model.layer1[0].downsample[0].stride == 1
    r34 = {k: v.shape for k, v in nn.resnet34((3, 96, 96), 10).state_dict().items()}
    assert r34["layer3.5.conv2.weight"] == (256, 256, 3, 3) and "layer3.6.conv1.weight" not in r34
    assert r34["layer2.0.downsample.0.weight"] == (128, 64, 1, 1) and r34["fc.weight"] == (10, 512)


@pytest.mark.parametrize("name", ["resnet34", "resnet50"])
def test_auto_precision_is_bf16_for_them_on_a_gpu(name):
    """Every layer has a 16-bit path, so --precision auto means bf16 where the GPU has it."""
    from types import SimpleNamespace

    from dptrain.run import amp

    model = nn.build_model(name, (3, 96, 96), 10)
    amp.check_model(model, "bf16")
    gpu = SimpleNamespace(precision="tf32", mixed_precisions=lambda: ("bf16", "fp16"))
    assert amp.resolve("auto", gpu, model) == "bf16"


@pytest.mark.parametrize("name", ["resnet34", "resnet50"])
@pytest.mark.parametrize("image_shape", [(3, 65, 65), (3, 32, 32)], ids=["imagenet", "small"])
def test_forward_and_backward_shapes(name, image_shape):
    """65 px is just above the small-image stem's limit (ImageNet's 7x7/2 + max-pool: 65 -> 33
    -> 17, then 17, 9, 5, 3 per stage); 32 px keeps the 3x3 stem (32, 16, 8, 4)."""
    dp.manual_seed(0)
    model = nn.build_model(name, image_shape, 7)
    assert model.small_stem == (image_shape[1] <= 64)
    assert (model.maxpool is None) == model.small_stem
    x = np.random.default_rng(0).standard_normal((2, *image_shape)).astype(np.float32)
    logits = model(dp.tensor(x))
    assert logits.shape == (2, 7)
    F.cross_entropy(logits, dp.tensor(np.array([1, 5]))).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, pname
        assert np.isfinite(p.grad.numpy()).all(), pname
    assert np.abs(model.conv1.weight.grad.numpy()).max() > 0
    assert int(model.layer4[-1].bn1.num_batches_tracked.numpy()) == 1


def _float64(model):
    for t in model.parameters() + model.buffers():
        if t.dtype.kind == "f":
            t.data = t.data.astype(np.float64)
    return model


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


@pytest.mark.skipif(not HAVE_TORCHVISION, reason="needs torch and torchvision")
@pytest.mark.parametrize("name", ["resnet34", "resnet50"])
@pytest.mark.parametrize("image_shape", [(3, 72, 72), (3, 32, 32)], ids=["imagenet", "small"])
def test_our_weights_load_into_torchvision_and_agree_in_float64(name, image_shape):
    """Our weights into torchvision's model of the same name: at 72 px torchvision's own model
    as it is (3-channel 7x7 stem), at 32 px the twin `train --torch` and `bench train` build
    (its stem swapped for ours). In float64: training-mode logits, every parameter's
    gradient and the updated running estimates; then torchvision's weights back into ours,
    and the eval-mode logits."""
    import torch
    import torchvision

    from dptrain.run.torch_twin import twin

    dp.manual_seed(3)
    ours = nn.build_model(name, image_shape, 10)
    state = ours.state_dict()
    if ours.small_stem:
        ref = twin(ours)
    else:
        ref = getattr(torchvision.models, name)(num_classes=10)
        ref.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        stem = twin(ours)  # the twin keeps torchvision's own stem at this size
        assert (stem.conv1.stride, stem.conv1.padding) == ((2, 2), (3, 3))
        assert isinstance(stem.maxpool, torch.nn.MaxPool2d)
    assert ref is not None and list(ref.state_dict()) == list(state)
    ref = ref.double().train()
    _float64(ours)

    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, *image_shape))
    y = np.array([1, 7, 3, 0])
    logits_ref = ref(torch.from_numpy(x))
    torch.nn.functional.cross_entropy(logits_ref, torch.from_numpy(y)).backward()
    logits = ours(dp.tensor(x))
    F.cross_entropy(logits, dp.tensor(y)).backward()
    assert logits.numpy().dtype == np.float64
    assert rel(logits.numpy(), logits_ref.detach().numpy()) <= 1e-10
    # a network at its initial weights amplifies rounding differences: float32 against float64
    # differ by 3% in some batch norms' gradients here, float64 against float64 by ~1e-11
    ref_params = dict(ref.named_parameters())
    for pname, p in ours.named_parameters():
        err = rel(p.grad.numpy(), ref_params[pname].grad.numpy())
        assert err <= 1e-8, f"gradient of {pname}: relative error {err:.2e}"
    ref_state = ref.state_dict()
    for key, value in ours.state_dict().items():
        assert rel(value, ref_state[key].numpy()) <= 1e-10, key

    # torchvision -> ours, after a second training-mode forward moved its running estimates
    with torch.no_grad():
        ref(torch.from_numpy(rng.standard_normal((4, *image_shape))))
    back = _float64(nn.build_model(name, image_shape, 10))
    back.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    back.eval()
    ref.eval()
    with torch.no_grad():
        expect = ref(torch.from_numpy(x)).numpy()
    with dp.no_grad():
        got = back(dp.tensor(x)).numpy()
    assert rel(got, expect) <= 1e-10


# --------------------------------------------------------------- resnet50 through the CLI

SHAPE = (3, 64, 64)  # the largest image the small-image stem takes
STEPS, SEED = 4, 5


def _rgb_shapes(seed, n, size=64):
    """n synthetic shapes as 3 x size x size RGB: edge-padded from 48, the channels
    differing."""
    from dptrain.data.synthetic import generate

    images, labels = generate(seed, np.arange(n))
    pad = (size - 48) // 2
    images = np.pad(images, ((0, 0), (0, 0), (pad, size - 48 - pad), (pad, size - 48 - pad)),
                    mode="edge")
    return np.ascontiguousarray(np.concatenate([images, 255 - images, images // 2 + 64],
                                               axis=1)), labels


def _pack(out, train, val, size):
    from dptrain.data.formats import packed
    from dptrain.data.synthetic import CLASSES

    packed.write(str(out), {"train": _rgb_shapes(1, train, size),
                            "val": _rgb_shapes(2, val, size)}, CLASSES, [0.5] * 3, [0.25] * 3)


def run_cli(*args, cache):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "dptrain", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def _train_args(data, logs, weights, *extra):
    # two training images at batch 2: every step takes the same batch, one step an epoch
    return ["train", "--model", "resnet50", "--dataset", "packed", "--data-dir", str(data),
            "--device", "cpu", "--batch-size", "2", "--epochs", str(STEPS), "--seed",
            str(SEED), "--optimizer", "adamw", "--lr", "1e-3", "--lr-schedule", "constant",
            "--warmup-steps", "0", "--log-every", "1", "--eval-every", "100",
            "--no-progress", "--log-dir", str(logs), "--save", str(weights), *extra]


def _losses(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _weights(path):
    with np.load(path) as w:
        return {k: w[k] for k in w.files if k != "__meta__"}


@pytest.fixture(scope="module")
def resnet50_run(tmp_path_factory):
    """resnet50 trained STEPS steps on 3x64x64 images through the CLI, with a checkpoint
    every 2 steps (about 20 s on 2 cores)."""
    tmp = tmp_path_factory.mktemp("resnet50")
    _pack(tmp / "data", 2, 2, SHAPE[1])
    out = run_cli(*_train_args(tmp / "data", tmp / "full", tmp / "full.npz", "--checkpoint-dir",
                               str(tmp / "ck"), "--checkpoint-every", "2"), cache=tmp / "cache")
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp


def test_resnet50_trains_on_the_cpu_through_the_cli(resnet50_run):
    tmp = resnet50_run
    losses = _losses(tmp / "full")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(np.isfinite(v) for v in losses.values()), losses
    assert losses[STEPS] < losses[1] - 0.5, losses  # one batch throughout: it fits it
    dp.manual_seed(SEED)  # as train() does before building the model: its initial weights
    start = nn.resnet50(SHAPE, 7).state_dict()
    trained = _weights(tmp / "full.npz")
    assert set(trained) == set(start)
    assert trained["conv1.weight"].shape == (64, 3, 3, 3)
    for key in ("conv1.weight", "layer3.4.conv2.weight", "layer4.0.downsample.1.weight",
                "fc.weight", "layer2.1.bn3.running_mean"):
        assert not np.array_equal(trained[key], start[key]), f"{key} did not change"
    assert int(trained["layer4.2.bn3.num_batches_tracked"]) == STEPS


def test_resnet50_resumes_bitwise(resnet50_run):
    tmp = resnet50_run
    out = run_cli(*_train_args(tmp / "data", tmp / "again", tmp / "again.npz", "--resume",
                               str(tmp / "ck" / "step-00000002")), cache=tmp / "cache")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 2" in out.stdout
    full, again = _losses(tmp / "full"), _losses(tmp / "again")
    assert sorted(again) == list(range(3, STEPS + 1))
    assert all(again[s] == full[s] for s in again), (again, full)
    resumed, ref = _weights(tmp / "again.npz"), _weights(tmp / "full.npz")
    for key, value in ref.items():
        assert np.array_equal(resumed[key], value), key


# --------------------------------------------------------------- on the GPU, in bf16


@pytest.mark.gpu
@pytest.mark.parametrize("image_shape", [(3, 96, 96), (3, 32, 32)], ids=["imagenet", "small"])
def test_resnet50_bf16_graph_replay_equals_eager_bitwise(image_shape):
    """resnet50's captured bf16 step (channels-last where the GPU's convolutions take it, the
    16-bit parameter shadow, batch statistics and running estimates updated inside the graph)
    replays exactly like the eager step: the weights after every step and the running
    estimates at the end, bit for bit."""
    from replay import train_steps

    from dptrain.optim import SGD

    runs = {}
    for graph in (False, True):
        model, snapshots = train_steps(
            "cuda", lambda: nn.resnet50(image_shape, 7), image_shape, 7, graph, 4, 3,
            images=32, batch=16, optimizer=lambda flat: SGD(flat, lr=0.05, momentum=0.9),
            precision="bf16")
        runs[graph] = snapshots, dict(model.state_dict())
    (eager, eager_state), (replayed, replayed_state) = runs[False], runs[True]
    for step, (a, b) in enumerate(zip(eager, replayed)):
        assert np.array_equal(a, b), f"weights differ after step {step + 1}"
    assert not np.array_equal(eager[0], eager[-1])
    assert int(replayed_state["bn1.num_batches_tracked"]) == 4
    for key, value in eager_state.items():
        assert np.array_equal(replayed_state[key], value), f"{key} differs after replay"


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
def test_resnet50_on_the_gpu_computes_the_cpu_forward(cu, channels_last):
    """resnet50 in fp32 on the GPU (outputs poisoned before each launch) against the CPU in
    float64 from the same weights, at 3x96x96 through ImageNet's stem, 8 images in training
    mode: the logits, the gradient of fc (the layers below it amplify rounding: float32
    against float64 differ by 3% in some batch norms' gradients on the CPU too) and the
    running estimates, among them those of the 2048-channel batch norms."""
    from dptrain.engine.autograd import Tensor

    shape = (3, 96, 96)
    dp.manual_seed(3)
    state = nn.resnet50(shape, 10).state_dict()
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((8, *shape)), np.arange(8) % 10
    ref = _float64(nn.resnet50(shape, 10)).load_state_dict(state)
    ref_logits = ref(dp.tensor(x))
    F.cross_entropy(ref_logits, dp.tensor(y)).backward()

    model = nn.resnet50(shape, 10, channels_last=channels_last).load_state_dict(state)
    model.to("cuda")
    precision = cu.runtime.precision
    cu.runtime.set_precision("fp32")
    try:
        logits = model(Tensor(cu.asarray(x.astype(np.float32))))
        F.cross_entropy(logits, Tensor(cu.asarray(y))).backward()
    finally:
        cu.runtime.set_precision(precision)
    assert rel(cu.to_numpy(logits.data), ref_logits.numpy()) <= 1e-3
    assert rel(cu.to_numpy(model.fc.weight.grad.data), ref.fc.weight.grad.numpy()) <= 1e-3
    got, want = model.state_dict(), ref.state_dict()
    for key in want:
        if "running" in key:
            assert rel(got[key], want[key]) <= 1e-3, key


@pytest.mark.gpu
def test_resnet50_bf16_resumes_bitwise_on_the_gpu(tmp_path):
    """8 steps of resnet50 in bf16 at 3x96x96 (ImageNet's stem) with a checkpoint at step 4;
    the run resumed from it logs the same losses and saves the same weights, bit for bit."""
    _pack(tmp_path / "data", 64, 16, 96)
    common = ["train", "--model", "resnet50", "--dataset", "packed", "--data-dir",
              str(tmp_path / "data"), "--device", "cuda", "--precision", "bf16",
              "--batch-size", "16", "--epochs", "2", "--max-steps", "8", "--seed", str(SEED),
              "--optimizer", "sgd", "--lr", "0.05", "--log-every", "1", "--eval-every", "100",
              "--no-progress"]
    full = run_cli(*common, "--log-dir", str(tmp_path / "full"), "--save",
                   str(tmp_path / "full.npz"), "--checkpoint-dir", str(tmp_path / "ck"),
                   "--checkpoint-every", "4", cache=tmp_path / "cache")
    assert full.returncode == 0, full.stderr[-3000:]
    again = run_cli(*common, "--log-dir", str(tmp_path / "again"), "--save",
                    str(tmp_path / "again.npz"), "--resume",
                    str(tmp_path / "ck" / "step-00000004"), cache=tmp_path / "cache")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 4" in again.stdout
    full_losses, again_losses = _losses(tmp_path / "full"), _losses(tmp_path / "again")
    assert sorted(full_losses) == list(range(1, 9)) and sorted(again_losses) == [5, 6, 7, 8]
    assert all(np.isfinite(v) for v in full_losses.values()), full_losses
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["config"]["precision"] == "bf16"
    assert all(again_losses[s] == full_losses[s] for s in again_losses), (again_losses,
                                                                          full_losses)
    resumed, ref = _weights(tmp_path / "again.npz"), _weights(tmp_path / "full.npz")
    for key, value in ref.items():
        assert np.array_equal(resumed[key], value), key
