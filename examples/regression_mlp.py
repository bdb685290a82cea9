"""A regression MLP on arrays you already have (here memory-mapped .npy files), data-parallel.

    mpirun -n 2 python examples/regression_mlp.py --x x.npy --y y.npy

Without --x/--y it makes a small problem first (y = sin(3 x0) + x1 * x2 + noise).
With --checkpoint-dir it saves the whole training state after every epoch, and --resume
goes on from the newest checkpoint there (at any number of ranks) as if never stopped.
"""
import argparse
import os
import tempfile

import numpy as np

import dptrain as dp
from dptrain import functional as F
from dptrain import nn


def make_problem(folder, n=2048, features=8):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = np.sin(3 * x[:, :1]) + x[:, 1:2] * x[:, 2:3] + 0.05 * rng.standard_normal((n, 1))
    np.save(os.path.join(folder, "x.npy"), x)
    np.save(os.path.join(folder, "y.npy"), y.astype(np.float32))
    return os.path.join(folder, "x.npy"), os.path.join(folder, "y.npy")


def main(args):
    world = dp.dist.init(device=args.device)
    if args.x is None:  # every rank makes the same files (same seed) in its own folder
        args.x, args.y = make_problem(tempfile.mkdtemp())
    x, y = np.load(args.x, mmap_mode="r"), np.load(args.y, mmap_mode="r")  # read by batch
    data = dp.ArrayDataset(x, y)

    dp.manual_seed(0)
    model = nn.Sequential(nn.Linear(x.shape[1], 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, y.shape[1]))
    ddp = dp.DataParallel(model, "adamw", lr=args.lr, weight_decay=0.0)
    step = ddp.compile(lambda batch: F.mse_loss(ddp(batch[0]), batch[1]))

    steps_per_epoch = len(data) // (args.batch_size * world.size)  # full batches only
    start = ddp.load(args.checkpoint_dir) // steps_per_epoch if args.resume else 0
    first = None
    for epoch in range(start, args.epochs):
        for batch in data.batches(args.batch_size, world, epoch):
            step(batch)
        loss = step.metrics()["loss"]
        first = loss if first is None else first
        if world.is_root:
            print(f"epoch {epoch + 1}: mse {loss:.4f}")
        if args.checkpoint_dir:
            ddp.save(args.checkpoint_dir)  # on every rank: the state is gathered
    if world.is_root:
        print(f"loss {first:.4f} -> {loss:.4f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--x", help="inputs, (n, features) .npy")
    p.add_argument("--y", help="targets, (n, outputs) .npy")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-dir", help="save the training state here every epoch")
    p.add_argument("--resume", action="store_true", help="go on from --checkpoint-dir")
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    dp.launch(main, args)
