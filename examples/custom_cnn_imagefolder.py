"""A CNN of your own, trained with your own loop on an image folder, data-parallel.

    mpirun -n 2 python examples/custom_cnn_imagefolder.py --data-dir photos --image-size 32

photos/ holds one folder per class (as torchvision's ImageFolder). Every rank runs this
script; each trains on its stride of every global batch and the gradients are averaged.
It shows the usual companions of a loop: a warm-up + cosine learning-rate schedule, no
weight decay on biases, gradient accumulation (--accumulate micro-batches a step),
clipping by global norm, an accuracy metric, and an evaluation in eval mode.
"""
import argparse

import dptrain as dp
from dptrain import functional as F
from dptrain import nn
from dptrain.data import get_dataset
from dptrain.optim import no_decay_groups, schedules


class SmallCNN(nn.Module):
    def __init__(self, channels, classes, size):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Linear(16 * (size // 4) ** 2, classes)

    def forward(self, x):
        return self.head(self.features(x))


def main(args):
    world = dp.dist.init(device=args.device)
    images = get_dataset("imagefolder", "train", None, data_dir=args.data_dir,
                         image_size=args.image_size)
    data = dp.ArrayDataset.from_dataset(images)  # float32 normalised images, int64 labels
    dp.manual_seed(0)  # the same initial weights on every rank
    model = SmallCNN(images.image_shape[0], images.num_classes, args.image_size)
    steps = args.epochs * (len(data) // (args.batch_size * world.size))
    lr = schedules.WarmupCosine(args.lr, total_steps=steps, warmup_steps=steps // 10)
    ddp = dp.DataParallel(model, "adamw", lr=lr, weight_decay=0.05,
                          param_groups=no_decay_groups(model))

    def train_step(batch):
        x, y = batch
        logits = ddp(x)
        # metrics stay on the device (no host sync in the step), averaged over the ranks
        return F.cross_entropy(logits, y), {"accuracy": F.accuracy(logits, y)}

    # each batch in --accumulate micro-batches, one exchange and update; norm clipped to 1
    step = ddp.compile(train_step, accumulate=args.accumulate, clip_grad_norm=1.0)
    first = None
    for epoch in range(args.epochs):
        for batch in data.batches(args.batch_size, world, epoch, drop_last=True):
            step(batch)
        read = step.metrics()  # per-step means over the epoch, combined over the ranks
        loss = read["loss"]
        first = loss if first is None else first
        if world.is_root:
            print(f"epoch {epoch + 1}: loss {loss:.4f} accuracy {read['accuracy']:.3f} "
                  f"grad norm {read['grad_norm']:.3f} lr {ddp.lr:.2g}")
    ddp.eval()  # on every rank: gathers the weights the last step updated
    hits, seen = 0, 0
    with dp.no_grad():
        for x, y in data.batches(args.batch_size, world, 0, drop_last=False):
            hits += float(F.count_correct(ddp(dp.tensor(x)), dp.tensor(y)).numpy())
            seen += len(y)
    if world.is_root:  # this rank's share of the images, in eval mode
        print(f"eval-mode accuracy on rank 0's images: {hits / seen:.3f}")
        print(f"loss {first:.4f} -> {loss:.4f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches a step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="auto")
    dp.launch(main, p.parse_args())
