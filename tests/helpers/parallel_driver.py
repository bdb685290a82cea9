"""A user's own model and loop on dptrain.DataParallel, for tests/run/test_parallel.py:
`python parallel_driver.py OUT GLOBAL_BATCH CAPTURE MODE`, alone or under mpirun.

MODE "train" trains 20 steps and rank 0 writes the weights and the per-step losses to OUT
(.npz); the others feed one kind of bad input: "noloss" (the step function returns None),
"badshape" (the second batch is smaller), "differ" (each rank seeds its own weights)."""
import sys

import numpy as np

import dptrain as dp
from dptrain import functional as F
from dptrain import nn


class TinyNet(nn.Module):
    """Not a model of dptrain.nn: a convolution, then two heads (classes and a regression)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.classes = nn.Linear(4 * 6 * 6, 3)
        self.value = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x):
        h = F.flatten(F.relu(self.conv(x)))
        return self.classes(h), self.value(h)


def main(out, global_batch, capture, mode):
    world = dp.dist.init(device="cpu")
    dp.manual_seed(world.rank if mode == "differ" else 0)
    ddp = dp.DataParallel(TinyNet(), "adamw", lr=1e-2, precision="fp32")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 1, 6, 6)).astype(np.float32)
    labels = rng.integers(0, 3, 64)
    values = rng.standard_normal((64, 2))  # float64: the step stores float32
    data = dp.ArrayDataset(x, labels, values)

    def loss_fn(batch):
        if mode == "noloss":
            return None
        xb, yb, vb = batch
        logits, value = ddp(xb)
        loss = F.cross_entropy(logits, yb, label_smoothing=0.1) + F.mse_loss(value, vb)
        return loss, {"mse": F.mse_loss(value, vb)}

    step = ddp.compile(loss_fn, capture=capture)
    losses = []
    for epoch in range(5):  # 64 samples / 16 per global batch: 4 steps an epoch, 20 in all
        for i, batch in enumerate(data.batches(global_batch // world.size, world, epoch)):
            if mode == "badshape" and step.steps == 1:
                batch = tuple(a[:-1] for a in batch)
            step(batch)
            losses.append(step.metrics()["loss"])
    weights = ddp.state_dict()
    if world.is_root:
        np.savez(out, losses=np.array(losses), **weights)


if __name__ == "__main__":
    dp.launch(main, sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4])
