"""The training loop: ``train(cfg)`` sets up the world, data, model and exchange, replays the
captured step (dptrain.run.step) and owns epochs, logging, evaluation, checkpoints and the
files a run leaves behind; it never asks which device it runs on. Metrics are read every
``log_every`` steps, never inside the step.
"""
from __future__ import annotations

import functools
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dptrain import backend
from dptrain import distributed as dist
from dptrain.checkpoints import CheckpointOptions, Checkpointing
from dptrain.checkpoints.state import run_identity
from dptrain.checkpoints.weights import load_weights, save_weights, weights_metadata
from dptrain.data import DeviceLoader, StrideSampler, get_dataset
from dptrain.data import augment
from dptrain.data.stream import check_depth, planned_batches
from dptrain.distributed.startup import first_on_host, process_age_s
from dptrain.distributed.stopping import StopRequests, signal_name
from dptrain.distributed.watchdog import Watchdog
from dptrain.distributed.world import root_decides
from dptrain.engine.rng import manual_seed, set_data_shard
from dptrain.errors import AgreedUsageError, RunStopped, UsageError
from dptrain.nn import build_model, sync_batch_norm
from dptrain.optim import OPTIMIZERS, LRSchedule
from dptrain.run import amp
from dptrain.run.config import DEFAULT_BATCH, TrainConfig, data_options, defaults_for
from dptrain.run.debug import step_hooks
from dptrain.run.evaluate import broadcast_buffers, eval_batch_sizes, evaluate
from dptrain.run.metrics import MetricsLog, Throughput
from dptrain.run.parallel import DataParallel
from dptrain.run.preflight import check_augment, check_outputs, check_sizes
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
        check_depth(cfg.prefetch_depth, cfg.data_workers)  # --prefetch-depth 1: one line
        check_sizes(cfg)  # a generated dataset that fits in memory, before making it
        # --save, --log-dir, --checkpoint-dir: writable and nobody else's, before training
        notes = root_decides(world, lambda: check_outputs(cfg))
        if cfg.global_batch_size is not None:
            if cfg.global_batch_size % world.size:  # the same sizes on every rank: agreed
                raise AgreedUsageError(f"--global-batch-size {cfg.global_batch_size} does not "
                                       f"divide by the {world.size} ranks")
            cfg.batch_size = cfg.global_batch_size // world.size
        elif cfg.batch_size is None:
            cfg.batch_size = DEFAULT_BATCH
        be.runtime.set_precision("auto" if cfg.precision in amp.COMPUTE_DTYPES else cfg.precision)
        manual_seed(cfg.seed)
        set_data_shard(world.rank, world.size)  # dropout draws the global batch's masks
        train_set, val_set = _load_datasets(cfg, world)
        model = build_model(cfg.model, augment.input_shape(cfg.augment, train_set.image_shape,
                                                           cfg.image_size), train_set.num_classes,
                            hidden=cfg.hidden).to(device)
        check_augment(cfg, train_set.image_shape)
        if cfg.sync_bn:
            sync_batch_norm(model, world.comm)
        cfg.precision = amp.resolve(cfg.precision, be.runtime, model)
        amp.check_runtime(cfg.precision, be.runtime)
        amp.check_model(model, cfg.precision)
        if world.local_rank == 0:  # ... and its 16-bit ones, once the precision is known
            be.runtime.prebuild([np.float32, amp.compute_dtype(cfg.precision)])
        if cfg.batch_size * world.size > len(train_set.labels):
            raise AgreedUsageError(f"--batch-size {cfg.batch_size} x {world.size} ranks is "
                                   f"larger than the {len(train_set.labels)} training images")
    except (ValueError, RuntimeError) as exc:
        if raised_in_user_code(exc):  # inside the user's --model builder: its traceback
            raise
        raise UsageError(str(exc)) from None
    if cfg.load:
        load_weights(model, cfg.load)
    return cfg, device, be, world, train_set, val_set, model, notes


def raised_in_user_code(exc: BaseException) -> bool:
    """Whether `exc` was raised inside the user's --model builder (FILE.py:FUNCTION): below
    build_user_model, in code outside dptrain. Its traceback is then the user's to see."""
    package, inside, tb = Path(__file__).resolve().parents[1], False, exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if inside and package not in Path(code.co_filename).resolve().parents:
            return True
        inside = inside or code.co_name == "build_user_model"
        tb = tb.tb_next
    return False


