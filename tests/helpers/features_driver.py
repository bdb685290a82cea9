"""A user's loop with the DDP features of dptrain.DataParallel, for
tests/run/test_parallel_features.py: `python features_driver.py OUT MODE [ACCUMULATE CLIP]`, alone or under mpirun.

MODE "train": 8 steps of a global batch of 16 with AdamW, a warm-up + cosine schedule, no
weight decay on biases (parameter groups), ACCUMULATE micro-batches and CLIP (0: none);
rank 0 writes the weights, the per-step losses and grad norms, and how many reduce-scatters
each step sent to OUT (.npz).
The others run under dptrain.launch with a 3 s collective timeout: "metrics0" (rank 0
alone reads step.metrics()), "state0" (rank 0 alone reads ddp.state_dict() after a step),
"current0" (every rank evaluates, then rank 0 alone reads ddp.state_dict(): no collective),
"sigterm" (steps until a SIGTERM stops it; OUT gets a line once it is stepping)."""
import os
import sys
import time

import numpy as np

import dptrain as dp
from dptrain import functional as F
from dptrain import nn
from dptrain.optim import no_decay_groups, schedules


def _setup(world, accumulate=1, clip=0.0):
    dp.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    lr = schedules.WarmupCosine(2e-2, total_steps=8, warmup_steps=2, min_lr=1e-3)
    ddp = dp.DataParallel(model, "adamw", lr=lr, weight_decay=0.1, precision="fp32",
                          param_groups=no_decay_groups(model), bucket_mb=0.001)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    data = dp.ArrayDataset(x, y)

    def loss_fn(batch):
        logits = ddp(batch[0])
        return F.cross_entropy(logits, batch[1]), {"correct": F.count_correct(logits, batch[1])}

    step = ddp.compile(loss_fn, reduce={"correct": "sum"}, accumulate=accumulate,
                       clip_grad_norm=clip or None)
    return ddp, step, data


def train(out, accumulate, clip):
    world = dp.dist.init(device="cpu")
    # No BatchNorm statistics of micro-batches differ from the whole batch's: eval-mode BN
    ddp, step, data = _setup(world, accumulate, clip)
    ddp.model[1].train(False)
    sent = []
    scatter = world.comm.reduce_scatter

    def counted(*args, **kwargs):
        sent[-1] += 1
        return scatter(*args, **kwargs)

    world.comm.reduce_scatter = counted
    losses, norms = [], []
    for epoch in range(2):  # 64 rows / 16 a step: 4 steps an epoch
        for batch in data.batches(16 // world.size, world, epoch):
            sent.append(0)
            step(batch)
            read = step.metrics()
            losses.append(read["loss"])
            norms.append(read.get("grad_norm", 0.0))
    weights = ddp.state_dict()
    if world.is_root:
        np.savez(out, losses=np.array(losses), norms=np.array(norms), sent=np.array(sent),
                 **weights)


def protected(out, mode):
    world = dp.dist.init(device="cpu")
    ddp, step, data = _setup(world)
    batches = data.batches(16 // world.size, world, 0)
    step(next(batches))
    if mode == "sigterm":
        with open(out, "w") as f:
            f.write("stepping\n")
        while True:
            step(next(batches, None) or next(data.batches(16 // world.size, world, 1)))
            time.sleep(0.05)
    if mode == "current0":
        ddp.eval()
    if world.rank == 0:
        read = {"metrics0": step.metrics, "state0": ddp.state_dict,
                "current0": ddp.state_dict}[mode]()
        assert read
    else:
        time.sleep(0 if mode == "current0" else 60)


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if mode == "train":
        train(out, int(sys.argv[3]), float(sys.argv[4]))
    else:
        dp.launch(protected, out, mode, collective_timeout=3)
