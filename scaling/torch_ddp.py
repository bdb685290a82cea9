"""The PyTorch DDP baseline of the scaling sweeps: dptrain's training run, done by PyTorch.

Launched by torchrun (one process per GPU), as strong.py and weak.py do:
  python -m torch.distributed.run --standalone --nproc_per_node=G -m scaling.torch_ddp \
      --device cuda --train-images N --epochs 1 --batch-size B --log-dir DIR
Without torchrun it runs one process.

Kept equal to `python -m dptrain train` so the two compare like for like:
  model      the reference CNN (conv3x3 pad 1 of 32/64/128 + ReLU + maxpool 2 each, FC
             4608-256-7), starting from dptrain's own initial weights for --seed
  data       the same arrays from dptrain.data.get_dataset, on the device, normalised the
             same way; dptrain's StrideSampler gives every rank the same batches as ours
  optimizer  dptrain's defaults and flags (TrainConfig): AdamW or SGD, the same LR schedule
  precision  bf16 autocast for bf16, and for auto on a GPU with bf16 (dptrain's auto picks
             bf16 there too); TF32 matmuls/convolutions for tf32 (and the fp32 parts of an
             autocast step); plain fp32 for fp32
  execution  eager PyTorch (DistributedDataParallel), where dptrain replays a CUDA graph
  metrics    loss summed on the device and read every --log-every steps; training time
             (train_s) counts the steps and those reads, not start-up or validation
DIR/summary.json has dptrain's keys (train_loss, val_loss, val_accuracy, wall_s, train_s,
images_per_s, world_size, global_batch_size, ...) plus framework "torch".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make dptrain importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402


def parse_args(argv):
    from dptrain.run.config import TrainConfig

    d = {f.name: f.default for f in fields(TrainConfig)}
    p = argparse.ArgumentParser(prog="python -m scaling.torch_ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn", choices=("cnn",))
    p.add_argument("--dataset", default=d["dataset"])
    p.add_argument("--train-images", type=int, required=True)
    p.add_argument("--val-images", type=int, required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="per process")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="over all processes (instead of --batch-size)")
    p.add_argument("--optimizer", default=d["optimizer"], choices=("adamw", "sgd"))
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--lr-schedule", default=d["lr_schedule"])
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"])
    p.add_argument("--momentum", type=float, default=d["momentum"])
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--precision", default=d["precision"],
                   choices=("auto", "tf32", "fp32", "bf16"))
    p.add_argument("--bucket-mb", type=float, default=d["bucket_mb"], help="DDP bucket size")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="accepted for dptrain's flag set; PyTorch runs eager steps anyway")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--log-every", type=int, default=d["log_every"])
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- pieces
# Also used single-process by scaling/threads.py for its PyTorch baseline.


def reference_cnn(torch, image_shape=(1, 48, 48), num_classes=7, seed=0):
    """torch's twin of dptrain.nn.cnn, holding dptrain's initial weights for `seed`
    (the layer indices, hence the state-dict names, are the same)."""
    import dptrain
    from dptrain.nn import build_model

    tnn = torch.nn
    c, h, w = image_shape
    layers = []
    for out in (32, 64, 128):
        layers += [tnn.Conv2d(c, out, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2)]
        c, h, w = out, h // 2, w // 2
    layers += [tnn.Flatten(), tnn.Linear(c * h * w, 256), tnn.ReLU(), tnn.Linear(256, num_classes)]
    model = tnn.Sequential(*layers)
    dptrain.manual_seed(seed)
    ours = build_model("cnn", image_shape, num_classes)
    model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32))
                           for k, v in ours.state_dict().items()})
    return model


def make_optimizer(torch, params, args):
    """dptrain.run.train.build_optimizer's choice, in torch (same defaults: betas, eps)."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum,
                               weight_decay=args.weight_decay, nesterov=args.nesterov)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


def set_precision(torch, precision):
    """Set the matmul precision; returns the autocast dtype (torch.bfloat16) or None."""
    tf32 = precision in ("auto", "tf32", "bf16")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    bf16 = precision == "bf16" or (precision == "auto" and torch.cuda.is_bf16_supported())
    return torch.bfloat16 if bf16 else None


def to_device(torch, dataset, device):
    """(uint8 images, int64 labels) of a dptrain dataset on `device`."""
    images = torch.from_numpy(np.array(dataset.images, copy=True)).to(device)
    labels = torch.from_numpy(np.array(dataset.labels, dtype=np.int64)).to(device)
    return images, labels


def normalize(images_u8, mean, std):
    """As dptrain's gather_normalize: pixels to [0, 1], then (x - mean) / std."""
    return images_u8.float().mul_(1.0 / (255.0 * std)).sub_(mean / std)


