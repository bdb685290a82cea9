"""What a checkpoint holds, and putting it back: exact resume of a training run.

Saved (a collective: every rank takes part, rank 0 writes):
  * the model's ``state_dict()`` (parameters, and buffers where the model has them), after
    the last step's shards were all-gathered;
  * the optimizer's whole state, all-gathered from the ZeRO-1 shards and cut per parameter,
    so it can be re-sharded onto any world size; its step count (AdamW's bias correction);
  * the step, the epoch and the position in the epoch (the data order itself is a pure
    function of the seed and the epoch; the learning rate a pure function of the step);
  * every random state: each rank's device generator (dropout), the init generator;
  * with fp16 mixed precision, the loss scale and its count of good steps;
  * the loop's metric sums since its last log and how many steps they cover, so a resumed
    run logs true window means whatever its --log-every;
  * the run's identity (``run_identity``), checked on resume against the settings that must
    not change.

Restored in place: parameters through ``load_state_dict`` (copies into the flat buffer, and
its 16-bit shadow under mixed precision),
optimizer state through ``runtime.upload_`` into the existing shards, random state through
``set_rng_state``, so a step already captured as a graph keeps reading the same buffers.

At the same world size the continued run is bitwise the uninterrupted one. At another world
size with the same global batch, data order, learning rate and every state carry over
exactly, but each rank's gradient is averaged over a different split of the batch, so the
run matches the uninterrupted one to float rounding, not bitwise; dropout's generator is
taken from rank 0 then.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dptrain.checkpoints.store import CheckpointError, CheckpointStore, load, step_dir
from dptrain.distributed.world import root_decides
from dptrain.errors import AgreedUsageError, UsageError
from dptrain.engine.rng import init_rng

# Settings a resumed run must share with the checkpoint (flag name, identity key): the
# optimisation's too, or the resumed run would train on with other settings than run.json
# records. --epochs and --max-steps may change (a finished run is extended).
MUST_MATCH = (("--model", "model"), ("--dataset", "dataset"), ("--train-images", "train_images"),
              ("--seed", "seed"), ("--optimizer", "optimizer"), ("--lr", "lr"),
              ("--lr-schedule", "lr_schedule"), ("--momentum", "momentum"),
              ("--nesterov", "nesterov"), ("--weight-decay", "weight_decay"))
MODEL, OPTIM = "model.npz", "optimizer.npz"
# The settings that decide a run's trajectory: a --checkpoint-dir records them (run.json), and
# a fresh run with others is refused there (dptrain.run.preflight).
IDENTITY = ("model", "hidden", "dataset", "data_dir", "channels", "image_size", "val_fraction",
            "augment", "augment_pad", "rrc_scale", "rrc_ratio", "train_images", "batch_size", "global_batch_size",
            "drop_last", "optimizer", "lr", "lr_schedule", "warmup_steps", "momentum",
            "nesterov", "weight_decay", "seed", "precision", "loss_scale",
            "loss_scale_interval", "sync_bn", "load")


def run_identity(cfg) -> dict:
    """The settings of `cfg` that make a run another one (JSON-able)."""
    return {key: to_json(list(v) if isinstance(v := getattr(cfg, key), tuple) else v)
            for key in IDENTITY}


def identity_difference(theirs: dict, mine: dict) -> str:
    """The first setting in which two identities differ, as flags: "--seed 3; this run --seed
    99"."""
    for key in IDENTITY:
        if theirs.get(key) != mine.get(key):
            flag = "--" + key.replace("_", "-")
            return f"{flag} {theirs.get(key)}; this run has {flag} {mine.get(key)}"
    return "other settings"


def to_json(value):
    """RNG states and the like as JSON: arrays become {"ndarray": [...], "dtype": ...}."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def from_json(value):
    if isinstance(value, dict):
        if set(value) == {"ndarray", "dtype"}:
            return np.array(value["ndarray"], dtype=value["dtype"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def restore_weights(files, where, model, optimizer, named) -> None:
    """A checkpoint's weights into `model` and its optimizer state (saved per parameter, as
    'parameter:slot' keys) into this rank's shard of `optimizer`; UsageError naming `where`."""
    try:
        model.load_state_dict(files[MODEL], source=where)
        per = {}
        for full, a in files[OPTIM].items():
            key, _, name = full.partition(":")
            per.setdefault(key, {})[name] = a
        optimizer.scatter_state(per, named, source=where)
    except (KeyError, ValueError) as exc:
        raise UsageError(f"{where}: {exc}") from None


