"""A user's loop that saves and resumes with DataParallel.save / load, for tests/run/
test_parallel_resume.py: `python resume_driver.py OUT SAVE_AT LOAD`, alone or under mpirun.

It trains a small net with dropout at fp16 (loss scaled, the scale doubling every 3 good
steps) to step 12 at a global batch of 16, reading the loss every step; the learning rate
halves after step 3. SAVE_AT > 0: save to
OUT.ckpt after that step (and go on). LOAD (a path, or "-"): load it first and go on from
its step, skipping the batches before it. Every rank writes OUT.rank{r}.npz: the loss of
each step it ran ("loss:STEP"), the final weights, loss scale and step count, and right
after a load the weights and the gathered optimizer state ("loaded:...")."""
import itertools
import sys

import numpy as np

import dptrain as dp
from dptrain import functional as F
from dptrain import nn

STEPS_PER_EPOCH, EPOCHS = 4, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.head(self.drop(F.flatten(F.relu(self.conv(x)))))


def main(out, save_at, load):
    world = dp.dist.init(device="cpu")
    dp.manual_seed(0)
    ddp = dp.DataParallel(Net(), "adamw", lr=2e-2, precision="fp16", loss_scale=2.0**8,
                          loss_scale_interval=3)
    saved = {}
    start = 0
    if load != "-":
        start = ddp.load(load)
        for name, value in ddp.state_dict().items():
            saved[f"loaded:model:{name}"] = value
        state = ddp.optimizer.gather_state(world.comm, list(ddp.model.named_parameters()))
        for key, per in state.items():
            saved.update({f"loaded:optim:{key}:{name}": a for name, a in per.items()})

    rng = np.random.default_rng(7)
    data = dp.ArrayDataset(rng.standard_normal((64, 1, 6, 6)).astype(np.float32),
                           rng.integers(0, 3, 64))
    step = ddp.compile(lambda b: F.cross_entropy(ddp(b[0]), b[1]))
    for epoch in range(start // STEPS_PER_EPOCH, EPOCHS):
        batches = data.batches(16 // world.size, world, epoch)
        skip = start - epoch * STEPS_PER_EPOCH if epoch == start // STEPS_PER_EPOCH else 0
        for batch in itertools.islice(batches, skip, None):
            if ddp.steps == 3:
                ddp.lr = 1e-2  # a schedule's change the checkpoint must carry
            step(batch)
            saved[f"loss:{ddp.steps}"] = np.float64(step.metrics()["loss"])
            if ddp.steps == save_at:
                ddp.save(f"{out}.ckpt")
    saved.update({f"final:{k}": v for k, v in ddp.state_dict().items()})
    np.savez(f"{out}.rank{world.rank}.npz", steps=ddp.steps,
             scale=np.array(ddp.scaler.state_dict()), **saved)


if __name__ == "__main__":
    dp.launch(main, sys.argv[1], int(sys.argv[2]), sys.argv[3])