def train_step(torch, net, opt, images, labels, idx, mean, std, lr, autocast=None):
    """One SGD/AdamW step on the rows idx (forward under `autocast`, a dtype, if given);
    returns the loss (on the device, no sync)."""
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
        logits = net(normalize(images[idx], mean, std))
    loss = torch.nn.functional.cross_entropy(logits.float(), labels[idx])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def evaluate(torch, model, images, labels, mean, std, rank=0, size=1, batch_size=1000):
    """Mean loss and accuracy over the set; rank r takes images r, r+N, ... (as dptrain)."""
    F = torch.nn.functional
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=images.device)
    mine = torch.arange(rank, labels.shape[0], size, device=images.device)
    with torch.no_grad():
        for start in range(0, mine.numel(), batch_size):
            idx = mine[start:start + batch_size]
            logits = model(normalize(images[idx], mean, std))
            y = labels[idx]
            sums[0] += F.cross_entropy(logits, y, reduction="sum").double()
            sums[1] += (logits.argmax(1) == y).sum().double()
    model.train()
    if size > 1:
        torch.distributed.all_reduce(sums)
    loss, correct = sums.tolist()
    n = labels.shape[0]
    return {"val_loss": loss / n, "val_accuracy": correct / n}


# ----------------------------------------------------------------------------- the run


def train(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dptrain.data import StrideSampler, get_dataset
    from dptrain.optim import LRSchedule

    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    autocast = None
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        autocast = set_precision(torch, args.precision)
    else:
        device = torch.device("cpu")
    if size > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.global_batch_size is not None:
        if args.global_batch_size % size:
            raise SystemExit(f"--global-batch-size {args.global_batch_size} does not divide by "
                             f"the {size} ranks")
        args.batch_size = args.global_batch_size // size
    torch.manual_seed(args.seed)

    train_set = get_dataset(args.dataset, "train", args.train_images, args.seed, args.cache_dir)
    val_set = get_dataset(args.dataset, "val", args.val_images, args.seed, args.cache_dir)
    images, labels = to_device(torch, train_set, device)
    val_images, val_labels = to_device(torch, val_set, device)
    mean, std = train_set.mean, train_set.std

    model = reference_cnn(torch, train_set.image_shape, train_set.num_classes, args.seed).to(device)
    net = model
    if size > 1:
        net = DistributedDataParallel(model, device_ids=[local_rank] if args.device == "cuda"
                                      else None, bucket_cap_mb=args.bucket_mb)
    opt = make_optimizer(torch, net.parameters(), args)
    sampler = StrideSampler(len(train_set.labels), args.batch_size, size, rank, seed=args.seed)
    steps_per_epoch = len(sampler)
    total = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    schedule = LRSchedule(args.lr, args.lr_schedule, total, args.warmup_steps)
    global_batch = args.batch_size * size
    root = rank == 0
    if root:
        print(f"torch_ddp: cnn on {args.dataset} ({len(train_set.labels)} train / "
              f"{len(val_set.labels)} val images), {device.type} x {size}, batch "
              f"{args.batch_size} per rank ({global_batch} global), {total} steps, "
              f"torch {torch.__version__}", flush=True)

    loss_sum = torch.zeros((), device=device)
    step, window_steps, train_time, last_loss, last_eval = 0, 0, 0.0, float("nan"), {}
    _sync(torch, device)
    wall_start = window_start = last_print = time.perf_counter()
    for epoch in range(args.epochs):
        # Per-epoch upload of this rank's batch indices (dptrain uploads each step's).
        batches = torch.from_numpy(sampler.epoch_batches(epoch)).to(device)
        for local in range(steps_per_epoch):
            if step >= total:
                break
            loss_sum += train_step(torch, net, opt, images, labels, batches[local], mean, std,
                                   schedule(step), autocast)
            step += 1
            window_steps += 1
            if step % args.log_every == 0 or step == total:
                if size > 1:
                    dist.all_reduce(loss_sum)
                last_loss = loss_sum.item() / size / window_steps  # .item() waits: the window ends
                now = time.perf_counter()
                train_time += now - window_start
                if root and args.progress and (now - last_print > 5 or step == total):
                    last_print = now
                    print(f"step {step}/{total} loss {last_loss:.4f} "
                          f"{window_steps * global_batch / (now - window_start):.0f} images/s",
                          flush=True)
                loss_sum.zero_()
                window_steps = 0
                window_start = now
            if step % steps_per_epoch == 0 or step == total:
                last_eval = evaluate(torch, model, val_images, val_labels, mean, std, rank, size)
                _sync(torch, device)
                window_start = time.perf_counter()  # validation is not training time
        if step >= total:
            break

    rate = step * global_batch / train_time if train_time > 0 else 0.0
    summary = {
        "framework": "torch",
        "precision": "bf16" if autocast is not None else args.precision,
        "torch_version": torch.__version__,
        "train_loss": last_loss,
        "val_loss": last_eval.get("val_loss"),
        "val_accuracy": last_eval.get("val_accuracy"),
        "steps": step,
        "images": step * global_batch,
        "world_size": size,
        "global_batch_size": global_batch,
        "device": args.device,
        "wall_s": time.perf_counter() - wall_start,
        "train_s": train_time,
        "images_per_s": rate,
        "images_per_s_per_rank": rate / size,
        "config": vars(args),
    }
    if root:
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.log_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"torch_ddp: done: {step} steps, {train_time:.2f} s training ({rate:.0f} images/s),"
              f" train_loss {last_loss:.4f}, val_accuracy {summary['val_accuracy']:.4f}",
              flush=True)
    if size > 1:
        dist.destroy_process_group()
    return summary


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    train(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
