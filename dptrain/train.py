"""The training loop: a capture-friendly step, metrics read every N steps.

``TrainStep`` is everything one step runs on the device: all-gather the parameters, take
the batch from the device loader, forward, backward with the gradient exchange, optimizer
update (in mixed precision ending with the cast of the updated shard to 16 bits), metric
sums. It reads no device value on the host, so the backend's runtime can capture it once
and replay it. ``train()`` around it owns epochs, logging, evaluation and
the files a run leaves behind; it never asks which device it runs on.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

import dptrain.functional as F
from dptrain import amp, backend, dist
from dptrain.autograd import Tensor, no_grad
from dptrain.checkpoint import load_weights, save_weights, weights_metadata
from dptrain.checkpoints import Checkpointing
from dptrain.data import DeviceLoader, StrideSampler, fixed_size, get_dataset
from dptrain.debug import step_hooks
from dptrain.errors import RunStopped, UsageError
from dptrain.flat import FlatParameters
from dptrain.metrics import MetricsLog, Throughput, fresh_log_dir
from dptrain.nn import build_model, sync_batch_norm
from dptrain.nonfinite import NonFiniteGuard
from dptrain.optim import OPTIMIZERS, LRSchedule
from dptrain.preflight import check_outputs
from dptrain.progress import Progress
from dptrain.random import manual_seed, set_data_shard
from dptrain.reducer import Reducer
from dptrain.startup import first_on_host, process_age_s
from dptrain.stopping import StopRequests, signal_name
from dptrain.watchdog import DEFAULT_TIMEOUT, Watchdog


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
    warmup_steps: int | None = None  # None: a fraction of the run, capped (LRSchedule)
    seed: int = 0
    device: str = "auto"
    # tf32, fp32 (matrix arithmetic); bf16, fp16 (mixed precision); auto: amp.resolve decides
    precision: str = "auto"
    loss_scale: float = amp.INIT_SCALE  # fp16: the initial loss scale
    loss_scale_interval: int = amp.INTERVAL  # fp16: good steps before the scale doubles
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
    data_dir: str | None = None  # datasets read from files: where they are
    channels: int | None = None  # 1 or 3; None: the dataset's own
    image_size: int | None = None  # resize images to this square size
    val_fraction: float = 0.1  # held out when a dataset has no test split of its own
    on_bad_image: str = "error"  # or "skip"
    augment: bool = False  # random crop (zero padding augment_pad) and flip, on the device
    augment_pad: int = 4
    checkpoint_dir: str | None = None  # exact-resume checkpoints (dptrain.checkpoints)
    checkpoint_every: int = 0  # steps; 0 = only when stopped by a signal
    keep_checkpoints: int = 3
    resume: str | None = None  # "auto" (newest usable in checkpoint_dir) or a checkpoint
    skip_nonfinite: int = 0  # bad steps to skip before stopping; 0 = stop at the first
    collective_timeout: float = DEFAULT_TIMEOUT  # seconds; 0 = no watchdog
    overwrite: bool = False  # write into a log_dir that holds files already
    torch: bool = False  # then train the PyTorch twin into LOG_DIR/torch (dptrain.torch_twin)


# capture() runs this many eager steps before it records the graph; the throughput meter
# leaves out those and the capturing step (CAPTURE_WARMUP + 1 steps): see warmup_steps_excluded.
CAPTURE_WARMUP = 2

# A CPU run uses a subset so `make train` finishes in minutes; a GPU run the full default set.
DEVICE_DEFAULTS = {
    "cpu": dict(train_images=8000, val_images=2000, epochs=3),
    "cuda": dict(train_images=60000, val_images=10000, epochs=5),
}


def defaults_for(cfg: TrainConfig, device: str) -> TrainConfig:
    for key, value in DEVICE_DEFAULTS[device].items():
        if key.endswith("_images") and fixed_size(cfg.dataset):
            continue  # a dataset read from files: all of it unless asked otherwise
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    return cfg


class TrainStep:
    """One optimisation step on the loader's current batch, metrics summed on the device."""

    def __init__(self, model, optimizer, reducer, loader, guard=None, dtype=np.float32):
        self.model, self.opt, self.reducer, self.loader = model, optimizer, reducer, loader
        self.guard = guard  # the non-finite check: decides on the device if the update applies
        self.dtype = np.dtype(dtype)  # of the activations (float16: mixed precision, dptrain.amp)
        self.scaler = guard.scaler if guard is not None else None
        self.be = optimizer.be
        self.loss_sum = self.be.zeros((), optimizer.flat.dtype)
        self.correct_sum = self.be.zeros((), np.float32)

    def __call__(self):
        be = self.be
        self.reducer.gather_parameters()  # last step's updated shards; overlaps the forward
        x, y = self.loader.batch()
        self.opt.zero_grad()
        logits = F.cast(self.model(F.cast(Tensor(x), self.dtype)), np.float32)
        loss = F.cross_entropy(logits, Tensor(y))
        # buckets start their reduce-scatter as their gradients complete
        loss.backward(self.scaler.seed() if self.scaler is not None else None)
        self.reducer.finish_backward()
        if self.guard is not None:
            self.guard(loss.data)
        self.opt.update()  # this rank's shard only; gathered at the start of the next step
        be.add_(self.loss_sum, loss.data)
        be.add_(self.correct_sum, be.count_correct(logits.data, y))

    def read_metrics(self, comm) -> tuple[float, float]:
        """(sum of losses averaged over ranks, correct predictions summed over ranks) since
        the last read. Every rank calls this at the same step (collectives); it synchronises."""
        comm.all_reduce(self.loss_sum.reshape(1), "mean")
        comm.all_reduce(self.correct_sum.reshape(1), "sum")
        loss, correct = float(self.be.to_numpy(self.loss_sum)), float(
            self.be.to_numpy(self.correct_sum))
        self.be.fill_(self.loss_sum, 0.0)
        self.be.fill_(self.correct_sum, 0.0)
        return loss, correct


