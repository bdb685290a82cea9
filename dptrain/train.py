"""The training loop: a capture-friendly step, metrics read every N steps.

``TrainStep`` is everything one step runs on the device: all-gather the parameters, take
the batch from the device loader, forward, backward with the gradient exchange, optimizer
update, metric sums. It reads no device value on the host, so the backend's runtime can
capture it once and replay it. ``train()`` around it owns epochs, logging, evaluation and
the files a run leaves behind; it never asks which device it runs on.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

import dptrain.functional as F
from dptrain import backend, dist
from dptrain.autograd import Tensor, no_grad
from dptrain.checkpoint import load_weights, save_weights
from dptrain.data import DeviceLoader, StrideSampler, get_dataset
from dptrain.debug import step_hooks
from dptrain.errors import UsageError
from dptrain.flat import FlatParameters
from dptrain.metrics import MetricsLog, Throughput
from dptrain.nn import build_model, sync_batch_norm
from dptrain.optim import OPTIMIZERS, LRSchedule
from dptrain.progress import Progress
from dptrain.random import manual_seed
from dptrain.reducer import Reducer


@dataclass
class TrainConfig:
    model: str = "cnn"
    hidden: tuple | None = None  # --model mlp: hidden layer widths (None: the model's default)
    dataset: str = "synthetic"
    train_images: int | None = None  # None: the device's default (see defaults_for)
    val_images: int | None = None
    epochs: int | None = None
    max_steps: int | None = None
    batch_size: int = 64  # per process
    global_batch_size: int | None = None  # alternative to batch_size: split over the ranks
    drop_last: bool = True
    bucket_mb: float = 4.0
    lr: float = 2e-3
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    optimizer: str = "adamw"
    lr_schedule: str = "cosine"
    warmup_steps: int = 60  # AdamW at full rate from step 0 can stall at chance level
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"
    log_dir: str | None = None
    save: str | None = None
    load: str | None = None
    eval_every: int = 0  # steps; 0 = at the end of every epoch
    log_every: int = 20
    cuda_graph: bool = True  # GPU: capture the step once, replay it every step
    sync_bn: bool = False  # batch norm statistics all-reduced over the ranks inside the step
    verify_replicas: bool = False  # debug: check every step that all ranks hold equal parameters
    cache_dir: str | None = None
    progress: bool = True


# A CPU run uses a subset so `make train` finishes in minutes; a GPU run the full default set.
DEVICE_DEFAULTS = {
    "cpu": dict(train_images=8000, val_images=2000, epochs=3),
    "cuda": dict(train_images=60000, val_images=10000, epochs=5),
}


def defaults_for(cfg: TrainConfig, device: str) -> TrainConfig:
    for key, value in DEVICE_DEFAULTS[device].items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    return cfg


class TrainStep:
    """One optimisation step on the loader's current batch, metrics summed on the device."""

    def __init__(self, model, optimizer, reducer, loader):
        self.model, self.opt, self.reducer, self.loader = model, optimizer, reducer, loader
        self.be = optimizer.be
        self.loss_sum = self.be.zeros((), optimizer.flat.dtype)
        self.correct_sum = self.be.zeros((), np.float32)

    def __call__(self):
        be = self.be
        self.reducer.gather_parameters()  # last step's updated shards; overlaps the forward
        x, y = self.loader.batch()
        self.opt.zero_grad()
        logits = self.model(Tensor(x))
        loss = F.cross_entropy(logits, Tensor(y))
        loss.backward()  # buckets start their reduce-scatter as their gradients complete
        self.reducer.finish_backward()
        self.opt.update()  # this rank's shard only; gathered at the start of the next step
        be.add_(self.loss_sum, loss.data)
        be.add_(self.correct_sum, be.count_correct(logits.data, y))

    def read_metrics(self, comm) -> tuple[float, float]:
        """(sum of losses averaged over ranks, correct on this rank) since the last read.

        Every rank calls this at the same step (it is a collective); it synchronises."""
        comm.all_reduce(self.loss_sum.reshape(1), "mean")
        loss, correct = float(self.be.to_numpy(self.loss_sum)), float(
            self.be.to_numpy(self.correct_sum))
        self.be.fill_(self.loss_sum, 0.0)
        self.be.fill_(self.correct_sum, 0.0)
        return loss, correct