@dataclass
class CheckpointOptions:
    """Where and when a run writes checkpoints, and which one it resumes from."""
    directory: str | None = None  # --checkpoint-dir (None: no checkpoints)
    every: int = 0  # --checkpoint-every: steps between checkpoints (0: only when stopped)
    keep: int = 3  # --keep-checkpoints
    resume: str | None = None  # --resume: "auto", a checkpoint directory, or None


class Checkpointing:
    """The loop's view of checkpoints: ``resume()`` once before training, ``due(step)`` and
    ``save(step)`` after steps. Every rank calls each of them at the same step. `identity` is
    the run's ``run_identity``: saved with each checkpoint and checked on resume."""

    def __init__(self, options: CheckpointOptions, identity: dict, world, model, optimizer,
                 reducer, steps_per_epoch, echo=print, warn=None, loader=None, scaler=None):
        self.options, self.identity = options, identity
        self.world, self.model, self.opt = world, model, optimizer
        self.loader = loader  # the training loader: its augmentation draws are saved too
        self.scaler = scaler  # fp16's loss scale (dptrain.run.amp), or None
        self.reducer, self.steps_per_epoch = reducer, steps_per_epoch
        self.be = optimizer.be
        self.echo = echo
        self.warn = warn or echo
        self.every = options.every or 0
        self.store = CheckpointStore(options.directory, options.keep) \
            if options.directory else None
        self.named = list(model.named_parameters())
        self.last_saved = None
        self.window_steps = None  # restored by resume(): the steps of the restored sums
        # the loop's metric sums since its last log (window_state / set_window_state), saved
        # so that a resumed run logs what the uninterrupted one logged
        self.window = None
        if self.store is not None and world.is_root:
            self.store.clean()

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def due(self, step: int) -> bool:
        return self.store is not None and self.every > 0 and step % self.every == 0

    # -- saving
    def _augment_state(self):
        """The loader's augmentation [seed, counter] (the same on every rank), or None."""
        if self.loader is None or not self.loader.augment:
            return None
        return [int(v) for v in self.loader.get_augment_state()]

    def _gather(self, mine) -> list:
        """Every rank's `mine`, in rank order."""
        if self.world.size > 1 and self.world.mpi_comm is not None:
            return self.world.mpi_comm.allgather(mine)
        return [mine]

    def _rng_states(self):
        return self._gather(to_json(self.be.runtime.get_rng_state()))

    def save(self, step: int, window_steps: int | None = None):
        """Gather everything (a collective) and let rank 0 write checkpoint `step`;
        `window_steps`: the steps the loop's metric sums cover (its logging window so far).
        A write that fails (a full disk) is a warning: the checkpoints written before stay,
        and training goes on."""
        if self.store is None or self.last_saved == step:
            return None
        self.reducer.sync_parameters()
        model_state = {k: np.asarray(v) for k, v in self.model.state_dict().items()}
        optim = self.opt.gather_state(self.world.comm, self.named)
        rng = self._rng_states()
        window = self._gather(self.window.window_state()) if self.window is not None else None
        scale = self.scaler.state_dict() if self.scaler is not None else None
        self.last_saved = step
        if not self.world.is_root:
            return None
        meta = {
            "world_size": self.world.size,
            "global_batch_size": self.identity["batch_size"] * self.world.size,
            "state": {
                "step": step,
                "epoch": step // self.steps_per_epoch,
                "position": step % self.steps_per_epoch,
                "steps_per_epoch": self.steps_per_epoch,
                "optimizer_steps": self.opt.steps,
                "loss_scale": scale,
                "window": window,
                "window_steps": window_steps,
                "rng": {"device": rng, "init": to_json(init_rng().bit_generator.state),
                        "augment": self._augment_state()},
            },
            "config": self.identity,
        }
        files = {MODEL: model_state,
                 OPTIM: {f"{key}:{name}": a for key, per in optim.items() for name, a in per.items()}}
        try:
            path = self.store.write(step, files, meta)
        except OSError as exc:
            self.store.discard(step)
            kept = [p for _, p in self.store.entries() if self.store.complete(p)]
            self.warn(f"dptrain: warning: checkpoint {step_dir(self.store.dir, step)}: cannot "
                      f"write ({exc.strerror or exc}); "
                      + (f"the newest kept is {kept[-1]}" if kept else "none is kept")
                      + "; training goes on")
            return None
        self.store.prune()
        return path

    # -- resuming
    def _find(self):
        """Rank 0: (path, manifest, files) to resume from, or None for a fresh start."""
        opts = self.options
        if opts.resume == "auto":
            found = self.store.latest(warn=lambda m: self.warn(f"dptrain: warning: {m}"))
            if found is None:
                self.echo(f"dptrain: no usable checkpoint in {opts.directory}; starting "
                          f"from step 0")
            return found
        if not Path(opts.resume).exists():
            raise UsageError(f"--resume {opts.resume}: no such checkpoint directory (auto "
                             "takes the newest in --checkpoint-dir)")
        try:
            return (opts.resume, *load(opts.resume))
        except CheckpointError as exc:
            raise UsageError(f"--resume {opts.resume}: {exc}") from None

    def _window_share(self, saved) -> list[float]:
        """This rank's metric sums: its own at the same world size; at another, the mean
        loss sum on every rank (read back as a mean) and all correct counts on rank 0."""
        if len(saved) == self.world.size:
            return saved[self.world.rank]
        loss = sum(v[0] for v in saved) / len(saved)
        return [loss, sum(v[1] for v in saved) if self.world.is_root else 0.0]

    def resume(self) -> int:
        """Restore the state of the checkpoint --resume names; returns the step to go on
        from (0 when there is nothing to resume)."""
        resume, world = self.options.resume, self.world
        if not resume:
            return 0
        if resume == "auto" and self.store is None:
            raise AgreedUsageError("--resume auto needs --checkpoint-dir (where to look)")
        # every rank has what rank 0 found: its errors are every rank's (one line, no abort)
        found = root_decides(world, self._find)
        if found is None:
            return 0
        path, manifest, files = found
        try:
            return self._restore(path, manifest, files)
        except UsageError as exc:  # the same checkpoint and settings on every rank
            raise AgreedUsageError(str(exc)) from None

    def _restore(self, path, manifest, files) -> int:
        mine, world = self.identity, self.world
        where = f"--resume {path}"
        saved = manifest.get("config", {})
        for flag, key in MUST_MATCH:
            if key in saved and saved[key] != mine[key]:
                raise UsageError(f"{where}: the checkpoint was trained with {flag} {saved[key]}, "
                                 f"this run has {flag} {mine[key]}")
        global_batch = mine["batch_size"] * world.size
        if manifest.get("global_batch_size") != global_batch:
            raise UsageError(f"{where}: the checkpoint was trained at global batch "
                             f"{manifest.get('global_batch_size')}, this run has {global_batch} "
                             f"({world.size} ranks x --batch-size {mine['batch_size']})")
        state = manifest["state"]
        if state.get("steps_per_epoch") != self.steps_per_epoch:
            raise UsageError(f"{where}: {state.get('steps_per_epoch')} steps per epoch in the "
                             f"checkpoint, {self.steps_per_epoch} in this run")
        restore_weights(files, where, self.model, self.opt, self.named)
        self.opt.steps = int(state["optimizer_steps"])
        if self.scaler is not None and state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])
        rng = from_json(state["rng"])
        device = rng["device"]
        self.be.runtime.set_rng_state(
            device[world.rank] if len(device) == world.size else device[0])
        init_rng().bit_generator.state = rng["init"]
        if rng.get("augment") is not None and self.loader is not None and self.loader.augment:
            self.loader.set_augment_state(rng["augment"])
        if self.window is not None and state.get("window"):
            self.window.set_window_state(self._window_share(state["window"]))
        # the steps those sums cover (None in checkpoints written before it was recorded)
        self.window_steps = state.get("window_steps")
        self.last_saved = int(state["step"])  # no need to write it again
        step = int(state["step"])
        if world.is_root:
            self.echo(f"dptrain: resumed from {path} at step {step} (epoch {state['epoch']}, "
                      f"written by {manifest.get('world_size')} rank(s))")
        return step