def train(cfg: TrainConfig, echo=print) -> dict:
    """Train as `cfg` says; returns the summary (rank 0 also writes LOGDIR/summary.json)."""
    run = _Run(cfg, echo)  # set-up: device, world, data, model
    run.build()  # the model and its step: exchange, optimizer, data order, loaders
    first_step = run.resume()  # resume: the checkpoint's state, restored in place
    if first_step and first_step >= run.total_steps:  # nothing left to run: say so, keep all
        return run.complete(first_step)
    run.open_log(first_step)  # the metrics log and the run's opening lines
    state = run.loop(first_step)  # the loop: epochs, logs, evaluations, checkpoints, stops
    return run.finish(state)  # the end: weights, summary, the torch twin


@dataclass
class _LoopState:
    """What the loop carries from step to step, and the summary reads at the end."""
    step: int
    since_log: int  # steps in the logging window (a resume restores its sums and count)
    startup_s: float | None  # process start to the timed steps
    ran: int = 0
    last_loss: float = float("nan")
    last_eval: dict = field(default_factory=dict)
    comm_exposed: float | None = 0.0  # seconds of communication that compute waited for
    stopped: int = 0  # the signal that stopped the run, 0 while none did


class _Run:
    """One training run's parts, built phase by phase; ``train`` walks the phases in order."""

    def __init__(self, cfg: TrainConfig, echo):
        self.echo = echo
        (self.cfg, self.device, self.be, self.world, self.train_set, self.val_set, self.model,
         self.notes) = _setup(cfg)
        self.root = self.world.is_root

    def build(self):
        """The kernels of the run's dtypes (built once per host, up front, in parallel), the flat
        parameters, ZeRO-1 optimizer shards, the bucketed exchange, the 16-bit shadow (mixed
        precision), the loss scaler (fp16) and the non-finite guard: the library's own."""
        cfg, world, train_set, val_set = self.cfg, self.world, self.train_set, self.val_set
        shape = augment.input_shape(cfg.augment, train_set.image_shape, cfg.image_size)
        self.ddp = ddp = DataParallel(
            self.model, functools.partial(build_optimizer, cfg), world=world,
            precision=cfg.precision, sync="broadcast", bucket_mb=cfg.bucket_mb,
            grad_exchange=cfg.grad_exchange, skip_nonfinite=cfg.skip_nonfinite,
            loss_scale=cfg.loss_scale, loss_scale_interval=cfg.loss_scale_interval,
            input_shapes=[(cfg.batch_size, *shape)]
            + [(n, *shape) for n in eval_batch_sizes(len(val_set.labels), world)])
        self.opt, self.reducer, self.scaler, self.guard = (ddp.optimizer, ddp.reducer, ddp.scaler,
                                                           ddp.guard)
        self.sampler = StrideSampler(len(train_set.labels), cfg.batch_size, world.size,
                                     world.rank, seed=cfg.seed, drop_last=cfg.drop_last)
        self.steps_per_epoch = len(self.sampler)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.schedule = LRSchedule(cfg.lr, cfg.lr_schedule, self.total_steps, cfg.warmup_steps)
        cfg.warmup_steps = self.schedule.warmup_steps
        self.opt.set_lr(self.schedule)  # begin_step sets each step's rate from its count
        self.global_batch = cfg.batch_size * world.size
        for note in self.notes:
            self.echo(f"dptrain: note: {note}")
        rrc, view = augment.resamplers(self.be, cfg.augment, train_set.image_shape,
                                       cfg.image_size, cfg.rrc_scale, cfg.rrc_ratio, cfg.seed,
                                       (world.rank, world.size), dtype=ddp.dtype)
        # batches laid out as the model's stem reads them, where it lays its input out itself
        layout = self.model.input_layout(shape, ddp.dtype, self.be)
        try:  # --data-on device with images larger than the device: one line
            self.loader = DeviceLoader(train_set, self.be, cfg.batch_size,
                                       augment=augment.kind(cfg.augment) == augment.CROP_FLIP,
                                       augment_pad=cfg.augment_pad, augment_seed=cfg.seed,
                                       shard=(world.rank, world.size), resample=rrc,
                                       data_on=cfg.data_on, prefetch_depth=cfg.prefetch_depth,
                                       data_workers=cfg.data_workers, dtype=ddp.dtype,
                                       layout=layout)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.val_loader = DeviceLoader(val_set, self.be, cfg.batch_size, resample=view,
                                       dtype=ddp.dtype, layout=layout)

    def resume(self) -> int:
        """Exact resume: parameters, optimizer shards, step, RNG and augmentation states are
        restored in place, before the step is captured. Returns the step to go on from."""
        cfg = self.cfg
        options = CheckpointOptions(cfg.checkpoint_dir, cfg.checkpoint_every or 0,
                                    cfg.keep_checkpoints, cfg.resume)
        self.ckpt = Checkpointing(options, run_identity(cfg), self.world, self.model, self.opt,
                                  self.reducer, self.steps_per_epoch, echo=self.echo,
                                  warn=lambda text: print(text, file=sys.stderr, flush=True),
                                  loader=self.loader, scaler=self.scaler)
        self.step_fn = TrainStep(self.model, self.opt, self.reducer, self.loader, self.guard,
                                 self.ddp.dtype)
        self.ckpt.window = self.step_fn  # its metric sums are saved and restored too
        first_step = self.ckpt.resume()
        # --data-on host gathers ahead along the sampler's order from the resumed step on
        self.loader.plan(planned_batches(self.sampler, first_step, self.total_steps), first_step)
        self.data_path = self.loader.mode
        # the steps the restored metric sums cover: the checkpoint's count, whatever
        # --log-every was and is (older checkpoints: as the log window was then)
        self.window_steps = (self.ckpt.window_steps if self.ckpt.window_steps is not None
                             else first_step % cfg.log_every)
        self.run_step = self.ddp.capture(self.step_fn) if cfg.cuda_graph else self.step_fn
        self.hooks = step_hooks(cfg, self.world, self.reducer, self.ddp.flat, self.scaler)
        return first_step

    def open_log(self, first_step: int):
        cfg = self.cfg
        # a resumed run drops what its log holds past the checkpoint (steps it runs again)
        self.log = MetricsLog(cfg.log_dir if self.root else None, resume_step=first_step)
        self.log.config(asdict(cfg))
        if not self.root:
            return
        self.echo(f"dptrain: {cfg.model} on {cfg.dataset} ({len(self.train_set.labels)} train / "
                  f"{len(self.val_set.labels)} val images), {self.device} x {self.world.size}, "
                  f"batch {cfg.batch_size} per rank ({self.global_batch} global), "
                  f"{self.total_steps} steps")
        if not (cfg.log_dir or cfg.save or cfg.checkpoint_dir):
            self.echo("dptrain: note: no --log-dir, --save or --checkpoint-dir: this run keeps "
                      "no files (`make train` keeps them in runs/latest)")
        if self.schedule.fit_warning():
            self.echo(f"dptrain: warning: {self.schedule.fit_warning()}")

    def loop(self, first_step: int) -> _LoopState:
        """Every step from `first_step` on, under the watchdog and the stop requests."""
        cfg, total_steps, per_epoch = self.cfg, self.total_steps, self.steps_per_epoch
        self.progress = Progress(total_steps, enabled=cfg.progress and self.root)
        # images/s leaves out the warm-up and capture steps (at least one step stays timed)
        self.excluded = min(CAPTURE_WARMUP + 1, max(total_steps - first_step - 1, 0))
        self.meter = Throughput(self.global_batch, warmup_steps=self.excluded)
        s = _LoopState(step=first_step, since_log=self.window_steps,
                       startup_s=process_age_s() if self.excluded == 0 else None)
        self.eval_every = cfg.eval_every or per_epoch
        watchdog = Watchdog(self.world, cfg.collective_timeout).start()
        self.watch = watchdog.watch
        stops = StopRequests(self.world).install()
        try:
            for epoch in range(first_step // per_epoch, cfg.epochs):
                batches = self.sampler.epoch_batches(epoch)
                first = s.step - epoch * per_epoch  # > 0 only in the epoch a resume lands in
                for local in range(first, min(per_epoch, first + total_steps - s.step)):
                    self.opt.begin_step()
                    self.loader.set_batch(batches[local])
                    with self.watch("training step", s.step + 1):
                        self.run_step()
                        s.stopped = stops.poll()
                    self._after_step(s, epoch)
                    if s.stopped:
                        break
                if s.step >= total_steps or s.stopped:
                    break
            if s.stopped:
                raise RunStopped(f"stopped by {signal_name(s.stopped)} after step {s.step}; "
                                 f"{where_stopped_files_are(cfg, self.ckpt.enabled)}",
                                 exit_code=128 + s.stopped, agreed=True)
            self.guard.read(s.step)
            if self.scaler is not None:
                self.scaler.read(s.step)
            stops.close()
        except RunStopped as exc:
            if exc.agreed:  # every rank issued the pending stop all-reduce: finish it
                stops.close()
            raise
        finally:
            stops.close(complete=False)
            self.loader.close()  # the stream's threads, also when the run stops early
            watchdog.stop()
            self.progress.close()
            self.log.close()
        return s

    def _after_step(self, s: _LoopState, epoch: int):
        """Count the step; log, evaluate and checkpoint when due."""
        s.step, s.ran, s.since_log = s.step + 1, s.ran + 1, s.since_log + 1
        if s.ran == self.excluded:  # warm-up and capture done; the timed steps start here
            self.be.runtime.synchronize()
            s.startup_s = process_age_s()
        self.meter.step()
        log_due = s.step % self.cfg.log_every == 0 or s.step == self.total_steps
        if not log_due:  # a logged step moves the progress with its metrics, once
            self.progress.advance(s.step)
        for hook in self.hooks:
            hook(s.step)
        if log_due:
            self._log_window(s, epoch)
        if s.step % self.eval_every == 0 or s.step == self.total_steps:
            self._evaluate(s, epoch)
        if self.ckpt.due(s.step) or (s.stopped and self.ckpt.enabled):
            self.guard.read(s.step)  # never checkpoint past a non-finite step
            with self.watch("checkpoint gather", s.step):
                path = self.ckpt.save(s.step, window_steps=s.since_log)
            if path is not None and s.stopped:
                self.progress.note(f"step {s.step}: checkpoint {path}")

    def _log_window(self, s: _LoopState, epoch: int):
        """Read the metrics summed on the device since the last log (one all-reduce)."""
        timed_steps = self.meter.window_steps
        with self.watch("metrics all-reduce", s.step):
            loss_sum, correct = self.step_fn.read_metrics(self.world.comm)
        skipped = self.guard.read(s.step)  # stops the run on a non-finite step
        exposed = self.reducer.read_exposed_comm()
        s.comm_exposed = None if exposed is None or s.comm_exposed is None else (
            s.comm_exposed + exposed * timed_steps)
        rate = self.meter.window()
        s.last_loss = loss_sum / s.since_log
        accuracy = correct / (s.since_log * self.global_batch)
        s.since_log = 0
        record = {"step": s.step, "epoch": epoch, "loss": s.last_loss, "accuracy": accuracy,
                  "lr": self.opt.lr, "images_per_s": rate}
        if self.scaler is not None:  # fp16: the scale now, overflowed (skipped) steps
            record["loss_scale"], record["overflow_steps"] = self.scaler.read(s.step)
        self.log.write({**record, "skipped_steps": skipped} if skipped else record)
        self.progress.update(s.step, loss=s.last_loss, acc=accuracy, images_per_s=rate)

    def _evaluate(self, s: _LoopState, epoch: int):
        self.meter.pause()  # evaluation is not training time
        with self.watch("evaluation", s.step):
            self.reducer.sync_parameters()
            broadcast_buffers(self.model, self.world.comm)  # evaluate with rank 0's estimates
            s.last_eval = evaluate(self.model, self.val_loader, world=self.world,
                                   dtype=self.ddp.dtype)
        self.log.write({"step": s.step, "epoch": epoch, **s.last_eval})
        self.progress.note(f"step {s.step}: val_loss {s.last_eval['val_loss']:.4f} "
                           f"val_accuracy {s.last_eval['val_accuracy']:.4f}")
        self.meter.resume()

    def finish(self, s: _LoopState) -> dict:
        """Gather the parameters, save the weights, write and print the summary."""
        cfg, world = self.cfg, self.world
        self.reducer.sync_parameters()
        broadcast_buffers(self.model, world.comm)
        startup_s = process_age_s() if s.startup_s is None else s.startup_s  # None: no step ran
        wall = self.meter.wall()
        failed = self._save_weights()  # a --save that could not be written, said at the end
        summary = self._summary(s, wall, startup_s)
        if self.root:
            self.log.summary(summary)
            accuracy = summary["val_accuracy"]
            self.echo(f"dptrain: done: {s.step} steps in {wall:.1f} s "
                      f"({self.meter.rate:.0f} images/s training, after {startup_s:.1f} s of "
                      f"start-up), train_loss {s.last_loss:.4f}, val_accuracy "
                      f"{'n/a' if accuracy is None else format(accuracy, '.4f')}")
            if cfg.torch:
                from dptrain.run.torch_twin import train_twin

                train_twin(cfg, self.device, self.global_batch, self.echo)
            self.echo(f"dptrain: {where_files_went(cfg)}")
        if failed:
            raise RunStopped(failed, exit_code=1, agreed=True)
        return summary

    def _save_weights(self) -> str | None:
        """Rank 0 writes --save; where that fails (a full disk), the weights go to the log
        directory instead. Returns, on every rank, what went wrong and where the weights
        are, or None."""
        cfg, failed = self.cfg, None
        if cfg.save and self.root:
            # random-resized-crop: evaluation's view (resize + centre crop to the model's side)
            crop = ({"eval_crop": self.loader.input_shape[1]} if self.val_loader.input_shape
                    != self.val_loader.image_shape else {})
            meta = weights_metadata(cfg.model, self.train_set, cfg.dataset,
                                    data={**data_options(cfg, absolute=True), "seed": cfg.seed,
                                          **crop})
            meta["hidden"] = list(cfg.hidden) if cfg.hidden else None  # for eval's --model
            failed, cfg.save = save_or_keep(self.model, cfg.save, meta, cfg.log_dir)
        if self.world.size > 1 and self.world.mpi_comm is not None:
            failed = self.world.mpi_comm.bcast(failed, root=0)  # every rank ends alike
        return failed

    def complete(self, step: int) -> dict:
        """A resumed run whose checkpoint is at (or past) its last step: nothing to train. Its
        summary.json and log stay as they are; --save gets the checkpoint's weights."""
        cfg = self.cfg
        path = Path(cfg.log_dir or "", "summary.json")
        try:
            summary = json.loads(path.read_text()) if cfg.log_dir else {}
        except (OSError, ValueError):
            summary = {}
        self.reducer.sync_parameters()  # --save: the checkpoint's weights
        broadcast_buffers(self.model, self.world.comm)
        failed = self._save_weights()
        if self.root:
            kept = (f"; its summary stays in {path}" if summary else
                    f"; {path} was never written (the run ended before)" if cfg.log_dir else "")
            self.echo(f"dptrain: the run is complete: the checkpoint is at step {step} of "
                      f"{self.total_steps}, nothing left to train (--epochs or --max-steps "
                      f"extend it){kept}")
            self.echo(f"dptrain: {where_files_went(cfg)}")
        if failed:
            raise RunStopped(failed, exit_code=1, agreed=True)
        return summary

    def _summary(self, s: _LoopState, wall: float, startup_s: float) -> dict:
        train_time, train_rate, comm = self.meter.total_s, self.meter.rate, s.comm_exposed
        return {
            "train_loss": s.last_loss,
            "val_loss": s.last_eval.get("val_loss"),
            "val_accuracy": s.last_eval.get("val_accuracy"),
            "steps": s.step,
            "images": s.step * self.global_batch,
            "world_size": self.world.size,
            "global_batch_size": self.global_batch,
            "device": self.device,
            "wall_s": wall,
            "train_s": train_time,
            "images_per_s": train_rate,
            "warmup_steps_excluded": self.excluded,
            "startup_s": startup_s,
            "prepare_s": self.ddp.prepare_s,
            "prepare_modules": self.ddp.prepare_report.get("built"),  # kernel modules built
            "images_per_s_per_rank": train_rate / self.world.size,
            "data_path": self.data_path,  # resident, streamed (gathered ahead) or staged
            "overflow_steps": self.scaler.overflows if self.scaler is not None else None,
            "comm_exposed_s": comm,  # None: not measurable under graph replay
            "comm_exposed_fraction": (comm / train_time if comm is not None and train_time > 0
                                      else None),
            "config": asdict(self.cfg),
        }


def save_or_keep(model, path, meta, log_dir) -> tuple[str | None, str | None]:
    """Write the weights to `path`; where that fails, to LOGDIR/weights.npz. Returns (what
    went wrong and where the weights are, or None; the path that holds them, or None)."""
    try:
        save_weights(model, path, meta)
        return None, path
    except OSError as exc:
        failed = f"--save {path}: cannot write ({exc.strerror or exc})"
    spare = Path(log_dir, "weights.npz") if log_dir else None
    if spare is None or spare.resolve() == Path(path).resolve():
        return f"{failed}; the weights are lost (no other --log-dir to keep them in)", None
    try:
        save_weights(model, spare, meta)
    except OSError as exc:
        return f"{failed}; the weights are lost ({spare}: {exc.strerror or exc} too)", None
    return f"{failed}; the weights are in {spare} instead", str(spare)


def where_stopped_files_are(cfg, checkpoints: bool) -> str:
    """A stopped run's last line: its log and checkpoint (no weights: it did not finish)."""
    kept = [f"log in {cfg.log_dir}"] if cfg.log_dir else []
    if checkpoints:
        kept.append(f"checkpoint in {cfg.checkpoint_dir} (--resume auto continues the run)")
    return "files: " + ", ".join(kept) if kept else "kept no files"


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
