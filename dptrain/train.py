"""The training loop: data on the device, a capture-friendly step, metrics read every N steps.

``TrainStep`` is everything one step runs on the device: gather the batch,
forward, backward, optimizer update, metric accumulation. It reads no device
value on the host, so it can later be captured as a CUDA graph. ``train()``
around it owns epochs, logging, evaluation and the files a run leaves behind.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import dptrain.functional as F
from dptrain import backend
from dptrain.autograd import Tensor, no_grad
from dptrain.checkpoint import load_weights, save_weights
from dptrain.data import StrideSampler, get_dataset
from dptrain.errors import UsageError
from dptrain.nn import build_model
from dptrain.optim import OPTIMIZERS, LRSchedule
from dptrain.progress import Progress
from dptrain.random import manual_seed


@dataclass
class TrainConfig:
    model: str = "cnn"
    dataset: str = "synthetic"
    train_images: int | None = None  # None: the device's default (see defaults_for)
    val_images: int | None = None
    epochs: int | None = None
    max_steps: int | None = None
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    optimizer: str = "sgd"
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"
    log_dir: str | None = None
    save: str | None = None
    load: str | None = None
    eval_every: int = 0  # steps; 0 = at the end of every epoch
    log_every: int = 20
    cache_dir: str | None = None
    progress: bool = True


# A CPU run uses a subset so `make train` finishes in minutes; a GPU run the full default set.
DEVICE_DEFAULTS = {
    "cpu": dict(train_images=12000, val_images=2000, epochs=3),
    "cuda": dict(train_images=60000, val_images=10000, epochs=5),
}


def defaults_for(cfg: TrainConfig, device: str) -> TrainConfig:
    for key, value in DEVICE_DEFAULTS[device].items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    return cfg


class TrainStep:
    """One optimisation step on device-resident data, with metrics summed on the device."""

    def __init__(self, model, optimizer, images, labels, mean, std):
        self.model, self.opt = model, optimizer
        self.be = optimizer.be
        self.images, self.labels = images, labels
        self.mean, self.std = mean, std
        self.loss_sum = self.be.zeros((), optimizer.flat.dtype)
        self.correct_sum = self.be.zeros((), np.float32)

    def __call__(self, batch_indices):
        be = self.be
        x = be.gather_normalize(self.images, batch_indices, self.mean, self.std)
        y = be.getitem(self.labels, batch_indices)
        self.opt.zero_grad()
        logits = self.model(Tensor(x))
        loss = F.cross_entropy(logits, Tensor(y))
        loss.backward()
        self.opt.update()
        be.add_(self.loss_sum, loss.data)
        be.add_(self.correct_sum, be.count_correct(logits.data, y))

    def read_metrics(self) -> tuple[float, float]:
        """(sum of losses, number correct) since the last read; synchronises with the device."""
        loss, correct = float(self.be.to_numpy(self.loss_sum)), float(
            self.be.to_numpy(self.correct_sum))
        self.be.fill_(self.loss_sum, 0.0)
        self.be.fill_(self.correct_sum, 0.0)
        return loss, correct


def evaluate(model, images, labels, mean, std, batch_size=1000) -> dict:
    """Mean loss and accuracy over a device-resident set; one host read at the end."""
    be = backend.get(backend.device_of(images))
    model.eval()
    n = labels.shape[0]
    loss_sum = be.zeros((), np.float32)
    correct = be.zeros((), np.float32)
    with no_grad():
        for start in range(0, n, batch_size):
            idx = be.asarray(np.arange(start, min(n, start + batch_size), dtype=np.int64))
            x = be.gather_normalize(images, idx, mean, std)
            y = be.getitem(labels, idx)
            logits = model(Tensor(x))
            loss = F.cross_entropy(logits, Tensor(y)).data
            be.add_(loss_sum, be.scale(loss, float(idx.shape[0])))
            be.add_(correct, be.count_correct(logits.data, y))
    model.train()
    return {
        "val_loss": float(be.to_numpy(loss_sum)) / n,
        "val_accuracy": float(be.to_numpy(correct)) / n,
    }


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


def build_optimizer(cfg: TrainConfig, params):
    cls = OPTIMIZERS[cfg.optimizer]
    if cls.__name__ == "SGD":
        return cls(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   nesterov=cfg.nesterov)
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def train(cfg: TrainConfig, echo=print) -> dict:
    """Train as `cfg` says; returns the summary (also written to LOGDIR/summary.json)."""
    try:  # configuration problems become one-line usage errors
        device = backend.resolve_device(cfg.device)
        cfg = defaults_for(cfg, device)
        be = backend.get(device)
        if device == "cuda" and cfg.precision != "auto":
            be.set_precision(cfg.precision)
        manual_seed(cfg.seed)
        train_set = get_dataset(cfg.dataset, "train", cfg.train_images, cfg.seed, cfg.cache_dir)
        val_set = get_dataset(cfg.dataset, "val", cfg.val_images, cfg.seed, cfg.cache_dir)
        model = build_model(cfg.model, train_set.image_shape, train_set.num_classes).to(device)
        if cfg.batch_size > len(train_set.labels):
            raise ValueError(f"--batch-size {cfg.batch_size} is larger than the "
                             f"{len(train_set.labels)} training images")
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    if cfg.load:
        load_weights(model, cfg.load)
    opt = build_optimizer(cfg, model.parameters())

    sampler = StrideSampler(len(train_set.labels), cfg.batch_size, seed=cfg.seed)
    steps_per_epoch = len(sampler)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps)

    images, labels = be.asarray(train_set.images), be.asarray(train_set.labels)
    val_images, val_labels = be.asarray(val_set.images), be.asarray(val_set.labels)
    stats = (train_set.mean, train_set.std)
    step_fn = TrainStep(model, opt, images, labels, *stats)
    log = MetricsLog(cfg.log_dir)
    echo(f"dptrain: {cfg.model} on {cfg.dataset} ({len(train_set.labels)} train / "
         f"{len(val_set.labels)} val images), {device}, batch {cfg.batch_size}, "
         f"{total_steps} steps over {cfg.epochs} epochs")

    progress = Progress(total_steps, enabled=cfg.progress)
    start = window_start = time.perf_counter()
    window_steps, step, last_loss, last_eval = 0, 0, float("nan"), {}
    eval_every = cfg.eval_every or steps_per_epoch
    try:
        for epoch in range(cfg.epochs):
            batches = sampler.epoch_batches(epoch)
            for local in range(steps_per_epoch):
                if step >= total_steps:
                    break
                opt.lr = schedule(step)
                opt.begin_step()
                step_fn(be.asarray(batches[local]))
                step += 1
                window_steps += 1
                if step % cfg.log_every == 0 or step == total_steps:
                    loss_sum, _ = step_fn.read_metrics()
                    now = time.perf_counter()
                    rate = window_steps * cfg.batch_size / (now - window_start)
                    last_loss = loss_sum / window_steps
                    log.write({"step": step, "epoch": epoch, "loss": last_loss,
                               "lr": opt.lr, "images_per_s": rate})
                    progress.update(step, loss=last_loss, images_per_s=rate)
                    window_start, window_steps = now, 0
                if step % eval_every == 0 or step == total_steps:
                    last_eval = evaluate(model, val_images, val_labels, *stats)
                    log.write({"step": step, "epoch": epoch, **last_eval})
                    progress.note(f"step {step}: val_loss {last_eval['val_loss']:.4f} "
                                  f"val_accuracy {last_eval['val_accuracy']:.4f}")
                    window_start = time.perf_counter()  # evaluation is not training time
            if step >= total_steps:
                break
    finally:
        progress.close()
        log.close()
    wall = time.perf_counter() - start
    if cfg.save:
        save_weights(model, cfg.save)
    summary = {
        "train_loss": last_loss,
        "val_loss": last_eval.get("val_loss"),
        "val_accuracy": last_eval.get("val_accuracy"),
        "steps": step,
        "images": step * cfg.batch_size,
        "world_size": 1,
        "device": device,
        "wall_s": wall,
        "images_per_s": step * cfg.batch_size / wall if wall > 0 else 0.0,
        "config": asdict(cfg),
    }
    log.summary(summary)
    echo(f"dptrain: done: {step} steps in {wall:.1f} s ({summary['images_per_s']:.0f} images/s), "
         f"train_loss {last_loss:.4f}, val_accuracy {summary['val_accuracy']:.4f}")
    return summary

