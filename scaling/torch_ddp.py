"""The PyTorch DDP baseline of the scaling sweeps: dptrain's training run, done by PyTorch.

Launched by torchrun (one process per GPU), as strong.py and weak.py do:
  python -m torch.distributed.run --standalone --nproc_per_node=G -m scaling.torch_ddp \
      --device cuda --model cnn --torch-mode graph --train-images N --epochs 1 \
      --batch-size B --log-dir DIR
Without torchrun it runs one process (no DDP wrapper then).

Kept equal to `python -m dptrain train` so the two compare like for like:
  model      the twin of dptrain's --model (cnn, resnet18; dptrain.run.torch_twin) for the
             dataset's image shape, starting from dptrain's own initial weights for --seed
  data       the same arrays from dptrain.data.get_dataset, on the device, normalised the
             same way inside the step; dptrain's StrideSampler gives every rank our batches
  optimizer  dptrain's defaults and flags (TrainConfig): AdamW or SGD, the same LR schedule;
             fused on a GPU (PyTorch's fastest)
  precision  bf16 / fp16: autocast to 16 bits with channels_last activations and weights
             (fp16 with dynamic loss scaling at dptrain's settings); auto is bf16 on a GPU
             with bf16 (as dptrain's auto for cnn and resnet18); TF32 for tf32 and the fp32
             parts of a 16-bit step; plain fp32 for fp32
  buffers    batch norm's running estimates stay per rank, rank 0's broadcast before each
             evaluation, as dptrain does (DDP's broadcast at every forward is off)
  execution  --torch-mode:
               eager    DistributedDataParallel, op by op
               compile  torch.compile (default mode) of the DDP module: Dynamo's DDP
                        optimizer splits the compiled graph at the gradient buckets;
                        the optimizer step eager
               graph    the whole step (gather, forward, backward with DDP's all-reduce,
                        the optimizer step, the loss sum) captured once as a CUDA graph and
                        replayed; the batch's rows are copied into a static index buffer
                        and the learning rate into a device tensor before each replay
  metrics    loss summed on the device and read every --log-every steps; train_s counts the
             steps after the first ones (as many as dptrain leaves out, CAPTURE_WARMUP + 1,
             where cuDNN tunes and torch.compile compiles; the graph mode GRAPH_WARMUP + 1,
             its eager warm-up and the capture) and those reads, not start-up or validation
DIR/summary.json has dptrain's keys (train_loss, val_loss, val_accuracy, wall_s, train_s,
images_per_s, world_size, global_batch_size, ...) plus framework "torch" and torch_mode.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make dptrain importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

MODELS = ("cnn", "resnet18")
TORCH_MODES = ("eager", "compile", "graph")
# PyTorch's rules for capturing DDP's backward (its notes on CUDA graphs, "Usage with
# DistributedDataParallel"): DDP built on a side stream, at least 11 eager DDP iterations
# before the capture, and no async NCCL error handling.
GRAPH_WARMUP = 11


def parse_args(argv):
    from dptrain.run.config import TrainConfig

    d = {f.name: f.default for f in fields(TrainConfig)}
    p = argparse.ArgumentParser(prog="python -m scaling.torch_ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn", choices=MODELS)
    p.add_argument("--torch-mode", default="eager", choices=TORCH_MODES,
                   help="how the step runs (default %(default)s)")
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
                   choices=("auto", "tf32", "fp32", "bf16", "fp16"))
    p.add_argument("--loss-scale", type=float, default=d["loss_scale"],
                   help="fp16: the initial loss scale")
    p.add_argument("--loss-scale-interval", type=int, default=d["loss_scale_interval"],
                   help="fp16: steps without an overflow before the scale doubles")
    p.add_argument("--bucket-mb", type=float, default=d["bucket_mb"], help="DDP bucket size")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="accepted for dptrain's flag set; --torch-mode picks PyTorch's execution")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--log-every", type=int, default=d["log_every"])
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    if args.torch_mode == "graph" and args.device != "cuda":
        p.error("--torch-mode graph: CUDA graphs need --device cuda")
    return args


# ----------------------------------------------------------------------------- pieces
# Also used single-process by scaling/threads.py for its PyTorch baseline.


def build_twin(torch, name, image_shape, num_classes, seed):
    """torch's twin of dptrain's model `name` (the same layers and state-dict names),
    holding dptrain's initial weights for `seed`."""
    import dptrain
    from dptrain.nn import build_model
    from dptrain.run.torch_twin import twin

    dptrain.manual_seed(seed)  # as dptrain's train() before it builds the model
    net = twin(build_model(name, tuple(image_shape), num_classes))
    if net is None:
        raise SystemExit(f"torch_ddp: --model {name} has no PyTorch twin here (resnet18's is "
                         "torchvision's)")
    return net


def reference_cnn(torch, image_shape=(1, 48, 48), num_classes=7, seed=0):
    """torch's twin of dptrain.nn.cnn with dptrain's initial weights for `seed`."""
    return build_twin(torch, "cnn", image_shape, num_classes, seed)