def evaluate(model, loader, world=None, batch_size=1000) -> dict:
    """Mean loss and accuracy over a loader's whole set. Each rank takes every N-th image
    and the sums are all-reduced; one host read at the end."""
    be = loader.be
    rank, size = (world.rank, world.size) if world else (0, 1)
    comm = world.comm if world else dist.LocalComm(be)
    model.eval()
    n = loader.num_images
    mine = np.arange(rank, n, size, dtype=np.int64)
    sums = be.zeros((2,), np.float32)  # loss * count, correct
    loss_sum, correct = sums[0:1].reshape(()), sums[1:2].reshape(())
    with no_grad():
        for start in range(0, len(mine), batch_size):
            idx = mine[start : start + batch_size]
            x, y = loader.gather(idx)
            logits = model(Tensor(x))
            loss = F.cross_entropy(logits, Tensor(y)).data
            be.add_(loss_sum, be.scale(loss, float(len(idx))))
            be.add_(correct, be.count_correct(logits.data, y))
    model.train()
    comm.all_reduce(sums, "sum")
    total_loss, total_correct = be.to_numpy(sums).tolist()
    return {"val_loss": total_loss / n, "val_accuracy": total_correct / n}


def broadcast_buffers(model, comm, root: int = 0):
    """Give every rank rank `root`'s buffers (batch norm's running estimates): at the start,
    like the parameters, and before evaluating or saving, where per-rank statistics may have
    drifted apart (as PyTorch's DDP does with its buffers)."""
    for buf in model.buffers():
        comm.broadcast(buf.data.reshape(-1), root)


def build_optimizer(cfg: TrainConfig, flat: FlatParameters, segments):
    cls = OPTIMIZERS[cfg.optimizer]
    if cls.__name__ == "SGD":
        return cls(flat, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   nesterov=cfg.nesterov, segments=segments)
    return cls(flat, lr=cfg.lr, weight_decay=cfg.weight_decay, segments=segments)


def _load_datasets(cfg: TrainConfig, world):
    """The train and val splits. Under mpirun the first rank of each host builds (and caches)
    them while the others wait, then everyone loads the cache: one generation per host, and
    the cached images are shared read-only memory maps."""
    def load():
        return (get_dataset(cfg.dataset, "train", cfg.train_images, cfg.seed, cfg.cache_dir),
                get_dataset(cfg.dataset, "val", cfg.val_images, cfg.seed, cfg.cache_dir))

    if world.mpi_comm is None or world.size == 1:
        return load()
    sets = load() if world.local_rank == 0 else None
    world.mpi_comm.Barrier()
    return sets if sets is not None else load()


def _setup(cfg: TrainConfig):
    """Device, world, data and model; configuration problems become one-line usage errors."""
    try:
        device = backend.resolve_device(cfg.device)
        be = backend.get(device)
        world = dist.init(be)  # selects this rank's device before anything is allocated
        cfg = defaults_for(cfg, device)
        if cfg.global_batch_size is not None:
            if cfg.global_batch_size % world.size:
                raise ValueError(f"--global-batch-size {cfg.global_batch_size} does not divide "
                                 f"by the {world.size} ranks")
            cfg.batch_size = cfg.global_batch_size // world.size
        be.runtime.set_precision(cfg.precision)
        manual_seed(cfg.seed)
        train_set, val_set = _load_datasets(cfg, world)
        model = build_model(cfg.model, train_set.image_shape, train_set.num_classes,
                            hidden=cfg.hidden).to(device)
        if cfg.sync_bn:
            sync_batch_norm(model, world.comm)
        if cfg.batch_size * world.size > len(train_set.labels):
            raise ValueError(f"--batch-size {cfg.batch_size} x {world.size} ranks is larger than "
                             f"the {len(train_set.labels)} training images")
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    if cfg.load:
        load_weights(model, cfg.load)
    return cfg, device, be, world, train_set, val_set, model


