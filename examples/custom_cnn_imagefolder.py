"""A CNN of your own, trained with your own loop on an image folder, data-parallel.

    mpirun -n 2 python examples/custom_cnn_imagefolder.py --data-dir photos --image-size 32

photos/ holds one folder per class (as torchvision's ImageFolder). Every rank runs this
script; each trains on its stride of every global batch and the gradients are averaged.
"""
import argparse


import dptrain as dp
from dptrain import functional as F
from dptrain import nn
from dptrain.data import get_dataset


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
    ddp = dp.DataParallel(model, "adamw", lr=args.lr)

    def train_step(batch):
        x, y = batch
        logits = ddp(x)
        # metrics stay on the device (no host sync in the step): correct answers summed
        correct = ddp.be.count_correct(logits.data, y.data)
        return F.cross_entropy(logits, y), {"correct": correct}

    step = ddp.compile(train_step, reduce={"correct": "sum"})
    global_batch = args.batch_size * world.size
    first = None
    for epoch in range(args.epochs):
        for batch in data.batches(args.batch_size, world, epoch, drop_last=True):
            step(batch)
        read = step.metrics()  # per-step means over the epoch, combined over the ranks
        loss, accuracy = read["loss"], read["correct"] / global_batch
        first = loss if first is None else first
        if world.is_root:
            print(f"epoch {epoch + 1}: loss {loss:.4f} accuracy {accuracy:.3f}")
    if world.is_root:
        print(f"loss {first:.4f} -> {loss:.4f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="auto")
    dp.launch(main, p.parse_args())
