"""The training loop: ``train(cfg)`` sets up the world, data, model and exchange, replays the
captured step (dptrain.run.step) and owns epochs, logging, evaluation, checkpoints and the
files a run leaves behind; it never asks which device it runs on. Metrics are read every
``log_every`` steps, never inside the step.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import asdict

import numpy as np

from dptrain import backend
from dptrain import distributed as dist
from dptrain.checkpoints import Checkpointing
from dptrain.checkpoints.weights import load_weights, save_weights, weights_metadata
from dptrain.data import DeviceLoader, StrideSampler, get_dataset
from dptrain.distributed.startup import first_on_host, process_age_s
from dptrain.distributed.stopping import StopRequests, signal_name
from dptrain.distributed.watchdog import Watchdog
from dptrain.engine.rng import manual_seed, set_data_shard
from dptrain.errors import RunStopped, UsageError
from dptrain.nn import build_model, sync_batch_norm
from dptrain.optim import OPTIMIZERS, LRSchedule
from dptrain.run import amp
from dptrain.run.config import DEFAULT_BATCH, TrainConfig, data_options, defaults_for
from dptrain.run.debug import step_hooks
from dptrain.run.evaluate import broadcast_buffers, eval_batch_sizes, evaluate
from dptrain.run.metrics import MetricsLog, Throughput
from dptrain.run.parallel import DataParallel
from dptrain.run.preflight import check_outputs
from dptrain.run.progress import Progress
from dptrain.run.step import CAPTURE_WARMUP, TrainStep


def build_optimizer(cfg: TrainConfig, flat, segments):
    cls = OPTIMIZERS[cfg.optimizer]
    if cls.__name__ == "SGD":
        return cls(flat, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   nesterov=cfg.nesterov, segments=segments)
    return cls(flat, lr=cfg.lr, weight_decay=cfg.weight_decay, segments=segments)


def _load_datasets(cfg: TrainConfig, world):
    """The train and val splits. Under mpirun the first rank of each host builds (and caches)
    them while the others wait, then everyone loads the cache: one generation per host, and
    the cached images are shared read-only memory maps."""
    options = data_options(cfg)

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
        if world.local_rank == 0:  # the step's float32 kernels build while data and model load
            be.runtime.prebuild([np.float32])
        cfg = defaults_for(cfg, device)
        # --save, --log-dir, --checkpoint-dir: writable and nobody else's, before training
        notes = check_outputs(cfg) if world.is_root else []
        if cfg.global_batch_size is not None:
            if cfg.global_batch_size % world.size:
                raise ValueError(f"--global-batch-size {cfg.global_batch_size} does not divide "
                                 f"by the {world.size} ranks")
            cfg.batch_size = cfg.global_batch_size // world.size
        elif cfg.batch_size is None:
            cfg.batch_size = DEFAULT_BATCH
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
        if world.local_rank == 0:  # ... and its 16-bit ones, once the precision is known
            be.runtime.prebuild([np.float32, amp.compute_dtype(cfg.precision)])
        if cfg.batch_size * world.size > len(train_set.labels):
            raise ValueError(f"--batch-size {cfg.batch_size} x {world.size} ranks is larger than "
                             f"the {len(train_set.labels)} training images")
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    if cfg.load:
        load_weights(model, cfg.load)
    return cfg, device, be, world, train_set, val_set, model, notes


def train(cfg: TrainConfig, echo=print) -> dict:
    """Train as `cfg` says; returns the summary (rank 0 also writes LOGDIR/summary.json)."""
    cfg, device, be, world, train_set, val_set, model, notes = _setup(cfg)
    root = world.is_root
    # the kernels of the run's dtypes (built once per host, up front, in parallel), the flat
    # parameters, ZeRO-1 optimizer shards, the bucketed exchange, the 16-bit shadow (mixed
    # precision), the loss scaler (fp16) and the non-finite guard: the library's own
    ddp = DataParallel(model, functools.partial(build_optimizer, cfg), world=world,
                       precision=cfg.precision, sync="broadcast", bucket_mb=cfg.bucket_mb,
                       grad_exchange=cfg.grad_exchange,
                       skip_nonfinite=cfg.skip_nonfinite, loss_scale=cfg.loss_scale,
                       loss_scale_interval=cfg.loss_scale_interval,
                       input_shapes=[(cfg.batch_size, *train_set.image_shape)]
                       + [(n, *val_set.image_shape)
                          for n in eval_batch_sizes(len(val_set.labels), world)])
    flat, opt, reducer, scaler, guard = ddp.flat, ddp.optimizer, ddp.reducer, ddp.scaler, ddp.guard

    sampler = StrideSampler(len(train_set.labels), cfg.batch_size, world.size, world.rank,
                            seed=cfg.seed, drop_last=cfg.drop_last)
    steps_per_epoch = len(sampler)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps)
    cfg.warmup_steps = schedule.warmup_steps
    global_batch = cfg.batch_size * world.size
    for note in notes:
        echo(f"dptrain: note: {note}")

    loader = DeviceLoader(train_set, be, cfg.batch_size, augment=cfg.augment,
                          augment_pad=cfg.augment_pad, augment_seed=cfg.seed,
                          shard=(world.rank, world.size))
    val_loader = DeviceLoader(val_set, be, cfg.batch_size)
    # Exact resume: restores parameters, optimizer shards, step, RNG and augmentation states
    # in place.
    dtype = ddp.dtype
    ckpt = Checkpointing(cfg, world, model, opt, reducer, steps_per_epoch, echo=echo,
                         warn=lambda text: print(text, file=sys.stderr, flush=True),
                         loader=loader, scaler=scaler)
    step_fn = TrainStep(model, opt, reducer, loader, guard, dtype)
    ckpt.window = step_fn  # its metric sums are saved and restored too
    first_step = ckpt.resume()
    run_step = ddp.capture(step_fn) if cfg.cuda_graph else step_fn
    hooks = step_hooks(cfg, world, reducer, flat, scaler)
    # a resumed run drops what its log holds past the checkpoint (steps it runs again)
    log = MetricsLog(cfg.log_dir if root else None, resume_step=first_step)
    log.config(asdict(cfg))
    if root:
        echo(f"dptrain: {cfg.model} on {cfg.dataset} ({len(train_set.labels)} train / "
             f"{len(val_set.labels)} val images), {device} x {world.size}, batch "
             f"{cfg.batch_size} per rank ({global_batch} global), {total_steps} steps")
        if not (cfg.log_dir or cfg.save or cfg.checkpoint_dir):
            echo("dptrain: note: no --log-dir, --save or --checkpoint-dir: this run keeps no "
                 "files (`make train` keeps them in runs/latest)")
        if schedule.fit_warning():
            echo(f"dptrain: warning: {schedule.fit_warning()}")

    progress = Progress(total_steps, enabled=cfg.progress and root)
    # images/s leaves out the warm-up and capture steps (at least one step stays timed)
    excluded = min(CAPTURE_WARMUP + 1, max(total_steps - first_step - 1, 0))
    meter = Throughput(global_batch, warmup_steps=excluded)
    startup_s = process_age_s() if excluded == 0 else None  # process start to timed steps
    # a resume lands inside a logging window: its sums were restored from the checkpoint
    since_log = first_step % cfg.log_every
    step, ran, last_loss, last_eval = first_step, 0, float("nan"), {}
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
                             exit_code=128 + stopped, agreed=True)
        guard.read(step)
        if scaler is not None:
            scaler.read(step)
        stops.close()
    except RunStopped as exc:
        if exc.agreed:  # every rank issued the pending stop all-reduce: finish it
            stops.close()
        raise
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
        save_weights(model, cfg.save, weights_metadata(
            cfg.model, train_set, cfg.dataset, data={**data_options(cfg), "seed": cfg.seed}))
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
        "prepare_s": ddp.prepare_s,
        "prepare_modules": ddp.prepare_report.get("built"),  # kernel modules built or loaded
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
            from dptrain.run.torch_twin import train_twin

            train_twin(cfg, device, global_batch, echo)
        echo(f"dptrain: {where_files_went(cfg)}")
    return summary


def where_files_went(cfg) -> str:
    """The run's last line: where its log and weights are, or that it kept none."""
    kept = []
    if cfg.log_dir:
        kept.append(f"log in {cfg.log_dir}" + (" (and its torch/)" if cfg.torch else ""))
    if cfg.save:
        kept.append(f"weights in {cfg.save}")
    if cfg.checkpoint_dir:
        kept.append(f"checkpoints in {cfg.checkpoint_dir}")
    if not kept:
        return "kept no files (no --log-dir, --save or --checkpoint-dir given)"
    return "files: " + ", ".join(kept)