def train(cfg: TrainConfig, echo=print) -> dict:
    """Train as `cfg` says; returns the summary (rank 0 also writes LOGDIR/summary.json)."""
    cfg, device, be, world, train_set, val_set, model = _setup(cfg)
    root = world.is_root
    flat = FlatParameters(model.parameters(), world.size, int(cfg.bucket_mb * 2**20))
    opt = build_optimizer(cfg, flat, flat.shard_segments(world.rank))
    reducer = Reducer(flat, world, model)
    reducer.broadcast_parameters()
    broadcast_buffers(model, world.comm)

    sampler = StrideSampler(len(train_set.labels), cfg.batch_size, world.size, world.rank,
                            seed=cfg.seed, drop_last=cfg.drop_last)
    steps_per_epoch = len(sampler)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps)
    global_batch = cfg.batch_size * world.size

    loader = DeviceLoader(train_set, be, cfg.batch_size)
    val_loader = DeviceLoader(val_set, be, cfg.batch_size)
    step_fn = TrainStep(model, opt, reducer, loader)
    run_step = be.runtime.capture(step_fn) if cfg.cuda_graph else step_fn
    hooks = step_hooks(cfg, world, reducer, flat)
    log = MetricsLog(cfg.log_dir if root else None)
    if root:
        echo(f"dptrain: {cfg.model} on {cfg.dataset} ({len(train_set.labels)} train / "
             f"{len(val_set.labels)} val images), {device} x {world.size}, batch "
             f"{cfg.batch_size} per rank ({global_batch} global), {total_steps} steps")

    progress = Progress(total_steps, enabled=cfg.progress and root)
    meter = Throughput(global_batch)
    step, last_loss, last_eval = 0, float("nan"), {}
    comm_exposed = 0.0  # seconds of communication that compute waited for
    eval_every = cfg.eval_every or steps_per_epoch
    try:
        for epoch in range(cfg.epochs):
            batches = sampler.epoch_batches(epoch)
            for local in range(min(steps_per_epoch, total_steps - step)):
                opt.lr = schedule(step)
                opt.begin_step()
                loader.set_batch(batches[local])
                run_step()
                step += 1
                meter.step()
                for hook in hooks:
                    hook(step)
                if step % cfg.log_every == 0 or step == total_steps:
                    window_steps = meter.window_steps
                    loss_sum, _ = step_fn.read_metrics(world.comm)
                    exposed = reducer.read_exposed_comm()
                    comm_exposed = None if exposed is None or comm_exposed is None else (
                        comm_exposed + exposed * window_steps)
                    rate = meter.window()
                    last_loss = loss_sum / window_steps
                    log.write({"step": step, "epoch": epoch, "loss": last_loss,
                               "lr": opt.lr, "images_per_s": rate})
                    progress.update(step, loss=last_loss, images_per_s=rate)
                if step % eval_every == 0 or step == total_steps:
                    meter.pause()  # evaluation is not training time
                    reducer.sync_parameters()
                    broadcast_buffers(model, world.comm)  # evaluate with rank 0's estimates
                    last_eval = evaluate(model, val_loader, world=world)
                    log.write({"step": step, "epoch": epoch, **last_eval})
                    progress.note(f"step {step}: val_loss {last_eval['val_loss']:.4f} "
                                  f"val_accuracy {last_eval['val_accuracy']:.4f}")
                    meter.resume()
            if step >= total_steps:
                break
    finally:
        progress.close()
        log.close()
    reducer.sync_parameters()
    broadcast_buffers(model, world.comm)
    wall = meter.wall()
    if cfg.save and root:
        save_weights(model, cfg.save)
    train_time, train_rate = meter.total_s, meter.rate
    summary = {
        "train_loss": last_loss,
        "val_loss": last_eval.get("val_loss"),
        "val_accuracy": last_eval.get("val_accuracy"),
        "steps": step,
        "images": step * global_batch,
        "world_size": world.size,
        "global_batch_size": global_batch,
        "device": device,
        "wall_s": wall,
        "train_s": train_time,
        "images_per_s": train_rate,
        "images_per_s_per_rank": train_rate / world.size,
        "comm_exposed_s": comm_exposed,  # None: not measurable under graph replay
        "comm_exposed_fraction": (comm_exposed / train_time if comm_exposed is not None
                                  and train_time > 0 else None),
        "config": asdict(cfg),
    }
    if root:
        log.summary(summary)
        echo(f"dptrain: done: {step} steps in {wall:.1f} s ({train_rate:.0f} images/s training), "
             f"train_loss {last_loss:.4f}, val_accuracy {summary['val_accuracy']:.4f}")
    return summary