def make_optimizer(torch, params, args, device=None, graph=False):
    """dptrain.run.train.build_optimizer's choice, in torch (same defaults: betas, eps). On a
    GPU the fused step; for a graph also capturable (AdamW's step count on the device) with
    the rate a device tensor, which set_lr fills before each replay."""
    extra = {"fused": True} if device is not None and device.type == "cuda" else {}
    lr = torch.tensor(args.lr, device=device) if graph else args.lr
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=args.momentum,
                               weight_decay=args.weight_decay, nesterov=args.nesterov, **extra)
    if graph:
        extra["capturable"] = True
    return torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay, **extra)


def set_lr(torch, opt, lr):
    """Every group's learning rate; a tensor rate (what a graph reads) is filled in place."""
    for group in opt.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def set_precision(torch, precision):
    """Set the matmul precision; returns the autocast dtype (bfloat16, float16) or None."""
    tf32 = precision in ("auto", "tf32", "bf16", "fp16")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    if precision == "fp16":
        return torch.float16
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


def forward_backward(torch, net, opt, images, labels, idx, mean, std, autocast=None,
                     scaler=None):
    """One optimisation step on the rows idx, reading nothing back to the host (so a graph
    can hold it): gather and normalise, forward (under `autocast`, a dtype, with
    channels_last input), loss, backward (DDP's all-reduce), optimizer step (through
    `scaler`, a GradScaler, if given). Returns the loss on the device."""
    x = normalize(images[idx], mean, std)
    if autocast is not None:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
        logits = net(x)
    loss = torch.nn.functional.cross_entropy(logits.float(), labels[idx])
    opt.zero_grad(set_to_none=False)  # in place: the gradients a graph wrote stay its own
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.detach()


def train_step(torch, net, opt, images, labels, idx, mean, std, lr, autocast=None):
    """One step at learning rate lr; returns the loss (on the device, no sync)."""
    set_lr(torch, opt, lr)
    return forward_backward(torch, net, opt, images, labels, idx, mean, std, autocast)


def graphed(torch, step, warmup, side):
    """`step` (no arguments, no host reads) as one CUDA graph: its first `warmup` calls run
    eagerly on the `side` stream, the next captures it and every call from then on replays
    it (the capture itself runs nothing, so no step is run twice or skipped)."""
    graph = None
    calls = 0

    def run():
        nonlocal graph, calls
        calls += 1
        if calls <= warmup:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            return
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            # thread_local: calls of other threads (NCCL's watchdog polling its events)
            # cannot invalidate the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step()
        graph.replay()

    return run


def wrap(torch, model, args, size, local_rank, side=None):
    """`model` in DistributedDataParallel on several processes (itself on one). With a
    `side` stream (the graph mode): static_graph, built on that stream."""
    if size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    def build():
        return DistributedDataParallel(
            model, device_ids=[local_rank] if args.device == "cuda" else None,
            bucket_cap_mb=args.bucket_mb, broadcast_buffers=False, static_graph=side is not None)

    if side is None:
        return build()
    side.wait_stream(torch.cuda.current_stream())  # the weights were copied in on this one
    with torch.cuda.stream(side):
        return build()


def broadcast_buffers(dist, model):
    """Rank 0's batch-norm estimates on every rank, as dptrain before it evaluates."""
    for buf in model.buffers():
        dist.broadcast(buf, 0)


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


def read_loss(torch, loss_sum, size, steps):
    """The loss averaged over the ranks and the window's `steps` (the host read ends the
    window's steps); the sum restarts."""
    if size > 1:
        torch.distributed.all_reduce(loss_sum)
    loss = loss_sum.item() / size / steps
    loss_sum.zero_()
    return loss


# ----------------------------------------------------------------------------- the run


def start(torch, args):
    """(rank, size, local rank, device, autocast dtype or None) of this process, its
    process group started and --global-batch-size turned into the per-rank --batch-size."""
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
        if args.torch_mode == "graph":  # PyTorch's notes: DDP's backward is captured with this off
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.global_batch_size is not None:
        if args.global_batch_size % size:
            raise SystemExit(f"--global-batch-size {args.global_batch_size} does not divide by "
                             f"the {size} ranks")
        args.batch_size = args.global_batch_size // size
    return rank, size, local_rank, device, autocast


def build_net(torch, model, args, size, local_rank, autocast):
    """(model in its memory format, the module the step calls, the graph mode's side stream
    or None): channels_last under 16-bit autocast, DDP on several processes, compiled in
    the compile mode."""
    if autocast is not None:
        model = model.to(memory_format=torch.channels_last)
    side = torch.cuda.Stream() if args.torch_mode == "graph" else None
    net = wrap(torch, model, args, size, local_rank, side)
    if args.torch_mode == "compile":
        net = torch.compile(net)
    return model, net, side


