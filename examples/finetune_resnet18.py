"""Fine-tune resnet18 from a saved weights file: the body frozen, a new head trained.

    mpirun -n 2 python examples/finetune_resnet18.py --weights resnet18.npz --classes 4

The weights are a .npz of torchvision-style names (what `python -m dptrain train --save`
writes, and torchvision's resnet18 state_dict saved with np.savez). A missing file is
first written with fresh weights, so the script runs anywhere. The data here is a small
made-up set of colour images whose class is the brightest channel.
"""
import argparse
import os

import numpy as np

import dptrain as dp
from dptrain import functional as F
from dptrain import nn


def toy_images(n, size, classes, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    x = rng.random((n, 3, size, size)).astype(np.float32)
    x[np.arange(n), labels % 3] += 0.5 + 0.25 * (labels // 3)[:, None, None]
    return x, labels


def main(args):
    world = dp.dist.init(device=args.device)
    shape = (3, args.image_size, args.image_size)
    if world.is_root and not os.path.exists(args.weights):
        dp.manual_seed(1)
        np.savez(args.weights, **nn.resnet18(shape, num_classes=10).state_dict())
        print(f"wrote fresh weights to {args.weights}")
    if world.mpi_comm is not None:
        world.mpi_comm.Barrier()  # the file exists for every rank

    model = nn.resnet18(shape, num_classes=10)
    with np.load(args.weights) as weights:
        model.load_state_dict(dict(weights), source=args.weights)
    for p in model.parameters():
        p.requires_grad = False  # freeze the body ...
    dp.manual_seed(0)
    model.fc = nn.Linear(model.fc.weight.shape[1], args.classes)  # ... and train a new head
    model.eval()  # batch norm keeps the saved running estimates

    ddp = dp.DataParallel(model, "adamw", lr=args.lr)
    step = ddp.compile(lambda batch: F.cross_entropy(ddp(batch[0]), batch[1]))
    data = dp.ArrayDataset(*toy_images(args.images, args.image_size, args.classes))
    first = None
    for epoch in range(args.epochs):
        for batch in data.batches(args.batch_size, world, epoch):
            step(batch)
        loss = step.metrics()["loss"]
        first = loss if first is None else first
        if world.is_root:
            print(f"epoch {epoch + 1}: loss {loss:.4f}")
    weights = ddp.state_dict()  # on every rank: the first read after a step gathers them
    if world.is_root:
        np.savez(args.out, **weights)
        print(f"loss {first:.4f} -> {loss:.4f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default="resnet18.npz")
    p.add_argument("--out", default="finetuned.npz")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--device", default="auto")
    dp.launch(main, p.parse_args())
