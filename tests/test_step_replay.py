"""A captured training step replays exactly like the eager one, dropout included: the
random offset lives on the device and the step advances it, so every replay draws a new
mask and graph and eager runs give bit-identical weights."""
from types import SimpleNamespace

import numpy as np
import pytest

import dptrain as dp
from dptrain import backend, dist, nn
from dptrain.data import DeviceLoader
from dptrain.flat import FlatParameters
from dptrain.optim import AdamW
from dptrain.reducer import Reducer
from dptrain.train import TrainStep

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _dropout_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(48, 5))


def _train(device, graph, steps=20, seed=4):
    be = backend.get(device)
    dp.manual_seed(seed)
    model = _dropout_model().to(device)
    flat = FlatParameters(model.parameters())
    opt = AdamW(flat, lr=1e-2)
    reducer = Reducer(flat, dist.World(comm=dist.LocalComm(be)))
    rng = np.random.default_rng(seed)
    data = SimpleNamespace(images=rng.integers(0, 256, (96, 1, 8, 8), dtype=np.uint8),
                           labels=rng.integers(0, 5, 96), mean=0.5, std=0.25, num_classes=5,
                           image_shape=(1, 8, 8))
    loader = DeviceLoader(data, be, 32)
    step_fn = TrainStep(model, opt, reducer, loader)
    run = be.runtime.capture(step_fn) if graph else step_fn
    snapshots = []
    for step in range(steps):
        opt.begin_step()
        loader.set_batch(rng.permutation(96)[:32])
        run()
        snapshots.append(be.to_numpy(flat.data).copy())
    return snapshots


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_step_replays_bitwise_like_eager(device):
    eager, graph = _train(device, graph=False), _train(device, graph=True)
    for step, (a, b) in enumerate(zip(eager, graph)):
        assert np.array_equal(a, b), f"{device}: weights differ after step {step + 1}"


@pytest.mark.parametrize("device", DEVICES)
def test_replayed_steps_draw_new_dropout_masks(device):
    """Inside one captured function, consecutive calls see different masks."""
    be = backend.get(device)
    be.runtime.manual_seed(11)
    out = be.zeros((2, 4096), np.float32)

    def draw():
        be.copy_(out[0], out[1])
        be.copy_(out[1], be.dropout_mask((4096,), 0.5))

    run = be.runtime.capture(draw, warmup=1)
    masks = []
    for _ in range(4):
        run()
        masks.append(be.to_numpy(out[1]).copy())
    for a, b in zip(masks, masks[1:]):
        assert not np.array_equal(a, b)
        assert 0.4 < (a > 0).mean() < 0.6
