"""The training loop: data on the device, a capture-friendly step, metrics read every N steps.

``TrainStep`` is everything one step runs on the device: gather the batch,
forward, backward, optimizer update, metric accumulation. It reads no device
value on the host, so it can later be captured as a CUDA graph. ``train()``
around it owns epochs, logging, evaluation and the files a run leaves behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import dptrain.functional as F
from dptrain import backend, dist
from dptrain.autograd import Tensor, no_grad
from dptrain.checkpoint import load_weights, save_weights
from dptrain.data import StrideSampler, get_dataset
from dptrain.errors import UsageError
from dptrain.flat import FlatParameters
from dptrain.nn import build_model
from dptrain.optim import OPTIMIZERS, LRSchedule
from dptrain.progress import Progress
from dptrain.random import manual_seed
from dptrain.reducer import Reducer


@dataclass
class TrainConfig:
    model: str = "cnn"
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
    """One optimisation step on device-resident data, with metrics summed on the device."""

    def __init__(self, model, optimizer, reducer, images, labels, mean, std):
        self.model, self.opt, self.reducer = model, optimizer, reducer
        self.be = optimizer.be
        self.images, self.labels = images, labels
        self.mean, self.std = mean, std
        self.loss_sum = self.be.zeros((), optimizer.flat.dtype)
        self.correct_sum = self.be.zeros((), np.float32)

    def __call__(self, batch_indices):
        be = self.be
        batch_indices = be.asarray(batch_indices)  # host indices are uploaded; device ones kept
        self.reducer.gather_parameters()  # last step's updated shards; overlaps the forward
        x = be.gather_normalize(self.images, batch_indices, self.mean, self.std)
        y = be.getitem(self.labels, batch_indices)
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


def evaluate(model, images, labels, mean, std, world=None, batch_size=1000) -> dict:
    """Mean loss and accuracy over a device-resident set. Each rank takes every N-th image
    and the sums are all-reduced; one host read at the end."""
    be = backend.get(backend.device_of(images))
    rank, size = (world.rank, world.size) if world else (0, 1)
    comm = world.comm if world else dist.LocalComm(be)
    model.eval()
    n = labels.shape[0]
    mine = np.arange(rank, n, size, dtype=np.int64)
    sums = be.zeros((2,), np.float32)  # loss * count, correct
    loss_sum, correct = sums[0:1].reshape(()), sums[1:2].reshape(())
    with no_grad():
        for start in range(0, len(mine), batch_size):
            idx = be.asarray(mine[start : start + batch_size])
            x = be.gather_normalize(images, idx, mean, std)
            y = be.getitem(labels, idx)
            logits = model(Tensor(x))
            loss = F.cross_entropy(logits, Tensor(y)).data
            be.add_(loss_sum, be.scale(loss, float(idx.shape[0])))
            be.add_(correct, be.count_correct(logits.data, y))
    model.train()
    comm.all_reduce(sums, "sum")
    total_loss, total_correct = be.to_numpy(sums).tolist()
    return {"val_loss": total_loss / n, "val_accuracy": total_correct / n}


class MetricsLog:
    """metrics.jsonl (one object per line) and summary.json under the log directory."""

    def __init__(self, log_dir: str | None):
        self.dir = Path(log_dir) if log_dir else None
        self.file = None
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.file = open(self.dir / "metrics.jsonl", "w")

    def write(self, record: dict):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def summary(self, record: dict):
        if self.dir:
            (self.dir / "summary.json").write_text(json.dumps(record, indent=2) + "\n")

    def close(self):
        if self.file:
            self.file.close()


def build_optimizer(cfg: TrainConfig, flat: FlatParameters, segments):
    cls = OPTIMIZERS[cfg.optimizer]
    if cls.__name__ == "SGD":
        return cls(flat, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   nesterov=cfg.nesterov, segments=segments)
    return cls(flat, lr=cfg.lr, weight_decay=cfg.weight_decay, segments=segments)


def verify_replicas(flat, world, step):
    """Raise unless every rank holds bit-identical parameters (a host sync; for testing)."""
    if world.size == 1:
        return
    digest = hashlib.sha256(flat.be.to_numpy(flat.data).tobytes()).hexdigest()
    digests = world.mpi_comm.allgather(digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"step {step}: parameters differ across ranks: {digests}")


def _maybe_fail(rank, step):
    """Test hook: DPTRAIN_FAULT=RANK:STEP makes that rank raise after that step."""
    fault = os.environ.get("DPTRAIN_FAULT")
    if fault and fault == f"{rank}:{step}":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} (DPTRAIN_FAULT)")


def _graph_safe(model, echo=None) -> bool:
    """Whether the step may be replayed as a graph. Dropout's random offset advances on the
    host, so a replay would reuse one mask every step: such models run eagerly."""
    from dptrain.nn import Dropout

    if any(isinstance(m, Dropout) and m.p > 0 for m in model.modules()):
        if echo:
            echo("dptrain: the model uses dropout; running the step eagerly, not as a CUDA graph")
        return False
    return True


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
        world = dist.init(device, be)  # selects this rank's GPU before anything is allocated
        cfg = defaults_for(cfg, device)
        if cfg.global_batch_size is not None:
            if cfg.global_batch_size % world.size:
                raise ValueError(f"--global-batch-size {cfg.global_batch_size} does not divide "
                                 f"by the {world.size} ranks")
            cfg.batch_size = cfg.global_batch_size // world.size
        if device == "cuda" and cfg.precision != "auto":
            be.set_precision(cfg.precision)
        manual_seed(cfg.seed)
        train_set, val_set = _load_datasets(cfg, world)
        model = build_model(cfg.model, train_set.image_shape, train_set.num_classes).to(device)
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

    sampler = StrideSampler(len(train_set.labels), cfg.batch_size, world.size, world.rank,
                            seed=cfg.seed, drop_last=cfg.drop_last)
    steps_per_epoch = len(sampler)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps)
    global_batch = cfg.batch_size * world.size

    images, labels = be.asarray(train_set.images), be.asarray(train_set.labels)
    val_images, val_labels = be.asarray(val_set.images), be.asarray(val_set.labels)
    stats = (train_set.mean, train_set.std)
    step_fn = TrainStep(model, opt, reducer, images, labels, *stats)
    run_step = step_fn
    if device == "cuda" and cfg.cuda_graph and _graph_safe(model, echo if root else None):
        from dptrain.graph import GraphedStep

        run_step = GraphedStep(step_fn, cfg.batch_size)
    log = MetricsLog(cfg.log_dir if root else None)
    if root:
        echo(f"dptrain: {cfg.model} on {cfg.dataset} ({len(train_set.labels)} train / "
             f"{len(val_set.labels)} val images), {device} x {world.size}, batch "
             f"{cfg.batch_size} per rank ({global_batch} global), {total_steps} steps")

    progress = Progress(total_steps, enabled=cfg.progress and root)
    start = window_start = time.perf_counter()
    train_time, window_steps, step, last_loss, last_eval = 0.0, 0, 0, float("nan"), {}
    window_time = 0.0  # training seconds in the current logging window (evaluations excluded)
    comm_exposed = 0.0  # seconds of communication that compute waited for
    eval_every = cfg.eval_every or steps_per_epoch
    try:
        for epoch in range(cfg.epochs):
            batches = sampler.epoch_batches(epoch)
            for local in range(steps_per_epoch):
                if step >= total_steps:
                    break
                opt.lr = schedule(step)
                opt.begin_step()
                run_step(batches[local])
                step += 1
                _maybe_fail(world.rank, step)
                if cfg.verify_replicas:
                    reducer.sync_parameters()
                    verify_replicas(flat, world, step)
                window_steps += 1
                if step % cfg.log_every == 0 or step == total_steps:
                    loss_sum, _ = step_fn.read_metrics(world.comm)
                    exposed = reducer.read_exposed_comm()
                    comm_exposed = None if exposed is None or comm_exposed is None else (
                        comm_exposed + exposed * window_steps)
                    now = time.perf_counter()
                    window_time += now - window_start
                    train_time += window_time
                    rate = window_steps * global_batch / window_time
                    last_loss = loss_sum / window_steps
                    log.write({"step": step, "epoch": epoch, "loss": last_loss,
                               "lr": opt.lr, "images_per_s": rate})
                    progress.update(step, loss=last_loss, images_per_s=rate)
                    window_start, window_steps, window_time = now, 0, 0.0
                if step % eval_every == 0 or step == total_steps:
                    window_time += time.perf_counter() - window_start
                    reducer.sync_parameters()
                    last_eval = evaluate(model, val_images, val_labels, *stats, world=world)
                    log.write({"step": step, "epoch": epoch, **last_eval})
                    progress.note(f"step {step}: val_loss {last_eval['val_loss']:.4f} "
                                  f"val_accuracy {last_eval['val_accuracy']:.4f}")
                    window_start = time.perf_counter()  # evaluation is not training time
            if step >= total_steps:
                break
    finally:
        progress.close()
        log.close()
    reducer.sync_parameters()
    wall = time.perf_counter() - start
    if cfg.save and root:
        save_weights(model, cfg.save)
    train_rate = step * global_batch / train_time if train_time > 0 else 0.0
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