def evaluate(model, loader, world=None, batch_size=1000, dtype=np.float32) -> dict:
    """Mean loss and accuracy over a loader's whole set, the model fed `dtype` activations.
    Each rank takes every N-th image and the sums are all-reduced; one host read at the end."""
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
            logits = F.cast(model(F.cast(Tensor(x), dtype)), np.float32)
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
    options = dict(data_dir=cfg.data_dir, channels=cfg.channels, image_size=cfg.image_size,
                   val_fraction=cfg.val_fraction, on_bad_image=cfg.on_bad_image)

    def load():
        return (get_dataset(cfg.dataset, "train", cfg.train_images, cfg.seed, cfg.cache_dir,
                            **options),
                get_dataset(cfg.dataset, "val", cfg.val_images, cfg.seed, cfg.cache_dir,
                            **options))

    return first_on_host(world, load)


def _setup(cfg: TrainConfig):
    """Device, world, data and model; configuration problems become one-line usage errors."""
    try:
        device = backend.resolve_device(cfg.device)
        be = backend.get(device)
        world = dist.init(be)  # selects this rank's device before anything is allocated
        cfg = defaults_for(cfg, device)
        if world.is_root:
            check_outputs(cfg)  # --save, --log-dir, --checkpoint-dir: writable, before training
        if cfg.global_batch_size is not None:
            if cfg.global_batch_size % world.size:
                raise ValueError(f"--global-batch-size {cfg.global_batch_size} does not divide "
                                 f"by the {world.size} ranks")
            cfg.batch_size = cfg.global_batch_size // world.size
        be.runtime.set_precision("auto" if cfg.precision in amp.COMPUTE_DTYPES else cfg.precision)
        manual_seed(cfg.seed)
        set_data_shard(world.rank, world.size)  # dropout draws the global batch's masks
        train_set, val_set = _load_datasets(cfg, world)
        model = build_model(cfg.model, train_set.image_shape, train_set.num_classes,
                            hidden=cfg.hidden).to(device)
        if cfg.sync_bn:
            sync_batch_norm(model, world.comm)
        cfg.precision = amp.resolve(cfg.precision, be.runtime, model)
        amp.check_runtime(cfg.precision, be.runtime)
        amp.check_model(model, cfg.precision)
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
    started = time.perf_counter()
    first_on_host(world, be.runtime.prepare)  # every kernel, built once per host, up front
    prepare_s = time.perf_counter() - started
    # 16-bit precisions: the layers read a 16-bit shadow of the parameters, all-gathered in
    # place of the fp32 shards (dptrain.flat, dptrain.reducer)
    flat = FlatParameters(model.parameters(), world.size, int(cfg.bucket_mb * 2**20),
                          shadow_dtype=amp.shadow_dtype(cfg.precision))
    opt = build_optimizer(cfg, flat, flat.shard_segments(world.rank))
    reducer = Reducer(flat, world, model)
    reducer.broadcast_parameters()  # also casts the whole shadow
    broadcast_buffers(model, world.comm)

    sampler = StrideSampler(len(train_set.labels), cfg.batch_size, world.size, world.rank,
                            seed=cfg.seed, drop_last=cfg.drop_last)
    steps_per_epoch = len(sampler)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps)
    cfg.warmup_steps = schedule.warmup_steps
    global_batch = cfg.batch_size * world.size
    if root and cfg.log_dir:
        # a resumed run continues in its own log directory
        cfg.log_dir, moved = fresh_log_dir(cfg.log_dir, cfg.overwrite or bool(cfg.resume))
        if moved:
            echo(f"dptrain: note: {moved}")

    loader = DeviceLoader(train_set, be, cfg.batch_size, augment=cfg.augment,
                          augment_pad=cfg.augment_pad, augment_seed=cfg.seed,
                          shard=(world.rank, world.size))
    val_loader = DeviceLoader(val_set, be, cfg.batch_size)
    # Exact resume: restores parameters, optimizer shards, step, RNG and augmentation states
    # in place.
    dtype = amp.compute_dtype(cfg.precision)
    scaler = (amp.LossScaler(be, cfg.loss_scale, cfg.loss_scale_interval)
              if cfg.precision in amp.LOSS_SCALED else None)
    ckpt = Checkpointing(cfg, world, model, opt, reducer, steps_per_epoch, echo=echo,
                         warn=lambda text: print(text, file=sys.stderr, flush=True),
                         loader=loader, scaler=scaler)
    first_step = ckpt.resume()
    guard = NonFiniteGuard(opt, world.comm, cfg.skip_nonfinite, scaler)
    step_fn = TrainStep(model, opt, reducer, loader, guard, dtype)
    run_step = be.runtime.capture(step_fn, warmup=CAPTURE_WARMUP) if cfg.cuda_graph else step_fn
    hooks = step_hooks(cfg, world, reducer, flat, scaler)
    log = MetricsLog(cfg.log_dir if root else None, append=first_step > 0)
    log.config(asdict(cfg))
    if root:
        echo(f"dptrain: {cfg.model} on {cfg.dataset} ({len(train_set.labels)} train / "
             f"{len(val_set.labels)} val images), {device} x {world.size}, batch "
             f"{cfg.batch_size} per rank ({global_batch} global), {total_steps} steps")
        if schedule.fit_warning():
            echo(f"dptrain: warning: {schedule.fit_warning()}")

    progress = Progress(total_steps, enabled=cfg.progress and root)
    # images/s leaves out the warm-up and capture steps (at least one step stays timed)
    excluded = min(CAPTURE_WARMUP + 1, max(total_steps - first_step - 1, 0))
    meter = Throughput(global_batch, warmup_steps=excluded)
    startup_s = process_age_s() if excluded == 0 else None  # process start to timed steps
    step, ran, since_log, last_loss, last_eval = first_step, 0, 0, float("nan"), {}
    comm_exposed = 0.0  # seconds of communication that compute waited for
    eval_every = cfg.eval_every or steps_per_epoch
    watchdog = Watchdog(world, cfg.collective_timeout).start()
    watch = watchdog.watch
    stops = StopRequests(world).install()
    stopped = 0
    try:
        for epoch in range(first_step // steps_per_epoch, cfg.epochs):
            batches = sampler.epoch_batches(epoch)
            first = step - epoch * steps_per_epoch  # > 0 only in the epoch a resume lands in
            for local in range(first, min(steps_per_epoch, first + total_steps - step)):
                opt.lr = schedule(step)
                opt.begin_step()
                loader.set_batch(batches[local])
                with watch("training step", step + 1):
                    run_step()
                    stopped = stops.poll()
                step, ran, since_log = step + 1, ran + 1, since_log + 1
                if ran == excluded:  # warm-up and capture done; the timed steps start here
                    be.runtime.synchronize()
                    startup_s = process_age_s()
                meter.step()
                progress.advance(step)
                for hook in hooks:
                    hook(step)
                if step % cfg.log_every == 0 or step == total_steps:
                    timed_steps = meter.window_steps
                    with watch("metrics all-reduce", step):
                        loss_sum, correct = step_fn.read_metrics(world.comm)
                    skipped = guard.read(step)  # stops the run on a non-finite step
                    exposed = reducer.read_exposed_comm()
                    comm_exposed = None if exposed is None or comm_exposed is None else (
                        comm_exposed + exposed * timed_steps)
                    rate = meter.window()
                    last_loss = loss_sum / since_log
                    accuracy = correct / (since_log * global_batch)
                    since_log = 0
                    record = {"step": step, "epoch": epoch, "loss": last_loss,
                              "accuracy": accuracy, "lr": opt.lr, "images_per_s": rate}
                    if scaler is not None:  # fp16: the scale now, overflowed (skipped) steps
                        record["loss_scale"], record["overflow_steps"] = scaler.read(step)
                    log.write({**record, "skipped_steps": skipped} if skipped else record)
                    progress.update(step, loss=last_loss, acc=accuracy, images_per_s=rate)
                if step % eval_every == 0 or step == total_steps:
                    meter.pause()  # evaluation is not training time
                    with watch("evaluation", step):
                        reducer.sync_parameters()
                        broadcast_buffers(model, world.comm)  # evaluate with rank 0's estimates
                        last_eval = evaluate(model, val_loader, world=world, dtype=dtype)
                    log.write({"step": step, "epoch": epoch, **last_eval})
                    progress.note(f"step {step}: val_loss {last_eval['val_loss']:.4f} "
                                  f"val_accuracy {last_eval['val_accuracy']:.4f}")
                    meter.resume()
                if ckpt.due(step) or (stopped and ckpt.enabled):
                    guard.read(step)  # never checkpoint past a non-finite step
                    with watch("checkpoint gather", step):
                        path = ckpt.save(step)
                    if path is not None and stopped:
                        progress.note(f"step {step}: checkpoint {path}")
                if stopped:
                    break
            if step >= total_steps or stopped:
                break
        if stopped:
            where = f"; checkpoint in {cfg.checkpoint_dir}" if ckpt.enabled else ""
            raise RunStopped(f"stopped by {signal_name(stopped)} after step {step}{where}",
                             exit_code=128 + stopped)
        guard.read(step)
        if scaler is not None:
            scaler.read(step)
        stops.close()
    finally:
        stops.close(complete=False)
        watchdog.stop()
        progress.close()
        log.close()
    reducer.sync_parameters()
    broadcast_buffers(model, world.comm)
    if startup_s is None:  # no step ran
        startup_s = process_age_s()
    wall = meter.wall()
    if cfg.save and root:
        save_weights(model, cfg.save, weights_metadata(cfg.model, train_set, cfg.dataset))
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
        "warmup_steps_excluded": excluded,
        "startup_s": startup_s,
        "prepare_s": prepare_s,
        "images_per_s_per_rank": train_rate / world.size,
        "overflow_steps": scaler.overflows if scaler is not None else None,  # fp16 skips
        "comm_exposed_s": comm_exposed,  # None: not measurable under graph replay
        "comm_exposed_fraction": (comm_exposed / train_time if comm_exposed is not None
                                  and train_time > 0 else None),
        "config": asdict(cfg),
    }
    if root:
        log.summary(summary)
        accuracy = summary["val_accuracy"]
        echo(f"dptrain: done: {step} steps in {wall:.1f} s ({train_rate:.0f} images/s training, "
             f"after {startup_s:.1f} s of start-up), train_loss {last_loss:.4f}, val_accuracy "
             f"{'n/a' if accuracy is None else format(accuracy, '.4f')}")
        if cfg.torch:
            from dptrain.torch_twin import train_twin

            train_twin(cfg, device, global_batch, echo)
    return summary
