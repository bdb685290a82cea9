"""A captured training step replays exactly like the eager one, dropout included: the
random offset lives on the device and the step advances it, so every replay draws a new
mask and graph and eager runs give bit-identical weights."""
import numpy as np
import pytest

import dptrain as dp
from dptrain import backend, nn
from replay import train_steps

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _dropout_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(48, 5))


def _train(device, graph, steps=20, seed=4):
    return train_steps(device, _dropout_model, (1, 8, 8), 5, graph, steps, seed)[1]


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


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_dropout_keeps_this_ranks_rows_of_the_global_mask(device):
    """Rank r of N drops exactly what one process drops on rows r, r+N, ... of the global
    batch (dptrain.engine.rng.set_data_shard), so data parallelism does not change dropout."""
    import dptrain.engine.functional as F
    from dptrain.engine.rng import set_data_shard

    be = backend.get(device)
    x = dp.tensor(np.ones((12, 5, 3), np.float32), device=device)
    try:
        be.runtime.manual_seed(21)
        set_data_shard(0, 1)
        whole = F.dropout(dp.tensor(np.ones((36, 5, 3), np.float32), device=device),
                          0.5).numpy()
        for rank in range(3):
            be.runtime.manual_seed(21)
            set_data_shard(rank, 3)
            mine = F.dropout(x, 0.5).numpy()
            assert np.array_equal(mine, whole[rank::3])
    finally:
        set_data_shard(0, 1)