def train(args) -> dict:
    import torch
    import torch.distributed as dist

    from dptrain.data import StrideSampler, get_dataset
    from dptrain.optim import LRSchedule
    from dptrain.run.metrics import Throughput, dumps
    from dptrain.run.step import CAPTURE_WARMUP

    rank, size, local_rank, device, autocast = start(torch, args)
    graph = args.torch_mode == "graph"
    torch.manual_seed(args.seed)
    train_set = get_dataset(args.dataset, "train", args.train_images, args.seed, args.cache_dir)
    val_set = get_dataset(args.dataset, "val", args.val_images, args.seed, args.cache_dir)
    images, labels = to_device(torch, train_set, device)
    val_images, val_labels = to_device(torch, val_set, device)
    mean, std = train_set.mean, train_set.std

    model = build_twin(torch, args.model, train_set.image_shape, train_set.num_classes,
                       args.seed).to(device)
    model, net, side = build_net(torch, model, args, size, local_rank, autocast)
    opt = make_optimizer(torch, model.parameters(), args, device, graph)
    scaler = (torch.amp.GradScaler("cuda", init_scale=args.loss_scale,
                                   growth_interval=args.loss_scale_interval)
              if autocast is torch.float16 else None)
    sampler = StrideSampler(len(train_set.labels), args.batch_size, size, rank, seed=args.seed)
    steps_per_epoch = len(sampler)
    total = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    schedule = LRSchedule(args.lr, args.lr_schedule, total, args.warmup_steps)
    global_batch = args.batch_size * size
    root = rank == 0
    if root:
        print(f"torch_ddp: {args.model} on {args.dataset} ({len(train_set.labels)} train / "
              f"{len(val_set.labels)} val images), {device.type} x {size}, {args.torch_mode}, "
              f"batch {args.batch_size} per rank ({global_batch} global), {total} steps, "
              f"torch {torch.__version__}", flush=True)

    # The step's inputs and outputs stay at fixed addresses: a graph replays on them.
    idx = torch.zeros(args.batch_size, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), device=device)

    def step():
        loss_sum.add_(forward_backward(torch, net, opt, images, labels, idx, mean, std,
                                       autocast, scaler))

    run = graphed(torch, step, GRAPH_WARMUP, side) if graph else step
    warmup = GRAPH_WARMUP + 1 if graph else CAPTURE_WARMUP + 1  # steps off the clock
    excluded = min(warmup, max(total - 1, 0))  # at least one step stays timed
    meter = Throughput(global_batch, warmup_steps=excluded)
    step_no, since_log, last_loss, last_eval, last_print = 0, 0, float("nan"), {}, 0.0
    for epoch in range(args.epochs):
        # Per-epoch upload of this rank's batch indices (dptrain uploads each step's).
        batches = torch.from_numpy(sampler.epoch_batches(epoch)).to(device)
        for local in range(min(steps_per_epoch, total - step_no)):
            set_lr(torch, opt, schedule(step_no))
            idx.copy_(batches[local])
            run()
            step_no, since_log = step_no + 1, since_log + 1
            if step_no == excluded:  # warm-up done: the clock starts once it has run
                _sync(torch, device)
            meter.step()
            if step_no % args.log_every == 0 or step_no == total:
                last_loss = read_loss(torch, loss_sum, size, since_log)
                rate, since_log = meter.window(), 0
                now = time.perf_counter()
                if root and args.progress and (now - last_print > 5 or step_no == total):
                    last_print = now
                    print(f"step {step_no}/{total} loss {last_loss:.4f} {rate or 0:.0f} images/s",
                          flush=True)
            if step_no % steps_per_epoch == 0 or step_no == total:
                _sync(torch, device)
                meter.pause()  # validation is not training time
                if size > 1:
                    broadcast_buffers(dist, model)
                last_eval = evaluate(torch, model, val_images, val_labels, mean, std, rank, size)
                meter.resume()
        if step_no >= total:
            break

    summary = {
        "framework": "torch",
        "torch_mode": args.torch_mode,
        "model": args.model,
        "precision": {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(autocast,
                                                                         args.precision),
        "torch_version": torch.__version__,
        "train_loss": last_loss,
        "val_loss": last_eval.get("val_loss"),
        "val_accuracy": last_eval.get("val_accuracy"),
        "steps": step_no,
        "images": step_no * global_batch,
        "world_size": size,
        "global_batch_size": global_batch,
        "device": args.device,
        "wall_s": meter.wall(),
        "train_s": meter.total_s,
        "images_per_s": meter.rate,
        "images_per_s_per_rank": meter.rate / size,
        "warmup_steps_excluded": excluded,
        "config": vars(args),
    }
    if root:
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.log_dir) / "summary.json").write_text(dumps(summary, indent=2) + "\n")
        print(f"torch_ddp: done: {step_no} steps, {meter.total_s:.2f} s training "
              f"({meter.rate:.0f} images/s), train_loss {last_loss:.4f}, val_accuracy "
              f"{summary['val_accuracy']:.4f}", flush=True)
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
